"""Prometheus metrics (`--metrics-port`): counted in the children, served by the master.

A child counts the jobs it runs in plain per-thread tables (no lock, no syscall, no Redis
on the hot path) and, once a second with its ping, sends what changed since the last
send to its master as "M" lines on the report pipe it already has. Deltas, not totals:
the master adds them up, so its counters only ever grow, across child deaths and
respawns, and a child that dies loses at most its last unsent second.

The master keeps those sums next to what it knows itself (children, busy threads, RSS,
restarts, requeues, poison jobs) and answers `GET /metrics` from its own select loop:
no thread in the master, so nothing of an HTTP server is half-held when it forks. Queue
sizes, latencies and crash suspects are read from Redis at scrape time, in one round trip
with a short timeout; when Redis does not answer, the scrape leaves them out for a while
and answers with the rest.
"""

from __future__ import annotations

import json
import os
import select
import socket
import time
from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import logs

if TYPE_CHECKING:
    from .supervisor import Supervisor

log = logs.get("forkq.metrics")

# Upper bounds (seconds) of the job duration histogram: background jobs run from a
# millisecond to minutes, so the client library's web-request defaults stop too early.
BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
NB = len(BOUNDS) + 1             # the last bucket is +Inf
# A row: failed, sum of seconds, then one count per bucket. Processed is the sum of the
# buckets (one fewer addition per job), so it always equals the histogram's count.
PREFIX = b"M"
# A write of at most PIPE_BUF (4096 on Linux) bytes to a pipe is atomic: a metrics line
# can never be cut by, or cut into, a "T"/"Q" line another thread writes to the same pipe.
MAX_LINE = 3900
MAX_LABEL = 200
OTHER = "(other)"                # where classes beyond the caps are counted
CHILD_KEYS = 500                 # (class, queue) pairs one processor thread keeps apart
MASTER_KEYS = 2000               # and the master: payloads name classes, and a flood of
                                 # made-up names must not grow memory or the scrape forever
# forkq_child_restarts_total's reasons, each exported from 0: a series that appeared only
# with its first restart hid that restart from increase() and rate()
RESTART_REASONS = ("crash", "memory", "jobs", "hang", "restart", "time_limit", "cancel")
REDIS_TIMEOUT_S = 1.0
# after Redis failed a scrape, skip it this long: from the first, doubling to the second
REDIS_BACKOFF_FIRST_S, REDIS_BACKOFF_S = 2.0, 10.0
HTTP_TIMEOUT_S = 5.0
HTTP_MAX_REQUEST = 16 * 1024
HTTP_MAX_CONNECTIONS = 16


# -- child side -------------------------------------------------------------------------


class JobTable:
    """Counts of one processor thread, written only by that thread (hence no lock):
    (class, queue) -> [failed, seconds, bucket counts...]."""

    __slots__ = ("rows",)

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str], list[Any]] = {}

    def observe(self, klass: str, queue: str, seconds: float, failed: bool,
                _bisect: Any = bisect_left, _bounds: tuple[float, ...] = BOUNDS) -> None:
        row = self.rows.get((klass, queue))
        if row is None:
            row = self._new_row(klass, queue)
        row[2 + _bisect(_bounds, seconds)] += 1
        row[1] += seconds
        if failed:
            row[0] += 1

    def _new_row(self, klass: str, queue: str) -> list[Any]:
        key = (klass, queue) if len(self.rows) < CHILD_KEYS else (OTHER, queue)
        row = self.rows.get(key)
        if row is None:
            row = [0, 0.0] + [0] * NB
            # one dict store: the reporter thread copies the dict, never sees it half-built
            self.rows[key] = row
        return row


