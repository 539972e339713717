"""Read and manage what forkq (or Sidekiq) keeps in Redis: queues, processes, running jobs,
the schedule/retry/dead sets and the counters.

Everything here reads Sidekiq's own keys, so it works the same on jobs Ruby Sidekiq pushed.
It never uses KEYS (it would block Redis on a big database): queues come from the `queues`
set, processes from the `processes` set, and the sorted sets are read by rank in pages, so
a dead set of 10,000 entries is never loaded at once.

Crash suspects (forkq's own `forkq:suspects:QUEUE` lists) are counted for the queues of the
`queues` set, next to their sizes: not SCANned for, so suspects of a queue someone removed
from that set (Sidekiq's "delete queue") are counted nowhere, though `Suspects(conn, name)`
still reads them.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Self

import redis

from . import batch, client, control, jobprogress, keys, payload, scripts, unique
# (`X as X`: re-exported, for a type checker with no_implicit_reexport, as mypy --strict)
from .pause import Pause as Pause, pause as pause, paused as paused, resume as resume  # noqa: F401
from .pause import wait_honoured as wait_honoured  # noqa: F401  (the API)
from .cancel import Location as Location, Outcome as Outcome, cancel as cancel  # noqa: F401
from .cancel import cancel_many as cancel_many, locate as locate  # noqa: F401  (the API)
from .errors import MalformedPayload
from .fetch import crash_id
from .jobprogress import Progress as Progress  # noqa: F401  (the API)
from .retry import MALFORMED_CLASS

DEFAULT_PAGE = 500
CLEAR_PAGE = 1000  # entries SortedSet.clear() and Queue.clear() look at in one script call
# Queue.delete: entries forget.lua reads at most, in one call, looking for jobs that pushes
# and removals moved from where they were read (a call that finds them where they were
# reads only them); Queue.apply: how long it gathers matches for one delete at most (a
# delete of jobs read longer ago finds more of them moved)
NEAR_SEARCH = 20_000
APPLY_GATHER_S = 0.5


def connect(url: str | None = None) -> redis.Redis:
    """A connection for admin work: FORKQ_REDIS_URL unless given, with a socket timeout so
    a command-line call cannot hang forever on an unreachable Redis."""
    return client.connect(url, socket_timeout=10)


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


# -- queues -----------------------------------------------------------------------------


@dataclass(frozen=True)
class QueueInfo:
    name: str
    size: int
    latency: float  # seconds the next job to run has waited; 0 when empty or unknown
    # jobs held by a process that crashed, waiting on the queue's suspects list to run one at
    # a time, each alone; not counted in `size` (a worker takes them before the queue)
    suspects: int = 0
    # paused with forkq.api.pause (pause.py): jobs wait on it, and no process claims them
    paused: bool = False


def _latency(raw: bytes | None, now: float) -> float:
    """Age of the next job to run (the RIGHTMOST entry: workers pop the right end).
    Accepts Sidekiq 6/7 float seconds and Sidekiq 8 integer milliseconds."""
    if not raw:
        return 0.0
    try:
        job = payload.parse(raw)
    except MalformedPayload:
        return 0.0
    return max(0.0, now - at) if (at := stamp(job.get("enqueued_at"))) else 0.0


def stamp(value: Any) -> float | None:
    """A time stamp from another writer (Sidekiq 6/7 float seconds, integer seconds, or Sidekiq 8
    milliseconds) as epoch seconds; None for one before 1970 or not finite, which no clock
    wrote (a -1e300 made a 300-digit latency)."""
    seconds = payload.seconds(value)
    return seconds if seconds is not None and 0 < seconds < math.inf else None


def queue_names(conn: redis.Redis) -> tuple[list[str], set[str]]:
    """Every queue's name, sorted: those in the `queues` set and every paused one (a queue
    can be paused before anything is pushed to it); and the paused ones. One round trip."""
    pipe = conn.pipeline(transaction=False)
    pipe.smembers(keys.QUEUES)
    pipe.hkeys(keys.PAUSED)
    listed, held = pipe.execute()
    paused = {_text(n) for n in held}
    return sorted({_text(n) for n in listed} | paused), paused


def queues(conn: redis.Redis) -> list[QueueInfo]:
    """Every queue in the `queues` set, and every paused one, with its length, latency,
    crash suspects and whether it is paused (three commands a queue, in one round trip)."""
    names, paused_names = queue_names(conn)
    if not names:
        return []
    pipe = conn.pipeline(transaction=False)
    for name in names:
        pipe.llen(keys.queue(name))
        pipe.lindex(keys.queue(name), -1)
        pipe.llen(keys.suspects(name))
    replies = pipe.execute()
    now = time.time()
    return [QueueInfo(name, int(replies[3 * i]), _latency(replies[3 * i + 1], now),
                      int(replies[3 * i + 2]), name in paused_names)
            for i, name in enumerate(names)]


class _List:
    """A list of payloads read a page at a time (LRANGE, never the whole list). Index 0 is
    the entry pushed last (LPUSH); the highest index is the next to run (workers pop the
    right end). Its pages are Entry objects whose `score` is the entry's index."""

    def __init__(self, conn: redis.Redis, name: str, key: str) -> None:
        self.redis = conn
        self.name = name
        self.key = key

    def size(self) -> int:
        return int(self.redis.llen(self.key))

    def page(self, offset: int, count: int, next_first: bool = False) -> list[Entry]:
        """`count` entries from `offset`, counted from the newest, or with next_first from
        the next to run. LLEN and LRANGE in one transaction, so the indices agree."""
        if count < 1:
            return []
        pipe = self.redis.pipeline(transaction=True)
        pipe.llen(self.key)
        if next_first:
            pipe.lrange(self.key, -offset - count, -offset - 1)
        else:
            pipe.lrange(self.key, offset, offset + count - 1)
        size, rows = pipe.execute()
        if not next_first:
            return [self._entry(raw, float(offset + i), int(size)) for i, raw in enumerate(rows)]
        first = max(0, int(size) - offset - count)  # the index of rows[0]
        return [self._entry(raw, float(first + i), int(size))
                for i, raw in reversed(list(enumerate(rows)))]

    def _entry(self, raw: bytes, index: float, size: int) -> "Entry":
        return Entry.of(raw, index)


