"""Job chains (forkq.chain): the build, the worker's continuation, failures, test modes.

In-process against the shared redis-server: a Manager whose processor is driven by hand
(claim, run, done), as in test_results and test_batch, so most tests take milliseconds.
One test runs a real master with two children and SIGKILLs one while a step runs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest
import structlog

import forkq
from forkq import api, chains, keys, testing
from forkq.fetch import requeue_owner_counts
from corekit import hand_driven_fixture, queued, run_one
from helpers import wait_until
from test_supervisor import start_master, sup_events, wait_event  # noqa: F401 (a fixture)

calls: list = []
failures: dict[str, int] = {}


@forkq.job(queue="cq", name="chain_test.step")
def step(tag: str, *rest) -> str:
    calls.append([tag, *rest])
    return f"from {tag}"


@forkq.job(queue="cq", name="chain_test.flaky")
def flaky(tag: str) -> None:
    """Fails the first time it runs for a tag, then succeeds."""
    if not failures.get(tag):
        failures[tag] = 1
        raise ValueError(f"first run of {tag}")
    calls.append(["flaky", tag])


@forkq.job(queue="cq", retry=0, name="chain_test.dies")
def dies(tag: str) -> None:
    calls.append(["dies", tag])
    if not failures.get(tag):
        failures[tag] = 1
        raise RuntimeError(f"boom {tag}")


@forkq.job(queue="cq", retry=False, name="chain_test.dropped")
def dropped(tag: str) -> None:
    raise KeyError(tag)


@forkq.job(queue="cq", keep_result=60, name="chain_test.kept")
def kept(n: int) -> int:
    calls.append(["kept", n])
    return n * 2


@forkq.job(queue="cq", name="chain_test.add")
def add(a: int, b: int) -> int:
    calls.append(["add", a, b])
    return a + b


@forkq.job(queue="cq", name="chain_test.when")
def when() -> object:
    return time  # a module: no JSON value


@forkq.job(queue="cq", name="chain_test.deep")
def deep(levels: int) -> list:
    value: list = []
    for _ in range(levels - 1):
        value = [value]
    return value


def depth(value) -> int:
    """Levels of lists and dicts, as Ruby's JSON counts them (it parses at most 100)."""
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    return 0


@forkq.job(queue="cq", unique_for=60, name="chain_test.unique")
def unique_job(n: int) -> None:
    pass


@pytest.fixture
def client(redis_url):
    calls.clear()
    failures.clear()
    c = forkq.configure(redis_url)
    try:
        yield c
    finally:
        forkq.client._default = None


worker = hand_driven_fixture("cq", "test:1:chain0000000a")


def inflight(r, worker) -> int:
    return r.hlen(worker.fetch.inflight_key)


def dead(r) -> list[dict]:
    return [json.loads(m) for m in r.zrange("dead", 0, -1)]


def retry_now(r, key: str = "retry") -> None:
    """Move a sorted set's jobs back onto their queue, as the poller (or a retry from
    dead) does."""
    for raw in r.zrange(key, 0, -1):
        r.zrem(key, raw)
        job = json.loads(raw)
        r.lpush(f"queue:{job['queue']}", raw)


def test_steps_run_in_order_each_once_and_each_ack_goes_with_the_next_push(client, r, worker):
    jids = forkq.chain(step.call("a"), step.call("b", 1), kept.call(3)).enqueue()
    assert len(jids) == 3 and len(set(jids)) == 3
    (first,) = queued(r, "cq")
    assert first["jid"] == jids[0] and first["args"] == ["a"]
    assert [s["jid"] for s in first["forkq_chain"]] == jids[1:]
    assert [s["args"] for s in first["forkq_chain"]] == [["b", 1], [3]]
    assert "enqueued_at" not in first["forkq_chain"][0]  # set when it is pushed
    for n, tag in enumerate(("a", "b")):
        run_one(worker)
        # no batched ack: the step left the in-flight hash with its successor's push
        assert inflight(r, worker) == 0
        assert worker.fetch.pending_acks() == 0
        (nxt,) = queued(r, "cq")
        assert nxt["jid"] == jids[n + 1] and time.time() - nxt["enqueued_at"] < 5
        assert len(nxt.get("forkq_chain", [])) == 1 - n
    run_one(worker)
    assert calls == [["a"], ["b", 1], ["kept", 3]]
    assert queued(r, "cq") == [] and forkq.result(jids[2], client=client) == 6
    worker.fetch.fetch(0)  # the last step has no chain: acked as any job, batched
    assert inflight(r, worker) == 0 and r.keys("queue:*") == []


