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

    python3 -m bench.chaos --minutes N --seed S [--fault-every 4] [--hang-timeout 12] [--keep DIR]
                           [--faults redis_freeze,child_kill]

The soak (`Soak`, below): an operator's bad day. Its own redis-server (AOF, fsync always)
and a real `forkq start --processes 3 --concurrency 5` on bench/chaos_app.py, whose jobs
take 0-200 ms and record each run to its end (key, jid, retry count, pid, time) in one HSET;
some fail once and retry, and the driver pushes plain jobs, bursts of 50-300, scheduled,
unique, batch (with an on_success callback), chain and iterable jobs (each item recorded
as a run of its own), ~15 pushes a second. Meanwhile,
every ~--fault-every seconds, one fault at random: SIGKILL a child; SIGSTOP one past the
hang timeout; SIGKILL the master alone, or its whole group, and start a new one (half the
masters get a host name of their own, so a dead one's jobs come back only after
--recovery-delay); TERM the master; `ctl quiet` then `ctl stop`; quiet or TERM, then SIGKILL
the group; HUP; Redis `SHUTDOWN`, SIGTERM or `kill -9`, restarted from its AOF; `CLIENT PAUSE`
(ALL or WRITE) 1-10 s; `CLIENT KILL` of every connection; Redis SIGSTOPped for 1 s to --hang-timeout + 8 s (past the recovery
delay); and Redis down while a master is killed or stopped. Beside it, a second forkq
(`--processes 1`, a host name of its own) that only Redis's faults touch: each forkq's orphan
sweep faces the other's live processes, and a run by the bystander that runs again is
unexplained (it is never killed). `--faults` restricts the faults, `--no-bystander` drops it. Then it waits until every queue,
suspects list, schedule, retry set and in-flight structure is empty, and reports what was
pushed, what never ran (LOST, not in dead), what ran more than once and why (the process of
the earlier run was killed after it, or stopped while Redis was down, or killed as hung by
its master though nothing froze it), and the dead set. Exit 1 on anything else.
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


# ---------------------------------------------------------------------------------------
# The soak: every kind of fault an operator's bad day brings, at random, on a mixed app.

SOAK_APP = ROOT / "bench" / "chaos_app.py"
SOAK_QUEUES = ("soak", "soak2")
FAULTS = ("child_kill", "child_hang", "master_kill", "group_kill", "master_term",
          "redis_shutdown", "redis_term", "redis_kill9", "client_pause", "redis_freeze", "client_kill",
          "quiet_stop", "outage_and_kill", "hup", "quiet_kill", "term_kill")
# Above the longest CLIENT PAUSE (10 s): a master whose loop waits on a paused Redis for
# longer than --hang-timeout kills every healthy child as hung (see README); --hang-timeout 3
# shows that. The delay stays above the hang timeout, as forkq asks.
HANG_TIMEOUT = 12.0


class SoakRedis(DurableRedis):
    """DurableRedis that can also be shut down by command, killed -9 and paused."""

    def shutdown(self) -> None:
        # with AOF and appendfsync always every acknowledged write is in the file already;
        # plain SHUTDOWN (not NOSAVE, which only skips an RDB save we do not configure)
        # makes Redis fsync the AOF and exit, the operator's clean stop
        c = redis.Redis(port=self.port, socket_timeout=5)
        try:
            c.shutdown()
        except REDIS_ERRORS:
            pass
        self.proc.wait(30)
        self.proc = None
        self.start()

    def kill9(self) -> None:
        self.down(kill=True)
        self.start()

    def down(self, kill: bool) -> None:
        if kill:
            self.proc.kill()
        else:
            self.proc.terminate()  # as SHUTDOWN: fsync the AOF, then exit
        self.proc.wait(30)
        self.proc = None


