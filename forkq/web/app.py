"""The dashboard as a WSGI application: routing, the auth and CSRF gates every request
passes, templates (Jinja2, autoescaping everything: job args and error messages in Redis
are hostile input), static files, and the headers on every answer."""

from __future__ import annotations

import base64
import math
import mimetypes
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import jinja2
import redis

from .. import api, client, payload
from . import security, views
from .wsgi import BadRequest, Request, Response

HERE = Path(__file__).resolve().parent
STATIC = HERE / "static"
FLASH_COOKIE = "forkq_flash"

StartResponse = Callable[..., Any]


def _address(req: Request) -> str:
    return req.environ.get("REMOTE_ADDR") or "unknown"


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = abs(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.1f}s"


def _when(stamp: Any, now: float) -> str:
    """A Sidekiq stamp (float seconds, or Sidekiq 8 integer milliseconds) as "3.0m ago" or
    "in 2.0h"."""
    value = _finite(stamp)
    if value is None:
        return "-"
    return f"in {_age(value - now)}" if value > now else f"{_age(now - value)} ago"


def _finite(stamp: Any) -> float | None:
    """payload.seconds, or None for NaN and infinities: a payload's JSON may hold NaN, and a
    sorted set's score may be inf, neither of which is a time."""
    value = payload.seconds(stamp)
    return value if value is not None and math.isfinite(value) else None


def _utc(stamp: Any) -> str:
    value = _finite(stamp)
    if value is None:
        return ""
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(value))
    except (OverflowError, OSError, ValueError):  # a year the platform's time_t cannot hold
        return ""


