"""Jobs for orphan-recovery tests: each run is recorded with the pid and host that ran it."""

import os
import socket
import time

import forkq


@forkq.job(name="orphan.work", retry=0)
def work(tag: str, seconds: float) -> None:
    time.sleep(seconds)
    forkq.default_client().redis.rpush("orphan:ran", f"{tag}:{os.getpid()}:{socket.gethostname()}")
