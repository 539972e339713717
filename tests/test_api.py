"""forkq.api against a real Redis: queues, processes, the sorted sets, stats.

Data is built with forkq.Client pushes and direct ZADDs of Sidekiq-format entries (what
Ruby Sidekiq writes is the same format); a real worker runs a retried job, and a real
`forkq start --processes 2` master shows its children grouped under it.
"""

from __future__ import annotations

import json
import time

import pytest

import forkq
from forkq import api
from corekit import queued, wait_records, workers  # noqa: F401  (workers is a fixture)
from helpers import wait_until
from test_ctl import start_master  # noqa: F401  (a fixture)

RECORD = "tests.apps.core_jobs.record"


def sk_job(i: int, klass: str = "HardJob", queue: str = "default", **extra) -> dict:
    """A failed job as Sidekiq 6.4 writes it, with an unknown field to carry through."""
    job = {"retry": True, "queue": queue, "args": [i], "class": klass, "jid": "%024x" % (i + 1),
           "created_at": 1700000000.5, "enqueued_at": 1700000000.6, "error_message": f"boom {i}",
           "error_class": "RuntimeError", "failed_at": 1700000001.0, "retry_count": 3,
           "custom_field": {"keep": [1, "two"]}}
    job.update(extra)
    return job


def fill(r, key: str, jobs: list[dict], base: float = 1_700_000_000.0) -> None:
    pipe = r.pipeline(transaction=False)
    for i, job in enumerate(jobs):
        pipe.zadd(key, {json.dumps(job): base + i})
    pipe.execute()


@pytest.mark.timeout(20)
def test_queue_sizes_and_latency_in_seconds_and_milliseconds(r, redis_url):
    c = forkq.Client(redis_url)
    for i in range(3):
        c.push("Some", [i], queue="a")
    now = time.time()
    # the next to run is the RIGHTMOST entry; an older job further left must not count
    r.rpush("queue:b", json.dumps({"class": "X", "args": [], "jid": "1" * 24, "enqueued_at": now - 42.0}))
    r.lpush("queue:b", json.dumps({"class": "X", "args": [], "jid": "2" * 24, "enqueued_at": now - 1000.0}))
    r.sadd("queues", "b", "c", "empty")
    r.rpush("queue:c", json.dumps({"class": "X", "args": [], "jid": "3" * 24,
                                   "enqueued_at": int((now - 7.0) * 1000)}))  # Sidekiq 8: ms
    got = {q.name: q for q in api.queues(api.connect())}
    assert {n: q.size for n, q in got.items()} == {"a": 3, "b": 2, "c": 1, "empty": 0}
    assert 41 <= got["b"].latency < 45
    assert 6 <= got["c"].latency < 10
    assert got["a"].latency < 5 and got["empty"].latency == 0


@pytest.mark.timeout(30)
def test_paging_2500_dead_entries_each_once_in_score_order(r, redis_url):
    fill(r, "dead", [sk_job(i, klass="A" if i % 2 else "B", queue="q1" if i % 5 else "q2")
                     for i in range(2500)])
    conn = api.connect()
    dead = api.dead(conn, page_size=300)
    seen = list(dead)
    assert [e.job["args"][0] for e in seen] == list(range(2500))
    assert [e.score for e in seen] == sorted(e.score for e in seen)
    assert dead.size() == 2500
    assert len(list(dead.entries(api.matching(klass="A")))) == 1250
    assert len(list(dead.entries(api.matching(queue="q2")))) == 500
    assert len(list(dead.entries(api.matching(klass="B", queue="q2")))) == 250
    hit = dead.find("%024x" % 2400)
    assert hit is not None and hit.job["args"] == [2399]
    assert dead.find("f" * 24) is None


@pytest.mark.timeout(30)
def test_retry_now_moves_dead_job_with_fields_and_a_worker_runs_it(r, redis_url, workers):
    job = sk_job(7, klass=RECORD, error_backtrace="eJy1")
    fill(r, "dead", [job, sk_job(8)])
    conn = api.connect()
    dead = api.dead(conn)
    entry = dead.find(job["jid"])
    before = time.time()
    assert dead.retry_now([entry]) == 1
    assert dead.retry_now([entry]) == 0  # ZREM-guarded: never pushed twice
    assert dead.size() == 1 and r.sismember("queues", "default")
    (moved,) = queued(r)
    assert moved["enqueued_at"] >= before
    assert moved["retry_count"] == 2  # Sidekiq's rule: a retried job keeps its count
    for k in ("custom_field", "error_backtrace", "created_at", "jid", "args", "failed_at"):
        assert moved[k] == job[k]
    w = workers()
    (rec,) = wait_records(r, 1, w, kind="record")
    assert rec["args"] == [7]


