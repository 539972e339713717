"""Rate limiters shared by the whole fleet: every host, child and thread on one Redis.

    stripe = forkq.limiter.concurrent("stripe", 5)          # at most 5 calls at once
    mail = forkq.limiter.window("mail", 100, "minute")      # at most 100 in any 60 s

    @forkq.job
    def charge(order_id):
        with stripe:
            ...                                             # the call being limited

Made once at import and shared by every thread; each process (a forked child too) talks
to Redis through its own connections. A limiter that stays full for `wait_timeout` seconds
raises forkq.OverLimit, which the worker answers by scheduling the job again later
without using one of its retries (see forkq.retry.overlimit_delay).

Every attempt is one Lua call that reads Redis's clock (TIME), never the host's: hosts
drift, and a lease or a window measured by two clocks would admit too many.
"""

from __future__ import annotations

import contextlib
import contextvars
import random
import secrets
import threading
import time
from typing import Any

import redis

from . import client as _client
from . import keys, logs, scripts
from .errors import OverLimit

__all__ = ["Concurrent", "Lease", "Window", "Bucket", "concurrent", "window", "bucket"]

log = logs.get("forkq.limiter")

PREFIX = keys.LIMITER_PREFIX
INTERVALS = {"second": 1, "minute": 60, "hour": 3600, "day": 86400}
# Waits between attempts while a limiter is full: the first short, growing to a cap, each
# drawn at random below its step so waiters that found it full together do not all come
# back together. At the cap a waiting thread costs Redis 5 to 10 calls a second.
FIRST_PAUSE_S = 0.01
MAX_PAUSE_S = 0.2
# A wait is slept in slices of at most this: a time limit (or a hard stop) lands in a
# thread only between bytecodes, and one long time.sleep toward a window's hint would hold
# the job seconds past its limit. Slices cost no Redis call.
SLICE_S = 0.1

_scripts: dict[str, Any] = {}
_scripts_lock = threading.Lock()


def _script(name: str, conn: redis.Redis) -> Any:
    """A limiter script, loaded once per process. Every call passes its own connection, so
    the client a script was loaded with (maybe the master's, before a fork) is never used."""
    script = _scripts.get(name)
    if script is None:
        with _scripts_lock:
            script = _scripts.get(name) or _scripts.setdefault(name, scripts.load(conn, name))
    return script


def _check_name(name: Any) -> str:
    if type(name) is not str or not name.strip():
        raise ValueError(f"a limiter's name must be a non-empty str, not {name!r}")
    return name


def _check_count(what: str, value: Any) -> int:
    if type(value) is not int or value < 1:
        raise ValueError(f"{what} must be an int of at least 1, not {value!r}")
    return value


def _check_seconds(what: str, value: Any, zero: bool) -> float:
    # compared, not passed to math.isfinite, which raises on an int past a float's range;
    # NaN fails every comparison
    ok = type(value) in (int, float) and (value >= 0 if zero else value > 0) and value <= 1e9
    if not ok:
        above = "0 or more" if zero else "above 0"
        raise ValueError(f"{what} must be a number of seconds {above} (at most 1e9), not {value!r}")
    return float(value)


def _check_interval(value: Any) -> float:
    if type(value) is str:
        if value not in INTERVALS:
            raise ValueError(f"interval must be a number of seconds or one of "
                             f"{', '.join(map(repr, INTERVALS))}, not {value!r}")
        return float(INTERVALS[value])
    seconds = _check_seconds("interval", value, zero=False)
    if seconds < 0.001:
        raise ValueError(f"interval must be at least 0.001 s (Redis's clock is read in ms), not {value!r}")
    return seconds


def _sleep(seconds: float) -> None:
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        time.sleep(min(left, SLICE_S))


