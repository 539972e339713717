"""Test mode for an app's own tests: pushes kept in memory, or jobs run at once, no Redis.

    from forkq import testing

    def test_signup():
        with testing.fake() as jobs:        # pushes are recorded here, not sent
            signup("ann@example.com")
            assert jobs.args(send_welcome) == [[42, "en"]]   # jobs.kwargs(...), jobs.calls(...)
            jobs.drain()                     # runs them here, and what they enqueue

    def test_signup_end_to_end():
        with testing.inline():               # each push runs its job before returning
            signup("ann@example.com")

A push in either mode goes through what a real one does before it reaches Redis, so a test
fails where production would: the arguments are checked (JSON-native values only), client
middleware runs, and the payload is encoded to Sidekiq's JSON and decoded again, so a job
gets its own copy of what a worker would get. A job runs through the registered server
middleware, in the calling thread, and its exception reaches the test: there is no retry.
The mode holds for the whole process (every Client, every thread) until the `with` ends.
A job pushed with keep_result keeps its outcome in memory when it runs here, and
`forkq.result(jid)` reads it there while the mode is on.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from . import chains, client, keys, logs, payload, results
from .errors import UnknownJob
from .jobs import Job, lookup
from .processor import run_job
from .retry import error_class, message

_lock = threading.Lock()
# jid -> the (done, total, note) its runs reported through forkq.progress(), while a mode
# is on (None when none is): what a worker would show at its heartbeats, every report kept
_reports: dict[Any, list[tuple[Any, Any, Any]]] | None = None
_chains: dict[str, list[Any]] | None = None  # a long chain's stored steps, by key, in a mode


class _Recorder:
    """Stands where a worker's Processor does for forkq.progress(), which stores its
    report on it (jobprogress.progress): here each one is kept, for progress()."""

    __slots__ = ()

    @property
    def progress(self) -> None:
        return None

    @progress.setter
    def progress(self, report: tuple[Any, Any, Any, Any, float]) -> None:
        reports = _reports
        if reports is not None:
            with _lock:
                reports.setdefault(report[0], []).append(report[1:4])


_RECORDER = _Recorder()


def progress(jid: str) -> list[tuple[Any, Any, Any]]:
    """What the job `jid` reported through forkq.progress() while it ran under fake()'s
    drain() or inline(): its (done, total, note) reports, oldest first ([] if none)."""
    if _reports is None:
        raise RuntimeError("forkq.testing.progress() reads what jobs reported under "
                           "testing.fake() or testing.inline(): call it inside the mode")
    with _lock:
        return list(_reports.get(jid, ()))


def _name(job: Job | str) -> str:
    return job if isinstance(job, str) else job.name


class FakeJobs:
    """The jobs pushed while `fake()` is on: Sidekiq payload dicts, oldest first.

    A scheduled job (`enqueue_in`, `enqueue_at`, a push with `at=`) carries its run time
    in epoch seconds under "at", as Sidekiq's test mode shows it; it is never in Redis's
    payload."""

    def __init__(self) -> None:
        self.jobs: list[dict[str, Any]] = []

    def __len__(self) -> int:
        return len(self.jobs)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(list(self.jobs))

    def of(self, job: Job | str) -> list[dict[str, Any]]:
        """The pushes of one job (the Job, or its registered name)."""
        name = _name(job)
        return [j for j in self.jobs if j["class"] == name]

    def args(self, job: Job | str) -> list[list[Any]]:
        """Each push's positional arguments, for one job, as a worker would receive them."""
        return [j["args"] for j in self.of(job)]

    def kwargs(self, job: Job | str) -> list[dict[str, Any]]:
        """Each push's keyword arguments, for one job ({} for a push that gave none)."""
        return [j.get("kwargs", {}) for j in self.of(job)]

    def calls(self, job: Job | str) -> list[tuple[list[Any], dict[str, Any]]]:
        """Each push of one job as (args, kwargs), the call a worker would make."""
        return [(j["args"], j.get("kwargs", {})) for j in self.of(job)]

    def progress(self, jid: str) -> list[tuple[Any, Any, Any]]:
        """The (done, total, note) reports of job `jid`'s runs (see testing.progress)."""
        return progress(jid)

    def queue(self, name: str) -> list[dict[str, Any]]:
        return [j for j in self.jobs if j["queue"] == name]

    def clear(self) -> None:
        with _lock:
            self.jobs.clear()

    def drain(self, job: Job | str | None = None, *, limit: int = 10_000) -> int:
        """Run the recorded jobs (or one job's) oldest first, scheduled ones too, and any
        they push meanwhile, until none are left; return how many ran.

        A job that raises is taken off the list first, and its exception propagates: the
        ones after it stay for the next drain. More than `limit` runs means jobs that keep
        pushing each other: RuntimeError, rather than a test that never ends."""
        name = None if job is None else _name(job)
        ran = 0
        while True:
            with _lock:
                i = next((i for i, j in enumerate(self.jobs) if name is None or j["class"] == name), None)
                if i is None:
                    return ran
                if ran >= limit:
                    raise RuntimeError(f"drain ran {limit} jobs and more keep coming: do the "
                                       "jobs push each other without end? (raise limit= if not)")
                entry = self.jobs.pop(i)
            ran += 1
            _run(entry)

    def _record(self, pushed: list[tuple[dict[str, Any], float | None]]) -> None:
        with _lock:
            for job, at in pushed:
                if at is not None:
                    job["at"] = at
                self.jobs.append(job)


