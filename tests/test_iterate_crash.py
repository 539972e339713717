"""Crashes of iterable jobs and --poison-after (scripts/requeue_all.lua): a death counts
toward poison only while the job's checkpoint has not moved since the last death counted.
The recovery script a master runs after a child's death (and orphan recovery after a whole
forkq's), called directly on a crafted in-flight hash: no process is killed."""

from __future__ import annotations

import json
import time

import pytest

import forkq
from forkq import iterate, keys
from forkq.fetch import requeue_owner_counts

QUEUE = "itcrash"
IDENT = "test:1:itcrash000001"


def crash(r, job: dict, checkpoint=None, poison_after: int = 3):
    """`job` in flight in IDENT as it dies, its checkpoint (if any) as the runner left it."""
    if checkpoint is not None:
        r.set(iterate.PREFIX + job["jid"], iterate._dump(checkpoint, "it.x"), ex=iterate.TTL_S)
    r.hset(keys.inflight(IDENT), f"7\n{QUEUE}", json.dumps(job))
    return requeue_owner_counts(r, IDENT, [QUEUE], crashed=True, poison_after=poison_after)


def job(jid: str) -> dict:
    return {"class": "it.x", "queue": QUEUE, "args": [1], "jid": jid, "created_at": time.time()}


def count(r, jid: str) -> int | None:
    raw = r.get(keys.CRASH_PREFIX + jid)
    return None if raw is None else int(raw)


@pytest.mark.timeout(10)
def test_an_iterable_job_that_checkpoints_between_its_deaths_is_never_poison(r):
    """OOM-killed every few hours, each time further on: it is what iterable jobs are for.
    Each death still makes it a suspect (run alone), with a count that starts afresh."""
    it = job("aaaa00000000000000000001")
    # a dict cursor holding the checkpoint's own field names: only the cursor's text counts
    for n, cursor in enumerate([None, 10, 20, {"at": 30, "page": "x, \"at\": 1}"}, [40], "50"]):
        got = crash(r, it, checkpoint=cursor)
        assert (got.poisoned, got.suspects) == (0, 1), (n, cursor)
        assert count(r, it["jid"]) == 1, "a death after progress counts as the first"
        assert r.lpop(keys.suspects(QUEUE)) is not None
    assert r.zcard("dead") == 0


@pytest.mark.timeout(10)
def test_deaths_with_no_progress_between_them_still_poison_the_job(r):
    """Three deaths at the same cursor poison it, though each run rewrote the checkpoint
    (its time moves at every write, the cursor not), and though it moved before."""
    it = job("bbbb00000000000000000002")
    assert crash(r, it, checkpoint=5).poisoned == 0
    r.delete(keys.suspects(QUEUE))
    for n in (1, 2):
        time.sleep(0.002)  # another "at" in the checkpoint's JSON
        assert crash(r, it, checkpoint={"page": 6}).poisoned == 0
        assert count(r, it["jid"]) == n
        r.delete(keys.suspects(QUEUE))
    got = crash(r, it, checkpoint={"page": 6})
    assert got.poisoned == 1 and got.suspects == 0
    dead = json.loads(r.zrange("dead", 0, -1)[0])
    assert dead["jid"] == it["jid"] and dead["error_class"] == "forkq.PoisonJob"
    assert dead["error_message"] == "killed its worker process 3 times without its checkpoint moving"
    assert r.keys(keys.CRASH_PREFIX + "*") == [], "its count and cursor mark go with it"
    assert r.get(iterate.PREFIX + it["jid"]) is not None, "kept: a retry from dead resumes"

    # any other job (no checkpoint): three deaths, as before
    plain = job("cccc00000000000000000003")
    assert [crash(r, plain).poisoned for _ in range(3)] == [0, 0, 1]
    assert json.loads(r.zrange("dead", -1, -1)[0])["error_message"] == "killed its worker process 3 times"


@pytest.mark.timeout(60)
def test_a_real_master_finishes_an_iterable_job_that_dies_past_poison_after_moving_on(
        redis_url, r, tmp_path):
    """--poison-after 2, end to end: a job whose child it SIGKILLs after each item, three
    times, each time further on, ends done; one killed twice at the same cursor goes to
    dead as poison."""
    from helpers import wait_until
    from test_supervisor import APPS, Master

    def runs(tag):
        return [x.decode().split()[1:] for x in r.lrange("itc:runs", 0, -1) if x.startswith(tag.encode())]

    m = Master(redis_url, tmp_path / "m", processes=1, concurrency=1, app=APPS / "iterate_crash_jobs.py",
               args=["--poison-after", "2", "--heartbeat-interval", "0.2"]).start()
    try:
        client = forkq.Client(redis_url)
        steps = client.push("itc.steps", [4])

        def ended():
            m.check()
            if r.zcard("dead"):
                return "dead"
            return len(runs("steps")) == 4 and r.get(iterate.PREFIX + steps) is None and "done"
        assert wait_until(ended, timeout=30, interval=0.05, message="steps done or dead") == "done", (
            f"{r.zrange('dead', 0, -1)}, runs {runs('steps')}")
        got = runs("steps")
        assert [c for c, _ in got] == ["0", "1", "2", "3"], "each run resumed after the last"
        assert len({pid for _, pid in got}) == 4, "three deaths, each in another child"
        assert r.zcard("dead") == 0 and r.llen(keys.suspects("default")) == 0
        wait_until(lambda: r.get(keys.CRASH_PREFIX + steps) is None, timeout=5, interval=0.02,
                   message="its crash count gone as it ended")

        stuck = client.push("itc.stuck", [])
        entry = wait_until(lambda: m.check() and r.zrange("dead", 0, -1), timeout=30, interval=0.05,
                           message="stuck in dead")
        dead = json.loads(entry[0])
        assert dead["jid"] == stuck and dead["error_class"] == "forkq.PoisonJob"
        assert dead["error_message"] == "killed its worker process 2 times without its checkpoint moving"
        assert [c for c, _ in runs("stuck")] == ["None", "7"]
    finally:
        m.kill()
