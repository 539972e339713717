"""A job that reports what its process's environment holds, for environment tests."""

import json
import os

import forkq


@forkq.job(name="env.report", retry=0)
def report(key: str) -> None:
    names = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "FORKQ_INDEX")
    forkq.default_client().redis.rpush(key, json.dumps({n: os.environ.get(n) for n in names}))
