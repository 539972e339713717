"""Review of iterable jobs (forkq/iterate.py) at awkward moments: what an interrupted job
keeps and loses (expiry, unique lock, batch, kept result), and forkq's own faults around
it. In-process workers against the shared Redis, as tests/test_iterate.py."""

from __future__ import annotations

import json
import threading
import time

import pytest

import forkq
from forkq import iterate, keys
from helpers import wait_until
from test_iterate import (QUEUE, at_gate, checkpoint, crashy, done, gate, items, stop,  # noqa: F401
                          walk, world)


@pytest.mark.timeout(20)
def test_an_interrupted_job_past_its_expires_at_resumes_rather_than_being_dropped(world, r):
    """expires_at bounds when a run may start: a job forkq itself interrupted at a stop
    has started, and its continuation must not be dropped half done as expired."""
    manager, launcher = world("test:1:revExp000001")
    jid = crashy.options(expires_in=1.0).enqueue(60)  # held at its item 30 until gate is set
    assert at_gate.wait(5)
    raw = next(iter(r.hvals(keys.inflight("test:1:revExp000001"))))
    expires_at = json.loads(raw)["expires_at"]
    wait_until(lambda: time.time() > expires_at + 0.01, timeout=3, message="its expiry, as it runs")
    stopping = threading.Thread(target=stop, args=(manager, launcher))
    stopping.start()
    wait_until(lambda: manager.stopping, timeout=2, message="the stop begun")
    gate.set()  # item 30 ends; the job is interrupted at its yield
    stopping.join(5)
    assert items() == list(range(31)) and checkpoint(r, jid) == 30
    back = json.loads(r.lindex(f"queue:{QUEUE}", -1))
    assert back["jid"] == jid and "expires_at" not in back
    world("test:1:revExp000002")
    wait_until(lambda: items()[-1:] == [59], timeout=5, message="the job resumed and finished")
    assert items() == list(range(60)), "the rest of its items ran"


@pytest.mark.timeout(20)
def test_an_interrupted_job_keeps_its_unique_lock_batch_count_and_result_for_its_end(world, r):
    """Interrupted, a unique job keeps its lock (it was put back, not done), a batch job is
    not counted, a keep_result job keeps nothing; all three once it ran to its end."""
    manager, launcher = world("test:1:revUBK000001")
    jid = walk.options(unique_for=60, keep_result=60).enqueue(400)
    batch = forkq.Batch(description="rev")  # unique jobs cannot join one: a second job
    with batch:
        walk.enqueue(400)
    wait_until(lambda: len(done) >= 50, timeout=5, message="50 items")
    stop(manager, launcher)
    lock = next(iter(r.scan_iter("*unique*")))
    assert r.get(lock).decode() == jid, "held while it waits to resume"
    assert walk.options(unique_for=60).enqueue(400) is None, "a duplicate is refused"
    st = forkq.batch_status(batch.bid)
    assert st.pending == 1 and not st.failures and not st.success
    assert r.llen(f"queue:{QUEUE}") == 2
    with pytest.raises(forkq.ResultNotReady):
        forkq.result(jid)
    world("test:1:revUBK000002")
    assert forkq.result(jid, timeout=10) is None
    wait_until(lambda: forkq.batch_status(batch.bid).pending == 0, timeout=10, message="counted")
    assert sorted(items()) == sorted(list(range(400)) * 2)
    wait_until(lambda: r.get(lock) is None, timeout=5, message="the lock released at success")


pages: list[int] = []  # the pages `paged` finished
page_fails: set[int] = set()  # the pages that fail once


@forkq.job(queue=QUEUE, name="it.paged", iterable=True, retry=3, keep_result=60)
def paged(n, cursor=None):
    """Moves its dict cursor to the next page before working on it, as paging code does:
    the cursor it yielded last changes in place while an item runs."""
    cursor = cursor or {"page": -1}
    while cursor["page"] + 1 < n:
        cursor["page"] += 1
        if cursor["page"] in page_fails:
            page_fails.discard(cursor["page"])
            raise ValueError(f"page {cursor['page']} failed")
        pages.append(cursor["page"])
        yield cursor
    return "paged"


