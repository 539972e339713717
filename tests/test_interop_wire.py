"""What forkq writes, read and acted on by Ruby Sidekiq 6.4.1 (and compared with what
Sidekiq itself writes in the same case): dead entries of jobs with a retry_queue, the
heartbeat fields later Sidekiqs read, and the queue names Sidekiq's client refuses.

The Ruby tests need Debian's ruby-sidekiq (the `sidekiq_ruby` fixture skips otherwise).
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

import forkq
from corekit import workers  # noqa: F401
from forkq import keys
from forkq.retry import Outcomes
from helpers import wait_until

IDENTITY = "interop:1:abcdefabcdef"


def _ruby(sidekiq_ruby, redis_url, script: str) -> str:
    out = subprocess.run([sidekiq_ruby.ruby, "-e", 'require "sidekiq"; require "sidekiq/api"; ' + script],
                         env=sidekiq_ruby._env(redis_url), capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _ruby_push(sidekiq_ruby, redis_url, item: dict) -> str:
    return _ruby(sidekiq_ruby, redis_url,
                 f"puts Sidekiq::Client.push(JSON.parse({json.dumps(json.dumps(item))}))").strip()


def _fail_in_forkq(r, raw: bytes, queue: str, exc: BaseException) -> str:
    """What a forkq processor does with a job fetched from `queue` that raised `exc`."""
    key = keys.inflight(IDENTITY)
    r.hset(key, "1\n" + queue, raw)
    job = json.loads(raw)
    job["queue"] = queue
    return Outcomes(r, key).failed(job, exc, "1\n" + queue, None)


@pytest.mark.timeout(90)
def test_a_dead_job_with_a_retry_queue_goes_back_to_it_as_sidekiqs_does(sidekiq_ruby, redis_url, r,
                                                                      tmp_path):
    item = {"class": "DoomedJob", "queue": "default", "args": [1], "retry": 0,
            "retry_queue": "other"}
    # Sidekiq's own: its worker (tests/interop/worker.rb) kills the job at its first failure
    ruby_jid = _ruby_push(sidekiq_ruby, redis_url, item)
    with sidekiq_ruby.server(redis_url, queues=["default"], log_path=tmp_path / "sidekiq.log"):
        wait_until(lambda: r.zcard("dead") == 1, timeout=30, message="Sidekiq killed its job")
    # forkq's: the same push, failed by forkq
    forkq_jid = _ruby_push(sidekiq_ruby, redis_url, item)
    raw = r.rpop("queue:default")  # fetched
    assert _fail_in_forkq(r, raw, "default", RuntimeError("doomed")) == "dead"

    dead = {e["jid"]: e for e in map(json.loads, r.zrange("dead", 0, -1))}
    assert dead[ruby_jid]["queue"] == "other"
    assert dead[forkq_jid]["queue"] == "other"

    # the Web UI's Retry on each: both go to the retry queue, neither back to default
    _ruby(sidekiq_ruby, redis_url, "Sidekiq::DeadSet.new.each(&:retry)")
    assert r.llen("queue:default") == 0
    assert {json.loads(raw)["jid"] for raw in r.lrange("queue:other", 0, -1)} == {ruby_jid, forkq_jid}


@pytest.mark.timeout(60)
def test_the_heartbeat_carries_the_thread_count_where_sidekiq_8_reads_it(workers, redis_url, r,
                                                                         sidekiq_ruby):
    worker = workers(concurrency=3)
    # Sidekiq 8.1.2+'s ProcessSet#each (and ProcessSet.[]): HMGET of these fields, then
    # "concurrency" => concurrency.to_i over info's; its Web UI's Threads column and
    # total come from there (lib/sidekiq/api.rb, commit 29f18983)
    info, concurrency = r.hmget(worker.identity, "info", "concurrency")
    assert json.loads(info)["concurrency"] == 3  # what 6.x, 7.x and 8.0-8.1.1 read
    assert concurrency == b"3"
    # and Sidekiq 6.4.1 still reads the heartbeat as before
    assert _ruby(sidekiq_ruby, redis_url, "puts Sidekiq::ProcessSet.new.total_concurrency").strip() == "3"


@pytest.mark.timeout(30)
def test_a_push_to_an_empty_queue_name_is_refused_as_sidekiqs_client_refuses_it(sidekiq_ruby,
                                                                             redis_url, r):
    refused = _ruby(sidekiq_ruby, redis_url, 'begin; Sidekiq::Client.push("class" => "X", '
                    '"args" => [], "queue" => ""); rescue ArgumentError => e; puts e.message; end')
    assert "valid queue name" in refused
    client = forkq.Client(redis_url)
    for at in (None, time.time() + 60):
        with pytest.raises(ValueError, match="non-empty name"):
            client.push("X", [1], queue="", at=at)
        # forkq's scheduler would kill it as malformed, and no --queue can name it
        with pytest.raises(ValueError, match="newline"):
            client.push_bulk("X", [[1], [2]], queue="a\nb", at=at)
        with pytest.raises(TypeError, match="must be a str, not int"):
            client.push("X", [1], queue=5, at=at)
    assert r.keys("*") == []
    # a middleware may set the queue too
    renamed = forkq.Client(redis_url, middleware=[lambda job: {**job, "queue": ""}])
    with pytest.raises(ValueError, match="non-empty name"):
        renamed.push("X", [1])
    assert r.keys("*") == []


@pytest.mark.timeout(60)
def test_tags_that_are_no_list_are_refused_as_sidekiqs_client_refuses_them(sidekiq_ruby, redis_url, r,
                                                                         tmp_path):
    refused = _ruby(sidekiq_ruby, redis_url, 'begin; Sidekiq::Client.push("class" => "X", '
                    '"args" => [], "tags" => "billing"); rescue ArgumentError => e; puts e.message; end')
    assert "tags must be an Array" in refused
    # What refusing saves: a Ruby server's poller takes such a job out of `schedule` (or
    # `retry`), then its push raises, and the job is gone (Sidekiq 6.4.1)
    r.zadd("schedule", {json.dumps({"class": "InteropJob", "args": [1], "jid": "b" * 24,
                                    "queue": "default", "retry": True, "tags": "billing"}): 1})
    with sidekiq_ruby.server(redis_url, queues=["none"], log_path=tmp_path / "sidekiq.log") as server:
        wait_until(lambda: r.zcard("schedule") == 0, timeout=30, message="Sidekiq polled it")
        wait_until(lambda: "tags must be an Array" in server.log_tail(), timeout=10,
                   message="Sidekiq's poller failed to push it")
    assert r.llen("queue:default") == 0 and r.zcard("schedule") == 0
    r.flushall()

    client = forkq.Client(redis_url)
    for at in (None, time.time() + 60):
        with pytest.raises(TypeError, match="'tags' must be a list"):
            client.push("X", [1], tags="billing", at=at)
        with pytest.raises(TypeError, match="'tags' must be a list"):
            client.push_bulk("X", [[1], [2]], tags=("a", "b"), at=at)
    with pytest.raises(TypeError, match="'tags' must be a list"):
        forkq.job(name="Tagged", tags="billing")(lambda: None)
    tagging = forkq.Client(redis_url, middleware=[lambda job: {**job, "tags": "billing"}])
    with pytest.raises(TypeError, match="'tags' must be a list"):
        tagging.push("X", [1])
    assert r.keys("*") == []
    assert client.push("X", [1], tags=["billing"]) and client.push("X", [2], tags=None)


def _nested(levels: int) -> list:
    value: list = []
    for _ in range(levels - 1):
        value = [value]
    return value


@pytest.mark.timeout(60)
def test_arguments_nested_past_what_sidekiqs_json_parses_are_refused(sidekiq_ruby, redis_url, r):
    # Ruby's JSON.parse (Sidekiq.load_json) stops at 100 levels; Sidekiq's poller takes a job
    # out of `schedule` or `retry` before parsing it, so a deeper one was lost there
    client = forkq.Client(redis_url)
    at = time.time() + 3600
    deepest = [client.push("X", [_nested(98)], at=at), client.push("X", kwargs={"k": _nested(98)}, at=at),
               client.push("X", [1], at=at, extra=_nested(99))]
    parsed = _ruby(sidekiq_ruby, redis_url, """
        Sidekiq.redis { |c| c.zrange("schedule", 0, -1) }.each do |raw|
          begin; puts Sidekiq.load_json(raw)["jid"]; rescue JSON::NestingError => e; puts e.message; end
        end""")
    assert sorted(parsed.split()) == sorted(deepest)  # as deep as Ruby Sidekiq reads

    for push in (lambda: client.push("X", [1, _nested(99)], at=at),
                 lambda: client.push("X", kwargs={"k": _nested(99)}),
                 lambda: client.push_bulk("X", [[1], [_nested(99)]]),
                 lambda: client.push("X", [1], extra=_nested(100))):
        with pytest.raises(TypeError, match="nested too deeply.*at most 100 levels"):
            push()
    assert r.zcard("schedule") == 3 and r.llen("queue:default") == 0


def _raise(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:
        return caught


@pytest.mark.timeout(60)
def test_sidekiqs_web_ui_shows_a_forkq_backtrace_without_running_the_jobs_input(sidekiq_ruby,
                                                                              redis_url, r):
    attack = "<img src=x onerror=alert(document.cookie)>"
    job = {"class": "Signup", "args": [attack], "jid": "a" * 24, "queue": "default",
           "retry": True, "backtrace": True}
    exc = _raise(ValueError(f"not an e-mail address: {attack}"))
    assert _fail_in_forkq(r, json.dumps(job).encode(), "default", exc) == "retry"

    # Sidekiq 6.4.1's retry page (7.x's and 8.x's write the backtrace the same way: plain
    # ERB, lines joined with <br/>, not escaped)
    page = _ruby(sidekiq_ruby, redis_url, """
        require "sidekiq/web"; require "rack/mock"
        e = Sidekiq::RetrySet.new.first
        res = Rack::MockRequest.new(Sidekiq::Web.new).get("/retries/#{e.score}-#{e.jid}",
                                                          "rack.session" => {})
        abort("status #{res.status}") unless res.status == 200
        puts Sidekiq::RetrySet.new.first.error_backtrace.inspect
        print res.body""")
    frames, body = page.split("\n", 1)
    assert "in _raise" in frames  # Sidekiq reads the frames
    assert "&lt;img src=x onerror" in body  # the message, escaped by Sidekiq
    assert "<img src=x" not in body
