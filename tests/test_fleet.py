"""Several forkq masters on one Redis: hosts whose clocks disagree, leases past the
heartbeat's expiry.

Each master is a real `python -m forkq start` in a session of its own. A master that
plays another host runs in a UTS namespace of its own (`unshare --uts`, a hostname of its
own), so another master judges it by its silence, as it would a real remote host, not by
its pid. A host whose clock is off is a master whose Python sees `time.time()` shifted
(a sitecustomize put on its PYTHONPATH), as every wall-clock time it writes would be.
Jobs from tests/apps/fleet_jobs.py count their starts and ends in Redis.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import redis

import forkq
import forkq.control
from forkq import keys, orphans
from helpers import json_lines, stop_gracefully, wait_until

REPO = Path(__file__).resolve().parent.parent
APP = REPO / "tests" / "apps" / "fleet_jobs.py"
APP_V2 = REPO / "tests" / "apps" / "fleet_jobs_v2.py"

SHIFTED_CLOCK = """\
import os
import time

_shift = float(os.environ["FLEET_CLOCK_SHIFT"])
_time, _time_ns = time.time, time.time_ns
time.time = lambda: _time() + _shift
time.time_ns = lambda: _time_ns() + int(_shift * 1e9)
"""


class Fleet:
    """Masters started for one test; every one still running is stopped at teardown."""

    def __init__(self, url: str, tmp: Path) -> None:
        self.url = url
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, *args: str, host: str | None = None,
              clock_shift: float = 0.0) -> subprocess.Popen:
        log = self.tmp / f"{name}.log"
        cmd = [sys.executable, "-m", "forkq", "start", "--require", str(APP), "--log-format", "json",
               "--pidfile", str(self.tmp / f"{name}.pid"), "--processes", "1", "--concurrency", "1",
               "--heartbeat-interval", "0.5", "--timeout", "1", *args]
        if host is not None:
            cmd = ["unshare", "--uts", "sh", "-c", f'hostname {host} && exec "$@"', "sh", *cmd]
        path = [str(REPO)]
        env = dict(os.environ, FORKQ_REDIS_URL=self.url)
        if clock_shift:
            shifted = self.tmp / f"{name}-clock"
            shifted.mkdir()
            (shifted / "sitecustomize.py").write_text(SHIFTED_CLOCK)
            path.insert(0, str(shifted))
            env["FLEET_CLOCK_SHIFT"] = str(clock_shift)
        env["PYTHONPATH"] = os.pathsep.join(path)
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=open(log, "w"),
                                stderr=subprocess.STDOUT, start_new_session=True)
        proc.log = log  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            stop_gracefully(proc, 30)
            try:  # what is left of its group: the children of a master killed alone, say
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _events(proc: subprocess.Popen, name: str) -> list[dict]:
    return [e for e in json_lines(proc.log) if e.get("event") == name]  # type: ignore[attr-defined]


def _owners_on(r: redis.Redis, host: str) -> list[str]:
    return [i.decode() for i, v in r.hgetall(keys.OWNERS).items() if json.loads(v).get("host") == host]


@pytest.fixture
def fleet(redis_url, tmp_path):
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to give a master a host name of its own")
    probe = subprocess.run(["unshare", "--uts", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a UTS namespace here: {probe.stderr.decode().strip()}")
    made = Fleet(redis_url, tmp_path)
    yield made
    made.close()


@pytest.mark.timeout(90)
def test_a_live_forkq_whose_clock_runs_behind_keeps_its_running_job(fleet, r, redis_url):
    """Its heartbeats carry times five minutes old by our clock: judged by them, another
    forkq took it for dead at every sweep and its running job ran a second time."""
    sweeper = fleet.start("sweeper", "--recovery-delay", "1.5")
    wait_until(lambda: r.hlen(keys.OWNERS) == 1, timeout=20, message="the sweeper's child registered")
    slow = fleet.start("slow", "--queue", "slow", host="fleet-slow-clock", clock_shift=-300)
    wait_until(lambda: _owners_on(r, "fleet-slow-clock"), timeout=20,
               message="the slow-clock host's child registered")
    # the sweeper, up since before the slow host registered, judges by silence 2 s after
    # it first reached Redis (its 1.5 s delay and a beat) and sweeps every second: the job
    # runs through a settled sweep or more
    forkq.Client(redis_url).push("fleet.work", ["long", 3.5], queue="slow")
    wait_until(lambda: r.hget("fleet:runs", "long"), timeout=30,
               message=f"the job ran\n{slow.log.read_text()[-2000:]}")  # type: ignore[attr-defined]
    (identity,) = _owners_on(r, "fleet-slow-clock")
    # the job writes its run before its thread acknowledges it, and acks go in batches
    wait_until(lambda: r.hlen(keys.inflight(identity)) == 0, timeout=10, message="the run was acknowledged")
    # nothing else holds the job or waits to run it again
    assert (r.llen("queue:slow"), r.llen(keys.suspects("slow"))) == (0, 0)
    assert r.hget("fleet:starts", "long") == b"1"
    assert not _events(sweeper, "recovered a dead process's jobs")


@pytest.mark.timeout(90)
def test_a_dead_forkq_whose_clock_ran_ahead_is_recovered_within_the_delay(fleet, r, redis_url):
    """Its last heartbeat carried a time five minutes ahead of ours: judged by it, its jobs
    waited those five minutes on top of the recovery delay."""
    delay = 1.5  # the least a lease can be with 0.5 s heartbeats (three of them)
    sweeper = fleet.start("sweeper", "--recovery-delay", str(delay))
    fast = fleet.start("fast", "--queue", "fast", host="fleet-fast-clock", clock_shift=300)
    wait_until(lambda: len(_owners_on(r, "fleet-fast-clock")) == 1, timeout=20,
               message="the fast-clock host's child registered")
    (identity,) = _owners_on(r, "fleet-fast-clock")
    jid = forkq.Client(redis_url).push("fleet.work", ["held", 60], queue="fast")
    wait_until(lambda: r.hlen(keys.inflight(identity)) == 1 and r.hget(identity, "beat"), timeout=20,
               message="the fast-clock host runs the job and has beaten")
    os.killpg(fast.pid, signal.SIGKILL)  # the whole host at once
    fast.wait(10)
    killed = time.monotonic()
    # the delay, a sweep (every second here), a heartbeat, and slack for a shared machine
    wait_until(lambda: r.llen(keys.suspects("fast")) == 1, timeout=delay + 1.0 + 0.5 + 5.0,
               message=f"the dead host's job recovered\n{sweeper.log.read_text()[-2000:]}")  # type: ignore[attr-defined]
    assert time.monotonic() - killed >= delay - 0.6, "recovered before the delay was up"
    assert json.loads(r.lindex(keys.suspects("fast"), 0))["jid"] == jid
    assert not r.exists(keys.inflight(identity)) and not r.hexists(keys.OWNERS, identity)
    assert not r.exists(keys.alive(identity))
    (event,) = _events(sweeper, "recovered a dead process's jobs")
    assert event["owner"] == identity and event["requeued"] == 1


@pytest.mark.timeout(20)
def test_a_recovery_delay_past_the_heartbeats_expiry_is_honoured(r):
    """Sidekiq's heartbeat hash expires 60 s after the last beat. With it gone, a longer
    --recovery-delay went by when the owner registered instead: a process up for an hour
    and silent for 61 s (frozen, or cut off from Redis) lost its running jobs at once."""
    now = time.time()
    entry = {"queues": ["default"], "host": "elsewhere", "pid": 1, "master": "elsewhere:1:x",
             "started_at": now - 3600, "heartbeat_interval": 5}
    r.hset(keys.OWNERS, mapping={"silent-65s": json.dumps(entry), "silent-130s": json.dumps(entry)})
    # what is left of each alive key: the silence, counted by Redis. No heartbeat hash: it
    # expired a while ago
    r.set(keys.alive("silent-65s"), 1, px=(keys.ALIVE_TTL_S - 65) * 1000)
    r.set(keys.alive("silent-130s"), 1, px=(keys.ALIVE_TTL_S - 130) * 1000)
    assert [i for i, _ in orphans.dead_owners(r, 120)] == ["silent-130s"]
    assert sorted(i for i, _ in orphans.dead_owners(r, 60)) == ["silent-130s", "silent-65s"]


@pytest.mark.timeout(60)
def test_a_job_the_old_workers_do_not_know_is_kept_in_dead_even_with_retry_false(fleet, r, redis_url):
    """A rolling deploy: the new code pushes a job of a class it adds, with retry=False, and
    a worker of the old version takes it. It never ran, yet it was dropped, as a failure of
    a job with retry=False is. Kept in dead, it runs once a retry sends it to new code."""
    old = fleet.start("old")
    wait_until(lambda: r.hlen(keys.OWNERS) == 1, timeout=20, message="the old version's child registered")
    jid = forkq.Client(redis_url).push("fleet.added", ["new-job"], retry=False)
    wait_until(lambda: r.zcard("dead") == 1, timeout=10,
               message=f"the job kept in dead\n{old.log.read_text()[-2000:]}")  # type: ignore[attr-defined]
    entry = json.loads(r.zrange("dead", 0, -1)[0])
    assert entry["jid"] == jid and entry["args"] == ["new-job"] and entry["retry"] is False
    assert entry["error_class"] == "forkq.errors.UnknownJob"
    assert "no job named 'fleet.added' is registered" in entry["error_message"]
    assert [e["fate"] for e in _events(old, "fail")] == ["dead"]

    new = fleet.start("new", "--require", str(APP_V2))
    wait_until(lambda: r.hlen(keys.OWNERS) == 2, timeout=20, message="the new version's child registered")
    assert old.send_signal(signal.SIGTERM) is None and old.wait(30) == 0
    done = subprocess.run([sys.executable, "-m", "forkq", "dead", "retry", "--jid", jid],
                          env=dict(os.environ, FORKQ_REDIS_URL=redis_url), cwd=REPO,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    wait_until(lambda: r.hget("fleet:runs", "new-job"), timeout=10,
               message=f"the new version ran it\n{new.log.read_text()[-2000:]}")  # type: ignore[attr-defined]
    assert r.hget("fleet:runs", "new-job") == b"1" and r.zcard("dead") == 0


def _pid_namespaces_usable() -> str | None:
    """Why two containers cannot be imitated here (None: they can)."""
    for tool in ("unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"needs {tool}(1)"
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "--uts", "true"],
                           capture_output=True)
    if probe.returncode != 0:
        return f"cannot make PID and UTS namespaces here: {probe.stderr.decode().strip()}"
    return None


@pytest.mark.timeout(90)
def test_ctl_check_in_one_of_two_containers_with_one_hostname_judges_its_own_children(redis_url, r, tmp_path):
    """Two containers given the same hostname each number their processes from 1, so their
    children have the same pids. Matched by host and pid alone, `ctl check` (a pod's probe)
    in a container whose children had stopped beating read the other's, and said ok."""
    problem = _pid_namespaces_usable()
    if problem:
        pytest.skip(problem)
    env = dict(os.environ, FORKQ_REDIS_URL=redis_url, PYTHONPATH=str(REPO))
    env.pop("FORKQ_PIDFILE", None)
    env.pop("FORKQ_CONFIG", None)
    boxes = {}
    try:
        for name in ("healthy", "frozen"):
            cmd = ["unshare", "--pid", "--fork", "--mount-proc", "--uts", "sh", "-c",
                   'hostname fleet-shared-name && exec "$@"', "sh",
                   sys.executable, "-m", "forkq", "start", "--require", str(APP), "--processes", "1",
                   "--heartbeat-interval", "0.5", "--log-format", "json",
                   "--pidfile", str(tmp_path / f"{name}.pid")]
            boxes[name] = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=open(tmp_path / f"{name}.log", "w"),
                                           stderr=subprocess.STDOUT, start_new_session=True)
        wait_until(lambda: r.scard("processes") == 2, timeout=30, message="both containers' children beat")

        def master(name: str) -> psutil.Process | None:
            for proc in psutil.Process(boxes[name].pid).children(recursive=True):
                if "forkq master" in " ".join(proc.cmdline()):
                    return proc
            return None
        masters = {name: wait_until(lambda n=name: master(n), timeout=10, message=f"{name} master")
                   for name in boxes}
        # the premise: the same pid on both sides, as the kernel hands them out in order (one
        # child each: with more, a child's thread can take the next one's pid first)
        in_box = [json.loads(r.hget(m, "info"))["pid"] for m in r.smembers("processes")]
        assert in_box[0] == in_box[1], in_box
        frozen = masters["frozen"].children()
        for child in frozen:
            child.suspend()
        try:
            wait_until(lambda: sum(1 for hb in forkq.control.heartbeats(r) if hb["beat_age"] > 3) == 1,
                       timeout=10, message="the frozen container's child fell silent")

            def check(name: str) -> subprocess.CompletedProcess:
                return subprocess.run(
                    ["nsenter", "-t", str(masters[name].pid), "-p", "-u", "-m", "--", sys.executable, "-m",
                     "forkq", "ctl", "check", "--max-age", "3", "--pidfile", str(tmp_path / f"{name}.pid")],
                    env=env, cwd=REPO, capture_output=True, text=True, timeout=30)
            ok, bad = check("healthy"), check("frozen")
            assert ok.returncode == 0, ok.stderr
            assert ok.stdout.strip() == "ok: master 1, 1 children heartbeating"
            assert bad.returncode == 1, bad.stdout
            assert bad.stderr.strip() == "forkq: unhealthy: master 1 has 1 children, 1 without a recent heartbeat"
        finally:
            for child in frozen:
                child.resume()
    finally:
        for proc in boxes.values():
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
