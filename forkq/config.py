"""Settings for `forkq start` and where each comes from: flag > environment > file > default.

Every option is declared once here: its flag, its environment variable (FORKQ_ + the flag
name), its key in `[tool.forkq]` of pyproject.toml or in a `--config` TOML file, and the
one parser that checks a value from any of those sources, so an error names the setting,
where the bad value came from, and what it accepts.
"""

from __future__ import annotations

import ipaddress
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from . import keys, logs
from .errors import ConfigError
from .queues import parse_queue
from .settings import Settings


def positive_int(text: Any) -> int:
    if isinstance(text, bool):  # a TOML true is a bool, and a bool is an int
        raise ValueError(f"must be a whole number, not {text!r}")
    try:
        value = int(text)
    except (TypeError, ValueError, OverflowError):  # OverflowError: a TOML inf
        raise ValueError(f"must be a whole number, not {text!r}") from None
    if isinstance(text, float) and text != value or value < 1:
        raise ValueError(f"must be a whole number of at least 1, not {text!r}")
    return value


def at_most(high: float, below: Callable[[Any], Any] = positive_int) -> Callable[[Any], Any]:
    """A parser (positive_int unless told) with a ceiling: a typo of a few zeros must not try
    to fork or start a million of something (the process hangs, half-started, where it
    should refuse)."""
    def parse(text: Any) -> Any:
        value = below(text)
        if value > high:
            raise ValueError(f"must be at most {high:g}, not {text!r}")
        return value
    return parse


def positive_float(text: Any) -> float:
    if isinstance(text, bool):
        raise ValueError(f"must be a number, not {text!r}")
    try:
        value = float(text)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"must be a number, not {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise ValueError(f"must be a number above 0, not {text!r}")
    return value


# The longest time setting: thread waits refuse a timeout past threading.TIMEOUT_MAX (about
# 292 years), and `--timeout 1e10` made every child die of OverflowError at stop, or
# `--poll-interval 1e10` end the scheduler thread, leaving scheduled jobs unmoved. 30 years.
SECONDS_MAX = 1e9


def seconds(text: Any) -> float:
    return at_most(SECONDS_MAX, positive_float)(text)


def port(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"must be a TCP port number (1-65535), not {value!r}")
    try:
        number = int(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"must be a TCP port number (1-65535), not {value!r}") from None
    if isinstance(value, float) and value != number or not 1 <= number <= 65535:
        raise ValueError(f"must be a TCP port number (1-65535), not {value!r}")
    return number


def bind_address(value: Any) -> str:
    """An IP address or a host name to listen on; whether it can be bound is found out at
    start, where the error names it too."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"must be an IP address or host name, such as 0.0.0.0, :: or 127.0.0.1, not {value!r}")
    value = value.strip()
    try:
        ipaddress.ip_address(value)
    except ValueError:
        if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?", value):
            raise ValueError(f"must be an IP address or host name, such as 0.0.0.0, :: or 127.0.0.1, "
                             f"not {value!r}") from None
    return value


def text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"must be a string, not {value!r}")
    return value


def switch(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    lowered = str(value).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"must be true or false, not {value!r}")


def one_of(*choices: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}, not {value!r}")
        return value
    return parse


def queue(value: Any) -> tuple[str, int]:
    try:
        return parse_queue(text(value))
    except ConfigError as exc:
        raise ValueError(f"{value!r}: " + str(exc).split(": ", 1)[-1]) from None


@dataclass(frozen=True)
class Option:
    flag: str                         # "--max-memory"; also names the env var and file key
    field: str                        # Settings attribute
    parse: Callable[[Any], Any]
    help: str
    short: str | None = None
    repeat: bool = False              # repeatable flag; whitespace-separated in env; list in a file
    is_switch: bool = False
    metavar: str | None = None
    nonempty: bool = False            # a repeatable setting that may not be an empty list
    empty_ok: bool = False            # "" is a value of its own, not a mistake (see parse_value)

    @property
    def name(self) -> str:
        return self.flag[2:]

    @property
    def dest(self) -> str:
        """The argparse attribute: the flag's name, as args.max_memory for --max-memory."""
        return self.name.replace("-", "_")

    @property
    def env(self) -> str:
        return "FORKQ_" + self.name.upper().replace("-", "_")


