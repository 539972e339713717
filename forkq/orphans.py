"""Orphan recovery: put back the jobs of forkq processes that died without a master to do it.

A child's jobs are put back by its master the moment it dies. When a whole forkq dies at
once (host power loss, a pod SIGKILLed, `kill -9` of the master and its children), its
private structures stay in Redis, registered in `forkq:owners`. Every live forkq sweeps
that registry now and then: an owner whose heartbeat is older than the recovery delay (or
gone, once the owner is older than the delay) is dead, and its jobs go back to their queues
(crash suspects to their queue's `forkq:suspects:QUEUE`). A lock with an expiry lets one
forkq sweep at a time cluster-wide. The registry is one small hash: no KEYS, no SCAN of the
database.

A recovered orphan counts as a crash for every job it had in flight, as a dead child does
(same --poison-after, same forkq.PoisonJob entry in dead): a job that takes down a whole
node (the pod OOM-killed because of it) would otherwise go from node to node forever.
Sidekiq Pro's super_fetch likewise counts every recovery against the job. Some orphans did
not crash: a process that stopped gracefully while Redis was down could not put its jobs
back or say that it stopped, and nothing in Redis tells it from one SIGKILLed. Counting
those too is accepted: each recovery only makes a job a suspect, run alone once and
cleared when it ends, so only --poison-after (3) such recoveries, each within 72 hours of
the last and with no run to its end between them, send an innocent job to dead (for an
iterable job, with no move of its checkpoint between them either: see requeue_all.lua).
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

import psutil
import redis

from . import keys, logs
from .fetch import Requeued, pid_namespace, refusal, requeue_owner_counts, writes_refused

log = logs.get("forkq.orphans")
LOCK = "forkq:orphan-lock"
_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


def _owner_info(raw: bytes) -> dict[str, Any]:
    try:
        info = json.loads(raw)
        return info if isinstance(info, dict) else {}
    except ValueError:
        return {}


def _lease(info: dict[str, Any], recovery_delay: float) -> float:
    """How long this owner may stay silent before it counts as dead: our --recovery-delay,
    but never under 3 of its own heartbeat intervals. Another forkq on the same Redis may
    beat less often than our delay; judged by our delay alone, it would lose the jobs it
    is running, and they would run twice."""
    interval = info.get("heartbeat_interval")
    if isinstance(interval, (int, float)) and not isinstance(interval, bool) and 0 < interval < 1e6:
        return max(recovery_delay, 3 * interval)
    return recovery_delay


def _master_pid(info: dict[str, Any]) -> int | None:
    """The pid of the master that owned this process (or its own pid without a master)."""
    master = info.get("master")
    if isinstance(master, str):
        parts = master.rsplit(":", 2)
        if len(parts) == 3 and parts[1].isdigit():
            return int(parts[1])
    pid = info.get("pid")
    return pid if isinstance(pid, int) else None


def _alive_here(pid: int) -> bool:
    """A forkq process with this pid runs on this host (not merely some reused pid)."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return "forkq" in " ".join(proc.cmdline())
    except psutil.AccessDenied:
        return True  # another user's process: can't tell, so not dead
    except psutil.Error:
        pass
    try:
        # /proc mounted with hidepid hides other users' processes from psutil, but a
        # signal 0 still tells a process that exists (EPERM) from one that does not
        os.kill(pid, 0)
    except PermissionError:
        return True
    except OSError:
        return False
    return False


