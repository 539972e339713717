"""Jobs the benchmarks and the demo run."""

import time

import forkq


@forkq.job(queue="bench")
def noop() -> None:
    pass


@forkq.job(queue="bench", unique_for=600)
def unique_noop(n: int) -> None:
    pass


@forkq.job(queue="bench")
def spin(n: int) -> None:
    # pure-Python work that holds the GIL: one process can run one core's worth of it
    x = 0
    for i in range(n):
        x += i


@forkq.job(queue="bench")
def sleepy(seconds: float) -> None:
    time.sleep(seconds)


@forkq.job(queue="latency", retry=0)
def stamp(enqueued: float, key: str) -> None:
    # the first thing the job does: record how long after its enqueue it started
    started = time.time()
    forkq.default_client().redis.rpush(key, f"{started - enqueued:.6f}")
