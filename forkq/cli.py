"""The `forkq` command: argument parsing for `start` and `ctl`, nothing else."""

from __future__ import annotations

import argparse
import importlib
import math
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

from . import __version__, config, logs
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
            return config.parse_value(option, text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse


def nonempty(text: str) -> str:
    """An argparse type for a flag that is not a setting (--config, --pidfile, --identity):
    given empty, it is refused as an empty setting is (config.parse_value)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(config.EMPTY)
    return text


def _positive_float(name: str):
    return _flag_type(config.Option(name, "", config.positive_float, ""))


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="forkq", description="A prefork background-job processor on Redis.")
    parser.add_argument("-V", "--version", action="version", version=f"forkq {__version__}")
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
    start.add_argument("--config", metavar="PATH", default=None, type=nonempty,
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
        p.add_argument("--pidfile", default=None, type=nonempty,
                       help="the master's pidfile (default: start's default)")
        p.add_argument("--config", metavar="PATH", default=None, type=nonempty,
                       help="the TOML file start was given, for its pidfile and redis-url [env FORKQ_CONFIG]")
        if action in ("quiet", "stop"):
            target = p.add_mutually_exclusive_group()
            target.add_argument("--identity", type=nonempty, help="signal this process through Redis instead")
            target.add_argument("--host", type=nonempty, help="signal every process on this host through Redis")
            target.add_argument("--all", action="store_true", help="signal every process through Redis")
        if action == "stop":
            p.add_argument("--timeout", type=_positive_float("--timeout"), default=60.0,
                           help="seconds to wait for the master to exit (default 60)")
        if action == "check":
            p.add_argument("--max-age", type=_positive_float("--max-age"), default=30.0,
                           help="oldest acceptable child heartbeat, seconds (default 30)")
            p.add_argument("--stuck-after", type=_positive_float("--stuck-after"), default=30.0,
                           help="seconds without a turn of the master's loop (it marks its pidfile "
                                "every 5 s) that make it unhealthy (default 30)")
            p.add_argument("--require-redis", action="store_true",
                           help="fail when Redis cannot be reached (a readiness probe: a pod with a "
                                "wrong URL or password must not count as ready); without it an "
                                "unreachable Redis is judged by the processes alone (liveness)")
    add_admin_commands(sub)
    from .web.command import add_web_command
    add_web_command(sub)
    return parser


def whole_number(name: str, low: int = 1, high: int | None = None):
    """An argparse type: an int in [low, high], or one readable line naming the flag."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a whole number, not {text!r}") from None
        if value < low or (high is not None and value > high):
            limit = f"at least {low}" if high is None else f"between {low} and {high}"
            raise argparse.ArgumentTypeError(f"{name} must be {limit}, not {value}")
        return value
    return parse


# sorted set -> (its actions besides list, the verb for moving entries onto their queues)
SET_ACTIONS = {"dead": ("retry", "delete"), "retry": ("retry-now", "delete", "kill"),
               "schedule": ("run-now", "delete", "kill")}


MALFORMED_HELP = ("entries that are no runnable job: forkq.MalformedJob (a payload forkq "
                  "could not parse) and members that do not parse")


