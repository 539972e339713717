"""Redis answering but refusing writes for a while (maxmemory reached under noeviction):
nothing forkq holds may be stranded or taken from a live process meanwhile.

Each test makes a private redis-server refuse writes with `CONFIG SET maxmemory 1`, the
way a full Redis does, and frees it again with `maxmemory 0`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import forkq
from corekit import core_jobs, records, wait_records, workers  # noqa: F401
from forkq import keys
from helpers import REPO_ROOT, stop_gracefully, wait_until

ORPHAN_APP = REPO_ROOT / "tests" / "apps" / "orphan_jobs.py"


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
        worker = workers(url=own_redis.url, ready=False, extra_args=["--heartbeat-interval", "0.2"])
        # its registration and several heartbeats
        wait_until(lambda: worker.assert_alive() or _rejected(conn, "hset") >= 6, timeout=15,
                   message="the worker's registration and heartbeats refused with OOM")
        conn.config_set("maxmemory", "0")
        # one line as the refusal starts; each beat logged a traceback
        log = worker.log_path.read_text()
        assert log.count("no heartbeat until that passes") == 1, log
        assert "heartbeat failed" not in log and "Traceback" not in log, log
        core_jobs.record.options(client=forkq.Client(own_redis.url)).enqueue("after OOM")
        wait_records(r, 1, worker, kind="record", timeout=15)
    finally:
        conn.config_set("maxmemory", "0")
        conn.close()
    assert worker.stop(timeout=15) == 0


OTHER = "elsewhere:4242:0123456789ab"  # a live forkq on another host: tests write its heartbeat


def _start_master(own_redis, tmp_path, recovery_delay: str, heartbeat: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "forkq", "start", "--require", str(ORPHAN_APP), "--processes", "1",
         "--concurrency", "1", "--recovery-delay", recovery_delay, "--heartbeat-interval", heartbeat,
         "--log-format", "json", "--pidfile", str(tmp_path / "forkq.pid"), "--timeout", "1"],
        env=dict(os.environ, FORKQ_REDIS_URL=own_redis.url, PYTHONPATH=str(REPO_ROOT)),
        cwd=REPO_ROOT, stdout=open(tmp_path / "master.log", "w"), stderr=subprocess.STDOUT,
        start_new_session=True)


def _register_other(r, interval: float, jid: str, started_at: float | None = None) -> str:
    """OTHER in the owners registry, running one job; returns that job's payload."""
    running = json.dumps({"class": "orphan.work", "args": ["once", 30], "jid": jid})
    r.hset(keys.OWNERS, OTHER, json.dumps({
        "queues": ["default"], "host": "elsewhere", "pid": 4242, "master": "elsewhere:4241:x",
        "started_at": time.time() if started_at is None else started_at, "heartbeat_interval": interval}))
    r.hset(keys.inflight(OTHER), "1\ndefault", running)
    return running


def _sweeps(r) -> int:
    # only the master's sweep uses EVAL (releasing the lock it took); workers use EVALSHA
    return r.info("commandstats").get("cmdstat_eval", {}).get("calls", 0)


@pytest.mark.timeout(60)
def test_a_forkq_elsewhere_is_not_taken_for_dead_when_a_full_redis_takes_writes_again(
        own_redis, tmp_path):
    """While Redis refuses writes no heartbeat is written; the sweep that first ran after
    the refusal took every other live forkq for dead, and the jobs they were running ran
    a second time beside them."""
    r = own_redis.client()
    here = tmp_path / "master.log"
    # sweeps every second; recovery delay 2 s, and 3 s of a one-second beat for the owner
    master = _start_master(own_redis, tmp_path, "2", "1")
    running = _register_other(r, 1, "j-running")

    def beat():
        r.hset(OTHER, "beat", time.time())

    try:
        beat()
        wait_until(lambda: master.poll() is None and _sweeps(r) >= 2, timeout=20,
                   message="the master sweeping")
        r.config_set("maxmemory", "1")
        # longer than the owner's 3 s lease: its beats are refused meanwhile
        refused_from = time.monotonic()
        wait_until(lambda: time.monotonic() - refused_from > 4 and _rejected(r, "set") >= 3,
                   timeout=20, message="sweeps refused through more than the owner's lease")
        done = _sweeps(r)
        r.config_set("maxmemory", "0")
        # the first sweep after the refusal, then the owner's first beat since
        wait_until(lambda: _sweeps(r) > done, timeout=10, message="a sweep after the refusal")
        beat()
        until = time.monotonic() + 4  # past the master's settling time (delay + its beat)
        while time.monotonic() < until:
            assert r.hget(keys.inflight(OTHER), "1\ndefault") == running.encode(), \
                "the live owner's running job was taken from it"
            assert master.poll() is None
            beat()
            time.sleep(0.25)  # the pace of the live owner's heartbeat, not a synchronisation
        assert r.llen("queue:default") == 0 and r.llen(keys.suspects("default")) == 0
        text = here.read_text()
        assert "recovered a dead process's jobs" not in text
        assert "so no heartbeat is written" in text
        # a refusal, not a stall: the sweep's refusal was logged as both, twice a turn
        assert "Redis stalled during the orphan sweep" not in text
    finally:
        r.config_set("maxmemory", "0")
        stop_gracefully(master, 20)
        r.close()