@pytest.mark.timeout(20)
def test_retry_and_schedule_sets_kill_delete_clear(r, redis_url):
    fill(r, "retry", [sk_job(i, klass="K" if i < 3 else "L") for i in range(10)])
    fill(r, "schedule", [{"class": "S", "args": [i], "jid": "%024x" % (100 + i), "queue": "later"}
                         for i in range(4)])
    fill(r, "dead", [sk_job(1000)], base=time.time() - 200 * 86400)  # past the 180 days
    conn = api.connect()
    retry = api.retries(conn, page_size=3)
    assert retry.apply(retry.kill, api.matching(klass="K")) == 3
    dead = api.dead(conn)
    # the kill trimmed the dead set as Sidekiq does: the 200-day-old entry is gone
    assert sorted(e.klass for e in dead) == ["K", "K", "K"]
    assert retry.size() == 7
    assert retry.apply(retry.delete, api.matching(jid="%024x" % 5)) == 1
    assert retry.size() == 6
    sched = api.schedule(conn)
    assert sched.apply(sched.retry_now, api.matching(klass="S")) == 4
    assert [j["args"] for j in queued(r, "later")] == [[0], [1], [2], [3]]
    assert all("enqueued_at" in j for j in queued(r, "later"))
    assert retry.clear() == 6 and retry.size() == 0
    with pytest.raises(ValueError):
        api.SortedSet(conn, "queues")


@pytest.mark.timeout(20)
def test_malformed_entries_are_listed_not_moved(r, redis_url):
    r.zadd("dead", {b"not json": 1.0, json.dumps(sk_job(1)): 2.0})
    dead = api.dead(api.connect())
    entries = list(dead)
    assert entries[0].job is None and entries[0].to_dict()["job"] == "not json"
    assert dead.apply(dead.retry_now) == 1
    assert dead.size() == 1 and len(queued(r)) == 1


@pytest.mark.timeout(20)
def test_stats_totals_and_history(r, redis_url):
    days = api._days(3)
    r.mset({"stat:processed": 50, "stat:failed": 5, f"stat:processed:{days[0]}": 10,
            f"stat:failed:{days[0]}": 2, f"stat:processed:{days[2]}": 7})
    forkq.Client(redis_url).push("X", [1], queue="a")
    fill(r, "dead", [sk_job(1), sk_job(2)])
    s = api.stats(api.connect(), days=3)
    assert (s.processed, s.failed, s.enqueued, s.dead, s.retries, s.scheduled) == (50, 5, 1, 2, 0, 0)
    assert s.history == [(days[0], 10, 2), (days[1], 0, 0), (days[2], 7, 0)]


@pytest.mark.timeout(40)
def test_processes_grouped_by_master_and_running_jobs(r, redis_url, start_master, workers):
    m = start_master(processes=2)
    m.wait_ready(r)
    lone = workers()
    # a Sidekiq process: a heartbeat with no master
    r.sadd("processes", "rubyhost:99:abcdefabcdef")
    r.hset("rubyhost:99:abcdefabcdef", mapping={
        "info": json.dumps({"hostname": "rubyhost", "pid": 99, "concurrency": 10, "queues": ["default"]}),
        "busy": 1, "beat": time.time() - 3, "quiet": "false", "rss": 1234})
    job = sk_job(1, klass="RubyJob")
    r.hset("rubyhost:99:abcdefabcdef:workers", "t1",
           json.dumps({"queue": "default", "payload": json.dumps(job), "run_at": 1700000000}))
    conn = api.connect()
    groups = api.processes(conn)
    forked = [g for g in groups if g.master is not None]
    assert len(forked) == 1 and len(groups) == 3
    assert [p.slot for p in forked[0].processes] == [0, 1]
    assert forked[0].master.split(":")[1] == str(m.pid)
    assert all(p.rss_kb > 0 and p.beat_age is not None and p.beat_age < 30 for p in forked[0].processes)
    lone_ids = {g.processes[0].identity for g in groups if g.master is None}
    assert lone_ids == {lone.identity, "rubyhost:99:abcdefabcdef"}
    (run,) = api.running(conn)
    assert run.identity == "rubyhost:99:abcdefabcdef" and run.job["jid"] == job["jid"]
    assert run.run_at == 1700000000 and run.queue == "default"


