"""Sidekiq wire-format details the interop tests did not reach: what forkq writes into
`dead` for a poison job, `retry: null`, a Web-UI retried job (retry_count -1) and a payload
without `queue`."""

from __future__ import annotations

import json
import subprocess
import time

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


@pytest.mark.timeout(10)
@pytest.mark.parametrize("retry_for, failed_ago, fate", [
    (3600, 60, "retry"),          # inside the window: the count (past retry: 2) is ignored
    (3600, 7200, "dead"),         # the window closed
    (None, 60, "dead"),           # no window: the count ends it
    ("1h", 60, "dead"),           # no usable window: the count still ends it
])
def test_retry_for_replaces_the_retry_count_as_in_sidekiq_8_1(r, retry_for, failed_ago, fate):
    """Sidekiq 8.1 made them exclusive: a Ruby client's `retry_for: 1.hour` retries for an
    hour whatever `retry` says. forkq stopped at whichever came first (Sidekiq 7)."""
    key = keys.inflight(IDENTITY)
    job = {"class": "gone.X", "args": [], "jid": "c" * 24, "queue": "default", "retry": 2,
           "retry_count": 4, "failed_at": time.time() - failed_ago}
    if retry_for is not None:
        job["retry_for"] = retry_for
    r.hset(key, "1", "default\n" + json.dumps(job))
    assert Outcomes(r, key).failed(job, RuntimeError("boom"), "1", None) == fate


@pytest.mark.timeout(10)
def test_retry_for_counts_from_a_failed_at_in_whole_integer_seconds(r):
    """A non-Ruby client may write failed_at as an integer of seconds (Go's encoding/json
    writes 1795347542.0 as 1795347542). Read as Sidekiq 8's milliseconds that is January
    1970, and retry_for 1 hour would kill the job at its next failure."""
    key = keys.inflight(IDENTITY)
    payload = {"class": "gone.X", "args": [], "jid": "c" * 24, "queue": "default", "retry": True,
               "retry_for": 3600, "retry_count": 0, "failed_at": int(time.time()) - 60}
    r.hset(key, "1", "default\n" + json.dumps(payload))
    assert Outcomes(r, key).failed(payload, RuntimeError("boom"), "1", None) == "retry"


def test_the_lua_dead_trim_uses_the_same_limits_as_python():
    from forkq import scripts
    text = scripts.source("requeue_all")
    assert f"tonumber(now) - {keys.DEAD_TIMEOUT_S})" in text
    assert f"'dead', 0, -{keys.DEAD_MAX_JOBS})" in text


# -- how many entries the dead set keeps ---------------------------------------------------
# Sidekiq's DeadSet#kill runs ZREMRANGEBYRANK dead 0 -dead_max_jobs after its ZADD: with
# 10,000 old entries plus the new one that removes ranks 0 and 1, leaving 9,999.

def _fill_dead(r, n):
    """n dead entries from the last day (the 180-day trim keeps them); the two oldest."""
    base = time.time() - 86400
    members = [json.dumps({"class": "Old", "args": [i], "jid": f"{i:024x}"}) for i in range(n)]
    r.zadd("dead", {m: base + i for i, m in enumerate(members)})
    return [m.encode() for m in members[:2]]


def _kill_with_outcomes(r, now=None):
    key = keys.inflight(IDENTITY)
    job = {"class": "New", "args": [], "jid": "1" * 24, "queue": "default", "retry": False}
    r.hset(key, "1\ndefault", json.dumps(job))
    Outcomes(r, key).to_dead(job, "1\ndefault", now=now)


def _kill_as_poison(r):
    job = {"class": "New", "args": [], "jid": "1" * 24, "queue": "default", "retry": True}
    r.hset(keys.inflight(IDENTITY), "7\ndefault", json.dumps(job))
    assert requeue_owner_counts(r, IDENTITY, ["default"], crashed=True, poison_after=1).poisoned == 1


def _kill_malformed(r):
    r.hset(keys.inflight(IDENTITY), "9", "no queue prefix here")
    requeue_owner_counts(r, IDENTITY, ["default"])


def _kill_from_retry_with_the_api(r):
    r.zadd("retry", {json.dumps({"class": "New", "args": [], "jid": "1" * 24, "queue": "default",
                                 "retry": True, "retry_count": 0}): time.time() + 60})
    retries = api.retries(r)
    assert retries.kill(list(retries)) == 1


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kill", [_kill_with_outcomes, _kill_as_poison, _kill_malformed,
                                  _kill_from_retry_with_the_api])
def test_every_way_into_dead_keeps_as_many_entries_as_sidekiq(r, kill):
    oldest = _fill_dead(r, keys.DEAD_MAX_JOBS)
    kill(r)
    assert r.zcard("dead") == keys.DEAD_MAX_JOBS - 1
    assert all(r.zscore("dead", raw) is None for raw in oldest)
    (newest,) = r.zrange("dead", -1, -1)
    assert json.loads(newest)["class"] in ("New", "forkq.MalformedJob")


@pytest.mark.timeout(60)
def test_sidekiqs_own_kill_keeps_the_same_number_of_dead_entries(sidekiq_ruby, redis_url, r):
    _fill_dead(r, keys.DEAD_MAX_JOBS)
    script = ('require "sidekiq"; require "sidekiq/api"; '
              'Sidekiq::DeadSet.new.kill(ARGV[0], notify_failure: false)')
    job = json.dumps({"class": "New", "args": [], "jid": "2" * 24, "queue": "default"})
    out = subprocess.run([sidekiq_ruby.ruby, "-e", script, job], env=sidekiq_ruby._env(redis_url),
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert r.zcard("dead") == keys.DEAD_MAX_JOBS - 1

    # forkq's kill on top of Sidekiq's leaves the size where Sidekiq left it
    _kill_with_outcomes(r)
    assert r.zcard("dead") == keys.DEAD_MAX_JOBS - 1


@pytest.mark.timeout(10)
def test_the_dead_age_trim_takes_an_entry_exactly_at_the_cutoff_as_sidekiq_does(r):
    # Sidekiq sends now - dead_timeout as a bare ZREMRANGEBYSCORE bound: inclusive
    now = 1_800_000_000.0
    r.zadd("dead", {"at-the-cutoff": now - keys.DEAD_TIMEOUT_S, "just-after": now - keys.DEAD_TIMEOUT_S + 1})
    _kill_with_outcomes(r, now)
    assert r.zscore("dead", "at-the-cutoff") is None
    assert r.zscore("dead", "just-after") is not None


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
