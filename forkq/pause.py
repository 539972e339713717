"""Pausing a queue across every forkq process: jobs stay on it, and none is claimed.

An operator pauses a queue when what its jobs talk to is down or must not be touched (a
payment provider's outage, a migration): pushes go on, nothing is lost, and the backlog
runs once the queue is resumed. The pause lives in Redis (keys.PAUSED), so it holds for
every host, survives restarts of the workers, and applies to a process started later.

Each process reads the paused queues at its heartbeat, in the pipeline it sends anyway:
the claim path pays nothing, and a pause takes effect within one heartbeat interval. A
job a process claimed before it learned of the pause still runs; after it, none is
claimed from that queue (neither from the queue nor from its crash suspects) and a
blocking wait on it ends. The process then reports the queues it honours in its
heartbeat, which is what `wait_honoured` (and `forkq pause --wait`) watches for.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import redis

from . import control, keys


@dataclass(frozen=True)
class Pause:
    queue: str
    at: float | None
    reason: str | None
    by: str | None


def check_queue(name: Any) -> str:
    """The queue name, or a ValueError/TypeError saying why it cannot be one."""
    if not isinstance(name, str):
        raise TypeError(f"a queue name must be a str, not {type(name).__name__}")
    if not name or "\n" in name:
        raise ValueError(f"not a queue name: {name!r}")
    return name


def pause(conn: redis.Redis, queue: str, reason: str | None = None, by: str | None = None) -> bool:
    """Pause `queue` for every process; False if it was paused already (its first pause's
    time and reason are kept)."""
    record = json.dumps({"at": time.time(), "reason": reason, "by": by})
    return bool(conn.hsetnx(keys.PAUSED, check_queue(queue), record))


def resume(conn: redis.Redis, queue: str) -> bool:
    """Resume `queue`; False if it was not paused."""
    return bool(conn.hdel(keys.PAUSED, check_queue(queue)))


def paused(conn: redis.Redis) -> dict[str, Pause]:
    """Every paused queue with when, why and by whom (what parses of it)."""
    out = {}
    for name, raw in conn.hgetall(keys.PAUSED).items():
        queue = name.decode("utf-8", "replace")
        try:
            record = json.loads(raw)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            record = {}  # written by hand: still a pause, as the workers read it
        at = record.get("at")
        out[queue] = Pause(queue, float(at) if isinstance(at, (int, float)) else None,
                           _str(record.get("reason")), _str(record.get("by")))
    return out


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def working(conn: redis.Redis, queue: str) -> list[dict[str, Any]]:
    """The heartbeats of live processes that claim from `queue` (quiet ones claim nothing)."""
    return [hb for hb in control.heartbeats(conn) if not hb["quiet"]
            and isinstance(names := hb["info"].get("queues"), list) and queue in names]


def laggards(conn: redis.Redis, queue: str, want_paused: bool = True) -> list[str]:
    """Identities of live processes that work `queue` and have not yet reported honouring
    its state (paused, or with want_paused=False resumed). Not those that never read
    pauses (see blind): waiting for them would be waiting for ever."""
    return [hb["identity"] for hb in working(conn, queue)
            if hb["paused"] is not None and (queue in hb["paused"]) != want_paused]


def blind(conn: redis.Redis, queue: str) -> list[str]:
    """Identities of live processes that work `queue` and never read pauses: Ruby Sidekiq
    (forkq:paused is forkq's own) or a forkq from before pauses. They go on claiming the
    queue's jobs while it is paused."""
    return [hb["identity"] for hb in working(conn, queue) if hb["paused"] is None]


def wait_honoured(conn: redis.Redis, queue: str, timeout: float, want_paused: bool = True,
                  poll: float = 0.2) -> list[str]:
    """Wait until every live process working `queue` honours its state; returns those that
    still do not when `timeout` runs out (empty: all do)."""
    deadline = time.monotonic() + timeout
    while True:
        late = laggards(conn, queue, want_paused)
        if not late or time.monotonic() >= deadline:
            return late
        time.sleep(min(poll, max(0.0, deadline - time.monotonic())))
