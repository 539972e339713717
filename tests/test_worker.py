"""A real `forkq start --no-fork` worker: running jobs, queue order, stopping, Redis trouble,
heartbeat and stats.

Workers are subprocesses running tests/apps/core_jobs.py (see tests/corekit.py); they
are SIGKILLed at teardown if a test leaves one running.
"""

import json
import re
import signal
import socket
import threading
import time
from collections import Counter
from datetime import datetime, timezone

import psutil
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

import forkq
from forkq import keys
from forkq.fetch import ReliableFetch, Waiters, requeue_owner_counts, settle_acks
from forkq.manager import Manager
from forkq.queues import QueueOrder
from corekit import (UnixSocketRedis, core_jobs, forkq_client, queued, records,  # noqa: F401
                     seen, wait_records, workers)
from helpers import CommandCutter, CommandHolder, wait_until

IDENTITY = re.compile(r"\A[^:]+:\d+:[0-9a-f]{12}\Z")


def _ids(recs):
    return [rec["args"][0] for rec in recs]


def _forkq_keys(r):
    """forkq's keys, less the stray scan's pass schedule: a --no-fork worker scans as a
    master does, and the rest until the next pass (an expiring key) is the fleet's, not
    something of the process left behind."""
    return sorted(k.decode() for k in r.keys("forkq:*") if k != keys.STRAYS_REST.encode())


# -- running jobs -------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_runs_queued_jobs_once_each_and_acks_them(workers, forkq_client, r):
    core_jobs.record.enqueue_many([[i] for i in range(50)])
    worker = workers(concurrency=4)
    done = wait_records(r, 50, worker, kind="record")
    assert sorted(_ids(done)) == list(range(50))

    # a job pushed while the worker idles (blocked in Redis) starts promptly too
    pushed = time.time()
    core_jobs.record.enqueue("late")
    (late,) = wait_records(r, 51, worker, kind="record", timeout=5)[50:]
    assert late["args"] == ["late"] and late["t"] - pushed < 1.0

    assert not r.exists("queue:default")
    wait_until(lambda: r.hlen(f"forkq:inflight:{worker.identity}") == 0, timeout=5,
               message="in-flight hash emptied by the acks")
    assert r.zcard("retry") == 0 and r.zcard("dead") == 0


@pytest.mark.timeout(30)
def test_a_job_reads_its_own_payload_with_current_job(workers, forkq_client, r):
    jid = core_jobs.whoami.enqueue("me")
    worker = workers(concurrency=2)
    first, again = wait_records(r, 2, worker, kind="whoami")
    assert first["jid"] == again["jid"] == jid
    assert (first["retry_count"], again["retry_count"]) == (None, 0)  # its retry knows it is one


@pytest.mark.timeout(30)
def test_idle_threads_keep_taking_jobs_while_one_runs_a_long_job(workers, forkq_client, r):
    """Processors claim for themselves as they finish: the two threads left beside a long
    job must work through every short job while it still runs, batch after batch."""
    core_jobs.sleepy.enqueue(3, "long")
    worker = workers(concurrency=3)
    wait_records(r, 1, worker, kind="start")
    core_jobs.record.enqueue_many([[i] for i in range(200)])
    done = wait_records(r, 200, worker, kind="record", timeout=2.5)
    assert sorted(_ids(done)) == list(range(200))
    assert records(r, "end") == []  # the long job is still running
    wait_records(r, 1, worker, kind="end", timeout=5)


@pytest.mark.timeout(60)
def test_every_ack_is_sent_when_a_burst_of_short_jobs_runs_dry(workers, forkq_client, r):
    """The last jobs of a burst end while another thread's claim finds the queue empty:
    their acks still reach Redis, with nothing left to claim to carry them."""
    worker = workers(concurrency=10)
    inflight = f"forkq:inflight:{worker.identity}"
    # The race is at each burst's end, whatever its size: with that ack left unsent, about
    # one burst in four stalled, of 200 jobs as of 2,000. So many short bursts: 25 of 500
    # miss it about once in 1,000 runs (15 of 2,000: once in 75), in half the time.
    for round_ in range(25):
        core_jobs.add.enqueue_many([[round_, i] for i in range(500)])
        wait_until(lambda: r.llen("queue:default") == 0 and r.hlen(inflight) == 0, timeout=5,
                   interval=0.02, message=f"burst {round_} acknowledged")


@pytest.mark.timeout(30)
def test_blocking_jobs_claimed_together_run_side_by_side(workers, forkq_client, r):
    """Ten 1-second jobs on ten threads take about a second, not ten."""
    core_jobs.sleepy.enqueue_many([[1, str(i)] for i in range(10)])
    worker = workers(concurrency=10)
    ends = wait_records(r, 10, worker, kind="end", timeout=8)
    starts = records(r, "start")
    assert max(e["t"] for e in ends) - min(s["t"] for s in starts) < 2.5


@pytest.mark.timeout(30)
def test_strict_queue_order_runs_all_of_a_before_b(workers, forkq_client, r):
    core_jobs.record.options(queue="b").enqueue_many([["b", i] for i in range(20)])
    core_jobs.record.options(queue="a").enqueue_many([["a", i] for i in range(20)])
    worker = workers(queues=["a", "b"], concurrency=1)
    done = wait_records(r, 40, worker, kind="record")
    assert [rec["args"] for rec in done] == (
        [["a", i] for i in range(20)] + [["b", i] for i in range(20)])


@pytest.mark.timeout(30)
def test_weighted_queues_favour_the_heavier_queue(workers, forkq_client, r):
    core_jobs.record.options(queue="a").enqueue_many([["a", i] for i in range(100)])
    core_jobs.record.options(queue="b").enqueue_many([["b", i] for i in range(100)])
    worker = workers(queues=["a,3", "b,1"], concurrency=1)
    done = wait_records(r, 200, worker, kind="record")
    first = Counter(rec["args"][0] for rec in done[:60])
    # each pick leads with a 3 times in 4: expect ~45 a of 60. The bounds below fail by
    # chance with probability ~1e-6 (a <= 30) and ~1e-8 (no b at all).
    assert first["a"] > 30, first
    assert first["b"] >= 1, first
    # within a queue, FIFO still holds
    assert [rec["args"][1] for rec in done if rec["args"][0] == "a"] == list(range(100))


