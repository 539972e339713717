"""Log lines: JSON with pid, and inside a job the jid, class and queue, even for app code."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import forkq
from helpers import forkq_command, free_port, json_lines, stop_gracefully, wait_until

REPO = Path(__file__).resolve().parent.parent
APP = REPO / "tests" / "apps" / "logging_jobs.py"


def _start(url: str, log: Path, *extra: str, constants: dict[str, float] | None = None) -> subprocess.Popen:
    env = dict(os.environ, FORKQ_REDIS_URL=url, PYTHONPATH=str(REPO))
    return subprocess.Popen(forkq_command("start", "--require", str(APP), "--log-format", "json", *extra,
                                          constants=constants),
                            env=env, cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _first(log: Path, event: str) -> dict | None:
    return next((x for x in json_lines(log) if x.get("event") == event), None)


@pytest.mark.timeout(60)
def test_app_log_lines_inside_a_job_carry_jid_class_queue_pid_and_slot(redis_url, tmp_path):
    log = tmp_path / "forkq.log"
    proc = _start(redis_url, log, "--processes", "1", "--concurrency", "2",
                  "--pidfile", str(tmp_path / "pid"))
    try:
        jid = forkq.Client(redis_url).push("logging.chatty", [7])
        line = wait_until(lambda: _first(log, "inside the job"), timeout=20,
                          message="the job's own log line never appeared")
        assert line["jid"] == jid and line["class"] == "logging.chatty" and line["queue"] == "default"
        assert line["x"] == 7 and line["slot"] == 0 and isinstance(line["pid"], int)
        done = wait_until(lambda: _first(log, "done"), timeout=10)
        assert done["jid"] == jid and "elapsed_ms" in done
        # a failure's message is logged cut as it is stored, not as a 5 MB line
        loud = forkq.Client(redis_url).push("logging.loud_failure", [5_000_000])
        fail = wait_until(lambda: _first(log, "fail"), timeout=10)
        assert fail["jid"] == loud and fail["error"] == "ValueError: " + "x" * 10_000
        # a line logged after the job (the next heartbeat or stop) carries no job fields
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        after = [x for x in json_lines(log) if x.get("event") in ("worker stopped", "master stopped")]
        assert after and all("jid" not in x for x in after)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.timeout(60)
def test_stdlib_logging_in_a_job_becomes_forkq_lines_with_the_job_fields(redis_url, tmp_path):
    """An app that does not set up logging: a job's logging.info() went nowhere and its
    logging.exception() reached stderr as bare text, with no time, pid or jid."""
    log = tmp_path / "forkq.log"
    proc = _start(redis_url, log, "--processes", "1", "--pidfile", str(tmp_path / "pid"))
    try:
        jid = forkq.Client(redis_url).push("logging.stdlib", [3])
        info = wait_until(lambda: _first(log, "stdlib info in the job x=3"), timeout=20,
                          message="the job's stdlib info line")
        error = wait_until(lambda: _first(log, "stdlib error in the job"), timeout=10)
        assert stop_gracefully(proc) == 0
    finally:
        stop_gracefully(proc)
    for line in (info, error):
        assert (line["jid"], line["class"], line["queue"]) == (jid, "logging.stdlib", "default")
        assert line["logger"] == "app.stdlib" and line["slot"] == 0
    assert (info["level"], error["level"]) == ("info", "error")
    assert "KeyError: 3" in error["exception"]


@pytest.mark.timeout(60)
def test_context_an_app_binds_with_structlog_contextvars_reaches_its_job_lines(redis_url, tmp_path):
    """A server middleware binding a tenant with structlog.contextvars: forkq's chain did
    not merge them, so the job's own lines lacked the field."""
    log = tmp_path / "forkq.log"
    env = dict(os.environ, FORKQ_REDIS_URL=redis_url, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "forkq", "start", "--processes", "1",
                             "--require", str(REPO / "tests" / "apps" / "context_jobs.py"),
                             "--log-format", "json", "--pidfile", str(tmp_path / "pid")],
                            env=env, cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        forkq.Client(redis_url).push_bulk("context.report", [[1], [2]])
        wait_until(lambda: len([x for x in json_lines(log) if x.get("event") == "done"]) == 2,
                   timeout=20, message="both jobs done")
        assert stop_gracefully(proc) == 0
    finally:
        stop_gracefully(proc)
    lines = json_lines(log)
    made = sorted((x["tenant"], x["rows"]) for x in lines if x.get("event") == "report made")
    assert made == [("t1", 1), ("t2", 2)]
    assert sorted(x["tenant"] for x in lines if x.get("event") == "stdlib report made") == ["t1", "t2"]
    # bound for the job's run only: the lines after it carry no tenant
    assert all("tenant" not in x for x in lines if x.get("event") in ("worker stopped", "master stopped"))


