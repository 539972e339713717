"""A mixed fleet: Ruby Sidekiq 6.4.1 servers and forkq on one Redis, as during a migration
or with jobs in two languages. Each side's failures, processes, running jobs, counters and
schedule are read (and acted on) through the other side's API: Sidekiq::RetrySet,
DeadSet, ProcessSet, Workers, Stats, Queue#clear, ScheduledSet#clear in Ruby
(tests/interop/inspect.rb), forkq.api and the admin CLI here.

Needs Debian's ruby-sidekiq (the `sidekiq_ruby` fixture skips otherwise).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

import forkq
from corekit import CORE_JOBS, REPO_ROOT, CoreWorker, hand_driven, records, run_one, wait_records
from corekit import workers  # noqa: F401  (the fixture)
from forkq import api
from forkq.retry import Outcomes
from forkq.scheduler import Scheduler
from helpers import wait_until
from test_admin_cli import ok_json

FAILED = "interop:sidekiq_failed"
SIDEKIQ_RAN = "interop:sidekiq_ran"
FAIL_BACKTRACE = "tests.apps.core_jobs.fail_backtrace"
SLEEPY = "tests.apps.core_jobs.sleepy"


def run(*args: str, cwd) -> subprocess.CompletedProcess:
    """`python -m forkq ARGS` of this checkout, in `cwd` (no pyproject.toml there to point it
    elsewhere)."""
    paths = (str(REPO_ROOT), os.environ.get("PYTHONPATH"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    return subprocess.run([sys.executable, "-m", "forkq", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=30, stdin=subprocess.DEVNULL)


def inspect(sidekiq_ruby, redis_url, *actions: str) -> dict:
    """What Ruby Sidekiq's API reads from the shared Redis (tests/interop/inspect.rb), after
    `actions`; any exception in Ruby fails the test."""
    out = subprocess.run([sidekiq_ruby.ruby, str(sidekiq_ruby.interop_dir / "inspect.rb"), *actions],
                         env=sidekiq_ruby._env(redis_url), capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _one(entries: list[dict], jid: str) -> dict:
    (entry,) = [e for e in entries if e["jid"] == jid]
    return entry


# -- failures, both ways ---------------------------------------------------------------


@pytest.mark.timeout(90)
def test_a_forkq_failure_is_read_by_ruby_moved_back_by_its_poller_and_run_by_forkq(
        sidekiq_ruby, redis_url, r, tmp_path):
    manager = hand_driven(redis_url, "default", "fleet:1:aaaaaaaaaaaa")
    try:
        jid = forkq.Client(redis_url).push(FAIL_BACKTRACE, ["x"], backtrace=True)
        run_one(manager)  # fails: KeyError, into retry
        (raw,) = r.zrange("retry", 0, -1)

        ruby = _one(inspect(sidekiq_ruby, redis_url)["retry"], jid)
        assert (ruby["class"], ruby["queue"], ruby["display_args"]) == (FAIL_BACKTRACE, "default", ["x"])
        assert (ruby["error_class"], ruby["error_message"]) == ("KeyError", "'deep x'")
        assert ruby["retry_count"] == 0 and ruby["retried_at"] is None
        assert ruby["failed_at"] == pytest.approx(time.time(), abs=30)
        assert ruby["at"] > ruby["failed_at"]  # forkq's backoff, as Sidekiq schedules it
        assert any("in _deep_raise" in line for line in ruby["error_backtrace"])

        # due now; a Ruby server that works no queue of this job's moves it as Sidekiq does
        r.zadd("retry", {raw: time.time() - 1})
        with sidekiq_ruby.server(redis_url, queues=["other"], log_path=tmp_path / "sidekiq.log"):
            wait_until(lambda: r.llen("queue:default") == 1, timeout=30,
                       message="Sidekiq's retry poller moved the job")
        (moved,) = [json.loads(m) for m in r.lrange("queue:default", 0, -1)]
        before = json.loads(raw)
        assert moved["enqueued_at"] > before["enqueued_at"]
        assert {**moved, "enqueued_at": None} == {**before, "enqueued_at": None}  # untouched

        run_one(manager)  # forkq runs it: it fails again, its second failure
        retries = api.retries(r)
        (entry,) = list(retries)
        assert entry.jid == jid and entry.job["retry_count"] == 1
        assert entry.job["failed_at"] == before["failed_at"]
        assert entry.job["retried_at"] > moved["enqueued_at"]
        ruby = _one(inspect(sidekiq_ruby, redis_url)["retry"], jid)
        assert ruby["retry_count"] == 1 and ruby["retried_at"] == entry.job["retried_at"]
        assert ruby["failed_at"] == before["failed_at"]
    finally:
        manager.fetch.close()


@pytest.mark.timeout(90)
def test_a_ruby_failure_is_read_by_forkq_moved_by_its_scheduler_and_dies_in_ruby(
        sidekiq_ruby, redis_url, r, tmp_path):
    jid = sidekiq_ruby.push(redis_url, "FailingJob", ["y"], retry=1)
    scheduler = Scheduler(r, Outcomes(r, "fleet:unused"))
    retries, dead = api.retries(r), api.dead(r)
    with sidekiq_ruby.server(redis_url, queues=["default"], log_path=tmp_path / "sidekiq.log"):
        wait_until(lambda: retries.size() == 1, timeout=30, message="Sidekiq put the job in retry")
        (entry,) = list(retries)
        assert (entry.jid, entry.klass, entry.queue) == (jid, "FailingJob", "default")
        assert entry.job["error_class"] == "ArgumentError" and entry.job["retry_count"] == 0
        listed = ok_json("retry", "list")
        assert [(e["jid"], e["error_class"]) for e in listed] == [(jid, "ArgumentError")]

        # forkq's scheduler moves Sidekiq's retry (Sidekiq's own backoff is 15 s or more)
        assert scheduler.poll(now=entry.score + 1) == 1
        wait_until(lambda: dead.size() == 1, timeout=30,
                   message="Sidekiq ran it again and, its one retry used, killed it")
    assert r.llen(FAILED) == 2
    (killed,) = list(dead)
    assert killed.jid == jid and killed.job["retry_count"] == 1
    assert killed.job["failed_at"] == entry.job["failed_at"] and killed.job["retried_at"] > entry.score - 60
    assert [e["jid"] for e in ok_json("dead", "list")] == [jid]


# -- processes, running jobs and counters ------------------------------------------------


class ForkqMaster(CoreWorker):
    """`forkq start` with a master and its children (not --no-fork), running core_jobs."""

    def __init__(self, url, log_path, processes=2):
        super().__init__(url, CORE_JOBS, queues=["default"], concurrency=1, log_path=log_path,
                         extra_args=["--processes", str(processes), "--timeout", "1",
                                     "--heartbeat-interval", "0.5"])

    def command(self):
        return [arg for arg in super().command() if arg != "--no-fork"]


@pytest.mark.timeout(90)
def test_ruby_sees_forkqs_children_their_jobs_and_counts_and_quiets_and_stops_them(
        sidekiq_ruby, redis_url, r, tmp_path):
    client = forkq.Client(redis_url)
    client.push("tests.apps.core_jobs.fail", ["f"], retry=0)  # one failure, into dead
    with ForkqMaster(redis_url, tmp_path / "forkq.log") as master:
        jids = [client.push(SLEEPY, [60, n]) for n in range(2)]  # one per child
        running = wait_until(lambda: (lambda b: b if len(b) == 2 else None)(ok_json("busy")),
                             timeout=20, message="both children running a sleepy job")
        waiting = [client.push(SLEEPY, [0, "w"]) for _ in range(2)]
        client.push(SLEEPY, [0, "s"], at=time.time() + 3600)
        identities = {b["identity"] for b in running}

        wait_until(lambda: sum(p.busy for g in api.processes(r) for p in g.processes) == 2,
                   timeout=10, message="the heartbeats count both busy threads")
        t0 = time.monotonic()
        ruby = inspect(sidekiq_ruby, redis_url)
        (default,) = [q for q in ok_json("queues") if q["name"] == "default"]
        # both ages of the same oldest job, read this far apart
        assert 0 <= default["latency"] - ruby["stats"]["default_queue_latency"] <= time.monotonic() - t0
        assert ruby["stats"]["default_queue_latency"] > 0
        assert {p["identity"] for p in ruby["processes"]} == identities
        for p in ruby["processes"]:
            assert (p["concurrency"], p["busy"], p["quiet"], p["stopping"]) == (1, 1, "false", False)
            assert p["identity"].startswith(f'{p["hostname"]}:{p["pid"]}:') and p["queues"] == ["default"]
        assert sorted((w["process"], w["jid"], w["class"], w["queue"]) for w in ruby["workers"]) == \
            sorted((b["identity"], b["jid"], b["class"], "default") for b in running)
        assert {w["jid"] for w in ruby["workers"]} == set(jids)

        stats, ours = ruby["stats"], ok_json("stats")
        assert (stats["processed"], stats["failed"]) == (ours["processed"], ours["failed"]) == (1, 1)
        assert stats["enqueued"] == ours["enqueued"] == len(waiting)
        assert (stats["scheduled_size"], stats["retry_size"], stats["dead_size"]) == \
            (ours["scheduled"], ours["retries"], ours["dead"]) == (1, 0, 1)
        assert stats["processes_size"] == ours["processes"] == 2
        assert stats["workers_size"] == ours["busy"] == len(ok_json("busy")) == 2

        # Sidekiq's Quiet on one child: forkq quiets its master's children (README)
        one = sorted(identities)[0]
        inspect(sidekiq_ruby, redis_url, f"quiet:{one}")
        wait_until(lambda: all(p["stopping"] for p in inspect(sidekiq_ruby, redis_url)["processes"]),
                   timeout=15, message="Ruby sees every forkq child quiet")
        assert r.llen("queue:default") == len(waiting)  # quiet: nothing new started

        inspect(sidekiq_ruby, redis_url, f"stop:{one}")
        assert master.wait_exit(20) == 0
    ruby = inspect(sidekiq_ruby, redis_url)
    assert ruby["processes"] == [] and ruby["workers"] == []
    assert ruby["stats"]["enqueued"] == 4  # the two running were put back
    assert ruby["queues"]["default"]["size"] == 4


@pytest.mark.timeout(30)
def test_forkq_stats_gives_sidekiqs_workers_size_and_default_queue_latency(sidekiq_ruby, redis_url, r):
    # heartbeats of two processes of any kind, and a job that has waited on `default` for
    # a minute
    for identity, busy in (("a:1:aaaaaaaaaaaa", 2), ("b:2:bbbbbbbbbbbb", 3)):
        r.sadd("processes", identity)
        r.hset(identity, mapping={"info": json.dumps({"hostname": "a", "pid": 1}), "busy": busy,
                                  "beat": time.time(), "quiet": "false"})
    r.sadd("queues", "default")
    r.lpush("queue:default", json.dumps({"class": "X", "args": [], "jid": "c" * 24, "queue": "default",
                                         "enqueued_at": time.time() - 60}))
    t0 = time.monotonic()
    ruby = inspect(sidekiq_ruby, redis_url)["stats"]
    ours = ok_json("stats")
    assert ruby["workers_size"] == ours["busy"] == 5
    assert 0 <= ours["default_latency"] - ruby["default_queue_latency"] <= time.monotonic() - t0
    assert ruby["default_queue_latency"] >= 60
    # a member that is no hash (Sidekiq's Stats raises WRONGTYPE) counts as not busy
    r.sadd("processes", "not-a-hash")
    r.set("not-a-hash", "x")
    out = run("stats", cwd=".")
    assert out.returncode == 0 and "busy  default latency" in out.stdout, out.stderr
    assert ok_json("stats")["busy"] == 5


# -- the schedule, and clearing from Ruby --------------------------------------------------


RECORD = "tests.apps.core_jobs.record"


@pytest.mark.timeout(90)
def test_ruby_schedules_and_clears_while_forkq_works(sidekiq_ruby, redis_url, r, workers):
    worker = workers(concurrency=1, timeout=1, poll_interval=0.2,
                     extra_args=["--heartbeat-interval", "0.5"])
    client = forkq.Client(redis_url)
    at = time.time() + 1
    sidekiq_ruby.push(redis_url, RECORD, ["ruby-in"], at=at)  # perform_in, from Ruby
    (ran,) = wait_records(r, 1, worker, kind="record", timeout=20)
    assert ran["args"] == ["ruby-in"] and ran["t"] >= at  # by forkq, at its time

    # forkq busy with one job, one waiting, one scheduled: Sidekiq's Clear on both
    client.push(SLEEPY, [60, "busy"])
    wait_until(lambda: len(api.running(r)) == 1, timeout=10,
               message="the sleepy job running, in the heartbeat Sidekiq::Workers reads")
    client.push(RECORD, ["cleared"])
    client.push(RECORD, ["unscheduled"], at=time.time() + 1)
    ruby = inspect(sidekiq_ruby, redis_url, "clear-queue:default", "clear-schedule")
    assert ruby["stats"]["enqueued"] == 0 and ruby["scheduled"] == [] and ruby["queues"] == {}
    assert len(ruby["workers"]) == 1  # what runs is not Sidekiq's to clear

    # what was running comes back at forkq's stop, on the queue Sidekiq sees
    assert worker.stop() == 0
    assert [rec["args"] for rec in records(r, "record")] == [["ruby-in"]]
    ruby = inspect(sidekiq_ruby, redis_url)
    assert ruby["stats"]["enqueued"] == 1 and ruby["queues"]["default"]["size"] == 1
    assert ok_json("stats")["enqueued"] == 1


# -- forkq's ctl in a mixed fleet ------------------------------------------------------------


@pytest.mark.timeout(60)
def test_ctl_host_and_all_reach_forkq_only_and_leave_ruby_sidekiq_alone(sidekiq_ruby, redis_url, r,
                                                                        workers, tmp_path):
    server = sidekiq_ruby.server(redis_url, log_path=tmp_path / "sidekiq.log")
    with server:
        worker = workers(extra_args=["--heartbeat-interval", "0.5"])
        marker = f":{server.proc.pid}:".encode()
        ruby = wait_until(lambda: next((m.decode() for m in r.smembers("processes") if marker in m), None),
                          timeout=15, message="the Ruby server's heartbeat")
        (host,) = {p.hostname for g in api.processes(r) for p in g.processes}

        for target in (["--host", host], ["--all"]):
            out = run("ctl", "quiet", *target, cwd=tmp_path)
            assert out.returncode == 0, out.stderr
            # a deploy's `forkq ctl stop --host H` must not stop the Ruby workers on H
            assert out.stdout.split() == ["TSTP", "->", worker.identity]
            assert r.llen(f"{ruby}-signals") == 0
            assert f"left alone, not forkq (Ruby Sidekiq?): {ruby}" in out.stderr
        wait_until(lambda: {p.identity: p.quiet for g in api.processes(r) for p in g.processes}
                   == {worker.identity: True, ruby: False}, timeout=10, message="forkq quiet, Ruby not")
        # one process named: that one, Ruby's too (as Sidekiq's Web UI can)
        out = run("ctl", "quiet", "--identity", ruby, cwd=tmp_path)
        assert out.returncode == 0 and out.stdout.split() == ["TSTP", "->", ruby], out.stderr
