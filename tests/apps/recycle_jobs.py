"""Jobs for tests/test_recycle_overlap.py, loaded with --require.

Each run is recorded as RPUSH sup:events {"event", "tag", "slot", "pid", "at"}, as
supervised_jobs.py records them, so the helpers of test_supervisor.py read them.
`recycle.hold` runs, on its first run only, until the test sets the key
`recycle:release:TAG`: a long job whose end the test decides, holding a child in its drain
for as long as the test needs. A run after that (put back by a crash) ends at once.
"""

import json
import os
import time

import redis

import forkq

EVENTS = "sup:events"


def _redis() -> redis.Redis:
    # a connection per use: nothing made at import time crosses a fork
    return redis.Redis.from_url(os.environ["FORKQ_REDIS_URL"])


def record(event, tag, **extra):
    entry = {"event": event, "tag": tag, "slot": os.environ.get("FORKQ_INDEX"),
             "pid": os.getpid(), "at": time.time(), **extra}
    client = _redis()
    try:
        client.rpush(EVENTS, json.dumps(entry))
    finally:
        client.close()


@forkq.job(name="recycle.hold", retry=0)
def hold_job(tag):
    client = _redis()
    try:
        attempt = client.incr(f"recycle:attempts:{tag}")
        record("start", tag, attempt=attempt)
        deadline = time.monotonic() + 30
        while (attempt == 1 and not client.exists(f"recycle:release:{tag}")
               and time.monotonic() < deadline):
            time.sleep(0.02)
    finally:
        client.close()
    record("done", tag, attempt=attempt)


@forkq.job(name="recycle.quick", retry=0)
def quick_job(tag):
    record("start", tag)
    record("done", tag)
