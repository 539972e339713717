"""Does forkq slow down with a deep queue, big retry/schedule sets, or many jobs run?

    python bench/scaling.py [--deep 1000000] [--sets 100000] [--rss-jobs 100000] [--rounds 5]

Prints, for `--processes 2 --concurrency 10` and no-op jobs: throughput over 60,000 jobs
with 60,000 waiting, with --deep waiting, and with --sets future entries in each of
`retry` and `schedule`; and a child's RSS after 10% and after all of --rss-jobs jobs.
The window is 60,000 jobs, not 20,000: at 40,000 jobs/s a half-second window measured
the fetchers' wake-up more than the queue, and moved by 30% from run to run.

The three settings run in rounds, back to back, and each comparison is the median of the
rounds' own ratios: run one after the other, once each, a slow spell of this shared host
landing on one of them moved the comparison by up to 40%.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil  # noqa: E402

import forkq  # noqa: E402
from bench import jobs  # noqa: E402
from bench.common import PrivateRedis, start_master, stop_master  # noqa: E402

WINDOW = 60_000
# where each setting's jobs and sets wait between its windows: RENAME swaps them in and
# out in O(1), so a million jobs are enqueued once, not once per round
STAGED = {"base": "queue:staged-base", "deep": "queue:staged-deep", "sets": "queue:staged-base"}
SETS = ("retry", "schedule")


def fill(r, n: int, queue: str = "bench") -> None:
    noop = jobs.noop.options(client=forkq.Client(r.url), queue=queue)
    for start in range(0, n, 100_000):
        noop.enqueue_many([()] * min(100_000, n - start))


def top_up(r, key: str, n: int) -> None:
    """Refill the staged list `key` ("queue:NAME") to `n` jobs."""
    missing = n - r.client.llen(key)
    if missing > 0:
        fill(r, missing, queue=key.removeprefix("queue:"))


def rate_over_window(r, staged: str, processes: int = 2) -> float:
    """Jobs/s over the first WINDOW jobs taken from the jobs waiting in `staged`, once
    every child is up: they are renamed into place (O(1)), so the window does not start
    while the second child is still booting. What is left goes back to `staged`."""
    waiting = r.client.llen(staged)
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
        r.client.rename(staged, "queue:bench")
        r.client.lpush("queue:bench", r.client.lindex("queue:bench", 0))  # wakes the blocked fetchers
        target = waiting - WINDOW
        while r.client.llen("queue:bench") > target:
            time.sleep(0.002)
        return WINDOW / (time.monotonic() - t0)
    finally:
        stop_master(master)
        if r.client.exists("queue:bench"):
            r.client.rename("queue:bench", staged)


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


def measure(deep: int = 1_000_000, sets: int = 100_000, rss_jobs: int = 100_000,
            rounds: int = 5) -> dict[str, Any]:
    """Processing rate with WINDOW, `deep` waiting, and `sets` entries in retry and
    schedule, in `rounds` rounds; a child's RSS early and late over `rss_jobs` jobs."""
    out: dict[str, Any] = {}
    with PrivateRedis() as r:
        future = time.time() + 86_400
        for key in SETS:
            pipe = r.client.pipeline(transaction=False)
            for i in range(sets):
                pipe.zadd(f"staged-{key}", {f'{{"class":"bench.jobs.noop","args":[],"jid":"{i:024x}","queue":"bench"}}': future + i})
            pipe.execute()
        size = {"base": WINDOW, "deep": deep, "sets": WINDOW}
        rates: dict[str, list[float]] = {name: [] for name in size}
        for i in range(rounds):
            # a different setting goes first each round: a drift across a round does not
            # always favour the same one
            order = list(size)[i % 3:] + list(size)[:i % 3]
            for name in order:
                top_up(r, STAGED[name], size[name])
                if name == "sets":
                    for key in SETS:
                        r.client.rename(f"staged-{key}", key)
                try:
                    rates[name].append(rate_over_window(r, STAGED[name]))
                finally:
                    if name == "sets":
                        for key in SETS:
                            r.client.rename(key, f"staged-{key}")
        for name in ("deep", "sets"):
            out[f"{name}_ratios"] = [x / b for x, b in zip(rates[name], rates["base"])]
            out[f"{name}_change"] = statistics.median(out[f"{name}_ratios"]) - 1
        out["base"] = statistics.median(rates["base"])
        r.client.delete(*STAGED.values(), *(f"staged-{key}" for key in SETS))
        out["rss_early_mb"], out["rss_late_mb"] = rss_over(r, rss_jobs)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--deep", type=int, default=1_000_000)
    p.add_argument("--sets", type=int, default=100_000)
    p.add_argument("--rss-jobs", type=int, default=100_000)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    f = measure(a.deep, a.sets, a.rss_jobs, a.rounds)
    print(f"{WINDOW:,} waiting:                      {f['base']:8,.0f} jobs/s (median of {a.rounds})")
    for name, what in (("deep", f"{a.deep:,} waiting"),
                       ("sets", f"{WINDOW:,} waiting, {a.sets:,} in retry and schedule")):
        print(f"{what}: {100 * f[name + '_change']:+.0f}% (rounds: "
              f"{', '.join(f'{100 * (x - 1):+.0f}%' for x in f[name + '_ratios'])})")
    print(f"child RSS after {a.rss_jobs // 10:,} jobs {f['rss_early_mb']:.1f} MB, "
          f"after {a.rss_jobs:,} jobs {f['rss_late_mb']:.1f} MB")


if __name__ == "__main__":
    main()
