"""Rate limiters (forkq.limiter) and the worker's answer to forkq.OverLimit.

In-process against the shared redis-server: limiters driven from threads and a forked
process, and a hand-driven Manager (corekit) for the worker's side, so each test takes
well under a second. One test runs a real master with two children.
"""

from __future__ import annotations

import contextvars
import json
import math
import os
import threading
import time

import pytest
import redis

import forkq
from forkq import keys, limiter, testing
from forkq.scheduler import Scheduler
from corekit import hand_driven_fixture, run_one
from test_supervisor import REPO_ROOT, start_master  # noqa: F401 (a fixture)
from helpers import wait_until

HOLDERS = "limtest:holders"
SEEN = "limtest:seen"
ran: list[str] = []


@pytest.fixture
def client(redis_url):
    ran.clear()
    return forkq.Client(redis_url)


def hold_many(lim: limiter.Concurrent, url: str, times: int, threads: int) -> None:
    """`threads` threads each take the limiter `times` times, noting in Redis how many
    held it at each entry."""
    def work():
        r = redis.Redis.from_url(url)
        for _ in range(times):
            with lim:
                r.rpush(SEEN, r.incr(HOLDERS))
                time.sleep(0.005)
                r.decr(HOLDERS)
        r.close()
    pool = [threading.Thread(target=work) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(20)


def seen(r) -> list[int]:
    return [int(n) for n in r.lrange(SEEN, 0, -1)]


# -- concurrent ---------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_threads_of_two_processes_never_hold_more_than_size(client, redis_url, r):
    lim = limiter.concurrent("pay", 3, wait_timeout=20, client=client)
    lim.acquire().release()  # the parent has a connection before the fork: the child must not use it
    pid = os.fork()
    if pid == 0:  # the child: its own threads on the same limiter object
        code = 1
        try:
            hold_many(lim, redis_url, times=8, threads=4)
            code = 0
        finally:
            os._exit(code)
    hold_many(lim, redis_url, times=8, threads=4)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    counts = seen(r)
    assert len(counts) == 64
    assert max(counts) == 3  # reached the size (so not one at a time), never beyond
    assert r.zcard(lim.key) == 0 and int(r.get(HOLDERS)) == 0


def test_a_lapsed_lease_comes_back_and_its_late_release_frees_nothing_else(client, r):
    lim = limiter.concurrent("pay", 1, wait_timeout=0, lock_timeout=0.2, client=client)
    stuck = lim.acquire()  # a holder that never releases (a SIGKILLed child)
    with pytest.raises(forkq.OverLimit):
        lim.acquire()
    started = time.monotonic()

    def take():
        try:
            return lim.acquire()
        except forkq.OverLimit:
            return None
    fresh = wait_until(take, timeout=3, message="the lapsed lease's slot taken again")
    assert time.monotonic() - started < 1
    # the stuck holder comes back late: its release must not free the new holder's slot
    assert stuck.release() is False
    assert r.zrange(lim.key, 0, -1) == [fresh.token.encode()]
    with pytest.raises(forkq.OverLimit):
        lim.acquire()
    assert fresh.release() is True and fresh.release() is False
    assert r.zcard(lim.key) == 0


def test_a_full_limiter_waits_its_wait_timeout_then_raises_naming_itself(client, r):
    lim = limiter.concurrent("mailer", 1, wait_timeout=0.3, client=client)
    with lim as lease:
        assert 0 < r.pttl(lim.key) <= 30_000  # no key stays forever
        started = time.monotonic()
        with pytest.raises(forkq.OverLimit, match="'mailer'") as caught:
            lim.acquire()
        assert 0.3 <= time.monotonic() - started < 0.6
        assert caught.value.limiter == "mailer"
        # a waiter admitted when the holder leaves within its wait_timeout
        threading.Timer(0.1, lease.release).start()
        lim2 = limiter.concurrent("mailer", 1, wait_timeout=2, client=client)
        lim2.acquire().release()
    assert r.zcard(lim.key) == 0


# -- window and bucket ----------------------------------------------------------------------


def test_a_window_admits_count_in_any_interval(client, r):
    lim = limiter.window("api", 3, 0.5, wait_timeout=0, client=client)
    first = time.monotonic()
    for _ in range(3):
        lim.acquire()
    started = time.monotonic()
    with pytest.raises(forkq.OverLimit, match="'api'"):
        lim.acquire()  # the oldest leaves in ~0.5 s, past wait_timeout: raised at once
    assert time.monotonic() - started < 0.05
    assert 0 < r.pttl(lim.key) <= 500

    # waiting ones are admitted as entries leave: 7 in all, each admission's Redis time
    # read back while it is still in the window
    waiting = limiter.window("api", 3, 0.5, wait_timeout=2, client=client)
    admitted = dict(r.zrange(lim.key, 0, -1, withscores=True))
    for _ in range(4):
        waiting.acquire()
        admitted.update(r.zrange(lim.key, 0, -1, withscores=True))
    assert time.monotonic() - first >= 0.99  # the 7th waited for the 4th to leave
    at = sorted(admitted.values())
    assert len(at) == 7
    # exactly count per interval: any 4 admissions span at least 0.5 s of Redis's clock,
    # and the waiters came in as soon as there was room (not a full extra interval later)
    assert all(later - earlier >= 500 for earlier, later in zip(at, at[3:]))
    assert at[3] - at[0] < 700 and at[6] - at[3] < 700


def test_a_bucket_admits_count_per_clock_window(client, r):
    lim = limiter.bucket("sms", 2, 0.5, wait_timeout=1, client=client)
    lim.acquire()
    lim.acquire()
    window = int(r.hget(lim.key, "w"))
    assert 0 < r.pttl(lim.key) <= 500
    lim.acquire()  # waited for the next window, which starts counting again
    assert int(r.hget(lim.key, "w")) == window + 1 and r.hget(lim.key, "n") == b"1"
    assert int(r.hget(lim.key, "w")) * 500 <= float(r.time()[0]) * 1000 + r.time()[1] / 1000


def test_named_intervals_and_repr():
    assert limiter.window("a", 5, "minute").interval == 60
    assert limiter.bucket("a", 5, "day").interval == 86400
    assert "size 2" in repr(limiter.concurrent("a", 2))


@pytest.mark.parametrize("make, bad", [
    (lambda: limiter.concurrent("a", 0), "size"),
    (lambda: limiter.concurrent("a", True), "size"),
    (lambda: limiter.concurrent("a", 2.0), "size"),
    (lambda: limiter.concurrent("", 2), "name"),
    (lambda: limiter.concurrent("  ", 2), "name"),
    (lambda: limiter.concurrent(None, 2), "name"),
    (lambda: limiter.concurrent("a", 2, wait_timeout=-1), "wait_timeout"),
    (lambda: limiter.concurrent("a", 2, wait_timeout=math.nan), "wait_timeout"),
    (lambda: limiter.concurrent("a", 2, lock_timeout=0), "lock_timeout"),
    (lambda: limiter.concurrent("a", 2, lock_timeout=math.inf), "lock_timeout"),
    (lambda: limiter.concurrent("a", 2, lock_timeout=10**400), "lock_timeout"),
    (lambda: limiter.concurrent("a", 2, client="redis://x"), "client"),
    (lambda: limiter.window("a", 0, 1), "count"),
    (lambda: limiter.window("a", 5, "week"), "interval"),
    (lambda: limiter.window("a", 5, "Minute"), "interval"),
    (lambda: limiter.window("a", 5, 0), "interval"),
    (lambda: limiter.window("a", 5, -1), "interval"),
    (lambda: limiter.bucket("a", 5, "1m"), "interval"),
    (lambda: limiter.bucket("a", 5, 60, wait_timeout=-0.5), "wait_timeout"),
])
def test_bad_arguments_are_refused_at_construction(make, bad):
    with pytest.raises(ValueError, match=bad):
        make()


@pytest.mark.parametrize("bad", [-1, 2.5, "5", True, float("inf")])
def test_a_bad_overlimit_retries_is_refused_where_it_is_given(bad):
    # the worker would read it as the default of 20 without a word
    with pytest.raises(ValueError, match="overlimit_retries"):
        forkq.job(name="limiter_test.bad_cap", overlimit_retries=bad)(lambda: None)
    with pytest.raises(ValueError, match="overlimit_retries"):
        limited.options(overlimit_retries=bad)
    assert limited.options(overlimit_retries=0).options["overlimit_retries"] == 0
    assert "overlimit_retries" not in limited.options(overlimit_retries=None).options  # the default


def test_testing_modes_admit_everyone_without_redis():
    nowhere = forkq.Client("redis://127.0.0.1:1/0")  # nothing listens there
    one = limiter.concurrent("t", 1, wait_timeout=0, client=nowhere)
    window = limiter.window("t", 1, "day", wait_timeout=0, client=nowhere)
    for mode in (testing.fake, testing.inline):
        with mode():
            with one, one, window:
                window.acquire()
                one.acquire().release()


def test_limiters_made_on_the_fly_leave_nothing_in_a_threads_context(client, r):
    # a processor thread's context lasts as long as the thread, and keeps every variable
    # ever set in it: one variable per limiter grew it by one for each limiter a job made
    grown: list = []

    def work():
        before = len(contextvars.copy_context())
        for i in range(3):
            outer = limiter.concurrent(f"fly-{i}", 1, wait_timeout=0, client=client)
            inner = limiter.concurrent(f"fly-in-{i}", 1, wait_timeout=0, client=client)
            with outer:
                with inner, limiter.concurrent("fly-other", 1, client=client):
                    pass
                assert r.zcard(inner.key) == 0 and r.zcard(outer.key) == 1  # each its own
            assert r.zcard(outer.key) == 0
        with testing.fake():
            for i in range(200):
                with limiter.concurrent(f"fly-fake-{i}", 1):
                    pass
        grown.append(len(contextvars.copy_context()) - before)

    thread = threading.Thread(target=work)  # a thread starts with an empty context
    thread.start()
    thread.join(10)
    assert grown and grown[0] <= 1, grown


# -- the worker's side ----------------------------------------------------------------------


@forkq.job(queue="lim", name="limiter_test.limited", retry=3)
def limited(tag: str) -> None:
    # wait_timeout 0 and a window already full: raises OverLimit at once
    with limiter.window("lim-test", 1, 60, wait_timeout=0, client=forkq.Client()):
        ran.append(tag)


@forkq.job(queue="lim", name="limiter_test.over", retry=3, overlimit_retries=2)
def over(tag: str) -> None:
    raise forkq.OverLimit("rate limiter 'x' stayed full", "x")


# a Manager on queue lim, not started: run_one() drives its one processor
worker = hand_driven_fixture("lim", "test:1:000000000001")


def scheduled(r) -> list[tuple[dict, float]]:
    return [(json.loads(raw), at) for raw, at in r.zrange(keys.SCHEDULE, 0, -1, withscores=True)]


def test_over_limit_reschedules_without_a_retry_and_runs_later(client, r, worker):
    secs, micros = r.time()
    r.zadd("forkq:limiter:lim-test:window", {"someone": secs * 1000 + micros // 1000})  # full
    jid = limited.options(client=client).enqueue("a")
    before = time.time()
    run_one(worker)
    (processor,) = worker.processors
    assert ran == [] and processor.failed == 0
    ((job, at),) = scheduled(r)
    assert job["jid"] == jid and job["overlimit"] == 1 and job["queue"] == "lim"
    assert "retry_count" not in job and "error_class" not in job and "enqueued_at" not in job
    assert before + 5 <= at <= time.time() + 7.5
    assert r.zcard(keys.RETRY) == 0 and r.hlen(worker.fetch.inflight_key) == 0

    # room again; the job comes back on its queue when due, and runs
    r.delete("forkq:limiter:lim-test:window")
    assert Scheduler(r, worker.outcomes).poll(now=at + 1) == 1
    run_one(worker)
    assert ran == ["a"] and processor.failed == 0 and r.zcard(keys.SCHEDULE) == 0


def test_after_its_overlimit_retries_an_over_limit_is_an_ordinary_failure(client, r, worker):
    over.options(client=client).enqueue("b")
    (processor,) = worker.processors
    delays = []
    for n in (1, 2):
        run_one(worker)
        ((job, at),) = scheduled(r)
        assert job["overlimit"] == n and "retry_count" not in job
        delays.append(at - time.time())
        r.delete(keys.SCHEDULE)
        r.lpush("queue:lim", json.dumps(job))
    assert delays[1] > 5 * 1.5 - 0.5  # the wait grows
    assert processor.failed == 0
    run_one(worker)  # the third: a failure, with a retry used
    assert r.zcard(keys.SCHEDULE) == 0 and processor.failed == 1
    ((raw, _),) = r.zrange(keys.RETRY, 0, -1, withscores=True)
    job = json.loads(raw)
    assert job["retry_count"] == 0 and job["error_class"] == "forkq.errors.OverLimit"
    assert job["overlimit"] == 2 and r.hlen(worker.fetch.inflight_key) == 0


def test_the_default_cap_is_20(client, r, worker):
    # pushed by name, without the @job's overlimit_retries: the default holds
    client.push("limiter_test.over", ["c"], queue="lim")
    job = json.loads(r.lpop("queue:lim"))
    assert "overlimit_retries" not in job
    r.lpush("queue:lim", json.dumps(dict(job, overlimit=19)))
    run_one(worker)
    ((again, at),) = scheduled(r)
    assert again["overlimit"] == 20 and at - time.time() <= 600 * 1.5
    r.delete(keys.SCHEDULE)
    r.lpush("queue:lim", json.dumps(again))
    run_one(worker)
    assert r.zcard(keys.SCHEDULE) == 0 and r.zcard(keys.RETRY) == 1


@forkq.job(queue="lim", name="limiter_test.over_once")
def over_once(tag: str) -> None:
    if tag not in ran:
        ran.append(tag)
        raise forkq.OverLimit("rate limiter 'x' stayed full", "x")
    ran.append("ok")


@forkq.job(queue="limcb", name="limiter_test.after")
def after(tag: str) -> None:
    pass


def test_a_batch_job_over_limit_stays_pending_and_is_no_failure(client, redis_url, r, worker):
    forkq.configure(redis_url)
    try:
        with forkq.Batch().on_complete(after, "c") as batch:
            over_once.enqueue("d")
        run_one(worker)
        status = batch.status()
        assert status.pending == 1 and status.failures == {} and not status.complete
        assert r.llen("queue:limcb") == 0  # no callback for a job that has not ended
        ((job, at),) = scheduled(r)
        assert Scheduler(r, worker.outcomes).poll(now=at + 1) == 1
        run_one(worker)
        worker.fetch.fetch(0)  # the claim that carries the ack
        assert ran == ["d", "ok"] and batch.status().success and r.llen("queue:limcb") == 1
    finally:
        forkq.client._default = None


# -- end to end -----------------------------------------------------------------------------


@pytest.mark.timeout(40)
def test_a_fleet_shares_a_limiter_made_at_import_and_reschedules_what_is_over(start_master, redis_url, r):
    """Two children of three threads each run 8 jobs through a concurrent limiter of 2
    made in the master before the fork (wait_timeout 0.05 s): never more than 2 hold it,
    those that found it full are rescheduled (a shortened wait) and all finish, none
    failed."""
    m = start_master(processes=2, concurrency=3, app=REPO_ROOT / "tests" / "apps" / "limiter_jobs.py",
                     env={"LIM_OVERLIMIT_FIRST_S": "0.1"})
    m.wait_slots()
    pusher = forkq.Client(redis_url)
    pusher.push_bulk("lim.hold", [[f"j{i}"] for i in range(8)])

    def finished():
        m.check()
        return r.llen("lim:done") == 8
    wait_until(finished, timeout=25, interval=0.05, message="8 jobs done")
    counts = [int(n) for n in r.lrange("lim:seen", 0, -1)]
    assert len(counts) == 8 and max(counts) <= 2
    assert r.zcard(keys.RETRY) == 0 and r.zcard(keys.DEAD) == 0
    # a child's info line, written out by its flusher a moment after the reschedule
    wait_until(lambda: any((e.get("event") or "").startswith("over limit: rescheduled in") for e in m.logs()),
               timeout=5, message=f"an over-limit reschedule logged\n{m.tail()}")


# -- review: waiting must stay interruptible ------------------------------------------------


@forkq.job(queue="lim", name="limiter_test.waits_in_time_limit", retry=3, time_limit=0.3)
def waits_in_time_limit(tag: str) -> None:
    # a window whose one entry leaves in ~3 s, inside wait_timeout: the limiter waits for it
    with limiter.window("lim-wait", 1, 3, wait_timeout=5, client=forkq.Client()):
        ran.append(tag)


@pytest.mark.timeout(20)
def test_a_time_limit_cuts_a_limiter_wait_short(client, r, worker):
    # A time limit lands only between bytecodes: a wait for a window's hint taken as one
    # long time.sleep held the job seconds past its limit (past the grace, it is given up
    # while its thread may still get in and make the limited call after its failure)
    secs, micros = r.time()
    r.zadd("forkq:limiter:lim-wait:window", {"someone": secs * 1000 + micros // 1000})
    r.pexpire("forkq:limiter:lim-wait:window", 3000)
    waits_in_time_limit.options(client=client).enqueue("e")
    started = time.monotonic()
    run_one(worker)
    took = time.monotonic() - started
    ((raw, _),) = r.zrange(keys.RETRY, 0, -1, withscores=True)
    assert json.loads(raw)["error_class"] == "forkq.errors.TimeLimitExceeded"
    assert ran == [] and took < 1.2, took


def test_an_over_limit_survives_pickling():
    # A job that runs its limited call in a ProcessPoolExecutor gets the pool's pickled
    # exception back: an OverLimit that cannot be unpickled broke the pool instead
    # (BrokenProcessPool, an ordinary failure) and was never rescheduled
    import copy
    import pickle
    exc = forkq.OverLimit("rate limiter 'x' stayed full for 5 s", "x")
    for back in (pickle.loads(pickle.dumps(exc)), copy.copy(exc)):
        assert type(back) is forkq.OverLimit and back.limiter == "x" and str(back) == str(exc)


def test_a_release_past_lock_timeout_says_it_lapsed_even_if_nobody_swept_it(client, r):
    # the lapsed lease is still in the zset (no acquire since swept it, and a longer lease
    # keeps the key): its release must still report the lapse, as the README promises
    short = limiter.concurrent("sweep", 2, wait_timeout=0, lock_timeout=0.2, client=client)
    long = limiter.concurrent("sweep", 2, wait_timeout=0, lock_timeout=5, client=client)
    late, other = short.acquire(), long.acquire()
    lapses = r.zscore(short.key, late.token)

    def redis_ms():
        secs, micros = r.time()
        return secs * 1000 + micros // 1000
    wait_until(lambda: redis_ms() > lapses, timeout=2, message="the short lease lapsed")
    assert r.zscore(short.key, late.token) is not None  # not swept yet
    assert late.release() is False
    assert r.zrange(short.key, 0, -1) == [other.token.encode()]  # its own entry gone, no other
    assert other.release() is True


@pytest.mark.parametrize("how", ["acquire", "with"])
def test_an_interruption_as_the_admission_comes_in_gives_the_slot_back(redis_server, r, how):
    """A time limit's exception (raised into the thread with PyThreadState_SetAsyncExc, as
    forkq's watchdog does) that lands as the script's reply arrives, after Redis admitted
    the token: the slot goes back at once, not after lock_timeout."""
    import ctypes
    from helpers import ReplyHolder
    from forkq.timelimit import TimeLimitExceeded
    holder = ReplyHolder(redis_server.port, marker=b"EVALSHA")
    lim = limiter.concurrent("interrupted", 1, lock_timeout=60,
                             client=forkq.Client(f"redis://127.0.0.1:{holder.port}/0"))
    from forkq import scripts
    r.script_load(scripts.source("limiter_concurrent"))  # the held call is its one EVALSHA
    caught: list[BaseException] = []

    def take() -> None:
        try:
            if how == "with":
                with lim:
                    time.sleep(5)  # never reached: interrupted on the way in
            else:
                lim.acquire()
        except BaseException as exc:
            caught.append(exc)
    t = threading.Thread(target=take)
    try:
        t.start()
        assert holder.holding.wait(5)  # admitted in Redis, the reply on its way
        assert r.zcard(keys.limiter("interrupted", "concurrent")) == 1
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(t.ident), ctypes.py_object(TimeLimitExceeded))
        holder.release.set()
        t.join(5)
    finally:
        holder.close()
    assert [type(e) for e in caught] == [TimeLimitExceeded]
    assert r.zcard(keys.limiter("interrupted", "concurrent")) == 0


def test_async_with_waits_without_stalling_the_loop(client, r):
    """`async with limiter:` in coroutines sharing one loop (as async jobs do): a waiter
    for a full limiter awaits its naps, so a ticker on the same loop goes on running; the
    slot goes to it once freed; a cancelled waiter leaves no lease behind."""
    import asyncio
    lim = limiter.concurrent("aw", 1, wait_timeout=3, client=client)
    win = limiter.window("aw", 1, 0.4, wait_timeout=3, client=client)

    async def main() -> tuple[int, list, int]:
        ticks = 0
        order: list = []
        release = asyncio.Event()
        holding = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        async def holder() -> None:
            async with lim:
                order.append("a in")
                holding.set()
                await release.wait()
            order.append("a out")

        async def waiter() -> None:
            async with lim:
                order.append("b in")

        tick = asyncio.create_task(ticker())
        a = asyncio.create_task(holder())
        await holding.wait()  # a holds the one slot
        b = asyncio.create_task(waiter())
        await asyncio.sleep(0.3)  # b waits for the slot meanwhile
        waited = ticks
        release.set()
        await asyncio.gather(a, b)
        # a waiter cancelled mid-wait (a time limit cancels its job's task) takes nothing
        async with lim:
            c = asyncio.create_task(waiter())
            await asyncio.sleep(0.05)
            c.cancel()
            with pytest.raises(asyncio.CancelledError):
                await c
        async with win:
            pass
        started = time.monotonic()
        async with win:  # the window's room comes back after its interval, awaited
            order.append(time.monotonic() - started)
        tick.cancel()
        return waited, order, ticks

    waited, order, ticks = asyncio.run(main())
    assert waited >= 10  # the ticker ran while b waited (a blocked loop: 0 or 1 ticks)
    assert order[:3] == ["a in", "a out", "b in"]
    assert 0.25 <= order[3] <= 0.9  # the window's 0.4 s, less the time since its first entry
    assert r.zcard(keys.limiter("aw", "concurrent")) == 0
