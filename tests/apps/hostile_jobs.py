"""Jobs for tests/test_hostile.py, required next to tests/apps/core_jobs.py."""

from __future__ import annotations

import forkq
from tests.apps.core_jobs import note


class UnprintableError(Exception):
    """An exception whose own __str__ raises (a buggy library's exception class)."""

    def __str__(self):
        raise RuntimeError("__str__ is broken too")


@forkq.job(name="hostile.unprintable")
def unprintable(tag):
    note("unprintable", tag)
    raise UnprintableError(tag)