class Queue(_List):
    """One queue's jobs (see _List for indices and pages), and the changes an operator makes
    to them: delete some, or all (clear)."""

    def __init__(self, conn: redis.Redis, name: str, page_size: int = DEFAULT_PAGE) -> None:
        if page_size < 1:
            raise ValueError("page_size must be at least 1")
        super().__init__(conn, name, keys.queue(name))
        self.page_size = page_size
        # how many of the jobs delete() and clear() removed carried the rest of a chain
        # (forkq.chain): its later steps will not run, where a cancel keeps them in dead
        self.chains_cut = 0

    def listed(self) -> bool:
        """Whether the `queues` set names it (an empty queue is still a queue)."""
        return bool(self.redis.sismember(keys.QUEUES, self.name))

    def _entry(self, raw: bytes, index: float, size: int) -> "Queued":
        return Queued.of(raw, index, size - 1 - int(index))

    def page(self, offset: int, count: int, next_first: bool = False  # type: ignore[override]
             ) -> list[Queued]:  # (its _entry makes Queued ones)
        """As _List.page, each entry with its `position` (0 runs next) as read."""
        return super().page(offset, count, next_first)  # type: ignore[return-value]

    def __iter__(self) -> Iterator[Queued]:
        return self.entries()

    def entries(self, where: Filter | None = None, next_first: bool = True) -> Iterator[Queued]:
        """Every job (matching `where`), the next to run first (or with next_first False the
        newest first), one page in memory at a time. Counted from the end workers pop, a
        page read after workers took some starts further on than the last one ended, so on
        a queue being worked some jobs are not seen: they were about to run anyway."""
        offset = 0
        while True:
            batch_ = self.page(offset, self.page_size, next_first)
            for entry in batch_:
                if where is None or where(entry):
                    yield entry
            if len(batch_) < self.page_size:
                return
            offset += len(batch_)

    def find(self, jid: str) -> Queued | None:
        """The job with this jid, looked for in Redis from the newest end (cancel.scan_list:
        only the match comes back)."""
        from .cancel import scan_list
        hit = scan_list(self.redis, self.key, jid)
        if hit is None:
            return None
        index, size, raw = hit
        return Queued.of(raw, float(index), size - 1 - index)

    # -- changes --------------------------------------------------------------------

    def apply(self, action: Callable[[list[Queued]], int], where: Filter | None = None) -> int:
        """Run `action` on the matching jobs, up to a page of them at a time; returns how
        many it changed (removed, for delete).

        The walk starts at the newest end, where producers push: a push moves the jobs not
        yet read one further on, so they are read later, never skipped (a kept one may be
        read twice), while workers popping the other end move no index counted from here.
        (From that end, each job a worker took would make the walk skip one.) Matches
        are gathered over pages until there are a page of them or they were read
        APPLY_GATHER_S ago: a delete then walks into the list once for them all, not once
        a page. Jobs the action removed take no index, so the walk goes on from those
        left. A queue pushed to faster than it is walked is not chased forever: the walk
        stops after reading twice as many jobs as the queue held."""
        offset = done = looked = 0
        budget = 2 * self.size() + self.page_size
        chosen: list[Queued] = []
        since = 0.0

        def flush() -> None:
            nonlocal offset, done, chosen
            changed = action(chosen)
            done += changed
            offset -= changed
            chosen = []

        while looked < budget:
            batch_ = self.page(offset, self.page_size)
            looked += len(batch_)
            offset += len(batch_)
            for entry in batch_:
                if where is None or where(entry):
                    if not chosen:
                        since = time.monotonic()
                    chosen.append(entry)
            if len(batch_) < self.page_size:
                break
            if len(chosen) >= self.page_size or (chosen and time.monotonic() - since > APPLY_GATHER_S):
                flush()
        if chosen:
            flush()
        return done

    def delete(self, entries: "Sequence[Entry] | bytes") -> int:
        """Remove jobs read from this queue (its pages, entries(), find()), ending each as a
        job leaving for good ends (see _forget): a unique job's lock released, a batch job
        counted as failed. Returns how many were removed: a job a worker took meanwhile is
        not. Each is looked for at the index it was read at (`score`), then around it
        (forget.lua's 'near'), and a call's worth is removed with one walk into the list:
        LREM of each job would walk the list to it, a thousand walks of a million-job queue
        for a page. Given bytes, removes the first entry with exactly those (LREM 1 from
        the newest end): equal bytes are the same job pushed twice."""
        if isinstance(entries, (bytes, str)):
            entry = Entry.of(entries, 0.0)
            removed = _forget(self.redis, self.key, "list", [entry])
            self.chains_cut += _chained([entry][:removed])
            return removed
        ordered = sorted(entries, key=lambda e: e.score)
        forget = scripts.load(self.redis, "forget")
        removed = 0
        # the highest indices first: what one call removes moves none of the next's jobs.
        # A round trip each, not one pipeline: Redis serves others between the calls.
        for end in range(len(ordered), 0, -CLEAR_PAGE):
            call = ordered[max(0, end - CLEAR_PAGE):end]
            gone = int(forget(keys=[self.key], args=_near_args(call)))
            removed += gone
            # those not removed were taken by workers, which pop the highest indices first
            self.chains_cut += _chained(call[:gone])
        return removed

    def clear(self) -> int:
        """Remove every job, ending each as delete() does; returns how many it removed.

        A page of jobs at a time (CLEAR_PAGE, fewer when they pass 8 MB), each page one
        round trip: a script pops them from the end workers pop, drops those with nothing
        to end, and puts the others back where they were (scripts/clear_list_page.lua);
        forget.lua removes and ends
        those in the same pipeline as the next page's pop. So a job is in the queue until
        it is dropped or ended: one a worker takes meanwhile is run and ended by that
        worker, never twice, and a client that dies between leaves jobs queued, never
        removed unended. Jobs pushed meanwhile at the other end are reached or left; a
        queue refilled as fast as it is emptied is not chased forever: the clear stops
        once it has taken twice as many jobs as the queue held."""
        take = scripts.load(self.redis, "clear_list_page")
        forget = scripts.load(self.redis, "forget")
        pipe = self.redis.pipeline(transaction=False)
        pipe.llen(self.key)
        take(keys=[self.key], args=[CLEAR_PAGE], client=pipe)
        size, reply = pipe.execute()
        budget = 2 * int(size) + CLEAR_PAGE
        removed = 0
        while True:
            looked, plain, length, chained, *rest = reply
            removed += int(plain)
            self.chains_cut += int(chained)
            budget -= int(looked)
            if not rest:
                if int(looked) == 0 or budget <= 0:
                    return removed
                reply = take(keys=[self.key], args=[CLEAR_PAGE])
                continue
            first = int(length) - len(rest)
            entries = [Entry.of(raw, float(first + i)) for i, raw in enumerate(rest)]
            pipe = self.redis.pipeline(transaction=False)
            forget(keys=[self.key], args=_near_args(entries), client=pipe)
            if budget > 0:
                take(keys=[self.key], args=[CLEAR_PAGE], client=pipe)
            replies = pipe.execute()
            removed += int(replies[0])
            # those not removed were taken by workers, from the right end: the last ones
            self.chains_cut += _chained(entries[:int(replies[0])])
            if budget <= 0:
                return removed
            reply = replies[1]


