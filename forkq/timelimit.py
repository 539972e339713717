"""Job time limits: `@forkq.job(time_limit=S)` stops a job that runs longer than S seconds.

One watchdog thread per worker process, started by the first limited job. When a job's
time is up, it raises TimeLimitExceeded in that job's thread (CPython's
PyThreadState_SetAsyncExc), so the job fails there, with a traceback that shows where it
was, and is retried as any failure is. A thread is interrupted only between Python
bytecodes: a job blocked in one long C call (a socket read without a timeout, a
time.sleep) is interrupted only when that call returns. If it has not ended `grace`
seconds (--time-limit-grace) past its limit, the watchdog gives it up: it logs the job's
stack and records the job's failure itself (the thread, if it ever comes back, records
nothing).

Once a limit fired, a child asks its master to be replaced (gracefully, one child at a
time). An exception landing at an arbitrary bytecode can leave a lock that the job's
libraries take in Python code held for good (queue.Queue's, under urllib3's connection
pools; logging's before 3.13), and then threads that later use it hang; a new process
starts clean, and frees a thread stuck in a call too.

Arming and disarming cost a lock and a dict entry, only for jobs that have a limit.

The same watchdog interrupts a job an operator cancelled (`forkq cancel`, see cancel()):
JobCancelled instead of TimeLimitExceeded, raised by the heartbeat's thread, withdrawn the
same way if it is still pending when the job ends, given up after the same grace, and
followed by the same request to be replaced. A job is interrupted once, by whichever of
its limit and a cancel comes first.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from . import logs
from .errors import JobCancelled, TimeLimitExceeded

log = logs.get("forkq.timelimit")

# Seconds past its limit before a job that was not interrupted is given up (the default
# of --time-limit-grace)
GRACE_S = 10.0
_NEVER = float("inf")

# (limit, seconds past it, or past a cancel; limit None for an unlimited job): record the
# job's failure
GiveUp = Callable[[float | None, float], None]


class Watchdog:
    """Raises TimeLimitExceeded in threads whose job ran past its limit.

    The exception can land in the job's thread at any bytecode after its limit, including
    inside arm() and disarm(). So neither calls Python code that holds a lock between
    statements: a plain Lock's with-block is entered and left in C, where threading's
    Condition and Event run Python methods that an exception landing in them would leave
    with their lock held (a deadlock this module had in its first form). The watchdog is
    woken through a SimpleQueue, whose put is C too.

    Exactly one side records a job's outcome: its own thread, unless settle() says the
    watchdog gave the job up first (and called its give_up)."""

    def __init__(self, grace: float = GRACE_S) -> None:
        self.grace = grace
        # called (in the watchdog's thread) after limits fired: a child asks its master to
        # be replaced, as an interrupted job may have left a lock of its libraries held
        self.on_fire: Callable[[], None] | None = None
        # the same after a cancel interrupted a job (Watchdog.cancel); on_fire if None
        self.on_cancel: Callable[[], None] | None = None
        # called once a job is given up, with what was given up on (TimeLimitExceeded or
        # JobCancelled): the child's replacement is counted as the one or the other
        self.on_give_up: Callable[[type[BaseException]], None] | None = None
        self._giving_up: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._starting = threading.Lock()
        self._wakeups: queue.SimpleQueue[None] = queue.SimpleQueue()
        # thread ident -> (deadline on the monotonic clock, limit, jid, give_up)
        self._armed: dict[int, tuple[float, float, Any, GiveUp | None]] = {}
        # thread ident -> (time the limit fired, limit, jid, give_up, what was raised) of jobs
        # interrupted, not yet ended; limit is None for a cancelled job that had none
        self._fired: dict[int, tuple[float, float | None, Any, GiveUp | None, type[BaseException]]] = {}
        self._given_up: set[int] = set()
        self._wake_at = _NEVER
        self._thread: threading.Thread | None = None
        self._raise: Any = None

    def arm(self, ident: int, limit: float, jid: Any, give_up: GiveUp | None = None) -> None:
        if self._thread is None:  # before this job is armed: nothing can fire at it yet
            with self._starting:
                if self._thread is None:
                    self._start()
        deadline = time.monotonic() + limit
        with self._lock:
            self._armed[ident] = (deadline, limit, jid, give_up)
            self._fired.pop(ident, None)  # left by a limit that fired before its job's try
            self._given_up.discard(ident)
            wake = deadline < self._wake_at
        if wake:
            self._wakeups.put(None)

    def disarm(self, ident: int) -> None:
        """Called by the job's own thread once the job ended, however it ended; again if a
        TimeLimitExceeded landed before this returned (a second call is harmless). After it
        returns, no TimeLimitExceeded can reach the thread: one that fired while the job was
        returning (still pending) is withdrawn, so a job is never both done and failed."""
        with self._lock:
            if self._armed.pop(ident, None) is not None:
                return
            fired = self._fired.pop(ident, None)
        if fired is not None:
            self._raise(ident, None)

    def settle(self, ident: int) -> bool:
        """After disarm: True if the job's own thread records its outcome, False if the
        watchdog gave it up and recorded it. Nothing can land in the thread by now."""
        with self._lock:
            if ident in self._given_up:
                self._given_up.discard(ident)
                return False
        return True

    def cancel(self, ident: int, jid: Any, in_job: Callable[[bool], bool], give_up: GiveUp | None,
               interrupt: Callable[[], bool] | None = None) -> bool:
        """Interrupt the job `jid` that thread `ident` runs, cancelled by an operator: raise
        JobCancelled in it, or, if `interrupt()` says it did (an async job's task cancelled
        on the loop), leave that to it. Called by the heartbeat's thread; True if it fired.

        `in_job(armed)`, called with the lock held, says whether the thread is still inside
        that job's run: `armed` is True while the job's time limit is armed (arm/disarm, under
        this lock, bound its run), else the caller knows from a window its thread marks
        itself (Processor._perform, which also says why that is enough). Not again for a
        job interrupted already (its limit fired, or an earlier beat's cancel): a second
        exception could land after the job, in forkq's code. The job's limit no longer fires
        after this; disarm withdraws the exception as it does a limit's, and a job that has
        not ended `grace` seconds later is given up through `give_up`."""
        if self._thread is None:
            with self._starting:
                if self._thread is None:
                    self._start()
        with self._lock:
            if ident in self._fired:
                return False
            armed = self._armed.get(ident)
            if not in_job(armed is not None):
                return False
            if armed is not None:
                del self._armed[ident]
            now = time.monotonic()
            handled = interrupt is not None and interrupt()
            self._fired[ident] = (now, None if armed is None else armed[1], jid, give_up, JobCancelled)
            if not handled:
                self._raise(ident, JobCancelled)
            wake = now + self.grace < self._wake_at
        if wake:
            self._wakeups.put(None)
        # an exception landing at any bytecode may have left a lock held, as a limit's may;
        # an async job's task was cancelled at an await, where nothing is left half-done
        then = self.on_cancel or self.on_fire
        if not handled and then is not None:
            then()
        return True

    def _start(self) -> None:
        import ctypes  # only in a process that runs limited jobs: it costs a few ms to import
        setter = ctypes.pythonapi.PyThreadState_SetAsyncExc

        def raise_in(ident: int, exc: type[BaseException] | None) -> None:
            # None passes NULL, which withdraws a pending exception; a class is raised as
            # KeyboardInterrupt is, and every CPython since 3.7 accepts one here
            setter(ctypes.c_ulong(ident), None if exc is None else ctypes.py_object(exc))

        self._raise = raise_in
        self._thread = threading.Thread(target=self._watch, name="forkq-timelimit", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while True:
            with self._lock:
                now = time.monotonic()
                fired = self._fire_due(now)
                stuck = self._stuck(now)
                wake = min((d for d, _, _, _ in self._armed.values()), default=_NEVER)
                report = min((f[0] + self.grace for f in self._fired.values()), default=_NEVER)
                self._wake_at = wake = min(wake, report)
            if fired and self.on_fire is not None:  # outside the lock: arm waits on it
                self.on_fire()
            for jid, limit, over, stack, give_up, kind in stuck:
                self._give_up(jid, limit, over, stack, give_up, kind)
            if stuck:
                continue
            try:
                self._wakeups.get(timeout=None if wake == _NEVER else max(0.0, wake - time.monotonic()))
            except queue.Empty:
                pass

    def _fire_due(self, now: float) -> int:
        """Raise in each thread whose job's time is up; how many. Called with the lock held."""
        due = [i for i, (deadline, _, _, _) in self._armed.items() if deadline <= now]
        for ident in due:
            _, limit, jid, give_up = self._armed.pop(ident)
            self._fired[ident] = (now, limit, jid, give_up, TimeLimitExceeded)
            self._raise(ident, TimeLimitExceeded)
        return len(due)

    def give_up_fired(self, timeout: float) -> None:
        """At a stop that cuts jobs off: give up now every job whose limit fired and that
        has not ended (recording its failure), and wait up to `timeout` for give-ups under
        way. Else the stop's requeue would put such a job back on its queue uncounted, to
        run past its limit again in the next process, and again, for good; or a give-up
        written after the requeue would leave the job both queued and in retry."""
        now = time.monotonic()
        with self._lock:
            taken = []
            for ident, (fired, limit, jid, give_up, kind) in list(self._fired.items()):
                if give_up is not None:
                    self._fired[ident] = (_NEVER, limit, jid, None, kind)
                    self._given_up.add(ident)
                    taken.append((give_up, limit, now - fired, jid, _stack(ident), kind))
            pending = list(self._giving_up)
        for give_up, limit, over, jid, stack, kind in taken:
            # the same line as a give-up after the grace: where the job is stuck is what an
            # operator needs, whichever came first
            _log_given_up(jid, limit, over, stack, kind)
            give_up(limit, over)
        until = now + timeout
        for thread in pending:
            thread.join(max(0.0, until - time.monotonic()))

    def _stuck(self, now: float) -> list[tuple[Any, float | None, float, str, GiveUp | None, type[BaseException]]]:
        """Jobs still running `grace` past their limit (or their cancel), each taken over
        once; lock held."""
        stuck = []
        for ident, (fired, limit, jid, give_up, kind) in list(self._fired.items()):
            if now - fired < self.grace:
                continue
            # the entry stays, for disarm to withdraw the exception still pending, with a
            # time that never comes due again
            self._fired[ident] = (_NEVER, limit, jid, None, kind)
            if give_up is not None:
                self._given_up.add(ident)
            stuck.append((jid, limit, now - fired, _stack(ident), give_up, kind))
        return stuck

    def _give_up(self, jid: Any, limit: float | None, over: float, stack: str, give_up: GiveUp | None,
                 kind: type[BaseException] = TimeLimitExceeded) -> None:
        if give_up is None and kind is not JobCancelled:
            log.warning("job ran past its time limit and was not interrupted: its thread is in a "
                        "call that cannot be interrupted, and the job fails when that call returns",
                        jid=jid, time_limit_s=limit, over_s=round(over, 1), stack=stack)
            return
        _log_given_up(jid, limit, over, stack, kind)
        if give_up is None:
            return
        # its own thread: the write rides out a Redis outage, and limits must keep firing
        thread = threading.Thread(target=give_up, args=(limit, over), name="forkq-timelimit-give-up",
                                  daemon=True)
        with self._lock:
            self._giving_up = [t for t in self._giving_up if t.is_alive()] + [thread]
        thread.start()
        if self.on_give_up is not None:
            self.on_give_up(kind)


def _stack(ident: int) -> str:
    frame = sys._current_frames().get(ident)
    return "".join(traceback.format_stack(frame)) if frame is not None else "(thread gone)"


def _log_given_up(jid: Any, limit: float | None, over: float, stack: str,
                  kind: type[BaseException]) -> None:
    if kind is JobCancelled:
        log.error("a cancelled job could not be interrupted (its thread is in a call that has "
                  "not returned); recording its cancellation without it", jid=jid,
                  over_s=round(over, 1), stack=stack)
    else:
        log.error("job ran past its time limit and could not be interrupted (its thread is in a "
                  "call that has not returned); recording its failure", jid=jid, time_limit_s=limit,
                  over_s=round(over, 1), stack=stack)


WATCHDOG = Watchdog()


def describe(exc: BaseException, limit: float | None) -> None:
    """Give a TimeLimitExceeded raised by the watchdog (a bare class, no message) one that
    says which limit it was, for the retry entry and the log line."""
    if limit is not None and not exc.args:
        exc.args = (f"the job ran longer than its time limit of {limit:g} s",)
