"""Keyword arguments: the payload's "kwargs" field, the checks before a push, the worker's
call, and everything else that carries a job's arguments (unique locks, periodic entries,
batch callbacks, retries, test modes, listings).

In-process against the shared redis-server, with a Manager driven by hand (corekit's
run_one): no worker processes.
"""

from __future__ import annotations

import hashlib
import json
import time
from datetime import datetime

import orjson
import pytest

import forkq
from forkq import admin, cron, testing
from corekit import hand_driven_fixture, no_middleware, run_one  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(30)

calls: list[tuple] = []


@forkq.job(queue="kq", name="kwargs_test.greet")
def greet(user, greeting="hello", *, locale="en"):
    job = forkq.current_job()
    calls.append((user, greeting, locale, job.get("kwargs") if job else None))
    return {"user": user, "locale": locale}


@forkq.job(queue="kq", name="kwargs_test.anything")
def anything(*args, **kwargs):
    calls.append((args, kwargs))


@forkq.job(queue="kq", name="kwargs_test.clock")
def clock(seconds, when=None):
    calls.append((seconds, when))


@forkq.job(queue="kq", name="kwargs_test.positional")
def positional(a, /, b):
    calls.append((a, b))


@forkq.job(queue="kq", name="kwargs_test.needs")
def needs(user, *, token):
    calls.append((user, token))


@forkq.job(queue="kq", retry=3, name="kwargs_test.fails")
def fails(user, *, why):
    raise RuntimeError(why)


@forkq.job(queue="kq", unique_for=60, name="kwargs_test.unique")
def unique(user, *, locale="en"):
    calls.append((user, locale))


@pytest.fixture
def client(redis_url):
    c = forkq.Client(redis_url)
    calls.clear()
    yield c


# a Manager on queue kq, not started: run_one() drives its one processor
worker = hand_driven_fixture("kq", "test:1:0000000000kw")


def queued(r, queue="kq"):
    return [json.loads(raw) for raw in reversed(r.lrange(f"queue:{queue}", 0, -1))]


# -- push and run ----------------------------------------------------------------------------


def test_kwargs_travel_in_their_own_field_and_the_worker_calls_with_them(client, r, worker):
    greet.options(client=client).enqueue(1, locale="fr")
    greet.options(client=client).enqueue(2, "hi")
    greet.options(client=client).enqueue(user=3, greeting="yo", locale="de")
    jobs = queued(r)
    assert [j["args"] for j in jobs] == [[1], [2, "hi"], []]
    assert [j.get("kwargs") for j in jobs] == [{"locale": "fr"}, None,
                                               {"user": 3, "greeting": "yo", "locale": "de"}]
    for _ in jobs:
        run_one(worker)
    # forkq.current_job() shows the payload's kwargs too
    assert calls == [(1, "hello", "fr", {"locale": "fr"}), (2, "hi", "en", None),
                     (3, "yo", "de", {"user": 3, "greeting": "yo", "locale": "de"})]
    assert worker.fetch.fetch(0) == [] and r.hlen(worker.fetch.inflight_key) == 0
    assert r.zcard("retry") == 0 and r.zcard("dead") == 0


def test_enqueue_in_and_at_take_a_parameter_named_seconds_or_when(client, r):
    # their first parameter is positional-only: a job's own `seconds`/`when` go to the job
    e = clock.options(client=client)
    now = time.time()
    assert e.enqueue_in(60, seconds=5, when="later")
    assert e.enqueue_at(now + 120, 1, when="x")
    assert [(json.loads(m)["args"], json.loads(m)["kwargs"], at - now > 59)
            for m, at in r.zrange("schedule", 0, -1, withscores=True)] == [
        ([], {"seconds": 5, "when": "later"}, True), ([1], {"when": "x"}, True)]


@forkq.job(queue="kq", name="kwargs_test.method_like")
def method_like(self, other=None):
    calls.append((self, other))


def test_a_parameter_named_self_is_given_by_keyword_on_every_push_path(client, r, worker):
    # `self` of enqueue (and of forkq.call, and of calling the job) is positional-only:
    # a job's own parameter of that name takes it by keyword, as `seconds` does
    e = method_like.options(client=client)
    assert method_like.options(client=client).enqueue(self="a", other=1)
    assert e.enqueue_in(60, self="b")
    assert e.enqueue_many([forkq.call(self="c"), {"self": "d"}])
    with testing.fake() as jobs:
        method_like.enqueue(self="e")
        assert jobs.kwargs(method_like) == [{"self": "e"}]
    assert method_like(self="f") is None  # called here, as a function
    assert [j.get("kwargs") for j in queued(r)] == [{"self": "a", "other": 1}, {"self": "c"},
                                                     {"self": "d"}]
    run_one(worker)
    assert calls == [("f", None), ("a", 1)]


