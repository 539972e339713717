"""Pushing jobs into Redis in Sidekiq's format, and turning a URL into a connection."""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.sentinel import MasterNotFoundError, Sentinel

from . import batch, keys, payload, scripts, unique, wire
from .errors import ConfigError, RedisUnavailable
from .masking import mask_text, mask_url  # noqa: F401  (forkq.client.mask_text, as before)

DEFAULT_URL = "redis://127.0.0.1:6379/0"
DEFAULT_TIMEOUT_S = 5.0

# A client middleware sees each payload before it is pushed and returns it (changed or
# not), or None to drop the job.
ClientMiddleware = Callable[[dict[str, Any]], "dict[str, Any] | None"]


def redis_url(url: str | None = None) -> str:
    """`url`, else FORKQ_REDIS_URL, else the local default. Either given empty is refused,
    as the CLI refuses it: an empty secret or template must not mean localhost, where
    jobs would be pushed to a Redis no worker reads."""
    name = "url"
    if url is None:
        url, name = os.environ.get("FORKQ_REDIS_URL"), "FORKQ_REDIS_URL"
        if url is None:
            return DEFAULT_URL
    if not url.strip():
        raise ConfigError(f"{name}={url!r}: must not be empty (leave it out for the default)")
    return url


def refused_credentials(exc: BaseException) -> bool:
    """A wrong password or ACL user: redis-py raises AuthenticationError for WRONGPASS and
    NOAUTH, but an error reply it does not map arrives as a plain ResponseError."""
    return isinstance(exc, redis.AuthenticationError) or (
        isinstance(exc, redis.ResponseError) and str(exc).startswith(("WRONGPASS", "NOAUTH")))


def unreachable(shown_url: str, exc: BaseException, url: str | None = None) -> str:
    """What to say of a connection failure: redis-py files a refused password or ACL user
    under ConnectionError too, but that Redis was reached, and the fix is the URL's. Given
    the real `url`, a TLS failure gets tls_hint's advice, as a push's does."""
    if refused_credentials(exc):
        return f"Redis at {shown_url} refused the credentials (password or ACL user): {exc}"
    return f"cannot reach Redis at {shown_url}: {exc}{tls_hint(url, {}, exc) if url else ''}"


SENTINEL_SCHEME = "redis+sentinel"
SENTINEL_TLS_SCHEME = "rediss+sentinel"  # TLS to the sentinels and the servers, as rediss://
SENTINEL_PORT = 26379

# rediss:// and rediss+sentinel:// options that may come from the environment instead of
# the URL's query string
TLS_ENV = {"ssl_ca_certs": "FORKQ_REDIS_CA", "ssl_certfile": "FORKQ_REDIS_CERT",
           "ssl_keyfile": "FORKQ_REDIS_KEY"}
TLS_CERT_REQS = ("none", "optional", "required")


def connect(url: str | None = None, **options: Any) -> redis.Redis:
    """A redis-py client for redis://, rediss:// (TLS), unix://, redis+sentinel:// or
    rediss+sentinel:// (TLS) URLs, with user/password.

    A Sentinel client asks the sentinels for the current primary each time it opens a
    connection, so after a failover its reconnects reach the new primary."""
    url = redis_url(url)
    scheme = _scheme(url)
    options.setdefault("health_check_interval", 30)
    options.setdefault("socket_connect_timeout", 5)
    if url.startswith("unix:"):
        # TCP-only options: redis-py's unix socket connection refuses them with a TypeError
        for tcp_only in ("socket_keepalive", "socket_keepalive_options"):
            options.pop(tcp_only, None)
    try:
        if scheme not in SCHEMES or not url.startswith(scheme):
            # redis-py's own message names only three of these, and not the Sentinel ones
            raise ValueError("a Redis URL starts with " + ", ".join(f"{s}://" for s in SCHEMES)
                             + " (redis://localhost:6379/0, say)")
        if scheme in (SENTINEL_SCHEME, SENTINEL_TLS_SCHEME):
            return _connect_sentinel(url, options, tls=scheme == SENTINEL_TLS_SCHEME)
        _check_db(url)
        if scheme == "rediss":
            _tls_options(dict(parse_qsl(urlsplit(url).query)), options)
        _check_query(url, scheme)
        return redis.Redis.from_url(url, **options)
    except ValueError as exc:
        raise ValueError(f"bad Redis URL {mask_url(url)!r}: {exc}") from None


