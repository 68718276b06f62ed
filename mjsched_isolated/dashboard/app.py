"""The dashboard's ASGI application (Starlette): pages, their JSON under ``/api/``, actions, live updates.

Every page ``/x`` has its JSON at ``/api/x`` (described by ``/api/openapi.json``). Actions are POSTs
(``/api/jobs/{name}/run``, ``/pause``, ``/resume``, ``/update``, ``/backfill``,
``/api/runs/{id}/cancel``, ``/retry``); the pages' forms post to the same URLs
and are sent back to the page (303) with a one-line message. Every action, refused ones too, is logged
(logger ``mjsched.dashboard``) and stored in the audit log with who and when. Only the operator role sees
the action buttons (the viewer role's POSTs are refused anyway).

Job names are any text without control characters, ``/`` included: links quote the whole name as one path
segment (``%2F``), and the names ``.`` and ``..``, which browsers and HTTP clients resolve away as dot
segments whatever their encoding, are linked as ``/job?name=..`` (and ``/api/job/<action>?name=..``).

Live updates: ``/api/events`` is a server-sent event stream that says ``change`` whenever the database's
fingerprint (:meth:`DashboardViews.fingerprint`) changes, checked every ``poll_s`` seconds; the page's
script then fetches the page again and swaps its ``<main>``. The script closes the stream while the tab
is hidden.

"Run now" does what ``jobs run`` does (:func:`ops.run_job`: a short-lived ``jobs-run-`` supervisor with one
worker child, in this process) on a background thread, so the request answers at once (202) and the run
shows up live like any other; one manual run per job at a time from one dashboard.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode

import msgspec
from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from mjsched_isolated import jobspec, ops
from mjsched_isolated.config import Settings
from mjsched_isolated.dashboard import charts, data
from mjsched_isolated.dashboard.auth import COOKIE, Auth, Role, Session
from mjsched_isolated.dashboard.openapi import openapi_schema
from mjsched_isolated.enums import ConcurrencyMode
from mjsched_isolated.errors import InputError, MjschedError, NotFoundError
from mjsched_isolated.status import MANUAL_INSTANCE_PREFIX
from mjsched_isolated.store import Store
from mjsched_isolated.store.dashboard_views import DashboardViews

log = logging.getLogger("mjsched.dashboard")
HERE = Path(__file__).parent
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; object-src 'none'; "
       "base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
EDITABLE = ("cron_expression", "timezone", "description", "configuration", "concurrency_mode", "max_queued",
            "max_runtime_minutes")


DOT_NAMES = (".", "..")  # names no path segment can carry: linked by query string


def job_url(name: str, **query: Any) -> str:
    """The job page of ``name`` (with ``query``): ``/jobs/<name as one quoted segment>``, or
    ``/job?name=...`` for a name a URL path cannot hold (:data:`DOT_NAMES`)."""
    if name in DOT_NAMES:
        return "/job?" + urlencode({"name": name, **query})
    return "/jobs/" + quote(name, safe="") + ("?" + urlencode(query) if query else "")


def job_api(name: str, action: str) -> str:
    """The POST URL of ``action`` on job ``name`` (see :func:`job_url`)."""
    if name in DOT_NAMES:
        return f"/api/job/{action}?" + urlencode({"name": name})
    return f"/api/jobs/{quote(name, safe='')}/{action}"


def utcnow() -> dt.datetime:
    """The wall clock (aware UTC): requests are outer loops; the page functions take ``now``."""
    return dt.datetime.now(dt.UTC)


class Who:
    """The requester: ``role`` (None: must log in), ``actor`` (for the audit log), ``session`` (the
    cookie's, possibly new: ``set_cookie``) and ``bearer`` (authenticated by token)."""

    def __init__(self, session: Session, role: Role | None, actor: str, *, bearer: bool, set_cookie: bool) -> None:
        self.session, self.role, self.actor, self.bearer, self.set_cookie = session, role, actor, bearer, set_cookie


class Dashboard:
    """The application's state: settings, store, auth, templates, manual runs in progress."""

    def __init__(self, settings: Settings, store: Store, *, poll_s: float = 1.0) -> None:
        self.settings, self.store, self.poll_s = settings, store, poll_s
        self.views = DashboardViews(store.engine)
        self.auth = Auth(settings.dashboard)
        self.env = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(default=True))
        self.env.filters["ts"] = _ts
        self.env.filters["ms"] = lambda v: "" if v is None else f"{v:,.0f} ms"
        self.env.filters["pretty"] = lambda v: json.dumps(v, indent=2, default=str, ensure_ascii=False)
        self.env.globals["chart"] = charts.svg
        self.env.globals["job_url"] = job_url
        self.env.globals["job_api"] = job_api
        self.manual: set[str] = set()
        self.manual_threads: list[threading.Thread] = []  # run-now threads (stop_manual_runs joins them)
        self.lock = threading.Lock()

    # -- who ------------------------------------------------------------------------------------------
    def identify(self, request: Request) -> Who:
        role = self.auth.bearer(request.headers.get("authorization"))
        session = self.auth.read_cookie(request.cookies.get(COOKIE))
        if role is not None:
            return Who(session or self.auth.new_session(), role, f"token:{role}", bearer=True, set_cookie=False)
        if session is None:
            session = self.auth.new_session()
            fresh = True
        else:
            fresh = False
        if not self.auth.enabled:
            return Who(session, "operator", "local", bearer=False, set_cookie=fresh)
        return Who(session, session.role, session.actor, bearer=False, set_cookie=fresh)

    def finish(self, response: Response, who: Who) -> Response:
        if who.set_cookie:
            response.set_cookie(COOKIE, self.auth.cookie_value(who.session), httponly=True, samesite="strict",
                                max_age=int(self.auth.max_age_s), path="/")
        response.headers["Content-Security-Policy"] = CSP
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "same-origin"
        response.headers.setdefault("Cache-Control", "no-store")
        return response

    # -- rendering ------------------------------------------------------------------------------------
    def page(self, request: Request, who: Who, template: str, context: dict[str, Any]) -> Response:
        html = self.env.get_template(template).render(
            **{"now": utcnow(), **context}, who=who, csrf=self.auth.csrf_token(who.session),
            auth_enabled=self.auth.enabled,
            flash=request.query_params.get("flash"), flash_error=request.query_params.get("error"),
            path=request.url.path, query=str(request.url.query), urlencode=urlencode)
        return self.finish(HTMLResponse(html), who)

    def json(self, who: Who, content: Any, status: int = 200) -> Response:
        body = json.dumps(content, default=_json_default, ensure_ascii=False).encode()
        return self.finish(Response(body, status, media_type="application/json"), who)

    def error(self, request: Request, who: Who, status: int, message: str) -> Response:
        if request.url.path.startswith("/api/"):
            return self.json(who, {"error": message}, status)
        html = self.env.get_template("error.html").render(status=status, message=message, who=who,
                                                          csrf=self.auth.csrf_token(who.session),
                                                          auth_enabled=self.auth.enabled, path=request.url.path,
                                                          flash=None, flash_error=None)
        return self.finish(HTMLResponse(html, status), who)

    def audit(self, who: Who, request: Request, action: str, target: str | None, outcome: str,
              details: dict[str, Any] | None = None) -> None:
        remote = request.client.host if request.client else None
        log.info("dashboard action %s %s by %s (%s) from %s: %s%s", action, target or "-", who.actor,
                 who.role or "none", remote or "?", outcome, f" {details}" if details else "")
        self.views.record_action(actor=who.actor, role=who.role or "none", action=action, target=target,
                                 outcome=outcome, details=details, remote_addr=remote)


