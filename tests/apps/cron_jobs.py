"""Periodic entries for tests/test_cron.py. `tick` comes due every second (a six-field
expression), and a server middleware records which process ran which due time:

    RPUSH cron:ran {"jid": ..., "due": ..., "pid": PID, "args": [...]}

`nightly-report` is a job another language's worker would run, never due in a test."""

from __future__ import annotations

import json
import os

import redis

import forkq

RAN = "cron:ran"
_conn: dict[int, redis.Redis] = {}


@forkq.job(name="cron.tick", queue="cron", retry=0)
def tick(label: str) -> None:
    pass


@forkq.server_middleware
def record(job, queue, call_next):
    result = call_next()
    if "cron" in job:
        conn = _conn.get(os.getpid())
        if conn is None:  # per process: never a connection made before the fork
            conn = _conn[os.getpid()] = redis.Redis.from_url(os.environ["FORKQ_REDIS_URL"])
        conn.rpush(RAN, json.dumps({"jid": job["jid"], "due": job["cron"]["due"],
                                    "pid": os.getpid(), "args": job["args"]}))
    return result


forkq.periodic("* * * * * *", tick, ["every second"], name="every-second")
forkq.periodic("30 2 * * *", "Reports::Nightly", ["daily"], tz="Europe/Paris",
               name="nightly-report", queue="reports")
