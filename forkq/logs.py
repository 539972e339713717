"""structlog set up once per process: JSON or readable text, each line with pid and slot."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "error": logging.ERROR, "critical": logging.CRITICAL}
_level = logging.INFO


def _add_process(slot: int | None) -> Any:
    pid = os.getpid()

    def add(_logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
        event["pid"] = pid
        if slot is not None:
            event["slot"] = slot
        return event
    return add


def configure(level: str = "info", fmt: str | None = None, slot: int | None = None,
              stream: Any = None) -> None:
    """(Re)configure logging for this process; call again in a child after fork."""
    global _level
    _level = LEVELS[level]
    stream = stream or sys.stdout
    if fmt is None:
        fmt = "text" if stream.isatty() else "json"
    renderer: Any = (structlog.processors.JSONRenderer() if fmt == "json"
                     else structlog.dev.ConsoleRenderer(colors=stream.isatty()))
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _add_process(slot),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_level),
        # one write per line, under a lock: threads' lines never interleave
        logger_factory=structlog.WriteLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )


def enabled(level: str) -> bool:
    """Whether `level` is logged; hot paths check this once instead of per call."""
    return LEVELS[level] >= _level


def get(name: str = "forkq") -> Any:
    return structlog.get_logger(name)
