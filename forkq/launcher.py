"""The Launcher: heartbeat (Sidekiq-compatible), stats flush and remote signals.

Each heartbeat also reads the lengths of its queues' suspects lists, so the manager learns
that crash suspects wait to be run alone without a Redis command per job. Only its own
queues': another app's suspects on the same Redis are none of its business.

And, while jobs run, it looks their jids up in forkq:cancel (one HMGET in the same
pipeline): a job an operator cancelled is interrupted within a heartbeat (Processor.cancel)."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import psutil
import redis

from . import jobmetrics, jobprogress, keys, logs, scripts
from .fetch import UNREADABLE_PAUSES, raise_first, read_paused, refusal, writes_refused
from .manager import REDIS_ERRORS, Manager
from .payload import sendable
from .retry import cancel_request

log = logs.get("forkq.launcher")
UNREADABLE_CANCELS = (f"{keys.CANCEL} cannot be read (it must be a hash, as forkq cancel writes "
                      "it): no running job is cancelled here until it can")
REMOTE_SIGNALS = {"TSTP": signal.SIGTSTP, "TERM": signal.SIGTERM, "TTIN": signal.SIGTTIN,
                  "USR1": signal.SIGTSTP, "INT": signal.SIGINT}


def new_identity() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{os.urandom(6).hex()}"


def _work_entry(cur: tuple[str, bytes, float, Any, str], progress: Any) -> bytes:
    """A running job's value in the work hash: Sidekiq's queue, payload and run_at, and its
    latest forkq.progress() (a key Sidekiq ignores) if it made one. The jid check: a
    progress the thread's last job recorded is not this one's (jobprogress.progress)."""
    q, raw, at, jid, _ = cur
    entry = {"queue": q, "payload": raw.decode("utf-8", "replace"), "run_at": int(at)}
    if progress is not None:
        try:
            if progress[0] == jid:
                entry[jobprogress.FIELD] = jobprogress.entry(progress)
                return json.dumps(entry).encode()
        except Exception:
            # forkq.progress() stores only plain values; were anything to slip through,
            # the job's entry goes without it: a raise here would fail the whole beat
            entry.pop(jobprogress.FIELD, None)
    return json.dumps(entry).encode()


class Launcher:
    def __init__(self, client: redis.Redis, identity: str, manager: Manager, info: dict[str, Any],
                 on_signal: Callable[[int], None], interval: float = 5.0) -> None:
        self.redis = client
        self.identity = identity
        self.manager = manager
        self.info = dict(info, identity=identity, hostname=socket.gethostname(), pid=os.getpid(),
                         started_at=time.time())
        self.info_json = json.dumps(self.info)
        concurrency = self.info.get("concurrency")
        self._concurrency = concurrency if type(concurrency) is int else 0
        self.on_signal = on_signal
        self.interval = interval
        self._flushed = (0, 0)
        self._proc = psutil.Process()
        # per-class job metrics (jobmetrics.py), flushed in each beat's own transaction
        self.jobs = jobmetrics.Flusher(p.jobs for p in manager.processors)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="forkq-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def beat_soon(self) -> None:
        """Write the next heartbeat now (e.g. to show quiet at once)."""
        self._stop.set()

    def stop(self) -> None:
        """End the heartbeat thread; final_flush() then writes what it would have."""
        self._stopping = True
        self._stop.set()
        self._thread.join(5)

    def final_flush(self) -> None:
        """The last stats, leave `processes`, drop the running-jobs hash (one try)."""
        pipe = self.redis.pipeline(transaction=True)
        stuck = self._thread.is_alive()
        n = self.jobs.add(pipe, final=True, stuck=stuck)
        gone = [keys.workers(self.identity), keys.work(self.identity)]
        if stuck:
            # a beat the stop could not wait for (stuck on a frozen Redis) may land after
            # this: the flushed totals stay a minute, or finding them gone it would add its
            # jobs again (the master, finding them, adds only what a later ping shows)
            self._stats(pipe, keys.HEARTBEAT_TTL_S)
        else:
            self._stats(pipe)
            gone.append(keys.flushed(self.identity))  # nothing of a stopped process stays
        pipe.srem(keys.PROCESSES, self.identity)
        pipe.unlink(*gone)
        result = pipe.execute(raise_on_error=False)
        self.jobs.done(result[:n], final=True)
        raise_first(result[n:])  # the metrics' refusals are theirs alone
        self._flushed = self._pending

    _stopping = False
    _pending = (0, 0)
    _refused = False  # the last beat met fetch.writes_refused
    _pauses_unreadable = False  # the last beat could not read forkq:paused
    _cancels_unreadable = False  # the last beat could not read forkq:cancel

    def _run(self) -> None:
        while True:
            try:
                self.beat()
                # Redis answers: what counts outages (see Manager.write) must know it, also
                # while a quiet process has no claims to tell it
                self.manager.health.ok()
            except REDIS_ERRORS:
                pass  # the fetcher logs the outage; the heartbeat comes back by itself
            except Exception as exc:
                if not writes_refused(exc):
                    log.exception("heartbeat failed")
                elif not self._refused:  # one line as the refusal starts, not a traceback a beat
                    log.error(f"Redis {refusal(exc)}: no heartbeat until that passes",
                              error=str(exc))
                self._refused = writes_refused(exc)
            else:
                self._refused = False
            self._stop.wait(self.interval)
            # cleared before the look: a stop() landing between a look and the clear would
            # be erased, and the thread would beat again and sleep a whole interval past it
            self._stop.clear()
            if self._stopping:
                return

    def _stats(self, pipe: Any, keep_s: int = keys.FLUSHED_TTL_S) -> None:
        processed, failed = self.manager.counts()
        self._pending = (processed, failed)
        # Totals, not deltas, and the script adds only what goes beyond the totals flushed
        # before: a beat whose reply was lost (sent again by redis-py, or followed by the
        # next beat with the same jobs) is counted once, and so are jobs that the master
        # counted after this process died (Supervisor.count_unflushed) when a beat sent
        # before the death lands after it. EVAL with the body, not EVALSHA: in a transaction
        # a NOSCRIPT could not be answered by sending the body instead.
        pipe.eval(scripts.source("flush_stats"), 5,
                  *keys.flush_stats(self.identity, datetime.now(timezone.utc).strftime("%Y-%m-%d")),
                  processed, failed, *self._flushed, keep_s, keys.STAT_DAY_TTL_S)

    _last_cleanup = 0.0

    def prune_processes(self) -> int:
        """Drop `processes` members whose heartbeat expired, at most once a minute
        cluster-wide (Sidekiq's rule), so dashboards don't list the dead."""
        if not self.redis.set(keys.PROCESS_CLEANUP, 1, nx=True, ex=60):
            return 0
        members = list(self.redis.smembers(keys.PROCESSES))
        if not members:
            return 0
        pipe = self.redis.pipeline(transaction=False)
        for m in members:
            pipe.exists(m)
        gone = [m for m, alive in zip(members, pipe.execute()) if not alive]
        if gone:
            self.redis.srem(keys.PROCESSES, *gone)
        return len(gone)

    def beat(self) -> None:
        now = time.monotonic()
        if now - self._last_cleanup >= 60:
            self._last_cleanup = now
            self.prune_processes()
        started = time.perf_counter()
        self.redis.ping()
        rtt_us = int((time.perf_counter() - started) * 1_000_000)
        running = self.manager.running()
        pipe = self.redis.pipeline(transaction=True)
        # first in the transaction, so their replies are the first n: the rest is read
        # from the end, and their errors (a key of another type) fail nothing else
        n = self.jobs.add(pipe)
        self._stats(pipe)
        # Both Sidekiq's names for the running jobs (6.4's and 6.5+'s), sent once and
        # copied in Redis (COPY keeps the expiry): a payload can be tens of MB, and each
        # copy of it built here lives until the pipeline is sent, at every beat while the
        # job runs. Built twice, a 50 MB job raised its child's peak RSS by some 250 MB.
        workers, work = keys.workers(self.identity), keys.work(self.identity)
        pipe.unlink(workers, work)
        if running:
            processors = self.manager.processors
            pipe.hset(workers, mapping={str(idx): _work_entry(cur, processors[idx].progress)
                                        for idx, cur in running})
            pipe.expire(workers, keys.HEARTBEAT_TTL_S)
            pipe.copy(workers, work)
        owner = self.manager.fetch.owner_json
        if owner is not None and not self._stopping:
            # re-assert the owners entry: if an orphan sweep ever took this live process
            # for dead (a Redis outage longer than its delay), the next beat registers it again
            pipe.hset(keys.OWNERS, self.identity, owner)
            pipe.set(keys.alive(self.identity), 1, px=keys.ALIVE_TTL_S * 1000)
        pipe.sadd(keys.PROCESSES, self.identity)
        pipe.exists(self.identity)
        reported = self.manager.fetch.order.paused
        pipe.hset(self.identity, mapping={
            "info": self.info_json, "busy": len(running), "beat": time.time(), "rtt_us": rtt_us,
            "quiet": "true" if self.manager.quiet_flag else "false",
            "rss": self._proc.memory_info().rss // 1024,
            # Sidekiq 8.1.2+ reads a process's thread count from this field, not from info:
            # without it its Web UI shows forkq with 0 threads and 0% utilisation
            "concurrency": self._concurrency,
            # the paused queues this process claims nothing from (pause.wait_honoured)
            "forkq_paused": json.dumps(sorted(reported))})
        pipe.expire(self.identity, keys.HEARTBEAT_TTL_S)
        # the running jobs' cancel requests, by the jid kept beside each payload (none parsed);
        # a jid redis-py cannot send would fail the whole beat, and no request can name it
        asked = [(idx, cur) for idx, cur in running if type(cur[3]) is str and sendable(cur[3])]
        if asked:
            pipe.hmget(keys.CANCEL, [cur[3] for _, cur in asked])
        suspects = self.manager.fetch.suspect_keys
        for key in suspects.values():
            pipe.llen(key)
        names = list(suspects)
        pipe.hmget(keys.PAUSED, names)
        pipe.rpop(keys.signals(self.identity))
        try:
            result = pipe.execute(raise_on_error=False)
        except BaseException:
            self.jobs.done(None)  # their counts go with the next beat
            raise
        self.jobs.done(result[:n])
        del result[:n]
        if asked:
            # before any error of the others is raised: a cancel is not held up by them
            requests = result.pop(-3 - len(names))
            try:
                self._cancel(asked, requests)
            except Exception:  # a fault here must not lose the signal popped below
                log.exception("could not act on cancel requests")
        raise_first(result[:-2] + result[-1:])  # all but forkq:paused's read (UNREADABLE_PAUSES)
        self._flushed = self._pending
        paused = read_paused(names, result[-2])
        if paused is None:
            if not self._pauses_unreadable:  # one line as it starts, not one a beat
                log.error(UNREADABLE_PAUSES, error=str(result[-2]))
            paused = self.manager.fetch.order.paused
        self._pauses_unreadable = isinstance(result[-2], Exception)
        try:
            self.manager.queues_paused(paused)
            if (honoured := self.manager.fetch.order.paused) != reported:
                # report at once which pauses it honours now: `forkq pause` may be waiting.
                # Also when the registration, not this beat, switched since `reported` was
                # read: left to the next beat, a new process said it honoured no pause for
                # a whole interval, and `forkq pause --wait` waited that long for it
                self.redis.hset(self.identity, "forkq_paused", json.dumps(sorted(honoured)))
        finally:
            # acted on even if the switch's writes failed: the RPOP above has taken the
            # signal off its list, and raised past, it was lost
            self._after_beat(result, names, paused)

    def _cancel(self, asked: list[tuple[int, Any]], requests: Any) -> None:
        """Interrupt each running job that HMGET forkq:cancel found a request for."""
        if isinstance(requests, Exception):  # WRONGTYPE: a hand-made key of another type
            if not self._cancels_unreadable:  # one line as it starts, not one a beat
                log.error(UNREADABLE_CANCELS, error=str(requests))
            self._cancels_unreadable = True
            return
        self._cancels_unreadable = False
        processors = self.manager.processors
        for (idx, cur), request in zip(asked, requests):
            if request is not None and processors[idx].cancel(cur, request):
                by, reason = cancel_request(request)
                log.info("cancelling a running job", jid=cur[3], by=by, reason=reason)

    def _after_beat(self, result: list[Any], names: list[str], paused: frozenset[str]) -> None:
        # jobs a crash made suspects: the manager runs them one at a time, each alone;
        # a paused queue's wait until it is resumed
        counts = result[-2 - len(names):-2]
        self.manager.suspects_seen(sum(int(n or 0) for q, n in zip(names, counts) if q not in paused))
        sig = result[-1]
        if sig:
            # whatever a client pushed there: bytes that are not UTF-8 are an unknown
            # signal like any other, not an error in the heartbeat
            name = sig.decode("utf-8", "backslashreplace") if isinstance(sig, bytes) else str(sig)
            signum = REMOTE_SIGNALS.get(name)
            if signum is None:
                log.warning("ignoring unknown remote signal", signal=name)
            else:
                log.info("remote signal", signal=name)
                self.on_signal(signum)
