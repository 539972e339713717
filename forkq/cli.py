"""The `forkq` command: its parser, `start` and `ctl`; the admin commands are in admin.py,
`forkq web` in web/command.py."""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from . import __version__, config, keys, logs
from .errors import ConfigError
from .settings import Settings

if TYPE_CHECKING:
    import redis

    from . import reload


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one readable line, exit 2, no usage dump
        command = self.prog.split(" ", 1)[1] + " " if " " in self.prog else ""
        # argparse echoes what it could not use: a Redis URL given where none is taken
        from .masking import mask_text
        sys.stderr.write(f"forkq: {mask_text(message)} (see forkq {command}--help)\n")
        raise SystemExit(2)

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        namespace, extras = super().parse_known_args(args, namespace)
        if extras and " " in self.prog:
            # argparse hands a subcommand's strays up to the top-level parser, whose error
            # then points at `forkq --help`, which lists none of that subcommand's flags
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


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
            target.add_argument("--host", type=nonempty,
                                help="signal every forkq process on this host through Redis")
            target.add_argument("--all", action="store_true", help="signal every forkq process through Redis")
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
    from .admin import add_admin_commands
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
            # a ceiling past any real use (--limit's 2**62) is no help in the message
            limit = f"at least {low}" if high is None or value < low and high > 10**9 \
                else f"between {low} and {high}"
            raise argparse.ArgumentTypeError(f"{name} must be {limit}, not {value}")
        return value
    return parse


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


# Values that name files may hold any bytes the file system does; every other value ends
# up in Redis or HTTP, where it must be UTF-8
_PATH_FLAGS = {"--require", "-r", "--pidfile", "--config"}
_PATH_ENV = {"FORKQ_REQUIRE", "FORKQ_PIDFILE", "FORKQ_CONFIG", "FORKQ_REDIS_CA", "FORKQ_REDIS_CERT",
             "FORKQ_REDIS_KEY"}
_SECRET_FLAGS = {"--password", "--token"}


def not_utf8(argv: list[str], environ: dict[str, str]) -> str | None:
    """Name the first argument or FORKQ_* variable that is not UTF-8 (Python keeps such bytes
    as lone surrogates, which fail only deep inside, as "'utf-8' codec can't encode")."""
    from .masking import mask_text
    for i, arg in enumerate(argv):
        if _encodes(arg):
            continue
        flag, value = arg, ""
        if arg.startswith("--") and "=" in arg:
            flag, value = arg.split("=", 1)
        elif arg.startswith("-") and not arg.startswith("--"):
            flag, value = arg[:2], arg[2:]
        elif i and argv[i - 1].startswith("-") and "=" not in argv[i - 1]:
            flag, value = argv[i - 1], arg
        if flag in _PATH_FLAGS:
            continue
        if not value or not _encodes(flag):
            flag = ""  # a positional argument, or an option's own name
        shown = "" if flag in _SECRET_FLAGS else \
            " (" + mask_text(os.fsencode(value or arg).decode("utf-8", "backslashreplace")) + ")"
        return (f"the value of {flag}{shown}" if flag else f"the argument{shown}") + " is not valid UTF-8"
    for name in sorted(environ):
        if name.startswith("FORKQ_") and name not in _PATH_ENV and not _encodes(environ[name]):
            return f"{name} is not valid UTF-8"
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def open_standard_fds() -> None:
    """Put /dev/null on any of descriptors 0-2 that was closed at exec (`forkq start >&-`, a
    daemonizing wrapper): Python leaves sys.stdout None then, which log setup tripped on
    with a traceback, and the next file forkq opened (a Redis socket) would take the
    number, where a job's subprocess writes its output."""
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        try:
            os.fstat(fd)
            continue
        except OSError:
            pass
        null = os.open(os.devnull, os.O_RDWR)
        if null != fd:
            os.dup2(null, fd)
            os.close(null)
        if getattr(sys, name) is None:
            setattr(sys, name, open(fd, mode, closefd=False))


