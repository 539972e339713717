"""Batches: jobs pushed together, and callback jobs pushed once they have all ended.

    batch = forkq.Batch(description="import 42")
    batch.on_success(notify, "import-42")     # once every job has succeeded
    batch.on_complete(report, "import-42")    # once every job has succeeded or failed once
    with batch:                                # pushes in this thread or task join it
        for row in rows:
            load_row.enqueue(row)
    forkq.batch_status(batch.bid)

A job pushed inside the `with` carries `"bid"` (Sidekiq Pro's field) and its jid is added
to the batch's set in the same MULTI that pushes it. A worker counts a batch job's success
in the claim call that acknowledges it (scripts/_after.lua), and a failure in the MULTI
that schedules its retry or ends it (scripts/batch_fail.lua); either may fire a callback,
inside that same script, once (scripts/_batch.lua holds the rules and the keys). Leaving
the `with` seals the batch: before that nothing fires. One that ends with an exception is
never sealed: its jobs run, its callbacks never do, and its status says `abandoned`.
"""

from __future__ import annotations

import contextvars
import json
import random
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import keys, payload, scripts

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

    import redis

    from .client import Client
    from .jobs import Enqueuer, Job, P

PREFIX = keys.BATCH_PREFIX
# A batch's keys live this long after its latest job ended (refreshed at most once a day),
# and DONE_TTL_S once it succeeded: its status stays readable for a day. _batch.lua holds
# the same numbers.
TTL_S = 30 * 86400
DONE_TTL_S = 86400

# the batch open in this thread or asyncio task (the `with` block's), or None
_open: contextvars.ContextVar["Batch | None"] = contextvars.ContextVar("forkq_batch", default=None)


def key(bid: str) -> str:
    """A batch's hash; "KEY:jids" is the set of its jobs that have not succeeded, and
    "KEY:failed" their last failures (scripts/_batch.lua)."""
    return keys.batch(bid)


def joining() -> "Batch | None":
    """The batch a push made now joins (Client.push_jobs asks once per push)."""
    return _open.get()


def new_bid() -> str:
    """14 characters, as Sidekiq Pro's bids, never starting with "-": one in 64 did, and
    `forkq batch BID` then read it as an option."""
    while (bid := secrets.token_urlsafe(10)).startswith("-"):
        pass
    return bid


