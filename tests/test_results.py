"""Job results (`keep_result`): what a worker keeps, and forkq.result() reading it.

In-process against the shared redis-server: a Manager whose processor is driven by hand
(claim, run, done), as in test_unique, so most tests take milliseconds. One test runs a
real `--no-fork` worker.
"""

from __future__ import annotations

import datetime
import json
import threading
import time

import pytest
import redis

import forkq
from forkq import testing
from corekit import (core_jobs, forkq_client, hand_driven_fixture, no_middleware, run_one,  # noqa: F401 (fixtures)
                     workers)
from helpers import wait_until


@forkq.job(queue="rq", keep_result=60, name="results_test.compute")
def compute(a: int, b: int) -> tuple:
    return a + b, 2 ** 70, "naïve"  # a tuple comes back as a list; a bignum and UTF-8 intact


@forkq.job(queue="rq", keep_result=60, time_limit=30, name="results_test.limited")
def limited(a: int) -> int:
    return a * 2  # run under the watchdog: its value comes back through another path


@forkq.job(queue="rq", name="results_test.plain")
def plain(a: int) -> int:
    return a


@forkq.job(queue="rq", keep_result=60, name="results_test.when")
def when() -> dict:
    return {"at": datetime.datetime(2030, 1, 1)}


@forkq.job(queue="rq", keep_result=60, retry=0, name="results_test.dies")
def dies(tag: str) -> None:
    raise RuntimeError(f"boom {tag}")


@forkq.job(queue="rq", keep_result=60, retry=False, name="results_test.dropped")
def dropped(tag: str) -> None:
    raise KeyError(tag)


@forkq.job(queue="rq", keep_result=60, retry=3, retry_in=lambda count, exc: "discard",
           name="results_test.discarded")
def discarded(tag: str) -> None:
    raise ValueError(tag)


@forkq.job(queue="rq", keep_result=60, retry=3, name="results_test.flaky")
def flaky(tag: str) -> None:
    raise ValueError(tag)


ADMIN: list[redis.Redis] = []


@forkq.job(queue="rq", keep_result=60, name="results_test.fills_redis")
def fills_redis() -> str:
    ADMIN[0].config_set("maxmemory", 1)  # every write refused (OOM) from here on
    return "kept"


@pytest.fixture
def client(redis_url):
    return forkq.Client(redis_url)


# a Manager on queue rq, not started: run_one() drives its one processor
worker = hand_driven_fixture("rq", "test:1:000000000001")



def result_keys(r) -> list[bytes]:
    return list(r.scan_iter("forkq:result:*"))


def test_a_success_keeps_the_value_readable_many_times_with_its_ttl(client, r, worker):
    jid = compute.options(client=client).enqueue(2, 3)
    run_one(worker)
    key = f"forkq:result:{jid}"
    # written before the ack: the ack rides on the next claim, the result is there already
    assert r.hlen(worker.fetch.inflight_key) == 1
    expected = [5, 2 ** 70, "naïve"]
    (element,) = r.lrange(key, 0, -1)  # a list of one JSON element, as documented
    assert json.loads(element) == {"value": expected}
    assert forkq.result(jid, client=client) == expected
    assert forkq.result(jid, timeout=1, client=client) == expected  # the blocking read
    assert forkq.result(jid, timeout=1, client=client) == expected
    assert r.llen(key) == 1 and 59_000 < r.pttl(key) <= 60_000  # reading kept both
    worker.fetch.fetch(0)
    assert r.hlen(worker.fetch.inflight_key) == 0


def test_a_job_with_a_time_limit_keeps_its_value_too(client, r, worker):
    jid = limited.options(client=client).enqueue(21)
    run_one(worker)
    assert forkq.result(jid, client=client) == 42


def test_jobs_without_keep_result_keep_nothing(client, r, worker):
    plain.options(client=client).enqueue(1)
    no_keep = compute.options(client=client, keep_result=None).enqueue(1, 2)
    assert "keep_result" not in json.loads(r.lrange("queue:rq", 0, 0)[0])
    run_one(worker)
    run_one(worker)
    assert result_keys(r) == []
    with pytest.raises(forkq.ResultNotReady, match="pushed without keep_result") as caught:
        forkq.result(no_keep, client=client)
    assert isinstance(caught.value, TimeoutError) and caught.value.jid == no_keep


def test_a_value_json_cannot_carry_leaves_the_success_and_reading_it_raises(client, r, worker):
    jid = when.options(client=client).enqueue()
    run_one(worker)
    worker.fetch.fetch(0)
    # a success: acknowledged, not retried, not dead
    assert r.hlen(worker.fetch.inflight_key) == r.zcard("retry") == r.zcard("dead") == 0
    assert worker.processors[0].failed == 0
    with pytest.raises(forkq.UnstorableResult, match=r"succeeded.*\['at'\] is datetime.*JSON-native"):
        forkq.result(jid, client=client)


