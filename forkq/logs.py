"""structlog set up once per process: JSON or readable text, each line with pid and slot."""

from __future__ import annotations

import contextvars
import json
import logging
import os
import sys
import threading
import time
from typing import Any

import orjson
import structlog
import structlog.contextvars

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "error": logging.ERROR, "critical": logging.CRITICAL}
_level = logging.INFO


_slot: int | None = None


def _add_process(_logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
    # read at call time, so a logger cached in the master is right in a forked child
    event["pid"] = os.getpid()
    if _slot is not None:
        event["slot"] = _slot
    return event


_job = threading.local()
# An async job's [(jid, class, queue, payload, processor)], set in the context its coroutine runs in
# (forkq.aio): many coroutines share the loop's thread, so its thread-local cannot say
# which job a line comes from. Read only where the thread-local has no job: a sync job's
# lines and current_job() pay nothing for it. A list, emptied ([None]) once the job ended:
# a task it started and left running inherited the context, and is in no job after it
# (as a thread a sync job starts): current_batch() there would join a counted batch.
TASK_JOB: contextvars.ContextVar[list | None] = contextvars.ContextVar("forkq_job", default=None)
_NO_TASK = (None,)


def set_job(jid: Any, name: str, queue: str, job: dict[str, Any] | None = None,
            owner: Any = None) -> None:
    """Mark this thread as running a job: every line it logs carries jid, class and queue,
    forkq.current_job() returns its payload, and forkq.progress() records on `owner` (the
    Processor, or forkq.testing's recorder; None: nowhere). What a job (or its middleware) bound with
    structlog.contextvars is this job's only: left bound, the thread's next job logged the
    last one's tenant, say."""
    _job.current = (jid, name, queue, job, owner)
    if _BOUND is None or _BOUND:
        structlog.contextvars.clear_contextvars()


def clear_job() -> None:
    _job.current = None


def current_job() -> dict[str, Any] | None:
    """The payload of the job this thread is running (jid, args, retry_count once it
    failed before...), as the processor and server middleware see it; None outside a job.
    In an async job's coroutine (and the tasks it starts, until the job ended), that job's."""
    current = getattr(_job, "current", None) or (TASK_JOB.get() or _NO_TASK)[0]
    return current[3] if current is not None else None


def _add_job(_logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
    # a thread-local read, not structlog's contextvars: this runs for every job
    current = getattr(_job, "current", None) or (TASK_JOB.get() or _NO_TASK)[0]
    if current is not None:
        event.setdefault("jid", current[0])
        event.setdefault("class", current[1])
        event.setdefault("queue", current[2])
    return event


_stamp_cache: list[Any] = [0, ""]


def _timestamp(_logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
    """ISO-8601 UTC with microseconds; the date part is formatted once per second."""
    now = time.time()
    sec = int(now)
    if sec != _stamp_cache[0]:
        _stamp_cache[0], _stamp_cache[1] = sec, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(sec))
    event["timestamp"] = f"{_stamp_cache[1]}.{int((now - sec) * 1_000_000):06d}Z"
    return event


_json_encode = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, default=repr).encode
_ORJSON_OPTIONS = orjson.OPT_NON_STR_KEYS


def _render_json(_logger: Any, _name: str, event: dict[str, Any]) -> str:
    try:
        return orjson.dumps(event, default=repr, option=_ORJSON_OPTIONS).decode()
    except TypeError:  # what orjson refuses (a lone surrogate, a huge int): json writes it
        return _json_encode(event)


# structlog's registry of the context variables bind_contextvars has made: empty until an
# app binds one, so lines of an app that never does skip merge_contextvars (copying the
# context costs every line). Private to structlog: if a version lacks it, always merge.
_BOUND = getattr(structlog.contextvars, "_CONTEXT_VARS", None)
_merge_contextvars = structlog.contextvars.merge_contextvars


def _add_context(logger: Any, method: str, event: dict[str, Any]) -> dict[str, Any]:
    """What the app bound with structlog.contextvars (a server middleware binding a
    tenant, say); a field given in the call wins."""
    if _BOUND is None or _BOUND:
        _merge_contextvars(logger, method, event)
    return event


_LEVEL_OF = {"warn": "warning", "exception": "error", "msg": "info", "failure": "error",
             "err": "error", "fatal": "critical"}
_format_exc_info = structlog.processors.format_exc_info


def _json_line(logger: Any, method: str, event: dict[str, Any]) -> str:
    """The JSON chain in one structlog processor: the app's bound context, level,
    timestamp, pid, slot, the running job, a formatted exception only when there is one,
    then orjson. A job logs a line at
    start and at finish; structlog's own chain and json's encoder cost 12 us a line."""
    _add_context(logger, method, event)
    event["level"] = _LEVEL_OF.get(method, method)
    _timestamp(logger, method, event)
    _add_process(logger, method, event)
    _add_job(logger, method, event)
    if "exc_info" in event or "exception" in event:
        event = _format_exc_info(logger, method, event)
    return _render_json(logger, method, event)


class _Lines:
    """Writes rendered lines to a stream, one whole line at a time under a lock.

    Buffered, a worker flushes every FLUSH_S from a thread of its own instead of once per
    line: with ten processor threads, a flush per line (a write syscall, which releases
    the GIL) cost a quarter of throughput at info level. Warnings and errors, and
    everything before them, are flushed at once; a process that is SIGKILLed loses at
    most FLUSH_S of info lines. The master stays unbuffered and has no flusher thread: it
    forks, and a lock held by a thread at fork time would stay held in the child."""

    FLUSH_S = 0.1
    MAX_PENDING = 256
    URGENT = frozenset({"warning", "warn", "error", "exception", "critical", "fatal", "failure", "err"})

    def __init__(self, stream: Any, buffered: bool) -> None:
        self.stream = stream
        self.buffered = buffered
        self.lock = threading.Lock()
        # kept here, not in the stream's buffer: PYTHONUNBUFFERED (set in many container
        # images) makes every stream write a syscall
        self.pending: list[str] = []
        self.failing = False

    def start_flusher(self) -> None:
        if self.buffered:
            threading.Thread(target=self._flusher, name="forkq-log-flush", daemon=True).start()

    def write(self, method: str, line: str) -> None:
        with self.lock:
            pending = self.pending
            pending.append(line)
            if not self.buffered or method in self.URGENT or len(pending) >= self.MAX_PENDING:
                self._write_out()

    def flush(self) -> None:
        with self.lock:
            if self.pending:
                self._write_out()

    def _write_out(self) -> None:
        text = "\n".join(self.pending) + "\n"
        self.pending.clear()
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError) as exc:
            # A reader that went away (EPIPE) or a full disk: these lines are lost, but
            # the thread that logged them, a processor in the middle of a job or the
            # master's loop, must not die of it
            if not self.failing:
                self.failing = True
                _complain(f"forkq: cannot write log lines ({exc}); dropping them until it works again\n")
        else:
            self.failing = False

    def _flusher(self) -> None:
        while _lines is self:
            time.sleep(self.FLUSH_S)
            try:
                self.flush()
            except (OSError, ValueError):  # stdout closed or gone: nothing left to do
                return