SCHEMES = ("redis", "rediss", "unix", SENTINEL_SCHEME, SENTINEL_TLS_SCHEME)


def _scheme(url: str) -> str:
    head, sep, _ = url.partition("://")
    return head.lower() if sep else ""


def _tls_options(query: dict[str, str], options: dict[str, Any]) -> None:
    # redis-py hands ssl_* query parameters through as text, which SSLConnection accepts;
    # check them here so a typo fails at start-up with a message, not at the first command.
    for option, env in TLS_ENV.items():
        if option not in query and option not in options and os.environ.get(env):
            options[option] = os.environ[env]
    reqs = query.get("ssl_cert_reqs", options.get("ssl_cert_reqs"))
    if isinstance(reqs, str) and reqs.lower() not in TLS_CERT_REQS:
        raise ValueError(f"ssl_cert_reqs must be one of {', '.join(TLS_CERT_REQS)}, not {reqs!r}")
    for option in TLS_ENV:
        path = query.get(option, options.get(option))
        if isinstance(path, str) and not os.path.isfile(path):
            raise ValueError(f"{option}: no such file {path!r}")


# OpenSSL's reasons for refusing a certificate that only its strict mode (VERIFY_X509_STRICT)
# gives: Python 3.13 turned that mode on by default, so a CA or certificate that 3.12
# accepted can be refused with one of these even though its CA is the one given.
_STRICT_ONLY_REFUSALS = (
    "CA cert does not include key usage extension",
    "Missing Authority Key Identifier",
    "Missing Subject Key Identifier",
    "Basic Constraints of CA cert not marked critical",
    "Authority Key Identifier marked critical",
    "Subject Key Identifier marked critical",
    "Subject empty and Subject Alt Name extension not critical",
    "Empty Subject Alternative Name extension",
    "Issuer name empty",
    "Subject name empty",
    "Path length invalid for non-CA cert",
    "Path length given without key usage keyCertSign",
    "Key usage keyCertSign invalid for non-CA cert",
    "Using cert extension requires at least X509v3",
    "cert info signature and signature algorithm mismatch",
)


def _strict_hint() -> str:
    from redis.connection import SSLConnection
    relax = ("add ssl_exclude_verify_flags=VERIFY_X509_STRICT to the URL to check it as "
             "Python 3.12 did" if "ssl_exclude_verify_flags" in _init_parameters(SSLConnection)
             else "a redis-py that takes ssl_exclude_verify_flags= can relax the check")
    return (" (the server's certificate or its CA breaks a rule that Python 3.13 and later "
            f"check by default (VERIFY_X509_STRICT): reissue it, or {relax})")


def tls_hint(url: str, options: dict[str, Any], exc: BaseException) -> str:
    """A sentence to add to a TLS connection error, or "": a server that requires a client
    certificate just closes the handshake, which Python reports as a bare EOF (3.11, 3.12)
    or a reset (3.13); one that requires TLS resets a plain connection."""
    scheme, text = _scheme(url), str(exc)
    if scheme == SENTINEL_SCHEME and ("reset by peer" in text or "closed by server" in text):
        return f" (if the sentinels require TLS, write {SENTINEL_TLS_SCHEME}://)"
    if scheme not in ("rediss", SENTINEL_TLS_SCHEME):
        return ""
    if "CERTIFICATE_VERIFY_FAILED" in text:
        lowered = text.lower()
        if any(reason.lower() in lowered for reason in _STRICT_ONLY_REFUSALS):
            return _strict_hint()
        return (" (the server's certificate was not trusted: give its CA with ssl_ca_certs= "
                "or FORKQ_REDIS_CA)")
    if "EOF" in text or "SSL" in text or "reset by peer" in text:
        query = dict(parse_qsl(urlsplit(url).query))
        if not (query.get("ssl_certfile") or options.get("ssl_certfile")
                or os.environ.get("FORKQ_REDIS_CERT")):
            return (" (the TLS handshake failed and no client certificate was given: if the "
                    "server requires one, set ssl_certfile= and ssl_keyfile=, or "
                    "FORKQ_REDIS_CERT and FORKQ_REDIS_KEY)")
    return ""