def dead_owners(client: redis.Redis, recovery_delay: float, *, this_host_now: bool = False,
                skip: set[str] | frozenset[str] = frozenset(),
                beats_since: float = 0.0) -> list[tuple[str, list[str]]]:
    """Registered owners judged dead, with their queues.

    Dead: silent for longer than `recovery_delay` (or 3 of the owner's own heartbeat
    intervals). Silence is counted by Redis, from what is left of the owner's alive key
    (keys.alive), so no two hosts' clocks are compared; an owner without one (a forkq from
    before the key) is judged by its heartbeat's `beat`, or by when it registered if it
    never beat, against our clock. Silence before
    `beats_since` (epoch seconds: when Redis last came back from an outage or a refusal of
    writes) does not count: nobody could beat then, and an owner that beats less often than
    we waited after it would look dead. With `this_host_now`, an owner on this host whose
    master is no longer a running forkq is dead at once (a restarted forkq recovers its
    predecessor at boot).
    """
    owners = client.hgetall(keys.OWNERS)
    if not owners:
        return []
    identities = [i for i in owners if i.decode() not in skip]
    pipe = client.pipeline(transaction=False)
    for identity in identities:
        pipe.pttl(keys.alive(identity.decode()))
        pipe.hget(identity, "beat")
    replies = pipe.execute()
    now = time.time()
    host = socket.gethostname()
    here = pid_namespace()
    dead = []
    for identity, left_ms, beat in zip(identities, replies[::2], replies[1::2]):
        info = _owner_info(owners[identity])
        queues = [q for q in info.get("queues", []) if isinstance(q, str)]
        # the pid rule only where a pid names the same process for us as for the owner:
        # elsewhere a live master's pid may be free, or another process's, in our namespace
        if this_host_now and here is not None and info.get("host") == host and info.get("pidns") == here:
            # the master and the owner itself: children outlive a SIGKILLed master while
            # they finish their jobs, and those jobs must not start again beside them
            pid, own = _master_pid(info), info.get("pid")
            if (pid is not None and pid != os.getpid() and not _alive_here(pid)
                    and not (isinstance(own, int) and own != os.getpid() and _alive_here(own))):
                dead.append((identity.decode(), queues))
                continue
        if isinstance(left_ms, int) and left_ms > 0:  # PTTL: -2 no such key, -1 no expiry
            silent = keys.ALIVE_TTL_S - left_ms / 1000
        else:
            if beat is not None:
                try:
                    last = float(beat)
                except ValueError:
                    last = 0.0
            else:
                started = info.get("started_at")
                last = float(started) if isinstance(started, (int, float)) else 0.0
            silent = now - last
        if min(silent, now - beats_since) > _lease(info, recovery_delay):
            dead.append((identity.decode(), queues))
    return dead


def sweep(client: redis.Redis, recovery_delay: float, holder: str, *, this_host_now: bool = False,
          skip: set[str] | frozenset[str] = frozenset(), stall_limit: float = float("inf"),
          poison_after: int = 3, beats_since: float = 0.0) -> list[tuple[str, Requeued]] | None:
    """Recover every dead owner's jobs, if no other forkq is sweeping; [(identity, counts)].

    Each job an owner had in flight counts as in a crash (see the module's docstring): at
    `poison_after` crashes it goes to dead, otherwise it runs again alone as a suspect.

    None, recovering nothing, when taking the lock (or being refused it) and reading the
    heartbeats took longer than `stall_limit` seconds: Redis stalled (paused, swapping, a
    slow command) with our call waiting, so it could not record anyone's heartbeat either,
    and every one looks stale. The caller treats that like an outage: live processes need
    time to beat again. A stall shorter than the socket timeout raises nothing, so timing
    is the only sign.

    While Redis refuses writes (maxmemory reached, a failed save: the lock's SET is
    refused), it raises that refusal, for the caller to treat as an outage: no process can
    write its heartbeat then either. Judged by heartbeats the moment the refusal ends, live
    processes elsewhere would look dead, and the jobs they are running would run a second
    time beside them. (It used to return None, and was logged as a stall too.)"""
    started = time.monotonic()
    try:
        if not client.set(LOCK, holder, nx=True, px=30_000):
            # Another forkq sweeps. A refusal that took long is a stall all the same: two
            # masters waiting on a paused Redis, the one refused would go on to sweep a
            # moment later with every heartbeat stale and nothing noted
            return None if time.monotonic() - started > stall_limit else []
    except redis.ResponseError as exc:
        if writes_refused(exc):
            log.warning(f"Redis {refusal(exc)}, so no heartbeat is written: no process is judged "
                        "dead until they have had time to resume", error=str(exc))
        raise
    recovered = []
    try:
        dead = dead_owners(client, recovery_delay, this_host_now=this_host_now, skip=skip,
                           beats_since=beats_since)
        if time.monotonic() - started > stall_limit:
            return None
        for identity, queues in dead:
            counts = requeue_owner_counts(client, identity, queues, crashed=True, poison_after=poison_after)
            recovered.append((identity, counts))
            log.warning("recovered a dead process's jobs", owner=identity, requeued=counts.requeued,
                        suspects=counts.suspects, poisoned=counts.poisoned)
    finally:
        client.eval(_RELEASE, 1, LOCK, holder)
    return recovered