def test_a_kept_result_goes_in_the_same_call_as_the_next_push(client, r, worker):
    jids = forkq.chain(kept.call(4), step.call("z")).enqueue()
    run_one(worker)
    assert forkq.result(jids[0], client=client) == 8
    assert [j["jid"] for j in queued(r, "cq")] == [jids[1]] and inflight(r, worker) == 0


def test_a_failing_middle_step_retries_then_the_chain_goes_on(client, r, worker):
    jids = forkq.chain(step.call("a"), flaky.call("f"), step.call("c")).enqueue()
    run_one(worker)
    run_one(worker)  # flaky fails: its payload, chain included, goes to retry
    (entry,) = [json.loads(m) for m in r.zrange("retry", 0, -1)]
    assert entry["jid"] == jids[1] and [s["jid"] for s in entry["forkq_chain"]] == [jids[2]]
    assert queued(r, "cq") == []
    retry_now(r)
    run_one(worker)
    run_one(worker)
    assert calls == [["a"], ["flaky", "f"], ["c"]]


def test_a_step_that_dies_keeps_the_rest_in_dead_and_a_retry_from_there_goes_on(client, r, worker):
    jids = forkq.chain(dies.call("d"), step.call("b"), step.call("c")).enqueue()
    run_one(worker)
    (entry,) = dead(r)
    assert entry["jid"] == jids[0]
    assert [s["jid"] for s in entry["forkq_chain"]] == jids[1:]
    assert queued(r, "cq") == [] and inflight(r, worker) == 0
    retry_now(r, "dead")
    for _ in range(3):
        run_one(worker)
    assert calls == [["dies", "d"], ["dies", "d"], ["b"], ["c"]]
    assert queued(r, "cq") == [] and dead(r) == []


def test_a_dropped_step_ends_the_chain_and_says_so(client, r, worker, monkeypatch):
    jids = forkq.chain(dropped.call("x"), step.call("never")).enqueue()
    with structlog.testing.capture_logs() as logged:
        # a logger made under capture_logs: the module's may be cached by an earlier test
        monkeypatch.setattr(chains, "log", structlog.get_logger("forkq.chain"))
        run_one(worker)
    assert queued(r, "cq") == [] and dead(r) == [] and r.zcard("retry") == 0
    assert calls == []
    (line,) = [e for e in logged if "chain ended" in e["event"]]
    assert "dropped" in line["event"] and line["jid"] == jids[0] and line["left"] == 1


def test_a_stored_chain_s_step_dropped_or_expired_takes_its_list_along(client, r, worker, monkeypatch):
    """Its later steps will not run, yet their list stayed for 210 days after each such
    step (retry=False, an expires_in missed): 8 KB and more a chain."""
    monkeypatch.setattr(chains, "INLINE_BYTES", 0)
    gone = forkq.chain(dropped.call("x"), step.call("never"), step.call("never")).enqueue()
    late = forkq.chain(step.options(expires_in=0.001).call("late"), step.call("never")).enqueue()
    time.sleep(0.01)  # past its expiry: nothing to poll for
    run_one(worker)
    run_one(worker)
    assert calls == [] and queued(r, "cq") == [] and dead(r) == [] and r.zcard("retry") == 0
    assert not r.exists(keys.chain(gone[0])) and not r.exists(keys.chain(late[0]))


def test_another_client_s_unique_chained_job_releases_its_lock_with_the_next_push(client, r, worker):
    nxt = {"class": "chain_test.step", "args": ["b"], "jid": "0" * 24, "queue": "cq", "retry": True}
    client.push("chain_test.step", ["a"], queue="cq", unique_for=60, forkq_chain=[nxt])
    assert len(r.keys("unique:*")) == 1
    run_one(worker)
    assert r.keys("unique:*") == [] and inflight(r, worker) == 0
    assert [j["jid"] for j in queued(r, "cq")] == ["0" * 24]


