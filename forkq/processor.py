"""One worker thread: take a claimed job, run it through server middleware, record the outcome."""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import batch, chains, hooks, iterate, keys, logs, payload, results, scripts, unique
from .jobmetrics import UNKNOWN, ClassTable, observe_both
from .errors import JobCancelled, MalformedPayload, OverLimit, TimeLimitExceeded, UnknownJob
from .fetch import Unit
from .iterate import Interrupted
from .jobs import lookup
from .metrics import JobTable
from .retry import (MALFORMED_QUEUE, MESSAGE_LIMIT, Outcomes, cancel_message, cancel_request,
                    dead_entry_for_malformed, message, overlimit_count, overlimit_delay)
from .timelimit import WATCHDOG, describe

if TYPE_CHECKING:
    from .manager import Manager

log = logs.get("forkq.processor")

# what _run_limited returns for a job the watchdog gave up on
_GIVEN_UP: Any = object()


class _GivenUp(BaseException):
    """Raised past a cancelled job without a time limit that the watchdog gave up on (and
    recorded): its thread, back from the call it was stuck in, records nothing."""

# True in a copy of a worker made by os.fork() inside job code; see guard_forks
_in_copy = False
_guarded = False


def guard_forks() -> None:
    """Make any copy of this worker forked by job code end with that job.

    Such a copy has only the forking thread. Were it to carry on, it would write the job's
    outcome a second time (a SystemExit in the copy would retry a job that succeeded) and
    then wait forever for work as a stray worker. Call once in each worker process: the
    flag costs the hot path one global read per job, where comparing pids would cost a
    syscall.
    """
    global _in_copy, _guarded
    _in_copy = False  # a worker forked by a process that had the hook starts clean
    if not _guarded:
        os.register_at_fork(after_in_child=_mark_copy)
        _guarded = True


def _mark_copy() -> None:
    global _in_copy
    _in_copy = True


def _leave_copy(exc: BaseException | None) -> None:
    """End a forked copy as the job's code ended in it, writing nothing to Redis."""
    code = 0
    if isinstance(exc, SystemExit):
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:  # sys.exit("message"), as the interpreter ends it
            print(exc.code, file=sys.stderr)
            code = 1
    elif exc is not None:
        traceback.print_exception(exc)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def run_job(fn: Callable[..., Any], job: dict[str, Any], queue: str) -> Any:
    """Call a job's function with its args (and kwargs, when the payload has them),
    through the registered server middleware."""
    chain = hooks.SERVER_MIDDLEWARE
    if not chain:
        kwargs = job.get("kwargs")
        return fn(*job["args"]) if kwargs is None else fn(*job["args"], **kwargs)

    def call(i: int) -> Any:
        if i == len(chain):
            kwargs = job.get("kwargs")  # as a middleware left the payload, as args are
            return fn(*job["args"]) if kwargs is None else fn(*job["args"], **kwargs)
        return chain[i](job, queue, lambda: call(i + 1))
    return call(0)


def _expired(job: dict[str, Any], expires: Any, queue: str) -> bool:
    """True if a job is past its expires_at (an epoch second, by this host's clock) and
    must not start. A value that is no number is ignored with a warning: running the job
    loses nothing, where dropping it on a typo would."""
    if type(expires) not in (int, float):
        log.warning("expires_at is not a number; the job runs", jid=job.get("jid"), queue=queue,
                    expires_at=repr(expires)[:100])
        return False
    now = time.time()
    # compared before any subtraction: an int past a float's range (valid JSON) raised
    # OverflowError there; NaN, too, is no expiry
    if not now > expires:
        return False
    try:
        late: float | None = round(now - expires, 3)
    except OverflowError:  # an int below a float's range
        late = None
    log.info("expired: not run", jid=job.get("jid"), queue=queue, late_s=late,
             **{"class": payload.display_name(job)})
    return True


