"""Batches (forkq.Batch): the push that joins a batch, the worker's counts, the callbacks.

In-process against the shared redis-server: Managers whose processor is driven by hand
(claim, run, done, and the next claim that carries the ack and its batch count), so each
test takes milliseconds. One test runs a real master with two children and SIGKILLs one.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import redis

import forkq
from forkq import api, keys
from forkq import batch as batch_mod
from forkq import testing
from forkq.fetch import requeue_owner_counts
from corekit import hand_driven, hand_driven_fixture, run_one
from helpers import wait_until
from test_supervisor import sup_events, start_master, wait_event  # noqa: F401 (a fixture)

calls: list = []
flaky_failures: dict[str, int] = {}


@forkq.job(queue="bq", name="batch_test.load")
def load(n: int) -> None:
    calls.append(["load", n])


@forkq.job(queue="bq", retry=1, name="batch_test.fails")
def fails(n: int) -> None:
    raise RuntimeError(f"boom {n}")


@forkq.job(queue="bq", name="batch_test.flaky")
def flaky(tag: str) -> None:
    """Fails the first time it runs for a tag, then succeeds."""
    if not flaky_failures.get(tag):
        flaky_failures[tag] = 1
        raise ValueError(f"first run of {tag}")
    calls.append(["flaky", tag])


@forkq.job(queue="bq", name="batch_test.fan_out")
def fan_out(n: int) -> None:
    """Adds n jobs to its own batch, as a job that finds more work does."""
    calls.append(["fan_out", n])
    with forkq.current_batch():
        load.enqueue_many([[i] for i in range(n)])


@forkq.job(queue="bcb", name="batch_test.notify")
def notify(tag: str) -> None:
    calls.append(["notify", tag])


@forkq.job(queue="bcb", name="batch_test.report")
def report(tag: str) -> None:
    calls.append(["report", tag])


@pytest.fixture
def client(redis_url):
    calls.clear()
    flaky_failures.clear()
    c = forkq.configure(redis_url)
    try:
        yield c
    finally:
        forkq.client._default = None


# a Manager on queue bq, not started: run_one() drives its one processor
worker = hand_driven_fixture("bq", "test:1:batch0000000a")


def callbacks(r) -> list[tuple[str, list]]:
    """The callback jobs pushed so far, oldest first: (class, args)."""
    return [(j["class"].rpartition(".")[2], j["args"])
            for j in map(json.loads, reversed(r.lrange("queue:bcb", 0, -1)))]


def run_all(worker, n: int) -> None:
    for _ in range(n):
        run_one(worker)
    worker.fetch.fetch(0)  # the claim that carries the last acks


def retry_now(r) -> None:
    """Move the retry set's jobs back onto their queue, as the poller does when due."""
    for raw in r.zrange("retry", 0, -1):
        r.zrem("retry", raw)
        r.lpush(f"queue:{json.loads(raw)['queue']}", raw)


def test_pushes_inside_join_the_batch_in_the_same_multi(client, r):
    before = r.info("commandstats").get("cmdstat_exec", {}).get("calls", 0)
    outside = load.enqueue(0)
    batch = forkq.Batch(description="import 42")
    with batch:
        one = load.enqueue(1)
        many = load.enqueue_many([[2], [3], [4]])
        later = load.enqueue_in(600, 5)
    jobs = {j["jid"]: j for j in map(json.loads, r.lrange("queue:bq", 0, -1))}
    assert "bid" not in jobs[outside]  # a push outside any batch is as before
    assert all(jobs[jid]["bid"] == batch.bid for jid in [one, *many])
    (scheduled,) = r.zrange("schedule", 0, -1)
    assert json.loads(scheduled)["bid"] == batch.bid
    assert {m.decode() for m in r.smembers(f"forkq:batch:{batch.bid}:jids")} == {one, *many, later}
    # one MULTI per push (enqueue_many's chunk is one push); the opening is a script call
    assert r.info("commandstats")["cmdstat_exec"]["calls"] - before == 3
    status = forkq.batch_status(batch.bid)
    assert (status.total, status.pending, status.failures) == (5, 5, {})
    assert status.sealed and not status.complete and not status.success and not status.abandoned
    assert status.description == "import 42"
    # TTL_S past the latest due time (the job pushed with enqueue_in(600))
    assert batch_mod.TTL_S + 590 < r.ttl(f"forkq:batch:{batch.bid}") <= batch_mod.TTL_S + 601
    assert batch_mod.TTL_S + 590 < r.ttl(f"forkq:batch:{batch.bid}:jids") <= batch_mod.TTL_S + 601


def test_jobs_without_a_batch_are_acked_as_before_and_a_foreign_bid_changes_nothing(client, r, worker):
    load.enqueue(1)
    (unit,) = worker.fetch.fetch(1)
    assert worker.processors[0].process(unit) is True  # a plain ack: no actions
    worker.done(unit.token)
    # a payload naming a batch forkq never made (a Sidekiq Pro bid, say) runs as any job
    forkq.default_client().push("batch_test.load", [2], queue="bq", bid="sidekiq-pro-bid")
    run_all(worker, 1)
    assert calls == [["load", 1], ["load", 2]]
    assert r.hlen(worker.fetch.inflight_key) == 0 and r.keys("forkq:batch:*") == []


def test_success_fires_once_after_the_last_success_and_with_its_ack(client, r, worker):
    batch = forkq.Batch().on_success(notify, "s").on_complete(report, "c")
    with batch:
        load.enqueue_many([[1], [2]])
    run_one(worker)
    run_one(worker)  # this claim carried the first job's ack: one of two counted
    assert callbacks(r) == [] and forkq.batch_status(batch.bid).pending == 1
    worker.fetch.fetch(0)  # the last ack: its success, and the callbacks, in that call
    assert callbacks(r) == [("report", ["c"]), ("notify", ["s"])]
    (raw,) = [j for j in r.lrange("queue:bcb", 0, -1) if b"notify" in j]
    pushed = json.loads(raw)
    assert type(pushed["enqueued_at"]) is float and pushed["queue"] == "bcb" and "bid" not in pushed
    status = forkq.batch_status(batch.bid)
    assert (status.total, status.pending, status.complete, status.success) == (2, 0, True, True)
    # a finished batch's keys stay a day, for its status
    assert 0 < r.ttl(f"forkq:batch:{batch.bid}") <= batch_mod.DONE_TTL_S
    assert not r.exists(f"forkq:batch:{batch.bid}:jids")  # every job left it as it succeeded
    worker.fetch.flush_acks()
    assert len(callbacks(r)) == 2


