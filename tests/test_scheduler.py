"""The scheduled-set poller in a real worker: `schedule` and `retry` entries come due and run."""

import json
import time

import pytest

from corekit import (core_jobs, forkq_client, records, seen, wait_records,  # noqa: F401
                     wait_zset, workers, zset)
from forkq import payload
from helpers import wait_until


@pytest.mark.timeout(30)
def test_enqueue_in_one_second_runs_within_two(workers, forkq_client, r):
    worker = workers(poll_interval=1)
    pushed = time.time()
    jid = core_jobs.record.enqueue_in(1, "soon")
    later = core_jobs.record.enqueue_in(60, "later")

    (ran,) = wait_records(r, 1, worker, kind="record", timeout=4)
    assert ran["args"] == ["soon"]
    assert pushed + 1 <= ran["t"] <= pushed + 2.5  # never early, and not much late
    (job,) = [p for p in seen(r) if p["jid"] == jid]
    assert "at" not in job
    assert job["enqueued_at"] >= pushed + 1  # stamped when it moved onto the queue
    # the job due in a minute is untouched
    ((waiting, _),) = zset(r, "schedule")
    assert waiting["jid"] == later and "enqueued_at" not in waiting


@pytest.mark.timeout(30)
def test_due_retries_are_moved_back_and_run_with_their_fields(workers, forkq_client, r):
    job = payload.build("tests.apps.core_jobs.record", ["retried"], now=time.time() - 100)
    job.update(enqueued_at=time.time() - 100, retry_count=2, error_class="ValueError",
               error_message="earlier", failed_at=time.time() - 90, custom={"keep": [1, 2]})
    r.zadd("retry", {payload.dumps(job): time.time() - 5})
    worker = workers(poll_interval=1)

    wait_records(r, 1, worker, kind="record", timeout=5)
    (ran,) = [p for p in seen(r) if p["jid"] == job["jid"]]
    assert ran["retry_count"] == 2 and ran["custom"] == {"keep": [1, 2]}
    assert ran["error_message"] == "earlier"
    assert ran["enqueued_at"] > job["enqueued_at"]
    assert r.zcard("retry") == 0


@pytest.mark.timeout(30)
def test_due_jobs_go_to_their_own_queue(workers, forkq_client, r):
    # the worker polls both sets but only works `default`: the moved job waits in `other`
    jid = core_jobs.record.options(queue="other").enqueue_at(time.time() + 0.5, "x")
    worker = workers(poll_interval=1)

    raw = wait_until(lambda: worker.assert_alive() or r.lindex("queue:other", 0), timeout=5,
                     message="the due job on queue:other")
    moved = json.loads(raw)
    assert moved["jid"] == jid and moved["queue"] == "other"
    assert isinstance(moved["enqueued_at"], float)
    assert b"other" in r.smembers("queues")
    assert r.zcard("schedule") == 0


@pytest.mark.timeout(30)
def test_many_due_jobs_all_move_once(workers, forkq_client, r):
    now = time.time()
    jobs = [payload.build("tests.apps.core_jobs.record", [i], now=now) for i in range(250)]
    r.zadd("schedule", {payload.dumps(j): now - 1 - i / 1000 for i, j in enumerate(jobs)})
    # two workers race for the same due jobs: ZREM lets exactly one of them move each
    first = workers(poll_interval=1, concurrency=4)
    second = workers(poll_interval=1, concurrency=4)

    done = wait_records(r, 250, first, second, kind="record", timeout=10)
    assert sorted(rec["args"][0] for rec in done) == list(range(250))
    assert r.zcard("schedule") == 0
    wait_until(lambda: r.llen("queue:default") == 0, timeout=5)
    assert len(records(r, "record")) == 250


@pytest.mark.timeout(30)
def test_a_malformed_scheduled_entry_goes_to_dead_and_the_rest_still_move(workers, forkq_client, r):
    r.zadd("schedule", {b"{not json": time.time() - 2})
    r.zadd("retry", {b'{"class": "X", "args": [], "queue": ["not", "a", "name"]}': time.time() - 2})
    jid = core_jobs.record.enqueue_at(time.time() - 1, "fine")  # already due: pushed directly
    later = core_jobs.record.enqueue_in(0.5, "fine later")
    worker = workers(poll_interval=1)

    wait_records(r, 2, worker, kind="record", timeout=5)
    assert {p["jid"] for p in seen(r)} >= {jid, later}
    dead = wait_zset(r, "dead", 2, worker)
    messages = sorted(entry["error_message"] for entry, _ in dead)
    assert any("in schedule" in m and "not JSON" in m for m in messages), messages
    assert any("in retry" in m and "queue" in m for m in messages), messages
    assert all(entry["error_class"] == "forkq.MalformedPayload" for entry, _ in dead)
    assert r.zcard("schedule") == 0 and r.zcard("retry") == 0


@pytest.mark.timeout(30)
def test_a_due_entry_that_cannot_be_re_encoded_does_not_stall_the_others(workers, forkq_client, r):
    # JSON that Python reads but cannot write back (a JavaScript client can produce both)
    now = time.time()
    r.zadd("schedule", {b'{"class": "X", "args": [NaN], "queue": "default"}': now - 3,
                        b'{"class": "X", "args": ["\\udc80"], "queue": "default"}': now - 2})
    jid = core_jobs.record.enqueue_at(now + 0.3, "fine")
    worker = workers(poll_interval=1)

    wait_records(r, 1, worker, kind="record", timeout=5)
    assert [p["jid"] for p in seen(r)] == [jid]
    dead = wait_zset(r, "dead", 2, worker)
    assert all("in schedule" in entry["error_message"] for entry, _ in dead)
    assert r.zcard("schedule") == 0


@pytest.mark.timeout(30)
def test_a_due_job_whose_queue_key_is_no_list_goes_to_dead_not_nowhere(workers, forkq_client, r):
    # the LPUSH failed after the ZREM, and Redis keeps a failed script's writes: the job
    # was gone from the schedule and on no queue, and the poller raised on every poll
    r.set("queue:broken", "a string")
    entry = {"class": "X", "args": [[], 2**60], "queue": "broken", "jid": "b" * 24, "retry": True}
    r.zadd("retry", {json.dumps(entry): time.time() - 2})
    jid = core_jobs.record.enqueue_at(time.time() + 0.3, "fine")
    worker = workers(poll_interval=1)

    wait_records(r, 1, worker, kind="record", timeout=5)
    assert [p["jid"] for p in seen(r)] == [jid]
    ((dead, _),) = wait_zset(r, "dead", 1, worker)
    assert (dead["jid"], dead["args"], dead["error_class"]) == ("b" * 24, [[], 2**60], "forkq.QueueNotAList")
    assert "queue:broken holds a string" in dead["error_message"]
    assert r.zcard("retry") == 0 and r.get("queue:broken") == b"a string"


@pytest.mark.timeout(30)
def test_the_wait_between_polls_stays_one_a_thread_can_take(r):
    # the average (--poll-interval) times the live processes passed threading.TIMEOUT_MAX,
    # and the OverflowError of the wait ended the scheduler thread: nothing scheduled or
    # retried moved again
    import threading

    from forkq.scheduler import Scheduler
    r.sadd("processes", *[f"host:{n}:000000000000" for n in range(1000)])
    scheduler = Scheduler(r, None, average_interval=1e9)
    waits = [scheduler._next_wait() for _ in range(20)]
    assert all(0 < w <= threading.TIMEOUT_MAX for w in waits), max(waits)
