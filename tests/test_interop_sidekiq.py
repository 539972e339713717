"""forkq and Ruby Sidekiq 6.4.1 share one Redis: each runs what the other pushes.

Needs Debian's ruby-sidekiq (the `sidekiq_ruby` fixture skips otherwise).
The Ruby side is tests/interop/push.rb and tests/interop/worker.rb; the forkq
side is tests/apps/interop_jobs.py, run by `python -m forkq start --no-fork`.
"""

import json
import re
import time
from pathlib import Path

import pytest

import forkq
from helpers import ForkqWorker, wait_until

INTEROP_JOBS = Path(__file__).resolve().parent / "apps" / "interop_jobs.py"
FORKQ_RAN = "interop:forkq_ran"
SIDEKIQ_RAN = "interop:sidekiq_ran"
JID = re.compile(r"\A[0-9a-f]{24}\Z")
ARGS = [1, "two", {"three": 3}]

# What Sidekiq 6.4.1's client writes for a plain push (see the wire-format reference).
PUSHED_FIELDS = {"class", "args", "jid", "queue", "retry", "created_at", "enqueued_at"}


def _records(r, key):
    return [json.loads(raw) for raw in r.lrange(key, 0, -1)]


def _queued(r, queue="default"):
    return [json.loads(raw) for raw in r.lrange(f"queue:{queue}", 0, -1)]


def _scheduled(r):
    return [(json.loads(raw), score) for raw, score in r.zrange("schedule", 0, -1, withscores=True)]


def _wait_for_records(r, key, count, timeout, process):
    """Wait until `key` holds `count` records, failing early if `process` died."""
    def enough():
        if process.proc.poll() is not None:
            raise AssertionError(
                f"{process.__class__.__name__} exited with {process.proc.returncode} "
                f"before running {count} job(s):\n{process.log_tail()}"
            )
        return r.llen(key) >= count

    wait_until(enough, timeout=timeout, interval=0.05,
               message=f"{count} record(s) on {key}")
    return _records(r, key)


def _forkq_worker(redis_url, tmp_path):
    return ForkqWorker(redis_url, INTEROP_JOBS, queues=["default"], concurrency=2,
                       log_path=tmp_path / "forkq.log")


def _sidekiq_server(sidekiq_ruby, redis_url, tmp_path):
    return sidekiq_ruby.server(redis_url, log_path=tmp_path / "sidekiq.log")


def _assert_sidekiq_shape(job):
    assert set(job) == PUSHED_FIELDS, job
    assert JID.match(job["jid"]), job["jid"]
    assert job["retry"] is True
    assert isinstance(job["created_at"], float)
    assert isinstance(job["enqueued_at"], float)
    assert job["created_at"] <= job["enqueued_at"]


# -- the Ruby harness and the reference agree (no forkq involved) -------------


@pytest.mark.timeout(60)
def test_ruby_push_writes_the_reference_format(sidekiq_ruby, redis_url, r):
    jid = sidekiq_ruby.push(redis_url, "InteropJob", ARGS)

    (job,) = _queued(r)
    _assert_sidekiq_shape(job)
    assert job["jid"] == jid
    assert (job["class"], job["args"], job["queue"]) == ("InteropJob", ARGS, "default")
    assert r.smembers("queues") == {b"default"}


@pytest.mark.timeout(60)
def test_ruby_sidekiq_runs_a_payload_built_by_hand(sidekiq_ruby, redis_url, r, tmp_path):
    now = time.time()
    job = {"class": "InteropJob", "args": ["by", "hand"], "jid": "0123456789abcdef01234567",
           "queue": "default", "retry": True, "created_at": now, "enqueued_at": now}
    r.sadd("queues", "default")
    r.lpush("queue:default", json.dumps(job))

    with _sidekiq_server(sidekiq_ruby, redis_url, tmp_path) as sidekiq:
        (ran,) = _wait_for_records(r, SIDEKIQ_RAN, 1, 30, sidekiq)
        assert sidekiq.stop() == 0

    assert ran == {"args": ["by", "hand"], "jid": job["jid"]}
    assert r.llen("queue:default") == 0


# -- Ruby pushes, forkq runs ----------------------------------------------------


@pytest.mark.timeout(60)
def test_forkq_runs_job_pushed_by_ruby_sidekiq(sidekiq_ruby, redis_url, r, tmp_path):
    sidekiq_ruby.push(redis_url, "InteropJob", ARGS)

    with _forkq_worker(redis_url, tmp_path) as worker:
        (ran,) = _wait_for_records(r, FORKQ_RAN, 1, 30, worker)
        assert worker.stop() == 0

    assert ran == {"args": ARGS}
    assert r.llen("queue:default") == 0
    assert r.zcard("retry") == 0 and r.zcard("dead") == 0