@pytest.mark.timeout(60)
def test_context_a_job_binds_does_not_reach_the_next_jobs_lines(redis_url, tmp_path):
    """bind_contextvars without the context manager left the value bound on the processor
    thread, and the next job it ran logged it as its own."""
    log = tmp_path / "forkq.log"
    env = dict(os.environ, FORKQ_REDIS_URL=redis_url, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "forkq", "start", "--no-fork", "--concurrency", "1",
                             "--require", str(REPO / "tests" / "apps" / "context_jobs.py"),
                             "--log-format", "json"],
                            env=env, cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        client = forkq.Client(redis_url)
        client.push("context.binds", [7])
        wait_until(lambda: _first(log, "bound leftover"), timeout=20, message="the first job's line")
        client.push("context.plain", [8])
        plain = wait_until(lambda: _first(log, "plain job line"), timeout=20, message="the second job's line")
        assert stop_gracefully(proc) == 0
    finally:
        stop_gracefully(proc)
    assert _first(log, "bound leftover")["leftover"] == 7
    assert "leftover" not in plain


@pytest.mark.timeout(60)
def test_an_app_with_its_own_logging_keeps_it_and_can_add_the_job_fields(redis_url, tmp_path):
    log = tmp_path / "forkq.log"
    env = dict(os.environ, FORKQ_REDIS_URL=redis_url, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "forkq", "start", "--no-fork", "--require",
                             str(REPO / "tests" / "apps" / "own_logging_jobs.py"), "--log-format", "json"],
                            env=env, cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        jid = forkq.Client(redis_url).push("ownlog.hello", [5])
        wait_until(lambda: "plain 5" in log.read_text(), timeout=20, message="the app's own line")
        assert stop_gracefully(proc) == 0
    finally:
        stop_gracefully(proc)
    text = log.read_text()
    assert f"APP {jid} ownlog.hello mine hello 5\n" in text  # its extra= is kept
    assert f"APP {jid} ownlog.hello default plain 5\n" in text
    # not written twice: forkq left the app's root handler alone
    assert not any("plain 5" in (x.get("event") or "") for x in json_lines(log))