class Batch:
    """A set of jobs and the callbacks to push when they have ended; see the module doc."""

    def __init__(self, description: str = "", *, client: "Client | None" = None) -> None:
        if type(description) is not str:
            raise TypeError(f"description must be a str, not {type(description).__name__}")
        try:
            description.encode()
        except UnicodeEncodeError as exc:
            # Redis stores it as UTF-8: refused here, not only by the `with` that writes
            # it (and never under forkq.testing, which writes nothing)
            raise ValueError(f"description must be text UTF-8 can hold: {exc.reason} at "
                             f"position {exc.start}") from None
        self.bid = new_bid()
        self.description = description
        self._client = client
        self._callbacks: dict[str, tuple[str, str]] = {}  # event -> (payload text, queue)
        # new, open, sealed, abandoned, unsealed (the seal failed), or reopened (see
        # current_batch: entered and left any number of times, writing nothing itself)
        self._state = "new"
        # one per `with` still open: a reopened batch may be entered inside its own `with`
        self._tokens: list[contextvars.Token[Batch | None]] = []

    def __repr__(self) -> str:
        return f"<forkq.Batch {self.bid} {self._state}>"

    @property
    def client(self) -> "Client":
        from .client import default_client
        return self._client or default_client()

    # -- callbacks ----------------------------------------------------------------------
    def on_success(self, job: "Job[P, Any] | Enqueuer[P]", /, *args: P.args, **kwargs: P.kwargs) -> "Batch":
        """Push job(*args, **kwargs) once every job of the batch has succeeded (retries included)."""
        return self._callback("on_success", job, args, kwargs)

    def on_complete(self, job: "Job[P, Any] | Enqueuer[P]", /, *args: P.args, **kwargs: P.kwargs) -> "Batch":
        """Push job(*args, **kwargs) once every job of the batch has succeeded or failed at least once."""
        return self._callback("on_complete", job, args, kwargs)

    def _callback(self, event: str, job: Any, args: tuple, kwargs: dict[str, Any]) -> "Batch":
        from .jobs import Enqueuer, Job
        if self._state not in ("new", "open"):
            raise RuntimeError(f"batch {self.bid} is {self._state}: its callbacks are fixed")
        if isinstance(job, Job):
            job = job._default()
        if not isinstance(job, Enqueuer):
            raise TypeError(f"a batch callback is a @forkq.job (or its .options(...)), not {job!r}")
        if "unique_for" in job.options:
            raise ValueError(f"{job.job.name}: a batch callback cannot be unique (it is pushed "
                             "once already); use .options(unique_for=None)")
        if "expires_in" in job.options:
            # stamped into expires_at by a client's push, which a callback never goes through
            raise ValueError(f"{job.job.name}: a batch callback cannot expire; use "
                             ".options(expires_in=None)")
        checked = payload.check_args(list(args))
        kwargs = payload.check_kwargs(kwargs)
        job.job.check_call(checked, kwargs)
        (built,) = job._build([checked], {0: kwargs} if kwargs else None)
        self._callbacks[event] = (payload.dumps(built), payload.check_queue(built["queue"]))
        return self

    # -- the with block -----------------------------------------------------------------
    def __enter__(self) -> "Batch":
        outer = _open.get()
        if self._state == "reopened" and (outer is None or outer.bid == self.bid):
            self._tokens.append(_open.set(self))
            return self
        if self._state not in ("new", "reopened"):
            raise RuntimeError(f"batch {self.bid} is {self._state}: a batch is opened once")
        if outer is not None:  # (a reopened one inside another batch's `with` too)
            raise RuntimeError("a batch is already open here: batches do not nest")
        from . import client as client_module
        if client_module.test_push is None:
            # one call: the hash, and the batch's entry in the index `forkq batches` lists
            scripts.load(self.client.redis, "batch_open")(
                keys=[key(self.bid), keys.BATCHES],
                args=[self.bid, self.description, repr(time.time()), keys.BATCHES_MAX,
                      repr(random.random())])
        self._state = "open"
        self._tokens.append(_open.set(self))
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        _open.reset(self._tokens.pop())
        if self._state == "reopened":
            return  # sealed long ago: what was pushed joined it, error or not
        if kind is None:
            self._seal()
        else:
            self._abandon()

    def _seal(self) -> None:
        """One call: a seal that fails (Redis unreachable) raises out of the `with`, and
        the batch stays unsealed in Redis, its callbacks never pushed."""
        from . import client as client_module
        if client_module.test_push is not None:
            self._state = "sealed"
            self._seal_in_memory()
            return
        success = self._callbacks.get("on_success", ("", ""))
        complete = self._callbacks.get("on_complete", ("", ""))
        seal = scripts.load(self.client.redis, "batch_seal")
        self._state = "unsealed"
        if seal(keys=[key(self.bid)], args=[*success, *complete]) == -1:
            raise RuntimeError(f"batch {self.bid} is gone from Redis (flushed, or expired): "
                               "its callbacks will not run")
        self._state = "sealed"

    def _abandon(self) -> None:
        """Leave the batch unsealed, so nothing fires; mark it for its status, best effort
        (the exception may be Redis's own, and unsealed is what keeps callbacks back), and
        only if its hash is still there (scripts/batch_abandon.lua)."""
        from . import client as client_module
        self._state = "abandoned"
        if client_module.test_push is not None:
            return
        try:
            scripts.load(self.client.redis, "batch_abandon")(keys=[key(self.bid)])
        except Exception:
            pass

    def _seal_in_memory(self) -> None:
        """Under forkq.testing every job of the batch ran already (inline) or is recorded
        (fake, where drain() runs them): the callbacks are pushed now, after them."""
        from . import client as client_module
        for event in ("on_complete", "on_success"):
            if event in self._callbacks:
                # (test_push is set: _seal called this because it is)
                client_module.test_push([("LPUSH", "queue:" + self._callbacks[event][1],  # type: ignore[misc]
                                          self._callbacks[event][0])])

    # -- joining pushes -----------------------------------------------------------------
    def stamp(self, jobs: list[dict[str, Any]], client: "Client") -> None:
        """Mark jobs about to be pushed through `client` as this batch's."""
        if client.url != self.client.url:
            raise ValueError(f"batch {self.bid} lives on {self.client.url!r}: a push inside it "
                             f"must go to the same Redis, not {client.url!r}")
        for j in jobs:
            if "unique_for" in j:
                raise ValueError(f"{j.get('class')}: unique jobs cannot join a batch (the lock's "
                                 "push is a script of its own); push it with "
                                 ".options(unique_for=None), or outside the batch")
            j["bid"] = self.bid

    def registered(self, commands: list[tuple], jobs: list[dict[str, Any]],
                   due: float | None = None) -> list[tuple]:
        """A push's commands, with the jids of the jobs still in this batch (a client
        middleware may drop a job or its bid) added to the batch in the same MULTI; `due`:
        a scheduled push's run time, which the batch's keys must outlive. The script goes
        as EVAL with its body: an EVALSHA unknown to Redis would fail inside the MULTI while
        the push itself went through."""
        jids = [j["jid"] for j in jobs if j.get("bid") == self.bid]
        if not jids:
            return commands
        b = key(self.bid)
        return [("MULTI",), *commands,
                ("EVAL", scripts.source("batch_join"), 2, b, b + ":jids", "" if due is None else repr(due), *jids),
                ("EXEC",)]

    def refused(self, commands: list[tuple], replies: list[Any],
                jobs: list[dict[str, Any]]) -> list[tuple]:
        """The MULTI that takes back out of this batch the jobs whose push failed inside
        registered()'s MULTI (`replies` is its EXEC's), or [] if none did: EXEC runs every
        command even when one fails (WRONGTYPE on a queue key), so those jids joined the
        batch without their jobs, and its success would wait for them forever."""
        mine = [j for j in jobs if j.get("bid") == self.bid]
        lost: set[str] = set()
        for command, reply in zip(commands, replies):
            if not isinstance(reply, Exception):
                continue
            if command[0] == "ZADD":  # the schedule's: every job of the push
                lost.update(j["jid"] for j in mine)
            elif command[0] == "LPUSH":
                lost.update(j["jid"] for j in mine if "queue:" + j.get("queue", "") == command[1])
        if not lost:
            return []
        b = key(self.bid)
        return [("MULTI",), ("SREM", b + ":jids", *lost), ("HINCRBY", b, "total", -len(lost)),
                ("EXEC",)]

    def status(self) -> "BatchStatus | None":
        return batch_status(self.bid, client=self._client)


