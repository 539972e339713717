"""What happens after a job raises: Sidekiq's backoff, the retry set and the dead set."""

from __future__ import annotations

import json
import math
import random
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import redis

from . import batch, hooks, keys, logs, payload, results, scripts, unique
from .errors import JobCancelled, UnknownJob, UnrunnablePayload
from .fetch import writes_refused

if TYPE_CHECKING:
    from .jobs import Job

DEFAULT_MAX_RETRIES = 25
MESSAGE_LIMIT = 10_000
# The furthest a retry is scheduled. A payload may carry any `retry` and `retry_count`
# (10**80 of each, say): count**4 then no longer fits a float, and `now + delay` raised
# OverflowError, leaving the job in flight to run again. Sidekiq's Ruby turns such a
# delay into an infinite score; a century is as good as never and stays a finite float.
MAX_DELAY_S = 100 * 365 * 86400


def jitter(count: int) -> int:
    """Sidekiq's spread for retry number `count` (0-based): rand(10) * (count + 1) seconds,
    added to the default delay and to a `retry_in` hook's alike (JobRetry in 6.4 and 7.x;
    8.0 draws rand(10 * (count + 1)) instead), so jobs that failed together come back
    spread out rather than all at once."""
    return random.randrange(10) * (count + 1)


def backoff(count: int) -> float:
    """Sidekiq's delay before retry number `count` (0-based): count**4 + 15 + jitter."""
    return count ** 4 + 15 + jitter(count)


# A job that raised forkq.OverLimit (a rate limiter stayed full) is scheduled again this
# many times before its next OverLimit counts as an ordinary failure; a job's own
# `overlimit_retries` option (a payload field) overrides it.
OVERLIMIT_RETRIES = 20
OVERLIMIT_FIRST_S = 5.0
OVERLIMIT_MAX_S = 600.0


def overlimit_count(job: dict[str, Any]) -> int:
    """How many times a job was put back for OverLimit so far (its payload's `overlimit`)."""
    done = job.get("overlimit")
    return done if type(done) is int and done > 0 else 0


def overlimit_delay(job: dict[str, Any]) -> float | None:
    """Seconds until a job that raised OverLimit runs again, or None once it has been put
    back its `overlimit_retries` times (it then fails as any job does). The payload's
    `overlimit` counts the times so far. 5 s the first time, growing by half each time up
    to 10 minutes, each drawn up to half again longer, so jobs that met a full limiter
    together come back spread out."""
    done, cap = overlimit_count(job), job.get("overlimit_retries")
    cap = cap if type(cap) is int and cap >= 0 else OVERLIMIT_RETRIES
    if done >= cap:
        return None
    # capped before the power: a payload's huge count must not overflow a float
    base = OVERLIMIT_FIRST_S * 1.5 ** min(done, 20)
    return min(base, OVERLIMIT_MAX_S) * random.uniform(1.0, 1.5)


def retry_option(job: dict[str, Any], jobdef: "Job | None" = None) -> Any:
    """The payload's `retry`; a payload without one (pushed by a bare Sidekiq-format client)
    takes the registered job's option, and an unknown job keeps Sidekiq's default of
    retrying, since its code may be on the way in a rolling deploy."""
    if job.get("retry") is not None:
        return job["retry"]
    # absent or null: Sidekiq takes the job class's option (JobRetry#local)
    return jobdef.retry if jobdef is not None else True


def max_retries(job: dict[str, Any], jobdef: "Job | None" = None) -> int:
    retry = retry_option(job, jobdef)
    if retry is True:
        return DEFAULT_MAX_RETRIES
    if retry is False or retry is None:
        return 0
    if type(retry) is int:
        return max(retry, 0)
    return DEFAULT_MAX_RETRIES