@pytest.mark.timeout(20)
def test_a_failure_never_checkpoints_a_cursor_the_failed_item_changed_in_place(world, r):
    """The yielded dict, moved on by the item that then failed, said that item was done:
    its retry skipped it. A failure keeps only a cursor that cannot have changed since its
    yield; a mutable one resumes from the last checkpoint written at a yield."""
    pages.clear()
    page_fails.clear()
    page_fails.add(5)
    world("test:1:revPag000001")
    jid = paged.enqueue(8)
    entry = wait_until(lambda: r.zrange("retry", 0, -1), timeout=5, message="a retry entry")
    assert pages == [0, 1, 2, 3, 4]
    assert checkpoint(r, jid) in (None, {"page": 4}), "page 5 did not finish"
    r.zrem("retry", entry[0])
    r.lpush(f"queue:{QUEUE}", entry[0])  # the retry, due now
    assert forkq.result(jid, timeout=5) == "paged"
    assert sorted(set(pages)) == list(range(8)), "no page skipped"


@pytest.mark.timeout(20)
def test_a_chained_iterable_step_deletes_its_checkpoint_as_it_pushes_the_next_step(world, r,
                                                                                  monkeypatch):
    """A chained step is released by the call that pushes the next step, not the batched
    ack: the checkpoint's delete goes in that call, rather than staying for 30 days."""
    monkeypatch.setattr(iterate, "FLUSH_S", 0.005)
    world("test:1:revChn000001")
    jids = forkq.chain(walk.call(20), walk.call(3)).enqueue()
    wait_until(lambda: len(done) == 23, timeout=5, message="both steps")
    wait_until(lambda: r.hlen(keys.inflight("test:1:revChn000001")) == 0, timeout=5,
               message="both acknowledged")
    assert r.get(iterate.PREFIX + jids[0]) is None, "the first step's checkpoint"


@pytest.mark.timeout(20)
def test_a_fault_after_an_iterable_job_ran_leaves_its_checkpoint_for_its_retry(world, r,
                                                                             monkeypatch):
    """forkq failing around a job it ran records the job's failure (_fault); the job's
    checkpoint delete, pending for its ack, must not ride on the next job's ack: its
    retry would start over."""
    monkeypatch.setattr(iterate, "FLUSH_S", 0.005)
    manager, _ = world("test:1:revFlt000001")
    proc = manager.processors[0]
    real = proc._observe
    faults = [RuntimeError("a fault in forkq's bookkeeping")]

    def observe(*a):
        if faults:
            raise faults.pop()
        return real(*a)

    monkeypatch.setattr(proc, "_observe", observe)
    jid = walk.enqueue(20)
    wait_until(lambda: r.zrange("retry", 0, -1), timeout=5, message="the fault recorded")
    saved = checkpoint(r, jid)
    assert saved is not None
    walk.enqueue(1)  # the next job on that thread, and its ack
    wait_until(lambda: len(done) == 21 and r.hlen(keys.inflight("test:1:revFlt000001")) == 0,
               timeout=5, message="the next job acknowledged")
    assert checkpoint(r, jid) == saved, "kept for the retry"


@forkq.job(queue=QUEUE, name="it.setcursor", iterable=True)
def set_cursor(n, cursor=None):
    for i in range(n):
        yield i if i < 2 else {i}  # a set from the third item: no JSON carries it


def test_testing_modes_refuse_a_cursor_json_cannot_carry_as_a_worker_does(monkeypatch):
    """A worker fails such a job at every run; inline() and fake()'s drain() ran it to its
    end, and the app's tests passed."""
    from forkq import hooks
    monkeypatch.setattr(hooks, "SERVER_MIDDLEWARE", [])  # another module's, left registered
    with forkq.testing.inline():
        with pytest.raises(TypeError, match="JSON cannot carry"):
            set_cursor.enqueue(3)
    with forkq.testing.fake() as jobs:
        set_cursor.enqueue(3)
        with pytest.raises(TypeError, match="JSON cannot carry"):
            jobs.drain()
    with forkq.testing.inline():
        set_cursor.enqueue(2)  # JSON cursors walk through as before