OPTIONS = [
    Option("--require", "require", text, "dotted module or .py file that defines jobs (repeatable)",
           "-r", repeat=True, metavar="MODULE_OR_PATH"),
    Option("--processes", "processes", at_most(1024), "child processes to fork (default: the CPUs this process may use, affinity and cgroup limit)", "-p"),
    Option("--concurrency", "concurrency", at_most(1000), "processor threads per process (default 10)", "-c"),
    Option("--queue", "queues", queue, "queue to work, NAME or NAME,WEIGHT (repeatable; default: default)",
           "-q", repeat=True, metavar="NAME[,WEIGHT]", nonempty=True),
    Option("--timeout", "timeout", seconds, "seconds running jobs get to finish at stop (default 25)", "-t"),
    Option("--redis-url", "redis_url", text, "Redis URL (default redis://127.0.0.1:6379/0)"),
    Option("--no-fork", "no_fork", switch, "run one worker in this process, without a master", is_switch=True,
           empty_ok=True),  # FORKQ_NO_FORK= is off, as in a shell
    Option("--poll-interval", "poll_interval", seconds,
           "average seconds between scheduled/retry polls, times the number of live processes (default 5)"),
    # at most a third of the heartbeat's 60 s expiry (Sidekiq's), or a live process would
    # vanish from `processes` between beats and lose a remote signal left for it
    Option("--heartbeat-interval", "heartbeat_interval", at_most(keys.HEARTBEAT_TTL_S / 3, positive_float),
           "seconds between heartbeats, at most 20; remote signals are read at each (default 5)"),
    Option("--tag", "tag", text, "tag shown in the heartbeat", empty_ok=True),
    Option("--log-level", "log_level", one_of(*logs.LEVELS), "debug, info, warning, error or critical"),
    Option("--log-format", "log_format", one_of("json", "text"),
           "json or text (default: text on a terminal, JSON otherwise)"),
    Option("--max-memory", "max_memory_mb", positive_float, "recycle a child whose RSS exceeds this many MB",
           metavar="MB"),
    Option("--max-jobs", "max_jobs", positive_int,
           "recycle a child once it has run this many jobs (a library that leaks, say)",
           metavar="N"),
    Option("--hang-timeout", "hang_timeout", seconds,
           "seconds without a ping before a child is killed as hung (default 30)"),
    Option("--time-limit-grace", "time_limit_grace", seconds,
           "seconds a job may run past its time_limit (or past an operator's cancel), stuck in a "
           "call that cannot be interrupted, before its failure is recorded without it (default 10)"),
    Option("--poison-after", "poison_after", positive_int,
           "deaths (of a child or a whole forkq) a job may cause before it goes to the dead set (default 3)"),
    Option("--recovery-delay", "recovery_delay", seconds,
           "seconds without a heartbeat before another forkq recovers a dead process's jobs (default 60)"),
    Option("--pidfile", "pidfile", text, "write the master's pid here (default $FORKQ_PIDFILE, else forkq.pid in $TMPDIR or /tmp)"),
    Option("--reload", "reload", switch,
           "restart when the app's source files change; for development, not with --no-fork",
           is_switch=True, empty_ok=True),
    Option("--metrics-port", "metrics_port", port,
           "serve Prometheus metrics from the master on this port (default: off)", metavar="PORT"),
    Option("--metrics-bind", "metrics_bind", bind_address,
           "address the metrics port listens on (default 0.0.0.0: every IPv4 interface; :: for IPv6 too)",
           metavar="ADDRESS"),
]

EMPTY = "must not be empty (leave it out for the default)"


def parse_value(o: Option, value: Any) -> Any:
    """One value of a setting, from any source. An empty string is refused unless it means
    something of its own (no tag, a switch off): set explicitly, it is a mistake, such as a
    secret or template that resolved to nothing, and taking it for the default would start
    a worker on a Redis at localhost, or with a pidfile that ctl then looks for elsewhere."""
    if isinstance(value, str) and not value.strip() and not o.empty_ok:
        raise ValueError(EMPTY)
    return o.parse(value)


# FORKQ_ variables forkq reads besides each setting's own: the configuration file, the
# TLS files of a rediss:// URL (client.TLS_ENV), the dashboard's secrets (web/command.py),
# and the slot index a master gives its children (and a job passes on to what it starts)
OTHER_ENV = frozenset({"FORKQ_CONFIG", "FORKQ_REDIS_CA", "FORKQ_REDIS_CERT", "FORKQ_REDIS_KEY",
                       "FORKQ_WEB_PASSWORD", "FORKQ_WEB_TOKEN", "FORKQ_WEB_SECRET", "FORKQ_INDEX"})

# What Kubernetes puts into every pod for a Service named forkq or forkq-something (say
# forkq-redis): FORKQ_REDIS_SERVICE_HOST, FORKQ_REDIS_PORT_6379_TCP, and a _PORT of tcp://...
_SERVICE_LINK = re.compile(r"FORKQ\w*_(SERVICE_HOST|SERVICE_PORT\w*|PORT_\d+_(TCP|UDP|SCTP)\w*)")
_SERVICE_URL = re.compile(r"(tcp|udp|sctp)://")


