"""Job chains: `forkq.chain(a.call(...), b.call(...)).enqueue()` runs b once a has succeeded.

Every step's payload is built when the chain is pushed, each with its own jid. The first
step is pushed as any job is; the others ride in its payload under `forkq_chain`, a JSON
array of the remaining payloads, as long as they are small (INLINE_BYTES): each step
carries all those after it, so a long chain written that way would write N²/2 payloads
over its life. A longer chain's later steps go, once, to a list of their own
(keys.chain), and `forkq_chain` is a reference to it, {"key", "next", "steps"}: the
worker reads the next step by its index. When a step succeeds, the worker pushes the next
one (carrying the rest, or the reference moved on) and releases the step's in-flight
entry in one script call (scripts/chain_next.lua), which pushes nothing if the entry is no
longer in flight: a successor is pushed once for each run that succeeded and was not put
back, never twice. The same call deletes the list once it pushes the last step.

A step that fails retries as any job, its chain in its payload; one that ends in dead
keeps the rest there, and a retry from dead carries on. Sidekiq (Ruby) ignores the field:
a step it runs ends the chain.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import TYPE_CHECKING, Any

import redis

from . import batch, keys, logs, payload, results, scripts
from .errors import MalformedPayload
from .retry import MALFORMED_CLASS, MALFORMED_QUEUE, dead_entry_for_malformed

if TYPE_CHECKING:
    from .fetch import Unit
    from .jobs import Enqueuer
    from .manager import Manager
    from .retry import Outcomes

log = logs.get("forkq.chain")

FIELD = "forkq_chain"
# later steps of up to this many bytes ride in the first step's payload; more go to a key
INLINE_BYTES = 8192
# in a step's own payload, only in a chain built with pass_result=True: the previous
# step's return value goes at the end of its args (and the flag goes, once it has)
PASS = "forkq_pass_result"


class Step:
    """One step of a chain: a job, its push options and its arguments. Made by
    `job.call(...)` or `job.options(...).call(...)`; runs nothing by itself."""

    __slots__ = ("enqueuer", "args", "kwargs")

    def __init__(self, enqueuer: "Enqueuer", args: tuple, kwargs: dict[str, Any]) -> None:
        self.enqueuer = enqueuer
        self.args = args
        self.kwargs = kwargs

    def __repr__(self) -> str:
        inner = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"{self.enqueuer.job.name}.call({', '.join(inner)})"


class Chain:
    """Steps to run one after another, each once the one before it has succeeded."""

    def __init__(self, steps: Iterable[Any], pass_result: bool = False) -> None:
        if type(pass_result) is not bool:
            raise TypeError(f"pass_result must be True or False, not {pass_result!r}")
        self.steps: list[Step] = list(steps)
        self.pass_result = pass_result
        if not self.steps:
            raise ValueError("a chain needs at least one step")
        for i, step in enumerate(self.steps):
            if type(step) is not Step:
                hint = (" (forkq.call names no job: write my_job.call(...))"
                        if type(step) is payload.Call else "")
                raise TypeError(f"step {i} of the chain is {step!r}, not a job's call: write "
                                f"my_job.call(*args, **kwargs){hint}")
            self._check(i, step)
        clients = {id(step.enqueuer.client) for step in self.steps}
        if len(clients) > 1:
            # the worker pushes each next step to the Redis its step ran from
            raise ValueError("the steps of a chain must be pushed by one client (one Redis): "
                             "give each job the same client=, or none")

    def _check(self, i: int, step: Step) -> None:
        enqueuer = step.enqueuer
        job, options = enqueuer.job, enqueuer.options
        try:
            args = payload.check_args(step.args)
            kwargs = payload.check_kwargs(step.kwargs) if step.kwargs else None
            # a step given the previous one's result gets one more positional argument
            with_result = args + [None] if self.pass_result and i > 0 else args
            if kwargs or job.keywords_required:
                job.check_call(with_result, kwargs)
            else:
                job.check_arity(with_result)
        except TypeError as exc:
            raise TypeError(f"step {i} of the chain: {exc}: nothing was pushed") from None
        if options.get("unique_for") is not None:
            # a worker pushes a later step directly: its lock would never be taken
            raise ValueError(f"step {i} of the chain ({job.name}) is unique (unique_for): a chain "
                             "cannot hold unique jobs; nothing was pushed")
        payload.check_queue(options.get("queue", "default"))
        step.args, step.kwargs = tuple(args), kwargs or {}

    def __repr__(self) -> str:
        return f"forkq.chain({', '.join(map(repr, self.steps))})"

    def enqueue(self) -> list[str]:
        """Push the chain; return every step's jid, first step first. [] if a client
        middleware dropped the first step (then nothing was pushed)."""
        return self._push(None)

    def enqueue_in(self, seconds: float) -> list[str]:
        """Push the chain with its first step due in `seconds`."""
        return self._push(time.time() + seconds)

    def enqueue_at(self, when: float | datetime) -> list[str]:
        """Push the chain with its first step due at `when` (epoch seconds or a datetime)."""
        from .client import epoch
        return self._push(epoch(when))

    def _push(self, at: float | None) -> list[str]:
        if batch.joining() is not None:
            # its later steps would be pushed by a worker, outside the batch's count
            raise ValueError("a chain cannot join a batch (it is pushed inside a `with forkq.Batch()`); "
                             "nothing was pushed")
        client = self.steps[0].enqueuer.client
        jobs = []
        for i, step in enumerate(self.steps):
            job = step.enqueuer._build([list(step.args)], {0: step.kwargs} if step.kwargs else None)[0]
            if self.pass_result and i > 0:
                job[PASS] = True
            if client.middleware:
                # each step through the client middleware, as its own push would be
                job = client._through_middleware(job)
                if job is None:
                    if i == 0:
                        return []
                    raise ValueError(f"a client middleware dropped step {i} of the chain; a chain "
                                     "cannot skip a step: nothing was pushed")
                if job.get("unique_for") is not None:
                    raise ValueError(f"a client middleware made step {i} of the chain unique "
                                     "(unique_for): a chain cannot hold unique jobs; nothing was pushed")
                payload.check_queue(job.get("queue"))
                if "tags" in job:  # as push_jobs checks what its middleware set
                    payload.check_tags(job["tags"])
            jobs.append(job)
        jids = [j["jid"] for j in jobs]
        first = jobs[0]
        if len(jobs) > 1:
            later = jobs[1:]
            raws = [payload.dumps(j) for j in later]
            # carried in the first payload, the later steps nest two levels deeper than
            # pushed alone (its forkq_chain list, each step's object): past what Ruby
            # Sidekiq's JSON parses, its poller would lose the first step once scheduled or
            # retried. Stored in a list, each step is a payload of its own.
            if sum(map(len, raws)) <= INLINE_BYTES and payload._native(later, payload.OPTION_ROOM):
                first[FIELD] = later
            else:
                key = keys.chain(first["jid"])
                wait = 0.0 if at is None else max(0.0, at - time.time())
                ttl_ms = int((keys.CHAIN_TTL_S + wait) * 1000)
                # written before the first step can run; a push that fails after it leaves
                # a list that expires. MULTI: never a list without its expiry
                client._send([("MULTI",), ("DEL", key), ("RPUSH", key, *raws),
                              ("PEXPIRE", key, ttl_ms), ("EXEC",)])
                first[FIELD] = {"key": key, "next": 0, "steps": len(later)}
                try:
                    client.push_jobs([first], at=at, middleware=False)
                except Exception as exc:
                    # a first step surely not pushed (a queue key holding no list, Redis
                    # gone): nothing reads the list, which would stay CHAIN_TTL_S, once
                    # for each try of a producer that tries again
                    if not getattr(exc, "maybe_pushed", False):
                        _forget(client, key)
                    raise
                return jids
        client.push_jobs([first], at=at, middleware=False)
        return jids


def _forget(client: Any, key: str) -> None:
    try:
        client._send([("DEL", key)])
    except Exception as exc:  # the push's own error is the one to raise
        log.warning("could not delete the steps of a chain whose first step was not pushed; "
                    "they expire", key=key, error=f"{type(exc).__name__}: {exc}")


def chain(*steps: Step, pass_result: bool = False) -> Chain:
    """A chain of job calls, each run once the one before it succeeded:

        forkq.chain(fetch.call(url), parse.call(), store.call(table="x")).enqueue()

    pass_result=True appends each step's return value (JSON-native) to the next step's
    positional arguments."""
    return Chain(steps, pass_result)


# -- in the worker --------------------------------------------------------------------

class Next:
    """What a chained step does once it succeeds; made before it runs (see Processor)."""

    __slots__ = ("keep", "after")

    def __init__(self, keep: tuple[str, int] | None, after: tuple[str, ...] | None) -> None:
        self.keep = keep  # a keep_result step's (jid, TTL ms): its result in the same MULTI
        self.after = after  # its after-success actions (a unique lock, a batch count)


class Broken(Exception):
    """A continuation that cannot be pushed: the reason it goes to dead."""


Read = Callable[[str, int], "bytes | str | None"]


def stored(rest: Any) -> str | None:
    """The key of a chain whose steps are kept in one (`forkq_chain` a reference to it),
    once the reference is checked; None for steps carried in the payload; raise Broken
    for a reference that is not one (never a key outside keys.CHAIN_PREFIX)."""
    if type(rest) is not dict:
        return None
    key, at, steps = rest.get("key"), rest.get("next"), rest.get("steps")
    if (type(key) is not str or not key.startswith(keys.CHAIN_PREFIX) or type(at) is not int
            or type(steps) is not int or not 0 <= at < steps):
        raise Broken(f"{FIELD} is neither a non-empty list of job payloads nor a reference to "
                     f"a chain's steps ({{\"key\": \"{keys.CHAIN_PREFIX}...\", \"next\": i, "
                     f"\"steps\": n}})")
    return key


def _check(where: str, step: Any) -> None:
    if type(step) is not dict:
        raise Broken(f"{where} is not an object (a job payload)")
    name = step.get("class")
    if type(name) is not str or not name:
        raise Broken(f"{where} has no 'class' string")
    if type(step.get("args")) is not list:
        raise Broken(f"{where} 'args' is missing or not a list")
    if "kwargs" in step and type(step["kwargs"]) is not dict:
        raise Broken(f"{where} 'kwargs' is not an object")
    if type(step.get("jid")) is not str or not step["jid"]:
        raise Broken(f"{where} has no 'jid' string")
    # its queue is checked when its turn comes (destination()): a bad one is a step that
    # cannot be pushed, parked in dead as itself, not a malformed continuation
    if FIELD in step:
        raise Broken(f"{where} holds a {FIELD} of its own")


def next_payload(rest: Any, value: Any, now: float, read: Read | None = None) -> dict[str, Any]:
    """The next step's payload, carrying the steps after it, from a step's `forkq_chain`
    and the value the step returned; raise Broken with the reason it cannot run. `read`
    (key, index) gives a stored chain's step (LINDEX), None if it is not there."""
    key = stored(rest)
    if key is not None:
        at, steps = rest["next"], rest["steps"]
        raw = None if read is None else read(key, at)
        if raw is None:
            raise Broken(f"step {at + 1} of the {steps} after the first is not in {key} (it "
                         f"expires {keys.CHAIN_TTL_S // 86400} days after the chain last "
                         "moved, or was deleted): it and the steps after it cannot run")
        try:
            step = payload.parse(raw)
        except MalformedPayload as exc:
            raise Broken(f"{key}[{at}] is not a job payload: {exc}") from None
        _check(f"{key}[{at}]", step)
        nxt = dict(step)
        if at + 1 < steps:
            nxt[FIELD] = {"key": key, "next": at + 1, "steps": steps}
    else:
        if type(rest) is not list or not rest:
            raise Broken(f"{FIELD} is not a non-empty list of job payloads")
        for i, step in enumerate(rest):
            _check(f"{FIELD}[{i}]", step)
        nxt = dict(rest[0])
        if len(rest) > 1:
            nxt[FIELD] = rest[1:]
    if nxt.pop(PASS, False) is True:
        if type(value) is tuple:
            value = list(value)  # as a tuple argument travels
        try:
            native = payload._native(value)
        except RecursionError:
            native = False
        if not native:
            raise Broken(f"the step before returned {results._short(value)} "
                         f"({type(value).__name__}), {_not_native(value)}: it cannot be "
                         f"passed to {nxt['class']} (pass_result)")
        if not payload._native(value, payload.ARG_ROOM):
            # as an argument pushed deeper: Ruby Sidekiq's poller would lose the step
            raise Broken(f"the step before returned {results._short(value)}, nested past the "
                         f"{payload.ARG_ROOM} levels an argument may take (Sidekiq's JSON parses "
                         f"100 in all): it cannot be passed to {nxt['class']} (pass_result)")
        nxt["args"] = nxt["args"] + [value]
    if "expires_in" in nxt:  # counted from this push, as the client counts it from its own
        try:
            payload.stamp_expiry(nxt, now)
        except (TypeError, ValueError) as exc:
            raise Broken(f"{FIELD}[0]: {exc}" if key is None else f"{key}[{rest['next']}]: {exc}") from None
    nxt["enqueued_at"] = now
    return nxt


