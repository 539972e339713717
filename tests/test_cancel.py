"""`forkq job` / `forkq cancel` (forkq.cancel): finding a job by jid and cancelling it.

The worker's side (a running job interrupted at its heartbeat) is played by hand here: a
heartbeat hash and a running-jobs hash written as a forkq process writes them, and the
request deleted with the dead-set write as the worker does. Real Redis throughout."""

from __future__ import annotations

import json
import threading
import time

import pytest

import forkq
from forkq import api, cancel, keys, scripts
from forkq.cli import main
from helpers import wait_until
from corekit import core_jobs, forkq_client, wait_records, workers  # noqa: F401 (fixtures)

IDENTITY = "host-1:4242:abcdef"


def _job(jid: str, queue: str = "a", **extra) -> dict:
    return {"class": "app.Thing", "args": [1, "x"], "jid": jid, "queue": queue, "retry": True,
            "created_at": 1700000000.0, "enqueued_at": 1700000000.5, **extra}


def _dead(r) -> list[dict]:
    return [json.loads(raw) for raw in r.zrange(keys.DEAD, 0, -1)]


def _beat(r, identity: str = IDENTITY, running: dict | None = None, beat: float = 100.0,
          forkq_process: bool = True) -> None:
    """A heartbeat and running-jobs hash as a live process writes them (launcher.beat)."""
    pipe = r.pipeline(transaction=True)
    pipe.sadd(keys.PROCESSES, identity)
    info = {"hostname": "host-1", "pid": 4242, "queues": ["a"]}
    fields = {"busy": 1 if running else 0, "beat": beat, "quiet": "false"}
    if forkq_process:
        info["forkq_cancel"] = True
        fields["forkq_paused"] = "[]"
    fields["info"] = json.dumps(info)
    pipe.hset(identity, mapping=fields)
    pipe.delete(keys.work(identity))
    if running:
        pipe.hset(keys.work(identity), "0", json.dumps(
            {"queue": running["queue"], "payload": json.dumps(running), "run_at": 1700000100}))
    pipe.execute()


def _polls(r) -> int:
    """How many polls a waiting cancel made (each begins with an HEXISTS of the request)."""
    return int(r.info("commandstats").get("cmdstat_hexists", {}).get("calls", 0))


def _in_thread(fn, *args, **kwargs) -> tuple[threading.Thread, list]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn(*args, **kwargs)), daemon=True)
    t.start()
    return t, out


# -- waiting jobs -------------------------------------------------------------------------


@pytest.mark.timeout(20)
def test_a_queued_unique_job_goes_to_dead_its_lock_released_and_its_request_deleted(r, redis_url):
    c = forkq.Client(redis_url)
    other = c.push("app.Thing", [0], queue="a")
    jid = c.push("app.Thing", [1], queue="a", unique_for=60)
    c.push("app.Thing", [2], queue="a")
    (lock,) = [k for k in r.keys("*") if b"unique" in k]
    where = api.locate(r, jid)
    assert (where.state, where.queue, where.position) == ("queued", "a", 1)
    out = api.cancel(r, jid, reason="bad input", by="ops@box")
    assert (out.state, out.where.state) == ("removed", "queued")
    (dead,) = _dead(r)
    assert dead["jid"] == jid and dead["error_class"] == "forkq.JobCancelled"
    assert dead["error_message"] == "cancelled by ops@box: bad input" and dead["failed_at"] > 0
    assert r.llen("queue:a") == 2 and json.loads(r.lindex("queue:a", -1))["jid"] == other
    assert not r.exists(lock)  # released: the same job can be pushed again
    assert r.hlen(keys.CANCEL) == 0


@pytest.mark.timeout(20)
def test_a_queued_batch_job_is_counted_failed_and_its_kept_result_says_cancelled(r, redis_url):
    c = forkq.Client(redis_url)
    with forkq.Batch(client=c) as batch:
        jid = c.push("app.Thing", [1], queue="a", keep_result=60)
    assert api.cancel(r, jid, by="me").state == "removed"
    status = forkq.batch_status(batch.bid)
    assert status.failures[jid]["error_class"] == "forkq.JobCancelled"
    assert status.complete  # its only job has ended: the batch completed
    with pytest.raises(forkq.JobFailed, match="JobCancelled"):
        forkq.result(jid, client=c)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("where", ["schedule", "retry", "suspect"])