def _chained(entries: list[Entry]) -> int:
    """How many of these carry the rest of a chain (chains.FIELD: a non-empty list, or a
    reference to a stored chain's steps)."""
    return sum(1 for e in entries
               if e.job is not None and type(e.job.get("forkq_chain")) in (list, dict)
               and e.job["forkq_chain"])


# -- processes and running jobs ---------------------------------------------------------


@dataclass(frozen=True)
class ProcessInfo:
    identity: str
    hostname: str | None
    pid: int | None
    slot: int | None
    master: str | None
    busy: int
    concurrency: int | None
    rss_kb: int
    beat_age: float | None
    quiet: bool
    queues: list[str]
    # those of its queues it has read as paused and claims nothing from (forkq.pause)
    paused: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ProcessGroup:
    """A forkq master's children (keyed by the master's identity), or one process alone:
    a Sidekiq process, or a forkq `--no-fork` worker, has no master."""
    master: str | None
    processes: list[ProcessInfo]


def _process(hb: dict[str, Any]) -> ProcessInfo:
    info = hb["info"] if isinstance(hb["info"], dict) else {}
    def _int(name: str) -> int | None:
        value = info.get(name)
        return value if type(value) is int else None
    master = info.get("master")
    return ProcessInfo(hb["identity"], info.get("hostname"), _int("pid"), _int("slot"),
                       master if isinstance(master, str) and master else None, hb["busy"],
                       hb.get("concurrency") or _int("concurrency"), hb["rss_kb"], hb["beat_age"],
                       hb["quiet"],
                       [q for q in info.get("queues", []) if isinstance(q, str)], hb["paused"] or [])


