"""What the fault-run apps (bench/chaos_app.py, tests/apps/chaos_jobs.py) share: a Redis
client per process and a write that rides out a Redis restart or pause.

Both apps are loaded by `--require` path into a master started with the repository on
PYTHONPATH (bench.common.start_master, bench.chaos's soak), so `bench` is importable there;
`tests` is not a package, only a namespace one, which any installed `tests` package hides.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

import redis

T = TypeVar("T")
_clients: dict[int, redis.Redis] = {}


def client() -> redis.Redis:
    """This process's client to FORKQ_REDIS_URL (one made before a fork is never used after)."""
    pid = os.getpid()
    c = _clients.get(pid)
    if c is None:
        c = _clients[pid] = redis.Redis.from_url(os.environ["FORKQ_REDIS_URL"], socket_timeout=5)
    return c


def write(fn: Callable[..., T], *args: object) -> T:
    """Call fn(*args) until Redis takes it (60 s at most): only for idempotent writes, as a
    reply lost in a restart makes the retry send the write a second time."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return fn(*args)
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
