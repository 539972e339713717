"""What a real worker does with failing jobs: retry set, dead set, hooks, malformed payloads.

Each test starts `forkq start --no-fork --require tests/apps/core_jobs.py` on the shared
redis-server (flushed first) and pushes jobs with forkq's client or raw LPUSH.
"""

import json
import re
import time

import pytest

import forkq
from corekit import (core_jobs, forkq_client, records, seen, wait_records,  # noqa: F401
                     wait_zset, workers, zset)
from forkq.payload import decode_backtrace
from helpers import wait_until

JID = re.compile(r"\A[0-9a-f]{24}\Z")


@pytest.mark.timeout(30)
def test_first_failure_goes_to_retry_with_sidekiqs_fields(workers, forkq_client, r):
    worker = workers()
    before = time.time()
    jid = core_jobs.fail.options(tenant={"id": 7}, wrapped="Shown").enqueue("a")

    ((job, score),) = wait_zset(r, "retry", 1, worker)
    after = time.time()
    assert job["jid"] == jid
    assert job["retry_count"] == 0
    assert job["error_class"] == "ValueError"
    assert job["error_message"] == "boom a"
    assert before <= job["failed_at"] <= after
    assert "retried_at" not in job
    assert "error_backtrace" not in job  # not asked for
    # unknown fields and everything the client wrote are kept untouched
    assert job["tenant"] == {"id": 7} and job["wrapped"] == "Shown"
    assert job["args"] == ["a"] and job["queue"] == "default" and job["retry"] is True
    assert isinstance(job["created_at"], float) and isinstance(job["enqueued_at"], float)
    # Sidekiq's first delay: 0**4 + 15 + rand(10) * 1, i.e. 15..24 s
    assert job["failed_at"] + 15 <= score <= job["failed_at"] + 25
    assert not r.exists("queue:default") and not r.exists("dead")


@pytest.mark.timeout(30)
def test_second_failure_increments_retry_count_and_sets_retried_at(workers, forkq_client, r):
    worker = workers(poll_interval=1)
    core_jobs.fail.enqueue("b")
    ((first, _),) = wait_zset(r, "retry", 1, worker)

    # make the retry due now; the worker's poller moves it back and it fails again
    (member,) = r.zrange("retry", 0, -1)
    assert r.zadd("retry", {member: time.time() - 1}, xx=True, ch=True) == 1

    def second_failure():
        worker.assert_alive()
        entries = zset(r, "retry")
        return entries if entries and entries[0][0].get("retry_count") == 1 else None

    ((second, score),) = wait_until(second_failure, timeout=10, message="retry_count 1 in retry")
    assert second["jid"] == first["jid"]
    assert second["failed_at"] == first["failed_at"]  # the first failure's time stays
    assert second["retried_at"] > first["failed_at"]
    assert second["error_message"] == "boom b"
    # retry number 1: 1**4 + 15 + rand(10) * 2 -> 16..34 s
    assert second["retried_at"] + 16 <= score <= second["retried_at"] + 35
    assert second["enqueued_at"] > first["enqueued_at"]  # moving to the queue re-stamps it
    assert len(records(r, "fail")) == 2


@pytest.mark.timeout(30)
def test_retry_false_drops_the_job(workers, forkq_client, r):
    worker = workers(concurrency=1)
    core_jobs.fail_no_retry.enqueue("x")
    core_jobs.record.enqueue("after")  # with one processor, it runs after the failure
    wait_records(r, 1, worker, kind="record")
    assert len(records(r, "fail")) == 1
    assert r.zcard("retry") == 0 and r.zcard("dead") == 0
    assert not r.exists("queue:default")


@pytest.mark.timeout(30)
def test_retry_zero_goes_to_dead_and_calls_the_exhausted_hook(workers, forkq_client, r):
    worker = workers()
    before = time.time()
    jid = core_jobs.fail_exhausted.enqueue("z")

    ((job, score),) = wait_zset(r, "dead", 1, worker)
    assert job["jid"] == jid
    assert job["retry_count"] == 0 and job["error_message"] == "exhausted z"
    assert before <= score <= time.time()
    (hook,) = wait_records(r, 1, worker, kind="exhausted")
    assert hook["args"] == [jid, 0, "ValueError"]
    assert r.zcard("retry") == 0


@pytest.mark.timeout(30)
def test_retries_exhausted_after_the_last_retry(workers, forkq_client, r):
    worker = workers(poll_interval=1)
    jid = core_jobs.fail_twice.enqueue("t")  # retry=1 and a retry_in hook of 0 s

    ((job, _),) = wait_zset(r, "dead", 1, worker, timeout=10)
    assert job["jid"] == jid
    assert job["retry_count"] == 1 and "retried_at" in job
    assert len(records(r, "fail")) == 2
    (hook,) = wait_records(r, 1, worker, kind="exhausted")
    assert hook["args"] == [jid, 1, "ValueError"]
    assert r.zcard("retry") == 0


