"""`forkq web`: serve the dashboard with waitress (a multi-threaded, production-grade pure
Python WSGI server), after refusing to expose an unauthenticated dashboard to a network."""

from __future__ import annotations

import argparse
import os
import sys

from .. import config
from ..cli import nonempty, whole_number
from ..errors import ConfigError
from .security import is_loopback

DEFAULT_PORT = 7433


def add_web_command(sub: argparse._SubParsersAction) -> None:
    """Register `forkq web`; it runs through the parser's `handler` default."""
    p = sub.add_parser("web", help="serve the web dashboard (127.0.0.1:7433 by default)")
    p.add_argument("--bind", default="127.0.0.1", metavar="HOST",
                   help="address to listen on (default 127.0.0.1); any non-loopback address "
                        "needs --password or --token")
    p.add_argument("--port", type=whole_number("--port", 1, 65535), default=DEFAULT_PORT,
                   help=f"default {DEFAULT_PORT}")
    p.add_argument("--password", default=None, type=nonempty,
                   help="require HTTP Basic auth with this password [env FORKQ_WEB_PASSWORD]")
    p.add_argument("--token", default=None, type=nonempty,
                   help="require this bearer token (or a login with it) [env FORKQ_WEB_TOKEN]")
    p.add_argument("--redis-url", default=None, type=nonempty, help="Redis URL [env FORKQ_REDIS_URL]")
    p.add_argument("--config", metavar="PATH", default=None, type=nonempty,
                   help="the TOML file start was given, for its redis-url (default: "
                        "./pyproject.toml's [tool.forkq] if any) [env FORKQ_CONFIG]")
    p.add_argument("--url-prefix", default="", metavar="PATH",
                   help="serve under this path, e.g. /forkq behind a reverse proxy")
    p.add_argument("--login-limit", type=whole_number("--login-limit", 0), default=10, metavar="N",
                   help="wrong passwords or tokens one address may send in a minute before it "
                        "is refused for the rest of it (default 10; 0: no limit)")
    p.add_argument("--threads", type=whole_number("--threads", 1, 1000), default=4, help="request threads (default 4)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    try:
        # an empty secret (a Kubernetes secret that resolved to nothing) must not serve
        # the dashboard without the password someone meant it to have
        password = args.password or config.given("FORKQ_WEB_PASSWORD", os.environ.get("FORKQ_WEB_PASSWORD"))
        token = args.token or config.given("FORKQ_WEB_TOKEN", os.environ.get("FORKQ_WEB_TOKEN"))
        secret = config.given("FORKQ_WEB_SECRET", os.environ.get("FORKQ_WEB_SECRET"))
        redis_url = config.redis_url_for_tools(args.redis_url, args.config)
    except ConfigError as exc:
        sys.stderr.write(f"forkq: {exc}\n")
        return 2
    if not is_loopback(args.bind) and not (password or token):
        sys.stderr.write(f"forkq: refusing to serve the dashboard on {args.bind} without "
                         "--password or --token (or FORKQ_WEB_PASSWORD / FORKQ_WEB_TOKEN): "
                         "anyone who can reach it could delete jobs\n")
        return 2
    prefix = args.url_prefix.rstrip("/")
    if prefix and not prefix.startswith("/"):
        sys.stderr.write(f"forkq: --url-prefix must start with '/', not {args.url_prefix!r}\n")
        return 2
    from .. import client
    try:
        import waitress
        from .app import Dashboard
    except ImportError as exc:
        sys.stderr.write(f"forkq: forkq web needs {exc.name}: pip install 'forkq[web]'\n")
        return 1
    try:
        app = Dashboard(redis_url, password=password, token=token, secret=secret,
                        login_limit=args.login_limit)
    except (ConfigError, ValueError) as exc:  # a malformed Redis URL
        sys.stderr.write(f"forkq: {exc}\n")
        return 2
    host = f"[{args.bind}]" if ":" in args.bind else args.bind
    import signal
    # TERM (systemd, docker, a test) is a normal way to stop: exit 0 like Ctrl-C
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        server = waitress.create_server(app, host=args.bind, port=args.port, threads=args.threads,
                                        url_prefix=prefix, ident="forkq")
    except (OSError, ValueError) as exc:  # ValueError: waitress cannot resolve --bind
        sys.stderr.write(f"forkq: cannot listen on {host}:{args.port}: "
                         f"{getattr(exc, 'strerror', None) or exc}\n")
        return 1
    # only now, when the socket is ours, say where to look
    print(f"forkq web: http://{host}:{args.port}{prefix}/ (Redis {client.mask_url(app.redis_url)}"
          f"{', password' if password else ''}{', token' if token else ''})", flush=True)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    return 0
