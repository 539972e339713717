"""`async def` jobs (forkq/aio.py): run on one event loop per worker process, in the
processor thread's context, under time limits, retries and results as sync jobs are.

The worker-side tests drive a real Manager by hand against the shared Redis; one test
runs them in the children of a real `forkq start` master."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import threading
import time

import pytest
import structlog

import forkq
from forkq import aio, hooks, limiter, logs, testing, timelimit
from forkq.manager import Manager
from forkq.queues import QueueOrder
from corekit import hand_driven_fixture, no_middleware, run_one  # noqa: F401 (a fixture)
from helpers import wait_until
from test_supervisor import push, start_master, sup_events, wait_event  # noqa: F401 (a fixture)

QUEUE = "aq"
seen: list[dict] = []
events: dict[str, asyncio.Event] = {}
cleaned: list[str] = []
release_stubborn = threading.Event()


@forkq.job(name="aio.compute", queue=QUEUE, keep_result=60)
async def compute(a, b):
    await asyncio.sleep(0)
    job = forkq.current_job()
    seen.append({"jid": job and job["jid"], "thread": threading.current_thread().name,
                 "bound": structlog.contextvars.get_contextvars(),
                 "fields": logs._add_job(None, "info", {}),  # what a line logged here carries
                 "loop": id(asyncio.get_running_loop())})
    return a + b


@forkq.job(name="aio.fails", queue=QUEUE, retry=3)
async def fails(why):
    await asyncio.sleep(0)
    raise ValueError(why)


@forkq.job(name="aio.exits", queue=QUEUE, retry=3)
async def exits():
    await asyncio.sleep(0)
    raise SystemExit(3)


@forkq.job(name="aio.meet", queue=QUEUE)
async def meet(mine, other):
    # each sets its own event and waits for the other's: both return only if they overlap
    for tag in (mine, other):
        events.setdefault(tag, asyncio.Event())
    events[mine].set()
    await asyncio.wait_for(events[other].wait(), 5)
    seen.append({"tag": mine, "thread": threading.current_thread().name,
                 "loop": id(asyncio.get_running_loop())})


@forkq.job(name="aio.slow", queue=QUEUE, time_limit=0.3)
async def slow(tag):
    try:
        await asyncio.sleep(30)
    finally:
        cleaned.append(tag)  # a cancelled coroutine runs its finally blocks


@forkq.job(name="aio.stubborn", queue=QUEUE, time_limit=0.2)
async def stubborn():
    while not release_stubborn.is_set():
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            cleaned.append("swallowed")  # and carries on: the job must not wait for it


@forkq.job(name="aio.leaves_a_task", queue=QUEUE)
async def leaves_a_task():
    async def background():
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cleaned.append("background")
            raise
    leaves_a_task.left = asyncio.get_running_loop().create_task(background())


@forkq.job(name="aio.spawns", queue=QUEUE)
async def spawns():
    events["go"] = asyncio.Event()

    async def outlives_its_job():
        seen.append({"when": "during", "job": forkq.current_job() is not None,
                     "batch": forkq.current_batch() is not None})
        await events["go"].wait()  # set by the test once the job was acknowledged
        batch = forkq.current_batch()
        seen.append({"when": "after", "job": forkq.current_job(), "batch": batch,
                     "fields": logs._add_job(None, "info", {})})
    spawns.left = asyncio.get_running_loop().create_task(outlives_its_job())
    await asyncio.sleep(0)  # the task has started, inside the job


def traced(f):
    """A decorator as apps write them: a plain function that returns f's outcome."""
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        return f(*args, **kwargs)
    return wrapper


@forkq.job(name="aio.decorated", queue=QUEUE, keep_result=60)
@traced
async def decorated(a, *, b):
    await asyncio.sleep(0)
    cleaned.append("ran")
    return a + b


@forkq.job(name="aio.made_sync", queue=QUEUE, keep_result=60)
@functools.wraps(decorated.__wrapped__.__wrapped__)
def made_sync(a, *, b):
    # the other kind: a decorator that runs the coroutine itself, as apps did before
    # forkq ran async def jobs
    return asyncio.run(decorated.__wrapped__.__wrapped__(a, b=b))


