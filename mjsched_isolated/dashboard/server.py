"""``mjsched dashboard``: the dashboard's own process (uvicorn), any number per database.

Safe by default: it binds to 127.0.0.1 unless told; on any other address it refuses to start
(:class:`InputError`, exit 2) unless an operator password or token is configured. It opens the database
read-write (actions are writes) but never migrates it: an outdated schema is refused like ``serve``
without ``--auto-upgrade``.
"""

from __future__ import annotations

import ipaddress
import logging
import socket

from mjsched_isolated import ops
from mjsched_isolated.config import Settings, redact_url
from mjsched_isolated.errors import InputError

log = logging.getLogger("mjsched.dashboard")


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only this machine (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(settings: Settings) -> None:
    """Refuse (:class:`InputError` on ``--host``) to bind beyond loopback without authentication."""
    dash = settings.dashboard
    if not is_loopback(dash.host) and not (dash.operator_password or dash.operator_token or dash.viewer_password
                                           or dash.viewer_token):
        raise InputError("--host", f"{dash.host!r} is not a loopback address and no dashboard password or token "
                                   "is set: set dashboard.operator_password (MJSCHED_DASHBOARD_OPERATOR_PASSWORD) "
                                   "or bind to 127.0.0.1")


def serve(settings: Settings) -> int:
    """Run the dashboard until SIGINT/SIGTERM; returns the exit code."""
    import uvicorn  # noqa: PLC0415 - the dashboard extra's packages, loaded only for this command

    from mjsched_isolated.dashboard.app import create_app, stop_manual_runs  # noqa: PLC0415 - needs the dashboard extra

    check_exposure(settings)
    dash = settings.dashboard
    sock = bind(dash.host, dash.port)  # before the database: a port in use is bad input, nothing opened
    try:
        store = ops.open_store(settings.database_url, auto_upgrade=settings.auto_upgrade)
        try:
            app = create_app(settings, store)
            config = uvicorn.Config(app, log_config=None, access_log=False, timeout_graceful_shutdown=2,
                                    lifespan="off")
            server = uvicorn.Server(config)
            host, port = sock.getsockname()[:2]
            shown = f"[{host}]" if ":" in host else host
            log.info("dashboard on http://%s:%d/ (database %s)", shown, port, redact_url(settings.database_url))
            server.run(sockets=[sock])
            # its Run now runs end with it, as `jobs run` ends its run on Ctrl-C: cancelled, lease released
            wait_s = settings.lease_renew_interval_s + settings.kill_grace_s + 5.0
            if asked := stop_manual_runs(app.state.dashboard, wait_s):
                log.info("dashboard stopped: cancelled its run(s) %s", ", ".join(map(str, asked)))
            return 0
        finally:
            store.close()
    finally:
        sock.close()


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (0: a free port). Raises :class:`InputError` (``--port`` or
    ``--host``) when it cannot be had."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise InputError("--host", f"cannot resolve {host!r}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise InputError("--port", f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(False)
    return sock
