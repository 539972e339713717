"""Iterable jobs (`@forkq.job(iterable=True)`): long jobs that stop between two items and
resume from a cursor instead of starting over.

The job is a generator function. It gets the cursor to resume from as the keyword argument
`cursor` (None on its first run) and yields, after each item it finished, the cursor that
says "done up to here". The runner below walks it and:

- keeps the last yielded cursor in `forkq:iter:JID` (JSON, with a TTL) at most every
  FLUSH_S seconds, when the job raises, and when it is interrupted: never a round trip per
  item;
- between two items, reads two attributes: its worker is stopping (a graceful stop, TERM,
  `forkq ctl stop`, a recycle), or an operator cancelled the job. On a stop it writes the
  checkpoint, closes the generator (its `finally` runs) and raises Interrupted, which the
  processor turns into one Lua call (scripts/iter_requeue.lua): job back at the head of its
  queue, its in-flight entry gone (and the checkpoint written, if the first write failed).
  No failure, no retry used. On a cancel it closes the generator and ends the job as
  cancelled, with no exception raised into the thread from outside;
- at the next run (after a stop, a crash's recovery, a retry, a retry from dead) reads the
  checkpoint and passes its cursor to the generator;
- when the generator is exhausted, has the checkpoint deleted by the call that acknowledges
  the job (scripts/_after.lua), so a crash in between resumes rather than starts over.

Items must be idempotent, as any job must: a crash redoes the items after the last
checkpoint (at most FLUSH_S seconds of them).

Outside a worker (forkq.testing's fake and inline, a test calling the runner) the
generator simply runs to its end, its cursors checked for JSON as a worker checks them."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from . import logs, payload
from .errors import JobCancelled, UnrunnablePayload

PREFIX = "forkq:iter:"
FLUSH_S = 5.0  # seconds between checkpoints while a job runs (as Sidekiq's iterable jobs)
# a checkpoint outlives Sidekiq's 25 retries (about 20 days), as Sidekiq's it-JID hash does
TTL_S = 30 * 86400

log = logs.get("forkq.iterate")

_job = logs._job
_clock = time.monotonic


class Interrupted(BaseException):
    """Raised by an iterable job's runner at a yield once its worker is stopping; the
    processor puts the job back with its checkpoint (Processor._interrupted). A
    BaseException, so that a middleware's `except Exception` does not report it as the
    job's error: it is no failure."""

    def __init__(self, key: str | None, state: str | None) -> None:
        super().__init__("interrupted by its worker's stop; back at the head of its queue")
        self.key = key        # forkq:iter:JID
        self.state = state    # the checkpoint's JSON to write, None if written already


def key_of(jid: str) -> str:
    return PREFIX + jid


def check(fn: Callable[..., Any], name: str) -> None:
    """Refuse at decoration what cannot be an iterable job."""
    import inspect
    if inspect.isasyncgenfunction(fn):
        raise TypeError(f"@forkq.job {name}: iterable=True takes a generator function (def with "
                        "yield); an async generator cannot be an iterable job")
    if not inspect.isgeneratorfunction(fn):
        raise TypeError(f"@forkq.job {name}: iterable=True takes a generator function that yields "
                        "the cursor after each item it finished; this one has no yield")
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return
    p = params.get("cursor")
    if p is None and not any(q.kind is q.VAR_KEYWORD for q in params.values()):
        raise TypeError(f"@forkq.job {name}: an iterable job receives the cursor to resume from as "
                        "the keyword argument `cursor` (None on its first run); add `cursor=None`")
    if p is not None and p.kind is p.POSITIONAL_ONLY:
        raise TypeError(f"@forkq.job {name}: `cursor` must be passable by keyword")


def requeued(raw: bytes | str, now: float | None = None) -> bytes | str:
    """The payload an interrupted job goes back with. Without its expires_at, which bounds
    when a job may start, and this one started (forkq interrupted it, where it would
    otherwise have run on): dropped as expired, it would be left half done. With its
    enqueued_at set to now, in the unit it had: a queue's latency is read off its oldest
    job's enqueued_at, and an export interrupted after two hours would make its queue look
    two hours behind at each deploy, to an operator and to an autoscaler. '' to put it back
    as fetched (nothing to change, or a payload json or UTF-8 cannot write back: NaN, a
    lone surrogate escape, which redis-py would refuse to send)."""
    job = payload.parse(raw)
    changed = job.pop("expires_at", None) is not None
    at = job.get("enqueued_at")
    if type(at) in (int, float):
        now = time.time() if now is None else now
        # Sidekiq 8's integer milliseconds, integer seconds (a client whose JSON drops the
        # .0), or float seconds: as payload.py reads them
        job["enqueued_at"] = (now if type(at) is float else
                              int(now * 1000) if at >= 10**11 else int(now))
        changed = True
    if not changed:
        return ""
    try:
        return payload.dumps(job).encode("utf-8")
    except ValueError:  # UnicodeEncodeError is one
        return ""


_SCALARS = frozenset({str, int, float, bool, type(None)})


def _fixed(cursor: Any) -> bool:
    """True if `cursor` cannot have changed since it was yielded: a scalar, or a tuple of
    scalars."""
    t = type(cursor)
    return t in _SCALARS or (t is tuple and all(type(c) in _SCALARS for c in cursor))


def _dump(cursor: Any, name: str) -> str:
    try:
        return json.dumps({"cursor": cursor, "at": time.time()}, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"iterable job {name} yielded a cursor JSON cannot carry "
                        f"({type(cursor).__name__}): {exc}") from None


