"""Sidekiq wire-format details the interop tests did not reach: what forkq writes into
`dead` for a poison job, `retry: null`, a Web-UI retried job (retry_count -1) and a payload
without `queue`."""

from __future__ import annotations

import json
import subprocess

import pytest

from forkq import api, jobs, keys
from forkq.fetch import requeue_owner_counts
from forkq.retry import Outcomes, record_failure

IDENTITY = "test:1:abcdefabcdef"
# [] and {} (cjson writes both as {}), an integer past 2**53 and a float with 17 digits
ARGS = [[], {}, 12345678901234567890, 2**53 + 1, 1795471552.5322554, "ü"]


def _poison(r, job):
    r.hset(keys.inflight(IDENTITY), "7\ndefault", json.dumps(job))
    counts = requeue_owner_counts(r, IDENTITY, ["default"], crashed=True, poison_after=1)
    assert counts.poisoned == 1
    (raw,) = r.zrange("dead", 0, -1)
    return raw


@pytest.mark.timeout(10)
def test_a_poison_dead_entry_keeps_the_payload_exactly(r):
    job = {"class": "Crash", "args": ARGS, "jid": "d" * 24, "queue": "default", "retry": True,
           "created_at": 1795471552.5322554, "tags": [], "custom": {"x": []}}
    entry = json.loads(_poison(r, job))
    for key, value in job.items():
        assert entry[key] == value, key
    assert entry["error_class"] == "forkq.PoisonJob"
    assert entry["error_message"] == "killed its worker process 1 times"
    assert isinstance(entry["failed_at"], float)
    assert "forkq_original" not in entry


@pytest.mark.timeout(10)
def test_a_poison_entry_for_a_job_that_failed_before_reads_as_the_poison(r):
    job = {"class": "Crash", "args": [], "jid": "e" * 24, "queue": "default", "retry": True,
           "error_class": "ValueError", "error_message": "old", "retry_count": 0, "failed_at": 1.5}
    entry = json.loads(_poison(r, job))
    assert (entry["error_class"], entry["failed_at"], entry["args"]) == ("forkq.PoisonJob", 1.5, [])
    assert api.dead(r).find("e" * 24).job["error_class"] == "forkq.PoisonJob"


@pytest.mark.timeout(60)
def test_sidekiqs_retry_takes_a_poison_entry_back_to_its_queue(sidekiq_ruby, redis_url, r):
    job = {"class": "Crash", "args": [], "jid": "f" * 24, "queue": "default", "retry": True,
           "tags": []}
    _poison(r, job)
    script = ('require "sidekiq"; require "sidekiq/api"; '
              'Sidekiq::DeadSet.new.each { |e| e.retry }')
    out = subprocess.run([sidekiq_ruby.ruby, "-e", script], env=sidekiq_ruby._env(redis_url),
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    (queued,) = [json.loads(raw) for raw in r.lrange("queue:default", 0, -1)]
    assert (queued["jid"], queued["args"], queued["tags"]) == ("f" * 24, [], [])
    assert r.zcard("dead") == 0


@pytest.mark.timeout(10)
def test_a_null_retry_takes_the_registered_jobs_option(r):
    twice = jobs.job(name="gap.twice", retry=2)(lambda *a: None)
    key = keys.inflight(IDENTITY)
    payload = {"class": "gap.twice", "args": [], "jid": "a" * 24, "queue": "default", "retry": None}
    r.hset(key, "1", "default\n" + json.dumps(payload))
    assert Outcomes(r, key).failed(payload, RuntimeError("boom"), "1", twice) == "retry"


def test_a_failure_after_sidekiqs_retry_now_keeps_failed_at():
    job = {"class": "X", "args": [], "retry_count": -1, "failed_at": 1.0}
    record_failure(job, RuntimeError("again"), 2.0)
    assert (job["retry_count"], job["failed_at"], job["retried_at"]) == (0, 1.0, 2.0)


@pytest.mark.timeout(10)
def test_retry_now_lowers_a_count_of_zero_as_sidekiq_does(r):
    r.zadd("retry", {json.dumps({"class": "X", "args": [], "jid": "b" * 24, "queue": "default",
                                 "retry": 1, "retry_count": 0}): 1})
    retries = api.retries(r)
    assert retries.retry_now(list(retries)) == 1
    (queued,) = [json.loads(raw) for raw in r.lrange("queue:default", 0, -1)]
    assert queued["retry_count"] == -1


@pytest.mark.timeout(10)
def test_retry_for_past_the_first_failure_exhausts_the_retries(r):
    key = keys.inflight(IDENTITY)
    payload = {"class": "gone.X", "args": [], "jid": "c" * 24, "queue": "default", "retry": True,
               "retry_for": 60, "retry_count": 3, "failed_at": 1.0}
    r.hset(key, "1", "default\n" + json.dumps(payload))
    assert Outcomes(r, key).failed(payload, RuntimeError("boom"), "1", None) == "dead"


def test_the_lua_dead_trim_uses_the_same_limits_as_python():
    from forkq import scripts
    text = scripts.source("requeue_all")
    assert f"tonumber(now) - {keys.DEAD_TIMEOUT_S})" in text
    assert f"'dead', 0, -{keys.DEAD_MAX_JOBS + 1})" in text


@pytest.mark.timeout(10)
def test_a_malformed_in_flight_entry_is_parked_not_retried_by_forkq(r):
    r.hset(keys.inflight(IDENTITY), "9", "no queue prefix here")
    requeue_owner_counts(r, IDENTITY, ["default"], crashed=False, poison_after=3)
    (raw,) = r.zrange("dead", 0, -1)
    entry = json.loads(raw)
    assert (entry["args"], entry["queue"], entry["forkq_original"]) == \
        ([], "forkq-malformed", "no queue prefix here")
    dead = api.dead(r)
    assert dead.retry_now(list(dead)) == 0 and r.zcard("dead") == 1
