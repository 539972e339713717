"""Orphan recovery: a whole forkq killed at once has its jobs put back by another forkq."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import redis

import forkq
from forkq import keys, orphans
from helpers import CommandHolder, ForkqWorker, wait_until

REPO = Path(__file__).resolve().parent.parent
APP = REPO / "tests" / "apps" / "orphan_jobs.py"


class Instance:
    """One forkq master in its own session (and, with `host`, its own UTS namespace)."""

    def __init__(self, url: str, tmp: Path, name: str, *args: str, host: str | None = None) -> None:
        self.log = tmp / f"{name}.log"
        # --timeout 1: the jobs here sleep for up to 30 s, and a teardown that waited out the
        # default 25 s for them would only slow the suite
        cmd = [sys.executable, "-m", "forkq", "start", "--require", str(APP), "--log-format", "json",
               "--pidfile", str(tmp / f"{name}.pid"), "--heartbeat-interval", "0.5", "--timeout", "1",
               *args]
        if host is not None:
            # a forkq that believes it runs on another host: only the heartbeat rule applies
            cmd = ["unshare", "--uts", "sh", "-c", f'hostname {host} && exec "$@"', "sh", *cmd]
        env = dict(os.environ, FORKQ_REDIS_URL=url, PYTHONPATH=str(REPO))
        self.proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=open(self.log, "w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def events(self, name: str) -> list[dict]:
        out = []
        for line in self.log.read_text().splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == name:
                out.append(event)
        return out

    def kill_all(self) -> None:
        """SIGKILL the master and every child at once, as a power loss would."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        self.kill_all()
        return self.proc.returncode


@pytest.fixture
def instances(redis_url, tmp_path):
    made: list[Instance] = []

    def start(name: str, *args: str, host: str | None = None) -> Instance:
        inst = Instance(redis_url, tmp_path, name, *args, host=host)
        made.append(inst)
        return inst
    yield start
    for inst in made:
        inst.stop()


def _owners_on(r: redis.Redis, host: str) -> list[str]:
    return [i.decode() for i, v in r.hgetall(keys.OWNERS).items() if json.loads(v).get("host") == host]


def _held(r: redis.Redis) -> int:
    return sum(r.hlen(keys.inflight(i.decode())) for i in r.hkeys(keys.OWNERS))


def _private_keys(r: redis.Redis) -> list[bytes]:
    return [k for pat in ("forkq:inflight:*", "forkq:landing:*") for k in r.scan_iter(pat)]


@pytest.mark.timeout(60)
def test_a_restarted_forkq_recovers_its_dead_predecessors_jobs_at_boot(instances, r, redis_url):
    a = instances("a", "--processes", "2", "--concurrency", "2")
    wait_until(lambda: r.hlen(keys.OWNERS) == 2, timeout=20, message="a's children registered")
    jids = forkq.Client(redis_url).push_bulk("orphan.work", [[f"j{i}", 30] for i in range(4)])
    wait_until(lambda: _held(r) == 4, timeout=10, message="a holds all four jobs")
    a.kill_all()
    # the default recovery delay is a minute: only the boot rule can be this quick
    b = instances("b", "--processes", "1", "--concurrency", "4")
    wait_until(lambda: len(b.events("recovered a dead process's jobs")) == 2, timeout=15,
               message="b recovered both of a's children at boot")
    # back as from a crash: suspects, which b runs one at a time, each alone
    wait_until(lambda: _held(r) == 1 and r.llen(keys.suspects("default")) == 3 and r.llen("queue:default") == 0,
               timeout=10, message="b runs one recovered job alone, three wait as suspects")
    assert [r.get(keys.CRASH_PREFIX + jid) for jid in jids] == [b"1"] * 4
    # counted over Sidekiq Pro's window: poison is --poison-after recoveries in 72 hours
    assert all(71 * 3600 < r.ttl(keys.CRASH_PREFIX + jid) <= 72 * 3600 for jid in jids)
    owners = [json.loads(v) for v in r.hvals(keys.OWNERS)]
    assert len(owners) == 1 and owners[0]["pid"] != a.proc.pid


