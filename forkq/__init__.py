"""forkq: a prefork background-job processor on Redis, in Sidekiq's format.

    import forkq

    @forkq.job(queue="mail", retry=5)
    def send_welcome(user_id): ...

    send_welcome.enqueue(42)
"""

from .client import Client, configure, default_client
from .cron import CronError, periodic
from .errors import (ConfigError, ForkqError, MalformedPayload, PartialEnqueue, RedisUnavailable,
                     UnknownJob)
from .jobs import Job, job
from .hooks import on_fork, server_middleware, slot_index
from .logs import JobFields, current_job

__all__ = [
    "Client", "ConfigError", "CronError", "ForkqError", "Job", "JobFields", "MalformedPayload", "PartialEnqueue",
    "RedisUnavailable", "UnknownJob", "configure", "current_job", "default_client", "job", "on_fork", "periodic",
    "server_middleware", "slot_index",
]
__version__ = "0.1.0"
