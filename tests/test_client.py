"""The client side: @forkq.job, enqueueing, payload shape in Redis, middleware, connections.

Everything is checked in a real redis-server (the shared one, flushed per test, or a
private `own_redis`). The job definitions are tests/apps/core_jobs.py.
"""

import functools
import json
import re
import time
from datetime import datetime, timedelta, timezone

import pytest
import redis

import forkq
import forkq.jobs
from corekit import UnixSocketRedis, core_jobs, forkq_client  # noqa: F401  (fixture)
from helpers import CommandCutter, free_port

JID = re.compile(r"\A[0-9a-f]{24}\Z")
PUSHED_FIELDS = {"class", "args", "jid", "queue", "retry", "created_at", "enqueued_at"}
SCHEDULED_FIELDS = PUSHED_FIELDS - {"enqueued_at"}


def _queue(r, name="default"):
    """Jobs on queue:NAME, the next one to run (the rightmost) first."""
    return [json.loads(raw) for raw in reversed(r.lrange(f"queue:{name}", 0, -1))]


def _schedule(r):
    return [(json.loads(m), s) for m, s in r.zrange("schedule", 0, -1, withscores=True)]


def _cmd_calls(r, command):
    stats = r.info("commandstats")
    return stats.get(f"cmdstat_{command}", {}).get("calls", 0)


# -- @forkq.job ---------------------------------------------------------------------------


def test_bare_decorator_defaults():
    job = core_jobs.record
    assert isinstance(job, forkq.Job)
    assert job.name == "tests.apps.core_jobs.record"  # module.function
    assert job.queue == "default"
    assert job.retry is True
    assert forkq.jobs.lookup("tests.apps.core_jobs.record") is job


def test_decorator_with_options(forkq_client, r):
    job = core_jobs.named
    assert (job.name, job.queue, job.retry) == ("CustomName", "mail", 3)
    assert forkq.jobs.lookup("CustomName") is job

    jid = job.enqueue("x")
    (pushed,) = _queue(r, "mail")
    assert pushed["jid"] == jid
    assert (pushed["class"], pushed["queue"], pushed["retry"], pushed["args"]) == (
        "CustomName", "mail", 3, ["x"])
    assert r.smembers("queues") == {b"mail"}
    assert not r.exists("queue:default")


def test_decorator_options_become_payload_fields(forkq_client, r):
    core_jobs.fail_retry_queue.enqueue("t")
    core_jobs.fail_no_dead.enqueue("t")
    core_jobs.fail_backtrace3.enqueue("t")
    by_class = {j["class"]: j for j in _queue(r)}
    assert by_class["tests.apps.core_jobs.fail_retry_queue"]["retry_queue"] == "retries"
    assert by_class["tests.apps.core_jobs.fail_no_dead"]["dead"] is False
    assert by_class["tests.apps.core_jobs.fail_no_dead"]["retry"] == 0
    assert by_class["tests.apps.core_jobs.fail_backtrace3"]["backtrace"] == 3


def test_negative_retry_is_refused():
    with pytest.raises(ValueError, match="retry"):
        forkq.job(retry=-1)


@pytest.mark.parametrize("bad", ["5", 5.0, None, [5]])
def test_a_retry_that_is_not_a_bool_or_count_is_refused_before_anything_is_pushed(bad, forkq_client, r):
    """retry="5" or 5.0 was pushed as it was, and every worker, Sidekiq's and forkq's,
    reads a retry of another type as its default: 25 retries, not 5."""
    with pytest.raises(ValueError, match="retry must be True, False or a count"):
        forkq.job(retry=bad)
    with pytest.raises(ValueError, match="retry must be True, False or a count"):
        core_jobs.add.options(retry=bad)
    with pytest.raises(ValueError, match="retry must be True, False or a count"):
        forkq_client.push("Any", [1], retry=bad)
    with pytest.raises(ValueError, match="retry must be True, False or a count"):
        forkq_client.push_bulk("Any", [[1]], retry=bad)
    assert r.dbsize() == 0


def test_calling_the_function_runs_it_locally(forkq_client, r):
    assert core_jobs.add(2, 3) == 5
    assert core_jobs.add.__wrapped__(1, 1) == 2
    assert r.dbsize() == 0