@dataclass
class SoakReport:
    seed: int = 0
    minutes: float = 0.0
    faults: Counter = field(default_factory=Counter)
    pushed: int = 0                      # keys expected to run (chain steps and callbacks too)
    ran: int = 0
    lost: list[str] = field(default_factory=list)
    dupes: dict[str, list] = field(default_factory=dict)    # key -> its runs, when > 1
    explained: int = 0
    unexplained: list[str] = field(default_factory=list)
    spurious_hangs: list[str] = field(default_factory=list)  # healthy children killed as hung
    by_spurious: int = 0                 # extra runs those kills caused
    by_outage_stop: int = 0              # extra runs of processes stopped while Redis was down
    dead: Counter = field(default_factory=Counter)          # error_class -> count
    dead_keys: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    leftovers: dict[str, object] = field(default_factory=dict)
    drain_s: float | None = None
    elapsed_s: float = 0.0

    def format(self) -> str:
        extra = sum(len(v) - 1 for v in self.dupes.values())
        lines = [
            f"seed {self.seed}, {self.minutes} min of faults, {self.elapsed_s:.0f} s in all",
            "faults:      " + ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items())),
            f"pushed:      {self.pushed} (plain, scheduled, unique, batch jobs, chain steps, callbacks)",
            f"ran:         {self.ran} at least once",
            f"LOST:        {len(self.lost)} {self.lost[:20]}",
            f"ran twice+:  {len(self.dupes)} keys, {extra} extra runs, {self.explained} explained "
            f"by a kill of the process that ran it first, {self.by_outage_stop} by its stop while "
            f"Redis was down, {len(self.unexplained)} UNEXPLAINED "
            f"{self.unexplained[:20]}",
            f"hang kills:  {len(self.spurious_hangs)} of children no fault froze ({self.by_spurious} extra "
            f"runs) {self.spurious_hangs[:6]}",
            f"dead:        {dict(self.dead)} {self.dead_keys[:20]}",
            f"drained in:  {_ms(self.drain_s)} after the faults stopped",
            f"leftovers:   {self.leftovers}",
        ]
        lines.append("result:      " + ("OK" if not self.problems else "FAILED: " + "; ".join(self.problems)))
        return "\n".join(lines)