OTHER_SHORT = "elsewhere:4243:0123456789ab"  # another forkq there, with a short lease


@pytest.mark.timeout(60)
def test_an_owner_that_beats_less_often_than_we_wait_after_a_refusal_keeps_its_jobs(own_redis, tmp_path):
    """After a refusal (or an outage) the master waited its own recovery delay and beat
    before judging, then read the silence of the refusal itself as death: another forkq
    beating every 1.5 s (a 4.5 s lease) that the refusal kept silent for 5 s had its running
    job taken before its next beat. Silence counts from when Redis took writes again."""
    r = own_redis.client()
    log_path = tmp_path / "master.log"
    # settled (delay + beat, 0.9 s) by its second sweep after the refusal, a second apart
    master = _start_master(own_redis, tmp_path, "0.6", "0.3")
    running = _register_other(r, 1.5, "j-slow")

    try:
        r.hset(OTHER, "beat", time.time())
        wait_until(lambda: master.poll() is None and _sweeps(r) >= 2, timeout=20,
                   message="the master sweeping")
        # a second owner, silent from now on, whose lease (the master's 0.6 s delay) ends
        # long before the refusal does: its recovery shows the master judging again
        r.hset(keys.OWNERS, OTHER_SHORT, json.dumps({
            "queues": ["short"], "host": "elsewhere", "pid": 4243, "master": "elsewhere:4241:x",
            "started_at": time.time(), "heartbeat_interval": 0.1}))
        r.hset(keys.inflight(OTHER_SHORT), "1\nshort", json.dumps({"class": "orphan.work",
                                                                    "args": ["short", 30], "jid": "j-short"}))
        r.config_set("maxmemory", "1")
        refused_from = time.monotonic()
        wait_until(lambda: time.monotonic() - refused_from > 5, timeout=20, interval=0.2,
                   message="a refusal longer than the owner's 4.5 s lease")
        r.config_set("maxmemory", "0")

        def judged_again():
            # the live owner's next beat is due within its 1.5 s, but it may not have come
            # yet: the sweep that recovers the silent one must leave the live one's job be
            assert r.hget(keys.inflight(OTHER), "1\ndefault") == running.encode(), \
                "the live owner's running job was taken from it"
            assert master.poll() is None
            return r.llen(keys.suspects("short")) == 1
        wait_until(judged_again, timeout=20, message="the silent owner's job recovered as a suspect")
        r.hset(OTHER, "beat", time.time())
        done = _sweeps(r)

        def kept_through_two_more_sweeps():  # well inside its lease
            assert r.hget(keys.inflight(OTHER), "1\ndefault") == running.encode(), \
                "the live owner's running job was taken from it"
            assert master.poll() is None
            return _sweeps(r) >= done + 2
        wait_until(kept_through_two_more_sweeps, timeout=10, interval=0.1, message="two more sweeps")
        assert r.llen(keys.suspects("default")) == 0
        assert "recovered a dead process's jobs" in log_path.read_text()  # the short one's
        # and the same owner, once silent past its lease, is still recovered
        r.hdel(OTHER, "beat")
        _register_other(r, 1.5, "j-slow", started_at=time.time() - 60)
        wait_until(lambda: r.llen(keys.suspects("default")) == 1, timeout=20,
                   message="the silent owner's job recovered as a suspect")
    finally:
        r.config_set("maxmemory", "0")
        stop_gracefully(master, 20)
        r.close()


@pytest.mark.timeout(10)
@pytest.mark.parametrize("message, refused", [
    ("MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist", True),
    ("Command # 2 (HSET h f v) of pipeline caused error: NOREPLICAS Not enough good replicas", True),
    ("Command # 1 (SET a b) of pipeline caused error: WRONGTYPE Operation against a key", False),
    ("ERR unknown command 'MISCONF'", False),
])
def test_refusals_without_a_redis_py_class_are_told_by_their_code_in_pipelines_too(message, refused):
    import redis
    from forkq.fetch import writes_refused
    assert writes_refused(redis.ResponseError(message)) is refused


@pytest.mark.timeout(60)
def test_a_stop_while_redis_refuses_writes_exits_0_and_says_so_in_one_line(own_redis, workers, r):
    """The last stats and the final requeue, refused with OOM, raised out of the stop: exit 1
    with a traceback, and with jobs still running the final requeue never ran."""
    worker = workers(url=own_redis.url)
    conn = own_redis.client()
    try:
        conn.config_set("maxmemory", "1")
        worker.signal(signal.SIGTERM)
        assert worker.wait_exit(30) == 0
    finally:
        conn.config_set("maxmemory", "0")
        conn.close()
    log = worker.log_path.read_text()
    assert "Traceback" not in log, log
    assert "could not write final stats: Redis refuses writes" in log, log
    # and the process's entry in the owners registry is left for the master or a sweep,
    # with nothing in it to put back
    assert own_redis.client().hlen(f"forkq:inflight:{worker.identity}") == 0
