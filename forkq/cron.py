"""Periodic jobs: `forkq.periodic(...)` declares an entry at import; every forkq process
that runs the app computes its due times locally and, at each one, races the others to a
Lua script that pushes the job once across the fleet.

Expressions are parsed and walked by cronsim, which follows Debian's cron (lists, ranges,
steps, month and day names, `L`, `#`, a leading seconds field). forkq adds the `@hourly`
family, time zones as zoneinfo names, and its own mapping of wall-clock times onto real
instants, so that the DST rule below holds for every expression, with or without seconds:

- An entry at fixed minutes and hours (neither field starts with `*`: `30 2 * * *`,
  `0 9,17 * * 1-5`) follows the wall clock. A time that a spring-forward skips runs once,
  at the first minute after the gap (02:30 runs at 03:00 in Europe/Paris); a time that a
  fall-back repeats runs once, at its first occurrence.
- Any other entry (`*/15 * * * *`, `0 */2 * * *`) is matched against every real instant's
  local time: it keeps its pace through a change, so the repeated hour's matches run twice
  (they are distinct instants) and a skipped hour has none.
"""

from __future__ import annotations

import hashlib
import math
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import redis
from cronsim import CronSim, CronSimError

from . import keys, logs, payload, scripts
from .errors import ConfigError
from .fetch import refusal, writes_refused

if TYPE_CHECKING:
    from .jobs import Job

log = logs.get("forkq.cron")

ALIASES = {"@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *", "@monthly": "0 0 1 * *",
           "@weekly": "0 0 * * 0", "@daily": "0 0 * * *", "@midnight": "0 0 * * *",
           "@hourly": "0 * * * *"}

# Candidates a lookup may pass over: only a wall-clock entry inside a repeated hour skips
# any (at most the matches of that hour: 3,600 for one that runs every second of it)
_SKIP_LIMIT = 10_000
# The longest a check thread sleeps without looking at the wall clock again: a clock that
# an NTP step or a resumed VM moved forward must not keep a due time waiting long
_MAX_SLEEP_S = 10.0


class CronError(ConfigError, ValueError):
    """A periodic entry forkq refuses; the message names the entry and what is wrong.

    A ConfigError, so `forkq start` and `forkq cron` print it as one line and exit
    non-zero; a ValueError, as Python code would expect of a bad argument."""