def main(argv: list[str] | None = None) -> int:
    open_standard_fds()
    bad = not_utf8(sys.argv[1:] if argv is None else argv, dict(os.environ))
    if bad:
        sys.stderr.write(f"forkq: {bad}; only file paths may be other bytes\n")
        return 2
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
            for line in config.unread_env() + [config.ignored_redis_url(settings.redis_url)]:
                if line:
                    sys.stderr.write(f"forkq: {line}\n")
            try:
                print(config.describe(settings, sources), flush=True)
            except BrokenPipeError:  # `forkq start --print-config | head`
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        if settings.reload:
            from . import reload
            # the settings file is watched too: the new master reads it again
            found = config.read_file(config.config_path(args.config))[1]
            reload.remember_start(found)
        return start(settings)
    import redis
    from . import admin
    try:
        if args.command in admin.COMMANDS:
            return admin.run(args)
        return ctl(args)
    except (ConfigError, ValueError) as exc:
        sys.stderr.write(f"forkq: {exc}\n")
        return 1
    except redis_errors() as exc:
        from .client import mask_url, redis_url, unreachable
        sys.stderr.write(f"forkq: {unreachable(mask_url(redis_url()), exc, redis_url())}\n")
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
        conn = control.redis_for_ctl()
        sent = control.remote_signal(conn, signame, identity=args.identity, host=args.host,
                                     everyone=args.all)
        _, others = control.remote_targets(conn, host=args.host, everyone=args.all)
        if others:
            sys.stderr.write(f"forkq: left alone, not forkq (Ruby Sidekiq?): {' '.join(sorted(others))}"
                             " (--identity reaches one)\n")
        if not sent:
            sys.stderr.write(f"forkq: no live process matches{_master_hint(conn, args.identity)}\n")
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


def _master_hint(conn, identity: str | None) -> str:
    """What to give instead, when --identity names a master: `forkq processes` shows masters
    by name in a column of their own, so the name is easy to take for an identity."""
    from . import control
    if identity is None:
        return ""
    children = [hb["identity"] for hb in control.heartbeats(conn) if hb["info"].get("master") == identity]
    if not children:
        return ""
    return (f": {identity} is a master, which reads no signals of its own; give one of its "
            f"children (--identity {children[0]}) and the master passes it to them all")


def warn_about_redis(settings: Settings) -> None:
    """Sidekiq's boot check: an evicting Redis silently loses jobs."""
    from . import client
    import redis
    conn = client.connect(settings.redis_url, socket_timeout=5)
    shown = client.mask_url(client.redis_url(settings.redis_url))
    try:
        conn.ping()
    except redis.RedisError as exc:
        if client.refused_credentials(exc):
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
    else:
        warn_about_queue_names(settings, conn)
    try:
        policy = conn.config_get("maxmemory-policy")
    except redis.ResponseError:
        return  # CONFIG is disabled on many managed servers; nothing to learn then
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        hint = client.tls_hint(client.redis_url(settings.redis_url), {}, exc).strip(" ()")
        logs.get("forkq").warning("Redis unreachable at boot; workers will retry", url=shown,
                                  error=str(exc), **({"hint": hint} if hint else {}))
        return
    finally:
        conn.close()  # the master forks next: no socket of its own may cross into a child
    value = policy.get(b"maxmemory-policy") or policy.get("maxmemory-policy")
    if value not in (b"noeviction", "noeviction", None):
        logs.get("forkq").warning(
            "Redis maxmemory-policy is not noeviction: under memory pressure Redis will "
            "delete keys, and with them jobs", policy=value.decode() if isinstance(value, bytes) else value)


