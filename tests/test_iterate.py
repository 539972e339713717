"""Iterable jobs (@forkq.job(iterable=True), forkq/iterate.py): a long job walks items by a
cursor, is interrupted between two items at its worker's stop and put back at the head of
its queue with a checkpoint, and resumes from the checkpoint after a stop, a crash, a
failure's retry; a cancel ends it at a yield.

In-process workers (tests/helpers.InProcessWorkers) against the shared Redis, except one
test that SIGTERMs a real master."""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest

import forkq
from forkq import hooks, iterate, keys, testing
from forkq.fetch import requeue_owner
from forkq.timelimit import WATCHDOG
from helpers import InProcessWorkers, wait_until
from test_supervisor import APPS, Master

QUEUE = "itq"
BEAT_S = 0.1

done: list[tuple[int, int]] = []   # (item, run) of each item a walk finished
runs: list[tuple[str, object]] = []  # ("start", cursor) / ("closed", exception class name)
gate = threading.Event()            # holds crashy at its item 30
at_gate = threading.Event()
abandon = threading.Event()
failed_once: set[str] = set()


def _walk(tag: str, n: int, cursor, pause: float):
    start = 0 if cursor is None else cursor + 1
    run = sum(1 for r in runs if r[0] == f"start {tag}")
    runs.append((f"start {tag}", cursor))
    try:
        for i in range(start, n):
            time.sleep(pause)
            done.append((i, run))
            yield i
    except BaseException as exc:
        runs.append(("closed", type(exc).__name__))
        raise


@forkq.job(queue=QUEUE, name="it.walk", iterable=True)
def walk(n, cursor=None):
    """n items of 2 ms each."""
    yield from _walk("walk", n, cursor, 0.002)


@forkq.job(queue=QUEUE, name="it.crashy", iterable=True)
def crashy(n, cursor=None):
    start = 0 if cursor is None else cursor + 1
    run = sum(1 for r in runs if r[0] == "start crashy")
    runs.append(("start crashy", cursor))
    for i in range(start, n):
        time.sleep(0.002)
        if i == 30 and run == 0:
            at_gate.set()
            gate.wait(10)
            if abandon.is_set():
                return "abandoned"  # a thread "killed" mid-item: it writes nothing more
        done.append((i, run))
        yield i


@forkq.job(queue=QUEUE, name="it.flaky", iterable=True, retry=3)
def flaky(n, cursor=None):
    start = 0 if cursor is None else cursor + 1
    run = sum(1 for r in runs if r[0] == "start flaky")
    runs.append(("start flaky", cursor))
    for i in range(start, n):
        if i == 10 and "flaky" not in failed_once:
            failed_once.add("flaky")
            raise ValueError("item 10 failed")
        done.append((i, run))
        yield i
    return "all done"


@forkq.job(queue=QUEUE, name="it.cursorless", iterable=True, keep_result=60)
def dicts(n, cursor=None):
    """Yields a dict cursor: what comes back is what JSON gives."""
    seen = (cursor or {}).get("at", -1)
    for i in range(seen + 1, n):
        done.append((i, 0))
        yield {"at": i}
    return n


@pytest.fixture
def world(redis_url, monkeypatch):
    """start(identity) -> (manager, launcher) of an in-process worker on QUEUE."""
    done.clear()
    runs.clear()
    gate.clear()
    at_gate.clear()
    abandon.clear()
    failed_once.clear()
    monkeypatch.setattr(hooks, "SERVER_MIDDLEWARE", [])
    monkeypatch.setattr(WATCHDOG, "grace", 0.5)
    forkq.configure(redis_url)
    made: list[InProcessWorkers] = []

    def start(identity: str, concurrency: int = 1):
        w = InProcessWorkers(redis_url, identity, QUEUE, BEAT_S)
        made.append(w)
        return w.start(concurrency)

    try:
        yield start
    finally:
        abandon.set()
        gate.set()
        for w in made:
            w.close()


