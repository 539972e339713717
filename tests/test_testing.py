"""forkq.testing: an app's tests push and run jobs without Redis."""

from __future__ import annotations

import threading

import pytest

import forkq
from forkq import hooks, testing

pytestmark = pytest.mark.timeout(20)

# nothing listens here: a push that tried Redis would raise RedisUnavailable
NOWHERE = "redis://127.0.0.1:1/0"
ran: list[tuple] = []


@forkq.job(name="testing.record", queue="low", client=forkq.Client(NOWHERE))
def record(*args):
    ran.append(args)


@forkq.job(name="testing.fan_out", client=forkq.Client(NOWHERE))
def fan_out(n):
    ran.append(("fan_out", n))
    if n > 0:
        fan_out.enqueue(n - 1)


@forkq.job(name="testing.boom", client=forkq.Client(NOWHERE))
def boom(message):
    raise ValueError(message)


@forkq.job(name="testing.mutate", client=forkq.Client(NOWHERE))
def mutate(items):
    items.append("changed")
    ran.append(("mutate", list(items)))


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    # other test files' apps, imported into this process, register middleware of their own
    monkeypatch.setattr(hooks, "SERVER_MIDDLEWARE", [])
    ran.clear()
    yield
    ran.clear()


def test_fake_records_every_kind_of_push_and_sends_none():
    client = forkq.Client(NOWHERE)
    with testing.fake() as jobs:
        jid = record.enqueue(1, "a")
        record.enqueue_many([[2], [3]])
        record.options(queue="high").enqueue(4)
        later = record.enqueue_in(60, 5)
        client.push("testing.record", [6], queue="other")
        client.push_bulk("Ruby::Job", [[7], [8]])
    assert len(jobs) == 8 and ran == []  # recorded, not run
    assert jobs.jobs[0]["jid"] == jid and jobs.jobs[0]["queue"] == "low"
    assert jobs.args(record) == [[1, "a"], [2], [3], [4], [5], [6]]
    assert jobs.args("Ruby::Job") == [[7], [8]]
    assert [j["args"] for j in jobs.queue("high")] == [[4]]
    scheduled = next(j for j in jobs if j["jid"] == later)
    assert scheduled["at"] > scheduled["created_at"] + 59 and "enqueued_at" not in scheduled
    assert all("at" not in j and "enqueued_at" in j for j in jobs if j["jid"] != later)
    # Sidekiq's own fields, as a Sidekiq client would write them
    assert {"class", "args", "jid", "queue", "retry", "created_at"} <= set(jobs.jobs[0])


def test_a_push_outside_the_mode_goes_to_redis_again(own_redis):
    with testing.fake() as jobs:
        forkq.Client(own_redis.url).push("testing.record", [1])
    assert len(jobs) == 1 and own_redis.client().llen("queue:default") == 0
    forkq.Client(own_redis.url).push("testing.record", [2])
    assert own_redis.client().llen("queue:default") == 1


def test_a_push_is_checked_and_goes_through_client_middleware_as_in_production():
    seen = []

    def stamp(job):
        seen.append(job["jid"])
        if job["args"] == ["drop me"]:
            return None
        job["tenant"] = "acme"
        return job

    client = forkq.Client(NOWHERE, middleware=[stamp])
    with testing.fake() as jobs:
        with pytest.raises(TypeError, match="JSON-native"):
            record.enqueue(object())
        with pytest.raises(ValueError, match="queue"):
            record.options(queue="").enqueue(1)
        assert client.push("testing.record", ["drop me"]) is None
        client.push("testing.record", ["keep me"])
    assert len(seen) == 2
    assert [(j["args"], j["tenant"]) for j in jobs] == [(["keep me"], "acme")]


def test_drain_runs_jobs_oldest_first_with_what_they_push_and_through_server_middleware():
    around = []

    def mw(job, queue, call_next):
        around.append((job["class"], queue))
        return call_next()

    forkq.server_middleware(mw)
    with testing.fake() as jobs:
        record.enqueue("first")
        fan_out.enqueue(2)
        record.enqueue("last")
        assert jobs.drain() == 5
        assert len(jobs) == 0
    assert ran == [("first",), ("fan_out", 2), ("last",), ("fan_out", 1), ("fan_out", 0)]
    assert around[0] == ("testing.record", "low") and len(around) == 5


def test_drain_of_one_job_leaves_the_others_and_a_failure_reaches_the_test():
    with testing.fake() as jobs:
        record.enqueue(1)
        boom.enqueue("bad input")
        fan_out.enqueue(0)
        assert jobs.drain(fan_out) == 1
        with pytest.raises(ValueError, match="bad input"):
            jobs.drain()
        assert jobs.args(record) == [] and jobs.args(boom) == []  # ran, then raised
        assert ran == [("fan_out", 0), (1,)]


def test_drain_stops_jobs_that_push_each_other_forever():
    with testing.fake() as jobs:
        fan_out.enqueue(10_000_000)
        with pytest.raises(RuntimeError, match="more keep coming"):
            jobs.drain(limit=50)
    assert len(ran) == 50


def test_a_job_gets_its_own_copy_of_its_arguments():
    items = ["original"]
    with testing.inline():
        mutate.enqueue(items)
    assert items == ["original"]
    assert ran == [("mutate", ["original", "changed"])]


def test_inline_runs_each_push_before_it_returns_and_raises_its_failure():
    with testing.inline():
        jid = record.enqueue("now")
        assert ran == [("now",)] and isinstance(jid, str)
        record.enqueue_in(3600, "scheduled runs at once too")
        fan_out.enqueue(1)
        with pytest.raises(ValueError, match="inline failure"):
            boom.enqueue("inline failure")
    assert ran == [("now",), ("scheduled runs at once too",), ("fan_out", 1), ("fan_out", 0)]


def test_an_unregistered_job_fails_when_it_runs_not_when_it_is_pushed():
    with testing.fake() as jobs:
        forkq.Client(NOWHERE).push("Ruby::OnlyJob", [1])
        with pytest.raises(forkq.UnknownJob, match="Ruby::OnlyJob"):
            jobs.drain()


def test_pushes_from_other_threads_are_recorded():
    with testing.fake() as jobs:
        threads = [threading.Thread(target=lambda i=i: record.enqueue_many([[i, n] for n in range(50)]))
                   for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
    assert len(jobs) == 200 and len({j["jid"] for j in jobs}) == 200


@forkq.job(name="testing.who_am_i", client=forkq.Client(NOWHERE))
def who_am_i(inner):
    job = forkq.current_job()
    ran.append(("before", job["jid"], job["args"]))
    if inner:
        who_am_i.enqueue(False)
    ran.append(("after", forkq.current_job()["jid"]))


def test_a_job_reads_its_own_payload_with_current_job():
    assert forkq.current_job() is None
    with testing.inline():
        outer = who_am_i.enqueue(True)
    assert forkq.current_job() is None
    (_, jid1, args1), (_, jid2, args2), (_, after_inner), (_, after_outer) = ran
    assert (jid1, args1, after_outer) == (outer, [True], outer)
    assert jid2 == after_inner != outer and args2 == [False]
