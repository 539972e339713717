"""A supervised forkq rides through Redis faults: a 10 s stall, connections cut mid-command,
and warns at boot when Redis may evict jobs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest

import forkq
from forkq import keys
from forkq.settings import STOP_GRACE_S
from helpers import forkq_command, json_lines, stop_gracefully, wait_until

REPO = Path(__file__).resolve().parent.parent
APP = REPO / "tests" / "apps" / "chaos_jobs.py"


def _start(url: str, tmp: Path, *args: str) -> subprocess.Popen:
    env = dict(os.environ, FORKQ_REDIS_URL=url, PYTHONPATH=str(REPO))
    return subprocess.Popen(
        [sys.executable, "-m", "forkq", "start", "--require", str(APP), "--queue", "chaos",
         "--processes", "2", "--concurrency", "5", "--heartbeat-interval", "0.5",
         "--log-format", "json", "--pidfile", str(tmp / "pid"), *args],
        env=env, cwd=REPO, stdout=open(tmp / "log", "w"), stderr=subprocess.STDOUT,
        start_new_session=True)


def _ran(r) -> set[int]:
    return {int(v) for v in r.hvals("chaos:execs")}


def _private(r) -> list[bytes]:
    return [k for pat in ("forkq:inflight:*", "forkq:landing:*") for k in r.scan_iter(pat)]


@pytest.mark.timeout(120)
def test_master_and_children_ride_through_redis_not_answering_for_10s(own_redis, tmp_path):
    r = own_redis.client()
    n = 2000
    forkq.Client(own_redis.url).push_bulk("chaos.record", [[i, False] for i in range(n)], queue="chaos")
    master = _start(own_redis.url, tmp_path)
    try:
        wait_until(lambda: len(_ran(r)) >= 50, timeout=30, message="jobs under way")
        assert r.llen("queue:chaos") > 0, "every job ran before the stall: nothing tested"
        own_redis.pause()
        stalled_at = time.time()
        time.sleep(10)  # the fault itself: Redis answers nothing for 10 s
        own_redis.resume()
        assert master.poll() is None, "the master died while Redis stalled"
        wait_until(lambda: _ran(r) == set(range(n)), timeout=60,
                   message="every job ran after Redis came back")
        beats = wait_until(lambda: [float(r.hget(m, "beat") or 0) for m in r.smembers("processes")],
                           timeout=5)
        wait_until(lambda: len([m for m in r.smembers("processes")
                                if float(r.hget(m, "beat") or 0) > stalled_at + 10]) >= 2,
                   timeout=15, message="both children heartbeat again", interval=0.1)
        assert beats
        assert stop_gracefully(master) == 0
        assert _private(r) == [] and r.llen("queue:chaos") == 0
    finally:
        stop_gracefully(master)


@pytest.mark.timeout(120)
def test_connections_cut_mid_command_lose_nothing(own_redis, tmp_path):
    r = own_redis.client()
    n = 3000
    forkq.Client(own_redis.url).push_bulk("chaos.record", [[i, False] for i in range(n)], queue="chaos")
    master = _start(own_redis.url, tmp_path)
    cuts = rounds = 0
    stop = threading.Event()

    def cut() -> None:
        nonlocal cuts, rounds
        admin = own_redis.client()
        while not stop.wait(0.1):
            # every client but this one: fetch scripts, blocking waits, acks, heartbeats
            cuts += admin.client_kill_filter(_type="normal", skipme=True)
            rounds += 1
        admin.close()

    try:
        wait_until(lambda: len(_ran(r)) >= 20, timeout=30, message="jobs under way")
        cutter = threading.Thread(target=cut)
        cutter.start()
        try:
            # about 3 s of every connection cut ten times a second, while jobs are still queued
            wait_until(lambda: rounds >= 30, timeout=30, message="connections cut repeatedly")
            assert r.llen("queue:chaos") > 0, "the jobs all ran before the cuts ended: nothing tested"
        finally:
            stop.set()
            cutter.join()
        assert master.poll() is None
        wait_until(lambda: _ran(r) == set(range(n)), timeout=60, message="every job ran")
        assert stop_gracefully(master) == 0
        assert _private(r) == [] and r.llen("queue:chaos") == 0 and r.llen("forkq:suspects:chaos") == 0
    finally:
        stop.set()
        stop_gracefully(master)


@pytest.mark.timeout(60)
def test_boot_warns_when_redis_may_evict_jobs(own_redis, tmp_path):
    own_redis.client().config_set("maxmemory-policy", "allkeys-lru")
    master = _start(own_redis.url, tmp_path)
    try:
        def warning():
            return next((e for e in json_lines(tmp_path / "log")
                         if "maxmemory-policy" in e.get("event", "")), None)
        event = wait_until(warning, timeout=20, message="a boot warning about maxmemory-policy")
        assert event["policy"] == "allkeys-lru" and event["level"] == "warning"
        # the warning comes before the master traps signals: stop it once it is up
        wait_until(lambda: own_redis.client().scard("processes") == 2, timeout=20,
                   message="children up")
    finally:
        assert stop_gracefully(master) == 0


STOP_TIMEOUT = 0.5  # --timeout of the stop tests: their 30 s jobs are cut off either way


def _stop_with_redis_away(own_redis, tmp_path: Path, away, processes: int = 1,
                          constants: dict[str, float] | None = None) -> tuple[list[dict], float, list[str]]:
    """Supervised children holding two 30 s jobs each, --timeout 0.5; `away` takes Redis
    away, then the master gets SIGTERM. The master's events, seconds until it exited 0,
    the children's identities. `constants`: forkq's stop-time constants to run with."""
    r = own_redis.client()
    env = dict(os.environ, FORKQ_REDIS_URL=own_redis.url, PYTHONPATH=str(REPO))
    log = tmp_path / "log"
    master = subprocess.Popen(
        forkq_command("start", "--require", str(REPO / "tests" / "apps" / "orphan_jobs.py"),
                      "--processes", str(processes), "--concurrency", "2", "--timeout", str(STOP_TIMEOUT),
                      "--heartbeat-interval", "0.5", "--log-format", "json", "--pidfile", str(tmp_path / "pid"),
                      constants=constants),
        env=env, cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: r.hlen(keys.OWNERS) == processes, timeout=20, message="children registered")
        owners = [o.decode() for o in r.hkeys(keys.OWNERS)]
        forkq.Client(own_redis.url).push_bulk("orphan.work", [[f"j{i}", 30] for i in range(2 * processes)])
        # a child claims no more than its two threads: all held means two in each
        wait_until(lambda: sum(r.hlen(keys.inflight(o)) for o in owners) == 2 * processes,
                   timeout=20, message="every child holds two jobs")
        away()
        started = time.monotonic()
        master.send_signal(signal.SIGTERM)
        assert master.wait(60) == 0
        return json_lines(log), time.monotonic() - started, owners
    finally:
        if master.poll() is None:
            os.killpg(master.pid, signal.SIGKILL)
            master.wait()


@pytest.mark.timeout(90)
def test_a_child_stopping_with_redis_down_gives_up_in_time_and_keeps_its_jobs(own_redis, tmp_path):
    """Its stop-time writes share one wait for Redis, so the child ends by itself inside
    --timeout plus the grace (each used to wait on its own, and the master killed it), and
    the jobs it could not put back stay in its in-flight hash for recovery. With a 1.5 s
    STOP_PATIENCE_S, not 4: the child's shared wait and the master's final pass are the
    test's time, and each write waiting on its own still overruns the grace."""
    events, _, (identity,) = _stop_with_redis_away(own_redis, tmp_path, own_redis.stop,
                                                   constants={"STOP_PATIENCE_S": 1.5})
    names = [e.get("event") for e in events]
    exited = [e for e in events if e.get("event") == "child exited"]
    assert [e["how"] for e in exited] == ["exit 0"]
    stopped = next(e for e in events if e.get("event") == "stopping children")
    took = _seconds(exited[0]["timestamp"]) - _seconds(stopped["timestamp"])
    assert took < STOP_TIMEOUT + STOP_GRACE_S, f"the child took {took:.1f}s to stop"
    assert any("Redis unreachable at stop" in n for n in names if n)
    own_redis.start()
    r = own_redis.client()
    assert r.hlen(keys.inflight(identity)) == 2 and r.llen("queue:default") == 0


