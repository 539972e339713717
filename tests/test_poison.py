"""Crash suspects are isolated: real masters, real children, real SIGKILLs.

When a child dies, every job in its in-flight hash gets its crash count (forkq:crashes:JID)
raised; one that reaches --poison-after goes to dead as forkq.PoisonJob, the others go to
their queue's forkq:suspects:QUEUE list. A worker whose heartbeat sees suspects on its
queues stops claiming, waits until it is idle, and runs them one at a time, each alone, so a later crash counts against the one
job that was running. Jobs come from tests/apps/supervised_jobs.py and record every run in
sup:events with the pid that ran it; waiting is always a deadline (wait_until).
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

import forkq
from forkq import keys, payload
from helpers import wait_beats, wait_until
from test_supervisor import APPS, FORK_DELAY, Master, assert_clean, push, queued_jids, sup_events, wait_event

SUSPECTS = keys.suspects("default")
HEARTBEAT = ["--heartbeat-interval", "0.2"]  # isolation starts within 0.2 s of a crash
ISOLATING = "isolating suspects: no new jobs until they have run, one at a time, alone"


@pytest.fixture
def start_master(redis_url, tmp_path):
    """start_master(processes=, concurrency=, args=) -> a running Master, fast heartbeat."""
    started: list[Master] = []

    def start(**kwargs) -> Master:
        kwargs["args"] = [*HEARTBEAT, *kwargs.get("args", ())]
        m = Master(redis_url, tmp_path / f"master{len(started)}", **kwargs)
        started.append(m)
        return m.start()

    yield start
    for m in started:
        try:
            m.kill()
        finally:
            print(m.tail(60))


def crash_count(r, jid: str) -> int | None:
    raw = r.get(f"forkq:crashes:{jid}")
    return None if raw is None else int(raw)


def crash_keys(r) -> list[bytes]:
    return list(r.scan_iter(match="forkq:crashes:*"))


def suspect_jids(r) -> list[str]:
    """Jids on the suspects list, left to right (the rightmost runs next)."""
    return [json.loads(raw)["jid"] for raw in r.lrange(SUSPECTS, 0, -1)]


def dead_jobs(r) -> list[dict]:
    return [json.loads(raw) for raw in r.zrange("dead", 0, -1)]


def assert_ran_alone(r, run: dict, done: dict) -> None:
    """Nothing else recorded an event in that process between the run's start and done."""
    assert run["pid"] == done["pid"]
    beside = [e for e in sup_events(r) if e["pid"] == run["pid"] and e["tag"] != run["tag"]
              and run["at"] < e["at"] < done["at"]]
    assert not beside, f"{run['tag']} did not run alone: {beside}"


def all_clear(r) -> None:
    """No suspect waits and no crash count is left behind."""
    wait_until(lambda: r.llen(SUSPECTS) == 0 and not crash_keys(r), timeout=5, interval=0.05,
               message=f"suspects={suspect_jids(r)} crash keys={crash_keys(r)}")


# -- the innocent job beside a poison job -------------------------------------------------------


