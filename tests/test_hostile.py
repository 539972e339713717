"""Hostile input: a corpus of bad entries written straight into Redis, then property tests.

One real `forkq start --no-fork` worker is fed the whole corpus at once (queue:default,
schedule and retry), interleaved with good jobs. Every good job must run exactly once,
every bad entry must end in `dead` with a readable reason (or, where Sidekiq would run or
retry it, there: each case says which), and the worker must keep running.

Then hypothesis: payload.parse raises nothing but MalformedPayload, retry.backoff stays in
Sidekiq's bounds, and Outcomes.failed routes any retry_count to retry or dead.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from corekit import core_jobs, records, wait_records, workers, zset  # noqa: F401
from forkq import payload, retry
from forkq.errors import MalformedPayload
from helpers import json_lines, wait_until

HOSTILE_JOBS = Path(__file__).resolve().parent / "apps" / "hostile_jobs.py"
RECORD = "tests.apps.core_jobs.record"
FAIL = "tests.apps.core_jobs.fail"


def _job(cls, args, **extra):
    return json.dumps({"class": cls, "args": args, "jid": payload.new_jid(), "retry": True,
                       "queue": "default", "created_at": time.time(), **extra}).encode()


def _nested(depth):
    value = ["leaf"]
    for _ in range(depth - 1):
        value = [value]
    return value


# queue:default entries: (raw, expected fate, what the reason must mention)
#   fate "dead": dead set, error_class forkq.MalformedPayload unless noted
#   fate "retry": retry set (Sidekiq retries it too)
#   fate "ran": a legitimately runnable job
BIG = 10 * 1024 * 1024
QUEUE_CORPUS = [
    (b"this is { not json", "dead", "not JSON"),
    (b"42", "dead", "JSON int, not an object"),
    (b"null", "dead", "JSON NoneType, not an object"),
    (b'"a string"', "dead", "JSON str, not an object"),
    (b'{"args": ["no class"]}', "dead", "no 'class' string"),
    (b'{"class": null, "args": []}', "dead", "no 'class' string"),
    (json.dumps({"class": RECORD}).encode(), "dead", "'args' is missing"),
    (json.dumps({"class": RECORD, "args": {"a": 1}}).encode(), "dead", "'args' is missing or not a list"),
    (json.dumps({"class": RECORD, "args": "abc"}).encode(), "dead", "'args' is missing or not a list"),
    (b'{"class": "tests.apps.core_jobs.record", "args": ["\xc3\x28 bad"]}', "dead", "not valid UTF-8"),
    (b"\xff\xfe\x00garbage", "dead", "not valid UTF-8"),
    # nested deeper than json's decoder recursion: used to escape as RecursionError
    (b"[" * 200_000, "dead", "nested too deeply"),
    # 10 MB of garbage: dead, and its bytes are kept
    (b"x" * BIG, "dead", "not JSON"),
    # retry_count far past any limit: the failure exhausts retries, so dead (Sidekiq too),
    # with the job's own error as the reason
    (_job(FAIL, ["huge-count"], retry_count=10**30), "dead", "boom huge-count"),
    # unknown class: Sidekiq retries it (its code may be on the way in a rolling deploy)
    (_job("NoSuch.Job", ["unknown"]), "retry", "NoSuch.Job"),
    # a 1 MB class name: an unknown class, so retry; the message is cut at 10,000 chars
    (_job("C" * (1024 * 1024), ["long-name"]), "retry", "CCCC"),
    # a negative retry_count is not a count: the failure is counted as the first one
    (_job(FAIL, ["negative-count"], retry_count=-5), "retry", "boom negative-count"),
    # retry as a string is not false and not a number: Sidekiq's default 25 retries
    (_job(FAIL, ["string-retry"], retry="yes please"), "retry", "boom string-retry"),
    # retry and retry_count far beyond a float: count**4 overflowed `now + delay`, and the job
    # stayed in flight; now it waits in retry at most a century away
    (_job(FAIL, ["astronomic"], retry=10**100, retry_count=10**80), "retry", "boom astronomic"),
    # job code raising an exception whose __str__ raises: still an ordinary failure
    (_job("hostile.unprintable", ["unprintable"]), "retry", "UnprintableError"),
]
# Runnable, so they must run exactly once (checked through core:ran)
QUEUE_RUNNABLE = [
    (_job(RECORD, ["nested", _nested(100)]), "nested"),
    (_job(RECORD, ["big-but-valid"], pad="p" * BIG), "big-but-valid"),
    # a `queue` field that disagrees with the list it was found on: it runs where it was found
    (_job(RECORD, ["wrong-queue-field"], queue="does-not-exist"), "wrong-queue-field"),
]

# Sorted-set entries: (key, raw, score, fate, reason)


def _zset_corpus(now):
    return [
        ("schedule", b"{oops", now - 5, "dead", "not JSON"),
        ("schedule", b'["class", "args"]', now - 5, "dead", "JSON list, not an object"),
        ("schedule", json.dumps({"class": RECORD, "args": [], "queue": 5}).encode(), now - 5,
         "dead", "payload 'queue' is 5"),
        ("schedule", json.dumps({"class": RECORD, "args": [], "queue": ""}).encode(), now - 5,
         "dead", "payload 'queue' is ''"),
        ("schedule", json.dumps({"class": RECORD, "args": [], "queue": "a\nb"}).encode(), now - 5,
         "dead", "not a queue name"),
        ("schedule", b"[" * 200_000, now - 5, "dead", "nested too deeply"),
        ("retry", b'{"class": "X"}', now - 5, "dead", "'args' is missing"),
        ("retry", b'{"class": "X", "args": ["\xc3\x28"]}', now - 5, "dead", "not valid UTF-8"),
    ]


# Sorted-set entries that are runnable: (key, raw, score, tag)
def _zset_runnable(now):
    return [
        ("schedule", _job(RECORD, ["sched-minus-inf"]), float("-inf"), "sched-minus-inf"),
        ("schedule", _job(RECORD, ["sched-negative"]), -1e9, "sched-negative"),
        ("schedule", _job(RECORD, ["sched-zero"]), 0, "sched-zero"),
        ("retry", _job(RECORD, ["retry-huge-count"], retry_count=10**30), now - 1, "retry-huge-count"),
        ("retry", _job(RECORD, ["retry-minus-inf"], retry_count=-5), float("-inf"), "retry-minus-inf"),
    ]


@pytest.mark.timeout(60)
def test_hostile_corpus_ends_in_dead_or_where_sidekiq_puts_it(workers, r):
    now = time.time()
    good = [f"good-{i}" for i in range(12)]
    # Redis itself refuses a NaN score, so a NaN-scored entry can never exist
    with pytest.raises(redis.ResponseError):
        r.zadd("schedule", {b'{"class": "X", "args": []}': float("nan")})
    # A job in schedule naming a queue nobody works: moved to that queue, as Sidekiq does
    # (a queue exists as soon as something is pushed to it); it waits there, untouched.
    elsewhere = _job(RECORD, ["elsewhere"], queue="does-not-exist")
    r.zadd("schedule", {elsewhere: now - 3})
    # never due: +inf stays in schedule forever, as in Sidekiq
    never = _job(RECORD, ["never"])
    r.zadd("schedule", {never: float("inf")})

    bad = [raw for raw, _, _ in QUEUE_CORPUS]
    runnable = [raw for raw, _ in QUEUE_RUNNABLE]
    entries = bad + runnable
    # interleave good jobs with the hostile ones, all onto queue:default
    for i, raw in enumerate(entries):
        r.lpush("queue:default", raw)
        if i % 2 == 0 and good:
            r.lpush("queue:default", _job(RECORD, [good.pop()]))
    for tag in good:
        r.lpush("queue:default", _job(RECORD, [tag]))
    for key, raw, score, _, _ in _zset_corpus(now):
        r.zadd(key, {raw: score})
    for key, raw, score, _ in _zset_runnable(now):
        r.zadd(key, {raw: score})

    # a remote signal is read per heartbeat: four of them take four beats
    worker = workers(concurrency=3, poll_interval=0.5,
                     extra_args=["--heartbeat-interval", "0.5", "--require", str(HOSTILE_JOBS)])

    # remote signals nobody defined, one not even UTF-8: ignored, the worker carries on
    for sig in (b"\xff\xfe", b"rm -rf /", b"KILL", b"TERM\x00"):
        r.lpush(f"{worker.identity}-signals", sig)

    good_tags = [f"good-{i}" for i in range(12)]
    ran_tags = good_tags + [t for _, t in QUEUE_RUNNABLE] + [t for *_, t in _zset_runnable(now)]
    wait_records(r, len(ran_tags), worker, kind="record", timeout=30)
    n_dead = sum(f == "dead" for *_, f, _ in QUEUE_CORPUS) + len(_zset_corpus(now))
    n_retry = sum(f == "retry" for *_, f, _ in QUEUE_CORPUS)
    wait_until(lambda: worker.assert_alive() or (r.zcard("dead") >= n_dead and r.zcard("retry") >= n_retry),
               timeout=20, message=f"{n_dead} dead and {n_retry} retry entries")
    wait_until(lambda: r.llen("queue:default") == 0, timeout=10, message="queue:default drained")
    wait_until(lambda: r.hlen(f"forkq:inflight:{worker.identity}") == 0, timeout=10,
               message="nothing left in flight")

    # every good and runnable job ran exactly once
    got = sorted(rec["args"][0] for rec in records(r, "record"))
    assert got == sorted(ran_tags)
    nested = [rec for rec in records(r, "record") if rec["args"][0] == "nested"]
    assert nested[0]["args"][1] == _nested(100)

    # every bad entry is in dead, with a reason naming its problem
    dead = [entry for entry, _ in zset(r, "dead")]
    assert len(dead) == n_dead, [d["error_message"][:200] for d in dead]
    messages = [d["error_message"] for d in dead]
    expected_dead = [(reason, where) for _, f, reason in QUEUE_CORPUS if f == "dead" for where in ["queue"]]
    expected_dead += [(reason, key) for key, _, _, f, reason in _zset_corpus(now)]
    for reason, where in expected_dead:
        hits = [m for m in messages if reason in m]
        assert hits, f"no dead entry mentions {reason!r}: {[m[:120] for m in messages]}"
        if where in ("schedule", "retry"):
            assert any(f"in {where}" in m for m in hits), (where, hits, "\n".join(m[:150] for m in messages))
    for entry in dead:
        assert len(entry["error_message"]) <= 10_000 + 500
        if entry["error_class"] == "forkq.MalformedPayload":
            assert "forkq_original" in entry or "forkq_original_base64" in entry
    (huge,) = [d for d in dead if d.get("error_message") == "boom huge-count"]
    assert huge["error_class"] == "ValueError" and huge["retry_count"] == 10**30 + 1
    (garbage,) = [d for d in dead if d.get("forkq_original", "").startswith("xxxx")]
    assert len(garbage["forkq_original"]) == BIG

    # the retryable ones wait in retry, with sane counts
    retried = {json.dumps(e["args"]): e for e, _ in zset(r, "retry")}
    assert len(retried) == n_retry
    assert retried['["unknown"]']["error_class"] == "forkq.errors.UnknownJob"
    long_name = retried['["long-name"]']
    assert long_name["error_class"] == "forkq.errors.UnknownJob"
    assert len(long_name["error_message"]) == 10_000  # cut as Sidekiq does
    assert retried['["negative-count"]']["retry_count"] == 0
    assert retried['["string-retry"]']["retry_count"] == 0
    assert retried['["string-retry"]']["retry"] == "yes please"  # kept untouched
    astronomic = retried['["astronomic"]']
    assert astronomic["retry_count"] == 10**80 + 1
    (score,) = [s for e, s in zset(r, "retry") if e["args"] == ["astronomic"]]
    assert now < score <= time.time() + retry.MAX_DELAY_S
    unprintable = retried['["unprintable"]']
    assert unprintable["error_class"] == "hostile_jobs.UnprintableError" or \
        unprintable["error_class"].endswith(".UnprintableError")
    assert "str() of UnprintableError raised RuntimeError" in unprintable["error_message"]
    assert len(records(r, "unprintable")) == 1

    # the schedule entry naming another queue is on that queue; +inf never became due
    (moved,) = r.lrange("queue:does-not-exist", 0, -1)
    assert json.loads(moved)["args"] == ["elsewhere"]
    assert b"does-not-exist" in r.smembers("queues")
    assert r.zrange("schedule", 0, -1) == [never]

    # still alive and heartbeating
    worker.assert_alive()
    seen = float(r.hget(worker.identity, "beat"))
    wait_until(lambda: float(r.hget(worker.identity, "beat") or 0) > seen, timeout=5,
               message="a fresh heartbeat")
    assert worker.identity.encode() in r.smembers("processes")
    assert not [k for k in r.keys("forkq:inflight:*") if r.hlen(k)]
    wait_until(lambda: r.llen(f"{worker.identity}-signals") == 0, timeout=5,
               message="the remote signals read")
    # each one named in one warning line, the non-UTF-8 one too; no traceback
    def ignored() -> list[str]:  # the last line may follow its RPOP by a moment
        return sorted(json.loads(line)["signal"] for line in worker.log_path.read_text().splitlines()
                      if "ignoring unknown remote signal" in line)
    wait_until(lambda: len(ignored()) == 4, timeout=5, message="four signals ignored")
    assert ignored() == sorted(["\\xff\\xfe", "rm -rf /", "KILL", "TERM\x00"])
    assert "Traceback" not in worker.log_path.read_text()
    worker.assert_alive()


@pytest.mark.timeout(30)
def test_a_garbage_entry_in_a_suspects_list_does_not_wedge_the_worker(workers, r):
    # claimed like any suspect, then parked in dead by the processor as a malformed payload
    r.lpush("forkq:suspects:default", b"not a job at all")
    worker = workers(concurrency=1, extra_args=["--heartbeat-interval", "0.5"])
    wait_until(lambda: r.llen("forkq:suspects:default") == 0, timeout=5, message="the suspect taken")
    r.lpush("queue:default", _job(RECORD, ["after-garbage-suspect"]))
    wait_records(r, 1, worker, kind="record", timeout=4)
    worker.assert_alive()
    (entry,) = [json.loads(m) for m in r.zrange("dead", 0, -1)]
    assert entry["error_class"] == "forkq.MalformedPayload" and entry["error_message"]
    assert entry["forkq_original"] == "not a job at all"
    # the recording job's ack is batched, and may follow its record by a moment
    wait_until(lambda: not [k for k in r.keys("forkq:inflight:*") if r.hlen(k)], timeout=5,
               message="every job acknowledged or written out of the in-flight hash")


# -- property tests -----------------------------------------------------------------------------

json_scalars = (st.none() | st.booleans() | st.integers() | st.text()
                | st.floats(allow_nan=True, allow_infinity=True))
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_parse_of_arbitrary_bytes_raises_only_malformed_payload(raw):
    try:
        job = payload.parse(raw)
    except MalformedPayload as exc:
        assert str(exc)
    else:
        assert type(job) is dict and type(job["class"]) is str and type(job["args"]) is list


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["class", "args", "jid", "queue", "retry", "retry_count"])
                       | st.text(max_size=5), json_values, max_size=6),
       st.sampled_from(["utf-8", "str"]))
def test_parse_of_any_json_object_raises_only_malformed_payload(obj, form):
    text = json.dumps(obj)  # Python writes NaN/Infinity, which its reader accepts
    raw = text if form == "str" else text.encode("utf-8", "surrogatepass")
    try:
        job = payload.parse(raw)
    except MalformedPayload as exc:
        assert str(exc)
    else:
        assert job.keys() == obj.keys()
        assert type(job["class"]) is str and job["class"] and type(job["args"]) is list


@pytest.mark.parametrize("raw", [b"[" * 100_000, b'{"a":' * 100_000, "[" * 100_000])
def test_parse_of_deeply_nested_json_is_malformed_not_recursion_error(raw):
    with pytest.raises(MalformedPayload, match="nested too deeply"):
        payload.parse(raw)


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=10**6))
def test_backoff_is_within_sidekiqs_bounds(count):
    delay = retry.backoff(count)
    assert count**4 + 15 <= delay <= count**4 + 15 + 9 * (count + 1)


def _expected_backoff(count, monkeypatch):
    """The exact mean over Sidekiq's ten jitter values."""
    total = 0
    for k in range(10):
        monkeypatch.setattr(retry.random, "randrange", lambda n, k=k: k)
        total += retry.backoff(count)
    return total / 10