@pytest.mark.timeout(30)
def test_equal_weights_interleave_queues(workers, forkq_client, r):
    core_jobs.record.options(queue="a").enqueue_many([["a", i] for i in range(40)])
    core_jobs.record.options(queue="b").enqueue_many([["b", i] for i in range(40)])
    worker = workers(queues=["a,1", "b,1"], concurrency=1)
    done = wait_records(r, 80, worker, kind="record")
    first = Counter(rec["args"][0] for rec in done[:40])
    assert first["a"] >= 1 and first["b"] >= 1, first  # strict order would give 40 a


@pytest.mark.timeout(30)
def test_a_copy_forked_by_job_code_ends_with_the_job_and_writes_nothing(workers, forkq_client, r):
    worker = workers(concurrency=3)
    hows = ["return", "exit", "raise"]
    for how in hows:
        core_jobs.forks.enqueue(how, how)

    originals = wait_records(r, 3, worker, kind="forks")
    copies = [rec["copy"] for rec in originals]
    wait_records(r, 3, worker, kind="copy")

    def copies_gone():
        for pid in copies:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    return False
            except psutil.NoSuchProcess:
                pass
        return True

    # each copy ends where the job's code handed back to the worker, not later as a stray
    wait_until(copies_gone, timeout=5, message="forked copies to exit")
    worker.signal(signal.SIGTERM)
    assert worker.wait_exit(timeout=10) == 0
    # the copies wrote no outcome: no retry for the one that raised or called sys.exit,
    # and each job ran once
    assert sorted(rec["args"][0] for rec in originals) == sorted(hows)
    assert not r.exists("retry") and not r.exists("dead") and not r.exists("queue:default")
    assert int(r.get("stat:failed") or 0) == 0
    assert int(r.get("stat:processed")) == 3
    assert _forkq_keys(r) == []


# -- stopping -----------------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_long_job_at_stop_goes_back_first_in_line(workers, forkq_client, r, signum):
    worker = workers(concurrency=1, timeout=1)
    core_jobs.sleepy.enqueue(30, "long")
    wait_records(r, 1, worker, kind="start")
    core_jobs.record.enqueue("behind")  # waits behind the long job (one processor)
    (original,) = r.hvals(f"forkq:inflight:{worker.identity}")

    sent = time.monotonic()
    worker.signal(signum)
    assert worker.wait_exit(timeout=10) == 0
    assert time.monotonic() - sent < 5

    # the interrupted job is back, byte for byte, at the right end: the next to run
    assert r.lindex("queue:default", -1) == original
    assert [j["args"] for j in queued(r)] == [[30, "long"], ["behind"]]
    assert not records(r, "end")
    assert _forkq_keys(r) == []
    assert worker.identity.encode() not in r.smembers("processes")
    assert not r.exists(f"{worker.identity}:workers") and not r.exists(f"{worker.identity}:work")
    assert r.zcard("retry") == 0 and r.zcard("dead") == 0  # a stop is not a failure


@pytest.mark.timeout(30)
def test_sigttin_during_a_stop_dumps_the_threads_still_draining(workers, forkq_client, r):
    """A stop that waits on a job is when an operator asks where it is: TTIN then still
    dumps the threads (the command loop has ended by then), and the stop goes on."""
    worker = workers(concurrency=1, timeout=20)
    core_jobs.sleepy.enqueue(3, "draining")
    wait_records(r, 1, worker, kind="start")
    worker.signal(signal.SIGTERM)
    wait_until(lambda: "stopping" in worker.log_path.read_text(), timeout=5, message="the stop began")
    worker.signal(signal.SIGTTIN)

    def dump():
        found = [json.loads(line) for line in worker.log_path.read_text().splitlines()
                 if line.startswith("{") and "thread dump" in line]
        return [d for d in found if d.get("thread") == "forkq-processor-0"]
    (job_thread,) = wait_until(dump, timeout=5, message="a thread dump during the stop")
    assert "sleepy" in job_thread["stack"]
    assert worker.wait_exit(timeout=15) == 0
    assert [rec["args"] for rec in records(r, "end")] == [["draining"]]


@pytest.mark.timeout(30)
def test_several_interrupted_jobs_go_back_in_their_original_order(workers, forkq_client, r):
    core_jobs.sleepy.enqueue_many([[30, tag] for tag in "ABCDE"])
    worker = workers(concurrency=3, timeout=1)
    wait_records(r, 3, worker, kind="start")
    assert sorted(rec["args"][0] for rec in records(r, "start")) == ["A", "B", "C"]

    worker.signal(signal.SIGTERM)
    assert worker.wait_exit(timeout=10) == 0
    # A, B and C were taken first, so they are first in line again, ahead of D and E
    assert [j["args"][1] for j in queued(r)] == ["A", "B", "C", "D", "E"]
    assert _forkq_keys(r) == []


@pytest.mark.timeout(30)
def test_short_job_at_stop_finishes_and_is_not_requeued(workers, forkq_client, r):
    worker = workers(concurrency=2, timeout=10)
    core_jobs.sleepy.enqueue(1, "short")
    wait_records(r, 1, worker, kind="start")
    worker.signal(signal.SIGTERM)
    assert worker.wait_exit(timeout=10) == 0

    assert [rec["args"] for rec in records(r, "end")] == [["short"]]
    assert not r.exists("queue:default")
    assert _forkq_keys(r) == []
    assert worker.identity.encode() not in r.smembers("processes")
    assert int(r.get("stat:processed")) == 1


