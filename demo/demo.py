"""forkq's demo: a private Redis, 2,000 jobs, `forkq start --processes 4`, live progress.

Halfway through it SIGKILLs one child, as the OOM killer would: the master puts that
child's in-flight jobs back into Redis (as crash suspects, each then run alone) and forks a
replacement, and every job still completes. Run it with `bash demo/run` (which installs what is missing) or
`python3 demo/demo.py`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil  # noqa: E402

import forkq  # noqa: E402
from bench.common import PrivateRedis, in_flight, start_master, stop_master  # noqa: E402
from demo import jobs  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description="forkq demo")
    p.add_argument("--jobs", type=int, default=2000)
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=10)
    a = p.parse_args()
    log = Path(os.environ.get("TMPDIR", "/tmp")) / "forkq-demo.log"
    with PrivateRedis() as redis_:
        r = redis_.client
        print(f"private redis-server on {redis_.url}")
        forkq.configure(redis_.url)
        t0 = time.monotonic()
        jobs.resize_image.enqueue_many([(i,) for i in range(a.jobs)])
        print(f"enqueued {a.jobs:,} jobs in {(time.monotonic() - t0) * 1000:.0f} ms "
              f"(enqueue_many, one round trip per 1,000)")
        cmd = ["--require", "demo/jobs.py", "--queue", "demo", "--processes", str(a.processes),
               "--concurrency", str(a.concurrency), "--poll-interval", "1", "--timeout", "10"]
        print(f"$ forkq start {' '.join(cmd)}   (log: {log})")
        master = start_master(redis_.url, *cmd, log=log)
        start = time.monotonic()
        killed = None
        last_done, last_t = 0, start
        try:
            while True:
                time.sleep(0.5)
                done = r.scard("demo:done")
                now = time.monotonic()
                rate = (done - last_done) / (now - last_t)
                last_done, last_t = done, now
                children = sorted(psutil.Process(master.pid).children(), key=lambda c: c.pid)
                busy = _busy_per_slot(r)
                bar = "#" * int(30 * done / a.jobs)
                print(f"[{bar:<30}] {done:5,}/{a.jobs:,} done  {rate:6,.0f} jobs/s  "
                      f"busy per child: {busy}  retry set: {r.zcard('retry')}", flush=True)
                if killed is None and done >= a.jobs * 0.4 and children:
                    victim = children[1 % len(children)]
                    held = _held_by_pid(r, victim.pid)
                    os.kill(victim.pid, signal.SIGKILL)
                    killed = (victim.pid, held)
                    print(f"  !! SIGKILL child pid {victim.pid} holding {held} in-flight jobs: "
                          "the master puts them back (each runs alone, as a crash suspect) and forks a replacement")
                if done >= a.jobs:
                    break
                if master.poll() is not None:
                    print(f"master exited early with {master.returncode}; see {log}")
                    return 1
                if now - start > 300:
                    print("demo timed out; see", log)
                    return 1
            elapsed = time.monotonic() - start
            code = stop_master(master)
        finally:
            if master.poll() is None:
                os.killpg(master.pid, signal.SIGKILL)
        runs = int(r.get("demo:runs") or 0)
        leftovers = sum(1 for _ in r.scan_iter("forkq:inflight:*")) + sum(1 for _ in r.scan_iter("forkq:landing:*"))
        print()
        print(f"all {a.jobs:,} jobs done in {elapsed:.1f} s ({a.jobs / elapsed:,.0f} jobs/s) "
              f"by {a.processes} children x {a.concurrency} threads")
        by_slot = {k.decode(): int(v) for k, v in sorted(r.hgetall("demo:by_slot").items())}
        print(f"runs per child slot: {by_slot}")
        print(f"jobs that failed once and succeeded on retry: {r.scard('demo:failed_once')}")
        if killed:
            print(f"killed child {killed[0]} held {killed[1]} jobs; total runs {runs:,} for "
                  f"{a.jobs:,} jobs ({runs - a.jobs} ran again after the kill), lost: {a.jobs - r.scard('demo:done')}")
        print(f"master exit code {code}; private in-flight structures left in Redis: {leftovers}")
        return 0 if code == 0 and leftovers == 0 and r.scard("demo:done") == a.jobs else 1


def _busy_per_slot(r) -> str:
    import json
    parts = []
    for owner, info in r.hgetall("forkq:owners").items():
        held = r.hlen(b"forkq:inflight:" + owner)
        parts.append((json.loads(info).get("pid"), held))
    return " ".join(f"{h:2d}" for _, h in sorted(parts)) or "-"


def _held_by_pid(r, pid: int) -> int:
    for owner in r.hkeys("forkq:owners"):
        if owner.decode().split(":")[-2] == str(pid):
            return r.hlen(b"forkq:inflight:" + owner)
    return 0


if __name__ == "__main__":
    sys.exit(main())
