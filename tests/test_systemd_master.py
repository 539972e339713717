"""The master speaks sd_notify to a real unix datagram socket, as systemd's Type=notify sees it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from helpers import wait_until

REPO = Path(__file__).resolve().parent.parent
APP = REPO / "tests" / "apps" / "supervised_jobs.py"
ENV_APP = REPO / "tests" / "apps" / "env_jobs.py"


def _collect(sock: socket.socket, until, deadline_s: float) -> list[str]:
    """Datagrams until `until(messages)` holds; fails at the deadline."""
    got: list[str] = []
    deadline = time.monotonic() + deadline_s
    while not until(got):
        left = deadline - time.monotonic()
        assert left > 0, f"timed out; got {got}"
        sock.settimeout(left)
        got.append(sock.recv(4096).decode())
    return got


@contextlib.contextmanager
def notified_master(redis_url: str, tmp_path: Path, app: Path, *args: str, watchdog_usec: str,
                    **env: str) -> Iterator[tuple[subprocess.Popen, socket.socket]]:
    """A real master started as systemd would (NOTIFY_SOCKET, WATCHDOG_USEC), and the
    datagram socket it notifies; the master is SIGKILLed at the end if still running."""
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    environ = dict(os.environ, NOTIFY_SOCKET=path, WATCHDOG_USEC=watchdog_usec,
                   FORKQ_REDIS_URL=redis_url, PYTHONPATH=str(REPO), **env)
    master = subprocess.Popen(
        [sys.executable, "-m", "forkq", "start", "--require", str(app),
         "--pidfile", str(tmp_path / "forkq.pid"), *args],
        env=environ, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        yield master, sock
    finally:
        if master.poll() is None:
            os.killpg(master.pid, signal.SIGKILL)
            master.wait()
        sock.close()


@pytest.mark.timeout(60)
def test_master_notifies_ready_status_watchdog_and_stopping(redis_url, tmp_path):
    with notified_master(redis_url, tmp_path, APP, "--processes", "2", "--concurrency", "2",
                         "--log-format", "json", watchdog_usec="1000000") as (master, sock):
        msgs = _collect(sock, lambda m: any(x.startswith("READY=1") for x in m)
                        and sum(x == "WATCHDOG=1" for x in m) >= 3, 30)
        ready = next(x for x in msgs if x.startswith("READY=1"))
        assert "STATUS=" in ready and "2/2 children" in ready, ready
        # with WatchdogSec=1 s the master pings every half period
        master.send_signal(signal.SIGTERM)
        msgs = _collect(sock, lambda m: any("0/2 children" in x for x in m), 30)
        assert any(x.startswith("STOPPING=1") for x in msgs), msgs
        assert master.wait(30) == 0


@pytest.mark.timeout(60)
def test_children_do_not_inherit_notify_socket(redis_url, tmp_path):
    """Only the master may talk to systemd: job code must not see NOTIFY_SOCKET."""
    with notified_master(redis_url, tmp_path, ENV_APP, "--processes", "1", "--concurrency", "1",
                         watchdog_usec="5000000") as (master, sock):
        _collect(sock, lambda m: any(x.startswith("READY=1") for x in m), 30)
        # /proc/PID/environ is overwritten by the process title, so ask a job what it sees
        import forkq
        forkq.Client(redis_url).push("env.report", ["seen"])
        r = redis.Redis.from_url(redis_url)
        raw = wait_until(lambda: r.lpop("seen"), timeout=20, message="the job did not run")
        seen = json.loads(raw)
        assert seen == {"NOTIFY_SOCKET": None, "WATCHDOG_USEC": None, "FORKQ_INDEX": "0"}, seen
        master.send_signal(signal.SIGTERM)
        master.wait(30)


@pytest.mark.timeout(60)
def test_the_watchdog_keeps_pinging_once_a_slot_recovers_from_a_failed_start(redis_url, tmp_path):
    """One failed start per slot, then healthy children: systemd must go on hearing
    WATCHDOG=1, or it kills a service that has recovered."""
    with notified_master(redis_url, tmp_path, REPO / "tests" / "apps" / "flaky_on_fork.py",
                         "--processes", "2", "--concurrency", "1", watchdog_usec="1000000",
                         FLAKY_DIR=str(tmp_path)) as (master, sock):
        msgs = _collect(sock, lambda m: any(x.startswith("READY=1") for x in m), 30)
        assert (tmp_path / "slot0").exists() and (tmp_path / "slot1").exists()
        after = _collect(sock, lambda m: sum(x == "WATCHDOG=1" for x in m) >= 3, 10)
        assert sum(x == "WATCHDOG=1" for x in after) >= 3, msgs + after
