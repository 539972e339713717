"""The settings a worker runs with, shared by the CLI, the supervisor and the worker."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

# A stopping child gets --timeout for its running jobs plus this long to put back what it
# holds and exit; the master kills it after that. The child keeps its Redis writes inside it.
STOP_GRACE_S = 5.0
# At stop, how long the writes that have a later chance (giving back unstarted and landed
# jobs, the final requeue, the last stats) wait in all for an unreachable Redis: what they
# could not write stays in the process's private lists, for the master or orphan recovery.
STOP_PATIENCE_S = 4.0


@dataclass
class Settings:
    require: list[str] = field(default_factory=list)
    queues: list[tuple[str, int]] = field(default_factory=lambda: [("default", 0)])
    concurrency: int = 10
    processes: int = field(default_factory=lambda: os.cpu_count() or 1)
    no_fork: bool = False
    timeout: float = 25.0
    redis_url: str | None = None
    poll_interval: float = 5.0
    heartbeat_interval: float = 5.0
    block_timeout: float = 2.0
    tag: str = ""
    labels: list[str] = field(default_factory=list)
    log_level: str = "info"
    log_format: str | None = None
    # supervisor
    max_memory_mb: float | None = None
    hang_timeout: float = 30.0
    poison_after: int = 3
    boot_window: float = 10.0
    pidfile: str | None = None
    recovery_delay: float = 60.0
    # metrics (served by the master; see metrics.py)
    metrics_port: int | None = None
    metrics_bind: str = "0.0.0.0"