@pytest.mark.timeout(120)
def test_a_frozen_redis_at_stop_holds_the_master_for_seconds_not_minutes(own_redis, tmp_path):
    """SIGSTOPped Redis: every try takes the master's socket timeout. The child is killed at
    --timeout plus the grace, and the master's final requeue gives up after its patience
    instead of twenty tries (over 100 s), leaving the jobs in the child's hash. Three
    children reaped one after another cost one try between them, not one each. Scaled
    down from 5 s grace, 4 s patience and a 5 s socket timeout to 2, 1.5 and 2 s: the
    same tries, sooner (the patience still less than a try, the final pass one try)."""
    events, took, identities = _stop_with_redis_away(
        own_redis, tmp_path, own_redis.pause, processes=3,
        constants={"STOP_GRACE_S": 2.0, "STOP_PATIENCE_S": 1.5, "REDIS_TIMEOUT_S": 2.0})
    # the children's kill at 0.5 + 2 s, one 2 s try as the first is reaped, the final pass:
    # about 6.5 s (a try per child reaped made it 10.5)
    assert took < 8.5, f"the master took {took:.1f}s to exit"
    assert any("stay in their private lists" in (e.get("event") or "") for e in events)
    own_redis.resume()
    r = own_redis.client()
    assert [r.hlen(keys.inflight(i)) for i in identities] == [2, 2, 2]
    assert r.llen("queue:default") == 0