def warn_about_queue_names(settings: Settings, conn: redis.Redis) -> None:
    """A --queue misspelt ('mial' for 'mail') is served in silence while its jobs wait on the
    queue they were pushed to. Warn when a served queue is one Redis has never listed and no
    registered job uses, but it is close to one of those: a queue no job has reached yet (a
    fresh Redis, jobs pushed from elsewhere) is no mistake, and gets no warning unless it
    looks like a slip."""
    import difflib

    import redis

    from .cron import ENTRIES
    from .jobs import REGISTRY
    served = [name for name, _ in settings.queues]
    for entry in ENTRIES.values():
        if entry.queue not in served:
            # every forkq running the app pushes its entries: the push lands, but only a
            # forkq serving that queue runs it, and one that serves none of them never does
            logs.get("forkq").warning(
                f"periodic entry {entry.name!r} pushes to queue {entry.queue!r}, which this forkq "
                "does not serve (--queue): its jobs run only where another forkq does",
                entry=entry.name, queue=entry.queue)
    try:
        listed = {q.decode("utf-8", "replace") for q in conn.smembers(keys.QUEUES)}
    except redis.RedisError:
        return  # a boot check only: the workers report what is wrong with Redis
    known = sorted(listed | {j.queue for j in REGISTRY.values()})
    for name in served:
        if name in known:
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.7)
        if close:
            logs.get("forkq").warning(
                f"--queue {name!r}: no job was ever pushed to that queue and no registered job "
                f"uses it; did you mean {close[0]!r}?",
                queue=name, similar=close[0])


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


class StoppedWhileStarting(BaseException):
    """SIGTERM or SIGINT came before the master (or --no-fork worker) traps its own; a
    BaseException, as KeyboardInterrupt, so that an app's `except Exception` lets it pass."""


def _stop_while_starting(signum: int, frame: object) -> None:
    raise StoppedWhileStarting(signal.Signals(signum).name)


def start(settings: Settings) -> int:
    """Boot and run; a TERM or INT while the app still imports (which can take seconds)
    ends it with exit 0 and one line, as a stop would: nothing was claimed yet. Once the
    master or the worker runs, its own signal traps replace these."""
    if settings.reload and settings.no_fork:
        sys.stderr.write("forkq: --reload restarts a master, and --no-fork runs none: "
                         "use --reload with --processes 1 instead\n")
        return 2
    logs.configure(settings.log_level, settings.log_format)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop_while_starting)
    try:
        # --reload execs with them blocked (reload.reexec): one sent during the exec is
        # pending until now, and ends this start as a stop during the import would
        signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGTERM, signal.SIGINT))
        return _start(settings)
    except StoppedWhileStarting as exc:
        logs.get("forkq").info("stop requested while starting; exiting before taking any job",
                               signal=str(exc))
        return 0


def _start(settings: Settings) -> int:
    since = time.time()  # --reload: a file saved while the app imports counts as a change
    try:
        load_app(settings.require)
    except ConfigError as exc:
        # only forkq's own refusals: an app's ValueError at import (a bad int() of its own
        # environment, say) keeps its traceback, as its other exceptions do, instead of
        # passing for a forkq setting in one line that says neither where nor what
        sys.stderr.write(f"forkq: {exc}\n")
        if settings.reload:
            return _wait_for_fix(settings, since, exc)
        return 2
    except Exception as exc:
        if not settings.reload:
            raise
        import traceback
        traceback.print_exc()  # the traceback it gets without --reload
        return _wait_for_fix(settings, since, exc)
    watcher = None
    if settings.reload:
        from . import reload
        watcher = reload.watcher_for(settings.require, since)
    # An app that calls structlog.configure at import (in its settings module, say) would
    # otherwise rule the master's lines, while each child sets forkq's up again after the
    # fork: the master's lines went to the app's stream and format, without pid.
    logs.configure(settings.log_level, settings.log_format)
    logs.take_stdlib_logging(settings.log_level)
    from .jobs import REGISTRY
    if not REGISTRY:
        # legal (a worker for jobs yet to be deployed), but far more often a forgotten flag
        logs.get("forkq").warning(
            "no jobs are registered: every job fetched fails as unknown and goes to retry "
            "(give --require the module or .py file that defines them)", require=settings.require)
    for line in config.unread_env():
        logs.get("forkq").warning(line)
    if ignored := config.ignored_redis_url(settings.redis_url):
        logs.get("forkq").warning(ignored)
    try:
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
        recycles = [flag for flag, value in (("--max-memory", settings.max_memory_mb),
                                             ("--max-jobs", settings.max_jobs)) if value is not None]
        if recycles:
            # a master recycles its children; a --no-fork worker has none to ask
            logs.get("forkq").warning(f"{' and '.join(recycles)} recycle the children of a master: "
                                      "with --no-fork there is none, and they are ignored")
        try:
            return end_within(EXIT_GRACE_S, run_standalone(settings))
        finally:
            logs.flush()
    from .control import pidfile
    from .supervisor import Supervisor
    if watcher is not None:
        logs.get("forkq").info("--reload: watching the app's files for changes",
                               files=len(watcher), dirs=len(watcher.dirs))
        if not sys.stdout.isatty():
            logs.get("forkq").warning(
                "--reload is for development: a deploy that writes files restarts every "
                "child at once, and a broken file leaves no worker running")
    try:
        with pidfile(settings.pidfile) as path:
            master = Supervisor(settings, pidfile=path, watcher=watcher)
            code = master.run()
            if master.reload_wanted():
                from . import reload
                # inside the with: the pidfile stays, with the same pid; returns if a stop
                # signal came in while it flushed the logs
                reload.reexec(master.stop_pending)
            if watcher is not None and master.state == "failed":
                # the children could not start (an on_fork hook raising, say): a broken edit
                # too, which the next change may fix
                return _wait_for_fix(settings, since, None, watcher)
    except ConfigError as exc:
        sys.stderr.write(f"forkq: {exc}\n")
        return 2
    return end_within(EXIT_GRACE_S, code)