def test_a_scheduled_retrying_or_suspect_job_goes_to_dead(r, redis_url, where):
    jid = "%024x" % 7
    job = _job(jid, retry_count=2, error_class="E", error_message="m") if where == "retry" else _job(jid)
    r.sadd(keys.QUEUES, "a")
    if where == "suspect":
        r.lpush(keys.suspects("a"), json.dumps(job))
    else:
        r.zadd(where, {json.dumps(job): time.time() + 600})
    located = api.locate(r, jid)
    assert located.state == {"schedule": "scheduled", "retry": "retry", "suspect": "suspect"}[where]
    if where == "retry":
        assert (located.retry_count, located.error) == (2, "E: m")
    out = api.cancel(r, jid, by="me")
    assert out.state == "removed"
    assert [d["error_message"] for d in _dead(r)] == ["cancelled by me"]
    assert r.zcard("schedule") + r.zcard("retry") + r.llen(keys.suspects("a")) == 0
    assert r.hlen(keys.CANCEL) == 0


@pytest.mark.timeout(20)
def test_an_entry_gone_before_the_move_writes_nothing_and_keeps_the_request(r, redis_url):
    jid = "%024x" % 8
    r.sadd(keys.QUEUES, "a")
    r.lpush("queue:a", json.dumps(_job(jid)))
    where = api.locate(r, jid)
    cancel.request(r, jid, None, "me")
    r.delete("queue:a")  # a worker claimed it meanwhile
    assert cancel.remove_waiting(r, where, "cancelled by me") is False
    assert r.zcard(keys.DEAD) == 0 and r.hexists(keys.CANCEL, jid)


@pytest.mark.timeout(20)
def test_not_found_and_dead_delete_the_request_and_say_so(r, redis_url):
    started = time.monotonic()
    out = api.cancel(r, "nothing-here")
    assert out.state == "not_found" and out.where.state == "not_found"
    assert 0.9 < time.monotonic() - started < 5  # looked again for about a second
    jid = "%024x" % 9
    r.zadd(keys.DEAD, {json.dumps(_job(jid, error_class="E", error_message="boom")): 1700000000})
    out = api.cancel(r, jid)
    assert (out.state, out.where.state) == ("not_found", "dead") and "E: boom" in out.detail
    assert r.hlen(keys.CANCEL) == 0 and r.zcard(keys.DEAD) == 1


@pytest.mark.timeout(20)
def test_locate_tells_each_place_apart(r, redis_url):
    r.sadd(keys.QUEUES, "a", "b")
    # another client's spacing, and a jid that only appears in another job's args
    r.lpush("queue:b", json.dumps({"class": "X", "args": ["j-queued"], "jid": "decoy"}))
    r.lpush("queue:b", json.dumps(_job("j-queued", "b"), separators=(", ", ": ")))
    assert api.locate(r, "j-queued").position == 1
    assert api.locate(r, "decoy").position == 0
    r.zadd(keys.SCHEDULE, {json.dumps(_job("j-sched")): 1800000000})
    assert (api.locate(r, "j-sched").state, api.locate(r, "j-sched").at) == ("scheduled", 1800000000)
    _beat(r, running=_job("j-run"))
    run = api.locate(r, "j-run")
    assert (run.state, run.identity, run.host, run.pid, run.forkq) == (
        "running", IDENTITY, "host-1", 4242, True)
    assert run.at == 1700000100 and "host-1 pid 4242" in run.describe()
    r.hset(keys.OWNERS, "host-2:1:x", "{}")
    r.hset(keys.inflight("host-2:1:x"), "tok", "a\n" + json.dumps(_job("j-claimed")))
    assert (api.locate(r, "j-claimed").state, api.locate(r, "j-claimed").identity) == ("claimed", "host-2:1:x")
    r.rpush(keys.result("j-done"), json.dumps({"value": 3}))
    assert api.locate(r, "j-done").state == "finished"
    assert api.locate(r, "nowhere").state == "not_found"
    with pytest.raises(ValueError):
        api.locate(r, 'a"b')


