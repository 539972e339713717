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


def measure(jobs_n: int = 2000, scheduled: int = 200, processes: int = 2,
            gap: float = 0.002) -> dict[str, float]:
    """Enqueue-to-start with idle workers, and how late scheduled jobs start (ms)."""
    with PrivateRedis() as r:
        client = forkq.Client(r.url)
        stamp = jobs.stamp.options(client=client)
        master = start_master(r.url, "--require", "bench/jobs.py", "--queue", "latency",
                              "--processes", str(processes), "--concurrency", "10",
                              "--log-level", "warning", "--poll-interval", "1")
        try:
            deadline = time.monotonic() + 20
            while r.client.scard("processes") < processes:
                if time.monotonic() > deadline:
                    raise SystemExit("workers did not start")
                time.sleep(0.05)
            time.sleep(2.5)  # let every waiter settle into its blocking wait
            for _ in range(jobs_n):
                stamp.enqueue(time.time(), "lat:now")
                time.sleep(gap)
            now = [x * 1000 for x in collect(r.client, "lat:now", jobs_n, 60)]
            base = time.time() + 2.0
            for i in range(scheduled):
                at = base + i * (5.0 / scheduled)
                stamp.enqueue_at(at, at, "lat:sched")
            late = [x * 1000 for x in collect(r.client, "lat:sched", scheduled, 60)]
        finally:
            stop_master(master)
    return {"p50_ms": pct(now, 50), "p99_ms": pct(now, 99), "max_ms": max(now),
            "sched_p50_ms": pct(late, 50), "sched_p99_ms": pct(late, 99), "sched_max_ms": max(late),
            "sched_mean_ms": statistics.mean(late)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=2000)
    p.add_argument("--scheduled", type=int, default=200)
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--gap", type=float, default=0.002, help="seconds between pushes")
    a = p.parse_args()
    f = measure(a.jobs, a.scheduled, a.processes, a.gap)
    print(f"enqueue -> start, idle workers ({a.jobs:,} jobs, --processes {a.processes}): "
          f"p50 {f['p50_ms']:.2f} ms, p99 {f['p99_ms']:.2f} ms, max {f['max_ms']:.2f} ms")
    print(f"scheduled job start after its time ({a.scheduled} jobs over 5 s, --poll-interval 1): "
          f"p50 {f['sched_p50_ms']:.0f} ms, p99 {f['sched_p99_ms']:.0f} ms, max {f['sched_max_ms']:.0f} ms, "
          f"mean {f['sched_mean_ms']:.0f} ms")


if __name__ == "__main__":
    main()