def stop(manager, launcher) -> float:
    """A graceful stop of an in-process worker, as the worker's own stop begins it; its
    duration."""
    t0 = time.monotonic()
    launcher.stop()
    assert manager.stop(time.monotonic() + 5)
    manager.fetch.close()
    return time.monotonic() - t0


def checkpoint(r, jid):
    raw = r.get(iterate.PREFIX + jid)
    return None if raw is None else json.loads(raw)["cursor"]


def items(run=None):
    return sorted(i for i, ru in done if run is None or ru == run)


@pytest.mark.timeout(30)
def test_a_stop_puts_the_job_back_at_the_head_with_its_checkpoint_and_a_new_worker_resumes(world, r):
    manager, launcher = world("test:1:iterA00000001")
    jid = walk.enqueue(400)  # 0.8 s of items: the stop lands in the middle
    pushed = time.time()
    r.lpush(f"queue:{QUEUE}", json.dumps({"class": "it.other", "args": [], "jid": "x" * 24,
                                          "queue": QUEUE}))  # pushed later: behind it
    wait_until(lambda: len(done) >= 50, timeout=5, message="50 items")
    took = stop(manager, launcher)
    assert took < 1.0, took  # no waiting for the job's end (or --timeout)
    first = items()
    assert 50 <= len(first) < 400
    assert first == list(range(len(first)))
    assert ("closed", "GeneratorExit") in runs, "the generator was closed: its finally ran"
    head = json.loads(r.lindex(f"queue:{QUEUE}", -1))  # the right end: the next one fetched
    assert head["jid"] == jid and "error_class" not in head and "retry_count" not in head
    # dated as it went back: the queue's latency is not the run's length
    assert head["enqueued_at"] > pushed + 0.05 and head["created_at"] <= pushed
    assert r.llen(f"queue:{QUEUE}") == 2
    assert r.hlen(keys.inflight("test:1:iterA00000001")) == 0
    assert checkpoint(r, jid) == first[-1]
    assert 0 < r.ttl(iterate.PREFIX + jid) <= iterate.TTL_S
    assert r.zcard("retry") == 0 and r.zcard("dead") == 0

    r.lrem(f"queue:{QUEUE}", 1, r.lindex(f"queue:{QUEUE}", 0))  # the placeholder, unrunnable here
    world("test:1:iterB00000001")
    wait_until(lambda: len(done) >= 400, timeout=10, message="the rest of the items")
    assert runs[-1] == ("start walk", first[-1])
    assert items() == list(range(400)), "every item exactly once in all"
    wait_until(lambda: r.get(iterate.PREFIX + jid) is None, timeout=5,
               message="the checkpoint deleted with the ack")


@pytest.mark.timeout(30)
def test_after_a_crash_the_job_resumes_from_its_last_checkpoint(world, r, monkeypatch):
    monkeypatch.setattr(iterate, "FLUSH_S", 0.02)
    ident = "test:1:iterC00000001"
    manager, launcher = world(ident)
    jid = crashy.enqueue(60)
    assert at_gate.wait(5)
    saved = checkpoint(r, jid)
    assert saved is not None and 10 <= saved < 30, saved
    # the crash: this process writes nothing more, and its master's recovery puts its
    # in-flight job back as a suspect (as after a SIGKILL)
    launcher.stop()
    assert not manager.stop(time.monotonic() + 0.2)  # its thread is stuck: a hard stop
    requeue_owner(r, ident, [QUEUE], crashed=True)
    abandon.set()
    gate.set()
    assert r.llen(keys.suspects(QUEUE)) == 1

    world("test:1:iterD00000001")
    wait_until(lambda: items(1)[-1:] == [59], timeout=10, message="the second run to the end")
    assert runs[-1] == ("start crashy", saved)
    assert items(0) == list(range(30))
    assert items(1) == list(range(saved + 1, 60)), "resumed after the checkpoint"
    # redone: only the items between the last checkpoint and the crash
    assert [i for i in range(60) if items().count(i) > 1] == list(range(saved + 1, 30))