@pytest.mark.timeout(30)
def test_sigtstp_quiets_the_worker_while_the_running_job_finishes(workers, forkq_client, r):
    worker = workers(concurrency=1, timeout=5)
    core_jobs.sleepy.enqueue(1.5, "running")
    wait_records(r, 1, worker, kind="start")
    core_jobs.record.enqueue("must wait")
    worker.signal(signal.SIGTSTP)

    wait_until(lambda: r.hget(worker.identity, "quiet") == b"true", timeout=3,
               message="heartbeat quiet=true")
    wait_records(r, 1, worker, kind="end", timeout=5)
    # Proving a job does NOT start needs a window of time: give it a generous one.
    time.sleep(1.0)
    worker.assert_alive()
    assert not records(r, "record")
    assert [j["args"] for j in queued(r)] == [["must wait"]]

    worker.signal(signal.SIGTERM)
    assert worker.wait_exit(timeout=10) == 0
    assert [j["args"] for j in queued(r)] == [["must wait"]]
    assert _forkq_keys(r) == []


@pytest.mark.timeout(30)
def test_a_quiet_worker_leaves_new_jobs_to_others(workers, forkq_client, r):
    quiet = workers(concurrency=1)  # idle: blocked in Redis waiting for a job
    quiet.signal(signal.SIGTSTP)
    wait_until(lambda: r.hget(quiet.identity, "quiet") == b"true", timeout=3,
               message="heartbeat quiet=true")
    core_jobs.record.enqueue("for someone else")
    other = workers(concurrency=1)

    (rec,) = wait_records(r, 1, quiet, other, kind="record", timeout=8)
    assert rec["pid"] == other.proc.pid  # not held back by the quiet worker
    assert not r.exists(f"forkq:landing:{quiet.identity}:default")
    quiet.assert_alive()


@pytest.mark.timeout(30)
def test_sigkill_leaves_the_running_job_in_the_private_inflight_hash(workers, forkq_client, r):
    worker = workers(concurrency=1)
    jid = core_jobs.sleepy.enqueue(30, "doomed")
    wait_records(r, 1, worker, kind="start")
    worker.signal(signal.SIGKILL)
    worker.wait_exit(timeout=5)

    (identity,) = [k.decode() for k in r.hkeys("forkq:owners")]
    assert identity == worker.identity
    assert json.loads(r.hget("forkq:owners", identity))["queues"] == ["default"]
    ((field, raw),) = r.hgetall(f"forkq:inflight:{identity}").items()
    number, queue = field.split(b"\n", 1)  # "TOKEN\nQUEUE" -> PAYLOAD
    assert number.isdigit() and queue == b"default"
    assert json.loads(raw)["jid"] == jid
    assert not r.exists("queue:default")  # not in the queue: only the private hash has it


@pytest.mark.timeout(30)
def test_worker_over_a_unix_socket(workers):
    with UnixSocketRedis() as server:
        worker = workers(url=server.unix_url, concurrency=1)
        jid = core_jobs.record.options(client=forkq.Client(server.unix_url)).enqueue("unix")
        conn = server.client()
        try:
            (rec,) = wait_records(conn, 1, worker, kind="record")
            assert rec["args"] == ["unix"]
            assert [p["jid"] for p in seen(conn)] == [jid]
        finally:
            conn.close()
        assert worker.stop(timeout=15) == 0


# -- Redis trouble ------------------------------------------------------------------------


def _run_through(own_redis, workers, redis_url, r, monkeypatch, disrupt, n=200):
    """Push n short jobs to own_redis, disrupt it while they run, and check none is lost."""
    monkeypatch.setenv("CORE_RECORD_URL", redis_url)  # records survive the disruption
    worker = workers(url=own_redis.url, concurrency=4, timeout=5)
    client = forkq.Client(own_redis.url)
    # 200 jobs of 30 ms on 4 threads: ~1.5 s of work, so the disruption lands mid-run
    core_jobs.sleepy.options(client=client).enqueue_many([[0.03, i] for i in range(n)])
    wait_records(r, 20, worker, kind="end")
    disrupt()
    assert len(records(r, "end")) < n, "the jobs all ended before the disruption was over"
    try:
        ended = wait_records(r, n, worker, kind="end", timeout=30)
    except AssertionError as exc:
        missing = set(range(n)) - {rec["args"][0] for rec in records(r, "end")}
        conn = own_redis.client()
        try:
            state = {k.decode(): conn.type(k).decode() for k in conn.keys("*")}
            inflight = conn.hgetall(f"forkq:inflight:{worker.identity}")
            landing = {k.decode(): conn.lrange(k, 0, -1) for k in conn.keys("forkq:landing:*")}
        finally:
            conn.close()
        raise AssertionError(f"{exc}\nmissing: {sorted(missing)}\nkeys: {state}\n"
                             f"in flight: {inflight}\nlanding: {landing}\n"
                             f"worker log:\n{worker.log_tail(60)}") from None
    ids = Counter(rec["args"][0] for rec in ended)
    assert set(ids) == set(range(n)), f"lost: {sorted(set(range(n)) - set(ids))}"
    worker.assert_alive()
    conn = own_redis.client()
    try:
        assert conn.llen("queue:default") == 0
        assert conn.zcard("retry") == 0 and conn.zcard("dead") == 0
        # the worker's heartbeat is back on the restarted server
        wait_until(lambda: worker.identity.encode() in conn.smembers("processes"), timeout=10,
                   message="heartbeat back in processes")
    finally:
        conn.close()
    return ids, worker


@pytest.mark.timeout(90)
def test_worker_survives_a_redis_restart_without_losing_jobs(own_redis, workers, redis_url, r,
                                                            monkeypatch):
    ids, worker = _run_through(own_redis, workers, redis_url, r, monkeypatch, own_redis.restart)
    # at-least-once: a job whose ack was lost may run twice, never zero times
    assert all(count >= 1 for count in ids.values())
    assert worker.stop(timeout=15) == 0


@pytest.mark.timeout(60)
def test_worker_started_while_redis_is_down_begins_once_it_is_up(own_redis, workers, redis_url,
                                                                 r, monkeypatch):
    monkeypatch.setenv("CORE_RECORD_URL", redis_url)
    own_redis.stop()
    worker = workers(url=own_redis.url, ready=False)
    # its own log is the only sign that it has tried and failed to reach Redis
    wait_until(lambda: worker.assert_alive() or "unreachable" in worker.log_path.read_text(),
               timeout=10, message="the worker noticing Redis is down")
    own_redis.start()
    conn = own_redis.client()
    try:
        worker.wait_ready(conn, timeout=15)
    finally:
        conn.close()
    core_jobs.record.options(client=forkq.Client(own_redis.url)).enqueue("after boot")
    wait_records(r, 1, worker, kind="record")


