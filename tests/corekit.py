"""Support for the core worker tests (test_client, test_retry, test_worker, ...).

    CORE_JOBS            path of tests/apps/core_jobs.py (the worker's --require)
    core_jobs            that module, imported as tests.apps.core_jobs, the name the
                         worker gives it (so job names match on both sides)
    workers              fixture: start(...) real `forkq start --no-fork` subprocesses,
                         each SIGKILLed at teardown if still alive
    UnixSocketRedis      a RedisServer that also listens on a unix socket
    hand_driven(url, queue, identity)  a registered Manager on one queue, not started,
                         whose one processor run_one(manager) drives in the test's thread
    records(r, kind)     what the jobs wrote to core:ran
    wait_records(...)    poll core:ran, failing early (with the log) if a worker died

Import the fixtures into a test module with `from corekit import workers, forkq_client`.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest
import redis

import forkq
import forkq.client
from forkq.manager import Manager
from forkq.queues import QueueOrder
from helpers import ForkqWorker, RedisServer, wait_until

REPO_ROOT = Path(__file__).resolve().parent.parent
CORE_JOBS = REPO_ROOT / "tests" / "apps" / "core_jobs.py"
# The worker runs from the repo root and imports --require tests/apps/core_jobs.py under
# its dotted name, tests.apps.core_jobs; import it under the same name here, so the
# default job names (tests.apps.core_jobs.record, ...) agree on both sides.
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

core_jobs = importlib.import_module("tests.apps.core_jobs")

RAN = core_jobs.RAN
SEEN = core_jobs.SEEN


class UnixSocketRedis(RedisServer):
    """A RedisServer that also listens on a unix socket in its directory."""

    @property
    def socket_path(self):
        return self.dir / "redis.sock"

    @property
    def unix_url(self):
        return f"unix://{self.socket_path}?db=0"

    def _command(self):
        return super()._command() + ["--unixsocket", str(self.socket_path),
                                     "--unixsocketperm", "700"]


class CoreWorker(ForkqWorker):
    """A ForkqWorker that knows its identity once its first heartbeat is in Redis."""

    identity: str | None = None

    def wait_ready(self, client, timeout=15.0):
        marker = f":{self.proc.pid}:".encode()

        def ready():
            self.assert_alive()
            for member in client.smembers("processes"):
                if marker in member:
                    return member.decode()
            return None

        self.identity = wait_until(ready, timeout=timeout, interval=0.02,
                                   message=f"heartbeat of worker pid {self.proc.pid}")
        return self.identity

    def signal(self, signum):
        os.kill(self.proc.pid, signum)

    def wait_exit(self, timeout):
        """Wait for the process to exit; return its code (AssertionError if it does not)."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            if time.monotonic() >= deadline:
                raise AssertionError(f"worker still running after {timeout:g}s:\n{self.log_tail()}")
            time.sleep(0.02)
        return self.proc.returncode

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture
def workers(redis_url, redis_server):
    """start(queues=..., concurrency=..., timeout=..., poll_interval=..., url=..., ready=True).

    Starts a worker on `url` (default: the shared server, already flushed) running
    core_jobs, waits for its heartbeat unless ready=False, and returns the CoreWorker.
    Every worker still alive at teardown is SIGKILLed.
    """
    started: list[CoreWorker] = []
    # Not tmp_path: pytest prunes old basetemp dirs, which races with other pytest runs
    # on the machine; a directory of our own lives exactly as long as the test.
    logs = Path(tempfile.mkdtemp(prefix="forkq-core-"))

    def start(queues=("default",), concurrency=2, timeout=5, poll_interval=None, url=None,
              extra_args=(), ready=True):
        url = url or redis_url
        args = ["--timeout", str(timeout)]
        if poll_interval is not None:
            args += ["--poll-interval", str(poll_interval)]
        worker = CoreWorker(url, CORE_JOBS, queues=list(queues), concurrency=concurrency,
                            extra_args=args + list(extra_args),
                            log_path=logs / f"worker-{len(started)}.log")
        started.append(worker)
        worker.start()
        if ready:
            client = forkq.client.connect(url)
            try:
                worker.wait_ready(client)
            finally:
                client.close()
        return worker

    try:
        yield start
    finally:
        for worker in started:
            worker.kill()
        if os.environ.get("FORKQ_KEEP_LOGS"):
            print(f"worker logs kept in {logs}")
        else:
            shutil.rmtree(logs, ignore_errors=True)


@pytest.fixture
def no_middleware(monkeypatch):
    """Without the server middleware imported modules left registered (core_jobs'
    remember_payload records each payload in the Redis FORKQ_REDIS_URL names): for tests
    that run jobs under forkq.testing with no Redis. Run alone, or first in an xdist
    worker, such a test failed with KeyError: 'FORKQ_REDIS_URL'."""
    from forkq import hooks
    monkeypatch.setattr(hooks, "SERVER_MIDDLEWARE", [])


@pytest.fixture
def forkq_client(redis_url):
    """forkq's default client pointed at the flushed shared server (reset at teardown)."""
    client = forkq.configure(redis_url)
    try:
        yield client
    finally:
        forkq.client._default = None


def records(r, kind=None):
    out = [json.loads(raw) for raw in r.lrange(RAN, 0, -1)]
    return [rec for rec in out if kind is None or rec["job"] == kind]


def seen(r):
    return [json.loads(raw) for raw in r.lrange(SEEN, 0, -1)]


def wait_records(r, count, *workers_, kind=None, timeout=10.0):
    """Poll until core:ran holds `count` records (of `kind`); fail early if a worker exited."""
    def enough():
        for w in workers_:
            w.assert_alive()
        got = records(r, kind)
        return got if len(got) >= count else None

    return wait_until(enough, timeout=timeout, interval=0.02,
                      message=f"{count} record(s) of {kind or 'any kind'} in {RAN}")


def zset(r, key):
    """[(payload dict, score)] of a sorted set, lowest score first."""
    return [(json.loads(m), s) for m, s in r.zrange(key, 0, -1, withscores=True)]


def wait_zset(r, key, count, *workers_, timeout=10.0):
    def enough():
        for w in workers_:
            w.assert_alive()
        got = zset(r, key)
        return got if len(got) >= count else None

    return wait_until(enough, timeout=timeout, interval=0.02, message=f"{count} entries in {key}")


def queued(r, queue="default"):
    """Jobs on queue:NAME, the next to run first."""
    return [json.loads(raw) for raw in reversed(r.lrange(f"queue:{queue}", 0, -1))]


def hand_driven(url: str, queue: str, identity: str) -> Manager:
    """A Manager on `queue` with one processor, registered but not started: run_one()
    drives it by hand. Close it with manager.fetch.close()."""
    manager = Manager(lambda: redis.Redis.from_url(url), identity, QueueOrder([(queue, 0)]),
                      concurrency=1)
    manager.fetch.register()
    return manager


def hand_driven_fixture(queue: str, identity: str):
    """A `worker` fixture for a test module: hand_driven on the shared Redis, flushed
    first (through `r`), closed after the test."""
    @pytest.fixture
    def worker(redis_url, r):
        manager = hand_driven(redis_url, queue, identity)
        yield manager
        manager.fetch.close()
    return worker


def run_one(manager: Manager) -> None:
    """Claim one job and run it as a processor thread does (Processor._serve's body)."""
    (unit,) = manager.fetch.fetch(1)
    (processor,) = manager.processors
    acked = processor.process(unit)
    if acked.__class__ is bool:
        manager.done(unit.token if acked else None)
    else:
        manager.done(unit.token, acked)
