"""Long runs and leftovers: what a stopped forkq must not wait for.

Real processes, real signals, a real redis-server; waits are deadlines (wait_until).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

import forkq
from helpers import ForkqWorker, forkq_command, json_lines, wait_until

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
def test_a_no_fork_worker_exits_after_its_stop_though_jobs_left_things_running(redis_url, r):
    # Each job returns at once but leaves 60 s of work behind: a non-daemon thread, a task
    # on a module-level executor, a multiprocessing child. The worker's stop is done in
    # milliseconds (nothing in flight); the interpreter's exit then waited for that work,
    # with TERM and INT still trapped, so only a SIGKILL ended the process. (One worker
    # for the three: each alone hung the exit, and each waits out the same grace, here
    # EXIT_GRACE_S 0.5 rather than 2.)
    log = Path(tempfile.mkdtemp(prefix="forkq-soak-")) / "worker.log"
    kinds = ["thread", "executor", "process"]
    with ForkqWorker(redis_url, APP, concurrency=2, log_path=log,
                     extra_args=["--timeout", "2", "--log-format", "json"],
                     constants={"EXIT_GRACE_S": 0.5}) as worker:
        wait_until(lambda: worker.assert_alive() or r.scard("processes"), timeout=15,
                   message="the worker's heartbeat")
        for what in kinds:
            forkq.Client(redis_url).push("soak.leave_running", [what, 60])
        wait_until(lambda: worker.assert_alive() or r.llen(LEFT) == len(kinds), timeout=15,
                   message="the jobs to leave a thread, a task and a process running")

        worker.proc.send_signal(signal.SIGTERM)
        stopped_at = time.monotonic()
        code = _exited_within(worker.proc, 15)
        assert code == 0, f"exit {code} 15 s after SIGTERM (None: still running)\n{worker.log_tail()}"
        assert time.monotonic() - stopped_at < 10
        lines = json_lines(log)
        assert [e["event"] for e in lines].count("worker stopped") == 1
        (gave_up,) = [e for e in lines if e["event"] == GIVE_UP]
        assert "left-by-job" in gave_up["threads"]
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
        # the exit waits out EXIT_GRACE_S: 0.5 s here, not 2
        proc = subprocess.Popen(forkq_command("start", "--require", str(APP),
                                              "--processes", "1", "--concurrency", "1", "--timeout", "2",
                                              "--log-format", "json", "--pidfile", str(tmp_path / "forkq.pid"),
                                              constants={"EXIT_GRACE_S": 0.5}),
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


@pytest.mark.timeout(60)
def test_each_heartbeat_sends_a_big_running_payload_to_redis_once(redis_url, r):
    # Every beat rewrites the running jobs under both of Sidekiq's keys (:workers for 6.4,
    # :work for 6.5+). Built and sent once per key, a job with 4 MB of arguments cost each
    # beat 8 MB of traffic, and twice the copies in the child's memory.
    size = 4 << 20
    log = Path(tempfile.mkdtemp(prefix="forkq-soak-")) / "worker.log"
    with ForkqWorker(redis_url, APP, concurrency=1, log_path=log,
                     extra_args=["--timeout", "1", "--heartbeat-interval", "0.3"]) as worker:
        identity = wait_until(lambda: worker.assert_alive() or next(iter(r.smembers("processes")), None),
                              timeout=15, message="the worker's heartbeat").decode()
        forkq.Client(redis_url).push("soak.hold", ["x" * size, 30])
        workers, work = f"{identity}:workers", f"{identity}:work"
        wait_until(lambda: worker.assert_alive() or r.exists(workers, work) == 2, timeout=15,
                   message="the running job in the heartbeat")

        def beats(n: int) -> tuple[int, int]:
            """Bytes Redis received over the next n beats, and that many beats' worth."""
            def next_beat(after: bytes) -> bytes | None:
                worker.assert_alive()
                beat = r.hget(identity, "beat")
                return beat if beat != after else None
            last = wait_until(lambda: next_beat(b""), timeout=5)
            start = r.info("stats")["total_net_input_bytes"]
            for _ in range(n):
                last = wait_until(lambda: next_beat(last), timeout=5, message="the next beat")
            return r.info("stats")["total_net_input_bytes"] - start, n

        received, n = beats(4)
        assert received / n < 1.5 * size, f"{received / n / size:.2f} payloads sent per beat"
        # what Sidekiq's readers see is unchanged: the same entry, with an expiry, under both
        (entry,) = r.hvals(workers)
        assert r.hgetall(workers) == r.hgetall(work)
        assert len(json.loads(json.loads(entry)["payload"])["args"][0]) == size
        assert 0 < r.ttl(workers) <= 60 and 0 < r.ttl(work) <= 60