@pytest.mark.timeout(30)
def test_a_fetch_sent_again_after_a_lost_reply_claims_nothing_twice(own_redis):
    """redis-py resends a command whose reply timed out (forkq claims through redis-py
    under Sentinel). If the first copy ran, the copy must hand over its claims, not claim
    new jobs under the same tokens (losing the first)."""
    forkq.Client(own_redis.url).push_bulk("Any", [[i] for i in range(6)])
    conn = redis.Redis(host="127.0.0.1", port=own_redis.port, socket_timeout=0.3,
                       retry=Retry(NoBackoff(), 8))  # attempts for ~2.7 s: resume lands in one
    admin = own_redis.client()
    fetch = ReliableFetch(conn, "test:1:000000000000", QueueOrder([("default", 0)]), direct=False)
    try:
        fetch.fetch(0)  # loads the script, so the copies stuck in the pause are runnable
        own_redis.pause()
        resume = threading.Timer(0.7, own_redis.resume)  # while redis-py is still retrying
        resume.start()
        try:
            units = fetch.fetch(2)
        finally:
            resume.join()
        # every copy that reached Redis ran once it resumed: still just the first two claimed
        assert [json.loads(u.raw)["args"] for u in units] == [[0], [1]]
        assert admin.hlen(fetch.inflight_key) == 2
        assert admin.llen("queue:default") == 4
        assert fetch.recover_uncertain() == 0
    finally:
        conn.close()
        admin.close()


@pytest.mark.timeout(20)
@pytest.mark.parametrize("script", ["_fetch", "_claim_suspect"])
def test_the_final_requeue_keeps_out_finished_jobs_whose_acks_ride_a_stuck_claim(own_redis, script):
    """A stop while Redis is frozen: a claim carrying finished jobs' acks (an ordinary one,
    or a crash suspect's to run alone) is stuck on its socket, and the final requeue, sent
    later on another connection, can reach Redis first. It put those finished jobs back on
    their queue, to run a second time."""
    holder = CommandHolder(own_redis.port)
    admin = own_redis.client()
    identity = "test:1:000000000000"
    fetch = ReliableFetch(redis.Redis(port=holder.port), identity, QueueOrder([("default", 0)]))
    caught: list[BaseException] = []

    def claim() -> None:
        try:
            fetch.fetch(1) if script == "_fetch" else fetch.claim_suspect()
        except BaseException as exc:  # reported below, not lost in the thread
            caught.append(exc)

    stuck = threading.Thread(target=claim)
    try:
        fetch.register()
        forkq.Client(own_redis.url).push_bulk("Any", [[i] for i in range(3)])
        finished = fetch.fetch(3)
        assert len(finished) == 3
        for unit in finished:
            fetch.ack(unit.token)
        holder.marker = getattr(fetch, script).sha.encode()
        stuck.start()
        assert holder.holding.wait(5)
        requeued, _ = fetch.requeue_all()  # what a stop does once its deadline passed
        assert requeued == 0
        assert admin.llen("queue:default") == 0
    finally:
        holder.close()
        if stuck.ident is not None:  # started
            stuck.join(5)
        admin.close()
    assert caught == []


@pytest.mark.timeout(20)
def test_the_final_requeue_waits_for_a_stuck_flush_of_acks(own_redis):
    """As above, for acks a quiet process flushes on their own (no claims then): the
    flush's HDEL stuck on a frozen Redis, the final requeue sent beside it put its
    finished jobs back."""
    holder = CommandHolder(own_redis.port)
    admin = own_redis.client()
    fetch = ReliableFetch(redis.Redis(port=holder.port), "test:1:000000000000",
                          QueueOrder([("default", 0)]))
    flusher = threading.Thread(target=fetch.flush_acks)
    requeue = threading.Thread(target=fetch.requeue_all)  # what a stop does past its deadline
    try:
        fetch.register()
        forkq.Client(own_redis.url).push_bulk("Any", [[i] for i in range(3)])
        for unit in fetch.fetch(3):
            fetch.ack(unit.token)
        holder.marker = b"HDEL"
        flusher.start()
        assert holder.holding.wait(5)
        requeue.start()
        requeue.join(0.5)  # the old code's requeue was done by now, ahead of the HDEL
        holder.release.set()
        requeue.join(5)
        assert admin.llen("queue:default") == 0
    finally:
        holder.close()
        for thread in (flusher, requeue):
            if thread.ident is not None:  # started
                thread.join(5)
        admin.close()


@pytest.mark.timeout(20)
def test_a_stopping_child_hands_its_master_the_acks_of_a_flush_stuck_on_the_wire(own_redis):
    """Redis frozen past the stop's grace, with a quiet child's flush of acks stuck on its
    socket: the child hands the master the fields of its finished jobs (unsent_acks) so
    that the master deletes them before its requeue, which can reach Redis first. The
    batch the stuck flush carried was in neither the pending acks nor a claim's, so it was
    not handed over, and those finished jobs went back on their queue to run again."""
    holder = CommandHolder(own_redis.port)
    admin = own_redis.client()
    identity = "test:1:000000000000"
    fetch = ReliableFetch(redis.Redis(port=holder.port), identity, QueueOrder([("default", 0)]))
    flusher = threading.Thread(target=fetch.flush_acks)
    try:
        fetch.register()
        forkq.Client(own_redis.url).push_bulk("Any", [[i] for i in range(3)])
        finished = fetch.fetch(3)
        for unit in finished:
            fetch.ack(unit.token)
        holder.marker = b"HDEL"
        flusher.start()
        assert holder.holding.wait(5)
        told = fetch.unsent_acks()  # what the child writes to its master as "A" lines
        assert sorted(told) == sorted((u.token, ()) for u in finished)
        # the master, once it killed the child: those entries out, then the requeue
        settle_acks(admin, identity, told)
        assert requeue_owner_counts(admin, identity, ["default"]).requeued == 0
        assert admin.llen("queue:default") == 0
    finally:
        holder.close()
        if flusher.ident is not None:  # started
            flusher.join(5)
        admin.close()
    assert fetch.unsent_acks() == []  # the flush went through once released