def add_admin_commands(sub: argparse._SubParsersAction) -> None:
    """stats, queues, processes and the dead/retry/schedule sets: read-only views and
    bulk actions on what is in Redis, for people (tables) and scripts (--json)."""
    common = ArgumentParser(add_help=False)
    common.add_argument("--redis-url", default=None, type=_flag_type(config.BY_KEY["redis_url"]),
                        help="Redis URL [env FORKQ_REDIS_URL]")
    common.add_argument("--json", action="store_true", help="print JSON for scripts instead of a table")
    p = sub.add_parser("stats", parents=[common], help="processed/failed totals, set sizes, daily history")
    p.add_argument("--days", type=whole_number("--days", 1, 3660), default=7, help="days of history (default 7)")
    sub.add_parser("queues", parents=[common], help="each queue: size and latency")
    sub.add_parser("processes", parents=[common], help="live processes grouped by master")
    sub.add_parser("busy", parents=[common], help="the jobs running now, longest-running first")
    for name, actions in SET_ACTIONS.items():
        p = sub.add_parser(name, help=f"list or act on the {name} set")
        verbs = p.add_subparsers(dest="action", required=True, parser_class=ArgumentParser)
        listing = verbs.add_parser("list", parents=[common], help=f"entries of the {name} set, oldest first")
        listing.add_argument("--jid", help="only this job")
        listing.add_argument("--class", dest="klass", metavar="NAME", help="only jobs of this class")
        listing.add_argument("--queue", help="only jobs of this queue")
        listing.add_argument("--malformed", action="store_true", help=MALFORMED_HELP)
        listing.add_argument("--limit", type=whole_number("--limit"), default=100,
                             help="show at most this many (default 100)")
        for verb in actions:
            a = verbs.add_parser(verb, parents=[common], help=f"{verb} the chosen entries")
            pick = a.add_mutually_exclusive_group(required=True)
            pick.add_argument("--jid", help="the entry with this jid")
            pick.add_argument("--class", dest="klass", metavar="NAME", help="every entry of this class")
            pick.add_argument("--queue", help="every entry of this queue")
            pick.add_argument("--all", action="store_true", help="every entry")
            pick.add_argument("--malformed", action="store_true", help=MALFORMED_HELP)


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
        elif not item or not all(part.isidentifier() for part in item.split(".")):
            raise ConfigError(f"--require {item!r}: not a dotted module name (app.jobs) or a .py file")
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
    return config.resolve(flags, config_path=config.config_path(args.config))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "handler", None):  # subcommands that run themselves (forkq web)
        return args.handler(args)
    if args.command == "start":
        try:
            settings, sources = settings_from(args)
        except ConfigError as exc:
            sys.stderr.write(f"forkq: {exc}\n")
            return 2
        if args.print_config:
            try:
                print(config.describe(settings, sources), flush=True)
            except BrokenPipeError:  # `forkq start --print-config | head`
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        return start(settings)
    import redis
    try:
        if args.command in ADMIN_COMMANDS:
            return admin(args)
        return ctl(args)
    except (ConfigError, ValueError) as exc:
        sys.stderr.write(f"forkq: {exc}\n")
        return 1
    except redis_errors() as exc:
        sys.stderr.write(f"forkq: cannot reach Redis: {exc}\n")
        return 1
    except redis.RedisError as exc:  # DB index out of range, WRONGTYPE, not a Redis server...
        sys.stderr.write(f"forkq: Redis error: {type(exc).__name__}: {exc}\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("forkq: interrupted\n")
        return 130
    except BrokenPipeError:  # `forkq dead list | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def redis_errors() -> tuple[type[BaseException], ...]:
    import redis
    return (redis.ConnectionError, redis.TimeoutError)


def ctl(args: argparse.Namespace) -> int:
    import signal

    from . import control
    try:
        path = config.config_path(args.config)
        settings, _ = config.resolve({}, config_path=path)
    except ConfigError as exc:  # what start would refuse: a setting, not the master's state
        sys.stderr.write(f"forkq: {exc}\n")
        return 2
    if path is not None:
        # read the same file start read: control.default_pidfile() looks there, and so
        # does the Redis URL below
        os.environ["FORKQ_CONFIG"] = path
    if settings.redis_url:
        os.environ.setdefault("FORKQ_REDIS_URL", settings.redis_url)
    remote = (getattr(args, "identity", None) is not None or getattr(args, "host", None) is not None
              or getattr(args, "all", False))
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
    pidfile = args.pidfile or control.default_pidfile()  # read once: check looks at it twice
    if args.action == "quiet":
        pid = control.signal_master(pidfile, signal.SIGTSTP)
        print(f"quiet: told master {pid}")
        return 0
    if args.action == "stop":
        pid = control.signal_master(pidfile, signal.SIGTERM)
        if control.wait_gone(pid, args.timeout):
            print(f"stopped: master {pid} exited")
            return 0
        sys.stderr.write(f"forkq: master {pid} is still running after {args.timeout:g}s\n")
        return 1
    pid = control.find_master(pidfile)
    try:
        rows = control.children_of(pid, control.redis_for_ctl())
    except redis_errors() as exc:
        if args.action != "check" or args.require_redis:
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
        stalled = control.pidfile_age(pidfile)
        if stalled is not None and stalled > args.stuck_after:
            # the children beat on their own: only this shows a master whose loop is stuck
            # (it would neither replace a dead child nor answer a stop)
            sys.stderr.write(f"forkq: unhealthy: master {pid} has not turned its loop "
                             f"for {stalled:.0f}s\n")
            return 1
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
    shown = client.mask_url(client.redis_url(settings.redis_url))
    try:
        conn.ping()
    except redis.RedisError as exc:
        if refused_credentials(exc):
            # redis-py files this under ConnectionError, but a retry only repeats the
            # refusal: at start it is a setting to fix (a password rotated under a running
            # worker is an outage to it instead, logged and retried)
            conn.close()
            raise ConfigError(f"Redis refused the credentials (password or ACL user) of "
                              f"--redis-url {shown}: {exc}") from None
        if not isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
            # it answered, but no retry will help: DB out of range, not Redis
            conn.close()
            raise ConfigError(f"--redis-url {shown}: {type(exc).__name__}: {exc}") from None
        # an outage: the warning below, and workers retry
    try:
        policy = conn.config_get("maxmemory-policy")
    except redis.ResponseError:
        return  # CONFIG is disabled on many managed servers; nothing to learn then
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        logs.get("forkq").warning("Redis unreachable at boot; workers will retry", url=shown, error=str(exc))
        return
    finally:
        conn.close()  # the master forks next: no socket of its own may cross into a child
    value = policy.get(b"maxmemory-policy") or policy.get("maxmemory-policy")
    if value not in (b"noeviction", "noeviction", None):
        logs.get("forkq").warning(
            "Redis maxmemory-policy is not noeviction: under memory pressure Redis will "
            "delete keys, and with them jobs", policy=value.decode() if isinstance(value, bytes) else value)


def warn_about_timing(settings: Settings) -> None:
    """A lease that can expire under a live process: its jobs would run twice. (A lease is
    never under 3 of the owner's own heartbeats: orphans.dead_owners sees to that.)"""
    s = settings
    if not s.no_fork and s.recovery_delay <= s.hang_timeout:
        logs.get("forkq").warning(
            "--recovery-delay is not above --hang-timeout: a child stuck in a job (one holding "
            "the GIL) stops its heartbeat, and another forkq may take its jobs before this "
            "master kills it; the job could then finish twice",
            recovery_delay=s.recovery_delay, hang_timeout=s.hang_timeout)


def refused_credentials(exc: BaseException) -> bool:
    """A wrong password or ACL user: redis-py raises AuthenticationError for WRONGPASS and
    NOAUTH, but an error reply it does not map arrives as a plain ResponseError."""
    import redis
    return isinstance(exc, redis.AuthenticationError) or (
        isinstance(exc, redis.ResponseError) and str(exc).startswith(("WRONGPASS", "NOAUTH")))


class StoppedWhileStarting(BaseException):
    """SIGTERM or SIGINT came before the master (or --no-fork worker) traps its own; a
    BaseException, as KeyboardInterrupt, so that an app's `except Exception` lets it pass."""


def _stop_while_starting(signum: int, frame: object) -> None:
    raise StoppedWhileStarting(signal.Signals(signum).name)


def start(settings: Settings) -> int:
    """Boot and run; a TERM or INT while the app still imports (which can take seconds)
    ends it with exit 0 and one line, as a stop would: nothing was claimed yet. Once the
    master or the worker runs, its own signal traps replace these."""
    logs.configure(settings.log_level, settings.log_format)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop_while_starting)
    try:
        return _start(settings)
    except StoppedWhileStarting as exc:
        logs.get("forkq").info("stop requested while starting; exiting before taking any job",
                               signal=str(exc))
        return 0


