"""`forkq ctl`: find a master through its pidfile and signal it, or signal processes
anywhere through their `-signals` lists in Redis (as Sidekiq's Web UI does)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import psutil
import redis

from . import client, keys, logs
from .errors import ConfigError
from .fetch import pid_namespace

log = logs.get("forkq.control")


def default_pidfile() -> str:
    """Where `start` puts its pidfile when not told, so where `ctl` looks: $FORKQ_PIDFILE,
    else `pidfile` in the configuration file `start` reads ($FORKQ_CONFIG, else
    ./pyproject.toml's [tool.forkq]), else forkq.pid in the temporary directory ($TMPDIR, /tmp)."""
    if os.environ.get("FORKQ_PIDFILE"):
        return os.environ["FORKQ_PIDFILE"]
    from . import config
    values, _ = config.read_file(config.config_path(None))
    for key, value in values.items():
        if config.BY_KEY[key].field == "pidfile" and isinstance(value, str) and value:
            return value
    return _fallback_pidfile()


def _fallback_pidfile() -> str:
    return os.environ.get("FORKQ_PIDFILE") or os.path.join(tempfile.gettempdir(), "forkq.pid")


@contextlib.contextmanager
def pidfile(path: str | None) -> Iterator[str | None]:
    """Hold a pidfile for this process: written atomically, removed at exit if still ours.

    A pidfile named by the operator (flag, environment or file) that names another live
    forkq master refuses the start: this master could not be reached by `forkq ctl`. The
    built-in default is only left alone, with a warning, so that two masters started
    casually on one host still run.

    The master touches the file as its loop turns (`touch`), so `forkq ctl check` can
    tell a stuck master from a live one.
    """
    chosen = path is not None  # start resolved flag > env > file already
    path = path or _fallback_pidfile()
    other = read_pid(path)
    if other is not None and other != os.getpid() and _is_forkq_master(other):
        if chosen:
            raise ConfigError(f"--pidfile {path} belongs to forkq master {other}, which is running: "
                              "give this one a pidfile of its own")
        log.warning("pidfile belongs to another running forkq master; not writing it",
                    pidfile=path, other_pid=other)
        yield None
        return
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".forkq-pid-", dir=directory)
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()}\n")
        os.replace(tmp, path)
    except OSError as exc:
        raise ConfigError(f"--pidfile {path}: cannot write it: {exc.strerror}") from None
    try:
        yield path
    finally:
        if read_pid(path) == os.getpid():
            with contextlib.suppress(OSError):
                os.unlink(path)


def touch(path: str) -> None:
    with contextlib.suppress(OSError):
        os.utime(path)


def pidfile_age(path: str) -> float | None:
    """Seconds since the master last touched its pidfile (None: it cannot be read)."""
    try:
        return time.time() - os.stat(path).st_mtime
    except OSError:
        return None


