"""The web dashboard in process (Starlette's test client, real SQLite store, real ``ops`` and worker
children): pages and their JSON, CSRF, roles, bearer tokens, the audit log, escaping, secrets, edits
validated like the CLI, keyset pagination, ``mjsched dashboard``'s refusals, and a fuzz of the API
against its own OpenAPI schema. The real-browser tests are in test_dashboard_browser.py."""

from __future__ import annotations

import datetime as dt
import json
import re
import socket
from pathlib import Path

import pytest
import sqlalchemy as sa
from clirun import Cli
from conftest import add_job
from waiting import wait_until

pytest.importorskip("starlette")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # starlette's test client on httpx
from starlette.testclient import TestClient

from mjsched_isolated.config import build_settings
from mjsched_isolated.dashboard.app import create_app
from mjsched_isolated.dashboard.auth import hash_secret, verify_secret
from mjsched_isolated.store import Store
from mjsched_isolated.store.schema import audit_log, runs

UTC = dt.UTC
PLUGINS = str(Path(__file__).parent / "dashboard_plugins")
PAYLOAD = "<script>document.title='pwned'</script>"
OPERATOR_PW, VIEWER_PW = "operator-secret-1", "viewer-secret-22"
OPERATOR_TOKEN, VIEWER_TOKEN = "op-token-0123456789abcdef", "view-token-0123456789abcdef"
CSRF = re.compile(r'name="csrf-token" content="([0-9a-f]+)"')


def settings_for(db_url: str, **dashboard) -> object:
    return build_settings({"database_url": db_url, "plugins_dir": PLUGINS, "dashboard": dashboard})


@pytest.fixture
def make_client(store: Store, db_url: str):
    made: list[TestClient] = []

    def make(**dashboard) -> TestClient:
        client = TestClient(create_app(settings_for(db_url, **dashboard), store, poll_s=0.05),
                            base_url="http://127.0.0.1", follow_redirects=False)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


def csrf_of(client: TestClient, path: str = "/jobs") -> str:
    page = client.get(path, follow_redirects=True)
    assert page.status_code == 200, page.text
    return CSRF.search(page.text).group(1)


def record_run(store: Store, job_id: int, *, status: str, error: str | None = None, details=None,
               started: dt.datetime | None = None, instance: str = "sup-a") -> None:
    started = started or dt.datetime.now(UTC)
    with store.engine.begin() as conn:
        conn.execute(runs.insert().values(
            job_id=job_id, started_at=started, completed_at=started + dt.timedelta(seconds=1), status=status,
            success=status == "Completed", error_message=error,
            details=None if details is None else json.dumps(details),
            executed_by_instance=instance, duration_ms=1000.0))


def audit_rows(store: Store) -> list[dict]:
    with store.engine.connect() as conn:
        return [dict(r) for r in conn.execute(sa.select(audit_log).order_by(audit_log.c.id)).mappings()]


# -- pages and their JSON ---------------------------------------------------------------------------------
def test_every_page_renders_and_has_its_json(make_client, store):
    job = add_job(store, "alpha", "nap", "*/5 * * * *")
    add_job(store, "beta", "hostile", "0 3 * * *")
    record_run(store, job["id"], status="Completed")
    record_run(store, job["id"], status="Failed", error="disk full")
    client = make_client()
    for path in ("/", "/jobs", "/jobs/alpha", "/runs", "/runs/1", "/audit", "/jobs?status=Active&mode=Skip",
                 "/runs?status=Failed&job=alpha", "/jobs?failing=1"):
        page = client.get(path)
        assert page.status_code == 200, (path, page.text[:300])
        assert "Content-Security-Policy" in page.headers and "script-src 'self'" in page.headers[
            "Content-Security-Policy"]
    overview = client.get("/api/overview").json()
    assert overview["totals"] == {"jobs": 2, "skipped": 0, "running": 0}
    assert overview["charts"]["day"]["totals"]["Failed"] == 1
    assert [f["error_message"] for f in overview["recent_failures"]] == ["disk full"]
    jobs = client.get("/api/jobs").json()["jobs"]
    assert [(j["name"], j["last_status"], j["schedule_words"]) for j in jobs] == [
        ("alpha", "Failed", "Every 5 minutes"), ("beta", None, "At 03:00")]
    assert jobs[0]["success_rate_pct"] is None  # counters are the supervisor's; none recorded here
    assert [j["name"] for j in client.get("/api/jobs?failing=1").json()["jobs"]] == ["alpha"]
    assert [j["name"] for j in client.get("/api/jobs?q=ET").json()["jobs"]] == ["beta"]
    detail = client.get("/api/jobs/alpha").json()
    assert len(detail["upcoming"]) == 5 and detail["last_day"] == {"Completed": 1, "Failed": 1}
    assert [r["status"] for r in detail["runs"]] == ["Failed", "Completed"]
    assert client.get("/api/runs/2").json()["run"]["error_message"] == "disk full"