def test_the_payload_put_back_drops_expires_at_dates_enqueued_at_and_falls_back_to_the_one_fetched():
    assert iterate.requeued(b'{"class":"a","args":[1],"jid":"j"}') == ""  # as fetched
    assert json.loads(iterate.requeued(
        '{"class":"a","args":["\u00e9"],"jid":"j","expires_at":1.5}'.encode())) == {
        "class": "a", "args": ["\u00e9"], "jid": "j"}
    # enqueued_at is now, in the unit the payload had it in: the queue's latency is read
    # off it, and an interrupted long job would otherwise show its queue hours behind
    now = 1_800_000_000.25
    for at, want in ((1_700_000_000.5, now), (1_700_000_000, 1_800_000_000),
                     (1_700_000_000_000, 1_800_000_000_250)):
        back = json.loads(iterate.requeued(
            json.dumps({"class": "a", "args": [], "jid": "j", "enqueued_at": at}), now=now))
        assert back["enqueued_at"] == want and type(back["enqueued_at"]) is type(want)
    # what json or redis-py cannot write back goes back as fetched, not stays in flight
    assert iterate.requeued(b'{"class":"a","args":[NaN],"jid":"j","expires_at":1}') == ""
    assert iterate.requeued(b'{"class":"a","args":["\\udc80"],"jid":"j","expires_at":1}') == ""


closing = threading.Event()  # set while `slow_close` is in its finally
let_close = threading.Event()


@forkq.job(queue=QUEUE, name="it.slowclose", iterable=True)
def slow_close(n, cursor=None):
    try:
        for i in range(0 if cursor is None else cursor + 1, n):
            time.sleep(0.002)
            done.append((i, 0))
            yield i
    finally:
        closing.set()
        let_close.wait(10)  # a cleanup that outlasts the stop's --timeout


@pytest.mark.timeout(20)
def test_a_stop_cut_off_in_a_slow_finally_still_resumes_from_the_cursor_reached(world, r,
                                                                                monkeypatch):
    """The cursor is kept before the generator is closed: a finally that outlasts the
    stop's timeout (the worker then puts its jobs back and exits) must not send the job
    back to a checkpoint seconds old."""
    from forkq.fetch import requeue_owner
    monkeypatch.setattr(iterate, "FLUSH_S", 60)  # no periodic checkpoint in this test
    closing.clear()
    let_close.clear()
    ident = "test:1:revSlw000001"
    manager, launcher = world(ident)
    try:
        jid = slow_close.enqueue(5000)
        wait_until(lambda: len(done) >= 50, timeout=5, message="50 items")
        launcher.stop()
        assert not manager.stop(time.monotonic() + 0.3), "a hard stop: the finally still runs"
        wait_until(closing.is_set, timeout=5, message="the generator closing")
        requeue_owner(r, ident, [QUEUE])  # what the stopping worker does next, then it exits
        assert checkpoint(r, jid) == items()[-1]
    finally:
        let_close.set()


@forkq.job(queue=QUEUE, name="it.blip", iterable=True, retry=False)
def blip(n, cursor=None):
    for i in range(n):
        done.append((i, 0))
        yield i


@pytest.mark.timeout(30)
def test_a_redis_outage_as_a_run_starts_is_ridden_out_not_the_jobs_failure(own_redis, monkeypatch):
    """Reading the checkpoint is the one Redis call an iterable job makes before its first
    item: an outage then failed the job (a retry used; dropped with retry=False), where a
    plain job, needing no Redis to start, would have run."""
    from forkq import hooks
    from helpers import InProcessWorkers
    done.clear()
    down = threading.Event()

    def outage(job, queue, next_):
        if job["class"] == "it.blip" and not down.is_set():
            own_redis.stop()  # the server goes away between the fetch and the run
            down.set()
        return next_()

    monkeypatch.setattr(hooks, "SERVER_MIDDLEWARE", [outage])
    forkq.configure(own_redis.url)
    workers = InProcessWorkers(own_redis.url, "test:1:revBlp000001", QUEUE, 0.1)
    try:
        workers.start(1)
        blip.enqueue(5)
        assert down.wait(10)
        own_redis.start()  # from this thread: the server dies with the thread that started it
        wait_until(lambda: len(done) == 5, timeout=5, message="the job ran once Redis was back")
        assert items() == [0, 1, 2, 3, 4]
    finally:
        workers.close()


@forkq.job(queue=QUEUE, name="it.messy", iterable=True)
def messy(n, cursor=None):
    try:
        for i in range(n):
            time.sleep(0.002)
            done.append((i, 0))
            yield i
    finally:
        raise ValueError("cleanup broke")  # at every end: the cancel's close too