class Sweeper:
    """Turns of the orphan sweep, for whichever process runs them: a master from its loop, a
    --no-fork worker from a thread of its own (a fleet of those has no master to do it).

    Besides the interval, it keeps what tells a stale heartbeat from a dead process: when
    Redis last came back from an outage, a refusal of writes or a stall, as seen by this
    process. Nobody could beat meanwhile, so heartbeats mean something again only once Redis
    has answered for the delay plus a heartbeat (`settled`). The stray scan (strays.Scanner)
    goes by the same record, and so does any other Redis call of the same loop (note_stall)."""

    def __init__(self, holder: str, recovery_delay: float, heartbeat_interval: float,
                 poison_after: int) -> None:
        self.holder = holder  # the lock's value: the process that sweeps
        self.recovery_delay = recovery_delay
        self.heartbeat_interval = heartbeat_interval
        self.poison_after = poison_after
        # a dead forkq's jobs are back within about delay + delay/4 + one heartbeat
        self.every = max(1.0, min(recovery_delay / 4, 15.0))
        self.next_at = 0.0
        self.ok_since: float | None = None  # monotonic: Redis has answered since
        self.back_at = 0.0  # the same moment in epoch seconds, as heartbeats are written

    def turn(self, client: redis.Redis, *, boot: bool = False,
             skip: set[str] | frozenset[str] = frozenset()) -> list[tuple[str, Requeued]]:
        """Sweep if one is due (at `boot`, always); [(identity, counts)] of owners recovered.

        At boot, only owners on this host whose master is gone (a restart after a crash)
        are recovered, at once. Later, owners with stale heartbeats are, but only once
        `settled`. `skip`: identities this process answers for itself (a master's children)."""
        now = time.monotonic()
        if not boot and now < self.next_at:
            return []
        self.next_at = now + self.every
        settled = self.settled(now)
        try:
            if self.ok_since is None:
                client.ping()
                self.ok_since, self.back_at = now, time.time()
            found = sweep(client, self.recovery_delay if settled else float("inf"), self.holder,
                          this_host_now=True, skip=skip, stall_limit=self.stall_limit,
                          poison_after=self.poison_after, beats_since=self.back_at)
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
            self.ok_since = None
            return []
        except Exception as exc:
            if writes_refused(exc):
                # BUSY on a read past the lock: nobody can beat now either, so heartbeats
                # count again only once Redis has answered for a while, as after an outage
                self.ok_since = None
                return []
            log.exception("orphan sweep failed")
            return []
        if found is None:
            self.stalled("the orphan sweep")
            return []
        return found

    def settled(self, now: float) -> bool:
        """Whether Redis has answered us long enough (the delay plus a heartbeat) for stale
        heartbeats to mean dead processes: after an outage or a stall every one looks stale."""
        return (self.ok_since is not None
                and now - self.ok_since >= self.recovery_delay + self.heartbeat_interval)

    @property
    def stall_limit(self) -> float:
        return min(1.0, self.recovery_delay / 4)

    def note_stall(self, started: float, what: str) -> None:
        """After a Redis call of the same loop that succeeded: if it took long, Redis
        stalled (paused, a slow command) with it waiting, and nobody could beat meanwhile.
        The orphan sweep sees a stall by its own timing only; after one spent elsewhere it
        found Redis quick again and every heartbeat stale, and took live processes' running
        jobs for dead ones', to run twice."""
        if time.monotonic() - started > self.stall_limit:
            self.stalled(what)

    def stalled(self, what: str) -> None:
        log.warning(f"Redis stalled during {what}; no process is judged dead until "
                    "heartbeats have had time to resume")
        self.ok_since, self.back_at = time.monotonic(), time.time()
