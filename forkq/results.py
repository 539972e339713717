"""Job results (`keep_result`): what a job returned, kept in Redis for whoever asks.

A job pushed with `keep_result=N` has its outcome written under `forkq:result:<jid>` for N
seconds when it ends for good: its return value once it succeeds, its error once it
leaves without success (dead, dropped, discarded, expired unrun). Nothing is written while
it waits to retry. The worker goes by the payload's `"keep_result"`, as it does for
`unique_for`, so a push from another client that carries it is treated alike.

The key holds a list of exactly one element, a JSON object:

    {"value": V}                                              the job returned V
    {"failed": FATE, "error_class": C, "error_message": M}    it left without success
    {"unstorable": WHAT}                                      it returned what JSON cannot carry

A list, so that a reader can wait with BLMOVE key key RIGHT RIGHT: Redis wakes it as the
element lands, and moving the only element of a list onto the same list changes nothing
(not even the TTL), so the result stays for every other reader. The writer replaces the
list whole (DEL, RPUSH, PEXPIRE in one MULTI): a job that ran twice leaves one element.
"""

from __future__ import annotations

import json
import math
import threading
import time
from typing import TYPE_CHECKING, Any

import orjson

from . import keys, logs, payload
from .errors import ForkqError, JobFailed, ResultNotReady, UnstorableResult

if TYPE_CHECKING:
    from .client import Client

log = logs.get("forkq.results")

MAX_S = payload.KEEP_RESULT_MAX_S
# a BLMOVE timeout of 0 blocks for ever, and Redis 6.2 reads one under a millisecond as 0
_MIN_BLOCK_S = 0.01
_ascii = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode

# forkq.testing's store while fake() or inline() is on: jid -> the element Redis would hold
_memory: dict[str, bytes | str] | None = None
_landed = threading.Condition()


def target(job: dict[str, Any]) -> tuple[str, int] | None:
    """(jid, TTL in ms) under which a payload's outcome is to be kept; None when it asks
    for none, or carries nothing usable (a payload from another client may hold anything)."""
    seconds: Any  # a number past the type() test, which mypy does not narrow by
    seconds, jid = job.get("keep_result"), job.get("jid")
    if type(seconds) not in (int, float) or not 0 < seconds <= MAX_S or type(jid) is not str or not jid:
        return None
    if not payload.sendable(jid):  # another client's "\\udc80": no key can be named by it
        return None
    return jid, max(1, math.ceil(seconds * 1000))


def _dump(element: dict[str, Any]) -> bytes | str:
    try:
        return orjson.dumps(element)
    except TypeError:  # an int beyond 64 bits, a lone surrogate: json's text, ASCII-only
        return _ascii(element)


def success(value: Any, jid: str) -> bytes | str:
    """The element for a job that returned `value`. One that JSON cannot carry becomes an
    `unstorable` marker, with a warning: the job ran, and its success stands."""
    if type(value) is tuple:
        value = list(value)  # as args: a tuple travels as a list
    try:
        if payload._native(value):
            return _dump({"value": value})
        where, bad = payload._first_bad(value, "the return value")
        if type(bad) is str:
            # a lone surrogate (a file name os.fsdecode made), which no payload may carry: a
            # result is read by forkq.result alone, which reads its ASCII escape back as it was
            try:
                return _ascii({"value": value})
            except (TypeError, ValueError):
                pass  # something else in it JSON cannot carry either
        what = f"{where} is {_short(bad)} ({type(bad).__name__})"
    except RecursionError:
        what = "the return value is nested too deeply (or contains itself)"
    log.warning("the job's return value is not JSON-native, so none is kept: its success "
                "stands, and reading its result raises forkq.UnstorableResult", jid=jid, detail=what)
    return _dump({"unstorable": what})


def _short(value: Any) -> str:
    try:
        text = repr(value)
    except Exception:
        return f"<{type(value).__name__} object>"
    return text if len(text) <= 200 else text[:200] + "..."


