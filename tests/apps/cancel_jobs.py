"""Jobs for tests/test_review_cancel.py's master test, loaded with --require: each run
recorded as in supervised_jobs (RPUSH sup:events), so the supervisor tests' helpers read it."""

import asyncio
import json
import os
import time

import redis

import forkq

EVENTS = "sup:events"


def record(event, tag=None, **extra):
    entry = {"event": event, "tag": tag, "slot": os.environ.get("FORKQ_INDEX"),
             "pid": os.getpid(), "at": time.time(), **extra}
    client = redis.Redis.from_url(os.environ["FORKQ_REDIS_URL"])
    try:
        client.rpush(EVENTS, json.dumps(entry))
    finally:
        client.close()


@forkq.job(name="cancel.deaf", retry=0)
async def deaf_job(tag):
    """Swallows every cancellation of its task, for up to 30 s."""
    record("start", tag)
    end = time.monotonic() + 30
    while time.monotonic() < end:
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            pass
    record("done", tag)


@forkq.job(name="cancel.quick", retry=0)
def quick_job(tag):
    record("done", tag)


@forkq.job(name="cancel.spin", retry=0)
def spin_job(tag):
    """Python code for up to 30 s: a cancel interrupts it between bytecodes."""
    record("start", tag)
    end = time.monotonic() + 30
    while time.monotonic() < end:
        sum(range(100))
    record("done", tag)