def test_bad_parameters_are_one_line_400s_and_unknown_names_404s(make_client, store):
    add_job(store, "alpha", "nap")
    client = make_client()
    assert client.get("/api/runs?status=Nope").json() == {
        "error": "status: must be one of Running, Completed, Failed, Cancelled, Timeout, got 'Nope'"}
    assert client.get("/api/runs?limit=0").status_code == 400
    assert client.get("/api/runs?since=yesterday").json() == {"error": "since: not an ISO-8601 date-time: 'yesterday'"}
    assert client.get("/api/jobs/nope").status_code == 404
    assert client.get("/api/runs?job=nope").json() == {"error": "job: no job named 'nope'"}
    assert client.get("/api/runs/abc").status_code == 400
    assert client.get("/runs/99").status_code == 404


def test_runs_are_paged_by_keyset_without_gaps_or_repeats(make_client, store):
    job = add_job(store, "alpha", "nap")
    t0 = dt.datetime(2026, 1, 1, tzinfo=UTC)
    for i in range(120):
        record_run(store, job["id"], status="Completed" if i % 3 else "Failed", started=t0 + dt.timedelta(minutes=i))
    client = make_client()
    seen, before = [], ""
    while True:
        page = client.get(f"/api/runs?limit=50{before}").json()
        seen += [r["id"] for r in page["runs"]]
        if page["next_before"] is None:
            break
        before = f"&before={page['next_before']}"
    assert seen == list(range(120, 0, -1))
    failed = client.get("/api/runs?status=Failed&limit=500").json()["runs"]
    assert len(failed) == 40 and all(r["status"] == "Failed" for r in failed)
    window = client.get("/api/runs?since=2026-01-01T00:10:00Z&until=2026-01-01T00:20:00").json()["runs"]
    assert [r["id"] for r in window] == list(range(20, 10, -1))


# -- CSRF, roles, tokens, the audit log -------------------------------------------------------------------
def test_a_post_without_csrf_token_is_refused_even_on_loopback_without_password(make_client, store):
    add_job(store, "alpha", "nap")
    client = make_client()
    refused = client.post("/api/jobs/alpha/pause")
    assert refused.status_code == 403 and "CSRF" in refused.json()["error"]
    forged = client.post("/api/jobs/alpha/pause", headers={"X-CSRF-Token": "0" * 64})
    assert forged.status_code == 403
    assert store.get_job("alpha")["status"] == "Active"  # nothing happened
    token = csrf_of(client)
    other = make_client()  # another browser's token is not this one's
    assert other.post("/api/jobs/alpha/pause", headers={"X-CSRF-Token": token}).status_code == 403
    done = client.post("/api/jobs/alpha/pause", headers={"X-CSRF-Token": token})
    assert done.status_code == 200 and done.json()["job"]["status"] == "Paused"
    form = client.post("/api/jobs/alpha/resume", data={"csrf_token": token, "next": "/jobs"})
    assert form.status_code == 303 and form.headers["location"].startswith("/jobs?flash=")
    assert store.get_job("alpha")["status"] == "Active"
    rows = audit_rows(store)
    assert [(r["action"], r["target"], r["outcome"], r["actor"]) for r in rows] == [
        ("pause", "alpha", "refused", "local"), ("pause", "alpha", "refused", "local"),
        ("pause", "alpha", "refused", "local"), ("pause", "alpha", "ok", "local"), ("resume", "alpha", "ok", "local")]
    assert all(r["at"] is not None and r["remote_addr"] for r in rows)


