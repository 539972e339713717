"""Finding a job by its jid, and cancelling it wherever it is (`forkq job`, `forkq cancel`,
`forkq.api.locate`, `forkq.api.cancel`).

A cancel first writes a request under keys.CANCEL, then looks for the job. A job that
waits (on its queue, among its queue's crash suspects, in the schedule or the retry set)
is moved to `dead` by one script that also ends it (its unique lock released, its batch
told it failed, its keep_result failure kept) and deletes the request. A job running on a
forkq process is the worker's to stop: at each heartbeat a process reads the requests for
the jobs it runs, interrupts them with forkq.JobCancelled and deletes the request when it
writes the job to `dead`. Written before the search, the request also catches a job that a
worker claims while the search goes on.

Nothing big travels to the client: a queue is scanned by a script, 10,000 entries a call,
that returns only the match; the sorted sets are read in pages by api.SortedSet.find.
Queues come from the `queues` set (no SCAN or KEYS, which an ACL may forbid), processes from
`processes`, in-flight hashes from the owners registry.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import redis

from . import control, keys, payload, results, scripts
from .errors import MalformedPayload
from .jobprogress import Progress
from .retry import CANCELLED_CLASS, cancel_message

if TYPE_CHECKING:
    from . import api

SCAN_CHUNK = 10_000  # list entries one script call looks at
SCAN_BYTES = 8 << 20  # and their bytes, past which it looks at no further slice of 500
PRUNE_AFTER_S = 24 * 3600  # a request older than this is pruned when another is written
PRUNE_SAMPLE = 20  # requests one write looks at for pruning
AGAIN_S = 1.0  # how long a job found nowhere is looked for again (in transit between keys)

WAITING = ("queued", "suspect", "scheduled", "retry")
NOT_FORKQ = " (not forkq: it does not read cancel requests)"
STATES = ("removed", "cancelled", "finished", "not_found", "not_forkq", "pending")


def check_jid(jid: Any) -> str:
    """The jid, or a ValueError/TypeError saying why it cannot be one."""
    if not isinstance(jid, str):
        raise TypeError(f"a jid must be a str, not {type(jid).__name__}")
    if not jid or len(jid) > 1000 or any(c in jid for c in "\n\r\"\\"):
        raise ValueError(f"not a jid: {jid[:100]!r}")
    if not payload.sendable(jid):  # else redis-py's own UnicodeEncodeError, mid-search
        raise ValueError(f"not a jid: {jid[:100]!r} holds text UTF-8 cannot carry")
    return jid




@dataclass(frozen=True)
class Location:
    """Where a job is. `state` is one of queued, suspect (a crash suspect of `queue`),
    scheduled, retry, running (in a process's running jobs), claimed (in a forkq process's
    in-flight hash, not yet or no longer shown as running), dead, finished (a kept
    keep_result outcome) or not_found."""
    state: str
    jid: str
    queue: str | None = None
    position: int | None = None  # queued / suspect: 0 runs next
    paused: bool | None = None  # queued / suspect: whether its queue is paused (forkq pause)
    at: float | None = None  # scheduled / retry: due; running: since; dead: when it died
    retry_count: int | None = None
    error: str | None = None  # retry / dead: "Class: message"
    identity: str | None = None  # running / claimed: the process
    host: str | None = None
    pid: int | None = None
    forkq: bool | None = None  # running: whether that process reads cancel requests
    result: dict[str, Any] | None = None  # finished: the kept element
    job: dict[str, Any] | None = None
    progress: Progress | None = None  # running: its latest forkq.progress(), if any
    raw: bytes | None = field(default=None, repr=False)  # the exact entry, to remove it

    def describe(self) -> str:
        """One line for people."""
        s = self.state
        # a paused queue's position 0 does not run next: nothing runs until it is resumed
        held = " (paused: nothing runs from it until it is resumed)" if self.paused else ""
        if s == "queued":
            return f"waiting on queue {self.queue}{held}, position {self.position} (0 runs next)"
        if s == "suspect":
            return f"a crash suspect of queue {self.queue}{held}, position {self.position} (0 runs next)"
        if s == "scheduled":
            return f"scheduled for {_utc(self.at)}"
        if s == "retry":
            return (f"in the retry set: {self.retry_count} retries so far, next at {_utc(self.at)}, "
                    f"last error {self.error}")
        if s == "running":
            who = f"{self.host} pid {self.pid}" if self.host else "a process"
            kind = "" if self.forkq else NOT_FORKQ
            done = f", at {self.progress.describe()}" if self.progress else ""
            return f"running on {who} ({self.identity}) since {_utc(self.at)}{done}{kind}"
        if s == "claimed":
            return f"claimed by forkq process {self.identity} (starting, or just ended)"
        if s == "dead":
            return f"in the dead set since {_utc(self.at)}: {self.error}"
        if s == "finished":
            r = self.result or {}
            if "failed" in r:
                return f"finished: {r.get('failed')}, {r.get('error_class')}: {r.get('error_message')}"
            return "finished: succeeded" + (" (its value was not storable)" if "unstorable" in r else "")
        return "not found (never pushed, ended without keep_result, or expired)"

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("raw")
        out["progress"] = self.progress.to_dict() if self.progress else None
        out["description"] = self.describe()
        return out


@dataclass(frozen=True)
class Outcome:
    """What cancel() did: `state` is one of STATES, `where` the job's last location."""
    state: str
    jid: str
    where: Location
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {"jid": self.jid, "state": self.state, "detail": self.detail,
                "where": self.where.to_dict()}