def test_backoff_is_increasing_in_expectation(monkeypatch):
    means = [_expected_backoff(c, monkeypatch) for c in range(0, 60)]
    assert all(a < b for a, b in zip(means, means[1:]))
    assert means[0] == 15 + 4.5


retry_counts = st.one_of(
    st.integers(), st.integers(min_value=10**18, max_value=10**60), st.integers(max_value=-1),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=10), st.none(), st.booleans(),
    st.lists(st.integers(), max_size=2),
)
retry_options = st.one_of(st.booleans(), st.integers(min_value=-5, max_value=30), st.none(),
                          st.integers(min_value=10**20, max_value=10**100),
                          st.text(max_size=5), st.floats(allow_nan=False, allow_infinity=False))
# (a non-finite float left in the payload cannot be written back as JSON: Outcomes raises
# ValueError and the processor sends the entry to dead, see test_retry.py; a non-finite
# retry_count is not left in the payload, it is replaced by 0)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(count=retry_counts, option=retry_options, has_option=st.booleans())
def test_a_failure_with_any_retry_count_ends_in_retry_or_dead(r, count, option, has_option):
    from forkq.retry import Outcomes

    r.delete("retry", "dead", "forkq:inflight:prop")
    job = {"class": "Prop", "args": [1], "jid": payload.new_jid(), "queue": "default",
           "retry_count": count}
    if has_option:
        job["retry"] = option
    outcomes = Outcomes(r, "forkq:inflight:prop")
    r.hset("forkq:inflight:prop", "7", b"default\n" + json.dumps(job).encode())
    fate = outcomes.failed(job, ValueError("prop"), "7", None)
    assert not r.exists("forkq:inflight:prop")  # released in the same write
    where = {"retry": r.zcard("retry"), "dead": r.zcard("dead")}
    if fate == "dropped":
        assert job.get("retry") is False and where == {"retry": 0, "dead": 0}
        return
    assert fate in ("retry", "dead")
    assert where == {fate: 1, ("dead" if fate == "retry" else "retry"): 0}
    (stored, score), = zset(r, fate)
    assert type(stored["retry_count"]) is int and stored["retry_count"] >= 0
    assert stored["error_class"] == "ValueError" and stored["error_message"] == "prop"
    assert math.isfinite(score)
    if fate == "retry":
        assert time.time() + 14 <= score <= time.time() + retry.MAX_DELAY_S