class _Limiter:
    kind = ""

    def __init__(self, name: str, wait_timeout: float, client: "_client.Client | None") -> None:
        self.name = _check_name(name)
        self.wait_timeout = _check_seconds("wait_timeout", wait_timeout, zero=True)
        if client is not None and not isinstance(client, _client.Client):
            raise ValueError(f"client must be a forkq.Client or None, not {type(client).__name__}")
        self.client = client
        self.key = keys.limiter(name, self.kind)

    def _redis(self) -> redis.Redis:
        # looked up at each attempt: the default client may be replaced with configure(),
        # and a Client opens new connections in a forked child (Client._connected)
        return (self.client or _client.default_client()).redis

    def _wait(self, attempt: Any) -> None:
        """Call attempt() -> (admitted, hint ms or None) until admitted, or raise OverLimit
        once wait_timeout has passed, sleeping between attempts."""
        for nap in self._naps(attempt):
            _sleep(nap)

    async def _await(self, attempt: Any) -> None:
        """_wait for a coroutine (`async with limiter:`): each nap awaited, so the other
        async jobs of the process's loop run meanwhile. An attempt itself is one Redis call,
        a round trip the loop waits for, as it waits for any sync call."""
        import asyncio
        for nap in self._naps(attempt):
            await asyncio.sleep(nap)

    def _naps(self, attempt: Any) -> Any:
        """The attempts, each made as the previous nap it yielded ends: returns once one
        admitted, raises OverLimit once wait_timeout has passed. A hint is when the
        limiter can next admit at the earliest: a window's oldest entry leaves then, and
        nothing frees it sooner."""
        admitted, hint = attempt()
        if admitted:
            return
        deadline = time.monotonic() + self.wait_timeout
        pause = FIRST_PAUSE_S
        while True:
            left = deadline - time.monotonic()
            if hint is not None and hint / 1000 > left:
                # still full when the wait would end: no use waiting, nor asking Redis again
                raise OverLimit(f"rate limiter {self.name!r} ({self.describe()}) has no room for "
                                f"{hint / 1000:g} s more, past its wait_timeout of {self.wait_timeout:g} s",
                                self.name)
            if left <= 0:
                break
            nap = random.uniform(pause / 2, pause)
            if hint is not None:
                nap += hint / 1000  # come back once there is room, spread by the nap
            yield min(nap, left)
            pause = min(pause * 2, MAX_PAUSE_S)
            admitted, hint = attempt()
            if admitted:
                return
        raise OverLimit(f"rate limiter {self.name!r} ({self.describe()}) stayed full for "
                        f"{self.wait_timeout:g} s", self.name)

    def describe(self) -> str:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<forkq.limiter {self.name!r}: {self.describe()}>"


class Lease:
    """One held slot of a concurrent limiter. release() gives it back (also on leaving a
    `with lease:`); a lease not released lapses by itself after the limiter's lock_timeout."""

    __slots__ = ("limiter", "token", "_released", "_lapses")

    def __init__(self, limiter: "Concurrent | None", token: str) -> None:
        self.limiter = limiter
        self.token = token
        self._released = limiter is None  # forkq.testing's: nothing to give back
        # when it lapses, on this host's monotonic clock (taken just after Redis admitted
        # it, so at most a round trip late): a lapsed lease nobody has swept yet is still
        # in the zset, and its release must report the lapse all the same
        self._lapses = 0.0 if limiter is None else time.monotonic() + limiter.lock_timeout

    def release(self) -> bool:
        """Give the slot back; True if this lease still held it. False if it had lapsed
        (the call ran past lock_timeout: the slot may already be someone else's, and is
        left to them), was released before, or Redis could not be reached (the lease then
        lapses by itself). Never raises: a job whose limited call succeeded must not fail,
        and run that call again on its retry, because the give-back did not arrive."""
        if self._released:
            return False
        self._released = True
        limiter = self.limiter
        assert limiter is not None  # the None lease of forkq.testing is released from the start
        try:
            # only this lease's own token: a lapsed lease re-taken by another holder has
            # that holder's token, which this never removes
            removed = limiter._redis().zrem(limiter.key, self.token)
        except redis.RedisError as exc:
            log.warning("could not release a rate limiter's lease; it lapses by itself",
                        limiter=limiter.name, lock_timeout=limiter.lock_timeout, error=str(exc))
            return False
        lapsed = not removed or time.monotonic() > self._lapses
        if lapsed:
            log.warning("a rate limiter's lease lapsed before its release (held past its "
                        "lock_timeout): the limiter may have admitted more than its size",
                        limiter=limiter.name, lock_timeout=limiter.lock_timeout, size=limiter.size)
        return not lapsed

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