def test_a_job_that_leaves_for_good_keeps_its_failure(client, r, worker):
    dead = dies.options(client=client).enqueue("d")
    gone = dropped.options(client=client).enqueue("x")
    thrown = discarded.options(client=client).enqueue("y")
    for _ in range(3):
        run_one(worker)
    assert r.zcard("dead") == 1 and r.zcard("retry") == 0 and r.hlen(worker.fetch.inflight_key) == 0
    with pytest.raises(forkq.JobFailed, match="boom d") as caught:
        forkq.result(dead, client=client)
    assert (caught.value.fate, caught.value.error_class, caught.value.error_message) == (
        "dead", "RuntimeError", "boom d")
    with pytest.raises(forkq.JobFailed, match="dropped: KeyError: 'x'"):
        forkq.result(gone, client=client)
    with pytest.raises(forkq.JobFailed, match="discarded.*ValueError: y"):
        forkq.result(thrown, client=client, timeout=1)
    assert all(58_000 < r.pttl(k) <= 60_000 for k in result_keys(r))


def test_a_poison_job_keeps_its_failure(client, r):
    from forkq.fetch import requeue_owner_counts
    identity = "test:1:poison0000000"
    jid = compute.options(client=client).enqueue(1, 2)
    r.hset(f"forkq:inflight:{identity}", "1\nrq", r.rpop("queue:rq"))
    assert requeue_owner_counts(r, identity, ["rq"], crashed=True, poison_after=1).poisoned == 1
    with pytest.raises(forkq.JobFailed, match="killed its worker process 1 times") as caught:
        forkq.result(jid, client=client)
    assert (caught.value.fate, caught.value.error_class) == ("dead", "forkq.PoisonJob")
    assert 58_000 < r.pttl(f"forkq:result:{jid}") <= 60_000


def test_a_periodic_push_keeps_its_result_under_the_jid_of_its_due_time(client, r, worker, monkeypatch):
    from forkq import cron
    monkeypatch.setattr(cron, "ENTRIES", {})
    entry = forkq.periodic("0 3 * * *", compute, [2, 3], name="results_test.nightly")
    due = 1_700_000_000
    r.lpush("queue:rq", json.dumps(entry.payload(due, time.time())))
    run_one(worker)
    assert forkq.result(cron.jid_for("results_test.nightly", due), client=client)[0] == 5
    with pytest.raises(forkq.ResultNotReady):  # another due time's push is another job
        forkq.result(cron.jid_for("results_test.nightly", due + 86400), client=client)


def test_a_job_waiting_to_retry_has_no_result_yet(client, r, worker):
    jid = flaky.options(client=client).enqueue("f")
    run_one(worker)
    assert r.zcard("retry") == 1 and result_keys(r) == []
    with pytest.raises(forkq.ResultNotReady):
        forkq.result(jid, client=client)


def test_an_expired_job_keeps_its_failure(client, r, worker):
    jid = compute.options(client=client, expires_in=0.001).enqueue(1, 1)
    wait_until(lambda: time.time() > json.loads(r.lindex("queue:rq", 0))["expires_at"], timeout=2)
    run_one(worker)
    with pytest.raises(forkq.JobFailed, match="expired before it started") as caught:
        forkq.result(jid, client=client)
    assert caught.value.fate == "expired"


def _blocked_readers(r) -> int:
    return sum(1 for c in r.client_list() if c.get("cmd") == "blmove" and "b" in c.get("flags", ""))


def test_a_wait_returns_as_the_result_lands_not_before(client, r, worker):
    jid = compute.options(client=client).enqueue(20, 22)
    ran_at: list[float] = []

    def run_when_waited_for():
        wait_until(lambda: _blocked_readers(r) == 2, timeout=5, message="two readers blocked")
        ran_at.append(time.monotonic())
        run_one(worker)

    got: dict[str, tuple] = {}

    def read(name):
        value = forkq.result(jid, timeout=20, client=client)
        got[name] = (value, time.monotonic())

    started = time.monotonic()
    other = threading.Thread(target=read, args=("other",))
    runner = threading.Thread(target=run_when_waited_for)
    other.start()
    runner.start()
    read("main")
    other.join(5)
    runner.join(5)
    # both blocked readers got it from the one write, neither before the job ran
    assert got["main"][0] == got["other"][0] == [42, 2 ** 70, "naïve"]
    assert min(got["main"][1], got["other"][1]) >= ran_at[0]
    assert got["main"][1] - started < 5  # as it landed, not at the 20 s timeout


