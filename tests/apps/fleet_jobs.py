"""Jobs for the fleet tests (tests/test_fleet.py): several masters on one Redis.

Each run is counted in Redis from inside the job, per tag: HINCRBY fleet:starts as it
begins, fleet:runs as it ends, so a test sees a job that started twice even if one of the
runs was cut off."""

import time

import forkq


@forkq.job(name="fleet.work", retry=0)
def work(tag: str, seconds: float) -> None:
    client = forkq.default_client().redis
    client.hincrby("fleet:starts", tag, 1)
    time.sleep(seconds)
    client.hincrby("fleet:runs", tag, 1)
