"""The demo's jobs: a little CPU and I/O each, a few failures that go to retry."""

import os
import random
import time

import forkq


@forkq.job(queue="demo", retry=3, retry_in=lambda count, exc: 1)
def resize_image(image_id: int) -> None:
    sum(i * i for i in range(3000))          # some CPU
    time.sleep(random.uniform(0.05, 0.15))   # some waiting, as on a network call
    r = forkq.default_client().redis
    if image_id % 400 == 7 and not r.sismember("demo:failed_once", image_id):
        r.sadd("demo:failed_once", image_id)
        raise RuntimeError(f"image {image_id}: storage timed out (fails once, then retries)")
    pipe = r.pipeline(transaction=False)
    pipe.sadd("demo:done", image_id)
    pipe.incr("demo:runs")
    pipe.hincrby("demo:by_slot", os.environ.get("FORKQ_INDEX", "-"), 1)
    pipe.execute()