@pytest.mark.timeout(30)
def test_dead_false_drops_instead_of_killing(workers, forkq_client, r):
    worker = workers(concurrency=1)
    core_jobs.fail_no_dead.enqueue("n")
    core_jobs.record.enqueue("after")
    wait_records(r, 1, worker, kind="record")
    assert len(records(r, "exhausted")) == 1  # the hook still runs
    assert r.zcard("dead") == 0 and r.zcard("retry") == 0


@pytest.mark.timeout(30)
def test_retry_in_hook_decides(workers, forkq_client, r):
    worker = workers(concurrency=1)
    seconds = core_jobs.fail_hooked.enqueue("seconds")
    discard = core_jobs.fail_hooked.enqueue("discard")
    kill = core_jobs.fail_hooked.enqueue("kill")
    fallback = core_jobs.fail_hooked.enqueue("none")  # None: Sidekiq's own backoff
    core_jobs.record.enqueue("after")
    started = time.time()
    wait_records(r, 1, worker, kind="record")

    assert [rec["args"] for rec in records(r, "retry_in")] == [
        [0, "seconds"], [0, "discard"], [0, "kill"], [0, "none"]]
    retry = {job["jid"]: (job, score) for job, score in zset(r, "retry")}
    dead = {job["jid"]: job for job, _ in zset(r, "dead")}
    assert set(retry) == {seconds, fallback}
    assert set(dead) == {kill}
    assert discard not in retry and discard not in dead
    job, score = retry[seconds]
    assert job["failed_at"] + 1000 <= score <= job["failed_at"] + 1009  # plus Sidekiq's jitter
    job, score = retry[fallback]
    assert job["failed_at"] + 15 <= score <= job["failed_at"] + 25
    assert dead[kill]["retry_count"] == 0 and dead[kill]["error_class"].endswith("HookedError")
    assert time.time() - started < 10


def _jitters(entries, since):
    """Each retry's delay past `since` seconds, which Sidekiq's jitter makes whole seconds."""
    out = []
    for job, score in entries:
        extra = score - job["retried_at" if "retried_at" in job else "failed_at"] - since
        assert abs(extra - round(extra)) < 1e-3, extra
        out.append(round(extra))
    return out


@pytest.mark.timeout(30)
def test_a_retry_in_delay_gets_sidekiqs_jitter_and_zero_retries_at_once(workers, forkq_client, r):
    worker = workers(concurrency=4)
    n = 30
    # retry number 0: rand(10) * 1 seconds on top of the hook's 1000
    first = {core_jobs.fail_hooked.enqueue("seconds") for _ in range(n)}
    # retry number 3 (the payload says two retries happened): rand(10) * 4
    fourth = {core_jobs.fail_hooked.options(retry_count=2).enqueue("seconds") for _ in range(n)}
    default = {core_jobs.fail_hooked.enqueue("none") for _ in range(n)}
    zero = core_jobs.fail_hooked.enqueue("zero")
    # the 90, not any 90 entries: the zero-delay job passes through retry too, and counted
    # among them it let the wait end with one of these not written yet
    wanted = first | fourth | default

    def written():
        worker.assert_alive()
        got = {job["jid"]: (job, score) for job, score in zset(r, "retry") if job["jid"] in wanted}
        return got if len(got) == len(wanted) else None
    entries = wait_until(written, timeout=10, interval=0.02, message=f"{len(wanted)} entries in retry")

    spread = _jitters([entries[j] for j in first], 1000)
    assert set(spread) <= set(range(10)) and len(set(spread)) > 1, spread
    spread = _jitters([entries[j] for j in fourth], 1000)
    assert set(spread) <= {4 * k for k in range(10)} and len(set(spread)) > 1, spread
    # Sidekiq's own delay for retry number 0 is 15 s plus the same jitter
    spread = _jitters([entries[j] for j in default], 15)
    assert set(spread) <= set(range(10)) and len(set(spread)) > 1, spread
    # 0 is due at once, with no jitter, and the worker's poller looks at once: the job's
    # five retries run back to back, where Sidekiq's jitter would add seconds between them
    ((dead, _),) = wait_zset(r, "dead", 1, worker)
    assert dead["jid"] == zero and dead["retry_count"] == 5
    assert dead["retried_at"] - dead["failed_at"] < 3