# -- what lands in Redis ------------------------------------------------------------------


def test_enqueue_writes_exactly_sidekiqs_fields(forkq_client, r):
    before = time.time()
    jid = core_jobs.record.enqueue(1, "two", {"three": [3]}, None)
    after = time.time()

    assert JID.match(jid)
    (raw,) = r.lrange("queue:default", 0, -1)
    job = json.loads(raw)
    assert set(job) == PUSHED_FIELDS
    assert job["jid"] == jid
    assert job["class"] == "tests.apps.core_jobs.record"
    assert job["args"] == [1, "two", {"three": [3]}, None]
    assert job["queue"] == "default"
    assert job["retry"] is True
    assert type(job["created_at"]) is float and type(job["enqueued_at"]) is float
    assert before <= job["created_at"] <= job["enqueued_at"] <= after
    assert r.smembers("queues") == {b"default"}


def test_each_job_gets_its_own_jid(forkq_client, r):
    jids = [core_jobs.record.enqueue(i) for i in range(50)]
    assert len(set(jids)) == 50
    assert [j["jid"] for j in _queue(r)] == jids


def test_lpush_order_is_fifo(forkq_client, r):
    for i in range(3):
        core_jobs.record.enqueue(i)
    # clients LPUSH, workers pop the right end: the first pushed is rightmost
    assert json.loads(r.lindex("queue:default", -1))["args"] == [0]
    assert [json.loads(r.rpop("queue:default"))["args"] for _ in range(3)] == [[0], [1], [2]]


def test_enqueue_in_goes_to_schedule_without_enqueued_at(forkq_client, r):
    before = time.time()
    jid = core_jobs.record.enqueue_in(60, "later")
    after = time.time()

    assert not r.exists("queue:default")
    ((job, score),) = _schedule(r)
    assert set(job) == SCHEDULED_FIELDS  # no enqueued_at, and no `at`
    assert job["jid"] == jid and job["args"] == ["later"]
    assert before + 60 <= score <= after + 60
    assert job["created_at"] <= score


def test_enqueue_at_datetime_and_epoch(forkq_client, r):
    when = datetime.now(timezone.utc) + timedelta(hours=1)
    a = core_jobs.record.enqueue_at(when, "dt")
    b = core_jobs.record.enqueue_at(when.timestamp() + 1, "float")
    c = core_jobs.record.enqueue_at(int(when.timestamp()) + 2, "int")

    scores = {job["jid"]: score for job, score in _schedule(r)}
    assert scores[a] == pytest.approx(when.timestamp(), abs=1e-6)
    assert scores[b] == pytest.approx(when.timestamp() + 1, abs=1e-6)
    assert scores[c] == int(when.timestamp()) + 2
    assert not r.exists("queue:default")


def test_enqueue_at_a_past_time_pushes_onto_the_queue(forkq_client, r):
    jid = core_jobs.record.enqueue_at(time.time() - 10, "overdue")
    assert not r.exists("schedule")
    (job,) = _queue(r)
    assert job["jid"] == jid and "enqueued_at" in job


def test_enqueue_at_refuses_a_bad_time(forkq_client, r):
    with pytest.raises(TypeError, match="epoch seconds or a datetime"):
        core_jobs.record.enqueue_at("tomorrow", 1)
    assert r.dbsize() == 0


def test_enqueue_many_is_one_lpush_per_batch(forkq_client, r):
    r.config_resetstat()
    jids = core_jobs.record.enqueue_many(([i] for i in range(2500)), batch_size=1000)

    assert _cmd_calls(r, "lpush") == 3  # batches of 1000, 1000, 500
    assert _cmd_calls(r, "sadd") == 3
    assert len(jids) == len(set(jids)) == 2500
    assert r.llen("queue:default") == 2500
    jobs = _queue(r)
    assert [j["args"] for j in jobs] == [[i] for i in range(2500)]  # FIFO kept across batches
    assert [j["jid"] for j in jobs] == jids
    assert all(set(j) == PUSHED_FIELDS for j in jobs)


