"""Unique jobs (`unique_for`): a push is refused while an identical job holds its lock.

The lock is `unique:<SHA-256 hex>` of the job's class, queue and args (and keyword
arguments, when the job has any), holding the jid of
the job that took it, for unique_for seconds (plus the delay of a scheduled push). The
push that takes it is one Lua call with the push itself (scripts/unique_push.lua); the
worker releases it, only while it still holds the same jid, after a success (riding on
the claim that carries the job's ack), before the run for `unique_until: "start"`, and
when the job leaves for good (dead, dropped, discarded). A retry keeps it.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

PREFIX = "unique:"
UNTIL = ("success", "start")
# the longest lock a push may ask for: PX takes milliseconds in a signed 64-bit integer,
# and the time settings stop at 1e9 s too (config.SECONDS_MAX)
MAX_S = 1e9

# The canonical text of an identity: compact, keys sorted (so {"a":1,"b":2} and {"b":2,"a":1}
# are one job), ASCII-only (any str, a lone surrogate too, encodes), and json's own float
# and big-integer text, which the push and the worker produce alike from the same values.
_canonical = json.JSONEncoder(separators=(",", ":"), sort_keys=True, ensure_ascii=True,
                              allow_nan=False).encode


def check(options: dict[str, Any]) -> dict[str, Any]:
    """Normalise the unique options of a push, in place: unique_for None or False drops
    both (no uniqueness for this push), unique_until "success" (the default) is left out of
    the payload. Raises TypeError/ValueError for anything else a payload cannot mean."""
    if "unique_for" not in options:
        if "unique_until" in options:
            until = options["unique_until"]
            _check_until(until)
            raise ValueError(f"unique_until={until!r} needs unique_for=SECONDS")
        return options
    seconds = options["unique_for"]
    if seconds is None or seconds is False:
        options.pop("unique_for")
        options.pop("unique_until", None)
        return options
    if type(seconds) not in (int, float):
        raise TypeError(f"unique_for must be a number of seconds above 0 (or None to push without "
                        f"uniqueness), not {seconds!r} ({type(seconds).__name__})")
    if not 0 < seconds <= MAX_S:  # NaN and inf fail it; math.isfinite raised OverflowError on a big int
        raise ValueError(f"unique_for must be a number of seconds above 0 and at most 1e9, not {seconds!r}")
    until = options.get("unique_until", "success")
    _check_until(until)
    if until == "success":
        options.pop("unique_until", None)
    return options


def wanted(job: dict[str, Any]) -> bool:
    """Whether a payload about to be pushed asks for uniqueness; raises as check() does for
    values it cannot mean (a client middleware or Client.push may have put them there)."""
    opts: dict[str, Any] = {k: job[k] for k in ("unique_for", "unique_until") if k in job}
    return "unique_for" in check(opts)


def _check_until(until: Any) -> None:
    if type(until) is not str:
        raise TypeError(f"unique_until must be 'success' or 'start', not {until!r} ({type(until).__name__})")
    if until not in UNTIL:
        raise ValueError(f"unique_until must be 'success' or 'start', not {until!r}")


def lock_key(name: str, queue: str, args: list, kwargs: dict[str, Any] | None = None) -> str:
    """The lock of a job's identity: (class, queue, args) as the JSON array
    [class, queue, args], compact, keys sorted, ASCII-only, hashed with SHA-256. A job
    with keyword arguments adds them, [class, queue, args, kwargs]; one without (or with
    an empty "kwargs", which runs the same) has the
    three-item identity it always had, so its locks (and Sidekiq's digest) are unchanged."""
    identity = [name, queue, args, kwargs] if kwargs else [name, queue, args]
    return PREFIX + hashlib.sha256(_canonical(identity).encode()).hexdigest()


def lock_of(job: dict[str, Any]) -> str | None:
    """The lock key a payload's push took, from the payload alone; None when it carries
    nothing usable (a payload from another client may hold anything). `unique_queue` is
    the queue it was pushed to, kept when a retry moved it to its `retry_queue`."""
    seconds: Any = job.get("unique_for")  # a number past the type() test, as mypy cannot see
    if type(seconds) not in (int, float) or not seconds > 0:
        return None
    queue = job.get("unique_queue", job.get("queue"))
    if type(queue) is not str:
        return None
    try:
        return lock_key(job["class"], queue, job["args"], job.get("kwargs"))
    except (TypeError, ValueError, RecursionError):
        return None


def ttl_ms(job: dict[str, Any], delay: float) -> int:
    """The lock's life for a push: unique_for, plus the wait of a scheduled push."""
    return max(1, math.ceil((job["unique_for"] + max(delay, 0.0)) * 1000))
