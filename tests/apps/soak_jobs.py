"""Jobs for tests/test_soak.py, loaded with --require.

SOAK_LINGER_AT_IMPORT=SECONDS in the environment makes this module start, as it is
imported, a non-daemon thread that sleeps that long (an app's own background thread).
"""

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import redis

import forkq

LEFT = "soak:left"  # a job records here that it has left something running
_EXECUTOR: list[ThreadPoolExecutor] = []

if os.environ.get("SOAK_LINGER_AT_IMPORT"):
    threading.Thread(target=time.sleep, args=(float(os.environ["SOAK_LINGER_AT_IMPORT"]),),
                     name="app-background", daemon=False).start()


def _sleep_in_copy(seconds):
    time.sleep(seconds)


@forkq.job(name="soak.leave_running", retry=0)
def leave_running(what, seconds):
    """Return at once, leaving `what` running for `seconds`: a non-daemon thread, a task
    on a module-level executor, or a multiprocessing child."""
    if what == "thread":
        threading.Thread(target=time.sleep, args=(seconds,), name="left-by-job", daemon=False).start()
    elif what == "executor":
        if not _EXECUTOR:
            _EXECUTOR.append(ThreadPoolExecutor(1))
        _EXECUTOR[0].submit(time.sleep, seconds)
    elif what == "process":
        import multiprocessing
        multiprocessing.get_context("fork").Process(target=_sleep_in_copy, args=(seconds,)).start()
    client = redis.Redis.from_url(os.environ["FORKQ_REDIS_URL"])
    try:
        client.rpush(LEFT, what)
    finally:
        client.close()


@forkq.job(name="soak.hold", retry=0)
def hold(blob, seconds):
    """Run `seconds` with a payload as big as `blob`."""
    time.sleep(seconds)
