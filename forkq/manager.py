"""The processors of one process, and the fetch loop that feeds them.

A claim takes as many jobs as there are idle processors, in one Lua round trip that also
carries the acks of finished jobs. While jobs keep coming, the processor that finishes
and finds nothing handed over makes the claim itself, keeps one job and hands the rest
to the others: no thread wakes another just to claim, and none waits for one that was
woken. The fetch thread claims when a processor cannot: at start, after a blocking
waiter caught a job, after a failed claim (with backoff), and for processors that went
idle while another claim was on its way. When Redis has nothing, the per-queue waiters
block in BLMOVE. One claim runs at a time (the baton).

Isolation of suspects: jobs that were in flight in a process that crashed wait on their
queue's `forkq:suspects:QUEUE` list. When the heartbeat sees suspects on this process's
queues, the fetch loop stops claiming, waits until every processor is idle, then claims
one suspect, runs it alone, and claims the next one the same way when it has finished,
until none is left. A crash while a suspect runs alone has that one job in flight, so it
counts against that job only: an innocent job that happened to run beside a poison job is
never poisoned.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import redis

from . import logs
from .fetch import ReliableFetch, Unit, Waiters, crash_id, refusal, writes_refused
from .processor import Processor
from .queues import QueueOrder
from .retry import Outcomes
from .settings import STOP_PATIENCE_S

log = logs.get("forkq.manager")
REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)
WATCH = 0.001  # seconds: see Handoff


class RedisHealth:
    """Logs once when Redis goes away and once when it is back, with the downtime."""

    def __init__(self) -> None:
        self._down_since: float | None = None
        self._lock = threading.Lock()
        self.outages = 0  # counts each time Redis went from answering to not

    @property
    def down(self) -> bool:
        return self._down_since is not None

    def failed(self, exc: BaseException) -> None:
        with self._lock:
            if self._down_since is None:
                self._down_since = time.monotonic()
                self.outages += 1
                log.error("Redis unreachable; fetching paused, retrying with backoff", error=str(exc))

    def ok(self) -> None:
        if self._down_since is None:
            return
        with self._lock:
            if self._down_since is not None:
                log.warning("Redis is back; fetching resumed",
                            downtime_s=round(time.monotonic() - self._down_since, 2))
                self._down_since = None


class Handoff:
    """Claimed jobs on their way to the processor threads, with as few thread wake-ups as
    can keep every job moving.

    A SimpleQueue wakes one sleeping thread per job put: ten claimed jobs, ten wake-ups,
    each a pair of futex calls and a GIL hand-over, which cost more than a no-op job runs.
    Here a put wakes one sleeper; a thread that takes a job while more wait wakes one
    more, unless a woken thread is already on its way. Short jobs drain on the threads
    already running; a job that blocks (I/O, sleep) releases the GIL, the woken thread
    takes the next job and wakes another, so blocking jobs still run side by side.

    While jobs keep coming, even that one wake-up per claim is mostly wasted: the thread
    that claimed runs the short jobs itself before the woken one gets the GIL, which then
    finds nothing (counted: one such wake-up per claim; without them a child's system time
    per no-op job fell by about two fifths). So one sleeper stands watch instead: it wakes every WATCH seconds while puts go
    on, and takes whatever it finds. A processor's own put or take (`lazy`) wakes nobody
    while a watch is kept; a job that blocks keeps the jobs claimed with it waiting for at
    most WATCH. The watch ends after a WATCH with no put, so an idle process sleeps
    untimed. The first thread woken for nothing takes the watch.
    """

    def __init__(self, watch: float = WATCH) -> None:
        self._watch_s = watch
        self._units: deque[Unit | None] = deque()
        self._lock = threading.Lock()
        self._sleepers: list[threading.Lock] = []  # the held bells of threads waiting
        self._waking = False  # a woken thread has not yet come for its job
        self._watcher: threading.Lock | None = None  # the bell of the sleeper on watch
        self._puts = 0

    def put_many(self, units: Sequence[Unit | None], lazy: bool = False) -> None:
        with self._lock:
            self._units.extend(units)
            self._puts += 1
            bell = self._wake_one(lazy)
        if bell is not None:
            bell.release()

    def _wake_one(self, lazy: bool) -> threading.Lock | None:
        if self._waking or not self._sleepers or not self._units or (lazy and self._watcher):
            return None
        self._waking = True
        return self._sleepers.pop()

    def get(self, bell: threading.Lock) -> Unit | None:
        """The next job, sleeping until there is one; `bell` is the caller's own Lock,
        held while it is not sleeping, released by whoever wakes it."""
        woken = False
        while True:
            with self._lock:
                if woken:
                    self._waking = False
                if self._units:
                    unit = self._units.popleft()
                    if self._watcher is bell:
                        self._watcher = None
                    wake = self._wake_one(True)
                else:
                    self._sleepers.append(bell)
                    if woken and self._watcher is None:
                        self._watcher = bell
                    watching = self._watcher is bell
                    puts = self._puts
                    unit = wake = _NOTHING
            if unit is not _NOTHING:
                if wake is not None:
                    wake.release()
                return unit
            if watching:
                woken = self._watch(bell, puts)
            else:
                bell.acquire()
                woken = True

    def _watch(self, bell: threading.Lock, puts: int) -> bool:
        """Sleep one WATCH on watch; True if woken by another thread."""
        if bell.acquire(timeout=self._watch_s):
            return True
        with self._lock:
            try:
                self._sleepers.remove(bell)
            except ValueError:
                popped = True  # a waker took the bell off the list and is about to ring it
            else:
                popped = False
                if self._puts == puts and not self._units:
                    self._watcher = None  # nothing put for a whole WATCH: sleep untimed
        if popped:
            bell.acquire()
        return popped

    def try_get(self) -> Any:
        """The next job without sleeping, or _NOTHING (for a processor: a lazy take)."""
        with self._lock:
            if not self._units:
                return _NOTHING
            unit = self._units.popleft()
            wake = self._wake_one(True)
        if wake is not None:
            wake.release()
        return unit

    def drain(self) -> list[Unit | None]:
        with self._lock:
            units = list(self._units)
            self._units.clear()
        return units


_NOTHING: Any = object()


class Manager:
    def __init__(self, connect: Callable[[], redis.Redis], identity: str, order: QueueOrder,
                 concurrency: int, block_timeout: float = 2.0, master: str | None = None,
                 processor: type[Processor] = Processor, heartbeat_interval: float = 5.0) -> None:
        self.redis = connect()
        self.concurrency = concurrency
        self.fetch = ReliableFetch(self.redis, identity, order, block_timeout, master,
                                   heartbeat_interval=heartbeat_interval)
        self.health = RedisHealth()
        self._refusal_logged = float("-inf")
        self.outcomes = Outcomes(self.redis, self.fetch.inflight_key)
        # `processor`: MeteredProcessor when the master serves metrics
        self.processors = [processor(self, i, self.outcomes) for i in range(concurrency)]
        self.waiters = Waiters(self.fetch, connect, self._wake_fetcher, self.health.failed)
        self.quiet_flag = False
        self.hard_stopped = False
        self.lost_thread = False
        self.on_lost: Callable[[], None] | None = None  # the worker's stop, after thread_lost
        # set by the heartbeat thread from LLEN forkq:suspects:QUEUE; read by the fetch loop
        self.suspects_waiting = False
        self._suspect: Unit | None = None   # the suspect running alone, while isolating
        self._suspect_jid: str | None = None
        self._handoff = Handoff()
        # jobs a claim brought back after quiet began: never started, _give_back_unstarted
        # returns them (see _too_late)
        self._late: list[Unit] = []
        self._idle = concurrency
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._asleep = False  # the fetcher sleeps waiting for idle processors (see done())
        # one claim at a time, by the fetcher or by a processor claiming for itself (take())
        self._baton = threading.Lock()
        # processors claim only once the fetcher's first claim succeeded (after registering)
        # and stop while the fetcher backs off after a failed claim
        self._fetcher_leads = True
        self._stopping = False  # quiet ends the claims; stop ends the fetch thread
        # set as stop() begins (not by quiet): an iterable job reads it between two items
        # and goes back to its queue with its checkpoint instead of running on (iterate.py)
        self.stopping = False
        self._fetcher = threading.Thread(target=self._fetch_loop, name="forkq-fetcher", daemon=True)

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        # registering needs Redis, so it happens on the fetch thread: with Redis down at
        # boot, the main thread must still be free to act on a stop signal
        for p in self.processors:
            p.start()
        self.waiters.start()
        self._fetcher.start()

    def quiet(self) -> None:
        """Stop claiming jobs; running ones finish. Claimed-but-unstarted ones go back."""
        if self.quiet_flag:
            return
        # the waiters first: one that sees quiet unset has landed its job before the
        # fetcher sees quiet_flag, so the fetcher's final give-back below returns it
        self.waiters.quiet()
        self.quiet_flag = True
        self._wake.set()

    def stop(self, deadline: float, tick: Callable[[], None] | None = None) -> bool:
        """Quiet, then wait until `deadline` (monotonic) for running jobs; True if all ended.
        `tick` is called about once a second while jobs run on (the child's report)."""
        self.quiet()
        self._stopping = self.stopping = True
        self._wake.set()
        self._fetcher.join(max(0.0, deadline - time.monotonic()))
        self.waiters.stop(max(0.0, deadline - time.monotonic()))
        # ticks go by the clock, not by each thread's join: threads ending less than a
        # second apart would otherwise drain with no tick at all
        next_tick = time.monotonic() + 1.0
        for p in self.processors:
            while (left := deadline - time.monotonic()) > 0 and p.thread.is_alive():
                if tick is None:
                    p.thread.join(left)
                    continue
                p.thread.join(min(left, max(0.0, next_tick - time.monotonic())))
                if p.thread.is_alive() and time.monotonic() >= next_tick:
                    tick()
                    next_tick = time.monotonic() + 1.0
        if any(p.thread.is_alive() for p in self.processors):
            self.hard_stopped = True
            return False
        return True

    def thread_lost(self, index: int) -> None:
        """A processor thread failed outside any job (called in its except block): this
        process stops, gracefully, so that its jobs go back and a whole one replaces it."""
        log.critical("processor thread failed outside any job; stopping this process so that "
                     "its jobs go back to their queues", thread=index, exc_info=True)
        self.lost_thread = True
        if self.on_lost is not None:
            self.on_lost()

    def busy(self) -> int:
        return sum(1 for p in self.processors if p.current is not None)

    def running(self) -> list[tuple[int, tuple[str, bytes, float, Any, str]]]:
        return [(p.index, cur) for p in self.processors if (cur := p.current) is not None]

    def counts(self) -> tuple[int, int]:
        """Executions and failures since start (summed per thread: no lock on the hot path)."""
        return (sum(p.processed for p in self.processors), sum(p.failed for p in self.processors))

    # -- processor side -------------------------------------------------------------------
    def take(self, bell: threading.Lock) -> Unit | None:
        """The next claimed job for a processor (None: stop); `bell` as in Handoff.get.

        A processor that finds nothing handed over claims for itself and every other idle
        processor, instead of waking the fetcher thread and sleeping until the fetcher
        wakes it: two thread hand-overs fewer on each claim's path."""
        unit = self._handoff.try_get()
        if unit is _NOTHING:
            unit = self._claim_here()
            if unit is _NOTHING:
                return self._handoff.get(bell)
        return unit

    def _claim_here(self) -> Any:
        if self._fetcher_leads or self.quiet_flag or self.suspects_waiting:
            return _NOTHING
        if not self._baton.acquire(blocking=False):
            # a claim is under way: it covers this processor if it was idle in time, and
            # its claimer looks again once it has let go of the baton (below)
            return _NOTHING
        units: list[Unit] = []
        try:
            want = self._idle
            if want <= 0 or self._fetcher_leads or self.quiet_flag or self.suspects_waiting:
                return _NOTHING
            try:
                units = self.fetch.fetch(want)
            except Exception as exc:
                # the fetcher thread backs off and retries; processors wait for it
                self._fetcher_leads = True
                if isinstance(exc, REDIS_ERRORS):
                    self.health.failed(exc)
                elif not writes_refused(exc):  # the fetcher's back-off logs those, once a minute
                    log.exception("fetch failed")
                self._wake.set()
                return _NOTHING
            self.health.ok()
            if units and self.quiet_flag:
                return self._too_late(units)
            if units:
                with self._lock:
                    self._idle -= len(units)
                if len(units) > 1:
                    self._handoff.put_many(units[1:], lazy=True)
            else:
                self.waiters.arm()
        finally:
            self._baton.release()
        # Checked after letting go: a processor turned away by the baton had already
        # counted itself idle and queued its ack. With jobs claimed, any idle processor
        # left (it went idle during the claim, or the queue ran short) needs another
        # claim; with none, a processor that finished during the claim has an ack to send.
        # The fetcher makes that claim (and arms the waiters if it finds nothing).
        if self._idle > (0 if units else want):
            self._wake.set()
        return units[0] if units else _NOTHING

    def done(self, token: str | None, after: tuple[str, ...] | None = None) -> None:
        if token is not None:
            self.fetch.ack(token, after)
        if self._suspect is not None:
            # while isolating, the suspect is the only job running: this is its end
            self.fetch.suspect_done(self._suspect_jid)
            self._suspect = None
        with self._lock:
            self._idle += 1
        if self._asleep:
            self._wake.set()  # only while isolating, or while processors may not claim

    def write(self, fn: Callable[..., Any], *args: Any, patient: bool = False) -> Any:
        """Run a Redis write, riding out an outage with backoff until a hard stop.

        A `patient` write has a later chance (the master's or orphan recovery's requeue), so
        it gives up sooner: the patient writes share one wait of STOP_PATIENCE_S from the
        first failure among them (ended early by limit_patience), and once that is spent,
        each further one is tried once. Five stop-time writes against a Redis that is gone
        wait seconds, not five times as long, and a stopping child ends before its master
        kills it. The wait belongs to one outage: after Redis has answered anything, the
        next outage gets a new one.

        A write Redis refuses for a state that passes (maxmemory reached, a failed save:
        fetch.writes_refused) is ridden out the same way, but only by one that is not
        patient: a job's outcome left unwritten would keep the job in flight, held by no
        thread, until its process stops. A patient one has its later chance at once."""
        delay = 0.05
        refused = False
        while True:
            try:
                result = fn(*args)
            except redis.ResponseError as exc:
                if patient or self.hard_stopped or not writes_refused(exc):
                    raise
                if not refused:
                    refused = True  # one line per write, not one per try
                    log.error(f"Redis {refusal(exc)}; trying again until it takes this write",
                              error=str(exc))
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            except REDIS_ERRORS as exc:
                if self.hard_stopped and not patient:
                    raise  # a job's outcome, with its process past the timeout
                self.health.failed(exc)
                pause = delay
                if patient:
                    now = time.monotonic()
                    if self._patience_outage != self.health.outages:
                        self._patience_outage = self.health.outages
                        self._patience_ends = min(now + STOP_PATIENCE_S, self._patience_limit)
                    ends = self._patience_ends
                    if now >= ends:
                        raise
                    pause = min(delay, ends - now)
                time.sleep(pause)
                delay = min(delay * 2, 2.0)
                continue
            self.health.ok()
            return result

    _patience_outage = 0
    _patience_ends = 0.0
    _patience_limit = float("inf")

    def limit_patience(self, until: float) -> None:
        """Patient writes give up by `until` (monotonic) at the latest."""
        self._patience_limit = until
        self._patience_ends = min(self._patience_ends, until)

    # -- fetch loop -----------------------------------------------------------------------
    def _wake_fetcher(self) -> None:
        self._wake.set()

    def _sleep(self, ready: Callable[[], bool] | None = None, timeout: float | None = None,
               watch_idle: bool = False) -> None:
        """Wait to be woken. done() sets the Event only while the fetcher sleeps with
        `watch_idle` (otherwise it would take a lock and notify per job, for nothing), so
        `ready` is checked once the flag is up: a processor that finished just before is
        seen there."""
        self._asleep = watch_idle
        try:
            if ready is None or not ready():
                self._wake.wait(timeout)
        finally:
            self._asleep = False

    def suspects_seen(self, waiting: int) -> None:
        """The heartbeat read this process's queues' suspects lists: isolate the suspects
        if there are any."""
        now = waiting > 0 and not self.quiet_flag
        if now != self.suspects_waiting:
            self.suspects_waiting = now
            self._wake.set()

    def queues_paused(self, paused: frozenset[str], resume: bool = True) -> bool:
        """The heartbeat read which of this process's queues are paused (pause.py): claim
        from none of them, block on none of them. True if that changed anything.
        `resume=False` for the registration's read, which may be older than a heartbeat's
        applied meanwhile (its reply slow to come): it may add pauses, never end one. It
        ended a pause the heartbeat had already reported honoured, and jobs of the queue
        ran until the next beat, after `forkq pause --wait` had returned."""
        order = self.fetch.order
        if paused == order.paused or not resume and paused <= order.paused:
            return False
        # Under the baton, so no claim is on its way with the old order: once this returns
        # (and the heartbeat says the pause is honoured) no job of a paused queue starts.
        # The order first, so a claim made next tries none of them; then the waiters, so
        # one blocking on a paused queue is unblocked and finds it closed; then what a
        # waiter caught just before goes back (fetch() no longer drains those lists).
        with self._baton:
            before = order.paused  # read again: the other caller may have switched meanwhile
            if not resume:
                paused = paused | before
            if paused == before:
                return False
            order.set_paused(paused)
            self.waiters.set_paused(paused)
            for queue in sorted(paused - before):
                self.fetch.give_back_landed(queue)
        for queue in sorted(paused - before):
            log.info("queue paused: no more of its jobs start here until it is resumed", queue=queue)
        for queue in sorted(before - paused):
            log.info("queue resumed", queue=queue)
        self._wake.set()  # a resumed queue may have jobs waiting: claim now
        return True

    def _register(self) -> bool:
        """Enter the owners registry before the first claim; False if stopped first."""
        delay = 0.05
        refused = False
        while not self.quiet_flag:
            try:
                paused = self.fetch.register()
            except (*REDIS_ERRORS, redis.ResponseError) as exc:
                # A full Redis refuses the registry's HSET; raised, it ended this thread,
                # and the process lived on heartbeating with nothing fetching its jobs
                if isinstance(exc, REDIS_ERRORS):
                    self.health.failed(exc)
                elif not writes_refused(exc):
                    raise
                elif not refused:
                    refused = True
                    log.error(f"Redis {refusal(exc)}; no job is claimed until it takes this "
                              "process's registration", error=str(exc))
                self._wake.wait(delay)
                self._wake.clear()
                delay = min(delay * 2, 2.0)
                continue
            self.health.ok()
            self.queues_paused(paused, resume=False)
            return True
        return False

    def _fetch_loop(self) -> None:
        if not self._register():
            self._give_back_unstarted()
            return
        delay = 0.05
        while not self.quiet_flag:
            self._wake.clear()
            if self.suspects_waiting:
                self._isolate()
                continue
            want = self._idle
            if want == 0:
                # processors claim for themselves as they finish (take()), unless one of
                # their claims failed: then this thread claims until one succeeds
                leads = self._fetcher_leads
                self._sleep(lambda: self._idle > 0, watch_idle=leads)
                continue
            with self._baton:
                want = self._idle
                if want == 0:
                    continue
                try:
                    units = self.fetch.fetch(want)
                except Exception as exc:
                    self._fetcher_leads = True
                    delay = self._back_off(exc, delay, "fetch failed")
                    continue
            self._fetcher_leads = False
            delay = 0.05
            self.health.ok()
            if units and self.quiet_flag:
                self._too_late(units)
                break
            if units:
                with self._lock:
                    self._idle -= len(units)
                self._handoff.put_many(units)
                continue
            self.waiters.arm()
            # a job that ended during the claim: claim again at once, carrying its ack
            self._sleep(lambda: self._idle != want)
        self._give_back_unstarted()
        self._ack_while_quiet()

    def _ack_while_quiet(self) -> None:
        """Quiet lasts until the stop (a preStop hook, then TERM), and no claim carries
        acks meanwhile: send them as jobs finish, or a process SIGKILLed after its grace
        period would run again every job that ended after it went quiet."""
        refused = False
        while not self._stopping:
            self._wake.clear()
            self._sleep(lambda: self._stopping or self.fetch.pending_acks() > 0, watch_idle=True)
            if not self.fetch.pending_acks():
                continue
            try:
                self.fetch.flush_acks()
            except Exception as exc:
                # kept for the next try; the final requeue flushes what is left
                if isinstance(exc, REDIS_ERRORS):
                    self.health.failed(exc)
                elif writes_refused(exc):
                    if not refused:  # one line as it starts, not a traceback a second
                        log.error(f"could not send acks while quiet: Redis {refusal(exc)}; "
                                  "trying again", error=str(exc))
                else:
                    log.exception("could not send acks while quiet")
                refused = writes_refused(exc)
                self._wake.clear()
                self._wake.wait(1.0)  # done() does not set it now: a pause, unless stop()
            else:
                refused = False
                self.health.ok()

    def _back_off(self, exc: Exception, delay: float, what: str) -> float:
        """After a failed claim (called inside the except block): report it, wait `delay`
        or until woken, and return the next, longer delay."""
        if isinstance(exc, REDIS_ERRORS):
            self.health.failed(exc)  # one line per outage, not one per attempt
        elif writes_refused(exc):  # NOREPLICAS, MISCONF: refused claims, one line a minute
            now = time.monotonic()
            if now - self._refusal_logged >= 60.0:
                self._refusal_logged = now
                log.error(f"{what}: Redis {refusal(exc)}", error=str(exc))
        else:
            log.exception(what)
        self._sleep(timeout=delay)
        return min(delay * 2, 2.0)

    def _isolate(self) -> None:
        """Run the suspects one at a time, each alone in this process, until none is left.

        Nothing else is claimed meanwhile: the waiters pause (what they caught goes back),
        and each claim waits until every processor is idle, its ack riding on the claim.
        """
        self.waiters.pause()
        log.info("isolating suspects: no new jobs until they have run, one at a time, alone")
        ran = 0
        returned_landed = False
        delay = 0.05
        while not self.quiet_flag:
            self._wake.clear()
            if self._idle < self.concurrency:
                if ran == 0 and not self.suspects_waiting:
                    break  # another process took them while our jobs were finishing
                self._sleep(lambda: self._idle == self.concurrency, watch_idle=True)
                continue
            with self._baton:
                if self._idle < self.concurrency:
                    continue  # a processor's claim, under way as isolation began, handed out jobs
                try:
                    if not returned_landed:
                        self.fetch.give_back_all_landed()
                        returned_landed = True
                    unit, leftovers = self.fetch.claim_suspect()
                except Exception as exc:
                    delay = self._back_off(exc, delay, "claiming a suspect failed")
                    continue
            delay = 0.05
            self.health.ok()
            if leftovers:
                log.warning("jobs held by no thread were left in flight; put back before a suspect "
                            "runs alone", count=leftovers)
            if unit is None:
                break
            if self.quiet_flag:
                # as in _too_late: claimed after quiet began, it goes back among the
                # suspects unstarted (_give_back_unstarted knows it by self._suspect)
                self._suspect, self._suspect_jid = unit, crash_id(unit.raw)
                self._late.append(unit)
                break
            ran += 1
            jid = _jid(unit.raw)
            self._suspect_jid = crash_id(unit.raw)  # its crash count's name: a jid-less job has one too
            self._suspect = unit
            log.warning("running a suspect alone", jid=jid, queue=unit.queue)
            with self._lock:
                self._idle -= 1
            self._handoff.put_many([unit])
        self.suspects_waiting = False
        self.waiters.resume()
        log.info("isolation ended", suspects_run=ran, stopping=self.quiet_flag)

    def _too_late(self, units: list[Unit]) -> Any:
        """Keep a claim's jobs from starting once quiet has begun (called holding the
        baton). A claim stuck on a frozen Redis returns after the stop gave up on it, and
        maybe after the final requeue put its jobs back on their queues: started then, they
        ran twice."""
        self._late.extend(units)
        return _NOTHING

    def _give_back_unstarted(self) -> None:
        with self._baton:  # a processor's claim under way ends first; quiet stops the next
            pass
        late, self._late = self._late, []
        unstarted: list[Unit] = []
        for u in [*late, *self._handoff.drain()]:
            if u is None:
                continue
            if u is self._suspect:
                # a suspect goes back among the suspects, never onto its queue
                self._suspect = None
                try:
                    self.write(self.fetch.return_suspect, u, patient=True)
                except Exception as exc:
                    _stop_failure(exc, "could not return an unstarted suspect; the final requeue does")
                continue
            unstarted.append(u)
        # landed jobs arrived after the claimed ones: back first, so the claimed end up ahead
        try:
            self.write(self.fetch.give_back_all_landed, patient=True)
        except Exception as exc:
            _stop_failure(exc, "could not return landed jobs; they stay private until the final requeue")
        if unstarted:
            try:
                self.write(self.fetch.requeue, unstarted, patient=True)
            except Exception as exc:
                _stop_failure(exc, "could not return unstarted jobs; they stay in flight for the final requeue")
        if self.fetch.pending_acks():
            try:
                self.write(self.fetch.flush_acks, patient=True)
            except Exception:
                log.warning("could not flush acks now; the final requeue flushes them first")
        self._handoff.put_many([None] * len(self.processors))


def _jid(raw: bytes) -> str | None:
    try:
        jid = json.loads(raw).get("jid")
    except (ValueError, AttributeError):
        return None
    return jid if isinstance(jid, str) else None


def _stop_failure(exc: BaseException, what: str) -> None:
    """A stop-time write that failed (called inside its except block). An outage or a
    refusal, which the final requeue or the master deals with, is one line; anything else
    keeps its traceback."""
    if isinstance(exc, REDIS_ERRORS) or writes_refused(exc):
        log.error(what, error=str(exc))
    else:
        log.exception(what)  # called inside the except block