def _seconds(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


@pytest.mark.timeout(90)
def test_jobs_a_child_finished_while_redis_was_frozen_past_the_grace_do_not_run_again(own_redis, tmp_path):
    """Redis frozen through a whole stop: the child's acks never leave it (its claim and
    its flush are stuck), the master kills it at --timeout plus the grace, and once Redis
    wakes the master's requeue of its hash put the jobs it had finished back on the queue,
    to run a second time. The child now tells the master which entries are finished."""
    runs = tmp_path / "runs"
    env = dict(os.environ, FORKQ_REDIS_URL=own_redis.url, PYTHONPATH=str(REPO),
               FILE_JOBS_RUNS=str(runs))
    log = tmp_path / "log"
    r = own_redis.client()
    total = 3000
    forkq.Client(own_redis.url).push_bulk("file.record", [[i] for i in range(total)], queue="file")
    # a 2 s STOP_GRACE_S, not 5: the child is stuck in Redis calls until it is killed either way
    master = subprocess.Popen(
        forkq_command("start", "--require", str(REPO / "tests" / "apps" / "file_jobs.py"),
                      "--queue", "file", "--processes", "1", "--concurrency", "10", "--timeout", str(STOP_TIMEOUT),
                      "--log-format", "json", "--pidfile", str(tmp_path / "pid"),
                      constants={"STOP_GRACE_S": 2.0}),
        env=env, cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: runs.exists() and runs.stat().st_size > 1000, timeout=30,
                   message="the first jobs to run")
        own_redis.pause()
        master.send_signal(signal.SIGTERM)
        wait_until(lambda: "did not stop in time" in log.read_text(), timeout=30,
                   message="the master to kill its child")
        own_redis.resume()
        assert master.wait(60) == 0
    finally:
        own_redis.resume()
        if master.poll() is None:
            os.killpg(master.pid, signal.SIGKILL)
            master.wait()
    ran = [int(n) for n in runs.read_text().split()]
    assert len(ran) == len(set(ran)), "a job ran twice within the stop"
    queued = {json.loads(raw)["args"][0] for raw in r.lrange("queue:file", 0, -1)}
    assert not queued & set(ran), f"{len(queued & set(ran))} finished jobs went back to run again"
    assert queued | set(ran) == set(range(total)), "a job was lost"
    assert _private(r) == []
