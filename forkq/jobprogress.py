"""A running job's progress: forkq.progress(done, total, note), kept in its processor's
memory and shown by the heartbeat in the job's entry of the running-jobs hash.

A call costs no Redis command: it replaces one tuple on the job's Processor, and the next
heartbeat writes the latest one into the work entry it writes anyway ("forkq_progress",
beside Sidekiq's "queue", "payload" and "run_at"; Sidekiq's Web UI ignores the key). It is
not kept anywhere else: the job's end drops it with its entry, at the next beat.

Not named progress.py: a submodule of that name would shadow the function forkq.progress
on the package once imported."""

from __future__ import annotations

import math
import numbers
import time
from dataclasses import asdict, dataclass
from typing import Any, TypeGuard

from . import logs

NOTE_LIMIT = 200  # characters of a note kept: a progress line, not a log
FIELD = "forkq_progress"  # its key in a work entry

_job = logs._job
_TASK_JOB = logs.TASK_JOB
_NO_TASK = (None,)
_INF = math.inf
# ints from here on are kept as floats: the heartbeat's json.dumps refuses an int of more
# than 4,300 digits, and a failing beat would stop the process's heartbeat, not one report
_BIG = 2**63
_now = time.time

OUTSIDE = ("forkq.progress() was called outside a running job: call it from the job's own "
           "thread or coroutine (a thread the job started is in no job), or check "
           "forkq.current_job() is not None first")


def progress(done: float, total: float | None = None, note: str | None = None) -> None:
    """Record how far the running job has got: `done` of `total` (None: unknown), with an
    optional short `note` ("importing", cut at 200 characters). The latest call wins; the
    heartbeat shows it within one --heartbeat-interval in `forkq busy`, `forkq job`, the
    dashboard and api.running(). No Redis command: cheap enough for a tight loop.

    Numbers must be finite and not negative (int, float, or any numbers.Real such as a
    numpy integer); a bad argument raises TypeError or ValueError. Outside a job it
    raises RuntimeError. Under forkq.testing's fake() and inline() each report is kept
    for testing.progress(jid)."""
    current = getattr(_job, "current", None) or (_TASK_JOB.get() or _NO_TASK)[0]
    if current is None:
        raise RuntimeError(OUTSIDE)
    # the common case first: plain ints and floats, checked without an ABC lookup. type(),
    # not .__class__, which an object may fake (a Mock(spec=int) does): the heartbeat's
    # json.dumps would then meet it, and a raise there stops the whole beat
    kind = type(done)
    if not ((kind is int and 0 <= done < _BIG) or (kind is float and 0 <= done < _INF)):
        done = _number("done", done)
    if total is not None:
        kind = type(total)
        if not ((kind is int and 0 <= total < _BIG) or (kind is float and 0 <= total < _INF)):
            total = _number("total", total)
    if note is not None:
        if type(note) is not str:
            if not isinstance(note, str):
                raise TypeError(f"forkq.progress: note must be a str or None, not {type(note).__name__}")
            # a subclass, as the plain str JSON writes: str.__str__, not str(), which
            # calls the subclass's own __str__ (it may return the subclass, whose encode()
            # or __len__ the heartbeat would then call, and a raise there stops the beat)
            note = str.__str__(note)
        if len(note) > NOTE_LIMIT:
            note = note[:NOTE_LIMIT]
    owner = current[4]
    if owner is not None:  # None only for a set_job without one (an app's own use of it)
        # with the jid: the heartbeat shows it only beside the job that recorded it
        owner.progress = (current[0], done, total, note, _now())


def _number(name: str, value: Any) -> int | float:
    """`value` as a plain int or float, or why it cannot be one."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"forkq.progress: {name} must be a number, not {type(value).__name__}")
    try:
        plain: int | float = int(value) if isinstance(value, numbers.Integral) else float(value)
        if plain.__class__ is int and plain >= _BIG:
            plain = float(plain)
    except (OverflowError, ValueError) as exc:
        raise ValueError(f"forkq.progress: {name} must be finite, not {_shown(value)}") from exc
    if plain != plain or plain in (math.inf, -math.inf):
        raise ValueError(f"forkq.progress: {name} must be finite, not {_shown(value)}")
    if plain < 0:
        raise ValueError(f"forkq.progress: {name} must not be negative, not {_shown(value)}")
    return plain


def _shown(value: Any) -> str:
    try:
        text = repr(value)
    except ValueError:  # an int past Python's 4,300 digits for str()
        return "an int of more than 4,300 digits"
    return text if len(text) <= 60 else text[:57] + "..."


def entry(recorded: tuple[Any, Any, Any, Any, float]) -> dict[str, Any]:
    """The work entry's object for a Processor's `progress`. A note's lone surrogate (from
    a file name read with surrogateescape, say) is written as "?": Ruby's JSON would choke
    on its escape, and Sidekiq's Busy page with it."""
    _, done, total, note, at = recorded
    if note is not None:
        note = note.encode("utf-8", "replace").decode("utf-8")
    return {"done": done, "total": total, "note": note, "at": at}


@dataclass(frozen=True)
class Progress:
    """A running job's latest forkq.progress(), as its heartbeat showed it."""
    done: float
    total: float | None
    note: str | None
    at: float | None  # epoch seconds of the call

    @classmethod
    def read(cls, value: Any) -> Progress | None:
        """From a work entry's "forkq_progress" (any writer's: None if it is not one)."""
        if not isinstance(value, dict):
            return None
        done, total, note, at = (value.get(k) for k in ("done", "total", "note", "at"))
        if not _finite(done) or not (total is None or _finite(total)):
            return None
        return cls(done, total, note if isinstance(note, str) else None, at if _finite(at) else None)

    def percent(self) -> int | None:
        """Whole percent done (floored: 99.9% is not 100%), None without a total above 0."""
        if not self.total:
            return None
        try:
            return math.floor(self.done * 100 / self.total)
        except OverflowError:  # ints past a float's range: valid, but no percent
            return None

    def describe(self) -> str:
        """"1,200/2,000 (60%) importing": done, total, percent and note, as known."""
        text = _count(self.done)
        if self.total is not None:
            text += f"/{_count(self.total)}"
            if (pct := self.percent()) is not None:
                text += f" ({pct}%)"
        return text + (f" {self.note}" if self.note else "")

    def to_dict(self) -> dict[str, Any]:
        return dict(asdict(self), percent=self.percent(), description=self.describe())


def _finite(value: Any) -> TypeGuard[int | float]:
    # an int is compared as it is: math.isfinite() raises for one past a float's range
    return (type(value) is int and value >= 0) or (type(value) is float and 0 <= value < _INF)


def _count(value: float) -> str:
    if type(value) is int or value.is_integer() and abs(value) < 1e15:
        return f"{int(value):,}"
    return f"{value:,.2f}".rstrip("0").rstrip(".")
