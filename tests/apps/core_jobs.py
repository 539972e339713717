"""Jobs for the core worker tests, loaded by `forkq start --no-fork --require tests/apps/core_jobs.py`.

The worker (run from the repo root) imports this file under its dotted name
`tests.apps.core_jobs`, and tests/corekit.py imports it under that same name, so the
default job names (`tests.apps.core_jobs.record`, ...) are the same on both sides.

Every job writes what it did to Redis, so a test can poll for it:

    RPUSH core:ran  {"job": KIND, "args": [...], "pid": PID, "t": EPOCH_S}
    RPUSH core:seen <the payload as the worker handed it to the job>   (server middleware)

Records go to CORE_RECORD_URL if set, else to FORKQ_REDIS_URL: a test that restarts the
worker's Redis points CORE_RECORD_URL at another server, so recording never fails.
"""

from __future__ import annotations

import json
import os
import time

import redis

import forkq

RAN = "core:ran"
SEEN = "core:seen"

_conn: redis.Redis | None = None
_conn_pid = 0


def store() -> redis.Redis:
    """The recording connection, made on first use in each process (never at import)."""
    global _conn, _conn_pid
    if _conn is None or _conn_pid != os.getpid():
        url = os.environ.get("CORE_RECORD_URL") or os.environ["FORKQ_REDIS_URL"]
        _conn = redis.Redis.from_url(url)
        _conn_pid = os.getpid()
    return _conn


def note(kind: str, *args, **extra) -> None:
    record = {"job": kind, "args": list(args), "pid": os.getpid(), "t": time.time()}
    record.update(extra)
    store().rpush(RAN, json.dumps(record))


@forkq.server_middleware
def remember_payload(job, queue, call_next):
    store().rpush(SEEN, json.dumps(job))
    return call_next()


# -- jobs that succeed ----------------------------------------------------------------


@forkq.job
def record(*args):
    note("record", *args)


@forkq.job
def add(a, b):
    """Touches no Redis: the tests call it directly to check local calls run the function."""
    return a + b


@forkq.job(queue="mail", retry=3, name="CustomName")
def named(*args):
    note("named", *args)


@forkq.job
def sleepy(seconds, tag):
    note("start", tag)
    time.sleep(seconds)
    note("end", tag)


# -- jobs that fail -------------------------------------------------------------------


@forkq.job
def fail(tag):
    note("fail", tag)
    raise ValueError(f"boom {tag}")


@forkq.job(retry=False)
def fail_no_retry(tag):
    note("fail", tag)
    raise ValueError(f"no retry {tag}")


def _exhausted(job, exc):
    note("exhausted", job["jid"], job.get("retry_count"), type(exc).__name__)


@forkq.job(retry=0, retries_exhausted=_exhausted)
def fail_exhausted(tag):
    note("fail", tag)
    raise ValueError(f"exhausted {tag}")


@forkq.job(retry=1, retry_in=lambda count, exc: 0, retries_exhausted=_exhausted)
def fail_twice(tag):
    """One retry, due at once: the second failure exhausts it."""
    note("fail", tag)
    raise ValueError(f"twice {tag}")


@forkq.job(retry=1, retry_in=lambda count, exc: 0)
def whoami(tag):
    """Records what forkq.current_job() tells it; its first run fails, so it runs twice."""
    job = forkq.current_job()
    note("whoami", tag, jid=job["jid"], retry_count=job.get("retry_count"))
    if "retry_count" not in job:
        raise RuntimeError("the first run fails")


@forkq.job(retry=0, dead=False, retries_exhausted=_exhausted)
def fail_no_dead(tag):
    note("fail", tag)
    raise ValueError(f"no dead {tag}")


class HookedError(Exception):
    def __init__(self, mode):
        super().__init__(f"hooked {mode}")
        self.mode = mode