class DeltaReporter:
    """Runs on a child's main thread: sums its processors' tables and sends the master
    what grew since the last send. Reading a row while its thread bumps it is safe: each
    number only grows, so a count read a moment early is sent with the next delta."""

    def __init__(self, tables: list[JobTable]) -> None:
        self.tables = tables
        self.sent: dict[tuple[str, str], list[Any]] = {}

    def deltas(self) -> list[tuple[tuple[str, str], list[Any], list[Any]]]:
        """[(key, totals now, delta since sent)] for each key that moved."""
        totals: dict[tuple[str, str], list[Any]] = {}
        for table in self.tables:
            for key, row in table.rows.copy().items():  # dict.copy() is atomic under the GIL
                now = list(row)
                have = totals.get(key)
                totals[key] = now if have is None else [a + b for a, b in zip(have, now)]
        out = []
        for key, now in totals.items():
            before = self.sent.get(key)
            delta = now if before is None else [a - b for a, b in zip(now, before)]
            if any(delta):  # a failure or seconds read apart from their bucket count too
                out.append((key, now, delta))
        return out

    def send(self, fd: int) -> int:
        """Write the deltas as "M" lines; returns how many lines went. A full pipe (the
        master is busy) keeps the rest for the next send instead of blocking this thread."""
        sent = 0
        for chunk, line in _lines(self.deltas()):
            if not _writable(fd):
                break
            try:
                os.write(fd, line)
            except OSError:
                break
            for key, now, _ in chunk:
                self.sent[key] = now
            sent += 1
        return sent


def _lines(rows: list[tuple[tuple[str, str], list[Any], list[Any]]]) -> Iterator[tuple[list[Any], bytes]]:
    chunk: list[Any] = []
    parts: list[bytes] = []
    size = 0
    for item in rows:
        (klass, queue), _, d = item
        part = json.dumps([klass[:MAX_LABEL], queue[:MAX_LABEL], d[0], round(d[1], 6), d[2:]],
                          separators=(",", ":"), ensure_ascii=True).encode()
        if parts and size + len(part) + 1 > MAX_LINE - 4:
            yield chunk, _line(parts)
            chunk, parts, size = [], [], 0
        chunk.append(item)
        parts.append(part)
        size += len(part) + 1
    if parts:
        yield chunk, _line(parts)


def _line(parts: list[bytes]) -> bytes:
    return PREFIX + b"[" + b",".join(parts) + b"]\n"


def _writable(fd: int) -> bool:
    poller = select.poll()  # select refuses a descriptor numbered 1024 or more
    poller.register(fd, select.POLLOUT)
    try:
        return any(events & select.POLLOUT for _, events in poller.poll(0))
    except OSError:
        return False


# -- master side: the sums --------------------------------------------------------------


@dataclass
class Aggregates:
    """What the children reported, summed since the master started."""

    jobs: dict[tuple[str, str], list[Any]] = field(default_factory=dict)
    rejected: int = 0   # lines that did not parse: a bug somewhere, shown as a metric

    def add(self, line: bytes) -> None:
        """One "M" line from a child (the prefix already stripped)."""
        try:
            rows = json.loads(line)
            if not isinstance(rows, list):
                raise ValueError("not a list of rows")
            parsed = [_row(r) for r in rows]
        except (ValueError, TypeError):
            self.rejected += 1
            return
        for key, values in parsed:
            have = self.jobs.get(key)
            if have is None:
                if len(self.jobs) >= MASTER_KEYS:
                    key = (OTHER, key[1])
                    have = self.jobs.get(key)
                if have is None:
                    have = self.jobs[key] = [0, 0.0] + [0] * NB
            for i, v in enumerate(values):
                have[i] += v


def _row(raw: Any) -> tuple[tuple[str, str], list[Any]]:
    klass, queue, failed, seconds, buckets = raw
    if (not isinstance(klass, str) or not isinstance(queue, str) or not isinstance(buckets, list)
            or len(buckets) != NB or not all(type(n) is int and n >= 0 for n in [failed, *buckets])
            or type(seconds) not in (int, float) or not seconds >= 0):
        raise ValueError("not a metrics row")
    return (klass, queue), [failed, float(seconds), *buckets]


# -- master side: what a scrape shows ---------------------------------------------------