def _held_by(r: redis.Redis, inst: Instance) -> list[str]:
    """Jids in flight in the children of this instance's master."""
    jids = []
    for identity, info in r.hgetall(keys.OWNERS).items():
        if orphans._master_pid(json.loads(info)) == inst.proc.pid:
            jids += [json.loads(v)["jid"] for v in r.hvals(keys.inflight(identity.decode()))]
    return jids


@pytest.mark.timeout(120)
def test_a_job_that_kills_whole_forkqs_goes_dead_after_poison_after_of_them(instances, r, redis_url):
    # a node's death (here every process SIGKILLed at once, as a pod's OOM kill does) while
    # the job runs counts against it as a child's death does: at --poison-after, it is poison
    poison = ("--poison-after", "2", "--processes", "1", "--concurrency", "2")
    jid = forkq.Client(redis_url).push("orphan.work", ["node-killer", 60])
    for n in (1, 2):
        node = instances(f"node{n}", *poison)
        wait_until(lambda: _held_by(r, node) == [jid], timeout=20,
                   message=f"node{n} runs the job\n{node.log.read_text()[-3000:]}")
        node.kill_all()
        # the node before this one was recovered, at this one's boot, as a crash
        assert r.get(keys.CRASH_PREFIX + jid) == (b"1" if n == 2 else None)

    last = instances("node3", *poison)
    wait_until(lambda: last.events("recovered a dead process's jobs"), timeout=20,
               message=f"node3 recovered node2's jobs\n{last.log.read_text()[-3000:]}")
    (raw,) = r.zrange("dead", 0, -1)
    entry = json.loads(raw)
    assert entry["jid"] == jid and entry["args"] == ["node-killer", 60]
    assert entry["error_class"] == "forkq.PoisonJob"
    assert entry["error_message"] == "killed its worker process 2 times"
    assert not r.exists(keys.CRASH_PREFIX + jid)
    assert r.llen(keys.suspects("default")) == 0 and r.llen("queue:default") == 0 and r.llen("orphan:ran") == 0
    (event,) = last.events("recovered a dead process's jobs")
    assert event["poisoned"] == 1


