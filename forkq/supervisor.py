"""The master: forks N children, talks to them over pipes, respawns and requeues.

One thread, one loop (after gunicorn's arbiter): wait on the self-pipe (signals) and the
children's report pipes, then handle signals, reap dead children (putting their private
jobs back before forking a replacement), kill hung or oversized ones, and fork until
every slot is filled. A child retired on purpose (--max-memory, --max-jobs, HUP, a job
interrupted) no longer fills its slot: its replacement is forked at once and claims jobs
while the old one finishes its own, so a recycle costs no capacity. Children never see
the master's signals directly: each command travels as one byte (a signal number) down a
pipe the master holds to every child, and EOF on that pipe tells a child its master is
gone.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import resource
import select
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

import psutil
import redis

from . import client, control, hooks, keys, logs, orphans, reload, scripts, strays, systemd, titles
from .fetch import After, Requeued, refusal, requeue_owner_counts, settle_acks, writes_refused
from .metrics import MetricsServer
from .settings import BEAT_NOW, STOP_GRACE_S, STOP_PATIENCE_S, Settings

log = logs.get("forkq.supervisor")
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGTSTP, signal.SIGTTIN, signal.SIGHUP)
# A child must outlive the signals a terminal or `systemctl kill` sends to the whole group,
# but the programs its jobs start must not inherit that: an ignored signal stays ignored
# across exec, so `Popen.terminate()` from a job did nothing. A caught one is reset to the
# default by exec, so the child catches these and does nothing with them.
CHILD_SHRUGS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
# Job control only: ignored by the job's programs too, so Ctrl-Z (forkq's quiet) freezes
# none of them.
CHILD_IGNORES = (signal.SIGTSTP, signal.SIGTTIN)
CRASH_LOOP_LIMIT = 3
# The master's read timeout on its Redis connection: what one call costs its loop when Redis
# has stopped answering (paused, a partition). The "socket timeout" the requeue and
# sweep comments below weigh their tries against.
REDIS_TIMEOUT_S = 5.0
# How often a master whose loop turns touches its pidfile: `forkq ctl check --stuck-after`
# judges a stuck master by the file's age
PIDFILE_TOUCH_S = 5.0
# read_report takes 4 KiB a call: this many drain a default-sized (64 KiB) pipe
PIPE_READS = 16


@dataclass
class Child:
    slot: int
    pid: int
    identity: str
    control_w: int          # master -> child commands
    report_r: int           # child -> master pings "B<busy> <processed> <failed>\n"
    started: float
    last_ping: float
    busy: int = 0
    totals: tuple[int, int] | None = None  # jobs processed and failed, as last pinged
    ready: bool = False                    # has reported since its worker started
    # told to stop (recycle) at this monotonic time: retired, it drains its running jobs
    # beside its replacement and no longer fills its slot (Supervisor.occupants)
    stopping_since: float | None = None
    reason: str = ""                       # why the master ended it: memory, jobs, hang, restart, time_limit, cancel
    # a job of it was interrupted: replace it, with this reason (time_limit, cancel)
    stuck: str | None = None
    fatal: str = ""                        # the error it reported just before dying
    finished: list[After] = field(default_factory=list)  # acks of jobs it finished, with actions
    buffer: bytes = b""


@dataclass
class Slot:
    failures: int = 0           # consecutive deaths soon after start
    next_spawn: float = 0.0     # monotonic time before which not to fork (backoff)
    last_exit: str = ""


@dataclass
class Stats:
    restarts: dict[str, int] = field(default_factory=dict)
    requeued: int = 0
    poisoned: int = 0
    suspects: int = 0      # of requeued: sent to their queue's suspects list, to run alone
    strays: int = 0        # of requeued: from structures no registered process held

    def add(self, counts: Requeued) -> None:
        self.requeued += counts.requeued
        self.poisoned += counts.poisoned
        self.suspects += counts.suspects


class Supervisor:
    def __init__(self, settings: Settings, pidfile: str | None = None,
                 watcher: reload.Watcher | None = None) -> None:
        self.settings = settings
        self.watcher = watcher             # --reload: the app's files (see check_reload)
        self.reloading: list[str] | None = None  # the changed files while a reload stops
        self.pidfile = pidfile
        self._pidfile_touched = time.monotonic()
        self.children: dict[int, Child] = {}
        self.slots = [Slot() for _ in range(settings.processes)]
        self.state = "running"            # running | quiet | stopping
        self.stop_deadline = 0.0
        self.recycle: list[int] = []       # slots queued for a rolling restart (HUP)
        self.pending_requeue: list[tuple[str, bool]] = []
        self.dead_slots: dict[str, int] = {}  # identity -> slot, of those in pending_requeue
        # identity -> acks (in-flight fields, with their after-success actions) of jobs a
        # stopping child finished but may not have acknowledged in Redis: applied before
        # its requeue, which would run them again (fetch.settle_acks)
        self.finished: dict[str, list[After]] = {}
        # identity -> the totals a child that exited last pinged, until they are in the stats
        self.uncounted: dict[str, tuple[int, int]] = {}
        self.stats = Stats()
        self.nonce = os.urandom(6).hex()
        self.identity = f"{socket.gethostname()}:{os.getpid()}:{self.nonce}"
        self.app = " ".join(settings.require) or "-"
        self._redis: redis.Redis | None = None
        self._sig_r, self._sig_w = os.pipe()
        self.exit_code = 0
        self._ready_sent = False
        self._requeue_retry_at = 0.0   # after Redis failed a requeue, don't block on it again
        self._requeue_backoff = 0.0    # ... for this long (s), doubling while it keeps failing
        self.sweeper = orphans.Sweeper(self.identity, settings.recovery_delay,
                                       settings.heartbeat_interval, settings.poison_after)
        self.scanner = strays.Scanner(self.sweeper)
        self._watchdog_every = systemd.watchdog_interval()
        self._last_watchdog = 0.0
        self.metrics: MetricsServer | None = None
        self._open_files_limit = resource.getrlimit(resource.RLIMIT_NOFILE)

    # -- main loop ----------------------------------------------------------------------
    def run(self) -> int:
        # The children's own modules, imported here before any fork: every child runs the
        # code this master started with. Imported in each child, after an in-place upgrade
        # (pip install -U under a running master) a respawned child mixed the new worker
        # with the master's old fetch and scripts, and crashed at start or stop. Their
        # pages are shared too. Importing them starts no thread.
        from . import worker  # noqa: F401
        if self.settings.metrics_port is not None:
            # listening before the first fork, and before gc.freeze(): the children share
            # the imported client library's pages, and close the socket (see child_main)
            self.metrics = MetricsServer(self, self.settings.metrics_bind, self.settings.metrics_port)
            host, port = self.metrics.address
            log.info("metrics served", url=f"http://{host}:{port}/metrics")
        self._open_files_limit = _make_room_for_pipes(self.settings.processes)
        for fd in (self._sig_r, self._sig_w):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(self._sig_w)
        for sig in FORWARDED + (signal.SIGCHLD,):
            signal.signal(sig, _noop)
        # The scripts a dead child's requeue (release and batch_fail: a poison job's unique
        # lock and batch) and count need, read now rather than at the first death: a master
        # whose Redis connection is open needs no new descriptor to put a child's jobs back,
        # even with its limit on open files reached (the stray scan keeps that connection
        # open more of the time)
        for name in ("requeue_all", "release", "batch_fail", "flush_stats"):
            scripts.source(name)
        # children share the preloaded app's pages: nothing the master allocated so far
        # is touched by a collection that would copy it
        gc.collect()
        gc.freeze()
        log.info("master started", processes=self.settings.processes, app=self.app,
                 identity=self.identity)
        self.sweep_orphans(boot=True)
        try:
            while True:
                self.spawn_missing()
                self.set_title()
                self.notify_systemd()
                self.touch_pidfile()
                if self.state in ("stopping", "failed") and not self.children:
                    break
                self.wait_for_events(0.5)
                self.reap_children()
                if self.children or self.state not in ("stopping", "failed"):
                    self.requeue_pending()  # else the loop ends, and the final pass tries
                self.sweep_orphans()
                self.sweep_strays()
                self.murder_hung_children()
                self.recycle_children()
                self.roll_restart()
                self.enforce_stop_deadline()
                self.check_reload()
        finally:
            self.requeue_pending(final=True)
            if self.metrics is not None:
                self.metrics.close()
        log.info("master stopped", exit_code=self.exit_code, restarts=self.stats.restarts,
                 requeued=self.stats.requeued, poisoned=self.stats.poisoned,
                 suspects=self.stats.suspects, strays=self.stats.strays)
        return self.exit_code

    def wait_for_events(self, timeout: float) -> None:
        fds = [self._sig_r] + [c.report_r for c in self.children.values()]
        wfds: list[int] = []
        if self.metrics is not None:
            fds += self.metrics.read_fds()
            wfds = self.metrics.write_fds()
        # poll, not select: select cannot watch a descriptor numbered 1024 or more, which
        # the children's pipes reach with some 500 children (the limit is 1024)
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        for fd in wfds:
            poller.register(fd, select.POLLOUT)
        ready, writable = [], []
        for fd, events in poller.poll(timeout * 1000):
            if events & select.POLLOUT:
                writable.append(fd)
            elif events & (select.POLLIN | select.POLLHUP | select.POLLERR):
                ready.append(fd)  # a hang-up or error is read as EOF, as select reported it
        by_fd = {c.report_r: c for c in self.children.values()}
        for fd in ready:
            if fd == self._sig_r:
                self.handle_signals()
            elif fd in by_fd:
                self.read_report(by_fd[fd])
            elif self.metrics is not None and self.metrics.owns(fd):
                self.metrics.readable(fd)
        if self.metrics is not None:
            for fd in writable:
                self.metrics.writable(fd)
            self.metrics.expire()

    def handle_signals(self) -> None:
        try:
            data = os.read(self._sig_r, 256)
        except BlockingIOError:
            return
        for signum in data:
            if signum in (signal.SIGINT, signal.SIGTERM):
                self.handle_stop(signum)
            elif signum == signal.SIGTSTP:
                self.handle_quiet()
            elif signum == signal.SIGTTIN:
                log.warning("thread dumps requested", children=len(self.children))
                self.tell_all(signal.SIGTTIN)
            elif signum == signal.SIGHUP:
                self.handle_hup()

    # -- signal handling ----------------------------------------------------------------
    def handle_stop(self, signum: int) -> None:
        if self.reloading is not None:
            self.cancel_reload(signum)
        if self.state == "stopping":
            log.info("already stopping", signal=signal.Signals(signum).name)
            return
        log.info("stopping children", signal=signal.Signals(signum).name, timeout=self.settings.timeout)
        self.state = "stopping"
        systemd.stopping(f"stopping {len(self.children)} children")
        self.stop_deadline = time.monotonic() + self.settings.timeout + STOP_GRACE_S
        self.tell_all(signal.SIGTERM)

    def handle_quiet(self) -> None:
        if self.state == "running":
            log.info("quiet: children stop taking new jobs")
            self.state = "quiet"
        self.tell_all(signal.SIGTSTP)

    def handle_hup(self) -> None:
        if self.state != "running":
            return
        log.info("rolling restart of every child, one at a time")
        self.recycle = sorted(c.slot for c in self.occupants())

    # -- --reload (see reload.py) -------------------------------------------------------
    def check_reload(self) -> None:
        """Stop every child the normal way when a watched file changed (running jobs finish
        within --timeout, unstarted ones go back); the caller then execs a new master
        (reload_wanted). While that stop runs nothing is polled: a file saved meanwhile is
        read by the new master's import."""
        watcher = self.watcher
        if watcher is None or self.state != "running" or not watcher.due():
            return
        changed = watcher.changed()
        if not changed:
            return
        log.info(f"reloading: {reload.shown(changed)} changed; stopping children",
                 files=len(changed), timeout=self.settings.timeout)
        self.reloading = changed
        self.state = "stopping"
        self.stop_deadline = time.monotonic() + self.settings.timeout + STOP_GRACE_S
        self.tell_all(signal.SIGTERM)

    def cancel_reload(self, signum: int) -> None:
        """A stop asked for while a reload stops the children: exit instead of starting again."""
        log.info("stop requested during the reload; exiting instead", signal=signal.Signals(signum).name)
        self.reloading = None

    def reload_wanted(self) -> bool:
        """After run(): whether to exec a new master. Not if a stop signal came in after the
        loop's last look at its self-pipe (reload.reexec looks again, just before the exec)."""
        if self.reloading is None or self.exit_code != 0:
            return False
        return not self.stop_pending()

    def stop_pending(self) -> bool:
        """Whether a stop signal came in since the loop last read its self-pipe (the reload
        is then cancelled)."""
        try:
            pending = os.read(self._sig_r, 256)
        except (BlockingIOError, OSError):
            pending = b""
        if any(signum in (signal.SIGINT, signal.SIGTERM) for signum in pending):
            self.cancel_reload(signal.SIGTERM if signal.SIGTERM in pending else signal.SIGINT)
            return True
        return False

    def tell(self, child: Child, signum: int) -> None:
        try:
            os.write(child.control_w, bytes([signum]))
        except (BrokenPipeError, BlockingIOError, OSError):
            pass  # it is exiting; the reaper deals with it

    def tell_all(self, signum: int) -> None:
        for child in list(self.children.values()):
            self.tell(child, signum)

    # -- children -------------------------------------------------------------------------
    def read_report(self, child: Child) -> bool:
        """Read what the child wrote: "B<busy> <processed> <failed>" pings (or "B<busy>"),
        "Q"/"T" quiet or stop asked through Redis, "A<json list>" finished jobs' in-flight
        fields (with their after-success actions) as it stops, "E<error>" before it dies, or "M<json>" metrics deltas
        (--metrics-port)."""
        try:
            data = os.read(child.report_r, 4096)
        except (BlockingIOError, InterruptedError):
            return False
        if not data:
            return False  # EOF: it is exiting; waitpid will tell how
        child.last_ping = time.monotonic()
        child.buffer += data
        *lines, child.buffer = child.buffer.split(b"\n")
        for line in lines:
            if line.startswith(b"B") and (ping := _parse_ping(line)) is not None:
                child.busy, totals = ping
                if totals is not None:
                    child.totals = totals
                if not child.ready:
                    child.ready = True
                    # a child that got going ends its slot's streak of failed starts: a slot
                    # that recovered is no longer crash-looping (the watchdog relies on this)
                    self.slots[child.slot].failures = 0
            elif line == b"Q":
                if self.state == "running":
                    log.info("quiet requested through Redis", slot=child.slot, child_pid=child.pid)
                    self.handle_quiet()
            elif line in (b"L", b"C"):
                # replaced by recycle_children, one recycle at a time; a limit's reason wins
                if child.stuck != "time_limit":
                    child.stuck = "time_limit" if line == b"L" else "cancel"
            elif line == b"T":
                log.info("stop requested through Redis", slot=child.slot, child_pid=child.pid)
                self.handle_stop(signal.SIGTERM)
            elif line.startswith(b"A"):
                child.finished.extend(_parse_acks(line))
            elif line.startswith(b"E"):
                child.fatal = line[1:].decode("utf-8", "replace")
            elif line.startswith(b"M") and self.metrics is not None:
                self.metrics.aggregates.add(line[1:])
        if len(child.buffer) > 65536:
            child.buffer = b""  # no line of the protocol is this long: drop, don't grow
        return True

    def reap_children(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            child = self.children.pop(pid, None)
            if child is not None:
                self.child_exited(child, status)

    def child_exited(self, child: Child, status: int) -> None:
        while self.read_report(child):
            pass  # what it wrote just before dying (why it died) may not be read yet
        os.close(child.control_w)
        os.close(child.report_r)
        code = os.waitstatus_to_exitcode(status)
        how = f"exit {code}" if code >= 0 else f"signal {signal.Signals(-code).name}"
        expected = self.state == "stopping" or child.reason in ("memory", "jobs", "restart", "time_limit", "cancel")
        # a child only leaves on its own when told to: an exit 0 nobody asked for is a job
        # calling os._exit(0), and must count against the jobs it held like any crash
        crashed = code != 0 or not expected
        if crashed and not expected:
            log.error("child died", slot=child.slot, child_pid=child.pid, how=how,
                      error=child.fatal or None)
        else:
            # a reason only when the master retired it (memory, restart): a plain stop has none
            extra = {"reason": child.reason} if child.reason else {}
            log.info("child exited", slot=child.slot, child_pid=child.pid, how=how, **extra)
        if self.state not in ("stopping", "failed") and child.stopping_since is None:
            # a crash (see above) or a child killed as hung; a retired child was counted
            # as it was retired (count_restart), and neither a stop nor a crash-loop
            # give-up (whose kill_all ends a slot's booting try) replaces anybody
            self.count_restart(child.reason or "crash")
        if child.totals is not None:
            # what it ran since its last flush, counted with the requeue: a crash left it
            # unflushed; after a clean exit whose last flush went through, nothing is added
            self.uncounted[child.identity] = child.totals
        if child.finished:
            self.finished[child.identity] = child.finished
        # its private jobs go back before anything else happens to the slot
        self.pending_requeue.append((child.identity, crashed))
        self.dead_slots[child.identity] = child.slot
        held = self.requeue_pending().get(child.identity, (0, 0))
        slot = self.slots[child.slot]
        if child.stopping_since is not None:
            # retired: its replacement has had the slot since. One that failed to start
            # meanwhile may have failed for want of what this child held (an on_fork hook
            # binding a port per slot): the slot starts over now, forked into at once and
            # with no streak, as when replacements waited for this exit. Its last_exit
            # stays the failed start's.
            slot.failures = 0
            slot.next_spawn = 0.0
            return
        slot.last_exit = f"{how}: {child.fatal}" if child.fatal else how
        lived = time.monotonic() - child.started
        # Only a child that never got going counts toward giving up: one that reported a
        # fatal error, or died early without ever reporting ready. A child killed after it
        # was up (OOM killer, an operator) or holding jobs (suspects, the poison count deals
        # with them) says nothing about whether the app can boot.
        failed_to_start = child.fatal or (not child.ready and lived < self.settings.boot_window)
        if crashed and not expected and failed_to_start and not any(held):
            slot.failures += 1
            slot.next_spawn = time.monotonic() + min(0.1 * 2 ** (slot.failures - 1), 10.0)
        else:
            slot.failures = 0
            slot.next_spawn = 0.0
        self.give_up_if_no_slot_starts(slot)

    def give_up_if_no_slot_starts(self, slot: Slot) -> None:
        # not while a slot's retired child drains: its replacement's failed starts may be
        # for want of what that child holds, and the slot starts over at its exit
        draining = self.draining_slots()
        if self.state == "running" and all(s.failures >= CRASH_LOOP_LIMIT and i not in draining
                                           for i, s in enumerate(self.slots)):
            sys.stderr.write(
                f"forkq: every child died within {self.settings.boot_window:g}s of starting, "
                f"or could not be forked, {CRASH_LOOP_LIMIT} times in a row "
                f"(last: {slot.last_exit}); giving up. See the log above.\n")
            self.exit_code = 1
            self.state = "failed"
            self.kill_all()

    def requeue_pending(self, final: bool = False) -> dict[str, tuple[int, int]]:
        """Put dead children's jobs back; {identity: (requeued, poisoned)} of those done now."""
        done: dict[str, tuple[int, int]] = {}
        if not final and time.monotonic() < self._requeue_retry_at:
            return done  # each try can block the loop for the socket timeout
        # The final pass, as the master exits, gives an unreachable Redis STOP_PATIENCE_S
        # (at least one try: a frozen Redis takes the socket timeout), then leaves the rest
        # to orphan recovery; before that, a failure waits for the next turn of the loop.
        give_up = time.monotonic() + STOP_PATIENCE_S
        while self.pending_requeue:
            identity, crashed = self.pending_requeue[0]
            started = time.monotonic()
            try:
                if finished := self.finished.get(identity):
                    settle_acks(self.redis, identity, finished)
                    del self.finished[identity]
                counts = requeue_owner_counts(
                    self.redis, identity, [q for q, _ in self.settings.queues],
                    crashed=crashed and self.state != "stopping", poison_after=self.settings.poison_after)
            except _WAITED_OUT as exc:
                self._put_off(exc, "requeue a dead child's jobs", final)
                if not final:
                    return done
                if time.monotonic() >= give_up:
                    break
                time.sleep(0.25)
                continue
            self.sweeper.note_stall(started, "a dead child's requeue")
            self._requeue_backoff = 0.0
            self.pending_requeue.pop(0)
            done[identity] = (counts.requeued, counts.poisoned)
            self.stats.add(counts)
            slot = self.dead_slots.pop(identity, None)
            if counts.suspects and slot is not None:
                self.beat_now(slot)
            if counts.requeued or counts.poisoned:
                # suspects: how many of the requeued went to forkq:suspects:QUEUE (to run alone)
                log.warning("requeued a child's in-flight jobs", identity=identity,
                            requeued=counts.requeued, poisoned=counts.poisoned, suspects=counts.suspects)
        # then what they ran since their last flush: the jobs go back first, a round trip
        # sooner
        waiting = {i for i, _ in self.pending_requeue}
        for identity in [i for i in self.uncounted if i not in waiting]:
            try:
                self.count_unflushed(identity, self.uncounted[identity])
            except _WAITED_OUT as exc:
                self._put_off(exc, "count a dead child's last jobs", final)
                break  # tried again with the next requeue
            del self.uncounted[identity]
            self._requeue_backoff = 0.0
        if final and (self.pending_requeue or self.uncounted):
            if self.pending_requeue:
                log.error("Redis unreachable or refusing writes: these children's jobs stay in "
                          "their private lists for orphan recovery",
                          identities=[i for i, _ in self.pending_requeue])
            if self.uncounted:
                log.error("Redis unreachable or refusing writes: the jobs these children ran since "
                          "their last heartbeat are not counted in stat:processed and stat:failed",
                          totals=self.uncounted)
        return done

    def beat_now(self, slot: int) -> None:
        """Have the child filling `slot` beat now: the suspects of the one that left it were
        just put back. A replacement forked after this learns of them at its first beat and
        runs them at once, but one already working would wait for its next, up to
        --heartbeat-interval (its retired predecessor died as it drained, or Redis put the
        requeue off). Only that child: another would stop claiming until its own threads
        were idle, for suspects the slot's child may have run by then."""
        for child in self.occupants():
            if child.slot == slot:
                self.tell(child, BEAT_NOW)

    def _put_off(self, exc: BaseException, what: str, final: bool) -> None:
        """After a requeue or count that failed (called in its except block): try again in
        0.5 s, doubling to 5 s while Redis keeps failing, or, for `final`, leave it to the
        caller. Each try against a Redis that does not answer can hold the loop for the
        socket timeout, hence the wait; a fixed 5 s left a dead child's jobs off their
        queue for up to 5 s after a short blip (a BUSY script, a restart) had passed.
        A refusal that passes (BUSY while someone's script runs, a full Redis) is waited
        out as an outage is: raised, it ended the master, and every child with it, at the
        first child death or stop that met one. Any other error reply is raised."""
        if isinstance(exc, redis.ResponseError) and not writes_refused(exc):
            raise
        if not final:
            self._requeue_backoff = min(max(0.5, self._requeue_backoff * 2), 5.0)
            self._requeue_retry_at = time.monotonic() + self._requeue_backoff
            why = refusal(exc) if writes_refused(exc) else "unreachable"
            log.warning(f"cannot {what} yet: Redis {why}", error=str(exc))

    def count_unflushed(self, identity: str, totals: tuple[int, int]) -> None:
        """Add to the stats what an exited child pinged beyond what its heartbeats flushed.

        The flush_stats script compares with the totals the child's own flushes recorded, so
        a child that flushed after its last ping, or exited cleanly (its last flush recorded
        its final totals), gets nothing added, and a heartbeat of the dead child that reaches Redis after
        this adds only what this did not. The record is left to expire a minute later rather
        than deleted: such a late heartbeat, not finding it, would count its jobs again."""
        day = datetime.now(timezone.utc).strftime("%Y-%m-%d")
        try:
            processed, failed = scripts.load(self.redis, "flush_stats")(
                keys=keys.flush_stats(identity, day),
                args=[*totals, "", "", keys.HEARTBEAT_TTL_S, keys.STAT_DAY_TTL_S])
        except redis.ResponseError as exc:
            if writes_refused(exc):
                raise  # waited out with the requeue
            # a counter someone overwrote with text, say: not worth ending the master (and
            # every child) over, as an unexpected error in the requeue does
            log.error("could not count the jobs a child ran since its last heartbeat",
                      identity=identity, error=str(exc))
            return
        if processed or failed:
            log.info("counted the jobs a child ran since its last heartbeat", identity=identity,
                     processed=int(processed), failed=int(failed))

    def sweep_orphans(self, boot: bool = False) -> None:
        """Recover the jobs of forkq processes that died with their master (see orphans.py).
        Not this master's children: it puts back theirs itself, the moment they die."""
        if self.state == "stopping" and not boot:
            return
        for _identity, counts in self.sweeper.turn(self.redis, boot=boot,
                                                   skip={c.identity for c in self.children.values()}):
            self.stats.add(counts)

    def sweep_strays(self) -> None:
        """Put back jobs from private structures that no registered process holds, written
        after their process was swept (a claim stuck in the network), a slice of the keyspace
        at a time (see strays.py)."""
        if self.state == "stopping":
            return
        for _identity, counts in self.scanner.turn(self.redis):
            self.stats.add(counts)
            self.stats.strays += counts.requeued

    @property
    def redis(self) -> redis.Redis:
        if self._redis is None:
            self._redis = client.connect(self.settings.redis_url, socket_timeout=REDIS_TIMEOUT_S)
        return self._redis

    def occupants(self) -> list[Child]:
        """The child filling each filled slot: every child but the retired ones, which
        drain their jobs beside their replacements (at most one per slot, as spawn_missing
        fills a slot only when it has none)."""
        return [c for c in self.children.values() if c.stopping_since is None]

    def draining_slots(self) -> set[int]:
        """Slots whose retired child is still finishing its jobs."""
        return {c.slot for c in self.children.values() if c.stopping_since is not None}

    def all_up(self) -> bool:
        """Every slot has a child that has reported since its worker started, and that was
        not just killed as hung (reaped later: HUP's next retirement could be it)."""
        filling = self.occupants()
        return len(filling) == len(self.slots) and all(c.ready and not c.reason for c in filling)

    def spawn_missing(self) -> None:
        if self.state not in ("running",):
            return
        for index in self.vacant_slots(time.monotonic()):
            if self.state == "running":  # a failed fork may have made the master give up
                self.spawn(index)

    def vacant_slots(self, now: float) -> list[int]:
        """Slots to fork a child into now: no child fills them, and no backoff holds them.
        A retired child's slot is vacant at once: the replacement claims jobs while the old
        child drains (else, with --processes 1, none started for up to --timeout)."""
        taken = {c.slot for c in self.occupants()}
        return [index for index, slot in enumerate(self.slots)
                if index not in taken and now >= slot.next_spawn]

    def spawn(self, index: int) -> None:
        opened: list[int] = []
        try:
            opened += os.pipe()
            opened += os.pipe()
        except OSError as exc:
            self.spawn_failed(index, opened, exc)
            return
        control_r, control_w, report_r, report_w = opened
        nonce = os.urandom(6).hex()
        if self._redis is not None:
            self._redis.connection_pool.disconnect()  # no socket crosses the fork
        inherited = [fd for c in self.children.values() for fd in (c.control_w, c.report_r)]
        inherited += [self._sig_r, self._sig_w, control_w, report_r]
        _flush_output()  # a line still in a buffer would be written by both processes
        try:
            pid = os.fork()
        except OSError as exc:
            self.spawn_failed(index, opened, exc)
            return
        if pid == 0:
            code = 1
            try:
                code = self.child_main(index, nonce, control_r, report_w, inherited)
            except BaseException as exc:
                import traceback
                traceback.print_exc()
                _report_fatal(report_w, exc)
            finally:
                _flush_output()
                os._exit(code)
        os.close(control_r)
        os.close(report_w)
        os.set_blocking(report_r, False)
        os.set_blocking(control_w, False)
        now = time.monotonic()
        identity = f"{socket.gethostname()}:{pid}:{nonce}"
        self.children[pid] = Child(index, pid, identity, control_w, report_r, now, now)
        log.info("child started", slot=index, child_pid=pid)

    def spawn_failed(self, index: int, opened: list[int], exc: OSError) -> None:
        """No pipe or no fork (a pids limit such as a pod's or TasksMax, too many open
        files) is often passing: the slot backs off and tries again, as after a failed
        start, while the children that run go on working."""
        for fd in opened:
            os.close(fd)
        slot = self.slots[index]
        slot.last_exit = f"cannot fork: {exc.strerror or exc}"
        slot.failures += 1
        slot.next_spawn = time.monotonic() + min(0.1 * 2 ** (slot.failures - 1), 10.0)
        log.error("cannot start a child; trying again", slot=index, error=exc.strerror or str(exc),
                  retry_in_s=round(slot.next_spawn - time.monotonic(), 1))
        self.give_up_if_no_slot_starts(slot)

    def child_main(self, index: int, nonce: str, control_r: int, report_w: int,
                   inherited: list[int]) -> int:
        # nothing of the master's survives here: its signal traps, its wakeup fd, the
        # pipes of other children (holding one would hide the master's death from them),
        # the metrics sockets (a child holding the listener would keep the port open
        # after the master died, and could accept a scrape nobody answers)
        signal.set_wakeup_fd(-1)
        for sig in FORWARDED + (signal.SIGCHLD,):
            signal.signal(sig, signal.SIG_DFL)
        for sig in CHILD_SHRUGS:
            signal.signal(sig, _noop)
            signal.siginterrupt(sig, False)  # a syscall in a job's thread resumes, not EINTR
        for sig in CHILD_IGNORES:
            signal.signal(sig, signal.SIG_IGN)
        for fd in inherited:
            try:
                os.close(fd)
            except OSError:
                pass
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, self._open_files_limit)  # the job's own
        if self.metrics is not None:
            self.metrics.abandon()
            self.metrics = None
        os.environ["FORKQ_INDEX"] = str(index)
        systemd.drop_environment()  # only the master speaks to systemd
        s = self.settings
        logs.configure(s.log_level, s.log_format, slot=index, buffered=True)
        titles.set_title(f"forkq child {index} {self.app} [0 of {s.concurrency} busy]", titles.CHILD_NAME)
        for fn in hooks.ON_FORK:
            try:
                fn(index)
            except Exception as exc:
                name = getattr(fn, "__qualname__", repr(fn))
                raise ChildStartError(f"on_fork hook {name} raised {type(exc).__name__}: {exc}") from exc
        from .worker import Worker
        identity = f"{socket.gethostname()}:{os.getpid()}:{nonce}"
        worker = Worker(s, slot=index, master=self.identity, control_fd=control_r,
                        report_fd=report_w, identity=identity,
                        title=f"forkq child {index} {self.app}")
        return worker.run()

    def kill_all(self) -> None:
        for child in self.children.values():
            _kill(child.pid)

    # -- health ---------------------------------------------------------------------------
    def murder_hung_children(self) -> None:
        now = time.monotonic()
        if self.state == "stopping":
            return  # a stopping child is busy draining; the stop deadline bounds it
        for child in list(self.children.values()):
            if child.stopping_since is not None:
                continue
            if now - child.last_ping > self.settings.hang_timeout and child.reason != "hang":
                # its pings may be waiting unread: this loop itself was held up (a Redis
                # stall in a sweep, up to its 5 s timeout), not the child. A pipe's worth
                # at most (64 KiB): a child that writes without end must not hold the loop
                for _ in range(PIPE_READS):
                    if not self.read_report(child):
                        break
                if self.state == "stopping" or now - child.last_ping <= self.settings.hang_timeout:
                    continue
                log.error("child stopped pinging; killing it", slot=child.slot, child_pid=child.pid,
                          silent_s=round(now - child.last_ping, 1))
                child.reason = "hang"
                _kill(child.pid)

    _last_recycle_check = 0.0

    def recycle_children(self) -> None:
        """Recycle a child over --max-memory or --max-jobs, or one where a job ran past its
        time limit (interrupting a job may leave a lock held, and only a new process frees
        a thread stuck in a call)."""
        limit = self.settings.max_memory_mb
        most = self.settings.max_jobs
        now = time.monotonic()
        if now - self._last_recycle_check < 1.0:
            return
        self._last_recycle_check = now
        if any(c.stopping_since is not None for c in self.children.values()):
            # one recycle at a time: at most one child beyond --processes (the retired one
            # draining), and a replacement that cannot start holds up the next retirement
            return
        # one killed as hung this turn is not reaped yet: retired again, its death would be
        # counted under this reason instead of hang
        live = [c for c in self.children.values() if not c.reason]
        for child in live:
            if child.stuck and self.state == "running":
                log.warning("a job of this child was interrupted (past its time limit, or "
                            "cancelled); replacing the child, which interrupting the job may "
                            "have left with a lock held",
                            slot=child.slot, child_pid=child.pid, reason=child.stuck)
                self.retire(child, child.stuck)
                return
        # Children reach --max-jobs at about the same time: as HUP's rolling restart does,
        # wait until the last replacement is up (a slot booting, or backing off after
        # failed starts, would otherwise take working children down with it)
        if most is not None and self.state == "running" and self.all_up():
            # the counts each child pings about once a second: a child may run a few jobs
            # past the limit, and a recycle finishes the jobs it holds. Processed alone:
            # it counts every job that ended, the failed ones (the second count) among them
            for child in live:
                ran = child.totals[0] if child.totals is not None else 0
                if ran >= most:
                    log.info("child ran its --max-jobs; recycling it", slot=child.slot,
                             child_pid=child.pid, jobs=ran, max_jobs=most)
                    self.retire(child, "jobs")
                    return
        if limit is None:
            return
        for child in live:
            try:
                rss_mb = psutil.Process(child.pid).memory_info().rss / 1_048_576
            except psutil.Error:
                continue
            if rss_mb > limit and self.state == "running":
                log.warning("child over its memory limit; recycling it", slot=child.slot,
                            child_pid=child.pid, rss_mb=round(rss_mb, 1), limit_mb=limit)
                self.retire(child, "memory")
                return

    def retire(self, child: Child, reason: str) -> None:
        """Tell `child` to stop (its running jobs get --timeout) and free its slot: the next
        turn of the loop forks its replacement, without waiting for it to exit. Its private
        jobs are still put back when it exits or dies (child_exited)."""
        child.reason = reason
        child.stopping_since = time.monotonic()
        self.tell(child, signal.SIGTERM)
        self.count_restart(reason)

    def count_restart(self, reason: str) -> None:
        """A child replaced (forkq_child_restarts_total, "master stopped"): counted as its
        replacement takes the slot, so when the event happened, as a graph of restarts
        wants it. That is at its death for a crash or a hang, and for a recycle (memory,
        jobs, HUP's restart, time_limit, cancel) as it is retired, not when it exits up to
        --timeout later: a HUP's restarts show at the HUP's rolling restart, each counted
        once, whether a stop begins while the child drains or it dies meanwhile."""
        self.stats.restarts[reason] = self.stats.restarts.get(reason, 0) + 1

    def roll_restart(self) -> None:
        if not self.recycle or self.state != "running":
            self.recycle = [] if self.state != "running" else self.recycle
            return
        if any(c.stopping_since is not None for c in self.children.values()):
            return
        if not self.all_up():
            return  # wait until the last replacement works before retiring the next
        slot = self.recycle.pop(0)
        for child in self.occupants():
            if child.slot == slot:
                self.retire(child, "restart")
                return

    def enforce_stop_deadline(self) -> None:
        now = time.monotonic()
        for child in list(self.children.values()):
            since = child.stopping_since
            if since is not None and now > since + self.settings.timeout + STOP_GRACE_S:
                log.error("child did not stop in time; killing it", slot=child.slot, child_pid=child.pid)
                child.stopping_since = float("inf")
                _kill(child.pid)
        if self.state == "stopping" and now > self.stop_deadline and self.children:
            log.error("children did not stop in time; killing them", pids=sorted(self.children))
            self.stop_deadline = float("inf")
            self.kill_all()

    def set_title(self) -> None:
        busy = sum(c.busy for c in self.children.values())
        filling = len(self.occupants())
        retired = len(self.children) - filling
        title = (f"forkq master {self.app} [{filling}/{len(self.slots)} children, "
                 f"{f'{retired} draining, ' if retired else ''}"
                 f"{busy} busy{', ' + self.state if self.state != 'running' else ''}]")
        if title != getattr(self, "_title", None):
            self._title = title
            titles.set_title(title, titles.MASTER_NAME)
            if self._ready_sent:
                systemd.status(title[len("forkq master "):])

    def notify_systemd(self) -> None:
        """Type=notify: READY once every slot's child is up, WATCHDOG while all is well."""
        if not self._ready_sent and self.state == "running" and self.all_up():
            self._ready_sent = True
            systemd.ready(self._title[len("forkq master "):])
            log.info("all children up", processes=len(self.slots))
        now = time.monotonic()
        if self._watchdog_every and now - self._last_watchdog >= self._watchdog_every and self.healthy(now):
            self._last_watchdog = now
            systemd.watchdog()

    def touch_pidfile(self) -> None:
        """Show `forkq ctl check` that this loop turns (children beat without it)."""
        now = time.monotonic()
        if self.pidfile is not None and now - self._pidfile_touched >= PIDFILE_TOUCH_S:
            self._pidfile_touched = now
            control.touch(self.pidfile)

    def healthy(self, now: float) -> bool:
        """No slot in a crash loop and every child pinging: what the systemd watchdog vouches for."""
        # a child being retired (HUP, --max-memory) stops pinging while it drains its jobs
        # for up to --timeout; enforce_stop_deadline bounds that, not the hang timeout. Its
        # replacement's failed starts are judged once it has exited (child_exited)
        draining = self.draining_slots()
        return (all(s.failures == 0 or i in draining for i, s in enumerate(self.slots))
                and all(now - c.last_ping < self.settings.hang_timeout
                        for c in self.children.values() if c.stopping_since is None))