class _UnprintableError(Exception):
    def __str__(self):
        raise RuntimeError("no")


@pytest.mark.parametrize("count, option", [(10**80, 10**100), (10**40, 10**100), (25, 10**9)],
                         ids=["overflows-float", "fits-a-float", "ordinary"])
def test_an_astronomic_retry_count_is_retried_at_a_finite_time(r, count, option):
    from forkq.retry import Outcomes

    r.hset("forkq:inflight:prop", "1", b"x")
    job = {"class": "X", "args": [], "retry": option, "retry_count": count}
    assert Outcomes(r, "forkq:inflight:prop").failed(job, ValueError("v"), "1", None) == "retry"
    ((stored, score),) = zset(r, "retry")
    assert stored["retry_count"] == count + 1
    assert time.time() < score <= time.time() + retry.MAX_DELAY_S
    assert not r.exists("forkq:inflight:prop")


def test_an_exception_whose_str_raises_is_still_recorded(r):
    from forkq.retry import Outcomes

    r.hset("forkq:inflight:prop", "1", b"x")
    job = {"class": "X", "args": [], "backtrace": True}
    assert Outcomes(r, "forkq:inflight:prop").failed(job, _UnprintableError(), "1", None) == "retry"
    ((stored, _),) = zset(r, "retry")
    assert stored["error_message"] == "<str() of _UnprintableError raised RuntimeError>"
    assert payload.decode_backtrace(stored["error_backtrace"]) == []  # never raised: no frames
    assert not r.exists("forkq:inflight:prop")



