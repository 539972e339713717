"""Enqueue-to-start latency with idle workers, and how close scheduled jobs start to their time.

    python bench/latency.py [--jobs 2000] [--scheduled 200] [--processes 2]

Idle workers block in Redis (BLMOVE), so a pushed job should start within a round trip or
two. Jobs are pushed one at a time with a pause between them, so the workers are idle
each time. Prints percentiles; asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import forkq  # noqa: E402
from bench import jobs  # noqa: E402
from bench.common import PrivateRedis, start_master, stop_master  # noqa: E402


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def collect(r, key: str, n: int, timeout: float) -> list[float]:
    deadline = time.monotonic() + timeout
    while r.llen(key) < n:
        if time.monotonic() > deadline:
            raise SystemExit(f"only {r.llen(key)} of {n} jobs started")
        time.sleep(0.05)
    return [float(x) for x in r.lrange(key, 0, -1)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=2000)
    p.add_argument("--scheduled", type=int, default=200)
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--gap", type=float, default=0.002, help="seconds between pushes")
    a = p.parse_args()
    with PrivateRedis() as r:
        client = forkq.Client(r.url)
        stamp = jobs.stamp.options(client=client)
        master = start_master(r.url, "--require", "bench/jobs.py", "--queue", "latency",
                              "--processes", str(a.processes), "--concurrency", "10",
                              "--log-level", "warning", "--poll-interval", "1")
        try:
            deadline = time.monotonic() + 20
            while r.client.scard("processes") < a.processes:
                if time.monotonic() > deadline:
                    raise SystemExit("workers did not start")
                time.sleep(0.05)
            time.sleep(2.5)  # let every waiter settle into its blocking wait
            for _ in range(a.jobs):
                stamp.enqueue(time.time(), "lat:now")
                time.sleep(a.gap)
            now = [x * 1000 for x in collect(r.client, "lat:now", a.jobs, 60)]
            print(f"enqueue -> start, idle workers ({a.jobs:,} jobs, --processes {a.processes}): "
                  f"p50 {pct(now, 50):.2f} ms, p99 {pct(now, 99):.2f} ms, max {max(now):.2f} ms")
            base = time.time() + 2.0
            for i in range(a.scheduled):
                at = base + i * (5.0 / a.scheduled)
                stamp.enqueue_at(at, at, "lat:sched")
            late = [x * 1000 for x in collect(r.client, "lat:sched", a.scheduled, 60)]
            print(f"scheduled job start after its time ({a.scheduled} jobs over 5 s, --poll-interval 1): "
                  f"p50 {pct(late, 50):.0f} ms, p99 {pct(late, 99):.0f} ms, max {max(late):.0f} ms, "
                  f"mean {statistics.mean(late):.0f} ms")
        finally:
            stop_master(master)


if __name__ == "__main__":
    main()