_FREE = Lease(None, "")


# The leases taken by `with limiter:` blocks of concurrent limiters, as (limiter, lease),
# innermost last, in this thread or asyncio task: async jobs' coroutines share one thread,
# and interleave at each await. A tuple replaced at each change, so a task started inside a
# `with` cannot take the lease of the task that started it. One variable for all limiters:
# a context keeps every variable ever set in it, and a processor thread's lasts as long as
# the thread, so one per limiter grew it by one for each limiter a job made on the fly.
_HELD: contextvars.ContextVar[tuple[tuple["Concurrent", Lease], ...]] = contextvars.ContextVar(
    "forkq_limiter_held", default=())


class Concurrent(_Limiter):
    """At most `size` holders at once across everyone sharing the Redis."""

    kind = "concurrent"

    def __init__(self, name: str, size: int, *, wait_timeout: float = 5, lock_timeout: float = 30,
                 client: "_client.Client | None" = None) -> None:
        self.size = _check_count("size", size)
        self.lock_timeout = _check_seconds("lock_timeout", lock_timeout, zero=False)
        super().__init__(name, wait_timeout, client)
        self._lease_ms = max(1, round(self.lock_timeout * 1000))

    def describe(self) -> str:
        return f"concurrent, size {self.size}, lock_timeout {self.lock_timeout:g} s"

    def acquire(self) -> Lease:
        """Take a slot, waiting up to wait_timeout for one; raise forkq.OverLimit if none
        came free. Release the returned Lease (or use it in a `with`)."""
        if _client.test_push is not None:
            return _FREE  # forkq.testing's fake() or inline(): no Redis, everyone admitted
        token = secrets.token_hex(8)
        with self._given_back(token):
            self._wait(lambda: self._attempt(token))
            return Lease(self, token)

    async def acquire_async(self) -> Lease:
        """acquire() for a coroutine: the wait for a slot is awaited, so the process's other
        async jobs run meanwhile (a blocking wait would stall every one of them)."""
        if _client.test_push is not None:
            return _FREE
        token = secrets.token_hex(8)
        with self._given_back(token):
            await self._await(lambda: self._attempt(token))
            return Lease(self, token)

    @contextlib.contextmanager
    def _given_back(self, token: str) -> Any:
        """Around an admission: interrupted (a time limit's exception or a task's
        cancellation, Ctrl-C: delivered as the script's reply comes in) or cut off after
        Redis may have admitted the token, give it back now, or the slot stays taken until
        lock_timeout, by nobody. OverLimit means it never was admitted."""
        try:
            yield
        except OverLimit:
            raise
        except BaseException:
            self._give_back(token)
            raise

    def _give_back(self, token: str) -> None:
        try:
            self._redis().zrem(self.key, token)
        except Exception:  # lapses by itself after lock_timeout
            pass

    def _attempt(self, token: str) -> tuple[bool, None]:
        conn = self._redis()
        reply = _script("limiter_concurrent", conn)(keys=[self.key], args=[self.size, self._lease_ms, token],
                                                    client=conn)
        # the earliest lease's lapse is no hint: a holder may release any moment before it
        return reply[0] == 1, None

    def __enter__(self) -> Lease:
        return self._hold(self.acquire())

    async def __aenter__(self) -> Lease:
        return self._hold(await self.acquire_async())

    def _hold(self, lease: Lease) -> Lease:
        try:
            _HELD.set(_HELD.get() + ((self, lease),))
        except BaseException:  # interrupted here, __exit__ would never give it back
            lease.release()
            raise
        return lease

    async def __aexit__(self, *exc: Any) -> None:
        self.__exit__()

    def __exit__(self, *exc: Any) -> None:
        held = _HELD.get()
        i = len(held) - 1
        while held[i][0] is not self:  # this limiter's innermost: others' may be inside it
            i -= 1
        _HELD.set(held[:i] + held[i + 1:])
        held[i][1].release()


