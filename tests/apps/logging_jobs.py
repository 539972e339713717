"""A job that logs through structlog, as application code does."""

import structlog

import forkq


@forkq.job(name="logging.chatty", retry=0)
def chatty(x: int) -> None:
    structlog.get_logger("app").warning("inside the job", x=x)


@forkq.job(name="logging.loud_failure", retry=0)
def loud_failure(size: int) -> None:
    raise ValueError("x" * size)
