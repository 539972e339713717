"""The `forkq` command: argument parsing for `start` and `ctl`, nothing else."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from . import config, logs
from .errors import ConfigError
from .settings import Settings


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one readable line, exit 2, no usage dump
        command = self.prog.split(" ", 1)[1] + " " if " " in self.prog else ""
        sys.stderr.write(f"forkq: {message} (see forkq {command}--help)\n")
        raise SystemExit(2)


def _flag_type(option: config.Option):
    def parse(text: str):
        try:
            return option.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse


def _positive_float(name: str):
    return _flag_type(config.Option(name, "", config.positive_float, ""))


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="forkq", description="A prefork background-job processor on Redis.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    start = sub.add_parser("start", help="run workers in the foreground")
    for o in config.OPTIONS:
        names = [o.short, o.flag] if o.short else [o.flag]
        help_ = f"{o.help} [env {o.env}]"
        if o.is_switch:
            start.add_argument(*names, dest=o.dest, action="store_const", const=True, default=None,
                               help=help_)
        else:
            start.add_argument(*names, dest=o.dest, type=_flag_type(o), metavar=o.metavar,
                               action="append" if o.repeat else "store", default=None, help=help_)
    start.add_argument("--config", metavar="PATH", default=None,
                       help="TOML file: a forkq.toml, or a pyproject.toml with [tool.forkq] "
                            "(default: ./pyproject.toml's [tool.forkq] if any) [env FORKQ_CONFIG]")
    start.add_argument("--print-config", action="store_true",
                       help="print the settings, where each came from, and exit")
    ctl = sub.add_parser("ctl", help="control a running forkq: quiet, stop, status, check")
    ctl_sub = ctl.add_subparsers(dest="action", required=True, parser_class=ArgumentParser)
    for action, text in (("quiet", "stop taking new jobs (running ones finish)"),
                         ("stop", "stop gracefully and wait for the master to exit"),
                         ("status", "the master and each child: slot, pid, busy, RSS, heartbeat age"),
                         ("check", "exit 0 if the master and every child heartbeat are healthy")):
        p = ctl_sub.add_parser(action, help=text)
        p.add_argument("--pidfile", default=None, help="the master's pidfile (default: start's default)")
        p.add_argument("--config", metavar="PATH", default=None,
                       help="the TOML file start was given, for its pidfile and redis-url [env FORKQ_CONFIG]")
        if action in ("quiet", "stop"):
            target = p.add_mutually_exclusive_group()
            target.add_argument("--identity", help="signal this process through Redis instead")
            target.add_argument("--host", help="signal every process on this host through Redis")
            target.add_argument("--all", action="store_true", help="signal every process through Redis")
        if action == "stop":
            p.add_argument("--timeout", type=_positive_float("--timeout"), default=60.0,
                           help="seconds to wait for the master to exit (default 60)")
        if action == "check":
            p.add_argument("--max-age", type=_positive_float("--max-age"), default=30.0,
                           help="oldest acceptable child heartbeat, seconds (default 30)")
    return parser


def module_name_for(path: Path) -> str | None:
    """The dotted name a .py file has under cwd or sys.path (app/jobs.py -> app.jobs), so
    its jobs register under the same names a client importing it normally would use."""
    for entry in [os.getcwd(), *sys.path]:
        if not entry:
            continue
        try:
            rel = path.relative_to(Path(entry).resolve())
        except (ValueError, OSError):
            continue
        parts = rel.with_suffix("").parts
        if parts and all(p.isidentifier() for p in parts):
            return ".".join(parts)
    return None


def load_app(requires: list[str]) -> None:
    """Import each --require: a dotted module, or a .py path imported under its dotted name."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    for item in requires:
        if item.endswith(".py") or os.sep in item:
            path = Path(item).resolve()
            if not path.is_file():
                raise ConfigError(f"--require {item}: no such file")
            name = module_name_for(path)
            if name is None:
                sys.path.insert(0, str(path.parent))
                name = path.stem
            _import(item, name)
        else:
            _import(item, item)


def _import(item: str, name: str) -> None:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and name.startswith(exc.name):
            raise ConfigError(f"--require {item}: no module named {exc.name!r} "
                              f"(is it on PYTHONPATH? cwd is {os.getcwd()})") from None
        raise


def settings_from(args: argparse.Namespace) -> tuple[Settings, dict[str, str]]:
    flags = {o.field: getattr(args, o.dest) for o in config.OPTIONS}
    return config.resolve(flags, config_path=args.config or os.environ.get("FORKQ_CONFIG"))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "start":
        try:
            settings, sources = settings_from(args)
        except ConfigError as exc:
            sys.stderr.write(f"forkq: {exc}\n")
            return 2
        if args.print_config:
            print(config.describe(settings, sources))
            return 0
        return start(settings)
    try:
        return ctl(args)
    except (ConfigError, ValueError) as exc:
        sys.stderr.write(f"forkq: {exc}\n")
        return 1
    except redis_errors() as exc:
        sys.stderr.write(f"forkq: cannot reach Redis: {exc}\n")
        return 1


