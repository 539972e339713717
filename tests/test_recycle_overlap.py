"""A recycled child's replacement works while the old child drains: no capacity gap.

The master retires a child (--max-jobs, --max-memory, HUP, a job interrupted) by telling it
to stop; the old child finishes its running jobs for up to --timeout. Its slot is filled
again at once, so jobs pushed meanwhile start in the replacement instead of waiting for the
old child's longest job. Two real masters (tests/test_supervisor.py's harness) show it with
--processes 1, and the master's bookkeeping around it is checked in-process.
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from forkq.settings import STOP_GRACE_S, Settings
from forkq.supervisor import Supervisor
from helpers import wait_until
from test_supervisor import (APPS, _close_master, _pid_gone, _pinging_children, _ping, _recycle_now, _title,  # noqa: F401
                             assert_clean, push, start_master, sup_events, wait_event)

APP = APPS / "recycle_jobs.py"


def _release(r, tag: str) -> None:
    r.set(f"recycle:release:{tag}", 1)


def _overlap(m, r, redis_url) -> tuple[int, int]:
    """--processes 1 --concurrency 2 --max-jobs 1: the child holds `long` (held until the
    test releases it) when its other thread finishes its first job, and is retired for it.
    Returns (old pid, new pid) once the replacement's worker has started, `long` still held."""
    (old,) = m.wait_slots().values()
    push(redis_url, "recycle.hold", "long")
    wait_event(r, m, "start", "long")
    push(redis_url, "recycle.quick", "warm")
    wait_event(r, m, "done", "warm")
    wait_until(lambda: m.check() and m.log_events("stopping", pid=old), timeout=10,
               message=f"the child retired at --max-jobs 1\n{m.tail()}")
    new = wait_until(lambda: m.check() and [e["pid"] for e in m.log_events("worker started")
                                             if e["pid"] != old],
                     timeout=5, message=f"a replacement working while the old child drains\n{m.tail()}")
    assert not sup_events(r, "done", "long") and not _pid_gone(old)
    return old, new[0]


@pytest.mark.timeout(40)
def test_a_job_pushed_while_a_recycled_child_drains_starts_in_its_replacement(start_master, redis_url, r):
    """With one process, a job pushed while the retired child drains its long job starts
    at once in the replacement (it waited for the long job before: up to --timeout). TSTP
    then quiets the replacement too; the old child finishes its job and exits as retired;
    every job ran once and the recycle is counted as `jobs`."""
    m = start_master(processes=1, concurrency=2, app=APP, args=["--max-jobs", "1", "--timeout", "10"])
    old, new = _overlap(m, r, redis_url)
    wait_until(lambda: "[1/1 children, 1 draining, " in m.title(), timeout=5,
               message=f"the title counts the slot once and the old child as draining: {m.title()}")
    # the old child goes on reporting as it drains (it stopped at the stop before): its
    # title says it is quiet, and the busy count the master adds up stays its own
    wait_until(lambda: _title(psutil.Process(old)).endswith("[1 of 2 busy, quiet]"), timeout=5,
               message=f"the draining child's title: {_title(psutil.Process(old))}")

    push(redis_url, "recycle.quick", "short")
    (short,) = wait_event(r, m, "start", "short", timeout=5)
    assert short["pid"] == new
    assert not sup_events(r, "done", "long"), "the short job only started once the long one ended"

    m.signal(signal.SIGTSTP)  # reaches both; the draining child is quiet already
    wait_until(lambda: m.log_events("quiet: no new jobs will start", pid=new), timeout=5,
               message=f"the replacement quiet\n{m.tail()}")
    push(redis_url, "recycle.quick", "while-quiet")

    _release(r, "long")
    (done,) = wait_event(r, m, "done", "long")
    assert done["pid"] == old
    (exited,) = wait_until(lambda: m.log_events("child exited", child_pid=old), timeout=10,
                           message=f"the old child exited\n{m.tail()}")
    assert (exited["reason"], exited["how"]) == ("jobs", "exit 0")
    assert _pid_gone(old)
    wait_until(lambda: "[1/1 children, 0 busy, quiet]" in m.title(), timeout=5,
               message=f"one child left: {m.title()}")
    assert [e["child_pid"] for e in m.log_events("child started")][1:] == [new], "one replacement"

    m.signal(signal.SIGTERM)
    assert m.wait(15) == 0
    for tag in ("long", "warm", "short"):
        assert len(sup_events(r, "start", tag)) == 1 and len(sup_events(r, "done", tag)) == 1, tag
    assert not sup_events(r, "start", "while-quiet") and r.llen("queue:default") == 1
    (stopped,) = m.log_events("master stopped")
    assert stopped["restarts"] == {"jobs": 1} and stopped["requeued"] == 0
    assert_clean(r, m)


