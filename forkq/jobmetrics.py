"""Per-class job metrics in Redis, in Sidekiq 7's format: which class takes the time, which
one fails, minute by minute over the last hours, for a team without Prometheus.

Recording. Each processor thread counts the jobs it runs in its own ClassTable (no lock,
no syscall, no Redis: a dict lookup, a comparison or a bisect and two additions per job,
timed once with what `--metrics-port` counts, from the clock read the job's log lines
use). At each heartbeat the launcher sums the tables and adds what grew since its last
beat to the heartbeat's own transaction (Flusher), so the metrics cost no round trip of
their own. Reading a row while its thread bumps it is safe: each number
only grows, so a count read a moment early goes with the next beat.

Format: Sidekiq 7's (lib/sidekiq/metrics/tracking.rb, shared.rb and query.rb at tag
v7.3.9, commit bf9afa4c43d4f418cb6133bac718b5488339eacc; the same in v7.0.0), so a Sidekiq 7
Web UI's Metrics tab shows forkq's jobs and `forkq metrics` shows Sidekiq 7's. Checked
against that source, not against a running Sidekiq 7:

- one hash per UTC minute, ``j|%Y%m%d|%-H:%-M`` (``j|20260225|8:3``), fields
  ``Class|p`` (jobs run), ``Class|f`` (of them failed) and ``Class|ms`` (milliseconds of
  the jobs that succeeded: Sidekiq leaves failures' times out), by HINCRBY, 8 hours' TTL;
- one histogram of successful jobs' durations per class and minute, ``Class-%d-%H:%-M``
  (``Sleepy-05-08:3``: day and hour zero-padded, the minute not), 26 unsigned 16-bit
  counters written with BITFIELD OVERFLOW SAT INCRBY u16 #i (bucket i holds jobs shorter
  than BUCKET_MS[i] ms), 8 hours' TTL.

Sidekiq 8 moved to other names (``j|%y%m%d|%-H:%M``, ``h|Class-...``): it does not read
these. Sidekiq 6.4 ignores them.
"""

from __future__ import annotations

import math
import re
import threading
from bisect import bisect_right
from collections.abc import Iterable
from datetime import datetime, timedelta, timezone
from typing import Any

from . import logs

log = logs.get("forkq.jobmetrics")

# Sidekiq::Metrics::Histogram::BUCKET_INTERVALS without its 1e20 "Slow" bound: a job goes
# in the first bucket whose bound it is under, and past the last one in the 26th
BUCKET_MS = (20, 30, 45, 65, 100, 150, 225, 335, 500, 750, 1100, 1700, 2500, 3800, 5750,
             8500, 13000, 20000, 30000, 45000, 65000, 100000, 150000, 225000, 335000)
NB = len(BUCKET_MS) + 1
_BOUNDS_S = tuple(ms / 1000 for ms in BUCKET_MS)
TTL_S = 8 * 3600                 # Sidekiq 7's SHORT_TERM and HISTOGRAM_TTL
U16_MAX = 65535                  # a histogram counter saturates here (OVERFLOW SAT)
OTHER = "(other)"                # where one thread counts classes beyond CLASSES_MAX
# where jobs of a class this worker cannot resolve are counted (they fail as UnknownJob):
# anyone who can push names them, so under their own names junk would take a thread's
# CLASSES_MAX rows and stop its real classes being kept apart
UNKNOWN = "(unknown)"
CLASSES_MAX = 500                # classes one thread keeps apart: payloads name classes
NAME_MAX = 200                   # characters of a class name written to Redis
MINUTES_MAX = 8 * 60             # what a read may ask for: the keys live 8 hours
HISTOGRAM_CLASSES = 20           # classes a read fetches histograms for (the slowest)
READ_CHUNK = 30                  # minute hashes a read asks for in one round trip

# A row: failed, seconds of the successful jobs, then one count per histogram bucket of
# the successful ones. Processed is failed plus the buckets: one addition fewer per job.
F, S, H = 0, 1, 2