def _save(conn: Any, key: str, state: str) -> bool:
    try:
        conn.set(key, state, ex=TTL_S)
    except Exception as exc:  # the job goes on; a crash now would redo a few more items
        log.warning("could not write an iterable job's checkpoint; it carries on", key=key,
                    error=f"{type(exc).__name__}: {exc}")
        return False
    return True


def _load(manager: Any, conn: Any, key: str) -> tuple[bool, Any]:
    """(found, cursor) of the checkpoint at `key`. An outage is ridden out (as a job's
    outcome is written): a job failed by it would use a retry (be dropped, with
    retry=False) where a plain job, needing no Redis to start, would have run; and one
    started without the checkpoint would begin again at its first item."""
    raw = manager.write(conn.get, key)
    if raw is None:
        return False, None
    try:
        return True, json.loads(raw)["cursor"]
    except (ValueError, TypeError, KeyError) as exc:
        log.warning("unreadable iterable-job checkpoint: starting from the first item", key=key,
                    error=f"{type(exc).__name__}: {exc}")
        return False, None


def runner(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """What a worker calls for the iterable job `fn` (Job.fn): runs the generator as the
    module docstring says and returns the generator's return value."""

    def run(*args: Any, **kwargs: Any) -> Any:
        if "cursor" in kwargs:
            # another client's push (forkq's refuses it): "multiple values for cursor" at
            # every run, its retries used up for nothing
            raise UnrunnablePayload(
                f"iterable job {name}: the payload's kwargs name `cursor`, which the worker passes "
                "itself (None at first, then the checkpoint's); push it without `cursor`")
        current = getattr(_job, "current", None)
        proc = current[4] if current is not None else None
        manager = getattr(proc, "manager", None)
        jid = current[0] if current is not None else None
        if manager is None or type(jid) is not str or not payload.sendable(jid):
            # forkq.testing, or a payload without a jid to keep a checkpoint under (or one
            # redis-py cannot send: its delete, batched with a claim, would fail every claim)
            return _through(fn(*args, cursor=None, **kwargs), name)
        key = PREFIX + jid
        conn = manager.redis
        found, cursor = _load(manager, conn, key)
        if found:
            log.info("resuming from a checkpoint", cursor=repr(cursor)[:100])
        gen = fn(*args, cursor=cursor, **kwargs)
        me = proc.current
        proc.iterating = me  # read by Processor.cancel: stop at the next yield
        try:
            return _walk(gen, manager, proc, me, conn, key, found, cursor, name)
        finally:
            proc.iterating = None

    run.__wrapped__ = fn  # type: ignore[attr-defined]
    return run


def _through(gen: Any, name: str) -> Any:
    """Walk `gen` to its end with no checkpoint. Each cursor is checked as a checkpoint
    would encode it, so that an app's tests (forkq.testing) fail on one a worker fails on."""
    nxt = gen.__next__
    try:
        while True:
            try:
                cursor = nxt()
            except StopIteration as stop:
                return stop.value
            _dump(cursor, name)
    finally:
        gen.close()  # at once, when a cursor was refused, rather than when collected


def _walk(gen: Any, manager: Any, proc: Any, me: Any, conn: Any, key: str, saved: bool,
          cursor: Any, name: str) -> Any:
    flush_at = _clock() + FLUSH_S
    moved = False  # a cursor yielded since the last checkpoint written
    nxt = gen.__next__
    while True:
        try:
            cursor = nxt()
        except StopIteration as stop:
            if saved:
                proc.iter_done = (key, key[len(PREFIX):])  # deleted with the job's ack
            return stop.value
        except BaseException:
            # a retry resumes after the last item that finished; unless the cursor is a
            # list or dict, which the failed item may have moved on in place (a page
            # number bumped before the page's work): saved, it would skip that item. Then
            # the checkpoint last written at a yield stands
            if moved and _fixed(cursor):
                _save(conn, key, _dump(cursor, name))
            raise
        if not moved:
            moved = True
            _dump(cursor, name)  # a cursor JSON cannot carry fails now, not in 5 s
        # the one check an item pays: two attribute reads
        if manager.stopping or proc.cancelling:
            if manager.stopping:
                state = _dump(cursor, name)
                # kept before the close: a finally that outlasts the stop's --timeout is
                # cut off with its process, and the job then resumes here, not from a
                # checkpoint seconds old
                kept = _save(conn, key, state)
                try:
                    gen.close()  # its finally blocks run
                except BaseException:  # one that raises fails the job: its retry resumes
                    if not kept:
                        _save(conn, key, state)
                    raise
                raise Interrupted(key, None if kept else state)
            if proc.cancel_asked is me:
                _cancelled(gen, conn, key, _dump(cursor, name), proc)
        now = _clock()
        if now >= flush_at:
            if _save(conn, key, _dump(cursor, name)):
                saved = True
                moved = False
            flush_at = now + FLUSH_S


def _cancelled(gen: Any, conn: Any, key: str, state: str, proc: Any) -> None:
    """An operator cancelled the job: end it here, between two items, as cancelled. The
    checkpoint is kept, so that a retry from dead resumes."""
    from .retry import cancel_message
    _save(conn, key, state)
    cancelled = JobCancelled(f"{cancel_message(proc.cancel_request)} (stopped between two items)")
    try:
        gen.close()
    except Exception as exc:
        # the cancel wins: ended as this error, the job would go to retry with its request
        # still pending, and walk on at each retry until a heartbeat cancelled it again
        log.warning("the job's cleanup raised as it was cancelled; it ends cancelled all the same",
                    error=f"{type(exc).__name__}: {exc}")
        raise cancelled from exc
    raise cancelled