def test_a_crash_after_the_step_pushes_its_successor_once(client, r, worker):
    """The master's recovery of a SIGKILLed child finds nothing of a step that succeeded:
    its in-flight entry went in the call that pushed its successor. (Acked in the batched
    way, it would sit there until the next claim, be put back, run again and push the
    next step a second time.) The same call repeated, as after a lost reply, pushes
    nothing more."""
    jids = forkq.chain(step.call("a"), step.call("b")).enqueue()
    (unit,) = worker.fetch.fetch(1)
    token = unit.token
    worker.processors[0].process(unit)
    # no ack queued: nothing to lose in the crash
    assert worker.fetch.pending_acks() == 0
    put_back = requeue_owner_counts(r, worker.fetch.identity, ["cq"], crashed=True)
    assert put_back.requeued == 0
    assert [j["jid"] for j in queued(r, "cq")] == [jids[1]]
    outcomes = worker.processors[0].outcomes
    again = chains._write(outcomes, token, None, None, [keys.QUEUES, keys.queue("cq")],
                          ["push", "cq", b'{"class":"x","args":[]}', 0, 0], ())
    assert again == 0 and len(queued(r, "cq")) == 1


def test_a_step_put_back_before_it_ended_pushes_its_successor_when_it_runs_again(client, r, worker):
    jids = forkq.chain(step.call("a"), step.call("b")).enqueue()
    (unit,) = worker.fetch.fetch(1)
    # recovery got there first (the child looked dead): the step is back on its queue
    assert requeue_owner_counts(r, worker.fetch.identity, ["cq"], crashed=False).requeued == 1
    worker.processors[0].process(unit)  # the first run ends after all
    assert [j["jid"] for j in queued(r, "cq")] == [jids[0]]  # no successor yet
    run_one(worker)
    run_one(worker)
    assert calls == [["a"], ["a"], ["b"]]


def test_a_graceful_stop_hands_nothing_over_for_a_chained_step(client, r, worker):
    jids = forkq.chain(step.call("a"), step.call("b")).enqueue()
    run_one(worker)
    assert worker.fetch.unsent_acks() == []
    worker.fetch.requeue_all()  # what a stopping child does last
    assert [j["jid"] for j in queued(r, "cq")] == [jids[1]]
    assert calls == [["a"]]


def test_refused_builds_push_nothing(client, r):
    with pytest.raises(ValueError, match="at least one step"):
        forkq.chain()
    with pytest.raises(TypeError, match=r"step 1 .*forkq.call names no job"):
        forkq.chain(step.call("a"), forkq.call("b"))
    with pytest.raises(TypeError, match="step 0 of the chain is"):
        forkq.chain(step)
    with pytest.raises(TypeError, match=r"step 1 of the chain: .*add takes 2 positional"):
        forkq.chain(step.call("a"), add.call(1))
    with pytest.raises(TypeError, match=r"step 0 of the chain: job argument args\[0\]"):
        forkq.chain(step.call(object()))
    with pytest.raises(ValueError, match="unique"):
        forkq.chain(step.call("a"), unique_job.call(1))
    with pytest.raises(ValueError, match="unique"):
        forkq.chain(step.options(unique_for=5).call("a"))
    with pytest.raises(ValueError, match="queue"):
        forkq.chain(step.options(queue="").call("a"))
    with pytest.raises(TypeError, match="pass_result"):
        forkq.chain(step.call("a"), pass_result=1)
    # with pass_result, a later step gets one argument more: add(1) takes the result
    forkq.chain(step.call("a"), add.call(1), pass_result=True)
    with pytest.raises(TypeError, match="step 1 of the chain"):
        forkq.chain(step.call("a"), add.call(1, 2), pass_result=True)
    other = forkq.Client(client.url)
    with pytest.raises(ValueError, match="one client"):
        forkq.chain(step.call("a"), step.options(client=other).call("b"))
    with pytest.raises(ValueError, match="batch"):
        with forkq.Batch():
            forkq.chain(step.call("a")).enqueue()
    assert r.keys("queue:*") == [] and r.zcard("schedule") == 0


def test_client_middleware_sees_each_step_and_may_not_skip_one(redis_url, r):
    seen = []

    def tag(job):
        seen.append(job["args"])
        job["tagged"] = True
        return None if job["args"] == ["skip"] else job

    c = forkq.Client(redis_url, middleware=[tag])
    jids = forkq.chain(step.options(client=c).call("a"), step.options(client=c).call("b")).enqueue()
    (first,) = queued(r, "cq")
    assert seen == [["a"], ["b"]] and first["tagged"] and first["forkq_chain"][0]["tagged"]
    assert [first["jid"], first["forkq_chain"][0]["jid"]] == jids
    r.delete("queue:cq")
    with pytest.raises(ValueError, match="dropped step 1"):
        forkq.chain(step.options(client=c).call("a"), step.options(client=c).call("skip")).enqueue()
    assert forkq.chain(step.options(client=c).call("skip"), step.options(client=c).call("b")).enqueue() == []
    assert r.keys("queue:*") == []
    # tags a middleware sets on a later step are refused as its own push refuses them: a
    # Ruby Sidekiq server's poller loses a job whose tags are no list
    c = forkq.Client(redis_url,
                     middleware=[lambda job: {**job, "tags": "x" if job["args"] == ["b"] else ["y"]}])
    with pytest.raises(TypeError, match="'tags' must be a list"):
        forkq.chain(step.options(client=c).call("a"), step.options(client=c).call("b")).enqueue()
    assert r.keys("queue:*") == [] and r.keys("forkq:chain:*") == []