def test_roles_passwords_and_bearer_tokens(make_client, store):
    add_job(store, "alpha", "nap")
    client = make_client(operator_password=hash_secret(OPERATOR_PW), viewer_password=VIEWER_PW,
                         operator_token=OPERATOR_TOKEN, viewer_token=VIEWER_TOKEN)
    assert client.get("/jobs").status_code == 303 and client.get("/jobs").headers["location"].startswith("/login")
    assert client.get("/api/jobs").status_code == 401
    token = csrf_of(client, "/login")
    wrong = client.post("/login", data={"password": "not-it-at-all", "csrf_token": token, "next": "/jobs"})
    assert wrong.status_code == 200 and "wrong password" in wrong.text
    assert client.post("/login", data={"password": VIEWER_PW, "next": "/jobs"}).status_code == 403  # login CSRF
    viewer = client.post("/login", data={"password": VIEWER_PW, "csrf_token": token, "next": "/jobs"})
    assert viewer.status_code == 303 and viewer.headers["location"] == "/jobs"
    token = csrf_of(client)  # a new session: a new token
    refused = client.post("/api/jobs/alpha/pause", headers={"X-CSRF-Token": token})
    assert refused.status_code == 403 and refused.json() == {"error": "forbidden: the viewer role is read-only"}
    assert client.get("/api/jobs").status_code == 200
    bare = TestClient(client.app, base_url="http://127.0.0.1")
    assert bare.post("/api/jobs/alpha/pause", headers={"Authorization": f"Bearer {VIEWER_TOKEN}"}).status_code == 403
    assert bare.post("/api/jobs/alpha/pause", headers={"Authorization": "Bearer wrong-token-xyz"}).status_code == 403
    paused = bare.post("/api/jobs/alpha/pause", headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"})
    assert paused.status_code == 200 and store.get_job("alpha")["status"] == "Paused"
    assert bare.get("/api/jobs", headers={"Authorization": f"Bearer {VIEWER_TOKEN}"}).status_code == 200
    operator = TestClient(client.app, base_url="http://127.0.0.1", follow_redirects=False)
    token = csrf_of(operator, "/login")
    operator.post("/login", data={"password": OPERATOR_PW, "csrf_token": token})
    assert operator.post("/api/jobs/alpha/resume", headers={"X-CSRF-Token": csrf_of(operator)}).status_code == 200
    rows = [(r["action"], r["role"], r["outcome"]) for r in audit_rows(store)]
    assert rows == [("login", "none", "refused"), ("login", "viewer", "ok"), ("pause", "viewer", "refused"),
                    ("pause", "viewer", "refused"), ("pause", "none", "refused"), ("pause", "operator", "ok"),
                    ("login", "operator", "ok"), ("resume", "operator", "ok")]
    assert [r["actor"] for r in audit_rows(store)][5] == "token:operator"
    audit_page = operator.get("/audit")
    assert "token:operator" in audit_page.text and "viewer@" in audit_page.text


def test_passwords_are_kept_as_scrypt_hashes():
    stored = hash_secret("correct horse")
    assert stored.startswith("scrypt$") and "correct horse" not in stored
    assert verify_secret("correct horse", stored) and not verify_secret("correct horsf", stored)


def test_secrets_never_appear_in_a_page_or_the_api(make_client, store, db_url):
    add_job(store, "alpha", "nap")
    client = make_client(operator_password=OPERATOR_PW, viewer_password=VIEWER_PW, operator_token=OPERATOR_TOKEN,
                         viewer_token=VIEWER_TOKEN, session_secret="session-secret-value-42")
    token = csrf_of(client, "/login")
    client.post("/login", data={"password": OPERATOR_PW, "csrf_token": token})
    bodies = [client.get(p).text for p in ("/", "/jobs", "/jobs/alpha", "/runs", "/audit", "/api/overview",
                                           "/api/jobs", "/api/jobs/alpha", "/api/audit", "/api/openapi.json")]
    for secret in (OPERATOR_PW, VIEWER_PW, OPERATOR_TOKEN, VIEWER_TOKEN, "session-secret-value-42"):
        assert not any(secret in body for body in bodies), secret


# -- escaping -------------------------------------------------------------------------------------------
def test_plugin_output_is_escaped_everywhere(make_client, store):
    job = add_job(store, "hostile<b>", "hostile")
    record_run(store, job["id"], status="Failed", error=PAYLOAD, details={"html": PAYLOAD, PAYLOAD: 1})
    client = make_client()
    for path in ("/", "/runs", "/runs/1", "/jobs", "/jobs/hostile%3Cb%3E"):
        body = client.get(path).text
        assert "<script>document" not in body and "hostile<b>" not in body, path
        assert "&lt;script&gt;document.title=" in body or path == "/jobs", path
    assert client.get("/api/runs/1").json()["run"]["error_message"] == PAYLOAD  # JSON keeps the text as is


# -- edits, validated like the CLI ---------------------------------------------------------------------------
def test_edit_is_validated_like_the_cli_and_nothing_is_written_on_error(make_client, store):
    add_job(store, "alpha", "nap", "*/5 * * * *")
    client = make_client()
    token = {"X-CSRF-Token": csrf_of(client)}
    bad = client.post("/api/jobs/alpha/update", json={"cron_expression": "61 * * * *"}, headers=token)
    assert bad.status_code == 400 and bad.json() == {"error": "cron_expression: invalid cron expression '61 * * * *'"}
    bad = client.post("/api/jobs/alpha/update", json={"configuration": {"seconds": "long"}}, headers=token)
    assert bad.status_code == 400 and bad.json()["error"].startswith("configuration.seconds: ")
    bad = client.post("/api/jobs/alpha/update", json={"name": "beta"}, headers=token)
    assert bad.json()["error"].startswith("name: cannot be changed here")
    form = client.post("/api/jobs/alpha/update", data={"csrf_token": token["X-CSRF-Token"], "configuration": "{x",
                                                       "next": "/jobs/alpha"})
    assert form.status_code == 303 and "error=configuration%3A+invalid+JSON" in form.headers["location"]
    assert store.get_job("alpha")["cron_expression"] == "*/5 * * * *"
    good = client.post("/api/jobs/alpha/update", headers=token, json={
        "cron_expression": "30 2 * * *", "timezone": "Europe/Berlin", "configuration": {"seconds": 0.1}})
    assert good.status_code == 200, good.text
    job = store.get_job("alpha")
    assert (job["cron_expression"], job["timezone"], json.loads(job["configuration"])) == (
        "30 2 * * *", "Europe/Berlin", {"seconds": 0.1})
    page = client.get("/jobs/alpha").text
    assert "At 02:30" in page and "Europe/Berlin" in page


def test_an_edit_with_a_deep_or_repeating_configuration_is_one_line_error(make_client, store):
    """Fresh-clone review M1, L4: no RecursionError (a 500), no silent last-key-wins."""
    add_job(store, "alpha", "nap", "*/5 * * * *")
    client = make_client()
    token = {"X-CSRF-Token": csrf_of(client)}
    bad = client.post("/api/jobs/alpha/update", json={"configuration": {"seconds": json.loads("[" * 200 + "]" * 200)}},
                      headers=token)
    assert bad.status_code == 400 and bad.json() == {"error": "configuration: nested deeper than 100 levels"}
    body = '{"configuration": {"seconds": ' + "[" * 5000 + "]" * 5000 + "}}"  # json.loads recurses out
    bad = client.post("/api/jobs/alpha/update", content=body, headers={**token, "content-type": "application/json"})
    assert bad.status_code == 400 and bad.json() == {"error": "body: must be a JSON object"}
    for text, error in (('{"seconds": ' + "[" * 1100 + "]" * 1100 + "}", "nested+deeper+than+100+levels"),
                        ('{"seconds": 1, "seconds": 2}', "duplicate+key+%27seconds%27")):
        form = client.post("/api/jobs/alpha/update", data={"csrf_token": token["X-CSRF-Token"], "configuration": text,
                                                           "next": "/jobs/alpha"})
        assert form.status_code == 303 and f"error=configuration%3A+{error}" in form.headers["location"]
    assert store.get_job("alpha")["configuration"] is None


def test_the_edit_form_and_filters_offer_every_concurrency_mode_and_max_queued(make_client, store):
    """Issue 12 point 7: Replace and QueueAll (with its bound) are chosen in the edit form and the jobs
    filter like the other modes; a bad bound is refused naming the field, and nothing is written."""
    add_job(store, "alpha", "nap", "*/5 * * * *")
    client = make_client()
    token = csrf_of(client)
    page = client.get("/jobs/alpha").text
    assert ">Replace</option>" in page and ">QueueAll</option>" in page and 'name="max_queued"' in page
    assert ">QueueAll</option>" in client.get("/jobs").text
    form = client.post("/api/jobs/alpha/update", data={"csrf_token": token, "concurrency_mode": "QueueAll",
                                                       "max_queued": "3", "next": "/jobs/alpha"})
    assert form.status_code == 303 and "error" not in form.headers["location"]
    job = store.get_job("alpha")
    assert (job["concurrency_mode"], job["max_queued"]) == ("QueueAll", 3)
    bad = client.post("/api/jobs/alpha/update", json={"max_queued": 0}, headers={"X-CSRF-Token": token})
    assert bad.status_code == 400 and bad.json() == {"error": "max_queued: must be between 1 and 1000, got 0"}
    assert store.get_job("alpha")["max_queued"] == 3
    assert [j["name"] for j in client.get("/api/jobs?mode=QueueAll").json()["jobs"]] == ["alpha"]
    assert client.get("/api/jobs?mode=Replace").json()["jobs"] == []


# -- run now ----------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_run_now_answers_at_once_and_the_run_is_recorded(make_client, store):
    add_job(store, "alpha", "nap", "0 0 1 1 *", configuration={"seconds": 0.2})
    client = make_client()
    token = {"X-CSRF-Token": csrf_of(client)}
    started = client.post("/api/jobs/alpha/run", headers=token)
    assert started.status_code == 202 and started.json()["accepted"] is True
    dash = client.app.state.dashboard
    wait_until(lambda: not dash.manual, 45, "the manual run to be recorded")
    [run] = client.get("/api/runs?job=alpha").json()["runs"]
    assert (run["status"], run["scheduled_at"], run["executed_by_instance"].startswith("jobs-run-")) == (
        "Completed", None, True)
    assert [(r["action"], r["outcome"]) for r in audit_rows(store)] == [("run", "ok"), ("run finished", "ok")]
    assert json.loads(audit_rows(store)[1]["details"])["run_id"] == run["id"]


def test_cancel_asks_the_holder_of_a_live_run_and_records_who(make_client, store):
    job = add_job(store, "alpha", "nap")
    record_run(store, job["id"], status="Completed")
    with store.engine.begin() as conn:
        conn.execute(runs.insert().values(job_id=job["id"], started_at=dt.datetime.now(UTC), status="Running",
                                          executed_by_instance="sup-a"))
    client = make_client()
    assert client.post("/api/runs/2/cancel").status_code == 403  # no CSRF token
    token = {"X-CSRF-Token": csrf_of(client, "/runs/2")}
    assert 'action="/api/runs/2/cancel"' in client.get("/runs/2").text
    asked = client.post("/api/runs/2/cancel", headers=token)
    assert asked.status_code == 202 and asked.json()["run"]["cancel_requested_by"] == "local"
    page = client.get("/runs/2").text
    assert "by local" in page and 'action="/api/runs/2/cancel"' not in page
    ended = client.post("/api/runs/1/cancel", headers=token)
    assert ended.status_code == 400 and ended.json()["error"].startswith("id: run 1 is not running: it ended Completed")
    assert client.post("/api/runs/99/cancel", headers=token).status_code == 404
    assert [(r["action"], r["target"], r["outcome"]) for r in audit_rows(store)] == [
        ("cancel", "2", "refused"), ("cancel", "2", "ok"), ("cancel", "1", "error"), ("cancel", "99", "error")]


# -- the command ----------------------------------------------------------------------------------------------
@pytest.fixture
def cli(tmp_path, capsys, monkeypatch):
    run = Cli(capsys, monkeypatch, tmp_path)
    return lambda *args: run(*args, expect=None)


def test_binding_beyond_loopback_without_authentication_is_refused(cli, db_url):
    proc = cli("dashboard", "--db", db_url, "--host", "0.0.0.0")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("error: --host: '0.0.0.0' is not a loopback address and no dashboard password")
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_port_in_use_is_a_one_line_error(cli, db_url):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        proc = cli("dashboard", "--db", db_url, "--port", str(taken.getsockname()[1]))
    assert proc.returncode == 2 and proc.stderr.startswith("error: --port: cannot listen on 127.0.0.1:")


def test_hash_password_prints_a_hash_the_settings_accept(cli, db_url, monkeypatch, tmp_path):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("a long password\n"))
    proc = cli("dashboard", "--hash-password")
    assert proc.returncode == 0 and verify_secret("a long password", proc.stdout.strip())