@pytest.mark.timeout(20)
def test_a_cancel_wins_over_a_finally_that_raises_as_it_closes_the_job(world, r):
    """Ending as that error instead, the job went to retry, its request still pending: each
    retry walked more items until a heartbeat cancelled it again, and failed again."""
    world("test:1:revMsy000001")
    jid = messy.enqueue(5000)
    wait_until(lambda: len(done) >= 20, timeout=5, message="20 items")
    r.hsetnx(keys.CANCEL, jid, json.dumps({"at": time.time(), "by": "alice", "reason": "stop it"}))
    wait_until(lambda: r.zcard("dead") or r.zcard("retry"), timeout=5, message="its end")
    assert r.zcard("retry") == 0
    dead = json.loads(r.zrange("dead", 0, -1)[0])
    assert dead["jid"] == jid and dead["error_class"] == "forkq.JobCancelled"
    assert "(stopped between two items)" in dead["error_message"]
    assert not r.hexists(keys.CANCEL, jid)
    assert checkpoint(r, jid) == items()[-1], "kept: a retry from dead resumes"


@pytest.mark.timeout(20)
@pytest.mark.parametrize("options", [{"retry": 5}, {"retry": False}])
def test_another_clients_payload_naming_cursor_goes_to_dead_at_once_whole(world, r, options):
    """forkq's push refuses `cursor` in kwargs (the worker passes it); a Ruby client's or a
    hand-written payload gets past that. It would fail with "multiple values for cursor" at
    every run, so it goes to dead at once, with the reason, payload whole, even with
    retry=False (dropping it would lose a job that never ran)."""
    world("test:1:revCur000001")
    job = {"class": "it.walk", "queue": QUEUE, "args": [3], "kwargs": {"cursor": 1},
           "jid": "c0ffee0000000000000000ab", "created_at": time.time(),
           "enqueued_at": time.time(), **options}
    r.lpush(f"queue:{QUEUE}", json.dumps(job))
    entry = wait_until(lambda: r.zrange("dead", 0, -1), timeout=5, message="a dead entry")
    dead = json.loads(entry[0])
    assert dead["error_class"] == "forkq.errors.UnrunnablePayload"
    assert "kwargs name `cursor`" in dead["error_message"] and "it.walk" in dead["error_message"]
    assert dead["kwargs"] == {"cursor": 1} and dead["args"] == [3] and dead["jid"] == job["jid"]
    assert r.zcard("retry") == 0 and done == [], "no retry, and no item ran"


@pytest.mark.timeout(20)
def test_a_payload_naming_cursor_ends_its_lock_batch_result_and_death_handlers_as_dead_does(world, r):
    """The way to dead an UnrunnablePayload takes, with dead=False and retry=False on the
    payloads: a unique job's lock released, a batch job counted failed with fate dead, a
    keep_result job's failure kept, and the death handlers run."""
    from forkq import hooks, unique
    deaths = []
    hooks.ON_DEATH.append(lambda job, exc: deaths.append((job["jid"], type(exc).__name__)))
    try:
        jid = walk.options(unique_for=60, keep_result=60, dead=False, retry=False).enqueue(3)
        batch = forkq.Batch(description="rev")  # a unique job cannot join one
        with batch:
            in_batch = walk.options(dead=False).enqueue(3)
        # as another client would write them: `cursor` in kwargs, the lock taken for that
        for i, raw in enumerate(r.lrange(f"queue:{QUEUE}", 0, -1)):
            job = json.loads(raw)
            job["kwargs"] = {"cursor": 2}
            r.lset(f"queue:{QUEUE}", i, json.dumps(job))
            if job["jid"] == jid:
                lock = unique.lock_of(job)
                r.set(lock, jid, ex=60)
        world("test:1:revCurEnd0001")
        wait_until(lambda: r.zcard("dead") == 2 and len(deaths) == 2, timeout=5, message="both dead")
        assert sorted(deaths) == sorted([(jid, "UnrunnablePayload"), (in_batch, "UnrunnablePayload")])
        assert r.get(lock) is None, "the lock released"
        with pytest.raises(forkq.JobFailed, match="went to the dead set.*UnrunnablePayload"):
            forkq.result(jid, timeout=3)
        failures = forkq.batch_status(batch.bid).failures
        assert list(failures) == [in_batch] and failures[in_batch]["fate"] == "dead"
        assert done == []
    finally:
        hooks.ON_DEATH.pop()