def test_enqueue_many_accepts_tuples_and_other_iterables(forkq_client, r):
    jids = core_jobs.record.enqueue_many([(1, 2), [3], iter([4, 5])])
    assert len(jids) == 3
    assert [j["args"] for j in _queue(r)] == [[1, 2], [3], [4, 5]]


@pytest.mark.parametrize("items, shown", [
    (["abc", "de"], "not str"),
    ([{1: "a"}], "name 1 is not a str"),  # a dict item is keyword arguments (by name)
    ([1, 2], "not int"),
    ([b"xy"], "not bytes"),
])
def test_enqueue_many_wants_a_list_of_argument_lists(forkq_client, r, items, shown):
    # a flat list is a common slip: it must not become one job per character or key
    with pytest.raises(TypeError, match=shown):
        core_jobs.record.enqueue_many(items)
    with pytest.raises(TypeError, match=shown):
        forkq.default_client().push_bulk("X", items)
    assert r.dbsize() == 0


def test_a_bad_argument_in_a_later_batch_pushes_nothing(forkq_client, r):
    items = [[i] for i in range(2500)]
    items[2100] = [object()]
    # the item is named: the value alone does not say which of 2,500 it was in
    with pytest.raises(TypeError, match=r"^item 2100 of the list: job argument args\[0\] is <object"):
        core_jobs.record.enqueue_many(items, batch_size=1000)
    with pytest.raises(TypeError, match=r"^item 2100 of the list: "):
        forkq.default_client().push_bulk("X", items)
    assert r.dbsize() == 0  # not the first two batches either
    with pytest.raises(TypeError, match=r"^job argument args\[0\]"):  # no item in a single push
        forkq.default_client().push("X", [object()])


@pytest.mark.parametrize("bad, where", [
    (["a\udcff"], r"args\[0\]"),
    ([{"name\udcff": 1}], r"args\[0\] key 'name\\udcff'"),
    ([[1, {"k": "x\udcff"}]], r"args\[0\]\[1\]\['k'\]"),
])
def test_a_lone_surrogate_in_a_later_batch_is_refused_by_name_and_pushes_nothing(forkq_client, r, bad,
                                                                                where):
    """A str holding a lone surrogate (os.fsdecode's file name that is not UTF-8) is no
    text a payload can carry. It failed in redis-py's encoding, batch by batch: the first
    two of an enqueue_many went in, then a UnicodeEncodeError named no item."""
    items = [[i] for i in range(2500)]
    items[2100] = bad
    with pytest.raises(TypeError, match=rf"^item 2100 of the list: job argument {where} is .*lone surrogate"):
        core_jobs.record.enqueue_many(items, batch_size=1000)
    assert r.dbsize() == 0
    with pytest.raises(TypeError, match=r"lone surrogate"):
        core_jobs.record.enqueue(surrogate="a\udcff")
    with pytest.raises(TypeError, match=r"^job keyword argument name .*lone surrogate"):
        forkq.default_client().push("X", [], kwargs={"a\udcff": 1})
    with pytest.raises(TypeError, match=r"^job option 'tags'\[0\] is .*lone surrogate"):
        core_jobs.record.options(tags=["a\udcff"]).enqueue(1)
    assert r.dbsize() == 0
    assert core_jobs.record.enqueue("é ok", {"ü": "ñ"})  # text beyond ASCII is fine


@forkq.job(name="client_test.two_or_three")
def two_or_three(a, b, c=None, *, verbose=False):
    pass


@forkq.job(name="client_test.at_least_one")
def at_least_one(a, *rest):
    pass


