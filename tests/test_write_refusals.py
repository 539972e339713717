"""Redis answering but refusing writes for a while (maxmemory reached under noeviction):
nothing forkq holds may be stranded or taken from a live process meanwhile.

Each test makes a private redis-server refuse writes with `CONFIG SET maxmemory 1`, the
way a full Redis does, and frees it again with `maxmemory 0`.
"""

from __future__ import annotations

import json

import pytest

import forkq
from corekit import core_jobs, records, wait_records, workers  # noqa: F401
from helpers import wait_until


def _rejected(conn, command: str) -> int:
    return conn.info("commandstats").get(f"cmdstat_{command}", {}).get("rejected_calls", 0)


@pytest.mark.timeout(60)
def test_outcomes_refused_by_a_full_redis_are_written_once_it_has_room(own_redis, workers,
                                                                      redis_url, r, monkeypatch):
    """A failure's retry entry and a malformed payload's dead entry, both refused with OOM,
    used to be given up at once: the job stayed in the in-flight hash, held by no thread,
    in no queue, retry or dead set, until the worker stopped."""
    monkeypatch.setenv("CORE_RECORD_URL", redis_url)  # the jobs' own records are not refused
    worker = workers(url=own_redis.url, concurrency=2)
    client = forkq.Client(own_redis.url)
    jid = core_jobs.fail_after.options(client=client).enqueue(1.5, "x")
    core_jobs.sleepy.options(client=client).enqueue(1.5, "s")
    wait_records(r, 2, worker, kind="start")
    conn = own_redis.client()
    try:
        # both threads are busy: the garbage is claimed when the sleepy job ends, with
        # Redis refusing writes by then
        conn.lpush("queue:default", b"not a job")
        conn.config_set("maxmemory", "1")
        # the ZADD of the retry entry and the one of the dead entry, both refused
        wait_until(lambda: worker.assert_alive() or _rejected(conn, "zadd") >= 2, timeout=15,
                   message="both outcome writes refused with OOM")
        assert [rec["args"] for rec in records(r, "fail")] == [["x"]]
        conn.config_set("maxmemory", "0")

        wait_until(lambda: conn.zcard("retry") == 1 and conn.zcard("dead") == 1, timeout=15,
                   message="the failure in retry and the malformed payload in dead")
        (raw,) = conn.zrange("retry", 0, -1)
        job = json.loads(raw)
        assert job["jid"] == jid
        assert job["retry_count"] == 0 and "retried_at" not in job  # one failure, not one per try
        (dead,) = conn.zrange("dead", 0, -1)
        assert json.loads(dead)["forkq_original"] == "not a job"
        assert conn.hlen(f"forkq:inflight:{worker.identity}") == 0
    finally:
        conn.config_set("maxmemory", "0")
        conn.close()
    assert worker.stop(timeout=15) == 0


@pytest.mark.timeout(60)
def test_a_worker_started_while_redis_refuses_writes_fetches_once_it_takes_them(
        own_redis, workers, redis_url, r, monkeypatch):
    """Its first write, the owners-registry entry, was refused with OOM, and the error ended
    the fetcher thread: the process heartbeat on, claiming nothing, for good."""
    monkeypatch.setenv("CORE_RECORD_URL", redis_url)
    conn = own_redis.client()
    try:
        conn.config_set("maxmemory", "1")
        worker = workers(url=own_redis.url, ready=False)
        # its registration and its first heartbeat, in either order
        wait_until(lambda: worker.assert_alive() or _rejected(conn, "hset") >= 2, timeout=15,
                   message="the worker's registration refused with OOM")
        conn.config_set("maxmemory", "0")
        core_jobs.record.options(client=forkq.Client(own_redis.url)).enqueue("after OOM")
        wait_records(r, 1, worker, kind="record", timeout=15)
    finally:
        conn.config_set("maxmemory", "0")
        conn.close()
    assert worker.stop(timeout=15) == 0
