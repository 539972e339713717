"""Pushing jobs into Redis in Sidekiq's format, and turning a URL into a connection."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

import redis

from . import keys, payload
from .errors import RedisUnavailable

DEFAULT_URL = "redis://127.0.0.1:6379/0"
DEFAULT_TIMEOUT_S = 5.0

# A client middleware sees each payload before it is pushed and returns it (changed or
# not), or None to drop the job.
ClientMiddleware = Callable[[dict[str, Any]], "dict[str, Any] | None"]


def redis_url(url: str | None = None) -> str:
    return url or os.environ.get("FORKQ_REDIS_URL") or DEFAULT_URL


def mask_url(url: str) -> str:
    """The URL with any password replaced (in the userinfo or a password= query
    parameter, both of which redis-py accepts), fit for logs and status output.

    Done on the text rather than by parsing, so a malformed URL (the kind an error
    message is about to show) is masked too and nothing else in it changes."""
    # the password runs to the LAST "@" before the path: a raw "@" in it must not leak a tail
    return _mask_query(re.sub(r"^([A-Za-z][A-Za-z0-9+.-]*://[^:@/?#]*:)[^/?#]*@", r"\1***@", url))


def _mask_query(text: str) -> str:
    return re.sub(r"((?:^|[?&])password=)[^&#]*", r"\1***", text)


def connect(url: str | None = None, **options: Any) -> redis.Redis:
    """A redis-py client for redis://, rediss:// (TLS) or unix:// URLs, with user/password."""
    url = redis_url(url)
    options.setdefault("health_check_interval", 30)
    options.setdefault("socket_connect_timeout", 5)
    if url.startswith("unix:"):
        # TCP-only options: redis-py's unix socket connection refuses them with a TypeError
        for tcp_only in ("socket_keepalive", "socket_keepalive_options"):
            options.pop(tcp_only, None)
    try:
        _check_db(url)
        return redis.Redis.from_url(url, **options)
    except ValueError as exc:
        raise ValueError(f"bad Redis URL {mask_url(url)!r}: {exc}") from None


def _check_db(url: str) -> None:
    # redis-py ignores a path it cannot read as a number and uses db 0: a typo would
    # silently send jobs to another database
    parts = urlsplit(url)
    if parts.scheme in ("redis", "rediss"):
        db = parts.path.replace("/", "")
        if db and not (db.isascii() and db.isdigit()):
            raise ValueError(f"the database must be a number, as in /0, not {db!r}")


def epoch(when: float | int | datetime) -> float:
    if isinstance(when, datetime):
        return when.timestamp()
    if isinstance(when, (int, float)) and not isinstance(when, bool):
        return float(when)
    raise TypeError(f"a run time must be epoch seconds or a datetime, not {type(when).__name__}")


class Client:
    """Pushes jobs to one Redis. Safe to share between threads; reconnects after fork."""

    def __init__(self, url: str | None = None, *,
                 middleware: Iterable[ClientMiddleware] = (), **redis_options: Any) -> None:
        self.url = redis_url(url)
        self.middleware: list[ClientMiddleware] = list(middleware)
        # Without a read timeout a push to a Redis that stopped answering (paused, network
        # cut) blocks its caller forever; Sidekiq's clients give up after 5 s too.
        redis_options.setdefault("socket_timeout", DEFAULT_TIMEOUT_S)
        self._options = redis_options
        self._redis: redis.Redis | None = None
        self._pid = 0

    @property
    def redis(self) -> redis.Redis:
        # A connection pool must never cross a fork: a child gets its own on first use.
        if self._redis is None or self._pid != os.getpid():
            self._redis = connect(self.url, **self._options)
            self._pid = os.getpid()
        return self._redis

    def push(self, name: str, args: Iterable[Any] = (), *, queue: str = "default",
             retry: bool | int = True, at: float | datetime | None = None, **options: Any) -> str | None:
        """Push one job; return its jid, or None if a client middleware dropped it."""
        jids = self.push_bulk(name, [args], queue=queue, retry=retry, at=at, **options)
        return jids[0] if jids else None

    def push_bulk(self, name: str, args_list: Iterable[Iterable[Any]], *, queue: str = "default",
                  retry: bool | int = True, at: float | datetime | None = None,
                  **options: Any) -> list[str]:
        """Push many jobs of one kind in one round trip (Sidekiq's push_bulk); return jids."""
        checked = [payload.check_args(payload.bulk_item(a)) for a in args_list]
        now = time.time()
        jobs = [payload.build(name, a, queue, retry, now, **options) for a in checked]
        return self.push_jobs(jobs, at=at)

    def push_jobs(self, jobs: list[dict[str, Any]], at: float | datetime | None = None) -> list[str]:
        """Push prepared payloads (each with class, args, jid, queue)."""
        if self.middleware:
            jobs = [j for j in (self._through_middleware(j) for j in jobs) if j is not None]
        if not jobs:
            return []
        run_at = None if at is None else epoch(at)
        now = time.time()
        pipe = self.redis.pipeline(transaction=False)
        if run_at is not None and run_at > now:
            pipe.zadd(keys.SCHEDULE, {payload.dumps(j): run_at for j in jobs})
        else:
            by_queue: dict[str, list[str]] = {}
            for j in jobs:
                j["enqueued_at"] = now
                by_queue.setdefault(j["queue"], []).append(payload.dumps(j))
            for q, raws in by_queue.items():
                pipe.sadd(keys.QUEUES, q)
                pipe.lpush(keys.queue(q), *raws)
        self._execute(pipe)
        return [j["jid"] for j in jobs]

    def _through_middleware(self, job: dict[str, Any]) -> dict[str, Any] | None:
        for mw in self.middleware:
            job = mw(job)
            if job is None:
                return None
        return job

    def _execute(self, pipe: redis.client.Pipeline) -> list[Any]:
        commands = list(pipe.command_stack)
        for attempt in (1, 2):
            try:
                return pipe.execute()
            except redis.ReadOnlyError:
                # A failover just happened and we still talk to the old primary: reconnect
                # and try once more, as the new primary is where the write belongs.
                if attempt == 2:
                    raise RedisUnavailable(f"Redis at {mask_url(self.url)} is read-only") from None
                self._redis = None
                pipe = self.redis.pipeline(transaction=False)
                pipe.command_stack.extend(commands)
            except redis.TimeoutError as exc:
                # the commands may have reached Redis and run: only their reply is missing
                raise RedisUnavailable(
                    f"Redis at {mask_url(self.url)} did not answer in time ({exc}); the job "
                    "may or may not have been pushed") from None
            except redis.ConnectionError as exc:
                raise RedisUnavailable(
                    f"cannot reach Redis at {mask_url(self.url)}: {exc}; the job was not pushed") from None
        raise AssertionError("unreachable")


_default: Client | None = None


def default_client() -> Client:
    """The client module-level helpers use; FORKQ_REDIS_URL picks its server."""
    global _default
    if _default is None:
        _default = Client()
    return _default


def configure(url: str | None = None, *, middleware: Iterable[ClientMiddleware] = ()) -> Client:
    """Replace the default client (e.g. at app start-up)."""
    global _default
    _default = Client(url, middleware=middleware)
    return _default