class _Counting(_Limiter):
    """A limiter that counts entries: `with limiter:` or acquire() takes one, and there is
    nothing to give back."""

    script = ""

    def __init__(self, name: str, count: int, interval: float | str, wait_timeout: float,
                 client: "_client.Client | None") -> None:
        self.count = _check_count("count", count)
        self.interval = _check_interval(interval)
        super().__init__(name, wait_timeout, client)
        self._interval_ms = max(1, round(self.interval * 1000))

    def describe(self) -> str:
        return f"{self.kind}, {self.count} per {self.interval:g} s"

    def acquire(self) -> None:
        """Count one entry, waiting up to wait_timeout for room; raise forkq.OverLimit if
        none came."""
        if _client.test_push is not None:
            return  # forkq.testing's fake() or inline(): no Redis, everyone admitted
        token = secrets.token_hex(8)
        self._wait(lambda: self._attempt(token))

    def _attempt(self, token: str) -> tuple[bool, int | None]:
        conn = self._redis()
        reply = _script(self.script, conn)(keys=[self.key], args=[self.count, self._interval_ms, token],
                                           client=conn)
        return (True, None) if reply[0] == 1 else (False, int(reply[2]))

    async def acquire_async(self) -> None:
        """acquire() for a coroutine: the wait for room is awaited, so the process's other
        async jobs run meanwhile."""
        if _client.test_push is not None:
            return
        token = secrets.token_hex(8)
        await self._await(lambda: self._attempt(token))

    def __enter__(self) -> None:
        self.acquire()

    def __exit__(self, *exc: Any) -> None:
        pass

    async def __aenter__(self) -> None:
        await self.acquire_async()

    async def __aexit__(self, *exc: Any) -> None:
        pass


class Window(_Counting):
    """At most `count` entries in any `interval` seconds (a sliding window)."""

    kind = "window"
    script = "limiter_window"


class Bucket(_Counting):
    """At most `count` entries in each `interval` window, windows aligned to the clock (a
    "minute" bucket refills at each whole minute)."""

    kind = "bucket"
    script = "limiter_bucket"


def concurrent(name: str, size: int, *, wait_timeout: float = 5, lock_timeout: float = 30,
               client: "_client.Client | None" = None) -> Concurrent:
    """A limiter of at most `size` holders at once, fleet-wide. A holder's slot lapses
    `lock_timeout` seconds after it was taken if it is not released first. `client`: the
    forkq.Client whose Redis holds it (the default client's otherwise)."""
    return Concurrent(name, size, wait_timeout=wait_timeout, lock_timeout=lock_timeout, client=client)


def window(name: str, count: int, interval: float | str, *, wait_timeout: float = 5,
           client: "_client.Client | None" = None) -> Window:
    """A limiter of at most `count` entries in any sliding `interval` (seconds, or
    "second", "minute", "hour", "day"), fleet-wide."""
    return Window(name, count, interval, wait_timeout, client)


def bucket(name: str, count: int, interval: float | str, *, wait_timeout: float = 5,
           client: "_client.Client | None" = None) -> Bucket:
    """A limiter of at most `count` entries per fixed `interval` window (seconds, or
    "second", "minute", "hour", "day"), windows aligned to Redis's clock, fleet-wide."""
    return Bucket(name, count, interval, wait_timeout, client)