class Processor:
    def __init__(self, manager: "Manager", index: int, outcomes: Outcomes) -> None:
        self.manager = manager
        self.index = index
        self.outcomes = outcomes
        self.processed = 0
        self.failed = 0
        # (queue, raw payload, started epoch s, jid, in-flight token) while a job runs: read
        # by the heartbeat, which shows the first three and looks the jid up in forkq:cancel
        self.current: tuple[str, bytes, float, Any, str] | None = None
        # (jid, done, total, note, at) of the running job's latest forkq.progress(), set by
        # the job's thread (jobprogress.py), shown by the heartbeat beside that jid only
        self.progress: tuple[Any, Any, Any, Any, float] | None = None
        # A cancel's handshake with the job's thread (see cancel() and _perform): the thread
        # is inside an unlimited job's run while `cancellable`; the heartbeat sets
        # `cancelling` before it looks, and a job that ends finding it set takes the slow
        # path. `ident`: this processor's thread, once it runs.
        self.cancellable = False
        self.cancelling = False
        self.cancel_request: Any = None  # the forkq:cancel entry of the last cancel raised here
        self.ident: int | None = None
        # An iterable job (forkq.iterate): `iterating` is the `current` it runs under, so a
        # cancel asks it to stop at its next yield first (`cancel_asked`, that same value);
        # `iter_done` is (checkpoint key, jid) once it ran to its end with a checkpoint in
        # Redis, which its ack deletes
        self.iterating: Any = None
        self.cancel_asked: Any = None
        self.iter_done: tuple[str, str] | None = None
        self.thread = threading.Thread(target=self.run, name=f"forkq-processor-{index}", daemon=True)
        self._log_jobs = logs.enabled("info")
        # per-class counts for the Redis metrics the heartbeat flushes (jobmetrics.py)
        self.jobs = ClassTable()
        self._observe = self.jobs.observe

    def start(self) -> None:
        self.thread.start()

    def run(self) -> None:
        try:
            self._serve()
        except BaseException:
            if self.manager.hard_stopped:
                raise  # cut off by a hard stop: its job goes back with the final requeue
            # a fault in forkq itself that _fault could not record: a thread that just ended
            # would leave the process working on with fewer threads, unseen
            self.manager.thread_lost(self.index)

    def _serve(self) -> None:
        self.ident = threading.get_ident()
        take = self.manager.take
        bell = threading.Lock()
        bell.acquire()  # held while running: whoever has a job for this thread releases it
        while True:
            unit = take(bell)
            if unit is None:
                return
            try:  # free in CPython 3.11+ until something raises
                acked = self.process(unit)
            except BaseException as exc:
                if self.manager.hard_stopped:
                    raise
                acked = self._fault(unit, exc)
            if acked.__class__ is bool:
                self.manager.done(unit.token if acked else None)
            else:  # its after-success actions (a unique lock, a batch) go with its ack
                self.manager.done(unit.token, acked)  # type: ignore[arg-type]  # a tuple: bool is above

    def _fault(self, unit: Unit, exc: BaseException) -> bool:
        """A fault in forkq's own handling of a job, outside the job's code: record it as
        that job's failure (retry, with the error, or dead), as a job's own exception is.
        Back on the head of its queue, a job that trips the fault every time would trip it
        again at once; left in flight, it would wait there until the process stops. One
        whose outcome was written before the fault (no longer in flight) is left as it is."""
        log.critical("forkq failed handling a job outside the job's code; recording it as "
                     "the job's failure", queue=unit.queue, exc_info=exc)
        logs.clear_job()
        self.current = None
        # an iterable job's checkpoint delete, pending for an ack this job will not have:
        # left set, the next job's ack would take it, and this one's retry start over
        self.iter_done = None
        job = payload.parse(unit.raw)  # it raised before this, or the fault came after it
        job["queue"] = unit.queue
        # Where the fault left process() says what it counted already: read from the
        # traceback, so the jobs that succeed pay nothing for it
        seen = _process_locals(exc)
        counted = "wrapped" in seen  # bound just before process() counts the job
        if not counted:
            self.processed += 1
        if seen.get("failed") in (None, self.failed):  # not counted by _perform's failure path
            self.failed += 1
        jobdef = lookup(job["class"])
        # an outcome written before the fault (_perform's failure path, a chain's next push)
        # released the entry: written again, a failure would be a second retry entry
        if self.manager.write(self.outcomes.redis.hexists, self.outcomes.inflight_key, unit.token):
            self.manager.write(self.outcomes.failed, job, exc, unit.token, jobdef)
        if not counted:  # after the write, which matters more: a fault here costs the count
            started = seen.get("started")
            try:
                self._observe(_label(job, jobdef), unit.queue,
                              0.0 if started is None else time.perf_counter() - started, True)
            except Exception:
                log.exception("could not count a job forkq failed in the per-class metrics")
        return False

    # the default binds a global once: this runs for every job, and each lookup counts
    def process(self, unit: Unit, _clock: Callable[[], float] = time.perf_counter
                ) -> bool | tuple[str, ...]:
        """Run one job; True if its in-flight entry still needs the batched ack, or for a
        unique or batch job that succeeded, its after-success actions to send with the
        ack: (key, jid) pairs, a lock to release or a batch to count it in."""
        try:
            job = payload.parse(unit.raw)
        except MalformedPayload as exc:
            return self._malformed(unit, str(exc))
        name = job["class"]
        # the payload decides, not the local @job: another client's push is treated alike
        lock = None if job.get("unique_for") is None else self._unique_lock(job)
        after = lock if job.get("bid") is None else batch.after_success(job, lock)
        # (jid, TTL ms) of a keep_result job, read before the job may change its payload
        keep = None if job.get("keep_result") is None else self._keep_target(job)
        expires = job.get("expires_at")
        if expires is not None and _expired(job, expires, unit.queue):
            why = f"not started before its expires_at ({expires!r})"
            if keep is not None and not self._keep(keep, results.failure("expired", "forkq.JobExpired", why)):
                return False
            if after is not lock and not self._expired_in_batch(job, why):
                return False
            if "forkq_chain" in job:
                chains.ended(job, "expired", self.outcomes.redis)
            return True if lock is None else lock  # dropped unrun: acknowledged as done
        if "forkq_chain" in job:  # the one test a job of no chain pays
            # _perform tells a Next from a (jid, TTL) by its class, as mypy cannot
            keep = chains.Next(keep, after)  # type: ignore[assignment]
        jobdef = lookup(name)
        self.progress = None  # the last job's, before this one shows as running
        self.current = (unit.queue, unit.raw, time.time(), job.get("jid"), unit.token)
        logs.set_job(job.get("jid"), payload.display_name(job), unit.queue, job, self)
        failed = self.failed
        started = _clock()  # one clock read for the job's log lines and its metrics
        try:
            acked = self._perform(unit, job, name, jobdef, keep, started)
        finally:
            logs.clear_job()
        # counted once it ended, failed or not, as Sidekiq counts: a job cut off by a hard
        # stop raised past here and counts when it runs again
        self.processed += 1
        # ActiveJob's real class, as payload.display_name; a class this worker cannot resolve
        # goes under one name (_label, which _fault uses; _fault also reads this local)
        wrapped = job.get("wrapped") if jobdef is not None else UNKNOWN
        self._observe(wrapped if type(wrapped) is str else name, unit.queue, _clock() - started,
                      self.failed != failed)
        if self.iter_done is not None:  # the one test other jobs pay for iterable ones
            after = self._iter_done(acked, after)
        return after if acked and after is not None else acked

    def _iter_done(self, acked: bool, after: tuple[str, ...] | None) -> tuple[str, ...] | None:
        """An iterable job ran to its end with a checkpoint in Redis: its delete goes with
        the ack (scripts/_after.lua), so a crash before the ack resumes rather than starts
        over. Not acknowledged here (a result that could not be kept), the checkpoint stays
        until its TTL: a run again resumes from it. A chain's step had it deleted by the
        call that pushed its next step (_continue)."""
        done, self.iter_done = self.iter_done, None
        if not acked or done is None:
            return after
        return done if after is None else (*after, *done)

    def _expired_in_batch(self, job: dict[str, Any], why: str) -> bool:
        """Count a batch job dropped unrun as its batch's failure before its ack; False if
        that could not be written (the job stays in flight, and is dropped again later)."""
        try:
            self.manager.write(batch.record_failure, self.manager.redis, job, "forkq.JobExpired",
                               why, "expired")
        except Exception as exc:
            log.error("could not count an expired job in its batch; it stays in flight",
                      jid=job.get("jid"), error=f"{type(exc).__name__}: {exc}")
            return False
        return True

    def _unique_lock(self, job: dict[str, Any]) -> tuple[str, str] | None:
        """A unique job's (lock key, jid), worked out before the job runs (it may change
        its args); None once released here, for `unique_until: "start"`."""
        key, jid = unique.lock_of(job), job.get("jid")
        # a jid redis-py cannot send (another client's "\\udc80") holds no lock, and its
        # release, batched with the next claim, would fail every claim after it
        if key is None or type(jid) is not str or not payload.sendable(jid):
            return None
        if job.get("unique_until") != "start":
            return key, jid
        try:
            self.manager.fetch.unlock_now(key, jid)
        except Exception as exc:  # the job runs anyway; its lock lasts until its TTL
            log.warning("could not release a unique job's lock before its run; it expires by "
                        "its TTL", jid=jid, lock=key, error=str(exc))
        return None

    def _keep_target(self, job: dict[str, Any]) -> tuple[str, int] | None:
        keep = results.target(job)
        if keep is None:
            log.warning("keep_result is not a number of seconds above 0 (or the payload has no "
                        "jid UTF-8 can carry): no result is kept", jid=job.get("jid"),
                        keep_result=repr(job.get("keep_result"))[:100])
        return keep

    def _keep(self, keep: tuple[str, int], element: bytes | str) -> bool:
        """Write a keep_result job's outcome before its ack is queued; False if it could not
        be written (the job then stays in flight, unacknowledged, and runs again)."""
        try:
            # ridden out through an outage, as a failure's record is
            self.manager.write(self.outcomes.keep_result, *keep, element)
        except Exception as exc:
            log.error("could not keep a job's result; the job stays in flight and will run again",
                      jid=keep[0], error=f"{type(exc).__name__}: {exc}")
            return False
        return True

    def _perform(self, unit: Unit, job: dict[str, Any], name: str, jobdef: Any,
                 keep: tuple[str, int] | None, started: float) -> bool:
        if self._log_jobs:
            log.info("start")
        try:
            if jobdef is None:
                raise UnknownJob(f"no job named {name!r} is registered in this worker "
                                 "(is its module in --require, or is a deploy rolling out?)")
            if jobdef.time_limit is None:
                try:
                    self.cancellable = True
                    value = self._run(jobdef.fn, job, unit.queue)
                finally:
                    # The race "the job returns (or raises) just as it is cancelled". The
                    # heartbeat's cancel() sets `cancelling`, then, under the watchdog's lock,
                    # raises JobCancelled here only if `cancellable` still holds. This thread
                    # does the reverse: clears `cancellable`, then reads `cancelling`. The GIL
                    # runs the four steps in some single order, so at least one side sees the
                    # other's write:
                    # - the cancel sees `cancellable` cleared: it raises nothing;
                    # - this sees `cancelling` set: _cancel_ended's disarm takes the same
                    #   lock, so it runs after a raise the cancel made (and withdraws the
                    #   exception if still pending), or before the cancel's check, which then
                    #   finds the window closed.
                    # An exception that lands before the withdrawal lands here, inside the
                    # try: the job ends cancelled, its return value dropped, never also
                    # done. None lands after this, in forkq's code or the next job. Without
                    # a cancel the cost is two attribute writes and a read: no lock.
                    self.cancellable = False
                    if self.cancelling:
                        self._cancel_ended()
            else:
                value = self._run_limited(unit, jobdef, job)
                if value is _GIVEN_UP:
                    self.current = None
                    return False  # given up by the watchdog, which recorded its failure
        except BaseException as exc:
            if _in_copy:
                _leave_copy(exc)
            self.current = None
            if exc.__class__ is _GivenUp:
                return False  # given up by the watchdog, which recorded its cancellation
            if exc.__class__ is Interrupted:
                return self._interrupted(unit, exc)
            if exc.__class__ is JobCancelled:
                # it may have landed as _cancel_ended began: finish it (nothing more can land)
                self.cancelling = False
                ident = threading.get_ident()
                WATCHDOG.disarm(ident)
                if not WATCHDOG.settle(ident):
                    return False
                if not exc.args:  # raised by the watchdog, a bare class: say who cancelled it
                    exc.args = (cancel_message(self.cancel_request),)
            if self.manager.hard_stopped:
                # cut off by a hard stop: the job goes back to its queue, not to retry
                raise
            if isinstance(exc, OverLimit) and self._over_limit(unit, exc):
                return False  # scheduled again, or left in flight: no failure either way
            # Anything else, SystemExit and KeyboardInterrupt included, came from the job's
            # own code (signals reach only the main thread): it is that job's failure, and
            # re-raising would end this thread with the job stuck in flight.
            self.failed += 1
            if type(exc) is TimeLimitExceeded and jobdef is not None:
                describe(exc, jobdef.time_limit)
            # The payload as fetched, as Sidekiq's JobRetry re-parses the job's string: what
            # the job or a middleware did to the dict (a list arg popped empty, a datetime
            # stored in a dict arg) must neither change what the retry runs with nor make
            # the failure unwritable, leaving the job in flight
            job = payload.parse(unit.raw)
            # Sidekiq retries a job on the queue it was fetched from (unless retry_queue):
            # a payload without "queue" must not come back on "default"
            job["queue"] = unit.queue
            elapsed = (time.perf_counter() - started) * 1000
            try:
                fate = self.manager.write(self.outcomes.failed, job, exc, unit.token, jobdef)
            except ValueError as err:
                # It parsed, but cannot be written back as JSON/UTF-8 (NaN, Infinity, a lone
                # surrogate escape): left alone it would stay in flight and run again forever.
                reason = (f"failed with {type(exc).__name__}: {message(exc)}; then the payload could not "
                          f"be re-encoded for retry: {err}")
                return self._malformed(unit, reason.encode("utf-8", "backslashreplace").decode())
            except Exception:
                log.exception("could not record a failure; the job stays in flight and will run again",
                              jid=job.get("jid"))
                return False
            if exc.__class__ is JobCancelled:
                self._log_cancelled(job, fate, elapsed_ms=round(elapsed, 2))
                return False
            log.warning("fail", elapsed_ms=round(elapsed, 2), fate=fate,
                        error=f"{type(exc).__name__}: {message(exc)[:MESSAGE_LIMIT]}")  # as stored
            return False  # the outcome write already released the in-flight entry
        if _in_copy:
            _leave_copy(None)
        self.current = None
        if keep is not None:
            if keep.__class__ is chains.Next:
                return self._continue(unit, job, keep, value, started)
            if not self._keep(keep, results.success(value, keep[0])):
                return False
        if self._log_jobs:
            log.info("done", elapsed_ms=round((time.perf_counter() - started) * 1000, 2))
        return True

    def _interrupted(self, unit: Unit, exc: Interrupted) -> bool:
        """An iterable job stopped between two items as its worker stops: its checkpoint
        written, the job back at the head of its queue and its in-flight entry deleted, in
        one call (scripts/iter_requeue.lua). No failure, no retry. False: nothing to ack; if
        the call fails, the job stays in flight for the stop's final requeue, and resumes
        from its last periodic checkpoint."""
        fetch = self.manager.fetch
        script = scripts.load(fetch.redis, "iter_requeue")  # rare: loaded when needed
        try:
            back = self.manager.write(script, [fetch.inflight_key, exc.key],
                                      [unit.token, exc.state or "", iterate.TTL_S, keys.CRASH_PREFIX,
                                       keys.SUSPECTS_PREFIX, iterate.requeued(unit.raw)],
                                      patient=True)
        except Exception as err:
            log.error("could not put an interrupted iterable job back; it stays in flight for the "
                      "stop's requeue", error=f"{type(err).__name__}: {err}")
            return False
        if self._log_jobs:
            log.info("interrupted: back on its queue, to resume from its checkpoint", requeued=bool(back))
        return False

    def _continue(self, unit: Unit, job: dict[str, Any], step: "chains.Next", value: Any,
                  started: float) -> bool:
        """A chained step succeeded: push its next step and release its in-flight entry in
        one call (never the batched ack: a crash between the two would run it again and
        push its successor twice). False either way: nothing is left to acknowledge, or
        the step stays in flight, unacknowledged, and runs again."""
        if self.iter_done is not None:  # an iterable step's checkpoint goes in that call too
            step.after = (*(step.after or ()), *self.iter_done)
        try:
            what = chains.advance(self.manager, self.outcomes, unit, job, step, value)
        except Exception as exc:
            log.error("could not push a chain's next step; the step stays in flight and will run again",
                      jid=job.get("jid"), error=f"{type(exc).__name__}: {exc}")
            return False
        if self._log_jobs:
            log.info("done", elapsed_ms=round((time.perf_counter() - started) * 1000, 2), chain=what)
        return False

    def _over_limit(self, unit: Unit, exc: OverLimit) -> bool:
        """A job whose rate limiter stayed full: put it in the schedule to run again later,
        without using a retry or counting a failure. False once it was put back its
        overlimit_retries times (or cannot be written back): it then fails as any job does."""
        job = payload.parse(unit.raw)  # as fetched, as a failure's retry is
        delay = overlimit_delay(job)
        if delay is None:
            return False
        job["queue"] = unit.queue
        job["overlimit"] = overlimit_count(job) + 1
        job.pop("enqueued_at", None)  # a schedule entry has none: the poller sets it
        try:
            # the retry's write: the schedule entry and the in-flight entry's release in one
            # MULTI, ridden out through an outage
            self.manager.write(functools.partial(self.outcomes.to_retry, key=keys.SCHEDULE), job, unit.token,
                               time.time() + delay)
        except ValueError:
            return False  # cannot be re-encoded: the failure path parks it in the dead set
        except Exception:
            log.exception("could not reschedule a job over its rate limit; it stays in flight and "
                          "will run again", jid=job.get("jid"))
            return True
        log.info(f"over limit: rescheduled in {delay:.0f}s", limiter=exc.limiter, overlimit=job["overlimit"])
        return True

    _run = staticmethod(run_job)  # a bound method would cost a call more per job

    def _run_limited(self, unit: Unit, jobdef: Any, job: dict[str, Any]) -> Any:
        """Run a job under its time limit. _GIVEN_UP if the watchdog gave it up (and
        recorded its failure), so that this thread, back from the call it was stuck in,
        records nothing; otherwise as _run, returning what the job returned or raising
        what it raised."""
        ident = threading.get_ident()
        try:
            try:
                WATCHDOG.arm(ident, jobdef.time_limit, job.get("jid"),
                             functools.partial(self._give_up, unit, jobdef))
                value = self._run(jobdef.fn, job, unit.queue)
            finally:
                WATCHDOG.disarm(ident)
        except BaseException as exc:
            if type(exc) is TimeLimitExceeded or type(exc) is JobCancelled:
                # it may have landed as the disarm above began: this one finishes it, and
                # nothing more can land (inside _perform's try, so never in forkq's own code)
                WATCHDOG.disarm(ident)
            if WATCHDOG.settle(ident):
                raise
            return _GIVEN_UP
        return value if WATCHDOG.settle(ident) else _GIVEN_UP

    def _cancel_ended(self) -> None:
        """A job without a time limit ended with `cancelling` set: withdraw the cancel's
        JobCancelled if it is still pending; _GivenUp if the watchdog gave the job up."""
        self.cancelling = False
        ident = threading.get_ident()
        WATCHDOG.disarm(ident)
        if not WATCHDOG.settle(ident):
            raise _GivenUp

    def cancel(self, cur: tuple[str, bytes, float, Any, str], request: Any) -> bool:
        """Interrupt the job of `cur` (a value of `current` the heartbeat read), which an
        operator cancelled; `request` is its forkq:cancel entry. Called by the heartbeat's
        thread. False if this thread no longer runs that job, or was interrupted already."""
        ident = self.ident
        if ident is None:
            return False
        if self.iterating is cur and self.cancel_asked is not cur:
            # an iterable job: it ends as cancelled at its next yield, cleanly, with no
            # exception raised into its thread; one still running at the next beat gets it
            self.cancel_request = request
            self.cancel_asked = cur
            self.cancelling = True
            return True
        self.cancelling = True  # before the watchdog looks at the window: see _perform

        def in_job(armed: bool) -> bool:  # with the watchdog's lock held
            if self.current is not cur or not (armed or self.cancellable):
                return False
            self.cancel_request = request  # the message of the JobCancelled about to land
            return True

        aio = sys.modules.get("forkq.aio")  # loaded only by an app with async jobs
        interrupt = None if aio is None else functools.partial(aio.cancel_run, ident)
        unit = Unit(cur[4], cur[0], cur[1])
        return WATCHDOG.cancel(ident, cur[3], in_job,
                               functools.partial(self._give_up_cancelled, unit, request), interrupt)

    def _give_up_cancelled(self, unit: Unit, request: Any, limit: float | None, over: float) -> None:
        """Record the cancellation of a job stuck in a call that cannot be interrupted, run
        by the watchdog in a thread of its own once --time-limit-grace passed."""
        exc = JobCancelled(f"{cancel_message(request)} (the job could not be interrupted: given up "
                           f"{over:.0f} s after its cancel)")
        recorded = self._record_given_up(unit, exc, None, "the cancellation of a job that could not "
                                         "be interrupted")
        if recorded is not None:
            job, fate = recorded
            self._log_cancelled(job, fate, request=request, queue=unit.queue,
                                **{"class": payload.display_name(job)})

    def _log_cancelled(self, job: dict[str, Any], fate: str, request: Any = None, **fields: Any) -> None:
        by, reason = cancel_request(self.cancel_request if request is None else request)
        log.warning("cancelled", jid=job.get("jid"), by=by, reason=reason, fate=fate, **fields)

    def _give_up(self, unit: Unit, jobdef: Any, limit: float, over: float) -> None:
        """Record the failure of a job stuck past its limit in a call that cannot be
        interrupted; run by the watchdog in a thread of its own."""
        exc = TimeLimitExceeded(f"the job ran longer than its time limit of {limit:g} s and could "
                                f"not be interrupted; given up {over:.0f} s past it")
        recorded = self._record_given_up(unit, exc, jobdef, "the failure of a job given up past its "
                                         "time limit")
        if recorded is not None:
            job, fate = recorded
            log.warning("fail", jid=job.get("jid"), queue=unit.queue, fate=fate,
                        error=f"TimeLimitExceeded: {exc}", **{"class": payload.display_name(job)})

    def _record_given_up(self, unit: Unit, exc: BaseException, jobdef: Any,
                         what: str) -> tuple[dict[str, Any], str] | None:
        """Write the outcome of a job the watchdog gave up, stuck in a call: (job, fate), or
        None if it could not be written (the job then stays in flight). `jobdef` None: the
        job's own, looked up by its class."""
        job = payload.parse(unit.raw)
        job["queue"] = unit.queue
        self.failed += 1
        try:
            fate = self.manager.write(self.outcomes.failed, job, exc, unit.token,
                                      lookup(job["class"]) if jobdef is None else jobdef)
        except Exception:
            log.exception(f"could not record {what}; it stays in flight, and runs again once its "
                          "process is replaced", jid=job.get("jid"))
            return None
        return job, fate

    def _malformed(self, unit: Unit, reason: str) -> bool:
        # parked on a queue nobody serves, like the scheduler's and the Lua scripts' malformed
        # entries: Sidekiq's Retry pushes a dead entry onto its queue, and on a served one
        # the unrunnable forkq.MalformedJob (retry: false) would be dropped, bytes and all
        reason = f"{reason} (fetched from queue {unit.queue!r})"
        entry = dead_entry_for_malformed(unit.raw, MALFORMED_QUEUE, reason, time.time())
        try:
            self.manager.write(self.outcomes.to_dead, entry, unit.token)
        except Exception:
            log.exception("could not move a malformed payload to the dead set; it stays in flight")
            return False
        log.error("malformed payload moved to the dead set", queue=unit.queue, reason=reason,
                  dead_jid=entry["jid"])
        return False


def _label(job: dict[str, Any], jobdef: Any) -> str:
    """The name a job is counted under in the metrics, as process() works it out."""
    if jobdef is None:
        return UNKNOWN
    wrapped = job.get("wrapped")
    return wrapped if type(wrapped) is str else job["class"]


def _process_locals(exc: BaseException) -> dict[str, Any]:
    """Processor.process's variables where `exc` left it; {} if it raised before that
    frame (or process was replaced, as a test may)."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is Processor.process.__code__:
            return tb.tb_frame.f_locals
        tb = tb.tb_next
    return {}


class MeteredProcessor(Processor):
    """A Processor that also counts what it runs, for `--metrics-port`.

    A subclass rather than a flag in Processor: with metrics off, the hot path does not
    even test whether they are on. With them on, a job costs one more call, a dict lookup
    and a few additions in this thread's own table (metrics.JobTable): no lock, no syscall,
    no Redis. The job is timed once, in Processor.process, for both tables.
    """

    def __init__(self, manager: "Manager", index: int, outcomes: Outcomes) -> None:
        super().__init__(manager, index, outcomes)
        self.table = JobTable()
        self._observe = observe_both(self.jobs.observe, self.table.observe)
