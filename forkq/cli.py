"""The `forkq` command: argument parsing for `start` (and later `ctl`), nothing else."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from . import logs
from .errors import ConfigError
from .queues import parse_queue
from .settings import Settings


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one readable line, exit 2, no usage dump
        sys.stderr.write(f"forkq: {message} (see forkq {self.prog.split()[-1]} --help)\n")
        raise SystemExit(2)


def _positive_int(name: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a whole number, not {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be at least 1, not {value}")
        return value
    return parse


def _positive_float(name: str):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number of seconds, not {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{name} must be above 0, not {text}")
        return value
    return parse


def _queue(text: str) -> tuple[str, int]:
    try:
        return parse_queue(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="forkq", description="A prefork background-job processor on Redis.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    start = sub.add_parser("start", help="run workers in the foreground")
    start.add_argument("-r", "--require", action="append", default=[], metavar="MODULE_OR_PATH",
                       help="dotted module or .py file that defines jobs (repeatable)")
    start.add_argument("-c", "--concurrency", type=_positive_int("--concurrency"), default=10,
                       help="processor threads per process (default 10)")
    start.add_argument("-q", "--queue", action="append", type=_queue, default=[], metavar="NAME[,WEIGHT]",
                       help="queue to work, with optional weight (repeatable; default: default)")
    start.add_argument("-t", "--timeout", type=_positive_float("--timeout"), default=25.0,
                       help="seconds running jobs get to finish at stop (default 25)")
    start.add_argument("-p", "--processes", type=_positive_int("--processes"), default=None,
                       help="child processes to fork (default: CPU count)")
    start.add_argument("--no-fork", action="store_true",
                       help="run one worker in this process, without a supervising master")
    start.add_argument("--poll-interval", type=_positive_float("--poll-interval"), default=5.0,
                       help="average seconds between scheduled/retry polls per process (default 5)")
    start.add_argument("--heartbeat-interval", type=_positive_float("--heartbeat-interval"), default=5.0,
                       help="seconds between heartbeats; remote signals are read at each (default 5)")
    start.add_argument("--tag", default="", help="tag shown in the heartbeat and process title")
    start.add_argument("--log-level", choices=sorted(logs.LEVELS, key=logs.LEVELS.get), default="info")
    start.add_argument("--log-format", choices=["json", "text"], default=None,
                       help="default: text on a terminal, JSON otherwise")
    start.add_argument("--max-memory", type=_positive_float("--max-memory"), default=None, metavar="MB",
                       help="recycle a child whose RSS exceeds this many MB")
    start.add_argument("--hang-timeout", type=_positive_float("--hang-timeout"), default=30.0,
                       help="seconds without a ping before a child is killed as hung (default 30)")
    start.add_argument("--poison-after", type=_positive_int("--poison-after"), default=3,
                       help="child deaths a job may cause before it goes to the dead set (default 3)")
    start.add_argument("--pidfile", default=None, help="write the master's pid here")
    ctl = sub.add_parser("ctl", help="control a running forkq: quiet, stop, status, check")
    ctl_sub = ctl.add_subparsers(dest="action", required=True, parser_class=ArgumentParser)
    for action, text in (("quiet", "stop taking new jobs (running ones finish)"),
                         ("stop", "stop gracefully and wait for the master to exit"),
                         ("status", "the master and each child: slot, pid, busy, RSS, heartbeat age"),
                         ("check", "exit 0 if the master and every child heartbeat are healthy")):
        p = ctl_sub.add_parser(action, help=text)
        p.add_argument("--pidfile", default=None, help="the master's pidfile (default: start's default)")
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


def settings_from(args: argparse.Namespace) -> Settings:
    s = Settings(require=args.require, queues=args.queue or [("default", 0)],
                 concurrency=args.concurrency, timeout=args.timeout, no_fork=args.no_fork,
                 poll_interval=args.poll_interval, heartbeat_interval=args.heartbeat_interval, tag=args.tag, log_level=args.log_level,
                 log_format=args.log_format, max_memory_mb=args.max_memory,
                 hang_timeout=args.hang_timeout, poison_after=args.poison_after, pidfile=args.pidfile)
    if args.processes is not None:
        s.processes = args.processes
    s.redis_url = os.environ.get("FORKQ_REDIS_URL")
    return s


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "start":
        return start(settings_from(args))
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
    rows = control.children_of(pid, control.redis_for_ctl())
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