def _utc(stamp: float | None) -> str:
    if stamp is None:
        return "?"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(stamp))


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _parse(raw: bytes | str) -> dict[str, Any] | None:
    try:
        return payload.parse(raw)
    except MalformedPayload:
        return None


def _error(job: dict[str, Any] | None) -> str | None:
    if not job or "error_class" not in job:
        return None
    return f"{job.get('error_class')}: {job.get('error_message')}"


# -- locate -----------------------------------------------------------------------------


def locate(conn: redis.Redis, jid: str) -> Location:
    """Where the job with this jid is now. Looked for in the order jobs travel (schedule,
    retry, queues, processes), so one moving forward meanwhile is found further on; then
    `dead` and a kept result. A job moving back (a failure to retry) may be missed: look
    again. Payloads must carry the jid as plain text (as every Sidekiq client writes it)."""
    check_jid(jid)
    for name, state in ((keys.SCHEDULE, "scheduled"), (keys.RETRY, "retry")):
        entry = _in_set(conn, name, jid)
        if entry is not None:
            return Location(state, jid, entry.queue, at=entry.score,
                            retry_count=_int(entry.job, "retry_count"), error=_error(entry.job),
                            job=entry.job, raw=entry.raw)
    found = _in_queues(conn, jid) or _running(conn, jid)
    if found is not None:
        return found
    entry = _in_set(conn, keys.DEAD, jid)
    if entry is not None:
        return Location("dead", jid, entry.queue, at=entry.score, error=_error(entry.job),
                        retry_count=_int(entry.job, "retry_count"), job=entry.job, raw=entry.raw)
    kept = conn.lindex(keys.result(jid), 0)
    if kept is not None:
        try:
            element = json.loads(kept)
        except ValueError:
            element = None
        return Location("finished", jid, result=element if isinstance(element, dict) else {})
    return Location("not_found", jid)


def _int(job: dict[str, Any] | None, name: str) -> int | None:
    value = (job or {}).get(name)
    return value if type(value) is int else None


def scan_list(conn: redis.Redis, key: str, jid: str, chunk: int = SCAN_CHUNK,
              budget: int = SCAN_BYTES) -> tuple[int, int, bytes] | None:
    """(index from the left, length, raw) of the first entry of list `key` whose payload
    has this jid, a script call per `chunk` entries (fewer if they pass `budget` bytes),
    each returning only a match."""
    hit = _scan(conn, "list", key, jid, chunk, budget)
    return None if hit is None else (hit[0], hit[1], hit[2])


def _scan(conn: redis.Redis, kind: str, key: str, jid: str, chunk: int = SCAN_CHUNK,
          budget: int = SCAN_BYTES) -> list[Any] | None:
    """find_jid.lua over a list or sorted set, a call at a time: [index, size, raw] (and
    the score, for a sorted set) of the first match, or None."""
    find = scripts.load(conn, "find_jid")
    start = 0
    while True:
        found, start, size, *hit = find(keys=[key], args=[kind, jid, start, chunk, budget])
        if found >= 0:
            return [int(found), int(size), *hit]
        if start >= size:
            return None


def _in_set(conn: redis.Redis, name: str, jid: str) -> "api.Entry | None":
    """The entry of the schedule, retry or dead set with this jid, scanned in Redis from
    the highest score (api.SortedSet.find would bring every entry to the client)."""
    from . import api
    hit = _scan(conn, "zset", name, jid)
    return None if hit is None else api.Entry.of(hit[2], float(hit[3]))


