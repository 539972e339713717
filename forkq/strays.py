"""Stray recovery: put back jobs from private structures that no registered owner holds.

forkq finds every in-flight hash and landing list through `forkq:owners` (orphans.py, the
master's requeue of a dead child). Once a process has been put back and unregistered,
anything written afterwards in its name is looked at by nobody, and its jobs wait for good:
- a claim or a blocking wait (BLMOVE) stuck in the network, which Linux keeps
  retransmitting even after the process was SIGKILLed, reaches Redis after its master or
  orphan recovery swept the process on a fresh connection (under --no-fork: after the
  process's own final requeue);
- an owners entry deleted by hand, an RDB restored beside a newer registry, a bug.

So, now and then, a master (or a --no-fork worker, which has none) walks the keyspace with
a COUNT-limited SCAN for in-flight hashes and landing lists, one slice per call of `step`,
and puts back the jobs of those whose identity has no owners entry. Sidekiq Pro's
super_fetch does the same kind of look for the private queues of processes that are gone,
about once an hour. One slice at a time cluster-wide (a lock with an expiry); the cursor is
kept in Redis, so whichever process takes the next slice goes on where the last one
stopped; the next pass starts `interval` seconds after one ends (an expiring key: Redis's
clock, not a host's).

Which structures are taken (never a live process's):
- A registered process's, never: a live process registers (alive key, then owners entry,
  in one transaction) before its first claim, and every heartbeat registers it again.
- A live process that orphan recovery swept while it was silent (a long GC pause, a frozen
  VM: "the delay is a lease" in the README) has no owners entry until its next beat, and
  its threads may be running what its hash holds. So an identity seen unregistered is only
  noted, with the time by Redis's clock; its structures are put back at a later slice, at
  least `wait` after it was first seen, and only if, checked inside the requeue script
  itself (fetch.requeue_stray), it is still unregistered and its alive key is gone or has
  not been renewed within `wait`. `wait` is the recovery delay, or 3 heartbeat intervals
  of any registered owner if that is longer, as orphan recovery judges silence. A process
  that beats in that time is registered again and keeps everything; one that did not beat
  for that long after having been swept has been silent for more than the lease twice over,
  and orphan recovery would take its jobs too. Slices taken while Redis has not answered
  for the delay plus a heartbeat (`confirm=False`: after an outage nobody could beat) note
  but take nothing.

Jobs put back this way are not counted as crash suspects. What this backstop exists for,
a claim or a blocking wait that landed after the sweep, brings jobs that no thread ever
started: a crash count would be false, and would make each of them run alone. A structure
left some other way (by hand, a restore, a bug) may hold a job that did kill its process;
that job runs again normally, and if it kills again its master counts that death, so
--poison-after stops it at most one death later. A job that already has a crash count
still goes back onto its queue's suspects list (requeue_all.lua).
"""

from __future__ import annotations

import json
import math
import re
import time
from typing import Any, NamedTuple

import redis

from . import keys, logs
from .fetch import Requeued, refusal, requeue_stray, writes_refused
from .orphans import Sweeper, _lease, _owner_info

log = logs.get("forkq.strays")

# Only in-flight hashes and landing lists start so (see keys.py): other forkq keys, say a
# crash count per suspect, can be many, and are never sent back to the client.
PATTERN = "forkq:[il]*"
SCAN_COUNT = 1000
# Measured over 1,000,000 other keys: a SCAN of COUNT 1000 keeps Redis about 0.6 ms, a
# whole pass 0.6 s of its time (1.4 s when the machine was busy). Every 10 minutes that is
# 0.1% of a core, and a stray job waits at most 10 minutes, plus up to two passes, plus `wait`.
INTERVAL_S = 600.0
# A slice stops after the SCAN call that passes this long, or this many calls: the master's
# loop (reaping and requeueing dead children) waits while it runs. At one slice a second, a
# pass over 1,000,000 keys took 70 to 155 slices (12 to 34 ms for the longest).
SLICE_S = 0.01
SLICE_CALLS = 50
# At most this many noted identities are taken in one slice; more wait for the next.
TAKES_PER_SLICE = 100
LOCK_PX = 30_000
# While a pass is under way, a slice is scanned this often (each about SLICE_S long)
SLICE_EVERY_S = 1.0
_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
_INFLIGHT = keys.inflight("").encode()
_LANDING = re.compile(rb"forkq:landing:(.+?:\d+:[0-9a-f]{12}):(.+)\Z", re.S)


