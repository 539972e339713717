"""Expiring jobs: `expires_in` on a push becomes the payload's `expires_at`, and a worker
drops, unrun, a job that has not started by then."""

import json
import math
import time

import pytest

import forkq
from forkq import cron, keys, processor, unique
from forkq.cron import Schedule
from corekit import core_jobs, forkq_client, records, wait_records, workers  # noqa: F401
from helpers import wait_until


def _payloads(r, key):
    if key == "schedule":
        return [json.loads(raw) for raw in r.zrange(key, 0, -1)]
    return [json.loads(raw) for raw in r.lrange(key, 0, -1)]


@pytest.mark.timeout(20)
def test_expires_in_is_stamped_as_expires_at_from_when_the_job_may_first_run(forkq_client, r):
    before = time.time()
    core_jobs.record.options(expires_in=60).enqueue("now")
    (now,) = _payloads(r, "queue:default")
    assert "expires_in" not in now and before + 60 <= now["expires_at"] <= time.time() + 60

    # scheduled: counted from its run time, not from the push
    at = time.time() + 3600
    core_jobs.record.options(expires_in=60).enqueue_at(at, "later")
    (later,) = _payloads(r, "schedule")
    assert later["expires_at"] == pytest.approx(at + 60)

    # a per-push None takes a job's expiry off; Client.push takes the option too
    forkq_client.push("Other", ["x"], queue="q", expires_in=5)
    core_jobs.record.options(expires_in=None).enqueue("never")
    assert "expires_in" not in _payloads(r, "queue:q")[0]
    assert "expires_at" not in _payloads(r, "queue:default")[0]  # LPUSH: newest first


@pytest.mark.timeout(20)
@pytest.mark.parametrize("bad", [0, -1, math.nan, math.inf, "60", True,
                                 pytest.param(10**400, id="int-past-float")])
def test_an_expires_in_that_is_not_seconds_above_0_is_refused_before_anything_is_pushed(bad, forkq_client, r):
    with pytest.raises(ValueError, match="expires_in"):
        core_jobs.record.options(expires_in=bad)
    with pytest.raises(ValueError, match="expires_in"):
        forkq_client.push("Other", [], expires_in=bad)
    with pytest.raises(ValueError, match="expires_in"):
        forkq.job(lambda: None, name="expiry.bad", expires_in=bad)
    assert r.dbsize() == 0


@pytest.mark.parametrize("expires_at, expired", [
    pytest.param(10**400, False, id="int-past-float"), pytest.param(-10**400, True, id="int-below-float"),
    (math.inf, False), (math.nan, False), (1.0, True)])
def test_any_number_a_payload_carries_as_expires_at_is_judged_without_raising(expires_at, expired):
    """An int past a float's range (JSON allows it; Python parses it exact) raised
    OverflowError in the worker's expiry check: a fault in forkq's handling, recorded as
    the job's failure at every try, until dead."""
    assert processor._expired({"jid": "x", "class": "A"}, expires_at, "q") is expired


def test_a_periodic_entrys_expiry_counts_from_its_due_time():
    entry = cron.Entry("digest", Schedule("0 3 * * *"), "Digest", "default",
                       options=(("expires_in", 3600),))
    job = entry.payload(1_700_000_000, 1_700_000_500.0)
    assert job["expires_at"] == 1_700_003_600 and "expires_in" not in job


@pytest.mark.timeout(30)
def test_a_worker_drops_a_job_past_its_expiry_unrun_and_runs_the_others(workers, forkq_client, r):
    now = time.time()
    base = {"class": core_jobs.record.name, "queue": "default", "retry": True, "created_at": now}
    pushed = [
        dict(base, jid="a" * 24, args=["expired"], expires_at=now - 1),
        dict(base, jid="b" * 24, args=["fresh"], expires_at=now + 600),
        # no number: the worker runs it (and warns) rather than lose it on a typo
        dict(base, jid="c" * 24, args=["garbled"], expires_at="soon"),
        dict(base, jid="d" * 24, args=["last"]),
        # a unique job that expired leaves for good: its lock goes with it
        dict(base, jid="e" * 24, args=["expired-unique"], expires_at=now - 1, unique_for=600),
    ]
    lock = unique.lock_key(core_jobs.record.name, "default", ["expired-unique"])
    r.set(lock, "e" * 24, ex=600)
    r.lpush("queue:default", *[json.dumps(j) for j in pushed])
    worker = workers(concurrency=1)
    wait_records(r, 3, worker, kind="record")
    wait_until(lambda: r.hlen(keys.inflight(worker.identity)) == 0, timeout=5,
               message="every claimed job acknowledged")
    assert sorted(rec["args"][0] for rec in records(r, "record")) == ["fresh", "garbled", "last"]
    assert r.llen("queue:default") == r.zcard("retry") == r.zcard("dead") == 0
    wait_until(lambda: not r.exists(lock), timeout=5, message="the expired unique job's lock released")
    log = worker.log_path.read_text()
    assert "expired: not run" in log and "expires_at is not a number" in log