def _connect_sentinel(url: str, options: dict[str, Any], tls: bool) -> redis.Redis:
    """redis+sentinel://[user:password@]host:port[,host:port...]/SERVICE[/DB][?sentinel_password=...]

    The user and password are the Redis servers'; sentinel_username / sentinel_password
    (query parameters) authenticate to the sentinels, which otherwise get none.
    rediss+sentinel:// (`tls`) speaks TLS to the sentinels and the servers alike, with the
    ssl_* parameters and FORKQ_REDIS_* files of rediss://."""
    scheme = SENTINEL_TLS_SCHEME if tls else SENTINEL_SCHEME
    rest = url.split("://", 1)[1]
    rest, _, fragment = rest.partition("#")
    rest, _, query_text = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hostlist = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, pw = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if colon else None
    sentinels = [_host_port(item, scheme) for item in hostlist.split(",")]
    parts = [p for p in path.split("/") if p]
    if not parts:
        raise ValueError(f"no service name: write {scheme}://HOST:PORT/SERVICE[/DB]")
    if len(parts) > 2:
        raise ValueError(f"the path must be /SERVICE or /SERVICE/DB, not /{path}")
    service = unquote(parts[0])
    db = 0
    if len(parts) == 2:
        if not (parts[1].isascii() and parts[1].isdigit()):
            raise ValueError(f"the database must be a number, as in /0, not {parts[1]!r}")
        db = int(parts[1])
    sentinel_kwargs: dict[str, Any] = {}
    for name, value in parse_qsl(query_text, keep_blank_values=True):
        if name == "sentinel_password":
            sentinel_kwargs["password"] = value
        elif name == "sentinel_username":
            sentinel_kwargs["username"] = value
        elif name in ("socket_timeout", "socket_connect_timeout"):
            options[name] = float(value)
        elif name.startswith("ssl_") and not tls:
            raise ValueError(f"{name} is a TLS option: write {SENTINEL_TLS_SCHEME}:// for TLS")
        elif name.startswith("ssl_"):
            options[name] = _ssl_parameter(name, value)
        else:
            raise ValueError(f"unknown query parameter {name!r} ({scheme}:// takes "
                             "sentinel_password, sentinel_username, socket_timeout, "
                             "socket_connect_timeout" + (" and ssl_*)" if tls else ")"))
    if tls:
        _tls_options({}, options)  # the query's ssl_* are in options now
        options["ssl"] = True  # SentinelConnectionPool: SentinelManagedSSLConnection
        # the sentinels get the same TLS settings: one CA and client certificate for both
        sentinel_kwargs.update((k, v) for k, v in options.items() if k.startswith("ssl"))
    # the sentinels get the same timeouts as the servers (a dead sentinel must not hang us)
    for name in ("socket_timeout", "socket_connect_timeout", "socket_keepalive"):
        if name in options:
            sentinel_kwargs.setdefault(name, options[name])
    # The next sentinel is the retry. redis-py's default (10 retries with backoff) made a
    # refused sentinel cost about 4 s, and one that drops packets 11 connect timeouts, in
    # every discovery before the next sentinel was asked.
    sentinel_kwargs["retry"] = Retry(NoBackoff(), 0)
    if username is not None:
        options["username"] = username
    if password is not None:
        options["password"] = password
    manager = _Sentinel(sentinels, sentinel_kwargs=sentinel_kwargs, **options)
    return manager.master_for(service, redis_class=redis.Redis, db=db)


