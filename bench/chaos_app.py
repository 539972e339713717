"""The app `python3 -m bench.chaos --minutes N` runs under faults (loaded with --require).

Every job takes a key (the driver's name for it: `p12`, `s3`, `u7`, `b2.5`, `c4.1`, `cb2`)
and, when it runs to its end, records that run with one atomic command:
`HSET soak:runs <uuid4> "key jid retry_count pid time"`. One field per run, so a write
retried after a lost reply (Redis restarting under it) still counts that run once, and the
fields of a key are exactly its completed runs. A job given fail_once raises on its first
attempt (`HSETNX soak:failed key`), so it goes through the retry set; `retry_in` brings it
back at once (any delay above 0 gets Sidekiq's jitter of up to 9 s).

`soak.items` is an iterable job: item i of job key `i7` records itself as key `i7.i`, then
yields i; with fail_once, one item (the middle one) raises on its first run, so the retry
resumes from the cursor the failure wrote.

Redis calls go to the worker's own Redis (FORKQ_REDIS_URL), through bench/jobkit.py's
client per process.
"""

from __future__ import annotations

import os
import random
import time
import uuid

import forkq
from bench.jobkit import client, write

RUNS = "soak:runs"
FAILED = "soak:failed"
QUEUES = ("soak", "soak2")


class SoakFailure(Exception):
    """The deliberate first failure of a fail_once job."""


def _run(key: str, fail_once: bool, pause: float = 0.2) -> None:
    time.sleep(random.uniform(0, pause))
    c = client()
    if fail_once and write(c.hsetnx, FAILED, key, 1):
        raise SoakFailure(f"{key} fails once on purpose")
    job = forkq.current_job() or {}
    write(c.hset, RUNS, uuid.uuid4().hex,
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


@forkq.job(name="soak.items", queue="soak2", retry=5, retry_in=_retry_soon, iterable=True)
def items(key: str, count: int, fail_once: bool = False, cursor=None):
    for i in range(0 if cursor is None else cursor + 1, count):
        _run(f"{key}.{i}", fail_once and i == count // 2, pause=0.1)
        yield i