class Unroutable(Broken):
    """A next step whose payload is fine but whose queue cannot take it: it goes to dead
    as itself (the rest of its chain in it), not as a malformed continuation."""


def destination(nxt: dict[str, Any]) -> str:
    """The next step's queue; raise Unroutable if no job can be pushed to it."""
    try:
        return payload.check_queue(nxt.get("queue"))
    except (TypeError, ValueError) as exc:
        raise Unroutable(f"its next step cannot be pushed: {exc}") from None


def _not_native(value: Any) -> str:
    """Why a returned value cannot be an argument (payload._native said it cannot)."""
    try:
        where, bad = payload._first_bad(value, "value")
    except RecursionError:
        return "which is not JSON-native"
    if type(bad) is str:  # a lone surrogate (a file name os.fsdecode made)
        try:
            bad.encode()
        except UnicodeEncodeError as exc:
            return (f"whose {where} holds text UTF-8 cannot carry ({exc.reason}: "
                    f"{exc.object[exc.start:exc.end]!r})")
    return "which is not JSON-native"


def encode(nxt: dict[str, Any]) -> bytes:
    """The next step's payload as Redis will hold it (UTF-8 JSON); raise Broken if it has
    none: a NaN or an integer of more than 4,300 digits from a foreign payload, or a lone
    surrogate (a filename read with surrogateescape, passed on by pass_result), which
    json writes but redis-py's UTF-8 encoding refuses, deep in the script's call."""
    try:
        return payload.dumps(nxt).encode()
    except UnicodeEncodeError as exc:
        why = (f"its payload holds text UTF-8 cannot carry ({exc.reason}: "
               f"{exc.object[exc.start:exc.end]!r})")
    except ValueError as exc:
        why = f"its payload cannot be written as JSON: {exc}"
    raise Broken(f"the next step ({nxt.get('class')}): {why}")


