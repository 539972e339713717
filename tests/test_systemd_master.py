"""The master speaks sd_notify to a real unix datagram socket, as systemd's Type=notify sees it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
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


@pytest.mark.timeout(60)
def test_master_notifies_ready_status_watchdog_and_stopping(redis_url, tmp_path):
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    env = dict(os.environ, NOTIFY_SOCKET=path, WATCHDOG_USEC="1000000", FORKQ_REDIS_URL=redis_url,
               PYTHONPATH=str(REPO))
    master = subprocess.Popen(
        [sys.executable, "-m", "forkq", "start", "--processes", "2", "--concurrency", "2",
         "--require", str(APP), "--pidfile", str(tmp_path / "forkq.pid"), "--log-format", "json"],
        env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        msgs = _collect(sock, lambda m: any(x.startswith("READY=1") for x in m)
                        and sum(x == "WATCHDOG=1" for x in m) >= 3, 30)
        ready = next(x for x in msgs if x.startswith("READY=1"))
        assert "STATUS=" in ready and "2/2 children" in ready, ready
        # with WatchdogSec=1 s the master pings every half period
        master.send_signal(signal.SIGTERM)
        msgs = _collect(sock, lambda m: any("0/2 children" in x for x in m), 30)
        assert any(x.startswith("STOPPING=1") for x in msgs), msgs
        assert master.wait(30) == 0
    finally:
        if master.poll() is None:
            os.killpg(master.pid, signal.SIGKILL)
            master.wait()
        sock.close()


@pytest.mark.timeout(60)
def test_children_do_not_inherit_notify_socket(redis_url, tmp_path):
    """Only the master may talk to systemd: job code must not see NOTIFY_SOCKET."""
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    env = dict(os.environ, NOTIFY_SOCKET=path, WATCHDOG_USEC="5000000", FORKQ_REDIS_URL=redis_url,
               PYTHONPATH=str(REPO))
    master = subprocess.Popen(
        [sys.executable, "-m", "forkq", "start", "--processes", "1", "--concurrency", "1",
         "--require", str(ENV_APP), "--pidfile", str(tmp_path / "forkq.pid")],
        env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _collect(sock, lambda m: any(x.startswith("READY=1") for x in m), 30)
        # /proc/PID/environ is overwritten by the process title, so ask a job what it sees
        import forkq
        forkq.Client(redis_url).push("env.report", ["seen"])
        r = redis.Redis.from_url(redis_url)
        raw = wait_until(lambda: r.lpop("seen"), timeout=20, message="the job did not run")
        seen = json.loads(raw)
        assert seen == {"NOTIFY_SOCKET": None, "WATCHDOG_USEC": None, "FORKQ_INDEX": "0"}, seen
    finally:
        master.send_signal(signal.SIGTERM)
        try:
            master.wait(30)
        finally:
            if master.poll() is None:
                os.killpg(master.pid, signal.SIGKILL)
        sock.close()


@pytest.mark.timeout(60)
def test_the_watchdog_keeps_pinging_once_a_slot_recovers_from_a_failed_start(redis_url, tmp_path):
    """One failed start per slot, then healthy children: systemd must go on hearing
    WATCHDOG=1, or it kills a service that has recovered."""
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    env = dict(os.environ, NOTIFY_SOCKET=path, WATCHDOG_USEC="1000000", FORKQ_REDIS_URL=redis_url,
               PYTHONPATH=str(REPO), FLAKY_DIR=str(tmp_path))
    master = subprocess.Popen(
        [sys.executable, "-m", "forkq", "start", "--processes", "2", "--concurrency", "1",
         "--require", str(REPO / "tests" / "apps" / "flaky_on_fork.py"),
         "--pidfile", str(tmp_path / "forkq.pid")],
        env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        msgs = _collect(sock, lambda m: any(x.startswith("READY=1") for x in m), 30)
        assert (tmp_path / "slot0").exists() and (tmp_path / "slot1").exists()
        after = _collect(sock, lambda m: sum(x == "WATCHDOG=1" for x in m) >= 3, 10)
        assert sum(x == "WATCHDOG=1" for x in after) >= 3, msgs + after
    finally:
        if master.poll() is None:
            os.killpg(master.pid, signal.SIGKILL)
            master.wait()
        sock.close()
