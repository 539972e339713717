"""Does forkq slow down with a deep queue, big retry/schedule sets, or many jobs run?

    python bench/scaling.py [--deep 1000000] [--sets 100000] [--rss-jobs 100000]

Prints, for `--processes 2 --concurrency 10` and no-op jobs: throughput over 60,000 jobs
with 60,000 waiting, with --deep waiting, and with --sets future entries in each of
`retry` and `schedule`; and a child's RSS after 10% and after all of --rss-jobs jobs.
The window is 60,000 jobs, not 20,000: at 40,000 jobs/s a half-second window measured
the fetchers' wake-up more than the queue, and moved by 30% from run to run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil  # noqa: E402

import forkq  # noqa: E402
from bench import jobs  # noqa: E402
from bench.common import PrivateRedis, start_master, stop_master  # noqa: E402

WINDOW = 60_000


def fill(r, n: int, queue: str = "bench") -> None:
    noop = jobs.noop.options(client=forkq.Client(r.url), queue=queue)
    for start in range(0, n, 100_000):
        noop.enqueue_many([()] * min(100_000, n - start))


def rate_over_window(r, waiting: int, processes: int = 2) -> float:
    """Jobs/s over the first WINDOW jobs taken from a queue `waiting` deep, once every
    child is up: the jobs wait under another name and are renamed into place (O(1)), so
    the window does not start while the second child is still booting."""
    r.client.delete("queue:bench", "queue:staged")
    fill(r, waiting, queue="staged")
    master = start_master(r.url, "--require", "bench/jobs.py", "--queue", "bench", "--processes",
                          str(processes), "--concurrency", "10", "--log-level", "warning")
    try:
        deadline = time.monotonic() + 30
        while r.client.scard("processes") < processes:
            if time.monotonic() > deadline:
                raise SystemExit("workers did not start")
            time.sleep(0.01)
        time.sleep(1.0)  # every fetcher settles into its blocking wait
        t0 = time.monotonic()
        r.client.rename("queue:staged", "queue:bench")
        r.client.lpush("queue:bench", r.client.lindex("queue:bench", 0))  # wakes the blocked fetchers
        target = waiting - WINDOW
        while r.client.llen("queue:bench") > target:
            time.sleep(0.002)
        return WINDOW / (time.monotonic() - t0)
    finally:
        stop_master(master)
        r.client.delete("queue:bench")


def rss_over(r, n: int) -> tuple[float, float]:
    fill(r, n)
    master = start_master(r.url, "--require", "bench/jobs.py", "--queue", "bench", "--processes", "1",
                          "--concurrency", "10", "--log-level", "warning")
    try:
        child = None
        early = None
        while r.client.llen("queue:bench") > 0:
            if child is None and psutil.Process(master.pid).children():
                child = psutil.Process(master.pid).children()[0]
            if early is None and child is not None and r.client.llen("queue:bench") <= n * 0.9:
                early = child.memory_info().rss / 1_048_576
            time.sleep(0.01)
        time.sleep(0.5)
        return early or 0.0, child.memory_info().rss / 1_048_576
    finally:
        stop_master(master)


def measure(deep: int = 1_000_000, sets: int = 100_000, rss_jobs: int = 100_000) -> dict[str, float]:
    """Processing rate with WINDOW, `deep` waiting, and `sets` entries in retry and
    schedule; a child's RSS early and late over `rss_jobs` jobs."""
    out: dict[str, float] = {}
    with PrivateRedis() as r:
        out["base"] = rate_over_window(r, WINDOW)
        out["deep"] = rate_over_window(r, deep)
        future = time.time() + 86_400
        for key in ("retry", "schedule"):
            pipe = r.client.pipeline(transaction=False)
            for i in range(sets):
                pipe.zadd(key, {f'{{"class":"bench.jobs.noop","args":[],"jid":"{i:024x}","queue":"bench"}}': future + i})
            pipe.execute()
        out["sets"] = rate_over_window(r, WINDOW)
        r.client.delete("retry", "schedule")
        out["rss_early_mb"], out["rss_late_mb"] = rss_over(r, rss_jobs)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--deep", type=int, default=1_000_000)
    p.add_argument("--sets", type=int, default=100_000)
    p.add_argument("--rss-jobs", type=int, default=100_000)
    a = p.parse_args()
    f = measure(a.deep, a.sets, a.rss_jobs)
    base = f["base"]
    print(f"{WINDOW:,} waiting:                      {base:8,.0f} jobs/s")
    print(f"{a.deep:,} waiting:                  {f['deep']:8,.0f} jobs/s ({100 * (f['deep'] / base - 1):+.0f}%)")
    print(f"{WINDOW:,} waiting, {a.sets:,} in retry and schedule: {f['sets']:8,.0f} jobs/s "
          f"({100 * (f['sets'] / base - 1):+.0f}%)")
    print(f"child RSS after {a.rss_jobs // 10:,} jobs {f['rss_early_mb']:.1f} MB, "
          f"after {a.rss_jobs:,} jobs {f['rss_late_mb']:.1f} MB")


if __name__ == "__main__":
    main()
