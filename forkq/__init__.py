"""forkq: a prefork background-job processor on Redis, in Sidekiq's format.

    import forkq

    @forkq.job(queue="mail", retry=5)
    def send_welcome(user_id): ...

    send_welcome.enqueue(42)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (ConfigError, ForkqError, JobCancelled, JobFailed, MalformedPayload, OverLimit, PartialEnqueue,
                     RedisUnavailable, ResultNotReady, TimeLimitExceeded, UnknownJob, UnstorableResult)
from .hooks import on_death, on_fork, server_middleware, slot_index

if TYPE_CHECKING:
    from .batch import Batch, BatchStatus, batch_status, current_batch
    from .chains import Chain, chain
    from .client import Client, configure, default_client
    from .cron import CronError, periodic
    from .jobprogress import progress
    from .jobs import Job, job
    from .logs import JobFields, current_job
    from .payload import Call, call
    from .results import result

__all__ = [
    "Client", "ConfigError", "CronError", "ForkqError", "Job", "JobCancelled", "JobFailed", "JobFields", "MalformedPayload",
    "OverLimit", "PartialEnqueue", "RedisUnavailable", "ResultNotReady", "TimeLimitExceeded", "UnknownJob",
    "UnstorableResult", "configure", "current_job", "default_client", "job", "on_death", "on_fork", "periodic", "result",
    "server_middleware", "slot_index", "progress",
    "Batch", "BatchStatus", "batch_status", "current_batch", "Call", "call", "Chain", "chain",
]
__version__ = "0.1.0"

# Imported on first use: redis-py (through .client) takes about 0.1 s to import, which
# every `forkq` command paid before it could refuse a flag or print its --help.
_LAZY = {"Client": "client", "configure": "client", "default_client": "client",
         "Job": "jobs", "job": "jobs", "JobFields": "logs", "current_job": "logs",
         "CronError": "cron", "periodic": "cron", "result": "results", "progress": "jobprogress",
         "Call": "payload", "call": "payload",
         "Batch": "batch", "BatchStatus": "batch", "batch_status": "batch",
         "current_batch": "batch", "Chain": "chains", "chain": "chains"}
# `import forkq` used to import these too, so forkq.client.connect or forkq.jobs.REGISTRY
# worked without importing them by name
_SUBMODULES = {"client", "jobs", "logs", "payload", "keys", "wire", "cron", "results", "limiter"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