def failure(fate: str, error_class: str, error_message: str) -> bytes | str:
    """The element for a job that left for good without success."""
    return _dump({"failed": fate, "error_class": error_class, "error_message": error_message})


def queue_write(pipe: Any, jid: str, ttl_ms: int, element: bytes | str) -> None:
    """Queue a result's write on a MULTI pipeline: the list replaced whole, with its TTL."""
    key = keys.result(jid)
    pipe.delete(key)
    pipe.rpush(key, element)
    pipe.pexpire(key, ttl_ms)


def remember(jid: str, element: bytes | str) -> None:
    """Keep a result in forkq.testing's store (fake().drain(), inline())."""
    with _landed:
        if _memory is not None:
            _memory[jid] = element
            _landed.notify_all()


def result(jid: str, timeout: float | None = 0.0, client: "Client | None" = None) -> Any:
    """The value a `keep_result` job returned, waiting up to `timeout` seconds for it (0:
    look once; None: wait without end).

    Raises forkq.JobFailed if the job left for good without success (its error class and
    message are on the exception), forkq.UnstorableResult if it succeeded but returned
    something JSON cannot carry, and forkq.ResultNotReady (a TimeoutError) if nothing was
    kept by the deadline: the job has not finished, waits to retry, was pushed without
    keep_result, or its result expired. A result can be read any number of times until
    it expires. Under forkq.testing's fake() or inline(), results come from the jobs run
    there, and Redis is not used."""
    if type(jid) is not str or not jid:
        raise TypeError(f"jid must be a non-empty str, not {jid!r}")
    if timeout is not None and not (type(timeout) in (int, float) and timeout >= 0
                                    and math.isfinite(timeout)):
        raise ValueError(f"timeout must be a number of seconds >= 0, or None to wait without end, "
                         f"not {timeout!r}")
    if _memory is not None:
        element = _from_memory(jid, timeout)
    else:
        from .client import default_client
        conn = (client or default_client()).redis
        key = keys.result(jid)
        element = conn.lindex(key, 0) if timeout == 0 else _wait(conn, key, timeout)
    if element is None:
        raise ResultNotReady(f"no result for job {jid}" + ("" if not timeout else f" after {timeout:g} s")
                             + ": it has not finished, waits to retry, was pushed without "
                             "keep_result, or its result expired", jid)
    return _read(jid, element)


def _wait(conn: Any, key: str, timeout: float | None) -> bytes | None:
    deadline = None if timeout is None else time.monotonic() + timeout
    # redis-py gives up on a reply after the connection's socket_timeout (a forkq.Client's
    # is 5 s): each BLMOVE blocks for less, and a longer wait is several of them
    limit = conn.connection_pool.connection_kwargs.get("socket_timeout")
    most = None if limit is None else limit - min(1.0, limit / 2)
    while True:
        if deadline is None:
            block = 0 if most is None else most
        else:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            block = max(left if most is None else min(left, most), _MIN_BLOCK_S)
        element = conn.blmove(key, key, block, "RIGHT", "RIGHT")
        if element is not None:
            return element


def _from_memory(jid: str, timeout: float | None) -> bytes | str | None:
    with _landed:
        _landed.wait_for(lambda: _memory is None or jid in _memory, timeout)
        return None if _memory is None else _memory.get(jid)


def _read(jid: str, element: bytes | str) -> Any:
    try:
        kept = payload._decode(element)
    except (ValueError, RecursionError):
        kept = None
    if type(kept) is dict:
        if "value" in kept:
            return kept["value"]
        if "unstorable" in kept:
            raise UnstorableResult(f"job {jid} succeeded, but no result was kept: {kept['unstorable']}; "
                                   "a result must be JSON-native (None, bool, int, finite float, str, "
                                   "list, dict with str keys)", jid)
        if "failed" in kept:
            raise JobFailed(jid, str(kept["failed"]), str(kept.get("error_class")),
                            str(kept.get("error_message")))
    raise ForkqError(f"the result kept for job {jid} is not one forkq wrote: {_short(element)}")