def test_nothing_fires_before_sealing_and_the_seal_fires_what_is_due(client, r, worker):
    batch = forkq.Batch().on_success(notify, "s")
    with batch:
        load.enqueue(1)
        run_all(worker, 1)  # the job ended before the batch was sealed
        assert forkq.batch_status(batch.bid).pending == 0
        assert callbacks(r) == []
    assert callbacks(r) == [("notify", ["s"])]
    assert calls == [["load", 1]]


def test_an_empty_batch_fires_at_once(client, r):
    with forkq.Batch().on_success(notify, "s").on_complete(report, "c") as batch:
        pass
    assert callbacks(r) == [("report", ["c"]), ("notify", ["s"])]
    status = batch.status()
    assert (status.total, status.pending, status.complete, status.success) == (0, 0, True, True)


def test_complete_fires_with_a_failure_and_a_dead_job_keeps_success_back(client, r, worker):
    with forkq.Batch().on_success(notify, "s").on_complete(report, "c") as batch:
        load.enqueue(1)
        failing = fails.enqueue(2)
    run_all(worker, 2)  # one success, one failure scheduled to retry
    assert callbacks(r) == [("report", ["c"])]
    status = batch.status()
    assert status.complete and not status.success and status.pending == 1
    assert status.failures[failing]["error_class"] == "RuntimeError"
    assert status.failures[failing]["error_message"] == "boom 2"
    assert status.failures[failing]["fate"] == "retry"
    retry_now(r)
    run_all(worker, 1)  # its last try: dead
    assert r.zcard("dead") == 1
    status = batch.status()
    assert status.failures[failing]["fate"] == "dead" and not status.success
    assert callbacks(r) == [("report", ["c"])]  # complete once, success never


def test_a_retried_job_that_succeeds_lets_success_fire(client, r, worker):
    with forkq.Batch().on_success(notify, "s").on_complete(report, "c") as batch:
        jid = flaky.enqueue("f")
    run_all(worker, 1)
    assert callbacks(r) == [("report", ["c"])]
    assert list(batch.status().failures) == [jid]
    retry_now(r)
    run_all(worker, 1)
    assert callbacks(r) == [("report", ["c"]), ("notify", ["s"])]
    status = batch.status()
    assert status.success and status.failures == {} and status.pending == 0


def test_a_job_run_again_counts_once(client, r, worker):
    """A job whose success was counted runs again (its claim's reply was lost and the
    claim sent again, or a master put it back while that claim was stuck on a frozen
    Redis): the batch holds jids, not a counter, so it counts once and fires once."""
    with forkq.Batch().on_success(notify, "s") as batch:
        load.enqueue_many([[1], [2]])
    raws = list(reversed(r.lrange("queue:bq", 0, -1)))
    run_all(worker, 1)
    r.rpush("queue:bq", raws[0])  # the first job again, ahead of the second
    run_all(worker, 1)
    assert batch.status().pending == 1 and callbacks(r) == []
    run_all(worker, 1)
    r.rpush("queue:bq", raws[1])
    run_all(worker, 1)
    assert calls == [["load", 1], ["load", 1], ["load", 2], ["load", 2]]
    assert callbacks(r) == [("notify", ["s"])]
    assert batch.status().total == 2 and batch.status().pending == 0


def test_a_kill_before_the_ack_loses_no_count(client, r, worker):
    """The child dies after the job ran, before its ack went out: the count was not sent
    either (they travel together), the requeue puts the job back, and its rerun counts."""
    with forkq.Batch().on_success(notify, "s") as batch:
        load.enqueue(1)
    (unit,) = worker.fetch.fetch(1)
    (processor,) = worker.processors
    after = processor.process(unit)
    worker.done(unit.token, after)  # queued; the process dies before its next claim
    assert batch.status().pending == 1
    requeue_owner_counts(r, worker.fetch.identity, ["bq"])
    fresh = hand_driven(forkq.default_client().url, "bq", "test:2:batch0000000b")
    try:
        run_all(fresh, 1)
    finally:
        fresh.fetch.close()
    assert calls == [["load", 1], ["load", 1]] and callbacks(r) == [("notify", ["s"])]


def test_the_count_and_the_ack_go_in_one_call_however_threads_interleave(client, r, worker):
    """A claim takes the queued acks while a processor queues its own: the ack and its
    batch count are one entry, so a claim carries both or neither (an ack sent alone
    would lose the count for good: the job never runs again)."""
    with forkq.Batch().on_success(notify, "s") as batch:
        load.enqueue(1)
    (unit,) = worker.fetch.fetch(1)
    after = worker.processors[0].process(unit)
    fetch = worker.fetch
    take_acks = fetch._take_acks

    def interleaved(limit):
        # the processor's thread, after the claim looked for acks with actions and before
        # it takes the plain acks
        fetch._take_acks = take_acks
        worker.done(unit.token, after)
        return take_acks(limit)

    fetch._take_acks = interleaved
    fetch.fetch(0)
    in_flight = r.hlen(fetch.inflight_key)
    assert in_flight == 1 or batch.status().pending == 0, "ack sent without its count"
    fetch.flush_acks()
    assert r.hlen(fetch.inflight_key) == 0 and callbacks(r) == [("notify", ["s"])]
    assert fetch.unsent_acks() == []


def test_two_processes_ending_the_last_two_jobs_at_once_fire_once(client, r, redis_url):
    """Two children's claims carry the batch's last two successes at the same moment."""
    managers = [hand_driven(redis_url, "bq", f"test:{i}:batch000000{i}c") for i in (1, 2)]
    try:
        for round_ in range(10):
            with forkq.Batch().on_success(notify, str(round_)):
                load.enqueue_many([[1], [2]])
            for m in managers:
                (unit,) = m.fetch.fetch(1)
                m.done(unit.token, m.processors[0].process(unit))
            gate = threading.Barrier(2)

            def ack(m):
                gate.wait()
                m.fetch.fetch(0)
            threads = [threading.Thread(target=ack, args=(m,)) for m in managers]
            for t in threads:
                t.start()
            for t in threads:
                t.join(5)
        assert sorted(args[0] for _, args in callbacks(r)) == sorted(str(i) for i in range(10))
    finally:
        for m in managers:
            m.fetch.close()


