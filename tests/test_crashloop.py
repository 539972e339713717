"""Giving up on a crash loop is for apps that cannot boot, not for children killed while up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from helpers import wait_until

REPO = Path(__file__).resolve().parent.parent
APP = REPO / "tests" / "apps" / "supervised_jobs.py"


@pytest.mark.timeout(90)
def test_children_killed_while_up_are_replaced_and_the_master_keeps_going(redis_url, r, tmp_path):
    env = dict(os.environ, FORKQ_REDIS_URL=redis_url, PYTHONPATH=str(REPO))
    master = subprocess.Popen(
        [sys.executable, "-m", "forkq", "start", "--processes", "2", "--concurrency", "1",
         "--require", str(APP), "--heartbeat-interval", "0.2", "--pidfile", str(tmp_path / "pid")],
        env=env, cwd=REPO, stdout=open(tmp_path / "log", "w"), stderr=subprocess.STDOUT,
        start_new_session=True)
    try:
        def up_children() -> list[int]:
            """Children that have started and heartbeated: up, not booting."""
            alive = {c.pid for c in psutil.Process(master.pid).children()}
            beating = {int(m.decode().split(":")[1]) for m in r.smembers("processes")}
            return sorted(alive & beating)

        killed = 0
        # more than CRASH_LOOP_LIMIT (3) deaths per slot, each within the 10 s boot window
        for _ in range(8):
            pids = wait_until(lambda: len(up_children()) == 2 and up_children(), timeout=15,
                              message="both children up")
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            wait_until(lambda: not set(pids) & {c.pid for c in psutil.Process(master.pid).children()},
                       timeout=5, message="the killed children reaped")
        assert master.poll() is None, f"the master gave up after {killed} kills of running children"
        wait_until(lambda: len(up_children()) == 2, timeout=15, message="both slots filled again")
        master.send_signal(signal.SIGTERM)
        assert master.wait(30) == 0
    finally:
        if master.poll() is None:
            os.killpg(master.pid, signal.SIGKILL)
            master.wait()
