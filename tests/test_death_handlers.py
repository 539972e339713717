"""forkq.on_death: handlers run once a job has failed its way into the dead set.

In-process against the shared redis-server: a Manager whose one processor is driven by
hand (corekit.run_one), so each test takes milliseconds."""

from __future__ import annotations

import json

import pytest

import forkq
from forkq import hooks
from corekit import hand_driven_fixture, run_one

worker = hand_driven_fixture("dq", "test:1:00000000death")


@forkq.job(queue="dq", retry=1, name="death_test.fails")
def fails(n: int) -> None:
    raise ValueError(f"boom {n}")


@forkq.job(queue="dq", retry=5, retry_in=lambda count, exc: "kill", name="death_test.killed")
def killed(n: int) -> None:
    raise KeyError(n)


@pytest.fixture
def deaths():
    seen: list = []
    handler = hooks.on_death(lambda job, exc: seen.append((job, exc)))
    yield seen
    hooks.ON_DEATH.remove(handler)


def test_a_death_handler_runs_once_the_retries_ran_out_and_not_before(worker, r, deaths, redis_url):
    forkq.configure(redis_url)
    jid = fails.enqueue(7)
    run_one(worker)
    assert deaths == [] and r.zcard("retry") == 1  # a retry is no death
    r.lpush("queue:dq", r.zrange("retry", 0, -1)[0])  # its retry comes due
    r.delete("retry")
    run_one(worker)
    ((job, exc),) = deaths
    assert job["jid"] == jid and job["retry_count"] == 1 and job["error_message"] == "boom 7"
    assert isinstance(exc, ValueError)
    (dead,) = r.zrange("dead", 0, -1)
    assert json.loads(dead)["jid"] == jid  # written before the handler ran


def test_a_kill_from_retry_in_is_a_death_and_a_broken_handler_changes_nothing(worker, r, deaths, redis_url):
    forkq.configure(redis_url)

    def broken(job, exc):
        raise RuntimeError("the pager is down")
    hooks.ON_DEATH.insert(0, broken)  # first: the handler after it still runs
    try:
        jid = killed.enqueue(1)
        run_one(worker)
    finally:
        hooks.ON_DEATH.remove(broken)
    assert [job["jid"] for job, _ in deaths] == [jid]
    assert [json.loads(raw)["jid"] for raw in r.zrange("dead", 0, -1)] == [jid]
    assert r.hlen(worker.fetch.inflight_key) == 0  # nothing left in flight by the failure
