"""Stray recovery: jobs written into a process's private structures after it was swept and
unregistered (a claim stuck in the network that lands late) are put back, and a live
process's never are. Against real redis-servers; `step` is driven by hand, with short
delays given as arguments instead of waiting out the defaults, and the last tests run a
real master with a recovery delay of a second."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis

import forkq
from forkq import fetch as fetch_mod
from forkq import keys, logs, orphans, strays
from forkq.fetch import ReliableFetch
from forkq.queues import QueueOrder
from forkq.settings import Settings
from forkq.supervisor import Supervisor
from helpers import CommandHolder, json_lines, stop_gracefully, wait_until

REPO = Path(__file__).resolve().parent.parent
IDENTITY = "test:1:000000000000"


def _fetch(port: int, identity: str = IDENTITY, queues: tuple[str, ...] = ("default",),
           heartbeat_interval: float = 0.1) -> ReliableFetch:
    return ReliableFetch(redis.Redis(port=port), identity, QueueOrder([(q, 0) for q in queues]),
                         heartbeat_interval=heartbeat_interval)


def _recovered(r: redis.Redis, delay: float, **kw) -> list[tuple[str, fetch_mod.Requeued]]:
    """Slices until one puts something back (polled: the identity must first be noted,
    then stay unregistered for `delay`)."""
    out: list = []

    def took() -> bool:
        done = strays.step(r, "master-a", delay, **kw)
        out.extend(done.recovered if done else [])
        return bool(out)

    wait_until(took, timeout=5, interval=0.05, message="a slice that puts the stray back")
    return out


@pytest.mark.timeout(20)
def test_a_claim_that_reaches_redis_after_its_process_was_swept_is_put_back(own_redis):
    """The claim is held on its way (a partition), the master sweeps the process as after
    its death, then the claim lands: its jobs sit in a hash that no owners entry names.
    Orphan recovery goes by that registry, so before stray recovery they stayed for good."""
    holder = CommandHolder(own_redis.port)
    admin = own_redis.client()
    fetch = _fetch(holder.port)
    claimed: list = []
    late = threading.Thread(target=lambda: claimed.extend(fetch.fetch(3)))
    try:
        fetch.register()
        jids = forkq.Client(own_redis.url).push_bulk("Any", [[i] for i in range(3)])
        holder.marker = fetch._fetch.sha.encode()
        late.start()
        assert holder.holding.wait(5), "the claim never went out"
        # the master reaps the (SIGKILLed) child and puts back what it held: nothing yet
        assert fetch_mod.requeue_owner_counts(admin, IDENTITY, ["default"], crashed=True).requeued == 0
        holder.release.set()
        late.join(5)
        assert len(claimed) == 3
        assert admin.hlen(keys.inflight(IDENTITY)) == 3 and admin.llen("queue:default") == 0
        assert not admin.hexists(keys.OWNERS, IDENTITY)
        # what existed before: orphan recovery finds nothing to put back
        assert orphans.sweep(admin, 0.0, "master-a") == []
        assert admin.hlen(keys.inflight(IDENTITY)) == 3

        ((identity, counts),) = _recovered(admin, 0.3)
        assert identity == IDENTITY and counts == fetch_mod.Requeued(3, 0, 0)
        # back on the queue as they were, the oldest first in line; not crash suspects
        back = [json.loads(raw)["jid"] for raw in admin.lrange("queue:default", 0, -1)]
        assert sorted(back) == sorted(jids) and back[-1] == jids[0]
        assert not admin.exists(keys.inflight(IDENTITY), keys.suspects("default"))
        assert not admin.keys(keys.CRASH_PREFIX + "*")
        assert not admin.exists(keys.STRAYS_SEEN, keys.STRAYS_LOCK, keys.STRAYS_CURSOR)
    finally:
        holder.close()
        if late.ident is not None:
            late.join(5)
        fetch.close()
        admin.close()


@pytest.mark.timeout(20)
def test_a_registered_process_keeps_its_in_flight_jobs_and_landed_job(r, redis_server):
    fetch = _fetch(redis_server.port, queues=("default", "mail"))
    fetch.register()
    forkq.Client(redis_server.url).push_bulk("Any", [[i] for i in range(4)])
    assert len(fetch.fetch(4)) == 4
    forkq.Client(redis_server.url).push("Any", [9], queue="mail")
    assert fetch.wait_for("mail", redis.Redis(port=redis_server.port))
    before = {k: r.dump(k) for k in (keys.inflight(IDENTITY), keys.landing(IDENTITY, "mail"))}
    for _ in range(3):
        done = strays.step(r, "master-a", 0.0)
        assert done is not None and done.recovered == []
    assert {k: r.dump(k) for k in before} == before
    assert not r.exists(keys.STRAYS_SEEN)


@pytest.mark.timeout(20)
def test_a_live_process_swept_while_silent_keeps_what_it_claimed_after(r, redis_server):
    """Orphan recovery took a live but silent process for dead (the delay is a lease). It
    claims again before its next beat: unregistered, its hash holds jobs its threads run.
    Its next beat registers it again, and stray recovery must leave those jobs alone; so
    must it when only its alive key shows it beat (its owners entry deleted by hand)."""
    fetch = _fetch(redis_server.port)
    fetch.register()
    forkq.Client(redis_server.url).push_bulk("Any", [[i] for i in range(4)])
    assert len(fetch.fetch(2)) == 2
    orphans_took = fetch_mod.requeue_owner_counts(r, IDENTITY, ["default"], crashed=True)
    assert orphans_took.requeued == 2 and not r.hexists(keys.OWNERS, IDENTITY)
    assert len(fetch.fetch(2)) == 2  # it wakes and claims before it beats
    held = r.hgetall(keys.inflight(IDENTITY))
    assert len(held) == 2

    # noted as unregistered, then the process beats: registered again, nothing taken
    # (interval 0: every slice is a new pass over this small keyspace)
    assert strays.step(r, "master-a", 0.2, interval=0.0).recovered == []
    assert r.hexists(keys.STRAYS_SEEN, IDENTITY)
    fetch.register()  # what its heartbeat writes (Launcher.beat)
    wait_until(lambda: strays.step(r, "master-b", 0.2, interval=0.0) is not None
               and not r.hexists(keys.STRAYS_SEEN, IDENTITY), timeout=5,
               message="the noted identity forgotten")
    assert r.hgetall(keys.inflight(IDENTITY)) == held

    # its owners entry deleted by hand after each beat: only its alive key shows that it
    # beats, and that is checked inside the requeue script, in the same call
    r.hdel(keys.OWNERS, IDENTITY)
    assert strays.step(r, "master-a", 0.2, interval=0.0).recovered == []
    assert r.hexists(keys.STRAYS_SEEN, IDENTITY)

    def beat_then_slice() -> bool:
        r.set(keys.alive(IDENTITY), 1, px=keys.ALIVE_TTL_S * 1000)
        return (strays.step(r, "master-a", 0.2, interval=0.0) is not None
                and not r.hexists(keys.STRAYS_SEEN, IDENTITY))

    wait_until(beat_then_slice, timeout=5, interval=0.05,
               message="the noted identity judged alive by its alive key")
    assert r.hgetall(keys.inflight(IDENTITY)) == held
    assert r.exists(keys.alive(IDENTITY))
    # silent for longer (its alive key aged past the wait): now it is a stray
    r.pexpire(keys.alive(IDENTITY), keys.ALIVE_TTL_S * 1000 - 60_000)
    ((identity, counts),) = _recovered(r, 0.2, interval=0.0)
    assert identity == IDENTITY and counts.requeued == 2
    assert not r.exists(keys.inflight(IDENTITY), keys.alive(IDENTITY))


@pytest.mark.timeout(20)
def test_a_job_a_late_blocking_wait_lands_in_an_unregistered_landing_list_goes_back(r, redis_server):
    """Under --no-fork: a BLMOVE stuck on its way reaches Redis after the process's own
    final requeue, and moves a job into its landing list (here of a queue whose name has
    colons, as the key's own separators do)."""
    fetch = _fetch(redis_server.port, queues=("mail:high",))
    fetch.register()
    fetch.requeue_all()  # the process's own stop
    jid = forkq.Client(redis_server.url).push("Any", [1], queue="mail:high")
    assert fetch.wait_for("mail:high", redis.Redis(port=redis_server.port))
    assert r.llen(keys.landing(IDENTITY, "mail:high")) == 1 and not r.exists("queue:mail:high")

    ((identity, counts),) = _recovered(r, 0.2)
    assert identity == IDENTITY and counts.requeued == 1
    assert [json.loads(raw)["jid"] for raw in r.lrange("queue:mail:high", 0, -1)] == [jid]
    assert not r.exists(keys.landing(IDENTITY, "mail:high"))


@pytest.mark.timeout(20)
def test_a_malformed_stray_entry_goes_to_dead_with_the_reason(r):
    gone = "elsewhere:4242:abcdefabcdef"
    good = json.dumps({"class": "Any", "args": [], "jid": "a" * 24, "queue": "default"})
    r.hset(keys.inflight(gone), mapping={"7": "no queue in this entry", "8\ndefault": good})
    # and a private name holding a key of another type: one line, and the others go on
    r.set(keys.inflight("wrong:1:abcdefabcdef"), "a string")
    out = io.StringIO()
    out.isatty = lambda: False
    try:
        # forkq's lines go to the stream given when logging was configured, which in a full
        # run is an earlier test's: capsys would not see them
        logs.configure("info", "json", stream=out)
        ((identity, counts),) = _recovered(r, 0.2)
    finally:
        logs.configure("info", "json")
    assert identity == gone and counts.requeued == 1
    assert "cannot put back a stray's jobs" in out.getvalue()
    assert r.get(keys.inflight("wrong:1:abcdefabcdef")) == b"a string"
    assert r.lrange("queue:default", 0, -1) == [good.encode()]
    (dead,) = [json.loads(m) for m in r.zrange("dead", 0, -1)]
    assert dead["class"] == "forkq.MalformedJob" and dead["forkq_original"] == "no queue in this entry"
    assert dead["error_message"] == "in-flight entry of unknown form (field 7)"


@pytest.mark.timeout(20)
def test_the_scan_is_a_slice_at_a_time_and_one_pass_per_interval(own_redis):
    """20,000 unrelated keys, a SCAN of COUNT 100 and at most 5 calls a slice: a pass is
    spread over slices that go on from a cursor kept in Redis, whichever master takes
    them; it makes about keys/COUNT calls in all, no KEYS; the next waits for the interval."""
    r = own_redis.client()
    pipe = r.pipeline(transaction=False)
    for i in range(0, 20_000, 1000):
        pipe.mset({f"app:{j}": "x" for j in range(i, i + 1000)})
    pipe.execute()
    r.hset(keys.inflight("gone:1:abcdefabcdef"), "1\ndefault", '{"class":"Any","args":[]}')
    r.config_resetstat()
    calls, slices, found = 0, 0, 0
    masters = ["master-a", "master-b"]
    while True:
        # a delay of a minute: nothing noted is taken during the pass
        done = strays.step(r, masters[slices % 2], 60.0, count=100, max_calls=5,
                           budget_s=10.0, interval=3600)
        assert done is not None and 1 <= done.calls <= 5
        calls, slices, found = calls + done.calls, slices + 1, found + done.found
        if not done.scanning:
            break
        assert r.get(keys.STRAYS_CURSOR) not in (None, b"0")
    assert found >= 1 and slices >= 20_000 // 1000
    stats = r.info("commandstats")
    assert stats["cmdstat_scan"]["calls"] == calls <= 2 * 20_000 // 100
    assert "cmdstat_keys" not in stats
    assert 3500 < r.pttl(keys.STRAYS_REST) / 1000 <= 3600 and not r.exists(keys.STRAYS_CURSOR)
    # resting: no scan, but what was noted is put back
    wait_until(lambda: strays.step(r, "master-a", 1e-3).recovered, timeout=5,
               message="the noted stray put back while resting")
    assert r.info("commandstats")["cmdstat_scan"]["calls"] == calls
    assert r.llen("queue:default") == 1
    # one slice at a time cluster-wide
    r.set(keys.STRAYS_LOCK, "master-c", px=5000)
    assert strays.step(r, "master-a", 1e-3) is None
    r.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["master", "no-fork"])