class Soak:
    def __init__(self, server: SoakRedis, seed: int, minutes: float, workdir: Path,
                 hang_timeout: float = HANG_TIMEOUT, fault_every: float = 4.0,
                 faults: tuple[str, ...] = FAULTS, bystander: bool = True) -> None:
        self.faults = faults
        self.with_bystander = bystander
        self.server = server
        self.hang_timeout = hang_timeout
        self.fault_every = fault_every
        self.rng = random.Random(seed)
        self.minutes = minutes
        self.dir = workdir
        self.pidfile = workdir / "forkq.pid"
        self.r = redis.Redis.from_url(server.url, socket_timeout=10)
        self.report = SoakReport(seed=seed, minutes=minutes)
        self.master: subprocess.Popen | None = None
        self.bystander: subprocess.Popen | None = None
        self.generation = 0
        self.killed: dict[int, float] = {}   # pid -> when it was killed uncleanly (epoch)
        self.spurious: set[int] = set()      # of those, killed by a master as hung unfrozen
        # pid -> when it had to stop (its master killed or stopped) while Redis was down: it
        # could neither acknowledge what it finished nor tell anyone, so that runs again
        self.outage_stopped: dict[int, float] = {}
        self.events: list[tuple[float, str, str]] = []
        self.gate = __import__("threading").Lock()   # pushes never straddle a Redis fault
        self.expected: set[str] = set()
        self.batches: dict[str, str] = {}    # callback key -> bid
        self.stop_faults = False
        self.fault_error: BaseException | None = None
        # masters under host names of their own need unshare and root
        self.hosts = os.geteuid() == 0 and shutil.which("unshare") is not None

    # -- processes ----------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        return dict(os.environ, FORKQ_REDIS_URL=self.server.url, FORKQ_PIDFILE=str(self.pidfile),
                    PYTHONPATH=str(ROOT))

    def command(self, processes: int) -> list[str]:
        return [sys.executable, "-m", "forkq", "start", "--require", str(SOAK_APP),
                "--queue", "soak", "--queue", "soak2", "--processes", str(processes), "--concurrency", "5",
                "--hang-timeout", str(self.hang_timeout), "--recovery-delay", str(self.hang_timeout + 3),
                "--heartbeat-interval", "1", "--poll-interval", "1", "--timeout", "5",
                "--log-level", "info", "--log-format", "json"]

    def start_bystander(self) -> None:
        """A second forkq on the same Redis, as on another host (a host name of its own, a
        pidfile of its own), that no fault touches but Redis's: its processes never die, so
        a job that one of them ran and that ran again was taken from a live process (by the
        other forkq's orphan sweep after a Redis fault, say) and is unexplained."""
        log = open(self.dir / "master-bystander.log", "w")
        cmd = self.command(1)
        if self.hosts:
            cmd = ["unshare", "--uts", "sh", "-c", 'hostname soak-bystander && exec "$@"', "sh", *cmd]
        env = dict(self.env(), FORKQ_PIDFILE=str(self.dir / "bystander.pid"))
        self.bystander = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True, cwd=ROOT)
        log.close()
        self.event("bystander_start", f"pid {self.bystander.pid}")

    def start_master(self) -> None:
        self.generation += 1
        log = open(self.dir / f"master-{self.generation}.log", "w")
        cmd = self.command(3)
        host = ""
        if self.hosts and self.rng.random() < 0.5:
            # a host name of its own (a UTS namespace; same pids): the next forkq cannot
            # tell this one's death by its pids, as with a Deployment's replacement pod, so
            # after a whole-forkq kill its jobs come back only by --recovery-delay
            host = f"soak-{self.generation}"
            cmd = ["unshare", "--uts", "sh", "-c", f'hostname {host} && exec "$@"', "sh", *cmd]
        self.master = subprocess.Popen(cmd, env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True, cwd=ROOT)
        log.close()
        self.event("master_start", f"pid {self.master.pid} {host}")
        # systemd's Restart= would not wait, but a fault on a master still importing the app
        # tests nothing more: wait until its children are up (or give up after a while)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(self.children()) < 3:
            if self.master.poll() is not None:
                raise RuntimeError(f"master {self.master.pid} exited with {self.master.returncode} at start")
            time.sleep(0.1)

    def children(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.master.pid).children() if self.master else []
        except psutil.Error:
            return []

    def event(self, kind: str, detail: str = "") -> None:
        self.events.append((time.time(), kind, detail))

    def ping(self) -> None:
        _ping(self.r, timeout=60)

    # -- faults -------------------------------------------------------------------------
    def fault(self, kind: str) -> None:
        self.report.faults[kind] += 1
        getattr(self, "f_" + kind)()

    def _victim(self) -> psutil.Process | None:
        kids = self.children()
        return self.rng.choice(kids) if kids else None

    def f_child_kill(self) -> None:
        kid = self._victim()
        if kid is None:
            return
        os.kill(kid.pid, signal.SIGKILL)
        # the time after the signal: a run recorded before it may have been the victim's
        self.killed[kid.pid] = time.time()
        self.event("child_kill", f"pid {kid.pid}")

    def f_child_hang(self) -> None:
        kid = self._victim()
        if kid is None:
            return
        os.kill(kid.pid, signal.SIGSTOP)
        self.event("child_hang", f"pid {kid.pid} stopped")
        # frozen, it finishes nothing: its completed runs are all recorded before now, and
        # the master SIGKILLs it after --hang-timeout
        self.killed[kid.pid] = time.time()
        deadline = time.monotonic() + self.hang_timeout + 15
        while time.monotonic() < deadline:
            if not psutil.pid_exists(kid.pid) or kid.status() == psutil.STATUS_ZOMBIE:
                self.event("child_hang", f"pid {kid.pid} killed by its master")
                return
            time.sleep(0.1)
        self.report.problems.append(f"a child SIGSTOPped for {self.hang_timeout + 15} s was not killed")
        os.kill(kid.pid, signal.SIGCONT)

    def f_master_kill(self) -> None:
        # the master alone: its children see EOF on their pipes and stop gracefully
        self.event("master_kill", f"pid {self.master.pid}")
        os.kill(self.master.pid, signal.SIGKILL)
        self.master.wait()
        time.sleep(self.rng.uniform(0, 2))
        self.start_master()

    def f_group_kill(self) -> None:
        # the whole forkq at once (a pod SIGKILLed): nothing of it puts anything back
        self._killpg()
        self.event("group_kill", f"pgid {self.master.pid}")
        time.sleep(self.rng.uniform(0, 2))
        self.start_master()

    def _killpg(self) -> None:
        """SIGKILL the master's whole group; its children count as killed from the moment
        after the signal (taken before it, a run recorded meanwhile looked unexplained)."""
        kids = self.children()
        try:
            os.killpg(self.master.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        now = time.time()
        for kid in kids:
            self.killed[kid.pid] = now
        self.master.wait()

    def f_master_term(self) -> None:
        self.event("master_term", f"pid {self.master.pid}")
        code = stop_master(self.master, timeout=30)
        if code != 0:
            self.report.problems.append(f"master exit {code} after TERM")
        self.start_master()

    def f_quiet_stop(self) -> None:
        self.event("quiet_stop", f"pid {self.master.pid}")
        q = subprocess.run([sys.executable, "-m", "forkq", "ctl", "quiet"], env=self.env(), cwd=ROOT,
                           capture_output=True, text=True, timeout=30)
        if q.returncode:
            self.report.problems.append(f"ctl quiet exit {q.returncode}: {q.stderr.strip()[-200:]}")
        time.sleep(self.rng.uniform(0.5, 3))
        s = subprocess.run([sys.executable, "-m", "forkq", "ctl", "stop", "--timeout", "30"], env=self.env(),
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
        if s.returncode:
            self.report.problems.append(f"ctl stop exit {s.returncode}: {s.stderr.strip()[-200:]}")
        code = self.master.wait(30)
        if code != 0:
            self.report.problems.append(f"master exit {code} after ctl stop")
        self.start_master()

    def f_hup(self) -> None:
        # systemctl reload: a rolling restart of the children
        self.event("hup", f"pid {self.master.pid}")
        os.kill(self.master.pid, signal.SIGHUP)

    def _kill_group_later(self, kind: str, sig: int) -> None:
        self.event(kind, f"pid {self.master.pid}")
        os.kill(self.master.pid, sig)
        time.sleep(self.rng.uniform(0.1, 3))
        self._killpg()
        self.start_master()

    def f_quiet_kill(self) -> None:
        # a pod's preStop quiet, then SIGKILL when its grace period runs out
        self._kill_group_later("quiet_kill", signal.SIGTSTP)

    def f_term_kill(self) -> None:
        # TERM, then SIGKILL before the stop ends (systemd's TimeoutStopSec too short)
        self._kill_group_later("term_kill", signal.SIGTERM)

    def f_redis_shutdown(self) -> None:
        with self.gate:
            self.event("redis_shutdown")
            self.server.shutdown()
            self.ping()

    def f_redis_term(self) -> None:
        # SIGTERM (systemctl restart redis): Redis fsyncs the AOF and exits
        with self.gate:
            self.event("redis_term")
            self.server.down(kill=False)
            time.sleep(self.rng.uniform(0, 2))
            self.server.start()
            self.ping()

    def f_redis_freeze(self) -> None:
        # SIGSTOP (a paused VM, a stalled disk): connections are still accepted by the
        # kernel but nothing answers, and its clock runs on, so every key's TTL and every
        # heartbeat's age jump by the freeze at SIGCONT; at times past the recovery delay
        with self.gate:
            seconds = self.rng.uniform(1, self.hang_timeout + 8)
            self.event("redis_freeze", f"{seconds:.1f} s")
            self.server.proc.send_signal(signal.SIGSTOP)
            try:
                time.sleep(seconds)
            finally:
                self.server.proc.send_signal(signal.SIGCONT)
            self.event("redis_freeze_end")

    def f_client_kill(self) -> None:
        # a proxy restarted or a failover: every connection is cut at once while Redis runs
        # on, with commands on the wire, blocked BLMOVEs and replies not yet sent
        with self.gate:
            self.event("client_kill")
            for kind in ("normal", "pubsub"):
                self.r.execute_command("CLIENT", "KILL", "TYPE", kind, "SKIPME", "yes")

    def f_redis_kill9(self) -> None:
        with self.gate:
            self.event("redis_kill9")
            self.server.kill9()
            self.ping()

    def f_client_pause(self) -> None:
        with self.gate:
            seconds = self.rng.uniform(1, 10)  # past the workers' 7 s socket timeout at times
            # WRITE: reads (and scripts flagged no-writes) go on, every write waits
            mode = self.rng.choice(("ALL", "WRITE"))
            self.event("client_pause", f"{seconds:.1f} s {mode}")
            self.r.execute_command("CLIENT", "PAUSE", int(seconds * 1000), mode)
            time.sleep(seconds)

    def f_outage_and_kill(self) -> None:
        # two faults at once: Redis goes down, and while it is down a process dies or is
        # stopped, so whoever should put its jobs back cannot reach Redis at first
        with self.gate:
            kill = self.rng.random() < 0.5
            self.event("outage", "kill -9" if kill else "TERM")
            self.server.down(kill)
            time.sleep(self.rng.uniform(0, 2))
            what = self.rng.choice(("child_kill", "master_kill", "group_kill", "master_term"))
            stopped: list[psutil.Process] = []
            self.report.faults["outage+" + what] += 1
            if what == "child_kill":
                self.f_child_kill()
            else:
                stopped = self.children()
                self.event(what, f"pid {self.master.pid} (Redis down)")
                if what == "master_term":
                    self.master.send_signal(signal.SIGTERM)
                    try:
                        code = self.master.wait(30)
                    except subprocess.TimeoutExpired:
                        code = "none within 30 s"
                    if code != 0:
                        self.report.problems.append(f"master exit {code} after TERM with Redis down")
                else:
                    if what == "group_kill":
                        self._killpg()
                    else:
                        os.kill(self.master.pid, signal.SIGKILL)
                    self.master.wait()
            time.sleep(self.rng.uniform(0, 6))
            self.server.start()
            # what those children finished before Redis came back may be unacknowledged
            now = time.time()
            for kid in stopped if what in ("master_kill", "master_term") else ():
                self.outage_stopped[kid.pid] = now
            self.event("outage_end")
            self.ping()
            if self.master.poll() is not None:
                self.start_master()

    def fault_loop(self, until: float) -> None:
        try:
            while not self.stop_faults and time.monotonic() < until:
                time.sleep(self.rng.uniform(0.5, 1.5) * self.fault_every)
                if self.stop_faults or time.monotonic() >= until:
                    return
                if self.master.poll() is not None:
                    self.report.problems.append(f"master exited by itself with {self.master.returncode}")
                    self.start_master()
                    continue
                self.fault(self.rng.choice(self.faults))
        except BaseException as exc:  # reported by the main thread
            self.fault_error = exc

    # -- pushes -------------------------------------------------------------------------
    def push_some(self, serial: int) -> None:
        from bench import chaos_app as app
        kind = self.rng.choices(("plain", "scheduled", "unique", "batch", "chain", "burst", "items"),
                                (60, 20, 20, 10, 10, 3, 8))[0]
        fail = self.rng.random() < 0.1
        n = serial
        with self.gate:
            for attempt in range(100):
                try:
                    if kind == "plain":
                        keys_ = [f"p{n}"]
                        app.work.enqueue(keys_[0], fail)
                    elif kind == "burst":
                        # a backlog, so children hold full batches and acks wait in them
                        keys_ = [f"p{n}.{i}" for i in range(self.rng.randint(50, 300))]
                        app.work.enqueue_many([(k, self.rng.random() < 0.05) for k in keys_])
                    elif kind == "scheduled":
                        keys_ = [f"s{n}"]
                        app.work.enqueue_in(self.rng.uniform(0.5, 8), keys_[0], fail)
                    elif kind == "unique":
                        keys_ = [f"u{n}"]
                        if app.unique.enqueue(keys_[0], fail) is None:
                            raise RuntimeError(f"unique push of new {keys_[0]} refused")
                    elif kind == "items":
                        # an iterable job of 5-40 items of 0-100 ms: a stop interrupts it
                        # between two items, a crash redoes those since its last checkpoint
                        count = self.rng.randint(5, 40)
                        keys_ = [f"i{n}.{i}" for i in range(count)]
                        app.items.enqueue(f"i{n}", count, fail)
                    elif kind == "batch":
                        size = self.rng.randint(2, 8)
                        keys_ = [f"b{n}.{i}" for i in range(size)] + [f"cb{n}"]
                        batch = forkq.Batch(description=f"soak {n}")
                        batch.on_success(app.callback, f"cb{n}")
                        with batch:
                            for k in keys_[:-1]:
                                app.work.enqueue(k, self.rng.random() < 0.1)
                    else:
                        size = self.rng.randint(2, 4)
                        keys_ = [f"c{n}.{i}" for i in range(size)]
                        forkq.chain(*[(app.work if i % 2 == 0 else app.work.options(queue="soak2")).call(k, fail and i == 1)
                                      for i, k in enumerate(keys_)]).enqueue()
                    self.expected.update(keys_)
                    return
                except REDIS_ERRORS:
                    # the gate keeps Redis faults out, so only a pooled connection that went
                    # stale in the last restart fails here, before anything reached Redis
                    time.sleep(0.05)
            raise RuntimeError("could not push for 100 tries")

    # -- the end ------------------------------------------------------------------------
    def structures(self) -> dict[str, int]:
        out = {}
        for q in SOAK_QUEUES:
            out[f"queue:{q}"] = self.r.llen(f"queue:{q}")
            out[f"suspects:{q}"] = self.r.llen(f"forkq:suspects:{q}")
        out["schedule"] = self.r.zcard("schedule")
        out["retry"] = self.r.zcard("retry")
        held = 0
        for k in self.r.scan_iter(match="forkq:inflight:*"):
            held += self.r.hlen(k)
        for k in self.r.scan_iter(match="forkq:landing:*"):
            held += self.r.llen(k)
        out["in flight"] = held
        return out

    def runs(self) -> dict[str, list[tuple[float, int, str, str]]]:
        out: dict[str, list] = {}
        for raw in self.r.hvals("soak:runs"):
            key, jid, attempt, pid, t = raw.decode().split()
            out.setdefault(key, []).append((float(t), int(pid), jid, attempt))
        for v in out.values():
            v.sort()
        return out

    def dead_jobs(self) -> list[tuple[str, str]]:
        """(key, error class) of each job in the dead set."""
        import json
        out = []
        for raw in self.r.zrange("dead", 0, -1):
            job = json.loads(raw)
            args = job.get("args") or ["?"]
            out.append((str(args[0]), str(job.get("error_class"))))
        return out

    def excused(self, dead: list[tuple[str, str]]) -> set[str]:
        """The keys a dead job keeps from running: itself, an iterable job's items, a batch
        member's callback (on_success waits for every member) and a chain's later steps."""
        out = set()
        for key, _ in dead:
            out.add(key)
            if key.startswith("i"):
                out |= {k for k in self.expected if k.startswith(key + ".")}
            elif key.startswith("b"):
                out.add("cb" + key[1:].split(".")[0])
            elif key.startswith("c") and not key.startswith("cb"):
                n, step = key[1:].split(".")
                out |= {k for k in self.expected
                        if k.startswith(f"c{n}.") and int(k.split(".")[1]) > int(step)}
        return out

    def dead_entries(self) -> None:
        for key, error in self.dead_jobs():
            self.report.dead[error] += 1
            self.report.dead_keys.append(f"{key}:{error}")
            # a job killed in --poison-after deaths may go there (README "Poison jobs");
            # none fails more than once, so nothing else should
            if error != "forkq.PoisonJob":
                self.report.problems.append(f"{key} in dead as {error}")

    def dead_owners(self) -> list[str]:
        """Registered owners that are no live process of either forkq: dead ones whose empty
        private hashes orphan recovery unregisters only after --recovery-delay (a forkq
        killed under another host name than the one now running), so the final check waits."""
        live = set()
        for proc in (self.master, self.bystander):
            try:
                live |= {p.pid for p in psutil.Process(proc.pid).children()} if proc else set()
            except psutil.Error:
                pass
        return [ident for pid, ident in _identities(self.r).items() if pid not in live]

    def drain(self, timeout: float) -> bool:
        t0 = time.monotonic()
        deadline = t0 + timeout
        while time.monotonic() < deadline:
            try:
                if (not any(self.structures().values()) and not self.dead_owners()
                        and self.expected <= set(self.runs()) | self.excused(self.dead_jobs())):
                    self.report.drain_s = time.monotonic() - t0
                    return True
            except REDIS_ERRORS:
                pass
            time.sleep(0.5)
        return False

    def hang_kills(self) -> None:
        """Children the masters killed as hung that no child_hang froze: forkq's own kills of
        healthy children, which make finished but unacknowledged jobs run again."""
        import json
        from datetime import datetime
        frozen = {int(d.split()[1]) for _, k, d in self.events if k == "child_hang" and d.endswith("stopped")}
        for log in sorted(self.dir.glob("master-*.log")):
            for line in log.read_text(errors="replace").splitlines():
                if "stopped pinging" not in line:
                    continue
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                pid = e.get("child_pid")
                if pid in frozen:
                    continue
                when = datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()
                self.report.spurious_hangs.append(f"{pid} silent {e.get('silent_s')} s ({log.name})")
                self.killed.setdefault(pid, when)
                self.spurious.add(pid)

    def analyse(self) -> None:
        rep = self.report
        self.hang_kills()
        runs = self.runs()
        rep.pushed = len(self.expected)
        rep.ran = len(self.expected & set(runs))
        dead = self.excused([tuple(k.split(":", 1)) for k in rep.dead_keys])
        rep.lost = sorted(self.expected - set(runs) - dead)
        for key, rs in runs.items():
            if key not in self.expected:
                rep.problems.append(f"a run of {key}, never pushed")
            if len(rs) < 2:
                continue
            rep.dupes[key] = rs
            for prev, _ in zip(rs, rs[1:]):
                t, pid = prev[0], prev[1]
                if pid in self.spurious and self.killed[pid] >= t:
                    rep.by_spurious += 1
                elif pid in self.killed and self.killed[pid] >= t:
                    rep.explained += 1
                elif pid in self.outage_stopped and self.outage_stopped[pid] >= t:
                    rep.by_outage_stop += 1
                else:
                    rep.unexplained.append(key)
        if rep.lost:
            rep.problems.append(f"{len(rep.lost)} jobs LOST")
        if rep.unexplained:
            rep.problems.append(f"{len(rep.unexplained)} unexplained extra runs")
        if rep.spurious_hangs:
            rep.problems.append(f"{len(rep.spurious_hangs)} children nobody froze killed as hung, "
                                f"{rep.by_spurious} extra runs from it")

    def run(self) -> SoakReport:
        import threading
        t_start = time.monotonic()
        self.start_master()
        if self.with_bystander:
            self.start_bystander()
        until = t_start + self.minutes * 60
        injector = threading.Thread(target=self.fault_loop, args=(until,), daemon=True)
        injector.start()
        serial = 0
        try:
            while time.monotonic() < until and self.fault_error is None:
                self.push_some(serial)
                serial += 1
                time.sleep(self.rng.expovariate(15))  # ~15 pushes a second
            self.stop_faults = True
            injector.join(120)
            if self.fault_error is not None:
                raise self.fault_error
            self.event("faults_end")
            if self.master.poll() is not None:
                self.start_master()
            self.ping()
            if not self.drain(180):
                self.report.problems.append(f"not drained within 180 s: {self.structures()}, "
                                            f"owners of no live process {self.dead_owners()}")
            self.dead_entries()
            self.analyse()
            code = stop_master(self.master, timeout=60)
            if code != 0:
                self.report.problems.append(f"final master exit {code} after TERM")
            if self.bystander is not None:
                if self.bystander.poll() is not None:
                    self.report.problems.append(f"the bystander forkq exited by itself with {self.bystander.returncode}")
                code = stop_master(self.bystander, timeout=60)
                if code != 0:
                    self.report.problems.append(f"bystander exit {code} after TERM")
            self.report.leftovers = {k: v for k, v in self.structures().items() if v}
            owners = self.r.hlen("forkq:owners")
            if owners:
                self.report.leftovers["forkq:owners"] = owners
            locks = sum(1 for _ in self.r.scan_iter(match="unique:*"))
            if locks:
                self.report.leftovers["unique locks"] = locks
            if self.report.leftovers:
                self.report.problems.append("structures left after the final stop")
        finally:
            self.stop_faults = True
            for proc in (self.master, self.bystander):
                if proc is not None and proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            self.report.elapsed_s = time.monotonic() - t_start
        return self.report

    def explain(self) -> str:
        """For each unexplained extra run: its runs and the faults around them."""
        out = []
        for key in sorted(set(self.report.unexplained))[:10]:
            rs = self.report.dupes[key]
            out.append(f"{key}: runs " + "; ".join(f"t={t:.3f} pid={p} jid={j} retry={a}" for t, p, j, a in rs))
            lo, hi = rs[0][0] - 10, rs[-1][0] + 1
            for t, kind, detail in self.events:
                if lo <= t <= hi:
                    out.append(f"    {t:.3f} {kind} {detail}")
        return "\n".join(out)


def soak(minutes: float, seed: int, keep: Path | None = None, hang_timeout: float = HANG_TIMEOUT,
         fault_every: float = 4.0, faults: tuple[str, ...] = FAULTS, bystander: bool = True) -> int:
    random.seed(seed)
    workdir = Path(tempfile.mkdtemp(prefix="forkq-soak-"))
    with SoakRedis() as server:
        forkq.configure(server.url)
        s = Soak(server, seed, minutes, workdir, hang_timeout, fault_every, faults, bystander)
        report = s.run()
    print(report.format())
    if report.unexplained:
        print(s.explain())
    if report.problems or keep:
        dest = keep or workdir
        if keep:
            shutil.copytree(workdir, keep, dirs_exist_ok=True)
        events = "\n".join(f"{t:.3f} {k} {d}" for t, k, d in s.events)
        (dest / "events.txt").write_text(events + "\n")
        print(f"master logs and events kept in {dest}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if report.problems else 0


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
    p.add_argument("--minutes", type=float,
                   help="run the soak instead: every kind of fault at random for this long")
    p.add_argument("--seed", type=int, default=1, help="the soak's random seed")
    p.add_argument("--keep", type=Path, help="the soak: keep master logs and events here")
    p.add_argument("--hang-timeout", type=float, default=HANG_TIMEOUT,
                   help="the soak's --hang-timeout (the recovery delay is 3 s more)")
    p.add_argument("--fault-every", type=float, default=4.0,
                   help="the soak: average seconds between one fault's end and the next")
    p.add_argument("--no-bystander", action="store_true",
                   help="the soak: no second forkq (untouched by faults) beside the one faulted")
    p.add_argument("--faults", help="the soak: only these faults, comma-separated (default: all)")
    a = p.parse_args()
    if a.minutes is not None:
        faults = tuple(a.faults.split(",")) if a.faults else FAULTS
        unknown = sorted(set(faults) - set(FAULTS))
        if unknown:
            p.error(f"--faults: no fault named {', '.join(unknown)} (there are {', '.join(FAULTS)})")
        sys.exit(soak(a.minutes, a.seed, a.keep, a.hang_timeout, a.fault_every, faults, not a.no_bystander))
    with DurableRedis() as server:
        report = run(server.url, server.restart, jobs=a.jobs, processes=a.processes,
                     concurrency=a.concurrency, duration=a.duration, kill_interval=a.kill_interval,
                     poison_after=a.poison_after, log=a.log)
    print(report.format())
    sys.exit(1 if report.problems() else 0)


if __name__ == "__main__":
    main()