def current_batch(client: "Client | None" = None) -> Batch | None:
    """The batch of the job this thread is running, reopened: pushes inside
    `with forkq.current_batch():` join it. None outside a job, or in a job of no batch.

    Safe because the running job has not succeeded yet: its own jid holds the batch's
    success back until the jobs it adds are counted (they join in the MULTI that pushes
    them, before this job can be acknowledged). `complete` that already fired (every other
    job had failed once) does not fire again."""
    from .logs import current_job
    job = current_job()
    bid = None if job is None else job.get("bid")
    if type(bid) is not str or not bid:
        return None
    reopened = Batch(client=client)
    reopened.bid = bid
    reopened._state = "reopened"
    return reopened


# -- the worker's side -------------------------------------------------------------------
def after_success(job: dict[str, Any], lock: tuple[str, str] | None) -> tuple[str, ...] | None:
    """A batch job's after-success actions: its batch's count, and `lock` (a unique job's
    release) if any. Only called for a payload with a "bid"; one that is no str (another
    client's) is ignored."""
    bid, jid = job["bid"], job.get("jid")
    # a bid or jid redis-py cannot send (another client's "\\udc80") names no batch's job,
    # and its count, batched with the next claim, would fail every claim after it
    if type(bid) is not str or not bid or type(jid) is not str \
            or not (payload.sendable(bid) and payload.sendable(jid)):
        return lock
    mine = (PREFIX + bid, jid)
    return mine if lock is None else mine + lock


def _failure_json(error_class: str, error_message: str, fate: str) -> str:
    return json.dumps({"error_class": error_class, "error_message": error_message[:1000],
                       "fate": fate, "at": time.time()})