def advance(manager: "Manager", outcomes: "Outcomes", unit: "Unit", job: dict[str, Any],
            step: Next, value: Any) -> str:
    """Push the next step of a chained job that succeeded, releasing its in-flight entry in
    the same call (with its result kept and its after-success actions, if any); return
    what was done: "next" (pushed), "dead" (the continuation could not run: parked in
    dead with the reason) or "gone" (the entry was no longer in flight: nothing pushed).
    Redis outages are ridden out through manager.write; anything else raises, and the
    step stays in flight."""
    now = time.time()
    fetched = payload.parse(unit.raw)  # as fetched: the job may have changed its dict
    rest = fetched.get(FIELD)
    element = None if step.keep is None else results.success(value, step.keep[0])
    after = step.after or ()
    # a stored chain's list lives on while its steps may still be pushed from dead
    chain: tuple[str, str] | tuple[()] = ()
    try:
        key = stored(rest)
        if key is not None:
            chain = (key, "keep")
        nxt = next_payload(rest, value, now, lambda k, i: _lindex(manager, outcomes, k, i))
        raw = encode(nxt)
    except (Broken, ValueError) as exc:
        return _bury(manager, outcomes, unit, job, rest, str(exc), step.keep, element, after,
                     now, chain)
    # its last step pushed, or parked in dead whole, nothing reads the list again
    if chain and FIELD not in nxt:
        chain = (chain[0], "del")
    try:
        queue = destination(nxt)
    except Unroutable as exc:
        return _park(manager, outcomes, unit, job, nxt, "forkq.ChainBroken",
                     f"{_after_step(job)} cannot go on: {exc}", step.keep, element, after, now,
                     chain)
    done = manager.write(_write, outcomes, unit.token, step.keep, element,
                         [keys.QUEUES, keys.queue(queue)], ["push", queue, raw, 0, 0], after,
                         chain)
    if isinstance(done, bytes):  # the type of what the queue's key holds: not a list
        # as the scheduler parks a due job there (move_due.lua), to be retried once fixed
        why = (f"{keys.queue(queue)} holds a {done.decode()}, not a list: the next step of a "
               f"chain, after {payload.display_name(job)} (jid {job.get('jid')}), could not be "
               "pushed onto it; retry it from dead once the key is fixed")
        return _park(manager, outcomes, unit, job, nxt, "forkq.QueueNotAList", why, step.keep,
                     element, after, now, chain)
    if done == 0:
        # the call repeated after its reply was lost (its first went through), or the step
        # was put back by a recovery, and pushes its next step when it runs again
        log.warning("a chained step succeeded but was no longer in flight: its next step was "
                    "pushed already, or is pushed when it runs again", jid=job.get("jid"))
        return "gone"
    return "next"


