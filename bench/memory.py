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
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil  # noqa: E402

import forkq  # noqa: E402
from bench.common import PrivateRedis, in_flight, start_master, stop_master  # noqa: E402


def measure(jobs_n: int = 10_000, processes: int = 2) -> dict[str, Any]:
    """The master's RSS with a heavy app preloaded, and each child's RSS and USS after
    the children shared `jobs_n` jobs."""
    with PrivateRedis() as r:
        client = forkq.Client(r.url)
        client.push_bulk("bench.heavy_app.touch", [[i] for i in range(jobs_n)], queue="mem")
        master = start_master(r.url, "--require", "bench/heavy_app.py", "--queue", "mem",
                              "--processes", str(processes), "--concurrency", "10",
                              "--log-level", "warning")
        try:
            deadline = time.monotonic() + 120
            while r.client.llen("queue:mem") or in_flight(r.client) or r.client.scard("processes") < processes:
                if time.monotonic() > deadline:
                    raise SystemExit("jobs did not finish")
                time.sleep(0.1)
            failed = r.client.zcard("retry") + r.client.zcard("dead")
            if failed:
                raise SystemExit(f"{failed} jobs failed; the figures would mean nothing")
            m = psutil.Process(master.pid)
            master_rss = m.memory_info().rss
            children = []
            for child in sorted(m.children(), key=lambda c: c.pid):
                full = child.memory_full_info()
                children.append({"pid": child.pid, "rss": full.rss, "uss": full.uss})
        finally:
            stop_master(master)
    return {"master_rss": master_rss, "children": children,
            "worst_uss_share": max(c["uss"] for c in children) / master_rss}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=10_000)
    p.add_argument("--processes", type=int, default=2)
    a = p.parse_args()
    f = measure(a.jobs, a.processes)
    master_rss = f["master_rss"]
    print(f"master RSS {master_rss / 1_048_576:.1f} MB (app preloaded, gc.freeze())")
    for c in f["children"]:
        print(f"child {c['pid']}: RSS {c['rss'] / 1_048_576:.1f} MB, USS {c['uss'] / 1_048_576:.1f} MB "
              f"= {100 * c['uss'] / master_rss:.0f}% of the master's RSS, after {a.jobs:,} jobs shared")


if __name__ == "__main__":
    main()