def _start(settings: Settings) -> int:
    try:
        load_app(settings.require)
        from . import client
        client.connect(settings.redis_url)  # validates the URL before anything forks
        warn_about_redis(settings)
        warn_about_timing(settings)
    except (ConfigError, ValueError) as exc:
        sys.stderr.write(f"forkq: {exc}\n")
        return 2
    if settings.no_fork:
        from .worker import run_standalone
        logs.configure(settings.log_level, settings.log_format, buffered=True)
        try:
            return run_standalone(settings)
        finally:
            logs.flush()
    from .control import pidfile
    from .supervisor import Supervisor
    try:
        with pidfile(settings.pidfile) as path:
            return Supervisor(settings, pidfile=path).run()
    except ConfigError as exc:
        sys.stderr.write(f"forkq: {exc}\n")
        return 2


# -- admin commands: stats, queues, processes, dead/retry/schedule ----------------------

ADMIN_COMMANDS = ("stats", "queues", "processes", "busy", *SET_ACTIONS)


def admin(args: argparse.Namespace) -> int:
    """Run one admin command; a Redis failure is one line naming the (masked) URL."""
    import redis
    from . import api, client
    try:
        url = client.redis_url(args.redis_url or config.from_env("redis_url"))
    except ConfigError as exc:
        sys.stderr.write(f"forkq: {exc}\n")
        return 2
    try:
        conn = api.connect(url)
        if args.command in SET_ACTIONS:
            return _set_command(conn, args)
        data, table = {"stats": _stats, "queues": _queues, "processes": _processes,
                       "busy": _busy}[args.command](conn, args)
    except redis_errors() as exc:
        sys.stderr.write(f"forkq: cannot reach Redis at {client.mask_url(url)}: {exc}\n")
        return 1
    except redis.RedisError as exc:
        sys.stderr.write(f"forkq: Redis at {client.mask_url(url)} answered with an error: "
                         f"{type(exc).__name__}: {exc}\n")
        return 1
    _emit(args, data, table)
    return 0


