"""`stat:processed` and `stat:failed` stay right when children die or replies are lost.

A child counts the jobs it ran in memory, and its heartbeat brings the stats up to its
totals (the flush_stats script adds only what goes beyond the totals it flushed before, so
a heartbeat that reaches Redis twice counts once). It also sends its totals to its master
in the ping it writes about once a second: when a child dies without flushing (SIGKILL, the
OOM killer, os._exit), the master adds what the child pinged beyond what its heartbeats
flushed, so only the jobs of the last ping interval before the death can go uncounted.

The jobs (tests/apps/stats_jobs.py) record each run in Redis as their last act, so the
test knows what ran, in which child and when.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import datetime, timezone

import pytest
import redis

import forkq
from forkq.launcher import Launcher
from forkq.manager import Manager
from forkq.queues import QueueOrder
from helpers import CommandCutter, CommandHolder, ForkqWorker, wait_until
from test_supervisor import APPS, Master, start_master  # noqa: F401  (fixture)

APP = APPS / "stats_jobs.py"
RUNS = "stats:runs"
CONCURRENCY = 4
# The ping goes out about once a second; a loaded machine can delay it. A killed child's
# jobs that ended within this long before the kill may be lost, no others.
PING_WINDOW_S = 2.0
# How long a child runs jobs before it is killed: well past the window, so that losing
# what a child ran since its (first and only) heartbeat shows.
KILL_AFTER_S = 4.0


def runs(r) -> list[tuple[int, float, str]]:
    out = []
    for raw in r.lrange(RUNS, 0, -1):
        pid, at, outcome = raw.decode().split()
        out.append((int(pid), float(at), outcome))
    return out


def today() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d")


def stat(r, name: str) -> int:
    return int(r.get(f"stat:{name}") or 0)


def day_stat(r, name: str, days: set[str]) -> int:
    return sum(int(r.get(f"stat:{name}:{day}") or 0) for day in days)


def drained(r, m: Master) -> bool:
    """Every job ran: nothing queued, nothing waiting as a crash suspect, nothing in flight."""
    m.check()
    if r.llen("queue:default") or r.llen("forkq:suspects:default"):
        return False
    return not any(r.hlen(f"forkq:inflight:{i.decode()}") for i in r.hkeys("forkq:owners"))


def push_ticks(url: str, first: int, count: int, seconds: float = 0.002) -> None:
    forkq.Client(url).push_bulk("stats.tick", [[n, seconds] for n in range(first, first + count)])


@pytest.mark.timeout(150)
def test_counts_of_sigkilled_children_are_not_lost(start_master, redis_url, r):
    days = {today()}
    # heartbeats far apart: without the master's help, a child killed between two of them
    # loses every job it ran since the first
    m = start_master(processes=2, concurrency=CONCURRENCY,
                     args=["--heartbeat-interval", "20", "--poison-after", "1000"], app=APP)
    m.wait_slots()
    pushed = 0
    kills: list[tuple[int, float]] = []
    for round_ in range(2):  # one kill in each slot
        slot = round_ % 2
        pid = m.wait_slots()[slot]

        def ran_a_while() -> bool:
            nonlocal pushed
            # the child has been running jobs for longer than the window: a count lost
            # since its start would show
            m.check()
            # jobs queued all along, about a second's worth at some 3,000 jobs/s: few
            # are left to run after the kills
            if r.llen("queue:default") < 3_000:
                push_ticks(redis_url, pushed, 3_000)
                pushed += 3_000
            mine = [at for p, at, _ in runs(r) if p == pid]
            return bool(mine) and time.time() - min(mine) > KILL_AFTER_S
        wait_until(ran_a_while, timeout=30, interval=0.1, message=f"child {pid} running jobs\n{m.tail()}")
        assert r.llen("queue:default") > 0, "the jobs ran out before the kill: push more"
        kills.append((pid, time.time()))
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: m.wait_slots().get(slot) not in (None, pid), timeout=15,
                   message=f"slot {slot} refilled\n{m.tail()}")
    wait_until(lambda: drained(r, m), timeout=90, interval=0.2, message=f"every job run\n{m.tail()}")
    days.add(today())
    assert m.proc.send_signal(signal.SIGTERM) is None
    assert m.wait(40) == 0
    assert len(m.log_events("child died")) == len(kills)

    ran = runs(r)
    ok, failed = sum(1 for *_, o in ran if o == "ok"), sum(1 for *_, o in ran if o == "fail")
    # what may be lost: per kill, the jobs the child ended in the last ping window, and
    # the ones it was running (recorded, not yet counted; they run again as suspects)
    may_lose = sum(sum(1 for p, at, _ in ran if p == pid and killed - PING_WINDOW_S < at <= killed)
                   + CONCURRENCY for pid, killed in kills)
    processed = stat(r, "processed")
    assert len(ran) - may_lose <= processed <= len(ran), (
        f"{len(ran)} runs, stat:processed {processed}, at most {may_lose} may be lost")
    assert failed - may_lose <= stat(r, "failed") <= failed
    assert day_stat(r, "processed", days) == processed
    assert day_stat(r, "failed", days) == stat(r, "failed")
    assert ok + failed >= pushed


@pytest.mark.timeout(90)
def test_counts_stay_exact_over_graceful_restarts_and_stops(start_master, redis_url, r):
    """A child that stops cleanly has flushed everything itself: its master, which now
    looks at every exited child's totals, must add nothing on top."""
    days = {today()}
    m = start_master(processes=2, concurrency=CONCURRENCY, args=["--heartbeat-interval", "0.5"],
                     app=APP)
    before = set(m.wait_slots().values())
    push_ticks(redis_url, 0, 6_000, seconds=0.001)
    wait_until(lambda: r.llen(RUNS) > 1_000, timeout=30, message=f"jobs running\n{m.tail()}")
    m.signal(signal.SIGHUP)  # a rolling restart: each child stops gracefully, mid-stream
    wait_until(lambda: not before & set(m.wait_slots().values()), timeout=40,
               message=f"both children replaced\n{m.tail()}")
    wait_until(lambda: drained(r, m), timeout=60, interval=0.1, message=f"every job run\n{m.tail()}")
    m.signal(signal.SIGTERM)
    assert m.wait(40) == 0
    days.add(today())

    ran = runs(r)
    assert len(ran) == 6_000  # nothing crashed: each job ran once
    assert stat(r, "processed") == 6_000
    assert stat(r, "failed") == sum(1 for *_, o in ran if o == "fail") == 600
    assert day_stat(r, "processed", days) == 6_000 and day_stat(r, "failed", days) == 600
    assert not list(r.scan_iter(match="forkq:flushed:*"))  # each clean stop removed its own