def test_enqueue_many_takes_dict_items_and_forkq_call_items(client, r, worker):
    items = [(1,), {"user": 2, "locale": "de"}, forkq.call(3, "hey", locale="it"), [4], forkq.call(5)]
    jids = greet.options(client=client).enqueue_many(items)
    assert len(jids) == 5
    jobs = queued(r)
    assert [(j["args"], j.get("kwargs")) for j in jobs] == [
        ([1], None), ([], {"user": 2, "locale": "de"}), ([3, "hey"], {"locale": "it"}),
        ([4], None), ([5], None)]
    assert [j["jid"] for j in jobs] == jids
    for _ in jobs:
        run_one(worker)
    assert [c[:3] for c in calls] == [(1, "hello", "en"), (2, "hello", "de"), (3, "hey", "it"),
                                      (4, "hello", "en"), (5, "hello", "en")]
    # by name (Client.push_bulk) the items mean the same; a 2-tuple stays two positional args
    client.push_bulk("Any", [({"a": 1}, {"b": 2}), {"c": 3}, forkq.call(1, d=4)], queue="other")
    assert [(j["args"], j.get("kwargs")) for j in queued(r, "other")] == [
        ([{"a": 1}, {"b": 2}], None), ([], {"c": 3}), ([1], {"d": 4})]


def test_a_dict_subclass_item_is_keyword_arguments_as_a_dict_is(client, r):
    from collections import OrderedDict, defaultdict
    items = [OrderedDict(user=1, locale="de"), defaultdict(int, user=2)]
    assert len(greet.options(client=client).enqueue_many(items)) == 2
    client.push_bulk("Any", [OrderedDict(a=1)], queue="other")
    assert [j["kwargs"] for j in queued(r)] == [{"user": 1, "locale": "de"}, {"user": 2}]
    assert [j["kwargs"] for j in queued(r, "other")] == [{"a": 1}]


def test_a_push_without_kwargs_is_byte_for_byte_as_before(client, r):
    greet.options(client=client).enqueue(1, "hi")
    greet.options(client=client).enqueue(2, **{})
    client.push("Any", [3], queue="kq", kwargs={})
    client.push("Any", [4], queue="kq", kwargs=None)
    anything.options(client=client).enqueue_many([(5,), {}, forkq.call(6)])
    for raw in r.lrange("queue:kq", 0, -1):
        job = json.loads(raw)
        # Sidekiq's fields in Sidekiq's order, nothing else: what was written before kwargs
        same = {k: job[k] for k in ("class", "args", "jid", "queue", "retry", "created_at",
                                    "enqueued_at")}
        assert raw == orjson.dumps(same) and b'"kwargs"' not in raw


def test_kwargs_are_checked_against_the_function_and_nothing_is_pushed(client, r):
    e = greet.options(client=client)
    refusals = [
        (lambda: e.enqueue(1, colour="red"), r"unexpected keyword argument 'colour'"),
        (lambda: e.enqueue(1, user=1), r"multiple values for argument 'user'"),
        (lambda: e.enqueue(locale="fr"), r"missing a required argument: 'user'"),
        (lambda: e.enqueue_in(5, 1, 2, 3, locale="fr"), r"too many positional arguments"),
        (lambda: positional.options(client=client).enqueue(a=1, b=2), r"'a' parameter is positional only"),
        (lambda: needs.options(client=client).enqueue(1), r"missing a required argument: 'token'"),
        (lambda: e.enqueue_many([(1,), {"user": 2}, {"locale": "x"}]),
         r"^item 2 of the list: kwargs_test.greet cannot be called .*missing a required argument: 'user'"),
    ]
    for push, message in refusals:
        with pytest.raises(TypeError, match=message + r".*: nothing was pushed$"):
            push()
    # JSON-native values only, as args: same rule and wording, the value's place named
    with pytest.raises(TypeError, match=r"^job argument kwargs\['when'\] is datetime.*\(datetime\); "
                                        r"forkq accepts only JSON-native values"):
        e.enqueue(1, when=datetime.now())
    with pytest.raises(TypeError, match=r"^job argument kwargs\['tags'\]\[1\] is \{1, 2\}"):
        anything.options(client=client).enqueue(tags=["a", {1, 2}])
    with pytest.raises(TypeError, match=r"^item 1 of the list: job keyword argument name 1 is not a str"):
        anything.options(client=client).enqueue_many([{"a": 1}, {1: "a"}])
    # by name: no signature to check, but the values and names are
    with pytest.raises(TypeError, match=r"^job argument kwargs\['x'\] is nan"):
        client.push("Any", [], kwargs={"x": float("nan")})
    with pytest.raises(TypeError, match=r"name b'x' is not a str"):
        client.push("Any", [], kwargs={b"x": 1})
    with pytest.raises(TypeError, match=r"keyword arguments must be a dict, not list"):
        client.push("Any", [], kwargs=[("x", 1)])
    # not as a payload option, where nothing would check it
    with pytest.raises(TypeError, match="kwargs is not a job option"):
        greet.options(kwargs={"locale": "fr"})
    with pytest.raises(TypeError, match="kwargs is not a job option"):
        forkq.job(name="kwargs_test.opt", kwargs={"a": 1})(lambda: None)
    assert r.dbsize() == 0
    assert client.push("kwargs_test.greet", [], kwargs={"colour": "red"})  # by name: unchecked