def unread_env(environ: Mapping[str, str] | None = None) -> list[str]:
    """One line per FORKQ_ variable that forkq does not read. A misspelt setting in the
    environment (FORKQ_QUEUE with an S, as the file's `queues` has) was ignored in silence,
    and the workers served only the default queue, while the same slip in a file is refused."""
    import difflib
    environ = os.environ if environ is None else environ
    known = sorted({o.env for o in OPTIONS} | OTHER_ENV)
    lines = []
    for name in sorted(environ):
        if not name.startswith("FORKQ_") or name in known or _SERVICE_LINK.fullmatch(name) \
                or name.endswith("_PORT") and _SERVICE_URL.match(environ[name]):
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.9)
        hint = f" (did you mean {close[0]}?)" if close else ""
        lines.append(f"{name} is not a variable forkq reads, so it is ignored{hint}")
    return lines


def ignored_redis_url(redis_url: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """A line when REDIS_URL is set but forkq runs on its default URL: Sidekiq and many
    hosting add-ons use REDIS_URL, and a worker that quietly served localhost instead
    looked idle while the jobs waited in the Redis that variable names."""
    from .client import DEFAULT_URL
    environ = os.environ if environ is None else environ
    theirs = environ.get("REDIS_URL")
    if redis_url not in (None, DEFAULT_URL) or environ.get("FORKQ_REDIS_URL") or not theirs \
            or theirs == DEFAULT_URL:
        return None
    return (f"REDIS_URL is set, but forkq reads FORKQ_REDIS_URL (or --redis-url, or redis-url "
            f"in its config file): using the default, {DEFAULT_URL}")


def given(name: str, value: str | None) -> str | None:
    """A flag or environment variable that is not a setting (--config, FORKQ_CONFIG, the
    dashboard's password): None when not given, refused when given empty, as parse_value."""
    if value is not None and not value.strip():
        raise ConfigError(f"{name if name.startswith('-') else f'{name}={value!r}:'} {EMPTY}")
    return value


def config_path(flag: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The file to read settings from: --config, else FORKQ_CONFIG, else None (meaning
    ./pyproject.toml's [tool.forkq], if any)."""
    environ = os.environ if environ is None else environ
    if flag is not None:
        return given("--config", flag)
    return given("FORKQ_CONFIG", environ.get("FORKQ_CONFIG"))


def from_env(field: str, environ: Mapping[str, str] | None = None) -> Any:
    """One setting from its FORKQ_* variable alone (None when unset), checked as resolve
    checks it: for the commands that read no file (the admin commands, forkq web)."""
    o = BY_KEY[field]
    environ = os.environ if environ is None else environ
    if o.env not in environ:
        return None
    raw = environ[o.env]
    # an empty list stays one empty value, so that parse_value names it
    return _parse(o, (raw.split() or [raw]) if o.repeat else raw, f"{o.env}={_shown(o, raw)}")


def redis_url_for_tools(flag: str | None, config_flag: str | None = None) -> str | None:
    """The Redis URL of the commands that run no worker (the admin commands, forkq web):
    the flag, else FORKQ_REDIS_URL, else redis-url in the file start reads (--config,
    FORKQ_CONFIG, ./pyproject.toml), else None for the default. The file's other settings
    are left for start to judge: a value only a worker uses must not stop `forkq stats`."""
    if flag is not None:
        return flag
    url = from_env("redis_url")
    if url is not None:
        return url
    return _from_file("redis_url", config_flag)


def require_for_tools(flags: list[str] | None, config_flag: str | None = None) -> list[str]:
    """The app modules of a command that imports the app without running a worker (`forkq
    cron`): the --require flags, else FORKQ_REQUIRE, else require in the file start reads;
    [] when none names any."""
    if flags:
        return flags
    modules = from_env("require")
    if modules is not None:
        return modules
    return _from_file("require", config_flag) or []


def _from_file(field: str, config_flag: str | None) -> Any:
    """One setting from the file start reads, None if it is not there; the file's other
    settings are left for start to judge."""
    values, name = read_file(config_path(config_flag))
    o = BY_KEY[field]
    for key, raw in values.items():
        if BY_KEY[key] is o:
            value = [raw] if o.repeat and not isinstance(raw, list) else raw
            return _parse(o, value, f"{name}: {o.name} = {_shown(o, raw)}")
    return None


def _keys() -> dict[str, Option]:
    table: dict[str, Option] = {}
    for o in OPTIONS:
        table[o.name] = o
        table[o.name.replace("-", "_")] = o
        table[o.field] = o
    return table


BY_KEY = _keys()


# how a pyproject.toml that does not parse shows it means to configure forkq
_FORKQ_TABLE = re.compile(rb"""tool\s*\.\s*["']?forkq\b""")


def read_file(path: str | None) -> tuple[dict[str, Any], str | None]:
    """Settings from --config PATH (a forkq.toml, or a pyproject.toml's [tool.forkq]), else
    from ./pyproject.toml's [tool.forkq] if present."""
    explicit = path is not None
    path = path or ("pyproject.toml" if os.path.exists("pyproject.toml") else None)
    if path is None:
        return {}, None
    where = f"--config {path}" if explicit else path
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file") from None
    except OSError as exc:  # a directory, no permission...
        raise ConfigError(f"{where}: cannot read it: {exc.strerror}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        if not explicit and not _FORKQ_TABLE.search(raw):
            # the project's file, not ours: a tool's syntax tomllib does not know yet
            # must not stop `forkq ctl stop` or a start configured by flags alone
            return {}, None
        if isinstance(exc, UnicodeDecodeError):
            raise ConfigError(f"{path}: not valid TOML: not UTF-8 at byte {exc.start}") from None
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    section = data.get("tool", {}).get("forkq") if isinstance(data.get("tool"), dict) else None
    if section is None:
        if not explicit or os.path.basename(path) == "pyproject.toml":
            return {}, None
        section = data
    if not isinstance(section, dict):
        raise ConfigError(f"{path}: [tool.forkq] must be a table")
    seen: dict[Option, str] = {}
    for key in section:
        if key not in BY_KEY:
            raise ConfigError(f"{path}: unknown setting {key!r} (known: {', '.join(o.name for o in OPTIONS)})")
        if BY_KEY[key] in seen:
            raise ConfigError(f"{path}: {seen[BY_KEY[key]]!r} and {key!r} are the same setting "
                              f"({BY_KEY[key].flag}); give it once")
        seen[BY_KEY[key]] = key
    return section, path


def resolve(flags: dict[str, Any], environ: Mapping[str, str] | None = None,
            config_path: str | None = None) -> tuple[Settings, dict[str, str]]:
    """Merge the sources; returns the settings and, per field, where its value came from."""
    environ = os.environ if environ is None else environ
    file_values, file_name = read_file(config_path)
    settings = Settings()
    sources: dict[str, str] = {o.field: "default" for o in OPTIONS}
    by_option = {BY_KEY[k]: v for k, v in file_values.items()}
    for o in OPTIONS:
        flag_value = flags.get(o.field)
        if flag_value is not None and flag_value != [] and flag_value is not False:
            setattr(settings, o.field, flag_value)
            sources[o.field] = "flag"
            continue
        if o.env in environ:
            setattr(settings, o.field, from_env(o.field, environ))
            sources[o.field] = "env"
            continue
        if o in by_option:
            raw = by_option[o]
            if o.repeat and not isinstance(raw, list):
                raw = [raw]
            setattr(settings, o.field, _parse(o, raw, f"{file_name}: {o.name} = {_shown(o, raw)}"))
            sources[o.field] = file_name or "file"
    return settings, sources


def _parse(o: Option, raw: Any, where: str) -> Any:
    try:
        if o.repeat:
            if o.nonempty and not raw:
                raise ValueError(f"needs at least one {o.metavar or 'value'}, not an empty list")
            return [parse_value(o, v) for v in raw]
        return parse_value(o, raw)
    except ValueError as exc:
        if o.field == "redis_url" and not isinstance(raw, str):
            # the parser's message would repeat the value, password and all
            exc = ValueError(f"must be a string, not {_shown(o, raw)}")
        raise ConfigError(f"{where}: {o.flag} {exc}") from None


def _shown(o: Option, raw: Any) -> str:
    """The value as an error message may show it: nothing of a Redis URL's password."""
    if o.field != "redis_url":
        return repr(raw)
    if isinstance(raw, str):
        from .masking import mask_url
        return repr(mask_url(raw))
    return f"a TOML {type(raw).__name__}"


def describe(settings: Settings, sources: dict[str, str]) -> str:
    """--print-config: every setting, its value (passwords masked) and its source."""
    from .client import mask_url, redis_url
    from .control import default_pidfile
    lines = []
    for o in OPTIONS:
        value = getattr(settings, o.field)
        if o.field == "redis_url":
            value = mask_url(redis_url(value))
        elif o.field == "pidfile" and value is None:
            value = default_pidfile()
        elif o.field == "queues":
            value = [f"{n},{w}" if w else n for n, w in value]
        lines.append(f"{o.name:20} = {value!r:40} # {sources[o.field]}")
    return "\n".join(lines)
