"""Chaos: SIGKILL random busy children every ~200 ms and restart Redis once; nothing may be lost.

    python bench/chaos.py [--jobs 20000] [--processes 4] [--concurrency 10] [--duration 40]
                          [--kill-interval 0.2] [--poison-after 1000]

A private redis-server (`--appendonly yes --appendfsync always`, so a restart keeps every
acknowledged write) and a master running tests/apps/chaos_jobs.py, which records each
execution of job n. The jobs are fed in batches over most of the run while one loop, every
~kill-interval, picks a random child holding jobs, freezes it (SIGSTOP) to read how many jobs
it holds (the upper bound of what its death can run twice), SIGKILLs it and times how long
until its private hash is gone (the master put its jobs back); halfway through, Redis is
restarted. Then it waits until everything has run, stops the master with TERM and checks.

Prints jobs, kills, duplicates, lost, poisoned and recovery times; exits 1 if a job was lost,
duplicates exceed the jobs held at the kills, a private structure (`forkq:inflight:*`,
`forkq:landing:*`), an owner, a suspect or a due `schedule`/`retry` entry is left, or the
master did not exit 0. tests/test_chaos.py runs the same `run()` at a smaller scale.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil  # noqa: E402
import redis  # noqa: E402

import forkq  # noqa: E402
from bench.common import ROOT, free_port, start_master, stop_master  # noqa: E402

APP = ROOT / "tests" / "apps" / "chaos_jobs.py"
QUEUE = "chaos"
EXECS = "chaos:execs"
FAILED = "chaos:failed"
REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)


class DurableRedis:
    """A private redis-server that keeps every acknowledged write across restart()."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            sys.exit("redis-server is not installed (Debian: apt-get install -y redis-server)")
        self.binary = binary
        self.dir = tempfile.mkdtemp(prefix="forkq-chaos-")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes", "--appendfsync", "always", "--dir", self.dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        probe = redis.Redis.from_url(self.url, socket_timeout=0.5)
        deadline = time.monotonic() + 10
        try:
            while True:
                try:
                    if probe.ping():
                        return
                except REDIS_ERRORS:
                    if time.monotonic() > deadline or self.proc.poll() is not None:
                        raise
                time.sleep(0.01)
        finally:
            probe.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: Redis finishes the AOF, then exits
            self.proc.wait(30)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> "DurableRedis":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            if self.proc is not None:
                self.proc.kill()
            shutil.rmtree(self.dir, ignore_errors=True)


@dataclass
class Report:
    jobs: int = 0
    failed_once: int = 0                 # jobs that raised once on purpose (went through retry)
    kills: int = 0
    held_at_kills: int = 0               # jobs in the victims' in-flight hashes at their deaths
    recovery_s: list[float] = field(default_factory=list)   # kill -> private hash gone
    recovery_timeouts: int = 0
    redis_down_s: float | None = None    # the restart: stopped -> answering again
    resumed_s: float | None = None       # Redis answering again -> a job recorded after it
    executions: int = 0
    duplicates: int = 0                  # executions beyond the first, summed over jobs
    lost: list[int] = field(default_factory=list)       # never ran, not in dead either
    poisoned: list[int] = field(default_factory=list)   # in dead as forkq.PoisonJob
    other_dead: int = 0
    leftovers: dict[str, object] = field(default_factory=dict)
    master_exit: int | None = None
    elapsed_s: float = 0.0
    drained: bool = False

    def problems(self) -> list[str]:
        out = []
        if self.lost:
            out.append(f"{len(self.lost)} jobs lost (never ran, not dead), e.g. {self.lost[:10]}")
        if self.duplicates > self.held_at_kills:
            out.append(f"{self.duplicates} duplicates > {self.held_at_kills} jobs in flight at the kills")
        if self.other_dead:
            out.append(f"{self.other_dead} jobs in dead for another reason than forkq.PoisonJob")
        if self.recovery_timeouts:
            out.append(f"{self.recovery_timeouts} killed children's private hashes outlived 10 s")
        for name, value in self.leftovers.items():
            if value:
                out.append(f"left at the end: {name} = {value}")
        if self.master_exit != 0:
            out.append(f"master exit code {self.master_exit} after TERM")
        if not self.drained:
            out.append("the jobs did not all run before the deadline")
        return out

    def format(self) -> str:
        rec = sorted(self.recovery_s)
        rec_line = (f"median {statistics.median(rec) * 1000:.1f} ms, max {rec[-1] * 1000:.1f} ms "
                    f"over {len(rec)} kills" if rec else "no kills")
        lines = [
            f"jobs:        {self.jobs:,} ({self.failed_once:,} failed once on purpose and were retried)",
            f"kills:       {self.kills:,} SIGKILLs of busy children, {self.held_at_kills:,} jobs in flight in them",
            f"executions:  {self.executions:,}",
            f"duplicates:  {self.duplicates:,} (bound: {self.held_at_kills:,} in flight at the kills)",
            f"lost:        {len(self.lost)}",
            f"poisoned:    {len(self.poisoned)} (in dead as forkq.PoisonJob, not lost)",
            f"recovery:    kill -> dead child's private hash gone: {rec_line}",
            f"redis:       restarted once, down {_ms(self.redis_down_s)}, first job recorded "
            f"{_ms(self.resumed_s)} after it answered again",
            f"leftovers:   {self.leftovers}",
            f"master exit: {self.master_exit} (TERM)",
            f"elapsed:     {self.elapsed_s:.1f} s",
        ]
        problems = self.problems()
        lines.append("result:      " + ("OK" if not problems else "FAILED: " + "; ".join(problems)))
        return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.0f} ms"