APPS = Path(__file__).resolve().parent / "apps"


@pytest.mark.timeout(60)
def test_a_fault_in_forkq_outside_a_job_is_that_jobs_failure_and_the_thread_goes_on(
        r, redis_url, workers):
    """A processor thread that raised outside a job's code used to end silently: its job
    stayed in flight until the process stopped, and the process went on heartbeating with
    a thread fewer (none, after enough such faults), its queue waiting."""
    import forkq
    client = forkq.Client(redis_url)
    cursed = [core_jobs.record.options(queue="faulty", client=client).enqueue(f"cursed-{i}")
              for i in range(3)]
    core_jobs.record.options(client=client).enqueue("after")
    # one thread and strict order: it must outlive three faults to run the job after them
    worker = workers(queues=("faulty", "default"), concurrency=1, ready=False,
                     extra_args=["--require", str(APPS / "faulty_set_job.py")])
    wait_records(r, 1, worker, kind="record")
    identity = worker.wait_ready(r)  # started with ready=False: worker.identity was None
    wait_until(lambda: worker.assert_alive() or r.zcard("retry") == 3, timeout=10,
               message="the three faulty jobs in retry")
    entries = [json.loads(raw) for raw in r.zrange("retry", 0, -1)]
    assert sorted(e["jid"] for e in entries) == sorted(cursed)
    assert {(e["error_class"], e["error_message"], e["queue"]) for e in entries} == {
        ("RuntimeError", "a fault in forkq, outside the job", "faulty")}
    # the faulty jobs' failures release their entries; the last job's ack is batched, and
    # may follow its record by a moment
    wait_until(lambda: not r.hgetall(f"forkq:inflight:{identity}"), timeout=5,
               message="every job acknowledged or written out of the in-flight hash")
    faults = [line for line in json_lines(worker.log_path) if line.get("level") == "critical"]
    assert len(faults) == 3 and "a fault in forkq, outside the job" in faults[0].get("exception", "")
    assert [rec["args"] for rec in records(r, "record")] == [["after"]]


@pytest.mark.timeout(60)
def test_a_fault_in_forkq_it_cannot_pin_on_a_job_stops_the_process_with_its_jobs_back(
        r, redis_url, workers):
    """Past a job's end, with nothing to record it against, the thread cannot go on: the
    process stops gracefully (exit 1, so that a master or service manager replaces it),
    running jobs finish and nothing is left in flight."""
    import forkq
    client = forkq.Client(redis_url)
    worker = workers(concurrency=3, extra_args=["--require", str(APPS / "faulty_done.py")])
    core_jobs.sleepy.options(client=client).enqueue(1, "beside")
    wait_until(lambda: records(r, "start"), timeout=10, message="the sleepy job running")
    core_jobs.fail.options(client=client).enqueue("tripwire")
    assert worker.proc.wait(timeout=30) == 1, worker.log_tail()
    lost = [line for line in json_lines(worker.log_path) if line.get("level") == "critical"]
    assert len(lost) == 1 and "stopping this process" in lost[0]["event"], lost
    assert "a fault in forkq, after a failed job" in lost[0].get("exception", "")
    assert [rec["args"] for rec in records(r, "end")] == [["beside"]]  # it finished
    assert r.zcard("retry") == 1 and not r.keys("forkq:inflight:*")
