"""What the next version of tests/apps/fleet_jobs.py adds (required beside it): a job that
a rolling deploy's new code pushes while workers of the old version still run."""

import forkq


@forkq.job(name="fleet.added", retry=False)
def added(tag: str) -> None:
    forkq.default_client().redis.hincrby("fleet:runs", tag, 1)