def _run(job: dict[str, Any]) -> None:
    # a chain's next step under inline() runs here, after the step before it returned, not
    # inside its push: a long chain would otherwise nest a few frames per step, and
    # overflow the stack at a few hundred steps
    nxt: dict[str, Any] | None = job
    while nxt is not None:
        nxt = _run_one(nxt)


def _run_one(job: dict[str, Any]) -> dict[str, Any] | None:
    entry = {k: v for k, v in job.items() if k != "at"}
    jobdef = lookup(entry["class"])
    if jobdef is None:
        raise UnknownJob(f"no job named {entry['class']!r} is registered (is its module imported?)")
    # inline, a job's push runs the next job inside it: the outer one is current again after
    outer = getattr(logs._job, "current", None)
    logs.set_job(entry.get("jid"), payload.display_name(entry), entry["queue"], entry, _RECORDER)
    keep = None if entry.get("keep_result") is None else results.target(entry)
    try:
        value = run_job(jobdef.fn, entry, entry["queue"])
    except BaseException as exc:
        if keep is not None:  # no retry here: the job has left for good
            results.remember(keep[0], results.failure("failed", error_class(exc), message(exc)))
        raise
    finally:
        logs._job.current = outer
    if keep is not None:
        results.remember(keep[0], results.success(value, keep[0]))
    if "forkq_chain" in entry:
        return _continue_chain(entry, value)
    return None


def _continue_chain(entry: dict[str, Any], value: Any) -> dict[str, Any] | None:
    """Push a chained job's next step through the mode's own push, as a worker would
    push it: fake() records it (drain() runs it); under inline() return it, for _run to
    run next. A continuation that cannot run raises here, where a worker parks it in dead."""
    push = client.test_push
    if push is None:  # the mode ended while the job ran
        return None
    stored = _chains or {}
    nxt = chains.next_payload(entry["forkq_chain"], value, time.time(),
                              lambda key, i: stored[key][i] if i < len(stored.get(key, ())) else None)
    encoded = chains.encode(nxt)
    queue = chains.destination(nxt)
    if getattr(push, "runs_now", False):
        return payload.parse(encoded)  # as a worker would read it back
    push([("SADD", keys.QUEUES, queue), ("LPUSH", keys.queue(queue), encoded)])
    return None


def _pushed(commands: list[tuple]) -> list[tuple[dict[str, Any], float | None]]:
    """The jobs in a push's Redis commands, as a worker would read them back, each with its
    run time if it went to the schedule: the commands are what Client.push_jobs would send,
    after its checks, client middleware and encoding. A long chain's stored steps are kept
    in memory, for its steps to read as a worker reads them from Redis."""
    out: list[tuple[dict[str, Any], float | None]] = []
    for command in commands:
        if command[0] == "RPUSH" and command[1].startswith(keys.CHAIN_PREFIX) and _chains is not None:
            _chains[command[1]] = list(command[2:])
        elif command[0] == "LPUSH":
            out += [(payload.parse(raw), None) for raw in command[2:]]
        elif command[0] == "ZADD":
            out += [(payload.parse(raw), float(at)) for at, raw in zip(command[2::2], command[3::2])]
    return out


@contextlib.contextmanager
def fake() -> Iterator[FakeJobs]:
    """Record every push in the returned FakeJobs instead of sending it to Redis."""
    recorded = FakeJobs()

    def push(commands: list[tuple]) -> None:
        recorded._record(_pushed(commands))

    with _mode(push):
        yield recorded


@contextlib.contextmanager
def inline() -> Iterator[None]:
    """Run each pushed job at once, in the pushing thread, before the push returns;
    scheduled ones too, whatever their time. A job's exception propagates to the push."""

    def push(commands: list[tuple]) -> None:
        for job, _at in _pushed(commands):
            _run(job)

    push.runs_now = True  # type: ignore[attr-defined]
    with _mode(push):
        yield


@contextlib.contextmanager
def _mode(push: client.TestPush) -> Iterator[None]:
    global _reports, _chains
    previous, kept, reports, stored = client.test_push, results._memory, _reports, _chains
    client.test_push = push
    results._memory = {} if kept is None else kept  # a mode inside another shares its results
    _reports = {} if reports is None else reports  # and its progress reports
    _chains = {} if stored is None else stored  # and its chains
    try:
        yield
    finally:
        client.test_push = previous
        results._memory = kept
        _reports = reports
        _chains = stored
