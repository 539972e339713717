"""Chaos: thousands of jobs, busy children SIGKILLed every ~200 ms, Redis restarted once.

The driver is bench/chaos.py's `run()` (`python bench/chaos.py` is the longer run): a real
master (`--processes 4 --concurrency 10`) runs tests/apps/chaos_jobs.py, which records each
execution of job n; 3,000 jobs are fed over ~6.5 s while a loop freezes a random child that
holds jobs, reads its in-flight hash (what its death can make run twice), SIGKILLs it and
times until the master has put its jobs back; at half time own_redis restarts (appendonly:
nothing acknowledged is lost). Then everything must have run, and the master exits 0 on TERM.
"""

from __future__ import annotations

import sys

import pytest

from helpers import REPO_ROOT

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.chaos import run  # noqa: E402

JOBS = 3_000


@pytest.fixture
def chaos(own_redis, tmp_path):
    # --poison-after 1000: these kills are random, not poison jobs; with the default 3 an
    # innocent job unlucky enough to be in flight in 3 of the ~25 kills would go to dead
    report = run(own_redis.url, own_redis.restart, jobs=JOBS, processes=4, concurrency=10,
                 duration=8.0, kill_interval=0.2, poison_after=1000, settle_timeout=60.0,
                 log=tmp_path / "master.log")
    text = report.format()
    print("\n" + text)
    if report.problems():
        print((tmp_path / "master.log").read_text(errors="replace")[-5000:])
    return report, text


@pytest.mark.timeout(150)
def test_chaos_loses_nothing(chaos):
    report, text = chaos
    assert report.kills >= 10, f"too few kills to mean anything\n{text}"
    assert report.redis_down_s is not None, f"Redis was not restarted\n{text}"
    assert report.drained, f"not every job ran before the deadline\n{text}"
    assert not report.lost, f"lost jobs\n{text}"
    assert not report.poisoned and not report.other_dead, f"jobs in dead\n{text}"
    assert report.duplicates <= report.held_at_kills, f"more duplicates than jobs in flight at the kills\n{text}"
    assert len(report.recovery_s) == report.kills and not report.recovery_timeouts, text
    for name, value in report.leftovers.items():
        assert not value, f"{name} left at the end\n{text}"
    assert report.master_exit == 0, f"master exit code after TERM\n{text}"
    assert not report.problems(), text