def test_args_the_function_cannot_take_are_refused_and_nothing_is_pushed(forkq_client, r):
    # pushed, such a job would fail with a TypeError at every run, retries and all
    with pytest.raises(TypeError, match=r"^client_test.two_or_three takes from 2 to 3 positional "
                                        r"arguments, not 1: nothing was pushed$"):
        two_or_three.enqueue(1)
    with pytest.raises(TypeError, match="not 4"):
        two_or_three.options(queue="low").enqueue_in(60, 1, 2, 3, 4)
    with pytest.raises(TypeError, match=r"^item 1 of the list: .* at least 1 positional argument, not 0"):
        at_least_one.enqueue_many([[1], [], [2]])
    assert r.dbsize() == 0
    assert two_or_three.enqueue(1, 2) and two_or_three.enqueue_at(time.time() + 60, 1, 2, 3)
    assert len(at_least_one.enqueue_many([[1], [1, 2, 3, 4, 5]])) == 2
    # by name, the function is not known here (another language's worker may run it)
    assert forkq.default_client().push("client_test.two_or_three", [])
    # a keyword-only parameter without a default is allowed now that a push can name it:
    # every push must (test_kwargs.py has the rest)
    needs = forkq.job(name="client_test.needs_keyword")(lambda *a, b: None)
    try:
        with pytest.raises(TypeError, match=r"missing a required argument: 'b': nothing was pushed"):
            needs.enqueue(1)
        with pytest.raises(TypeError, match=r"^item 0 of the list: .*missing a required argument: 'b'"):
            needs.enqueue_many([(1,), {"b": 2}])
        assert needs.enqueue(1, b=2)
    finally:
        forkq.jobs.REGISTRY.pop("client_test.needs_keyword", None)


def _inject(*front, **keywords):
    """A decorator that calls the function with arguments of its own (a connection, a
    session), as many apps' do: the job is pushed with the rest of the args only."""
    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return fn(*front, *args, **keywords, **kwargs)
        return wrapper
    return decorate


def test_the_arity_is_the_called_functions_not_the_one_a_decorator_wraps(forkq_client, r):
    # signature() follows functools.wraps' __wrapped__ to the inner function, whose
    # parameters the wrapper fills in: those jobs were refused at push, or at import
    @forkq.job(name="client_test.with_conn")
    @_inject("conn")
    def with_conn(conn, row):
        return conn, row

    @forkq.job(name="client_test.with_session")
    @_inject(session="s")
    def with_session(row, *, session):
        return row, session

    try:
        assert with_conn.enqueue(1) and with_session.enqueue(2)
        assert with_conn.enqueue_many([[3]]) and r.llen("queue:default") == 3
        assert forkq.jobs.lookup("client_test.with_conn").fn(1) == ("conn", 1)  # as a worker calls it
        # a partial, a callable object and a bound method are checked by what they take
        part = forkq.job(name="client_test.partial")(functools.partial(lambda a, b, c=None: None, 1))
        with pytest.raises(TypeError, match="takes from 1 to 2 positional arguments, not 0"):
            part.enqueue()
        assert part.enqueue(2)
    finally:
        for name in ("with_conn", "with_session", "partial"):
            forkq.jobs.REGISTRY.pop(f"client_test.{name}", None)


def _at_second_batch(act):
    """A client middleware that calls `act` once, on the first job of the second batch of
    1,000 (args [1000]), before that batch is sent."""
    fired = []

    def middleware(job):
        if job["args"] == [1000] and not fired:
            fired.append(True)
            act()
        return job
    return middleware


def _args_in(conn, queue="default"):
    return [j["args"][0] for j in _queue(conn, queue)]


@pytest.mark.timeout(30)
def test_enqueue_many_refused_part_way_says_which_jobs_are_in_redis(own_redis):
    admin = own_redis.client()
    refuse = _at_second_batch(lambda: admin.config_set("maxmemory", 1))  # OOM from here on
    client = forkq.Client(own_redis.url, middleware=[refuse])
    items = [[i] for i in range(2500)]
    with pytest.raises(forkq.PartialEnqueue) as info:
        core_jobs.record.options(client=client).enqueue_many(items)
    error = info.value
    assert isinstance(error, forkq.RedisUnavailable)
    assert "1,000 of 2,500 jobs were pushed" in str(error) and "OutOfMemoryError" in str(error)
    assert error.unsure == [] and not error.maybe_pushed  # a refused LPUSH pushed nothing
    assert [j["jid"] for j in _queue(admin)] == error.jids
    # the rest, pushed again once Redis takes writes, completes the set with no repeat
    admin.config_set("maxmemory", 0)
    assert error.resume_at == 1000
    core_jobs.record.options(client=client).enqueue_many(items[error.resume_at:])
    assert _args_in(admin) == list(range(2500))
    admin.close()


