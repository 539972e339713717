"""Copy-on-write check: a child's unique memory (USS) next to the master's RSS.

    python bench/memory.py [--jobs 10000] [--processes 2]

The master imports bench/heavy_app.py (heavy modules, a 300,000-entry table), calls
gc.freeze() and forks. After the children have run the jobs, each child's USS (pages
only it holds) should be a small part of the master's RSS. Prints figures only.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil  # noqa: E402

import forkq  # noqa: E402
from bench.common import PrivateRedis, in_flight, start_master, stop_master  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=10_000)
    p.add_argument("--processes", type=int, default=2)
    a = p.parse_args()
    with PrivateRedis() as r:
        client = forkq.Client(r.url)
        client.push_bulk("bench.heavy_app.touch", [[i] for i in range(a.jobs)], queue="mem")
        master = start_master(r.url, "--require", "bench/heavy_app.py", "--queue", "mem",
                              "--processes", str(a.processes), "--concurrency", "10",
                              "--log-level", "warning")
        try:
            deadline = time.monotonic() + 120
            while r.client.llen("queue:mem") or in_flight(r.client) or r.client.scard("processes") < a.processes:
                if time.monotonic() > deadline:
                    raise SystemExit("jobs did not finish")
                time.sleep(0.1)
            failed = r.client.zcard("retry") + r.client.zcard("dead")
            if failed:
                raise SystemExit(f"{failed} jobs failed; the figures would mean nothing")
            m = psutil.Process(master.pid)
            master_rss = m.memory_info().rss
            print(f"master RSS {master_rss / 1_048_576:.1f} MB (app preloaded, gc.freeze())")
            for child in sorted(m.children(), key=lambda c: c.pid):
                full = child.memory_full_info()
                print(f"child {child.pid}: RSS {full.rss / 1_048_576:.1f} MB, USS {full.uss / 1_048_576:.1f} MB "
                      f"= {100 * full.uss / master_rss:.0f}% of the master's RSS, after {a.jobs:,} jobs shared")
        finally:
            stop_master(master)


if __name__ == "__main__":
    main()