@pytest.mark.parametrize("bad, why", [
    ("x", "not a non-empty list"),
    ([], "not a non-empty list"),
    ([1], r"forkq_chain\[0\] is not an object"),
    ([{"args": []}], r"forkq_chain\[0\] has no 'class'"),
    ([{"class": "chain_test.step", "args": ["b"], "jid": "j2", "queue": "cq"}, {"class": "y"}],
     r"forkq_chain\[1\] 'args'"),
])
def test_a_malformed_continuation_goes_to_dead_and_the_step_is_acked(client, r, worker, bad, why):
    client.push("chain_test.kept", [5], queue="cq", keep_result=60, forkq_chain=bad)
    run_one(worker)
    assert inflight(r, worker) == 0 and worker.fetch.pending_acks() == 0
    assert queued(r, "cq") == [] and calls == [["kept", 5]]
    (entry,) = dead(r)
    assert entry["class"] == "forkq.MalformedJob" and entry["queue"] == "forkq-malformed"
    assert entry["error_class"] == "forkq.ChainBroken"
    assert "chain_test.kept" in entry["error_message"]
    assert re.search(why, entry["error_message"])
    assert json.loads(entry["forkq_original"]) == bad
    (kept_jid,) = [k.decode().rpartition(":")[2] for k in r.keys("forkq:result:*")]
    assert forkq.result(kept_jid, client=client) == 10  # the step's success stands


def test_a_next_queue_key_that_is_no_list_parks_that_step_itself_in_dead(client, r, worker):
    """Its payload is fine, only its queue's key is not: it went to dead as a MalformedJob
    holding the whole continuation, told only "something other than a list", and no
    retry from dead could carry on. Now the step itself is there, as the scheduler parks a
    due job whose queue's key holds no list, with the key's type named."""
    r.set("queue:elsewhere", "x")
    jids = forkq.chain(step.call("a"), step.options(queue="elsewhere").call("b"),
                       step.call("c")).enqueue()
    run_one(worker)
    assert inflight(r, worker) == 0 and worker.fetch.pending_acks() == 0
    (entry,) = dead(r)
    assert entry["class"] == "chain_test.step" and entry["jid"] == jids[1]
    assert entry["args"] == ["b"] and entry["queue"] == "elsewhere"
    assert [s["jid"] for s in entry["forkq_chain"]] == jids[2:]
    assert entry["error_class"] == "forkq.QueueNotAList"
    assert entry["error_message"] == (
        f"queue:elsewhere holds a string, not a list: the next step of a chain, after "
        f"chain_test.step (jid {jids[0]}), could not be pushed onto it; retry it from dead "
        "once the key is fixed")
    r.delete("queue:elsewhere")  # fixed: a retry from dead carries on
    dead_set = api.SortedSet(r, "dead")
    assert dead_set.retry_now(dead_set.page(0)) == 1
    assert [j["jid"] for j in queued(r, "elsewhere")] == [jids[1]]


@pytest.mark.parametrize("bad, why", [
    ("", "a job's queue must be a non-empty name without a newline, not ''"),
    (7, "a job's queue must be a str, not int (7)"),
])
def test_a_next_step_with_an_unusable_queue_name_goes_to_dead_itself(client, r, worker, bad, why):
    """Its payload was called malformed and buried in a MalformedJob as the continuation's
    JSON, though only its destination was bad; and a later step's bad queue stopped the
    chain early, at a step whose own next step was fine."""
    nxt = {"class": "chain_test.step", "args": ["b"], "jid": "j2", "queue": "cq"}
    later = {"class": "chain_test.step", "args": ["c"], "jid": "j3", "queue": bad}
    client.push("chain_test.step", ["a"], queue="cq", forkq_chain=[nxt, later])
    run_one(worker)
    assert dead(r) == [] and [j["jid"] for j in queued(r, "cq")] == ["j2"]
    run_one(worker)
    assert inflight(r, worker) == 0 and calls == [["a"], ["b"]] and queued(r, "cq") == []
    (entry,) = dead(r)
    assert entry["class"] == "chain_test.step" and entry["jid"] == "j3" and entry["queue"] == bad
    assert entry["error_class"] == "forkq.ChainBroken"
    assert entry["error_message"] == (
        f"the chain after chain_test.step (jid j2) cannot go on: its next step cannot be "
        f"pushed: {why}")
    assert "forkq_original" not in entry