def test_a_stray_is_put_back_by_a_master_and_by_a_no_fork_worker(redis_url, r, tmp_path, mode):
    """The master takes slices on its own: a stray left before it started (an owners entry
    lost to an RDB restored beside a newer registry) is back once Redis has answered it for
    the delay plus a heartbeat, with one warning, and counted in its stats. A fleet of
    --no-fork workers has no master: there, a stray waited for one for good."""
    gone = "elsewhere:4242:abcdefabcdef"
    job = json.dumps({"class": "orphan.work", "args": ["s", 0], "jid": "b" * 24, "queue": "nobody"})
    r.hset(keys.inflight(gone), "1\nnobody", job)
    log = tmp_path / "forkq.log"
    env = dict(os.environ, FORKQ_REDIS_URL=redis_url, PYTHONPATH=str(REPO))
    how = ["--processes", "1"] if mode == "master" else ["--no-fork"]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "forkq", "start", *how, "--require", str(REPO / "tests/apps/orphan_jobs.py"),
             "--log-format", "json", "--recovery-delay", "1", "--heartbeat-interval", "0.3", "--timeout", "1"],
            env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: r.lrange("queue:nobody", 0, -1) == [job.encode()], timeout=15,
                   message="the stray's job back on its queue")
        assert not r.exists(keys.inflight(gone))
    finally:
        assert stop_gracefully(proc) == 0
    lines = json_lines(log)
    (warning,) = [e for e in lines if e.get("event", "").startswith("put back jobs from private")]
    assert warning["identity"] == gone and warning["requeued"] == 1 and warning["level"] == "warning"
    if mode == "master":
        (stopped,) = [e for e in lines if e.get("event") == "master stopped"]
        assert stopped["strays"] == 1 and stopped["requeued"] == 1


