"""A fault in forkq's own code after a job, for tests/test_hostile.py (required next to
tests/apps/core_jobs.py): a processor's return after a failed job, whose retry write
already released its in-flight entry, raises."""

from __future__ import annotations

from forkq.manager import Manager

_done = Manager.done


def _faulty_done(self, token):
    if token is None:
        raise RuntimeError("a fault in forkq, after a failed job")
    _done(self, token)


Manager.done = _faulty_done
