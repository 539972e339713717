"""Job time limits (`@forkq.job(time_limit=S)`, forkq/timelimit.py): a job that runs past
its limit fails with TimeLimitExceeded in its own thread and is retried, the thread goes on
with other jobs, and a limit that fires as the job returns never leaks past the job."""

import json
import logging
import signal
import sys
import threading
import time
import traceback

import pytest

import forkq
from forkq import logs, timelimit
from forkq.errors import TimeLimitExceeded
from corekit import core_jobs, forkq_client, records, workers  # noqa: F401
from helpers import wait_until
from test_supervisor import push, start_master, sup_events, wait_event  # noqa: F401


@pytest.mark.timeout(30)
def test_a_job_past_its_limit_fails_and_its_thread_goes_on(workers, forkq_client, r):
    worker = workers(concurrency=1)  # one thread: the next jobs run only if it is freed
    jid = core_jobs.spin_limited.enqueue("spin")
    core_jobs.quick_limited.enqueue_many([[i] for i in range(3)])
    wait_until(lambda: len(records(r, "limited")) == 3, timeout=15,
               message="the jobs queued behind the runaway one")
    (member,) = r.zrange("retry", 0, -1)
    entry = json.loads(member)
    assert entry["jid"] == jid
    assert entry["error_class"].endswith("TimeLimitExceeded")
    assert "time limit of 0.5 s" in entry["error_message"]
    assert entry["retry_count"] == 0
    # it ran about its limit, not until something else stopped it
    (start,) = [rec for rec in records(r, "start") if rec["args"] == ["spin"]]
    failed_after = entry["failed_at"] - start["t"]
    assert 0.4 < failed_after < 3, failed_after
    assert not records(r, "swallowed"), "except Exception in the job must not catch the limit"
    # the last quick job's ack is batched, and may follow its record by a moment
    wait_until(lambda: r.hlen(f"forkq:inflight:{worker.identity}") == 0, timeout=5,
               message="every job acknowledged or written out of the in-flight hash")
    worker.assert_alive()