def _lindex(manager: "Manager", outcomes: "Outcomes", key: str, index: int) -> Any:
    """A stored chain's step, an outage ridden out; raise Broken if its key holds no list
    (raised on, the step would stay in flight and run again at each restart, forever)."""
    try:
        return manager.write(outcomes.redis.lindex, key, index)
    except redis.ResponseError as exc:
        if not str(exc).startswith("WRONGTYPE"):
            raise
        raise Broken(f"{key} holds something other than a list of the chain's steps") from None


def _after_step(job: dict[str, Any]) -> str:
    return f"the chain after {payload.display_name(job)} (jid {job.get('jid')})"


def _bury(manager: "Manager", outcomes: "Outcomes", unit: "Unit", job: dict[str, Any], rest: Any,
          why: str, keep: tuple[str, int] | None, element: bytes | str | None,
          after: tuple[str, ...], now: float, chain: tuple[str, str] | tuple[()] = ()) -> str:
    """Park a continuation that cannot run in dead (a forkq.MalformedJob entry holding it,
    on a queue nobody serves), acknowledging the step that succeeded in the same call."""
    reason = f"{_after_step(job)} cannot go on: {why}"
    reason = reason.encode("utf-8", "backslashreplace").decode()
    try:
        text = json.dumps(rest, ensure_ascii=True)
    except (TypeError, ValueError):
        text = repr(rest)
    entry = dead_entry_for_malformed(text.encode(), MALFORMED_QUEUE, reason, now)
    entry["error_class"] = "forkq.ChainBroken"
    return _to_dead(manager, outcomes, unit, job, entry, reason, keep, element, after, now, chain)


