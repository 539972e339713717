"""A job that logs through structlog, as application code does."""

import logging

import structlog

import forkq


@forkq.job(name="logging.chatty", retry=0)
def chatty(x: int) -> None:
    structlog.get_logger("app").warning("inside the job", x=x)


@forkq.job(name="logging.loud_failure", retry=0)
def loud_failure(size: int) -> None:
    raise ValueError("x" * size)


@forkq.job(name="logging.stdlib", retry=0)
def stdlib(x: int) -> None:
    stdlog = logging.getLogger("app.stdlib")
    stdlog.info("stdlib info in the job x=%d", x)
    try:
        raise KeyError(x)
    except KeyError:
        stdlog.exception("stdlib error in the job")