def _in_queues(conn: redis.Redis, jid: str) -> Location | None:
    from . import api
    names, paused = api.queue_names(conn)
    for name in names:
        # suspects first: a worker takes them before the queue
        for key, state in ((keys.suspects(name), "suspect"), (keys.queue(name), "queued")):
            try:
                hit = scan_list(conn, key, jid)
            except redis.ResponseError as exc:
                if "WRONGTYPE" not in str(exc):
                    raise
                continue  # not a list: no job of ours is there
            if hit is not None:
                index, length, raw = hit
                job = _parse(raw)
                return Location(state, jid, name, position=length - 1 - index, paused=name in paused,
                                retry_count=_int(job, "retry_count"), error=_error(job),
                                job=job, raw=raw)
    return None


def running_on(conn: redis.Redis, jid: str, identities: list[str],
               forkq: frozenset[str] | set[str] = frozenset()) -> dict[str, tuple[str, bytes | str]]:
    """identity -> ("work", entry) or ("inflight", entry) for each of these processes that
    shows the job in its running jobs (either Sidekiq name of the hash) or, for a forkq
    process, in its in-flight hash. One round trip. For the `forkq` processes among them
    (those in the owners registry) "work" needs both: their running jobs are written at
    each heartbeat, and a job they ended since is still shown there until the next one,
    while it leaves the in-flight hash as it ends."""
    find = scripts.load(conn, "find_jid")
    pipe = conn.pipeline(transaction=False)
    for identity in identities:
        find(keys=[keys.work(identity), keys.workers(identity)], args=["work", jid], client=pipe)
        find(keys=[keys.inflight(identity)], args=["inflight", jid], client=pipe)
    replies = pipe.execute()
    out: dict[str, tuple[str, bytes | str]] = {}
    for i, identity in enumerate(identities):
        work, inflight = replies[2 * i], replies[2 * i + 1]
        if work and (inflight or identity not in forkq):
            out[identity] = ("work", work[1])
        elif inflight:
            out[identity] = ("inflight", inflight[1])
    return out


def _running(conn: redis.Redis, jid: str) -> Location | None:
    pipe = conn.pipeline(transaction=False)
    pipe.smembers(keys.PROCESSES)
    pipe.hkeys(keys.OWNERS)
    members, owners = pipe.execute()
    forkq = {_text(o) for o in owners}
    identities = sorted({_text(m) for m in members} | forkq)
    if not identities:
        return None
    hits = running_on(conn, jid, identities, forkq)
    # a process showing it as running wins over one that holds it in flight
    for identity, (kind, value) in sorted(hits.items(), key=lambda h: h[1][0] != "work"):
        return _where_running(conn, jid, identity, kind, value)
    return None


def _where_running(conn: redis.Redis, jid: str, identity: str, kind: str,
                   value: bytes | str) -> Location:
    from . import api
    hb = control.heartbeat(conn, identity)
    info = hb["info"] if hb else {}
    host = info.get("hostname") if isinstance(info.get("hostname"), str) else None
    pid = info.get("pid") if type(info.get("pid")) is int else None
    if kind == "inflight":
        name, _, raw = _text(value).partition("\n")
        # a process with no heartbeat (starting, or dead with the job to be put back) is
        # taken at its word as a forkq one: the job ends where requests are read
        return Location("claimed", jid, name, identity=identity, host=host, pid=pid,
                        forkq=hb is None or reads_cancels(hb), job=_parse(raw))
    entry = api._running_entry(identity, b"", value)
    return Location("running", jid, entry.queue, at=entry.run_at, identity=identity, host=host,
                    pid=pid, forkq=hb is not None and reads_cancels(hb), job=entry.job,
                    progress=entry.progress)


def reads_cancels(hb: dict[str, Any]) -> bool:
    """Whether the process of this heartbeat (control.heartbeat) acts on cancel requests:
    a forkq worker says so in its info (`forkq_cancel`); Ruby Sidekiq, and a forkq from
    before cancels, never read forkq:cancel."""
    return hb["info"].get("forkq_cancel") is True


# -- cancel -----------------------------------------------------------------------------


def request(conn: redis.Redis, jid: str, reason: str | None, by: str | None,
            now: float | None = None) -> tuple[bool, dict[str, Any]]:
    """Write the request unless one stands (HSETNX: the first one's by and reason stay);
    prunes a sample of requests older than PRUNE_AFTER_S. (written, the standing request)."""
    now = time.time() if now is None else now
    record = json.dumps({"at": now, "by": by, "reason": reason})
    wrote, standing, _ = scripts.load(conn, "cancel_request")(
        keys=[keys.CANCEL], args=[jid, record, now - PRUNE_AFTER_S, PRUNE_SAMPLE])
    try:
        current = json.loads(standing) if standing is not None else {}
    except ValueError:
        current = {}
    return bool(wrote), current if isinstance(current, dict) else {}