def test_pass_result_appends_the_value_and_an_unstorable_one_goes_to_dead(client, r, worker):
    jids = forkq.chain(add.call(1, 2), add.call(10), step.call("s"), pass_result=True).enqueue()
    for _ in range(3):
        run_one(worker)
    assert calls == [["add", 1, 2], ["add", 10, 3], ["s", 13]]
    assert r.keys("queue:*") == []
    calls.clear()
    forkq.chain(when.call(), step.call("t"), pass_result=True).enqueue()
    run_one(worker)
    assert inflight(r, worker) == 0 and queued(r, "cq") == [] and calls == []
    (entry,) = dead(r)
    assert "not JSON-native" in entry["error_message"] and "module" in entry["error_message"]
    assert jids


def test_steps_too_deep_to_ride_in_the_first_payload_are_stored_and_run(client, r, worker):
    """A later step's argument may nest 98 levels, as its own push's; carried in the first
    payload it nested 102, which Ruby Sidekiq's poller (JSON.parse: 100) loses once the
    first step is scheduled or retried. Such a chain is stored in its list instead."""
    jids = forkq.chain(step.call("a"), step.call("b", deep(98))).enqueue_in(60)
    (raw,) = r.zrange("schedule", 0, -1)
    assert depth(json.loads(raw)) <= 100 and r.llen(keys.chain(jids[0])) == 1
    retry_now(r, "schedule")  # as the poller does once it is due
    run_one(worker)
    (nxt,) = queued(r, "cq")
    assert nxt["jid"] == jids[1] and depth(nxt) == 100
    run_one(worker)
    assert calls == [["a"], ["b", deep(98)]] and r.keys("forkq:chain:*") == []
    short = forkq.chain(step.call("c"), step.call("d", deep(96))).enqueue()  # 100: still inline
    (first,) = queued(r, "cq")
    assert depth(first) == 100 and first["forkq_chain"][0]["jid"] == short[1]


def test_pass_result_refuses_a_value_nested_past_an_arguments_room(client, r, worker):
    forkq.chain(deep.call(98), step.call(), pass_result=True).enqueue()
    run_one(worker)
    (nxt,) = queued(r, "cq")
    assert depth(nxt) == 100  # the value as deep as a pushed argument may be: passed on
    r.delete("queue:cq")
    forkq.chain(deep.call(99), step.call(), pass_result=True).enqueue()
    run_one(worker)
    assert inflight(r, worker) == 0 and queued(r, "cq") == []
    (entry,) = dead(r)
    assert "nested past the 98 levels" in entry["error_message"]


def test_a_later_step_s_expires_in_counts_from_its_own_push(client, r, worker):
    forkq.chain(step.call("a"), step.options(expires_in=60).call("b")).enqueue()
    (first,) = queued(r, "cq")
    assert first["forkq_chain"][0]["expires_in"] == 60 and "expires_at" not in first["forkq_chain"][0]
    time.sleep(0.01)
    run_one(worker)
    (nxt,) = queued(r, "cq")
    assert "expires_in" not in nxt and nxt["expires_at"] == pytest.approx(nxt["enqueued_at"] + 60)


def test_a_scheduled_chain_waits_in_the_schedule_whole(client, r):
    jids = forkq.chain(step.call("a"), step.call("b")).enqueue_in(60)
    ((raw, at),) = r.zrange("schedule", 0, -1, withscores=True)
    job = json.loads(raw)
    assert job["jid"] == jids[0] and job["forkq_chain"][0]["jid"] == jids[1]
    assert at == pytest.approx(time.time() + 60, abs=5)
    forkq.chain(step.call("c")).enqueue_at(time.time() + 120)
    assert r.zcard("schedule") == 2


