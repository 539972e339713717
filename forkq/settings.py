"""The settings a worker runs with, shared by the CLI, the supervisor and the worker."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


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
