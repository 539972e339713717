"""Jobs the benchmarks and the demo run."""

import os
import random
import time

import forkq


@forkq.job(queue="bench")
def noop() -> None:
    pass


@forkq.job(queue="bench")
def sleepy(seconds: float) -> None:
    time.sleep(seconds)


@forkq.job(queue="demo", retry=2)
def resize_image(image_id: int) -> None:
    # stand-in for real work: a little CPU and a little I/O wait
    sum(i * i for i in range(2000))
    time.sleep(random.uniform(0.005, 0.03))
    if image_id % 250 == 0:
        raise RuntimeError(f"image {image_id} is corrupt (a demo failure that goes to retry)")
