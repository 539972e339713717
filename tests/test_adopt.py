"""An application adopting forkq: its own logging set-up, hooks and middleware, the way a
team moving from Celery or RQ writes them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import forkq
from helpers import json_lines, stop_gracefully, wait_until

REPO = Path(__file__).resolve().parent.parent
APPS = REPO / "tests" / "apps"


def _start(url: str, app: Path, out: Path | int, err: Path, *extra: str) -> subprocess.Popen:
    """`forkq start` with JSON lines to `out` (a file, or subprocess.PIPE)."""
    env = dict(os.environ, FORKQ_REDIS_URL=url, PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-m", "forkq", "start", "--require", str(app),
                             "--log-format", "json", *extra],
                            env=env, cwd=REPO, stdout=open(out, "w") if isinstance(out, Path) else out,
                            stderr=open(err, "w"), start_new_session=True)


def _event(path: Path, event: str) -> dict | None:
    return next((x for x in json_lines(path) if x.get("event") == event), None)


@pytest.mark.timeout(60)
def test_an_app_that_configures_structlog_at_import_keeps_forkqs_lines_in_the_master(
        redis_url, tmp_path):
    # The master imports the app after setting up its logs, and each child sets them up
    # again after the fork: the app's structlog.configure used to win in the master only,
    # whose lines then went to the app's stream, without pid, whatever --log-format said.
    out, err = tmp_path / "out.log", tmp_path / "err.log"
    proc = _start(redis_url, APPS / "adopt_jobs.py", out, err, "--processes", "1",
                  "--pidfile", str(tmp_path / "pid"))
    try:
        jid = forkq.Client(redis_url).push("adopt.chatty", [7])
        line = wait_until(lambda: _event(out, "structlog inside the job"), timeout=20,
                          message="the job's structlog line in forkq's output")
        assert line["jid"] == jid and line["class"] == "adopt.chatty" and line["slot"] == 0
        # the app's stdlib logging still goes where the app sent it
        wait_until(lambda: "APP app stdlib inside the job 7" in err.read_text(), timeout=10)
        assert stop_gracefully(proc, 30) == 0
        for event in ("master started", "child started", "master stopped"):
            master = _event(out, event)
            assert master is not None, f"{event!r} not in forkq's output: {err.read_text()[-2000:]}"
            assert master["pid"] == proc.pid and master["level"] == "info" and "timestamp" in master
        assert all(x.get("event") != "master started" for x in json_lines(err))
    finally:
        stop_gracefully(proc, 30)


@pytest.mark.timeout(60)
def test_a_retry_due_at_once_runs_at_once_not_at_the_next_scheduled_poll(redis_url, r, tmp_path):
    # retry_in returning 0 puts the job in the retry set due now, and the README says it
    # retries at once; the poller slept on for its own interval (on average --poll-interval
    # times the live processes, here 30 s) before it looked at the retry set again.
    out, err = tmp_path / "out.log", tmp_path / "err.log"
    proc = _start(redis_url, APPS / "adopt_jobs.py", out, err, "--no-fork", "--poll-interval", "30")
    try:
        wait_until(lambda: _event(out, "worker started"), timeout=20, message="the worker's start")
        forkq.Client(redis_url).push("adopt.flaky", ["runs", 2], retry=5)
        runs = wait_until(lambda: len(r.lrange("runs", 0, -1)) == 3 and r.lrange("runs", 0, -1),
                          timeout=20, message="three runs of the job")
        started = [float(x) for x in runs]
        assert started[2] - started[0] < 5, started
        assert stop_gracefully(proc, 30) == 0
    finally:
        stop_gracefully(proc, 30)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", [["--processes", "1"], ["--no-fork"]])
def test_jobs_keep_running_when_stdout_can_no_longer_be_written(mode, redis_url, r, tmp_path):
    # A log reader that went away (forkq start | tee, a shipper that died) or a full disk:
    # forkq's next log line raised in whichever thread wrote it. A processor thread died
    # with it (a job's `fail` line is written at once), the worker went on heartbeating
    # with no thread left to run jobs, and the master died at its next line.
    err = tmp_path / "err.log"
    proc = _start(redis_url, APPS / "adopt_jobs.py", subprocess.PIPE, err,
                  "--concurrency", "2", "--pidfile", str(tmp_path / "pid"), *mode)
    try:
        while b"worker started" not in proc.stdout.readline():
            assert proc.poll() is None, err.read_text()
        proc.stdout.close()  # every write to stdout fails from now on (EPIPE)
        client = forkq.Client(redis_url)
        client.push_bulk("adopt.fail", [["a"], ["b"], ["c"]], retry=False)
        client.push_bulk("adopt.record", [["ran", str(i)] for i in range(300)], retry=0)
        wait_until(lambda: r.llen("ran") == 300, timeout=20,
                   message=f"all 300 jobs to run; stderr: {err.read_text()[-2000:]}")
        assert stop_gracefully(proc, 30) == 0, err.read_text()[-3000:]
        assert "Traceback" not in err.read_text()
        assert not r.keys("forkq:inflight:*")
    finally:
        stop_gracefully(proc, 30)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("kind", ["async generator", "generator"])
def test_a_function_whose_call_does_not_run_its_body_is_refused_as_a_job(kind):
    # A worker calls the job's function in a thread (an async def's coroutine it runs on
    # its event loop): a generator's call runs none of its body, and the job was logged
    # done and acknowledged without its body ever running.
    async def async_generator(x: int):
        yield x

    def generator(x: int):
        yield x

    fn = {"async generator": async_generator, "generator": generator}[kind]
    name = f"adopt.refused.{kind.replace(' ', '_')}"
    with pytest.raises(TypeError, match=f"@forkq.job {name}: an? {kind.split()[0]}"):
        forkq.job(name=name)(fn)
    with pytest.raises(TypeError, match="cannot be a job"):
        forkq.job(fn)
    assert name not in forkq.jobs.REGISTRY


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", [["--processes", "1"], ["--no-fork"]])
def test_forkq_starts_and_works_with_stdout_closed(mode, redis_url, r, tmp_path):
    # `forkq start >&-`, or a wrapper that closed its descriptors: Python left sys.stdout
    # None, and log set-up ended start with a traceback (AttributeError: isatty)
    err = tmp_path / "err.log"
    env = dict(os.environ, FORKQ_REDIS_URL=redis_url, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "forkq", "start", "--require",
                             str(APPS / "adopt_jobs.py"), "--concurrency", "2",
                             "--pidfile", str(tmp_path / "pid"), *mode],
                            env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(err, "w"),
                            preexec_fn=lambda: os.close(1), start_new_session=True)
    try:
        forkq.Client(redis_url).push_bulk("adopt.record", [["ran", str(i)] for i in range(50)])
        wait_until(lambda: proc.poll() is None and r.llen("ran") == 50, timeout=20,
                   message=f"the 50 jobs to run; stderr: {err.read_text()[-2000:]}")
        # the descriptor holds /dev/null, not whatever forkq opened next (a Redis socket)
        assert os.readlink(f"/proc/{proc.pid}/fd/1") == os.devnull
        assert stop_gracefully(proc, 30) == 0, err.read_text()[-3000:]
        assert "Traceback" not in err.read_text()
    finally:
        stop_gracefully(proc, 30)