class ClassTable:
    """Counts of one processor thread, written only by that thread (hence no lock):
    class -> [failed, seconds of successes, bucket counts...], totals since it started.

    `observe(klass, queue, seconds, failed)`: one job ended (the queue is metrics.JobTable's;
    Sidekiq's format has none). A closure over the table rather than a method: it runs for
    every job, and reading its dict and bounds from cells, with no bisect for the first
    bucket (most jobs are under 20 ms), costs less than a method. Within a row the
    bucket is counted before the seconds are added: a beat reading between the two sends
    the job without its time, which goes with a later beat (Flusher._commands)."""

    __slots__ = ("rows", "observe")

    def __init__(self) -> None:
        rows: dict[str, list[Any]] = {}
        self.rows = rows
        new_row, bisect, bounds = self._new_row, bisect_right, _BOUNDS_S
        first = bounds[0]

        def observe(klass: str, queue: str, seconds: float, failed: bool) -> None:
            try:
                row = rows[klass]
            except KeyError:
                row = new_row(klass)
            if failed:
                row[0] += 1
            elif seconds < first:
                row[2] += 1
                row[1] += seconds
            else:
                row[2 + bisect(bounds, seconds)] += 1
                row[1] += seconds
        self.observe = observe

    def _new_row(self, klass: str) -> list[Any]:
        key = klass if len(self.rows) < CLASSES_MAX else OTHER
        row = self.rows.get(key)
        if row is None:
            row = [0, 0.0] + [0] * NB
            self.rows[key] = row  # one dict store: the flusher copies the dict, never half-built
        return row


def observe_both(jobs: Any, table: Any) -> Any:
    """One call per job that feeds this module's table and metrics.JobTable alike."""
    def observe(klass: str, queue: str, seconds: float, failed: bool) -> None:
        jobs(klass, queue, seconds, failed)
        table(klass, queue, seconds, failed)
    return observe


def _name(klass: Any) -> str:
    """The name a class is written under: any str, cut to NAME_MAX and sendable (JSON's
    "\\udc80" parses to a lone surrogate that UTF-8, hence redis-py, cannot carry), with
    "|" written %7C and "%" %25. Sidekiq 7's Web UI splits a field at every "|" and takes
    the first two parts (metrics/query.rb, top_jobs): class "A|p"'s field "A|p|p" would
    count as class A's runs. "%" is escaped too, so that each written name reads back as
    one class (_shown): "a|b" and a class named "a%7Cb" are written apart."""
    name = klass if type(klass) is str else repr(klass)
    name = name[:NAME_MAX]
    if "|" in name or "%" in name:
        name = name.replace("%", "%25").replace("|", "%7C")
    if not name.isascii():
        name = name.encode("utf-8", "backslashreplace").decode("utf-8")
    return name


_ESCAPED = re.compile("%(25|7C)")


def _shown(name: str) -> str:
    """A class as written, shown as its jobs name it: _name's escapes undone, in one pass
    ("%257C" is the class "%7C"). Sidekiq's fields hold no "%": shown as they are."""
    return _ESCAPED.sub(lambda m: "%" if m[1] == "25" else "|", name) if "%" in name else name


def minute_key(at: datetime) -> str:
    """Sidekiq 7's per-minute hash: j|%Y%m%d|%-H:%-M, UTC."""
    at = at.astimezone(timezone.utc)
    return f"j|{at:%Y%m%d}|{at.hour}:{at.minute}"


def histogram_key(klass: str, at: datetime) -> str:
    """Sidekiq 7's per-class, per-minute histogram: Class-%d-%H:%-M, UTC."""
    at = at.astimezone(timezone.utc)
    return f"{klass}-{at:%d-%H}:{at.minute}"


