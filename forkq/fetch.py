"""Reliable fetch: claim jobs into a private in-flight hash, acknowledge, put back.

A job moves from `queue:NAME` into `forkq:inflight:IDENTITY` inside one Lua call (several
jobs per call, as many as there are idle threads), runs, and is deleted from the hash in a
later call that also claims the next batch. When every queue is empty, one waiter thread
per queue blocks in BLMOVE, moving an arriving job into a private landing list (never into
memory alone) and waking the fetcher, so idle workers start a new job within a round trip
instead of polling.

Suspects (jobs that were in flight in a process that crashed) wait on their queue's
`forkq:suspects:QUEUE`; `claim_suspect` takes one at a time from this process's queues into
the in-flight hash, so the manager can run each alone, and deletes the crash counts of
suspects that ran to their end.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

import redis
from redis.backoff import NoBackoff
from redis.connection import AbstractConnection
from redis.retry import Retry

from . import batch, keys, logs, results, scripts, unique, wire
from .queues import QueueOrder

log = logs.get("forkq.fetch")


def pid_namespace() -> str | None:
    """This boot and PID namespace, "BOOT_ID:INODE": pids mean the same thing only to
    processes that share it. Containers with one hostname (the containers of a pod,
    hostNetwork pods on a node, `docker run --network host`) and hosts cloned with the
    same name do not; None where it cannot be read."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None


# Error replies of a Redis that answers but takes no writes for now: maxmemory reached under
# noeviction (OOM), an RDB save that failed (MISCONF), too few replicas for
# min-replicas-to-write (NOREPLICAS), a replica (READONLY) or one cut off from its primary
# (MASTERDOWN). Each passes once memory is freed, the disk or replica is back, or a failover
# ends; a write that met one is worth trying again, as after an outage. So does BUSY, which
# Redis answers to every command, reads too, while someone's script or function runs past
# busy-reply-threshold (until it ends or SCRIPT KILL): the command did not run. And NOPERM,
# an ACL user short of a command forkq needs, which lasts until the ACL is fixed, and then
# forkq carries on: as a traceback each try it flooded the log and failed every stop.
_REFUSALS = ("MISCONF ", "NOREPLICAS ", "BUSY ")


def writes_refused(exc: BaseException) -> bool:
    """Whether `exc` is Redis refusing writes (or, BUSY and NOPERM, a command) for a state
    that passes (see _REFUSALS)."""
    if isinstance(exc, (redis.exceptions.OutOfMemoryError, redis.exceptions.ReadOnlyError,
                        redis.exceptions.MasterDownError, redis.exceptions.NoPermissionError)):
        return True
    # redis-py has no classes for these: their code heads the message, after what a
    # pipeline puts in front ("Command # 1 (HSET ...) of pipeline caused error: ")
    if not isinstance(exc, redis.ResponseError):
        return False
    return str(exc).rpartition(" of pipeline caused error: ")[2].startswith(_REFUSALS)


def refusal(exc: BaseException) -> str:
    """What Redis is doing, for a log line about a refusal writes_refused accepts: BUSY
    and NOPERM refuse more than writes, and "refuses writes" sent operators to maxmemory
    and disk space for a long script or an ACL."""
    text = str(exc).rpartition(" of pipeline caused error: ")[2]
    if text.startswith("BUSY "):
        return "is busy running a script"
    if isinstance(exc, redis.exceptions.NoPermissionError):
        return "refuses a command to this ACL user"
    return "refuses writes"


# A finished job's in-flight field and its after-success actions, (key, jid) pairs flattened
# (scripts/_after.lua); () for a plain ack.
After = tuple[str, tuple[str, ...]]


class Unit(NamedTuple):
    token: str   # its field in the in-flight hash: "NUMBER\nQUEUE"
    queue: str
    raw: bytes