@pytest.mark.timeout(40)
def test_a_retired_child_killed_while_it_drains_gives_its_jobs_back_and_gets_no_second_replacement(
        start_master, redis_url, r):
    """SIGKILLed during its drain, the old child's jobs go back as after any death (the
    job runs again, once, in the replacement), and its slot, already filled, gets no
    second replacement. The replacement, already running, is told to beat at once and
    runs the suspect within a second or so, as a replacement forked after a death would:
    before, it waited for its next heartbeat (here 20 s away)."""
    m = start_master(processes=1, concurrency=2, app=APP,
                     args=["--max-jobs", "1", "--timeout", "10", "--heartbeat-interval", "20"])
    old, new = _overlap(m, r, redis_url)
    os.kill(old, signal.SIGKILL)
    (exited,) = wait_until(lambda: m.check() and m.log_events("child exited", child_pid=old), timeout=10,
                           message=f"the old child reaped\n{m.tail()}")
    assert (exited["reason"], exited["how"]) == ("jobs", "signal SIGKILL")
    wait_event(r, m, "start", "long", count=2, timeout=3)
    again = wait_event(r, m, "done", "long")
    assert [(e["pid"], e["attempt"]) for e in sup_events(r, "start", "long")] == [(old, 1), (new, 2)]
    assert [(e["pid"], e["attempt"]) for e in again] == [(new, 2)]
    assert [c.pid for c in m.children()] == [new]
    assert [e["child_pid"] for e in m.log_events("child started")][1:] == [new], "one replacement"

    m.signal(signal.SIGTERM)
    assert m.wait(15) == 0
    (stopped,) = m.log_events("master stopped")
    assert stopped["restarts"] == {"jobs": 1} and stopped["requeued"] == 1
    assert_clean(r, m)


# -- the master's bookkeeping, in-process (child records with real pipes, no processes) --------


def _commands(control_r: int) -> bytes:
    os.set_blocking(control_r, False)
    try:
        return os.read(control_r, 64)
    except BlockingIOError:
        return b""


@pytest.mark.timeout(10)
def test_a_retired_childs_slot_is_vacant_at_once_and_filled_once():
    """spawn_missing forks into vacant_slots(): a retired child leaves its slot vacant at
    once, its replacement fills it, and the slot counts one child (all_up, HUP's list) while
    the old one drains. Still one recycle at a time; stop and quiet reach both."""
    sup = Supervisor(Settings(processes=2, max_jobs=10, timeout=3))
    made = _pinging_children(sup, range(2))
    (old, old_w, old_control), (other, other_w, other_control) = made
    try:
        _ping(sup, old, old_w, b"B1 12 0\n")
        _ping(sup, other, other_w, b"B0 3 0\n")
        assert sup.all_up() and sup.vacant_slots(time.monotonic()) == []
        _recycle_now(sup)
        assert old.reason == "jobs" and _commands(old_control) == bytes([signal.SIGTERM])
        assert sup.vacant_slots(time.monotonic()) == [0] and not sup.all_up()

        made += _pinging_children(sup, range(2, 3))  # the replacement, forked into slot 0
        new, new_w, new_control = made[2]
        new.slot = 0
        assert sup.vacant_slots(time.monotonic()) == [] and not sup.all_up()  # not ready yet
        _ping(sup, new, new_w, b"B2 0 0\n")
        assert sup.all_up() and sorted(c.pid for c in sup.occupants()) == sorted([other.pid, new.pid])
        # the metrics endpoint: one series per slot (Prometheus takes no duplicates), the
        # draining child's threads added to its replacement's
        from forkq.metrics import Aggregates, Collector, QueueReader
        families = {f.name: f for f in Collector(sup, Aggregates(), QueueReader(None))._children()}
        assert [(s.labels, s.value) for s in families["forkq_busy_threads"].samples] == [
            ({"slot": "0"}, 3), ({"slot": "1"}, 0)]
        assert [s.labels["slot"] for s in families["forkq_threads"].samples] == ["0", "1"]
        assert families["forkq_children"].samples[0].value == 3

        _ping(sup, other, other_w, b"B0 15 0\n")  # past --max-jobs too, while the old one drains
        _recycle_now(sup)
        assert other.stopping_since is None, "one recycle at a time"
        sup.handle_hup()
        assert sup.recycle == [0, 1]  # each slot once, not the draining child's again
        sup.roll_restart()
        assert new.stopping_since is None and other.stopping_since is None and sup.recycle == [0, 1]

        sup.handle_quiet()
        sup.handle_stop(signal.SIGTERM)
        for _child, _w, control in made:
            assert _commands(control) == bytes([signal.SIGTSTP, signal.SIGTERM])
        assert sup.stop_deadline <= time.monotonic() + 3 + STOP_GRACE_S
        assert sup.vacant_slots(time.monotonic()) == [] and sup.recycle == [0, 1]
        sup.roll_restart()
        assert sup.recycle == [] and new.stopping_since is None
    finally:
        _close_master(sup, made)


