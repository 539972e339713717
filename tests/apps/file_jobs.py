"""Jobs that record each run by appending their number to the file FILE_JOBS_RUNS: no
Redis call inside the job, so a job's run never waits on (or is cut off by) a frozen Redis,
and only forkq's own bookkeeping decides whether a job runs twice (bench/frozen_stop.py)."""

import os
import random
import time

import forkq

_fds: dict[int, int] = {}


@forkq.job(name="file.record", queue="file", retry=0)
def record(n: int) -> None:
    time.sleep(random.random() * 0.005)
    pid = os.getpid()
    fd = _fds.get(pid)
    if fd is None:  # per process: a descriptor opened before the fork is shared
        fd = _fds[pid] = os.open(os.environ["FILE_JOBS_RUNS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(fd, f"{n}\n".encode())  # one write under O_APPEND: lines never interleave