class ChildStartError(Exception):
    """A child could not start (its message names why); the master shows the message."""


def _report_fatal(report_w: int, exc: BaseException) -> None:
    """Tell the master, in one line, why this child is about to die."""
    what = str(exc) if isinstance(exc, ChildStartError) else f"{type(exc).__name__}: {exc}"
    line = " ".join(what.split())[:500]
    try:
        os.write(report_w, b"E" + line.encode("utf-8", "replace") + b"\n")
    except OSError:
        pass


_WAITED_OUT = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError, redis.ResponseError)


def _parse_ping(line: bytes) -> tuple[int, tuple[int, int] | None] | None:
    """(busy, (processed, failed)) from "B<busy> <processed> <failed>", (busy, None) from a
    bare "B<busy>", None from anything else."""
    fields = line[1:].split(b" ")
    if len(fields) not in (1, 3) or not all(f.isdigit() for f in fields):
        return None
    return int(fields[0]), ((int(fields[1]), int(fields[2])) if len(fields) == 3 else None)


def _parse_acks(line: bytes) -> list[After]:
    """The acks of an "A<json list>" line: each a field, or [field, key, jid, ...] with its
    after-success actions; none from a line that is not one, and no item of another shape."""
    try:
        items = json.loads(line[1:])
    except ValueError:
        return []
    if not isinstance(items, list):
        return []
    out: list[After] = []
    for item in items:
        if isinstance(item, str):
            out.append((item, ()))
        elif (isinstance(item, list) and len(item) % 2 == 1 and len(item) > 1
              and all(isinstance(x, str) for x in item)):
            out.append((item[0], tuple(item[1:])))
    return out


def _make_room_for_pipes(processes: int) -> tuple[int, int]:
    """Raise the soft limit on open files to what the children's pipes need; returns the
    limits as they were, for the children. The master holds two descriptors per child, and
    systemd starts a service with a soft limit of 1024: some 500 children would leave no
    descriptor for the next fork. The hard limit stays what the operator set."""
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    soft, hard = limits
    needed = 2 * processes + 256  # and room for Redis, metrics scrapes, the app's own files
    if soft != resource.RLIM_INFINITY and soft < needed:
        raised = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
    return limits


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _noop(signum: int, frame: object) -> None:
    """Handlers do nothing themselves: in the master the wakeup fd carries the signal to the
    loop, and a child catches only so that the programs its jobs exec get the default."""


def _flush_output() -> None:
    try:
        logs.flush()
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
