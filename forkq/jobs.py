"""@forkq.job: the registry of runnable jobs and the enqueuers that push them."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar, overload

import redis

from . import payload, unique
from .client import Client, default_client, epoch
from .errors import PartialEnqueue, RedisUnavailable

if TYPE_CHECKING:
    from .chains import Step

# Only names in this registry ever run: a payload's class is looked up here and never
# imported, so a job naming os.system (or anything unregistered) cannot run code.
REGISTRY: dict[str, "Job"] = {}

RetryIn = Callable[[int, BaseException], "float | int | str | None"]
Exhausted = Callable[[dict, BaseException], None]

# A job's parameters and return type, so a user's type checker checks `enqueue(...)`
# against the function's own signature (forkq ships py.typed)
P = ParamSpec("P")
R = TypeVar("R")


class Enqueuer(Generic[P]):
    """Pushes one job kind with fixed options; `Job.options(...)` returns one."""

    def __init__(self, job: "Job[P, Any]", client: Client | None = None, **options: Any) -> None:
        self.job = job
        self._client = client
        self.options = payload.check_options(unique.check(options))
        if "retry" in options:
            payload.check_retry(options["retry"])

    @property
    def client(self) -> Client:
        return self._client or self.job.client or default_client()

    def _push(self, args: tuple, kwargs: dict[str, Any], at: float | datetime | None) -> list[str]:
        checked = payload.check_args(args)
        job = self.job
        try:
            if kwargs or job.keywords_required:
                kwargs = payload.check_kwargs(kwargs)
                job.check_call(checked, kwargs)
            else:
                job.check_arity(checked)
        except TypeError as exc:
            raise TypeError(f"{exc}: nothing was pushed") from None
        return self.client.push_jobs(self._build([checked], {0: kwargs} if kwargs else None), at=at)

    def _build(self, checked: list[list], keywords: dict[int, dict[str, Any]] | None = None,
               first: int = 0) -> list[dict[str, Any]]:
        """Payloads for checked args lists; `keywords` holds the keyword arguments of the
        items that have any, by index in the whole push (checked[0] being item `first`)."""
        now = time.time()
        name, options = self.job.name, self.options
        if not keywords:
            return [payload.build(name, a, now=now, **options) for a in checked]
        return [payload.build(name, a, now=now, kwargs=keywords.get(i), **options)
                for i, a in enumerate(checked, first)]

    def call(self, /, *args: Any, **kwargs: Any) -> "Step":
        """A step of a chain (forkq.chain) pushed with these options and arguments."""
        from .chains import Step
        return Step(self, args, kwargs)

    # self positional-only, as the time of enqueue_in: a job's own `self` goes to the job
    def enqueue(self, /, *args: P.args, **kwargs: P.kwargs) -> str | None:
        jids = self._push(args, kwargs, None)
        return jids[0] if jids else None

    def enqueue_in(self, seconds: float, /, *args: P.args, **kwargs: P.kwargs) -> str | None:
        jids = self._push(args, kwargs, time.time() + seconds)
        return jids[0] if jids else None

    def enqueue_at(self, when: float | datetime, /, *args: P.args, **kwargs: P.kwargs) -> str | None:
        jids = self._push(args, kwargs, epoch(when))
        return jids[0] if jids else None

    def enqueue_many(self, args_list: Iterable[Any], batch_size: int = 1000) -> list[str]:
        """Push many jobs, one round trip per batch of `batch_size`; return the jids of
        those pushed (not of jobs client middleware dropped, nor of unique jobs refused
        because an identical one is pending: the list is then shorter than the input).

        Each item is a job's positional args (a tuple or list), its keyword arguments (a
        dict), or both (`forkq.call(*args, **kwargs)`).

        Every argument list is checked before any job is pushed, so a bad one pushes
        nothing. When Redis fails after some batches went in, PartialEnqueue says which
        jobs are in Redis: a retry of the rest pushes no job twice."""
        checked, keywords = payload.check_many(args_list)
        job = self.job
        if job.arity is not None and checked:
            # the lengths' extremes, not check_arity per item: a bulk push costs about 3 us
            # a job in all, and this about 50 ns (check_arity's call alone costs more);
            # items with keyword arguments are each checked in full
            fewest, most = job.arity
            lengths = list(map(len, checked))
            if (keywords or job.keywords_required or min(lengths) < fewest
                    or (most is not None and max(lengths) > most)):
                for i, args in enumerate(checked):
                    try:
                        job.check_call(args, keywords.get(i))
                    except TypeError as exc:
                        raise TypeError(f"item {i} of the list: {exc}: nothing was pushed") from None
        jids: list[str] = []
        for start in range(0, len(checked), batch_size):
            jobs = self._build(checked[start:start + batch_size], keywords, start)
            try:
                jids += self.client.push_jobs(jobs)
            except (RedisUnavailable, redis.RedisError) as exc:
                if not jids:
                    raise  # nothing went in: the error as a single push would raise it
                # a push refused by Redis (OOM, READONLY) is not in Redis, unless its
                # batch spans several queues whose pipeline stopped part way
                sure_not = isinstance(exc, RedisUnavailable) and not exc.maybe_pushed
                unsure = [] if sure_not or _one_queue_refused(exc, jobs) else [j["jid"] for j in jobs]
                resume_at = start + len(jobs) if unsure else start
                raise PartialEnqueue(jids, unsure, resume_at, len(checked), exc) from exc
        return jids


def _one_queue_refused(exc: BaseException, jobs: list[dict[str, Any]]) -> bool:
    return isinstance(exc, redis.ResponseError) and len({j["queue"] for j in jobs}) == 1


class Job(Generic[P, R]):
    """A function registered as a job. Calling it runs it here; `enqueue` runs it later."""

    def __init__(self, fn: Callable[P, R], name: str, queue: str, retry: bool | int,
                 backtrace: bool | int, retry_in: RetryIn | None, retries_exhausted: Exhausted | None,
                 client: Client | None, options: dict[str, Any], time_limit: float | None = None,
                 iterable: bool = False) -> None:
        # what a worker calls (see below), the function itself or a runner around it
        self.fn: Callable[..., Any] = fn
        self.name = name
        self.queue = queue
        self.retry = retry
        self.backtrace = backtrace
        self.retry_in_hook = retry_in
        self.exhausted_hook = retries_exhausted
        self.client = client
        self.extra = options
        # the worker's, not the payload's: read for every job run, so None costs one test
        self.time_limit = time_limit
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn
        # fn is what a worker (and forkq.testing) calls: for an async def, a plain function
        # that runs its coroutine on the process's event loop (forkq.aio). Decided here, so
        # a run tests nothing: a sync job's path is what it was.
        self.is_async = inspect.iscoroutinefunction(fn) or _wraps_async(fn)
        if self.is_async:
            from . import aio  # loaded only by an app with async jobs
            self.fn = aio.runner(fn, limited=time_limit is not None)
        # a generator walked by forkq.iterate, which passes `cursor` itself
        self.iterable = iterable
        if iterable:
            from . import iterate
            self.fn = iterate.runner(fn, name)
        # (fewest, most) positional args the function takes, most None for *args; None when
        # its signature cannot be read: a push that could only fail when run is refused
        self.signature = _signature(fn)
        if iterable and self.signature is not None:
            # a push that names the cursor would clash with the one the worker passes
            self.signature = self.signature.replace(parameters=[
                p for p in self.signature.parameters.values() if p.name != "cursor"])
        self.arity = _arity(self.signature)
        # keyword-only parameters without a default: a push must name each of them
        self.keywords_required = _keywords_required(self.signature)

    def check_arity(self, args: list) -> None:
        """Raise TypeError if the function cannot be called with `args`: such a job
        would fail at every run, its retries included, and end in dead."""
        arity = self.arity
        if arity is None:
            return
        fewest, most = arity
        if len(args) < fewest or (most is not None and len(args) > most):
            if most is None:
                takes = f"at least {fewest}"
            elif fewest == most:
                takes = str(fewest)
            else:
                takes = f"from {fewest} to {most}"
            one = takes in ("1", "at least 1")
            raise TypeError(f"{self.name} takes {takes} positional argument{'' if one else 's'}, "
                            f"not {len(args)}")

    def check_call(self, args: list, kwargs: dict[str, Any] | None) -> None:
        """Raise TypeError if the function cannot be called with `args` and keyword
        arguments `kwargs` (an unknown name, one also given positionally, a required
        parameter left out), as check_arity does for positional ones alone."""
        if not kwargs and not self.keywords_required:
            self.check_arity(args)
            return
        if self.iterable and kwargs and "cursor" in kwargs:
            # the signature checked has no `cursor` (see __init__): bind would call it unknown
            raise TypeError(f"{self.name} cannot be called with these arguments: `cursor` is "
                            "for the worker to pass to an iterable job (None at first, then "
                            "its checkpoint)")
        if self.signature is None:
            return
        try:
            self.signature.bind(*args, **(kwargs or {}))
        except TypeError as exc:
            raise TypeError(f"{self.name} cannot be called with these arguments: {exc}") from None

    def __call__(self, /, *args: P.args, **kwargs: P.kwargs) -> R:
        # the function as written: an async def job's call returns its coroutine
        return self.__wrapped__(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<forkq.Job {self.name} queue={self.queue}>"

    def options(self, **overrides: Any) -> Enqueuer[P]:
        """An enqueuer with per-call overrides, e.g. `options(queue="low", retry=3)`."""
        if "time_limit" in overrides:
            raise TypeError(f"{self.name}: time_limit is set by @forkq.job only; the workers enforce "
                            "the limit the job was registered with, whatever a push carries")
        client = overrides.pop("client", None)
        opts = self._payload_options()
        opts.update(overrides)
        return Enqueuer(self, client, **opts)

    def _payload_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"queue": self.queue, "retry": self.retry}
        if self.backtrace:
            opts["backtrace"] = self.backtrace
        opts.update(self.extra)
        return opts

    def _default(self) -> Enqueuer[P]:
        # built once: a job's options are fixed at decoration, and enqueue is a hot path
        enqueuer = self.__dict__.get("_enqueuer")
        if enqueuer is None:
            enqueuer = self._enqueuer = self.options()
        return enqueuer

    def enqueue(self, /, *args: P.args, **kwargs: P.kwargs) -> str | None:
        return self._default().enqueue(*args, **kwargs)

    def call(self, /, *args: Any, **kwargs: Any) -> "Step":
        """A step of a chain: `forkq.chain(fetch.call(url), parse.call()).enqueue()`. Runs
        nothing by itself (calling the job itself runs it here)."""
        return self._default().call(*args, **kwargs)

    def enqueue_in(self, seconds: float, /, *args: P.args, **kwargs: P.kwargs) -> str | None:
        return self._default().enqueue_in(seconds, *args, **kwargs)

    def enqueue_at(self, when: float | datetime, /, *args: P.args, **kwargs: P.kwargs) -> str | None:
        return self._default().enqueue_at(when, *args, **kwargs)

    def enqueue_many(self, args_list: Iterable[Any], batch_size: int = 1000) -> list[str]:
        return self._default().enqueue_many(args_list, batch_size)

    def retry_in(self, hook: RetryIn) -> RetryIn:
        """Decorator form: `@my_job.retry_in` sets the retry-delay hook.

        The hook is called as hook(count, exc), count being the retry number (0 for the
        first). It returns seconds, "discard" (drop the job), "kill" (straight to dead) or
        None (Sidekiq's default count**4 + 15 + jitter). As in Sidekiq, a delay above 0 gets
        Sidekiq's jitter added: rand(10) * (count + 1) whole seconds, so returning 60
        retries the first failure in 60-69 s. 0 retries at once, with no jitter (Sidekiq
        would use its default delay instead). A negative number, anything else, or a hook
        that raises means the default.
        """
        self.retry_in_hook = hook
        return hook

    def retries_exhausted(self, hook: Exhausted) -> Exhausted:
        self.exhausted_hook = hook
        return hook


@overload
def job(fn: Callable[P, R]) -> Job[P, R]: ...


@overload
def job(fn: None = None, *, queue: str = "default", retry: bool | int = True,
        name: str | None = None, backtrace: bool | int = False, retry_in: RetryIn | None = None,
        retries_exhausted: Exhausted | None = None, client: Client | None = None,
        time_limit: float | None = None, unique_for: float | None = None,
        unique_until: str = "success", keep_result: float | None = None, iterable: bool = False,
        **options: Any) -> Callable[[Callable[P, R]], Job[P, R]]: ...


def job(fn: Callable[..., Any] | None = None, *, queue: str = "default", retry: bool | int = True,
        name: str | None = None, backtrace: bool | int = False, retry_in: RetryIn | None = None,
        retries_exhausted: Exhausted | None = None, client: Client | None = None,
        time_limit: float | None = None, unique_for: float | None = None,
        unique_until: str = "success", keep_result: float | None = None, iterable: bool = False,
        **options: Any) -> Any:
    """Register a function as a job: bare `@job` or `@job(queue=..., retry=..., name=...)`.

    retry: True means Sidekiq's 25 attempts, False none, an int that many.
    retry_in: hook(count, exc) choosing the delay before a retry (see Job.retry_in); a
    delay above 0 gets Sidekiq's jitter of rand(10) * (count + 1) seconds added.
    time_limit: seconds a run may take; past them, TimeLimitExceeded is raised inside the
    job (see forkq.timelimit), which fails and is retried as any failure is.
    unique_for: seconds during which a push of the same (class, queue, args) is refused
    while one is pending; unique_until: "success" (the lock goes when the job succeeds or
    leaves for good) or "start" (just before it runs). See forkq.unique.
    keep_result: seconds to keep the job's outcome in Redis once it ends (its return
    value, or its error if it leaves without success), for forkq.result(jid). See
    forkq.results.
    iterable: the function is a generator that takes the cursor to resume from as the
    keyword `cursor` (None at first) and yields the cursor after each item it finished; a
    stop interrupts it between two items and it resumes from its last checkpoint. See
    forkq.iterate.
    """
    payload.check_retry(retry)
    limit = _check_time_limit(time_limit)
    if unique_for is not None:
        options["unique_for"] = unique_for
    if unique_until != "success":
        options["unique_until"] = unique_until
    if keep_result is not None:
        options["keep_result"] = keep_result
    unique.check(options)

    def register(f: Callable[..., Any]) -> Job[..., Any]:
        jname = name or f"{f.__module__}.{f.__qualname__}"
        if iterable:
            from . import iterate
            iterate.check(f, jname)
        else:
            _check_runnable(f, jname)
        j = Job(f, jname, queue, retry, backtrace, retry_in, retries_exhausted, client,
                payload.check_options(options), limit, iterable)  # at import, not at the first enqueue
        REGISTRY[jname] = j
        return j

    return register(fn) if fn is not None else register


def _check_time_limit(limit: Any) -> float | None:
    if limit is None:
        return None
    # at most what a thread wait accepts, as the time settings are (config.SECONDS_MAX)
    if type(limit) in (int, float) and 0 < limit <= 1e9:
        return float(limit)
    raise ValueError(f"time_limit must be a number of seconds above 0 (at most 1e9), or None, not {limit!r}")


def _wraps_async(fn: Callable[..., Any]) -> bool:
    """True for a plain function that a decorator wrapped around an async def (its
    __wrapped__, as functools.wraps sets): calling it most likely returns the coroutine,
    which a sync job's run would take for the job's result, its body never run."""
    if getattr(fn, "__wrapped__", None) is None:
        return False
    try:
        return inspect.iscoroutinefunction(inspect.unwrap(fn))
    except ValueError:  # a __wrapped__ chain that loops
        return False


def _check_runnable(f: Callable[..., Any], name: str) -> None:
    # A processor thread calls the function and takes its return as the end of the job:
    # calling one of these only makes a generator, so the body never ran while the job
    # was logged done, counted and acknowledged. (An async def runs on the event loop.)
    if inspect.isasyncgenfunction(f):
        raise TypeError(f"@forkq.job {name}: an async generator function cannot be a job (calling "
                        "it runs none of its body); make it an async def without yield")
    if inspect.isgeneratorfunction(f):
        raise TypeError(f"@forkq.job {name}: a generator function cannot be a job (calling it "
                        "runs none of its body); make it a plain def without yield, or, for a long "
                        "job that yields a cursor after each item, @forkq.job(iterable=True)")


def _signature(f: Callable[..., Any]) -> inspect.Signature | None:
    try:
        # the function the worker calls, not the one a functools.wraps decorator names as
        # __wrapped__: that wrapper may fill some of its parameters in itself
        return inspect.signature(f, follow_wrapped=False)
    except (TypeError, ValueError):  # a builtin or an object Python cannot describe
        return None


def _arity(sig: inspect.Signature | None) -> tuple[int, int | None] | None:
    if sig is None:
        return None
    fewest, most = 0, 0
    star = False
    for p in sig.parameters.values():
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            most += 1
            fewest += p.default is p.empty
        elif p.kind is p.VAR_POSITIONAL:
            star = True
    return fewest, None if star else most


def _keywords_required(sig: inspect.Signature | None) -> frozenset[str]:
    if sig is None:
        return frozenset()
    return frozenset(p.name for p in sig.parameters.values()
                     if p.kind is p.KEYWORD_ONLY and p.default is p.empty)


def lookup(name: str) -> Job | None:
    return REGISTRY.get(name)
