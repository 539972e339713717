"""Review of the seams between job progress, cancellation, chains and older features.

In-process against the shared redis-server: a real Manager (its processor threads) and a
Launcher beating every 0.1 s, as in test_cancel_worker; the operator's side goes through
forkq.api.cancel / locate as `forkq cancel` and `forkq job` do."""

from __future__ import annotations

import json
import threading
import time

import pytest

import forkq
from forkq import api, hooks, jobprogress, keys, logs
from forkq.launcher import _work_entry
from forkq.timelimit import WATCHDOG
from helpers import InProcessWorkers, wait_beats, wait_until

QUEUE = "seamq"
IDENTITY = "test:1:seams000000a"
BEAT_S = 0.1

started: dict[str, threading.Event] = {}
ran: list[str] = []
release = threading.Event()
spun_once: set[str] = set()


def _mark(tag: str) -> None:
    started.setdefault(tag, threading.Event()).set()


def wait_started(tag: str, timeout: float = 5.0) -> None:
    assert started.setdefault(tag, threading.Event()).wait(timeout), f"{tag} never started"


@forkq.job(queue=QUEUE, name="seam.spin_once", retry=5)
def spin_once(tag: str) -> str:
    """Spins (until cancelled) the first time it runs for a tag; returns at once after."""
    ran.append(f"spin {tag}")
    if tag not in spun_once:
        spun_once.add(tag)
        _mark(tag)
        end = time.monotonic() + 20
        while time.monotonic() < end and not release.is_set():
            pass
    return tag


@forkq.job(queue=QUEUE, name="seam.record")
def record(tag: str) -> None:
    ran.append(f"record {tag}")


@pytest.fixture
def running(redis_url, r, monkeypatch):
    """start(concurrency) -> (manager, launcher): started, beating every BEAT_S seconds."""
    started.clear()
    ran.clear()
    release.clear()
    spun_once.clear()
    monkeypatch.setattr(WATCHDOG, "on_fire", lambda: None)
    monkeypatch.setattr(WATCHDOG, "grace", 0.5)
    monkeypatch.setattr(hooks, "SERVER_MIDDLEWARE", [])
    forkq.configure(redis_url)
    workers = InProcessWorkers(redis_url, IDENTITY, QUEUE, BEAT_S, info={"forkq_cancel": True})
    start = workers.start

    try:
        yield start
    finally:
        release.set()
        workers.close()


def dead(r) -> list[dict]:
    return [json.loads(m) for m in r.zrange("dead", 0, -1)]


@pytest.mark.timeout(20)
def test_a_running_chain_step_cancelled_keeps_the_rest_and_a_retry_from_dead_goes_on(running, r):
    """Cancelled as it runs, a chain's step goes to dead with the steps after it in its
    entry; retried from there, it runs and the chain goes on."""
    running()
    jids = forkq.chain(spin_once.call("a"), record.call("b")).enqueue()
    wait_started("a")
    out = api.cancel(r, jids[0], reason="stop", wait=5, poll=0.02)
    assert out.state == "cancelled", out
    (entry,) = dead(r)
    assert entry["jid"] == jids[0] and entry["error_class"] == "forkq.JobCancelled"
    assert [s["jid"] for s in entry["forkq_chain"]] == [jids[1]]
    assert not r.hexists(keys.CANCEL, jids[0])
    dead_set = api.SortedSet(r, "dead")
    assert dead_set.retry_now([dead_set.find(jids[0])]) == 1
    wait_until(lambda: "record b" in ran, timeout=5, message="the chain's next step")
    assert ran == ["spin a", "spin a", "record b"]


@pytest.mark.timeout(20)
def test_a_queued_chain_step_cancelled_keeps_the_rest_and_a_retry_from_dead_goes_on(running, r):
    """Cancelled while it waits, a chain's step goes to dead whole (forkq_chain in its
    entry); retried from dead, the chain goes on."""
    jids = forkq.chain(spin_once.call("q"), record.call("w")).enqueue()
    spun_once.add("q")  # it will not spin when it runs
    out = api.cancel(r, jids[0], wait=1)
    assert out.state == "removed", out
    (entry,) = dead(r)
    assert [s["jid"] for s in entry["forkq_chain"]] == [jids[1]]
    running()
    dead_set = api.SortedSet(r, "dead")
    assert dead_set.retry_now([dead_set.find(jids[0])]) == 1
    wait_until(lambda: "record w" in ran, timeout=5, message="the chain's next step")