def _complain(text: str) -> None:
    """One line on stderr, if stderr can still take it."""
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):  # AttributeError: no sys.stderr at all
        pass


class _LineLogger:
    """structlog's logger end: each method hands the rendered line to this process's
    _Lines, looked up at each call. structlog caches a logger at its first use, and one
    first used in the master must write through the child's own _Lines after fork."""

    def __getattr__(self, method: str) -> Any:
        def emit(message: str) -> None:
            _lines.write(method, message)  # type: ignore[union-attr]
        setattr(self, method, emit)  # built once per level name
        return emit


_lines: _Lines | None = None


def flush() -> None:
    """Write out buffered lines: before os._exit, before fork."""
    if _lines is not None:
        _lines.flush()


def flush_all() -> None:
    """Buffered lines, then stdout and stderr: before os._exit or an exec, which write out
    nothing of what this process still holds. A stream that is gone is let be."""
    flush()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def configure(level: str = "info", fmt: str | None = None, slot: int | None = None,
              stream: Any = None, buffered: bool = False) -> None:
    """(Re)configure logging for this process; call again in a child after fork.
    `buffered` is for worker processes, which log a line per job start and finish."""
    global _level, _slot, _lines
    _level = LEVELS[level]
    _slot = slot
    stream = stream or sys.stdout
    if fmt is None:
        fmt = "text" if stream.isatty() else "json"
    if _lines is not None:
        _lines.flush()
    _lines = _Lines(stream, buffered)
    _lines.start_flusher()  # after the assignment: the flusher runs while it is the current one
    logger = _LineLogger()
    if fmt == "json":
        processors: list[Any] = [_json_line]
    else:
        processors = [_add_context, structlog.processors.add_log_level, _timestamp, _add_process, _add_job,
                      structlog.processors.format_exc_info,
                      structlog.dev.ConsoleRenderer(colors=stream.isatty())]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(_level),
        # one write per line, under a lock: threads' lines never interleave
        logger_factory=lambda *_args: logger,
        cache_logger_on_first_use=True,
    )