def test_client_push_refuses_kwargs_that_are_no_dict_even_empty_ones(client, r):
    # an empty list or string was read as "no keyword arguments" and the job pushed
    for bad in ([], "", (), 0, [("x", 1)]):
        with pytest.raises(TypeError, match=r"keyword arguments must be a dict, not"):
            client.push("Any", [1], kwargs=bad)
    assert r.dbsize() == 0
    assert client.push("Any", [1], kwargs={}) and client.push("Any", [2], kwargs=None)


def test_a_keyword_only_parameter_without_default_is_a_required_keyword(client, r, worker):
    assert needs.options(client=client).enqueue(1, token="t")
    assert needs.options(client=client).enqueue_many([forkq.call(2, token="u")])
    run_one(worker)
    run_one(worker)
    assert calls == [(1, "t"), (2, "u")]


# -- bad payloads, retries -------------------------------------------------------------------


@pytest.mark.parametrize("bad", [[1, 2], None, "locale=fr", 3])
def test_a_payload_whose_kwargs_is_not_an_object_goes_to_dead_with_the_reason(client, r, worker, bad):
    raw = json.dumps({"class": "kwargs_test.greet", "args": [1], "kwargs": bad, "jid": "ab" * 12,
                      "queue": "kq", "retry": True})
    r.lpush("queue:kq", raw)
    run_one(worker)
    assert calls == []  # never called
    (entry,) = [json.loads(m) for m in r.zrange("dead", 0, -1)]
    assert entry["class"] == "forkq.MalformedJob"
    assert "payload 'kwargs' is not an object" in entry["error_message"]
    assert entry["forkq_original"] == raw  # nothing lost
    assert worker.fetch.fetch(0) == [] and r.hlen(worker.fetch.inflight_key) == 0
    assert r.llen("queue:kq") == 0 and r.zcard("retry") == 0


def test_a_retry_carries_the_kwargs_and_runs_with_them(client, r, worker):
    fails.options(client=client).enqueue(1, why="boom")
    run_one(worker)
    (retry,) = [json.loads(m) for m in r.zrange("retry", 0, -1)]
    assert (retry["args"], retry["kwargs"], retry["error_message"]) == ([1], {"why": "boom"}, "boom")
    # forkq retry/dead listings: the busy and suspects tables show kwargs next to args
    assert admin._args_text(retry) == '[1] {"why": "boom"}'
    assert admin._args_text({"args": [1]}) == "[1]"


# -- unique jobs -----------------------------------------------------------------------------


def documented_lock(name, queue, args, kwargs=None):
    """The documented identity, worked out here rather than by forkq.unique."""
    identity = [name, queue, args] if kwargs is None else [name, queue, args, kwargs]
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return "unique:" + hashlib.sha256(text.encode()).hexdigest()


def test_the_unique_lock_includes_kwargs_only_when_there_are_some(client, r, worker):
    e = unique.options(client=client)
    plain = e.enqueue(7)
    fr = e.enqueue(7, locale="fr")
    assert plain and fr  # two jobs: the kwargs tell them apart
    assert e.enqueue(7) is None and e.enqueue(7, locale="fr") is None
    assert e.enqueue(7, locale="de")
    # without kwargs, the three-item identity of before: existing locks stay valid
    assert r.get(documented_lock("kwargs_test.unique", "kq", [7])) == plain.encode()
    assert r.get(documented_lock("kwargs_test.unique", "kq", [7], {"locale": "fr"})) == fr.encode()
    # the worker finds the same lock from the payload, and releases it after success
    run_one(worker)
    run_one(worker)
    assert worker.fetch.fetch(0) == []
    assert not r.exists(documented_lock("kwargs_test.unique", "kq", [7]))
    assert not r.exists(documented_lock("kwargs_test.unique", "kq", [7], {"locale": "fr"}))
    assert e.enqueue(7, locale="fr")