@pytest.mark.timeout(90)
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1) for a second hostname")
def test_another_hosts_dead_forkq_is_recovered_within_the_delay(instances, r, redis_url):
    probe = subprocess.run(["unshare", "--uts", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a UTS namespace here: {probe.stderr.decode().strip()}")
    delay = 3.0
    b = instances("b", "--processes", "1", "--concurrency", "4", "--recovery-delay", str(delay))
    a = instances("a", "--processes", "2", "--concurrency", "2", "--recovery-delay", str(delay),
                  host="forkq-test-host-a")
    wait_until(lambda: len(_owners_on(r, "forkq-test-host-a")) == 2, timeout=20,
               message="a's children registered under their own host name")
    forkq.Client(redis_url).push_bulk("orphan.work", [[f"j{i}", 1] for i in range(4)], queue="a-only")
    # b does not work a-only: only recovery can make these jobs run, and b must not take them early
    a_identities = set(_owners_on(r, "forkq-test-host-a"))
    # eight: b's four threads can hold only four, so some are left for a (with four, an idle
    # b could claim them all before a's fetchers woke, and a would hold nothing)
    forkq.Client(redis_url).push_bulk("orphan.work", [[f"k{i}", 30] for i in range(8)])
    wait_until(lambda: sum(r.hlen(keys.inflight(i)) for i in a_identities) >= 1, timeout=10,
               message="a holds jobs")
    # registration comes before the first heartbeat: wait until every child has beaten
    wait_until(lambda: all(r.hget(i, "beat") for i in a_identities), timeout=10,
               message="a's children heartbeating")
    a.kill_all()
    # measured after the kill: a job finishing between a read and the kill would change the count.
    # A child holds jobs in its landing lists too (a blocking wait moved one in while every
    # thread was busy), and recovery returns those as well.
    held = sum(r.hlen(keys.inflight(i)) for i in a_identities)
    held += sum(r.llen(k) for i in a_identities for k in r.scan_iter(keys.landing(i, "*")))
    last_beat = max(float(r.hget(i, "beat")) for i in a_identities)
    assert held >= 1
    wait_until(lambda: not any(r.exists(keys.inflight(i)) for i in a_identities), timeout=30,
               message="a's private hashes recovered")
    recovered_after = time.time() - last_beat
    # bound: the delay, one sweep interval (max(1, delay/4)), a heartbeat, scheduling slack
    assert delay <= recovered_after + 0.6, f"recovered too early: {recovered_after:.2f}s after the last beat"
    assert recovered_after < delay + 1.0 + 0.5 + 2.0, f"recovered {recovered_after:.2f}s after the last beat"
    # the master logs a recovery after its script ran: the line may land a moment later
    requeued = lambda: sum(e["requeued"] for e in b.events("recovered a dead process's jobs"))  # noqa: E731
    wait_until(lambda: requeued() >= held, timeout=5, message="b's log of the recovery")
    assert requeued() == held
    assert not a_identities & set(i.decode() for i in r.hkeys(keys.OWNERS))


@pytest.mark.timeout(90)
def test_live_processes_are_not_swept_after_a_redis_outage_longer_than_the_delay(tmp_path, own_redis):
    """After an outage every heartbeat is stale; the sweep waits until live ones beat again."""
    url = own_redis.url
    r = own_redis.client()
    a = Instance(url, tmp_path, "a", "--processes", "1", "--concurrency", "2", "--recovery-delay", "2")
    b = Instance(url, tmp_path, "b", "--processes", "1", "--concurrency", "2", "--recovery-delay", "2")
    try:
        wait_until(lambda: r.hlen(keys.OWNERS) == 2, timeout=20, message="both registered")
        # running through the outage and a few sweeps (one a second) after it
        forkq.Client(url).push_bulk("orphan.work", [[f"j{i}", 6] for i in range(4)])
        wait_until(lambda: _held(r) == 4, timeout=10, message="all four jobs held")
        own_redis.pause()
        time.sleep(3)  # the outage itself: longer than the 2 s recovery delay
        own_redis.resume()
        wait_until(lambda: r.llen("orphan:ran") == 4, timeout=40, message="all four jobs ran")
        ran = [x.decode().split(":")[0] for x in r.lrange("orphan:ran", 0, -1)]
        assert sorted(ran) == ["j0", "j1", "j2", "j3"], f"a job ran twice or not at all: {ran}"
        assert not a.events("recovered a dead process's jobs") and not b.events("recovered a dead process's jobs")
        # the pause is shorter than the masters' socket timeout: only the sweep's own timing
        # shows it, and the master that held the sweep lock saw it
        stalled = "Redis stalled during the orphan sweep; no process is judged dead until " \
                  "heartbeats have had time to resume"
        assert a.events(stalled) or b.events(stalled)
    finally:
        a.stop()
        b.stop()


@pytest.mark.timeout(20)
def test_dead_owner_rules(r):
    now = time.time()
    entry = {"queues": ["default"], "host": "elsewhere", "pid": 1, "master": "elsewhere:1:x", "started_at": now}
    r.hset(keys.OWNERS, mapping={
        "fresh-beat": json.dumps(entry),
        "stale-beat": json.dumps(entry),
        "young-no-beat": json.dumps(entry),
        "old-no-beat": json.dumps(dict(entry, started_at=now - 120)),
    })
    r.hset("fresh-beat", "beat", now)
    r.hset("stale-beat", "beat", now - 90)
    dead = {i for i, _ in orphans.dead_owners(r, 60)}
    assert dead == {"stale-beat", "old-no-beat"}
    assert orphans.dead_owners(r, float("inf")) == []
    # only one sweeper at a time
    r.set(orphans.LOCK, "someone-else", px=5000)
    assert orphans.sweep(r, 60, "me") == []
    assert r.hlen(keys.OWNERS) == 4
    r.delete(orphans.LOCK)
    r.rpush(keys.inflight("stale-beat"), "x")  # wrong type would be a bug; use the real format
    r.delete(keys.inflight("stale-beat"))
    r.hset(keys.inflight("stale-beat"), "1", 'default\n{"class":"c","args":[],"jid":"j"}')
    recovered = {identity: counts.requeued for identity, counts in orphans.sweep(r, 60, "me")}
    assert recovered == {"stale-beat": 1, "old-no-beat": 0}
    # back as from a crash: a suspect to run alone, its crash count raised
    assert r.lrange(keys.suspects("default"), 0, -1) == [b'{"class":"c","args":[],"jid":"j"}']
    assert r.get(keys.CRASH_PREFIX + "j") == b"1"
    assert not r.exists("queue:default")
    assert set(r.hkeys(keys.OWNERS)) == {b"fresh-beat", b"young-no-beat"}
    assert not r.exists(orphans.LOCK)


def test_a_dead_master_pid_means_dead_only_in_our_own_pid_namespace(r):
    """Containers of one pod share a hostname but not pids: an owner whose master pid is
    free here may be alive in its own namespace, and only its heartbeat can tell."""
    now = time.time()
    gone = 2**22 + 12345  # past pid_max's default: no process has it here
    assert not psutil.pid_exists(gone)
    entry = {"queues": ["default"], "host": socket.gethostname(), "pid": gone,
             "master": f"{socket.gethostname()}:{gone}:x", "started_at": now}
    r.hset(keys.OWNERS, mapping={
        "same-ns": json.dumps(dict(entry, pidns=orphans.pid_namespace())),
        "other-ns": json.dumps(dict(entry, pidns="another-boot:4026531836")),
        "older-version": json.dumps(entry),
    })
    for identity in ("same-ns", "other-ns", "older-version"):
        r.hset(identity, "beat", now)
    assert orphans.pid_namespace() is not None
    dead = {i for i, _ in orphans.dead_owners(r, 60, this_host_now=True)}
    assert dead == {"same-ns"}


def test_children_that_outlive_their_killed_master_are_not_taken_for_dead(r):
    """A SIGKILLed master's children finish their jobs before they stop: a forkq started
    at once on the host must not start those jobs again beside them."""
    gone = 2**22 + 12346
    here = socket.gethostname()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "forkq child stand-in"])
    try:
        entry = {"queues": ["default"], "host": here, "master": f"{here}:{gone}:x",
                 "started_at": time.time(), "pidns": orphans.pid_namespace()}
        r.hset(keys.OWNERS, mapping={"draining": json.dumps(dict(entry, pid=child.pid)),
                                     "gone-too": json.dumps(dict(entry, pid=gone + 1))})
        r.hset("draining", "beat", time.time())
        r.hset("gone-too", "beat", time.time())
        assert [i for i, _ in orphans.dead_owners(r, 60, this_host_now=True)] == ["gone-too"]
    finally:
        child.kill()
        child.wait()