def read_pid(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _is_forkq_master(pid: int) -> bool:
    try:
        cmdline = " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return False
    return "forkq master" in cmdline or ("forkq" in cmdline and " start" in cmdline)


def find_master(path: str | None) -> int:
    """The master's pid from its pidfile, or ConfigError saying what is wrong."""
    path = path or default_pidfile()
    pid = read_pid(path)
    if pid is None:
        raise ConfigError(f"no forkq master: pidfile {path} is missing or empty "
                          "(start with --pidfile, or pass the same --pidfile here)")
    try:
        running = psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # it exited just now
        running = False
    if not running:
        raise ConfigError(f"stale pidfile {path}: process {pid} is not running")
    if not _is_forkq_master(pid):
        raise ConfigError(f"stale pidfile {path}: process {pid} is not a forkq master")
    return pid


def signal_master(path: str | None, signum: int) -> int:
    pid = find_master(path)
    try:
        os.kill(pid, signum)
    except PermissionError:
        raise ConfigError(f"not allowed to signal master {pid}: run forkq ctl as its user") from None
    return pid


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


# -- Redis side: heartbeats and remote signals ------------------------------------------

def heartbeats(conn: redis.Redis) -> list[dict[str, Any]]:
    """Every live process's heartbeat (Sidekiq's and forkq's), parsed."""
    members = sorted(conn.smembers(keys.PROCESSES))
    if not members:
        return []
    pipe = conn.pipeline(transaction=False)
    for m in members:
        pipe.hgetall(m)
    now = time.time()
    # raise_on_error=False: a member whose key is not a hash (WRONGTYPE) is skipped, not fatal
    return [hb for m, h in zip(members, pipe.execute(raise_on_error=False))
            if (hb := parse_heartbeat(m, h, now)) is not None]


def heartbeat(conn: redis.Redis, identity: str) -> dict[str, Any] | None:
    """One process's heartbeat, parsed as heartbeats() parses each; None when it has none
    (stopped, or silent for HEARTBEAT_TTL_S)."""
    try:
        h = conn.hgetall(identity)
    except redis.ResponseError:  # not a hash
        return None
    return parse_heartbeat(identity.encode(), h, time.time())


def parse_heartbeat(member: bytes, h: Any, now: float) -> dict[str, Any] | None:
    if not isinstance(h, dict) or not h:
        return None
    try:
        info = json.loads(h.get(b"info", b"{}"))
    except ValueError:
        info = {}
    if not isinstance(info, dict):  # a heartbeat written by something else: show what parses
        info = {}
    beat = _number(h.get(b"beat"), float)
    return {"identity": member.decode("utf-8", "replace"), "info": info,
            "busy": _number(h.get(b"busy"), int), "quiet": h.get(b"quiet") == b"true",
            "rss_kb": _number(h.get(b"rss"), int),
            # Sidekiq 8.1.2+ keeps its thread count here and no longer in info
            "concurrency": _number(h.get(b"concurrency"), int) or None,
            "beat_age": now - beat if beat and math.isfinite(beat) else None,
            # the paused queues this process honours (forkq's own field; see pause.py);
            # None from a process that never reads pauses (Sidekiq, an older forkq)
            "paused": _names(h[b"forkq_paused"]) if b"forkq_paused" in h else None}


def _names(raw: bytes | None) -> list[str]:
    try:
        names = json.loads(raw) if raw else []
    except ValueError:
        return []
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []


def _number(raw: bytes | None, kind: type) -> Any:
    """A heartbeat field as a number; 0 when missing or not a number (one bad heartbeat in
    Redis must not break `ctl check`, `forkq processes` or the dashboard)."""
    try:
        return kind(raw or 0)
    except (TypeError, ValueError, OverflowError):
        return 0


def remote_targets(conn: redis.Redis, *, identity: str | None = None, host: str | None = None,
                   everyone: bool = False) -> tuple[list[str], list[str]]:
    """(targets, left alone): the identities a remote quiet or stop reaches, and those a
    `host` or `everyone` matched but that are no forkq (Ruby Sidekiq sharing the Redis).

    Only an `identity` reaches any process: on a Redis a Ruby Sidekiq fleet shares (a
    migration), `forkq ctl stop --host H` in a deploy of forkq must not stop the Ruby
    workers on H. Sidekiq's own Web UI's Quiet All and Stop All still reach everyone."""
    targets, others = [], []
    for hb in heartbeats(conn):
        if hb["identity"] == identity:
            targets.append(hb["identity"])
        elif everyone or (host is not None and hb["info"].get("hostname") == host):
            (targets if hb["info"].get("forkq") is True else others).append(hb["identity"])
    return targets, others


def remote_signal(conn: redis.Redis, signame: str, *, identity: str | None = None,
                  host: str | None = None, everyone: bool = False) -> list[str]:
    """LPUSH signame onto each target's `-signals` list (remote_targets); returns the
    identities signalled."""
    targets, _ = remote_targets(conn, identity=identity, host=host, everyone=everyone)
    if not targets:
        return []
    pipe = conn.pipeline(transaction=False)
    for t in targets:
        pipe.lpush(keys.signals(t), signame)
        pipe.expire(keys.signals(t), keys.HEARTBEAT_TTL_S)
    pipe.execute()
    return targets


def children_of(master_pid: int, conn: redis.Redis) -> list[dict[str, Any]]:
    """The master's children with their heartbeats (matched by host and pid, in our pid
    namespace)."""
    host = socket.gethostname()
    elsewhere = _other_pid_namespaces(conn, host)
    by_pid = {}
    for hb in heartbeats(conn):
        info = hb["info"]
        if (info.get("hostname") == host and isinstance(info.get("pid"), int)
                and hb["identity"] not in elsewhere):
            by_pid[info["pid"]] = hb
    try:
        children = psutil.Process(master_pid).children()
    except psutil.NoSuchProcess:  # exited since find_master() saw it
        raise ConfigError(f"master {master_pid} has exited") from None
    rows = []
    for child in children:
        try:
            rss_mb = child.memory_info().rss / 1_048_576
        except psutil.Error:
            continue
        beat = by_pid.get(child.pid)
        rows.append({"pid": child.pid, "slot": beat["info"].get("slot") if beat else None,
                     "busy": beat["busy"] if beat else None,
                     "concurrency": beat["info"].get("concurrency") if beat else None,
                     "quiet": beat["quiet"] if beat else None, "rss_mb": rss_mb,
                     "beat_age": beat["beat_age"] if beat else None})
    return sorted(rows, key=lambda r: (r["slot"] is None, r["slot"] or 0, r["pid"]))


def _other_pid_namespaces(conn: redis.Redis, host: str) -> set[str]:
    """Identities of forkq processes with our host name whose pids are not ours to read.

    Containers given one hostname (hostNetwork pods on a node, compose's `hostname:`) each
    number their processes from 1, so their children have the same pids: matched by host
    and pid alone, `ctl check` in one container judged it by another's heartbeats, passing
    a container whose children had stopped beating (or failing a healthy one). The owners
    registry records each process's pid namespace; a process not in it (or from a forkq
    that did not record one) is matched as before."""
    here = pid_namespace()
    if here is None:
        return set()
    out = set()
    for identity, raw in conn.hgetall(keys.OWNERS).items():
        try:
            info = json.loads(raw)
        except ValueError:
            continue
        if (isinstance(info, dict) and info.get("host") == host
                and isinstance(info.get("pidns"), str) and info["pidns"] != here):
            out.add(identity.decode("utf-8", "replace"))
    return out


def redis_for_ctl() -> redis.Redis:
    return client.connect(None, socket_timeout=5)