@pytest.mark.timeout(90)
def test_forkq_runs_every_job_of_ruby_push_bulk(sidekiq_ruby, redis_url, r, tmp_path):
    n = 25
    jids = sidekiq_ruby.push_bulk(redis_url, "InteropJob", n)
    assert len(set(jids)) == n

    with _forkq_worker(redis_url, tmp_path) as worker:
        _wait_for_records(r, FORKQ_RAN, n, 60, worker)
        assert worker.stop() == 0

    ran = sorted(record["args"][0] for record in _records(r, FORKQ_RAN))
    assert ran == list(range(n)), "each bulk job runs exactly once"
    assert r.llen("queue:default") == 0


# -- forkq pushes, Ruby Sidekiq runs ---------------------------------------------


@pytest.mark.timeout(60)
def test_ruby_sidekiq_runs_job_pushed_by_forkq(sidekiq_ruby, redis_url, r, tmp_path):
    jid = forkq.Client(redis_url).push("InteropJob", ARGS)

    with _sidekiq_server(sidekiq_ruby, redis_url, tmp_path) as sidekiq:
        (ran,) = _wait_for_records(r, SIDEKIQ_RAN, 1, 30, sidekiq)
        assert sidekiq.stop() == 0

    assert ran == {"args": ARGS, "jid": jid}
    assert r.llen("queue:default") == 0
    assert r.zcard("retry") == 0 and r.zcard("dead") == 0


@pytest.mark.timeout(120)
def test_ruby_sidekiq_poller_runs_job_scheduled_by_forkq(sidekiq_ruby, redis_url, r, tmp_path):
    at = time.time() + 1.0
    jid = forkq.Client(redis_url).push("InteropJob", ARGS, at=at)

    ((job, score),) = _scheduled(r)
    assert job["jid"] == jid and score == pytest.approx(at, abs=1e-3)
    assert r.llen("queue:default") == 0

    # Sidekiq polls `schedule` within about 2 s of boot (worker.rb sets its timing).
    with _sidekiq_server(sidekiq_ruby, redis_url, tmp_path) as sidekiq:
        (ran,) = _wait_for_records(r, SIDEKIQ_RAN, 1, 40, sidekiq)
        assert sidekiq.stop() == 0

    assert ran == {"args": ARGS, "jid": jid}
    assert r.zcard("schedule") == 0


# -- the same bytes either way ---------------------------------------------------


def _types(job):
    return {key: type(value) for key, value in job.items()}


@pytest.mark.timeout(60)
def test_forkq_and_ruby_push_the_same_payload_shape(sidekiq_ruby, redis_url, r):
    ruby_jid = sidekiq_ruby.push(redis_url, "InteropJob", ARGS)
    forkq_jid = forkq.Client(redis_url).push("InteropJob", ARGS)

    by_jid = {job["jid"]: job for job in _queued(r)}
    ruby_job, forkq_job = by_jid[ruby_jid], by_jid[forkq_jid]

    _assert_sidekiq_shape(ruby_job)
    _assert_sidekiq_shape(forkq_job)
    assert _types(forkq_job) == _types(ruby_job)
    for field in ("class", "args", "queue", "retry"):
        assert forkq_job[field] == ruby_job[field], field
    assert r.smembers("queues") == {b"default"}


@pytest.mark.timeout(60)
def test_forkq_and_ruby_schedule_the_same_payload_shape(sidekiq_ruby, redis_url, r):
    at = time.time() + 3600
    ruby_jid = sidekiq_ruby.push(redis_url, "InteropJob", ARGS, at=at)
    forkq_jid = forkq.Client(redis_url).push("InteropJob", ARGS, at=at)

    by_jid = {job["jid"]: (job, score) for job, score in _scheduled(r)}
    (ruby_job, ruby_score), (forkq_job, forkq_score) = by_jid[ruby_jid], by_jid[forkq_jid]

    # A scheduled payload has no `at` and no `enqueued_at`; the score is the run time.
    assert set(ruby_job) == PUSHED_FIELDS - {"enqueued_at"}
    assert _types(forkq_job) == _types(ruby_job)
    assert ruby_score == pytest.approx(at, abs=1e-3)
    assert forkq_score == pytest.approx(at, abs=1e-3)
    assert r.llen("queue:default") == 0