@pytest.mark.timeout(30)
def test_an_acl_user_without_scan_gets_one_line_from_the_master(own_redis, tmp_path):
    admin = own_redis.client()
    admin.acl_setuser("fq", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
                      commands=["+@all", "-scan"])
    log = tmp_path / "master.log"
    env = dict(os.environ, FORKQ_REDIS_URL=f"redis://fq:pw@127.0.0.1:{own_redis.port}/0",
               PYTHONPATH=str(REPO))
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "forkq", "start", "--require", str(REPO / "tests/apps/orphan_jobs.py"),
             "--processes", "1", "--log-format", "json", "--recovery-delay", "1", "--timeout", "1"],
            env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # a look a second (the sweep interval with this delay): two refused at least, so a
        # line a look would show as two
        wait_until(lambda: sum(int(e["count"]) for e in admin.acl_log() if e["object"] == "scan") >= 2,
                   timeout=15, message="the master's scans refused")
    finally:
        assert stop_gracefully(proc) == 0
        admin.close()
    lines = json_lines(log)
    assert len([e for e in lines if e.get("event", "").startswith("stray recovery cannot run")]) == 1
    assert "Traceback" not in log.read_text()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("call", ["strays", "requeue", "lock"])
def test_a_stall_that_stray_recovery_waits_out_does_not_make_live_processes_look_dead(own_redis, call):
    """Redis paused (shorter than the socket timeout) while the master's stray slice, or its
    requeue of a dead child, waited on it: the call came back without an error, the orphan
    sweep after it found Redis quick and every heartbeat stale, and took a live process's
    running job for a dead one's.
    `lock`: two masters waited on a paused Redis to take the orphan sweep's lock. The other
    one got it as Redis woke, saw the stall and recovered nothing; this one, refused the
    lock, came back with nothing noted, and its next sweep did the same (test_orphans'
    outage test failed this way with another test file running beside it)."""
    r = own_redis.client()
    live = _fetch(own_redis.port, "elsewhere:77:abcdefabcdef")
    live.register()
    forkq.Client(own_redis.url).push("Any", [1])
    assert len(live.fetch(1)) == 1  # a job it is running
    sup = Supervisor(Settings(redis_url=own_redis.url, recovery_delay=0.5, heartbeat_interval=0.5))
    sup.sweeper.ok_since, sup.sweeper.back_at = time.monotonic() - 10, time.time() - 10  # settled
    if call == "requeue":
        sup.pending_requeue.append(("dead:1:000000000000", True))  # a child just reaped
    if call == "lock":
        r.set(orphans.LOCK, "the-other-master", px=30_000)
        sup.sweeper.next_at = 0.0
    target = {"strays": sup.sweep_strays, "requeue": sup.requeue_pending, "lock": sup.sweep_orphans}[call]
    waiting = threading.Thread(target=target)
    own_redis.pause()
    try:
        waiting.start()
        time.sleep(1.2)  # the stall itself: longer than the 0.5 s delay, under the 5 s timeout
    finally:
        own_redis.resume()
    waiting.join(10)
    if call == "lock":
        assert r.get(orphans.LOCK) == b"the-other-master"  # this master's SET came back refused
        r.delete(orphans.LOCK)  # the other master's sweep is over
    sup.sweeper.next_at = 0.0
    sup.sweep_orphans()
    assert r.hlen(keys.inflight(live.identity)) == 1 and r.llen("queue:default") == 0
    assert r.hexists(keys.OWNERS, live.identity)
    os.close(sup._sig_r)
    os.close(sup._sig_w)


