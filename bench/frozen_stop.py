"""A stop while Redis is frozen: does any job run twice, or get stranded?

    python bench/frozen_stop.py [--rounds 8] [--mode fork|nofork] [--jobs 4000] [--freeze 4]

Each round: a private redis-server, --jobs jobs of tests/apps/file_jobs.py (they record
their runs in a file, never in Redis), a forkq (--processes 2, or --no-fork) with
--timeout 1 working through them; once some have run, Redis is frozen (SIGSTOP), forkq is
sent SIGTERM, and Redis is woken --freeze seconds later (4: past forkq's stop deadline;
9: past the master's grace too, so it kills its children and gives up on its own requeue). The claims, acks
and waits that were on the wire reach Redis beside the stop's final requeue. A second
forkq then runs whatever went back. Prints, per round, the jobs run twice, the jobs never
run and what was left in private structures; exits 1 if any job was lost.
A job that was running at the deadline may run again (the price of a hard stop), so the
jobs here take at most 5 ms: by the deadline none is running, and any job run twice is
forkq's bookkeeping at fault.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import forkq  # noqa: E402
from bench.common import ROOT, PrivateRedis, start_master, stop_master  # noqa: E402

APP = ROOT / "tests" / "apps" / "file_jobs.py"


def _runs(path: Path) -> Counter:
    return Counter(int(n) for n in path.read_text().split()) if path.exists() else Counter()


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.02)


def one_round(mode: str, jobs: int, tmp: Path, freeze: float) -> tuple[int, int, int]:
    runs_file = tmp / "runs"
    runs_file.unlink(missing_ok=True)
    os.environ["FILE_JOBS_RUNS"] = str(runs_file)
    args = ["--require", str(APP), "--queue", "file", "--timeout", "1", "--concurrency", "10",
            "--log-level", "warning", "--pidfile", str(tmp / "pid")]
    args += ["--no-fork"] if mode == "nofork" else ["--processes", "2"]
    with PrivateRedis() as r:
        forkq.Client(r.url).push_bulk("file.record", [[i] for i in range(jobs)], queue="file")
        first = start_master(r.url, *args, log=tmp / "first.log")
        _wait(lambda: sum(_runs(runs_file).values()) > jobs // 8, 60, "the first forkq to run jobs")
        os.kill(r.proc.pid, signal.SIGSTOP)
        time.sleep(0.2)  # claims and acks go out into the frozen server
        first.send_signal(signal.SIGTERM)
        time.sleep(freeze)
        os.kill(r.proc.pid, signal.SIGCONT)
        code = stop_master(first, timeout=40)
        if code != 0:
            print(f"  the first forkq exited {code}")
        left = sum(r.client.hlen(k) if r.client.type(k) == b"hash" else r.client.llen(k)
                   for k in r.client.keys("forkq:inflight:*") + r.client.keys("forkq:landing:*"))
        second = start_master(r.url, *args, log=tmp / "second.log")
        try:
            _wait(lambda: len(_runs(runs_file)) >= jobs - left and r.client.llen("queue:file") == 0, 120,
                  f"the second forkq to run the rest (see {tmp / 'second.log'})")
        finally:
            stop_master(second)
    runs = _runs(runs_file)
    return sum(1 for v in runs.values() if v > 1), jobs - len(runs), left


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--mode", choices=("fork", "nofork"), default="fork")
    parser.add_argument("--jobs", type=int, default=4000)
    parser.add_argument("--freeze", type=float, default=4.0)
    args = parser.parse_args()
    totals = Counter()
    tmp = tempfile.mkdtemp(prefix="forkq-frozen-")  # kept if a round fails: its logs are there
    for n in range(args.rounds):
        twice, lost, left = one_round(args.mode, args.jobs, Path(tmp), args.freeze)
        totals.update(twice=twice, lost=lost, left=left)
        print(f"round {n}: {args.jobs} jobs, {twice} ran twice, {lost} never ran, "
              f"{left} left in private structures at the stop", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"{args.rounds} rounds ({args.mode}): {totals['twice']} ran twice, {totals['lost']} never ran, "
          f"{totals['left']} left private")
    return 1 if totals["lost"] else 0


if __name__ == "__main__":
    sys.exit(main())
