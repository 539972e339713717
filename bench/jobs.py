"""Jobs the benchmarks and the demo run."""

import time

import forkq


@forkq.job(queue="bench")
def noop() -> None:
    pass


@forkq.job(queue="bench")
def sleepy(seconds: float) -> None:
    time.sleep(seconds)