@pytest.mark.timeout(30)
def test_backtrace_option_stores_a_decodable_error_backtrace(workers, forkq_client, r):
    worker = workers()
    full = core_jobs.fail_backtrace.enqueue("all")
    three = core_jobs.fail_backtrace3.enqueue("three")
    one = core_jobs.fail_backtrace1.enqueue("one")
    entries = {job["jid"]: job for job, _ in wait_zset(r, "retry", 3, worker)}

    lines = decode_backtrace(entries[full]["error_backtrace"])
    assert all(isinstance(line, str) for line in lines)
    text = "\n".join(lines)
    assert "_deep_raise" in text and "fail_backtrace" in text
    # frames only, as in a Ruby backtrace: the message is error_message's (Sidekiq's Web UI
    # escapes that one and not the backtrace)
    assert "deep all" not in text and not text.startswith("Traceback")

    # backtrace=N keeps the N frames nearest the error, as Sidekiq's first N Ruby lines
    # (a Ruby line is a frame): each whole, from its file and line on
    short = decode_backtrace(entries[three]["error_backtrace"])
    files = [line for line in short if line.startswith('  File "')]
    assert short[0] == files[0] and len(files) == 3, short
    assert files[-2].endswith("in fail_backtrace3") and files[-1].endswith("in _deep_raise"), short
    assert short[-1].strip() == 'raise KeyError(f"deep {tag}")'
    # one frame: where the error was raised, not the caret line under it alone
    single = decode_backtrace(entries[one]["error_backtrace"])
    assert single[0].startswith('  File "') and single[0].endswith("in _deep_index"), single
    assert single[1].strip() == 'return {}[f"deep {tag}"]', single


@pytest.mark.timeout(30)
def test_retry_queue_is_used_for_the_retry(workers, forkq_client, r):
    worker = workers(queues=["default", "retries"], poll_interval=1)
    jid = core_jobs.fail_retry_queue.enqueue("q")
    ((job, _),) = wait_zset(r, "retry", 1, worker)
    assert job["queue"] == "retries" and job["retry_queue"] == "retries"

    (member,) = r.zrange("retry", 0, -1)
    assert r.zadd("retry", {member: time.time() - 1}, xx=True, ch=True) == 1
    wait_records(r, 2, worker, kind="fail")
    payloads = [p for p in seen(r) if p["jid"] == jid]
    assert [p["queue"] for p in payloads] == ["default", "retries"]


@pytest.mark.timeout(30)
def test_stat_failed_counts_failures(workers, forkq_client, r):
    worker = workers()
    for i in range(3):
        core_jobs.fail.enqueue(i)
    core_jobs.record.enqueue("ok")
    wait_zset(r, "retry", 3, worker)
    wait_records(r, 1, worker, kind="record")
    assert worker.stop(timeout=15) == 0
    day = time.strftime("%Y-%m-%d", time.gmtime())
    assert int(r.get("stat:failed")) == 3
    assert int(r.get(f"stat:failed:{day}")) == 3
    assert int(r.get("stat:processed")) == 4  # processed counts failed executions too


@pytest.mark.timeout(30)
def test_sys_exit_in_a_job_is_that_jobs_failure(workers, forkq_client, r):
    worker = workers(concurrency=1)
    jid = core_jobs.exits.enqueue("x")
    core_jobs.record.enqueue("after")  # the only processor must survive to run this

    wait_records(r, 1, worker, kind="record", timeout=5)
    ((job, _),) = zset(r, "retry")
    assert job["jid"] == jid and job["error_class"] == "SystemExit"
    worker.assert_alive()
    wait_until(lambda: r.hlen(f"forkq:inflight:{worker.identity}") == 0, timeout=5,
               message="nothing left in flight")


# -- payloads that are not runnable jobs ---------------------------------------------------

MALFORMED = [
    (b"this is not json", "not JSON"),
    (b'["an", "array"]', "JSON list, not an object"),
    (b'{"args": [1], "jid": "aaaaaaaaaaaaaaaaaaaaaaaa"}', "no 'class' string"),
    (b'{"class": "tests.apps.core_jobs.record", "args": "not a list"}', "'args' is missing or not a list"),
    (b'{"class": "tests.apps.core_jobs.record", "args": ["\xff\xfe bad utf-8"]}', "not valid UTF-8"),
]


@pytest.mark.timeout(30)
def test_malformed_payloads_go_to_dead_and_the_worker_keeps_going(workers, forkq_client, r):
    for raw, _ in MALFORMED:
        r.lpush("queue:default", raw)
    core_jobs.record.enqueue("still works")
    worker = workers(concurrency=1)  # one processor: the good job runs after all of them

    wait_records(r, 1, worker, kind="record")
    dead = zset(r, "dead")
    assert len(dead) == len(MALFORMED)
    by_reason = {}
    for entry, _ in dead:
        assert entry["error_class"] == "forkq.MalformedPayload"
        # not "default", where it came from: Sidekiq's Retry pushes an entry onto its queue,
        # and a worker there would drop the unrunnable forkq.MalformedJob with its bytes
        assert entry["queue"] == "forkq-malformed"
        assert entry["error_message"].endswith("(fetched from queue 'default')")
        assert JID.match(entry["jid"])
        by_reason[entry["error_message"]] = entry
    for raw, reason in MALFORMED:
        (entry,) = [e for message, e in by_reason.items() if reason in message]
        # the original bytes are kept, readable when they are text
        if "utf-8" in reason.lower():
            assert "forkq_original_base64" in entry
        else:
            assert entry["forkq_original"] == raw.decode()
    worker.assert_alive()
    assert not r.exists("queue:default")