class _Sly(str):
    """A str subclass whose methods lie: its own __str__ returns itself, its length is
    small, and encoding it raises (as the heartbeat's entry() encodes a note)."""

    def __str__(self) -> str:
        return self

    def __len__(self) -> int:
        return 3

    def encode(self, *args, **kwargs):  # type: ignore[override]
        raise RuntimeError("encode() of a str subclass")


class _Owner:
    progress = None


def test_a_str_subclass_note_is_kept_as_a_plain_cut_str_so_the_beat_can_write_it():
    """A note of a str subclass is stored as a plain str, cut at 200 characters: the
    heartbeat's entry for it is written, never raising from the subclass's methods."""
    owner = _Owner()
    logs.set_job("j1", "X", QUEUE, {}, owner)
    try:
        jobprogress.progress(1, 2, _Sly("n" * 500))
    finally:
        logs.clear_job()
    note = owner.progress[3]
    assert type(note) is str and note == "n" * jobprogress.NOTE_LIMIT
    entry = json.loads(_work_entry((QUEUE, b"{}", 1.0, "j1", "t"), owner.progress))
    assert entry[jobprogress.FIELD]["note"] == "n" * jobprogress.NOTE_LIMIT


leftover: list[str] = []
go_on = threading.Event()


@forkq.job(queue=QUEUE, name="seam.async_reporter")
async def async_reporter(tag: str, done: int, leave_task: bool) -> None:
    """Reports `done` of 100 with its tag as note; with leave_task, starts a task that
    outlives it and keeps reporting; then waits for go_on."""
    import asyncio

    async def behind() -> None:
        while True:
            try:
                forkq.progress(99, 100, "left behind")
                leftover.append("recorded")
            except RuntimeError:
                leftover.append("refused")
                return
            await asyncio.sleep(0.02)

    forkq.progress(done, 100, tag)
    if leave_task:
        asyncio.get_running_loop().create_task(behind())
    while not go_on.is_set():
        await asyncio.sleep(0.01)
    if leave_task:
        return
    while not release.is_set():
        await asyncio.sleep(0.01)


def _shown(r) -> dict[str, dict]:
    out = {}
    for raw in r.hvals(keys.workers(IDENTITY)):
        entry = json.loads(raw)
        out[json.loads(entry["payload"])["jid"]] = entry.get(jobprogress.FIELD)
    return out


@pytest.mark.timeout(20)
def test_async_jobs_sharing_the_loop_each_show_their_own_progress_and_a_left_task_none(running, r):
    """Two async jobs on the one loop thread: each work entry shows its own job's progress;
    a task one of them left running reports nothing once that job ended (RuntimeError),
    and the other job's entry never shows the task's value."""
    leftover.clear()
    go_on.clear()
    running(concurrency=2)
    a = async_reporter.enqueue("a", 10, True)
    b = async_reporter.enqueue("b", 20, False)
    shown = wait_until(lambda: (s := _shown(r)) and all(s.get(j) for j in (a, b)) and s,
                       timeout=5, message="both jobs' progress")
    assert (shown[a]["done"], shown[a]["note"]) == (99, "left behind")  # the task, while a runs
    assert (shown[b]["done"], shown[b]["note"]) == (20, "b")
    go_on.set()
    wait_until(lambda: "refused" in leftover, timeout=5, message="the left task refused")
    wait_until(lambda: list(_shown(r)) == [b], timeout=5, message="a's entry gone")
    wait_beats(r, IDENTITY)
    assert _shown(r)[b]["note"] == "b"


@forkq.job(queue=QUEUE, name="seam.kept_spin", keep_result=60)
def kept_spin(tag: str) -> str:
    _mark(tag)
    while not release.is_set():
        pass
    return tag