def queue_failure(pipe: Any, job: dict[str, Any], error_class: str, error_message: str,
                  fate: str) -> None:
    """Queue the count of a batch job's failure on a MULTI `pipe` (nothing for a job that
    is in no batch)."""
    bid, jid = job.get("bid"), job.get("jid")
    if type(bid) is not str or not bid or type(jid) is not str:
        return
    scripts.load(pipe, "batch_fail")(keys=[key(bid)], args=[
        jid, _failure_json(error_class, error_message, fate)], client=pipe)


def record_failure(client: "redis.Redis", job: dict[str, Any], error_class: str,
                   error_message: str, fate: str) -> None:
    """Count a batch job's failure now, in a call of its own (a job dropped unrun)."""
    pipe = client.pipeline(transaction=True)
    queue_failure(pipe, job, error_class, error_message, fate)
    if len(pipe):
        pipe.execute()


def on_failure(redis_client: "redis.Redis", job: dict[str, Any], exc: BaseException,
               plan: tuple[str, Any]) -> tuple[str, Any]:
    """A failure's plan (fate, write) from retry.Outcomes, made to count the failure in
    the job's batch in the same MULTI as the write (which takes `client=` a pipeline)."""
    bid, jid = job.get("bid"), job.get("jid")
    if type(bid) is not str or not bid or type(jid) is not str:
        return plan
    from .retry import error_class, message
    fate, write = plan
    failure = (error_class(exc), message(exc), fate)

    def write_in_batch(token: str, client: Any = None) -> None:
        pipe = redis_client.pipeline(transaction=True) if client is None else client
        write(token, client=pipe)
        queue_failure(pipe, job, *failure)
        if client is None:
            pipe.execute()
    return fate, write_in_batch


# -- reading -------------------------------------------------------------------------------
# what `forkq batch`, `forkq batches` and the dashboard call a batch, in the order it goes
STATES = ("open", "running", "complete", "succeeded", "abandoned")


def state_of(sealed: bool, abandoned: bool, complete: bool, success: bool) -> str:
    """open (its `with` has not ended), running (sealed, waiting for its jobs), complete
    (on_complete's condition met), succeeded, or abandoned (an exception left the `with`)."""
    return ("succeeded" if success else "complete" if complete else "abandoned" if abandoned
            else "running" if sealed else "open")


@dataclass(frozen=True)
class BatchStatus:
    """What forkq.batch_status() reads. `pending`: jobs that have not succeeded (yet);
    `failures`: jid -> {"error_class", "error_message", "fate", "at"} of the last failure of
    each job that has not succeeded since; `complete`/`success`: whether that callback's
    condition was met (and its job pushed, if it has one)."""

    bid: str
    description: str
    created_at: float
    total: int
    pending: int
    failures: dict[str, dict[str, Any]]
    sealed: bool
    abandoned: bool
    complete: bool
    success: bool
    complete_at: float | None
    success_at: float | None

    @property
    def state(self) -> str:
        return state_of(self.sealed, self.abandoned, self.complete, self.success)


def batch_status(bid: str, client: "Client | None" = None) -> BatchStatus | None:
    """A batch's status, or None if Redis has none (never opened, or expired)."""
    from .client import default_client
    return read_status((client or default_client()).redis, bid)


def read_status(r: "redis.Redis", bid: str) -> BatchStatus | None:
    """batch_status on a redis.Redis of one's own (`forkq batch`, forkq.api users)."""
    b = key(bid)
    pipe = r.pipeline(transaction=True)
    pipe.hgetall(b)
    pipe.scard(b + ":jids")
    pipe.hgetall(b + ":failed")
    meta, pending, failed = pipe.execute()
    if not meta:
        return None
    meta = {k.decode(): v.decode() for k, v in meta.items()}
    total = int(meta.get("total", 0))

    def when(field: str) -> float | None:
        return float(meta[field]) if field in meta else None
    return BatchStatus(
        bid=bid, description=meta.get("description", ""),
        created_at=float(meta.get("created_at", 0)), total=total, pending=pending,
        failures={k.decode(): json.loads(v) for k, v in failed.items()},
        sealed=meta.get("sealed") == "1", abandoned=meta.get("abandoned") == "1",
        complete="complete_at" in meta, success="success_at" in meta,
        complete_at=when("complete_at"), success_at=when("success_at"))