@pytest.mark.timeout(20)
def test_a_cancel_ends_the_job_at_a_yield_without_an_exception_raised_in_its_thread(world, r):
    fired: list[int] = []
    WATCHDOG.on_cancel = lambda: fired.append(1)
    try:
        world("test:1:iterE00000001")
        jid = walk.enqueue(5000)
        wait_until(lambda: len(done) >= 20, timeout=5, message="20 items")
        r.hsetnx(keys.CANCEL, jid, json.dumps({"at": time.time(), "by": "alice", "reason": "oops"}))
        entry = wait_until(lambda: r.zrange("dead", 0, -1), timeout=5, message="dead entry")
    finally:
        WATCHDOG.on_cancel = None
    dead = json.loads(entry[0])
    assert dead["jid"] == jid and dead["error_class"] == "forkq.JobCancelled"
    assert dead["error_message"] == "cancelled by alice: oops (stopped between two items)"
    assert ("closed", "GeneratorExit") in runs, "closed at a yield, not interrupted inside an item"
    assert fired == [], "no exception was raised into the thread (no replacement asked)"
    assert len(done) < 5000
    assert checkpoint(r, jid) == items()[-1], "kept: a retry from dead resumes"
    assert not r.hexists(keys.CANCEL, jid)


@pytest.mark.timeout(20)
def test_a_failure_keeps_the_checkpoint_and_its_retry_resumes(world, r):
    world("test:1:iterF00000001")
    jid = flaky.options(keep_result=60).enqueue(20)
    entry = wait_until(lambda: r.zrange("retry", 0, -1), timeout=5, message="a retry entry")
    assert checkpoint(r, jid) == 9, "written as the job raised: the last item it finished"
    # the retry, due now (no scheduler runs in this process)
    r.zrem("retry", entry[0])
    r.lpush(f"queue:{QUEUE}", entry[0])
    assert forkq.result(jid, timeout=5) == "all done"
    assert runs == [("start flaky", None), ("start flaky", 9)]
    assert items() == list(range(20)) and items(1) == list(range(10, 20))
    wait_until(lambda: r.get(iterate.PREFIX + jid) is None, timeout=5, message="checkpoint deleted")


@pytest.mark.timeout(20)
def test_success_deletes_the_checkpoint_with_the_ack(world, r, monkeypatch):
    monkeypatch.setattr(iterate, "FLUSH_S", 0.005)
    world("test:1:iterG00000001")
    seen: list[bool] = []

    @forkq.job(queue=QUEUE, name="it.watched", iterable=True)
    def watched(n, cursor=None):
        for i in range(n):
            time.sleep(0.003)
            yield i
        seen.append(r.get(iterate.PREFIX + forkq.current_job()["jid"]) is not None)

    jid = watched.enqueue(20)
    wait_until(lambda: seen, timeout=5, message="the end of the walk")
    assert seen == [True], "a checkpoint was written while it ran"
    wait_until(lambda: r.hlen(keys.inflight("test:1:iterG00000001")) == 0, timeout=5, message="the ack")
    assert r.get(iterate.PREFIX + jid) is None


@pytest.mark.timeout(10)
def test_json_cursors_and_return_values(world, r):
    world("test:1:iterH00000001")
    jid = dicts.enqueue(5)
    assert forkq.result(jid, timeout=5) == 5
    r.set(iterate.PREFIX + "j" * 24, json.dumps({"cursor": {"at": 2}, "at": 0}))
    r.lpush(f"queue:{QUEUE}", json.dumps({"class": "it.cursorless", "args": [6], "jid": "j" * 24,
                                          "queue": QUEUE, "keep_result": 60}))
    assert forkq.result("j" * 24, timeout=5) == 6
    assert items() == [0, 1, 2, 3, 3, 4, 4, 5]
    # a jid redis-py cannot send keeps no checkpoint: its delete, batched with the next
    # claim, would fail every claim after it
    done.clear()
    r.lpush(f"queue:{QUEUE}", b'{"class":"it.cursorless","args":[2],"jid":"\\udc80x","queue":"itq"}')
    wait_until(lambda: items() == [0, 1], timeout=5, message="the jid-less walk")
    jid = dicts.enqueue(1)
    assert forkq.result(jid, timeout=5) == 1, "claims go on"