def remove_waiting(conn: redis.Redis, where: Location, text: str, now: float | None = None) -> bool:
    """Move a waiting job (queued, suspect, scheduled, retry) to `dead` as cancelled, ended
    as a kill ends it (unique lock released, batch failure counted, keep_result failure
    kept), and delete its cancel request, all in one script call. False when the entry
    was no longer there (claimed, moved or deleted meanwhile): nothing was written."""
    from . import api
    assert where.state in WAITING and where.raw is not None
    now = time.time() if now is None else now
    job = dict(where.job) if where.job is not None else None
    if job is None:  # unparseable: kept as its bytes, as a poison job is
        dead_raw: bytes | str = where.raw
    else:
        job.update(error_class=CANCELLED_CLASS, error_message=text, failed_at=now)
        try:
            dead_raw = payload.dumps(job)
        except ValueError:  # NaN that json.loads let in: kept as it was
            dead_raw = where.raw
    if where.state in ("queued", "suspect"):
        source, kind = (keys.queue(where.queue) if where.state == "queued"
                        else keys.suspects(where.queue)), "list"
    else:
        source, kind = (keys.SCHEDULE if where.state == "scheduled" else keys.RETRY), "zset"
    entry = api.Entry(where.raw, 0.0, where.job)
    lock = api._lock(entry)
    in_batch = api._batch_of(entry)
    failure = json.dumps({"error_class": CANCELLED_CLASS, "error_message": text, "fate": "dead",
                          "at": now})
    args: list[Any] = [dead_raw, now, where.raw, kind, now - keys.DEAD_TIMEOUT_S,
                       keys.DEAD_MAX_JOBS, lock[0] if lock else "", where.jid,
                       in_batch[0] if in_batch else "", failure]
    script_keys = [keys.DEAD, source, keys.CANCEL]
    keep = results.target(job) if job is not None else None
    if keep is not None and keep[0] == where.jid:
        script_keys.append(keys.result(where.jid))
        args += [results.failure("dead", CANCELLED_CLASS, text), keep[1]]
    return bool(scripts.load(conn, "to_dead")(keys=script_keys, args=args))


def cancel(conn: redis.Redis, jid: str, reason: str | None = None, by: str | None = None,
           wait: float = 30.0, poll: float = 0.25) -> Outcome:
    """Cancel the job with this jid wherever it is; see Outcome and the README's
    "Cancelling a job". A waiting job is moved to `dead` at once ("removed"). A job running
    on forkq processes is waited for up to `wait` seconds: "cancelled" once the worker has
    stopped it (the request is gone), "finished" if it ended by itself first, "pending"
    if neither happened in time (the request stays: the worker acts on it when it sees
    it). A job on a process that does not read requests (Ruby Sidekiq) is "not_forkq",
    one found nowhere or already dead "not_found"; the request is deleted in those cases."""
    return cancel_many(conn, [jid], reason, by, wait, poll)[0]


def cancel_many(conn: redis.Redis, jids: list[str], reason: str | None = None, by: str | None = None,
                wait: float = 30.0, poll: float = 0.25) -> list[Outcome]:
    """cancel() for several jobs, within one `wait` in all. Every request is written before
    the first job is looked for, so workers stop all the running ones at their next
    heartbeat, not one heartbeat after another as each gets its turn."""
    for jid in jids:
        check_jid(jid)
    for name, value in (("reason", reason), ("by", by)):
        if value is None:
            continue
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a str or None, not {type(value).__name__}")
        try:  # checked before anything is written: the dead entry carries it as UTF-8
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"{name} is not text UTF-8 can carry ({exc.reason}: "
                             f"{value[exc.start:exc.end]!r} at {exc.start})") from None
    if not wait >= 0:
        raise ValueError(f"wait must be 0 or more seconds, not {wait!r}")
    # a jid given twice is one job, cancelled once: its second search would find it in dead
    # with no request left and say a worker stopped it, though it was removed while waiting
    distinct = list(dict.fromkeys(jids))
    texts = [cancel_message(request(conn, jid, reason, by)[1]) for jid in distinct]
    deadline = time.monotonic() + wait
    done = {jid: _Canceller(conn, jid, text, deadline, poll).run() for jid, text in zip(distinct, texts)}
    return [done[jid] for jid in jids]


