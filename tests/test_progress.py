"""forkq.progress(): a running job's progress, kept in its processor's memory and written by
the heartbeat into the job's work entry ("forkq_progress"), read back by api.running(),
api.locate(), `forkq busy`, `forkq job` and the dashboard, and ignored by Ruby Sidekiq.

The worker tests run a real Manager and a Launcher beating every 0.1 s in this process,
against the shared Redis (as tests/test_cancel_worker.py does)."""

from __future__ import annotations

import asyncio
import fractions
import json
import math
import subprocess
import threading
import time
import types
import wsgiref.util

import pytest

import forkq
from forkq import api, hooks, jobprogress, keys, logs, testing
from forkq.jobprogress import Progress
from forkq.launcher import _work_entry
from forkq.manager import Manager
from helpers import InProcessWorkers, wait_beats, wait_until

QUEUE = "pq"
IDENTITY = "test:1:progress000a"
BEAT_S = 0.1

step = threading.Event()  # the job waits for it between its two reports
release = threading.Event()
reported: list[str] = []


@forkq.job(queue=QUEUE, name="pg.importer")
def importer(rows: int) -> None:
    forkq.progress(rows * 3 // 5, rows, "importing")
    reported.append("first")
    step.wait(10)
    forkq.progress(rows, rows, "done <soon>")
    reported.append("second")
    release.wait(10)


@forkq.job(queue=QUEUE, name="pg.silent")
def silent() -> None:
    reported.append("silent")
    release.wait(10)


@forkq.job(queue=QUEUE, name="pg.encoder")
async def encoder(frames: int) -> None:
    forkq.progress(frames / 4, frames, "encoding")
    reported.append("async")
    while not release.is_set():
        await asyncio.sleep(0.01)


@forkq.job(queue=QUEUE, name="pg.threaded")
def threaded() -> None:
    """Calls progress from a thread it started, which is in no job."""
    def worker() -> None:
        try:
            forkq.progress(1)
        except RuntimeError as exc:
            reported.append(str(exc))
    t = threading.Thread(target=worker)
    t.start()
    t.join()


@forkq.job(queue=QUEUE, name="pg.reporter")
def reporter(n: int) -> None:
    for i in range(n):
        forkq.progress(i + 1, n, "step")
    reported.append(f"reported {n}")


@pytest.fixture
def running(redis_url, monkeypatch):
    """start(concurrency) -> manager: a Manager and its Launcher, beating every BEAT_S s."""
    step.clear()
    release.clear()
    reported.clear()
    monkeypatch.setattr(hooks, "SERVER_MIDDLEWARE", [])
    forkq.configure(redis_url)
    workers = InProcessWorkers(redis_url, IDENTITY, QUEUE, BEAT_S)

    def start(concurrency: int = 1) -> Manager:
        return workers.start(concurrency)[0]

    try:
        yield start
    finally:
        step.set()
        release.set()
        workers.close()


def work_entries(r) -> list[dict]:
    return [json.loads(v) for v in r.hvals(keys.workers(IDENTITY))]


def shown_progress(r, jid: str):
    """The forkq_progress of `jid`'s work entry, once the heartbeat shows one."""
    for entry in work_entries(r):
        if json.loads(entry["payload"])["jid"] == jid and "forkq_progress" in entry:
            return entry["forkq_progress"]
    return None


@pytest.mark.timeout(20)
def test_progress_shows_in_the_work_entry_within_a_beat_and_everywhere_it_is_read(running, r, capsys):
    running(concurrency=1)
    before = time.time()
    jid = importer.enqueue(2000)
    wait_until(lambda: reported == ["first"], timeout=5, message="the job's first report")
    shown = wait_until(lambda: shown_progress(r, jid), timeout=2, message="progress in the work hash")
    assert shown["done"] == 1200 and shown["total"] == 2000 and shown["note"] == "importing"
    assert before <= shown["at"] <= time.time()
    # Sidekiq's own keys stay as they were, in both names of the hash
    (entry,) = work_entries(r)
    assert set(entry) == {"queue", "payload", "run_at", "forkq_progress"} and entry["queue"] == QUEUE
    assert r.hvals(keys.work(IDENTITY)) == r.hvals(keys.workers(IDENTITY))

    (job,) = api.running(r)
    assert job.progress == Progress(1200, 2000, "importing", shown["at"])
    where = api.locate(r, jid)
    assert where.state == "running" and where.progress == job.progress
    assert ", at 1,200/2,000 (60%) importing" in where.describe()
    assert where.to_dict()["progress"]["percent"] == 60

    from forkq import cli
    capsys.readouterr()
    assert cli.main(["busy"]) == 0
    # among the worker's log lines, on the same stdout
    header, row = [line for line in capsys.readouterr().out.splitlines()
                   if line.startswith(("process ", IDENTITY))]
    assert header.split()[:6] == ["process", "queue", "jid", "class", "running", "progress"]
    assert "1,200/2,000 (60%) importing" in row
    assert cli.main(["busy", "--json"]) == 0
    out = capsys.readouterr().out
    (data,) = json.loads(out[out.index("[\n"):])
    assert data["progress"]["description"] == "1,200/2,000 (60%) importing"
    assert cli.main(["job", jid]) == 0
    assert "at 1,200/2,000 (60%) importing" in capsys.readouterr().out

    # the latest call wins, at the next beat
    step.set()
    wait_until(lambda: (shown_progress(r, jid) or {}).get("done") == 2000, timeout=2,
               message="the second report shown")
    assert api.running(r)[0].progress.describe() == "2,000/2,000 (100%) done <soon>"

    # its end drops it; the thread's next job, which reports nothing, shows none
    release.set()
    wait_until(lambda: not r.exists(keys.workers(IDENTITY)), timeout=5, message="the job's entry gone")
    release.clear()
    sjid = silent.enqueue()
    wait_until(lambda: "silent" in reported, timeout=5, message="the silent job started")
    (entry,) = wait_until(lambda: work_entries(r), timeout=2, message="the silent job shown")
    assert json.loads(entry["payload"])["jid"] == sjid
    wait_beats(r, IDENTITY)  # beats that must not show the last job's progress on this one
    (entry,) = work_entries(r)
    assert "forkq_progress" not in entry and api.running(r)[0].progress is None


@pytest.mark.timeout(20)
def test_an_async_job_reports_progress_from_its_coroutine(running, r):
    running(concurrency=1)
    jid = encoder.enqueue(30)
    shown = wait_until(lambda: shown_progress(r, jid), timeout=5, message="progress in the work hash")
    assert (shown["done"], shown["total"], shown["note"]) == (7.5, 30, "encoding")
    assert api.running(r)[0].progress.describe() == "7.5/30 (25%) encoding"


@pytest.fixture
def no_middleware(monkeypatch):
    """Without what other modules register (corekit's core_jobs records each payload in
    Redis): these jobs run under forkq.testing, with no Redis."""
    monkeypatch.setattr(hooks, "SERVER_MIDDLEWARE", [])


def test_outside_a_job_and_in_a_thread_the_job_started_it_raises_runtime_error(no_middleware):
    reported.clear()
    with pytest.raises(RuntimeError, match="outside a running job"):
        forkq.progress(1, 2)
    with testing.inline():
        threaded.enqueue()
    assert len(reported) == 1 and "a thread the job started is in no job" in reported[0]


def _recorded(*args, **kwargs):
    """What progress() records on its processor, called as if inside a job."""
    owner = types.SimpleNamespace(progress=None)
    logs.set_job("jid-1", "X", "q", {"jid": "jid-1"}, owner)
    try:
        forkq.progress(*args, **kwargs)
    finally:
        logs.clear_job()
    return owner.progress


def test_arguments_are_checked_and_a_note_is_cut():
    assert _recorded(5)[:4] == ("jid-1", 5, None, None)
    assert _recorded(0.5, 1, note="x" * 500)[3] == "x" * jobprogress.NOTE_LIMIT
    # other numbers (numpy's float64 is a float subclass, its int64 a numbers.Integral)
    # become plain ones JSON can write
    class Int(int):
        pass

    class Float(float):
        pass
    plain = _recorded(Int(3), Float(4.5))
    assert plain[1:3] == (3, 4.5) and type(plain[1]) is int and type(plain[2]) is float
    assert _recorded(fractions.Fraction(1, 2))[1] == 0.5
    # a huge int as a float: the heartbeat's JSON could not write one of 5,000 digits
    assert _recorded(2**70, 10**300)[1:3] == (float(2**70), 1e300)
    bad = [((True,), TypeError, "done must be a number, not bool"),
           (("5",), TypeError, "done must be a number, not str"),
           ((None,), TypeError, "done must be a number"),
           ((1, "2"), TypeError, "total must be a number"),
           ((math.nan,), ValueError, "done must be finite"),
           ((1, math.inf), ValueError, "total must be finite"),
           ((10**5000,), ValueError, "done must be finite"),
           ((Float("nan"),), ValueError, "done must be finite"),
           ((-1,), ValueError, "done must not be negative"),
           ((1, -0.5), ValueError, "total must not be negative"),
           ((1, 2, 3), TypeError, "note must be a str or None, not int")]
    for args, kind, text in bad:
        with pytest.raises(kind, match=text):
            _recorded(*args)


def test_under_testing_fake_and_inline_a_reporting_job_runs(no_middleware):
    reported.clear()
    with testing.inline():
        reporter.enqueue(3)
    with testing.fake() as jobs:
        reporter.enqueue(2)
        assert jobs.drain() == 1
    assert reported == ["reported 3", "reported 2"]


def test_an_apps_tests_read_what_a_job_reported_under_fake_and_inline(no_middleware):
    with testing.fake() as jobs:
        jid = reporter.enqueue(3)
        assert jobs.progress(jid) == []  # pushed, not run yet
        jobs.drain()
        assert jobs.progress(jid) == [(1, 3, "step"), (2, 3, "step"), (3, 3, "step")]
    with testing.inline():
        jid = reporter.enqueue(2)
        assert testing.progress(jid) == [(1, 2, "step"), (2, 2, "step")]
    with pytest.raises(RuntimeError, match="inside the mode"):
        testing.progress(jid)


def test_the_heartbeat_shows_a_progress_beside_the_job_that_recorded_it_only():
    cur = ("q", b'{"jid":"b"}', 1700000000.7, "b", "tok")
    assert "forkq_progress" not in json.loads(_work_entry(cur, ("a", 1, 2, None, 1.0)))
    entry = json.loads(_work_entry(cur, ("b", 1, 2, "caf\udce9", 1.5)))
    assert entry == {"queue": "q", "payload": '{"jid":"b"}', "run_at": 1700000000,
                     "forkq_progress": {"done": 1, "total": 2, "note": "caf?", "at": 1.5}}


def test_describe_and_read():
    assert Progress(1200, 2000, "importing", None).describe() == "1,200/2,000 (60%) importing"
    assert Progress(1200, None, "rows", None).describe() == "1,200 rows"
    assert Progress(0, 0, None, None).describe() == "0/0"
    assert Progress(999, 1000, None, None).describe() == "999/1,000 (99%)"  # floored, not 100%
    assert Progress(2.25, 3.0, None, None).describe() == "2.25/3 (75%)"
    assert Progress(2100, 2000, None, None).percent() == 105  # a total that was an estimate
    assert Progress.read({"done": 1, "total": 4, "note": "n", "at": 2.5}) == Progress(1, 4, "n", 2.5)
    for junk in (None, "x", [], {"done": "1"}, {"done": True}, {"done": 1, "total": "4"},
                 {"done": -1}):
        assert Progress.read(junk) is None
    assert Progress.read({"done": 1, "note": 5, "at": "x"}) == Progress(1, None, None, None)
    # valid JSON past a float's range: read, and a percent only where it fits one
    huge = Progress.read({"done": 10**400, "total": 10**401})
    assert huge is not None and huge.percent() == 10 and huge.describe().startswith("10,000,")
    assert Progress.read({"done": 10**400, "total": 1}).percent() is None
    assert Progress(1.5e308, 1e-300, None, None).percent() is None


def _get(app, path: str) -> tuple[str, str]:
    environ: dict = {"PATH_INFO": path, "REQUEST_METHOD": "GET"}
    wsgiref.util.setup_testing_defaults(environ)
    status: list[str] = []
    body = b"".join(app(environ, lambda s, h: status.append(s)))
    return status[0], body.decode()


def _fake_process(r, progress: dict | None) -> str:
    """A live process's heartbeat and one running job, as a forkq worker writes them."""
    identity = "web-test:1:abcabcabcabc"
    info = {"hostname": "web-test", "pid": 4242, "queues": ["default"], "concurrency": 5,
            "identity": identity, "started_at": time.time()}
    r.sadd("processes", identity)
    r.hset(identity, mapping={"info": json.dumps(info), "busy": 1, "beat": time.time(),
                              "quiet": "false", "rss": 20480})
    jid = "e" * 24
    work = {"queue": "default", "run_at": int(time.time()) - 5,
            "payload": json.dumps({"class": "SlowImport", "args": [1], "jid": jid, "queue": "default",
                                   "retry": True, "created_at": time.time(), "enqueued_at": time.time()})}
    if progress is not None:
        work["forkq_progress"] = progress
    r.hset(keys.workers(identity), "tid1", json.dumps(work))
    return jid


@pytest.mark.timeout(30)
def test_the_dashboard_shows_progress_on_busy_and_the_job_page(redis_url, r):
    from forkq.web.app import Dashboard
    jid = _fake_process(r, {"done": 1200, "total": 2000, "note": "<b>importing</b>", "at": time.time()})
    app = Dashboard(redis_url)
    status, page = _get(app, "/busy")
    assert status.startswith("200"), page
    assert '<progress max="100" value="60">' in page
    assert "1,200/2,000 (60%) &lt;b&gt;importing&lt;/b&gt;" in page and "<b>importing" not in page
    status, page = _get(app, f"/jobs/{jid}")
    assert status.startswith("200") and "at 1,200/2,000 (60%) &lt;b&gt;importing" in page
    _fake_process(r, None)  # the same job, with no progress: a dash, no bar
    status, page = _get(app, "/busy")
    assert status.startswith("200") and "<progress" not in page and "SlowImport" in page


@pytest.mark.timeout(60)
def test_ruby_sidekiq_reads_a_work_entry_with_progress_and_renders_its_busy_page(sidekiq_ruby, redis_url, r):
    _fake_process(r, {"done": 1200, "total": 2000, "note": "importing", "at": time.time()})
    script = """
        require "sidekiq/web"; require "rack/mock"
        Sidekiq::Workers.new.each { |_p, _t, work| puts work["payload"]["class"], work["queue"] }
        res = Rack::MockRequest.new(Sidekiq::Web.new).get("/busy", "rack.session" => {})
        abort("status #{res.status}") unless res.status == 200
        puts res.body.include?("SlowImport")"""
    out = subprocess.run([sidekiq_ruby.ruby, "-e", 'require "sidekiq"; require "sidekiq/api"; ' + script],
                         env=sidekiq_ruby._env(redis_url), capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["SlowImport", "default", "true"]