@dataclass(frozen=True)
class BatchSummary:
    """A batch as `forkq batches` lists it: BatchStatus's counts without its failures
    (`failed` counts them: jobs whose last try failed and that have not succeeded since)."""

    bid: str
    description: str
    created_at: float
    state: str
    total: int
    pending: int
    failed: int
    complete_at: float | None
    success_at: float | None


# what a listing reads of each batch's hash: never the callbacks' payloads, which may be big
_SUMMARY_FIELDS = ("description", "created_at", "total", "sealed", "abandoned", "complete_at",
                   "success_at")
# The most index entries a listing reads (expired ones included) unless its limit is
# higher: a listing of a state few batches are in stops there, saying older ones may exist
# (Listing.more), instead of reading the whole index (keys.BATCHES_MAX entries).
LOOK_AT = 2000
_PAGE_MAX = 1000  # index entries read in one round trip, at most


class Listing(list):
    """recent()'s batches, a list. `more`: the listing stopped at its budget of index
    entries read (`looked_at`) before it had `limit` batches or reached the index's end, so
    older batches in the state(s) asked for may exist."""

    more: bool = False
    looked_at: int = 0


def recent(r: "redis.Redis", limit: int = 100, states: "Iterable[str] | None" = None,
           look_at: int | None = None) -> Listing:
    """The newest batches Redis holds, newest first: up to `limit` of them, only those in
    `states` (of STATES) if given, among the newest max(look_at, limit) entries of the
    index (keys.BATCHES); look_at defaults to LOOK_AT. Each round trip reads a page of
    the index's entries' fields (only those a listing shows), the counts of the previous
    page's batches in `states`, and the next page of the index; pages grow while a filter
    finds few. An entry whose batch has expired is dropped from the index. A batch opened
    more than keys.BATCHES_MAX batches ago is not listed, though `forkq batch BID` still
    reads it."""
    wanted = None if states is None else set(states)
    if wanted is not None and not wanted <= set(STATES):
        raise ValueError(f"unknown batch state(s) {sorted(wanted - set(STATES))}: "
                         f"expected some of {', '.join(STATES)}")
    budget = max(LOOK_AT if look_at is None else look_at, limit)
    size = min(limit + 10, budget, _PAGE_MAX)
    out = Listing()
    # batches in `states` whose counts (SCARD, HLEN) go with the next round trip: a
    # filtered listing reads the counts of those it shows only
    counting: list[tuple[bytes, float, dict[str, str | None]]] = []
    gone: list[bytes] = []
    seen: set[bytes] = set()
    found = looked = 0
    # Pages follow on by score, not by rank: the next one holds the entries scored below
    # the last page's lowest score, `top`, and those scored `top` not read yet (a tie). By
    # rank, an entry another listing dropped meanwhile (an expired batch's) moved every
    # rank after it up, and as many batches went unlisted; one opened meanwhile was read
    # twice.
    cursor: list[Any] = [None, set()]  # [top, members scored top read so far]
    members = _page(r, cursor, size) if limit > 0 else []
    while members or counting:
        looked += len(members)
        if members:
            _follow(cursor, members)
        end = len(members) < size  # the index's: no page after this one
        last = end or looked >= budget
        if wanted is not None:
            size *= 2
        size = min(size, _PAGE_MAX, budget - looked)
        # the next page goes with this one unless this one most likely fills the listing
        ahead = bool(members) and not last and (
            wanted is not None or found + len(members) < limit)
        pipe = r.pipeline(transaction=False)
        for raw, _, _ in counting:
            pipe.scard(PREFIX.encode() + raw + b":jids")
            pipe.hlen(PREFIX.encode() + raw + b":failed")
        for raw, _ in members:
            b = PREFIX.encode() + raw
            pipe.hmget(b, _SUMMARY_FIELDS)
            if wanted is None:
                pipe.scard(b + b":jids")
                pipe.hlen(b + b":failed")
        if ahead:
            asked = _ask_page(pipe, cursor, size), size
        # stopping at the budget: whether the index goes on past it (a short page says not)
        spent = bool(members) and not end and looked >= budget
        if spent:
            asked = _ask_page(pipe, cursor, 1), 1
        replies = iter(pipe.execute(raise_on_error=False))
        for raw, score, fields in counting:
            pending, failed = next(replies), next(replies)
            if isinstance(pending, Exception) or isinstance(failed, Exception):
                gone.append(raw)  # (WRONGTYPE) keys of that name that no batch of forkq's wrote
            else:
                out.append(_summary(raw, score, fields, pending, failed))
        counting = []
        for raw, score in members:
            meta = next(replies)
            counts = (next(replies), next(replies)) if wanted is None else ()
            # expired, or (WRONGTYPE) a key of that name that no batch of forkq's wrote
            if isinstance(meta, Exception) or all(v is None for v in meta) or \
                    any(isinstance(v, Exception) for v in counts):
                gone.append(raw)
                continue
            if raw in seen:  # a tie at a page's edge that moved meanwhile
                continue
            seen.add(raw)
            fields = _fields(meta)
            if found >= limit:
                continue
            if wanted is None:
                out.append(_summary(raw, score, fields, *counts))
                found += 1
            elif _state(fields) in wanted:
                counting.append((raw, score, fields))
                found += 1
        if not members:
            pass  # a round trip for the last counts only
        elif found >= limit or last:
            if spent and found < limit:
                out.more = bool(_next_page(cursor, replies, *asked))
            members = []
        elif ahead:
            members = _next_page(cursor, replies, *asked)
        else:
            members = _page(r, cursor, size)
    if gone:
        r.zrem(keys.BATCHES, *gone)
    out.looked_at = looked
    return out


