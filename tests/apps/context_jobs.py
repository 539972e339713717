"""An app whose server middleware binds structlog context variables around each job."""

import logging

import structlog
import structlog.contextvars

import forkq


@forkq.server_middleware
def tenant(job: dict, queue: str, call_next):
    with structlog.contextvars.bound_contextvars(tenant=f"t{job['args'][0]}"):
        return call_next()


@forkq.job(name="context.report", retry=0)
def report(n: int) -> None:
    structlog.get_logger("app").info("report made", rows=n)
    logging.getLogger("app.std").info("stdlib report made")


@forkq.job(name="context.binds", retry=0)
def binds(n: int) -> None:
    # bound without the context manager, as apps do: it must not outlive this job
    structlog.contextvars.bind_contextvars(leftover=n)
    structlog.get_logger("app").info("bound leftover")


@forkq.job(name="context.plain", retry=0)
def plain(n: int) -> None:
    structlog.get_logger("app").info("plain job line")
