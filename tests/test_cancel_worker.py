"""Cancelling a running job, the worker's side: a heartbeat that finds a forkq:cancel entry
for a job it runs interrupts that job with JobCancelled (through the time-limit watchdog),
and the job goes to dead, not retried, its request deleted in the same write.

The tests run a real Manager (its processor threads) and a Launcher beating every 0.1 s in
this process, against the shared Redis; the operator's side is played by an HSET of the
request, as `forkq cancel` writes it."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import structlog

import forkq
from forkq import hooks, keys
from forkq import launcher as launcher_mod
from forkq.errors import JobFailed
from forkq.timelimit import WATCHDOG
from corekit import core_jobs, forkq_client, wait_records, workers  # noqa: F401 (fixtures)
from helpers import InProcessWorkers, record_faults, switch_threads_often, wait_beats, wait_until

QUEUE = "cq"
IDENTITY = "test:1:cancel00000a"
BEAT_S = 0.1

started: dict[str, threading.Event] = {}
ran: list[str] = []
hooked: list[str] = []
release = threading.Event()  # frees the jobs stuck in an uninterruptible wait


def _mark(tag: str) -> None:
    started.setdefault(tag, threading.Event()).set()


@forkq.job(queue=QUEUE, name="cw.spin", retry=5)
def spin(tag: str) -> None:
    """Loops in Python for up to 20 s: only an exception raised in its thread ends it."""
    _mark(tag)
    end = time.monotonic() + 20
    try:
        while time.monotonic() < end and not release.is_set():
            pass
    except Exception:  # must not catch a cancel
        ran.append(f"swallowed {tag}")
    ran.append(f"spun out {tag}")


@spin.retries_exhausted
def _exhausted(job, exc):
    hooked.append(f"exhausted {job['jid']}")


@forkq.job(queue=QUEUE, name="cw.quick")
def quick(tag: str) -> None:
    ran.append(tag)


@forkq.job(queue=QUEUE, name="cw.unique_spin", unique_for=600)
def unique_spin(tag: str) -> None:
    _mark(tag)
    while not release.is_set():
        pass


@forkq.job(queue=QUEUE, name="cw.kept_spin", keep_result=60, retry=3)
def kept_spin(tag: str) -> None:
    _mark(tag)
    while not release.is_set():
        pass


@forkq.job(queue=QUEUE, name="cw.limited_spin", time_limit=10, retry=5)
def limited_spin(tag: str) -> None:
    _mark(tag)
    while not release.is_set():
        pass


@forkq.job(queue=QUEUE, name="cw.swallower")
def swallower(tag: str) -> str:
    """Catches everything, a cancel too, and returns: its job is done, not cancelled."""
    _mark(tag)
    try:
        while not release.is_set():
            pass
    except BaseException as exc:
        ran.append(f"swallowed {type(exc).__name__}")
    return "ok"


@forkq.job(queue=QUEUE, name="cw.stuck")
def stuck(tag: str) -> None:
    _mark(tag)
    release.wait(30)  # one C wait: an exception raised in the thread lands when it returns
    ran.append(f"came back {tag}")


@forkq.job(queue=QUEUE, name="cw.nap", retry=5)
async def nap(tag: str) -> None:
    _mark(tag)
    try:
        await asyncio.sleep(30)
    finally:
        ran.append(f"cleaned {tag}")


@forkq.job(queue=QUEUE, name="cw.limited_nap", time_limit=10, retry=5)
async def limited_nap(tag: str) -> None:
    _mark(tag)
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        ran.append(f"cancelled {tag}")
        raise ValueError("what the coroutine made of it")  # still ends as JobCancelled


@forkq.job(queue=QUEUE, name="cw.async_swallower", keep_result=60)
async def async_swallower(tag: str) -> str:
    """Catches its cancellation and returns, as swallower does: done too, not cancelled."""
    _mark(tag)
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        ran.append(f"swallowed {tag}")
    return "ok"


@forkq.job(queue=QUEUE, name="cw.brief")
def brief(n: int) -> int:
    end = time.perf_counter() + 0.0001 * (n % 7)
    while time.perf_counter() < end:
        pass
    return n


def _on_death(job, exc):
    hooked.append(f"death {job['jid']}")


@pytest.fixture
def running(redis_url, r, monkeypatch):
    """start(concurrency) -> (manager, launcher): started, beating every BEAT_S seconds."""
    started.clear()
    ran.clear()
    hooked.clear()
    release.clear()
    fired: list[int] = []
    monkeypatch.setattr(WATCHDOG, "on_fire", lambda: fired.append(1))
    monkeypatch.setattr(WATCHDOG, "grace", 0.5)
    monkeypatch.setattr(hooks, "ON_DEATH", [_on_death])
    # without core_jobs' recording middleware (imported for the --no-fork test): a cancel
    # landing in its Redis call leaks a pooled connection, the kind of damage the child's
    # replacement is for, and at the race test's rate the pool runs out
    monkeypatch.setattr(hooks, "SERVER_MIDDLEWARE", [])
    forkq.configure(redis_url)
    workers = InProcessWorkers(redis_url, IDENTITY, QUEUE, BEAT_S)

    def start(concurrency: int = 1):
        return workers.start(concurrency)

    start.fired = fired  # type: ignore[attr-defined]
    try:
        yield start
    finally:
        release.set()
        workers.close()


def ask_cancel(r, jid: str, by: str | None = "alice@host", reason: str | None = "wrong customer") -> float:
    """What `forkq cancel` writes (keeping a first request); returns when."""
    at = time.time()
    r.hsetnx(keys.CANCEL, jid, json.dumps({"at": at, "by": by, "reason": reason}))
    return at


def dead(r) -> list[dict]:
    return [json.loads(m) for m in r.zrange("dead", 0, -1)]


def wait_dead(r, count: int = 1, timeout: float = 5.0) -> list[dict]:
    def enough():
        got = dead(r)
        return got if len(got) >= count else None
    return wait_until(enough, timeout=timeout, interval=0.01, message=f"{count} dead entries")


def wait_counts(manager, expected: tuple[int, int], timeout: float = 5.0) -> None:
    """Wait until manager.counts() is `expected`: a thread counts its job after the job's
    body returns, so `ran` can show the job a moment before counts() does."""
    wait_until(lambda: manager.counts() == expected, timeout=timeout,
               message=f"manager.counts() == {expected}")


def wait_started(tag: str, timeout: float = 5.0) -> None:
    assert started.setdefault(tag, threading.Event()).wait(timeout), f"{tag} never started"


@pytest.mark.timeout(20)
def test_a_looping_job_is_interrupted_within_a_heartbeat_and_goes_to_dead_not_retry(running, r):
    manager, _ = running(concurrency=1)
    jid = spin.enqueue("a")  # retry=5: a failure would go to retry
    wait_started("a")
    asked = ask_cancel(r, jid)
    (entry,) = wait_dead(r)
    took = time.time() - asked
    assert took < BEAT_S + 1.0, took  # one beat, plus the write (and a busy machine)
    assert entry["jid"] == jid
    assert entry["error_class"] == "forkq.JobCancelled"
    assert entry["error_message"] == "cancelled by alice@host: wrong customer"
    assert r.zcard("retry") == 0
    assert not r.hexists(keys.CANCEL, jid), "the dead write deletes the request"
    assert hooked == [], "neither retries_exhausted nor on_death runs for a cancel"
    assert "swallowed a" not in ran and "spun out a" not in ran
    # the heartbeat thread that cancelled asks after raising in the job's thread, which
    # can write the dead entry first
    wait_until(lambda: running.fired, timeout=5,
               message="the child asking to be replaced, as after a time limit")
    assert r.hlen(f"forkq:inflight:{IDENTITY}") == 0
    # the thread goes on: the next job on it runs and succeeds
    quick.enqueue("next")
    wait_until(lambda: "next" in ran, timeout=5, message="the next job ran")
    wait_counts(manager, (2, 1))
    assert not manager.lost_thread


@pytest.mark.timeout(20)
def test_an_unreadable_request_still_cancels_and_a_foreign_one_is_left_alone(running, r, monkeypatch):
    """A hand-written entry that is no JSON still cancels ("by an operator"); a request
    for a jid this process does not run stays for whoever runs it."""
    running(concurrency=1)
    r.hset(keys.CANCEL, "elsewhere", json.dumps({"at": 1, "by": "bob", "reason": None}))
    jid = spin.enqueue("b")
    wait_started("b")
    wait_beats(r, IDENTITY)  # beats that saw the foreign request, and must not touch it
    assert r.hexists(keys.CANCEL, "elsewhere")
    assert dead(r) == []  # nor the job it runs
    r.hset(keys.CANCEL, jid, "not json")
    (entry,) = wait_dead(r)
    assert entry["error_message"] == "cancelled by an operator"
    assert r.hkeys(keys.CANCEL) == [b"elsewhere"]


@pytest.mark.timeout(20)
def test_a_unique_jobs_lock_is_released_and_a_kept_result_says_cancelled(running, r):
    running(concurrency=2)
    jid = kept_spin.enqueue("k")
    wait_started("k")
    ask_cancel(r, jid, by="carol", reason=None)
    with pytest.raises(JobFailed) as failed:
        forkq.result(jid, timeout=5)
    assert failed.value.fate == "dead"
    assert failed.value.error_class == "forkq.JobCancelled"
    assert failed.value.error_message == "cancelled by carol"

    ujid = unique_spin.enqueue("u")
    assert unique_spin.enqueue("u") is None  # its lock holds while it runs
    wait_started("u")
    ask_cancel(r, ujid)
    wait_dead(r, 2)
    assert unique_spin.enqueue("u") is not None  # its lock was released: pushable again


@pytest.mark.timeout(20)
def test_a_job_under_a_time_limit_is_cancelled_through_the_same_watchdog(running, r):
    """Its limit is disarmed by the cancel: it ends once, as cancelled, not also retried
    for its limit."""
    manager, _ = running(concurrency=1)
    jid = limited_spin.enqueue("l")
    wait_started("l")
    ask_cancel(r, jid)
    (entry,) = wait_dead(r)
    assert entry["error_class"] == "forkq.JobCancelled"
    assert r.zcard("retry") == 0 and not r.hexists(keys.CANCEL, jid)
    wait_until(lambda: running.fired, timeout=5, message="the child asking to be replaced")
    quick.enqueue("after")
    wait_until(lambda: "after" in ran, timeout=5, message="the thread ran the next job")
    wait_counts(manager, (2, 1))


@pytest.mark.timeout(20)
def test_a_cancelled_batch_job_counts_as_its_batchs_dead_failure(running, r):
    running(concurrency=1)
    with forkq.Batch() as batch:
        jid = spin.enqueue("batch")
    wait_started("batch")
    ask_cancel(r, jid)
    wait_dead(r)
    status = batch.status()
    assert status.failures[jid]["fate"] == "dead"
    assert status.failures[jid]["error_class"] == "forkq.JobCancelled"


@pytest.mark.timeout(20)
def test_an_async_job_without_a_limit_has_its_task_cancelled_and_ends_as_job_cancelled(running, r):
    running(concurrency=1)
    jid = nap.enqueue("n")
    wait_started("n")
    ask_cancel(r, jid)
    (entry,) = wait_dead(r)
    assert entry["error_class"] == "forkq.JobCancelled"  # not CancelledError
    assert "cleaned n" in ran, "its finally ran: the task was cancelled at its await"
    assert r.zcard("retry") == 0 and not r.hexists(keys.CANCEL, jid)
    assert not running.fired, "an async job cancelled at an await leaves no lock held"
    quick.enqueue("after")
    wait_until(lambda: "after" in ran, timeout=5, message="the thread ran the next job")


@pytest.mark.timeout(20)
def test_an_async_job_under_a_time_limit_is_cancelled_on_the_loop_too(running, r):
    """Its thread polls for the task (where a time limit's exception can land); the
    cancel goes to the task all the same, and whatever the coroutine raised on it, the
    job ends as JobCancelled, its limit disarmed."""
    running(concurrency=1)
    jid = limited_nap.enqueue("ln")
    wait_started("ln")
    ask_cancel(r, jid)
    (entry,) = wait_dead(r)
    assert entry["error_class"] == "forkq.JobCancelled"
    assert "cancelled ln" in ran
    assert r.zcard("retry") == 0 and not running.fired


@pytest.mark.timeout(20)
def test_an_async_job_that_swallows_its_cancel_and_returns_is_done_as_a_sync_one_is(running, r):
    """It ended as JobCancelled though it returned: dead, its value dropped, and a retry
    from dead would have run again a job that had finished (a sync job that does the same
    is done: see the test below)."""
    manager, _ = running(concurrency=1)
    jid = async_swallower.enqueue("as")
    wait_started("as")
    ask_cancel(r, jid)
    wait_until(lambda: "swallowed as" in ran, timeout=5, message="the cancel reached the task")
    wait_counts(manager, (1, 0))
    assert forkq.result(jid, timeout=0) == "ok"
    # past the grace, by the heartbeat's clock: a given-up record would have come by now
    wait_beats(r, IDENTITY, count=round(WATCHDOG.grace / BEAT_S) + 3)
    assert dead(r) == [] and r.zcard("retry") == 0 and manager.counts() == (1, 0)
    assert r.hexists(keys.CANCEL, jid), "a request the job outlived stays for the operator side"
    assert not running.fired


@pytest.mark.timeout(20)
def test_a_job_stuck_in_a_c_call_is_given_up_after_the_grace_and_records_nothing_later(running, r):
    manager, _ = running(concurrency=1)
    jid = stuck.enqueue("s")
    wait_started("s")
    asked = ask_cancel(r, jid, reason="stuck")
    (entry,) = wait_dead(r, timeout=5)
    assert time.time() - asked >= WATCHDOG.grace  # given up, not interrupted
    assert entry["error_class"] == "forkq.JobCancelled"
    assert entry["error_message"].startswith("cancelled by alice@host: stuck (the job could not be")
    assert not r.hexists(keys.CANCEL, jid)
    release.set()  # the call returns: the exception lands, and the thread records nothing more
    quick.enqueue("after")
    wait_until(lambda: "after" in ran, timeout=5, message="the thread ran the next job")
    assert "came back s" not in ran
    assert r.zcard("dead") == 1 and r.zcard("retry") == 0
    wait_counts(manager, (2, 1))


@pytest.mark.timeout(20)
def test_a_job_that_swallows_its_cancel_is_done_once_and_never_given_up_later(running, r):
    """Its return is its outcome; the watchdog forgets the cancel when the job ends (else,
    the grace past, it would record the job it thinks stuck as cancelled: done and dead),
    and a later job on the thread can be cancelled."""
    manager, _ = running(concurrency=1)
    jid = swallower.enqueue("w")
    wait_started("w")
    ask_cancel(r, jid)
    wait_until(lambda: "swallowed JobCancelled" in ran, timeout=5, message="the cancel landed")
    wait_until(lambda: manager.counts() == (1, 0), timeout=5, message="the job done")
    # past the grace, by the heartbeat's clock: what must not happen would have by now
    wait_beats(r, IDENTITY, count=round(WATCHDOG.grace / BEAT_S) + 3)
    assert dead(r) == [] and r.zcard("retry") == 0
    assert manager.counts() == (1, 0)
    assert r.hexists(keys.CANCEL, jid), "a request the job outlived stays for the operator side"
    other = spin.enqueue("x")
    wait_started("x")
    ask_cancel(r, other)
    (entry,) = wait_dead(r)
    assert entry["jid"] == other


@pytest.mark.timeout(20)
def test_an_unreadable_cancel_hash_is_logged_once_and_the_heartbeat_goes_on(running, r, monkeypatch):
    r.sadd(keys.CANCEL, "x")
    with structlog.testing.capture_logs() as logged:
        # a logger made under capture_logs: the module's may be cached by an earlier test
        monkeypatch.setattr(launcher_mod, "log", structlog.get_logger("forkq.launcher"))
        running(concurrency=1)
        spin.enqueue("w")
        wait_started("w")
        first = r.hget(IDENTITY, "beat")
        wait_until(lambda: r.hget(IDENTITY, "beat") != first, timeout=2, message="beats go on")
        wait_beats(r, IDENTITY)
    unreadable = [e for e in logged if "forkq:cancel cannot be read" in e["event"]]
    assert len(unreadable) == 1 and "WRONGTYPE" in unreadable[0]["error"]


@pytest.mark.timeout(30)
def test_cancels_racing_jobs_that_end_never_leak_into_the_next_job_or_forkq(running, r, monkeypatch,
                                                                             request):
    """Cancels aimed at a thread's jobs back to back, many landing as a job ends: each job
    ends one way (done, or dead as cancelled, once), and no JobCancelled lands outside its
    job, in forkq's own code (it would reach Processor._fault). Fails when cancel() does
    not check the thread's window (only that it still runs the job)."""
    faults = record_faults(monkeypatch)
    switch_threads_often(request)  # cancels land all over each job's end
    manager, launcher = running(concurrency=1)
    launcher.stop()  # cancels come from this test, at a far higher rate than beats
    (proc,) = manager.processors
    n = 400
    brief.enqueue_many([[i] for i in range(n)])
    fired = 0
    deadline = time.monotonic() + 20
    while manager.counts()[0] < n and time.monotonic() < deadline:
        cur = proc.current
        if cur is not None and proc.cancel(cur, b"{}"):
            fired += 1
        time.sleep(0.0002)
    processed, failed = manager.counts()
    assert processed == n
    assert faults == []
    assert not manager.lost_thread
    jids = [e["jid"] for e in dead(r)]
    assert len(jids) == failed == len(set(jids))  # each cancelled job ended once, as dead
    # many landed (a cancel's record left behind would stop every later one), none twice
    assert 10 <= failed <= fired, (failed, fired)


@pytest.mark.timeout(30)
def test_a_no_fork_worker_cancels_a_running_job(workers, forkq_client, r):
    """A real `forkq start --no-fork` process: its heartbeat finds the request and the job
    lands in dead; the process goes on (no master to replace it: it says so)."""
    worker = workers(concurrency=1, extra_args=["--heartbeat-interval", "0.2"])
    jid = core_jobs.spin_forever.enqueue("nf")
    wait_records(r, 1, worker, kind="start")
    ask_cancel(r, jid, by="ops", reason="runaway")
    (entry,) = wait_dead(r, timeout=10)
    assert entry["jid"] == jid and entry["error_class"] == "forkq.JobCancelled"
    assert entry["error_message"] == "cancelled by ops: runaway"
    assert not r.hexists(keys.CANCEL, jid)
    core_jobs.record.enqueue("after")
    wait_records(r, 1, worker, kind="record")
    worker.assert_alive()
    log = worker.log_tail()
    assert "cancelled" in log and "its time limit, or a cancel" in log