def _wait_for_fix(settings: Settings, since: float, exc: BaseException | None,
                  watcher: "reload.Watcher | None" = None) -> int:
    """--reload after a broken edit: wait, holding the pidfile (`forkq ctl stop` and Ctrl-C
    still end it), until a watched file changes, then start again. Does not return but by a
    stop signal (StoppedWhileStarting)."""
    from . import reload
    from .control import pidfile
    if watcher is None:
        watcher = reload.watcher_for(settings.require, since, failed=exc)
    # a stop must end the wait: the handlers of a master that ran go, and so do any the
    # app's failed import put in place of start's (its own SIGTERM one only called it)
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop_while_starting)
    sys.stderr.write(f"forkq: --reload: waiting for a change to the app's files "
                     f"({len(watcher)} watched) to start again\n")
    sys.stderr.flush()
    try:
        with pidfile(settings.pidfile):
            changed = reload.wait_for_change(watcher)
            logs.get("forkq").info(f"reloading: {reload.shown(changed)} changed; starting again",
                                   files=len(changed))
            reload.reexec()
    except ConfigError as exc:  # the pidfile is another running master's
        sys.stderr.write(f"forkq: {exc}\n")
        return 2
    return 1  # not reached: reexec does not return


# Once the master or a --no-fork worker has stopped, what is left of its exit is the
# interpreter's: joining non-daemon threads, an executor's workers and multiprocessing
# children, then atexit handlers. A job (or an app at import) that left one of those
# running kept the stopped process alive for as long as it ran, with its stop signals
# already trapped, until systemd or Kubernetes killed it. Enough for an atexit handler
# to flush (Sentry's default is 2 s); a forked child ends at once (os._exit).
EXIT_GRACE_S = 2.0


def end_within(grace: float, code: int) -> int:
    """Return `code` for the normal exit, after arranging that the process ends with
    it `grace` seconds from now even if that exit is still waiting for something the app
    left running (a daemon thread keeps running while the interpreter waits)."""
    import threading

    def cut_short() -> None:
        time.sleep(grace)
        left = sorted(t.name for t in threading.enumerate()
                      if t.is_alive() and not t.daemon and t is not threading.main_thread())
        logs.get("forkq").warning(
            "the exit is still waiting for threads or processes the app left running; "
            "ending without them", waited_s=grace, threads=left or None)
        logs.flush_all()
        os._exit(code)

    threading.Thread(target=cut_short, name="forkq-exit", daemon=True).start()
    return code
