"""Sidekiq's job payload: build it, check arguments, parse what a queue holds."""

from __future__ import annotations

import base64
import json
import math
import re
import sys
import time
import zlib
from random import getrandbits
from collections.abc import Iterable
from typing import Any, NoReturn

import orjson

from .errors import MalformedPayload

_SCALARS = frozenset({str, int, float, bool, type(None)})
_encode = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode
_fast_encode = orjson.dumps
_fast_decode = orjson.loads
_FastDecodeError = orjson.JSONDecodeError
# orjson reads an integer beyond 64 bits as a float, silently losing digits; a Ruby
# bignum in a Sidekiq payload must survive, so such payloads take the standard parser
_LONG_NUMBER = re.compile(r"[0-9]{19}").search
# for bytes (what a worker reads), mapping every digit to 0 and looking for a run of 19
# takes a third of the regex's time, which is more than orjson takes to parse a payload
_DIGITS_TO_ZERO = bytes.maketrans(b"123456789", b"000000000")
_LONG_RUN = b"0" * 19


def _decode(raw: bytes | str) -> Any:
    """json.loads, about 5x faster. orjson refuses what json accepts (NaN, lone surrogate
    escapes, UTF-16) and would round long integers: those go to json.loads, so what a
    payload means and how a bad one is reported stay exactly json's."""
    if (_LONG_RUN not in raw.translate(_DIGITS_TO_ZERO) if type(raw) is bytes
            else _LONG_NUMBER(raw) is None):  # type: ignore[arg-type]  # a str here
        try:
            return _fast_decode(raw)
        except _FastDecodeError:
            pass
    return json.loads(raw)


def sendable(text: str) -> bool:
    """Whether redis-py can send this str: JSON's "\\udc80" parses to a lone surrogate
    that UTF-8 cannot carry, and one such argument fails the whole call or pipeline it
    rides in (a heartbeat, a claim with the acks batched on it)."""
    if text.isascii():
        return True
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def new_jid() -> str:
    # 12 random bytes as Sidekiq does; `random` is reseeded in forked children by CPython,
    # and a jid is an identifier, not a secret, so the cheap generator is the right one.
    return "%024x" % getrandbits(96)


def dumps(job: dict[str, Any]) -> str:
    """Re-encode a payload read from Redis: json's rules, so a NaN that json.loads let in
    raises ValueError here (orjson would write null and change the job)."""
    return _encode(job)


def dumps_new(job: dict[str, Any]) -> bytes | str:
    """Encode a payload built from checked args (finite floats only, str keys): orjson,
    about 10x faster than json, with json for what orjson refuses (integers beyond 64
    bits, lone surrogates). Both write compact JSON that Sidekiq reads the same way."""
    try:
        return _fast_encode(job)
    except TypeError:
        return _encode(job)


# Ruby's JSON, which Sidekiq reads payloads with, parses at most 100 levels of arrays and
# objects. A Ruby Sidekiq server's poller takes a job out of `schedule` or `retry` before it
# parses it, so a payload nested deeper is lost when one polls it. An argument sits inside
# the payload object and its args list (or kwargs object), an option inside the payload.
ARG_ROOM = 98
OPTION_ROOM = 99
_UNLIMITED = 1 << 62  # for values that never ride in a payload (a job's result)


def _native(value: Any, room: int = _UNLIMITED) -> bool:
    """Whether value is JSON-native, its strings UTF-8 text (_utf8), and it nests at most
    `room` levels of lists and dicts."""
    kind = type(value)
    if kind in _SCALARS:
        if kind is str:  # isascii first: it costs nothing, and nearly every str is ASCII
            return value.isascii() or sendable(value)
        return kind is not float or math.isfinite(value)
    if kind is list:
        room -= 1
        return room >= 0 and all(_native(v, room) for v in value)
    if kind is dict:
        room -= 1
        return room >= 0 and all(type(k) is str and (k.isascii() or sendable(k)) and _native(v, room)
                                 for k, v in value.items())
    return False


def _utf8(text: str) -> bool:
    """Whether a str is text a payload may carry. A lone surrogate (what os.fsdecode makes
    of a file name that is not UTF-8) is not: json writes it as a "\\udc80" escape that
    Ruby's JSON parses into a string it then cannot write, so a Ruby Sidekiq poller that
    takes the job out of `schedule` or `retry` loses it; forkq's own push failed deep in
    redis-py with UnicodeEncodeError, after any earlier batch of an enqueue_many went in."""
    return text.isascii() or sendable(text)