def processes(conn: redis.Redis) -> list[ProcessGroup]:
    """Live processes (from the `processes` set), children grouped under their master and
    sorted by slot; groups sorted by master identity, lone processes after them."""
    groups: dict[str, list[ProcessInfo]] = {}
    alone: list[ProcessGroup] = []
    for proc in map(_process, control.heartbeats(conn)):
        if proc.master is None:
            alone.append(ProcessGroup(None, [proc]))
        else:
            groups.setdefault(proc.master, []).append(proc)
    out = [ProcessGroup(m, sorted(ps, key=lambda p: (p.slot is None, p.slot or 0, p.identity)))
           for m, ps in sorted(groups.items())]
    return out + sorted(alone, key=lambda g: g.processes[0].identity)


@dataclass(frozen=True)
class RunningJob:
    identity: str
    thread: str
    queue: str | None
    run_at: float | None
    job: dict[str, Any] | None
    # its latest forkq.progress(), as of its process's last heartbeat
    progress: Progress | None = None


def _running_entry(identity: str, thread: bytes, raw: bytes | str) -> RunningJob:
    """One `IDENTITY:workers` value. Sidekiq 6.4 and forkq store the payload as a JSON
    string; later Sidekiqs may store it as an object: accept both."""
    try:
        entry = payload._decode(raw)
    except ValueError:
        entry = {}
    if not isinstance(entry, dict):
        entry = {}
    job = entry.get("payload")
    if isinstance(job, str):
        try:
            job = payload.parse(job)
        except MalformedPayload:
            job = None
    # Sidekiq 8 writes run_at in milliseconds, as its payload stamps
    return RunningJob(identity, _text(thread), entry.get("queue"), stamp(entry.get("run_at")),
                      job if isinstance(job, dict) else None,
                      Progress.read(entry.get(jobprogress.FIELD)))


def running(conn: redis.Redis) -> list[RunningJob]:
    """The jobs running now, from each live process's `IDENTITY:workers` hash (falling back
    to Sidekiq 6.5+'s `IDENTITY:work` for processes that write only that one)."""
    members = sorted(_text(m) for m in conn.smembers(keys.PROCESSES))
    if not members:
        return []
    pipe = conn.pipeline(transaction=False)
    for m in members:
        pipe.hgetall(keys.workers(m))
        pipe.hgetall(keys.work(m))
    replies = pipe.execute()
    out: list[RunningJob] = []
    for i, identity in enumerate(members):
        hashes = replies[2 * i] or replies[2 * i + 1]
        out += [_running_entry(identity, t, v) for t, v in sorted(hashes.items())]
    return out


# -- sorted sets: schedule, retry, dead -------------------------------------------------