def _zone(tz: Any, where: str) -> ZoneInfo:
    if isinstance(tz, ZoneInfo):
        return tz
    if isinstance(tz, timezone) and tz.utcoffset(None) == timedelta(0):
        return ZoneInfo("UTC")
    if type(tz) is not str:
        raise CronError(f"{where}: tz must be a time zone name such as 'Europe/Paris', "
                        f"not {type(tz).__name__} ({tz!r})")
    try:
        return ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError):
        pass
    import difflib
    import zoneinfo
    known = zoneinfo.available_timezones()
    if not known:
        hint = " (this system has no time zone database: pip install tzdata)"
    else:
        close = difflib.get_close_matches(tz, sorted(known), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise CronError(f"{where}: unknown time zone {tz!r}{hint}")


class Schedule:
    """A cron expression in a time zone; due times are whole epoch seconds."""

    def __init__(self, expression: str, tz: Any = "UTC", where: str = "cron") -> None:
        if type(expression) is not str:
            raise CronError(f"{where}: the expression must be a str, not {type(expression).__name__}")
        self.expression = expression
        self.tz = _zone(tz, where)
        text = ALIASES.get(expression.strip().lower(), expression)
        parts = text.split()
        if text.strip().startswith("@"):
            raise CronError(f"{where}: unknown cron alias {expression.strip()!r} (known: "
                            f"{', '.join(ALIASES)}; @reboot has no meaning for a fleet)")
        if len(parts) not in (5, 6):
            raise CronError(f"{where}: bad cron expression {expression!r}: it has {len(parts)} "
                            "fields, not 5 (minute hour day month weekday) or 6 (second first)")
        if len(parts) == 5:
            parts.insert(0, "0")
        # cronsim keeps its own DST handling for 5-field expressions in a zone: giving it
        # six fields always, and naive or real datetimes, leaves the mapping to forkq
        self.fields = " ".join(parts)
        self.wall = not (parts[1].startswith("*") or parts[2].startswith("*")) and \
            self.tz.key not in ("UTC", "Etc/UTC")
        try:
            CronSim(self.fields, datetime(2000, 1, 1))
        except CronSimError as exc:
            raise CronError(f"{where}: bad cron expression {expression!r} "
                            f"({str(exc).lower()} field)") from None
        if self.next_after(time.time()) is None:
            raise CronError(f"{where}: cron expression {expression!r} never comes due")

    @property
    def spec(self) -> str:
        """What identifies the timing across the fleet (see cron_boot.lua)."""
        return f"{self.fields} {self.tz.key}"

    def local(self, due: float) -> datetime:
        return datetime.fromtimestamp(due, self.tz)

    def next_after(self, t: float) -> int | None:
        """The first due time strictly after `t` (epoch seconds), None if none comes in
        the 50 years cronsim looks ahead."""
        local = datetime.fromtimestamp(t, self.tz).replace(microsecond=0)
        start = local.replace(tzinfo=None) if self.wall else local
        return self._first(CronSim(self.fields, start), lambda due: due > t)

    def latest_at(self, t: float) -> int | None:
        """The last due time at or before `t`, None if none in the 50 years before it."""
        if not self.wall:
            # from the next whole second, found from epoch seconds: an aware datetime plus
            # a timedelta is wall-clock arithmetic, which drops a repeated hour's fold
            after = datetime.fromtimestamp(math.floor(t) + 1, self.tz)
            return self._first(CronSim(self.fields, after, reverse=True), lambda due: due <= t)
        local = datetime.fromtimestamp(t, self.tz).replace(microsecond=0)
        wall = local.replace(tzinfo=None)
        if local.fold:
            # the second pass of a repeated hour: the wall times still ahead in it were
            # real (in their first pass) before now, so they are due times before now
            # (never None: self.tz is a ZoneInfo, so `local` is aware)
            wall += local.replace(fold=0).utcoffset() - local.utcoffset()  # type: ignore[operator]
        return self._first(CronSim(self.fields, wall + timedelta(seconds=1), reverse=True),
                           lambda due: due <= t)

    def _first(self, candidates: CronSim, wanted: Callable[[int], bool]) -> int | None:
        for _ in range(_SKIP_LIMIT):
            try:
                found = next(candidates)
            except StopIteration:
                return None
            due = self._instant(found)
            if wanted(due):
                return due
        return None

    def _instant(self, found: datetime) -> int:
        if found.tzinfo is not None:
            return round(found.timestamp())
        # a wall-clock time: its first occurrence when repeated, and when skipped the
        # first minute after the gap (as Debian's cron runs skipped jobs right after it)
        aware = found.replace(tzinfo=self.tz, fold=0)
        probe = found.replace(second=0)
        for _ in range(24 * 60):
            if _exists(aware):
                return round(aware.timestamp())
            probe += timedelta(minutes=1)
            aware = probe.replace(tzinfo=self.tz)
        return round(aware.timestamp())  # no zone has a gap of a day; never reached


def _exists(aware: datetime) -> bool:
    back = aware.astimezone(timezone.utc).astimezone(aware.tzinfo)
    return back.replace(tzinfo=None, fold=0) == aware.replace(tzinfo=None, fold=0)


def _stamp(raw: Any) -> float:
    """A due time stored in an entry's hash; -inf for none, or for one that is no number."""
    try:
        return float(raw) if raw else -math.inf
    except ValueError:
        return -math.inf


def jid_for(name: str, due: int) -> str:
    """The jid of an entry's job for one due time: the same in every process, so the job
    one process pushed can be found by anyone who knows the entry and the time."""
    return hashlib.blake2b(f"{name}\n{due}".encode(), digest_size=12).hexdigest()


@dataclass(frozen=True)
class Entry:
    """One periodic entry: a schedule, and the job it pushes at each due time."""

    name: str
    schedule: Schedule = field(compare=False)
    job: str
    queue: str
    args: tuple = ()
    options: tuple = ()  # (key, value) pairs for the payload: retry, backtrace, tags...
    max_delay: float | None = None
    kwargs: tuple = ()  # (name, value) pairs: the job's keyword arguments

    @property
    def signature(self) -> tuple:
        # what makes a second declaration under the same name the same entry
        import json
        return (self.schedule.spec, self.job, self.queue, json.dumps(self.args),
                json.dumps(dict(self.options), sort_keys=True), self.max_delay,
                json.dumps(dict(self.kwargs), sort_keys=True))

    def payload(self, due: int, now: float) -> dict[str, Any]:
        job = payload.build(self.job, list(self.args), self.queue, now=now,
                            kwargs=dict(self.kwargs) or None, **dict(self.options))
        job["jid"] = jid_for(self.name, due)
        # a job pushed late (a missed due time caught up) can tell which time it stands for
        job["cron"] = {"name": self.name, "due": due}
        job["enqueued_at"] = now
        if "expires_in" in job:  # counted from the due time, not from a late push
            payload.stamp_expiry(job, due)
        return job


ENTRIES: dict[str, Entry] = {}


def periodic(expression: str, job: Job[..., Any] | str, args: list | tuple = (), *, name: str | None = None,
             tz: str | ZoneInfo = "UTC", queue: str | None = None, retry: bool | int | None = None,
             max_delay: float | None = None, kwargs: dict[str, Any] | None = None,
             **options: Any) -> Entry:
    """Push `job` with `args` (and keyword arguments `kwargs`) at each due time of `expression` in time zone `tz`, once
    across every forkq process running this app. Call it at import, in the app's jobs
    module.

    job: a `@forkq.job` function, or a job name (a job another language's worker runs).
    name: the entry's name, unique in the app and shared by every process (default: the
    job's name); give one to run a job on two schedules.
    tz: a zoneinfo name. The default, UTC, is the same on every host; a host's local zone
    is not used, as hosts in other zones would push at other times.
    queue, retry and other payload options default to the job's own.
    max_delay: seconds after which a due time that no forkq reached (all were down) is
    skipped instead of run late, by Redis's clock (the fleet's, not the host's); None
    (the default) runs the latest missed one once.

    Raises CronError (a ValueError) for a bad expression, an unknown time zone, a name
    declared twice with other settings, and TypeError for arguments that are not
    JSON-native."""
    from .jobs import Job
    if options.get("unique_for") not in (None, False) or "unique_until" in options:
        raise CronError(f"forkq.periodic({expression!r}): unique_for is refused here: an entry "
                        "already pushes at most one job per due time")
    if isinstance(job, Job):
        job_name = job.name
        merged = _options(expression, lambda: job.options(
            **({} if queue is None else {"queue": queue}),
            **({} if retry is None else {"retry": retry}), **options).options)
    elif type(job) is str and job:
        job_name = job
        merged = _options(expression, lambda: payload.check_options(
            {"queue": "default" if queue is None else queue,
             "retry": payload.check_retry(True if retry is None else retry), **options}))
    elif callable(job):
        raise CronError(f"forkq.periodic({expression!r}): {getattr(job, '__qualname__', job)!r} is "
                        "not a job: decorate it with @forkq.job, or give a job name")
    else:
        raise CronError(f"forkq.periodic({expression!r}): job must be a @forkq.job function or "
                        f"a job name, not {job!r}")
    # a job's own unique_for is ignored: the push script does not take locks, and a worker
    # given the option would try to release one nobody took
    merged.pop("unique_for", None)
    merged.pop("unique_until", None)
    entry_name = job_name if name is None else name
    if type(entry_name) is not str or not entry_name or "\n" in entry_name:
        raise CronError(f"forkq.periodic({expression!r}): name must be a non-empty str without "
                        f"a newline, not {entry_name!r}")
    where = f"forkq.periodic {entry_name!r}"
    try:
        checked = payload.check_args(args)
        keywords = payload.check_kwargs(kwargs) if kwargs is not None else {}
        if isinstance(job, Job):
            job.check_call(checked, keywords)
        queue_name = payload.check_queue(merged["queue"])
    except TypeError as exc:
        raise TypeError(f"{where}: {exc}") from None
    except ValueError as exc:
        raise CronError(f"{where}: {exc}") from None
    # compared, not passed to math.isfinite, which raises OverflowError on an int past a float
    if max_delay is not None and (type(max_delay) not in (int, float)
                                  or not 0 < max_delay <= sys.float_info.max):
        raise CronError(f"{where}: max_delay must be a number of seconds above 0, or None, "
                        f"not {max_delay!r}")
    schedule = Schedule(expression, tz, where)
    entry = Entry(entry_name, schedule, job_name, queue_name, tuple(checked),
                  tuple((k, v) for k, v in merged.items() if k != "queue"), max_delay,
                  tuple(keywords.items()))
    existing = ENTRIES.get(entry_name)
    if existing is not None and existing.signature != entry.signature:
        raise CronError(f"{where}: an entry of that name is already declared "
                        f"({existing.schedule.expression!r} in {existing.schedule.tz.key}, job "
                        f"{existing.job}); give each a name= of its own")
    if existing is not None:
        return existing  # the same module imported twice: the same entry
    ENTRIES[entry_name] = entry
    return entry


def _options(expression: str, check: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The payload options an entry's jobs get, checked as an enqueue checks them."""
    try:
        return check()
    except TypeError as exc:
        raise TypeError(f"forkq.periodic({expression!r}): {exc}") from None
    except ValueError as exc:
        raise CronError(f"forkq.periodic({expression!r}): {exc}") from None


REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)
RETRY_S = 5.0  # after a push Redis refused, before the entry's next try
# cron_push.lua's verdicts on a due time
PUSHED, DONE, NOT_YET, TOO_LATE = 1, 0, -1, -2
# How far this host's clock may stray from Redis's before its log says so: a reading taken
# before a call looks behind by the round trip, which a busy Redis stretches past a second
SKEW_WARN_S = 2.0
BEHIND_SLACK_S = 1.0


def _lag() -> str:
    """cron_boot.lua's limit on how far a boot's `since` may lag Redis's clock: the slack
    a host behind keeps (tests set it to inf to drive Cron by a clock of their own)."""
    return repr(BEHIND_SLACK_S) if math.isfinite(BEHIND_SLACK_S) else ""


class Cron:
    """A process's periodic check: sleeps until the earliest next due time of its entries
    (nothing in Redis meanwhile), then offers each due entry's job to the push script.

    Missed runs: at start, an entry whose latest due time at or before now is newer than
    what the fleet pushed (every forkq was down at that time) has that one due time pushed
    at once, never the ones before it; with max_delay, only if it is that recent by
    Redis's clock (the push script judges it: a host whose clock runs behind would find
    recent a due time the fleet's clock passed long ago). An entry first seen, or a
    schedule of it first seen, owes nothing from before that moment.

    Redis's clock is the fleet's: `now` given to boot, check and wait_time is this host's
    clock, set to Redis's (learnt from the scripts' replies, which carry Redis's TIME; the
    scripts refuse a due time Redis's clock has not reached). A host ahead would otherwise
    push early and, as a push marks every due time before it done, take from the hosts on
    time the due times between the two clocks. A host behind is set to within
    BEHIND_SLACK_S of Redis's clock after its first reply; until then it pushes late, or
    skips what max_delay says is too late. Either way its log says so, once."""

    def __init__(self, client: redis.Redis, entries: list[Entry] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.redis = client
        self.entries = list(ENTRIES.values()) if entries is None else entries
        self.clock = clock
        self._push = scripts.load(client, "cron_push")
        self._boot = scripts.load(client, "cron_boot")
        self._next: dict[str, int | None] = {}
        self._held: dict[str, float] = {}  # entries whose push failed: not before this time
        self._ahead = 0.0  # how far this host's clock ran ahead of Redis's at the last reply
        self._skew: str | None = None  # "ahead" or "behind" once the log has said so
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="forkq-cron", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    @property
    def booted(self) -> bool:
        return len(self._next) == len(self.entries)

    def boot(self, now: float) -> None:
        """Mark entries first seen, and find each one's next due time (or a missed one)."""
        host = now
        try:
            *states, clock = self._boot(
                keys=[keys.cron(e.name) for e in self.entries],
                args=[repr(now), keys.CRON_TTL_S, _lag()] + [e.schedule.spec for e in self.entries])
        except redis.ResponseError as exc:
            if writes_refused(exc):
                raise
            # one entry's key that is no hash (WRONGTYPE) failed them all, at every try:
            # each on its own, so only that one stays out, named once
            replies = [self._boot_one(e, now) for e in self.entries]
            states = [state for state, _ in replies]
            clock = next((c for _, c in replies if c is not None), None)
        now = host - self._ahead if clock is None else self._learn(host, clock)
        for entry, state in zip(self.entries, states):
            if state is None:
                self._next[entry.name] = None
                continue
            done = max(_stamp(state[0]), _stamp(state[1]))
            latest = entry.schedule.latest_at(now)
            self._next[entry.name] = latest if latest is not None and latest > done \
                else entry.schedule.next_after(now)

    def _boot_one(self, entry: Entry, now: float) -> tuple[list[Any] | None, Any]:
        """The entry's state and Redis's clock; (None, None) for an entry left out."""
        try:
            state, clock = self._boot(keys=[keys.cron(entry.name)],
                                      args=[repr(now), keys.CRON_TTL_S, _lag(), entry.schedule.spec])
            return state, clock
        except redis.ResponseError as exc:
            if writes_refused(exc):
                raise
            log.error("periodic entry left out: its Redis key cannot be read as forkq's (delete "
                      "it to start the entry afresh)", entry=entry.name, key=keys.cron(entry.name),
                      error=str(exc))
            return None, None

    def _learn(self, host: float, clock: Any) -> float:
        """Take in Redis's clock from a script's reply (`host`: this host's clock read just
        before the call); returns the fleet's now, this host's clock set to Redis's."""
        error = host - float(clock)
        # A host behind keeps BEHIND_SLACK_S of its lag: its reading, taken before the call,
        # looks behind by the round trip, and one taken for ahead would offer each due time
        # before Redis's clock reached it (a refused call each). Not learning the lag at all
        # left a host behind by more than an entry's max_delay skipping every due time.
        self._ahead = error if error > 0 else min(0.0, error + BEHIND_SLACK_S)
        skew = "ahead" if error > SKEW_WARN_S else "behind" if error < -SKEW_WARN_S else None
        if skew != self._skew:
            if skew == "ahead":
                log.warning("this host's clock runs ahead of Redis's: periodic jobs wait for "
                            "Redis's clock (set this host's clock right, NTP)", ahead_s=round(error, 1))
            elif skew == "behind":
                log.warning("this host's clock runs behind Redis's: periodic jobs follow "
                            "Redis's clock (set this host's clock right, NTP)",
                            behind_s=round(-error, 1))
            else:
                log.info("this host's clock agrees with Redis's again", error_s=round(error, 1))
            self._skew = skew
        return host - self._ahead

    def check(self, now: float) -> list[tuple[Entry, int, str]]:
        """Offer every entry due at `now` to the push script; returns (entry, due time,
        jid) for each that this call pushed. Touches Redis only when something is due."""
        if not self.booted:
            self.boot(now)
        host = now
        pushed = []
        for entry in self.entries:
            now = host - self._ahead  # as learnt from the latest reply
            next_due = self._next[entry.name]
            if next_due is None or next_due > now or self._held.get(entry.name, 0.0) > now:
                continue
            # normally next_due itself; the latest one when this process was away (a frozen
            # or suspended VM, a Redis outage): never a backlog of them
            due = entry.schedule.latest_at(now)
            if due is not None:  # None: no due time in the 50 years before now
                try:
                    offered, late = self._offer(entry, due, host)
                except redis.ResponseError as exc:
                    # this entry's push fails (its queue's key holds no list, say): the
                    # due time stays unmarked and is tried again, and the others go on
                    if entry.name not in self._held:
                        log.error("periodic push failed; trying again", entry=entry.name,
                                  queue=entry.queue, error=str(exc))
                    self._held[entry.name] = now + RETRY_S
                    continue
                self._held.pop(entry.name, None)
                if offered == NOT_YET:
                    # not come by Redis's clock: this host's runs ahead (learnt by the
                    # call), and offers it again when Redis's clock reaches it
                    self._next[entry.name] = entry.schedule.next_after(host - self._ahead)
                    continue
                if offered == TOO_LATE:
                    log.warning("periodic due time skipped: no forkq reached it within max_delay",
                                entry=entry.name, due=entry.schedule.local(due).isoformat(),
                                late_s=round(late, 1), max_delay=entry.max_delay)
                elif offered == PUSHED:
                    jid = jid_for(entry.name, due)
                    pushed.append((entry, due, jid))
                    log.info("periodic job pushed", entry=entry.name, job=entry.job,
                             queue=entry.queue, jid=jid, due=entry.schedule.local(due).isoformat(),
                             **({"late_s": round(late, 1)} if late >= 60 else {}))
            self._next[entry.name] = entry.schedule.next_after(now)
        return pushed

    def _offer(self, entry: Entry, due: int, host: float) -> tuple[int, float]:
        """The push script's verdict on the due time (PUSHED by this call, DONE before,
        NOT_YET or TOO_LATE by Redis's clock), and how late it is by that clock."""
        now = host - self._ahead
        job = entry.payload(due, now)
        limit = [] if entry.max_delay is None else [repr(entry.max_delay)]
        offered, clock = self._push(keys=[keys.cron(entry.name)],
                                    args=[due, entry.queue, payload.dumps_new(job), job["jid"],
                                          repr(now), keys.CRON_TTL_S, entry.schedule.spec, *limit])
        self._learn(host, clock)
        return int(offered), float(clock) - due

    def wait_time(self, now: float) -> float:
        """Seconds from `now` to the next check, at most _MAX_SLEEP_S."""
        now -= self._ahead
        waits = [_MAX_SLEEP_S]
        for name, due in self._next.items():
            if due is not None:
                waits.append(max(0.0, due - now, self._held.get(name, 0.0) - now))
        return min(waits)

    def _run(self) -> None:
        refused = False
        while not self._stop.is_set():
            try:
                self.check(self.clock())
                wait = self.wait_time(self.clock())
            except REDIS_ERRORS:
                wait = 1.0  # the fetcher reports the outage; a due time waits for Redis
            except Exception as exc:
                if not writes_refused(exc):
                    log.exception("periodic check failed")
                elif not refused:
                    log.error(f"periodic check: Redis {refusal(exc)}; trying again", error=str(exc))
                refused = writes_refused(exc)
                wait = RETRY_S
            else:
                refused = False
            self._stop.wait(wait)


def status(conn: redis.Redis, entries: list[Entry], now: float) -> list[dict[str, Any]]:
    """Each entry as `forkq cron` shows it: its settings, next due time from `now`, and
    the latest push the fleet made (from Redis)."""
    pipe = conn.pipeline(transaction=False)
    for entry in entries:
        pipe.hmget(keys.cron(entry.name), "pushed", "jid", "pushed_at", "since")
    rows = []
    for entry, (pushed, jid, pushed_at, since) in zip(entries, pipe.execute()):
        due = entry.schedule.next_after(now)
        last = int(float(pushed)) if pushed else None
        rows.append({
            "name": entry.name, "expression": entry.schedule.expression,
            "timezone": entry.schedule.tz.key, "job": entry.job, "queue": entry.queue,
            "args": list(entry.args), "kwargs": dict(entry.kwargs), "max_delay": entry.max_delay,
            "next_due": due, "next_due_local": None if due is None else entry.schedule.local(due).isoformat(),
            "last_pushed": last,
            "last_pushed_local": None if last is None else entry.schedule.local(last).isoformat(),
            "last_pushed_at": float(pushed_at) if pushed_at else None,
            "last_jid": jid.decode() if isinstance(jid, bytes) else jid,
            "since": float(since) if since else None,
        })
    return rows