def _spin(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _more_bytecode():
    """Python code enough for an exception still pending on this thread to land in it."""
    for _ in range(200):
        pass
    _spin(0.0001)


@pytest.mark.timeout(30)
def test_jobs_ending_at_their_limit_end_one_way_each_and_never_deadlock():
    """Many jobs that end right at their limit: each ends exactly one way (returned, or
    raised TimeLimitExceeded inside its try), nothing lands in the thread's code after
    the job, and arm/disarm never deadlock (a first version, built on
    threading.Condition, hung within 300 runs: the exception landed in its Python
    __exit__ with the lock held)."""
    dog = timelimit.Watchdog()
    outcomes = {"returned": 0, "limited": 0}
    leaked = []

    def run():
        ident = threading.get_ident()
        for i in range(1500):
            limit = 0.0002 + (i % 7) * 0.00005
            try:
                try:
                    dog.arm(ident, limit, i)
                    _spin(limit)  # ends at about the limit: the two race
                finally:
                    dog.disarm(ident)
                outcomes["returned"] += 1
            except TimeLimitExceeded:
                outcomes["limited"] += 1
            try:
                _more_bytecode()
            except TimeLimitExceeded:
                leaked.append(i)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(20)
    assert not thread.is_alive(), "arm/disarm deadlocked"
    assert not leaked, f"a limit landed after its job ended, at runs {leaked[:10]}"
    assert outcomes["returned"] > 0 and outcomes["limited"] > 0, outcomes
    assert outcomes["returned"] + outcomes["limited"] == 1500


@pytest.mark.timeout(20)
def test_a_limit_firing_while_the_job_waits_to_disarm_lands_inside_the_job():
    """The interleaving that leaves an exception pending past the job: its thread ended
    the job and waits in disarm() for the lock, while the watchdog, holding it, fires.
    Played here step by step: the test holds the lock and fires as the watchdog does."""
    dog = timelimit.Watchdog()
    armed, go = threading.Event(), threading.Event()
    ended = []

    def job():
        ident = threading.get_ident()
        try:
            try:
                dog.arm(ident, 60, "jid")
                armed.set()
                go.wait()
            finally:
                dog.disarm(ident)
            ended.append("returned")
        except TimeLimitExceeded:
            ended.append("limited")
        try:
            _more_bytecode()
        except TimeLimitExceeded:
            ended.append("leaked")

    thread = threading.Thread(target=job, daemon=True)
    thread.start()
    assert armed.wait(5)
    with dog._lock:
        go.set()
        wait_until(lambda: "disarm" in "".join(
            traceback.format_stack(sys._current_frames().get(thread.ident))), timeout=5)
        dog._fire_due(time.monotonic() + 61)
    thread.join(5)
    assert ended == ["limited"]


@pytest.mark.timeout(20)
def test_a_job_blocked_in_a_call_is_logged_with_its_stack_and_fails_when_it_returns(tmp_path):
    out = tmp_path / "log"
    stream = open(out, "w")
    logs.configure(level="warning", fmt="json", stream=stream)
    dog = timelimit.Watchdog(grace=0.3)
    release = threading.Event()
    ended = []

    def job():
        ident = threading.get_ident()
        try:
            try:
                dog.arm(ident, 0.1, "jid-blocked")
                release.wait()  # one C call: the limit cannot land until it returns
                time.sleep(0)
                ended.append("returned")
            finally:
                dog.disarm(ident)
        except TimeLimitExceeded:
            ended.append("limited")

    thread = threading.Thread(target=job)
    thread.start()
    try:
        line = wait_until(lambda: [json.loads(ln) for ln in out.read_text().splitlines()
                                   if "time limit" in ln], timeout=10)
        (entry,) = line
        assert entry["jid"] == "jid-blocked" and entry["level"] == "warning"
        assert "release.wait()" in entry["stack"]
        assert not ended
    finally:
        release.set()
        thread.join(5)
        stream.close()
    assert ended == ["limited"]


@pytest.mark.timeout(20)
@pytest.mark.parametrize("how", ["limit", "cancel"])
def test_a_job_given_up_at_a_stop_has_its_stack_logged(tmp_path, how):
    """A child's stop that runs out of --timeout gives up a job stuck in a call before the
    grace does (give_up_fired): its stack goes to the log then too, as the README says."""
    out = tmp_path / "log"
    stream = open(out, "w")
    logs.configure(level="warning", fmt="json", stream=stream)
    dog = timelimit.Watchdog(grace=60)  # the stop comes long before the grace would
    release = threading.Event()
    given_up = []

    def job():
        ident = threading.get_ident()
        try:
            try:
                dog.arm(ident, 0.05 if how == "limit" else 60, "jid-stop",
                        give_up=lambda limit, over: given_up.append(limit))
                release.wait()  # one C call: nothing can land until it returns
                time.sleep(0)
            finally:
                dog.disarm(ident)
        except BaseException:
            pass

    thread = threading.Thread(target=job)
    thread.start()
    try:
        if how == "cancel":
            wait_until(lambda: dog.cancel(thread.ident, "jid-stop", lambda armed: armed,
                                          give_up=lambda limit, over: given_up.append(limit)),
                       timeout=5, message="the cancel fired")
        else:
            wait_until(lambda: thread.ident in dog._fired, timeout=5, message="the limit fired")
        dog.give_up_fired(timeout=1.0)
        assert len(given_up) == 1
        stream.flush()
        (entry,) = [json.loads(ln) for ln in out.read_text().splitlines() if "jid-stop" in ln]
        assert entry["level"] == "error"
        assert ("cancelled" in entry["event"]) == (how == "cancel")
        assert "release.wait()" in entry["stack"]
    finally:
        release.set()
        thread.join(5)
        stream.close()


@pytest.mark.timeout(10)
@pytest.mark.parametrize("bad", [0, -1, "5", True, float("nan"), float("inf"), 1e10])
def test_a_bad_time_limit_is_refused_at_import(bad):
    with pytest.raises(ValueError, match="time_limit"):
        forkq.job(name=f"bad.limit.{bad!r}", time_limit=bad)(lambda: None)


@pytest.mark.timeout(10)
def test_a_push_cannot_carry_a_time_limit():
    limited = forkq.job(name="limit.options", time_limit=3)(lambda: None)
    assert limited.time_limit == 3.0
    with pytest.raises(TypeError, match="time_limit"):
        limited.options(time_limit=10)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("job,grace,error", [
    ("sup.spin", "0.5", "ran longer than its time limit of 0.3 s"),
    ("sup.stuck", "0.5", "could not be interrupted"),  # given up by the watchdog
    ("sup.stuck", "30", "could not be interrupted"),   # given up by the replaced child's stop
], ids=["interrupted", "stuck", "stuck-past-the-stop"])
def test_a_job_past_its_limit_is_failed_once_and_its_child_replaced(start_master, redis_url, r, job, grace, error):
    """A job blocked in a call that never returns cannot be interrupted: without a hard
    end it held its thread, and its in-flight entry, for as long as the child lived. And
    an interrupted job may leave a lock of its libraries held: its child is replaced either
    way. A job still stuck when that child's stop times out is recorded as failed, not put
    back on its queue to run past its limit again in the next child, and the next."""
    m = start_master(processes=1, concurrency=2, args=["--time-limit-grace", grace, "--timeout", "1"])
    (before,) = m.wait_slots().values()
    jid = push(redis_url, job, "limited")
    (start,) = wait_event(r, m, "start", "limited")
    assert start["pid"] == before

    member = wait_until(lambda: r.zrange("retry", 0, -1), timeout=10, message=f"a retry entry\n{m.tail()}")
    entry = json.loads(member[0])
    assert entry["jid"] == jid and entry["error_class"].endswith("TimeLimitExceeded")
    assert error in entry["error_message"]
    assert entry["failed_at"] - start["at"] > 0.3

    # the child where the limit fired is replaced in its slot
    after = wait_until(lambda: (s := m.slots()) and s.get(0) not in (None, before) and s[0],
                       timeout=20, message=f"slot 0 replaced\n{m.tail()}")
    # the old child drains beside its replacement: its exit may come after the replacement
    exits = wait_until(lambda: [e for e in m.log_events("child exited") if e.get("child_pid") == before],
                       timeout=10, message=f"the replaced child exited\n{m.tail()}")
    assert exits[0]["reason"] == "time_limit"
    push(redis_url, "sup.quick", "after")
    (done,) = wait_event(r, m, "done", "after")
    assert done["pid"] == after
    # recorded once, as a failure: neither put back by the stop nor run again
    assert len(sup_events(r, "start", "limited")) == 1
    assert r.zcard("retry") == 1 and r.llen("queue:default") == 0
    m.signal(signal.SIGTERM)
    assert m.wait(20) == 0


@pytest.mark.timeout(60)
def test_a_limit_landing_in_a_jobs_stdlib_logging_never_blocks_other_threads_logging():
    """Jobs that log through the standard library (routed into forkq's lines by
    logs._ToLines) and are cut off by their limit mid-call. Before 3.13 a limit landing
    just after Handler.handle() took the handler's lock left it held: every other
    processor thread's next logging call hung for good (within a few hundred runs on 3.11
    and 3.12, the limit landing in Handler.acquire or Handler.release)."""
    # Lines go nowhere, as a worker's buffered ones mostly do: a write syscall would
    # release the GIL, and the limit would then land at its return, never at the lock
    logs.configure(level="info", fmt="json", stream=_Discard())
    handler = logs._ToLines()
    applog = logging.getLogger("forkq-test-limited-app")
    applog.propagate = False
    applog.setLevel(logging.INFO)
    applog.addHandler(handler)
    dog = timelimit.Watchdog()
    ident = threading.get_ident()
    try:
        for run in range(300):
            try:
                try:
                    dog.arm(ident, 0.002, run)
                    while True:
                        applog.info("working")
                finally:
                    dog.disarm(ident)
            except TimeLimitExceeded:
                dog.disarm(ident)
            assert dog.settle(ident)
            other = threading.Thread(target=applog.info, args=("another job",), daemon=True)
            other.start()
            other.join(5)
            assert not other.is_alive(), f"another thread's logging call hung after run {run}"
    finally:
        applog.removeHandler(handler)


class _Discard:
    def write(self, text: str) -> None:
        pass

    def flush(self) -> None:
        pass
