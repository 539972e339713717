"""Cancelling jobs, from an adversarial review: cancels that reach the worker at awkward
moments (an async job whose event loop is just starting, a coroutine deaf to its
cancellation), and the operator's side with odd input (a reason UTF-8 cannot carry, a job
claimed by a forkq that reads no cancel requests).

The worker tests run a real Manager in this process against the shared Redis, as
test_cancel_worker does, and fire the cancels at the processor as its heartbeat would;
one starts a real master (tests/apps/cancel_jobs.py)."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import pytest

import forkq
from forkq import aio, api, hooks, keys
from forkq.timelimit import WATCHDOG
from helpers import InProcessWorkers, record_faults, switch_threads_often, wait_until
from test_supervisor import APPS, push, start_master, sup_events, wait_event  # noqa: F401

QUEUE = "rq"
IDENTITY = "test:1:revcancel0a"
BEAT_S = 0.1


def _spin(n: int) -> None:
    end = time.perf_counter() + 0.0001 * (n % 7)
    while time.perf_counter() < end:
        pass


@forkq.job(queue=QUEUE, name="rc.async_brief")
async def async_brief(n: int) -> int:
    _spin(n)
    await asyncio.sleep(0)
    return n


@forkq.job(queue=QUEUE, name="rc.async_quick")
async def async_quick(tag: str) -> str:
    await asyncio.sleep(0)
    return tag


@forkq.job(queue=QUEUE, name="rc.spin", retry=3)
def spin() -> None:
    end = time.monotonic() + 20
    while time.monotonic() < end:
        pass


@pytest.fixture
def running(redis_url, r, monkeypatch):
    monkeypatch.setattr(WATCHDOG, "on_fire", lambda: None)
    monkeypatch.setattr(WATCHDOG, "grace", 0.5)
    monkeypatch.setattr(hooks, "SERVER_MIDDLEWARE", [])
    forkq.configure(redis_url)
    workers = InProcessWorkers(redis_url, IDENTITY, QUEUE, BEAT_S)
    start = workers.start

    try:
        yield start
    finally:
        workers.close()


def dead(r) -> list[dict]:
    return [json.loads(m) for m in r.zrange("dead", 0, -1)]


@pytest.mark.timeout(30)
def test_cancels_racing_async_jobs_never_hang_their_thread(running, r, monkeypatch, request):
    """Cancels fired at a thread's async jobs back to back: each job ends once (done, or
    dead as cancelled), nothing lands in forkq's code, and the thread never hangs. Before
    cancel_run took the run before the loop starts, a cancel landing in the loop's start-up
    (which an interrupted start leaves to the next job) hung the thread in most runs."""
    faults = record_faults(monkeypatch)
    switch_threads_often(request)
    aio.shutdown()  # the first job starts the loop, as in a new child
    before = set(_loop_threads())  # any that another test left, stopping
    manager, launcher = running(concurrency=1)
    launcher.stop()  # cancels come from this test, far faster than beats
    (proc,) = manager.processors
    n = 200
    async_brief.enqueue_many([[i] for i in range(n)])
    deadline = time.monotonic() + 15
    while manager.counts()[0] < n and time.monotonic() < deadline:
        cur = proc.current
        if cur is not None:
            proc.cancel(cur, b"{}")
        time.sleep(0.0002)
    processed, failed = manager.counts()
    assert processed == n, (processed, failed)
    assert faults == [] and not manager.lost_thread
    jids = [e["jid"] for e in dead(r)]
    assert len(jids) == failed == len(set(jids)) and r.zcard("retry") == 0
    assert len(set(_loop_threads()) - before) == 1

def _loop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "forkq-asyncio" and t.is_alive()]


@pytest.mark.timeout(20)
def test_a_cancel_as_the_first_async_job_starts_the_loop_leaves_one_loop(running, r, monkeypatch):
    """The first async job of a process starts the event loop inside the job's run. A
    cancel arriving then was raised in the thread (no task to cancel yet) and landed in
    the loop's start-up, past its thread's start and before the loop was recorded: an
    event loop thread left running for nothing, another started by the next async job,
    and (landing inside threading's own code) a processor thread waiting for good with
    aio's lock held. The cancel must reach the job through the run, not the thread."""
    aio.shutdown()
    assert aio._loop is None
    before = set(_loop_threads())  # any that another test left, stopping
    manager, launcher = running(concurrency=1)
    launcher.stop()  # the cancel comes from the test, exactly as the loop starts
    (proc,) = manager.processors
    real_thread = threading.Thread
    fired = []

    class Thread(real_thread):
        def start(self):
            super().start()
            if self.name == "forkq-asyncio" and not fired:
                # from another thread, as the heartbeat's, at this very moment
                cur = proc.current
                beat = real_thread(target=lambda: fired.append(proc.cancel(cur, b'{"by": "rev"}')))
                beat.start()
                beat.join()
                end = time.monotonic() + 0.05
                while time.monotonic() < end:  # Python code: a raised exception lands here
                    pass

    monkeypatch.setattr(aio.threading, "Thread", Thread)
    jid = async_quick.enqueue("first")
    (entry,) = wait_until(lambda: dead(r), timeout=5, message="the cancelled job in dead")
    assert fired == [True]
    assert entry["jid"] == jid and entry["error_class"] == "forkq.JobCancelled"
    monkeypatch.setattr(aio.threading, "Thread", real_thread)
    again = async_quick.enqueue("second")
    wait_until(lambda: manager.counts() == (2, 1), timeout=5, message="the next async job done")
    assert r.zcard("dead") == 1 and again != jid
    assert set(_loop_threads()) - before == {aio._thread}, _loop_threads()


@pytest.mark.timeout(60)
def test_an_async_job_deaf_to_its_cancel_is_given_up_and_its_child_replaced(start_master, redis_url, r):
    """A coroutine that swallows its CancelledError keeps its processor thread waiting
    for its task: once the cancel is given up (recorded as cancelled without it), only a
    new process gets that thread back. A sync job's cancel asks for the replacement as it
    interrupts; an async job's, handled on the loop, did not, nor did the give-up in a
    child: the child went on with a thread fewer for as long as the coroutine ran."""
    m = start_master(processes=1, concurrency=2, app=APPS / "cancel_jobs.py",
                     args=["--time-limit-grace", "0.5", "--heartbeat-interval", "0.2", "--timeout", "1"])
    (before,) = m.wait_slots().values()
    jid = push(redis_url, "cancel.deaf", "deaf")
    (start,) = wait_event(r, m, "start", "deaf")
    assert start["pid"] == before
    r.hset(keys.CANCEL, jid, json.dumps({"at": time.time(), "by": "rev", "reason": "deaf"}))
    (entry,) = wait_until(lambda: dead(r), timeout=10, message=f"the job in dead\n{m.tail()}")
    assert entry["jid"] == jid and entry["error_class"] == "forkq.JobCancelled"
    assert "could not be interrupted" in entry["error_message"]
    after = wait_until(lambda: (s := m.slots()) and s.get(0) not in (None, before) and s[0],
                       timeout=15, message=f"slot 0 replaced\n{m.tail()}")
    # the old child drains beside its replacement: its exit may come after the replacement
    exited = wait_until(lambda: [line for line in m.tail().splitlines() if "child exited" in line],
                        timeout=10, message=f"the replaced child exited\n{m.tail()}")
    assert "cancel" in exited[-1] and "time_limit" not in exited[-1], exited
    push(redis_url, "cancel.quick", "after")
    (done,) = wait_event(r, m, "done", "after")
    assert done["pid"] == after
    assert sup_events(r, "done", "deaf") == []
    m.signal(signal.SIGTERM)
    assert m.wait(20) == 0



@pytest.mark.timeout(40)
def test_a_child_replaced_after_a_cancel_is_counted_as_cancel_not_time_limit(start_master, redis_url, r):
    """The master replaces a child after a cancel interrupted one of its jobs, as after a
    time limit, and says which it was (log, forkq_child_restarts_total)."""
    m = start_master(processes=1, concurrency=2, app=APPS / "cancel_jobs.py",
                     args=["--heartbeat-interval", "0.2", "--timeout", "1"])
    (before,) = m.wait_slots().values()
    jid = push(redis_url, "cancel.spin", "spin")
    wait_event(r, m, "start", "spin")
    r.hset(keys.CANCEL, jid, json.dumps({"at": time.time(), "by": "rev", "reason": "spin"}))
    (entry,) = wait_until(lambda: dead(r), timeout=10, message=f"the job in dead\n{m.tail()}")
    assert entry["jid"] == jid and entry["error_class"] == "forkq.JobCancelled"
    wait_until(lambda: (s := m.slots()) and s.get(0) not in (None, before), timeout=15,
               message=f"slot 0 replaced\n{m.tail()}")
    # the old child drains beside its replacement: its exit may come after the replacement
    exited = wait_until(lambda: [line for line in m.tail().splitlines() if "child exited" in line],
                        timeout=10, message=f"the replaced child exited\n{m.tail()}")
    assert "cancel" in exited[-1] and "time_limit" not in exited[-1], exited
    m.signal(signal.SIGTERM)
    assert m.wait(20) == 0


@pytest.mark.timeout(20)
def test_a_reason_utf8_cannot_carry_is_refused_before_anything_is_written(redis_url, r):
    """api.cancel wrote the request, then failed moving the job with a UnicodeEncodeError
    from deep in redis-py: the job left waiting with a request standing, for a worker to
    cancel it later by surprise. A clear ValueError first, and nothing written."""
    forkq.configure(redis_url)
    try:
        jid = spin.enqueue()
        for kwargs in ({"reason": "why\udcff"}, {"by": "\ud800ops"}):
            with pytest.raises(ValueError, match="not text UTF-8 can carry"):
                api.cancel(r, jid, wait=0, **kwargs)
        assert r.hlen(keys.CANCEL) == 0 and r.llen(f"queue:{QUEUE}") == 1 and r.zcard("dead") == 0
        assert api.cancel(r, jid, reason="why", wait=0).state == "removed"
    finally:
        forkq.client._default = None


@pytest.mark.timeout(20)
def test_a_job_claimed_by_a_forkq_that_reads_no_cancels_is_not_forkq_not_pending(redis_url, r):
    """A forkq from before cancels (in a rolling upgrade) holds the job in flight, not yet
    in its running jobs (claimed since its last beat): the cancel waited on it as on a
    process that reads requests, said "pending" ("its worker stops it at its next
    heartbeat", which it never does) and left the request standing."""
    identity = "old:7:forkq0000001"
    jid = "%024x" % 77
    job = {"class": "app.Thing", "args": [], "jid": jid, "queue": "a"}
    r.sadd(keys.PROCESSES, identity)
    r.hset(keys.OWNERS, identity, "{}")
    r.hset(identity, mapping={"beat": 100.0, "busy": 1, "info": json.dumps(
        {"hostname": "h", "pid": 7, "forkq": True})})  # no "forkq_cancel"
    r.hset(keys.inflight(identity), "tok", "a\n" + json.dumps(job))
    assert api.locate(r, jid).forkq is False
    out = api.cancel(r, jid, wait=1.0, poll=0.05)
    assert (out.state, out.where.state) == ("not_forkq", "claimed"), out
    assert not r.hexists(keys.CANCEL, jid)


@pytest.mark.parametrize("on_the_loop", [False, True], ids=["sync", "async"])
@pytest.mark.timeout(10)
def test_a_cancel_given_up_asks_for_the_replacement_as_a_cancel_not_a_time_limit(on_the_loop):
    """A cancelled job still running `grace` later is given up, and the give-up asks the
    master for a fresh process. It wrote L, a time limit's byte, whatever was given up:
    a sync job's C was overridden (a limit's reason wins) and an async job's cancel, which
    writes nothing as it fires, was always counted as time_limit."""
    import os

    from forkq.settings import Settings
    from forkq.supervisor import Supervisor
    from forkq.timelimit import Watchdog
    from forkq.worker import Worker
    from test_supervisor import _close_children, _pinging_children
    dog = Watchdog()
    dog.grace = 0.1
    read, write = os.pipe()
    os.set_blocking(read, False)
    worker = Worker.__new__(Worker)  # only its report pipe: what a child writes its master
    worker.report_fd = write
    dog.on_fire, dog.on_cancel, dog.on_give_up = worker._interrupted, worker._cancelled, worker._stuck_thread
    given_up = threading.Event()
    # a thread id no thread has: nothing to raise in, and the give-up comes `grace` later
    assert dog.cancel(2**40 + 7, "j1", lambda armed: True, lambda limit, over: given_up.set(),
                      interrupt=(lambda: True) if on_the_loop else None)
    wait_until(given_up.is_set, timeout=5, message="the cancel given up")
    written = b""

    def asked_twice_or_once() -> bool:
        nonlocal written
        try:
            written += os.read(read, 64)
        except BlockingIOError:
            pass
        return written.count(b"\n") == (1 if on_the_loop else 2)
    wait_until(asked_twice_or_once, timeout=5, message="the give-up's report")
    sup = Supervisor(Settings(processes=1))
    made = _pinging_children(sup, range(1))
    try:
        (child, report_w, _), = made
        os.write(report_w, written)
        assert sup.read_report(child)
        assert child.stuck == "cancel", written
    finally:
        for fd in (read, write, sup._sig_r, sup._sig_w):
            os.close(fd)
        _close_children(made)
