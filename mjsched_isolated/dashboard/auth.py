"""Who is asking, and may they: password hashes, signed session cookies, bearer tokens, CSRF tokens.

Standard library only (``hashlib.scrypt``, ``hmac``, ``secrets``). Two roles: ``viewer`` (read-only) and
``operator`` (may act). With no password and no token configured the dashboard is open to whoever can
reach it, as ``operator`` named ``local``: the CLI refuses that on any address but loopback.

CSRF (OWASP's "signed double-submit" pattern): every visitor gets a signed session cookie carrying a random
session id; the CSRF token is the HMAC of that id. A state-changing POST must carry the token (form field
``csrf_token`` or header ``X-CSRF-Token``) or a valid ``Authorization: Bearer`` token; a page on another
site can neither read the token nor send the cookie (``SameSite=Strict``), so it cannot make the dashboard
act, even on loopback with no password set.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from typing import Any, Literal

import msgspec

from mjsched_isolated.config import Dashboard
from mjsched_isolated.errors import InputError

Role = Literal["viewer", "operator"]
SCRYPT_N, SCRYPT_R, SCRYPT_P = 2**14, 8, 1  # OWASP's scrypt minimum (N=2^14... with r=8, p=1 is its floor)
COOKIE = "mjsched_session"


def hash_secret(secret: str, *, salt: bytes | None = None) -> str:
    """``scrypt$N$r$p$<salt>$<hash>`` (base64) of ``secret``: what the settings may hold instead of it."""
    salt = salt if salt is not None else secrets.token_bytes(16)
    digest = hashlib.scrypt(secret.encode(), salt=salt, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P, dklen=32)
    return "$".join(("scrypt", str(SCRYPT_N), str(SCRYPT_R), str(SCRYPT_P),
                     base64.b64encode(salt).decode(), base64.b64encode(digest).decode()))


def _as_hash(value: str, field: str) -> str:
    if not value.startswith("scrypt$"):
        return hash_secret(value)
    try:
        _, n, r, p, salt, digest = value.split("$")
        int(n), int(r), int(p), base64.b64decode(salt, validate=True), base64.b64decode(digest, validate=True)
    except ValueError:
        raise InputError(field, "looks like a scrypt hash but is not one printed by "
                                "`mjsched dashboard --hash-password`") from None
    return value


def verify_secret(secret: str, stored: str) -> bool:
    """Whether ``secret`` matches ``stored`` (a :func:`hash_secret` value), in constant time."""
    _, n, r, p, salt, digest = stored.split("$")
    expected = base64.b64decode(digest)
    try:
        got = hashlib.scrypt(secret.encode(), salt=base64.b64decode(salt), n=int(n), r=int(r), p=int(p),
                             dklen=len(expected))
    except ValueError:
        return False
    return hmac.compare_digest(got, expected)


class Session(msgspec.Struct, frozen=True):
    """A visitor: ``sid`` (random, names the CSRF token), ``role`` (None: not logged in), ``actor``
    (who, for the audit log) and ``expires`` (Unix seconds)."""

    sid: str
    role: Role | None
    actor: str
    expires: float


LOGIN_FAILURES = 5  # failed logins from one address ...
LOGIN_WINDOW_S = 300.0  # ... within this many seconds lock that address out for the rest of the window


class LoginThrottle:
    """Failed logins per remote address (in this process): after :data:`LOGIN_FAILURES` within
    :data:`LOGIN_WINDOW_S`, further attempts from it are refused until the oldest failure ages out
    (OWASP's login throttling). ``now`` is a monotonic time in seconds, passed in."""

    def __init__(self) -> None:
        self.failures: dict[str, list[float]] = {}

    def _recent(self, address: str, now: float) -> list[float]:
        recent = [t for t in self.failures.get(address, []) if now - t < LOGIN_WINDOW_S]
        if recent:
            self.failures[address] = recent
        else:
            self.failures.pop(address, None)
        return recent

    def locked(self, address: str, now: float) -> bool:
        """Whether ``address`` may not try now."""
        return len(self._recent(address, now)) >= LOGIN_FAILURES

    def failed(self, address: str, now: float) -> None:
        """Count a failed login from ``address``."""
        self.failures.setdefault(address, []).append(now)
        if len(self.failures) > 10_000:  # bounded memory: forget the quietest addresses
            for key in sorted(self.failures, key=lambda k: self.failures[k][-1])[:5_000]:
                del self.failures[key]


class Auth:
    """The dashboard's authentication, from its settings; keeps only hashes of passwords and tokens."""

    def __init__(self, settings: Dashboard) -> None:
        operator: Role = "operator"
        viewer: Role = "viewer"
        self.passwords: list[tuple[Role, str]] = [
            (role, _as_hash(value, f"dashboard.{role}_password"))
            for role, value in ((operator, settings.operator_password), (viewer, settings.viewer_password))
            if value]
        # tokens are long random strings: a SHA-256 is enough and keeps every API call fast
        self.tokens: list[tuple[Role, bytes]] = [
            (role, hashlib.sha256(value.encode()).digest())
            for role, value in ((operator, settings.operator_token), (viewer, settings.viewer_token))
            if value]
        self.key = (settings.session_secret or secrets.token_hex(32)).encode()
        self.throttle = LoginThrottle()
        self.max_age_s = settings.session_max_age_s

    @property
    def enabled(self) -> bool:
        """Whether any password or token is configured (else everyone is ``operator``)."""
        return bool(self.passwords or self.tokens)

    # -- passwords and tokens -------------------------------------------------------------------------
    def login(self, password: str) -> Role | None:
        """The role whose password this is, or None."""
        for role, stored in self.passwords:
            if verify_secret(password, stored):
                return role
        return None

    def bearer(self, header: str | None) -> Role | None:
        """The role of an ``Authorization: Bearer <token>`` header's token, or None."""
        if not header or not header.lower().startswith("bearer "):
            return None
        digest = hashlib.sha256(header[7:].strip().encode()).digest()
        for role, stored in self.tokens:
            if hmac.compare_digest(digest, stored):
                return role
        return None

    # -- sessions -------------------------------------------------------------------------------------
    def _sign(self, payload: bytes) -> str:
        return hmac.new(self.key, payload, hashlib.sha256).hexdigest()

    def new_session(self, role: Role | None = None, actor: str = "anonymous") -> Session:
        """A fresh session (new id, so a new CSRF token: a login never keeps the id it was given)."""
        return Session(secrets.token_urlsafe(18), role, actor, time.time() + self.max_age_s)

    def cookie_value(self, session: Session) -> str:
        """``session`` as a signed cookie value."""
        payload = base64.urlsafe_b64encode(msgspec.json.encode(session))
        return payload.decode() + "." + self._sign(payload)

    def read_cookie(self, value: str | None) -> Session | None:
        """The session a cookie value carries, or None when missing, forged or expired."""
        if not value or "." not in value:
            return None
        payload, _, signature = value.rpartition(".")
        if not hmac.compare_digest(self._sign(payload.encode()), signature):
            return None
        try:
            session = msgspec.json.decode(base64.urlsafe_b64decode(payload), type=Session)
        except (ValueError, msgspec.ValidationError):
            return None
        return session if session.expires > time.time() else None

    def csrf_token(self, session: Session) -> str:
        """The CSRF token of ``session``."""
        return self._sign(b"csrf:" + session.sid.encode())

    def csrf_ok(self, session: Session | None, token: str | None) -> bool:
        """Whether ``token`` is ``session``'s CSRF token."""
        if session is None or not token:
            return False
        return hmac.compare_digest(self.csrf_token(session), token)


def public_view(settings: Dashboard) -> dict[str, Any]:
    """What the dashboard may show about its own settings: never a secret, only whether one is set."""
    return {"host": settings.host, "port": settings.port,
            "passwords": sorted(r for r, v in (("operator", settings.operator_password),
                                               ("viewer", settings.viewer_password)) if v),
            "tokens": sorted(r for r, v in (("operator", settings.operator_token),
                                            ("viewer", settings.viewer_token)) if v)}


def dumps(value: Any) -> str:
    """JSON text for the API (datetimes as ISO-8601)."""
    return json.dumps(value, default=str)