def redis_errors() -> tuple[type[BaseException], ...]:
    import redis
    return (redis.ConnectionError, redis.TimeoutError)


def ctl(args: argparse.Namespace) -> int:
    import signal

    from . import control
    if args.config:
        # read the same file start read: control.default_pidfile() looks there, and so
        # does the Redis URL below
        os.environ["FORKQ_CONFIG"] = args.config
    settings, _ = config.resolve({}, config_path=os.environ.get("FORKQ_CONFIG"))
    if settings.redis_url:
        os.environ.setdefault("FORKQ_REDIS_URL", settings.redis_url)
    remote = getattr(args, "identity", None) or getattr(args, "host", None) or getattr(args, "all", False)
    if args.action in ("quiet", "stop") and remote:
        signame = "TSTP" if args.action == "quiet" else "TERM"
        sent = control.remote_signal(control.redis_for_ctl(), signame, identity=args.identity,
                                     host=args.host, everyone=args.all)
        if not sent:
            sys.stderr.write("forkq: no live process matches\n")
            return 1
        for identity in sent:
            print(f"{signame} -> {identity}")
        return 0
    if args.action == "quiet":
        pid = control.signal_master(args.pidfile, signal.SIGTSTP)
        print(f"quiet: told master {pid}")
        return 0
    if args.action == "stop":
        pid = control.signal_master(args.pidfile, signal.SIGTERM)
        if control.wait_gone(pid, args.timeout):
            print(f"stopped: master {pid} exited")
            return 0
        sys.stderr.write(f"forkq: master {pid} is still running after {args.timeout:g}s\n")
        return 1
    pid = control.find_master(args.pidfile)
    try:
        rows = control.children_of(pid, control.redis_for_ctl())
    except redis_errors() as exc:
        if args.action != "check":
            raise
        # a Redis outage is not this pod's fault, and restarting it would not help: judge
        # by the processes alone (the master replaces children that die or hang)
        import psutil
        children = psutil.Process(pid).children()
        if not children:
            sys.stderr.write(f"forkq: unhealthy: master {pid} has no children\n")
            return 1
        print(f"ok: master {pid}, {len(children)} children (Redis unreachable, heartbeats not checked: {exc})")
        return 0
    if args.action == "check":
        bad = [r for r in rows if r["beat_age"] is None or r["beat_age"] > args.max_age]
        if not rows or bad:
            sys.stderr.write(f"forkq: unhealthy: master {pid} has {len(rows)} children, "
                             f"{len(bad)} without a recent heartbeat\n")
            return 1
        print(f"ok: master {pid}, {len(rows)} children heartbeating")
        return 0
    print(f"master pid {pid}  children {len(rows)}")
    print(f"{'slot':>4} {'pid':>7} {'busy':>9} {'rss MB':>8} {'heartbeat':>10}  state")
    for r in rows:
        busy = "-" if r["busy"] is None else f"{r['busy']}/{r['concurrency']}"
        age = "-" if r["beat_age"] is None else f"{r['beat_age']:.1f}s ago"
        state = "no heartbeat" if r["beat_age"] is None else ("quiet" if r["quiet"] else "running")
        print(f"{'-' if r['slot'] is None else r['slot']:>4} {r['pid']:>7} {busy:>9} "
              f"{r['rss_mb']:>8.1f} {age:>10}  {state}")
    return 0


def warn_about_redis(settings: Settings) -> None:
    """Sidekiq's boot check: an evicting Redis silently loses jobs."""
    from . import client
    import redis
    conn = client.connect(settings.redis_url, socket_timeout=5)
    try:
        policy = conn.config_get("maxmemory-policy")
    except redis.ResponseError:
        return  # CONFIG is disabled on many managed servers; nothing to learn then
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        logs.get("forkq").warning("Redis unreachable at boot; workers will retry",
                                  url=client.mask_url(client.redis_url(settings.redis_url)), error=str(exc))
        return
    finally:
        conn.close()  # the master forks next: no socket of its own may cross into a child
    value = policy.get(b"maxmemory-policy") or policy.get("maxmemory-policy")
    if value not in (b"noeviction", "noeviction", None):
        logs.get("forkq").warning(
            "Redis maxmemory-policy is not noeviction: under memory pressure Redis will "
            "delete keys, and with them jobs", policy=value.decode() if isinstance(value, bytes) else value)


def start(settings: Settings) -> int:
    logs.configure(settings.log_level, settings.log_format)
    try:
        load_app(settings.require)
        from . import client
        client.connect(settings.redis_url)  # validates the URL before anything forks
    except (ConfigError, ValueError) as exc:
        sys.stderr.write(f"forkq: {exc}\n")
        return 2
    warn_about_redis(settings)
    if settings.no_fork:
        from .worker import run_standalone
        return run_standalone(settings)
    from .control import pidfile
    from .supervisor import Supervisor
    try:
        with pidfile(settings.pidfile):
            return Supervisor(settings).run()
    except ConfigError as exc:
        sys.stderr.write(f"forkq: {exc}\n")
        return 2
