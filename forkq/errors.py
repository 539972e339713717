"""forkq's exception types: what a user may catch, each named for what went wrong."""


def _rebuilt(cls: type[BaseException], args: tuple, state: dict) -> BaseException:
    exc = cls.__new__(cls)
    exc.args = args
    exc.__dict__.update(state)
    return exc


class ForkqError(Exception):
    """Base class of forkq's own errors."""

    def __reduce__(self) -> tuple:
        # pickled as its args and attributes, not as a call of __init__ with its args (the
        # message alone, which most of these __init__s do not take): an error raised in a
        # process pool's worker, or sent between processes, comes back whole instead of as
        # a TypeError that breaks the pool
        return _rebuilt, (type(self), self.args, self.__dict__)


class RedisUnavailable(ForkqError):
    """Redis could not be reached, or did not answer a push. `maybe_pushed` is False when
    nothing reached Redis, True when the push may have run with its reply lost."""

    def __init__(self, message: str, maybe_pushed: bool = False) -> None:
        super().__init__(message)
        self.maybe_pushed = maybe_pushed


class PartialEnqueue(RedisUnavailable):
    """enqueue_many pushed some batches, then Redis failed (unreachable, silent, or
    refusing writes). `jids` are in Redis; `unsure` (the failed batch's) may be; the
    argument lists from index `resume_at` on were not pushed."""

    def __init__(self, jids: list[str], unsure: list[str], resume_at: int, total: int,
                 cause: BaseException) -> None:
        pushed = f"{resume_at - len(unsure):,} of {total:,} jobs were pushed"
        if unsure:
            pushed += f", the next {len(unsure):,} may have been"
        why = cause if isinstance(cause, ForkqError) else f"{type(cause).__name__}: {cause}"
        super().__init__(f"{pushed}, then: {why}", maybe_pushed=bool(unsure))
        self.jids = jids
        self.unsure = unsure
        self.resume_at = resume_at


class ConfigError(ForkqError):
    """A setting has a value forkq cannot use; the message names it."""


class MalformedPayload(ValueError):
    """A queued entry is not a usable Sidekiq job; the message says why."""


class UnknownJob(ForkqError):
    """A payload names a job that no required module registered."""


class UnrunnablePayload(ForkqError, TypeError):
    """A payload its job can never run with, whatever the code deployed: an iterable job's
    `kwargs` naming `cursor`, which the worker passes itself (another client's push, a
    hand-written payload; forkq's own push refuses it). Every retry would fail the same
    way, so the job goes to the dead set at once, its payload whole, whatever its `retry`
    and `dead` options say (dropping it would lose a job that never ran)."""


class TimeLimitExceeded(BaseException):
    """Raised inside a job that ran longer than its `@forkq.job(time_limit=...)`.

    A BaseException, as KeyboardInterrupt is: a job's `except Exception:` (a retry loop, a
    handler that logs and carries on) must not swallow it and run on past its limit. The
    job fails with it and is retried as any failure is."""


class JobCancelled(BaseException):
    """Raised inside a running job that an operator cancelled (`forkq cancel JID`,
    `forkq.api.cancel`). A BaseException for the reason TimeLimitExceeded is one: a job's
    `except Exception:` must not swallow it. The job is not retried: it goes to the dead
    set with error_class `forkq.JobCancelled`, from where it can be retried by hand."""


class OverLimit(ForkqError):
    """A rate limiter (forkq.limiter) stayed full for its whole `wait_timeout`. `limiter` is
    its name. Escaping a job, it does not count as a failure: the worker schedules the job
    again later (see the README's "Rate limiters")."""

    def __init__(self, message: str, limiter: str) -> None:
        super().__init__(message)
        self.limiter = limiter


class ResultNotReady(ForkqError, TimeoutError):
    """forkq.result() found no result for the job by its deadline: the job has not
    finished, waits to retry, was pushed without keep_result, or its result expired."""

    def __init__(self, message: str, jid: str) -> None:
        super().__init__(message)
        self.jid = jid


class JobFailed(ForkqError):
    """forkq.result() of a job that left for good without succeeding. `fate` says how:
    "dead", "dropped" (retry=False, dead=False), "discarded" (a retry_in hook), "expired"
    (not started within expires_in), "failed" (raised under forkq.testing, which has no
    retries); `error_class` and `error_message` are its error's."""

    def __init__(self, jid: str, fate: str, error_class: str, error_message: str) -> None:
        how = _FATES.get(fate, f"failed ({fate})")
        super().__init__(f"job {jid} {how}: {error_class}: {error_message}")
        self.jid = jid
        self.fate = fate
        self.error_class = error_class
        self.error_message = error_message


_FATES = {"dead": "failed and went to the dead set", "dropped": "failed and was dropped",
          "discarded": "failed and was discarded by its retry_in hook",
          "expired": "expired before it started", "failed": "failed"}


class UnstorableResult(ForkqError, TypeError):
    """forkq.result() of a job that succeeded but returned a value JSON cannot carry, so
    none was kept (the job's success stands)."""

    def __init__(self, message: str, jid: str) -> None:
        super().__init__(message)
        self.jid = jid