class JobFields(logging.Filter):
    """A filter for an app's own logging handlers: each record logged while a job runs
    gets `jid`, `class` and `queue` attributes (None outside a job), for a format such as
    "%(jid)s %(message)s". Attributes the record already has (from `extra=`) are kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        current = (getattr(_job, "current", None) or (TASK_JOB.get() or _NO_TASK)[0]
                   or (None, None, None))
        for name, value in zip(("jid", "class", "queue"), current):
            if name not in record.__dict__:
                record.__dict__[name] = value
        return True


class _ToLines(logging.Handler):
    """Writes the standard library's records as forkq lines: the same format, stream and
    buffering, with `logger` and, while a job runs, its jid, class and queue."""

    def __init__(self) -> None:
        super().__init__()
        self._loggers: dict[str, Any] = {}

    def handle(self, record: logging.LogRecord) -> Any:
        """As logging.Handler.handle, without the handler's lock: _Lines writes each line
        under a lock of its own. Before 3.13, handle() takes that lock in a Python method
        and releases it in a finally: a job's TimeLimitExceeded (timelimit.py) landing
        between the two left it held by that thread, and every other thread's next logging
        call through here blocked for good."""
        rv = self.filter(record)
        if isinstance(rv, logging.LogRecord):  # 3.12+: a filter may hand back a new record
            record = rv
        if rv:
            self.emit(record)
        return rv

    def emit(self, record: logging.LogRecord) -> None:
        try:
            logger = self._loggers.get(record.name)
            if logger is None:
                logger = self._loggers[record.name] = get(record.name)
            n = record.levelno
            method = ("critical" if n >= logging.CRITICAL else "error" if n >= logging.ERROR
                      else "warning" if n >= logging.WARNING else "info" if n >= logging.INFO
                      else "debug")
            fields: dict[str, Any] = {"logger": record.name}
            if record.exc_info:
                fields["exc_info"] = record.exc_info
            getattr(logger, method)(record.getMessage(), **fields)
        except Exception:
            self.handleError(record)


def take_stdlib_logging(level: str) -> bool:
    """Route the standard library's logging into forkq's lines, unless the app set up
    logging of its own (the root logger has a handler): without this, a job's
    `logging.getLogger(__name__).info(...)` went nowhere and its warnings reached stderr
    as bare text, with no time, pid or job. True if taken.

    Python's last resort, not a root handler: logging set up after the import (in an
    on_fork hook, or on a job's first run) must still take over. With a root handler
    in place, the app's logging.basicConfig() did nothing, and its log file was never
    written."""
    root = logging.getLogger()
    if root.handlers:
        return False
    logging.lastResort = _ToLines()
    if root.level == logging.WARNING:  # the default: nobody chose it
        root.setLevel(LEVELS[level])
    return True


def enabled(level: str) -> bool:
    """Whether `level` is logged; hot paths check this once instead of per call."""
    return LEVELS[level] >= _level


def get(name: str = "forkq") -> Any:
    return structlog.get_logger(name)