@pytest.mark.timeout(45)
def test_an_innocent_job_beside_a_poison_job_runs_alone_and_only_the_poison_goes_dead(
        start_master, redis_url, r):
    m = start_master(processes=1, concurrency=3, args=["--poison-after", "3"])
    m.wait_slots()
    innocent = push(redis_url, "sup.sleep", "innocent", 2)
    wait_event(r, m, "start", "innocent")
    poison = push(redis_url, "sup.suicide", "poison")

    # the poison killed the child the innocent ran in: both are suspects, and the
    # replacement runs the innocent (the older claim) first, alone
    runs = wait_event(r, m, "start", "innocent", count=2)
    assert crash_count(r, innocent) == 1
    waiting = [push(redis_url, "sup.quick", f"q{i}") for i in range(5)]

    def dead_poison():
        m.check()
        return [e for e in dead_jobs(r) if e["jid"] == poison]
    (entry,) = wait_until(dead_poison, timeout=20, interval=0.05, message=f"poison in dead\n{m.tail()}")
    assert entry["error_class"] == "forkq.PoisonJob"
    assert entry["error_message"] == "killed its worker process 3 times"
    assert "forkq_original" not in entry  # the payload is kept as it was, not re-encoded
    assert [e["jid"] for e in dead_jobs(r)] == [poison], "only the job that kills its process is poison"

    (done,) = wait_event(r, m, "done", "innocent")
    assert_ran_alone(r, runs[1], done)
    poison_runs = sup_events(r, "start", "poison")
    assert len(poison_runs) == 3 and len({e["pid"] for e in poison_runs}) == 3

    def quick_done():
        m.check()
        found = {e["tag"]: e for e in sup_events(r, "done") if e["tag"].startswith("q")}
        return found if len(found) == len(waiting) else None
    quick = wait_until(quick_done, timeout=10, interval=0.05, message=f"quick jobs done\n{m.tail()}")
    assert min(e["at"] for e in quick.values()) > done["at"], "jobs pushed during isolation waited"

    alone = [e["jid"] for e in m.log_events("running a suspect alone")]
    assert sorted(alone) == sorted([innocent, poison, poison])
    # each isolation here ended with its process: the poison killed it
    assert len(m.log_events(ISOLATING)) == 2 and not m.log_events("isolation ended")
    # the first death held both jobs; the poison's later deaths, alone, held it only
    requeues = [(e["requeued"], e["suspects"], e["poisoned"])
                for e in m.log_events("requeued a child's in-flight jobs")]
    assert requeues == [(2, 2, 0), (1, 1, 0), (0, 0, 1)]
    all_clear(r)

    m.signal(signal.SIGTERM)
    assert m.wait(15) == 0
    (stopped,) = m.log_events("master stopped")
    assert (stopped["requeued"], stopped["suspects"], stopped["poisoned"]) == (3, 3, 1)
    assert_clean(r, m, set())


def push_without_jid(r, name: str, *args) -> bytes:
    """A job as a client that leaves out the jid writes it (forkq runs it all the same)."""
    raw = json.dumps({"class": name, "args": list(args), "queue": "default"}).encode()
    r.sadd("queues", "default")
    r.lpush("queue:default", raw)
    return raw


@pytest.mark.timeout(45)
def test_a_poison_job_without_a_jid_goes_dead_and_its_innocent_neighbour_is_cleared(
        start_master, redis_url, r):
    """Crash counts were kept by jid only: a job without one went back onto its queue
    uncounted after each death it caused, and crashed the fleet forever."""
    m = start_master(processes=1, concurrency=3, args=["--poison-after", "3"])
    m.wait_slots()
    push_without_jid(r, "sup.sleep", "innocent", 2)
    wait_event(r, m, "start", "innocent")
    poison = push_without_jid(r, "sup.suicide", "poison")

    def dead_poison():
        m.check()
        return dead_jobs(r)
    (entry,) = wait_until(dead_poison, timeout=20, interval=0.05, message=f"poison in dead\n{m.tail()}")
    assert entry["class"] == "sup.suicide" and entry["error_class"] == "forkq.PoisonJob"
    assert entry["error_message"] == "killed its worker process 3 times"
    assert len(sup_events(r, "start", "poison")) == 3
    # the innocent ran alone after the first death, and its count went when it ended
    runs = wait_event(r, m, "start", "innocent", count=2)
    (done,) = wait_event(r, m, "done", "innocent")
    assert_ran_alone(r, runs[1], done)
    all_clear(r)
    assert r.llen("queue:default") == 0
    assert poison.rstrip(b"}") in r.zrange("dead", 0, -1)[0]  # its own bytes, the reason appended

    m.signal(signal.SIGTERM)
    assert m.wait(15) == 0


# -- a crash while a suspect runs alone; other children keep working ----------------------------


