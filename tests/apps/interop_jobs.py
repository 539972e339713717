"""Jobs for the Sidekiq interop tests, loaded by a forkq worker with --require.

InteropJob has the same name as the Ruby class in tests/interop/worker.rb, so
either side can push it and either side can run it. Each run is recorded as
RPUSH interop:forkq_ran {"args": [...]} on the worker's own Redis.
"""

import json
import os

import redis

import forkq

RAN_KEY = "interop:forkq_ran"


@forkq.job(name="InteropJob", queue="default")
def interop_job(*args):
    # A connection per run: nothing made at import time can leak across a fork.
    client = redis.Redis.from_url(os.environ["FORKQ_REDIS_URL"])
    try:
        client.rpush(RAN_KEY, json.dumps({"args": list(args)}))
    finally:
        client.close()