class _Canceller:
    """One cancel's search and wait (see cancel())."""

    def __init__(self, conn: redis.Redis, jid: str, text: str, deadline: float, poll: float) -> None:
        self.redis = conn
        self.jid = jid
        self.text = text
        self.deadline = deadline
        self.poll = poll
        # processes seen running it -> the heartbeat `beat` values seen since (see _wait)
        self.watch: dict[str, list[bytes | None]] = {}

    def _done(self, state: str, where: Location, detail: str, drop: bool = True) -> Outcome:
        if drop:
            self.redis.hdel(keys.CANCEL, self.jid)
        return Outcome(state, self.jid, where, detail)

    def run(self) -> Outcome:
        missing_until: float | None = None
        while True:
            where = locate(self.redis, self.jid)
            if where.state in WAITING:
                if remove_waiting(self.redis, where, self.text):
                    return Outcome("removed", self.jid, where,
                                   f"was {where.describe()}; moved to the dead set")
                if time.monotonic() >= self.deadline:
                    # it keeps moving (or its key is odd): the worker acts on the request if
                    # it runs
                    return Outcome("pending", self.jid, where, f"{where.describe()}, and moved "
                                   "each time it was to be removed; the request stays")
                continue  # claimed or moved meanwhile: find it again
            if where.state in ("running", "claimed") and not where.forkq:
                return self._done("not_forkq", where,
                                  f"{where.describe().replace(NOT_FORKQ, '')}; that process does "
                                  "not read cancel requests, and nothing stops it from here")
            if where.state in ("running", "claimed"):
                outcome = self._wait(where)
                if outcome is not None:
                    return outcome
                continue  # left the processes watched, not ended: find it again
            if self.watch and not self.redis.hexists(keys.CANCEL, self.jid):
                # a worker stopped it while this looked elsewhere
                return Outcome("cancelled", self.jid, where, f"stopped by its worker; now {where.describe()}")
            if self.watch:
                return self._done("finished", where, f"it ended before the cancel reached it; now "
                                                     f"{where.describe()}")
            if where.state == "dead":
                if (where.job or {}).get("error_class") == CANCELLED_CLASS and \
                        not self.redis.hexists(keys.CANCEL, self.jid):
                    # a worker stopped it, taking this request, before it was looked for
                    # (between its write and the search, or while others of the same
                    # cancel_many were waited for)
                    return Outcome("cancelled", self.jid, where, f"stopped by its worker; now "
                                                                 f"{where.describe()}")
                return self._done("not_found", where, f"nothing to cancel: {where.describe()}")
            if where.state == "finished":
                return self._done("finished", where, f"nothing to cancel: {where.describe()}")
            # found nowhere: it may be between two keys (claimed, landing, moving due)
            now = time.monotonic()
            if missing_until is None:
                missing_until = now + AGAIN_S
            if now >= missing_until:
                return self._done("not_found", where, "no job with this jid in any queue, set "
                                                      "or process")
            time.sleep(0.1)

    def _wait(self, where: Location) -> Outcome | None:
        """Wait for the worker to act on the request, polling the processes seen running the
        job. None once it is on none of them and each has beaten twice since it was seen
        there without it (or stopped): the caller looks for it again, and concludes it ended
        by itself if it finds it nowhere. Twice: a process drops a failing job from the
        running jobs it reports just before it writes the failure, so one beat without it
        may come from a job the worker is ending as cancelled right then."""
        assert where.identity is not None
        self.watch.setdefault(where.identity, [])
        identities = list(self.watch)
        while True:
            pipe = self.redis.pipeline(transaction=False)
            pipe.hexists(keys.CANCEL, self.jid)
            for identity in identities:
                pipe.hget(identity, "beat")
            replies = pipe.execute()
            hits = running_on(self.redis, self.jid, identities)
            if not replies[0]:
                # the worker deleted it with its write to dead (see keys.CANCEL)
                return Outcome("cancelled", self.jid, where,
                               f"stopped by its worker (was {where.describe()}); now in the dead set")
            for identity, beat in zip(identities, replies[1:]):
                seen = self.watch[identity]
                if identity in hits:
                    seen.clear()  # still there: beats count from when it is gone
                    seen.append(beat)
                elif not seen or seen[-1] != beat:
                    seen.append(beat)
            # seen[0] is the beat at the last sight of the job (or the first poll without it)
            if all(i not in hits and (len(self.watch[i]) >= 3 or self.watch[i][-1] is None)
                   for i in identities):
                return None
            if time.monotonic() >= self.deadline:
                return Outcome("pending", self.jid, where,
                               f"{where.describe()}; the request stays, and its worker stops it "
                               "at its next heartbeat")
            time.sleep(self.poll)
