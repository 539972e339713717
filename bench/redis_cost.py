"""What one claim costs Redis, counted in instructions: a figure the host's noise cannot move.

    python bench/redis_cost.py [--claims 1000]

Runs a private redis-server under valgrind's callgrind and makes claims of 10 no-op jobs
through forkq's own fetch (each claim carrying the acks of the one before, as in a busy
child). Two runs differ only in the number of claims, so start-up, loading the queue and
shutting down cancel out: their difference over the extra claims is Redis's user-space
instructions per claim. Kernel time (the socket round trip) is not counted. Timed figures
on this shared 2-core VM move by a third between runs; this one repeats to the
instruction, so it shows what a change to the claim script saves Redis.

Needs valgrind (Debian: apt-get install -y valgrind); without it the figure is skipped.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis  # noqa: E402

import forkq  # noqa: E402
from bench import jobs  # noqa: E402
from bench.common import free_port  # noqa: E402
from forkq.fetch import ReliableFetch  # noqa: E402
from forkq.queues import QueueOrder  # noqa: E402

BATCH = 10


def _instructions(claims: int, jobs_n: int) -> int:
    """Instructions redis-server ran in all, start to shutdown, making `claims` claims."""
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="forkq-callgrind-")
    out = os.path.join(workdir, "callgrind.out")
    proc = subprocess.Popen(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", shutil.which("redis-server"),
         "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", workdir],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port)
        deadline = time.monotonic() + 60
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise SystemExit("redis-server under valgrind did not start")
                time.sleep(0.1)
        url = f"redis://127.0.0.1:{port}/0"
        jobs.noop.options(client=forkq.Client(url), queue="bench").enqueue_many([()] * jobs_n)
        fetch = ReliableFetch(client, "bench:1:000000000000", QueueOrder([("bench", 0)]))
        fetch.register()
        for _ in range(claims):
            units = fetch.fetch(BATCH)
            if len(units) != BATCH:
                raise SystemExit(f"a claim got {len(units)} jobs, not {BATCH}")
            for unit in units:
                fetch.ack(unit.token)
        fetch.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    try:
        text = Path(out).read_text()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return int(re.search(r"^(?:totals|summary): (\d+)", text, re.M).group(1))


def measure(claims: int = 1000) -> dict[str, float] | None:
    """Redis's instructions per claim of 10 jobs (None without valgrind)."""
    if shutil.which("valgrind") is None:
        return None
    jobs_n = (claims + claims // 5 + 1) * BATCH  # the same queue for both runs
    small = _instructions(claims // 5, jobs_n)
    large = _instructions(claims + claims // 5, jobs_n)
    per_claim = (large - small) / claims
    return {"per_claim": per_claim, "per_job": per_claim / BATCH}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--claims", type=int, default=1000)
    a = p.parse_args()
    f = measure(a.claims)
    if f is None:
        print("valgrind is not installed: no instruction count")
        return
    print(f"Redis, user space: {f['per_claim']:,.0f} instructions per claim of {BATCH} jobs "
          f"({f['per_job']:,.0f} per job)")


if __name__ == "__main__":
    main()