@pytest.mark.timeout(60)
def test_a_job_in_a_200000_job_queue_is_located_and_cancelled_server_side(r, redis_url):
    r.sadd(keys.QUEUES, "big")
    pipe = r.pipeline(transaction=False)
    for i in range(200_000):
        pipe.lpush("queue:big", '{"class":"X","args":[%d],"jid":"%024x","queue":"big"}' % (i, i))
        if i % 20_000 == 0:
            pipe.execute()
    pipe.execute()
    last = "%024x" % 0  # pushed first: next to run, at the far end of the scan
    started = time.perf_counter()
    where = api.locate(r, last)
    located = time.perf_counter() - started
    assert (where.state, where.position) == ("queued", 0)
    out = api.cancel(r, last, wait=0)
    elapsed = time.perf_counter() - started
    assert out.state == "removed" and r.llen("queue:big") == 199_999
    print(f"200,000-job queue: located in {located:.3f} s, located and cancelled in {elapsed:.3f} s")


@pytest.mark.timeout(20)
def test_requests_older_than_a_day_are_pruned_as_new_ones_are_written(r, redis_url):
    old = json.dumps({"at": time.time() - 2 * 86400, "by": None, "reason": None})
    r.hset(keys.CANCEL, mapping={f"old{i}": old for i in range(5)})
    r.hset(keys.CANCEL, "handwritten", "not json")
    wrote, standing = cancel.request(r, "new", "why", "me")
    assert wrote and standing["reason"] == "why"
    assert sorted(r.hkeys(keys.CANCEL)) == [b"handwritten", b"new"]
    # the first request's by and reason stand
    assert cancel.request(r, "new", "other", "you") == (False, standing)


# -- running jobs: the worker's part played by hand ---------------------------------------


@pytest.mark.timeout(20)
def test_a_running_job_is_cancelled_once_its_worker_deletes_the_request(r, redis_url):
    jid = "%024x" % 11
    _beat(r, running=_job(jid))
    before = _polls(r)
    t, out = _in_thread(api.cancel, r, jid, reason="why", by="me", wait=10, poll=0.02)
    wait_until(lambda: _polls(r) > before + 2, message="the cancel polls")
    assert r.hexists(keys.CANCEL, jid) and t.is_alive()
    # the worker: its heartbeat read the request, the job was interrupted, and one MULTI
    # writes it to dead and deletes the request
    pipe = r.pipeline(transaction=True)
    pipe.zadd(keys.DEAD, {json.dumps(_job(jid, error_class="forkq.JobCancelled",
                                          error_message="cancelled by me: why")): time.time()})
    pipe.hdel(keys.CANCEL, jid)
    pipe.execute()
    t.join(5)
    (outcome,) = out
    assert (outcome.state, outcome.where.state) == ("cancelled", "running")


@pytest.mark.timeout(20)
def test_a_running_job_that_ends_by_itself_is_finished_after_two_beats_without_it(r, redis_url):
    jid = "%024x" % 12
    _beat(r, running=_job(jid), beat=100.0)
    before = _polls(r)
    t, out = _in_thread(api.cancel, r, jid, wait=10, poll=0.02)
    wait_until(lambda: _polls(r) > before + 2, message="the cancel polls")
    _beat(r, beat=100.0)  # gone from its running jobs, no beat since: not enough
    for beat in (101.0, 102.0):
        now = _polls(r)
        wait_until(lambda: _polls(r) > now + 2, message="the cancel polls")
        assert t.is_alive() and r.hexists(keys.CANCEL, jid)
        _beat(r, beat=beat)
    t.join(5)
    (outcome,) = out
    assert outcome.state == "finished" and not r.hexists(keys.CANCEL, jid)