@pytest.mark.timeout(30)
def test_enqueue_many_whose_reply_is_lost_part_way_names_the_batch_that_may_be_in(own_redis):
    client = forkq.Client(own_redis.url, middleware=[_at_second_batch(own_redis.pause)],
                          socket_timeout=0.5)
    try:
        with pytest.raises(forkq.PartialEnqueue) as info:
            core_jobs.record.options(client=client).enqueue_many([[i] for i in range(2500)])
    finally:
        own_redis.resume()
    error = info.value
    assert len(error.jids) == 1000 and len(error.unsure) == 1000 and error.maybe_pushed
    assert error.resume_at == 2000
    assert "the next 1,000 may have been" in str(error)
    admin = own_redis.client()
    # the frozen server held the batch's bytes: whether it ran them is what `unsure` means
    assert [j["jid"] for j in _queue(admin)] in (error.jids, error.jids + error.unsure)
    assert admin.llen("queue:default") < 2500  # the last batch was never sent
    admin.close()


@pytest.mark.timeout(30)
def test_enqueue_many_cut_off_part_way_has_pushed_exactly_its_jids(own_redis):
    client = forkq.Client(own_redis.url, middleware=[_at_second_batch(own_redis.stop)])
    with pytest.raises(forkq.PartialEnqueue, match="1,000 of 2,500 jobs were pushed") as info:
        core_jobs.record.options(client=client).enqueue_many([[i] for i in range(2500)])
    assert info.value.unsure == [] and "not pushed" in str(info.value)
    own_redis.start()
    admin = own_redis.client()
    assert [j["jid"] for j in _queue(admin)] == info.value.jids
    admin.close()


def test_enqueue_many_that_fails_at_its_first_batch_raises_as_a_push_would(r):
    client = forkq.Client(f"redis://127.0.0.1:{free_port()}/0")
    with pytest.raises(forkq.RedisUnavailable, match="not pushed") as info:
        core_jobs.record.options(client=client).enqueue_many([[1], [2]])
    assert type(info.value) is forkq.RedisUnavailable


def test_options_override_queue_and_retry_for_one_push(forkq_client, r):
    jid = core_jobs.record.options(queue="low", retry=2).enqueue("x")
    core_jobs.record.enqueue("y")

    (low,) = _queue(r, "low")
    assert (low["jid"], low["queue"], low["retry"]) == (jid, "low", 2)
    (default,) = _queue(r, "default")
    assert (default["queue"], default["retry"]) == ("default", True)
    assert r.smembers("queues") == {b"low", b"default"}
    assert core_jobs.record.queue == "default"  # the job's own options are unchanged


def test_options_can_schedule_and_bulk_push(forkq_client, r):
    low = core_jobs.record.options(queue="low")
    low.enqueue_in(30, "s")
    low.enqueue_many([[1], [2]])
    ((scheduled, _),) = _schedule(r)
    assert scheduled["queue"] == "low"
    assert [j["args"] for j in _queue(r, "low")] == [[1], [2]]


# -- arguments that JSON cannot carry -----------------------------------------------------


class Thing:
    def __repr__(self):
        return "<Thing 42>"


@pytest.mark.parametrize("bad, shown", [
    ({1, 2}, "{1, 2}"),
    (b"raw", "b'raw'"),
    (Thing(), "<Thing 42>"),
    ({"pair": (1, 2)}, "(1, 2)"),
    ({5: "five"}, "key 5"),
    (float("nan"), "nan"),
    ([1, [float("inf")]], "inf"),
], ids=["set", "bytes", "object", "tuple-in-dict", "int-key", "nan", "nested-inf"])
def test_non_json_args_raise_typeerror_and_push_nothing(forkq_client, r, bad, shown):
    for push in (
        lambda: core_jobs.record.enqueue("fine", bad),
        lambda: core_jobs.record.enqueue_in(5, bad),
        lambda: core_jobs.record.enqueue_at(time.time() + 5, bad),
        lambda: core_jobs.record.enqueue_many([["fine"], [bad], ["fine"]]),
        lambda: forkq.default_client().push("Anything", ["fine", bad]),
    ):
        with pytest.raises(TypeError) as info:
            push()
        assert shown in str(info.value)
    assert r.dbsize() == 0