def test_inline_runs_the_generator_to_its_end(redis_url):
    done.clear()
    runs.clear()
    with testing.inline():
        walk.enqueue(5)
    assert items() == [0, 1, 2, 3, 4] and runs == [("start walk", None)]


def test_the_decorator_refuses_generators_without_iterable_and_other_misuses():
    with pytest.raises(TypeError, match=r"iterable=True"):
        @forkq.job(name="it.bad1")
        def gen(cursor=None):
            yield 1
    with pytest.raises(TypeError, match="has no yield"):
        @forkq.job(name="it.bad2", iterable=True)
        def plain(cursor=None):
            return 1
    with pytest.raises(TypeError, match="async generator"):
        @forkq.job(name="it.bad3", iterable=True)
        async def agen(cursor=None):
            yield 1
    with pytest.raises(TypeError, match="`cursor`"):
        @forkq.job(name="it.bad4", iterable=True)
        def nocursor(n):
            yield n
    with forkq.testing.fake():
        with pytest.raises(TypeError, match="`cursor` is for the worker to pass.*nothing was pushed"):
            walk.enqueue(3, cursor=2)  # not "an unexpected keyword argument": it has one
        with pytest.raises(TypeError, match="nothing was pushed"):
            walk.enqueue(3, 2)


@pytest.mark.timeout(60)
def test_a_real_master_stops_at_once_during_a_long_iterable_job_and_the_next_one_finishes_it(
        redis_url, r, tmp_path):
    """SIGTERM to a master whose child runs a 2-second iterable job (--timeout 25), 0.3 s
    into it: the master exits at once (not after the job's 1.7 s left), the job back on its queue with its checkpoint;
    a second master runs the rest, each item once in all."""
    def recorded():
        return [int(x.split()[0]) for x in r.lrange("iter:items", 0, -1)]

    first = Master(redis_url, tmp_path / "m1", processes=1, concurrency=1,
                   app=APPS / "iterate_jobs.py", args=["--timeout", "25"]).start()
    second = None
    try:
        jid = forkq.Client(redis_url).push("iter.export", [200])
        wait_until(lambda: first.check() and len(recorded()) >= 30, timeout=15, interval=0.02,
                   message=f"30 items\n{first.tail()}")
        t0 = time.monotonic()
        first.signal(signal.SIGTERM)
        assert first.wait(10) == 0
        took = time.monotonic() - t0
        assert took < 1.2, f"stopped in {took:.1f} s: it waited for the job\n{first.tail()}"
        got = recorded()
        assert len(got) < 200 and got == list(range(len(got)))
        assert [json.loads(x)["jid"] for x in r.lrange("queue:default", 0, -1)] == [jid]
        assert checkpoint(r, jid) == got[-1]

        second = Master(redis_url, tmp_path / "m2", processes=1, concurrency=1,
                        app=APPS / "iterate_jobs.py").start()
        wait_until(lambda: second.check() and r.get(iterate.PREFIX + jid) is None, timeout=20,
                   interval=0.05, message=f"the job finished\n{second.tail()}")
        assert recorded() == list(range(200)), "each item exactly once"
        assert len({x.split()[1] for x in r.lrange("iter:items", 0, -1)}) == 2  # two children
        assert r.zcard("retry") == 0 and r.zcard("dead") == 0
    finally:
        for m in (first, second):
            if m is not None:
                m.kill()