@pytest.mark.timeout(90)
def test_a_child_killed_while_redis_is_down_is_counted_once_redis_is_back(start_master, own_redis,
                                                                          monkeypatch, tmp_path):
    """The master cannot count a dead child's jobs while Redis is down: it tries again with
    the requeue, as it does for the jobs, and counts them once Redis answers."""
    monkeypatch.setenv("FORKQ_REDIS_URL", own_redis.url)
    r = own_redis.client()
    m = Master(own_redis.url, tmp_path / "master", processes=2, concurrency=CONCURRENCY,
               args=["--heartbeat-interval", "20"], app=APP).start()
    try:
        victim = m.wait_slots()[0]
        # both children have beaten once; their next beats are 20 s away, so what the one to
        # be killed runs is known to the master from its pings
        wait_until(lambda: r.scard("processes") == 2, timeout=15, message=m.tail())
        push_ticks(own_redis.url, 0, 2_000, seconds=0.001)
        wait_until(lambda: drained(r, m), timeout=60, interval=0.1, message=f"every job run\n{m.tail()}")
        ran = len(runs(r))
        assert any(p == victim for p, _, _ in runs(r)), "the child to kill ran no job"
        # its only heartbeat was at its start: what it ran is known from its pings alone
        # (two pings at least, one a second, since its last job)
        last = max(at for p, at, _ in runs(r) if p == victim)
        wait_until(lambda: time.time() - last > 2.5, timeout=5)
        r.close()
        own_redis.stop()
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: m.log_events("cannot requeue a dead child's jobs yet: Redis unreachable"),
                   timeout=15, message=f"the master trying while Redis is down\n{m.tail()}")
        own_redis.start()
        r = own_redis.client()
        (counted,) = wait_until(lambda: m.log_events("counted the jobs a child ran since its last heartbeat"),
                                timeout=30, message=f"the master counting once Redis is back\n{m.tail()}")
        mine = [o for p, _, o in runs(r) if p == victim]
        # what has been counted for the child now: its heartbeats' and the master's
        flushed = r.hmget(f"forkq:flushed:{counted['identity']}", "processed", "failed")
        assert [int(n) for n in flushed] == [len(mine), mine.count("fail")]
        m.signal(signal.SIGTERM)
        assert m.wait(40) == 0
        assert stat(r, "processed") == ran == 2_000
        assert stat(r, "failed") == 200
    finally:
        m.kill()
        r.close()


