"""`stat:processed` and `stat:failed` stay right when replies are lost.

A child counts the jobs it ran in memory, and its heartbeat brings the stats up to its
totals (the flush_stats script adds only what goes beyond the totals it flushed before, so
a heartbeat that reaches Redis twice counts once).

The jobs (tests/apps/stats_jobs.py) record each run in Redis as their last act, so the
test knows what ran, in which child and when.
"""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

import forkq
from helpers import CommandCutter, ForkqWorker, wait_until
from test_supervisor import APPS

APP = APPS / "stats_jobs.py"
RUNS = "stats:runs"
CONCURRENCY = 4


def today() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d")


def stat(r, name: str) -> int:
    return int(r.get(f"stat:{name}") or 0)


def day_stat(r, name: str, days: set[str]) -> int:
    return sum(int(r.get(f"stat:{name}:{day}") or 0) for day in days)


def push_ticks(url: str, first: int, count: int, seconds: float = 0.002) -> None:
    forkq.Client(url).push_bulk("stats.tick", [[n, seconds] for n in range(first, first + count)])


@pytest.mark.timeout(60)
def test_a_heartbeat_whose_reply_is_lost_counts_its_jobs_once(own_redis, monkeypatch):
    """Redis ran the heartbeat's transaction, and the reply never came back (a connection
    cut): redis-py sends it again, or the next beat does. Either way the same totals reach
    the script again, which adds nothing the second time."""
    cutter = CommandCutter(own_redis.port, b"stat:processed", armed=False)
    url = f"redis://127.0.0.1:{cutter.port}/0"
    monkeypatch.setenv("FORKQ_REDIS_URL", url)
    r = own_redis.client()
    worker = ForkqWorker(url, APP, concurrency=CONCURRENCY, extra_args=["--heartbeat-interval", "3"])
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
            wait_until(lambda: beat() > fresh + 4, timeout=15, message=worker.log_tail())
        assert (stat(r, "processed"), stat(r, "failed")) == (500, 50)
        assert day_stat(r, "processed", {today()}) == 500
    finally:
        cutter.close()
        r.close()