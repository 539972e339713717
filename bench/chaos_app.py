"""The app `python3 -m bench.chaos --minutes N` runs under faults (loaded with --require).

Every job takes a key (the driver's name for it: `p12`, `s3`, `u7`, `b2.5`, `c4.1`, `cb2`)
and, when it runs to its end, records that run with one atomic command:
`HSET soak:runs <uuid4> "key jid retry_count pid time"`. One field per run, so a write
retried after a lost reply (Redis restarting under it) still counts that run once, and the
fields of a key are exactly its completed runs. A job given fail_once raises on its first
attempt (`HSETNX soak:failed key`), so it goes through the retry set; `retry_in` brings it
back at once (any delay above 0 gets Sidekiq's jitter of up to 9 s).

Redis calls go to the worker's own Redis (FORKQ_REDIS_URL), through a client per process.
"""

from __future__ import annotations

import os
import random
import time
import uuid

import redis

import forkq

RUNS = "soak:runs"
FAILED = "soak:failed"
QUEUES = ("soak", "soak2")
_clients: dict[int, redis.Redis] = {}


class SoakFailure(Exception):
    """The deliberate first failure of a fail_once job."""


def _client() -> redis.Redis:
    pid = os.getpid()
    c = _clients.get(pid)
    if c is None:
        c = _clients[pid] = redis.Redis.from_url(os.environ["FORKQ_REDIS_URL"], socket_timeout=5)
    return c


def _write(fn, *args):
    """Ride out a Redis restart or pause: both writes are idempotent, so retrying is safe."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return fn(*args)
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _run(key: str, fail_once: bool) -> None:
    time.sleep(random.uniform(0, 0.2))
    c = _client()
    if fail_once and _write(c.hsetnx, FAILED, key, 1):
        raise SoakFailure(f"{key} fails once on purpose")
    job = forkq.current_job() or {}
    _write(c.hset, RUNS, uuid.uuid4().hex,
           f"{key} {job.get('jid')} {job.get('retry_count', '-')} {os.getpid()} {time.time():.6f}")


def _retry_soon(count, exc):
    return 0


@forkq.job(name="soak.work", queue="soak", retry=5, retry_in=_retry_soon)
def work(key: str, fail_once: bool = False) -> None:
    _run(key, fail_once)


@forkq.job(name="soak.unique", queue="soak", retry=5, retry_in=_retry_soon, unique_for=300)
def unique(key: str, fail_once: bool = False) -> None:
    _run(key, fail_once)


@forkq.job(name="soak.callback", queue="soak2", retry=5, retry_in=_retry_soon)
def callback(key: str) -> None:
    _run(key, False)
