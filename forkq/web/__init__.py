"""forkq's web dashboard: a WSGI app (`make_app`) that `forkq web` serves, or that you
mount in your own site under any prefix.

    from forkq.web import make_app
    dashboard = make_app("redis://127.0.0.1:6379/0", password="s3cret")
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import Dashboard

from .command import add_web_command

__all__ = ["Dashboard", "add_web_command", "make_app", "mount"]


def __getattr__(name: str) -> Any:
    # the app (and Jinja2) load on first use: `forkq --help` and every other subcommand
    # import this package only for add_web_command
    if name == "Dashboard":
        from .app import Dashboard
        return Dashboard
    raise AttributeError(name)

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def make_app(redis_url: str | None = None, *, password: str | None = None,
             token: str | None = None, secret: str | None = None,
             page_size: int = 25,
             authorize: Callable[[dict[str, Any]], bool] | None = None,
             login_limit: int = 10) -> "Dashboard":
    """The dashboard as a WSGI callable.

    redis_url: FORKQ_REDIS_URL (then redis://127.0.0.1:6379/0) when not given.
    password: require HTTP Basic auth with this password (any user name).
    token: require `Authorization: Bearer TOKEN`, or a login with it in the browser.
    secret: signs the CSRF and login cookies; give the same one to every process of a
        multi-process server when there is no password or token (they derive it otherwise).
    authorize: a check of your own site's login, called with the WSGI environ of every
        request (static files aside); False answers 403. E.g. in Django, with the session
        middleware's user in the environ, or a signed cookie your site sets.
    login_limit: wrong passwords or tokens one address may send in a minute before it is
        refused (429) for the rest of that minute; 0 turns the limit off.
    Links and form actions start at the WSGI SCRIPT_NAME, so it works under any prefix.
    """
    from .app import Dashboard
    return Dashboard(redis_url, password=password, token=token, secret=secret,
                     page_size=page_size, authorize=authorize, login_limit=login_limit)


def mount(outer: WSGIApp, prefix: str, dashboard: WSGIApp) -> WSGIApp:
    """`outer`, except that requests under `prefix` go to `dashboard` with the prefix moved
    from PATH_INFO to SCRIPT_NAME (what Django's or any other WSGI app's wsgi.py needs;
    Flask users can equally use werkzeug's DispatcherMiddleware)."""
    prefix = "/" + prefix.strip("/")

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == prefix or path.startswith(prefix + "/"):
            environ = dict(environ, SCRIPT_NAME=environ.get("SCRIPT_NAME", "") + prefix,
                           PATH_INFO=path[len(prefix):] or "/")
            return dashboard(environ, start_response)
        return outer(environ, start_response)
    return app