@pytest.mark.timeout(45)
def test_a_kill_while_a_suspect_runs_alone_counts_against_it_only_and_others_flow(
        start_master, redis_url, r):
    m = start_master(processes=2, concurrency=2, args=["--poison-after", "3"])
    m.wait_slots()
    victim = push(redis_url, "sup.sleep", "victim", 2)
    (first,) = wait_event(r, m, "start", "victim")
    os.kill(first["pid"], signal.SIGKILL)
    runs = wait_event(r, m, "start", "victim", count=2)
    alone_pid = runs[1]["pid"]
    assert crash_count(r, victim) == 1

    # while the suspect runs alone, the other child takes everything else
    bystander = push(redis_url, "sup.sleep", "bystander", 2)
    forkq.Client(redis_url).push_bulk("sup.quick", [[f"q{i}"] for i in range(10)])
    (b_run,) = wait_event(r, m, "start", "bystander")
    quick = wait_event(r, m, "done", None, count=10)
    assert b_run["pid"] != alone_pid
    assert alone_pid not in {e["pid"] for e in quick}
    assert not sup_events(r, "done", "victim") and not sup_events(r, "done", "bystander")

    # a crash now has one job in flight: only the suspect's count goes up
    os.kill(alone_pid, signal.SIGKILL)
    runs = wait_event(r, m, "start", "victim", count=3)
    assert crash_count(r, victim) == 2
    assert crash_count(r, bystander) is None
    (b_done,) = wait_event(r, m, "done", "bystander")
    assert len(sup_events(r, "start", "bystander")) == 1
    (done,) = wait_event(r, m, "done", "victim", timeout=10)
    assert_ran_alone(r, runs[2], done)
    assert not dead_jobs(r)

    killed = [e for e in m.log_events("requeued a child's in-flight jobs")
              if e["identity"].split(":")[-2] == str(alone_pid)]
    assert [(e["requeued"], e["suspects"], e["poisoned"]) for e in killed] == [(1, 1, 0)]
    all_clear(r)
    assert_clean(r, m, set(m.wait_slots().values()))


# -- several suspects: one at a time per process, each alone ------------------------------------


@pytest.mark.timeout(30)
def test_suspects_run_one_at_a_time_each_alone_while_ordinary_jobs_flow(start_master, redis_url, r):
    # suspects as a crash leaves them: the payload on its queue's list, a crash count each
    suspects = []
    for i in range(3):
        job = payload.build("sup.sleep", [f"suspect{i}", 0.5], retry=0)
        r.lpush(SUSPECTS, payload.dumps(job))
        r.set(f"forkq:crashes:{job['jid']}", 1)
        suspects.append(job["jid"])
    client = forkq.Client(redis_url)
    client.push_bulk("sup.sleep", [[f"plain{i}", 0.5] for i in range(4)])
    client.push_bulk("sup.quick", [[f"q{i}"] for i in range(20)])

    m = start_master(processes=2, concurrency=3)
    wait_event(r, m, "done", None, count=3 + 4 + 20, timeout=20)
    for i in range(3):
        (run,) = sup_events(r, "start", f"suspect{i}")
        (done,) = sup_events(r, "done", f"suspect{i}")
        assert_ran_alone(r, run, done)
    assert sorted(e["jid"] for e in m.log_events("running a suspect alone")) == sorted(suspects)
    assert not dead_jobs(r)
    all_clear(r)
    assert_clean(r, m, set(m.wait_slots().values()))


# -- a graceful stop while a suspect runs alone ---------------------------------------------------


@pytest.mark.timeout(45)
def test_a_stop_during_isolation_puts_the_suspect_back_on_the_suspects_list_and_exits_0(
        start_master, redis_url, r):
    m = start_master(processes=1, concurrency=2, args=["--timeout", "1"])
    m.wait_slots()
    victim = push(redis_url, "sup.sleep", "victim", 3)
    (first,) = wait_event(r, m, "start", "victim")
    os.kill(first["pid"], signal.SIGKILL)
    wait_event(r, m, "start", "victim", count=2)
    waiting = push(redis_url, "sup.quick", "waiting")  # no job starts beside the suspect

    m.signal(signal.SIGTERM)
    sent = time.monotonic()
    assert m.wait(10) == 0
    assert time.monotonic() - sent < 1 + 4
    # cut off by the stop, it is still a suspect: next in line on the suspects list, with
    # its crash count, not back on its queue where it would run beside others again
    assert suspect_jids(r) == [victim]
    assert crash_count(r, victim) == 1
    assert queued_jids(r) == [waiting]
    assert not sup_events(r, "done")
    (ended,) = m.log_events("isolation ended")
    assert ended["stopping"] is True
    assert_clean(r, m, set())

    # the next master runs it, alone, to its end; nothing is left behind
    m2 = start_master(processes=1, concurrency=2)
    (done,) = wait_event(r, m2, "done", "victim", timeout=15)
    runs = sup_events(r, "start", "victim")
    assert len(runs) == 3
    assert_ran_alone(r, runs[2], done)
    wait_event(r, m2, "done", "waiting")
    assert not dead_jobs(r)
    all_clear(r)
    assert_clean(r, m2, set(m2.wait_slots().values()))


