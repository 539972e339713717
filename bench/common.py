"""Shared by the benchmarks and the demo: a private redis-server and a forkq master to drive."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrivateRedis:
    """A throwaway redis-server on a free loopback port, gone when the block ends."""

    def __enter__(self) -> "PrivateRedis":
        binary = shutil.which("redis-server")
        if binary is None:
            sys.exit("redis-server is not installed (Debian: apt-get install -y redis-server)")
        self.dir = tempfile.mkdtemp(prefix="forkq-bench-")
        self.port = free_port()
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)

    def commands(self) -> int:
        """Commands executed so far, those run inside Lua scripts included."""
        stats = self.client.info("commandstats")
        return sum(v["calls"] for k, v in stats.items() if k not in ("cmdstat_info",))


def start_master(url: str, *args: str, log: Path | None = None) -> subprocess.Popen:
    env = dict(os.environ, FORKQ_REDIS_URL=url, PYTHONPATH=str(ROOT))
    out = open(log, "w") if log else subprocess.DEVNULL
    return subprocess.Popen([sys.executable, "-m", "forkq", "start", *args], env=env,
                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)


def stop_master(proc: subprocess.Popen, timeout: float = 30) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def in_flight(client: redis.Redis) -> int:
    owners = client.hkeys("forkq:owners")
    if not owners:
        return 0
    pipe = client.pipeline(transaction=False)
    for o in owners:
        pipe.hlen(b"forkq:inflight:" + o)
    return sum(pipe.execute())