@pytest.mark.timeout(30)
def test_jobs_a_stuck_claim_brings_back_after_quiet_began_are_given_back_not_run(own_redis):
    """A stop while Redis is frozen: a processor's claim stuck on its socket returns once
    Redis wakes, after the stop gave up waiting (and maybe after its final requeue put
    those jobs back). The processor started the jobs it brought, so they ran twice. Here a
    processor's take() is driven by hand, with no other thread of the manager running."""
    holder = CommandHolder(own_redis.port)
    admin = own_redis.client()
    identity = "test:1:000000000000"
    manager = Manager(lambda: redis.Redis(port=holder.port), identity,
                      QueueOrder([("default", 0)]), concurrency=2)
    taken: list = []
    bell = threading.Lock()
    bell.acquire()  # held while its processor is awake, as Handoff.get wants
    processor = threading.Thread(target=lambda: taken.append(manager.take(bell)))
    try:
        manager.fetch.register()
        manager._fetcher_leads = False  # as after the fetcher's first claim
        forkq.Client(own_redis.url).push_bulk("Any", [[1], [2]])
        holder.marker = manager.fetch._fetch.sha.encode()
        processor.start()
        assert holder.holding.wait(5), "the processor's claim never went out"
        manager.quiet()  # SIGTERM arrives while the claim is stuck
        holder.release.set()
        wait_until(lambda: taken or admin.hlen(keys.inflight(identity)) == 2, timeout=5,
                   message="the claim's reply")
        manager._give_back_unstarted()  # the fetcher thread's part of a stop
        processor.join(5)
        assert taken == [None]  # told to stop, not handed a job
        assert admin.llen("queue:default") == 2
        assert admin.hlen(keys.inflight(identity)) == 0
    finally:
        holder.close()
        if processor.ident is not None:
            manager._handoff.put_many([None])
            processor.join(5)
        admin.close()


@pytest.mark.timeout(30)
def test_a_suspect_a_stuck_claim_brings_back_after_quiet_began_goes_back_unstarted(own_redis):
    """As above, for the claim of a crash suspect to run alone: it was handed to the
    processors whatever the time, and a sleeping one could start it after the stop."""
    holder = CommandHolder(own_redis.port)
    admin = own_redis.client()
    identity = "test:1:000000000000"
    manager = Manager(lambda: redis.Redis(port=holder.port), identity,
                      QueueOrder([("default", 0)]), concurrency=2)
    isolating = threading.Thread(target=manager._isolate)
    try:
        manager.fetch.register()
        admin.lpush(keys.suspects("default"), b'{"class":"Any","args":[1],"jid":"0123456789abcdef01234567"}')
        holder.marker = manager.fetch._claim_suspect.sha.encode()
        isolating.start()
        assert holder.holding.wait(5), "the suspect's claim never went out"
        manager.quiet()  # SIGTERM arrives while the claim is stuck
        holder.release.set()
        isolating.join(5)
        assert not isolating.is_alive()
        assert manager._handoff.drain() == []  # nothing handed to a processor
        manager._give_back_unstarted()  # the fetcher thread's part of a stop
        assert admin.llen(keys.suspects("default")) == 1
        assert admin.hlen(keys.inflight(identity)) == 0
    finally:
        holder.close()
        if isolating.ident is not None:
            isolating.join(5)
        admin.close()


@pytest.mark.timeout(20)
def test_a_blocking_wait_whose_reply_is_lost_still_hands_over_its_job(own_redis):
    """A BLMOVE whose reply is lost has moved a job into the landing list. Sent again
    (redis-py retries on a broken connection) it would block on an empty queue and the
    fetcher would never look at that list: the job would wait for the next arrival."""
    cutter = CommandCutter(own_redis.port, armed=False)  # BLMOVE is sent before arming
    admin = own_redis.client()
    fetch = ReliableFetch(admin, "test:1:000000000000", QueueOrder([("default", 0)]),
                          block_timeout=1.0, direct=False)
    woken = threading.Event()
    waiters = Waiters(fetch, lambda: redis.Redis(port=cutter.port, socket_timeout=3), woken.set,
                      lambda exc: None)
    try:
        waiters.start()
        waiters.arm()
        wait_until(lambda: any(c.get("cmd") == "blmove" for c in admin.client_list()),
                   message="the waiter blocking in BLMOVE")
        cutter.armed.set()
        forkq.Client(own_redis.url).push_bulk("Any", [[1]])
        assert cutter.cut.wait(5)
        assert woken.wait(5), "the fetcher was never told a job may have landed"
        (unit,) = fetch.fetch(1)
        assert json.loads(unit.raw)["args"] == [1]
    finally:
        waiters.stop(2)
        cutter.close()
        admin.close()


@pytest.mark.timeout(10)
def test_a_resent_claim_naming_a_queue_twice_hands_over_each_job_once(own_redis):
    """A claim may name a queue twice (its landing list, then the queue itself). The copy
    of it sent again finds the first run's claims by field, "TOKEN\\nQUEUE": each must come
    back once, or a job would run twice."""
    forkq.Client(own_redis.url).push_bulk("Any", [[i] for i in range(4)])
    admin = own_redis.client()
    fetch = ReliableFetch(own_redis.client(), "test:1:000000000000", QueueOrder([("default", 0)]),
                          direct=False)
    landing = "forkq:landing:test:1:000000000000:default"
    admin.lmove("queue:default", landing, "RIGHT", "LEFT")  # as a blocking wait does
    # want 3, no acks, may be a resend, from token 1, no unique locks; the landing list's
    # queue, the queue
    args = [3, 0, 1, 1, 0, "default", "default"]
    keys_ = [fetch.inflight_key, landing, "queue:default"]
    first = fetch._fetch(keys=keys_, args=args)
    again = fetch._fetch(keys=keys_, args=args)
    assert first[0] == [1, 2]  # one job from the landing list, two from the queue
    fields = again[1::3]
    assert again[0] == -1 and sorted(fields) == [b"1\ndefault", b"2\ndefault", b"3\ndefault"]
    assert again[3::3] == first[1] + first[2]
    assert admin.hlen(fetch.inflight_key) == 3 and admin.llen("queue:default") == 1
    admin.close()


