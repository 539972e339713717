"""Unique jobs (`unique_for`): the push's lock, and its release by a real worker's code.

In-process against the shared redis-server: a Manager whose processor is driven by hand
(claim, run, done, and the next claim that carries the ack), so each test takes
milliseconds. One test runs a real master and SIGKILLs its child.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal

import pytest
import redis

import forkq
from forkq import testing
from corekit import hand_driven_fixture, run_one
from helpers import wait_until
from test_supervisor import sup_events, start_master, wait_event  # noqa: F401 (a fixture)

RUNS = "unique:test:runs"
calls: list[list] = []


@forkq.job(queue="uq", unique_for=60, name="unique_test.sync")
def sync(user: int) -> None:
    calls.append([user])


@forkq.job(queue="uq", unique_for=60, unique_until="start", name="unique_test.at_start")
def at_start(user: int) -> None:
    calls.append(["start", user])


@forkq.job(queue="uq", unique_for=60, retry=1, name="unique_test.fails")
def fails(user: int) -> None:
    raise RuntimeError("boom")


@forkq.job(queue="uq", unique_for=60, retry=False, name="unique_test.fails_once")
def fails_once(user: int) -> None:
    raise RuntimeError("boom")


@forkq.job(queue="uq", name="unique_test.plain")
def plain(user: int) -> None:
    calls.append(["plain", user])


@pytest.fixture
def client(redis_url):
    c = forkq.Client(redis_url)
    calls.clear()
    yield c


# a Manager on queue uq, not started: run_one() drives its one processor
worker = hand_driven_fixture("uq", "test:1:000000000000")



def lock_key(name: str, queue: str, args: list) -> str:
    """The documented key, worked out here rather than by forkq.unique: the format is what
    another client taking the same locks relies on."""
    text = json.dumps([name, queue, args], sort_keys=True, separators=(",", ":"))
    return "unique:" + hashlib.sha256(text.encode()).hexdigest()


def locks(r) -> dict[bytes, bytes]:
    return {k: r.get(k) for k in r.scan_iter("unique:*") if k != RUNS.encode()}


def test_a_duplicate_is_refused_while_pending_and_pushes_nothing(client, r):
    jid = sync.options(client=client).enqueue(7)
    assert jid is not None
    assert sync.options(client=client).enqueue(7) is None
    assert sync.options(client=client).enqueue_in(30, 7) is None
    assert r.llen("queue:uq") == 1 and r.zcard("schedule") == 0
    key = lock_key("unique_test.sync", "uq", [7])
    assert locks(r) == {key.encode(): jid.encode()}
    assert 59_000 < r.pttl(key) <= 60_000
    # the payload carries the option, for the worker; the default unique_until is not written
    (raw,) = r.lrange("queue:uq", 0, -1)
    job = json.loads(raw)
    assert job["unique_for"] == 60 and "unique_until" not in job
    assert sync.options(client=client).enqueue(8) is not None  # other args: another job


def test_the_same_args_on_another_queue_are_another_job(client, r):
    assert sync.options(client=client).enqueue(7)
    assert sync.options(client=client, queue="other").enqueue(7)
    assert r.llen("queue:uq") == 1 and r.llen("queue:other") == 1
    assert len(locks(r)) == 2


def test_enqueue_many_leaves_duplicates_out_of_its_jids(client, r):
    first = sync.options(client=client).enqueue(1)
    jids = sync.options(client=client).enqueue_many([[1], [2], [2], [3]])
    assert len(jids) == 2 and first not in jids
    assert sorted(json.loads(x)["args"] for x in r.lrange("queue:uq", 0, -1)) == [[1], [2], [3]]
    assert sorted(r.get(lock_key("unique_test.sync", "uq", [a])).decode()
                  for a in (2, 3)) == sorted(jids)


def test_bypass_with_unique_for_none(client, r):
    assert sync.options(client=client).enqueue(7)
    assert sync.options(client=client, unique_for=None).enqueue(7)
    assert sync.options(client=client, unique_for=False).enqueue(7)
    assert r.llen("queue:uq") == 3
    assert [("unique_for" in json.loads(x)) for x in r.lrange("queue:uq", 0, -1)] == [False, False, True]


def test_a_lock_expires_after_its_ttl(client, r):
    fast = sync.options(client=client, unique_for=0.05)
    assert fast.enqueue(7)
    assert fast.enqueue(7) is None
    wait_until(lambda: not r.exists(lock_key("unique_test.sync", "uq", [7])), timeout=2)
    assert fast.enqueue(7)
    assert r.llen("queue:uq") == 2


def test_a_scheduled_push_holds_its_lock_for_the_delay_too(client, r):
    assert sync.options(client=client, unique_for=10).enqueue_in(100, 7)
    assert r.zcard("schedule") == 1
    ttl = r.pttl(lock_key("unique_test.sync", "uq", [7]))
    assert 109_000 < ttl <= 110_000
    assert sync.options(client=client).enqueue(7) is None


def test_the_push_takes_the_lock_and_pushes_as_one(client, r):
    # a queue key of the wrong type makes the push fail inside the script: no lock is left
    # behind for a job that never went in
    r.set("queue:uq", "not a list")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        sync.options(client=client).enqueue(7)
    assert locks(r) == {}
    r.delete("queue:uq")
    # a held lock refuses its job, and the job is not pushed: one of each, never a lock alone
    r.set(lock_key("unique_test.sync", "uq", [7]), "someone")
    assert sync.options(client=client).enqueue(7) is None
    assert r.llen("queue:uq") == 0


def test_success_releases_the_lock_with_the_ack(client, r, worker):
    assert sync.options(client=client).enqueue(7)
    run_one(worker)
    assert calls == [[7]]
    key = lock_key("unique_test.sync", "uq", [7])
    assert r.exists(key)  # not yet: it rides on the next claim, with the ack
    assert worker.fetch.fetch(0) == []
    assert not r.exists(key) and r.hlen(worker.fetch.inflight_key) == 0
    assert sync.options(client=client).enqueue(7)


def test_flush_acks_releases_too(client, r, worker):
    assert sync.options(client=client).enqueue(7)
    run_one(worker)
    assert len(locks(r)) == 1
    worker.fetch.flush_acks()  # quiet and stop send acks this way
    assert locks(r) == {} and r.hlen(worker.fetch.inflight_key) == 0


def test_an_unlock_is_queued_with_its_ack_as_one_entry(client, r, worker):
    """A processor used to queue its ack, then its unlock: a flush in between (quiet's
    loop, on another processor's wake) sent the ack alone, and the lock stayed until the
    stop. Now the two are one entry (fetch.ack's after-success actions): pending_acks()
    counts it, and a flush sends both or neither."""
    assert sync.options(client=client).enqueue(7)
    (unit,) = worker.fetch.fetch(1)
    (processor,) = worker.processors
    lock = processor.process(unit)
    fetch = worker.fetch
    worker.done(unit.token, lock)
    assert fetch.pending_acks() == 1 and len(locks(r)) == 1
    # handed to the master at a stop with its unlock, which the master applies with it
    assert fetch.unsent_acks() == [(unit.token, lock)]
    fetch.flush_acks()
    assert r.hlen(fetch.inflight_key) == 0 and locks(r) == {}


def test_an_unlock_never_goes_out_before_its_jobs_ack(client, r, worker):
    """A call took the pending acks, then a processor queued its ack and unlock, then the
    call took the unlocks: the lock went while the job's in-flight entry stayed, and a
    crash then would run the job again beside a new push of it."""
    assert sync.options(client=client).enqueue(7)
    (unit,) = worker.fetch.fetch(1)
    (processor,) = worker.processors
    lock = processor.process(unit)
    fetch = worker.fetch
    take_acks = fetch._take_acks

    def interleaved(limit):
        fetch._take_acks = take_acks
        taken = take_acks(limit)
        worker.done(unit.token, lock)  # the processor's thread, just after the take
        return taken

    fetch._take_acks = interleaved
    fetch.fetch(0)
    assert not (r.hlen(fetch.inflight_key) == 1 and locks(r) == {}), "unlock sent without its ack"
    fetch.flush_acks()
    assert r.hlen(fetch.inflight_key) == 0 and locks(r) == {}


def test_unique_until_start_releases_before_the_run(client, r, worker):
    seen = []
    jobdef = forkq.jobs.lookup("unique_test.at_start")
    original = jobdef.fn
    jobdef.fn = lambda user: seen.append(locks(r))
    try:
        assert at_start.options(client=client).enqueue(7)
        assert at_start.options(client=client).enqueue(7) is None
        run_one(worker)
    finally:
        jobdef.fn = original
    assert seen == [{}]  # gone while the job ran
    assert at_start.options(client=client).enqueue(7)


def test_a_failure_that_retries_keeps_the_lock_and_a_death_releases_it(client, r, worker):
    jid = fails.options(client=client).enqueue(7)
    key = lock_key("unique_test.fails", "uq", [7])
    run_one(worker)
    assert r.zcard("retry") == 1 and r.get(key) == jid.encode()
    assert fails.options(client=client).enqueue(7) is None
    # the retry runs and fails for the last time: dead, and the lock goes in the same call
    (raw,) = r.zrange("retry", 0, -1)
    r.delete("retry")
    r.lpush("queue:uq", raw)
    run_one(worker)
    assert r.zcard("dead") == 1 and not r.exists(key)
    assert fails.options(client=client).enqueue(7)


def test_a_dropped_job_releases_its_lock(client, r, worker):
    assert fails_once.options(client=client).enqueue(7)  # retry=False: dropped on failure
    assert len(locks(r)) == 1
    run_one(worker)
    assert r.zcard("retry") == 0 and r.zcard("dead") == 0
    assert locks(r) == {} and r.hlen(worker.fetch.inflight_key) == 0


def test_an_unknown_class_that_dies_releases_its_lock(client, r, worker):
    assert client.push("unique_test.nobody", [7], queue="uq", retry=0, unique_for=60)
    assert len(locks(r)) == 1
    run_one(worker)
    assert r.zcard("dead") == 1 and locks(r) == {}


def test_a_retry_to_retry_queue_keeps_the_lock_it_took(client, r, worker):
    key = lock_key("unique_test.fails", "uq", [7])
    assert fails.options(client=client, retry_queue="later").enqueue(7)
    run_one(worker)
    (raw,) = r.zrange("retry", 0, -1)
    job = json.loads(raw)
    assert job["queue"] == "later" and job["unique_queue"] == "uq"
    assert r.exists(key)
    # its success, on the retry queue, releases the lock its first push took
    r.delete("retry")
    r.lpush("queue:uq", json.dumps(dict(job, **{"class": "unique_test.sync"})))
    r.set(lock_key("unique_test.sync", "uq", [7]), job["jid"])
    run_one(worker)
    worker.fetch.flush_acks()
    assert not r.exists(lock_key("unique_test.sync", "uq", [7]))


def test_a_stale_job_cannot_release_a_newer_lock(client, r, worker):
    fast = sync.options(client=client, unique_for=0.05)
    old = fast.enqueue(7)
    key = lock_key("unique_test.sync", "uq", [7])
    wait_until(lambda: not r.exists(key), timeout=2)
    new = sync.options(client=client).enqueue(7)  # the old one is still queued
    assert new and new != old
    run_one(worker)  # the old one runs (pushed first) and succeeds
    worker.fetch.flush_acks()
    assert r.get(key) == new.encode()


def test_a_payload_from_another_client_is_unlocked_as_ours(client, r, worker):
    # no @job option involved: a raw Sidekiq-format push that took the lock as documented
    key = lock_key("unique_test.sync", "uq", [9])
    job = {"class": "unique_test.sync", "args": [9], "jid": "a" * 24, "queue": "uq",
           "retry": True, "unique_for": 30}
    r.set(key, "a" * 24, px=30_000)
    r.lpush("queue:uq", json.dumps(job))
    run_one(worker)
    worker.fetch.flush_acks()
    assert not r.exists(key)


def test_a_poison_job_releases_its_lock_and_leaves_a_newer_one(client, r):
    from forkq.fetch import requeue_owner_counts
    identity = "test:1:poison0000000"
    key7, key8 = lock_key("unique_test.sync", "uq", [7]), lock_key("unique_test.sync", "uq", [8])
    held = []
    for user in (7, 8):
        sync.options(client=client).enqueue(user)
        raw = r.rpop("queue:uq")
        r.hset(f"forkq:inflight:{identity}", f"{user}\nuq", raw)
        held.append(json.loads(raw)["jid"])
    r.set(key8, "newer-push-jid")  # 8's lock lapsed and another push of it took it since
    counts = requeue_owner_counts(r, identity, ["uq"], crashed=True, poison_after=1)
    assert counts.poisoned == 2 and r.zcard("dead") == 2
    assert not r.exists(key7)  # free for the next push of the same job, as after any death
    assert r.get(key8) == b"newer-push-jid"
    assert sync.options(client=client).enqueue(7) is not None


def test_an_operators_delete_or_kill_releases_the_lock(client, r):
    from forkq import api
    later = sync.options(client=client)
    gone, killed, queued = later.enqueue_in(600, 1), later.enqueue_in(600, 2), later.enqueue(3)
    plain_jid = plain.options(client=client).enqueue_in(600, 4)  # no lock: the plain ZREM
    assert [later.enqueue(u) for u in (1, 2, 3)] == [None] * 3
    scheduled = api.schedule(r)
    assert scheduled.delete([scheduled.find(gone), scheduled.find(plain_jid)]) == 2
    assert scheduled.kill([scheduled.find(killed)]) == 1
    (entry,) = api.Queue(r, "uq").page(0, 10)
    assert api.Queue(r, "uq").delete(entry.raw) == 1
    assert locks(r) == {} and r.zcard("schedule") == 0 and r.zcard("dead") == 1
    assert all(later.enqueue(u) for u in (1, 2, 3))  # each may be pushed again at once


def test_a_kill_or_delete_of_an_entry_moved_meanwhile_neither_buries_nor_unlocks_it(client, r):
    from forkq import api
    jid = sync.options(client=client).enqueue_in(600, 5)
    scheduled = api.schedule(r)
    entry = scheduled.find(jid)
    r.zrem("schedule", entry.raw)  # the scheduler moved it to its queue since it was read
    r.lpush("queue:uq", entry.raw)
    assert scheduled.kill([entry]) == 0 and scheduled.delete([entry]) == 0
    assert r.zcard("dead") == 0 and r.llen("queue:uq") == 1
    assert r.get(lock_key("unique_test.sync", "uq", [5])) == jid.encode()


@pytest.mark.parametrize("options, error", [
    ({"unique_for": 0}, ValueError), ({"unique_for": -1}, ValueError),
    ({"unique_for": float("inf")}, ValueError), ({"unique_for": "60"}, TypeError),
    ({"unique_for": True}, TypeError), pytest.param({"unique_for": 10**400}, ValueError, id="int-past-float"),
    ({"unique_for": 60, "unique_until": "end"}, ValueError),
    ({"unique_for": 60, "unique_until": 1}, TypeError), ({"unique_until": "start"}, ValueError),
])
def test_bad_options_are_refused_at_decoration_and_per_push(options, error):
    with pytest.raises(error, match="unique_"):
        forkq.job(name="unique_test.bad", **options)(lambda: None)
    with pytest.raises(error, match="unique_"):
        plain.options(**options)
    with pytest.raises(error, match="unique_"):
        forkq.Client("redis://127.0.0.1:1/0").push("unique_test.plain", [1], **options)


def test_periodic_refuses_unique_for_and_ignores_the_jobs_own():
    from forkq import cron
    with pytest.raises(cron.CronError, match="unique_for"):
        forkq.periodic("* * * * *", sync, [1], name="unique_test.cron1", unique_for=60)
    entry = forkq.periodic("* * * * *", sync, [1], name="unique_test.cron2")
    # None means no uniqueness, as on a push: nothing to refuse
    plain = forkq.periodic("* * * * *", "Other", name="unique_test.cron3", unique_for=None)
    try:
        assert "unique_for" not in dict(entry.options) and "unique_for" not in dict(plain.options)
    finally:
        cron.ENTRIES.pop("unique_test.cron2", None)
        cron.ENTRIES.pop("unique_test.cron3", None)


def test_fake_mode_records_every_push_without_enforcing_uniqueness(redis_url):
    # redis_url: inline mode runs the server middleware corekit registers, which records
    # in the Redis FORKQ_REDIS_URL names
    with testing.fake() as jobs:
        assert sync.enqueue(7) and sync.enqueue(7)
        assert jobs.args(sync) == [[7], [7]]
        assert jobs.of(sync)[0]["unique_for"] == 60
    calls.clear()
    with testing.inline():
        sync.enqueue(7)
        sync.enqueue(7)
    assert calls == [[7], [7]]


@pytest.mark.timeout(60)
def test_a_sigkilled_childs_unique_job_is_requeued_runs_once_and_unlocks(start_master, redis_url, r):
    """The child running a unique job dies: recovery puts the job back with its lock held,
    a duplicate push is still refused, and the job's eventual success releases the lock."""
    m = start_master(processes=1, concurrency=1)
    (victim_pid,) = m.wait_slots().values()
    pusher = forkq.Client(redis_url)
    jid = pusher.push("sup.sleep", ["uq-victim", 0.5], unique_for=60)
    key = lock_key("sup.sleep", "default", ["uq-victim", 0.5])
    wait_event(r, m, "start", "uq-victim")
    os.kill(victim_pid, signal.SIGKILL)
    assert pusher.push("sup.sleep", ["uq-victim", 0.5], unique_for=60) is None
    wait_event(r, m, "done", "uq-victim", timeout=15)
    wait_until(lambda: not r.exists(key), timeout=5, message="the lock released after the rerun")
    starts = [e["pid"] for e in sup_events(r, "start", "uq-victim")]
    assert len(starts) == 2 and starts[0] == victim_pid and starts[1] != victim_pid
    assert len(sup_events(r, "done", "uq-victim")) == 1
    assert r.llen("queue:default") == 0 and r.zcard("dead") == 0 and r.zcard("retry") == 0
    assert pusher.push("sup.sleep", ["uq-victim", 0.5], unique_for=60) not in (None, jid)
