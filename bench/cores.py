"""What this machine's cores give two CPU-bound processes over one, with no Redis and no
forkq: the ceiling for any `--processes 2` over `--processes 1` figure measured here.

    python bench/cores.py [--rounds 5]

On a virtual machine, two busy vCPUs may share a physical core or the host's attention
with other guests; each process then runs slower while the other runs, and two
processes give less than twice the work of one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

TURNS = 10_000_000  # about half a second of CPython on this project's machine


def _spin(turns: int) -> None:
    x = 0
    for i in range(turns):
        x += i


def _run(processes: int, turns: int) -> float:
    """Seconds until `processes` forked children, each spinning `turns`, have all ended."""
    started = time.perf_counter()
    pids = []
    for _ in range(processes):
        pid = os.fork()
        if pid == 0:
            try:
                _spin(turns)
            finally:
                os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
    return time.perf_counter() - started


def measure(rounds: int = 5, turns: int = TURNS) -> dict[str, object]:
    """Median over interleaved rounds of 2 x (one process's time) / (two processes' time)."""
    ratios = []
    for _ in range(rounds):
        one = _run(1, turns)
        two = _run(2, turns)
        ratios.append(2 * one / two)
    return {"ratio": statistics.median(ratios), "ratios": ratios}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    f = measure(a.rounds)
    print(f"{os.cpu_count()} cores: 2 CPU-bound processes over 1: {f['ratio']:.2f}x "
          f"(rounds: {', '.join(f'{x:.2f}' for x in f['ratios'])})")


if __name__ == "__main__":
    main()