def _ask_page(pipe: Any, cursor: list[Any], size: int) -> int:
    """Queue the reads of the index's next page after `cursor` (see recent) on `pipe`;
    return how many replies they make."""
    top = cursor[0]
    if top is None:
        pipe.zrevrangebyscore(keys.BATCHES, "+inf", "-inf", start=0, num=size, withscores=True)
        return 1
    # the ties (batches opened in the same microsecond: rare, and few) read or not
    pipe.zrevrangebyscore(keys.BATCHES, top, top, start=0, num=len(cursor[1]) + size,
                          withscores=True)
    pipe.zrevrangebyscore(keys.BATCHES, f"({top!r}", "-inf", start=0, num=size, withscores=True)
    return 2


def _got_page(cursor: list[Any], replies: list[Any], size: int) -> list[tuple[bytes, float]]:
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    if len(replies) == 1:
        return replies[0]
    ties, below = replies
    return ([m for m in ties if m[0] not in cursor[1]] + below)[:size]


def _next_page(cursor: list[Any], replies: Iterator[Any], count: int,
               size: int) -> list[tuple[bytes, float]]:
    return _got_page(cursor, [next(replies) for _ in range(count)], size)


def _page(r: Any, cursor: list[Any], size: int) -> list[tuple[bytes, float]]:
    pipe = r.pipeline(transaction=False)
    _ask_page(pipe, cursor, size)
    return _got_page(cursor, pipe.execute(), size)


def _follow(cursor: list[Any], members: list[tuple[bytes, float]]) -> None:
    """Move `cursor` past a page just read."""
    low = members[-1][1]
    if low != cursor[0]:
        cursor[0], cursor[1] = low, set()
    cursor[1].update(m for m, score in members if score == low)


def _fields(meta: list[bytes | None]) -> dict[str, str | None]:
    return dict(zip(_SUMMARY_FIELDS, (None if v is None else v.decode("utf-8", "replace")
                                      for v in meta)))


def _state(fields: dict[str, str | None]) -> str:
    return state_of(fields["sealed"] == "1", fields["abandoned"] == "1",
                    fields["complete_at"] is not None, fields["success_at"] is not None)


def _summary(raw: bytes, score: float, fields: dict[str, str | None], pending: int,
             failed: int) -> BatchSummary:
    def number(name: str) -> float | None:
        try:
            return float(fields[name]) if fields[name] is not None else None  # type: ignore[arg-type]
        except ValueError:  # not forkq's writing: shown as missing, not a failed listing
            return None
    created_at = number("created_at")
    try:
        total = int(fields["total"] or 0)
    except ValueError:
        total = 0
    return BatchSummary(
        bid=raw.decode("utf-8", "replace"), description=fields["description"] or "",
        created_at=score if created_at is None else created_at, state=_state(fields),
        total=total, pending=pending, failed=failed,
        complete_at=number("complete_at"), success_at=number("success_at"))
