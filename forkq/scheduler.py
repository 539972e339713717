"""The poller that moves due jobs from `schedule` and `retry` onto their queues."""

from __future__ import annotations

import math
import random
import threading
import time
from typing import Any

import redis

from . import keys, logs, payload, scripts
from .fetch import writes_refused
from .retry import MALFORMED_QUEUE, Outcomes, dead_entry_for_malformed

log = logs.get("forkq.scheduler")
BATCH = 100


class Scheduler:
    """Polls at Sidekiq's spread-out interval (average × live processes, randomised), but
    never sleeps past the earliest due job, so scheduled jobs start close to their time."""

    def __init__(self, client: redis.Redis, outcomes: Outcomes, average_interval: float = 5.0,
                 first_wait: float | None = None) -> None:
        self.redis = client
        self.outcomes = outcomes
        self.average = average_interval
        self.first_wait = first_wait
        self._move = scripts.load(client, "move_due")
        self._stop = threading.Event()
        self._bell = threading.Condition()
        # the earliest time (epoch s) a retry written by this process since the last poll
        # falls due: the poller wakes for it, where Redis's earliest was read before it
        self._due = math.inf
        self._thread = threading.Thread(target=self._run, name="forkq-scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._bell:
            self._bell.notify()
        self._thread.join(5)

    def due_at(self, at: float) -> None:
        """A job was just put in the retry set to run at `at` (epoch seconds): poll by then.

        Without this, a retry due sooner than the poller's next look (a `retry_in` hook's 0
        or a few seconds) waited for it, on average the poll interval times the live
        processes."""
        with self._bell:
            if at < self._due:
                self._due = at
                self._bell.notify()

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        with self._bell:
            while not self._stop.is_set():
                left = min(deadline - time.monotonic(), self._due - time.time())
                if left <= 0:
                    return
                self._bell.wait(left)

    def _run(self) -> None:
        first = self.first_wait if self.first_wait is not None else min(self.average, 1.0) * random.random()
        self._sleep(first)
        refused = False
        while not self._stop.is_set():
            with self._bell:
                self._due = math.inf  # this poll sees what came before; it may miss what comes after
            try:
                self.poll()
                wait = self._next_wait()
            except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                wait = self.average  # the fetcher reports the outage; just try later
            except Exception as exc:
                if not writes_refused(exc):
                    log.exception("scheduled-set poll failed")
                elif not refused:  # one line as the refusal starts, not a traceback a poll
                    log.error("scheduled-set poll refused by Redis; trying again", error=str(exc))
                refused = writes_refused(exc)
                wait = self.average
            else:
                refused = False
            self._sleep(wait)

    def poll(self, now: float | None = None) -> int:
        """Move every due job in both sets; returns how many moved."""
        moved = 0
        for key in (keys.SCHEDULE, keys.RETRY):
            while True:
                t = time.time() if now is None else now
                due = self.redis.zrange(key, "-inf", t, byscore=True, offset=0, num=BATCH)
                if not due:
                    break
                moved += self._move_batch(key, due, t)
                if len(due) < BATCH:
                    break
        return moved

    def _move_batch(self, key: str, members: list[bytes], now: float) -> int:
        argv: list[Any] = []
        for member in members:
            try:
                job = payload.parse(member)
                queue = job.get("queue", "default")
                if type(queue) is not str or not queue or "\n" in queue:
                    raise ValueError(f"payload 'queue' is {queue!r}, not a queue name")
                job["enqueued_at"] = now
                # NaN, Infinity or a lone surrogate escape parse but cannot be written back:
                # find out here, or the whole batch fails on every poll
                text = payload.dumps(job)
                text.encode("utf-8")
            except ValueError as exc:
                reason = f"in {key}: {exc}".encode("utf-8", "backslashreplace").decode()
                entry = dead_entry_for_malformed(member, MALFORMED_QUEUE, reason, now)
                self.outcomes.to_dead(entry, member, now, source=key, kind="zset")
                log.error("malformed entry moved to the dead set", source=key, reason=reason)
                continue
            argv += [member, queue, text]
        return int(self._move(keys=[key], args=argv)) if argv else 0

    def _next_wait(self) -> float:
        live = max(1, self.redis.scard(keys.PROCESSES))
        average = self.average * live
        wait = average * (random.uniform(0.5, 1.5) if live < 10 else random.random())
        pipe = self.redis.pipeline(transaction=False)
        pipe.zrange(keys.SCHEDULE, 0, 0, withscores=True)
        pipe.zrange(keys.RETRY, 0, 0, withscores=True)
        now = time.time()
        for first in pipe.execute():
            if first:
                wait = min(wait, max(0.0, first[0][1] - now) + random.uniform(0.0, 0.05))
        # average x live processes can pass what a thread wait takes (threading.TIMEOUT_MAX):
        # the OverflowError would end this thread; a poll a day costs nothing
        return min(max(wait, 0.01), 86400.0)