@pytest.mark.timeout(20)
def test_a_job_running_on_sidekiq_is_not_forkq_and_a_timeout_is_pending(r, redis_url):
    _beat(r, "ruby:1:x", running=_job("on-ruby"), forkq_process=False)
    out = api.cancel(r, "on-ruby", wait=5)
    assert (out.state, out.where.forkq) == ("not_forkq", False)
    assert out.detail.count("not forkq") == 0 and "does not read cancel requests" in out.detail
    assert "(not forkq: " in out.where.describe()  # as `forkq job` says it
    assert not r.hexists(keys.CANCEL, "on-ruby")
    _beat(r, running=_job("slow"))
    out = api.cancel(r, "slow", wait=0.2, poll=0.05)
    assert out.state == "pending" and "request stays" in out.detail
    assert r.hexists(keys.CANCEL, "slow")  # left for the worker
    # held in flight by a process that died (no heartbeat): waited for, not spun on, until
    # orphan recovery puts it back where the next cancel, or its next worker, finds it
    r.hset(keys.OWNERS, "gone:1:x", "{}")
    r.hset(keys.inflight("gone:1:x"), "tok", "a\n" + json.dumps(_job("orphan")))
    before = _polls(r)
    out = api.cancel(r, "orphan", wait=0.3, poll=0.05)
    assert (out.state, out.where.state) == ("pending", "claimed") and _polls(r) - before < 20


# -- the commands -------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_job_and_cancel_commands_exit_codes_and_one_line_errors(r, redis_url, capsys):
    jid = forkq.Client(redis_url).push("app.Thing", [1], queue="a")
    assert main(["job", jid]) == 0
    assert capsys.readouterr().out == f"{jid}: waiting on queue a, position 0 (0 runs next)\n"
    assert main(["job", "nowhere"]) == 1
    assert main(["job", jid, "--json"]) == 0
    assert json.loads(capsys.readouterr().out.split("\n", 1)[1])["state"] == "queued"
    assert main(["cancel", jid, "--reason", "oops", "--json"]) == 0
    (printed,) = json.loads(capsys.readouterr().out)
    assert printed["state"] == "removed" and "oops" in _dead(r)[0]["error_message"]
    assert main(["cancel", jid, "nowhere", "--wait", "0"]) == 1  # dead already, and not found
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(": ")[1] for line in lines] == ["not found", "not found"] and "dead" in lines[0]
    assert main(["cancel", 'bad"jid']) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "not a jid" in captured.err
    assert main(["cancel", "x", "--redis-url", "redis://127.0.0.1:1/0"]) == 1
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err


# -- the dashboard ------------------------------------------------------------------------

from test_web import browser, web  # noqa: E402,F401  (fixtures: one `forkq web` for this module)


@pytest.mark.timeout(30)
def test_dashboard_cancel_buttons_and_the_job_page(browser, r, redis_url):
    import re
    c = forkq.Client(redis_url)
    queued = c.push("app.Thing", [1], queue="a")
    scheduled = c.push("app.Thing", [2], queue="a", at=time.time() + 600)
    _beat(r, running=_job("j-run"))
    page = browser.get("/queues/a")
    assert f'name="jid" value="{queued}" formaction="/cancel"' in page.text
    assert browser.post("/cancel", {"jid": queued}, csrf="").status == 403  # no token: nothing
    assert r.llen("queue:a") == 1
    resp = browser.post("/cancel", {"jid": queued, "back": "/queues/a"}, csrf=page.csrf)
    assert resp.status == 303 and resp.headers["Location"] == "/queues/a"
    assert r.llen("queue:a") == 0 and _dead(r)[0]["error_message"].startswith("cancelled by dashboard")
    assert "removed" in browser.get("/queues/a").text  # the flash
    lookup = browser.get(f"/jobs/{queued}")
    assert lookup.status == 200 and "in the dead set" in lookup.text and ">Cancel<" not in lookup.text
    sched = browser.get("/scheduled")
    assert f'name="jid" value="{scheduled}"' in sched.text
    browser.post("/cancel", {"jid": scheduled}, csrf=sched.csrf)
    assert r.zcard(keys.SCHEDULE) == 0 and r.zcard(keys.DEAD) == 2
    busy = browser.get("/busy")
    assert 'name="jid" value="j-run"' in busy.text
    resp = browser.post("/cancel", {"jid": "j-run", "back": "/busy"}, csrf=busy.csrf)
    assert resp.status == 303 and r.hexists(keys.CANCEL, "j-run")  # left for the worker
    assert "next heartbeat" in browser.get("/busy").text
    running = browser.get("/jobs/j-run")
    assert "running on host-1 pid 4242" in running.text and re.search(r">\s*Cancel\s*<", running.text)