def test_a_job_adds_jobs_to_its_own_batch_and_success_waits_for_them(client, r, worker):
    assert forkq.current_batch() is None  # outside any job
    with forkq.Batch().on_success(notify, "s") as batch:
        fan_out.enqueue(2)
    run_all(worker, 1)  # fan_out succeeded: its jobs were counted before its ack
    status = batch.status()
    assert (status.total, status.pending, status.success) == (3, 2, False)
    assert callbacks(r) == []
    run_all(worker, 2)
    assert calls == [["fan_out", 2], ["load", 0], ["load", 1]]
    assert callbacks(r) == [("notify", ["s"])] and batch.status().total == 3


def test_an_exception_inside_abandons_the_batch(client, r, worker):
    batch = forkq.Batch().on_success(notify, "s").on_complete(report, "c")
    with pytest.raises(ZeroDivisionError):
        with batch:
            load.enqueue(1)
            1 / 0
    run_all(worker, 1)  # what was pushed still runs
    status = batch.status()
    assert status.abandoned and not status.sealed and status.pending == 0
    assert not status.complete and callbacks(r) == []
    with pytest.raises(RuntimeError, match="abandoned"):
        batch.on_success(notify, "again")
    assert load.enqueue(2) and "bid" not in json.loads(r.lindex("queue:bq", 0))



def test_abandoning_a_batch_whose_keys_expired_leaves_no_key_behind(client, r):
    """Abandoning HSET the hash whatever: on a batch whose keys had gone (a `with` held open
    past the TTL, an eviction) it made a hash with no TTL, which stayed in Redis for good."""
    batch = forkq.Batch()
    with pytest.raises(ZeroDivisionError):
        with batch:
            r.delete(batch_mod.key(batch.bid))  # its keys expire while the `with` runs
            1 / 0
    assert repr(batch) == f"<forkq.Batch {batch.bid} abandoned>"
    assert r.keys("forkq:batch:*") == [] and batch.status() is None
    assert [k for k in r.keys("*") if r.ttl(k) == -1] == [keys.BATCHES.encode()]

def test_a_poison_job_counts_as_failed(client, r):
    identity = "test:1:poisonbatch00"
    with forkq.Batch().on_complete(report, "c") as batch:
        jid = load.enqueue(1)
    r.hset(f"forkq:inflight:{identity}", "1\nbq", r.rpop("queue:bq"))
    assert requeue_owner_counts(r, identity, ["bq"], crashed=True, poison_after=1).poisoned == 1
    assert batch.status().failures[jid]["error_class"] == "forkq.PoisonJob"
    assert callbacks(r) == [("report", ["c"])]


def test_an_expired_job_counts_as_failed(client, r, worker):
    with forkq.Batch().on_success(notify, "s").on_complete(report, "c") as batch:
        jid = load.options(expires_at=1.0).enqueue(1)  # long past
    run_all(worker, 1)
    assert calls == [] and batch.status().failures[jid]["fate"] == "expired"
    assert callbacks(r) == [("report", ["c"])]


def test_misuse_is_refused_and_pushes_nothing(client, r):
    unique = load.options(unique_for=60)
    with pytest.raises(ValueError, match="unique jobs cannot join a batch"):
        with forkq.Batch():
            unique.enqueue(1)
    with pytest.raises(RuntimeError, match="do not nest"):
        with forkq.Batch():
            with forkq.Batch():
                pass
    with pytest.raises(TypeError, match="takes 1 positional argument"):
        forkq.Batch().on_success(notify)
    with pytest.raises(ValueError, match="cannot be unique"):
        forkq.Batch().on_success(notify.options(unique_for=5), "x")
    with pytest.raises(ValueError, match="cannot expire"):
        forkq.Batch().on_complete(report.options(expires_in=60), "x")
    with forkq.Batch() as sealed:
        pass
    with pytest.raises(RuntimeError, match="sealed"):
        sealed.on_complete(report, "late")
    with pytest.raises(RuntimeError, match="opened once"):
        with sealed:
            pass
    # a job's own batch, reopened inside another: it said "is reopened: opened once"
    reopened = batch_mod.Batch()
    reopened.bid, reopened._state = sealed.bid, "reopened"  # as current_batch() makes it
    with pytest.raises(RuntimeError, match="already open here: batches do not nest"):
        with forkq.Batch():
            with reopened:
                pass
    with reopened:  # alone, it is entered any number of times
        assert batch_mod.joining() is reopened
    assert r.llen("queue:bq") == 0 and r.keys("unique:*") == []
    assert forkq.batch_status("no-such-batch") is None


def test_a_description_utf8_cannot_hold_is_refused_when_the_batch_is_made(client, r):
    """A lone surrogate passed Batch() and forkq.testing, then failed the `with` in
    production with redis-py's UnicodeEncodeError."""
    with pytest.raises(ValueError, match="surrogates not allowed at position 4"):
        forkq.Batch(description="bad \udc80")
    assert r.keys("*") == []
    with forkq.Batch(description="ok \u202e\U0001f600") as fine:
        pass
    assert fine.status().description == "ok \u202e\U0001f600"


def test_a_middleware_dropping_a_job_leaves_it_out_of_the_batch(redis_url, r):
    forkq.configure(redis_url, middleware=[lambda j: None if j["args"] == [2] else j])
    try:
        with forkq.Batch().on_success(notify, "s") as batch:
            load.enqueue_many([[1], [2], [3]])
        assert batch.status().total == 2 and r.llen("queue:bq") == 2
    finally:
        forkq.client._default = None


def test_the_ttls_in_lua_are_the_pythons():
    text = (Path(batch_mod.__file__).parent / "scripts" / "_batchttl.lua").read_text()
    assert int(re.search(r"BATCH_TTL = (\d+)", text).group(1)) == batch_mod.TTL_S
    assert int(re.search(r"BATCH_DONE_TTL = (\d+)", text).group(1)) == batch_mod.DONE_TTL_S