class Flusher:
    """Runs on the heartbeat's thread: adds to the beat's pipeline what grew since the last
    beat Redis took, per class, under the current UTC minute."""

    def __init__(self, tables: Iterable[ClassTable]) -> None:
        self.tables = list(tables)
        self.sent: dict[str, list[Any]] = {}
        self._pending: dict[str, list[Any]] | None = None
        self._names: dict[str, str] = {}
        self._failing = False
        # The final flush (launcher.final_flush) may run while a beat is stuck on a frozen
        # Redis: both touch the state, and after it the beats neither add nor record
        self._lock = threading.Lock()
        self._final = False

    def _totals(self) -> dict[str, list[Any]]:
        totals: dict[str, list[Any]] = {}
        names = self._names
        for table in self.tables:
            for klass, row in table.rows.copy().items():  # dict.copy() is atomic under the GIL
                name = names.get(klass)
                if name is None:
                    name = names[klass] = _name(klass)
                have = totals.get(name)
                totals[name] = list(row) if have is None else [a + b for a, b in zip(have, row)]
        return totals

    def add(self, pipe: Any, now: datetime | None = None, final: bool = False,
            stuck: bool = False) -> int:
        """Queue the writes on `pipe`; returns how many commands (their replies come first
        when called before anything else is queued). done() once the pipeline went, or
        done(None) if it did not. A fault here queues nothing and is logged: the heartbeat
        goes on without metrics.

        `final`: the final flush's (again if it is retried). From then on the beats add
        nothing, so a beat stuck at the stop that comes back sends no count twice.
        `stuck`: a beat is still running; a transaction it queued and has no answer for is
        taken as landing (Redis runs it before the final flush's, queued after it on the
        same frozen server), so the final flush sends only what came after it."""
        with self._lock:
            if self._final and not final:
                return 0
            if final and not self._final:
                self._final = True
                if stuck and self._pending is not None:
                    self.sent = self._pending
                self._pending = None
            try:
                commands = self._commands(now or datetime.now(timezone.utc))
            except Exception:
                log.exception("could not gather per-class job metrics; the heartbeat goes without")
                self._pending = None
                return 0
        for args in commands:
            pipe.execute_command(*args)
        return len(commands)

    def _commands(self, now: datetime) -> list[tuple[Any, ...]]:
        totals = self._totals()
        jkey = minute_key(now)
        out: list[tuple[Any, ...]] = []
        for name, row in totals.items():
            before = self.sent.get(name)
            if before is None:
                before = [0, 0.0] + [0] * NB
            failed = row[F] - before[F]
            counts = [a - b for a, b in zip(row[H:], before[H:])]
            processed = failed + sum(counts)
            # from the running totals, rounded each time: no drift from rounding deltas.
            # Sent whenever it grew, not only with a success of this beat: a beat that read
            # the row between a job's count and its seconds sent the job without them
            ms = round(row[S] * 1000) - round(before[S] * 1000)
            succeeded = any(counts)
            if processed > 0:
                out.append(("HINCRBY", jkey, f"{name}|p", processed))
            if failed:
                out.append(("HINCRBY", jkey, f"{name}|f", failed))
            if ms or succeeded:  # a success writes the field, 0 too, as Sidekiq's does
                out.append(("HINCRBY", jkey, f"{name}|ms", ms))
            if succeeded:
                hkey = histogram_key(name, now)
                incr = [a for i, c in enumerate(counts) if c for a in ("INCRBY", "u16", f"#{i}", c)]
                out.append(("BITFIELD", hkey, "OVERFLOW", "SAT", *incr))
                out.append(("EXPIRE", hkey, TTL_S))
        if out:
            out.append(("EXPIRE", jkey, TTL_S))
        self._pending = totals
        return out

    def done(self, replies: list[Any] | None, final: bool = False) -> None:
        """The pipeline went: what was added counts as sent, even where Redis refused it
        (a key of another type): sent again, it would be refused again, and kept, it
        would grow. One log line as refusals start, not one a beat. None: the pipeline
        did not go (its counts go with the next). `final`: the final flush's; after it, a
        beat's is ignored."""
        with self._lock:
            if self._final and not final:
                return
            if replies is None:
                self._pending = None
                return
            if self._pending is not None:
                self.sent = self._pending
                self._pending = None
        errors = [r for r in replies if isinstance(r, Exception)]
        if errors and not self._failing:
            log.error("could not write per-class job metrics (a key of another type?); "
                      "they are dropped until Redis takes them", error=str(errors[0]))
        self._failing = bool(errors)


# -- reading ----------------------------------------------------------------------------


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def quantile_ms(histogram: list[int], q: float) -> int | None:
    """The bound (ms) of the bucket that holds the q-quantile, None past the last bound
    or with nothing counted: the histogram says "under this", nothing finer."""
    total = sum(histogram)
    if not total:
        return None
    want = math.ceil(q * total)
    seen = 0
    for i, count in enumerate(histogram):
        seen += count
        if seen >= want:
            return BUCKET_MS[i] if i < len(BUCKET_MS) else None
    return None