def test_a_wait_longer_than_the_socket_timeout_ends_with_result_not_ready(redis_url, r):
    # blocks in chunks shorter than the client's socket_timeout (0.4 s here): one
    # BLMOVE of the whole second would end in a redis-py TimeoutError instead
    client = forkq.Client(redis_url, socket_timeout=0.4)
    started = time.monotonic()
    with pytest.raises(forkq.ResultNotReady, match="after 1 s"):
        forkq.result("0" * 24, timeout=1.0, client=client)
    assert 1.0 <= time.monotonic() - started < 1.5


def test_a_result_write_refused_keeps_the_job_in_flight_until_it_is_written(client, r, worker, redis_server):
    admin = redis_server.client()
    ADMIN[:] = [admin]
    r.config_resetstat()
    jid = fills_redis.options(client=client).enqueue()
    runner = threading.Thread(target=run_one, args=(worker,))
    try:
        runner.start()

        def refused():
            return r.info("errorstats").get("errorstat_OOM", {}).get("count", 0) >= 1
        wait_until(refused, timeout=5, message="the result's write refused")
        # not acknowledged without its result, and not lost: still in flight, still trying
        assert runner.is_alive() and not r.exists(f"forkq:result:{jid}")
        assert r.hlen(worker.fetch.inflight_key) == 1
    finally:
        admin.config_set("maxmemory", 0)
        runner.join(10)
        admin.close()
    assert not runner.is_alive()
    assert forkq.result(jid, client=client) == "kept"
    worker.fetch.fetch(0)
    assert r.hlen(worker.fetch.inflight_key) == 0


@pytest.mark.parametrize("bad, error", [
    (0, ValueError), (-1, ValueError), (float("inf"), ValueError), (float("nan"), ValueError),
    (2e9, ValueError), (10**400, ValueError), ("60", TypeError), (True, TypeError), ([60], TypeError),
])
def test_a_bad_keep_result_is_refused_before_anything_is_pushed(bad, error, r):
    with pytest.raises(error, match="keep_result"):
        forkq.job(name="results_test.bad", keep_result=bad)(lambda: None)
    with pytest.raises(error, match="keep_result"):
        plain.options(keep_result=bad)
    with pytest.raises(error, match="keep_result"):
        forkq.Client("redis://127.0.0.1:1/0").push(
            "results_test.plain", [1], keep_result=bad)
    assert r.dbsize() == 0


def test_result_refuses_a_bad_jid_or_timeout(client):
    with pytest.raises(TypeError, match="jid"):
        forkq.result(None, client=client)
    with pytest.raises(ValueError, match="timeout"):
        forkq.result("a" * 24, timeout=-1, client=client)


def test_testing_modes_keep_results_in_memory(no_middleware):
    with testing.inline():
        jid = compute.enqueue(1, 2)
        assert forkq.result(jid) == forkq.result(jid, timeout=1) == [3, 2 ** 70, "naïve"]
        with pytest.raises(forkq.UnstorableResult):
            forkq.result(when.enqueue())
    with testing.fake() as jobs:
        jid, other = compute.enqueue(3, 4), dies.enqueue("t")
        with pytest.raises(forkq.ResultNotReady):
            forkq.result(jid)
        with pytest.raises(RuntimeError, match="boom t"):
            jobs.drain()
        assert forkq.result(jid) == [7, 2 ** 70, "naïve"]
        with pytest.raises(forkq.JobFailed, match="boom t"):
            forkq.result(other)
    # the mode's store goes with it: outside, forkq.result() reads Redis again
    assert forkq.results._memory is None


@pytest.mark.timeout(30)
def test_a_real_worker_keeps_results(workers, forkq_client, r):
    ok = core_jobs.add.options(keep_result=60).enqueue(2, 3)
    failed = core_jobs.fail_no_retry.options(keep_result=60).enqueue("e2e")
    workers(concurrency=2)
    assert forkq.result(ok, timeout=10) == 5
    with pytest.raises(forkq.JobFailed, match="dropped: ValueError: no retry e2e"):
        forkq.result(failed, timeout=10)


def test_a_returned_lone_surrogate_is_kept_and_read_back_as_it_was():
    """Arguments may hold no lone surrogate (a payload carries UTF-8 text only), but a
    result is read by forkq.result alone: a returned file name os.fsdecode made is kept,
    ASCII-escaped, and reads back as it was."""
    from forkq import results
    element = results.success(["name\udcff", {"k": 1}], "j1")
    assert json.loads(element) == {"value": ["name\udcff", {"k": 1}]}
    assert "unstorable" in json.loads(results.success(["name\udcff", object()], "j2"))