@pytest.mark.timeout(20)
def test_crash_suspects_counted_per_queue_and_in_stats_and_listed_next_first(r, redis_url):
    from forkq import fetch, keys
    from forkq.queues import QueueOrder
    c = forkq.Client(redis_url)
    jids = [c.push("Crashy", [i], queue="mail") for i in range(3)]
    c.push("Calm", [9], queue="mail")
    c.push("Other", [1], queue="idle")
    # as a child's death makes them: claimed into a process's in-flight hash, then
    # requeued as crashed by the real script (a crash count raised for each)
    held = fetch.ReliableFetch(r, "dead-child", QueueOrder([("mail", 0)]), direct=False)
    held.register()
    assert [json.loads(u.raw)["jid"] for u in held.fetch(3)] == jids
    assert fetch.requeue_owner_counts(r, "dead-child", ["mail"], crashed=True).suspects == 3
    r.incr(keys.CRASH_PREFIX + jids[0])  # the first one was in flight in an earlier death too
    # garbage on a suspects list is shown, not crashed on; a queue out of the `queues` set
    # is not counted (no SCAN), but its suspects can still be read by name
    r.rpush(keys.suspects("idle"), b"not a job")
    r.lpush(keys.suspects("unlisted"), json.dumps({"class": "X", "args": [], "jid": "u" * 24}))
    conn = api.connect()
    got = {q.name: (q.size, q.suspects) for q in api.queues(conn)}
    assert got == {"mail": (1, 3), "idle": (1, 1)}
    s = api.stats(conn, days=1)
    assert (s.enqueued, s.suspects) == (2, 4)

    listed = api.Suspects(conn, "mail").page(0, 10)
    # the oldest claim runs first (RPOP): the next to run is listed first
    assert [(e.jid, e.crashes, e.score) for e in listed] == [(jids[0], 2, 2.0), (jids[1], 1, 1.0),
                                                              (jids[2], 1, 0.0)]
    assert [e.jid for e in api.Suspects(conn, "mail").page(1, 1)] == [jids[1]]
    assert listed[0].to_dict()["crashes"] == 2 and listed[0].klass == "Crashy"
    garbage = api.Suspects(conn, "idle").page(0, 10)
    assert [(e.job, e.crashes) for e in garbage] == [(None, 0)]
    assert api.Suspects(conn, "unlisted").size() == 1


@pytest.mark.timeout(20)
def test_a_sidekiq_8_heartbeat_gives_its_thread_count_from_its_own_field(r, redis_url):
    """Sidekiq 8.1.2+ writes `concurrency` beside `info` and no longer inside it; older
    Sidekiqs (and forkq before its own field) have it in `info` only."""
    info = {"hostname": "rb", "pid": 7, "queues": ["default"], "identity": "rb:7:new"}
    r.sadd("processes", "rb:7:new", "rb:8:old")
    r.hset("rb:7:new", mapping={"info": json.dumps(info), "busy": 1, "beat": time.time(),
                                "concurrency": 5, "quiet": "false", "rss": 100})
    r.hset("rb:8:old", mapping={"info": json.dumps(dict(info, pid=8, concurrency=3)), "busy": 0,
                                "beat": time.time(), "quiet": "false", "rss": 100})
    found = {p.identity: p.concurrency for g in api.processes(r) for p in g.processes}
    assert found == {"rb:7:new": 5, "rb:8:old": 3}


@pytest.mark.timeout(20)
def test_a_suspect_without_a_jid_shows_its_crash_count(r, redis_url):
    """Its count is kept under its payload's SHA1 (fetch.crash_id): read by jid, it was 0."""
    from forkq import fetch
    from forkq.queues import QueueOrder
    r.lpush("queue:mail", json.dumps({"class": "Crashy", "args": [1], "queue": "mail"}))
    held = fetch.ReliableFetch(r, "dead-child", QueueOrder([("mail", 0)]), direct=False)
    held.register()
    assert len(held.fetch(1)) == 1
    assert fetch.requeue_owner_counts(r, "dead-child", ["mail"], crashed=True).suspects == 1
    (listed,) = api.Suspects(api.connect(), "mail").page(0, 10)
    assert listed.jid is None and listed.crashes == 1
