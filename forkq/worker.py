"""One worker process: the Launcher, Manager and Processors, driven from its main thread.

The main thread only waits for commands and acts on them. Commands are signal numbers,
one byte each, arriving on one of: the self-pipe that this process's own signal handlers
write to (`forkq start --no-fork`), the pipe from the master (a forked child, which also
sends settings.BEAT_NOW: heartbeat now), or the heartbeat relaying a `-signals` entry
from Redis. In a child, EOF on the master's pipe means the master is gone: the child
stops gracefully on its own.

Without a master, the worker also runs the master's backstops (Sweeps): in a fleet of
--no-fork workers, one process per pod, nothing else puts back a dead pod's jobs.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import threading
import time
import traceback
from typing import Any

import redis

from . import __version__, client, cron, logs, orphans, strays, titles
from .errors import JobCancelled, TimeLimitExceeded
from .fetch import refusal, requeue_owner, writes_refused
from .launcher import Launcher, new_identity
from .manager import REDIS_ERRORS, Manager
from .metrics import DeltaReporter
from .processor import MeteredProcessor, Processor, guard_forks
from .queues import QueueOrder
from .scheduler import Scheduler
from .settings import BEAT_NOW, STOP_GRACE_S, Settings
from .timelimit import WATCHDOG

log = logs.get("forkq.worker")
TRAPPED = (signal.SIGINT, signal.SIGTERM, signal.SIGTSTP, signal.SIGTTIN, signal.SIGHUP)
STOP = (signal.SIGINT, signal.SIGTERM)


class Worker:
    def __init__(self, settings: Settings, *, slot: int | None = None, master: str | None = None,
                 control_fd: int | None = None, report_fd: int | None = None,
                 identity: str | None = None, title: str | None = None) -> None:
        self.settings = settings
        self.slot = slot
        self.master = master
        self.identity = identity or new_identity()
        self.title = title
        self.control_fd = control_fd
        self.report_fd = report_fd
        self._cmd_r, self._cmd_w = os.pipe()
        os.set_blocking(self._cmd_w, False)
        self.stopping = False
        self.metrics: DeltaReporter | None = None
        self._handed: set[str] = set()  # acks already told to the master (_hand_over_acks)
        self.sweeps: Sweeps | None = None

    def connect(self) -> redis.Redis:
        # socket_timeout bounds a command when Redis stops answering (paused, cut); a
        # blocking wait gets its own margin on top of its block timeout
        return client.connect(self.settings.redis_url,
                              socket_timeout=self.settings.block_timeout + 5,
                              socket_keepalive=True)

    def command(self, signum: int) -> None:
        """Ask the main thread to act on `signum` (thread-safe, async-signal-safe)."""
        try:
            os.write(self._cmd_w, bytes([signum]))
        except BlockingIOError:
            pass

    def run(self) -> int:
        s = self.settings
        guard_forks()
        default_signals_in_copies()
        conn = self.connect()
        # metrics are counted only in a child: its master sums and serves them
        metered = s.metrics_port is not None and self.report_fd is not None
        self.manager = Manager(self.connect, self.identity, QueueOrder(s.queues), s.concurrency,
                               s.block_timeout, self.master,
                               processor=MeteredProcessor if metered else Processor,
                               heartbeat_interval=s.heartbeat_interval)
        WATCHDOG.grace = s.time_limit_grace
        WATCHDOG.on_fire = self._interrupted
        WATCHDOG.on_cancel = self._cancelled
        WATCHDOG.on_give_up = self._stuck_thread
        self.metrics = (DeltaReporter([p.table for p in self.manager.processors])  # type: ignore[attr-defined]
                        if metered else None)
        info = {"tag": s.tag, "concurrency": s.concurrency, "queues": self.manager.fetch.order.names,
                "weights": [{n: w for n, w in s.queues}], "labels": s.labels, "version": __version__,
                "embedded": False, "forkq": True, "master": self.master, "slot": self.slot,
                # acts on forkq:cancel at its heartbeat (cancel.reads_cancels)
                "forkq_cancel": True}
        self.launcher = Launcher(conn, self.identity, self.manager, info, self.remote_command,
                                 s.heartbeat_interval)
        self.scheduler = Scheduler(conn, self.manager.outcomes, s.poll_interval)
        self.manager.outcomes.retry_written = self.scheduler.due_at
        # a thread of its own, only for an app that declares periodic entries: it sleeps until
        # the next due time, away from the fetch path and the scheduler's spread-out polls
        self.cron = cron.Cron(conn) if cron.ENTRIES else None
        self.manager.on_lost = lambda: self.command(signal.SIGTERM)
        self.manager.start()
        self.launcher.start()
        self.scheduler.start()
        if self.cron is not None:
            self.cron.start()
        if self.master is None:
            # a child's master sweeps; this process is the only forkq some hosts run
            self.sweeps = Sweeps(s, self.identity)
            self.sweeps.start()
        log.info("worker started", identity=self.identity, concurrency=s.concurrency,
                 queues=self.manager.fetch.order.names, mode=self.manager.fetch.order.mode)
        self._loop()
        return self._stop()

    def _interrupted(self, report: bytes = b"L\n") -> None:
        """A job's time limit fired (L), or a cancel interrupted a job (C): ask the master
        for a fresh process (see timelimit)."""
        if self.report_fd is None:
            log.warning("a job was interrupted (its time limit, or a cancel); a lock it held in a "
                        "library may stay held: restart this worker if its jobs hang")
            return
        try:
            os.write(self.report_fd, report)
        except OSError:
            pass  # the master is gone: this child is stopping anyway

    def _cancelled(self) -> None:
        self._interrupted(b"C\n")

    def _stuck_thread(self, kind: type[BaseException] = TimeLimitExceeded) -> None:
        """A job was given up, its thread still in the call it is stuck in: only a new
        process gets that thread back. A limit or a cancel that raised in the thread asked
        for one as it fired; an async job's cancel, handled on the loop, did not, and a
        coroutine that swallows its CancelledError holds its thread as long as it runs."""
        if self.report_fd is None:
            log.error("this worker runs with one thread fewer until the stuck call returns; "
                      "restart it to get the thread back")
            return
        # the master marks the child once, however often it is asked; as a cancel if that
        # is what was given up (an async job's cancel asked for nothing as it fired)
        self._interrupted(b"C\n" if kind is JobCancelled else b"L\n")

    def _loop(self) -> None:
        fds = [self._cmd_r] + ([self.control_fd] if self.control_fd is not None else [])
        last_report = 0.0
        while not self.stopping:
            # the first report goes out at once: it tells the master this child works
            now = time.monotonic()
            if self.report_fd is not None and now - last_report >= 1.0:
                last_report = now
                self._report()
            # poll, not select: a child's pipe from its master can be numbered 1024 or more
            poller = select.poll()
            for fd in fds:
                poller.register(fd, select.POLLIN)
            for fd, _events in poller.poll(1000):
                data = os.read(fd, 64)
                if not data and fd == self.control_fd:
                    log.warning("master is gone; stopping")
                    fds.remove(fd)
                    self.control_fd = None
                    self.stopping = True
                for signum in data:
                    self._handle(signum)

    def remote_command(self, signum: int) -> None:
        """A signal from this process's `-signals` list in Redis (Sidekiq's Web UI, forkq ctl).

        A child asked to stop passes the request to its master, which stops the whole node:
        a child stopped on its own would just be respawned in its slot.
        """
        if signum in STOP and self.report_fd is not None:
            try:
                os.write(self.report_fd, b"T\n")
                return
            except OSError:
                pass  # no master to ask: stop by ourselves
        if signum == signal.SIGTSTP and self.report_fd is not None:
            # quiet here at once (the heartbeat shows it), and make the master quiet too, or
            # a replacement for a child that dies would start taking jobs again
            try:
                os.write(self.report_fd, b"Q\n")
            except OSError:
                pass
        self.command(signum)

    def _report(self) -> None:
        """Tell the master we are alive (a hung process can't) and how busy we are."""
        busy = self.manager.busy()
        self._ping(busy)
        self._pinged = True
        if self.metrics is not None:
            self.metrics.send(self.report_fd)
        shown = (busy, self.manager.quiet_flag)
        if self.title and shown != self._title_shown:
            self._title_shown = shown
            titles.set_title(f"{self.title} [{busy} of {self.settings.concurrency} busy"
                             f"{', quiet' if self.manager.quiet_flag else ''}]", titles.CHILD_NAME)

    _title_shown: tuple[int, bool] | None = None
    _pinged = False

    def _drain_report(self) -> None:
        """About once a second while a stop waits for running jobs: report to the master,
        and dump the threads when asked (TTIN). A drain that does not end is when an
        operator most wants to see where the jobs are, and the command loop is over."""
        # not before a first ping: that would tell the master a child that never got going
        # had started (see _stop's final ping)
        if self.report_fd is not None and self._pinged:
            self._report()
        poller = select.poll()
        for fd in (self._cmd_r, self.control_fd):
            if fd is not None:
                poller.register(fd, select.POLLIN)
        for fd, _events in poller.poll(0):
            try:
                data = os.read(fd, 64)
            except OSError:
                continue
            if signal.SIGTTIN in data:  # stop and quiet are under way already
                dump_threads()

    def _ping(self, busy: int) -> None:
        # with the jobs run and failed so far: if this process dies before its heartbeat
        # flushes them, the master adds them to the stats (Supervisor.count_unflushed)
        processed, failed = self.manager.counts()
        try:
            os.write(self.report_fd, b"B%d %d %d\n" % (busy, processed, failed))
        except (BlockingIOError, BrokenPipeError):
            pass

    def _handle(self, signum: int) -> None:
        # HUP reaches only a --no-fork worker (a master rolls its children instead): a closed
        # terminal or a reload. Its default, dying at once, strands the running jobs in this
        # process's private hash with no master to put them back.
        if signum in STOP or signum == signal.SIGHUP:
            log.info("stopping", signal=signal.Signals(signum).name)
            self.stopping = True
        elif signum == signal.SIGTSTP:
            log.info("quiet: no new jobs will start")
            self.manager.quiet()
            self.launcher.beat_soon()
        elif signum == signal.SIGTTIN:
            dump_threads()
        elif signum == BEAT_NOW:
            self.launcher.beat_soon()

    def _stop(self) -> int:
        deadline = time.monotonic() + self.settings.timeout
        # what is written to Redis after the jobs is done by the time the master would kill us
        self.manager.limit_patience(deadline + STOP_GRACE_S - 1.0)
        self.manager.quiet()
        self.launcher.beat_soon()  # status shows it draining now, not at the next beat
        self.scheduler.stop()
        if self.cron is not None:
            self.cron.stop()
        if self.sweeps is not None:
            self.sweeps.stop()
        # a retired child drains beside its replacement for up to --timeout: it goes on
        # reporting, or its title and the master's busy count (title, STATUS=, metrics)
        # would show what ran when it was told to stop until it exits
        finished = self.manager.stop(deadline, tick=self._drain_report)
        if not finished:
            WATCHDOG.give_up_fired(timeout=1.0)  # before any requeue puts such a job back
        else:
            stop_async_loop()
        self._hand_over_acks()  # before any stop-time write that a frozen Redis could hold
        if not finished:
            log.warning("jobs still running at the timeout; putting them back on their queues",
                        busy=self.manager.busy())
        # The heartbeat first: a beat under way re-asserts this process in the owners
        # registry, and after the requeue that entry would outlive the process
        self.launcher.stop()
        # With jobs still running, their requeue comes last, just before _exit: a job that
        # ends after its requeue has run and will run again, so that window stays short.
        requeued = self._requeue_all() if finished else 0
        try:
            self.manager.write(self.launcher.final_flush, patient=True)
        except REDIS_ERRORS:
            log.error("could not write final stats: Redis unreachable")
        except redis.ResponseError as exc:
            if not writes_refused(exc):
                raise
            log.error(f"could not write final stats: Redis {refusal(exc)}", error=str(exc))
        if self.report_fd is not None and self._pinged:
            # the final totals: no ping went out while the jobs drained, and if the last
            # stats could not be written, the master writes these. Only after a first ping:
            # one would tell the master that a child that never got going had started.
            self._ping(self.manager.busy())
        if self.metrics is not None and self.report_fd is not None:
            self.metrics.send(self.report_fd)  # the last jobs' counts, before the master reaps us
        if not finished:
            requeued = self._requeue_all()
        log.info("worker stopped", requeued=requeued)
        if self.manager.hard_stopped:
            # threads still inside job code must not outlive the stop or write outcomes
            logs.flush()
            sys.stdout.flush()
            os._exit(1 if self.manager.lost_thread else 0)
        # not 0 after a lost thread: the master counts this exit as a crash either way,
        # but under --no-fork a service manager restarts only a failed process
        return 1 if self.manager.lost_thread else 0

    def _requeue_all(self) -> int:
        self._hand_over_acks()
        try:
            return self.manager.write(self._requeue_once, patient=True)
        except REDIS_ERRORS:
            log.error("Redis unreachable at stop: in-flight jobs stay in this process's private "
                      "structures until the supervisor or orphan recovery puts them back")
            return 0
        except redis.ResponseError as exc:
            if not writes_refused(exc):
                raise
            log.error(f"Redis {refusal(exc)} at stop: in-flight jobs stay in this process's private "
                      "structures until the supervisor or orphan recovery puts them back",
                      error=str(exc))
            return 0

    def _hand_over_acks(self) -> None:
        """Tell the master which in-flight entries are finished jobs, before our own flush.

        With Redis frozen past the stop's grace, the flush (or the claim carrying those
        acks) is still stuck when the master kills us, and its requeue of our hash, once
        Redis wakes, would run those jobs again. The master deletes these entries first.
        An ack with after-success actions (a unique job's unlock, a batch job's count)
        goes with them, and the master applies both in one call (fetch.settle_acks): a
        batch job that succeeded is not put back to run again.
        Lines stay under PIPE_BUF, so each one arrives whole or not at all; a full pipe
        loses only this safeguard, not a job."""
        if self.report_fd is None:
            return
        chunk: list[str | list[str]] = []
        size = 0
        for token, actions in self.manager.fetch.unsent_acks():
            if token in self._handed:
                continue
            self._handed.add(token)
            item = [token, *actions] if actions else token
            cost = len(json.dumps(item)) + 2
            if cost > 3000:
                continue  # a queue name of kilobytes: its job may run again, as after a crash
            if size + cost > 3000:
                if not self._send_acks(chunk):
                    return
                chunk, size = [], 0
            chunk.append(item)
            size += cost
        if chunk:
            self._send_acks(chunk)

    def _send_acks(self, tokens: list[str | list[str]]) -> bool:
        try:
            os.write(self.report_fd, b"A" + json.dumps(tokens).encode() + b"\n")  # type: ignore[arg-type]
            return True
        except OSError:
            return False

    def _requeue_once(self) -> int:
        self.manager.fetch.flush_acks()
        requeued, _ = requeue_owner(self.manager.redis, self.identity, self.manager.fetch.order.names)
        return requeued


class Sweeps:
    """The orphan sweep and the stray scan, as a master runs them (orphans.Sweeper,
    strays.Scanner: same lock, intervals, delay and settling rules), for a worker with no
    master. A thread and a Redis connection of their own: a sweep waiting on Redis holds up
    neither the heartbeat nor a job, and a master's socket timeout bounds each wait."""

    def __init__(self, settings: Settings, identity: str) -> None:
        self.identity = identity
        self.redis = client.connect(settings.redis_url, socket_timeout=5)
        self.sweeper = orphans.Sweeper(identity, settings.recovery_delay, settings.heartbeat_interval,
                                       settings.poison_after)
        self.scanner = strays.Scanner(self.sweeper)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="forkq-sweeps", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """No sweep after this returns, bar one stuck on a frozen Redis: that one takes
        nothing of ours (it skips this process) and its lock expires by itself, so the stop
        does not wait the socket timeout for it."""
        self._stop.set()
        self._thread.join(1.0)

    def _run(self) -> None:
        boot = True
        while not self._stop.is_set():
            # the first turn is a master's boot sweep: a predecessor on this host whose
            # process is gone (systemd restarting a --no-fork worker) is recovered at once
            self.sweeper.turn(self.redis, boot=boot, skip={self.identity})
            boot = False
            if self._stop.is_set():
                break
            self.scanner.turn(self.redis)
            # the scanner waits for the sweeper while Redis has not answered it (Scanner.turn)
            due = self.sweeper.next_at
            if self.sweeper.ok_since is not None:
                due = min(due, self.scanner.next_at)
            self._stop.wait(max(due - time.monotonic(), 0.05))
        self.redis.close()


_copies_reset = False


def stop_async_loop() -> None:
    """Once every job ended: cancel what async jobs left running on this process's event
    loop (forkq.aio), if one was started, and stop it. A hard stop exits without it."""
    aio = sys.modules.get("forkq.aio")
    if aio is not None:
        aio.shutdown(timeout=1.0)


def default_signals_in_copies() -> None:
    """Give any copy of this worker forked by job code (a multiprocessing Process, say) the
    signal handling of a plain Python process, as exec gives the programs a job starts.

    Otherwise the copy keeps the worker's: a signal a job sends its own copy (`terminate()`)
    does nothing, and under --no-fork the copy shares this worker's wakeup pipe, so that
    SIGTERM stops the worker instead. Registered once per process: a hook stays for good.
    """
    global _copies_reset
    if not _copies_reset:
        os.register_at_fork(after_in_child=_default_signals)
        _copies_reset = True


def _default_signals() -> None:
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGTSTP, signal.SIGTTIN, signal.SIGHUP,
                signal.SIGQUIT):
        handler = signal.getsignal(sig)
        if callable(handler) and handler is not signal.default_int_handler:
            # an ignored one stays ignored, as exec would leave it
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)


def dump_threads() -> None:
    frames = sys._current_frames()
    for thread in threading.enumerate():
        frame = frames.get(thread.ident or -1)
        stack = "".join(traceback.format_stack(frame)) if frame else "<no frame>"
        log.warning("thread dump", thread=thread.name, stack=stack)


def run_standalone(settings: Settings) -> int:
    """`forkq start --no-fork`: one worker in this process, driven by its own signals."""
    if settings.metrics_port is not None:
        log.warning("--metrics-port is served by the master, and --no-fork runs none: no metrics")
    worker = Worker(settings)
    os.set_blocking(worker._cmd_w, False)
    signal.set_wakeup_fd(worker._cmd_w)
    for sig in TRAPPED:
        signal.signal(sig, _ignore)
    return worker.run()


def _ignore(signum: int, frame: Any) -> None:
    """The wakeup fd carries the signal to the main loop; nothing happens in the handler."""
