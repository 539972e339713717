"""An app that sets up the standard library's logging in each child, after forkq's start."""

import logging
import os

import forkq


@forkq.on_fork
def log_to_file(slot: int) -> None:
    logging.basicConfig(filename=os.environ["APP_LOG_FILE"], level=logging.INFO,
                        format=f"APP slot={slot} %(name)s %(message)s")


@forkq.job(name="forklog.hello", retry=0)
def hello(x: int) -> None:
    logging.getLogger("app").info("hello %d", x)