def _retry_in(count, exc):
    note("retry_in", count, exc.mode)
    return {"seconds": 1000, "zero": 0, "discard": "discard", "kill": "kill", "none": None}[exc.mode]


@forkq.job(retry=5, retry_in=_retry_in)
def fail_hooked(mode):
    raise HookedError(mode)


def _exiting_retry_in(count, exc):
    raise SystemExit("retry_in hook exits")


@forkq.job(retry=5, retry_in=_exiting_retry_in)
def fail_exiting_retry_in(tag):
    """A retry_in hook that raises SystemExit: the job still goes to retry."""
    note("fail", tag)
    raise ValueError(f"exiting hook {tag}")


def _interrupting_exhausted(job, exc):
    raise KeyboardInterrupt


@forkq.job(retry=0, retries_exhausted=_interrupting_exhausted)
def fail_interrupting_exhausted(tag):
    """A retries_exhausted hook that raises KeyboardInterrupt: the job still goes dead."""
    note("fail", tag)
    raise ValueError(f"interrupting hook {tag}")


@forkq.job
def fail_mutating(items, opts):
    """Works through its list arg, popping each item, and fails part way; also leaves
    something JSON cannot carry in its dict arg."""
    while items:
        item = items.pop()
        note("mutating", item)
        if item == "b":
            opts["when"] = object()
            raise ValueError(f"failed at {item}")


@forkq.job(backtrace=True)
def fail_backtrace(tag):
    _deep_raise(tag)


@forkq.job(backtrace=3)
def fail_backtrace3(tag):
    _deep_raise(tag)


def _deep_raise(tag):
    raise KeyError(f"deep {tag}")


@forkq.job(backtrace=1)
def fail_backtrace1(tag):
    _deep_index(tag)


def _deep_index(tag):
    # Python 3.11+ prints a line of carets under the failing subscript
    return {}[f"deep {tag}"]


@forkq.job(retry_queue="retries")
def fail_retry_queue(tag):
    note("fail", tag)
    raise ValueError(f"retry queue {tag}")


@forkq.job
def exits(tag):
    """Job code that calls sys.exit(): a failure of this job, not of the worker."""
    note("exits", tag)
    raise SystemExit(3)


@forkq.job(backtrace=True)
def fail_surrogate(tag):
    """An error message with a lone surrogate, as os.fsdecode() gives for a bad filename."""
    note("fail", tag)
    name = b"bad-\xff".decode("utf-8", "surrogateescape")  # 'bad-\udcff'
    raise FileNotFoundError("no such file: " + name)


@forkq.job(retries_exhausted=_exhausted)
def fail_after(seconds, tag):
    note("start", tag)
    time.sleep(seconds)
    note("fail", tag)
    raise ValueError(f"late {tag}")


@forkq.job
def forks(tag, how):
    """Job code that forks, as some libraries do, and lets the copy end its own way.

    The copy records its pid and then returns, raises, or calls sys.exit, back into the
    worker's code; the original just records that it ran.
    """
    pid = os.fork()
    if pid == 0:
        note("copy", tag, how)
        if how == "return":
            return
        if how == "exit":
            raise SystemExit(0)
        raise ValueError(f"copy {tag}")
    note("forks", tag, copy=pid)


# -- jobs with a time limit -----------------------------------------------------------


@forkq.job(time_limit=0.5, retry=1, retry_in=lambda count, exc: 1000)
def spin_limited(tag):
    """Runs Python code forever, swallowing every Exception as a careless retry loop does."""
    note("start", tag)
    while True:
        try:
            sum(range(1000))
        except Exception:
            note("swallowed", tag)


@forkq.job(retry=5)
def spin_forever(tag):
    """Runs Python code for up to 20 s with no time limit: a cancel (or a stop) ends it."""
    note("start", tag)
    end = time.monotonic() + 20
    while time.monotonic() < end:
        sum(range(1000))


@forkq.job(time_limit=5)
def quick_limited(tag):
    note("limited", tag)