@pytest.mark.timeout(60)
def test_a_forkq_that_beats_less_often_than_anothers_delay_keeps_its_running_jobs(instances, r, redis_url):
    """Judged by b's one-second delay alone, a's two-second heartbeats look dead half the
    time: b would take the job a is running, and it would run twice. Each owner is given
    at least three of its own heartbeat intervals."""
    a = instances("a", "--processes", "1", "--concurrency", "1", "--heartbeat-interval", "2")
    wait_until(lambda: r.hlen(keys.OWNERS) == 1, timeout=20, message="a's child registered")
    forkq.Client(redis_url).push_bulk("orphan.work", [["once", 5]])
    wait_until(lambda: _held(r) == 1, timeout=10, message="a runs the job")
    b = instances("b", "--processes", "1", "--concurrency", "1", "--recovery-delay", "1")
    wait_until(lambda: r.hlen(keys.OWNERS) == 2, timeout=20, message="b's child registered")
    wait_until(lambda: r.llen("orphan:ran") == 1, timeout=15, message="a finished the job")
    # its ack is batched and follows its record by a moment
    wait_until(lambda: _held_by(r, a) == [], timeout=5, message="a's ack of the job")
    # the moment a's run ended, nothing else holds or waits to run that job
    assert _held(r) == 0 and r.llen("queue:default") == 0 and r.llen(keys.suspects("default")) == 0
    assert not b.events("recovered a dead process's jobs")
    (ran,) = [x.decode() for x in r.lrange("orphan:ran", 0, -1)]
    assert ran.startswith("once:")