@pytest.mark.timeout(20)
def test_a_cancelled_keep_result_chain_step_fails_its_waiter_and_the_next_waits(running, r):
    """A keep_result step cancelled as it runs: its reader gets JobFailed (JobCancelled)
    at once; the next step, never pushed, has no result."""
    running()
    jids = forkq.chain(kept_spin.call("k"), record.call("after")).enqueue()
    wait_started("k")
    assert api.cancel(r, jids[0], wait=5, poll=0.02).state == "cancelled"
    with pytest.raises(forkq.JobFailed, match="JobCancelled"):
        forkq.result(jids[0]).get(timeout=1)
    assert api.locate(r, jids[1]).state == "not_found"
    assert "record after" not in ran


def test_forkq_job_on_a_paused_queue_says_it_is_paused_not_that_it_runs_next(redis_url, r, capsys):
    """A job waiting on a paused queue is not "0 runs next": locate and `forkq job` say the
    queue is paused; once resumed, the line is as before."""
    from forkq import cli, pause
    c = forkq.Client(redis_url)
    jid = c.push("seam.record", ["p"], queue="held")
    pause.pause(r, "held", reason="maintenance")
    where = api.locate(r, jid)
    assert where.state == "queued" and where.paused is True and where.to_dict()["paused"] is True
    assert cli.main(["job", jid]) == 0
    assert capsys.readouterr().out.strip() == (
        f"{jid}: waiting on queue held (paused: nothing runs from it until it is resumed), "
        "position 0 (0 runs next)")
    pause.resume(r, "held")
    where = api.locate(r, jid)
    assert where.paused is False
    assert where.describe() == "waiting on queue held, position 0 (0 runs next)"


@pytest.mark.timeout(20)
def test_a_running_job_whose_jid_utf8_cannot_carry_does_not_stop_the_heartbeat(running, r):
    """A payload's jid of a lone surrogate escape ("\\udc80", valid JSON another client may
    write) runs as any job; while it runs, its process keeps beating (its running jobs
    shown) and a cancel of its other job is acted on. The beat's HMGET of forkq:cancel
    carried that jid, and redis-py's refusal to encode it failed every beat: the process
    looked dead, read no cancel and no signal."""
    running(concurrency=2)
    raw = ('{"class":"seam.spin_once","args":["odd"],"jid":"odd\\udc80","queue":"%s","retry":true}'
           % QUEUE)
    r.sadd(keys.QUEUES, QUEUE)
    r.lpush(keys.queue(QUEUE), raw)
    wait_started("odd")
    jid = spin_once.enqueue("other")
    wait_started("other")
    beats = set()
    wait_until(lambda: beats.add(r.hget(IDENTITY, "beat")) or len(beats) >= 3, timeout=3,
               message="the process beating on")
    assert len(r.hvals(keys.workers(IDENTITY))) == 2
    assert api.cancel(r, jid, wait=3, poll=0.02).state == "cancelled"


@pytest.mark.timeout(20)
@pytest.mark.parametrize("extra", ['"bid":"seam-bid"', '"unique_for":600', '"keep_result":60'])
def test_a_batch_unique_or_kept_job_whose_jid_utf8_cannot_carry_is_acked_and_fetching_goes_on(
        running, r, extra):
    """A batch or unique job whose payload's jid is a lone surrogate escape: its
    after-success actions (the batch count, the lock's release) ride with the next claim;
    unencodable, they failed every claim after it, and the process ran nothing more. A
    keep_result one could not write its result and stayed in flight, to run again."""
    running()
    raw = ('{"class":"seam.record","args":["odd"],"jid":"odd\\udc80","queue":"%s",%s}'
           % (QUEUE, extra))
    r.sadd(keys.QUEUES, QUEUE)
    r.lpush(keys.queue(QUEUE), raw)
    wait_until(lambda: "record odd" in ran, timeout=5, message="the odd job ran")
    record.enqueue("next")
    wait_until(lambda: "record next" in ran, timeout=5, message="the next job ran")
    wait_until(lambda: r.hlen(keys.inflight(IDENTITY)) == 0, timeout=5,
               message="both acknowledged")