def _ssl_parameter(name: str, value: str) -> Any:
    """A rediss+sentinel:// ssl_* query parameter, read as redis-py reads a rediss:// one."""
    _check_tls_name(name)
    from redis.connection import URL_QUERY_ARGUMENT_PARSERS
    parse = URL_QUERY_ARGUMENT_PARSERS.get(name, str)
    try:
        return parse(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: bad value {value!r}") from None


def _check_tls_name(name: str) -> None:
    # redis-py passes an unknown query parameter on to the connection class, whose
    # TypeError comes only at the first command (a traceback from the CLI)
    from redis.connection import SSLConnection
    if name not in _init_parameters(SSLConnection):
        raise ValueError(f"unknown TLS option {name!r}")


# The sentinel that last named a primary, per list of sentinels, for this process and
# the children it forks: each Client, worker connection pool and CLI command builds its
# own _Sentinel, and each would otherwise try the URL's first sentinel first. One that
# drops packets cost every one of them a connect timeout (5 s by default).
_answered: dict[tuple[tuple[str, int], ...], tuple[str, int]] = {}


def _address(sentinel: redis.Redis) -> tuple[str, int]:
    kwargs = sentinel.connection_pool.connection_kwargs
    return kwargs["host"], kwargs["port"]


class _Sentinel(Sentinel):
    """redis-py's Sentinel, with a readable error when no sentinel names a primary: its own
    shows each sentinel as its client's whole repr and each failure only by class
    ("network:ConnectionError"), hiding a refused connection or TLS handshake. It asks
    first the sentinel that answered last in this process."""

    def __init__(self, sentinels: list[tuple[str, int]], **kwargs: Any) -> None:
        super().__init__(sentinels, **kwargs)
        self._addresses = tuple(_address(s) for s in self.sentinels)
        last = _answered.get(self._addresses)
        if last is not None and last in self._addresses:
            i = self._addresses.index(last)
            self.sentinels.insert(0, self.sentinels.pop(i))

    def discover_master(self, service_name: str) -> tuple[str, int]:
        failures = []
        for i, sentinel in enumerate(self.sentinels):
            host, port = _address(sentinel)
            where = f"{host}:{port}"
            try:
                state = sentinel.sentinel_masters().get(service_name)
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                failures.append(f"{where}: {exc}")
                continue
            if state and self.check_master_state(state, service_name):
                # ask this one first next time, as redis-py does
                self.sentinels[0], self.sentinels[i] = sentinel, self.sentinels[0]
                _answered[self._addresses] = (host, port)
                return state["ip"], state["port"]
            failures.append(f"{where}: " + ("reports it down" if state else "does not monitor it"))
        raise MasterNotFoundError(f"no sentinel named a primary for {service_name!r} "
                                  f"({'; '.join(failures)})")


def _host_port(item: str, scheme: str) -> tuple[str, int]:
    item = item.strip()
    if not item:
        raise ValueError(f"no sentinel address: write {scheme}://HOST:PORT[,HOST:PORT...]/SERVICE")
    if item.startswith("["):
        host, bracket, tail = item[1:].partition("]")
        if not bracket or (tail and not tail.startswith(":")):
            raise ValueError(f"bad sentinel address {item!r}")
        port_text = tail[1:]
    else:
        host, _, port_text = item.partition(":")
    if not port_text:
        return host, SENTINEL_PORT
    if not (port_text.isascii() and port_text.isdigit()) or not 0 < int(port_text) < 65536:
        raise ValueError(f"bad sentinel port in {item!r}")
    return host, int(port_text)


def _check_query(url: str, scheme: str) -> None:
    # redis-py hands a query parameter it has no parser for to the connection class, whose
    # TypeError comes only at the first command: a traceback from the CLI, or a worker
    # that starts and then cannot fetch
    from redis.connection import Connection, SSLConnection, UnixDomainSocketConnection
    cls = {"rediss": SSLConnection, "unix": UnixDomainSocketConnection}.get(scheme, Connection)
    accepted = _init_parameters(cls) | {"max_connections"}  # the pool's own
    for name, _ in parse_qsl(urlsplit(url).query):
        if name in accepted:
            continue
        if name.startswith("ssl") and scheme == "redis":
            raise ValueError(f"{name} is a TLS option: write rediss:// for TLS")
        if name.startswith("ssl_") and scheme == "rediss":
            raise ValueError(f"unknown TLS option {name!r}")
        raise ValueError(f"unknown query parameter {name!r}")


def _init_parameters(cls: type) -> set[str]:
    """The keyword arguments cls() takes, following **kwargs up its bases."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters.values()
        names.update(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    names.discard("self")
    return names


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


# forkq.testing's fake or inline mode, while one is on: push(commands) is given a push's
# Redis commands, exactly as they would be sent, in place of the Redis write
TestPush = Callable[[list[tuple]], Any]
test_push: TestPush | None = None


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
        self._pushers: _Pushers | None = None
        self._pid = 0

    @property
    def redis(self) -> redis.Redis:
        self._connected()
        return self._redis

    def _connected(self) -> _Pushers:
        # A connection pool must never cross a fork: a child gets its own on first use.
        if self._redis is None or self._pid != os.getpid():
            self._redis = connect(self.url, **self._options)
            self._pushers = _Pushers(self._redis)
            self._pid = os.getpid()
        return self._pushers  # type: ignore[return-value]  # set with _redis just above

    def push(self, name: str, args: Iterable[Any] = (), *, queue: str = "default",
             retry: bool | int = True, at: float | datetime | None = None,
             kwargs: dict[str, Any] | None = None, **options: Any) -> str | None:
        """Push one job; return its jid, or None if a client middleware dropped it.
        `kwargs`: keyword arguments, for a job a forkq worker runs (Sidekiq ignores them)."""
        checked = [payload.check_args(payload.bulk_item(args))]
        # None is none; anything else is checked, so a falsy non-dict ([], "") is refused
        checked_kwargs = None if kwargs is None else payload.check_kwargs(kwargs)
        keywords = {0: checked_kwargs} if checked_kwargs else None
        jids = self._push_checked(name, checked, queue, retry, at, options, keywords)
        return jids[0] if jids else None

    def push_bulk(self, name: str, args_list: Iterable[Any], *, queue: str = "default",
                  retry: bool | int = True, at: float | datetime | None = None,
                  **options: Any) -> list[str]:
        """Push many jobs of one kind in one round trip (Sidekiq's push_bulk); return jids.
        An item is positional args (a list or tuple), keyword arguments (a dict), or both
        (`forkq.call(*args, **kwargs)`)."""
        checked, keywords = payload.check_many(args_list)
        return self._push_checked(name, checked, queue, retry, at, options, keywords)

    def _push_checked(self, name: str, checked: list[list], queue: str, retry: bool | int,
                      at: float | datetime | None, options: dict[str, Any],
                      keywords: dict[int, dict[str, Any]] | None = None) -> list[str]:
        payload.check_options(unique.check(options))
        payload.check_retry(retry)
        now = time.time()
        if keywords:
            jobs = [payload.build(name, a, queue, retry, now, keywords.get(i), **options)
                    for i, a in enumerate(checked)]
        else:
            jobs = [payload.build(name, a, queue, retry, now, **options) for a in checked]
        return self.push_jobs(jobs, at=at)

    def push_jobs(self, jobs: list[dict[str, Any]], at: float | datetime | None = None, *,
                  middleware: bool = True) -> list[str]:
        """Push prepared payloads (each with class, args, jid, queue); return the jids of
        those pushed: not those a client middleware dropped, nor the unique ones refused
        because an identical job holds its lock. Inside a `with forkq.Batch()`, the jobs
        join it, in the same MULTI as their push. middleware=False: the caller has already
        passed them through the client middleware (forkq.chain)."""
        joining = batch.joining()
        if joining is not None:
            joining.stamp(jobs, self)
        if self.middleware and middleware:
            jobs = [j for j in (self._through_middleware(j) for j in jobs) if j is not None]
            for j in jobs:  # a middleware may set tags too (options were checked before it)
                if "tags" in j:
                    payload.check_tags(j["tags"])
        if not jobs:
            return []
        # middleware may put anything in a payload: only jobs built here from checked args
        # take the fast encoder
        encode = payload.dumps if self.middleware else payload.dumps_new
        run_at = None if at is None else epoch(at)
        now = time.time()
        for j in jobs:
            if "expires_in" in j:
                payload.stamp_expiry(j, now if run_at is None else max(run_at, now))
        if test_push is None and any("unique_for" in j for j in jobs):
            return self._push_unique(jobs, run_at, now, encode)
        if run_at is not None and run_at > now:
            for q in {j.get("queue", "default") for j in jobs}:  # the scheduler's default
                payload.check_queue(q)
            scored = [part for j in jobs for part in (run_at, encode(j))]
            commands = [("ZADD", keys.SCHEDULE, *scored)]
            self._send_joined(commands, joining, jobs, run_at)
            return [j["jid"] for j in jobs]
        by_queue: dict[str, list[bytes | str]] = {}
        for j in jobs:
            j["enqueued_at"] = now
            by_queue.setdefault(j["queue"], []).append(encode(j))
        for q in by_queue:
            payload.check_queue(q)
        # SADD and LPUSH per queue, as Sidekiq's client sends them (not atomic together: a
        # queue named in `queues` with nothing pushed is harmless)
        commands = [command for q, raws in by_queue.items()
                    for command in (("SADD", keys.QUEUES, q), ("LPUSH", keys.queue(q), *raws))]
        self._send_joined(commands, joining, jobs)
        return [j["jid"] for j in jobs]

    def _push_unique(self, jobs: list[dict[str, Any]], run_at: float | None, now: float,
                     encode: Callable[[dict[str, Any]], bytes | str]) -> list[str]:
        """Push jobs some of which are unique: one Lua call takes each lock and pushes its
        job together (scripts/unique_push.lua). Jobs without uniqueness go in the same call,
        in order, so a mixed batch keeps its order on the queue."""
        later = run_at is not None and run_at > now
        delay = run_at - now if later else 0.0  # type: ignore[operator]  # later: run_at is set
        argv: list[Any] = []
        for j in jobs:
            q = j.get("queue", "default") if later else j["queue"]  # as the plain path reads it
            payload.check_queue(q)
            if unique.wanted(j):
                lock = unique.lock_key(j["class"], q, j["args"], j.get("kwargs"))
                ttl = unique.ttl_ms(j, delay)
            else:
                lock, ttl = "", 0
            if not later:
                j["enqueued_at"] = now
            argv += [lock, j["jid"], ttl, q, run_at if later else "", encode(j)]
        pushed = self._send_script("unique_push", (2, keys.QUEUES, keys.SCHEDULE, *argv))
        return [j["jid"] for j, ok in zip(jobs, pushed) if ok]

    def _through_middleware(self, job: dict[str, Any]) -> dict[str, Any] | None:
        for mw in self.middleware:
            job = mw(job)  # type: ignore[assignment]  # None returns at once, below
            if job is None:
                return None
        return job

    def _send(self, commands: list[tuple]) -> Any:
        """Send one push's commands in one write, turning Redis trouble into forkq errors."""
        if test_push is not None:
            return test_push(commands)
        return self._write(lambda pushers: pushers.run(commands))

    def _send_joined(self, commands: list[tuple], joining: "batch.Batch | None",
                     jobs: list[dict[str, Any]], due: float | None = None) -> None:
        """Send a push's commands; inside a batch, in a MULTI that adds the jobs to it."""
        if joining is None:
            self._send(commands)
            return
        replies = self._send(joining.registered(commands, jobs, due))
        # EXEC runs every command even if one fails (WRONGTYPE on a queue key): say so,
        # as the plain push does, once the jobs not pushed are out of the batch again (a
        # caller may handle the error and seal the batch)
        errors = [r for r in replies if isinstance(r, Exception)] if type(replies) is list else []
        if errors:
            undo = joining.refused(commands, replies, jobs)
            if undo:
                self._send(undo)
            raise errors[0]

    def _send_script(self, name: str, args: tuple) -> Any:
        """Run one push's script (numkeys, keys..., argv...), with _send's errors."""
        return self._write(lambda pushers: pushers.run_script(name, args))

    def _write(self, run: Callable[["_Pushers"], Any]) -> Any:
        for attempt in (1, 2):
            try:
                return run(self._connected())
            except redis.ReadOnlyError:
                # A failover just happened and we still talk to the old primary: reconnect
                # and try once more, as the new primary is where the write belongs.
                if attempt == 2:
                    raise RedisUnavailable(f"Redis at {mask_url(self.url)} is read-only") from None
                self._redis = None
            except wire.Unanswered as exc:
                raise RedisUnavailable(
                    f"lost the connection to Redis at {mask_url(self.url)} before its reply "
                    f"({exc.__cause__}); the job may or may not have been pushed",
                    maybe_pushed=True) from None
            except redis.TimeoutError as exc:
                # the commands may have reached Redis and run: only their reply is missing
                raise RedisUnavailable(
                    f"Redis at {mask_url(self.url)} did not answer in time ({exc}); the job "
                    "may or may not have been pushed", maybe_pushed=True) from None
            except redis.ConnectionError as exc:
                raise RedisUnavailable(
                    f"{unreachable(mask_url(self.url), exc)}; the job was not pushed"
                    f"{tls_hint(self.url, self._options, exc)}") from None
        raise AssertionError("unreachable")


class _Pushers:
    """Connections for pushes, driven directly (forkq.wire): about twice the single-enqueue
    throughput of redis-py's path, and never a silent resend, which pushes a job twice
    when a connection broke after the command reached Redis. Every push, to one queue,
    several, or the schedule, is one write and its replies.

    A push to a queue was a Lua script doing SADD and LPUSH: that cost Redis about 9 us a
    push against about 2 for the two commands, and the client a slower round trip."""

    MAX_IDLE = 16

    def __init__(self, client: redis.Redis) -> None:
        self._new = wire.connection_factory(client)
        self._idle: list[Any] = []  # list.pop/append are atomic: shared between threads
        self._client = client
        self._scripts: dict[str, Any] = {}

    def run(self, commands: list[tuple]) -> Any:
        return self._on_idle(wire.run_commands, *commands)

    def run_script(self, name: str, args: tuple) -> Any:
        """EVALSHA of a push script (EVAL after NOSCRIPT), on a pooled connection."""
        script = self._scripts.get(name) or self._scripts.setdefault(name, scripts.load(self._client, name))
        return self._on_idle(wire.run_script, script.sha, script.script, args)

    def _on_idle(self, run: Callable[..., Any], *args: Any) -> Any:
        try:
            conn = self._idle.pop()
        except IndexError:
            conn = self._new()
        try:
            return run(conn, *args)
        except wire.Unanswered as exc:
            if wire.readonly(exc):  # Sentinel's connection dropped itself on READONLY
                raise redis.ReadOnlyError(str(exc)) from None
            raise
        finally:
            self._give(conn)  # in step, or disconnected by wire after a failure

    def _give(self, conn: Any) -> None:
        if len(self._idle) < self.MAX_IDLE:
            self._idle.append(conn)
        else:
            conn.disconnect()


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