class Slice(NamedTuple):
    scanning: bool    # a pass is under way: the next slice is due soon
    calls: int        # SCAN calls this slice made
    found: int        # in-flight hashes and landing lists they returned
    recovered: list[tuple[str, Requeued]]  # identities whose structures were put back


def step(client: redis.Redis, holder: str, recovery_delay: float, *,
         interval: float = INTERVAL_S, count: int = SCAN_COUNT, budget_s: float = SLICE_S,
         max_calls: int = SLICE_CALLS, confirm: bool = True, poison_after: int = 3) -> Slice | None:
    """Scan the next slice of the keyspace (if a pass is due or under way), note the
    identities of unregistered structures it finds, and put back those noted at least
    `wait` ago that are still unregistered and silent (see the module's docstring).

    None when another master holds the slice lock, or Redis refuses writes (its lock
    could not be set)."""
    try:
        if not client.set(keys.STRAYS_LOCK, holder, nx=True, px=LOCK_PX):
            return None
    except redis.ResponseError as exc:
        if writes_refused(exc):
            return None
        raise
    try:
        pipe = client.pipeline(transaction=False)
        pipe.time()
        pipe.get(keys.STRAYS_CURSOR)
        pipe.exists(keys.STRAYS_REST)
        pipe.hlen(keys.STRAYS_SEEN)
        (seconds, micros), cursor, resting, noted = pipe.execute()
        now_ms = seconds * 1000 + micros // 1000
        if cursor is None and not resting:
            cursor = b"0"  # a new pass
        calls, found, scanning = 0, 0, False
        if cursor is not None:
            position = int(cursor) if cursor.isdigit() else 0  # not ours: start the pass again
            structures: dict[str, set[str]] = {}
            started = time.monotonic()
            while True:
                position, batch = client.scan(position, match=PATTERN, count=count)
                calls += 1
                found += _collect(batch, structures)
                if position == 0 or calls >= max_calls or time.monotonic() - started >= budget_s:
                    break
            pipe = client.pipeline(transaction=True)
            if position == 0:
                pipe.delete(keys.STRAYS_CURSOR)
                if interval > 0:
                    pipe.set(keys.STRAYS_REST, holder, px=max(1, int(interval * 1000)))
            else:
                pipe.set(keys.STRAYS_CURSOR, position)
            pipe.execute()
            scanning = position != 0
            if structures:
                noted += _note(client, structures, now_ms)
        recovered = []
        if confirm and noted:
            recovered = _take(client, now_ms, recovery_delay, poison_after)
        return Slice(scanning, calls, found, recovered)
    finally:
        client.eval(_RELEASE, 1, keys.STRAYS_LOCK, holder)


def _collect(batch: list[bytes], structures: dict[str, set[str]]) -> int:
    """Add the identities of the in-flight hashes and landing lists in `batch` (with each
    landing list's queue) to `structures`; how many of the keys were such."""
    n = 0
    for key in batch:
        try:
            if key.startswith(_INFLIGHT):
                structures.setdefault(key[len(_INFLIGHT):].decode(), set())
            elif match := _LANDING.match(key):
                structures.setdefault(match[1].decode(), set()).add(match[2].decode())
            else:
                continue  # a key of another kind that happens to match, or of a foreign form
        except UnicodeDecodeError:
            continue  # forkq writes no such name
        n += 1
    return n


def _note(client: redis.Redis, structures: dict[str, set[str]], now_ms: int) -> int:
    """Note the identities in `structures` that have no owners entry (keeping the first
    time each was seen, adding queues of landing lists found since); forget registered
    ones noted before. How many were noted afresh."""
    identities = list(structures)
    pipe = client.pipeline(transaction=False)
    for identity in identities:
        pipe.hexists(keys.OWNERS, identity)
    pipe.hmget(keys.STRAYS_SEEN, identities)
    *registered, before = pipe.execute()
    pipe = client.pipeline(transaction=False)
    fresh = 0
    for identity, owned, raw in zip(identities, registered, before):
        if owned:
            if raw is not None:
                pipe.hdel(keys.STRAYS_SEEN, identity)
            continue
        record = _record(raw) if raw is not None else None
        if record is None:
            record = {"at": now_ms, "queues": []}
            fresh += 1
        queues = sorted(set(record["queues"]) | structures[identity])
        if raw is None or queues != record["queues"]:
            pipe.hset(keys.STRAYS_SEEN, identity, json.dumps({"at": record["at"], "queues": queues}))
    pipe.execute()
    return fresh