def _jids_in(r: redis.Redis, identity: str) -> list[str]:
    return [json.loads(v)["jid"] for v in r.hvals(keys.inflight(identity))]


def _needs_a_second_hostname() -> None:
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) for a second hostname")
    probe = subprocess.run(["unshare", "--uts", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a UTS namespace here: {probe.stderr.decode().strip()}")


@pytest.mark.timeout(60)
def test_a_fleet_of_no_fork_workers_runs_again_the_job_of_one_whose_pod_was_killed(instances, r, redis_url):
    """One --no-fork worker per pod, no master anywhere (Kubernetes): a pod SIGKILLed, or
    whose node vanished, left its running job in its private hash, and no worker ever put
    it back. The other pod is on another host, so only the heartbeat rule can apply."""
    _needs_a_second_hostname()
    # the shortest settings that keep a lease: 3 beats of 0.5 s over a 1 s delay
    timing = ("--no-fork", "--concurrency", "1", "--recovery-delay", "1")
    a = instances("a", *timing, host="forkq-pod-a")
    (a_id,) = wait_until(lambda: _owners_on(r, "forkq-pod-a"), timeout=20, message="a registered")
    jid = forkq.Client(redis_url).push("orphan.work", ["long", 30])
    wait_until(lambda: _jids_in(r, a_id) == [jid], timeout=10, message="a runs the job")
    b = instances("b", *timing)
    (b_id,) = wait_until(lambda: _owners_on(r, socket.gethostname()), timeout=20, message="b registered")
    wait_until(lambda: r.hget(a_id, "beat") and r.hget(b_id, "beat"), timeout=10, message="both beating")
    a.kill_all()
    last_beat = float(r.hget(a_id, "beat"))
    # the README's worst case here: the 1.5 s lease, a 1 s sweep interval and a beat
    wait_until(lambda: _jids_in(r, b_id) == [jid], timeout=15,
               message="b runs the dead pod's job again")
    recovered_after = time.time() - last_beat
    assert recovered_after >= 1.5 - 0.6, f"taken {recovered_after:.2f}s after a's last beat"
    # with the time b takes to see a suspect (a beat) and start it, and scheduling slack
    assert recovered_after < 1.5 + 1.0 + 0.5 + 0.5 + 2.0, f"back {recovered_after:.2f}s after a's last beat"
    (event,) = b.events("recovered a dead process's jobs")
    assert event["owner"] == a_id and event["requeued"] == 1 and event["suspects"] == 1
    assert not r.hexists(keys.OWNERS, a_id) and not r.exists(keys.inflight(a_id))


@pytest.mark.timeout(60)
def test_a_no_fork_worker_restarted_on_its_host_recovers_its_predecessors_jobs_at_boot(instances, r, redis_url):
    """systemd restarting a --no-fork worker after a SIGKILL: as a master does at boot, the new
    one puts back what the old one held at once, without waiting for the (default) delay."""
    a = instances("a", "--no-fork", "--concurrency", "1")
    (a_id,) = wait_until(lambda: r.hkeys(keys.OWNERS), timeout=20, message="a registered")
    jid = forkq.Client(redis_url).push("orphan.work", ["long", 30])
    wait_until(lambda: _jids_in(r, a_id.decode()) == [jid], timeout=10, message="a runs the job")
    a.kill_all()
    b = instances("b", "--no-fork", "--concurrency", "1")
    (event,) = wait_until(lambda: b.events("recovered a dead process's jobs"), timeout=15,
                          message="b recovered a's job at boot")
    assert event["owner"] == a_id.decode() and event["requeued"] == 1
    (b_id,) = wait_until(lambda: [i for i in r.hkeys(keys.OWNERS) if i != a_id], timeout=10,
                         message="b registered")
    wait_until(lambda: _jids_in(r, b_id.decode()) == [jid], timeout=10, message="b runs the job")


@pytest.mark.timeout(60)
def test_masters_and_no_fork_workers_sweep_together_without_taking_a_live_ones_jobs(instances, r, redis_url):
    """A mixed fleet on one Redis, all with a 1 s delay: a master and a --no-fork worker here,
    a --no-fork worker on another host that dies. Its job is put back once, by one of them,
    and the jobs the live ones are running stay theirs through several leases."""
    _needs_a_second_hostname()
    timing = ("--concurrency", "1", "--recovery-delay", "1")
    a = instances("a", "--no-fork", "--queue", "a", *timing, host="forkq-pod-a")
    b = instances("b", "--no-fork", "--queue", "b", *timing)
    m = instances("m", "--processes", "1", "--queue", "m", *timing)
    wait_until(lambda: r.hlen(keys.OWNERS) == 3, timeout=20, message="a, b and m's child registered")
    client = forkq.Client(redis_url)
    jids = {q: client.push("orphan.work", [q, 30], queue=q) for q in "abm"}
    identities = {json.loads(v)["queues"][0]: i.decode() for i, v in r.hgetall(keys.OWNERS).items()}
    wait_until(lambda: all(_jids_in(r, identities[q]) == [jids[q]] for q in "abm"), timeout=10,
               message="each runs its own job")
    wait_until(lambda: all(r.hget(i, "beat") for i in identities.values()), timeout=10,
               message="all beating")
    a.kill_all()
    wait_until(lambda: r.llen(keys.suspects("a")) == 1, timeout=15, message="a's job put back")
    # two leases (1.5 s: 3 beats of 0.5 s), three sweep intervals (1 s)
    until = time.monotonic() + 3
    while time.monotonic() < until:
        for q in "bm":
            assert _jids_in(r, identities[q]) == [jids[q]], f"{q}'s running job was taken from it"
            assert r.hexists(keys.OWNERS, identities[q])
        time.sleep(0.1)  # the pace of the watch, not a synchronisation
    recovered = b.events("recovered a dead process's jobs") + m.events("recovered a dead process's jobs")
    assert [(e["owner"], e["requeued"]) for e in recovered] == [(identities["a"], 1)]
    assert r.lrange(keys.suspects("a"), 0, -1) and r.get(keys.CRASH_PREFIX + jids["a"]) == b"1"
    assert r.llen("queue:a") == 0 and not r.exists(keys.inflight(identities["a"]))


@pytest.mark.timeout(60)
def test_a_no_fork_workers_sweep_stuck_on_redis_holds_up_neither_its_heartbeat_nor_its_jobs(own_redis):
    """The sweep's lock request held on its way, as on a partition that catches only its
    connection: the worker beats, runs jobs and stops in time all the same."""
    holder = CommandHolder(own_redis.port, marker=orphans.LOCK.encode())
    r = own_redis.client()
    worker = ForkqWorker(f"redis://127.0.0.1:{holder.port}/0", APP, concurrency=1,
                         extra_args=["--heartbeat-interval", "0.5", "--recovery-delay", "1",
                                     "--timeout", "1"]).start()
    try:
        assert holder.holding.wait(20), worker.log_tail()
        (identity,) = wait_until(lambda: r.hkeys(keys.OWNERS), timeout=10, message="registered")
        first = wait_until(lambda: r.hget(identity, "beat"), timeout=10, message="a beat")
        wait_until(lambda: r.hget(identity, "beat") != first, timeout=5, message="the next beat")
        forkq.Client(own_redis.url).push("orphan.work", ["quick", 0])
        wait_until(lambda: r.llen("orphan:ran") == 1, timeout=10, message="the job ran")
        started = time.monotonic()
        assert worker.stop(timeout=15) == 0, worker.log_tail()
        assert time.monotonic() - started < 5, "the stop waited for the stuck sweep"
    finally:
        holder.close()
        if worker.proc.poll() is None:
            worker.proc.kill()
            worker.proc.wait()
        r.close()