@pytest.mark.timeout(10)
def test_a_replacement_that_fails_to_start_backs_off_while_the_old_child_drains(redis_url):
    """A replacement dying at start counts a failed start and backs off as any would. It
    may fail for want of what the draining child holds (an on_fork hook binding a port per
    slot), so the master neither gives up nor fails the watchdog over it until the old
    child has exited; then the slot starts over, at once, and is judged as always."""
    sup = Supervisor(Settings(processes=1, max_jobs=10, redis_url=redis_url))
    made = _pinging_children(sup, range(1))
    (old, old_w, _), = made
    slot = sup.slots[0]

    def failed_start(error: bytes) -> None:
        made.extend(_pinging_children(sup, range(len(made), len(made) + 1)))
        new, new_w, _ = made[-1]
        new.slot = 0
        _ping(sup, new, new_w, b"E" + error + b"\n")
        del sup.children[new.pid]
        sup.child_exited(new, 1 << 8)  # exit 1, never ready

    try:
        _ping(sup, old, old_w, b"B1 12 0\n")
        _recycle_now(sup)
        assert old.reason == "jobs"
        backoffs = []
        for _ in range(3):
            failed_start(b"on_fork hook bind raised OSError: port in use")
            backoffs.append(slot.next_spawn - time.monotonic())
            assert sup.vacant_slots(time.monotonic()) == [] and sup.vacant_slots(slot.next_spawn) == [0]
        assert slot.failures == 3 and backoffs == sorted(backoffs) and backoffs[0] > 0
        assert sup.state == "running" and sup.healthy(time.monotonic()), "judged before the old child left"
        assert sup.stats.restarts == {"jobs": 1, "crash": 3}

        del sup.children[old.pid]
        sup.child_exited(old, 0)
        assert (slot.failures, sup.vacant_slots(time.monotonic())) == (0, [0])
        assert slot.last_exit == "exit 1: on_fork hook bind raised OSError: port in use"
        assert sup.stats.restarts == {"jobs": 1, "crash": 3}, "counted as retired, not again"

        for _ in range(3):  # with no child draining, a crash loop is one again
            failed_start(b"on_fork hook bind raised OSError: port in use")
        assert sup.state == "failed" and sup.exit_code == 1
    finally:
        _close_master(sup, made)


@pytest.mark.timeout(10)
def test_a_recycle_is_counted_as_the_child_is_retired_not_at_its_exit(redis_url):
    """forkq_child_restarts_total counts a child replaced when its replacement takes the
    slot: a recycle (here HUP's `restart`) at the retirement, not when the old child exits
    up to --timeout later, and once, even if a stop begins while it drains. Before, it
    counted at the exit: a graph of restarts showed a HUP's long after it. The replacement,
    ended by the stop, counts nothing, as any child a stop ends. Every reason is exported
    from 0, or increase() missed a reason's first restart."""
    from forkq.metrics import Aggregates, Collector, QueueReader
    sup = Supervisor(Settings(processes=1, redis_url=redis_url))
    made = _pinging_children(sup, range(2))
    (old, old_w, _), (new, new_w, _) = made
    del sup.children[new.pid]  # forked below, into the slot the old child leaves

    def restarts() -> dict[str, float]:
        families = {f.name: f for f in Collector(sup, Aggregates(), QueueReader(None)).collect()
                    if f.name == "forkq_child_restarts"}
        return {s.labels["reason"]: s.value for s in families["forkq_child_restarts"].samples
                if s.name.endswith("_total")}

    try:
        assert restarts() == dict.fromkeys(
            ["cancel", "crash", "hang", "jobs", "memory", "restart", "time_limit"], 0)
        _ping(sup, old, old_w, b"B1 12 0\n")
        sup.handle_hup()
        sup.roll_restart()
        assert old.reason == "restart" and old.stopping_since is not None
        assert sup.stats.restarts == {"restart": 1} and restarts()["restart"] == 1
        new.slot = 0
        sup.children[new.pid] = new
        _ping(sup, new, new_w, b"B0 0 0\n")
        sup.handle_stop(signal.SIGTERM)

        del sup.children[new.pid]
        sup.child_exited(new, 0)
        del sup.children[old.pid]
        sup.child_exited(old, 0)
        assert sup.stats.restarts == {"restart": 1}, "the replacement a stop ended counts none"
    finally:
        _close_master(sup, made)