def _record(raw: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    if (not isinstance(record, dict) or not isinstance(record.get("at"), int)
            or not isinstance(record.get("queues"), list)
            or not all(isinstance(q, str) for q in record["queues"])):
        return None
    return record


def _take(client: redis.Redis, now_ms: int, recovery_delay: float,
          poison_after: int) -> list[tuple[str, Requeued]]:
    """Put back the structures of identities noted at least `wait` ago that are still
    unregistered and silent; forget those that are not (they beat again: alive)."""
    noted = client.hgetall(keys.STRAYS_SEEN)
    if not noted:
        return []
    # as orphan recovery judges silence: our delay, or 3 heartbeats of a slower forkq
    wait_s = max([recovery_delay, *(_lease(_owner_info(v), recovery_delay)
                                    for v in client.hvals(keys.OWNERS))])
    if not math.isfinite(wait_s):
        return []
    wait_ms = int(wait_s * 1000)
    recovered = []
    taken = 0
    for raw_identity, raw in noted.items():
        identity = raw_identity.decode()
        record = _record(raw)
        if record is None:
            client.hdel(keys.STRAYS_SEEN, identity)
            continue
        if now_ms - record["at"] < wait_ms or taken >= TAKES_PER_SLICE:
            continue
        taken += 1
        try:
            counts = requeue_stray(client, identity, record["queues"], poison_after=poison_after,
                                   silent_left_ms=max(0, keys.ALIVE_TTL_S * 1000 - wait_ms))
        except redis.ResponseError as exc:
            if writes_refused(exc):
                raise
            # a key of the wrong type under a private name (WRONGTYPE): forgotten until the
            # next pass, so it does not stand in front of the others at every slice
            client.hdel(keys.STRAYS_SEEN, identity)
            log.warning("cannot put back a stray's jobs", identity=identity, error=str(exc))
            continue
        client.hdel(keys.STRAYS_SEEN, identity)
        if counts is None:
            continue  # registered again, or beat since: a live process keeps its jobs
        if counts.requeued or counts.poisoned:
            log.warning("put back jobs from private structures no registered process held",
                        identity=identity, landing_queues=record["queues"], requeued=counts.requeued,
                        suspects=counts.suspects, poisoned=counts.poisoned,
                        unregistered_for_s=round((now_ms - record["at"]) / 1000))
        recovered.append((identity, counts))
    return recovered


class Scanner:
    """Turns of the stray scan for whichever process runs them (a master's loop, a --no-fork
    worker's sweep thread): a slice a second while a pass is under way, else a look every
    sweep interval whether one is due or something noted can be taken. It goes by the orphan
    sweeper's record of Redis's health, and adds to it what it meets."""

    def __init__(self, sweeper: Sweeper) -> None:
        self.sweeper = sweeper
        self.next_at = 0.0
        self._refused = False  # warned that Redis refuses what stray recovery needs

    def turn(self, client: redis.Redis) -> list[tuple[str, Requeued]]:
        """Take a slice if one is due; [(identity, counts)] of structures put back."""
        now = time.monotonic()
        sweeper = self.sweeper
        # Not while the orphan sweep finds Redis unreachable: each call here would wait out
        # the socket timeout again on the same outage, and the caller's loop (a master's
        # signals, reaping, stop deadline) would turn once per two timeouts instead of one
        if now < self.next_at or sweeper.ok_since is None:
            return []
        self.next_at = now + sweeper.every
        try:
            # as for orphans: after an outage nobody could beat, so a live process swept while
            # silent may not have registered again yet
            done = step(client, sweeper.holder, sweeper.recovery_delay, confirm=sweeper.settled(now),
                        poison_after=sweeper.poison_after)
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
            # noted here as the orphan sweep notes it: met here, an outage that had ended by
            # the sweep's next turn left every heartbeat stale and the sweep none the wiser
            sweeper.ok_since = None
            return []
        except redis.ResponseError as exc:
            if writes_refused(exc):
                sweeper.ok_since = None  # nobody can beat either (see Sweeper.turn)
            # SCAN or EVALSHA refused to an ACL user or renamed away, a busy script: one line
            # while it lasts, not one a look
            if not self._refused:
                why = f"Redis {refusal(exc)}" if writes_refused(exc) else "Redis refused a command"
                log.warning(f"stray recovery cannot run: {why}; jobs in private structures no "
                            "registered process holds are not put back meanwhile", error=str(exc))
                self._refused = True
            return []
        except Exception:
            log.exception("stray recovery failed")
            return []
        self._refused = False
        sweeper.note_stall(now, "stray recovery")
        if done is None:
            return []
        if done.scanning:
            self.next_at = now + SLICE_EVERY_S
        return done.recovered
