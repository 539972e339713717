"""The dashboard's guards: who may look (password or token), that a state change came from
our own page (CSRF), which addresses may be bound without a credential, and the headers
that keep a browser from running or framing anything we did not mean it to."""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import os
import secrets
from http.cookies import SimpleCookie
from typing import Any

CSRF_COOKIE = "forkq_csrf"
SESSION_COOKIE = "forkq_session"

# No inline script or style anywhere: an injected <script> cannot run even if escaping
# were ever missed somewhere.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")

BASE_HEADERS = [("Content-Security-Policy", CSP), ("X-Frame-Options", "DENY"),
                ("X-Content-Type-Options", "nosniff"), ("Referrer-Policy", "same-origin")]


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach. A hostname other than localhost
    counts as not loopback: it may resolve anywhere."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def same(a: str, b: str) -> bool:
    """Constant-time string comparison, so response time does not leak a prefix."""
    return hmac.compare_digest(a.encode(), b.encode())


def derive_secret(password: str | None, token: str | None, secret: str | None) -> bytes:
    """The key that signs cookies. Derived from the credential when there is one, so every
    process of a multi-worker deployment signs alike; random otherwise (cookies then last
    as long as this process, which is fine for a dashboard on localhost)."""
    if secret:
        return hashlib.sha256(b"forkq-web-secret:" + secret.encode()).digest()
    if password or token:
        material = f"{password or ''}\0{token or ''}".encode()
        return hashlib.sha256(b"forkq-web-cred:" + material).digest()
    return os.urandom(32)


def sign(key: bytes, value: str) -> str:
    mac = hmac.new(key, value.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).decode().rstrip("=")


def new_csrf(key: bytes) -> str:
    nonce = secrets.token_urlsafe(18)
    return f"{nonce}.{sign(key, 'csrf:' + nonce)}"


def valid_csrf(key: bytes, value: str | None) -> bool:
    if not value or value.count(".") != 1:
        return False
    nonce, mac = value.split(".")
    return same(mac, sign(key, "csrf:" + nonce))


def session_value(key: bytes) -> str:
    """The login cookie for token auth: a MAC only the holder of the key can make, so it
    stops working when the token (and with it the key) changes."""
    return sign(key, "session")


def cookies(environ: dict[str, Any]) -> dict[str, str]:
    jar = SimpleCookie()
    try:
        jar.load(environ.get("HTTP_COOKIE", ""))
    except Exception:  # a malformed Cookie header from someone else's site: ignore it
        return {}
    return {k: m.value for k, m in jar.items()}


def cookie_header(name: str, value: str, path: str, max_age: int | None = None,
                  secure: bool = False) -> tuple[str, str]:
    parts = [f"{name}={value}", f"Path={path or '/'}", "HttpOnly", "SameSite=Strict"]
    if secure:  # served over HTTPS: never send it back over plain HTTP
        parts.append("Secure")
    if max_age is not None:
        parts.append(f"Max-Age={max_age}")
    return ("Set-Cookie", "; ".join(parts))


class Throttle:
    """Refuses an address that sent `limit` wrong passwords or tokens within `window`
    seconds, until that window ends: guessing is slowed to `limit` a window. Counted in
    Redis, so every process of a multi-process server shares the count. Behind a reverse
    proxy the address is the proxy's, and one guesser locks out everyone for a window."""

    PREFIX = "forkq:web:auth-failures:"

    def __init__(self, limit: int = 10, window: int = 60) -> None:
        if limit < 0 or window < 1:
            raise ValueError(f"login limit must be >= 0 and its window >= 1 s, not {limit}, {window}")
        self.limit = limit
        self.window = window

    def wait(self, conn: Any, address: str) -> int:
        """Seconds until `address` may try again; 0 if it may now."""
        if not self.limit:
            return 0
        pipe = conn.pipeline(transaction=False)
        pipe.get(self.PREFIX + address)
        pipe.ttl(self.PREFIX + address)
        count, ttl = pipe.execute()
        return max(ttl, 1) if count is not None and int(count) >= self.limit else 0

    def failed(self, conn: Any, address: str) -> None:
        if not self.limit:
            return
        key = self.PREFIX + address
        pipe = conn.pipeline(transaction=False)
        pipe.set(key, 0, ex=self.window, nx=True)  # the window starts at the first failure
        pipe.incr(key)
        pipe.execute()


class Guard:
    """Authentication and CSRF checks for one app."""

    def __init__(self, password: str | None, token: str | None, secret: str | None) -> None:
        self.password = password or None
        self.token = token or None
        self.key = derive_secret(self.password, self.token, secret)

    @property
    def open(self) -> bool:
        return self.password is None and self.token is None

    def authenticated(self, environ: dict[str, Any]) -> bool:
        if self.open:
            return True
        header = environ.get("HTTP_AUTHORIZATION", "")
        scheme, _, value = header.partition(" ")
        scheme = scheme.lower()
        if self.password and scheme == "basic":
            try:
                user_pass = base64.b64decode(value.strip(), validate=True).decode("utf-8")
            except (ValueError, UnicodeDecodeError):
                return False
            # any user name: the password alone is the credential
            return same(user_pass.partition(":")[2], self.password)
        if self.token and scheme == "bearer":
            return same(value.strip(), self.token)
        if self.token:
            return same(cookies(environ).get(SESSION_COOKIE, ""), session_value(self.key))
        return False

    @staticmethod
    def offered(environ: dict[str, Any]) -> bool:
        """Whether the request carries a password or token to check. A first visit carries
        none, and a stale login cookie (a signed value nobody guesses) is no guess either:
        counted, a dashboard page left open would lock its user out with its refreshes."""
        return bool(environ.get("HTTP_AUTHORIZATION", "").strip())

    def challenge(self) -> list[tuple[str, str]]:
        """What to answer an unauthenticated request with (beside the status)."""
        if self.password:
            return [("WWW-Authenticate", 'Basic realm="forkq", charset="UTF-8"')]
        return []

    def csrf_ok(self, environ: dict[str, Any], submitted: str | None) -> bool:
        """A POST is ours when the hidden field equals the signed cookie (a page on another
        site can send our cookie but cannot read it to copy it into the form), and the
        browser does not say it came from another origin."""
        if not self.same_origin(environ):
            return False
        cookie = cookies(environ).get(CSRF_COOKIE)
        return bool(submitted) and valid_csrf(self.key, cookie) and same(submitted or "", cookie or "")

    @staticmethod
    def same_origin(environ: dict[str, Any]) -> bool:
        if environ.get("HTTP_SEC_FETCH_SITE", "same-origin") not in ("same-origin", "none"):
            return False
        origin = environ.get("HTTP_ORIGIN")
        if not origin:
            return True  # older browsers and non-browser clients; the token still holds
        host = environ.get("HTTP_HOST") or environ.get("SERVER_NAME", "")
        # compare host:port only: behind a TLS-terminating proxy our own scheme is http
        # while the browser's Origin says https. "null" (sandboxed frames) never matches.
        return origin.partition("://")[2] == host