@pytest.mark.timeout(20)
def test_a_queue_of_large_payloads_is_scanned_in_calls_bounded_by_bytes(r, redis_url):
    pipe = r.pipeline(transaction=False)
    for i in range(2_000):
        pipe.lpush("queue:fat", json.dumps(_job("%024x" % i, "fat", blob="x" * 1000)))
    pipe.execute()
    calls = lambda: int(r.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))  # noqa: E731
    before = calls()
    index, length, raw = cancel.scan_list(r, "queue:fat", "%024x" % 0, budget=100_000)
    assert (index, length, json.loads(raw)["jid"]) == (1_999, 2_000, "%024x" % 0)
    # a slice of 500 entries (~0.5 MB) passes the budget: four calls, not one
    assert calls() - before == 4


@pytest.mark.timeout(20)
def test_the_sorted_sets_are_searched_in_redis_from_the_top_while_their_low_end_drains(r):
    pipe = r.pipeline(transaction=False)
    for i in range(3_000):
        pipe.zadd(keys.SCHEDULE, {json.dumps(_job("%024x" % i)): 1_000 + i})
    pipe.execute()
    target = "%024x" % 10  # near the low end, the first to fall due
    calls = lambda: int(r.info("commandstats").get("cmdstat_zrange", {}).get("calls", 0))  # noqa: E731
    before = calls()
    where = cancel.locate(r, target)
    assert (where.state, where.jid, where.at) == ("scheduled", target, 1_010.0)
    assert calls() == before  # no page of the set came to the client (api.SortedSet.find)
    # entries leaving the low end between two calls of the scan do not hide one above them
    hit = cancel._scan(r, "zset", keys.SCHEDULE, target, chunk=1_000)
    assert hit is not None
    first = cancel._scan(r, "zset", keys.SCHEDULE, "%024x" % 99_999, chunk=1_000)
    assert first is None
    find = scripts.load(r, "find_jid")
    found, start, size = find(keys=[keys.SCHEDULE], args=["zset", target, 0, 1_000, 1 << 30])
    assert (found, start, size) == (-1, 1_000, 3_000)
    r.zremrangebyrank(keys.SCHEDULE, 0, 4)  # five fall due and leave
    found, _, _, raw, score = find(keys=[keys.SCHEDULE], args=["zset", target, start, 5_000, 1 << 30])
    assert json.loads(raw)["jid"] == target and float(score) == 1_010.0


@pytest.mark.timeout(40)
def test_forkq_cancel_stops_jobs_running_on_a_real_worker_at_one_heartbeat(workers, forkq_client, r,
                                                                           redis_url, capsys):
    """Both sides for real: `forkq cancel` writes the requests and waits; a `forkq start`
    worker's heartbeat interrupts the jobs and writes them to dead; the command says so.
    Two jobs named at once are stopped at the same beat, not one beat after another."""
    worker = workers(concurrency=2, extra_args=["--heartbeat-interval", "2"])
    jids = [core_jobs.spin_forever.enqueue(tag) for tag in ("e2e-1", "e2e-2")]
    wait_records(r, 2, worker, kind="start")
    assert cancel.locate(r, jids[0]).state in ("claimed", "running")  # "running" from its next beat
    capsys.readouterr()
    assert main(["cancel", *jids, "--reason", "runaway", "--wait", "20", "--redis-url", redis_url]) == 0
    out = capsys.readouterr().out
    assert out.count(": cancelled: ") == 2 and all(jid in out for jid in jids), out
    dead = {entry["jid"]: entry for entry in _dead(r)}
    assert set(dead) == set(jids) and not r.hexists(keys.CANCEL, jids[0])
    for entry in dead.values():
        assert entry["error_class"] == "forkq.JobCancelled"
        assert entry["error_message"].endswith(": runaway")
    # both requests were there for the same heartbeat (2 s apart from the next one)
    assert abs(dead[jids[0]]["failed_at"] - dead[jids[1]]["failed_at"]) < 1.0
    assert cancel.locate(r, jids[1]).state == "dead"
    core_jobs.record.enqueue("after")  # the worker goes on
    wait_records(r, 1, worker, kind="record")