def test_options_json_cannot_carry_as_given_raise_typeerror_and_push_nothing(forkq_client, r):
    """orjson wrote a datetime or UUID option as a string: the job carried another type."""
    when = datetime.now(timezone.utc)
    for push in (
        lambda: core_jobs.record.options(expires=when).enqueue("fine"),
        lambda: core_jobs.record.options(meta={"ids": {1, 2}}).enqueue_many([["fine"]]),
        lambda: forkq.default_client().push("Anything", ["fine"], expires=when),
        lambda: forkq.default_client().push_bulk("Anything", [["fine"]], tags=("a",)),
    ):
        with pytest.raises(TypeError, match=r"job option '(expires|meta|tags)'"):
            push()
    with pytest.raises(TypeError, match="job option 'expires' is datetime"):
        forkq.job(expires=when)(lambda: None)  # at import, not at the first enqueue
    assert r.dbsize() == 0
    assert core_jobs.record.options(tags=["a"], meta={"n": 1.5}).enqueue("fine")


# -- client middleware --------------------------------------------------------------------


def test_client_middleware_can_change_a_payload(redis_url, r):
    seen = []

    def tag(job):
        seen.append(dict(job))
        job["tenant"] = "acme"
        job["args"] = job["args"] + ["added"]
        return job

    client = forkq.Client(redis_url, middleware=[tag])
    jid = core_jobs.record.options(client=client).enqueue(1)

    (job,) = _queue(r)
    assert job["jid"] == jid
    assert job["tenant"] == "acme"
    assert job["args"] == [1, "added"]
    assert seen and seen[0]["class"] == "tests.apps.core_jobs.record"


def test_client_middleware_can_drop_a_payload(redis_url, r):
    def drop_odd(job):
        return None if job["args"][0] % 2 else job

    client = forkq.Client(redis_url, middleware=[drop_odd])
    enq = core_jobs.record.options(client=client)

    assert enq.enqueue(1) is None
    assert enq.enqueue_in(10, 3) is None
    assert r.dbsize() == 0
    jids = enq.enqueue_many([[i] for i in range(6)])
    assert len(jids) == 3
    assert [j["args"] for j in _queue(r)] == [[0], [2], [4]]
    assert [j["jid"] for j in _queue(r)] == jids


def test_configure_sets_the_default_clients_middleware(redis_url, r):
    try:
        forkq.configure(redis_url, middleware=[lambda job: {**job, "via": "configure"}])
        core_jobs.record.enqueue(1)
    finally:
        forkq.client._default = None
    (job,) = _queue(r)
    assert job["via"] == "configure"


# -- connections --------------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("url, env", [("", None), ("  ", None), (None, ""), (None, " ")])
def test_an_empty_url_or_forkq_redis_url_is_refused_not_taken_for_localhost(url, env, monkeypatch):
    # a Kubernetes secret that resolved to nothing: pushing to 127.0.0.1:6379 would put the
    # jobs where no worker reads them (or fail later, far from the cause)
    monkeypatch.delenv("FORKQ_REDIS_URL", raising=False)
    if env is not None:
        monkeypatch.setenv("FORKQ_REDIS_URL", env)
    with pytest.raises(forkq.ConfigError, match="must not be empty"):
        forkq.Client(url)


@pytest.mark.timeout(30)
def test_forkq_redis_url_picks_the_server_of_a_client_given_none(redis_url, r, monkeypatch):
    monkeypatch.setenv("FORKQ_REDIS_URL", redis_url)
    forkq.Client().push("Anything", [1])
    assert [j["args"] for j in _queue(r)] == [[1]]


def test_two_clients_push_to_two_servers(forkq_client, r, own_redis):
    other = forkq.Client(own_redis.url)
    here = core_jobs.record.enqueue("here")
    there = core_jobs.record.options(client=other).enqueue("there")
    low_level = other.push("RubyJob", [1], queue="ruby", retry=False)

    assert [j["jid"] for j in _queue(r)] == [here]
    theirs = own_redis.client()
    try:
        assert [j["jid"] for j in _queue(theirs)] == [there]
        (ruby,) = _queue(theirs, "ruby")
        assert (ruby["jid"], ruby["class"], ruby["retry"]) == (low_level, "RubyJob", False)
        assert set(ruby) == PUSHED_FIELDS
    finally:
        theirs.close()
    assert not r.exists("queue:ruby")


