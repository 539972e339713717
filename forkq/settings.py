"""The settings a worker runs with, shared by the CLI, the supervisor and the worker."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

# A stopping child gets --timeout for its running jobs plus this long to put back what it
# holds and exit; the master kills it after that. The child keeps its Redis writes inside it.
STOP_GRACE_S = 5.0
# At stop, how long the writes that have a later chance (giving back unstarted and landed
# jobs, the final requeue, the last stats) wait in all for an unreachable Redis: what they
# could not write stays in the process's private lists, for the master or orphan recovery.
STOP_PATIENCE_S = 4.0
# A command byte the master sends a child down its pipe, beside the signal numbers the
# others are (0 is none): write the next heartbeat now. A heartbeat is how a worker learns
# that crash suspects wait (launcher.Launcher.beat)
BEAT_NOW = 0


def usable_cpus(cgroup_root: str = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup") -> int:
    """The CPUs this process may use: its affinity (taskset, a cpuset), capped by its
    cgroup's CPU quota rounded up. os.cpu_count() counts the whole machine: in a pod
    limited to 2 CPUs on a 64-core node it gave 64 children, each throttled, each holding
    its own memory and connections."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root, self_cgroup)
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(cpus, 1)


def cgroup_cpu_quota(cgroup_root: str = "/sys/fs/cgroup",
                     self_cgroup: str = "/proc/self/cgroup") -> float | None:
    """CPUs' worth of time this process's cgroup, or any cgroup above it, may use per
    period (cgroup v2 cpu.max, v1 cpu.cfs_quota_us); None when nothing limits it."""
    try:
        lines = Path(self_cgroup).read_text().splitlines()
    except OSError:
        return None
    root = Path(cgroup_root)
    limits: list[float] = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # v2, the unified hierarchy
            for d in _up_from(root, path):
                limits += _quota(d / "cpu.max", None)
        elif "cpu" in controllers.split(","):
            for mount in (root / controllers, root / "cpu,cpuacct", root / "cpu"):
                if mount.is_dir():
                    for d in _up_from(mount, path):
                        limits += _quota(d / "cpu.cfs_quota_us", d / "cpu.cfs_period_us")
                    break
    return min(limits) if limits else None


def _up_from(mount: Path, path: str) -> list[Path]:
    """The cgroup's directory and those above it under `mount`. Inside a container the
    mount is usually the container's own cgroup, and the path it is listed under does not
    exist there: the mount itself is then the one that counts."""
    parts = [p for p in path.strip().split("/") if p and p != ".."]
    return [mount.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _quota(quota_file: Path, period_file: Path | None) -> list[float]:
    try:
        if period_file is None:
            quota, _, period = quota_file.read_text().strip().partition(" ")
        else:
            quota, period = quota_file.read_text().strip(), period_file.read_text().strip()
        q, p = int(quota), int(period)  # v2's "max" or v1's -1: no limit
    except (OSError, ValueError):
        return []
    return [q / p] if q > 0 and p > 0 else []


@dataclass
class Settings:
    require: list[str] = field(default_factory=list)
    queues: list[tuple[str, int]] = field(default_factory=lambda: [("default", 0)])
    concurrency: int = 10
    processes: int = field(default_factory=usable_cpus)
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
    max_jobs: int | None = None
    hang_timeout: float = 30.0
    time_limit_grace: float = 10.0
    poison_after: int = 3
    boot_window: float = 10.0
    pidfile: str | None = None
    reload: bool = False               # restart on source changes (see reload.py)
    recovery_delay: float = 60.0
    # metrics (served by the master; see metrics.py)
    metrics_port: int | None = None
    metrics_bind: str = "0.0.0.0"