@pytest.mark.timeout(60)
def test_a_heartbeat_whose_reply_is_lost_counts_its_jobs_once(own_redis, monkeypatch):
    """Redis ran the heartbeat's transaction, and the reply never came back (a connection
    cut): redis-py sends it again, or the next beat does. Either way the same totals reach
    the script again, which adds nothing the second time."""
    cutter = CommandCutter(own_redis.port, b"stat:processed", armed=False)
    url = f"redis://127.0.0.1:{cutter.port}/0"
    monkeypatch.setenv("FORKQ_REDIS_URL", url)
    r = own_redis.client()
    # beats 1.2 s apart: the 500 jobs below take some 0.2 s, so all of them end between two
    worker = ForkqWorker(url, APP, concurrency=CONCURRENCY, extra_args=["--heartbeat-interval", "1.2"])
    try:
        with worker:
            def beat() -> float:
                worker.assert_alive()
                members = r.smembers("processes")
                return float(r.hget(next(iter(members)), "beat") or 0) if members else 0.0
            first = wait_until(beat, timeout=15, message=worker.log_tail())
            fresh = wait_until(lambda: (b := beat()) > first and b, timeout=10, message=worker.log_tail())
            # right after a beat, so that the next one carries every job's count
            push_ticks(own_redis.url, 0, 500, seconds=0)
            wait_until(lambda: r.llen(RUNS) == 500, timeout=20, message=worker.log_tail())
            assert beat() == fresh and stat(r, "processed") == 0, "jobs too slow for this test"
            cutter.armed.set()
            assert cutter.cut.wait(10), worker.log_tail()
            wait_until(lambda: stat(r, "processed") >= 500, timeout=10, message=worker.log_tail())
            # another beat (the same totals sent again) must add nothing; so must the stop's
            wait_until(lambda: beat() > fresh + 1.8, timeout=15, message=worker.log_tail())
        assert (stat(r, "processed"), stat(r, "failed")) == (500, 50)
        assert day_stat(r, "processed", {today()}) == 500
    finally:
        cutter.close()
        r.close()


@pytest.mark.timeout(90)
def test_jobs_that_end_while_a_child_stops_are_counted_when_its_last_flush_is_refused(
        own_redis, redis_url, r, tmp_path):
    """A stopping child pings no more while its running jobs finish; if Redis then refuses
    its last flush, its master writes the totals the child sent as it exited."""
    admin = own_redis.client()
    m = Master(own_redis.url, tmp_path / "master", processes=1, concurrency=CONCURRENCY,
               args=["--heartbeat-interval", "20", "--timeout", "5"], app=APP,
               env={"STATS_RECORD_URL": redis_url}).start()
    try:
        m.wait_slots()
        wait_until(lambda: admin.scard("processes") == 1, timeout=15, message=m.tail())
        (identity,) = admin.smembers("processes")
        forkq.Client(own_redis.url).push_bulk("stats.long_tick", [[n, 2.0] for n in range(1, 5)])
        # started, not only in flight: a job a claim brought that no thread had taken yet
        # would be given back unstarted by the stop (this test failed so, 2 runs of 4)
        wait_until(lambda: r.llen("stats:started") == 4, timeout=10,
                   message=f"four jobs running\n{m.tail()}")
        admin.config_set("maxmemory", "1")  # a full Redis: every write refused
        m.signal(signal.SIGHUP)  # the child stops, its jobs end after its last ping
        wait_until(lambda: m.log_events("cannot count a dead child's last jobs yet: Redis refuses writes"),
                   timeout=30, message=f"the master waiting for Redis to take writes\n{m.tail()}")
        assert r.llen(RUNS) == 4
        assert m.log_events("could not write final stats: Redis refuses writes")
        admin.config_set("maxmemory", "0")
        (counted,) = wait_until(lambda: m.log_events("counted the jobs a child ran since its last heartbeat"),
                                timeout=20, message=f"the master counting\n{m.tail()}")
        assert (counted["identity"], counted["processed"], counted["failed"]) == (identity.decode(), 4, 0)
        assert int(admin.get("stat:processed")) == 4
        m.signal(signal.SIGTERM)
        assert m.wait(40) == 0
        assert int(admin.get("stat:processed")) == r.llen(RUNS)
    finally:
        m.kill()
        admin.close()


@pytest.mark.timeout(30)
def test_a_heartbeat_that_reaches_redis_after_the_final_flush_adds_nothing(own_redis):
    """A stop while Redis is frozen: the heartbeat the stop could not wait for (it joins
    the heartbeat thread for 5 s) is stuck on its socket and reaches Redis after the final
    flush. The final flush deleted the record of the flushed totals, so that beat added,
    from its own older figure, the jobs the final flush had just counted."""
    holder = CommandHolder(own_redis.port)
    admin = own_redis.client()
    identity = "test:1:000000000000"
    client = redis.Redis(port=holder.port)
    manager = Manager(lambda: client, identity, QueueOrder([("default", 0)]), concurrency=1)
    launcher = Launcher(client, identity, manager, {"concurrency": 1}, lambda signum: None)
    (processor,) = manager.processors
    beat = threading.Thread(target=launcher.beat)
    launcher._thread = beat  # the heartbeat thread, still stuck in its beat when the stop flushes
    try:
        manager.fetch.register()
        processor.processed = 10
        launcher.beat()
        assert stat(admin, "processed") == 10
        processor.processed = 30
        holder.marker = b"forkq:alive"  # in a heartbeat's transaction, not in the final flush's
        beat.start()
        assert holder.holding.wait(5), "the heartbeat never went out"
        launcher.final_flush()
        assert stat(admin, "processed") == 30
        holder.release.set()
        beat.join(5)
        assert not beat.is_alive()
        assert stat(admin, "processed") == 30
        assert day_stat(admin, "processed", {today()}) == 30
    finally:
        holder.close()
        if beat.ident is not None:
            beat.join(5)
        admin.close()
