"""A fault in forkq's own code before a job runs, for tests/test_hostile.py (required next
to tests/apps/core_jobs.py): marking a thread as running a job raises for a job fetched
from queue `faulty`, as a bug in forkq between fetch and run would."""

from __future__ import annotations

from forkq import logs

_set_job = logs.set_job


def _faulty_set_job(jid, name, queue, job=None, owner=None):
    if queue == "faulty":
        raise RuntimeError("a fault in forkq, outside the job")
    _set_job(jid, name, queue, job, owner)


logs.set_job = _faulty_set_job
