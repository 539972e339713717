"""App-registered hooks: server middleware around each job, on_fork, death handlers, and
the child's slot."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

# A server middleware wraps each job run: mw(job, queue, call_next) must call call_next()
# (to run the job) and return its result, or raise. Logging, metrics and error reporters
# plug in here.
ServerMiddleware = Callable[[dict, str, Callable[[], Any]], Any]

SERVER_MIDDLEWARE: list[ServerMiddleware] = []
ON_FORK: list[Callable[[int], None]] = []
DeathHandler = Callable[[dict, BaseException], None]
ON_DEATH: list[DeathHandler] = []


def server_middleware(mw: ServerMiddleware) -> ServerMiddleware:
    """Register a server middleware (usable as a decorator)."""
    SERVER_MIDDLEWARE.append(mw)
    return mw


def on_fork(fn: Callable[[int], None]) -> Callable[[int], None]:
    """Register fn(slot) to run in each child after fork, before its threads start."""
    ON_FORK.append(fn)
    return fn


def on_death(fn: DeathHandler) -> DeathHandler:
    """Register fn(job, exc) to run, in the worker, once a job has failed its way into the
    dead set (its retries ran out, or a retry_in hook said "kill"): after the write, so
    an alert it sends describes what Redis holds. A handler that raises is logged, and
    changes nothing for the job."""
    ON_DEATH.append(fn)
    return fn


def slot_index() -> int | None:
    """This child's slot 0..N-1 under `forkq start --processes N`; None outside a child."""
    value = os.environ.get("FORKQ_INDEX")
    return int(value) if value is not None and value.isdigit() else None
