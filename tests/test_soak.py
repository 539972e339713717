"""Long runs and leftovers: what a stopped forkq must not wait for.

Real processes, real signals, a real redis-server; waits are deadlines (wait_until).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import forkq
from helpers import ForkqWorker, json_lines, wait_until

REPO_ROOT = Path(__file__).resolve().parent.parent
APP = REPO_ROOT / "tests" / "apps" / "soak_jobs.py"
LEFT = "soak:left"
GIVE_UP = "the exit is still waiting for threads or processes the app left running; ending without them"


def _exited_within(proc: subprocess.Popen, seconds: float) -> int | None:
    try:
        return proc.wait(seconds)
    except subprocess.TimeoutExpired:
        return None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("what", ["thread", "executor", "process"])
def test_a_no_fork_worker_exits_after_its_stop_though_a_job_left_something_running(redis_url, r, what):
    # The job returns at once but leaves 60 s of work behind. The worker's stop is done in
    # milliseconds (nothing in flight); the interpreter's exit then waited for that work,
    # with TERM and INT still trapped, so only a SIGKILL ended the process.
    log = Path(tempfile.mkdtemp(prefix="forkq-soak-")) / "worker.log"
    with ForkqWorker(redis_url, APP, concurrency=2, log_path=log,
                     extra_args=["--timeout", "2", "--log-format", "json"]) as worker:
        wait_until(lambda: worker.assert_alive() or r.scard("processes"), timeout=15,
                   message="the worker's heartbeat")
        forkq.Client(redis_url).push("soak.leave_running", [what, 60])
        wait_until(lambda: worker.assert_alive() or r.llen(LEFT), timeout=15,
                   message=f"the job to leave a {what} running")

        worker.proc.send_signal(signal.SIGTERM)
        stopped_at = time.monotonic()
        code = _exited_within(worker.proc, 15)
        assert code == 0, f"exit {code} 15 s after SIGTERM (None: still running)\n{worker.log_tail()}"
        assert time.monotonic() - stopped_at < 10
        lines = json_lines(log)
        assert [e["event"] for e in lines].count("worker stopped") == 1
        (gave_up,) = [e for e in lines if e["event"] == GIVE_UP]
        if what == "thread":
            assert gave_up["threads"] == ["left-by-job"]
    # a process the job forked outlives the worker, as it would a forked child: not ours to end
    with contextlib.suppress(ProcessLookupError):
        os.killpg(worker.proc.pid, signal.SIGKILL)


@pytest.mark.timeout(60)
def test_a_master_exits_after_its_stop_though_the_app_runs_a_thread_of_its_own(redis_url, r, tmp_path):
    # A non-daemon thread the app started at import lives in the master only (a fork copies
    # no thread): once every child had stopped, the master's exit waited for it.
    out = tmp_path / "master.log"
    env = dict(os.environ, FORKQ_REDIS_URL=redis_url, SOAK_LINGER_AT_IMPORT="60",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p))
    with open(out, "wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "forkq", "start", "--require", str(APP),
                                 "--processes", "1", "--concurrency", "1", "--timeout", "2",
                                 "--log-format", "json", "--pidfile", str(tmp_path / "forkq.pid")],
                                env=env, cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: proc.poll() is None and r.scard("processes"), timeout=15,
                   message=f"the child's heartbeat\n{out.read_text(errors='replace')}")
        proc.send_signal(signal.SIGTERM)
        code = _exited_within(proc, 15)
        assert code == 0, f"exit {code} 15 s after SIGTERM (None: still running)\n{out.read_text()}"
        lines = json_lines(out)
        assert [e["event"] for e in lines].count("master stopped") == 1
        (gave_up,) = [e for e in lines if e["event"] == GIVE_UP]
        assert gave_up["threads"] == ["app-background"]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