def _ts(value: Any) -> str:
    if isinstance(value, dt.datetime):
        return value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ")
    return "" if value is None else str(value)


def _json_default(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return value.isoformat().replace("+00:00", "Z")
    return str(value)


Handler = Callable[[Request, Who], Awaitable[Response]]


def create_app(settings: Settings, store: Store, *, poll_s: float = 1.0) -> Starlette:
    """The dashboard on ``store`` (already open, at this code's schema)."""
    dash = Dashboard(settings, store, poll_s=poll_s)

    def guarded(handler: Handler, *, page: bool) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            who = dash.identify(request)
            if who.role is None:
                if page:
                    return dash.finish(RedirectResponse("/login?" + urlencode({"next": _next_of(request)}), 303), who)
                return dash.error(request, who, 401, "authentication required: log in, or send "
                                                     "'Authorization: Bearer <token>'")
            try:
                return await handler(request, who)
            except NotFoundError as exc:
                return dash.error(request, who, 404, str(exc))
            except InputError as exc:
                return dash.error(request, who, 400, str(exc))
        return endpoint

    def reader(fn: Callable[[Request], dict[str, Any]], template: str | None
               ) -> Callable[[Request], Awaitable[Response]]:
        async def handler(request: Request, who: Who) -> Response:
            context = await run_in_threadpool(fn, request)
            if template is None:
                return dash.json(who, context)
            return dash.page(request, who, template, context)
        return guarded(handler, page=template is not None)

    def q(request: Request) -> dict[str, str]:
        return dict(request.query_params)

    pages = {
        "overview": lambda r: data.overview(store, dash.views, utcnow(), settings.database_url),
        "jobs": lambda r: data.jobs_page(dash.views, q(r)),
        "job": lambda r: data.job_page(store, dash.views, _job_name(r), {k: v for k, v in q(r).items() if k != "name"},
                                       utcnow()),
        "runs": lambda r: data.runs_page(dash.views, q(r)),
        "run": lambda r: data.run_page(dash.views, r.path_params["run_id"]),
        "audit": lambda r: data.audit_page(dash.views, q(r)),
    }

    # -- actions ------------------------------------------------------------------------------------
    def action(name: str, perform: Callable[[Request, Who, str, dict[str, Any]], Awaitable[tuple[int, dict[str, Any]]]]
               ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            who = dash.identify(request)
            form: dict[str, Any] = {}
            is_form = request.headers.get("content-type", "").startswith(
                ("application/x-www-form-urlencoded", "multipart/form-data"))
            if is_form:
                form = dict(await request.form())
            elif request.headers.get("content-type", "").startswith("application/json"):
                try:
                    body = json.loads(await request.body() or b"{}")
                except (ValueError, RecursionError):  # RecursionError: nested ~1000 levels deep
                    body = None
                if not isinstance(body, dict):
                    return dash.error(request, who, 400, "body: must be a JSON object")
                form = body
            target = _job_name(request) or request.path_params.get("run_id")
            token = request.headers.get("x-csrf-token") or (form.pop("csrf_token", None) if is_form else None)
            if not who.bearer and not dash.auth.csrf_ok(who.session, token if isinstance(token, str) else None):
                await run_in_threadpool(dash.audit, who, request, name, target, "refused", {"reason": "no CSRF token"})
                return dash.error(request, who, 403, "forbidden: a POST needs the page's CSRF token or a bearer token")
            if who.role is None:
                return dash.error(request, who, 401, "authentication required")
            if who.role != "operator":
                await run_in_threadpool(dash.audit, who, request, name, target, "refused", {"reason": "read-only role"})
                return _back(request, who, 403, f"forbidden: the {who.role} role is read-only", is_form)
            try:
                status, result = await perform(request, who, target or "", form)
            except (InputError, MjschedError) as exc:
                code = (404 if isinstance(exc, NotFoundError) else
                        409 if isinstance(exc, ops.AlreadyRunningError) else 400)
                await run_in_threadpool(dash.audit, who, request, name, target, "error", {"error": str(exc)})
                return _back(request, who, code, str(exc), is_form)
            await run_in_threadpool(dash.audit, who, request, name, target, "ok",
                                    {k: v for k, v in form.items() if k != "next"} or None)
            if is_form:
                return _redirect(request, who, form.get("next"), flash=result.get("message", "done"))
            return dash.json(who, result, status)
        return endpoint

    def _back(request: Request, who: Who, status: int, message: str, is_form: bool) -> Response:
        if is_form and status != 403:
            return _redirect(request, who, None, error=message)
        return dash.error(request, who, status, message)

    def _redirect(request: Request, who: Who, target: Any, **message: str) -> Response:
        name = _job_name(request)
        fallback = (job_url(name) if name else
                    "/runs/" + request.path_params["run_id"] if "run_id" in request.path_params else "/")
        back = target if _safe_next(target) == target else fallback
        path, _, query = back.partition("?")  # keep the name of a /job?name= page, drop an older message
        kept = {k: v for k, v in parse_qsl(query) if k == "name"}
        back = path + "?" + urlencode({**kept, **message})
        return dash.finish(RedirectResponse(back, 303), who)

    async def do_pause(request: Request, who: Who, name: str, form: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        job = await run_in_threadpool(ops.pause_job, store, name, utcnow())
        return 200, {"job": data._job_summary(job), "message": f"job {name!r} paused"}

    async def do_resume(request: Request, who: Who, name: str, form: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        job = await run_in_threadpool(ops.resume_job, store, name, utcnow())
        return 200, {"job": data._job_summary(job), "message": f"job {name!r} {job['status'].lower()}"}

    async def do_update(request: Request, who: Who, name: str, form: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        changes = _changes(form)
        job = await run_in_threadpool(ops.update_job, store, settings, name, changes, utcnow())
        return 200, {"job": data._job_summary(job), "message": f"job {name!r} updated"}

    async def do_run(request: Request, who: Who, name: str, form: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        job = await run_in_threadpool(store.get_job, name)
        if job["concurrency_mode"] != ConcurrencyMode.CONCURRENT and job["locked_by_instance"]:
            raise ops.AlreadyRunningError(name, job["concurrency_mode"], job["locked_by_instance"], job["locked_at"])
        with dash.lock:
            if name in dash.manual:  # its Run now from this dashboard is starting or running
                raise ops.AlreadyRunningError(name, job["concurrency_mode"], "this dashboard's Run now", None)
            dash.manual.add(name)
        thread = threading.Thread(target=_run_in_background, args=(
            dash, who, request.client.host if request.client else None, name), name=f"run-now-{name}", daemon=True)
        with dash.lock:  # the finished ones dropped: a long-lived dashboard does not keep them all
            dash.manual_threads = [*(t for t in dash.manual_threads if t.is_alive()), thread]
        thread.start()
        return 202, {"job_name": name, "accepted": True,
                     "message": f"job {name!r} started: its run appears in the list as soon as a worker takes it"}

    async def do_cancel(request: Request, who: Who, run_id: str, form: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        try:
            number = int(run_id)
        except ValueError:
            raise InputError("id", f"must be an integer, got {run_id!r}") from None
        run = await run_in_threadpool(ops.cancel_run, store, number, who.actor)
        return 202, {"run": data._run_summary(run),
                     "message": f"run {number}: cancel requested; its supervisor stops it at its next lease renewal"}

    async def do_backfill(request: Request, who: Who, name: str, form: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        start, end = _when(form, "from"), _when(form, "to")
        bound = _positive_int("max", form.get("max"), ops.DEFAULT_BACKFILL_MAX, from_form=request.headers.get(
            "content-type", "").startswith(("application/x-www-form-urlencoded", "multipart/form-data")))
        result = await run_in_threadpool(lambda: ops.backfill_job(store, name, start, end, utcnow(),
                                                                  max_occurrences=bound, requested_by=who.actor,
                                                                  audit_role=None))
        return 202, {"backfill": msgspec.structs.asdict(result), "message": (
            f"job {name!r}: {len(result.added)} occurrence(s) added for backfill ({len(result.already_run)} already "
            f"run, {len(result.already_pending)} already pending, {len(result.left_to_schedule)} left to the "
            "regular schedule)")}

    async def do_retry(request: Request, who: Who, run_id: str, form: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        try:
            number = int(run_id)
        except ValueError:
            raise InputError("id", f"must be an integer, got {run_id!r}") from None
        entry = await run_in_threadpool(lambda: ops.retry_run(store, number, utcnow(), requested_by=who.actor))
        return 202, {"retry": entry, "message": f"run {number}: retry pending as attempt {entry['attempt']}; a "
                                                "supervisor starts it at its next poll"}

    # -- login ---------------------------------------------------------------------------------------
    async def login_page(request: Request) -> Response:
        who = dash.identify(request)
        return dash.page(request, who, "login.html", {"next": _safe_next(request.query_params.get("next"))})

    async def login(request: Request) -> Response:
        who = dash.identify(request)
        form = dict(await request.form())
        if not dash.auth.csrf_ok(who.session, str(form.get("csrf_token") or "")):
            return dash.error(request, who, 403, "forbidden: a POST needs the page's CSRF token")
        remote = request.client.host if request.client else "?"
        if dash.auth.throttle.locked(remote, time.monotonic()):
            await run_in_threadpool(dash.audit, who, request, "login", None, "refused", {"reason": "throttled"})
            return dash.error(request, who, 429, "too many failed logins from this address: try again in a few "
                                                 "minutes")
        role = await run_in_threadpool(dash.auth.login, str(form.get("password") or ""))
        if role is None:
            dash.auth.throttle.failed(remote, time.monotonic())
            await run_in_threadpool(dash.audit, who, request, "login", None, "refused", None)
            return dash.page(request, who, "login.html", {"next": _safe_next(form.get("next")),
                                                          "login_error": "wrong password"})
        session = dash.auth.new_session(role, f"{role}@{remote}")
        new = Who(session, role, session.actor, bearer=False, set_cookie=True)
        await run_in_threadpool(dash.audit, new, request, "login", None, "ok", None)
        return dash.finish(RedirectResponse(_safe_next(form.get("next")), 303), new)

    async def logout(request: Request) -> Response:
        who = dash.identify(request)
        form = dict(await request.form())
        if not dash.auth.csrf_ok(who.session, str(form.get("csrf_token") or "")):
            return dash.error(request, who, 403, "forbidden: a POST needs the page's CSRF token")
        new = Who(dash.auth.new_session(), None, "anonymous", bearer=False, set_cookie=True)
        return dash.finish(RedirectResponse("/login" if dash.auth.enabled else "/", 303), new)

    # -- live updates --------------------------------------------------------------------------------
    async def events(request: Request, who: Who) -> Response:
        async def stream() -> AsyncIterator[str]:
            last = None
            yield "retry: 2000\n\n"
            while not await request.is_disconnected():
                mark = await run_in_threadpool(dash.views.fingerprint)
                if mark != last:
                    if last is not None:
                        yield "event: change\ndata: {}\n\n"
                    last = mark
                else:
                    yield ": keep-alive\n\n"
                await asyncio.sleep(dash.poll_s)
        response = StreamingResponse(stream(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})
        return dash.finish(response, who)

    async def schema(request: Request, who: Who) -> Response:
        return dash.json(who, openapi_schema())

    async def health(request: Request) -> Response:
        return JSONResponse({"ok": True})

    routes = [
        Route("/", reader(pages["overview"], "overview.html")),
        Route("/jobs", reader(pages["jobs"], "jobs.html")),
        Route("/jobs/{name:path}", reader(pages["job"], "job.html")),
        Route("/job", reader(pages["job"], "job.html")),  # ?name=: the names . and .. (see job_url)
        Route("/runs", reader(pages["runs"], "runs.html")),
        Route("/runs/{run_id}", reader(pages["run"], "run.html")),
        Route("/audit", reader(pages["audit"], "audit.html")),
        Route("/login", login_page, methods=["GET"]),
        Route("/login", login, methods=["POST"]),
        Route("/logout", logout, methods=["POST"]),
        Route("/healthz", health),
        Route("/api/openapi.json", guarded(schema, page=False)),
        Route("/api/events", guarded(events, page=False)),
        Route("/api/overview", reader(pages["overview"], None)),
        Route("/api/jobs", reader(pages["jobs"], None)),
        Route("/api/runs", reader(pages["runs"], None)),
        Route("/api/runs/{run_id}", reader(pages["run"], None)),
        Route("/api/audit", reader(pages["audit"], None)),
        Route("/api/jobs/{name:path}/run", action("run", do_run), methods=["POST"]),
        Route("/api/jobs/{name:path}/pause", action("pause", do_pause), methods=["POST"]),
        Route("/api/jobs/{name:path}/resume", action("resume", do_resume), methods=["POST"]),
        Route("/api/jobs/{name:path}/update", action("update", do_update), methods=["POST"]),
        Route("/api/jobs/{name:path}/backfill", action("backfill", do_backfill), methods=["POST"]),
        Route("/api/runs/{run_id}/cancel", action("cancel", do_cancel), methods=["POST"]),
        Route("/api/runs/{run_id}/retry", action("retry", do_retry), methods=["POST"]),
        Route("/api/jobs/{name:path}", reader(pages["job"], None)),
        Route("/api/job", reader(pages["job"], None)),
        *[Route(f"/api/job/{verb}", action(verb, handler), methods=["POST"]) for verb, handler in (
            ("run", do_run), ("pause", do_pause), ("resume", do_resume), ("update", do_update),
            ("backfill", do_backfill))],
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    app = Starlette(routes=routes)
    app.state.dashboard = dash
    return app


def stop_manual_runs(dash: Dashboard, wait_s: float) -> list[int]:
    """At the dashboard's stop: ask for every run its "Run now" buttons started and that is still live
    to be cancelled (``ops.cancel_run``, by "dashboard stopped"), then wait up to ``wait_s`` seconds for
    their threads, whose supervisors kill each run's tree at their next lease renewal and record it
    Cancelled, releasing the job's lease (before, a SIGTERM left the run Running until another supervisor
    abandoned it, and Run now of that job was refused until then). Returns the run ids asked to cancel."""
    mine = MANUAL_INSTANCE_PREFIX + dash.settings.instance
    asked = []
    for run in dash.store.inflight_runs():
        if run["executed_by_instance"] == mine:
            try:
                ops.cancel_run(dash.store, run["id"], "dashboard stopped")
                asked.append(run["id"])
            except MjschedError as exc:  # it ended meanwhile
                log.info("run %d not cancelled at the dashboard's stop: %s", run["id"], exc)
    give_up = time.monotonic() + wait_s
    for thread in dash.manual_threads:
        thread.join(max(0.0, give_up - time.monotonic()))
    return asked


def _run_in_background(dash: Dashboard, who: Who, remote: str | None, name: str) -> None:
    try:
        outcome = ops.run_job(dash.store, dash.settings, name)
        details: dict[str, Any] = {"run_id": outcome.run_id, "queued": outcome.queued}
        result = "ok"
    except Exception as exc:  # noqa: BLE001 - reported in the log and the audit log, never lost in a thread
        details, result = {"error": str(exc)}, "error"
        log.warning("run now of job %s failed: %s", name, exc)
    finally:
        with dash.lock:
            dash.manual.discard(name)
    try:
        dash.views.record_action(actor=who.actor, role=who.role or "none", action="run finished", target=name,
                                 outcome=result, details=details, remote_addr=remote)
    except Exception as exc:  # noqa: BLE001 - the database went away: the log keeps it
        log.warning("audit of run now of job %s not stored: %s", name, exc)


def _job_name(request: Request) -> str:
    """The job a request is about: its ``{name}`` path segment, else its ``name`` query parameter."""
    return request.path_params.get("name") or request.query_params.get("name") or ""


def _when(form: dict[str, Any], key: str) -> dt.datetime:
    """Form or JSON field ``key`` as a date-time (ISO-8601; naive: in the job's timezone). Raises
    :class:`InputError` naming ``key``."""
    value = form.get(key)
    if not isinstance(value, str) or not value.strip():
        raise InputError(key, f"required: an ISO-8601 date-time, got {value!r}")
    try:
        return dt.datetime.fromisoformat(value.strip())
    except ValueError:
        raise InputError(key, f"not an ISO-8601 date-time: {value!r}") from None


def _changes(form: dict[str, Any]) -> dict[str, Any]:
    """The edit form's (or JSON body's) fields as store values, like ``jobs update``'s options: empty
    form fields are left unchanged; ``configuration`` is a JSON object (text in a form)."""
    unknown = sorted(set(form) - set(EDITABLE) - {"next"})
    if unknown:
        raise InputError(unknown[0], f"cannot be changed here; editable: {', '.join(EDITABLE)}")
    changes: dict[str, Any] = {}
    for key in EDITABLE:
        if key not in form:
            continue
        value = form[key]
        if key == "configuration" and isinstance(value, str):
            if not value.strip():
                continue
            value = jobspec.parse_configuration(value)
        elif key in ("max_runtime_minutes", "max_queued") and isinstance(value, str):
            if not value.strip():
                continue
            try:
                value = int(value)
            except ValueError:
                raise InputError(key, f"must be an integer, got {value!r}") from None
        elif isinstance(value, str) and not value.strip() and key != "description":
            continue
        changes[key] = value
    if not changes:
        raise InputError("update", "nothing to change: give at least one field")
    return changes


def _safe_next(value: Any) -> str:
    """``value`` if it is a path on this site, else ``/`` (no open redirect: ``//host``, ``/\\host``)."""
    if isinstance(value, str) and value.startswith("/") and value[1:2] not in ("/", "\\") and "\n" not in value:
        return value
    return "/"


def _next_of(request: Request) -> str:
    return request.url.path + (f"?{request.url.query}" if request.url.query else "")


def _positive_int(field: str, raw: Any, default: int, *, from_form: bool) -> int:
    """A positive integer from a form post (``from_form``: digits) or a JSON body (an integer number, not a
    bool, a float or a string); absent (or an empty form field): ``default``. Raises :class:`InputError`
    naming ``field``."""
    if raw is None or (from_form and raw == ""):
        return default
    value = int(raw) if from_form and isinstance(raw, str) and raw.isascii() and raw.isdigit() else raw
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(field, f"must be a positive integer, got {str(raw)[:40]!r}")
    return value
