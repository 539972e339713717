"""What Redis operators do to a server under a running forkq: ACL users restricted to the
commands forkq needs (or short of one), the server closing idle connections (`timeout`),
scripts flushed, a long script making Redis answer BUSY.

Each test runs a real `forkq start --processes 2` (or a real Waiters thread) against a
private redis-server, and checks afterwards that every job ran exactly once and nothing
stayed in a private structure.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest

import forkq
from forkq import keys
from forkq.fetch import ReliableFetch, Waiters
from forkq.queues import QueueOrder
from helpers import json_lines, wait_until

REPO = Path(__file__).resolve().parent.parent
APP = REPO / "tests" / "apps" / "chaos_jobs.py"


def _start(url: str, tmp: Path, *args: str) -> subprocess.Popen:
    env = dict(os.environ, FORKQ_REDIS_URL=url, PYTHONPATH=str(REPO))
    return subprocess.Popen(
        [sys.executable, "-m", "forkq", "start", "--require", str(APP), "--queue", "chaos",
         "--processes", "2", "--concurrency", "5", "--heartbeat-interval", "0.5",
         "--log-format", "json", "--pidfile", str(tmp / "pid"), *args],
        env=env, cwd=REPO, stdout=open(tmp / "log", "w"), stderr=subprocess.STDOUT,
        start_new_session=True)


def _stop(master: subprocess.Popen) -> int:
    if master.poll() is None:
        master.send_signal(signal.SIGTERM)
        try:
            return master.wait(40)
        except subprocess.TimeoutExpired:
            os.killpg(master.pid, signal.SIGKILL)
            master.wait()
    return master.returncode


def _runs(r) -> Counter:
    """How many times each chaos job ran to its end."""
    return Counter(int(v) for v in r.hvals("chaos:execs"))


def _private(r) -> list[bytes]:
    return [k for pat in ("forkq:inflight:*", "forkq:landing:*") for k in r.scan_iter(pat)]


def _events(tmp: Path, text: str) -> list[dict]:
    return [e for e in json_lines(tmp / "log") if text in (e.get("event") or "")]


def _acl_user(r, *rules: str) -> None:
    r.acl_setuser("fq", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
                  commands=list(rules))


@pytest.mark.timeout(90)
def test_an_acl_user_without_client_still_runs_every_job_once(own_redis, tmp_path):
    """The blocking waits asked CLIENT ID (to end them early at a stop) before blocking, and
    took the refusal for a failed wait: they never blocked, so a worker that went idle
    never saw another job, with a warning a second per queue."""
    r = own_redis.client()
    _acl_user(r, "+@all", "-client")
    master = _start(f"redis://fq:pw@127.0.0.1:{own_redis.port}/0", tmp_path)
    try:
        wait_until(lambda: r.hlen(keys.OWNERS) == 2, timeout=20, message="children registered")
        # idle: their waits are what must see these jobs arrive
        wait_until(lambda: sum(c.get("cmd") == "blmove" for c in r.client_list()) == 2,
                   timeout=10, message="both children blocking on the empty queue")
        n = 300
        forkq.Client(own_redis.url).push_bulk("chaos.record", [[i, i % 10 == 0] for i in range(n)],
                                              queue="chaos")
        wait_until(lambda: len(_runs(r)) == n, timeout=30, message="every job ran")
        assert _stop(master) == 0
    finally:
        _stop(master)
    assert set(_runs(r).values()) == {1}
    assert _private(r) == [] and r.llen("queue:chaos") == 0 and r.zcard("retry") == 0
    assert len(_events(tmp_path, "CLIENT ID refused")) == 2  # a line per child, not a second
    assert _events(tmp_path, "blocking wait failed") == []


@pytest.mark.timeout(60)
def test_a_stop_ends_a_blocking_wait_whose_connection_the_server_timed_out(own_redis):
    """With the server's `timeout` set, a waiter's connection idle while its worker was busy
    is closed, and redis-py reconnects it silently before the next BLMOVE. The id asked once
    named the closed connection, so CLIENT UNBLOCK at a stop or quiet reached nobody and the
    wait ran on to its block timeout."""
    admin = own_redis.client()
    fetch = ReliableFetch(own_redis.client(), "test:1:000000000000", QueueOrder([("default", 0)]),
                          block_timeout=30.0, direct=False)
    woken = threading.Event()
    waiters = Waiters(fetch, lambda: own_redis.client(socket_timeout=40), woken.set, lambda exc: None)

    def blocked() -> list[int]:
        return [c["id"] for c in admin.client_list() if c.get("cmd") == "blmove"
                and c.get("flags") == "b"]

    try:
        waiters.start()
        waiters.arm()
        (first,) = wait_until(blocked, message="the waiter blocking in BLMOVE")
        forkq.Client(own_redis.url).push_bulk("Any", [[1]])
        assert woken.wait(5)  # it caught the job and disarmed itself, as for a busy worker
        admin.config_set("timeout", 1)
        wait_until(lambda: first not in [c["id"] for c in admin.client_list()], timeout=10,
                   message="the server closing the idle waiter's connection")
        waiters.arm()  # the worker idle again
        (second,) = wait_until(blocked, message="the waiter blocking again")
        assert second != first
        waiters.quiet()
        wait_until(lambda: blocked() == [], timeout=5, message="the blocking wait ended by quiet")
    finally:
        admin.config_set("timeout", 0)
        waiters.stop(2)
        admin.close()