def test_test_modes_run_the_steps_in_order(client, r):
    with testing.inline():
        forkq.chain(add.call(1, 2), add.call(4), pass_result=True).enqueue()
    assert calls == [["add", 1, 2], ["add", 4, 3]]
    calls.clear()
    with testing.fake() as jobs:
        jids = forkq.chain(step.call("a"), step.call("b"), kept.call(2)).enqueue()
        assert [j["jid"] for j in jobs] == jids[:1]
        assert jobs.drain() == 3
        assert forkq.result(jids[2]) == 4
    assert calls == [["a"], ["b"], ["kept", 2]]
    assert r.keys("queue:*") == [] and r.keys("forkq:result:*") == []


@pytest.mark.timeout(20)
def test_inline_runs_a_long_chain_without_nesting_a_frame_per_step(client, r):
    """Under inline() each step ran inside the push of the one before: about 320 steps
    overflowed the stack. Then each step carried all those after it: 2,000 steps took
    about 40 s. 2,000 steps, each passing the running total on, in well under a second."""
    with testing.inline():
        jids = forkq.chain(add.call(0, 1), *[add.call(1) for _ in range(1999)],
                           pass_result=True).enqueue()
    assert len(jids) == 2000 and len(calls) == 2000
    assert calls[-1] == ["add", 1, 1999]
    calls.clear()
    with testing.fake() as jobs:  # and fake()'s drain, from the steps kept in memory
        forkq.chain(*[step.call(f"s{i}") for i in range(300)]).enqueue()
        assert jobs.drain() == 300
    assert [c[0] for c in calls] == [f"s{i}" for i in range(300)]
    calls.clear()


def test_a_long_chain_keeps_its_steps_in_one_list_not_in_every_payload(client, r, worker):
    """Each step carried every step after it: a 200-step chain's first payload was 29 KB
    and it pushed 2.9 MB over its life (1,000 steps: 147 KB and 73 MB), a square of its
    length. Past INLINE_BYTES the later steps are written once, to a list, and each payload
    carries a reference to it: the same 200 steps push 52 KB and store 29 KB once."""
    jids = forkq.chain(*[step.call(f"{i:03d}" + "x" * 80) for i in range(200)]).enqueue()
    (key,) = r.keys("forkq:chain:*")
    assert key.decode() == keys.chain(jids[0]) and r.llen(key) == 199
    assert r.ttl(key) == pytest.approx(keys.CHAIN_TTL_S, abs=60)
    pushed = []
    while r.llen("queue:cq"):
        raw = r.lindex("queue:cq", -1)
        pushed.append(len(raw))
        job = json.loads(raw)
        if len(pushed) < 200:
            assert job["forkq_chain"] == {"key": key.decode(), "next": len(pushed) - 1, "steps": 199}
        else:
            assert "forkq_chain" not in job
        run_one(worker)
    assert [c[0][:3] for c in calls] == [f"{i:03d}" for i in range(200)]
    assert max(pushed) < 400 and sum(pushed) < 80_000
    assert r.keys("forkq:chain:*") == [], "deleted with the push of its last step"
    assert dead(r) == [] and r.zcard("retry") == 0
    short = forkq.chain(step.call("a"), step.call("b")).enqueue()  # a handful: in the payload
    (job,) = queued(r, "cq")
    assert [s["jid"] for s in job["forkq_chain"]] == short[1:] and r.keys("forkq:chain:*") == []


def test_a_stored_chain_s_step_that_dies_goes_on_from_dead_and_a_lost_list_is_named(
        client, r, worker, monkeypatch):
    monkeypatch.setattr(chains, "INLINE_BYTES", 0)
    forkq.chain(step.call("a"), dies.call("d"), step.call("c"), step.call("e")).enqueue()
    (key,) = r.keys("forkq:chain:*")
    r.pexpire(key, 60_000)
    run_one(worker)
    assert r.ttl(key) > 60, "renewed by the step's push"
    run_one(worker)  # dies: retry=0
    (entry,) = dead(r)
    assert entry["forkq_chain"] == {"key": key.decode(), "next": 1, "steps": 3}
    retry_now(r, "dead")
    run_one(worker)
    run_one(worker)
    run_one(worker)
    assert calls == [["a"], ["dies", "d"], ["dies", "d"], ["c"], ["e"]]
    assert r.keys("forkq:chain:*") == [] and queued(r, "cq") == []
    calls.clear()
    jids = forkq.chain(step.call("x"), step.call("y"), step.call("z")).enqueue()
    r.delete(keys.chain(jids[0]))
    run_one(worker)
    assert calls == [["x"]] and inflight(r, worker) == 0 and queued(r, "cq") == []
    (lost,) = [e for e in dead(r) if e["class"] == "forkq.MalformedJob"]
    assert lost["error_class"] == "forkq.ChainBroken"
    assert (f"step 1 of the 2 after the first is not in {keys.chain(jids[0])} (it expires 210 "
            "days after the chain last moved, or was deleted)") in lost["error_message"]