@forkq.job(name="aio.forks", keep_result=60)
async def forks(fd):
    pid = os.fork()  # job code that forks, and lets the copy carry on
    os.write(fd, b"copy-forked\n" if pid == 0 else b"")
    await asyncio.sleep(0)
    os.write(fd, b"copy-went-on\n" if pid == 0 else b"")
    return pid


pool = limiter.concurrent("aio-pool", 2, wait_timeout=1)


@forkq.job(name="aio.hold", queue=QUEUE)
async def hold(mine, other):
    # "a" takes a lease, then "b"; "a" leaves its `with` while "b" is still in its own
    for tag in (mine, other, "a-out"):
        events.setdefault(tag, asyncio.Event())
    if mine == "b":
        await asyncio.wait_for(events["a"].wait(), 5)
    with pool as lease:
        seen.append({"tag": mine, "token": lease.token})
        events[mine].set()
        await asyncio.wait_for(events[other if mine == "a" else "a-out"].wait(), 5)
    if mine == "a":
        b = next(s["token"] for s in seen if s["tag"] == "b")
        seen.append({"b_still_held": pool._redis().zscore(pool.key, b) is not None})
        events["a-out"].set()


worker = hand_driven_fixture(QUEUE, "test:1:async000000a")


@pytest.fixture
def client(redis_url):
    seen.clear()
    events.clear()
    cleaned.clear()
    c = forkq.configure(redis_url)
    try:
        yield c
    finally:
        forkq.client._default = None


@pytest.fixture
def fresh_loop():
    """Each test starts without a loop and leaves none behind (as a worker's stop does)."""
    aio.shutdown()
    yield
    release_stubborn.set()
    aio.shutdown()
    release_stubborn.clear()


def retries(r) -> list[dict]:
    return [json.loads(raw) for raw in r.zrange("retry", 0, -1)]


@pytest.mark.timeout(10)
def test_an_async_job_runs_on_the_loop_in_its_jobs_context_and_keeps_its_result(client, r, worker,
                                                                                   fresh_loop):
    def tenant(job, queue, call_next):
        structlog.contextvars.bind_contextvars(tenant="acme")
        outcome.append(call_next())  # middleware sees the job's result, in its own thread
        return outcome[-1]

    outcome: list = []
    hooks.SERVER_MIDDLEWARE.append(tenant)
    try:
        jid = compute.enqueue(2, 3)
        run_one(worker)
    finally:
        hooks.SERVER_MIDDLEWARE.remove(tenant)
    assert outcome == [5]
    (run,) = seen
    assert run["jid"] == jid  # forkq.current_job() inside the coroutine
    assert run["thread"] == "forkq-asyncio"
    assert run["bound"] == {"tenant": "acme"}
    assert run["fields"] == {"jid": jid, "class": "aio.compute", "queue": QUEUE}
    assert forkq.result(jid) == 5
    worker.fetch.fetch(0)  # the claim that carries the ack
    assert r.hlen(worker.fetch.inflight_key) == 0 and not retries(r)
    # the same loop runs the next one
    compute.enqueue(1, 1)
    run_one(worker)
    assert seen[1]["loop"] == run["loop"]


@pytest.mark.timeout(10)
def test_an_async_jobs_exception_is_its_failure_and_goes_to_retry(client, r, worker, fresh_loop):
    jid = fails.enqueue("boom")
    run_one(worker)
    (entry,) = retries(r)
    assert entry["jid"] == jid and entry["error_class"] == "ValueError"
    assert entry["error_message"] == "boom" and entry["retry_count"] == 0
    assert r.hlen(worker.fetch.inflight_key) == 0