def test_test_modes_run_callbacks_after_the_jobs_without_redis(client, r):
    with testing.inline():
        with forkq.Batch().on_success(notify, "s"):
            load.enqueue(1)
            fan_out.enqueue(1)  # its push, inside the job, joins this batch too
    assert calls == [["load", 1], ["fan_out", 1], ["load", 0], ["notify", "s"]]
    calls.clear()
    with testing.fake() as jobs:
        with forkq.Batch().on_complete(report, "c") as batch:
            load.enqueue(3)
        assert [j["class"] for j in jobs] == ["batch_test.load", "batch_test.report"]
        assert jobs.of(load)[0]["bid"] == batch.bid
        assert jobs.drain() == 2
    assert calls == [["load", 3], ["report", "c"]]
    assert r.keys("forkq:batch:*") == []


@pytest.mark.timeout(60)
def test_a_real_master_fires_once_across_children_and_a_sigkill(start_master, redis_url, r):
    """Two children share a batch; one is SIGKILLed while its job runs: the job runs again
    in the child that replaces it, and the callback runs once, after every job."""
    m = start_master(processes=2, concurrency=1)
    pids = set(m.wait_slots().values())
    pusher = forkq.Client(redis_url)
    batch = forkq.Batch(client=pusher)
    batch.on_success(forkq.jobs.lookup("sup.quick") or _sup_quick(), "batch-done")
    with batch:
        pusher.push("sup.sleep", ["victim", 1.0])
        pusher.push("sup.sleep", ["a", 0.2])
        pusher.push("sup.sleep", ["b", 0.2])
    (start,) = wait_event(r, m, "start", "victim")
    assert start["pid"] in pids
    os.kill(start["pid"], signal.SIGKILL)
    wait_event(r, m, "done", "batch-done", timeout=20)
    assert [e["tag"] for e in sup_events(r, "done")][-1] == "batch-done"
    assert len(sup_events(r, "start", "victim")) == 2 and len(sup_events(r, "done", "victim")) == 1
    status = batch.status()
    assert status.success and status.total == 3 and status.pending == 0
    wait_until(lambda: r.llen("queue:default") == 0, timeout=5)
    assert len(sup_events(r, "done", "batch-done")) == 1


def _sup_quick():
    """sup.quick as the master's app registers it (tests/apps/supervised_jobs.py), for
    building the callback's payload here."""
    @forkq.job(name="sup.quick", retry=0)
    def quick_job(tag):
        pass
    return quick_job


def test_a_callback_whose_queue_key_is_no_list_goes_to_dead_not_lost(client, r, worker):
    """A push onto a key of the wrong type fails; inside the claim that counts the last
    success, it failed the whole call after the callback was marked fired: it was lost."""
    r.set("queue:bcb", "not a list")
    with forkq.Batch().on_success(notify, "s").on_complete(report, "c") as batch:
        load.enqueue(1)
    run_all(worker, 1)  # the claim that carries the ack and fires both: no error
    status = batch.status()
    assert status.success and status.complete and r.hlen(worker.fetch.inflight_key) == 0
    parked = sorted(map(json.loads, r.zrange("dead", 0, -1)), key=lambda j: j["class"])
    assert [(j["class"], j["args"], j["queue"]) for j in parked] == [
        ("batch_test.notify", ["s"], "bcb"), ("batch_test.report", ["c"], "bcb")]
    assert all("queue:bcb" in j["error_message"] and "string" in j["error_message"] for j in parked)
    # an empty batch fires as it is sealed: the seal does not raise either
    with forkq.Batch().on_success(notify, "e"):
        pass
    assert r.zcard("dead") == 3 and r.get("queue:bcb") == b"not a list"
    r.delete("queue:bcb")  # the operator fixes the key and retries them from dead
    dead = api.dead(r)
    assert dead.retry_now(list(dead.entries())) == 3
    assert sorted(callbacks(r)) == [("notify", ["e"]), ("notify", ["s"]), ("report", ["c"])]


def test_a_push_redis_refuses_inside_a_batch_adds_no_job_to_it(client, r, worker):
    """EXEC runs every command of the MULTI even when the LPUSH fails (WRONGTYPE): the jid
    joined the batch without its job, and the batch, sealed by a caller that handled the
    push's error, waited for that job forever."""
    r.set("queue:broken", "not a list")
    with forkq.Batch().on_success(notify, "s") as batch:
        load.enqueue(1)
        with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
            load.options(queue="broken").enqueue(2)
        with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
            load.options(queue="broken").enqueue_many([[3], [4]])
    assert batch.status().total == 1
    run_all(worker, 1)
    assert batch.status().success and callbacks(r) == [("notify", ["s"])]


def test_a_job_scheduled_past_the_batch_ttl_keeps_the_batch_alive(client, r, worker):
    # the seal gave the keys TTL_S whatever the jobs' due times: a job due later ran
    # against expired keys, changed nothing, and the callbacks were never pushed
    far = batch_mod.TTL_S + 86400
    with forkq.Batch().on_success(notify, "s") as batch:
        load.enqueue_in(far, 1)
        load.enqueue(2)  # a later, plain push must not cut the keys' life short again
    b = batch_mod.key(batch.bid)
    # every key must outlive the job's due time, or its success has nothing to count in
    assert min(r.ttl(b), r.ttl(b + ":jids")) > far + batch_mod.TTL_S - 60
    run_all(worker, 1)  # job 2 ends: the refresh keeps the horizon too
    assert min(r.ttl(b), r.ttl(b + ":jids")) > far + batch_mod.TTL_S - 60
    assert batch.status().total == 2


def test_retrying_a_parked_callback_before_its_key_is_fixed_keeps_it(client, r, worker):
    # move_due.lua (the scheduler, the retry poller, api retry_now) ZREMed the entry, then
    # its LPUSH failed with WRONGTYPE and Redis kept the ZREM: the job was in neither place
    r.set("queue:bcb", "not a list")
    with forkq.Batch().on_success(notify, "s"):
        pass
    dead = api.dead(r)
    assert dead.retry_now(list(dead.entries())) == 0
    assert r.zcard("dead") == 1  # still there, to retry once the key is fixed
    r.delete("queue:bcb")
    assert dead.retry_now(list(dead.entries())) == 1 and callbacks(r) == [("notify", ["s"])]


