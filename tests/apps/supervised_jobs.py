"""Jobs for the supervisor tests (tests/test_supervisor.py), loaded with --require.

Every run is recorded as RPUSH sup:events {"event", "tag", "slot", "slot_api", "pid", ...}
on the worker's own Redis (FORKQ_REDIS_URL), so a test can tell which child ran what, in
which order: "fork" from the on_fork hook, "start"/"done" from the jobs.

SUP_FORK_DELAY=SECONDS in the environment makes the on_fork hook that slow; so does a number
in the Redis key sup:fork-delay, for the children forked after a test sets it.
"""

import json
import os
import signal
import time

import redis

import forkq

EVENTS = "sup:events"
FORK_DELAY = "sup:fork-delay"
_LEAK: list[bytes] = []


def record(event, tag=None, **extra):
    # A connection per record: nothing made at import time crosses a fork.
    entry = {"event": event, "tag": tag, "slot": os.environ.get("FORKQ_INDEX"),
             "slot_api": forkq.slot_index(), "pid": os.getpid(), "at": time.time(), **extra}
    client = redis.Redis.from_url(os.environ["FORKQ_REDIS_URL"])
    try:
        client.rpush(EVENTS, json.dumps(entry))
    finally:
        client.close()


@forkq.on_fork
def _record_fork(slot):
    record("fork", hook_slot=slot)
    # SUP_FORK_DELAY or sup:fork-delay: a slow start-up (warming caches, connecting...)
    # before any job runs
    client = redis.Redis.from_url(os.environ["FORKQ_REDIS_URL"])
    try:
        delay = client.get(FORK_DELAY)
    finally:
        client.close()
    time.sleep(float(delay or os.environ.get("SUP_FORK_DELAY", "0")))


@forkq.job(name="sup.sleep", retry=0)
def sleep_job(tag, seconds):
    record("start", tag)
    time.sleep(seconds)
    record("done", tag)


@forkq.job(name="sup.quick", retry=0)
def quick_job(tag):
    record("done", tag)


@forkq.job(name="sup.suicide", retry=0)
def suicide_job(tag):
    """A poison job: it kills the process running it, every time."""
    record("start", tag)
    os.kill(os.getpid(), signal.SIGKILL)


@forkq.job(name="sup.quit", retry=0)
def quit_job(tag):
    """A poison job of the quiet kind: it ends the process running it with status 0."""
    record("start", tag)
    os._exit(0)


@forkq.job(name="sup.leak", retry=0)
def leak_job(tag, mb, hold):
    """Allocate `mb` MB that this process keeps for good (a leak), then hold `hold` s."""
    _LEAK.append(b"\x01" * (mb << 20))  # written, so resident
    record("start", tag)
    time.sleep(hold)
    record("done", tag)


@forkq.job(name="sup.hog_once", retry=0)
def hog_once_job(tag, mb, hold):
    """First run: hold `mb` MB for `hold` s. Any later run finishes at once."""
    client = redis.Redis.from_url(os.environ["FORKQ_REDIS_URL"])
    try:
        attempt = client.incr(f"sup:attempts:{tag}")
    finally:
        client.close()
    record("start", tag, attempt=attempt)
    if attempt == 1:
        data = b"\x01" * (mb << 20)
        time.sleep(hold)
        del data
    record("done", tag, attempt=attempt)


def _disposition(sig):
    handler = signal.getsignal(sig)
    if handler is signal.default_int_handler:
        return "default_int_handler"
    if isinstance(handler, signal.Handlers):
        return handler.name
    return getattr(handler, "__qualname__", repr(handler))


def _sleep_when_told(started, sig, report):
    report.send(_disposition(sig))  # what forkq left this copy to handle `sig` with
    started.set()
    time.sleep(60)


@forkq.job(name="sup.signal_own", retry=0)
def signal_own_job(tag):
    """Send each signal a worker shrugs off to a program this job started and to a forked
    copy of this process (a multiprocessing Process), and record how each ended: a job's
    own processes must obey the signals it sends them, as they would outside forkq."""
    import multiprocessing
    import subprocess
    fork = multiprocessing.get_context("fork")
    ended = {"program": {}, "copy": {}, "copy_handler": {}}
    # (SIGQUIT is treated as SIGTERM, but would leave a core dump here)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        program = subprocess.Popen(["sleep", "60"])  # returns once exec has happened
        program.send_signal(sig)
        try:
            ended["program"][sig.name] = program.wait(2)
        except subprocess.TimeoutExpired:
            program.kill()
            program.wait()
            ended["program"][sig.name] = None
        started = fork.Event()
        reader, writer = fork.Pipe(duplex=False)
        copy = fork.Process(target=_sleep_when_told, args=(started, sig, writer))
        copy.start()
        started.wait(10)
        ended["copy_handler"][sig.name] = reader.recv() if reader.poll(10) else None
        os.kill(copy.pid, sig)
        copy.join(2)
        ended["copy"][sig.name] = copy.exitcode
        if copy.exitcode is None:
            copy.kill()
            copy.join()
        reader.close()
        writer.close()
    record("done", tag, ended=ended)


@forkq.job(name="sup.stuck", retry=1, retry_in=lambda count, exc: 1000, time_limit=0.3)
def stuck_job(tag):
    """Past its limit in one C call that never returns: the limit cannot interrupt it."""
    record("start", tag)
    import threading
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()  # a second acquire of the same lock: never returns
    record("done", tag)


@forkq.job(name="sup.spin", retry=1, retry_in=lambda count, exc: 1000, time_limit=0.3)
def spin_job(tag):
    """Python code past its limit: interrupted where it runs."""
    record("start", tag)
    while True:
        sum(range(100))