def _short(value: Any, limit: int = 120) -> str:
    """One line of a job's args or error for a table cell; the whole payload is a click away."""
    text = views.visible(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


class Dashboard:
    """A WSGI callable. Thread-safe: one redis-py connection pool shared by the server's
    threads, made on first use in each process (never inherited across a fork)."""

    def __init__(self, redis_url: str | None = None, *, password: str | None = None,
                 token: str | None = None, secret: str | None = None, page_size: int = 25,
                 authorize: Callable[[dict[str, Any]], bool] | None = None,
                 login_limit: int = 10) -> None:
        self.redis_url = client.redis_url(redis_url)
        client.connect(self.redis_url)  # a bad URL fails here, at startup, not per request
        self.guard = security.Guard(password, token, secret)
        self.throttle = security.Throttle(login_limit)
        self.page_size = page_size
        self.authorize = authorize
        self._conn: tuple[int, redis.Redis] | None = None
        self._lock = threading.Lock()
        self._static = {p.name: p for p in STATIC.iterdir() if p.is_file()}
        self.env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"),
                                      autoescape=True, undefined=jinja2.StrictUndefined,
                                      trim_blocks=True, lstrip_blocks=True)
        self.env.filters.update(age=_age, short=_short, utc=_utc, visible=views.visible,
                                job_json=views.job_json, shown=views.shown, plain=views.plain)
        self.env.globals.update(when=_when, label=views.label)
        self.routes: dict[tuple[str, str], Callable[[Request], Response]] = {
            ("GET", "/"): lambda r: views.overview(self, r),
            ("GET", "/stats.json"): lambda r: views.stats_json(self, r),
            ("GET", "/processes"): lambda r: views.processes(self, r),
            ("POST", "/processes/signal"): lambda r: views.signal(self, r),
            ("GET", "/busy"): lambda r: views.busy(self, r),
            ("GET", "/search"): lambda r: views.search(self, r),
            ("GET", "/queues"): lambda r: views.queues_page(self, r),
            ("GET", "/batches"): lambda r: views.batches_page(self, r),
            ("GET", "/metrics-by-class"): lambda r: views.metrics_page(self, r),
            ("POST", "/cancel"): lambda r: views.cancel_action(self, r),
            ("GET", "/login"): self.login_page,
            ("POST", "/login"): self.login,
            ("POST", "/logout"): self.logout,
        }
        # paths that end in a parameter (a job's key, a queue's name):
        # (method, prefix) -> view(request, rest of the path)
        self.param_routes: dict[tuple[str, str], Callable[[Request, str], Response]] = {
            ("GET", "/queues/"): lambda r, name: views.queue_page(self, r, name),
            ("POST", "/queues/"): lambda r, name: views.queue_action(self, r, name),
            ("GET", "/batches/"): lambda r, bid: views.batch_page(self, r, bid),
            ("GET", "/jobs/"): lambda r, jid: views.job_by_jid(self, r, jid),
        }
        for slug in views.SETS:
            # (mypy cannot infer a lambda with a default: the dicts' annotations say it all)
            self.routes[("GET", f"/{slug}")] = lambda r, s=slug: views.set_page(self, r, s)  # type: ignore[misc]
            self.routes[("POST", f"/{slug}/action")] = lambda r, s=slug: views.set_action(self, r, s)  # type: ignore[misc]
            self.param_routes[("GET", f"/{slug}/")] = \
                lambda r, k, s=slug: views.job_page(self, r, s, k)  # type: ignore[misc]

    # -- plumbing -------------------------------------------------------------------

    def redis(self) -> redis.Redis:
        with self._lock:
            if self._conn is None or self._conn[0] != os.getpid():
                self._conn = (os.getpid(), api.connect(self.redis_url))
            return self._conn[1]

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        req = Request(environ)
        try:
            resp = self.handle(req)
        except BadRequest as exc:
            resp = Response.text(f"bad request: {exc}\n", "400 Bad Request")
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            resp = self.render(req, "error.html", status="503 Service Unavailable",
                               message=client.unreachable(client.mask_url(self.redis_url), exc))
        except redis.RedisError as exc:  # e.g. WRONGTYPE: a key that is not what Sidekiq writes
            resp = self.render(req, "error.html", status="500 Internal Server Error",
                               message=f"Redis answered: {exc}")
        headers = list(security.BASE_HEADERS) + [("Content-Type", resp.content_type),
                                                  ("Cache-Control", resp.cache)]
        headers += resp.headers + req.set_cookies
        headers.append(("Content-Length", str(len(resp.body))))
        start_response(resp.status, headers)
        return [resp.body if req.method != "HEAD" else b""]

    def handle(self, req: Request) -> Response:
        if req.path.startswith("/static/") and req.method in ("GET", "HEAD"):
            return self.static(req.path[len("/static/"):])
        method = "GET" if req.method == "HEAD" else req.method
        path = req.path.rstrip("/") or "/"
        if self.authorize is not None and not self.authorize(req.environ):
            return Response.text("forbidden\n", "403 Forbidden")
        # before anything else, even a 404: an outsider learns nothing, not even the Redis host
        offered = self.guard.offered(req.environ)
        if not self.guard.open and (offered or (method == "POST" and path == "/login")):
            wait = self.throttle.wait(self.redis(), _address(req))
            if wait:
                resp = Response.text(f"too many failed logins from this address: try again in "
                                     f"{wait} s\n", "429 Too Many Requests")
                resp.headers.append(("Retry-After", str(wait)))
                return resp
        if path != "/login" and not self.guard.authenticated(req.environ):
            if offered:
                self.throttle.failed(self.redis(), _address(req))
            return self.unauthorized(req)
        route = self.routes.get((method, path))
        if route is None:
            if any(p == path for _, p in self.routes):
                return Response.text("method not allowed\n", "405 Method Not Allowed")
            route = self.param_route(method, req.path)
        if route is None:
            return self.render(req, "error.html", status="404 Not Found", message="no such page")
        if method == "POST" and not self.guard.csrf_ok(req.environ, req.field("csrf")):
            # nothing has been read from Redis or changed yet
            return self.render(req, "error.html", status="403 Forbidden",
                               message="this form is stale or came from another site: "
                                       "reload the page and try again")
        return route(req)

    def param_route(self, method: str, path: str) -> Callable[[Request], Response] | None:
        """The view for a path that ends in a parameter. The parameter is the rest of the
        unstripped path: a queue name may hold a slash, or end in one."""
        for (m, prefix), view in self.param_routes.items():
            if path.startswith(prefix) and len(path) > len(prefix):
                if m == method:
                    return lambda r, rest=path[len(prefix):], view=view: view(r, rest)  # type: ignore[misc]
        if any(path.startswith(p) and len(path) > len(p) for _, p in self.param_routes):
            return lambda r: Response.text("method not allowed\n", "405 Method Not Allowed")
        return None

    def unauthorized(self, req: Request) -> Response:
        if self.guard.token and req.method == "GET" and not req.path.endswith(".json"):
            return Response.redirect(req.url("/login"))
        resp = Response.text("authentication required\n", "401 Unauthorized")
        resp.headers += self.guard.challenge()
        return resp

    def static(self, name: str) -> Response:
        path = self._static.get(name)  # only files that were there at startup: no traversal
        if path is None:
            return Response.text("not found\n", "404 Not Found")
        kind = mimetypes.guess_type(name)[0] or "application/octet-stream"
        if kind.startswith("text/") or kind.endswith("javascript"):
            kind += "; charset=utf-8"
        return Response(path.read_bytes(), content_type=kind, cache="public, max-age=300")

    def csrf_token(self, req: Request) -> str:
        """The request's CSRF cookie if it is one of ours, else a new one (set on the way out)."""
        if req.csrf is None:
            current = security.cookies(req.environ).get(security.CSRF_COOKIE)
            if not current or not security.valid_csrf(self.guard.key, current):
                current = security.new_csrf(self.guard.key)
                self._set_cookie(req, security.CSRF_COOKIE, current)
            req.csrf = current
        return req.csrf

    def _set_cookie(self, req: Request, name: str, value: str, max_age: int | None = None) -> None:
        secure = req.environ.get("wsgi.url_scheme") == "https"
        req.set_cookies.append(security.cookie_header(name, value, req.root + "/", max_age, secure))

    def flash(self, req: Request, message: str) -> None:
        """A one-line result shown on the next page (carried in a cookie, so a crafted URL
        cannot put words on the page)."""
        value = base64.urlsafe_b64encode(message.encode()).decode()
        self._set_cookie(req, FLASH_COOKIE, value, max_age=60)

    def _take_flash(self, req: Request) -> str | None:
        value = security.cookies(req.environ).get(FLASH_COOKIE)
        if not value:
            return None
        self._set_cookie(req, FLASH_COOKIE, "", max_age=0)
        try:
            return base64.urlsafe_b64decode(value.encode()).decode("utf-8")[:200]
        except (ValueError, UnicodeDecodeError):
            return None

    def back(self, req: Request, default: str) -> str:
        """Where a form returns to: a path inside the app (never another site)."""
        target = req.field("back")
        if not target.startswith("/") or target.startswith("//") or "\\" in target:
            target = default
        return req.url(target)

    def render(self, req: Request, template: str, status: str = "200 OK", **context: Any) -> Response:
        context.update(status=status, root=req.root, csrf=self.csrf_token(req), path=req.path,
                       here=req.path + ("?" + req.environ["QUERY_STRING"]
                                        if req.environ.get("QUERY_STRING") else ""),
                       flash=self._take_flash(req), login=not self.guard.open and self.guard.token,
                       redis_url=client.mask_url(self.redis_url))
        return Response.html(self.env.get_template(template).render(**context), status)

    # -- login (token auth in a browser) -------------------------------------------------

    def login_page(self, req: Request) -> Response:
        return self.render(req, "login.html", failed=False)

    def login(self, req: Request) -> Response:
        if self.guard.token and security.same(req.field("token"), self.guard.token):
            self._set_cookie(req, security.SESSION_COOKIE, security.session_value(self.guard.key),
                             max_age=12 * 3600)
            return Response.redirect(req.url("/"))
        self.throttle.failed(self.redis(), _address(req))
        return self.render(req, "login.html", status="401 Unauthorized", failed=True)

    def logout(self, req: Request) -> Response:
        self._set_cookie(req, security.SESSION_COOKIE, "", max_age=0)
        return Response.redirect(req.url("/login" if self.guard.token else "/"))