class ReliableFetch:
    def __init__(self, client: redis.Redis, identity: str, order: QueueOrder,
                 block_timeout: float = 2.0, master: str | None = None, direct: bool = True,
                 heartbeat_interval: float = 5.0) -> None:
        self.redis = client
        self.heartbeat_interval = heartbeat_interval
        self.identity = identity
        self.order = order
        self.block_timeout = block_timeout
        self.master = master
        self.inflight_key = keys.inflight(identity)
        self._landing_keys = {q: keys.landing(identity, q) for q in order.names}
        self.suspect_keys = {q: keys.suspects(q) for q in order.names}
        self._fetch = scripts.load(client, "fetch")
        # the claim runs on a connection of its own, past redis-py's per-command overhead
        # (forkq.wire); `direct=False` keeps redis-py's path, which may resend
        self._new_conn = wire.connection_factory(client) if direct else None
        self._conn: Any = None
        self._resend = 0 if self._new_conn is not None else 1  # the script's resend guard
        self._requeue_tokens = scripts.load(client, "requeue_tokens")
        self._release = scripts.load(client, "release")
        self._requeue_all = scripts.load(client, "requeue_all")
        self._claim_suspect = scripts.load(client, "claim_suspect")
        self._return_suspect = scripts.load(client, "return_suspect")
        self._next_token = 1
        self._acks: deque[str] = deque()
        # (token, (key, jid, ...)) of succeeded jobs with after-success actions (a unique
        # job's lock released, a batch job's success counted: scripts/_after.lua): the ack
        # and its actions are one entry, so they always go in the same call. A batch's
        # count must not be lost, and an ack sent without it would lose it for good
        self._after: deque[After] = deque()
        # the acks (plain, and with their actions) of the claim on the wire: a stop's
        # flush_acks applies them too, in case that claim is stuck (Redis frozen) and
        # reaches Redis after the final requeue, which would otherwise put those finished
        # jobs back to run again. One tuple, swapped whole, so a reader never sees half.
        self._sending: tuple[list[str], list[After]] = _NONE
        # the acks of a flush on the wire: a stopping child hands them to its master too,
        # as a stuck flush may reach Redis after the master's requeue of its hash
        self._flushing: tuple[list[str], list[After]] = _NONE
        self._flush_lock = threading.Lock()
        self.owner_json: str | None = None  # set by register(); the heartbeat re-asserts it
        # jids of suspects that ran to their end: their crash counts are deleted with the
        # next acks (only suspects ever land here, so ordinary jobs cost nothing)
        self._cleared: list[str] = []
        self._landed: set[str] = set()
        # token ranges (first, count) of fetch calls that failed: the script may have run
        # and claimed jobs whose reply never arrived (Redis went down right after it)
        self._uncertain: list[tuple[int, int]] = []

    # -- registry -------------------------------------------------------------------
    def register(self) -> frozenset[str]:
        """Record this process as an owner of private structures, before any claim; returns
        which of its queues are paused (so that not even its first claim takes from them)."""
        info = {"queues": self.order.names, "host": socket.gethostname(), "pid": os.getpid(),
                "pidns": pid_namespace(), "master": self.master, "started_at": time.time(),
                "heartbeat_interval": self.heartbeat_interval}
        self.owner_json = json.dumps(info)
        pipe = self.redis.pipeline(transaction=True)
        # the alive key first: an orphan sweep that finds this entry also finds the clock it
        # is judged by, and never falls back to started_at, written by this host's clock
        pipe.set(keys.alive(self.identity), 1, px=keys.ALIVE_TTL_S * 1000)
        pipe.hset(keys.OWNERS, self.identity, self.owner_json)
        pipe.hmget(keys.PAUSED, self.order.names)
        *written, records = pipe.execute(raise_on_error=False)
        raise_first(written)
        paused = read_paused(self.order.names, records)
        if paused is None:
            log.error(UNREADABLE_PAUSES, error=str(records))
        return paused or frozenset()

    # -- claiming -------------------------------------------------------------------
    def fetch(self, want: int) -> list[Unit]:
        """Claim up to `want` jobs and send pending acks, in one round trip."""
        if self._uncertain:
            self.recover_uncertain()
        if self._cleared:
            self.flush_acks()  # a suspect's ack and its crash count's delete go together
        after = self._take_after() if self._after else []
        acks = self._take_acks(4000)
        # a paused queue's landing list waits for its resume (Manager.queues_paused gave
        # back what it held when the pause began)
        paused = self.order.paused
        landed = [q for q in self.order.names if q in self._landed and q not in paused]
        self._landed.difference_update(landed)
        order = self.order() if want > 0 else []
        keys_ = [self.inflight_key] + [self._landing_keys[q] for q in landed]
        keys_ += [keys.queue(q) for q in order]
        first = -(-self._next_token // 10) * 10  # a multiple of ten: fetch.lua formats fewer digits
        self._next_token = first + max(want, 0)
        names = landed + order
        if after:
            tokens, actions = _split(after)
            argv: list[Any] = [want, len(acks) + len(tokens), self._resend, first,
                               len(actions) // 2, *acks, *tokens, *actions, *names]
        else:
            argv = [want, len(acks), self._resend, first, 0, *acks, *names]
        # what a stop applies without this claim (flush_acks, the master's hand-over)
        self._sending = (acks, after)
        try:
            flat = self._claim(keys_, argv)
        except Exception:
            self._sending = _NONE
            # the acks were not applied: keep them for the next call; a landing list that
            # was not drained must be drained next time too
            self._acks.extendleft(reversed(acks))
            self._after.extendleft(reversed(after))
            self._landed.update(landed)
            if want > 0:
                self._uncertain.append((first, want))
            raise
        self._sending = _NONE
        units = _units(flat, first, names)
        if landed:
            self._landed.update(_undrained(flat, want, landed))
        return units

    def _claim(self, keys_: list[str], argv: list[Any]) -> list[Any]:
        if self._new_conn is None:
            return self._fetch(keys=keys_, args=argv)
        if self._conn is None:
            self._conn = self._new_conn()
        return wire.run_script(self._conn, self._fetch.sha, self._fetch.script,
                               (len(keys_), *keys_, *argv))

    def close(self) -> None:
        if self._conn is not None:
            self._conn.disconnect()

    def claim_suspect(self) -> tuple[Unit | None, int]:
        """Send pending acks, then claim the next suspect; (the suspect or None, leftovers).

        The caller has every processor idle: whatever the in-flight hash still holds after
        the acks is held by no thread, and goes back (`leftovers`) before the claim. A call
        whose reply is lost leaves its claim under a token the next call finds as a
        leftover: back on the suspects list, then claimed again. Only this process's queues
        are claimed from, in the order it fetches them: another app's suspects are not its.
        """
        if self._uncertain:
            self.recover_uncertain()
        if self._after:
            self.flush_acks()  # acks with after-success actions go through release.lua
        acks = self._take_acks(4000)
        cleared = list(self._cleared)
        token = str(self._next_token)
        self._next_token += 1
        order = self.order()
        self._sending = (acks, [])  # as in fetch(): a stop's flush deletes them too
        try:
            flat = self._claim_suspect(
                keys=[self.inflight_key, *[self.suspect_keys[q] for q in order]],
                args=[token, len(acks), len(cleared), keys.CRASH_PREFIX, keys.SUSPECTS_PREFIX,
                      *acks, *cleared, *order])
        except Exception:
            self._sending = _NONE
            self._acks.extendleft(reversed(acks))
            raise
        self._sending = _NONE
        del self._cleared[:len(cleared)]
        leftovers = int(flat[0])
        if len(flat) == 1:
            return None, leftovers
        return Unit(flat[1].decode(), flat[2].decode(), flat[3]), leftovers

    def suspect_done(self, jid: str | None) -> None:
        """A suspect ran to its end (success or failure) without killing its process: it is
        not poison, and its crash count (named by crash_id) goes with the next acks."""
        if jid:
            self._cleared.append(jid)

    def return_suspect(self, unit: Unit) -> int:
        """Put a claimed suspect no thread started back at the head of its suspects list."""
        return int(self._return_suspect(keys=[self.inflight_key], args=[unit.token, keys.SUSPECTS_PREFIX]))

    def recover_uncertain(self) -> int:
        """Put back jobs that failed fetch calls claimed without our knowing.

        Those jobs sit in the in-flight hash under tokens only this process could have
        used, with no processor holding them: without this they would wait there until
        the process stops. Tokens the script never claimed are simply absent. A field
        names its queue as well as its token, so the fields are read, not rebuilt.
        """
        fields = sorted((f for f in self.redis.hkeys(self.inflight_key)
                         if _claimed_in(f, self._uncertain)), key=_claim_number)
        returned = 0
        for i in range(0, len(fields), 4000):
            returned += int(self._requeue_tokens(keys=[self.inflight_key], args=fields[i:i + 4000]))
        self._uncertain.clear()
        if returned:
            log.warning("jobs claimed by a fetch whose reply was lost are back on their queues",
                        count=returned)
        return returned

    def wait_for(self, queue: str, conn: redis.Redis) -> bool:
        """Block until a job arrives on `queue` (moving it into our landing list)."""
        try:
            got = conn.blmove(keys.queue(queue), self._landing_keys[queue], self.block_timeout,
                              "RIGHT", "LEFT")
        except Exception:
            # the move may have happened with its reply lost: drain the landing list anyway
            self._landed.add(queue)
            raise
        if got is not None:
            self._landed.add(queue)
            return True
        return False

    def give_back_landed(self, queue: str, conn: redis.Redis | None = None) -> int:
        """Return what a blocking wait moved into our landing list to the head of `queue`."""
        conn = conn or self.redis
        landing, dest = self._landing_keys[queue], keys.queue(queue)
        n = 0
        # the landing list is LPUSHed: moving from its left to the queue's right end leaves
        # the oldest job rightmost, first in line again
        while conn.lmove(landing, dest, "LEFT", "RIGHT") is not None:
            n += 1
        if n:
            # as the requeue scripts' keep_listed: Sidekiq's Clear may have taken the queue
            # out of `queues` meanwhile, and a job back on an unlisted queue waits unseen
            conn.sadd(keys.QUEUES, queue)
        return n

    def give_back_all_landed(self) -> int:
        return sum(self.give_back_landed(q) for q in self.order.names)

    # -- acknowledging ----------------------------------------------------------------
    def ack(self, token: str, after: tuple[str, ...] | None = None) -> None:
        """Queue a finished job's delete, and with `after` its after-success actions,
        (key, jid) pairs (a unique job's lock to release, a batch to count its success
        in); they ride along with the next fetch call, together."""
        if after is None:
            self._acks.append(token)
        else:
            self._after.append((token, after))

    def unlock_now(self, lock: str, jid: str) -> None:
        """Release a unique lock at once if it still holds `jid` (`unique_until: "start"`)."""
        self._release(keys=[self.inflight_key], args=[0, lock, jid])

    def _take_after(self, limit: int = 1000) -> list[After]:
        after = self._after
        out: list[After] = []
        while after and len(out) < limit:
            out.append(after.popleft())
        return out

    def pending_acks(self) -> int:
        return len(self._acks) + len(self._after)

    def unsent_acks(self) -> list[After]:
        """The finished jobs whose ack may not have reached Redis, each with its
        after-success actions (a stopping child hands them to its master, which applies
        them with settle_acks): those on a claim or a flush still waiting for its reply,
        and those not sent yet. A batch job's count goes with its ack, never apart: the
        master applies both in one call, and a count that also arrives with the stuck
        claim counts once (the batch removes the jid it counts)."""
        # each copied whole, under the GIL
        (sent, sent_after), (flushed, flushed_after) = self._sending, self._flushing
        return ([(t, ()) for t in sent] + sent_after + [(t, ()) for t in flushed] + flushed_after
                + [(t, ()) for t in list(self._acks)] + list(self._after))

    def _take_acks(self, limit: int) -> list[str]:
        acks = self._acks
        out: list[str] = []
        while acks and len(out) < limit:
            out.append(acks.popleft())
        return out

    def flush_acks(self) -> None:
        # One flush at a time: a stop's flush, then its requeue, must reach Redis after
        # another thread's flush that is stuck on a frozen Redis holding a batch; sent
        # beside it, the requeue could get there first and put those finished jobs back
        with self._flush_lock:
            self._flush_acks()

    def _flush_acks(self) -> None:
        sending, sending_after = self._sending
        if sending or sending_after:
            # another thread's claim is carrying these; applying them twice does no harm
            # (a lock is deleted only while it holds the jid, a count made once per jid)
            self._settle(sending, sending_after)
        while self._acks or self._cleared or self._after:
            after = self._take_after() if self._after else []
            batch = self._take_acks(4000)
            self._flushing = (batch, after)
            cleared = list(self._cleared)
            try:
                if after:
                    tokens, actions = _split(after)
                    release = [len(batch) + len(tokens), *batch, *tokens, *actions]
                if cleared:
                    pipe = self.redis.pipeline(transaction=True)
                    if after:  # in the same MULTI as the crash counts' delete
                        self._release(keys=[self.inflight_key], args=release, client=pipe)
                    elif batch:
                        pipe.hdel(self.inflight_key, *batch)
                    pipe.delete(*[keys.CRASH_PREFIX + jid for jid in cleared])
                    pipe.execute()
                elif after:
                    self._release(keys=[self.inflight_key], args=release)
                else:
                    self.redis.hdel(self.inflight_key, *batch)
            except Exception:
                self._acks.extendleft(reversed(batch))
                self._after.extendleft(reversed(after))
                raise
            finally:
                self._flushing = _NONE
            del self._cleared[:len(cleared)]

    def _settle(self, acks: list[str], after: list[After]) -> None:
        if after:
            tokens, actions = _split(after)
            self._release(keys=[self.inflight_key], args=[len(acks) + len(tokens), *acks, *tokens, *actions])
        else:
            self.redis.hdel(self.inflight_key, *acks)

    # -- putting back ---------------------------------------------------------------
    def requeue(self, units: list[Unit]) -> int:
        """Put claimed-but-unstarted jobs back at the head of their queues."""
        if not units:
            return 0
        return self._requeue_tokens(keys=[self.inflight_key], args=[u.token for u in units])

    def requeue_all(self) -> tuple[int, int]:
        """Return everything this process holds to its queues and unregister it."""
        self.flush_acks()
        return requeue_owner(self.redis, self.identity, self.order.names, script=self._requeue_all)


# A forkq:paused of another type (written by hand, say with SADD) made the registration
# raise, which ended the fetch thread for good, and every heartbeat raise past the remote
# signal it had popped. Logged instead, and no pause changes until it is fixed.
UNREADABLE_PAUSES = (f"{keys.PAUSED} cannot be read (it must be a hash, as forkq pause writes "
                     "it): no queue's pause changes here until it can")


def read_paused(names: list[str], records: Any) -> frozenset[str] | None:
    """Which of `names` are paused, from HMGET forkq:paused's reply; None for an error."""
    if isinstance(records, Exception):
        return None
    return frozenset(q for q, record in zip(names, records) if record is not None)


def raise_first(replies: list[Any]) -> None:
    """Raise the first error among a pipeline's replies (execute(raise_on_error=False))."""
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply


_NONE: tuple[list[str], list[After]] = ([], [])


def settle_acks(client: redis.Redis, identity: str, acks: list[After]) -> None:
    """Apply the acks a stopping child handed its master (unsent_acks), before the master
    puts back what its in-flight hash still holds: plain ones with HDEL, the others with
    their after-success actions in the same release.lua call, so no entry is deleted
    without its batch count or unlock. One round trip; each part is safe to apply twice
    (the child's stuck claim may land too). Raises if Redis does not take it all: the
    caller then tries again or leaves the entries to be put back, and those jobs run again
    and count then."""
    inflight = keys.inflight(identity)
    plain = [token for token, actions in acks if not actions]
    after = [(token, actions) for token, actions in acks if actions]
    pipe = client.pipeline(transaction=False)
    for i in range(0, len(plain), 4000):
        pipe.hdel(inflight, *plain[i:i + 4000])
    release = scripts.load(client, "release")
    for i in range(0, len(after), 1000):
        tokens, actions = _split(after[i:i + 1000])
        release(keys=[inflight], args=[len(tokens), *tokens, *actions], client=pipe)
    if len(pipe):
        pipe.execute()


def _split(after: list[After]) -> tuple[list[str], list[str]]:
    """Queued (token, actions) entries as the scripts take them: the tokens, and every
    action's (key, jid) flattened."""
    return [token for token, _ in after], [x for _, actions in after for x in actions]


def _units(flat: list[Any], first: int, names: list[str]) -> list[Unit]:
    """The fetch script's reply as Units: a count per key tried, then each key's jobs,
    numbered from `first`; or, from a resend that found its first run's claims, (field,
    queue, payload) triples."""
    head = flat[0]
    if head == -1:
        return [Unit(flat[i].decode(), flat[i + 1].decode(), flat[i + 2])
                for i in range(1, len(flat), 3)]
    units = []
    token = first
    got = iter(flat[1:])
    for name, count in zip(names, head):
        if count:
            for raw in next(got):
                units.append(Unit(f"{token}\n{name}", name, raw))  # the in-flight field
                token += 1
    return units


def crash_id(raw: bytes) -> str | None:
    """What the crash count of the job `raw` is kept under, named as the Lua scripts name it
    (crash_id in scripts/_entry.lua): its jid, or "sha1:" and the SHA1 of the payload for a
    job without a string jid; None for a payload that is no JSON."""
    try:
        job = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if isinstance(job, dict) and isinstance(job.get("jid"), str):
        return job["jid"]
    if isinstance(job, (dict, list)):
        return "sha1:" + hashlib.sha1(raw).hexdigest()
    return None


def _claim_number(field: bytes) -> int:
    """The token number an in-flight field starts with (-1 for a field forkq did not write)."""
    head = field.split(b"\n", 1)[0]
    return int(head) if head.isdigit() else -1


def _claimed_in(field: bytes, ranges: list[tuple[int, int]]) -> bool:
    number = _claim_number(field)
    return any(first <= number < first + count for first, count in ranges)


def _undrained(flat: list[Any], want: int, landed: list[str]) -> list[str]:
    """The landing lists a claim may have left jobs in: those it did not reach, and those
    that gave all it asked of them. Draining an empty one again on every claim cost an RPOP
    per claim (a fifth of the Redis commands per job)."""
    head = flat[0]
    if head == -1:
        return landed  # a resend's reply says nothing about them
    left = []
    asked = want
    for i, queue in enumerate(landed):
        if i >= len(head):
            left.extend(landed[i:])
            break
        got = head[i]
        if got >= asked:
            left.append(queue)
        asked -= got
    return left


class Requeued(NamedTuple):
    requeued: int   # put back to run again, suspects included
    poisoned: int   # sent to dead as forkq.PoisonJob
    suspects: int   # of `requeued`, those put on their queue's suspects list instead


def requeue_owner(client: redis.Redis, identity: str, queue_names: list[str], *,
                  crashed: bool = False, poison_after: int = 3, script: Any = None) -> tuple[int, int]:
    """Return a (possibly dead) process's private jobs to their queues; (requeued, poisoned)."""
    counts = requeue_owner_counts(client, identity, queue_names, crashed=crashed,
                                  poison_after=poison_after, script=script)
    return counts.requeued, counts.poisoned


def requeue_owner_counts(client: redis.Redis, identity: str, queue_names: list[str], *,
                         crashed: bool = False, poison_after: int = 3, script: Any = None) -> Requeued:
    """Return a (possibly dead) process's private jobs to their queues, or to their queues'
    suspects lists: after a crash (`crashed`) every job in flight is a suspect, and a job
    that still has a crash count stays one."""
    return _requeue_all(client, identity, queue_names, crashed, poison_after, script, "")


def requeue_stray(client: redis.Redis, identity: str, queue_names: list[str], *,
                  silent_left_ms: int, poison_after: int = 3) -> Requeued | None:
    """As requeue_owner_counts, without a crash, for a process that is not registered: only
    if, in the same call, it still has no owners entry and its alive key is gone or has at
    most `silent_left_ms` left (it has not beaten since). None, touching nothing, if not."""
    counts = _requeue_all(client, identity, queue_names, False, poison_after, None, silent_left_ms)
    return None if counts.requeued < 0 else counts


def _requeue_all(client: redis.Redis, identity: str, queue_names: list[str], crashed: bool,
                 poison_after: int, script: Any, guard: int | str) -> Requeued:
    script = script or scripts.load(client, "requeue_all")
    landing = [keys.landing(identity, q) for q in queue_names]
    requeued, poisoned, suspects, leavers = script(
        keys=[keys.inflight(identity), keys.OWNERS, *landing],
        args=[identity, 1 if crashed else 0, poison_after, time.time(), keys.CRASH_PREFIX,
              keys.SUSPECTS_PREFIX, guard, *queue_names])
    if leavers:
        _settle_poisoned(client, keys.inflight(identity), leavers)
    return Requeued(int(requeued), int(poisoned), int(suspects))


def _settle_poisoned(client: redis.Redis, inflight_key: str, entries: list[bytes]) -> None:
    """Do for jobs the requeue sent to dead as poison what every other way to dead does in
    the write that ends the job: release a unique job's lock (while it still holds the
    jid), keep a keep_result job's failure and count a batch job's. Lua cannot name the
    lock (a SHA-256), so this is a second round trip: should it fail, the lock lapses with
    its TTL and no failure is kept or counted, which a warning says."""
    pipe = client.pipeline(transaction=True)
    release = scripts.load(client, "release")
    for raw in entries:
        try:
            job = json.loads(raw)
        except ValueError:
            continue
        if type(job) is not dict:
            continue
        lock, jid = unique.lock_of(job), job.get("jid")
        if lock is not None and type(jid) is str:
            release(keys=[inflight_key], args=[0, lock, jid], client=pipe)
        keep = results.target(job)
        if keep is not None:
            results.queue_write(pipe, *keep, results.failure(
                "dead", "forkq.PoisonJob", str(job.get("error_message", ""))))
        if "bid" in job:
            batch.queue_failure(pipe, job, "forkq.PoisonJob", str(job.get("error_message", "")), "dead")
    if not len(pipe):
        return
    try:
        pipe.execute()
    except redis.RedisError as exc:
        log.warning("poison jobs went to dead, but their unique locks, kept failures and batch "
                    "counts were not written (the locks lapse with their TTL; their batches will "
                    "not complete)", jobs=len(entries), error=str(exc))


def owner_queues(client: redis.Redis, identity: str) -> list[str] | None:
    """The queues a registered owner fetched from, or None if it is not registered."""
    raw = client.hget(keys.OWNERS, identity)
    if raw is None:
        return None
    return json.loads(raw)["queues"]


class Waiters:
    """One thread per queue that blocks in Redis while the fetcher has nothing to claim."""

    def __init__(self, fetch: ReliableFetch, connect: Callable[[], redis.Redis],
                 wake: Callable[[], None], on_error: Callable[[BaseException], None]) -> None:
        self._fetch = fetch
        self._connect = connect
        self._wake = wake
        self._on_error = on_error
        self._armed = threading.Event()
        self._stopping = False
        self._quiet = False
        self._paused = False
        # per queue: set unless the queue is paused (pause.py); its waiter blocks on it
        # instead of in Redis, and catches nothing there
        self._open = {q: threading.Event() for q in fetch.order.names}
        for ev in self._open.values():
            ev.set()
        self._client_ids: dict[str, int | None] = {}
        self._connections: dict[str, AbstractConnection] = {}
        self._ids_refused = False  # CLIENT ID refused (an ACL without CLIENT): ask no more
        self._threads = [threading.Thread(target=self._run, args=(q,), name=f"forkq-wait-{q}",
                                          daemon=True) for q in fetch.order.names]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def arm(self) -> None:
        self._armed.set()

    def disarm(self) -> None:
        self._armed.clear()

    def quiet(self) -> None:
        """Claim nothing more: a wait already blocking puts back whatever it catches."""
        self._quiet = True
        self._armed.clear()
        self._unblock()

    def pause(self) -> None:
        """Claim nothing until resume() (while the process runs suspects alone): as quiet,
        a wait already blocking puts back whatever it catches."""
        self._paused = True
        self._armed.clear()
        self._unblock()

    def resume(self) -> None:
        self._paused = False

    def set_paused(self, paused: frozenset[str]) -> None:
        """Block on no queue in `paused`: a wait already blocking on one ends now (what it
        caught meanwhile goes back), and its waiter sleeps until the queue is resumed."""
        if self._stopping:
            return  # stop() opened every queue so that no waiter sleeps past it: keep them so
        newly = [q for q, ev in self._open.items() if q in paused and ev.is_set()]
        for q, ev in self._open.items():
            if q in paused:
                ev.clear()
            else:
                ev.set()
        if newly:
            self._unblock(newly)

    def stop(self, timeout: float) -> None:
        """Stop blocking; returns once no BLMOVE is in flight (or the timeout passed)."""
        self._stopping = True
        self._armed.set()
        for ev in self._open.values():
            ev.set()
        answered = self._unblock()
        deadline = time.monotonic() + timeout
        # A BLMOVE that reached Redis just after that unblock (sent as the stop began, or
        # on a connection still being made, whose id was not known yet) would block for
        # the whole block timeout: unblock again, while Redis answers, until every waiter
        # is back. Only a stop pays these round trips.
        while answered and (alive := [t for t in self._threads if t.is_alive()]):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            alive[0].join(min(0.02, left))
            answered = self._unblock()
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        # A wait still blocked here could not be ended early (no CLIENT, or its BLMOVE went
        # out just after the unblock) and outlives a short --timeout. Left blocked, it could
        # move a job pushed after the final requeue into a landing list nobody will look at:
        # the requeue has unregistered this process. Closing its connection makes Redis
        # drop the wait; a job it caught first is in the landing list the requeue empties.
        for t, queue in zip(self._threads, self._fetch.order.names):
            if t.is_alive() and (connection := self._connections.get(queue)) is not None:
                _shut(connection)

    def _unblock(self, queues: list[str] | None = None) -> bool:
        """End blocking waits (on `queues`, else all) now instead of at their timeout, so a
        stop takes milliseconds. False if Redis did not answer (trying again would only
        wait out more timeouts)."""
        answered = True
        ids = self._client_ids if queues is None else {q: self._client_ids.get(q) for q in queues}
        for client_id in list(ids.values()):
            if client_id is not None:
                try:
                    self._fetch.redis.client_unblock(client_id)
                except Exception:
                    answered = False  # Redis unreachable: the wait ends at its socket timeout instead
        return answered

    def _learn_id(self, queue: str, connection: AbstractConnection) -> None:
        """Run as the waiter's connection (re)connects: its id, for _unblock.

        Asked on each connect because redis-py's pool silently replaces a connection the
        server closed while it sat idle (its `timeout` setting, a restart): an id asked
        once would then name a connection that is gone, and a stop would wait out the
        BLMOVE's timeout. One connection per waiter thread: this id is the one BLMOVE
        blocks on."""
        connection.on_connect()
        self._connections[queue] = connection
        self._client_ids[queue] = None
        if self._ids_refused:
            return
        try:
            connection.send_command("CLIENT", "ID")
            self._client_ids[queue] = int(connection.read_response())
        except redis.ResponseError as exc:
            # An ACL user without CLIENT, or CLIENT renamed away: block without an id.
            # Raised, it kept the waiter from ever blocking, so an idle worker never
            # saw a new job; the cost is a stop that waits up to block_timeout.
            self._ids_refused = True
            log.warning("CLIENT ID refused: blocking waits are not ended early, so quiet and "
                        "stop wait up to the block timeout for them", error=str(exc),
                        block_timeout_s=self._fetch.block_timeout)

    def _run(self, queue: str) -> None:
        conn = self._connect()
        # No resend: redis-py sends a command again on a broken connection, and a BLMOVE
        # whose reply was lost has already moved a job. Sent again it blocks on the queue
        # and returns nothing, and the landing list it filled goes unnoticed. An error
        # instead reaches wait_for, which has the fetcher drain that list.
        conn.set_retry(Retry(NoBackoff(), 0))
        conn.connection_pool.connection_kwargs["redis_connect_func"] = functools.partial(
            self._learn_id, queue)
        refused = False
        open_ = self._open[queue]
        while True:
            self._armed.wait()
            if self._stopping:
                return
            if not open_.is_set():
                open_.wait()  # the queue is paused: set again by its resume, or by stop()
                continue
            try:
                if self._stopping or self._quiet or self._paused:
                    continue
                if self._fetch.wait_for(queue, conn):
                    if self._quiet or self._paused or not open_.is_set():
                        # a quiet (or isolating) process must not hold a job nobody will start
                        self._fetch.give_back_landed(queue, conn)
                    else:
                        self._armed.clear()
                        self._wake()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if self._stopping:
                    return  # stop() closed this connection: not an outage
                self._client_ids[queue] = None  # a new connection gets a new id
                self._on_error(exc)
                time.sleep(0.5)
                self._wake()  # the fetcher drains a landing list the lost reply left filled
            except Exception as exc:
                # OOM, READONLY after a failover...: a waiter that died here would leave
                # its queue unwatched for good, so the idle worker never saw new jobs.
                # A refusal (BUSY for a script's whole run) is one line, not one a second.
                if not (refused and writes_refused(exc)):
                    log.warning("blocking wait failed; retrying", queue=queue, error=str(exc))
                refused = writes_refused(exc)
                time.sleep(1.0)
            else:
                refused = False
            if self._stopping:
                return


def _shut(connection: AbstractConnection) -> None:
    """Shut a connection's socket from another thread: the thread reading it gets EOF and
    the server, seeing the close, drops any blocking command it holds for it."""
    sock = getattr(connection, "_sock", None)
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed
