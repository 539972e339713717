"""Per-class job metrics in Redis (jobmetrics.py): counted per processor thread, flushed
with the heartbeat in Sidekiq 7's keys, read by api.job_metrics, `forkq metrics` and the
dashboard."""

from __future__ import annotations

import json
import re
import signal
from datetime import datetime, timedelta, timezone

import pytest

import forkq
from forkq import api, cli, hooks, jobmetrics, keys
from forkq.jobmetrics import ClassTable, Flusher, histogram_key, minute_key
from helpers import InProcessWorkers, wait_until

QUEUE = "jmq"
IDENTITY = "test:1:jobmetrics0a"
BEAT_S = 0.1


@forkq.job(queue=QUEUE, name="jm.Fast")
def fast() -> None:
    pass


@forkq.job(queue=QUEUE, name="jm.Flaky", retry=False)
def flaky(fail: bool) -> None:
    if fail:
        raise ValueError("flaky failed")


@pytest.fixture
def running(redis_url, monkeypatch):
    """start(concurrency) -> (manager, launcher), beating every BEAT_S s."""
    monkeypatch.setattr(hooks, "SERVER_MIDDLEWARE", [])
    forkq.configure(redis_url)
    workers = InProcessWorkers(redis_url, IDENTITY, QUEUE, BEAT_S)
    try:
        yield workers.start
    finally:
        workers.close()


def _classes(conn, **kw) -> dict[str, dict]:
    return {c["class"]: c for c in api.job_metrics(conn, **kw)["classes"]}


def _flush(flusher: Flusher, r, at: datetime) -> None:
    pipe = r.pipeline(transaction=True)
    n = flusher.add(pipe, at)
    flusher.done(pipe.execute()[:n])


def _minutes_now() -> list[datetime]:
    """This UTC minute and the one before: a beat may land on either side of a boundary."""
    now = datetime.now(timezone.utc)
    return [now, now - timedelta(minutes=1)]


@pytest.mark.timeout(20)
def test_exact_counts_per_class_in_the_api_and_the_cli_after_a_beat(running, r, capsys):
    running(2)
    for _ in range(3):
        fast.enqueue()
    for fail in (True, True, False):
        flaky.enqueue(fail)

    def counted():
        got = _classes(r)
        return ({k: (c["processed"], c["failed"]) for k, c in got.items()}
                == {"jm.Fast": (3, 0), "jm.Flaky": (3, 2)})
    wait_until(counted, timeout=10, message="3 Fast and 3 Flaky (2 failed) in the metrics")
    got = _classes(r)
    assert got["jm.Flaky"]["failure_pct"] == pytest.approx(66.7)
    # Sidekiq's histogram counts successful jobs only: these no-op jobs are all under 20 ms
    assert got["jm.Fast"]["histogram"][0] == 3 and got["jm.Flaky"]["histogram"][0] == 1
    assert got["jm.Fast"]["p50_ms"] == got["jm.Fast"]["p95_ms"] == 20
    assert sum(got["jm.Fast"]["series"]["processed"]) == 3
    assert _classes(r, klass="jm.Flaky").keys() == {"jm.Flaky"}

    capsys.readouterr()
    assert cli.main(["metrics", "--json", "--minutes", "5"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["minutes"] == 5 and len(data["buckets"]) == 5
    assert {c["class"]: c["processed"] for c in data["classes"]} == {"jm.Fast": 3, "jm.Flaky": 3}
    assert cli.main(["metrics", "--class", "jm.Flaky"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["class", "processed", "failed", "failed"]
    assert lines[1].split()[:4] == ["jm.Flaky", "3", "2", "66.7"]


def test_the_cli_table_right_aligns_every_number_column_as_the_readme_shows(r, redis_url, capsys):
    table = ClassTable()
    for _ in range(120):
        table.observe("app.jobs.Import", "q", 7.7, False)
    table.observe("app.jobs.Import", "q", 1.0, True)
    table.observe("app.jobs.Mailer", "q", 0.02, False)
    _flush(Flusher([table]), r, datetime.now(timezone.utc))
    capsys.readouterr()
    assert cli.main(["metrics"]) == 0
    header, *rows = capsys.readouterr().out.splitlines()[:3]
    # each column's cells end where its heading ends (formatted numbers and "<8500" too)
    ends = [m.end() for m in re.finditer(r"processed|failed %|failed(?! %)|total s|avg ms|p\d\d ms",
                                         header)]
    assert len(ends) == 7
    for row in rows:
        assert [m.end() for m in re.finditer(r"\S+", row)][1:] == ends, (header, row)


@pytest.mark.timeout(20)
def test_keys_are_sidekiq_7s_per_utc_minute_and_expire(running, r):
    running(1)
    fast.enqueue()
    wait_until(lambda: _classes(r).get("jm.Fast"), timeout=10, message="Fast in the metrics")
    hashes = [minute_key(t) for t in _minutes_now()]
    found = [k for k in hashes if r.hget(k, "jm.Fast|p") == b"1"]
    assert len(found) == 1, hashes
    at = _minutes_now()[hashes.index(found[0])]
    assert found[0] == f"j|{at:%Y%m%d}|{at.hour}:{at.minute}"  # UTC, hour and minute unpadded
    assert r.hexists(found[0], "jm.Fast|ms") and not r.hexists(found[0], "jm.Fast|f")
    assert 0 < r.ttl(found[0]) <= 8 * 3600
    hist = histogram_key("jm.Fast", at)
    assert hist == f"jm.Fast-{at:%d}-{at:%H}:{at.minute}"
    assert r.execute_command("BITFIELD_RO", hist, "GET", "u16", "#0") == [1]
    assert 0 < r.ttl(hist) <= 8 * 3600


def test_minute_keys_are_utc_whatever_the_clock_zone():
    east = timezone(timedelta(hours=5, minutes=30))
    at = datetime(2026, 3, 1, 4, 5, 59, tzinfo=east)  # 22:35 UTC the day before
    assert minute_key(at) == "j|20260228|22:35"
    assert histogram_key("A", at) == "A-28-22:35"
    assert minute_key(datetime(2026, 3, 1, 8, 3, tzinfo=timezone.utc)) == "j|20260301|8:3"
    assert histogram_key("A", datetime(2026, 3, 1, 8, 3, tzinfo=timezone.utc)) == "A-01-08:3"


def test_buckets_and_sums_follow_sidekiqs_rules(r):
    table = ClassTable()
    for seconds, failed in ((0.0199, False), (0.020, False), (0.5, False), (400.0, False),
                            (9.0, True)):
        table.observe("K", "q", seconds, failed)
    at = datetime(2026, 3, 1, 8, 3, tzinfo=timezone.utc)
    flusher = Flusher([table])
    _flush(flusher, r, at)
    # a failure's time is left out of ms and of the histogram, as Sidekiq does
    assert r.hgetall("j|20260301|8:3") == {b"K|p": b"5", b"K|f": b"1", b"K|ms": b"400540"}
    got = r.execute_command("BITFIELD_RO", "K-01-08:3",
                            *[a for i in range(26) for a in ("GET", "u16", f"#{i}")])
    assert got[0] == 1 and got[1] == 1 and got[9] == 1 and got[25] == 1 and sum(got) == 4
    # a second flush with nothing new writes nothing; a new job only its delta
    assert flusher.add(r.pipeline(), at) == 0
    table.observe("K", "q", 0.001, False)
    _flush(flusher, r, at)
    assert r.hget("j|20260301|8:3", "K|p") == b"6"
    rows = api.job_metrics(r, minutes=3, now=at + timedelta(minutes=1, seconds=30))["classes"]
    assert rows[0]["series"]["processed"] == [0, 6, 0]  # 8:02, 8:03, 8:04: oldest first
    assert rows[0]["avg_ms"] == pytest.approx(400541 / 5, abs=0.1)
    assert rows[0]["p95_ms"] is None  # past the last bound (335 s): Sidekiq's "Slow"


@pytest.mark.timeout(20)
def test_a_refused_metrics_write_fails_nothing_else_in_the_beat(redis_url, r, monkeypatch):
    for at in _minutes_now() + [datetime.now(timezone.utc) + timedelta(minutes=1)]:
        r.set(minute_key(at), "not a hash")  # HINCRBY answers WRONGTYPE
    monkeypatch.setattr(hooks, "SERVER_MIDDLEWARE", [])
    forkq.configure(redis_url)
    workers = InProcessWorkers(redis_url, IDENTITY, QUEUE, beat_s=60)  # beats when told
    try:
        manager, launcher = workers.start(1)
        signals: list[int] = []
        launcher.on_signal = signals.append
        fast.enqueue()
        wait_until(lambda: manager.processors[0].processed == 1, timeout=10, message="the job run")
        # one beat carries the job's metrics, its stats and the signal: the refusal of the
        # first fails neither of the others
        r.rpush(keys.signals(IDENTITY), "TSTP")
        launcher.beat_soon()
        wait_until(lambda: signals == [signal.SIGTSTP], timeout=10, message="the signal acted on")
        assert r.get(keys.STAT_PROCESSED) == b"1"
        # dropped, not kept to grow: and a read skips the minutes it cannot read
        assert "jm.Fast" not in _classes(r)
    finally:
        workers.close()


def test_a_class_name_redis_cannot_carry_is_written_escaped(r):
    table = ClassTable()
    table.observe("bad\udc80name", "q", 0.001, False)
    table.observe("x" * 1000, "q", 0.001, False)
    flusher = Flusher([table])
    at = datetime(2026, 3, 1, 8, 3, tzinfo=timezone.utc)
    _flush(flusher, r, at)
    names = {c["class"] for c in api.job_metrics(r, 1, now=at)["classes"]}
    assert names == {"bad\\udc80name", "x" * jobmetrics.NAME_MAX}


def test_a_fault_gathering_the_metrics_queues_nothing_on_the_beat(r):
    class Broken:
        @property
        def rows(self):
            raise RuntimeError("a bug")
    pipe = r.pipeline(transaction=True)
    assert Flusher([Broken()]).add(pipe) == 0 and len(pipe) == 0  # type: ignore[list-item]


def test_minutes_out_of_range_is_refused_before_redis():
    with pytest.raises(ValueError, match="1 to 480"):
        api.job_metrics(None, minutes=0)  # type: ignore[arg-type]
    with pytest.raises(SystemExit) as exc:
        cli.main(["metrics", "--minutes", "481"])
    assert exc.value.code == 2


def _get(dash, path: str, query: str = "") -> tuple[str, str]:
    """A GET through the dashboard's WSGI callable, in this process: (status, body)."""
    got = []
    body = b"".join(dash({"REQUEST_METHOD": "GET", "PATH_INFO": path, "QUERY_STRING": query,
                          "REMOTE_ADDR": "127.0.0.1", "wsgi.url_scheme": "http"},
                         lambda status, headers: got.append(status)))
    return got[0], body.decode()


def test_the_dashboard_page_lists_classes_escaped_and_one_class_by_minute(r, redis_url):
    from forkq.web.app import Dashboard
    table = ClassTable()
    for klass, seconds, failed in (("<script>x</script>", 0.05, False), ("Slow", 2.0, False),
                                   ("Slow", 1.0, True)):
        table.observe(klass, "q", seconds, failed)
    _flush(Flusher([table]), r, datetime.now(timezone.utc))
    dash = Dashboard(redis_url)
    status, page = _get(dash, "/metrics-by-class")
    assert status.startswith("200")
    assert "<script>x" not in page and "&lt;script&gt;x&lt;/script&gt;" in page
    assert page.index("Slow") < page.index("&lt;script&gt;")  # most time first
    status, page = _get(dash, "/metrics-by-class", "minutes=120&class=Slow")
    assert status.startswith("200")
    assert "By minute (UTC)" in page and "2,500 ms" in page  # the 2 s job's bucket: under 2.5 s
    assert _get(dash, "/metrics-by-class", "minutes=7")[0].startswith("400")


# Sidekiq 6.4 (the machine's ruby-sidekiq) knows nothing of these keys: its stats and Web
# UI pages must work with them present
SIDEKIQ_6_PAGES = """
require "sidekiq"; require "sidekiq/api"; require "sidekiq/web"; require "rack/mock"
s = Sidekiq::Stats.new
puts "stats #{s.processed} #{s.failed}"
%w[/ /busy /queues /morgue /retries /scheduled].each do |path|
  puts "#{path} #{Rack::MockRequest.new(Sidekiq::Web.new).get(path, "rack.session" => {}).status}"
end
"""


@pytest.mark.timeout(60)
def test_sidekiq_6_stats_and_web_ui_work_beside_the_metrics_keys(sidekiq_ruby, r, redis_url):
    import subprocess
    table = ClassTable()
    table.observe("Mailer", "q", 0.05, False)
    table.observe("Mailer", "q", 0.05, True)
    _flush(Flusher([table]), r, datetime.now(timezone.utc))
    r.set(keys.STAT_PROCESSED, 2)
    assert any(k.startswith(b"j|") for k in r.keys())
    out = subprocess.run([sidekiq_ruby.ruby, "-e", SIDEKIQ_6_PAGES], capture_output=True, text=True,
                         timeout=50, env=sidekiq_ruby._env(redis_url))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:7] == ["stats 2 0", "/ 200", "/busy 200", "/queues 200",
                                          "/morgue 200", "/retries 200", "/scheduled 200"]


def test_a_thread_keeps_500_classes_apart_and_counts_the_rest_as_other(r):
    table = ClassTable()
    for i in range(jobmetrics.CLASSES_MAX + 2):
        table.observe(f"C{i}", "q", 0.001, False)
    table.observe("C0", "q", 0.001, True)  # a class it keeps goes on in its own row
    table.observe("late", "q", 0.05, False)
    at = datetime(2026, 3, 1, 8, 3, tzinfo=timezone.utc)
    _flush(Flusher([table]), r, at)
    got = _classes(r, minutes=1, now=at)
    assert len(got) == jobmetrics.CLASSES_MAX + 1 and "late" not in got
    assert (got["C0"]["processed"], got["C0"]["failed"]) == (2, 1)
    other = got[jobmetrics.OTHER]
    assert other["processed"] == 3 and other["histogram"][:4] == [2, 0, 0, 1]
    assert sum(other["series"]["ms"]) == 52


def test_a_jobs_seconds_read_after_its_count_go_with_a_later_beat(r):
    # a beat that copies a row between observe()'s bucket count and its seconds (the
    # processor thread preempted there) sends the job without its time: the time must go
    # with a later beat, also one that has no new job of that class, or only a failure
    table = ClassTable()
    row = [0, 0.0] + [0] * jobmetrics.NB
    table.rows["Long"] = row
    flusher = Flusher([table])
    at = datetime(2026, 3, 1, 8, 3, tzinfo=timezone.utc)
    row[jobmetrics.H + 20] += 1  # a 60 s job, counted...
    _flush(flusher, r, at)
    row[jobmetrics.S] += 60.0    # ...then its seconds, after the beat read the row
    _flush(flusher, r, at)
    row[jobmetrics.H + 20] += 1  # again, and a failure arrives before the next beat
    _flush(flusher, r, at)
    row[jobmetrics.S] += 60.0
    row[jobmetrics.F] += 1
    _flush(flusher, r, at)
    assert r.hgetall("j|20260301|8:3") == {b"Long|p": b"3", b"Long|f": b"1", b"Long|ms": b"120000"}


def test_a_class_asked_for_is_looked_up_under_the_name_it_was_written_as(r, redis_url, capsys):
    # written escaped and cut (see above): asking for the class as the payload names it
    # finds it, and a lone surrogate is no UnicodeEncodeError (the CLI refuses argv that
    # is not UTF-8 itself)
    table = ClassTable()
    table.observe("bad\udc80name", "q", 0.001, False)
    table.observe("x" * 1000, "q", 0.001, True)
    at = datetime.now(timezone.utc)
    _flush(Flusher([table]), r, at)
    assert _classes(r, minutes=2, klass="bad\udc80name").keys() == {"bad\\udc80name"}
    assert _classes(r, minutes=2, klass="x" * 1000)["x" * jobmetrics.NAME_MAX]["failed"] == 1
    forkq.configure(redis_url)
    capsys.readouterr()
    assert cli.main(["metrics", "--minutes", "2", "--class", "x" * 1000, "--json"]) == 0
    assert [c["failed"] for c in json.loads(capsys.readouterr().out)["classes"]] == [1]


def test_the_final_flush_beside_a_stuck_beat_counts_each_job_once(r):
    # the stop could not wait for a beat stuck on a frozen Redis: its transaction, queued
    # first, lands before the final flush's, and it may come back and beat once more
    table = ClassTable()
    flusher = Flusher([table])
    at = datetime(2026, 3, 1, 8, 3, tzinfo=timezone.utc)
    table.observe("K", "q", 0.001, False)
    stuck = r.pipeline(transaction=True)
    n = flusher.add(stuck, at)
    table.observe("K", "q", 0.001, True)
    final = r.pipeline(transaction=True)
    assert flusher.add(final, at, final=True, stuck=True) == 3  # K|p, K|f, the EXPIRE
    flusher.done(stuck.execute()[:n])  # the stuck beat lands first, then comes back
    flusher.done(final.execute(), final=True)
    assert flusher.add(r.pipeline(), at) == 0  # a beat after the final flush adds nothing
    assert r.hgetall("j|20260301|8:3") == {b"K|p": b"2", b"K|f": b"1", b"K|ms": b"1"}

    # a beat whose transaction failed before the stop: its counts go with the final flush
    table = ClassTable()
    flusher = Flusher([table])
    table.observe("L", "q", 0.001, False)
    assert flusher.add(r.pipeline(transaction=True), at) > 0
    flusher.done(None)
    final = r.pipeline(transaction=True)
    n = flusher.add(final, at, final=True, stuck=True)
    flusher.done(final.execute()[:n], final=True)
    assert r.hget("j|20260301|8:3", "L|p") == b"1"


def test_a_read_in_chunks_of_minutes_is_the_read_in_one(r, monkeypatch):
    at = datetime(2026, 3, 1, 8, 3, tzinfo=timezone.utc)
    for back, klass in ((0, "A"), (1, "B"), (2, "A"), (4, "A"), (6, "B")):
        table = ClassTable()
        table.observe(klass, "q", 0.001 * (back + 1), back == 2)
        _flush(Flusher([table]), r, at - timedelta(minutes=back))
    r.set(minute_key(at - timedelta(minutes=3)), "not a hash")  # one chunk's reply an error
    whole = api.job_metrics(r, minutes=7, now=at)
    monkeypatch.setattr(jobmetrics, "READ_CHUNK", 2)
    assert api.job_metrics(r, minutes=7, now=at) == whole
    got = {c["class"]: c["series"]["processed"] for c in whole["classes"]}
    assert got == {"A": [0, 0, 1, 0, 1, 0, 1], "B": [1, 0, 0, 0, 0, 1, 0]}  # oldest first
    one = api.job_metrics(r, minutes=7, klass="B", now=at)
    monkeypatch.setattr(jobmetrics, "READ_CHUNK", 30)
    assert one == api.job_metrics(r, minutes=7, klass="B", now=at)
    assert one["classes"][0]["series"]["ms"] == [7, 0, 0, 0, 0, 2, 0]


@pytest.mark.timeout(20)
def test_jobs_of_classes_this_worker_cannot_resolve_take_one_row_not_the_cap(running, r,
                                                                             redis_url):
    # anyone who can push names such classes: under their own names, junk took a thread's
    # 500 rows for good, and the app's real classes went to (other) from then on
    manager, _ = running(1)
    client = forkq.Client(redis_url)
    for i in range(3):
        client.push(f"junk.Name{i}", queue=QUEUE, retry=False)
    fast.enqueue()
    want = {jobmetrics.UNKNOWN: (3, 3), "jm.Fast": (1, 0)}
    wait_until(lambda: {k: (c["processed"], c["failed"]) for k, c in _classes(r).items()} == want,
               timeout=10, message=f"{want} in the metrics")
    assert manager.processors[0].jobs.rows.keys() == {jobmetrics.UNKNOWN, "jm.Fast"}
    # their failures keep their names where an operator looks for them
    assert sorted(json.loads(e)["class"] for e in r.zrange("dead", 0, -1)) == [
        "junk.Name0", "junk.Name1", "junk.Name2"]


def _sidekiq_7_top_jobs(hash_: dict[bytes, bytes]) -> dict[str, dict[str, int]]:
    """Sidekiq 7's Web UI reading a minute hash (metrics/query.rb, top_jobs, v7.3.9):
    `kls, metric = k.split("|")`, the first two parts of a split at every "|"."""
    out: dict[str, dict[str, int]] = {}
    for k, v in hash_.items():
        kls, metric = (k.decode().split("|") + [""])[:2]
        out.setdefault(kls, {}).setdefault(metric, 0)
        out[kls][metric] += int(v)
    return out


def test_a_class_name_with_a_bar_cannot_count_as_another_class(r, redis_url, capsys):
    # "Mailer|p" wrote the field "Mailer|p|p", which Sidekiq 7's UI counts as Mailer's
    # runs; "%" is escaped too, so that "a|b" and a class really named "a%7Cb" stay apart
    table = ClassTable()
    for klass, failed in (("Mailer", False), ("Mailer", True), ("Mailer|p", True),
                          ("Mailer|p", False), ("a|b", False), ("a%7Cb", False)):
        table.observe(klass, "q", 0.001, failed)
    at = datetime.now(timezone.utc)
    _flush(Flusher([table]), r, at)
    fields = r.hgetall(minute_key(at))
    assert all(f.count(b"|") == 1 for f in fields), fields
    seen = _sidekiq_7_top_jobs(fields)
    assert seen["Mailer"] == {"p": 2, "f": 1, "ms": 1}
    assert seen["Mailer%7Cp"] == {"p": 2, "f": 1, "ms": 1}
    # forkq shows and takes the names the jobs carry
    got = _classes(r, minutes=2)
    assert {k: (c["processed"], c["failed"]) for k, c in got.items()} == {
        "Mailer": (2, 1), "Mailer|p": (2, 1), "a|b": (1, 0), "a%7Cb": (1, 0)}
    assert got["Mailer|p"]["histogram"][0] == 1  # its histogram key is written escaped too
    assert _classes(r, minutes=2, klass="Mailer|p").keys() == {"Mailer|p"}
    forkq.configure(redis_url)
    capsys.readouterr()
    assert cli.main(["metrics", "--minutes", "2", "--class", "a%7Cb", "--json"]) == 0
    assert [(c["class"], c["processed"]) for c in json.loads(capsys.readouterr().out)["classes"]] \
        == [("a%7Cb", 1)]
    from forkq.web.app import Dashboard
    dash = Dashboard(redis_url)
    link = "minutes=60&amp;class=Mailer%7Cp"  # the link of the class's row, and where it goes
    assert link in _get(dash, "/metrics-by-class")[1]
    status, page = _get(dash, "/metrics-by-class", link.replace("&amp;", "&"))
    assert status.startswith("200") and "By minute (UTC)" in page
    # a field another writer left with a bar in its class (forkq before this, within its 8
    # hours) is read as the class before its last bar, never as the first part's
    r.hset(minute_key(at), "Mailer|x|p", 5)
    assert _classes(r, minutes=2)["Mailer|x"]["processed"] == 5
    assert _classes(r, minutes=2)["Mailer"]["processed"] == 2


@pytest.mark.timeout(20)
def test_jobs_forkq_failed_outside_their_code_are_counted_once(running, r, monkeypatch):
    # _fault recorded them as failed but the metrics never saw them; where process() had
    # counted a job already (or _perform its failure), _fault counted it a second time
    from forkq import logs, processor
    manager, _ = running(1)
    proc = manager.processors[0]
    trips = {"set_job": 1, "message": 1, "observe": 1}
    real_set_job, real_message, real_observe = logs.set_job, processor.message, proc._observe

    def tripped(name, real):
        def call(*a, **kw):
            if trips[name]:
                trips[name] -= 1
                raise RuntimeError(f"a fault in forkq at {name}")
            return real(*a, **kw)
        return call

    def row(klass):  # (failed, succeeded) in the thread's table
        got = proc.jobs.rows.get(klass)
        return None if got is None else (got[jobmetrics.F], sum(got[jobmetrics.H:]))
    # before the job runs; in the failure path after _perform counted the failure; in the
    # count itself (not counted again: a count that faults would fault again). Each wait
    # ends once _fault finished, its count being the last thing it does
    monkeypatch.setattr(logs, "set_job", tripped("set_job", real_set_job))
    fast.enqueue()
    wait_until(lambda: row("jm.Fast") == (1, 0), timeout=5, message="the first job failed")
    monkeypatch.setattr(processor, "message", tripped("message", real_message))
    flaky.enqueue(True)
    wait_until(lambda: row("jm.Flaky") == (1, 0), timeout=5, message="the second job failed")
    monkeypatch.setattr(proc, "_observe", tripped("observe", real_observe))
    fast.enqueue()
    flaky.enqueue(False)  # run after it by the one thread
    wait_until(lambda: row("jm.Flaky") == (1, 1), timeout=5, message="the last job counted")
    assert not any(trips.values())
    assert (proc.processed, proc.failed) == (4, 3)
    assert {k: row(k) for k in proc.jobs.rows} == {"jm.Fast": (1, 0), "jm.Flaky": (1, 1)}


@forkq.job(queue=QUEUE, name="jm.Retried")
def retried() -> None:
    raise ValueError("retried failed")


@pytest.mark.timeout(20)
def test_a_fault_after_a_failure_was_recorded_does_not_record_it_again(running, r, monkeypatch):
    """A fault in _perform's failure path after its write (here in the "fail" log line)
    reached _fault, which wrote the failure a second time: a second retry entry, the job
    run twice more. The entry is no longer in flight: the outcome stands, counted once."""
    from forkq import processor
    manager, _ = running(1)
    proc = manager.processors[0]
    real_message, trips = processor.message, [1]

    def tripped(*a, **kw):
        if trips:
            trips.pop()
            raise RuntimeError("a fault in forkq after the failure's write")
        return real_message(*a, **kw)
    monkeypatch.setattr(processor, "message", tripped)
    jid = retried.enqueue()
    # _fault counts the job last (process() had not): then its write, if any, was made
    wait_until(lambda: "jm.Retried" in proc.jobs.rows, timeout=5, message="the job counted")
    assert not trips and (proc.processed, proc.failed) == (1, 1)
    assert proc.jobs.rows["jm.Retried"][jobmetrics.F] == 1
    (entry,) = [json.loads(raw) for raw in r.zrange("retry", 0, -1)]
    assert entry["jid"] == jid and entry["error_message"] == "retried failed"


def test_a_bad_minutes_is_a_400_with_its_reason_not_another_period(r, redis_url, capsys):
    # "abc" (and " 60", "6_0") showed 60 minutes as if asked for; each is one line naming
    # the periods, as the dashboard's other bad parameters are
    from forkq.web.app import Dashboard
    dash = Dashboard(redis_url)
    for bad in ("abc", "", "-5", "-60", "0", "7", "6_0", "%2060", "060", "99999999999999999999"):
        status, body = _get(dash, "/metrics-by-class", f"minutes={bad}")
        assert status.startswith("400"), (bad, status)
        assert body.startswith("bad request: minutes must be one of 60, 120, 240, 480, not ")
        assert body.count("\n") == 1, body
    assert _get(dash, "/metrics-by-class", "minutes=240")[0].startswith("200")
    assert _get(dash, "/metrics-by-class")[0].startswith("200")  # none given: 60
    forkq.configure(redis_url)
    for bad, why in (("abc", "a whole number, not 'abc'"), ("-5", "between 1 and 480, not -5"),
                     ("99999999999999999999", "between 1 and 480")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exc:
            cli.main(["metrics", "--minutes", bad])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert f"--minutes must be {why}" in err and err.count("\n") == 1, err