def test_a_stop_hands_over_every_unsent_ack_with_its_actions(client, r, worker):
    """What a stopping child hands its master (unsent_acks) goes with its after-success
    actions: a batch job's count (an ack alone would lose it, so it was left out and the
    job, finished, went back to run again) and a unique job's unlock."""
    with forkq.Batch().on_success(notify, "s"):
        load.enqueue(1)
    load.options(unique_for=60).enqueue(2)
    processor, fetch = worker.processors[0], worker.fetch
    done = {}
    for unit in fetch.fetch(2):
        done[unit.token] = processor.process(unit)
        worker.done(unit.token, done[unit.token])
    assert fetch.pending_acks() == 2
    assert sorted(fetch.unsent_acks()) == sorted(done.items())


def _hand_over(child) -> list:
    """What a stopping child writes to its master's pipe (Worker._hand_over_acks), as the
    master reads it back."""
    from forkq.supervisor import _parse_acks
    from forkq.worker import Worker
    read, write = os.pipe()
    try:
        stopping = Worker.__new__(Worker)
        stopping.report_fd, stopping.manager, stopping._handed = write, child, set()
        stopping._hand_over_acks()
        os.close(write)
        write = -1
        data = os.read(read, 65536)
    finally:
        os.close(read)
        if write >= 0:
            os.close(write)
    return [ack for line in data.split(b"\n") if line for ack in _parse_acks(line)]


def _master(url: str):
    from forkq.settings import Settings
    from forkq.supervisor import Supervisor
    return Supervisor(Settings(redis_url=url, queues=[("bq", 0)]))


def test_a_graceful_stop_does_not_rerun_a_batch_job_that_succeeded(client, r, redis_server, worker):
    """Redis frozen at a stop: the child's claim carrying a batch job's ack and count is
    stuck on the wire, and the master, once the child is gone, applies what the child
    handed over, then puts back its in-flight jobs. The batch job was not handed over
    (an ack alone would lose its count), so the master put it back and it ran again.
    Now the master applies the ack with its count; the stuck claim, landing after, counts
    nothing more: the job runs once and the batch fires once."""
    from forkq.manager import Manager
    from forkq.queues import QueueOrder
    from helpers import CommandHolder
    batch = forkq.Batch().on_success(notify, "s")
    with batch:
        load.enqueue(1)
        load.enqueue(2)
    holder = CommandHolder(redis_server.port)
    identity = "test:1:batch0000000h"
    child = Manager(lambda: redis.Redis(port=holder.port), identity, QueueOrder([("bq", 0)]),
                    concurrency=1)
    child.fetch.register()
    claim = threading.Thread(target=child.fetch.fetch, args=(0,))
    master = _master(redis_server.url)
    try:
        (unit,) = child.fetch.fetch(1)
        child.done(unit.token, child.processors[0].process(unit))
        holder.marker = batch_mod.PREFIX.encode()  # the claim that carries the count
        claim.start()
        assert holder.holding.wait(5)
        handed = _hand_over(child)
        assert [token for token, _ in handed] == [unit.token]
        master.finished[identity] = handed
        master.pending_requeue.append((identity, False))
        assert master.requeue_pending() == {identity: (0, 0)}  # nothing put back
        assert batch.status().pending == 1
        holder.release.set()  # Redis wakes: the stuck claim lands, with the same count
        claim.join(5)
        assert not claim.is_alive() and batch.status().pending == 1
    finally:
        holder.close()
        if claim.ident is not None:
            claim.join(5)
        child.fetch.close()
        os.close(master._sig_r)
        os.close(master._sig_w)
    run_all(worker, 1)  # job 2
    assert r.llen("queue:bq") == 0 and calls == [["load", 1], ["load", 2]]
    assert callbacks(r) == [("notify", ["s"])]


def test_a_hand_over_the_master_cannot_apply_leaves_the_job_to_run_again(client, r, worker):
    """Redis unreachable from the master: nothing is acked without its count. The entry
    stays in flight, the master keeps the hand-over for its next try, and when the job is
    put back (orphan recovery, here) it runs again and counts then, once."""
    from helpers import free_port
    batch = forkq.Batch().on_success(notify, "s")
    with batch:
        load.enqueue(1)
    identity = worker.fetch.identity
    (unit,) = worker.fetch.fetch(1)
    worker.done(unit.token, worker.processors[0].process(unit))
    handed = _hand_over(worker)
    assert handed == [(unit.token, (batch_mod.key(batch.bid), json.loads(
        r.hget(worker.fetch.inflight_key, unit.token))["jid"]))]
    master = _master(f"redis://127.0.0.1:{free_port()}/0")
    try:
        master.finished[identity] = handed
        master.pending_requeue.append((identity, False))
        assert master.requeue_pending() == {}
        assert master.finished[identity] == handed and master.pending_requeue
    finally:
        os.close(master._sig_r)
        os.close(master._sig_w)
    assert r.hexists(worker.fetch.inflight_key, unit.token) and batch.status().pending == 1
    worker.fetch._after.clear()  # the child is gone: its own ack never goes out
    assert requeue_owner_counts(r, identity, ["bq"]).requeued == 1
    worker.fetch.register()
    run_all(worker, 1)
    assert calls == [["load", 1], ["load", 1]] and callbacks(r) == [("notify", ["s"])]


def test_jobs_an_operator_deletes_count_as_failed_so_the_batch_completes(client, r, worker):
    """A batch job deleted from its queue or from the schedule never ends, so the batch
    waited for it for good: neither callback fired."""
    batch = forkq.Batch().on_complete(report, "c").on_success(notify, "s")
    with batch:
        load.enqueue(1)
        queued = load.enqueue(2)
        later = load.enqueue_in(600, 3)
    run_one(worker)  # job 1 (the oldest) succeeds
    worker.fetch.fetch(0)
    (entry,) = api.Queue(r, "bq").page(0, 10)
    assert api.Queue(r, "bq").delete(entry.raw) == 1
    assert callbacks(r) == []  # the scheduled one is still pending
    scheduled = api.schedule(r)
    assert scheduled.delete([scheduled.find(later)]) == 1
    assert callbacks(r) == [("report", ["c"])]  # complete; success never
    status = batch.status()
    assert (status.pending, status.complete, status.success) == (2, True, False)
    assert {jid: f["fate"] for jid, f in status.failures.items()} == {queued: "deleted", later: "deleted"}


# -- the index that lists batches (forkq batches, /batches) ------------------------------