# -- periodic, batches, test modes -----------------------------------------------------------


@pytest.fixture
def entries():
    saved = dict(cron.ENTRIES)
    cron.ENTRIES.clear()
    try:
        yield cron.ENTRIES
    finally:
        cron.ENTRIES.clear()
        cron.ENTRIES.update(saved)


def test_periodic_takes_kwargs_checked_at_import(entries):
    entry = forkq.periodic("0 8 * * *", greet, [1], kwargs={"locale": "fr"}, name="morning")
    job = entry.payload(1_700_000_000, 1_700_000_000.5)
    assert (job["args"], job["kwargs"]) == ([1], {"locale": "fr"})
    plain = forkq.periodic("0 9 * * *", greet, [2], name="plain")
    assert "kwargs" not in plain.payload(1_700_000_000, 1_700_000_000.5)
    # the same declaration twice is one entry; other kwargs under the same name are refused
    assert forkq.periodic("0 8 * * *", greet, [1], kwargs={"locale": "fr"}, name="morning") is entry
    with pytest.raises(cron.CronError, match="already declared"):
        forkq.periodic("0 8 * * *", greet, [1], kwargs={"locale": "de"}, name="morning")
    with pytest.raises(TypeError, match=r"^forkq.periodic 'bad': kwargs_test.greet cannot be called "
                                        r"with these arguments: got an unexpected keyword argument 'x'"):
        forkq.periodic("0 8 * * *", greet, [1], kwargs={"x": 1}, name="bad")
    with pytest.raises(TypeError, match=r"^forkq.periodic 'bad': job argument kwargs\['at'\] is"):
        forkq.periodic("0 8 * * *", "Other", kwargs={"at": datetime.now()}, name="bad")
    assert "bad" not in entries


def test_periodic_pushes_its_kwargs(r, entries):
    entry = forkq.periodic("* * * * *", greet, [1], kwargs={"locale": "fr"}, name="each")
    (row,) = cron.status(r, [entry], time.time())
    assert (row["args"], row["kwargs"]) == ([1], {"locale": "fr"})


def test_batch_callbacks_take_kwargs():
    calls.clear()
    with testing.fake() as jobs:
        with forkq.Batch() as b:
            b.on_success(greet, 1, locale="fr")
            greet.enqueue(2)
        with pytest.raises(TypeError, match="unexpected keyword argument 'x'"):
            forkq.Batch().on_complete(greet, 1, x=1)
        assert jobs.calls(greet) == [([2], {}), ([1], {"locale": "fr"})]


def test_fake_mode_records_kwargs_and_drain_runs_with_them(no_middleware):
    calls.clear()
    with testing.fake() as jobs:
        greet.enqueue(1, locale="fr")
        greet.enqueue(2)
        greet.enqueue_many([{"user": 3, "greeting": "yo"}])
        assert jobs.args(greet) == [[1], [2], []]
        assert jobs.kwargs(greet) == [{"locale": "fr"}, {}, {"user": 3, "greeting": "yo"}]
        assert jobs.calls(greet) == [([1], {"locale": "fr"}), ([2], {}),
                                     ([], {"user": 3, "greeting": "yo"})]
        with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
            greet.enqueue(1, colour="red")  # checked as a real push is
        assert jobs.drain() == 3
    assert [c[:3] for c in calls] == [(1, "hello", "fr"), (2, "hello", "en"), (3, "yo", "en")]


def test_inline_mode_runs_with_kwargs_and_keeps_the_result(no_middleware):
    calls.clear()
    with testing.inline():
        jid = greet.options(keep_result=60).enqueue(1, locale="fr")
        assert forkq.result(jid) == {"user": 1, "locale": "fr"}
    assert calls == [(1, "hello", "fr", {"locale": "fr"})]


def test_an_empty_kwargs_field_has_the_identity_of_none():
    from forkq import unique
    assert unique.lock_key("K", "q", [1], {}) == unique.lock_key("K", "q", [1]) != \
        unique.lock_key("K", "q", [1], {"a": 1})