def test_client_push_bulk_is_one_lpush(redis_url, r):
    client = forkq.Client(redis_url)
    r.config_resetstat()
    jids = client.push_bulk("BulkJob", [[i] for i in range(100)], queue="bulk", retry=5)
    assert _cmd_calls(r, "lpush") == 1
    jobs = _queue(r, "bulk")
    assert [j["jid"] for j in jobs] == jids
    assert all(j["retry"] == 5 and j["class"] == "BulkJob" for j in jobs)


def test_unreachable_redis_raises_redisunavailable_with_password_masked(r):
    port = free_port()  # nothing listens here
    client = forkq.Client(f"redis://worker:hunter2@127.0.0.1:{port}/0")
    with pytest.raises(forkq.RedisUnavailable) as info:
        core_jobs.record.options(client=client).enqueue(1)
    message = str(info.value)
    assert "hunter2" not in message
    assert f"127.0.0.1:{port}" in message
    assert "worker:***@" in message
    assert isinstance(info.value, forkq.ForkqError)
    assert r.dbsize() == 0

    with pytest.raises(forkq.RedisUnavailable):
        client.push_bulk("X", [[1], [2]])


def test_redisunavailable_when_the_server_goes_away(own_redis):
    client = forkq.Client(own_redis.url)
    assert client.push("X", [1])
    own_redis.stop()
    with pytest.raises(forkq.RedisUnavailable, match="not pushed"):
        client.push("X", [2])
    own_redis.start()
    assert client.push("X", [3])  # the same client works again once Redis is back
    conn = own_redis.client()
    try:
        assert [j["args"] for j in _queue(conn)] == [[1], [3]]
    finally:
        conn.close()


@pytest.mark.timeout(30)
def test_a_connection_the_server_closed_while_idle_is_replaced_without_a_duplicate(redis_url, r):
    client = forkq.Client(redis_url)
    assert client.push("X", [1])
    killed = r.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
    assert killed >= 1  # the client's idle connection is gone
    assert client.push("X", [2])
    assert [j["args"] for j in _queue(r)] == [[1], [2]]


@pytest.mark.timeout(30)
def test_a_push_refused_by_redis_raises_and_leaves_the_connection_in_step(redis_url, r):
    """A push is two commands in one write (SADD, LPUSH): when either is refused, every
    reply is still read, so the connection's next command gets its own reply."""
    from forkq import wire
    client = forkq.Client(redis_url)
    assert client.push("X", [1])
    r.set("queue:taken", "not a list")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        client.push("X", [2], queue="taken")
    assert client.push("X", [3])
    assert [j["args"] for j in _queue(r)] == [[1], [3]]
    # the first of the two refused: the second's reply must not be left for the next caller
    conn = wire.connection_factory(client.redis)()
    try:
        with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
            wire.run_commands(conn, ("SADD", "queue:taken", "x"), ("LPUSH", "queue:other", "y"))
        assert wire.run_commands(conn, ("ECHO", "mine")) == b"mine"
    finally:
        conn.disconnect()
    assert r.lrange("queue:other", 0, -1) == [b"y"]