def test_opening_a_batch_indexes_it_in_the_same_single_call(client, r):
    r.config_resetstat()
    batch = forkq.Batch(description="indexed")
    with batch:
        stats = r.info("commandstats")
        # one call, EVALSHA: the hash and its index entry together, in no MULTI
        assert stats["cmdstat_evalsha"]["calls"] == 1 and "cmdstat_exec" not in stats
        created = float(r.hget(f"forkq:batch:{batch.bid}", "created_at"))
        assert r.zrange(keys.BATCHES, 0, -1, withscores=True) == [(batch.bid.encode(), created)]
        assert 0 < r.ttl(f"forkq:batch:{batch.bid}") <= batch_mod.TTL_S
    assert r.zcard(keys.BATCHES) == 1  # sealing adds nothing
    with testing.fake():
        with forkq.Batch():
            pass
    assert r.zcard(keys.BATCHES) == 1  # a batch under forkq.testing touches no Redis


def test_an_index_key_of_another_type_fails_the_opening_before_anything_is_written(client, r):
    r.set(keys.BATCHES, "not a sorted set")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        with forkq.Batch():
            load.enqueue(1)  # never reached: the `with` raised on entering
    assert r.keys("*") == [keys.BATCHES.encode()]


def test_recent_lists_the_newest_first_with_their_states_and_counts(client, r):
    # a `with` not left yet (another thread's: batches do not nest)
    opener = threading.Thread(target=forkq.Batch(description="still open").__enter__)
    opener.start()
    opener.join()
    with pytest.raises(KeyError):
        with forkq.Batch(description="gave up"):
            raise KeyError("x")
    with forkq.Batch(description="done"):
        pass
    with forkq.Batch(description="all failed") as failed_batch:
        (bad,) = load.enqueue_many([[1]])
    batch_mod.record_failure(r, {"bid": failed_batch.bid, "jid": bad}, "E", "m", "dead")
    with forkq.Batch(description="half failed") as running:
        one, _ = load.enqueue_many([[1], [2]])
    batch_mod.record_failure(r, {"bid": running.bid, "jid": one}, "E", "m", "retry")
    listed = batch_mod.recent(r)
    assert [(b.description, b.state, b.total, b.pending, b.failed) for b in listed] == [
        ("half failed", "running", 2, 2, 1), ("all failed", "complete", 1, 1, 1),
        ("done", "succeeded", 0, 0, 0), ("gave up", "abandoned", 0, 0, 0),
        ("still open", "open", 0, 0, 0)]
    assert listed[0].bid == running.bid and listed[0].created_at == running.status().created_at
    assert listed[2].success_at is not None and listed[1].complete_at is not None
    assert [b.description for b in batch_mod.recent(r, limit=2)] == ["half failed", "all failed"]
    assert [b.description for b in batch_mod.recent(r, states=["succeeded", "abandoned"])] == [
        "done", "gave up"]
    # the state read from the hash is the one `forkq batch` and batch_status give
    assert [b.state for b in listed] == [forkq.batch_status(b.bid).state for b in listed]
    with pytest.raises(ValueError, match="unknown batch state"):
        batch_mod.recent(r, states=["pending"])


def test_expired_batches_leave_the_index_as_it_is_read_and_as_batches_open(client, r):
    now = time.time()
    old = now - batch_mod.TTL_S - 60
    alive_old = forkq.Batch(description="alive for long")
    with alive_old:
        pass
    # opened long ago, kept alive since (its jobs kept ending): its entry must stay
    r.zadd(keys.BATCHES, {alive_old.bid: old - 1})
    # entries whose keys expired: long ago, and recently (a batch that succeeded yesterday)
    r.zadd(keys.BATCHES, {f"gone-old-{i}": old - i for i in range(3)})
    r.zadd(keys.BATCHES, {"gone-recent": now - 3600})
    with forkq.Batch(description="new") as new:
        pass
    # opening dropped the old entries whose batch is gone, and looked at no recent one
    assert {m.decode() for m in r.zrange(keys.BATCHES, 0, -1)} == {alive_old.bid, "gone-recent", new.bid}
    assert [b.bid for b in batch_mod.recent(r)] == [new.bid, alive_old.bid]
    assert {m.decode() for m in r.zrange(keys.BATCHES, 0, -1)} == {alive_old.bid, new.bid}
    # a key of a batch's name holding something else is no batch: skipped and dropped too
    r.zadd(keys.BATCHES, {"not-a-hash": now})
    r.set("forkq:batch:not-a-hash", "x")
    assert [b.bid for b in batch_mod.recent(r)] == [new.bid, alive_old.bid]
    assert r.zscore(keys.BATCHES, "not-a-hash") is None


def test_opening_prunes_past_old_entries_whose_batches_are_still_alive(client, r):
    # ten batches opened long ago and still alive (their jobs kept retrying, say) used to
    # be the ten oldest entries every opening looked at: nothing behind them was pruned
    old = time.time() - batch_mod.TTL_S - 3600
    alive = []
    for i in range(10):
        with forkq.Batch(description=f"long-lived {i}") as b:
            pass
        r.zadd(keys.BATCHES, {b.bid: old - 100 + i})
        alive.append(b.bid)
    r.zadd(keys.BATCHES, {f"gone-{i}": old + i for i in range(50)})
    for _ in range(5):
        with forkq.Batch():
            pass
    left = {m.decode() for m in r.zrange(keys.BATCHES, 0, -1)}
    assert set(alive) <= left
    # each opening looks at ten of the old entries from a random rank on: a run of five
    # that all hit the alive ten has a chance of (1/51)**5
    assert len({m for m in left if m.startswith("gone-")}) < 50


def test_recent_reads_past_pages_of_expired_entries(client, r):
    with forkq.Batch(description="oldest") as kept:
        pass
    now = time.time()
    r.zadd(keys.BATCHES, {f"gone-{i}": now + i for i in range(250)})
    (found,) = batch_mod.recent(r, limit=5)
    assert found.bid == kept.bid and r.zcard(keys.BATCHES) == 1


def test_the_index_keeps_at_most_batches_max_entries(client, r, monkeypatch):
    monkeypatch.setattr(keys, "BATCHES_MAX", 3)
    bids = []
    for i in range(5):
        with forkq.Batch(description=str(i)) as b:
            pass
        bids.append(b.bid)
    assert [m.decode() for m in r.zrange(keys.BATCHES, 0, -1)] == bids[2:]
    assert [b.description for b in batch_mod.recent(r)] == ["4", "3", "2"]
    # the batches themselves are untouched: only the listing forgets the oldest
    assert forkq.batch_status(bids[0]).state == "succeeded"


