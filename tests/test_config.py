"""Settings: the TOML file, MJSCHED_* variables and flags, their precedence, errors naming the key, secrets
kept out of reprs and logs, and the ``check`` command, through the CLI (in-process: ``main(argv)``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sqlalchemy as sa
from clirun import Cli
from conftest import FIXTURE_PLUGINS, add_job, isolated_database

from mjsched_isolated.config import load_settings
from mjsched_isolated.errors import InputError
from mjsched_isolated.store import Store
from mjsched_isolated.store.schema import jobs

pytestmark = pytest.mark.timeout(60)

PLUGINS = str(Path(__file__).parents[1] / "plugins")


def _toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "mjsched.toml"
    path.write_text(text)
    return str(path)


# -- the loader --------------------------------------------------------------------------------------------
def test_precedence_is_flags_then_environment_then_file_then_defaults(tmp_path):
    path = _toml(tmp_path, "max_concurrent_jobs = 3\nlease_timeout_s = 120\nplugins_dir = 'from-file'\n"
                           "[retention]\nkeep_days = 7\nkeep_min_per_job = 5\n")
    env = {"MJSCHED_LEASE_TIMEOUT_S": "90", "MJSCHED_RETENTION_KEEP_DAYS": "14", "MJSCHED_PLUGINS_DIR": "from-env"}
    s = load_settings(config_path=path, environ=env, flags={"plugins_dir": "from-flag", "max_concurrent_jobs": None})
    assert s.plugins_dir == "from-flag"  # flag beats environment and file
    assert s.lease_timeout_s == 90.0 and s.retention.keep_days == 14.0  # environment beats file
    assert s.max_concurrent_jobs == 3 and s.retention.keep_min_per_job == 5  # file beats defaults; None flag ignored
    assert s.shutdown_timeout_s == 30.0 and s.retention.prune_batch_size == 500  # defaults


def test_config_file_named_by_environment(tmp_path):
    path = _toml(tmp_path, "max_concurrent_jobs = 4\n")
    assert load_settings(environ={"MJSCHED_CONFIG": path}).max_concurrent_jobs == 4
    assert load_settings(config_path=path, environ={"MJSCHED_CONFIG": "/nonexistent"}).max_concurrent_jobs == 4


@pytest.mark.parametrize("text, field", [
    ("bogus = 1\n", "bogus"),
    ("[retention]\nkeep_dayz = 7\n", "retention.keep_dayz"),
    ("max_concurrent_jobs = '3'\n", "max_concurrent_jobs"),  # a string in the file is a wrong type, not a number
    ("[retention]\nkeep_days = -1\n", "retention.keep_days"),
    ("[notifications.email]\nhost = 'smtp'\n", "notifications.email.sender"),
    ("[notifications.email]\nhost = 'smtp'\nsender = 'a@b'\nsecurity = 'tls13'\n", "notifications.email.security"),
    ("[notifications.webhook]\nurl = 'ftp://x'\n", "notifications.webhook.url"),
    ("[metrics]\nport = 70000\n", "metrics.port"),
    ("[recycling]\nmax_tasks_per_child = 0\n", "recycling.max_tasks_per_child"),
    ("lease_ttl_s = 3\n", "lease_renew_interval_s"),
    ("heartbeat_lease_s = 120\n", "heartbeat_lease_s"),  # below heartbeat_interval_s (300): would lapse
    ("heartbeat_interval_s = 60\nheartbeat_lease_s = 60\n", "heartbeat_lease_s"),
    ("log_format = 'xml'\n", "log_format"),
    ("max_concurrent_jobs = 3\nmax_concurrent_jobs = 4\n", "--config"),  # not valid TOML
])
def test_bad_file_names_the_key(tmp_path, text, field):
    with pytest.raises(InputError) as err:
        load_settings(config_path=_toml(tmp_path, text), environ={})
    assert err.value.field == field, str(err.value)


def test_a_config_file_that_is_not_utf8_is_one_error_naming_config(tmp_path):
    """New-user review: a byte that is not UTF-8 raised UnicodeDecodeError out of tomllib (a traceback)."""
    path = tmp_path / "bad.toml"
    path.write_bytes(b'database_url = "sqlite:////tmp/\xff.db"\n')
    with pytest.raises(InputError) as err:
        load_settings(config_path=str(path), environ={})
    assert err.value.field == "--config" and "is not UTF-8 text" in str(err.value)


@pytest.mark.parametrize("env, field", [
    ({"MJSCHED_MAX_CONCURRENT_JOBS": "five"}, "MJSCHED_MAX_CONCURRENT_JOBS"),
    ({"MJSCHED_AUTO_UPGRADE": "perhaps"}, "MJSCHED_AUTO_UPGRADE"),
    ({"MJSCHED_METRICS_PORT": "-1"}, "metrics.port"),
    ({"MJSCHED_CONFIG": "/nonexistent/mjsched.toml"}, "MJSCHED_CONFIG"),
])
def test_bad_environment_names_the_variable(env, field):
    with pytest.raises(InputError) as err:
        load_settings(environ=env)
    assert err.value.field == field, str(err.value)


def test_environment_types_lists_and_sections():
    s = load_settings(environ={"MJSCHED_AUTO_UPGRADE": "true", "MJSCHED_METRICS_PORT": "9108",
                               "MJSCHED_NOTIFICATIONS_EMAIL_HOST": "smtp.example",
                               "MJSCHED_NOTIFICATIONS_EMAIL_PORT": "587",
                               "MJSCHED_NOTIFICATIONS_EMAIL_SENDER": "sched@example",
                               "MJSCHED_NOTIFICATIONS_EMAIL_RECIPIENTS": "ops@example, dev@example",
                               "MJSCHED_NOTIFICATIONS_WEBHOOK_URL": "https://hooks.example/x",
                               "MJSCHED_UNRELATED_THING": "ignored"})
    assert s.auto_upgrade is True and s.metrics.port == 9108
    assert s.notifications.email.port == 587 and s.notifications.email.recipients == ["ops@example", "dev@example"]
    assert s.notifications.channels() == ["log", "email", "webhook"]


def test_secrets_never_in_repr(tmp_path):
    path = _toml(tmp_path, "database_url = 'postgresql+psycopg://u:dbpass123@db/x'\n"
                           "[notifications.email]\nhost = 'smtp'\nsender = 'a@b'\nusername = 'u'\n"
                           "[notifications.webhook]\nurl = 'https://h/x'\n")
    s = load_settings(config_path=path, environ={"MJSCHED_NOTIFICATIONS_EMAIL_PASSWORD": "smtppass456",
                                                 "MJSCHED_NOTIFICATIONS_WEBHOOK_SECRET": "hooksecret789"})
    assert s.notifications.email.password == "smtppass456" and s.notifications.webhook.secret == "hooksecret789"
    text = repr(s) + str(s) + repr(s.notifications) + str(s.notifications.email)
    for secret in ("dbpass123", "smtppass456", "hooksecret789"):
        assert secret not in text
    as_query = load_settings(environ={"MJSCHED_DATABASE_URL": "postgresql+psycopg://db/x?user=u&password=qpass321"})
    assert "qpass321" not in repr(as_query) and "password=***" in repr(as_query)


# -- through the CLI ---------------------------------------------------------------------------------------
@pytest.fixture
def cli(tmp_path, capsys, monkeypatch) -> Cli:
    """``mjsched`` in-process, in ``tmp_path``, with no ``MJSCHED_*`` variables (the exit code is checked
    by each test)."""
    run = Cli(capsys, monkeypatch, tmp_path)
    return lambda *args, env=None: run(*args, env=env, expect=None)


def test_cli_bad_config_is_one_line_exit_2_and_nothing_written(cli, tmp_path):
    path = _toml(tmp_path, "[retention]\nkeep_days = 'forever'\n")
    for args in (["serve", "--config", path], ["jobs", "list", "--config", path], ["check", "--config", path]):
        proc = cli(*args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
        assert proc.stderr.startswith("error: retention.keep_days: "), proc.stderr
    assert not list(tmp_path.glob("*.db*"))  # no database file was created


def test_serve_takes_its_settings_from_the_file_and_flags_win(cli, tmp_path):
    db = f"sqlite:///{tmp_path / 'a.db'}"
    path = _toml(tmp_path, f"database_url = '{db}'\nplugins_dir = '{FIXTURE_PLUGINS}'\nmax_concurrent_jobs = 2\n"
                           "lease_timeout_s = 45\n")
    proc = cli("serve", "--config", path, "--run-for", "0")
    assert proc.returncode == 0, proc.stderr
    assert "2 workers, lease timeout 45 s" in proc.stderr
    proc = cli("serve", "--run-for", "0", "--max-concurrent-jobs", "3", env={"MJSCHED_CONFIG": path,
                                                                                      "MJSCHED_LEASE_TIMEOUT_S": "50"})
    assert proc.returncode == 0, proc.stderr
    assert "3 workers, lease timeout 50 s" in proc.stderr


def test_serve_log_hides_database_and_channel_secrets(cli, tmp_path):
    with isolated_database("postgresql", tmp_path) as url:
        secret_url = sa.engine.make_url(url).set(password="hunter2pw").render_as_string(hide_password=False)
        if "?" in secret_url:  # and once more as libpq's query parameter, which must be hidden too
            secret_url += "&password=hunter2pw"
        env = {"MJSCHED_NOTIFICATIONS_EMAIL_HOST": "127.0.0.1", "MJSCHED_NOTIFICATIONS_EMAIL_SENDER": "s@x",
               "MJSCHED_NOTIFICATIONS_EMAIL_PASSWORD": "smtpsecret42", "MJSCHED_NOTIFICATIONS_WEBHOOK_URL": "http://127.0.0.1:9/x",
               "MJSCHED_NOTIFICATIONS_WEBHOOK_SECRET": "hooksecret42"}
        proc = cli("serve", "--db", secret_url, "--plugins", FIXTURE_PLUGINS, "--run-for", "0",
                    "--log-level", "DEBUG", env=env)
        assert proc.returncode == 0, proc.stderr
        assert "supervisor" in proc.stderr and "***" in proc.stderr
        for secret in ("hunter2pw", "smtpsecret42", "hooksecret42"):
            assert secret not in proc.stderr + proc.stdout


def test_check_is_zero_when_all_is_well_and_lists_each_problem(cli, tmp_path):
    db = f"sqlite:///{tmp_path / 'c.db'}"
    Store.open(db).close()  # check reads only: the database must exist (a mistyped --db is a problem)
    ok = cli("check", "--db", db, "--plugins", PLUGINS)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "all is well" in ok.stdout and "shell" in ok.stdout

    store = Store.open(db)
    try:
        add_job(store, "good", "shell", "*/5 * * * *", configuration=json.dumps({"command": ["true"]}))
        add_job(store, "bad-config", "shell", "*/5 * * * *", configuration=json.dumps({"command": []}))
        add_job(store, "bad-type", "no_such_plugin", "*/5 * * * *")
        add_job(store, "bad-cron", "shell", "*/5 * * * *", configuration=json.dumps({"command": ["true"]}))
        with store.engine.begin() as conn:  # as another tool or an older version could have written it
            conn.execute(jobs.update().where(jobs.c.name == "bad-cron").values(cron_expression="61 * * * *"))
    finally:
        store.close()
    bad = cli("check", "--db", db, "--plugins", PLUGINS, "--json")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    report = json.loads(bad.stdout)
    assert not report["ok"]
    problems = "\n".join(report["problems"])
    assert "job bad-config: configuration.command" in problems
    assert "job bad-type: job_type" in problems
    assert "job bad-cron: cron_expression" in problems
    assert "good" not in problems and len(report["problems"]) == 3, problems

    broken = cli("check", "--db", f"sqlite:///{tmp_path / 'd.db'}", "--plugins", FIXTURE_PLUGINS)
    assert broken.returncode == 1 and "broken_import.py: failed to import" in broken.stdout, broken.stdout


def test_check_and_jobs_run_name_a_number_or_time_edited_by_hand(cli, tmp_path):
    """SQLite keeps text in a number or timestamp column: `check` names the job and field, `jobs run`
    refuses with exit 2 (the supervisor sets such a job aside: tests/test_supervisor.py)."""
    db = f"sqlite:///{tmp_path / 'c.db'}"
    store = Store.open(db)
    try:
        for name in ("stall", "far", "garbage-start", "good"):
            add_job(store, name, "shell", "*/5 * * * *", configuration=json.dumps({"command": ["true"]}))
        with store.engine.begin() as conn:
            conn.execute(sa.text("UPDATE jobs SET max_runtime_minutes = 'abc' WHERE name = 'stall'"))
            conn.execute(sa.text("UPDATE jobs SET max_jitter_s = 1e300 WHERE name = 'far'"))
            conn.execute(sa.text("UPDATE jobs SET start_at = 'garbage' WHERE name = 'garbage-start'"))
    finally:
        store.close()
    bad = cli("check", "--db", db, "--plugins", PLUGINS, "--json")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    problems = "\n".join(json.loads(bad.stdout)["problems"])
    assert "job stall: max_runtime_minutes: 'abc' in the database is not an integer" in problems
    assert "job far: max_jitter_s: 1e+300 in the database is out of range" in problems
    assert "job garbage-start: start_at: 'garbage' in the database is not a timestamp" in problems
    assert "good" not in problems and len(json.loads(bad.stdout)["problems"]) == 3, problems
    run = cli("jobs", "run", "stall", "--db", db, "--plugins", PLUGINS)
    assert run.returncode == 2 and "max_runtime_minutes" in run.stderr, run.stderr


def test_check_validates_the_configured_jobs_file(cli, tmp_path):
    jobs_file = tmp_path / "jobs.toml"
    jobs_file.write_text("[[jobs]]\nname = 'x'\njob_type = 'shell'\ncron_expression = 'every day'\n"
                         "[jobs.configuration]\ncommand = ['true']\n")
    proc = cli("check", "--db", f"sqlite:///{tmp_path / 'c.db'}", "--plugins", PLUGINS,
                env={"MJSCHED_JOBS_FILE": str(jobs_file)})
    assert proc.returncode == 1, proc.stdout
    assert "PROBLEM jobs file:" in proc.stdout and "cron_expression" in proc.stdout, proc.stdout
    flag = cli("check", "--db", f"sqlite:///{tmp_path / 'c.db'}", "--plugins", PLUGINS, "--jobs", str(jobs_file))
    assert flag.returncode == 1 and "PROBLEM jobs file:" in flag.stdout, flag.stdout


def test_check_reports_an_outdated_schema_as_a_problem(cli, tmp_path):
    from alembic import command

    from mjsched_isolated.store import migrate, schema

    db = f"sqlite:///{tmp_path / 'old.db'}"
    engine = schema.connect(db)
    try:
        with engine.begin() as conn:
            command.upgrade(migrate.config(conn), "0001")
    finally:
        engine.dispose()
    proc = cli("check", "--db", db, "--plugins", PLUGINS)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "PROBLEM database schema is at revision 0001" in proc.stdout and "db upgrade" in proc.stdout


@pytest.mark.parametrize("text, field", [
    ("[notifications.email]\nhost = 'smtp'\nsender = 'a@b'\nrecipients = ['not an email']\n",
     "notifications.email.recipients[0]"),
    ("[notifications.email]\nhost = 'smtp'\nsender = 'a@b'\nrecipients = ['a@b\\r\\nBcc: x@y']\n",
     "notifications.email.recipients[0]"),
    ("[notifications.email]\nhost = 'smtp'\nsender = ''\n", "notifications.email.sender"),
    ("[notifications.email]\nhost = ' '\nsender = 'a@b'\n", "notifications.email.host"),
    ("[notifications.webhook]\nurl = 'http://'\n", "notifications.webhook.url"),
    ("[notifications]\nretry_backoff_s = 10\nretry_backoff_max_s = 5\n", "notifications.retry_backoff_max_s"),
])
def test_bad_channel_settings_name_the_key(tmp_path, text, field):
    with pytest.raises(InputError) as err:
        load_settings(config_path=_toml(tmp_path, text), environ={})
    assert err.value.field == field, str(err.value)


def test_check_warns_when_email_notices_would_have_no_recipients(cli, tmp_path):
    db = f"sqlite:///{tmp_path / 'c.db'}"
    store = Store.open(db)
    try:
        add_job(store, "loud", "shell", "*/5 * * * *", configuration=json.dumps({"command": ["true"]}))
        add_job(store, "addressed", "shell", "*/5 * * * *", configuration=json.dumps({"command": ["true"]}),
                notify_recipients=json.dumps(["ops@example.org"]))
    finally:
        store.close()
    env = {"MJSCHED_NOTIFICATIONS_EMAIL_HOST": "127.0.0.1", "MJSCHED_NOTIFICATIONS_EMAIL_SENDER": "s@example.org"}
    proc = cli("check", "--db", db, "--plugins", PLUGINS, env=env)
    assert proc.returncode == 1, proc.stdout
    assert "PROBLEM job loud: notify_recipients: none" in proc.stdout and "job addressed" not in proc.stdout
    env["MJSCHED_NOTIFICATIONS_EMAIL_RECIPIENTS"] = "ops@example.org"
    assert cli("check", "--db", db, "--plugins", PLUGINS, env=env).returncode == 0


def test_unparseable_database_url_is_bad_input_and_keeps_its_password_hidden(cli, tmp_path):
    proc = cli("jobs", "list", "--db", "postgresql+psycopg://u:pw4leak@127.0.0.1:notaport/x")
    assert proc.returncode == 2 and proc.stderr.startswith("error: --db: not a usable database URL"), proc.stderr
    assert "pw4leak" not in proc.stderr
    proc = cli("jobs", "pause", "x", "--db", f"sqlite:///{tmp_path}/no/such/dir/x.db")  # a command that writes
    assert proc.returncode == 2 and "cannot connect" in proc.stderr, proc.stderr
    proc = cli("jobs", "list", "--db", f"sqlite:///{tmp_path}/no/such/dir/x.db")  # a read-only one
    assert proc.returncode == 2 and proc.stderr.startswith("error: --db: no database at"), proc.stderr


@pytest.mark.parametrize("text, flags, field", [
    ("max_concurrent_jobs = 'three'\n", {"max_concurrent_jobs": 3}, "max_concurrent_jobs"),
    ("[retention]\nkeep_days = 'week'\n", {"retention": {"keep_days": 7.0}}, "retention.keep_days"),
    ("[notifications.webhook]\nurl = 5\n", {"notifications": {"webhook": {"url": "https://x"}}},
     "notifications.webhook.url"),
])
def test_a_file_value_of_the_wrong_type_is_reported_even_when_a_flag_overrides_it(tmp_path, text, flags, field):
    path = _toml(tmp_path, text)
    with pytest.raises(InputError) as err:
        load_settings(config_path=path, environ={}, flags=flags)
    assert err.value.field == field and path in str(err.value), str(err.value)


def test_a_file_value_a_flag_makes_valid_across_keys_is_not_refused(tmp_path):
    """Only types are judged alone: a check across keys is judged on the merged settings."""
    path = _toml(tmp_path, "lease_ttl_s = 3\n")
    assert load_settings(config_path=path, environ={}, flags={"lease_renew_interval_s": 1.0}).lease_ttl_s == 3


def test_serve_reports_a_bad_file_value_a_flag_overrides(cli, tmp_path):
    path = _toml(tmp_path, "max_concurrent_jobs = 'three'\n")
    proc = cli("serve", "--config", path, "--run-for", "0", "--max-concurrent-jobs", "2")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("error: max_concurrent_jobs: "), proc.stderr
    assert not list(tmp_path.glob("*.db*"))


def test_a_heartbeat_lease_not_longer_than_its_interval_names_both(tmp_path):
    with pytest.raises(InputError) as err:
        load_settings(config_path=_toml(tmp_path, "heartbeat_interval_s = 60\nheartbeat_lease_s = 30\n"), environ={})
    assert err.value.field == "heartbeat_lease_s" and "heartbeat_interval_s (60 s" in err.value.message
    assert load_settings(config_path=_toml(tmp_path, "heartbeat_interval_s = 60\nheartbeat_lease_s = 90\n"),
                         environ={}).heartbeat_lease_s == 90