def _timed(fn) -> float:
    started = time.monotonic()
    fn()
    return time.monotonic() - started


FROZEN_TIMEOUT_S = 1.5


@pytest.mark.timeout(60)
def test_a_master_facing_a_frozen_redis_waits_on_one_call_a_turn_not_two(own_redis):
    """Redis frozen (a paused VM, a host gone without a reset): each Redis call of the
    master's loop waits out the socket timeout (5 s). The orphan sweep met it, then the
    stray slice waited 5 s more on the same outage, every turn: a TERM, a dead child's
    reaping, the stop deadline's kill waited up to 10 s instead of 5 (measured with a real
    master and --recovery-delay 4: TERM acted on after 9 s, 4 s before stray recovery)."""
    sup = Supervisor(Settings(redis_url=own_redis.url, processes=1, recovery_delay=4.0))
    # The master's own connection but for its 5 s timeout: what is tested is how many
    # timeouts a turn waits out, not how long one is, and four of 5 s took 10 s of the suite
    sup._redis = forkq.client.connect(own_redis.url, socket_timeout=FROZEN_TIMEOUT_S)
    waited, skipped = 0.8 * FROZEN_TIMEOUT_S, 0.4 * FROZEN_TIMEOUT_S
    try:
        sup.sweep_orphans(boot=True)
        assert sup.sweeper.ok_since is not None
        own_redis.pause()
        # a turn whose orphan sweep is due: it meets the outage; the slice does not wait too
        sup.sweeper.next_at = sup.scanner.next_at = 0.0
        assert _timed(sup.sweep_orphans) >= waited
        assert _timed(sup.sweep_strays) < skipped
        # a turn where the slice is the first to meet it (the orphan sweep not due): it
        # notes the outage, so the next turn's slice does not wait on it again
        own_redis.resume()
        sup.sweeper.next_at = 0.0
        sup.sweep_orphans()
        assert sup.sweeper.ok_since is not None
        own_redis.pause()
        sup.scanner.next_at = 0.0
        assert _timed(sup.sweep_strays) >= waited
        sup.scanner.next_at = 0.0
        assert _timed(sup.sweep_strays) < skipped
    finally:
        own_redis.resume()
        os.close(sup._sig_r)
        os.close(sup._sig_w)