def many_batches(r, states: list[str]) -> list[str]:
    """Batches opened a second apart, oldest first, one per state of `states`: "succeeded"
    (sealed empty), "running" (one job pending) or "abandoned"; written by forkq's own
    scripts in one pipeline, which is quicker than a `with` each."""
    from forkq import scripts
    pipe = r.pipeline(transaction=False)
    now = time.time() - len(states)
    bids = []
    for i, state in enumerate(states):
        bid = batch_mod.new_bid()
        b = batch_mod.key(bid)
        scripts.load(r, "batch_open")(keys=[b, keys.BATCHES], args=[
            bid, f"#{i}", repr(now + i), keys.BATCHES_MAX, "0.5"], client=pipe)
        if state == "abandoned":
            scripts.load(r, "batch_abandon")(keys=[b], client=pipe)
        else:
            if state == "running":
                scripts.load(r, "batch_join")(keys=[b, b + ":jids"], args=["", "j" + bid], client=pipe)
            scripts.load(r, "batch_seal")(keys=[b], args=["", "", "", ""], client=pipe)
        bids.append(bid)
    pipe.execute()
    return bids


def test_a_filtered_listing_reads_a_bounded_part_of_the_index_and_says_more_may_exist(client, r):
    """A listing of a state few batches are in (/batches?state=, forkq batches --state) read
    the whole index, up to 10,000 entries, 110 a page, two round trips a page: 182 round
    trips. It stops at LOOK_AT entries now, in pages that grow, each read with the next,
    says older ones may exist, and reads the counts of the batches it lists only."""
    n = batch_mod.LOOK_AT + 300
    bids = many_batches(r, ["abandoned"] * 3 + ["succeeded"] * (n - 13) + ["running"] * 10)
    r.config_resetstat()
    found = batch_mod.recent(r, states=["abandoned"])
    stats = r.info("commandstats")
    assert found == [] and found.more and found.looked_at == batch_mod.LOOK_AT
    assert stats["cmdstat_hmget"]["calls"] == batch_mod.LOOK_AT and "cmdstat_scard" not in stats
    # a page a round trip (after the first, its ties and what is below them), and one
    # look past the last in the last page's round trip
    assert stats["cmdstat_zrevrangebyscore"]["calls"] <= 1 + 2 * 5 and "cmdstat_zcard" not in stats
    whole = batch_mod.recent(r, states=["abandoned"], look_at=keys.BATCHES_MAX)
    assert [b.bid for b in whole] == bids[2::-1] and not whole.more and whole.looked_at == n
    r.config_resetstat()
    running = batch_mod.recent(r, limit=4, states=["running"])
    assert [b.bid for b in running] == bids[:-5:-1] and not running.more
    assert [(b.state, b.total, b.pending, b.failed) for b in running] == [("running", 1, 1, 0)] * 4
    assert r.info("commandstats")["cmdstat_scard"]["calls"] == 4
    newest = batch_mod.recent(r, limit=3, look_at=1)  # a limit past look_at is looked at whole
    assert [b.bid for b in newest] == bids[:-4:-1] and not newest.more
    assert batch_mod.recent(r, limit=5, look_at=3, states=["running"]).more is False

def _locks(r) -> list[bytes]:
    return list(r.scan_iter("unique:*"))


def test_clearing_a_set_ends_each_entry_as_a_delete_does(client, r, monkeypatch):
    """The dashboard's "Delete all" UNLINKed the whole set: each unique job's lock stayed
    held until its TTL (every push of the same job refused meanwhile) and each batch job
    went uncounted, so its batch never completed. Pages of 4 here, so several pages run,
    with an entry whose `bid` key is spelled with an escape, one that only mentions
    unique_for in its message, and one that is no JSON at all."""
    monkeypatch.setattr(api, "CLEAR_PAGE", 4, raising=False)
    batch = forkq.Batch().on_complete(report, "c").on_success(notify, "s")
    with batch:
        in_batch = [load.enqueue_in(600, i) for i in range(5)]
    unique = [load.options(unique_for=60).enqueue_in(600 + i, 10 + i) for i in range(5)]
    for i in range(5):
        load.enqueue_in(700, 20 + i)
    escaped = api.schedule(r).find(in_batch[0])
    r.zrem("schedule", escaped.raw)
    r.zadd("schedule", {escaped.raw.replace(b'"bid"', b'"\\u0062id"'): escaped.score})
    r.zadd("schedule", {b"not json": 1.0, json.dumps(
        {"class": "X", "args": [], "jid": "ab" * 12, "error_message": "no unique_for here"}): 2.0})
    assert len(_locks(r)) == 5 and r.zcard("schedule") == 17
    assert api.schedule(r).clear() == 17
    assert r.zcard("schedule") == 0 and _locks(r) == []
    assert all(load.options(unique_for=60).enqueue(10 + i) for i in range(5))  # free at once
    status = batch.status()
    assert {jid: f["fate"] for jid, f in status.failures.items()} == dict.fromkeys(in_batch, "deleted")
    assert callbacks(r) == [("report", ["c"])]  # complete; success never


def test_a_clear_never_drops_an_entry_pushed_meanwhile_without_ending_it(client, r, monkeypatch):
    """Entries pushed while a clear runs are ended like the others or left in the set, never
    removed with their lock held; and a set refilled as fast as it is cleared is not
    chased forever (one push per page, here, for good)."""
    monkeypatch.setattr(api, "CLEAR_PAGE", 2, raising=False)
    first = [load.options(unique_for=60).enqueue_in(600, i) for i in range(6)]
    pushed: list[str] = []
    forget_args = getattr(api, "_forget_args", None)

    def push_meanwhile(kind, entries):
        pushed.append(load.options(unique_for=60).enqueue_in(900, 100 + len(pushed)))
        return forget_args(kind, entries)

    monkeypatch.setattr(api, "_forget_args", push_meanwhile, raising=False)
    scheduled = api.schedule(r)
    removed = scheduled.clear()
    assert all(scheduled.find(jid) is None for jid in first)
    left = {jid for jid in pushed if scheduled.find(jid) is not None}
    assert left and removed == 6 + len(pushed) - len(left)
    # a pushed entry still in the set holds its lock; one the clear removed holds none
    held = {json.loads(raw)["args"][0] - 100 for raw in r.zrange("schedule", 0, -1)}
    for n, jid in enumerate(pushed):
        assert (r.get(lock_of(100 + n)) == jid.encode()) == (n in held)



