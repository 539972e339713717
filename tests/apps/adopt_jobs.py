"""An application that sets up its own logging when imported, as many do in a settings
module: stdlib logging to stderr, and structlog rendering JSON to stderr."""

import logging
import sys

import structlog

import forkq

logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="APP %(name)s %(message)s")
structlog.configure(
    processors=[structlog.processors.add_log_level, structlog.processors.JSONRenderer()],
    logger_factory=structlog.PrintLoggerFactory(sys.stderr),
)


@forkq.job(name="adopt.chatty", retry=0)
def chatty(x: int) -> None:
    structlog.get_logger("app").info("structlog inside the job", x=x)
    logging.getLogger("app").info("stdlib inside the job %s", x)


def _redis():
    return forkq.default_client().redis


@forkq.job(name="adopt.flaky", retry=5, retry_in=lambda count, exc: 0)
def flaky(key: str, failures: int) -> None:
    """Fails its first `failures` runs; each run's start time goes onto the list `key`."""
    import time
    runs = _redis().rpush(key, time.time())
    if runs <= failures:
        raise RuntimeError(f"run {runs} of {key}")


@forkq.job(name="adopt.record", retry=0)
def record(key: str, value: str) -> None:
    _redis().rpush(key, value)


@forkq.job(name="adopt.fail", retry=False)
def fail(tag: str) -> None:
    raise RuntimeError(f"failing {tag}")


@forkq.job(name="adopt.sleep", retry=0)
def sleep(key: str, seconds: float) -> None:
    import time
    _redis().rpush(key, "started")
    time.sleep(seconds)