def run_two(redis_url: str, identity: str) -> list:
    """Claim two jobs and run them at once in two processor threads; what each returned."""
    manager = Manager(lambda: forkq.client.connect(redis_url), identity, QueueOrder([(QUEUE, 0)]),
                      concurrency=2)
    manager.fetch.register()
    try:
        units = manager.fetch.fetch(2)
        assert len(units) == 2
        acked: list = []
        threads = [threading.Thread(target=lambda p, u: acked.append(p.process(u)), args=(p, u))
                   for p, u in zip(manager.processors, units)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        return acked
    finally:
        manager.fetch.close()


@pytest.mark.timeout(10)
def test_a_coroutines_system_exit_fails_its_job_and_the_loop_goes_on(client, r, worker, fresh_loop):
    # asyncio lets SystemExit and KeyboardInterrupt out of the loop: its thread ended, and
    # every async job after it waited for good
    jid = exits.enqueue()
    run_one(worker)
    (entry,) = retries(r)
    assert entry["jid"] == jid and entry["error_class"] == "SystemExit"
    compute.enqueue(1, 2)
    run_one(worker)
    assert len(seen) == 1


@pytest.mark.timeout(15)
def test_async_jobs_of_two_processor_threads_share_the_loop_and_overlap(client, r, redis_url, fresh_loop):
    meet.enqueue("a", "b")
    meet.enqueue("b", "a")
    started = time.monotonic()
    acked = run_two(redis_url, "test:1:async000000b")
    assert acked == [True, True], retries(r)  # a failure is False: wait_for timed out
    assert time.monotonic() - started < 4
    assert sorted(s["tag"] for s in seen) == ["a", "b"]
    assert {s["thread"] for s in seen} == {"forkq-asyncio"}
    assert len({s["loop"] for s in seen}) == 1


@pytest.mark.timeout(15)
def test_interleaved_async_jobs_each_release_their_own_limiter_lease(client, r, redis_url, fresh_loop):
    # both `with pool:` blocks run in the loop's one thread: a per-thread stack of leases
    # made "a"'s exit release "b"'s lease, and the limiter admit a third holder meanwhile
    hold.enqueue("a", "b")
    hold.enqueue("b", "a")
    assert run_two(redis_url, "test:1:async000000c") == [True, True], retries(r)
    assert {"b_still_held": True} in seen
    assert r.zcard(pool.key) == 0  # both given back


@pytest.mark.timeout(10)
def test_a_time_limit_cancels_the_coroutine_and_fails_the_job(client, r, worker, fresh_loop):
    jid = slow.enqueue("x")
    started = time.monotonic()
    run_one(worker)
    took = time.monotonic() - started
    assert 0.25 < took < 2, took
    assert cleaned == ["x"]
    (entry,) = retries(r)
    assert entry["jid"] == jid and entry["error_class"].endswith("TimeLimitExceeded")
    assert "time limit of 0.3 s" in entry["error_message"]
    # the loop goes on serving jobs
    compute.enqueue(1, 2)
    run_one(worker)
    assert len(seen) == 1


@pytest.mark.timeout(10)
def test_a_coroutine_that_swallows_its_cancellation_is_given_up(client, r, worker, fresh_loop,
                                                                 monkeypatch):
    monkeypatch.setattr(timelimit.WATCHDOG, "grace", 0.6)  # waited for half of it
    jid = stubborn.enqueue()
    started = time.monotonic()
    run_one(worker)
    took = time.monotonic() - started
    assert 0.4 < took < 2.5, took
    assert "swallowed" in cleaned
    (entry,) = retries(r)
    assert entry["jid"] == jid and entry["error_class"].endswith("TimeLimitExceeded")
    assert "left running" in entry["error_message"]
    # the processor thread is free, and the loop serves other jobs meanwhile
    compute.enqueue(1, 2)
    run_one(worker)
    assert len(seen) == 1


@pytest.mark.timeout(10)
def test_an_async_def_under_a_plain_decorator_is_run_as_an_async_job(client, r, worker, fresh_loop):
    # the decorator's wrapper is a plain function returning the coroutine: called as a
    # sync job's function, the job was logged done and acknowledged, its body never run
    jid = decorated.enqueue(2, b=3)
    run_one(worker)
    assert cleaned == ["ran"], retries(r)
    assert forkq.result(jid) == 5
    # one whose wrapper runs the coroutine itself still returns what it returned
    jid = made_sync.enqueue(1, b=1)
    run_one(worker)
    assert cleaned == ["ran", "ran"] and forkq.result(jid) == 2


@pytest.mark.timeout(10)
def test_a_task_that_outlives_its_job_is_in_no_job_once_it_ended(client, r, worker, fresh_loop):
    # as a thread a sync job starts: after the job, current_batch() reopening the batch of
    # a job already counted would add jobs to a batch whose success may have fired
    with forkq.Batch() as b:
        spawns.enqueue()
    run_one(worker)
    worker.fetch.fetch(0)  # the claim that carries the ack, and the batch's count
    assert forkq.batch_status(b.bid).success  # counted: its success has fired
    aio.loop().call_soon_threadsafe(events["go"].set)
    wait_until(lambda: len(seen) == 2, timeout=5, message=f"the task's record: {seen}")
    assert seen[0] == {"when": "during", "job": True, "batch": True}
    assert seen[1] == {"when": "after", "job": None, "batch": None, "fields": {}}


@pytest.mark.timeout(10)
def test_a_copy_forked_in_a_coroutine_ends_when_it_gives_the_loop_control(client, fresh_loop):
    # as a copy forked by a sync job ends with the job (processor.guard_forks): this one
    # has only the loop's thread, which ran on for good, a stray copy of the worker
    read, write = os.pipe()
    copy = reaped = None
    try:
        with testing.inline():
            copy = forkq.result(forks.enqueue(write))
            assert compute.enqueue(1, 1)  # the worker's loop serves on
        os.close(write)
        write = None
        reaped = wait_until(lambda: (w := os.waitpid(copy, os.WNOHANG))[0] and w, timeout=3,
                            message="the copy to end")
        assert os.waitstatus_to_exitcode(reaped[1]) == 0
        assert os.read(read, 100) == b"copy-forked\n"  # what it ran before giving control back
    finally:
        if copy and not reaped:  # never leave it running
            os.kill(copy, signal.SIGKILL)
            os.waitpid(copy, 0)
        os.close(read)
        if write is not None:
            os.close(write)


@pytest.mark.timeout(10)
def test_the_stop_cancels_tasks_left_on_the_loop_and_ends_its_thread(client, r, worker, fresh_loop):
    from forkq.worker import stop_async_loop
    leaves_a_task.enqueue()
    run_one(worker)
    thread = aio._thread
    assert thread is not None and thread.is_alive()
    assert not leaves_a_task.left.done()  # outlived its job
    stop_async_loop()
    assert cleaned == ["background"]
    assert not thread.is_alive() and aio._loop is None


@pytest.mark.timeout(10)
def test_testing_modes_run_async_jobs_and_refuse_inside_a_running_loop(fresh_loop, no_middleware):
    seen.clear()
    with testing.inline():
        jid = compute.enqueue(2, 2)
        assert forkq.result(jid) == 4
        with pytest.raises(ValueError, match="no"):
            fails.enqueue("no")
    assert seen[0]["jid"] == jid
    with testing.fake() as jobs:
        compute.enqueue(3, 3)
        assert jobs.drain() == 1
    assert len(seen) == 2

    async def a_test():
        with testing.fake() as jobs:
            compute.enqueue(1, 1)
            with pytest.raises(RuntimeError, match="inside a running event loop"):
                jobs.drain()
        assert await compute(1, 1) == 2  # a call is the coroutine itself
    asyncio.run(asyncio.wait_for(a_test(), 5))
    assert len(seen) == 3


@pytest.mark.timeout(60)
def test_async_jobs_in_a_masters_children(start_master, redis_url, r):  # noqa: F811
    """In a forked child: the loop starts there, current_job() works in the coroutine,
    and a time limit cancels one (its finally runs) and the child is replaced."""
    from test_supervisor import APPS
    m = start_master(processes=1, concurrency=2, app=APPS / "async_jobs.py",
                     args=["--time-limit-grace", "2", "--timeout", "1"])
    (before,) = m.wait_slots().values()
    jid = push(redis_url, "aio.whoami", "who")
    (ran,) = wait_event(r, m, "done", "who")
    assert ran["jid"] == jid and ran["pid"] == before and ran["thread"] == "forkq-asyncio"
    limited = push(redis_url, "aio.limited", "lim")
    (cancelled,) = wait_event(r, m, "cancelled", "lim")
    assert cancelled["pid"] == before
    member = wait_until(lambda: r.zrange("retry", 0, -1), timeout=10, message=f"a retry entry\n{m.tail()}")
    entry = json.loads(member[0])
    assert entry["jid"] == limited and entry["error_class"].endswith("TimeLimitExceeded")
    after = wait_until(lambda: (s := m.slots()) and s.get(0) not in (None, before) and s[0],
                       timeout=20, message=f"slot 0 replaced\n{m.tail()}")
    push(redis_url, "aio.whoami", "again")
    (again,) = wait_event(r, m, "done", "again")
    assert again["pid"] == after
    assert len(sup_events(r, "start", "lim")) == 1
    m.signal(signal.SIGTERM)
    assert m.wait(20) == 0