@dataclass
class Entry:
    """One member of a sorted set. `raw` is the exact member, needed to remove it (ZREM
    matches bytes); `job` is None when the member is not a job forkq can parse."""
    raw: bytes
    score: float
    job: dict[str, Any] | None = field(default=None)

    @classmethod
    def of(cls, raw: bytes, score: float) -> Self:
        try:
            job: dict[str, Any] | None = payload.parse(raw)
        except MalformedPayload:
            job = None
        return cls(raw, score, job)

    @property
    def jid(self) -> str | None:
        return self.job.get("jid") if self.job else None

    @property
    def klass(self) -> str | None:
        return payload.display_name(self.job) if self.job else None

    @property
    def queue(self) -> str | None:
        return self.job.get("queue", "default") if self.job else None

    def to_dict(self) -> dict[str, Any]:
        job = self.job or {}
        return {"score": self.score, "jid": self.jid, "class": self.klass, "queue": self.queue,
                "error_class": job.get("error_class"), "error_message": job.get("error_message"),
                "retry_count": job.get("retry_count"),
                "job": self.job if self.job is not None else _text(self.raw)}


@dataclass
class Queued(Entry):
    """A job waiting on a queue: `score` is its index from the left (the newest end) and
    `position` how many jobs were to run before it (0 runs next), both when it was read."""
    position: int = 0

    @classmethod
    def of(cls, raw: bytes, score: float, position: int = 0) -> Self:  # type: ignore[override]
        entry = super().of(raw, score)
        entry.position = position
        return entry

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "position": self.position}


Filter = Callable[[Entry], bool]


def matching(klass: str | None = None, queue: str | None = None,
             jid: str | None = None, malformed: bool = False) -> Filter:
    """A filter on class (the `wrapped` name for ActiveJob, or `class`), queue and jid;
    `malformed` keeps only what was never a runnable job: the `forkq.MalformedJob` entries
    forkq writes for payloads it could not parse, and members that do not parse at all."""
    def test(entry: Entry) -> bool:
        if entry.job is None:
            return klass is None and queue is None and jid is None
        if malformed and entry.job.get("class") != MALFORMED_CLASS:
            return False
        return ((klass is None or klass in (entry.klass, entry.job.get("class")))
                and (queue is None or entry.queue == queue)
                and (jid is None or entry.jid == jid))
    return test