def error_class(exc: BaseException) -> str:
    kind = type(exc)
    if kind is JobCancelled:
        return CANCELLED_CLASS  # as forkq exports it: what `forkq dead` and the Web UI show
    if kind.__module__ == "builtins":
        return kind.__qualname__
    return f"{kind.__module__}.{kind.__qualname__}"


def message(exc: BaseException) -> str:
    """str(exc), or a stand-in when the exception's own __str__ raises: a job's broken
    exception class must not stop its failure from being recorded."""
    try:
        return str(exc)
    except Exception as err:
        return f"<str() of {type(exc).__name__} raised {type(err).__name__}>"


def _utf8(text: str) -> str:
    """text that encodes as UTF-8: a lone surrogate (a filename read with surrogateescape,
    say) becomes a visible \\udcff escape instead of making the retry write fail."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def record_failure(job: dict[str, Any], exc: BaseException, now: float) -> None:
    """Stamp the error fields as Sidekiq does; unknown fields stay untouched."""
    job["error_message"] = _utf8(message(exc)[:MESSAGE_LIMIT])
    job["error_class"] = error_class(exc)
    count = job.get("retry_count")
    # -1 is a count too: Sidekiq's Web UI "Retry" (and forkq's retry-now) lowers a count
    # of 0 to -1, and the next failure must make it 0 again and keep failed_at, as Sidekiq
    # does; anything lower is not a count
    if type(count) is int and count >= -1:
        job["retry_count"] = count + 1
        job["retried_at"] = now
    else:
        job["retry_count"] = 0
        job["failed_at"] = now
    keep = job.get("backtrace")
    if keep:
        # The frames only, as a Ruby backtrace holds: no "Traceback" header and no
        # "KeyError: ..." line. Sidekiq's Web UI escapes error_message but writes the
        # backtrace lines into its page as they are (they are file names and line numbers
        # in Ruby), so a message holding the job's input, "<img src=x onerror=...>" say,
        # ran as script in the browser of whoever opened the retry or the dead job.
        frames = traceback.format_tb(exc.__traceback__)
        if type(keep) is int and keep is not True:
            # Ruby backtraces start at the raise, so Sidekiq's "first N lines" are the ones
            # nearest the error; in Python's order those are the last N (the first are
            # forkq's own frames). A Ruby line is a frame, where Python prints two or three
            # (the file and line, the code, the carets): counted in text lines, N kept half
            # frames, backtrace=1 only the carets, which say neither file nor line.
            frames = frames[-keep:]
        lines = [ln.rstrip("\n") for chunk in frames for ln in chunk.splitlines()]
        job["error_backtrace"] = payload.encode_backtrace([_utf8(ln) for ln in lines])


def _retry_for_over(job: dict[str, Any], now: float) -> bool | None:
    """Whether `retry_for`'s window (seconds since the first failure) has closed; None when
    the job has no usable one. As in Sidekiq 8.1+, a job with a window is retried until it
    closes whatever its count, so a Ruby 8.1 client's `retry_for` means the same here (7.x
    stopped at either limit)."""
    limit = job.get("retry_for")
    first = payload.seconds(job.get("failed_at"))
    if type(limit) not in (int, float) or first is None:
        return None
    try:
        closes = first + limit  # type: ignore[operator]  # limit is a number (checked above)
    except OverflowError:  # an int past float's range
        closes = math.inf
    if not math.isfinite(closes):
        return None  # a count must still end retries that no window can
    return closes < now


CANCELLED_CLASS = "forkq.JobCancelled"


def cancel_request(raw: Any) -> tuple[str | None, str | None]:
    """(by, reason) of a forkq:cancel entry (keys.CANCEL), raw or parsed; None for what it
    lacks, both for an entry that is no JSON object (written by hand: still a cancel, as
    the workers read it)."""
    try:
        record = raw if isinstance(raw, dict) else json.loads(raw)
    except (TypeError, ValueError):
        return None, None
    if not isinstance(record, dict):
        return None, None
    by, reason = record.get("by"), record.get("reason")
    return (by if isinstance(by, str) and by else None,
            reason if isinstance(reason, str) and reason else None)


def cancel_message(raw: Any) -> str:
    """The error_message of a job an operator cancelled, from its forkq:cancel entry:
    "cancelled by alice@host: reason", "cancelled by an operator" when it says nothing."""
    by, reason = cancel_request(raw)
    said = f"cancelled by {by or 'an operator'}"
    return f"{said}: {reason}" if reason else said


# The queue of a dead entry for something that had no usable queue of its own: one nobody
# serves, so Sidekiq's "Retry" (which refuses an empty queue name and drops the entry)
# parks it there, bytes and all. forkq's own retry-now leaves these entries in `dead`.
MALFORMED_QUEUE = "forkq-malformed"
MALFORMED_CLASS = "forkq.MalformedJob"


def dead_entry_for_malformed(raw: bytes, queue: str, reason: str, now: float) -> dict[str, Any]:
    """A dead-set entry for something that was never a runnable job, keeping its bytes."""
    entry: dict[str, Any] = {"class": MALFORMED_CLASS, "args": [], "jid": payload.new_jid(),
                             "queue": queue, "retry": False, "error_class": "forkq.MalformedPayload",
                             "error_message": reason, "failed_at": now}
    try:
        entry["forkq_original"] = raw.decode("utf-8")
    except UnicodeDecodeError:
        import base64
        entry["forkq_original_base64"] = base64.b64encode(raw).decode()
    return entry


class Outcomes:
    """Writes a job's fate to Redis and releases its in-flight entry in the same call."""

    def __init__(self, client: redis.Redis, inflight_key: str) -> None:
        self.redis = client
        self.inflight_key = inflight_key
        self._to_dead = scripts.load(client, "to_dead")
        self._release = scripts.load(client, "release")
        # token -> (fate, write) of failures whose write has not succeeded yet
        self._plans: dict[str, tuple[str, Callable[[str], None]]] = {}
        # told the due time of each retry written, so this process's poller looks by then
        self.retry_written: Callable[[float], None] | None = None

    def to_dead(self, job: dict[str, Any], token: str | bytes | None, now: float | None = None,
                source: str | None = None, kind: str = "hash",
                lock: tuple[str, str] | None = None, client: Any = None) -> None:
        """`lock`: a unique job's (lock key, jid), released in the same call. `client`: a
        MULTI pipeline to queue the call on (see _ending)."""
        now = time.time() if now is None else now
        self._to_dead(keys=[keys.DEAD, source or self.inflight_key],
                      args=[payload.dumps(job), now, token or "", kind,
                            now - keys.DEAD_TIMEOUT_S, keys.DEAD_MAX_JOBS, *(lock or ())],
                      client=client)

    def to_retry(self, job: dict[str, Any], token: str, at: float, client: Any = None,
                 key: str = keys.RETRY) -> None:
        """Put a job in the retry set (or, with key=keys.SCHEDULE, the schedule) to run at
        `at`, and release its in-flight entry in the same MULTI (`client`'s, if given)."""
        pipe = self.redis.pipeline(transaction=True) if client is None else client
        pipe.zadd(key, {payload.dumps(job): at})
        pipe.hdel(self.inflight_key, token)
        if client is None:
            pipe.execute()
        if self.retry_written is not None:
            self.retry_written(at)

    def drop(self, token: str, lock: tuple[str, str] | None = None, client: Any = None) -> None:
        if lock is None:
            (client or self.redis).hdel(self.inflight_key, token)
        else:
            self._release(keys=[self.inflight_key], args=[1, token, *lock], client=client)

    def keep_result(self, jid: str, ttl_ms: int, element: bytes | str) -> None:
        """Write a `keep_result` job's outcome (see forkq.results): one MULTI."""
        pipe = self.redis.pipeline(transaction=True)
        results.queue_write(pipe, jid, ttl_ms, element)
        pipe.execute()

    def _ending(self, fate: str, write: Callable[..., None], keep: tuple[str, int] | None,
                exc: BaseException) -> tuple[str, Callable[[str], None]]:
        """A plan that ends a job for good; with `keep` (a keep_result job's jid and TTL),
        its failure is kept in the same MULTI as its fate, so a reader never waits for a
        job that has gone, nor sees a failure of one that is still in flight."""
        if keep is None:
            return fate, write
        element = results.failure(fate, error_class(exc), _utf8(message(exc)[:MESSAGE_LIMIT]))

        def write_with_result(token: str, client: Any = None) -> None:
            pipe = self.redis.pipeline(transaction=True) if client is None else client
            results.queue_write(pipe, *keep, element)
            write(token, client=pipe)
            if client is None:
                pipe.execute()
        return fate, write_with_result

    def failed(self, job: dict[str, Any], exc: BaseException, token: str,
               jobdef: "Job | None") -> str:
        """Route a failed job; returns what was done: retry, dead, discarded or dropped.

        The caller retries this call while Redis is unreachable, so the decision (stamping
        the error fields, running the hooks) is made once per failure and kept until its
        write succeeds: a retried write must not count the failure again.
        """
        plan = self._plans.get(token)
        if plan is None:
            plan = self._plan(job, exc, jobdef)
            if "bid" in job:  # counted in its batch in the same MULTI
                plan = batch.on_failure(self.redis, job, exc, plan)
            self._plans[token] = plan
        fate, write = plan
        try:
            write(token)
        except (redis.ConnectionError, redis.TimeoutError):
            raise  # the same plan is written when the caller tries again
        except BaseException as write_exc:  # not `exc`: the job's, read below
            if not writes_refused(write_exc):  # refused for now: tried again as after an outage
                self._plans.pop(token, None)
            raise
        self._plans.pop(token, None)
        if fate in ("dropped", "discarded") and "forkq_chain" in job:
            from .chains import ended  # chains imports this module
            ended(job, fate, self.redis)
        # an operator's cancel is no death: as a kill from `dead`, it runs no handler
        if fate == "dead" and hooks.ON_DEATH and not isinstance(exc, JobCancelled):
            _run_death_handlers(job, exc)
        return fate

    def _plan(self, job: dict[str, Any], exc: BaseException,
              jobdef: "Job | None") -> tuple[str, Callable[[str], None]]:
        now = time.time()
        limit = max_retries(job, jobdef)
        # a unique job keeps its lock while it waits to retry, and releases it (in the
        # write that ends it) when it leaves for good: dead, dropped or discarded
        lock = None
        if job.get("unique_for") is not None:
            key, jid = unique.lock_of(job), job.get("jid")
            if key is not None and type(jid) is str:
                lock = (key, jid)
        drop = self.drop if lock is None else lambda token, client=None: self.drop(token, lock, client)
        # a keep_result job that leaves for good keeps its failure (nothing while it waits
        # to retry); jobs without the option pay this one lookup
        keep = None if job.get("keep_result") is None else results.target(job)
        # A class this worker does not know never ran: in a rolling deploy the new code's
        # jobs reach old workers. Its `retry: false` or `dead: false` is about failures of
        # its own code, and dropping it lost a job nobody ever ran; it goes to dead, where
        # a retry sends it back once a worker that knows it runs.
        unknown = isinstance(exc, UnknownJob)
        # An operator's cancel (forkq cancel): to dead whatever the job's retry options say,
        # without its retries_exhausted hook, for a person to look at (and retry from there)
        cancelled = isinstance(exc, JobCancelled)
        # A payload no retry can run (an iterable job's kwargs naming `cursor`): to dead at
        # once, kept whatever its options say, for a person to fix and push again
        unrunnable = isinstance(exc, UnrunnablePayload)
        if retry_option(job, jobdef) is False and not unknown and not cancelled and not unrunnable:
            return self._ending("dropped", drop, keep, exc)
        record_failure(job, exc, now)
        # Before the retry-or-dead decision, as Sidekiq's JobRetry does: a dead entry names
        # the retry queue too, so Sidekiq's (or forkq's) "Retry" of a dead job sends it
        # there and not back among the fresh jobs retry_queue keeps it away from
        if type(job.get("retry_queue")) is str:
            if lock is not None and "unique_queue" not in job and job["retry_queue"] != job["queue"]:
                job["unique_queue"] = job["queue"]  # the queue its lock is named by
            job["queue"] = job["retry_queue"]
        if cancelled:
            return self._ending("dead", lambda token, client=None: self._cancelled(job, token, now, lock, client),
                                keep, exc)
        if unrunnable:
            return self._ending("dead", lambda token, client=None: self.to_dead(job, token, now, lock=lock,
                                                                               client=client), keep, exc)
        count = job["retry_count"]
        over = _retry_for_over(job, now)
        if not (count >= limit if over is None else over):
            decision = self._decide(jobdef, count, exc)
            if decision == "discard":
                return self._ending("discarded", drop, keep, exc)
            if decision != "kill":
                at = now + min(decision, MAX_DELAY_S)  # type: ignore[operator]  # the str ones are above
                return "retry", lambda token, client=None: self.to_retry(job, token, at, client)
        elif jobdef is not None and jobdef.exhausted_hook is not None:
            try:
                jobdef.exhausted_hook(job, exc)
            except BaseException:  # a broken hook must not lose the job: it still goes dead
                # (BaseException: a hook's sys.exit() would end the processor thread with
                # the job stuck in flight, as a job's own would; see Processor._perform)
                pass
        if job.get("dead") is False and not unknown:
            return self._ending("dropped", drop, keep, exc)
        return self._ending("dead", lambda token, client=None: self.to_dead(job, token, now, lock=lock,
                                                                           client=client), keep, exc)

    def _cancelled(self, job: dict[str, Any], token: str, now: float, lock: tuple[str, str] | None,
                   client: Any = None) -> None:
        """A cancelled job to dead, and its cancel request deleted in the same MULTI: the
        operator's side sees it gone once the job is in dead, and a retry from there is
        not cancelled again."""
        pipe = self.redis.pipeline(transaction=True) if client is None else client
        jid = job.get("jid")
        if type(jid) is str:
            pipe.hdel(keys.CANCEL, jid)
        self.to_dead(job, token, now, lock=lock, client=pipe)
        if client is None:
            pipe.execute()

    @staticmethod
    def _decide(jobdef: "Job | None", count: int, exc: BaseException) -> float | str:
        hook = jobdef.retry_in_hook if jobdef is not None else None
        if hook is not None:
            try:
                answer = hook(count, exc)
            except BaseException:  # SystemExit too: it would end the processor thread
                answer = None
            if answer in ("discard", "kill"):
                return answer
            if isinstance(answer, (int, float)) and not isinstance(answer, bool):
                if answer > 0:
                    # Sidekiq adds its jitter to a hook's delay too. Capped first: a
                    # payload's huge retry_count makes an int no float can hold.
                    return answer + min(jitter(count), MAX_DELAY_S)
                if answer == 0:
                    # forkq's own: 0 retries at once, unspread (Sidekiq takes only a delay
                    # above 0 and falls back to its default backoff)
                    return 0.0
        return backoff(count)


def _run_death_handlers(job: dict[str, Any], exc: BaseException) -> None:
    for handler in list(hooks.ON_DEATH):
        try:
            handler(job, exc)
        except BaseException:  # SystemExit too: it would end the processor thread
            logs.get("forkq.retry").exception("a death handler failed; the job is in dead all the same",
                                              handler=getattr(handler, "__qualname__", repr(handler)),
                                              jid=job.get("jid"))
