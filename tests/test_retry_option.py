"""A payload without `retry` (a bare Sidekiq-format client): the registered job decides."""

from __future__ import annotations

import json

import pytest

from forkq import jobs, keys
from forkq.retry import Outcomes


def _register(name, **options):
    job = jobs.job(name=name, **options)(lambda *a: None)
    return job


def _fail(r, payload, jobdef):
    key = keys.inflight("test:1:aaaaaaaaaaaa")
    r.hset(key, "1", "default\n" + json.dumps(payload))
    fate = Outcomes(r, key).failed(payload, RuntimeError("boom"), "1", jobdef)
    assert r.hlen(key) == 0, "the failure must release the in-flight entry"
    return fate


@pytest.mark.timeout(10)
def test_missing_retry_takes_the_registered_jobs_option(r):
    never = _register("opt.never", retry=False)
    twice = _register("opt.twice", retry=2)
    base = {"args": [], "jid": "a" * 24, "queue": "default"}
    assert _fail(r, dict(base, **{"class": "opt.never"}), never) == "dropped"
    assert r.zcard("retry") == 0 and r.zcard("dead") == 0
    assert _fail(r, dict(base, **{"class": "opt.twice"}), twice) == "retry"
    assert r.zcard("retry") == 1


@pytest.mark.timeout(10)
def test_missing_retry_on_an_unknown_job_still_retries(r):
    payload = {"class": "not.registered.anywhere", "args": [], "jid": "b" * 24, "queue": "default"}
    assert _fail(r, payload, None) == "retry"
    (member,) = r.zrange("retry", 0, -1)
    assert "retry" not in json.loads(member), "the payload is not rewritten with a retry field"


@pytest.mark.timeout(10)
def test_an_explicit_retry_in_the_payload_wins_over_the_registered_option(r):
    never = _register("opt.never2", retry=False)
    payload = {"class": "opt.never2", "args": [], "jid": "c" * 24, "queue": "default", "retry": 3}
    assert _fail(r, payload, never) == "retry"