@pytest.mark.timeout(30)
def test_jobs_claimed_by_a_fetch_that_failed_are_put_back(own_redis):
    """The claim timed out (the direct path never resends), but the script ran: those
    claims go back to the queue."""
    forkq.Client(own_redis.url).push_bulk("Any", [[i] for i in range(4)])
    conn = redis.Redis(host="127.0.0.1", port=own_redis.port, socket_timeout=0.3,
                       retry=Retry(NoBackoff(), 0))
    admin = own_redis.client()
    fetch = ReliableFetch(conn, "test:1:000000000000", QueueOrder([("default", 0)]))
    try:
        fetch.fetch(0)
        own_redis.pause()
        try:
            with pytest.raises(redis.TimeoutError):
                fetch.fetch(3)
        finally:
            own_redis.resume()
        # the copy sent before the timeout still ran: three jobs held, nobody running them
        wait_until(lambda: admin.hlen(fetch.inflight_key) == 3, timeout=5,
                   message="the timed-out fetch's claims")
        units = fetch.fetch(4)  # puts them back first, then claims in the original order
        assert [json.loads(u.raw)["args"] for u in units] == [[0], [1], [2], [3]]
        assert admin.hlen(fetch.inflight_key) == 4
    finally:
        conn.close()
        admin.close()


@pytest.mark.timeout(30)
def test_the_fields_a_claim_writes_are_the_tokens_its_jobs_carry(own_redis):
    """The script writes each job's in-flight field ("TOKEN\\nQUEUE") itself, building the
    token's digits from its tens; the worker names the same field when it acknowledges. A
    field that differed would leave a finished job in flight, to run again after a crash."""
    admin = own_redis.client()
    client = forkq.Client(own_redis.url)
    fetch = ReliableFetch(own_redis.client(), "test:1:000000000000", QueueOrder([("default", 0)]))
    landing = "forkq:landing:test:1:000000000000:default"
    try:
        # straight through the script, from tokens that are not multiples of ten, across a
        # tens boundary, and split between a landing list and the queue
        for first in (1, 7, 95, 1009):
            client.push_bulk("Any", [[i] for i in range(12)])
            for _ in range(4):
                admin.lmove("queue:default", landing, "RIGHT", "LEFT")
            reply = fetch._fetch(keys=[fetch.inflight_key, landing, "queue:default"],
                                 args=[12, 0, 0, first, 0, "default", "default"])
            assert reply[0] == [4, 8]
            assert sorted(admin.hkeys(fetch.inflight_key)) == sorted(
                f"{t}\ndefault".encode() for t in range(first, first + 12))
            admin.delete(fetch.inflight_key)
        # and through the fetcher, claims of changing sizes, each acknowledged by its tokens
        client.push_bulk("Any", [[i] for i in range(60)])
        fetch._next_token = 3
        for want in (7, 10, 13, 1, 9, 20):
            units = fetch.fetch(want)
            assert len(units) == want
            assert sorted(admin.hkeys(fetch.inflight_key)) == sorted(u.token.encode() for u in units)
            for unit in units:
                fetch.ack(unit.token)
            fetch.flush_acks()
            assert admin.exists(fetch.inflight_key) == 0
    finally:
        fetch.close()
        admin.close()


@pytest.mark.timeout(30)
def test_a_landing_list_is_drained_across_claims_and_then_left_alone(own_redis):
    """A landing list holding more than one claim takes is drained over the next claims
    (oldest first, ahead of the queue); once a claim finds it short, later claims stop
    asking it, so a claim costs one RPOP again."""
    admin = own_redis.client()
    client = forkq.Client(own_redis.url)
    fetch = ReliableFetch(own_redis.client(), "test:1:000000000000", QueueOrder([("default", 0)]))
    try:
        client.push_bulk("Any", [[i] for i in range(5)])
        landing = "forkq:landing:test:1:000000000000:default"
        for _ in range(5):  # as BLMOVE does: oldest rightmost
            admin.lmove("queue:default", landing, "RIGHT", "LEFT")
        client.push_bulk("Any", [[i] for i in range(5, 10)])
        fetch._landed.add("default")
        admin.config_resetstat()
        got = fetch.fetch(3) + fetch.fetch(3) + fetch.fetch(3) + fetch.fetch(3)
        assert [json.loads(u.raw)["args"][0] for u in got] == list(range(10))
        assert admin.llen(landing) == 0
        stats = admin.info("commandstats")
        # claims: 3 from landing; 2 from landing + 1 from the queue; then queue only
        assert stats["cmdstat_rpop"]["calls"] == 1 + 2 + 1 + 1
    finally:
        fetch.close()
        admin.close()


@pytest.mark.timeout(30)
def test_a_job_given_back_from_the_landing_list_puts_its_queue_back_in_queues(redis_url, r):
    """Sidekiq's Clear (Queue#clear) SREMs the queue from `queues`; a job a blocking wait
    had caught, given back at quiet or pause, waited on a queue nothing listed, unseen by
    Sidekiq's Web UI and Stats and by `forkq stats`, as the requeue scripts' once did."""
    fetch = ReliableFetch(redis.Redis.from_url(redis_url), "test:1:00000000000l",
                          QueueOrder([("cleared", 0)]))
    try:
        forkq.Client(redis_url).push("Any", [1], queue="cleared")
        assert fetch.wait_for("cleared", fetch.redis)
        r.delete("queue:cleared")
        r.srem("queues", "cleared")  # what Queue#clear does
        assert fetch.give_back_landed("cleared") == 1
        assert r.llen("queue:cleared") == 1 and r.smembers("queues") == {b"cleared"}
        assert fetch.give_back_landed("cleared") == 0
    finally:
        fetch.close()