class SortedSet:
    """The `schedule`, `retry` or `dead` set, read in pages by rank (lowest score first)."""

    def __init__(self, conn: redis.Redis, name: str, page_size: int = DEFAULT_PAGE) -> None:
        if name not in (keys.SCHEDULE, keys.RETRY, keys.DEAD):
            raise ValueError(f"unknown sorted set {name!r}: schedule, retry or dead")
        if page_size < 1:
            raise ValueError("page_size must be at least 1")
        self.redis = conn
        self.name = name
        self.page_size = page_size

    def size(self) -> int:
        return int(self.redis.zcard(self.name))

    def page(self, offset: int, count: int | None = None) -> list[Entry]:
        """Entries at ranks offset .. offset+count-1."""
        count = count or self.page_size
        rows = self.redis.zrange(self.name, offset, offset + count - 1, withscores=True)
        return [Entry.of(raw, score) for raw, score in rows]

    def __iter__(self) -> Iterator[Entry]:
        return self.entries()

    def entries(self, where: Filter | None = None) -> Iterator[Entry]:
        """Every entry (matching `where`) in score order, one page in memory at a time.
        Entries added or removed while iterating may be missed or seen twice, as with
        any paged read of a changing set."""
        offset = 0
        while True:
            batch = self.page(offset)
            for entry in batch:
                if where is None or where(entry):
                    yield entry
            if len(batch) < self.page_size:
                return
            offset += len(batch)

    def find(self, jid: str) -> Entry | None:
        """The first entry with this jid: a paged scan that stops at the first hit (a jid
        is not indexed; the member is the whole JSON)."""
        needle = jid.encode()
        for entry in self.entries():
            if needle in entry.raw and entry.jid == jid:
                return entry
        return None

    # -- changes --------------------------------------------------------------------

    def apply(self, action: Callable[[list[Entry]], int], where: Filter | None = None) -> int:
        """Run `action` on each page of matching entries; returns how many it changed.
        Pages are re-read after each change: entries the action removed no longer take
        ranks, so the next page starts at the ranks of the entries left behind."""
        offset = done = 0
        while True:
            batch = self.page(offset)
            if not batch:
                return done
            chosen = [e for e in batch if where is None or where(e)]
            changed = action(chosen) if chosen else 0
            done += changed
            if len(batch) < self.page_size:
                return done
            offset += len(batch) - changed

    def retry_now(self, entries: list[Entry]) -> int:
        """Move entries onto their queues now, with `enqueued_at` set, through the same
        ZREM-guarded script the scheduler uses: an entry another process moved or deleted
        meanwhile is not pushed twice. As Sidekiq does, `retry_count` goes down by one, so
        a retried job that fails again keeps the count it had (0 goes to -1). Unparseable
        entries, and entries for what was never a runnable job, stay."""
        now = time.time()
        argv: list[Any] = []
        for entry in entries:
            if entry.job is None or entry.job.get("class") == MALFORMED_CLASS:
                continue
            job = dict(entry.job)
            name = job.get("queue", "default")
            if type(name) is not str or not name or "\n" in name:
                continue
            # as Sidekiq's SortedEntry#retry: 0 becomes -1, so the next failure is 0 again
            # and a retry-now never uses up one of the job's retries
            if self.name != keys.SCHEDULE and type(job.get("retry_count")) is int:
                job["retry_count"] -= 1
            job["enqueued_at"] = now
            try:
                encoded = payload.dumps(job)
            except ValueError:  # NaN/Infinity that json.loads let in: leave it, retry the rest
                continue
            argv += [entry.raw, name, encoded]
        if not argv:
            return 0
        return int(scripts.load(self.redis, "move_due")(keys=[self.name], args=argv))

    def delete(self, entries: list[Entry]) -> int:
        """Remove entries; a unique job's lock goes with it (see _forget)."""
        if not entries:
            return 0
        return _forget(self.redis, self.name, "zset", entries)

    def kill(self, entries: list[Entry]) -> int:
        """Move entries to `dead` with the worker's script (Sidekiq's trimming: 180 days,
        9,999 entries), ending each in the same call: a unique job's lock released, a batch
        job's failure counted with fate `dead`. Entries already dead stay where they are."""
        if self.name == keys.DEAD or not entries:
            return 0
        to_dead = scripts.load(self.redis, "to_dead")
        now = time.time()
        failure = json.dumps({"error_class": "forkq.Killed", "error_message": "killed by an operator",
                              "fate": "dead", "at": now})
        pipe = self.redis.pipeline(transaction=False)
        for entry in entries:
            end: list[Any] = list(_lock(entry))
            if (in_batch := _batch_of(entry)) is not None:
                end = [end[0] if end else "", in_batch[1], in_batch[0], failure]
            to_dead(keys=[keys.DEAD, self.name],
                    args=[entry.raw, now, entry.raw, "zset", now - keys.DEAD_TIMEOUT_S,
                          keys.DEAD_MAX_JOBS, *end], client=pipe)
        return sum(int(n or 0) for n in pipe.execute())

    def clear(self) -> int:
        """Remove every entry, ending each as delete() does (a unique job's lock released,
        a batch job's failure counted with fate `deleted`); returns how many it removed.

        A page of entries at a time (CLEAR_PAGE), each page one round trip: a script
        removes the entries that have nothing to end and hands back the others, which go
        to forget.lua in the same pipeline as the next page's read. Every removal is of
        an entry read first, so one a push adds meanwhile is ended like the rest or left
        in the set, never dropped unended. A set that keeps growing is not chased forever:
        the clear stops once it has looked at twice as many entries as the set held."""
        take = scripts.load(self.redis, "clear_page")
        forget = scripts.load(self.redis, "forget")
        pipe = self.redis.pipeline(transaction=False)
        pipe.zcard(self.name)
        take(keys=[self.name], args=[CLEAR_PAGE], client=pipe)
        size, reply = pipe.execute()
        budget = 2 * int(size) + CLEAR_PAGE
        removed = 0
        while True:
            looked, plain, *rest = reply
            removed += int(plain)
            budget -= int(looked)
            if not rest:
                if int(looked) == 0 or budget <= 0:
                    return removed
                reply = take(keys=[self.name], args=[CLEAR_PAGE])
                continue
            pipe = self.redis.pipeline(transaction=False)
            entries = [Entry.of(raw, 0.0) for raw in rest]
            argv = _forget_args("zset", entries)
            if argv is None:  # "unique_for" in an error message, say: nothing to end
                pipe.zrem(self.name, *rest)
            else:
                forget(keys=[self.name], args=argv, client=pipe)
            if budget > 0:
                take(keys=[self.name], args=[CLEAR_PAGE], client=pipe)
            replies = pipe.execute()
            removed += int(replies[0])
            if budget <= 0:
                return removed
            reply = replies[1]


def _lock(entry: Entry) -> tuple[str, str] | tuple[()]:
    """(lock key, jid) of a unique job's entry, else (): what release scripts take."""
    job = entry.job
    if job is None or "unique_for" not in job:
        return ()
    lock, jid = unique.lock_of(job), job.get("jid")
    return (lock, jid) if lock is not None and type(jid) is str else ()