def _first_bad(value: Any, path: str, room: int = _UNLIMITED) -> tuple[str, Any]:
    """(where, what) of the first value _native refuses; what is a list or dict when it
    is one nested past `room`."""
    kind = type(value)
    if (kind is list or kind is dict) and room <= 0:
        return path, value
    if kind is list:
        for i, v in enumerate(value):
            if not _native(v, room - 1):
                return _first_bad(v, f"{path}[{i}]", room - 1)
    elif kind is dict:
        for k, v in value.items():
            if type(k) is not str or not _utf8(k):
                return f"{path} key {k!r}", k
            if not _native(v, room - 1):
                return _first_bad(v, f"{path}[{k!r}]", room - 1)
    return path, value


def _refusal(where: str, bad: Any) -> str:
    """Why a value found by _first_bad cannot go into a payload."""
    if type(bad) is str:
        return (f"{where} is {bad!r}, a str holding a lone surrogate, which is no UTF-8 text (a "
                "file name os.fsdecode could not decode, say): a payload carries text only; pass "
                "such a name as os.fsencode(name).hex() or with errors='backslashreplace'")
    return (f"{where} is {bad!r} ({type(bad).__name__}); forkq accepts only JSON-native values: "
            "None, bool, int, float (finite), str, list, dict with str keys")


def bulk_item(args: Any) -> Any:
    """One item of a bulk push as a list, or as given for check_args to refuse: a string
    is not a list of its characters, nor a dict a list of its keys."""
    if type(args) in (list, tuple) or isinstance(args, (str, bytes, bytearray, dict)):
        return args
    try:
        return list(args)
    except TypeError:
        return args


def check_args(args: Any) -> list:
    """Return args as a list, or raise TypeError naming the first value JSON can't carry."""
    if type(args) is tuple:
        args = list(args)
    if type(args) is not list:
        raise TypeError(f"job args must be a list or tuple, not {type(args).__name__}")
    i = 0
    try:
        for i, v in enumerate(args):
            if not _native(v, ARG_ROOM):
                _refuse(v, f"args[{i}]")
    except RecursionError:
        _too_deep(f"args[{i}]")
    return args


def _too_deep(path: str) -> NoReturn:
    # a value that holds itself (a list appended to itself), or is nested past what Ruby
    # Sidekiq parses (ARG_ROOM): JSON cannot carry the first, Sidekiq loses the second
    raise TypeError(f"job argument {path} is nested too deeply, or holds itself; a payload nests "
                    f"at most 100 levels of lists and dicts (Sidekiq's JSON parses no more), "
                    f"{ARG_ROOM} within an argument")


def _refuse(value: Any, path: str) -> None:
    where, bad = _first_bad(value, path, ARG_ROOM)
    if type(bad) in (list, dict):
        _too_deep(path)
    raise TypeError(f"job argument {_refusal(where, bad)}")


def check_kwargs(kwargs: Any) -> dict[str, Any]:
    """Return keyword arguments as a dict, or raise TypeError naming the first name that
    is not a str or the first value JSON can't carry (with check_args's wording)."""
    if type(kwargs) is not dict:
        if not isinstance(kwargs, dict):
            raise TypeError(f"job keyword arguments must be a dict, not {type(kwargs).__name__}")
        kwargs = dict(kwargs)
    name: Any = None
    try:
        for name, v in kwargs.items():
            if type(name) is not str:
                raise TypeError(f"job keyword argument name {name!r} is not a str "
                                f"({type(name).__name__}); keyword argument names are str")
            if not _utf8(name):
                raise TypeError(f"job keyword argument name {_refusal('', name)[1:]}")
            if not _native(v, ARG_ROOM):
                _refuse(v, f"kwargs[{name!r}]")
    except RecursionError:
        _too_deep(f"kwargs[{name!r}]")
    return kwargs


