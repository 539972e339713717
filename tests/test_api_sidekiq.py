"""forkq.api and the admin CLI read and steer what Ruby Sidekiq 6.4.1 itself wrote: its
retry and dead entries, its heartbeat, its running jobs, and its `-signals` list.

Needs Debian's ruby-sidekiq (the `sidekiq_ruby` fixture skips otherwise).
"""

from __future__ import annotations

import json

import pytest

from forkq import api, control
from helpers import wait_until
from test_admin_cli import ok_json, run

FAILED = "interop:sidekiq_failed"


def _ruby_identity(r, server) -> str:
    (identity,) = [m.decode() for m in r.smembers("processes") if f":{server.proc.pid}:".encode() in m]
    return identity


@pytest.mark.timeout(90)
def test_retry_entry_written_by_sidekiq_is_listed_and_retried_now(sidekiq_ruby, redis_url, r, tmp_path):
    jid = sidekiq_ruby.push(redis_url, "FailingJob", ["x", 1])
    with sidekiq_ruby.server(redis_url, log_path=tmp_path / "sidekiq.log"):
        retries = api.retries(r)
        wait_until(lambda: retries.size() == 1, timeout=30, message="Sidekiq put the job in retry")
        (entry,) = list(retries)
        assert (entry.jid, entry.klass, entry.queue) == (jid, "FailingJob", "default")
        assert entry.job["error_class"] == "ArgumentError"
        assert entry.job["retry_count"] == 0
        assert entry.score > entry.job["failed_at"]  # Sidekiq schedules the retry ahead

        listed = ok_json("retry", "list", "--class", "FailingJob")
        assert [e["jid"] for e in listed] == [jid]
        assert listed[0]["error_class"] == "ArgumentError"

        # Sidekiq's own backoff would wait 15 s or more; retry-now hands it back at once
        out = run("retry", "retry-now", "--jid", jid)
        assert out.returncode == 0, out.stderr
        wait_until(lambda: r.llen(FAILED) == 2, timeout=20, message="Sidekiq ran the job again")
        wait_until(lambda: retries.size() == 1, timeout=20, message="back in retry after failing")
        (again,) = list(retries)
        # retry-now lowered retry_count by one (0 -> -1, as Sidekiq's Web UI does), so the
        # second failure does not use up a retry
        assert again.jid == jid and again.job["retry_count"] == 0


@pytest.mark.timeout(90)
def test_dead_entry_written_by_sidekiq_is_found_and_retried_into_a_queue(sidekiq_ruby, redis_url, r,
                                                                        tmp_path):
    jid = sidekiq_ruby.push(redis_url, "DoomedJob", [7], queue="other", retry=0)
    dead = api.dead(r)
    with sidekiq_ruby.server(redis_url, log_path=tmp_path / "sidekiq.log"):
        wait_until(lambda: dead.size() == 1, timeout=30, message="Sidekiq killed the job")
    entry = dead.find(jid)
    assert entry is not None and entry.klass == "DoomedJob" and entry.queue == "other"
    assert entry.job["error_class"] == "RuntimeError"
    assert "gives up at once" in entry.job["error_message"]
    assert [e.jid for e in dead.entries(api.matching(queue="other"))] == [jid]

    assert dead.retry_now([entry]) == 1
    assert dead.size() == 0
    (queued,) = [json.loads(raw) for raw in r.lrange("queue:other", 0, -1)]
    assert queued["jid"] == jid and queued["args"] == [7] and queued["enqueued_at"] >= entry.score


@pytest.mark.timeout(90)
def test_sidekiq_process_and_its_running_job_show_and_quiet_reaches_it(sidekiq_ruby, redis_url, r,
                                                                       tmp_path):
    jid = sidekiq_ruby.push(redis_url, "SlowJob", [30])
    # -t 1: the 30 s job is still running when the test ends, and Sidekiq's stop would give
    # it the default 5 s before pushing it back
    server = sidekiq_ruby.server(redis_url, concurrency=3, log_path=tmp_path / "sidekiq.log", timeout=1)
    with server:
        identity = _ruby_identity(r, server)
        wait_until(lambda: any(j.job and j.job.get("jid") == jid for j in api.running(r)), timeout=20,
                   message="the running SlowJob in Sidekiq's workers hash")
        (job,) = [j for j in api.running(r) if j.identity == identity]
        assert job.queue == "default" and job.job["class"] == "SlowJob" and job.run_at > 0

        (proc,) = [p for g in api.processes(r) for p in g.processes if p.identity == identity]
        assert proc.pid == server.proc.pid and proc.concurrency == 3 and not proc.quiet
        wait_until(lambda: [p.busy for g in api.processes(r) for p in g.processes
                            if p.identity == identity] == [1], timeout=15,
                   message="Sidekiq's heartbeat counts the busy thread")

        busy = ok_json("busy")
        assert [(b["identity"], b["jid"], b["class"]) for b in busy] == [(identity, jid, "SlowJob")]

        assert control.remote_signal(r, "TSTP", identity=identity) == [identity]
        wait_until(lambda: [p.quiet for g in api.processes(r) for p in g.processes
                            if p.identity == identity] == [True], timeout=20,
                   message="Sidekiq read its -signals list and went quiet")