def _emit(args: argparse.Namespace, data: object, table: list[str]) -> None:
    import json
    print(json.dumps(_strict(data), indent=2, default=str, allow_nan=False) if args.json
          else "\n".join(table))


def _strict(data: object) -> object:
    """A copy with NaN and Infinity as null: Python's json reads them from any client's
    payload (and a Redis score may be inf) and would write them back, but they are not
    JSON, and jq or JSON.parse reading --json would refuse the whole output. A loop, not
    recursion: a payload nested as deep as json.loads allows must not hit the stack limit."""
    root: list[object] = [None]
    todo: list[tuple[object, Any, Any]] = [(data, root, 0)]
    while todo:
        value, parent, key = todo.pop()
        if isinstance(value, float) and not math.isfinite(value):
            value = None
        elif isinstance(value, dict):
            copy: dict[Any, object] = dict.fromkeys(value)  # keeps the key order
            todo += [(item, copy, k) for k, item in value.items()]
            value = copy
        elif isinstance(value, (list, tuple)):
            items: list[object] = [None] * len(value)
            todo += [(item, items, i) for i, item in enumerate(value)]
            value = items
        parent[key] = value
    return root[0]


def _table(header: list[str], rows: list[list[object]]) -> list[str]:
    """Columns as wide as their widest cell; numbers right-aligned, text left-aligned."""
    cells = [[str(c) for c in header]] + [["-" if c is None else _printable(str(c)) for c in row]
                                          for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    numeric = [all(isinstance(row[i], (int, float)) for row in rows) and rows for i in range(len(header))]
    def line(row: list[str]) -> str:
        return "  ".join(c.rjust(w) if num else c.ljust(w)
                         for c, w, num in zip(row, widths, numeric)).rstrip()
    return [line(r) for r in cells]


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _printable(text: str) -> str:
    """A cell as one line, with no terminal escapes: payloads and error messages are input."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.1f}s"


def _stats(conn, args):
    from dataclasses import asdict
    from . import api
    s = api.stats(conn, args.days)
    data = asdict(s)
    data["history"] = [{"day": d, "processed": p, "failed": f} for d, p, f in s.history]
    table = _table(["processed", "failed", "enqueued", "scheduled", "retries", "dead", "processes"],
                   [[s.processed, s.failed, s.enqueued, s.scheduled, s.retries, s.dead, s.processes]])
    table += [""] + _table(["day (UTC)", "processed", "failed"], [list(h) for h in s.history])
    return data, table


def _queues(conn, args):
    from dataclasses import asdict
    from . import api
    qs = api.queues(conn)
    table = _table(["queue", "size", "latency"], [[q.name, q.size, _age(q.latency)] for q in qs])
    return [asdict(q) for q in qs], table if qs else ["no queues"]


def _processes(conn, args):
    from dataclasses import asdict
    from . import api
    groups = api.processes(conn)
    data = [{"master": g.master, "processes": [asdict(p) for p in g.processes]} for g in groups]
    rows = []
    for g in groups:
        for p in g.processes:
            rows.append([g.master or "(none)", p.slot, p.pid, f"{p.busy}/{p.concurrency or '?'}",
                         f"{p.rss_kb / 1024:.1f}", _age(p.beat_age), "quiet" if p.quiet else "running",
                         p.identity])
    header = ["master", "slot", "pid", "busy", "rss MB", "heartbeat", "state", "identity"]
    return data, _table(header, rows) if rows else ["no live processes"]


def _enqueued_at(job: dict | None) -> float:
    at = (job or {}).get("enqueued_at")
    return float(at) if isinstance(at, (int, float)) else float("inf")


def _busy(conn, args):
    import json
    import time
    from . import api, payload
    now = time.time()
    # run_at is whole seconds (Sidekiq's format): among jobs started in the same second,
    # the one enqueued first most likely started first
    jobs = sorted(api.running(conn), key=lambda j: (j.run_at or now, _enqueued_at(j.job)))
    data, rows = [], []
    for j in jobs:
        job = j.job or {}
        took = now - j.run_at if j.run_at else None
        name = payload.display_name(job) if job else None
        data.append({"identity": j.identity, "thread": j.thread, "queue": j.queue, "jid": job.get("jid"),
                     "class": name, "args": job.get("args"), "run_at": j.run_at, "running_for": took})
        args_text = json.dumps(job.get("args"), default=str) if job else "(unreadable)"
        rows.append([j.identity, j.queue, job.get("jid"), name, _age(took),
                     args_text if len(args_text) <= 40 else args_text[:37] + "..."])
    header = ["process", "queue", "jid", "class", "running", "args"]
    return data, _table(header, rows) if rows else ["no jobs running"]


def _set_command(conn, args: argparse.Namespace) -> int:
    from . import api, keys
    zset = api.SortedSet(conn, args.command)
    where = api.matching(klass=args.klass, queue=args.queue, jid=args.jid,
                         malformed=getattr(args, "malformed", False))
    if args.action == "list":
        import itertools
        entries = list(itertools.islice(zset.entries(where), args.limit))
        rows = [[_when(e.score), e.jid, e.klass, e.queue, _error(e)] for e in entries]
        table = _table(["when (UTC)", "jid", "class", "queue", "error"], rows) if rows else [
            f"no matching entries in {args.command}"]
        _emit(args, [e.to_dict() for e in entries], table)
        return 0
    if getattr(args, "malformed", False) and args.action in ("retry", "retry-now", "run-now"):
        sys.stderr.write(f"forkq: {args.action} --malformed: these entries are no runnable jobs; "
                         f"list them, or delete them\n")
        return 2
    action = {"retry": zset.retry_now, "retry-now": zset.retry_now, "run-now": zset.retry_now,
              "delete": zset.delete, "kill": zset.kill}[args.action]
    dead_before = api.dead(conn).size() if args.action == "kill" else 0
    if args.jid:
        entry = zset.find(args.jid)
        if entry is None:
            sys.stderr.write(f"forkq: no entry with jid {args.jid} in {args.command}\n")
            return 1
        count = action([entry])
        if count == 0 and args.action not in ("delete", "kill"):
            sys.stderr.write(f"forkq: could not {args.action} jid {args.jid}: it is no runnable job "
                             "(a malformed entry, no valid queue name, or NaN/Infinity in it; "
                             "see `list --json`)\n")
            return 1
    else:
        count = zset.apply(action, None if args.all else where)
    data: dict[str, object] = {"set": args.command, "action": args.action, "count": count}
    line = f"{args.action}: {count} entr{'y' if count == 1 else 'ies'} of {args.command}"
    if args.action == "kill":
        # the dead set is trimmed as Sidekiq trims it, so a big kill does not leave all it
        # moved there: say how many are gone rather than let the count promise them
        data["dropped"] = dropped = max(0, dead_before + count - api.dead(conn).size())
        line += " moved to dead"
        if dropped:
            line += (f", which keeps only its newest {keys.DEAD_MAX_JOBS - 1:,} entries (none older than "
                     f"{keys.DEAD_TIMEOUT_S // 86400} days): its {dropped:,} oldest were dropped")
    _emit(args, data, [line])
    return 0


def _when(score: float) -> str:
    from datetime import datetime, timezone
    try:
        return datetime.fromtimestamp(score, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    except (OverflowError, OSError, ValueError):
        return str(score)


def _error(entry) -> str:
    job = entry.job or {}
    if not job.get("error_class"):
        return "" if entry.job is not None else "(unparseable entry)"
    text = f"{job['error_class']}: {job.get('error_message', '')}"
    return text if len(text) <= 60 else text[:57] + "..."
