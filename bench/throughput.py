"""Enqueue and processing throughput, Redis commands per job, and child-death recovery time.

    python bench/throughput.py [--jobs 20000] [--processes 2] [--concurrency 10] [--rounds 3]

Prints figures; asserts nothing. Uses a private redis-server on a free port.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil  # noqa: E402

import forkq  # noqa: E402
from bench import jobs  # noqa: E402
from bench.common import PrivateRedis, in_flight, start_master, stop_master  # noqa: E402


def wait_drained(r, queue: str, timeout: float) -> float:
    """The time the queue and every in-flight hash were last seen empty. Polled every
    2 ms (a 20,000-job window is under half a second): about 0.01 commands per job."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if r.llen(f"queue:{queue}") == 0 and in_flight(r) == 0:
            return time.monotonic()
        time.sleep(0.002)
    raise SystemExit(f"not drained after {timeout}s: {r.llen(f'queue:{queue}')} queued")


def wait_ready(r, processes: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while r.scard("processes") < processes or r.hlen("forkq:owners") < processes:
        if time.monotonic() > deadline:
            raise SystemExit("workers did not start")
        time.sleep(0.01)


def bench_enqueue(r, n: int, rounds: int = 3) -> tuple[float, float]:
    """Best of `rounds` after a warm-up (the first push also opens the connection)."""
    client = forkq.Client(r.url)
    many = jobs.noop.options(client=client)
    many.enqueue_many([()] * 1000)
    r.client.delete("queue:bench")
    bulk_rate = single_rate = 0.0
    single = min(n, 5000)
    for _ in range(rounds):
        t0 = time.perf_counter()
        many.enqueue_many([()] * n)
        bulk_rate = max(bulk_rate, n / (time.perf_counter() - t0))
        r.client.delete("queue:bench")
        t0 = time.perf_counter()
        for _ in range(single):
            many.enqueue()
        single_rate = max(single_rate, single / (time.perf_counter() - t0))
        r.client.delete("queue:bench")
    return bulk_rate, single_rate


def bench_enqueue_unique(r, n: int, rounds: int = 3) -> tuple[float, float]:
    """As bench_enqueue, for unique jobs (`unique_for`), every push taking a new lock (its
    own args): the push is a Lua call that checks and sets the lock with the push."""
    client = forkq.Client(r.url)
    many = jobs.unique_noop.options(client=client)
    many.enqueue_many([(i,) for i in range(1000)])
    bulk_rate = single_rate = 0.0
    single = min(n, 5000)
    for _ in range(rounds):
        r.client.flushall()
        t0 = time.perf_counter()
        many.enqueue_many([(i,) for i in range(n)])
        bulk_rate = max(bulk_rate, n / (time.perf_counter() - t0))
        r.client.flushall()
        t0 = time.perf_counter()
        for i in range(single):
            many.enqueue(i)
        single_rate = max(single_rate, single / (time.perf_counter() - t0))
    r.client.flushall()
    return bulk_rate, single_rate


def wait_blocked(r, processes: int, timeout: float = 20) -> None:
    """Until every child's fetcher has found the queue empty and blocks in BLMOVE."""
    deadline = time.monotonic() + timeout
    while sum(1 for c in r.client_list() if c.get("cmd") == "blmove") < processes:
        if time.monotonic() > deadline:
            raise SystemExit("workers did not start waiting for jobs")
        time.sleep(0.01)


def redis_cpu(r) -> float:
    info = r.client.info("cpu")
    return info["used_cpu_user"] + info["used_cpu_sys"]


def children_cpu(children: list[psutil.Process]) -> float:
    return sum(t.user + t.system for t in (c.cpu_times() for c in children))


def machine_busy() -> float:
    """CPU seconds the whole machine has spent busy (every core, every process): with
    Redis on the same cores, what the children leave idle is what a second process can
    use. psutil reads /proc/stat; idle and iowait are the time nothing ran."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)


def bench_process(r, n: int, processes: int, concurrency: int, log_level: str,
                  job: Any = jobs.noop, args: tuple = ()) -> tuple[float, ...]:
    """Jobs/s and Redis commands per job over `n` no-op jobs, timed from their arrival on
    the queue with every child up and waiting: the workers' pace, not how fast children
    boot (timing from the first claim counted the second child's start-up against
    --processes 2, by up to a tenth of a 20,000-job window). Also the children's,
    Redis's and the whole machine's CPU seconds per job over the window."""
    r.client.delete("queue:bench", "queue:staged")
    client = forkq.Client(r.url)
    job.options(client=client, queue="staged").enqueue_many([args] * (n - 1))
    last = job.options(client=client)
    proc = start_master(r.url, "--require", "bench/jobs.py", "--queue", "bench", "--processes",
                        str(processes), "--concurrency", str(concurrency), "--log-level", log_level,
                        "--log-format", "json")
    try:
        wait_ready(r.client, processes)
        wait_blocked(r.client, processes)
        children = psutil.Process(proc.pid).children()
        cpu0, rcpu0, busy0 = children_cpu(children), redis_cpu(r), machine_busy()
        c0 = r.commands()
        t0 = time.monotonic()
        # RENAME puts n - 1 jobs in place at once; the push of the last one wakes the
        # blocked fetchers, as any push would
        r.client.rename("queue:staged", "queue:bench")
        last.enqueue(*args)
        t1 = wait_drained(r.client, "bench", 300)
        c1 = r.commands()
        cpu1, rcpu1, busy1 = children_cpu(children), redis_cpu(r), machine_busy()
        leftover = r.client.zcard("retry") + r.client.zcard("dead")
        if leftover:
            raise SystemExit(f"{leftover} jobs failed: the benchmark is not measuring what it says")
    finally:
        stop_master(proc)
    return n / (t1 - t0), (c1 - c0) / n, (cpu1 - cpu0) / n, (rcpu1 - rcpu0) / n, (busy1 - busy0) / n


def bench_recovery(r, processes: int, concurrency: int, rounds: int) -> list[float]:
    client = forkq.Client(r.url)
    proc = start_master(r.url, "--require", "bench/jobs.py", "--queue", "bench", "--processes",
                        str(processes), "--concurrency", str(concurrency), "--log-level", "warning")
    times = []
    try:
        wait_ready(r.client, processes)
        for _ in range(rounds):
            r.client.delete("queue:bench")
            jobs.sleepy.options(client=client).enqueue_many([(30,)] * (processes * concurrency))
            deadline = time.monotonic() + 20
            while in_flight(r.client) < processes * concurrency:
                if time.monotonic() > deadline:
                    raise SystemExit("jobs were not claimed")
                time.sleep(0.002)
            victim = psutil.Process(proc.pid).children()[0]
            identity = _identity_of(r.client, victim.pid)
            held = r.client.hlen(f"forkq:inflight:{identity}")
            t0 = time.monotonic()
            os.kill(victim.pid, signal.SIGKILL)
            # back in shared lists (the queue, or forkq:suspects:bench for crash suspects) the
            # moment the dead child's private hash is gone
            while r.client.exists(f"forkq:inflight:{identity}"):
                if time.monotonic() - t0 > 10:
                    raise SystemExit("jobs did not come back")
                time.sleep(0.0005)
            times.append(time.monotonic() - t0)
            back = r.client.llen("queue:bench") + r.client.llen("forkq:suspects:bench")
            if back < held:
                raise SystemExit(f"only {back} of {held} jobs came back")
            # clear for the next round: no 30 s sleepers left to run alone
            r.client.delete("queue:bench", "forkq:suspects:bench")
            for key in r.client.scan_iter("forkq:crashes:*"):
                r.client.delete(key)
            wait_ready(r.client, processes)
    finally:
        proc.send_signal(signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return times


def _identity_of(client, pid: int) -> str:
    for owner in client.hkeys("forkq:owners"):
        if owner.decode().split(":")[-2] == str(pid):
            return owner.decode()
    raise SystemExit(f"no owner entry for pid {pid}")


SPIN = 2500  # loop turns of bench.jobs.spin: about 0.2 ms of CPU on this project's machine


def measure(jobs_n: int = 20_000, processes: int = 2, concurrency: int = 10,
            recovery_rounds: int = 5, rounds: int = 3, ratio_rounds: int = 0) -> dict[str, Any]:
    """Every figure of this benchmark, on a private Redis. Each processing figure is the
    median of `rounds` runs, interleaved so that a busy spell on the machine does not
    land on one setting only; the scaling ratio is the median of the rounds' ratios, over
    `ratio_rounds` rounds if more: single rounds of it range from about 1.2x to 2x here."""
    out: dict[str, Any] = {}
    with PrivateRedis() as r:
        out["enqueue_many"], out["enqueue"] = bench_enqueue(r, jobs_n)
        out["enqueue_many_unique"], out["enqueue_unique"] = bench_enqueue_unique(r, jobs_n)
        runs: dict[str, list[tuple[float, ...]]] = {"warning": [], "info": [], "1": [],
                                                    "spin": [], "spin1": []}
        spin_n = max(jobs_n // 5, 200)
        for _ in range(rounds):
            for key, procs, level in (("warning", processes, "warning"), ("1", 1, "warning"),
                                      ("info", processes, "info")):
                r.client.flushall()
                runs[key].append(bench_process(r, jobs_n, procs, concurrency, level))
            # the same comparison with jobs that do some work (about 0.2 ms of Python each):
            # Redis's share of the cores is then small, and the figure shows whether the
            # processes themselves scale
            for key, procs in (("spin", processes), ("spin1", 1)):
                r.client.flushall()
                runs[key].append(bench_process(r, spin_n, procs, concurrency, "warning",
                                               jobs.spin, (SPIN,)))
        for _ in range(ratio_rounds - rounds):
            for key, procs in (("warning", processes), ("1", 1)):
                r.client.flushall()
                runs[key].append(bench_process(r, jobs_n, procs, concurrency, "warning"))
        for key in ("warning", "info", "1"):
            out[f"process_{key}"] = statistics.median(run[0] for run in runs[key])
            out[f"commands_{key}"] = statistics.median(run[1] for run in runs[key])
            out[f"child_us_{key}"] = statistics.median(run[2] for run in runs[key]) * 1e6
            out[f"redis_us_{key}"] = statistics.median(run[3] for run in runs[key]) * 1e6
            # cores busy over the window: CPU per job times jobs per second
            out[f"busy_{key}"] = statistics.median(run[4] * run[0] for run in runs[key])
        out["ratios"] = [two[0] / one[0] for two, one in zip(runs["warning"], runs["1"])]
        out["ratio"] = statistics.median(out["ratios"])
        out["spin_ratios"] = [two[0] / one[0] for two, one in zip(runs["spin"], runs["spin1"])]
        out["spin_ratio"] = statistics.median(out["spin_ratios"])
        out["spin_1"] = statistics.median(run[0] for run in runs["spin1"])
        out["spin_child_us"] = statistics.median(run[2] for run in runs["spin1"]) * 1e6
        r.client.flushall()
        times = bench_recovery(r, processes, concurrency, recovery_rounds)
        out["recovery_median_ms"] = statistics.median(times) * 1000
        out["recovery_worst_ms"] = max(times) * 1000
        out["recovery_kills"] = len(times)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=20_000)
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=10)
    p.add_argument("--recovery-rounds", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3, help="processing runs per setting (median)")
    a = p.parse_args()
    f = measure(a.jobs, a.processes, a.concurrency, a.recovery_rounds, a.rounds)
    print(f"enqueue_many:        {f['enqueue_many']:10,.0f} jobs/s  (batches of 1,000, {a.jobs:,} jobs, best of 3)")
    print(f"enqueue (one by one): {f['enqueue']:9,.0f} jobs/s  (one thread, best of 3)")
    print(f"unique jobs (unique_for): enqueue_many {f['enqueue_many_unique']:,.0f} jobs/s, "
          f"enqueue {f['enqueue_unique']:,.0f} jobs/s")
    for level in ("warning", "info"):
        print(f"processing --log-level {level:7}: {f['process_' + level]:8,.0f} jobs/s, "
              f"{f['commands_' + level]:.2f} Redis commands/job "
              f"({a.jobs:,} no-op jobs, --processes {a.processes} --concurrency {a.concurrency})")
    print(f"processing --processes 1 (warning): {f['process_1']:8,.0f} jobs/s")
    print(f"CPU per job, --processes {a.processes} (warning): children {f['child_us_warning']:.1f} us, "
          f"Redis {f['redis_us_warning']:.1f} us; --processes 1: children {f['child_us_1']:.1f} us, "
          f"Redis {f['redis_us_1']:.1f} us")
    print(f"cores busy, whole machine: --processes {a.processes} {f['busy_warning']:.2f}, "
          f"--processes 1 {f['busy_1']:.2f} (of {psutil.cpu_count()})")
    print(f"--processes {a.processes} over 1: {f['ratio']:.2f}x (median of "
          f"{', '.join(f'{x:.2f}' for x in f['ratios'])})")
    print(f"--processes {a.processes} over 1, jobs of spin({SPIN}): {f['spin_ratio']:.2f}x (median of "
          f"{', '.join(f'{x:.2f}' for x in f['spin_ratios'])}; 1 process {f['spin_1']:,.0f} jobs/s, "
          f"{f['spin_child_us']:.0f} us of child CPU per job)")
    print(f"recovery after SIGKILL of a busy child ({a.concurrency} jobs in flight): "
          f"median {f['recovery_median_ms']:.1f} ms, worst {f['recovery_worst_ms']:.1f} ms "
          f"over {f['recovery_kills']:.0f} kills")


if __name__ == "__main__":
    main()