def _park(manager: "Manager", outcomes: "Outcomes", unit: "Unit", job: dict[str, Any],
          nxt: dict[str, Any], error_class: str, why: str, keep: tuple[str, int] | None,
          element: bytes | str | None, after: tuple[str, ...], now: float,
          chain: tuple[str, str] | tuple[()] = ()) -> str:
    """Park a next step whose only fault is its destination in dead as itself, the rest of
    its chain in it, acknowledging the step that succeeded in the same call."""
    why = why.encode("utf-8", "backslashreplace").decode()
    entry = dict(nxt, error_class=error_class, error_message=why, failed_at=now)
    return _to_dead(manager, outcomes, unit, job, entry, why, keep, element, after, now, chain)


def _to_dead(manager: "Manager", outcomes: "Outcomes", unit: "Unit", job: dict[str, Any],
             entry: dict[str, Any], reason: str, keep: tuple[str, int] | None,
             element: bytes | str | None, after: tuple[str, ...], now: float,
             chain: tuple[str, str] | tuple[()]) -> str:
    target = [keys.DEAD, keys.DEAD]
    argv = ["dead", now, payload.dumps(entry), now - keys.DEAD_TIMEOUT_S, keys.DEAD_MAX_JOBS]
    done = manager.write(_write, outcomes, unit.token, keep, element, target, argv, after, chain)
    if done == 0:
        return "gone"
    what = "continuation" if entry.get("class") == MALFORMED_CLASS else "next step"
    log.error(f"chain ended: its {what} moved to the dead set", jid=job.get("jid"),
              reason=reason, dead_jid=entry["jid"])
    return "dead"