@pytest.mark.timeout(10)
def test_hups_rolling_restart_skips_a_child_just_killed_as_hung():
    """murder_hung_children SIGKILLs a silent child and roll_restart runs later in the same
    turn, before the reap: a HUP whose next slot was that child's retired it again, so its
    death was counted (and logged, at info) as `restart`, not `hang`, and HUP's turn for its
    slot went to a child already dead. Such a child is not up: the rolling restart waits
    for its replacement, as for any slot that is not working."""
    sup = Supervisor(Settings(processes=2))
    made = _pinging_children(sup, range(2))
    (hung, hung_w, _), (other, other_w, _) = made
    try:
        _ping(sup, hung, hung_w, b"B1 3 0\n")
        _ping(sup, other, other_w, b"B0 3 0\n")
        sup.handle_hup()
        assert sup.recycle == [0, 1]
        hung.reason = "hang"  # as murder_hung_children leaves it, the SIGKILL sent
        sup.roll_restart()
        assert hung.reason == "hang" and hung.stopping_since is None
        assert other.stopping_since is None and sup.recycle == [0, 1], "nothing retired yet"
        assert not sup.all_up()
    finally:
        _close_master(sup, made)


@pytest.mark.timeout(10)
def test_a_requeue_redis_put_off_has_the_slots_new_child_beat_once_it_is_done(redis_url):
    """A child died holding a job while Redis was down: its requeue is put off, and its
    slot gets a replacement meanwhile, which beat (and found no suspects) before the job
    went back. Once the requeue is done, that replacement, the slot's child now, is told
    to beat at once (settings.BEAT_NOW) to learn of the suspect; the other slot's child is
    not, and the dead child's slot is forgotten (Supervisor.dead_slots)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    import forkq
    from forkq import keys
    from forkq.fetch import ReliableFetch
    from forkq.queues import QueueOrder
    from forkq.settings import BEAT_NOW
    from helpers import free_port
    sup = Supervisor(Settings(processes=2, redis_url=redis_url))
    made = _pinging_children(sup, range(3))
    (dead, _, _), (_, _, other_control), (new, _, new_control) = made
    del sup.children[new.pid]  # forked below, into the slot the dead child leaves
    held = ReliableFetch(redis.Redis.from_url(redis_url), dead.identity, QueueOrder([("default", 0)]))
    held.register()
    forkq.Client(redis_url).push("Any", [1])
    assert len(held.fetch(1)) == 1  # in flight in the child about to die
    try:
        sup._redis = redis.Redis(port=free_port(), retry=Retry(NoBackoff(), 0))  # Redis down
        del sup.children[dead.pid]
        sup.child_exited(dead, signal.SIGKILL)
        assert sup.pending_requeue == [(dead.identity, True)] and sup.dead_slots == {dead.identity: 0}
        new.slot = 0
        sup.children[new.pid] = new
        sup._redis, sup._requeue_retry_at = None, 0.0  # Redis back
        assert sup.requeue_pending() == {dead.identity: (1, 0)}
        r = redis.Redis.from_url(redis_url)
        assert r.llen(keys.SUSPECTS_PREFIX + "default") == 1
        assert _commands(new_control) == bytes([BEAT_NOW]) and _commands(other_control) == b""
        assert sup.pending_requeue == [] and sup.dead_slots == {}
    finally:
        held.redis.close()
        _close_master(sup, made)