# -- fuzzing the API against its own schema ----------------------------------------------------------------
@pytest.mark.timeout(120)
def test_api_fuzzed_against_its_schema_never_answers_500(make_client, store):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings

    job = add_job(store, "alpha", "nap")
    record_run(store, job["id"], status="Failed", error="x")
    client = make_client(operator_token=OPERATOR_TOKEN)
    schema = schemathesis.openapi.from_asgi("/api/openapi.json", client.app,
                                            headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"})
    failures, calls = [], []
    for operation in schema.get_all_operations():
        op = operation.ok()
        if op.path.endswith("/run"):
            continue  # starts real worker children: covered by test_run_now_...

        @settings(max_examples=10, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy())
        def check(case):
            response = case.call(headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"})
            calls.append(response.status_code)
            if response.status_code >= 500:
                failures.append((case.method, case.formatted_path, case.query, case.body, response.status_code))

        check()
    assert failures == []
    assert len(calls) >= 40 and 200 in calls  # it did reach the handlers


@pytest.mark.parametrize("target", ["//evil.example/x", "/\\evil.example", "https://evil.example/", "jobs"])
def test_login_and_forms_never_redirect_off_site(make_client, store, target):
    add_job(store, "alpha", "nap")
    client = make_client(operator_password=OPERATOR_PW)
    token = csrf_of(client, "/login")
    done = client.post("/login", data={"password": OPERATOR_PW, "csrf_token": token, "next": target})
    assert done.status_code == 303 and done.headers["location"] == "/"
    form = client.post("/api/jobs/alpha/pause", data={"csrf_token": csrf_of(client), "next": target})
    assert form.status_code == 303 and form.headers["location"].startswith("/jobs/alpha?")


def test_a_runs_captured_output_is_shown_escaped_and_updates_the_fingerprint(make_client, store):
    from mjsched_isolated.store.output import RunOutput

    job = add_job(store, "alpha", "nap")
    with store.engine.begin() as conn:
        conn.execute(runs.insert().values(job_id=job["id"], started_at=dt.datetime.now(UTC), status="Running"))
    client = make_client()
    views = client.app.state.dashboard.views
    before = views.fingerprint()
    RunOutput(store.engine).append(1, 0, ["line one\n", PAYLOAD + "\n"], dt.datetime.now(UTC))
    assert views.fingerprint() != before  # an open run page refreshes as the run prints
    page = client.get("/runs/1").text
    assert "line one" in page and "&lt;script&gt;document.title=" in page and PAYLOAD not in page
    assert client.get("/api/runs/1").json()["output"] == "line one\n" + PAYLOAD + "\n"
    RunOutput(store.engine).append(1, 2, [f"chunk {i}\n" for i in range(70)], dt.datetime.now(UTC))
    text, earlier = views.output_tail(1)
    assert earlier == 8 and text.startswith("chunk 6\n") and text.endswith("chunk 69\n")
    assert "8 earlier chunk(s) are left out" in client.get("/runs/1").text


def test_upcoming_occurrences_follow_the_jobs_own_dst_policy(store):
    from mjsched_isolated.dashboard.data import upcoming

    after = dt.datetime(2024, 3, 30, 12, 0, tzinfo=UTC)
    shift = add_job(store, "shift", "nap", "30 2 * * *", timezone="Europe/Berlin", next_run_at=after)
    skip = add_job(store, "skip", "nap", "30 2 * * *", timezone="Europe/Berlin", next_run_at=after,
                   dst_gap_policy="Skip")
    first = upcoming(shift, after, 1)[0]
    assert (first["utc"], first["note"]) == (dt.datetime(2024, 3, 31, 1, 0, tzinfo=UTC),
                                             "moved: 2024-03-31 02:30 does not exist (DST gap)")
    assert upcoming(skip, after, 1)[0]["utc"] == dt.datetime(2024, 4, 1, 0, 30, tzinfo=UTC)


def test_failed_logins_from_one_address_are_throttled(make_client, store):
    from mjsched_isolated.dashboard.auth import LOGIN_FAILURES, LOGIN_WINDOW_S, LoginThrottle

    client = make_client(operator_password=OPERATOR_PW)
    token = csrf_of(client, "/login")
    for _ in range(LOGIN_FAILURES):
        assert "wrong password" in client.post("/login", data={"password": "guess-guess", "csrf_token": token}).text
    locked = client.post("/login", data={"password": OPERATOR_PW, "csrf_token": token})
    assert locked.status_code == 429  # even the right password, until the window passes
    assert [json.loads(r["details"] or "{}").get("reason") for r in audit_rows(store)][-1] == "throttled"
    throttle = LoginThrottle()  # the window, with time passed in
    for t in range(LOGIN_FAILURES):
        throttle.failed("10.0.0.1", float(t))
    assert throttle.locked("10.0.0.1", 10.0) and not throttle.locked("10.0.0.2", 10.0)
    assert not throttle.locked("10.0.0.1", LOGIN_WINDOW_S + 0.5)


def test_supervisors_show_their_cap_and_version(make_client, store):
    """A supervisor writes its worker cap and version when it registers; the overview shows both."""
    from mjsched_isolated import __version__
    from mjsched_isolated.supervisor.liveness import Liveness

    liveness = Liveness(store, "sup-cap-7", 30.0, 10.0, lambda: dt.datetime.now(dt.UTC), max_concurrent_jobs=7)
    liveness.maintain(0.0)
    assert liveness.registered
    [row] = [s for s in make_client().get("/api/overview").json()["supervisors"] if s["instance"] == "sup-cap-7"]
    assert (row["max_concurrent_jobs"], row["version"], row["alive"]) == (7, __version__, True)
    page = make_client().get("/").text
    assert "<th>cap</th><th>version</th>" in page and f"<td>7</td><td>{__version__}</td>" in page


# -- backfill, retry, roles, awkward names (h-backfill) ---------------------------------------------------------
def test_backfill_and_retry_buttons_post_with_csrf_and_are_audited(make_client, store):
    job = add_job(store, "alpha", "nap", "0 * * * *", next_run_at=dt.datetime(2099, 1, 1, tzinfo=UTC))
    record_run(store, job["id"], status="Failed", error="x")
    client = make_client()
    page = client.get("/jobs/alpha").text
    assert 'action="/api/jobs/alpha/backfill"' in page
    assert 'action="/api/runs/1/retry"' in client.get("/runs/1").text
    assert client.post("/api/jobs/alpha/backfill", json={"from": "2026-11-30T00:00", "to": "2026-11-30T02:00"}
                       ).status_code == 403  # no CSRF token
    token = {"X-CSRF-Token": csrf_of(client)}
    done = client.post("/api/jobs/alpha/backfill", headers=token,
                       json={"from": "2026-11-30T00:00:00Z", "to": "2026-11-30T02:00:00Z"})
    assert done.status_code == 202, done.text
    assert len(done.json()["backfill"]["added"]) == 3
    form = client.post("/api/jobs/alpha/backfill", data={"csrf_token": token["X-CSRF-Token"], "max": "2",
                                                         "from": "2026-11-30T00:00", "to": "2026-11-30T03:00",
                                                         "next": "/jobs/alpha"})
    assert form.status_code == 303 and "error=max%3A" in form.headers["location"]
    assert "3 occurrence(s) waiting" in client.get("/jobs/alpha").text
    retried = client.post("/api/runs/1/retry", headers=token)
    assert retried.status_code == 202 and retried.json()["retry"]["attempt"] == 2
    assert [(r["action"], r["target"], r["outcome"]) for r in audit_rows(store)] == [
        ("backfill", "alpha", "refused"), ("backfill", "alpha", "ok"), ("backfill", "alpha", "error"),
        ("retry", "1", "ok")]
    assert store.backfills.pending(job["id"])[0] == 4


def test_backfill_api_wants_a_positive_integer_max_and_an_active_or_paused_job(make_client, store):
    """New-user review L2 (``max`` "5", 5.5, true were accepted from JSON) and M4 (an Expired or Disabled
    job's backfill was accepted and never ran)."""
    job = add_job(store, "alpha", "nap", "0 * * * *", next_run_at=dt.datetime(2099, 1, 1, tzinfo=UTC))
    add_job(store, "gone", "nap", "0 * * * *", status="Expired", next_run_at=None)
    client = make_client()
    token = {"X-CSRF-Token": csrf_of(client)}
    window = {"from": "2026-11-30T00:00:00Z", "to": "2026-11-30T02:00:00Z"}
    for bad in ("5", 5.5, True, 0, -1, "five"):
        refused = client.post("/api/jobs/alpha/backfill", headers=token, json={**window, "max": bad})
        assert refused.status_code == 400 and refused.json()["error"].startswith("max: must be a positive integer")
    assert store.backfills.pending(job["id"])[0] == 0
    expired = client.post("/api/jobs/gone/backfill", headers=token, json=window)
    assert expired.status_code == 400 and expired.json()["error"].startswith("name: job 'gone' is Expired")
    assert client.post("/api/jobs/alpha/backfill", headers=token, json={**window, "max": 3}).status_code == 202
    form = client.post("/api/jobs/alpha/backfill", data={"csrf_token": token["X-CSRF-Token"], "max": "5", **window,
                                                         "next": "/jobs/alpha"})
    assert form.status_code == 303 and "error" not in form.headers["location"]  # a form's digits are fine


def test_a_viewer_sees_no_action_buttons_and_an_operator_does(make_client, store):
    job = add_job(store, "alpha", "nap")
    record_run(store, job["id"], status="Failed", error="x")
    with store.engine.begin() as conn:
        conn.execute(runs.insert().values(job_id=job["id"], started_at=dt.datetime.now(UTC), status="Running",
                                          executed_by_instance="sup-a"))
    client = make_client(operator_password=OPERATOR_PW, viewer_password=VIEWER_PW)
    pages = ("/", "/jobs/alpha", "/runs", "/runs/1", "/runs/2")
    for password, shown in ((VIEWER_PW, False), (OPERATOR_PW, True)):
        token = csrf_of(client, "/login")
        client.post("/login", data={"password": password, "csrf_token": token, "next": "/"})
        text = "".join(client.get(path).text for path in pages)
        for action in ("/run", "/pause", "/update", "/backfill", "/cancel", "/retry"):
            assert (f'{action}" class=' in text or f'{action}"' in text) is shown, (password, action)
        client.post("/logout", data={"csrf_token": csrf_of(client)})


# (a literal "%" is left out: Starlette's test client decodes the path twice, uvicorn once)
@pytest.mark.parametrize("name", ["..", ".", "a/b", "a/../b", "x/run", "sp ace?#&", "ünï/.."])
def test_every_job_name_is_reachable_from_its_links_and_its_buttons_work(make_client, store, name):
    add_job(store, name, "nap")
    client = make_client()
    listing = client.get("/jobs").text
    href = re.search(r'<td><a href="([^"]+)">', listing).group(1).replace("&amp;", "&")
    page = client.get(href)
    assert page.status_code == 200 and f"<h1>{name.replace('&', '&amp;')} " in page.text, (href, page.text[:300])
    action = re.search(r'action="([^"]+/pause[^"]*)"', page.text).group(1).replace("&amp;", "&")
    done = client.post(action, data={"csrf_token": csrf_of(client), "next": href})
    assert done.status_code == 303 and "flash=" in done.headers["location"], done.headers
    assert store.get_job(name)["status"] == "Paused"


@pytest.mark.timeout(60)
def test_stopping_the_dashboard_cancels_its_run_now_runs_and_releases_the_lease(store, db_url):
    """A SIGTERM to the dashboard used to leave its Run now run Running (no worker, lease held, Run now
    refused) until another supervisor abandoned it; serve() now calls stop_manual_runs after uvicorn stops."""
    from mjsched_isolated.dashboard.app import stop_manual_runs

    add_job(store, "alpha", "nap", "0 0 1 1 *", configuration={"seconds": 30})
    settings = build_settings({"database_url": db_url, "plugins_dir": PLUGINS, "lease_renew_interval_s": 0.3,
                               "lease_ttl_s": 3, "kill_grace_s": 0.5})
    with TestClient(create_app(settings, store, poll_s=0.05), base_url="http://127.0.0.1",
                    follow_redirects=False) as client:
        assert client.post("/api/jobs/alpha/run", headers={"X-CSRF-Token": csrf_of(client)}).status_code == 202
        wait_until(lambda: client.get("/api/runs?job=alpha").json()["runs"], 30, "the run to start")
        dash = client.app.state.dashboard
        [run_id] = stop_manual_runs(dash, wait_s=20)
        assert not dash.manual and not any(t.is_alive() for t in dash.manual_threads)
    run = store.get_run(run_id)
    assert (run["status"], run["cancel_requested_by"]) == ("Cancelled", "dashboard stopped")
    assert store.get_job("alpha")["locked_by_instance"] is None