# -- a quiet worker does not isolate -------------------------------------------------------------


@pytest.mark.timeout(30)
def test_a_quiet_worker_leaves_suspects_alone(start_master, redis_url, r):
    m = start_master(processes=1, concurrency=2)
    (pid,) = m.wait_slots().values()
    child = wait_until(lambda: next((i.decode() for i in r.smembers("processes") if f":{pid}:".encode() in i),
                                    None), timeout=10, message=f"child {pid}'s heartbeat")
    m.signal(signal.SIGTSTP)
    wait_until(lambda: m.log_events("quiet: no new jobs will start"), timeout=5, interval=0.05,
               message=f"the child to be quiet\n{m.tail()}")
    job = payload.build("sup.quick", ["suspect"], retry=0)
    r.lpush(SUSPECTS, payload.dumps(job))
    r.set(f"forkq:crashes:{job['jid']}", 1)
    wait_beats(r, child, count=5)  # five heartbeats: a non-quiet worker would have run it by now
    assert suspect_jids(r) == [job["jid"]]
    assert not m.log_events(ISOLATING)
    assert not sup_events(r, "done")
    m.signal(signal.SIGTERM)
    assert m.wait(10) == 0
    assert suspect_jids(r) == [job["jid"]]


# -- the claim script's edges, called directly ---------------------------------------------------


@pytest.mark.timeout(10)
def test_a_suspect_claim_puts_back_what_no_thread_holds_and_a_resent_claim_hands_over_the_same(r):
    from forkq.fetch import ReliableFetch
    from forkq.queues import QueueOrder

    fetch = ReliableFetch(r, "test:1:000000000000", QueueOrder([("default", 0)]))
    plain = payload.build("sup.quick", ["plain"], retry=0)
    stale = payload.build("sup.quick", ["stale"], retry=0)   # a suspect left in flight
    r.set(f"forkq:crashes:{stale['jid']}", 1)
    r.hset(fetch.inflight_key, mapping={"7": "default\n" + payload.dumps(plain),
                                        "8": "default\n" + payload.dumps(stale)})
    fresh = payload.build("sup.quick", ["fresh"], retry=0)
    r.lpush(SUSPECTS, payload.dumps(fresh))
    r.set(f"forkq:crashes:{fresh['jid']}", 1)

    unit, leftovers = fetch.claim_suspect()
    assert leftovers == 2
    assert queued_jids(r) == [plain["jid"]]       # never a suspect: back on its queue
    # still a suspect: back at the head of the suspects list, so claimed first
    assert json.loads(unit.raw)["jid"] == stale["jid"] and unit.queue == "default"
    assert suspect_jids(r) == [fresh["jid"]]
    assert r.hkeys(fetch.inflight_key) == [unit.token.encode()]

    # the same call sent again (its reply lost): the claim it made is handed over again.
    # The hash entries above are in the form earlier versions wrote ("TOKEN" -> "QUEUE\n
    # PAYLOAD"); the claim is in today's ("TOKEN\nQUEUE" -> PAYLOAD)
    assert unit.token == "1\ndefault" and r.hget(fetch.inflight_key, unit.token) == unit.raw
    again = fetch._claim_suspect(keys=[fetch.inflight_key, SUSPECTS],
                                 args=["1", 0, 0, "forkq:crashes:", keys.SUSPECTS_PREFIX, "default"])
    assert again[1:] == [unit.token.encode(), b"default", unit.raw]
    assert suspect_jids(r) == [fresh["jid"]]

    # it ran to its end: its ack and its crash count's delete ride on the next claim
    fetch.ack(unit.token)
    fetch.suspect_done(stale["jid"])
    unit2, leftovers = fetch.claim_suspect()
    assert leftovers == 0 and json.loads(unit2.raw)["jid"] == fresh["jid"]
    assert crash_count(r, stale["jid"]) is None
    assert r.hkeys(fetch.inflight_key) == [unit2.token.encode()]
    # unit2 was never acked, so nobody holds it (a claim whose reply was lost): the next
    # claim puts it back among the suspects and claims it again, under its own token
    unit3, leftovers = fetch.claim_suspect()
    assert leftovers == 1 and unit3.raw == unit2.raw and unit3.token != unit2.token
    assert r.hkeys(fetch.inflight_key) == [unit3.token.encode()]
    assert crash_count(r, fresh["jid"]) == 1
    assert r.llen(SUSPECTS) == 0 and queued_jids(r) == [plain["jid"]]
    fetch.ack(unit3.token)
    assert fetch.claim_suspect() == (None, 0)
    assert r.hlen(fetch.inflight_key) == 0