def _batch_of(entry: Entry) -> tuple[str, str] | None:
    """(batch key, jid) of a batch job's entry, else None."""
    job = entry.job
    if job is None or "bid" not in job:
        return None
    bid, jid = job["bid"], job.get("jid")
    return (batch.key(bid), jid) if type(bid) is str and bid and type(jid) is str else None


def _forget(conn: redis.Redis, key: str, kind: str, entries: list[Entry]) -> int:
    """Remove entries from a sorted set or a queue list, and end each one removed as a job
    leaving for good ends (scripts/forget.lua): its unique lock released (left held, it
    refused every push of the same job until its TTL ran out, though no such job was
    pending any more), and its failure counted in its batch (left uncounted, the batch
    never completed). Entries with neither take the plain ZREM or LREM."""
    argv = _forget_args(kind, entries)
    if argv is None:
        if kind == "zset":
            return int(conn.zrem(key, *[e.raw for e in entries]))
        return sum(int(conn.lrem(key, 1, e.raw)) for e in entries)
    return int(scripts.load(conn, "forget")(keys=[key], args=argv))


def _forget_args(kind: str, entries: list[Entry]) -> list[Any] | None:
    """forget.lua's arguments for `entries`, or None when none has a lock, a batch or a jid
    (an iterable job's checkpoint, forkq:iter:JID, goes with it)."""
    quads, ends = _quadruplets(entries)
    return [kind, _deleted(), *quads] if ends else None


def _near_args(entries: list[Entry]) -> list[Any]:
    """forget.lua's 'near' arguments for entries of a list, lowest index (`score`) first;
    those with nothing to end too (an LREM each would walk the list once each)."""
    quads, _ = _quadruplets(entries)
    return ["near", _deleted(), f"forkq:deleted:{uuid.uuid4().hex}", NEAR_SEARCH, len(entries),
            *(int(e.score) for e in entries), *quads]


def _deleted() -> str:
    return json.dumps({"error_class": "forkq.Deleted", "error_message": "deleted by an operator",
                       "fate": "deleted", "at": time.time()})


def _quadruplets(entries: list[Entry]) -> tuple[list[Any], bool]:
    """(member, lock key or '', jid or '', batch key or '') of each entry, flat, and whether
    any has a lock, a batch or a jid. Every jid is passed, not only those of locks and
    batches: any job may be an iterable one with a checkpoint (the payload does not say),
    and forget.lua deletes the checkpoints of the entries it removed in one DEL."""
    out: list[Any] = []
    ends = False
    for entry in entries:
        lock, in_batch = _lock(entry), _batch_of(entry)
        jid = entry.jid
        if type(jid) is not str or not payload.sendable(jid):
            jid = ""  # (one redis-py cannot send would fail the whole call)
        ends = ends or bool(lock) or in_batch is not None or jid != ""
        out += [entry.raw, lock[0] if lock else "", jid, in_batch[0] if in_batch else ""]
    return out, ends


def schedule(conn: redis.Redis, page_size: int = DEFAULT_PAGE) -> SortedSet:
    return SortedSet(conn, keys.SCHEDULE, page_size)


def retries(conn: redis.Redis, page_size: int = DEFAULT_PAGE) -> SortedSet:
    return SortedSet(conn, keys.RETRY, page_size)


def dead(conn: redis.Redis, page_size: int = DEFAULT_PAGE) -> SortedSet:
    return SortedSet(conn, keys.DEAD, page_size)


# -- crash suspects ---------------------------------------------------------------------


@dataclass
class Suspect(Entry):
    """A crash suspect: `score` is its index on the suspects list, `crashes` the deaths it
    was in flight for (forkq:crashes:ID, see fetch.crash_id; 0 once that count expired)."""
    crashes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "crashes": self.crashes}


class Suspects(_List):
    """A queue's crash suspects (read-only). Workers RPOP them, so the highest index runs
    next; pages here start from that end, as an operator asks "what runs next"."""

    def __init__(self, conn: redis.Redis, name: str) -> None:
        super().__init__(conn, name, keys.suspects(name))

    def _entry(self, raw: bytes, index: float, size: int) -> "Suspect":
        return Suspect.of(raw, index)

    def page(self, offset: int, count: int, next_first: bool = True  # type: ignore[override]
             ) -> list[Suspect]:  # (its _entry makes Suspect ones)
        """`count` suspects from `offset`, counted from the next to run (or with next_first
        False from the newest), with their crash counts: one MGET after the page."""
        out: list[Suspect] = super().page(offset, count, next_first)  # type: ignore[assignment]
        ids = [crash_id(s.raw) for s in out]  # a jid-less job's count is under its payload's SHA1
        named = [i for i in ids if i is not None]
        if named:
            counts = dict(zip(named, self.redis.mget([keys.CRASH_PREFIX + i for i in named])))
            for s, i in zip(out, ids):
                value = counts.get(i) if i is not None else None
                s.crashes = int(value) if value and value.isdigit() else 0
        return out


