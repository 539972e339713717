"""An app that sets up the standard library's logging itself, with forkq's job fields."""

import logging
import sys

import forkq

_handler = logging.StreamHandler(sys.stdout)
_handler.setFormatter(logging.Formatter("APP %(jid)s %(class)s %(queue)s %(message)s"))
_handler.addFilter(forkq.JobFields())
logging.getLogger().addHandler(_handler)
logging.getLogger().setLevel(logging.INFO)


@forkq.job(name="ownlog.hello", retry=0)
def hello(x: int) -> None:
    logging.getLogger("app").info("hello %d", x, extra={"queue": "mine"})
    logging.getLogger("app").info("plain %d", x)