def test_a_reference_outside_forkq_chain_keys_is_broken_and_that_key_untouched(client, r, worker):
    r.rpush("other", json.dumps({"class": "chain_test.step", "args": ["no"], "jid": "j9", "queue": "cq"}))
    client.push("chain_test.step", ["a"], queue="cq",
                forkq_chain={"key": "other", "next": 0, "steps": 1})
    run_one(worker)
    assert calls == [["a"]] and queued(r, "cq") == [] and r.llen("other") == 1 and r.ttl("other") == -1
    (entry,) = dead(r)
    assert entry["error_class"] == "forkq.ChainBroken"
    assert "neither a non-empty list of job payloads nor a reference" in entry["error_message"]


def test_a_stored_chain_s_last_step_parked_in_dead_takes_the_list_with_it(
        client, r, worker, monkeypatch):
    """A last step parked in dead for its destination carries its whole payload and no
    reference, yet its list was kept (renewed) for 210 days that nothing would read it.
    A middle step parked so keeps it, for a retry from dead to go on."""
    monkeypatch.setattr(chains, "INLINE_BYTES", 0)
    r.set("queue:elsewhere", "x")
    elsewhere = step.options(queue="elsewhere")
    ends = forkq.chain(step.call("a"), step.call("b"), elsewhere.call("c")).enqueue()
    run_one(worker)
    run_one(worker)
    (last,) = dead(r)
    assert last["jid"] == ends[2] and last["error_class"] == "forkq.QueueNotAList"
    assert "forkq_chain" not in last and not r.exists(keys.chain(ends[0]))
    middle = forkq.chain(step.call("x"), elsewhere.call("y"), step.call("z")).enqueue()
    run_one(worker)
    assert len(dead(r)) == 2 and r.ttl(keys.chain(middle[0])) > 60


def test_a_stored_chain_s_key_holding_no_list_parks_the_continuation_not_the_step(
        client, r, worker, monkeypatch):
    """LINDEX on it raised WRONGTYPE out of the worker's continuation: the step that
    succeeded stayed in flight, to run again at each restart, its next step never pushed."""
    monkeypatch.setattr(chains, "INLINE_BYTES", 0)
    jids = forkq.chain(step.call("a"), step.call("b")).enqueue()
    r.delete(keys.chain(jids[0]))
    r.set(keys.chain(jids[0]), "not a list")
    run_one(worker)
    assert calls == [["a"]] and inflight(r, worker) == 0 and queued(r, "cq") == []
    (entry,) = dead(r)
    assert entry["error_class"] == "forkq.ChainBroken"
    assert f"{keys.chain(jids[0])} holds something other than a list" in entry["error_message"]


def test_a_long_chain_whose_first_push_fails_leaves_no_list(client, r, monkeypatch):
    """The list is written before the first step's push; a push that surely failed left it
    for 210 days, one more for each try of a producer that tries again."""
    monkeypatch.setattr(chains, "INLINE_BYTES", 0)
    r.set("queue:cq", "x")
    for _ in range(2):
        with pytest.raises(Exception, match="WRONGTYPE"):
            forkq.chain(step.call("a"), step.call("b")).enqueue()
    assert r.keys("forkq:chain:*") == []
    r.delete("queue:cq")
    jids = forkq.chain(step.call("a"), step.call("b")).enqueue()
    assert r.exists(keys.chain(jids[0]))


def test_deleting_a_stored_chain_s_step_for_good_deletes_its_list(client, r, monkeypatch):
    """A long chain's later steps are in a list only its live step reads: deleting that
    step (a queue's delete or clear, a sorted set's delete or clear, by the CLI, the API
    or the dashboard) left the list for 210 days, 8 KB and more each, a cleared queue of
    them gigabytes. Each goes with the entry it was deleted with; other chains' stay."""
    monkeypatch.setattr(chains, "INLINE_BYTES", 0)
    at = time.time() + 3600

    def pushed(n, later=None):
        made = [forkq.chain(step.call(f"{i}"), step.call("b")) for i in range(n)]
        return [keys.chain((c.enqueue() if later is None else c.enqueue_at(later))[0]) for c in made]

    def listed(names):
        return sum(r.exists(k) for k in names)

    by_jid, cleared = pushed(1), pushed(3)
    queue = api.Queue(r, "cq")
    (entry,) = [e for e in queue.entries() if keys.chain(e.jid) == by_jid[0]]
    assert queue.delete([entry]) == 1 and listed(by_jid) == 0 and listed(cleared) == 3
    assert queue.clear() == 3 and listed(cleared) == 0
    scheduled = pushed(3, later=at)
    schedule = api.schedule(r)
    assert schedule.delete(schedule.page(0)[:1]) == 1 and listed(scheduled) == 2
    assert schedule.clear() == 2 and listed(scheduled) == 0
    assert r.keys("forkq:chain:*") == [] and r.llen("queue:cq") == 0