def _write(outcomes: "Outcomes", token: str, keep: tuple[str, int] | None,
           element: bytes | str | None, target: list[str], argv: list[Any],
           after: tuple[str, ...], chain: tuple[str, str] | tuple[()] = ()) -> int | bytes:
    """`chain`: a stored chain's (key, "keep" or "del"): its expiry renewed, or the list
    deleted once its last step is pushed."""
    pipe = outcomes.redis.pipeline(transaction=True)
    if keep is not None and element is not None:
        results.queue_write(pipe, *keep, element)
    key, action = chain or (None, "")
    pipe.eval(scripts.source("chain_next"), 4 if key else 3, outcomes.inflight_key, *target,
              *([key] if key else []), token, *argv, action, keys.CHAIN_TTL_S * 1000, *after)
    done = pipe.execute()[-1]
    return done if isinstance(done, bytes) else int(done)


def ended(job: dict[str, Any], fate: str, conn: Any = None) -> None:
    """Log that a chained job left without success for good, other than to dead (where
    the rest of its chain waits in its entry): the steps after it will not run. A long
    chain's list of them is deleted through `conn`, once the job's fate is written: nothing
    reads it again. Best effort: raising here would have the fate written again."""
    rest = job.get(FIELD)
    if conn is not None and type(rest) is dict:
        try:
            key = stored(rest)
            conn.delete(key)
        except Exception as exc:  # Broken (then there is nothing of ours to delete) or Redis
            if not isinstance(exc, Broken):
                log.warning("could not delete the steps of a chain that ended; they expire",
                            key=rest.get("key"), error=f"{type(exc).__name__}: {exc}")
    left = len(rest) if type(rest) is list else None
    if type(rest) is dict and type(rest.get("steps")) is int and type(rest.get("next")) is int:
        left = rest["steps"] - rest["next"]
    log.warning(f"chain ended: its step was {fate}, the steps after it will not run",
                jid=job.get("jid"), left=left,
                **{"class": payload.display_name(job)})