def read(conn: Any, minutes: int = 60, klass: str | None = None,
         now: datetime | None = None, histograms: int = HISTOGRAM_CLASSES) -> dict[str, Any]:
    """Per-class totals and per-minute series over the last `minutes` UTC minutes (this
    one included), slowest class (most milliseconds) first. The minute hashes pipelined
    READ_CHUNK at a time, then the histograms of the `histograms` slowest classes (or of
    `klass`) pipelined: 2 round trips for an hour, 17 for 8 hours. Classes are named as
    their jobs name them (_name's "|" and "%" escapes undone); a field with a "|" in its
    class part (Sidekiq's, or forkq's before it escaped them) is that class's, the metric
    being the part after the last "|"."""
    if type(minutes) is not int or not 1 <= minutes <= MINUTES_MAX:
        raise ValueError(f"minutes must be a whole number from 1 to {MINUTES_MAX}, not {minutes!r}")
    if klass is not None:
        klass = _name(klass)  # as it was written: cut, and escaped where UTF-8 cannot carry it
    now = (now or datetime.now(timezone.utc)).astimezone(timezone.utc).replace(second=0, microsecond=0)
    times = [now - timedelta(minutes=i) for i in range(minutes - 1, -1, -1)]  # oldest first
    series: dict[str, dict[str, list[int]]] = {}
    # a field names the same class and metric every minute: parsed once
    fields: dict[Any, tuple[str, str] | None] = {}

    def entry(name: str) -> dict[str, list[int]]:
        got = series.get(name)
        if got is None:
            got = series[name] = {"p": [0] * minutes, "f": [0] * minutes, "ms": [0] * minutes}
        return got

    # In chunks, each folded into the series before the next is asked for: with many
    # classes, 8 hours of replies at once held hundreds of MB in the reader
    for start in range(0, minutes, READ_CHUNK):
        pipe = conn.pipeline(transaction=False)
        for t in times[start:start + READ_CHUNK]:
            if klass is None:
                pipe.hgetall(minute_key(t))
            else:
                pipe.hmget(minute_key(t), f"{klass}|p", f"{klass}|f", f"{klass}|ms")
        # a minute key of another type (not Sidekiq's, not forkq's) is a minute with nothing
        for i, reply in enumerate(pipe.execute(raise_on_error=False), start):
            if isinstance(reply, Exception):
                continue
            if klass is not None:
                if any(v is not None for v in reply):
                    e = entry(klass)
                    for metric, v in zip(("p", "f", "ms"), reply):
                        e[metric][i] += _int(v)
                continue
            for field, value in reply.items():
                parsed = fields.get(field, False)
                if parsed is False:
                    name, _, metric = _text(field).rpartition("|")
                    parsed = fields[field] = (name, metric) if name and metric in ("p", "f", "ms") else None
                if parsed is not None:
                    # (never the False of .get: replaced just above)
                    entry(parsed[0])[parsed[1]][i] += _int(value)  # type: ignore[index]
    rows: list[dict[str, Any]] = []
    written: dict[int, str] = {}  # id(row) -> its class as written, for its histogram keys
    for name, s in series.items():
        p, f, ms = sum(s["p"]), sum(s["f"]), sum(s["ms"])
        ok = p - f
        rows.append({"class": _shown(name), "processed": p, "failed": f,
                     "failure_pct": round(100 * f / p, 1) if p else 0.0,
                     "total_ms": ms, "avg_ms": round(ms / ok, 1) if ok > 0 else None,
                     "p50_ms": None, "p95_ms": None, "histogram": None,
                     "series": {"processed": s["p"], "failed": s["f"], "ms": s["ms"]}})
        written[id(rows[-1])] = name
    rows.sort(key=lambda r: (-r["total_ms"], -r["processed"], r["class"]))
    wanted = [r for r in rows[:histograms] if r["processed"] > r["failed"]]
    if wanted:
        pipe = conn.pipeline(transaction=False)
        asked = []
        for r in wanted:
            for i, t in enumerate(times):
                if r["series"]["processed"][i] > r["series"]["failed"][i]:
                    get = [a for b in range(NB) for a in ("GET", "u16", f"#{b}")]
                    pipe.execute_command("BITFIELD_RO", histogram_key(written[id(r)], t), *get)
                    asked.append(r)
        for r, reply in zip(asked, pipe.execute(raise_on_error=False)):
            if isinstance(reply, Exception):
                continue  # a key of another type under that name: no histogram from it
            if r["histogram"] is None:
                r["histogram"] = [0] * NB
            r["histogram"] = [a + _int(b) for a, b in zip(r["histogram"], reply)]
        for r in wanted:
            if r["histogram"] is not None:
                r["p50_ms"] = quantile_ms(r["histogram"], 0.5)
                r["p95_ms"] = quantile_ms(r["histogram"], 0.95)
    return {"minutes": minutes, "until": now.isoformat(),
            "buckets": [f"{t:%H:%M}" for t in times], "bucket_ms": list(BUCKET_MS),
            "classes": rows}