def _sup_job(name: str, fn):
    return forkq.jobs.lookup(name) or forkq.job(name=name, retry=0)(fn)


@pytest.mark.timeout(60)
def test_a_real_master_runs_a_chain_once_through_a_sigkill(start_master, redis_url, r):
    """A step's child is SIGKILLed while the step runs: the step runs again in the child
    that replaces it, and each step after it runs once, in order."""
    def sleep_job(tag, seconds):
        pass

    def quick_job(tag):
        pass

    sleep = _sup_job("sup.sleep", sleep_job)
    quick = _sup_job("sup.quick", quick_job)
    m = start_master(processes=2, concurrency=1)
    m.wait_slots()
    pusher = forkq.Client(redis_url)
    forkq.chain(sleep.options(client=pusher).call("first", 0.05),
                sleep.options(client=pusher).call("victim", 2.0),
                quick.options(client=pusher).call("third"),
                quick.options(client=pusher).call("fourth")).enqueue()
    (start,) = wait_event(r, m, "start", "victim")
    os.kill(start["pid"], signal.SIGKILL)
    wait_event(r, m, "done", "fourth", timeout=20)
    done = [e["tag"] for e in sup_events(r, "done")]
    assert done == ["first", "victim", "third", "fourth"]
    assert len(sup_events(r, "start", "victim")) == 2
    wait_until(lambda: r.llen("queue:default") == 0, timeout=5)
    assert dead(r) == [] and r.zcard("retry") == 0


def test_queue_delete_says_how_many_deleted_jobs_carried_the_rest_of_a_chain(r, capsys):
    """A cancel keeps a chain's later steps in dead; `forkq queue NAME delete` dropped them
    without a word. It now counts the deleted jobs that carried a chain, whichever way they
    were deleted: by class or jid (read in Python), or all (dropped by clear_list_page.lua,
    or handed back to Python when they hold a lock or batch to end)."""
    from forkq import cli

    def job(i, klass="Step", **extra):
        return {"class": klass, "args": [i], "jid": f"{i:024x}", "queue": "mail", **extra}

    rest = [{"class": "Next", "args": [], "jid": "n" * 24, "queue": "mail"}]
    jobs = [job(1, forkq_chain=rest), job(2), job(3, forkq_chain=rest), job(4, "Other"),
            job(5, "Other", forkq_chain=rest), job(6, "Other", args=[{"forkq_chain": [1]}]),
            job(7, "Other", forkq_chain=rest, unique_for=60), job(8, "Other", forkq_chain=[]),
            job(9, "Other", forkq_chain=rest),
            job(11, "Other", forkq_chain={"key": "forkq:chain:x", "next": 0, "steps": 2})]
    r.rpush(keys.queue("mail"), *[json.dumps(j) for j in jobs])
    r.sadd(keys.QUEUES, "mail")
    assert cli.main(["queue", "mail", "delete", "--class", "Step"]) == 0
    assert capsys.readouterr().out == (
        "delete: 3 jobs of queue mail; 2 of them carried the rest of a chain, whose later steps "
        "will not run (forkq cancel parks a step in dead with them)\n")
    assert cli.main(["queue", "mail", "delete", "--jid", f"{9:024x}", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"queue": "mail", "action": "delete", "count": 1,
                                                   "chains_cut": 1}
    assert cli.main(["queue", "mail", "delete", "--all"]) == 0
    assert capsys.readouterr().out == (
        "delete: 6 jobs of queue mail (workers may have taken some meanwhile); 3 of them carried "
        "the rest of a chain, whose later steps will not run (forkq cancel parks a step in dead "
        "with them)\n")
    assert r.llen(keys.queue("mail")) == 0
    r.rpush(keys.queue("mail"), json.dumps(job(10)))
    assert cli.main(["queue", "mail", "delete", "--all"]) == 0
    assert capsys.readouterr().out == (
        "delete: 1 job of queue mail (workers may have taken some meanwhile)\n")