@pytest.mark.timeout(30)
def test_the_claim_connection_outlives_a_server_side_close_and_a_script_flush(own_redis):
    """The claim runs on a connection of the fetcher's own: one the server dropped while
    idle is replaced before sending, and a Redis that forgot the script gets its body."""
    forkq.Client(own_redis.url).push_bulk("Any", [[i] for i in range(4)])
    admin = own_redis.client()
    fetch = ReliableFetch(own_redis.client(), "test:1:000000000000", QueueOrder([("default", 0)]))
    try:
        got = fetch.fetch(1)
        assert admin.client_kill_filter(_type="normal", skipme=True) >= 1
        got += fetch.fetch(1)
        admin.script_flush()
        got += fetch.fetch(1)
        assert [json.loads(u.raw)["args"] for u in got] == [[0], [1], [2]]
        assert admin.hlen(fetch.inflight_key) == 3
        assert admin.llen("queue:default") == 1
    finally:
        fetch.close()
        admin.close()


@pytest.mark.timeout(60)
def test_a_failure_recorded_while_redis_is_down_is_recorded_once(own_redis, workers, redis_url,
                                                                 r, monkeypatch):
    monkeypatch.setenv("CORE_RECORD_URL", redis_url)
    worker = workers(url=own_redis.url, concurrency=1)
    client = forkq.Client(own_redis.url)
    jid = core_jobs.fail_after.options(client=client).enqueue(0.5, "x")
    wait_records(r, 1, worker, kind="start")
    own_redis.stop()
    wait_records(r, 1, worker, kind="fail")  # it raised: its outcome cannot be written now
    time.sleep(1.5)  # the outage being simulated: the worker keeps retrying the write
    own_redis.start()

    conn = own_redis.client()
    try:
        wait_until(lambda: conn.zcard("retry") == 1, timeout=10, message="the failure in retry")
        (raw,) = conn.zrange("retry", 0, -1)
    finally:
        conn.close()
    job = json.loads(raw)
    assert job["jid"] == jid
    assert job["retry_count"] == 0 and "retried_at" not in job  # one failure, not one per try


@pytest.mark.timeout(60)
def test_an_idle_worker_notices_jobs_again_after_redis_refused_writes(own_redis, workers,
                                                                       redis_url, r, monkeypatch):
    """maxmemory reached (noeviction): BLMOVE is refused with OOM for a while."""
    monkeypatch.setenv("CORE_RECORD_URL", redis_url)
    worker = workers(url=own_redis.url, concurrency=1)
    conn = own_redis.client()
    try:
        conn.config_set("maxmemory", "1")

        def blmove_refused():
            worker.assert_alive()
            stats = conn.info("commandstats").get("cmdstat_blmove", {})
            return stats.get("rejected_calls", 0) >= 1

        wait_until(blmove_refused, timeout=10, message="the worker's BLMOVE refused with OOM")
        conn.config_set("maxmemory", "0")
        core_jobs.record.options(client=forkq.Client(own_redis.url)).enqueue("after OOM")
        wait_records(r, 1, worker, kind="record", timeout=10)
    finally:
        conn.close()


@pytest.mark.timeout(90)
def test_worker_rides_through_a_paused_redis(own_redis, workers, redis_url, r, monkeypatch):
    def pause():
        own_redis.pause()
        try:
            time.sleep(3)  # the outage being simulated, not a synchronisation
        finally:
            own_redis.resume()

    ids, worker = _run_through(own_redis, workers, redis_url, r, monkeypatch, pause)
    assert all(count == 1 for count in ids.values()), "a pause loses nothing: exactly once"
    assert worker.stop(timeout=15) == 0


# -- heartbeat, remote signals, stats -----------------------------------------------------


@pytest.mark.timeout(30)
def test_heartbeat_in_sidekiqs_format(workers, r):
    worker = workers(queues=["critical", "default"], concurrency=3)
    identity = worker.identity
    assert IDENTITY.match(identity)
    assert identity.split(":")[:2] == [socket.gethostname(), str(worker.proc.pid)]

    beat = {k.decode(): v.decode() for k, v in r.hgetall(identity).items()}
    assert {"info", "busy", "beat", "quiet", "rtt_us", "rss"} <= set(beat)
    info = json.loads(beat["info"])
    assert info["hostname"] == socket.gethostname()
    assert info["pid"] == worker.proc.pid
    assert info["concurrency"] == 3
    assert info["queues"] == ["critical", "default"]
    assert info["identity"] == identity
    assert isinstance(info["started_at"], float)
    assert beat["busy"] == "0"
    assert beat["quiet"] == "false"
    assert abs(float(beat["beat"]) - time.time()) < 10
    assert int(beat["rtt_us"]) >= 0
    assert int(beat["rss"]) > 1000  # KB: a Python process is well over a megabyte
    assert 0 < r.ttl(identity) <= 60


@pytest.mark.timeout(30)
def test_remote_signals_quiet_then_stop_the_worker(workers, forkq_client, r):
    """TSTP then TERM through IDENTITY-signals, as Sidekiq's Web UI sends them.

    The heartbeat pops one signal per beat; --heartbeat-interval 0.2 makes that quick.
    """
    worker = workers(concurrency=1, timeout=1, extra_args=["--heartbeat-interval", "0.2"])
    first_beat = float(r.hget(worker.identity, "beat"))
    wait_until(lambda: float(r.hget(worker.identity, "beat")) > first_beat, timeout=2,
               message="a second heartbeat within the 0.2 s interval")
    core_jobs.sleepy.enqueue(30, "held")
    wait_records(r, 1, worker, kind="start")
    signals = f"{worker.identity}-signals"

    r.lpush(signals, "TSTP")
    r.expire(signals, 60)
    wait_until(lambda: r.hget(worker.identity, "quiet") == b"true", timeout=2,
               message="quiet=true after a remote TSTP")
    wait_until(lambda: r.hget(worker.identity, "busy") == b"1", timeout=2, message="busy=1")
    (running,) = r.hvals(f"{worker.identity}:workers")
    running = json.loads(running)
    assert running["queue"] == "default"
    assert json.loads(running["payload"])["args"] == [30, "held"]
    assert isinstance(running["run_at"], int) and abs(running["run_at"] - time.time()) < 40
    assert not r.exists(signals)  # popped
    worker.assert_alive()

    r.lpush(signals, "TERM")
    r.expire(signals, 60)
    assert worker.wait_exit(timeout=8) == 0
    assert [j["args"] for j in queued(r)] == [[30, "held"]]
    assert worker.identity.encode() not in r.smembers("processes")