class QueueReader:
    """Queue sizes and latencies from Redis, each scrape, never stalling the master long:
    a 1 s timeout, no retries, and after a failure no try for 2 s, doubling to
    REDIS_BACKOFF_S while it keeps failing (a fixed 10 s kept queue sizes out of the
    scrapes for that long after a short blip had passed)."""

    def __init__(self, url: str | None) -> None:
        self.url = url
        self.skip_until = 0.0
        self.backoff = 0.0

    def read(self) -> list[Any] | None:
        now = time.monotonic()
        if now < self.skip_until:
            return None
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        from . import api, client
        # a connection per scrape, closed at once: no socket of ours is open when the
        # master forks, and none goes stale between scrapes
        conn = client.connect(self.url, socket_timeout=REDIS_TIMEOUT_S,
                              socket_connect_timeout=REDIS_TIMEOUT_S, retry=Retry(NoBackoff(), 0),
                              health_check_interval=0)
        try:
            rows = api.queues(conn)
        except Exception as exc:
            self.backoff = min(max(REDIS_BACKOFF_FIRST_S, self.backoff * 2), REDIS_BACKOFF_S)
            self.skip_until = time.monotonic() + self.backoff
            log.warning("metrics: cannot read queue sizes from Redis; leaving them out",
                        error=str(exc), retry_in_s=self.backoff)
            return None
        finally:
            conn.close()
        self.backoff = 0.0
        return rows