class Call:
    """One item of a bulk push that gives keyword arguments, with or without positional
    ones: `forkq.call(7, locale="en")`. A plain dict item is keyword arguments only; a
    tuple or list, positional only. (A bare `(args, kwargs)` pair would read as a job of
    two arguments, so it means just that.)"""

    __slots__ = ("args", "kwargs")

    def __init__(self, /, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.kwargs = kwargs

    def __repr__(self) -> str:
        inner = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"forkq.call({', '.join(inner)})"


def call(*args: Any, **kwargs: Any) -> Call:
    """An item of `enqueue_many` (or `Client.push_bulk`) giving positional and keyword
    arguments: `job.enqueue_many([forkq.call(1, locale="en"), forkq.call(2)])`."""
    return Call(*args, **kwargs)


def check_many(args_list: Iterable[Any]) -> tuple[list[list], dict[int, dict[str, Any]]]:
    """check_args for each item of a bulk push; a refusal names the item, since the value
    alone may not tell which of thousands it was in. Returns the args lists and, by item
    index, the keyword arguments of the items that give any (a dict item, or a Call)."""
    checked: list[list] = []
    keywords: dict[int, dict[str, Any]] = {}
    for item in args_list:
        try:
            kind = type(item)
            if kind is tuple or kind is list:  # the common items first, as fast as before
                checked.append(check_args(item))
            elif kind is Call or isinstance(item, dict):  # an OrderedDict too, as push(kwargs=) takes
                args, kwargs = (item.args, item.kwargs) if kind is Call else ((), item)
                kwargs = check_kwargs(kwargs)
                if kwargs:
                    keywords[len(checked)] = kwargs
                checked.append(check_args(args))
            else:
                checked.append(check_args(bulk_item(item)))
        except TypeError as exc:
            raise TypeError(f"item {len(checked)} of the list: {exc}") from None
    return checked, keywords


def check_options(options: dict[str, Any]) -> dict[str, Any]:
    """Return options if every value can go into a payload as it is, else raise TypeError
    naming the first that cannot: orjson would quietly write a datetime or UUID as a string,
    and the job would carry a value of another type than the one given. expires_in and
    keep_result are checked as numbers of seconds; keep_result=None is taken out;
    overlimit_retries as a count."""
    if "kwargs" in options:
        # a push's keyword arguments are checked against the function; as an option they
        # would reach the payload unchecked
        raise TypeError("kwargs is not a job option: give keyword arguments to the push "
                        "(job.enqueue(x=1), Client.push(name, args, kwargs={...}))")
    if "tags" in options:
        check_tags(options["tags"])
    if "expires_in" in options:
        check_expires_in(options["expires_in"])
    if "keep_result" in options and check_keep_result(options["keep_result"]) is None:
        del options["keep_result"]  # None: this push keeps no result
    if "overlimit_retries" in options:
        retries = options["overlimit_retries"]
        # the worker reads anything else as the default (20): say so here, not never
        if retries is None:
            del options["overlimit_retries"]  # None: the default for this push
        elif type(retries) is not int or retries < 0:
            raise ValueError(f"overlimit_retries must be an int of 0 or more (times a job that "
                             f"raised forkq.OverLimit is scheduled again), not {retries!r}")
    for name, value in options.items():
        if not _native(value, OPTION_ROOM):
            where, bad = _first_bad(value, f"option {name!r}", OPTION_ROOM)
            if type(bad) in (list, dict):
                raise TypeError(f"job option {name!r} is nested too deeply; a payload nests at "
                                "most 100 levels of lists and dicts (Sidekiq's JSON parses no "
                                f"more), {OPTION_ROOM} within an option")
            raise TypeError(f"job {_refusal(where, bad)}")
    return options


def check_tags(value: Any) -> Any:
    """Return a `tags` option if it is a list (or None), else raise TypeError. Sidekiq's
    client refuses anything else, and a Ruby Sidekiq server's poller, meeting such a job in
    `schedule` or `retry`, takes it out and then fails to push it: the job is gone. Its Web
    UI's queue, retry and dead pages fail on it too."""
    if value is None or type(value) is list:
        return value
    raise TypeError(f"job option 'tags' must be a list (of names), not {type(value).__name__} "
                    f"({value!r}); Sidekiq refuses, or loses, a job with any other tags")


def check_expires_in(value: Any) -> float | None:
    """Return an expires_in option (seconds) if it is a finite number above 0, or None (no
    expiry), else raise: a job that could never start, or never expire, is a mistake."""
    # compared, not passed to math.isfinite: an int past a float's range raised OverflowError
    if value is None or (type(value) in (int, float) and 0 < value <= sys.float_info.max):
        return value
    raise ValueError(f"expires_in must be a number of seconds above 0, or None, not {value!r}")


# PEXPIRE takes milliseconds in a signed 64-bit integer; the time settings stop at 1e9 s too
KEEP_RESULT_MAX_S = 1e9


def check_keep_result(seconds: Any) -> float | int | None:
    """Return a keep_result option (seconds to keep a job's result, see forkq.results) if
    it is a number above 0 and at most 1e9, or None (no result kept); else raise
    TypeError or ValueError."""
    if seconds is None:
        return None
    if type(seconds) not in (int, float):
        raise TypeError(f"keep_result must be a number of seconds above 0 (or None to keep no "
                        f"result), not {seconds!r} ({type(seconds).__name__})")
    if not 0 < seconds <= KEEP_RESULT_MAX_S:  # NaN and inf fail it too; math.isfinite raises on 10**400
        raise ValueError(f"keep_result must be a number of seconds above 0 and at most 1e9, not {seconds!r}")
    return seconds


def stamp_expiry(job: dict[str, Any], start: float) -> None:
    """Turn a job's expires_in option into the `expires_at` its payload carries: the epoch
    second after which it must not start, counted from when it may first run (`start`:
    its push, or its scheduled time)."""
    expires_in = check_expires_in(job.pop("expires_in"))
    if expires_in is not None:
        job["expires_at"] = start + expires_in


def check_retry(retry: Any) -> bool | int:
    """Return retry if it is True, False or a count >= 0, else raise: a payload's retry of
    another type ("5", 5.0) means Sidekiq's default of 25 retries to every worker that
    reads it, Ruby's and forkq's alike, so the job would retry 25 times, not 5."""
    if type(retry) is bool or (type(retry) is int and retry >= 0):
        return retry
    raise ValueError(f"retry must be True, False or a count >= 0, not {retry!r}")


def check_queue(name: Any) -> str:
    """Return name if a job can be pushed to it, else raise as Sidekiq's client refuses an
    empty one: such a job would wait forever on a queue no worker can be told to serve
    (--queue takes neither an empty name nor a newline), or, scheduled, be moved to the dead
    set as malformed by the scheduler."""
    if type(name) is not str:
        raise TypeError(f"a job's queue must be a str, not {type(name).__name__} ({name!r})")
    if not name or "\n" in name:
        raise ValueError(f"a job's queue must be a non-empty name without a newline, not {name!r}")
    return name


def build(name: str, args: list, queue: str = "default", retry: bool | int = True,
          now: float | None = None, kwargs: dict[str, Any] | None = None,
          **extra: Any) -> dict[str, Any]:
    """A new job, fields in Sidekiq's order; extra options (backtrace, retry_queue...) kept.
    Checked keyword arguments go in a "kwargs" field after args; without any (None or
    empty) the payload has no such field, byte for byte what Sidekiq's client writes."""
    now = time.time() if now is None else now
    if kwargs:
        job: dict[str, Any] = {"class": name, "args": args, "kwargs": kwargs, "jid": new_jid(),
                               "queue": queue, "retry": retry, "created_at": now}
    else:
        job = {"class": name, "args": args, "jid": new_jid(), "queue": queue,
               "retry": retry, "created_at": now}
    if extra:
        job.update(extra)
    return job


def parse(raw: bytes | str) -> dict[str, Any]:
    """Decode one queue entry; raise MalformedPayload with the reason it can't run."""
    try:
        job = _decode(raw)
    except UnicodeDecodeError:
        raise MalformedPayload("payload is not valid UTF-8") from None
    except ValueError as exc:
        raise MalformedPayload(f"payload is not JSON: {exc}") from None
    except RecursionError:
        # json's decoder recurses per nesting level: '[' * 100000 would otherwise escape as
        # RecursionError, killing the processor thread (or stalling every scheduler poll)
        raise MalformedPayload("payload is JSON nested too deeply to decode") from None
    if type(job) is not dict:
        raise MalformedPayload(f"payload is JSON {type(job).__name__}, not an object")
    name = job.get("class")
    if type(name) is not str or not name:
        raise MalformedPayload("payload has no 'class' string")
    if type(job.get("args")) is not list:
        raise MalformedPayload("payload 'args' is missing or not a list")
    # JSON object keys are always strings: an object is all a worker needs to call with it
    if "kwargs" in job and type(job["kwargs"]) is not dict:
        raise MalformedPayload("payload 'kwargs' is not an object (keyword arguments by name)")
    return job


def display_name(job: dict[str, Any]) -> str:
    """The name to log: ActiveJob wraps the real class in 'wrapped'."""
    wrapped = job.get("wrapped")
    return wrapped if type(wrapped) is str else job["class"]


def seconds(stamp: Any) -> float | None:
    """Sidekiq 6/7 stamp floats in seconds, Sidekiq 8 integers in milliseconds."""
    if type(stamp) is float:
        return stamp
    if type(stamp) is int:
        # A client that writes whole seconds as an integer (Go's encoding/json drops the
        # ".0") would otherwise read as January 1970: with retry_for, a first failure would
        # go straight to dead. 1e11 is March 1973 in milliseconds, the year 5138 in seconds.
        return stamp / 1000.0 if abs(stamp) >= 100_000_000_000 else float(stamp)
    return None


def encode_backtrace(lines: list[str]) -> str:
    return base64.b64encode(zlib.compress(_encode(lines).encode())).decode()


def decode_backtrace(blob: str) -> list[str]:
    return _decode(zlib.decompress(base64.b64decode(blob)))