@pytest.mark.timeout(30)
def test_stats_count_every_execution(workers, forkq_client, r):
    worker = workers(concurrency=3)
    core_jobs.record.enqueue_many([[i] for i in range(25)])
    core_jobs.fail.enqueue("x")
    wait_records(r, 25, worker, kind="record")
    wait_until(lambda: r.zcard("retry") == 1, message="the failure in retry")
    assert worker.stop(timeout=15) == 0

    day = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    assert int(r.get("stat:processed")) == 26
    assert int(r.get(f"stat:processed:{day}")) == 26
    assert int(r.get("stat:failed")) == 1
    assert 0 < r.ttl(f"stat:processed:{day}") <= 5 * 365 * 24 * 3600


@pytest.mark.timeout(30)
def test_a_job_counts_as_processed_when_it_ends_not_when_it_starts(workers, forkq_client, r):
    """Sidekiq counts a job in `stat:processed` once it has run (ensure, after the job)."""
    worker = workers(concurrency=1, extra_args=["--heartbeat-interval", "0.2"])
    core_jobs.sleepy.enqueue(2, "long")
    wait_records(r, 1, worker, kind="start")
    first = float(r.hget(worker.identity, "beat"))
    # two heartbeats later, anything counted so far has been flushed
    wait_until(lambda: float(r.hget(worker.identity, "beat")) > first + 0.3, timeout=5,
               message="two heartbeats after the job started")
    assert records(r, "end") == []  # still running
    assert int(r.get("stat:processed") or 0) == 0
    wait_records(r, 1, worker, kind="end", timeout=10)
    wait_until(lambda: int(r.get("stat:processed") or 0) == 1, timeout=5,
               message="the job counted once it ended")


@pytest.mark.timeout(30)
def test_sigttin_logs_every_thread_stack(workers):
    worker = workers(concurrency=2)
    expected = {"MainThread", "forkq-processor-0", "forkq-processor-1", "forkq-fetcher",
                "forkq-heartbeat"}

    def dumps():
        worker.assert_alive()
        found = [json.loads(line) for line in worker.log_path.read_text().splitlines()
                 if line.startswith("{") and "thread dump" in line]
        return found if expected <= {d.get("thread") for d in found} else None

    worker.signal(signal.SIGTTIN)
    found = wait_until(dumps, timeout=5, message=f"a thread dump of {sorted(expected)} in the log")
    assert all("File " in d["stack"] for d in found)
    worker.assert_alive()  # TTIN only dumps; the worker keeps running


@pytest.mark.timeout(20)
def test_a_stop_that_lands_as_the_heartbeat_wakes_ends_the_heartbeat_at_once(redis_url, r):
    """A stopping worker wakes its heartbeat (beat_soon) and soon after ends it
    (Launcher.stop). A stop landing after the woken thread had looked for it but before it
    cleared its event was erased: the thread beat once more and slept a whole interval,
    the stop waited its 5 s join and its final flush took the beat for stuck."""
    from forkq.launcher import Launcher
    manager = Manager(lambda: redis.Redis.from_url(redis_url), "stop-race:1",
                      QueueOrder([("default", 0)]), concurrency=1)
    launcher = Launcher(manager.redis, "stop-race:1", manager, {"concurrency": 1},
                        on_signal=lambda signum: None, interval=30)
    armed = threading.Event()

    class StopLandsHere(threading.Event):
        def clear(self) -> None:
            if armed.is_set():  # the stop lands here, between the look and the clear
                armed.clear()
                launcher._stopping = True
                super().set()
            super().clear()

    launcher._stop = StopLandsHere()
    try:
        manager._register()
        launcher.start()
        wait_until(lambda: r.exists("stop-race:1"), timeout=5, message="the first beat")
        armed.set()
        launcher.beat_soon()
        launcher._thread.join(3)
        assert not armed.is_set(), "the woken heartbeat never cleared its event"
        assert not launcher._thread.is_alive(), "the heartbeat slept on past the stop"
    finally:
        launcher._stopping = True
        threading.Event.set(launcher._stop)
        manager.fetch.close()


@forkq.job(queue="tickq", name="tick.staggered", retry=0)
def _staggered() -> None:
    # processor N's job ends 0.6 s after processor N-1's: each one's join returns early
    index = int(threading.current_thread().name.rsplit("-", 1)[1])
    time.sleep(0.6 * (index + 1))


@pytest.mark.timeout(20)
def test_a_drain_ticks_about_once_a_second_while_its_jobs_end_one_by_one(redis_url, r, monkeypatch):
    """Manager.stop calls its tick (a draining child's report: busy count, title) about once
    a second while jobs run on. It ticked only when a thread outlived a whole 1 s join: jobs
    ending less than a second apart, each on the next thread joined, drained with no tick
    at all, however long they took together."""
    from forkq import hooks
    from helpers import InProcessWorkers
    monkeypatch.setattr(hooks, "SERVER_MIDDLEWARE", [])
    w = InProcessWorkers(redis_url, "tick-test:1", "tickq", 5.0)
    try:
        manager, launcher = w.start(concurrency=3)
        c = forkq.Client(redis_url)
        for _ in range(3):
            c.push("tick.staggered", [], queue="tickq")
        wait_until(lambda: manager.busy() == 3, timeout=5, interval=0.01, message="three jobs running")
        ticks: list[float] = []
        started = time.monotonic()
        assert manager.stop(started + 10, tick=lambda: ticks.append(time.monotonic() - started))
        took = time.monotonic() - started
        assert 1.4 < took < 3, took
        assert ticks and ticks[0] < 1.3, ticks  # busy went out while the last two ran on
    finally:
        w.close()