@pytest.mark.timeout(30)
def test_a_failing_payload_that_cannot_be_re_encoded_goes_to_dead(workers, forkq_client, r):
    # Python's json reads these, but they cannot be written back for a retry
    for raw in (b'{"class": "tests.apps.core_jobs.fail", "args": [NaN], "jid": "nan"}',
                b'{"class": "tests.apps.core_jobs.fail", "args": [1e400], "jid": "inf"}',
                b'{"class": "tests.apps.core_jobs.fail", "args": ["\\ud800"], "jid": "sur"}'):
        r.lpush("queue:default", raw)
    core_jobs.record.enqueue("after")
    worker = workers(concurrency=1)

    wait_records(r, 1, worker, kind="record")
    dead = zset(r, "dead")
    assert len(dead) == 3
    for entry, _ in dead:
        assert entry["error_class"] == "forkq.MalformedPayload"
        assert "ValueError: boom" in entry["error_message"]
        assert json.loads(entry["forkq_original"])["jid"] in {"nan", "inf", "sur"}
    assert r.zcard("retry") == 0
    wait_until(lambda: r.hlen(f"forkq:inflight:{worker.identity}") == 0, timeout=5,
               message="nothing left in flight")


@pytest.mark.timeout(30)
def test_an_error_message_with_a_lone_surrogate_still_retries(workers, forkq_client, r):
    worker = workers()
    jid = core_jobs.fail_surrogate.enqueue("s")
    ((job, _),) = wait_zset(r, "retry", 1, worker)
    assert job["jid"] == jid
    assert job["error_message"] == "no such file: bad-\\udcff"
    assert "in fail_surrogate" in "\n".join(decode_backtrace(job["error_backtrace"]))
    assert r.zcard("dead") == 0


@pytest.mark.timeout(30)
def test_unknown_class_goes_to_retry_not_dead(workers, forkq_client, r):
    worker = workers()
    jid = forkq.default_client().push("NoSuchJob", [1, 2])
    ((job, _),) = wait_zset(r, "retry", 1, worker)
    assert job["jid"] == jid
    assert job["error_class"] == "forkq.errors.UnknownJob"
    assert "NoSuchJob" in job["error_message"]
    assert job["retry_count"] == 0
    assert r.zcard("dead") == 0


@pytest.mark.timeout(30)
def test_hooks_raising_base_exceptions_neither_strand_the_job_nor_end_the_thread(workers, forkq_client, r):
    # a hook's SystemExit or KeyboardInterrupt ended the processor thread silently, with
    # the job left in flight and, once every thread had gone, a worker that beat its
    # heartbeat but ran nothing
    worker = workers(concurrency=1)
    retried = core_jobs.fail_exiting_retry_in.enqueue("r")
    killed = core_jobs.fail_interrupting_exhausted.enqueue("k")
    core_jobs.record.enqueue("after")  # one thread: it runs only if that thread lives on
    wait_records(r, 1, worker, kind="record")
    ((job, score),) = zset(r, "retry")
    assert job["jid"] == retried and job["error_message"] == "exiting hook r"
    assert job["failed_at"] + 15 <= score <= job["failed_at"] + 25  # the default backoff
    ((job, _),) = zset(r, "dead")
    assert job["jid"] == killed and job["error_message"] == "interrupting hook k"
    held = [v for k in r.keys("forkq:inflight:*") for v in r.hvals(k)]
    assert not [v for v in held if retried.encode() in v or killed.encode() in v]


@pytest.mark.timeout(30)
def test_a_retry_carries_the_args_as_fetched_whatever_the_job_did_to_them(workers, forkq_client, r):
    # Sidekiq re-parses the job's string to retry it; forkq wrote back the dict the job had
    # been handed: a list popped part way lost the items not yet done, and an object left
    # in a dict arg made the failure unwritable, stranding the job in flight
    worker = workers(concurrency=1)
    jid = core_jobs.fail_mutating.enqueue(["a", "b", "c"], {"k": 1})
    ((job, _),) = wait_zset(r, "retry", 1, worker)
    assert job["jid"] == jid and job["error_message"] == "failed at b"
    assert job["args"] == [["a", "b", "c"], {"k": 1}]
    assert [rec["args"] for rec in records(r, "mutating")] == [["c"], ["b"]]
    held = [v for k in r.keys("forkq:inflight:*") for v in r.hvals(k)]
    assert not [v for v in held if jid.encode() in v]