class Collector:
    """prometheus_client's custom-collector interface over the supervisor's state."""

    def __init__(self, supervisor: "Supervisor", aggregates: Aggregates, queues: QueueReader) -> None:
        self.sup = supervisor
        self.agg = aggregates
        self.queues = queues

    def describe(self) -> list[Any]:
        return []  # registering must not call collect(), which reads Redis

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
        jobs = sorted(self.agg.jobs.items())
        processed = CounterMetricFamily("forkq_jobs_processed", "Jobs run (succeeded or failed), by class and queue",
                                        labels=["class", "queue"])
        failed = CounterMetricFamily("forkq_jobs_failed", "Jobs that raised, by class and queue",
                                     labels=["class", "queue"])
        duration = HistogramMetricFamily("forkq_job_duration_seconds",
                                         "Time from a job's start until its outcome was recorded",
                                         labels=["class", "queue"])
        for (klass, queue), row in jobs:
            cumulative, buckets = 0, []
            for bound, count in zip((*map(_le, BOUNDS), "+Inf"), row[2:]):
                cumulative += count
                buckets.append((bound, cumulative))
            processed.add_metric([klass, queue], cumulative)
            failed.add_metric([klass, queue], row[0])
            duration.add_metric([klass, queue], buckets, row[1])
        yield processed
        yield failed
        yield duration

        sup = self.sup
        yield from self._children()
        restarts = CounterMetricFamily("forkq_child_restarts", "Children replaced, by why, counted "
                                       "as the replacement takes the slot: at a crash or hang, at "
                                       "a recycle's start, not at the old child's exit",
                                       labels=["reason"])
        for reason, n in sorted({**dict.fromkeys(RESTART_REASONS, 0), **sup.stats.restarts}.items()):
            restarts.add_metric([reason], n)
        yield restarts
        yield CounterMetricFamily("forkq_jobs_requeued", "Jobs this master put back into Redis "
                                  "from dead children, orphaned processes and stray structures",
                                  value=sup.stats.requeued)
        yield CounterMetricFamily("forkq_jobs_strays", "Of forkq_jobs_requeued, jobs put back from "
                                  "private structures no registered process held", value=sup.stats.strays)
        yield CounterMetricFamily("forkq_jobs_poisoned", "Jobs sent to the dead set as poison "
                                  "(in flight in too many deaths of a child or a whole forkq)", value=sup.stats.poisoned)
        yield CounterMetricFamily("forkq_metrics_rejected", "Metrics lines from children that did "
                                  "not parse", value=self.agg.rejected)
        yield from self._queues()

    def _children(self) -> Iterator[Any]:
        import psutil
        from prometheus_client.core import GaugeMetricFamily
        children = sorted(self.sup.children.values(), key=lambda c: c.slot)
        yield GaugeMetricFamily("forkq_children", "Live child processes", value=len(children))
        yield GaugeMetricFamily("forkq_processes", "Child processes this master keeps running (--processes)",
                                value=len(self.sup.slots))
        busy = GaugeMetricFamily("forkq_busy_threads", "Processor threads running a job, per child slot",
                                 labels=["slot"])
        threads = GaugeMetricFamily("forkq_threads", "Processor threads per child slot (--concurrency)",
                                    labels=["slot"])
        rss = GaugeMetricFamily("forkq_child_rss_bytes", "Resident memory of each child slot, shared "
                                "pages included: during a recycle, its two children's summed",
                                labels=["slot"])
        # what --max-memory is compared with, one child's: the sum above, during a recycle,
        # tripped an alert set at the limit though no child was near it
        rss_max = GaugeMetricFamily("forkq_child_rss_max_bytes", "Resident memory of the largest "
                                    "child in each slot (what --max-memory, in MiB, is compared with)",
                                    labels=["slot"])
        # summed per slot: while a recycled child drains, its replacement already works in
        # the same slot, and one series per label set is all Prometheus takes
        per_slot: dict[int, list[int]] = {}
        for c in children:
            row = per_slot.setdefault(c.slot, [0, 0, 0, 0])
            row[0] += c.busy
            row[1] += self.sup.settings.concurrency
            try:
                one = psutil.Process(c.pid).memory_info().rss
            except psutil.Error:
                continue  # it just died; the reaper will tell
            row[2] += one
            row[3] = max(row[3], one)
        for slot, (b, t, r, most) in per_slot.items():
            busy.add_metric([str(slot)], b)
            threads.add_metric([str(slot)], t)
            if r:
                rss.add_metric([str(slot)], r)
                rss_max.add_metric([str(slot)], most)
        yield busy
        yield threads
        yield rss
        yield rss_max

    def _queues(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily
        found = self.queues.read()
        yield GaugeMetricFamily("forkq_redis_up", "1 if the queue sizes below were read from Redis "
                                "at this scrape, 0 if Redis did not answer (or is being left alone "
                                "after it did not)", value=0 if found is None else 1)
        # Redis-wide, so every master exports the same values: the help says how to add them
        # up, as a dashboard author reads it where the metric is
        same = " (the same on every master: aggregate with max by (queue), not sum)"
        size = GaugeMetricFamily("forkq_queue_size", "Jobs waiting in each queue" + same,
                                 labels=["queue"])
        latency = GaugeMetricFamily("forkq_queue_latency_seconds",
                                    "How long the next job of each queue has waited" + same,
                                    labels=["queue"])
        suspects = GaugeMetricFamily("forkq_queue_suspects", "Jobs of each queue a crashed process "
                                     "held, waiting to run one at a time, alone" + same,
                                     labels=["queue"])
        paused = GaugeMetricFamily("forkq_queue_paused", "1 while a queue is paused (no process "
                                   "claims its jobs), else 0" + same, labels=["queue"])
        for q in found or []:
            size.add_metric([q.name], q.size)
            latency.add_metric([q.name], q.latency)
            suspects.add_metric([q.name], q.suspects)
            paused.add_metric([q.name], 1 if q.paused else 0)
        yield size
        yield latency
        yield suspects
        yield paused


def _le(bound: float) -> str:
    return repr(float(bound))


# -- master side: the HTTP endpoint, served from the select loop --------------------------


@dataclass
class _Conn:
    sock: socket.socket
    deadline: float
    request: bytes = b""
    response: bytes = b""
    sent: int = 0


class MetricsServer:
    """`GET /metrics` answered by the master's own loop: non-blocking accept, read the
    small request, write the exposition, close. A slow or silent client costs the loop
    nothing: each step does only what the socket is ready for, and a connection is cut
    after HTTP_TIMEOUT_S."""

    def __init__(self, supervisor: "Supervisor", bind: str, port: int) -> None:
        from prometheus_client import CollectorRegistry
        from prometheus_client import ProcessCollector

        self.registry = CollectorRegistry(auto_describe=False)
        self.aggregates = Aggregates()
        self.registry.register(Collector(supervisor, self.aggregates, QueueReader(supervisor.settings.redis_url)))
        # the master's own CPU, memory and open fds, under the library's usual names
        ProcessCollector(registry=self.registry)
        self.listener = _listen(bind, port)
        self.address = self.listener.getsockname()[:2]
        self.conns: dict[int, _Conn] = {}

    # the loop asks which fds to wait on, then hands back the ready ones
    def read_fds(self) -> list[int]:
        return [self.listener.fileno()] + [fd for fd, c in self.conns.items() if not c.response]

    def write_fds(self) -> list[int]:
        return [fd for fd, c in self.conns.items() if c.response]

    def owns(self, fd: int) -> bool:
        return fd == self.listener.fileno() or fd in self.conns

    def abandon(self) -> None:
        """In a freshly forked child: close every socket inherited from the master (the
        listener, any scrape in progress) without a word to the peer, and detach them from
        their objects, so that no later close() hits a number the child reuses."""
        for sock in [self.listener, *(c.sock for c in self.conns.values())]:
            try:
                os.close(sock.detach())
            except OSError:
                pass
        self.conns = {}

    def readable(self, fd: int) -> None:
        if fd == self.listener.fileno():
            self._accept()
            return
        conn = self.conns.get(fd)
        if conn is None:
            return
        try:
            data = conn.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(fd)
            return
        conn.request += data
        if b"\r\n\r\n" in conn.request or b"\n\n" in conn.request:
            conn.response = self._respond(conn.request)
        elif len(conn.request) > HTTP_MAX_REQUEST:
            conn.response = _http(431, "text/plain", b"request too large\n")

    def writable(self, fd: int) -> None:
        conn = self.conns.get(fd)
        if conn is None:
            return
        try:
            conn.sent += conn.sock.send(conn.response[conn.sent:])
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            conn.sent = len(conn.response)
        if conn.sent >= len(conn.response):
            self._close(fd)

    def expire(self) -> None:
        now = time.monotonic()
        for fd in [fd for fd, c in self.conns.items() if now > c.deadline]:
            self._close(fd)

    def close(self) -> None:
        for fd in list(self.conns):
            self._close(fd)
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of fds, say: try again at the next event
                log.warning("metrics: accept failed", error=str(exc))
                return
            if len(self.conns) >= HTTP_MAX_CONNECTIONS:
                sock.close()
                continue
            sock.setblocking(False)
            self.conns[sock.fileno()] = _Conn(sock, time.monotonic() + HTTP_TIMEOUT_S)

    def _close(self, fd: int) -> None:
        conn = self.conns.pop(fd, None)
        if conn is not None:
            conn.sock.close()

    def _respond(self, request: bytes) -> bytes:
        head = request.split(b"\r\n\r\n", 1)[0].split(b"\n\n", 1)[0].decode("latin-1")
        lines = head.splitlines()
        parts = lines[0].split() if lines else []
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return _http(400, "text/plain", b"bad request\n")
        method, target = parts[0], parts[1].split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            return _http(405, "text/plain", b"only GET\n", extra="Allow: GET, HEAD\r\n")
        if target not in ("/metrics", "/"):
            return _http(404, "text/plain", b"not found: the metrics are at /metrics\n")
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        from prometheus_client.exposition import choose_encoder
        encoder, content_type = choose_encoder(headers.get("accept", ""))
        try:
            body = encoder(self.registry)
        except Exception:
            log.exception("metrics: building the exposition failed")
            return _http(500, "text/plain", b"metrics failed; see the master's log\n")
        return _http(200, content_type, body, head_only=method == "HEAD")


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large", 500: "Internal Server Error"}


def _http(status: int, content_type: str, body: bytes, extra: str = "", head_only: bool = False) -> bytes:
    head = (f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n{extra}\r\n")
    return head.encode("latin-1") + (b"" if head_only else body)


def _listen(bind: str, port: int) -> socket.socket:
    from .errors import ConfigError
    try:
        infos = socket.getaddrinfo(bind or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family = infos[0][0]
        if bind == "::" and socket.has_dualstack_ipv6():
            sock = socket.create_server(("::", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=16)
        else:
            sock = socket.create_server(infos[0][4][:2], family=family, backlog=16)
    except OSError as exc:
        raise ConfigError(f"--metrics-bind {bind} --metrics-port {port}: cannot listen there: "
                          f"{exc.strerror or exc}") from None
    sock.setblocking(False)
    return sock
