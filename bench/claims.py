"""Where a child's time goes with no-op jobs: running them, or waiting on a claim's round trip.

    python bench/claims.py [--jobs 60000] [--rounds 3]

Each child alternates between running the jobs of one claim and waiting for the next
claim's reply, while its other threads have nothing to run. With two children and one
Redis on two cores, a core can only be busy for the children's work while at least one
child is not waiting: the share of the window in which both wait at once is time the
machine cannot use, and what keeps `--processes 2` from twice `--processes 1`.

Prints, for `--processes 1` and `--processes 2` (`--concurrency 10`, interleaved rounds,
medians): a claim's round trip as a child sees it, the share of a child's time spent
waiting on claims, and the share of the window in which both children waited; beside
them a claim's round trip from a bare client with nothing else running, and a PING's.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis  # noqa: E402

import forkq  # noqa: E402
from bench import jobs  # noqa: E402
from bench.common import PrivateRedis, start_master, stop_master  # noqa: E402
from bench.throughput import wait_blocked, wait_drained, wait_ready  # noqa: E402
from forkq.fetch import ReliableFetch  # noqa: E402
from forkq.queues import QueueOrder  # noqa: E402


def bare_round_trips(r, claims: int) -> tuple[float, float]:
    """Median µs of a claim of ten (with the last claim's acks) and of a PING, from one
    thread of a process doing nothing else."""
    jobs.noop.options(client=forkq.Client(r.url)).enqueue_many([()] * (claims * 10))
    fetcher = ReliableFetch(redis.Redis.from_url(r.url), "bench:claims:0", QueueOrder([("bench", 0)]))
    fetcher.register()
    held: list[Any] = []
    claim = []
    for _ in range(claims):
        for unit in held:
            fetcher.ack(unit.token)
        began = time.perf_counter_ns()
        held = fetcher.fetch(10)
        claim.append(time.perf_counter_ns() - began)
    fetcher.close()
    ping = []
    for _ in range(claims):
        began = time.perf_counter_ns()
        r.client.ping()
        ping.append(time.perf_counter_ns() - began)
    r.client.flushall()
    return statistics.median(claim) / 1e3, statistics.median(ping) / 1e3


def traced_window(r, n: int, processes: int, trace: str) -> dict[str, float]:
    """One window of `n` no-op jobs with every child's claims traced."""
    for old in glob.glob(os.path.join(trace, "claims.*")):
        os.remove(old)
    client = forkq.Client(r.url)
    jobs.noop.options(client=client, queue="staged").enqueue_many([()] * (n - 1))
    os.environ["FORKQ_BENCH_TRACE"] = trace
    proc = start_master(r.url, "--require", "bench/claim_trace.py", "--queue", "bench",
                        "--processes", str(processes), "--concurrency", "10", "--log-level", "warning")
    try:
        wait_ready(r.client, processes)
        wait_blocked(r.client, processes)
        t0 = time.monotonic_ns()
        r.client.rename("queue:staged", "queue:bench")
        jobs.noop.options(client=client).enqueue()
        wait_drained(r.client, "bench", 300)
        t1 = time.monotonic_ns()
    finally:
        stop_master(proc)
        r.client.flushall()
    children = []
    for path in glob.glob(os.path.join(trace, "claims.*")):
        with open(path) as f:
            spans = [tuple(map(int, line.split())) for line in f]
        children.append([(a, b) for a, b in spans if a >= t0 and b <= t1])
    window = t1 - t0
    waited = [sum(b - a for a, b in spans) for spans in children]
    count = sum(len(spans) for spans in children)
    return {"rate": n / (window / 1e9),
            "rtt_us": sum(waited) / max(count, 1) / 1e3,
            "waiting": statistics.mean(w / window for w in waited),
            "all_waiting": _all_at_once(children, t0) / window}


def _all_at_once(children: list[list[tuple[int, int]]], start: int) -> int:
    """Nanoseconds during which every child was inside a claim."""
    edges = sorted((t, step) for spans in children for a, b in spans for t, step in ((a, 1), (b, -1)))
    inside, last, total = 0, start, 0
    for t, step in edges:
        if inside == len(children):
            total += t - last
        inside += step
        last = t
    return total


def measure(n: int = 60_000, rounds: int = 3, claims: int = 2000) -> dict[str, Any]:
    out: dict[str, Any] = {}
    runs: dict[int, list[dict[str, float]]] = {1: [], 2: []}
    with PrivateRedis() as r, tempfile.TemporaryDirectory(prefix="forkq-claims-") as trace:
        out["bare_claim_us"], out["ping_us"] = bare_round_trips(r, claims)
        for _ in range(rounds):
            for processes in (1, 2):
                runs[processes].append(traced_window(r, n, processes, trace))
    for processes, windows in runs.items():
        for key in windows[0]:
            out[f"{key}_{processes}"] = statistics.median(w[key] for w in windows)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=60_000)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    f = measure(a.jobs, a.rounds)
    print(f"bare client: claim of 10 {f['bare_claim_us']:.0f} us, PING {f['ping_us']:.0f} us (median round trips)")
    for processes in (1, 2):
        print(f"--processes {processes}: {f[f'rate_{processes}']:,.0f} jobs/s (traced), claim round trip "
              f"{f[f'rtt_us_{processes}']:.0f} us, each child waiting on claims "
              f"{100 * f[f'waiting_{processes}']:.0f}% of the window")
    print(f"--processes 2: both children waiting at once {100 * f['all_waiting_2']:.0f}% of the window")


if __name__ == "__main__":
    main()