def test_a_jid_utf8_cannot_carry_is_refused_by_locate_and_cancel_with_a_clear_error(r):
    """api.locate / api.cancel given a jid with a lone surrogate: a ValueError saying so,
    not redis-py's UnicodeEncodeError from inside the search; nothing written."""
    for call in (lambda: api.locate(r, "ab\udc80"), lambda: api.cancel(r, "ab\udc80", wait=0)):
        with pytest.raises(ValueError, match="UTF-8 cannot carry"):
            call()
    assert not r.exists(keys.CANCEL)


@pytest.mark.timeout(20)
def test_a_cancelled_batch_job_fires_on_complete_and_a_retry_from_dead_then_fires_on_success(running, r):
    """The only job of a batch, cancelled as it runs: on_complete is pushed and runs;
    retried from dead, it succeeds and on_success runs too (a cancel is a failure the
    batch counts, not one that ends it for good)."""
    running()
    with forkq.Batch().on_complete(record, "complete").on_success(record, "success") as batch:
        jid = spin_once.enqueue("bat")
    wait_started("bat")
    assert api.cancel(r, jid, wait=5, poll=0.02).state == "cancelled"
    wait_until(lambda: "record complete" in ran, timeout=5, message="on_complete ran")
    assert "record success" not in ran and batch.status().failures[jid]["fate"] == "dead"
    dead_set = api.SortedSet(r, "dead")
    assert dead_set.retry_now([dead_set.find(jid)]) == 1
    wait_until(lambda: "record success" in ran, timeout=5, message="on_success ran")
    assert ran.count("record complete") == 1


def test_a_jid_given_twice_to_cancel_many_is_one_job_removed_once(redis_url, r):
    """cancel_many([J, J]) of a waiting job: both answers say it was removed; the second
    search no longer found it in dead and claimed a worker had stopped it."""
    c = forkq.Client(redis_url)
    jid = c.push("seam.record", ["twice"], queue=QUEUE)
    first, second = api.cancel_many(r, [jid, jid], wait=1)
    assert first.state == second.state == "removed" and first is second
    assert len(dead(r)) == 1


def test_a_number_that_fakes_its_class_is_stored_as_a_plain_one_so_the_beat_can_write_it():
    """A MagicMock(spec=int) says its __class__ is int; with comparisons that pass, the
    fast path stored the mock itself, and the heartbeat's json.dumps raised on it. What
    is stored is a plain int or float, whatever the argument claims to be."""
    from unittest import mock
    fake = mock.MagicMock(spec=int)
    for op in ("__ge__", "__le__", "__lt__", "__gt__"):
        getattr(fake, op).return_value = True
    fake.__int__.return_value = 7
    owner = _Owner()
    logs.set_job("j2", "X", QUEUE, {}, owner)
    try:
        jobprogress.progress(fake, fake)
    finally:
        logs.clear_job()
    assert type(owner.progress[1]) is int and type(owner.progress[2]) is int
    entry = json.loads(_work_entry((QUEUE, b"{}", 1.0, "j2", "t"), owner.progress))
    assert entry[jobprogress.FIELD]["done"] == 7


def test_a_progress_the_beat_cannot_write_leaves_the_entry_without_it():
    """Whatever slipped into a Processor's progress (set by hand here: forkq.progress()
    stores only plain values), the work entry is written, without the progress."""
    cur = (QUEUE, b'{"jid":"j3"}', 1.0, "j3", "t")
    for bad in [("j3", object(), None, None, 1.0), ("j3", 1, 2, b"bytes note", 1.0), ("j3",)]:
        entry = json.loads(_work_entry(cur, bad))
        assert entry == {"queue": QUEUE, "payload": '{"jid":"j3"}', "run_at": 1}
    assert json.loads(_work_entry(cur, ("j3", 1, 2, "n", 1.0)))[jobprogress.FIELD]["note"] == "n"