def test_a_call_ending_many_entries_of_a_batch_checks_it_once_and_fires_once(client, r):
    """forget.lua checked a batch's completion after each entry it ended: a clear's page of
    1,000 entries of one batch checked it 1,000 times, about half the call. Once per batch
    per call now, after all its entries; each batch's on_complete is still pushed once."""
    one = forkq.Batch().on_complete(report, "one")
    two = forkq.Batch().on_complete(report, "two")
    later = time.time() + 600
    with one:
        ones = [load.enqueue_at(later + 2 * i, i) for i in range(150)]
    with two:  # interleaved with one's in the schedule
        twos = [load.enqueue_at(later + 2 * i + 1, i) for i in range(150)]
    r.config_resetstat()
    assert api.schedule(r).clear() == 300
    stats = r.info("commandstats")
    # two clear_page calls and one forget.lua that ends all 300
    assert sum(stats.get(f"cmdstat_{c}", {"calls": 0})["calls"] for c in ("eval", "evalsha")) == 3
    assert stats["cmdstat_scard"]["calls"] == 2  # batch_check's: once per batch
    assert sorted(callbacks(r)) == [("report", ["one"]), ("report", ["two"])]
    assert set(one.status().failures) == set(ones) and set(two.status().failures) == set(twos)
    assert r.ttl(batch_mod.key(one.bid) + ":failed") > 0

def lock_of(n: int) -> str:
    from forkq import unique
    return unique.lock_key("batch_test.load", "bq", [n])


def test_a_scheduled_batch_job_an_operator_kills_counts_as_dead(client, r, worker):
    """Killed from the schedule, a batch job went to dead without ever failing, uncounted:
    its batch never completed (and once the dead set's trimming dropped it, nothing could
    count it). A job in dead has ended: it counts as failed, with fate `dead`, in the
    call that buries it. A killed job that had already failed keeps one failure."""
    batch = forkq.Batch().on_complete(report, "c")
    with batch:
        later = load.enqueue_in(600, 1)
        failing = fails.enqueue(2)
    run_one(worker)  # fails once: to the retry set, counted with fate `retry`
    assert callbacks(r) == []
    scheduled, retries = api.schedule(r), api.retries(r)
    assert scheduled.kill([scheduled.find(later)]) == 1
    assert callbacks(r) == [("report", ["c"])]
    assert retries.kill([retries.find(failing)]) == 1
    status = batch.status()
    assert {jid: f["fate"] for jid, f in status.failures.items()} == {later: "dead", failing: "dead"}
    assert callbacks(r) == [("report", ["c"])] and r.zcard("dead") == 2


def test_no_bid_starts_with_a_dash_that_forkq_batch_would_read_as_an_option():
    assert not [bid for bid in (forkq.Batch().bid for _ in range(2000)) if bid.startswith("-")]


def _index(r, scores: list[float]) -> list[str]:
    """Batches opened by batch_open.lua with the given created_at scores, in one pipeline;
    their bids, newest first as the index orders them (ties by bid, descending)."""
    from forkq import scripts
    pipe = r.pipeline(transaction=False)
    for i, score in enumerate(scores):
        bid = batch_mod.new_bid()
        scripts.load(r, "batch_open")(keys=[batch_mod.key(bid), keys.BATCHES], args=[
            bid, f"#{i}", repr(score), keys.BATCHES_MAX, "0.5"], client=pipe)
    pipe.execute()
    return [m.decode() for m in r.zrevrange(keys.BATCHES, 0, -1)]


def test_a_listing_misses_no_batch_when_another_drops_expired_entries_meanwhile(client, r, redis_url):
    """Pages followed each other by rank: an expired batch's entry that another listing
    dropped meanwhile (the dashboard's and `forkq batches`, say, as a succeeded batch's
    keys expire a day after it, its entry 30 days) moved every later rank up, and as
    many live batches went unlisted: 50 of the newest 100 here. By score now; and a page
    edge among batches opened in the same microsecond neither repeats nor skips one."""
    start = time.time() - 1000
    newest = _index(r, [start + i for i in range(300)])
    for bid in newest[50:150]:
        r.delete(batch_mod.key(bid))  # expired
    live = newest[:50] + newest[150:]
    reads = []

    def before(commands):
        if any(str(c[0]).upper().startswith("ZREVRANGE") for c in commands):
            reads.append(commands)
            if len(reads) == 2:  # before the second page: another listing, to its end
                assert len(batch_mod.recent(r, limit=100)) == 100
                assert r.zcard(keys.BATCHES) == 200  # it dropped the 100 expired

    class Lister(redis.Redis):
        def execute_command(self, *args, **options):
            before([args])
            return super().execute_command(*args, **options)

        def pipeline(self, *args, **kwargs):
            pipe = super().pipeline(*args, **kwargs)
            execute = pipe.execute

            def run(*a, **k):
                before([c[0] for c in pipe.command_stack])
                return execute(*a, **k)
            pipe.execute = run
            return pipe

    found = batch_mod.recent(Lister.from_url(redis_url), limit=100)
    assert len(reads) == 2 and [b.bid for b in found] == live[:100] and not found.more
    r.delete(keys.BATCHES)
    tied = _index(r, [start] * 260)  # one score: the pages' edges all fall among ties
    for bid in tied[::5]:
        r.hset(batch_mod.key(bid), "abandoned", "1")  # as batch_abandon.lua marks it
    found = batch_mod.recent(r, limit=100, states=["abandoned"])
    assert [b.bid for b in found] == tied[::5] and not found.more
    found = batch_mod.recent(r, limit=30, states=["abandoned"], look_at=100)
    assert [b.bid for b in found] == tied[:100:5] and found.more and found.looked_at == 100


def test_a_reopened_batch_entered_inside_its_own_with_leaves_both(client):
    """A helper that enters the job's batch inside a `with` of that same object: the inner
    exit forgot the outer's token, and the outer exit raised TypeError (Token, got None)."""
    reopened = batch_mod.Batch()
    reopened._state = "reopened"  # as current_batch() makes it
    with reopened:
        with reopened:
            assert batch_mod.joining() is reopened
        assert batch_mod.joining() is reopened
    assert batch_mod.joining() is None