# -- stats ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stats:
    processed: int
    failed: int
    enqueued: int
    scheduled: int
    retries: int
    dead: int
    processes: int
    # (UTC day "YYYY-MM-DD", processed, failed), today first
    history: list[tuple[str, int, int]]
    # crash suspects of the queues in the `queues` set (not part of `enqueued`)
    suspects: int = 0
    # jobs running now, the `busy` of every heartbeat, forkq's and Ruby Sidekiq's (what
    # Sidekiq::Stats calls workers_size), and the age of queue `default`'s next job
    # (default_queue_latency), so the two sides' figures can be set side by side
    busy: int = 0
    default_latency: float = 0.0


def _days(count: int, today: datetime | None = None) -> list[str]:
    today = today or datetime.now(timezone.utc)
    return [(today - timedelta(days=i)).strftime("%Y-%m-%d") for i in range(count)]


def stats(conn: redis.Redis, days: int = 7) -> Stats:
    """Sidekiq's totals, forkq's crash suspects and the per-day counters of the last `days`
    UTC days, in two round trips (queue lengths and busy counts need the names first)."""
    first = conn.pipeline(transaction=False)
    first.smembers(keys.QUEUES)
    first.smembers(keys.PROCESSES)
    listed, members = first.execute()
    names = [_text(n) for n in listed]
    members = list(members)
    day_names = _days(max(days, 0))
    pipe = conn.pipeline(transaction=False)
    pipe.mget(keys.STAT_PROCESSED, keys.STAT_FAILED)
    pipe.lindex(keys.queue("default"), -1)
    for member in members:
        pipe.hget(member, "busy")
    for key in (keys.SCHEDULE, keys.RETRY, keys.DEAD):
        pipe.zcard(key)
    pipe.scard(keys.PROCESSES)
    for name in names:
        pipe.llen(keys.queue(name))
    for name in names:
        pipe.llen(keys.suspects(name))
    if day_names:
        pipe.mget([keys.stat_day("processed", d) for d in day_names])
        pipe.mget([keys.stat_day("failed", d) for d in day_names])
    replies = pipe.execute(raise_on_error=False)
    # a `processes` member or queue:default that is of another type (written by something
    # else) is not busy or has no latency; any other error is Redis's answer, raised as
    # execute() would
    oldest = replies[1] if not isinstance(replies[1], Exception) else None
    busy = sum(control._number(b, int) for b in replies[2:2 + len(members)]
               if not isinstance(b, Exception))
    replies = replies[:1] + replies[2 + len(members):]
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    (processed, failed), scheduled, retry, dead_, procs = replies[:5]
    lengths = replies[5:5 + len(names)]
    suspects = replies[5 + len(names):5 + 2 * len(names)]
    history: list[tuple[str, int, int]] = []
    if day_names:
        done, fails = replies[-2], replies[-1]
        history = [(d, int(p or 0), int(f or 0)) for d, p, f in zip(day_names, done, fails)]
    return Stats(int(processed or 0), int(failed or 0), sum(int(n) for n in lengths),
                 int(scheduled), int(retry), int(dead_), int(procs), history,
                 sum(int(n) for n in suspects), busy, _latency(oldest, time.time()))


# -- per-class job metrics --------------------------------------------------------------


def job_metrics(conn: redis.Redis, minutes: int = 60, klass: str | None = None,
                now: datetime | None = None) -> dict[str, Any]:
    """Per-class job metrics of the last `minutes` UTC minutes (1 to 480, this minute
    included), kept in Redis in Sidekiq 7's format by every forkq worker (and every
    Sidekiq 7): {"minutes", "until", "buckets" (HH:MM, oldest first), "bucket_ms" (the
    histogram's bounds), "classes": [{"class", "processed", "failed", "failure_pct",
    "total_ms" and "avg_ms" (successful jobs only, as Sidekiq), "p50_ms", "p95_ms" (the
    bound of the histogram bucket they fall in; None past the last bound, or for classes
    past the 20 slowest), "histogram", "series": {"processed", "failed", "ms"} one value
    per bucket}], most milliseconds first. `klass`: that class only. A round trip per 30
    minutes, and one for the histograms."""
    from . import jobmetrics
    return jobmetrics.read(conn, minutes, klass, now)