def _ping(client: redis.Redis, timeout: float = 30) -> None:
    """Wait until `client` answers (after a restart its pooled connections are stale)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.ping()
            return
        except REDIS_ERRORS:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _push(enqueuer, args: list) -> None:
    """enqueue_many, retried when a pooled connection went stale in the Redis restart (the
    restart is over before the next push, so a failed push never reached Redis)."""
    for attempt in range(50):
        try:
            enqueuer.enqueue_many(args)
            return
        except REDIS_ERRORS:
            if attempt == 49:
                raise
            time.sleep(0.05)


def _identities(r: redis.Redis) -> dict[int, str]:
    """pid -> identity of every registered owner (identities are HOST:PID:NONCE)."""
    out = {}
    for raw in r.hkeys("forkq:owners"):
        ident = raw.decode()
        parts = ident.split(":")
        if len(parts) >= 3 and parts[-2].isdigit():
            out[int(parts[-2])] = ident
    return out


def _wait_stopped(proc: psutil.Process, timeout: float = 1.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if proc.status() == psutil.STATUS_STOPPED:
                return True
        except psutil.Error:
            return False
        time.sleep(0.0005)
    return False


def kill_busy_child(r: redis.Redis, master_pid: int, report: Report) -> bool:
    """SIGKILL one random child that holds jobs; False if none held any.

    The child is frozen (SIGSTOP) before its hash is read: a frozen child claims and runs
    nothing more, so what its hash holds then bounds what its death can make run twice."""
    try:
        kids = psutil.Process(master_pid).children()
    except psutil.Error:
        return False
    owners = _identities(r)
    random.shuffle(kids)
    for kid in kids:
        ident = owners.get(kid.pid)
        if ident is None:
            continue
        key = f"forkq:inflight:{ident}"
        if not r.hlen(key):
            continue
        try:
            os.kill(kid.pid, signal.SIGSTOP)
        except ProcessLookupError:
            continue
        try:
            held = r.hlen(key) if _wait_stopped(kid) else 0
        finally:
            if not held:
                os.kill(kid.pid, signal.SIGCONT)
        if not held:
            continue
        t0 = time.monotonic()
        os.kill(kid.pid, signal.SIGKILL)
        report.kills += 1
        report.held_at_kills += held
        while r.exists(key):
            if time.monotonic() - t0 > 10:
                report.recovery_timeouts += 1
                return True
            time.sleep(0.0005)
        report.recovery_s.append(time.monotonic() - t0)
        return True
    return False


def run(url: str, restart_redis: Callable[[], None], *, jobs: int = 20_000, processes: int = 4,
        concurrency: int = 10, duration: float = 40.0, kill_interval: float = 0.2,
        poison_after: int = 1000, fail_every: int = 50, settle_timeout: float = 120.0,
        log: Path | None = None, extra_args: tuple[str, ...] = ()) -> Report:
    """Feed `jobs` over most of `duration` seconds while killing busy children every
    ~`kill_interval` s and restarting Redis once at half time; then drain, stop and check."""
    report = Report(jobs=jobs)
    r = redis.Redis.from_url(url, socket_timeout=5)
    client = forkq.Client(url)
    from tests.apps import chaos_jobs  # registers chaos.record here too, to enqueue it
    enqueuer = chaos_jobs.record.options(client=client)
    all_args = [(n, n % fail_every == 0) for n in range(jobs)]
    report.failed_once = sum(1 for _, f in all_args if f)
    # --poison-after high: a random kill is not a poison job; with the default 3, an innocent
    # job in flight in 3 of the hundreds of kills would go to dead as forkq.PoisonJob
    master = start_master(url, "--require", str(APP), "--queue", QUEUE, "--processes", str(processes),
                          "--concurrency", str(concurrency), "--poll-interval", "1",
                          "--heartbeat-interval", "1", "--poison-after", str(poison_after),
                          "--log-level", "warning", "--log-format", "json", *extra_args, log=log)
    t_start = time.monotonic()
    try:
        feed_time = duration * 0.8
        ticks = max(1, int(feed_time / 0.1))
        batch = math.ceil(jobs / ticks)
        pushed = 0
        next_push = next_kill = t_start
        restarted = False
        resumed_from: tuple[float, int] | None = None
        while True:
            now = time.monotonic()
            elapsed = now - t_start
            if pushed < jobs and now >= next_push:
                _push(enqueuer, all_args[pushed:pushed + batch])
                pushed = min(jobs, pushed + batch)
                next_push += 0.1
            if not restarted and elapsed >= duration / 2:
                restarted = True
                t0 = time.monotonic()
                restart_redis()
                _ping(r)
                report.redis_down_s = time.monotonic() - t0
                resumed_from = (time.monotonic(), r.hlen(EXECS))
            if resumed_from is not None and report.resumed_s is None and r.hlen(EXECS) > resumed_from[1]:
                report.resumed_s = time.monotonic() - resumed_from[0]
            # a child that holds nothing is not worth killing (and killing idle young children
            # looks to the master like a crash loop at boot): until one holds jobs, look again
            # every loop turn, then wait ~kill_interval for the next kill
            if elapsed < duration and now >= next_kill and kill_busy_child(r, master.pid, report):
                next_kill = now + kill_interval * random.uniform(0.5, 1.5)
            if elapsed >= duration and pushed >= jobs:
                break
            if master.poll() is not None:
                raise RuntimeError(f"the master exited early with {master.returncode}")
            time.sleep(0.005)

        deadline = time.monotonic() + settle_timeout
        while time.monotonic() < deadline:
            if _settled(r, jobs):
                report.drained = True
                break
            if report.resumed_s is None and resumed_from and r.hlen(EXECS) > resumed_from[1]:
                report.resumed_s = time.monotonic() - resumed_from[0]
            time.sleep(0.1)
        report.master_exit = stop_master(master, timeout=60)
    finally:
        if master.poll() is None:
            os.killpg(master.pid, signal.SIGKILL)
            master.wait()
        report.elapsed_s = time.monotonic() - t_start
    _check(r, report)
    r.close()
    return report


def _counts(r: redis.Redis) -> Counter:
    return Counter(int(v) for v in r.hvals(EXECS))


def _dead(r: redis.Redis) -> tuple[list[int], int]:
    import json
    poisoned, other = [], 0
    for raw in r.zrange("dead", 0, -1):
        job = json.loads(raw)
        if job.get("class") == "chaos.record" and job.get("error_class") == "forkq.PoisonJob":
            poisoned.append(job["args"][0])
        else:
            other += 1
    return poisoned, other


def _settled(r: redis.Redis, jobs: int) -> bool:
    """Every job ran or is dead, and nothing is queued, held, suspect, scheduled or retrying."""
    try:
        if r.llen(f"queue:{QUEUE}") or r.llen(f"forkq:suspects:{QUEUE}") or r.zcard("retry") or r.zcard("schedule"):
            return False
        pipe = r.pipeline(transaction=False)
        for ident in r.hkeys("forkq:owners"):
            pipe.hlen(b"forkq:inflight:" + ident)
        if any(pipe.execute()):
            return False
        poisoned, _ = _dead(r)
        return len(set(_counts(r)) | set(poisoned)) >= jobs
    except REDIS_ERRORS:
        return False


def _check(r: redis.Redis, report: Report) -> None:
    counts = _counts(r)
    report.executions = sum(counts.values())
    report.duplicates = sum(c - 1 for c in counts.values() if c > 1)
    report.poisoned, report.other_dead = _dead(r)
    report.lost = sorted(set(range(report.jobs)) - set(counts) - set(report.poisoned))
    now = time.time()
    report.leftovers = {
        "forkq:inflight:*": sorted(k.decode() for k in r.scan_iter(match="forkq:inflight:*")),
        "forkq:landing:*": sorted(k.decode() for k in r.scan_iter(match="forkq:landing:*")),
        "forkq:owners": r.hlen("forkq:owners"),
        f"forkq:suspects:{QUEUE}": r.llen(f"forkq:suspects:{QUEUE}"),
        f"queue:{QUEUE}": r.llen(f"queue:{QUEUE}"),
        "due in schedule": r.zcount("schedule", "-inf", now),
        "due in retry": r.zcount("retry", "-inf", now),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=20_000)
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=10)
    p.add_argument("--duration", type=float, default=40.0, help="seconds of kills (jobs fed over 80%%)")
    p.add_argument("--kill-interval", type=float, default=0.2, help="average seconds between kills")
    p.add_argument("--poison-after", type=int, default=1000,
                   help="high on purpose: random kills are not poison jobs")
    p.add_argument("--log", type=Path, help="keep the master's log here")
    a = p.parse_args()
    with DurableRedis() as server:
        report = run(server.url, server.restart, jobs=a.jobs, processes=a.processes,
                     concurrency=a.concurrency, duration=a.duration, kill_interval=a.kill_interval,
                     poison_after=a.poison_after, log=a.log)
    print(report.format())
    sys.exit(1 if report.problems() else 0)


if __name__ == "__main__":
    main()