@pytest.mark.timeout(60)
def test_logging_an_app_sets_up_in_an_on_fork_hook_takes_over(redis_url, tmp_path):
    """forkq's stdlib handler sat on the root logger, so an app's logging.basicConfig()
    after the import (in an on_fork hook, or in a job) did nothing: no log file."""
    log, app_log = tmp_path / "forkq.log", tmp_path / "app.log"
    env = dict(os.environ, FORKQ_REDIS_URL=redis_url, PYTHONPATH=str(REPO), APP_LOG_FILE=str(app_log))
    proc = subprocess.Popen([sys.executable, "-m", "forkq", "start", "--processes", "1", "--require",
                             str(REPO / "tests" / "apps" / "fork_logging_jobs.py"), "--log-format", "json",
                             "--pidfile", str(tmp_path / "pid")],
                            env=env, cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        jid = forkq.Client(redis_url).push("forklog.hello", [5])
        wait_until(lambda: any(x.get("event") == "done" and x.get("jid") == jid for x in json_lines(log)),
                   timeout=20, message="the job done")
        assert stop_gracefully(proc) == 0
    finally:
        stop_gracefully(proc)
    assert app_log.exists() and "APP slot=0 app hello 5\n" in app_log.read_text()
    assert not any((x.get("event") or "").startswith("hello") for x in json_lines(log))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", [["--no-fork"], ["--processes", "1"]])
def test_stop_works_while_redis_is_unreachable(mode, tmp_path):
    """A worker booted against a Redis that is not there still obeys TERM and exits 0."""
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens here
    log = tmp_path / "forkq.log"
    # the stop waits out STOP_PATIENCE_S (4 s) in the child, then again in the master's
    # final requeue: a shorter one shows the same, in a third of the time
    patience = 1.5
    proc = _start(url, log, *mode, "--pidfile", str(tmp_path / "pid"),
                  constants={"STOP_PATIENCE_S": patience})
    try:
        # the fetcher's line: by then the worker (and in a child, its master) acts on signals
        wait_until(lambda: any("fetching paused" in x.get("event", "") for x in json_lines(log)), timeout=20,
                   message="no line saying fetching is paused")
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(45) == 0
        took = time.monotonic() - started
        # the stop-time writes share one wait for Redis (STOP_PATIENCE_S), then the master
        # tries its requeue for as long again; each write used to wait on its own (18 s)
        assert took < 3.5 * patience, f"the stop took {took:.1f}s"
        assert not any("Redis is back" in x.get("event", "") for x in json_lines(log))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.timeout(10)
def test_json_lines_carry_level_time_process_job_and_exception():
    import io
    from forkq import logs
    out = io.StringIO()
    out.isatty = lambda: False
    try:
        logs.configure("info", "json", slot=2, stream=out)
        log = logs.get("forkq.test")
        logs.set_job("abc", "Mailer", "mail")
        log.info("done", elapsed_ms=1.5)
        logs.clear_job()
        try:
            raise KeyError("gone")
        except KeyError:
            log.exception("failed", odd={1: object()})
        log.warn("careful")
        log.debug("not shown")
        done, failed, warned = [json.loads(line) for line in out.getvalue().splitlines()]
    finally:
        logs.configure("info", "json")
    assert done["event"] == "done" and done["level"] == "info" and done["elapsed_ms"] == 1.5
    assert (done["jid"], done["class"], done["queue"], done["slot"]) == ("abc", "Mailer", "mail", 2)
    assert done["pid"] == os.getpid() and done["timestamp"].endswith("Z")
    assert failed["level"] == "error" and "KeyError: 'gone'" in failed["exception"]
    assert "jid" not in failed and failed["odd"]["1"].startswith("<object")
    assert warned["level"] == "warning"


@pytest.mark.timeout(10)
def test_buffered_lines_are_batched_flushed_soon_and_warnings_at_once():
    import io
    from forkq import logs

    class Counting(io.StringIO):
        writes = 0

        def write(self, text):
            Counting.writes += 1
            return super().write(text)

        def isatty(self):
            return False

    out = Counting()
    early = logs.get("forkq.early")
    early.info("before")  # cached by structlog now, as a master's logger is before fork
    try:
        logs.configure("info", "json", stream=out, buffered=True)
        for i in range(100):
            early.info("line", i=i)
        assert Counting.writes <= 1  # at most one batch so far, not a write per line
        wait_until(lambda: out.getvalue().count("\n") == 100, timeout=2,
                   message="the flusher wrote the buffered lines")
        assert Counting.writes <= 2
        early.info("queued")
        early.warning("urgent")
        events = [json.loads(x)["event"] for x in out.getvalue().splitlines()]
        assert events[-2:] == ["queued", "urgent"]  # a warning goes out at once, in order
    finally:
        logs.configure("info", "json")