@pytest.mark.timeout(60)
def test_threads_share_a_client_and_every_push_lands_once(redis_url, r):
    import threading
    client = forkq.Client(redis_url)
    jids: list[str] = []

    def pusher(t: int) -> None:
        for i in range(300):
            jids.append(client.push("X", [t, i]))

    threads = [threading.Thread(target=pusher, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    queued = _queue(r)
    assert len(queued) == len(jids) == 2400 and len(set(jids)) == 2400
    assert sorted(tuple(j["args"]) for j in queued) == [(t, i) for t in range(8) for i in range(300)]


@pytest.mark.timeout(30)
def test_a_redis_that_stops_answering_raises_instead_of_hanging(own_redis):
    assert forkq.Client(own_redis.url).redis.connection_pool.connection_kwargs[
        "socket_timeout"] == 5.0  # the default: finite, as Sidekiq's
    client = forkq.Client(own_redis.url, socket_timeout=0.5)
    client.push("X", [1])
    own_redis.pause()
    try:
        started = time.monotonic()
        with pytest.raises(forkq.RedisUnavailable, match="may or may not have been pushed"):
            client.push("X", [2])
        assert time.monotonic() - started < 3
    finally:
        own_redis.resume()
    assert client.push("X", [3])


@pytest.mark.parametrize("url", [
    "http://:hunter2@127.0.0.1:6379/0",
    "redis://:hunter2@127.0.0.1:notaport/0",
    "redis://:hunter2@[::1/0",
    "redis://:hunter2@127.0.0.1:6379/notadb",
])
def test_bad_url_is_a_valueerror_with_password_masked(url):
    with pytest.raises(ValueError, match="bad Redis URL") as info:
        forkq.Client(url).push("X", [1])
    assert "hunter2" not in str(info.value)


def test_url_database_number_is_used(own_redis):
    client = forkq.Client(own_redis.url.rsplit("/", 1)[0] + "/3")
    client.push("X", [1])
    db0, db3 = own_redis.client(), redis.Redis(host="127.0.0.1", port=own_redis.port, db=3)
    try:
        assert db0.dbsize() == 0
        assert [j["class"] for j in _queue(db3)] == ["X"]
    finally:
        db0.close()
        db3.close()


def test_unix_socket_url():
    with UnixSocketRedis() as server:
        client = forkq.Client(server.unix_url)
        jid = core_jobs.record.options(client=client).enqueue("via socket")
        conn = server.client()
        try:
            (job,) = _queue(conn)
        finally:
            conn.close()
        assert job["jid"] == jid and job["args"] == ["via socket"]
        # the worker connects with TCP keepalive: a unix socket URL must still work
        conn = forkq.client.connect(server.unix_url, socket_keepalive=True, socket_timeout=5)
        try:
            assert conn.llen("queue:default") == 1
        finally:
            conn.close()


def _two_queues(n):
    return [{"class": "X", "args": [n], "jid": f"{q}{n}", "queue": q} for q in ("a", "b")]


@pytest.mark.timeout(20)
def test_a_push_whose_reply_is_lost_says_it_may_be_in_and_is_never_sent_twice(own_redis):
    """A reply lost after the commands ran: the push is in Redis once, and the error says
    it may be there, whether it went to several queues or to the schedule. Saying "not
    pushed" invites the caller to push it again."""
    admin = own_redis.client()
    for marker, push, stored in (
        (b"LPUSH", lambda c, n: c.push_jobs(_two_queues(n)),
         lambda: (admin.llen("queue:a"), admin.llen("queue:b"))),
        (b"ZADD", lambda c, n: c.push("X", [n], at=time.time() + 3600),
         lambda: (admin.zcard("schedule"),)),
    ):
        cutter = CommandCutter(own_redis.port, marker)
        client = forkq.Client(f"redis://127.0.0.1:{cutter.port}/0")
        try:
            with pytest.raises(forkq.RedisUnavailable) as info:
                push(client, 1)
            assert cutter.cut.is_set()
            assert info.value.maybe_pushed and "may or may not have been pushed" in str(info.value)
            assert set(stored()) == {1}
            push(client, 2)  # the client carries on, on a new connection
            assert set(stored()) == {2}
        finally:
            cutter.close()
    admin.close()


@pytest.mark.parametrize("error", [
    forkq.errors.ResultNotReady("nothing kept by the deadline", "j1"),
    forkq.errors.JobFailed("j1", "dead", "ValueError", "bad row"),
    forkq.errors.UnstorableResult("not JSON", "j2"),
    forkq.errors.RedisUnavailable("down", maybe_pushed=True),
    forkq.errors.PartialEnqueue(["a"], ["b"], 2, 5, RuntimeError("cut")),
    forkq.errors.OverLimit("full", "stripe"),
], ids=lambda e: type(e).__name__)
def test_forkq_errors_cross_processes_whole(error):
    # raised in a process pool's worker (or sent through a multiprocessing queue), an error
    # is pickled; rebuilt by calling __init__ with the message alone, it raised TypeError
    # there and the pool came back broken
    import pickle
    back = pickle.loads(pickle.dumps(error))
    assert (type(back), str(back), back.__dict__) == (type(error), str(error), error.__dict__)