@pytest.mark.timeout(10)
def test_a_suspect_claim_takes_from_this_processs_queues_only_in_their_order(r):
    from forkq.fetch import ReliableFetch
    from forkq.queues import QueueOrder

    fetch = ReliableFetch(r, "test:1:000000000000", QueueOrder([("high", 0), ("low", 0)]))
    jobs = {q: payload.build("sup.quick", [q], queue=q, retry=0) for q in ("other", "low", "high")}
    for q, job in jobs.items():
        r.lpush(keys.suspects(q), payload.dumps(job))
    claimed = []
    while (unit := fetch.claim_suspect()[0]) is not None:
        claimed.append((unit.queue, json.loads(unit.raw)["jid"]))
        fetch.ack(unit.token)
    assert claimed == [("high", jobs["high"]["jid"]), ("low", jobs["low"]["jid"])]
    # another app's queue: not this process's to run
    assert [json.loads(raw)["jid"] for raw in r.lrange(keys.suspects("other"), 0, -1)] == [jobs["other"]["jid"]]


# -- two apps on one Redis: each runs its own suspects only ----------------------------------------


@pytest.mark.timeout(60)
def test_another_apps_suspects_neither_pause_nor_run_in_this_app(start_master, redis_url, r):
    # app A (the sup.* jobs, queue mail) and app B (orphan.work only, queue billing) share a
    # Redis. A's replacement child takes 3 s to start, so for 3 s after a crash in A nobody
    # but B could take A's suspect: B must leave it alone and keep working.
    a = start_master(processes=1, concurrency=2, args=["--queue", "mail"])
    b = start_master(processes=1, concurrency=2, args=["--queue", "billing"], app=APPS / "orphan_jobs.py")
    client = forkq.Client(redis_url)
    client.push("orphan.work", ["warm-up", 0], queue="billing")
    wait_until(lambda: r.llen("orphan:ran") == 1, timeout=15, message=f"B at work\n{b.tail()}")
    victim = client.push("sup.sleep", ["victim", 1.5], queue="mail")
    (first,) = wait_event(r, a, "start", "victim", timeout=15)
    r.set(FORK_DELAY, 3)  # read by A's on_fork hook: its replacement child takes 3 s to start
    os.kill(first["pid"], signal.SIGKILL)
    wait_until(lambda: a.log_events("requeued a child's in-flight jobs"), timeout=5, interval=0.02,
               message=f"A requeued its dead child's job\n{a.tail()}")

    client.push_bulk("orphan.work", [[f"b{i}", 0] for i in range(5)], queue="billing")
    wait_until(lambda: r.llen("orphan:ran") == 6, timeout=5, interval=0.02,
               message=f"B ran its own jobs\n{b.tail()}")
    assert not b.log_events(ISOLATING), "B paused its own work for A's suspect"
    # A's replacement is still starting: its suspect waits for it, on its own queue's list
    assert [json.loads(raw)["jid"] for raw in r.lrange(keys.suspects("mail"), 0, -1)] == [victim]

    (done,) = wait_event(r, a, "done", "victim", timeout=15)
    assert done["pid"] in a.slots().values()
    assert [e["jid"] for e in a.log_events("running a suspect alone")] == [victim]
    assert not b.log_events(ISOLATING) and not b.log_events("running a suspect alone")
    assert not b.log_events("fail") and r.zcard("retry") == 0 and r.zcard("dead") == 0
    wait_until(lambda: r.llen(keys.suspects("mail")) == 0 and not crash_keys(r), timeout=5,
               interval=0.05, message=f"crash keys={crash_keys(r)}")
