"""`forkq stats|queues|processes|dead|retry|schedule`: real `python -m forkq` subprocesses
against a real Redis; --json output must parse and agree with forkq.api."""

from __future__ import annotations

import json
import time
import os
import subprocess
import sys
from pathlib import Path

import pytest

import forkq
from forkq import api, keys
from corekit import queued, workers  # noqa: F401  (a fixture)
from helpers import wait_until
from test_api import fill, sk_job

REPO_ROOT = Path(__file__).resolve().parent.parent


def run(*args: str, url: str | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    if url is not None:
        env["FORKQ_REDIS_URL"] = url
    return subprocess.run([sys.executable, "-m", "forkq", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def ok_json(*args: str) -> object:
    out = run(*args, "--json")
    assert out.returncode == 0, (args, out.stdout, out.stderr)
    return json.loads(out.stdout)


@pytest.mark.timeout(30)
def test_stats_and_queues_json_match_the_api_and_tables_print(r, redis_url):
    c = forkq.Client(redis_url)
    c.push("A", [1], queue="alpha")
    c.push("A", [2], queue="alpha")
    c.push("B", [], queue="beta")
    r.set("stat:processed", 12)
    fill(r, "dead", [sk_job(i) for i in range(3)])
    # two jobs of beta wait as crash suspects (a dead child's jobs, as requeue_all leaves them)
    r.lpush(keys.suspects("beta"), json.dumps(sk_job(7, queue="beta")), json.dumps(sk_job(8, queue="beta")))
    stats = ok_json("stats", "--days", "2")
    s = api.stats(api.connect(), 2)
    assert (stats["processed"], stats["enqueued"], stats["dead"], stats["suspects"]) == (12, 3, 3, 2) \
        == (s.processed, s.enqueued, s.dead, s.suspects)
    assert [h["day"] for h in stats["history"]] == [d for d, _, _ in s.history]
    qs = ok_json("queues")
    assert [(q["name"], q["size"], q["suspects"]) for q in qs] == [("alpha", 2, 0), ("beta", 1, 2)] \
        == [(q.name, q.size, q.suspects) for q in api.queues(api.connect())]
    table = run("queues")
    assert table.returncode == 0
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["queue", "size", "suspects", "latency", "state"]
    assert lines[1].split()[:3] == ["alpha", "2", "0"] and lines[2].split()[:3] == ["beta", "1", "2"]
    totals = run("stats").stdout.splitlines()
    assert dict(zip(totals[0].split(), totals[1].split()))["suspects"] == "2"
    # and which jobs they are: next to run (the rightmost) first, with their crash counts
    r.set(keys.CRASH_PREFIX + "%024x" % 9, 2)
    listed = ok_json("suspects", "beta")
    assert [(e["jid"], e["crashes"]) for e in listed] == [("%024x" % 8, 0), ("%024x" % 9, 2)]
    lines = run("suspects", "beta", "--limit", "1").stdout.splitlines()
    assert lines[0].split() == ["jid", "class", "crashes", "args"]
    assert lines[1].split()[:3] == ["%024x" % 8, "HardJob", "0"] and lines[2] == "(1 of 2; --limit shows more)"
    assert run("suspects", "alpha").stdout.strip() == "no crash suspects wait for queue 'alpha'"


@pytest.mark.timeout(30)
def test_dead_list_filters_and_actions(r, redis_url):
    fill(r, "dead", [sk_job(i, klass="A" if i % 2 else "B", queue="q1" if i < 6 else "q2") for i in range(10)])
    listed = ok_json("dead", "list", "--class", "A", "--limit", "3")
    assert [e["job"]["args"] for e in listed] == [[1], [3], [5]]
    assert listed == [e.to_dict() for e in list(api.dead(api.connect()).entries(api.matching(klass="A")))[:3]]
    assert [e["jid"] for e in ok_json("dead", "list", "--jid", "%024x" % 5)] == ["%024x" % 5]
    table = run("dead", "list")
    assert table.returncode == 0 and table.stdout.splitlines()[0].split()[:3] == ["when", "(UTC)", "jid"]
    assert "RuntimeError: boom 0" in table.stdout
    assert ok_json("dead", "retry", "--jid", "%024x" % 1) == {"set": "dead", "action": "retry", "count": 1}
    assert queued(r, "q1")[0]["jid"] == "%024x" % 1
    assert ok_json("dead", "delete", "--queue", "q2")["count"] == 4
    assert ok_json("dead", "delete", "--all")["count"] == 5
    assert r.zcard("dead") == 0
    missing = run("dead", "retry", "--jid", "f" * 24)
    assert missing.returncode == 1 and "no entry with jid" in missing.stderr


@pytest.mark.timeout(30)
def test_retry_set_retry_now_and_kill(r, redis_url):
    fill(r, "retry", [sk_job(i, klass="K" if i < 4 else "L") for i in range(6)])
    assert ok_json("retry", "kill", "--class", "K")["count"] == 4
    assert r.zcard("dead") == 4
    assert ok_json("retry", "retry-now", "--all")["count"] == 2
    assert len(queued(r)) == 2 and r.zcard("retry") == 0
    assert "retry-now: 0 entries of retry" in run("retry", "retry-now", "--all").stdout


@pytest.mark.timeout(40)
def test_dead_retry_all_on_1000_entries_works_in_pages(r, redis_url):
    fill(r, "dead", [sk_job(i) for i in range(1000)])
    assert ok_json("dead", "retry", "--all")["count"] == 1000
    assert r.zcard("dead") == 0
    jobs = queued(r)
    assert len(jobs) == 1000 and sorted(j["args"][0] for j in jobs) == list(range(1000))
    assert len({j["jid"] for j in jobs}) == 1000


@pytest.mark.timeout(30)
def test_processes_table_and_json(r, redis_url, workers):
    w = workers()
    groups = ok_json("processes")
    assert len(groups) == 1 and groups[0]["master"] is None
    (proc,) = groups[0]["processes"]
    assert proc["identity"] == w.identity and proc["pid"] == w.proc.pid
    out = run("processes")
    assert out.returncode == 0 and w.identity in out.stdout and "heartbeat" in out.stdout.splitlines()[0]


@pytest.mark.timeout(30)
def test_bad_arguments_and_unreachable_redis_are_one_line(r, redis_url):
    for args in (["dead", "retry"], ["dead", "retry", "--all", "--class", "A"], ["stats", "--days", "x"],
                 ["retry", "list", "--limit", "0"], ["dead", "frobnicate"],
                 ["dead", "list", "--limit", "99999999999999999999"],
                 ["suspects", "q", "--limit", "99999999999999999999"]):
        out = run(*args)
        assert out.returncode == 2, (args, out.stderr)
        assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    out = run("queues", "--redis-url", "redis://user:hunter2@127.0.0.1:1/0")
    assert out.returncode == 1 and out.stderr.count("\n") == 1
    assert "hunter2" not in out.stderr and "***" in out.stderr


@pytest.mark.timeout(60)
def test_admin_commands_and_web_read_the_redis_url_start_reads_from_its_file(r, redis_url, tmp_path,
                                                                           monkeypatch):
    """They read --redis-url and FORKQ_REDIS_URL only: in a project configured by its
    pyproject.toml, `forkq stats` looked at a Redis on localhost instead of the workers'."""
    forkq.Client(redis_url).push("Counted", [1], queue="from-file")
    monkeypatch.delenv("FORKQ_REDIS_URL")
    # a setting only a worker uses, with a bad value, is start's business
    (tmp_path / "pyproject.toml").write_text(f'[tool.forkq]\nredis-url = "{redis_url}"\nprocesses = 0\n')
    (tmp_path / "other.toml").write_text('redis-url = "redis://127.0.0.1:1/0"\n')

    def queues(*args: str, cwd=tmp_path, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "forkq", "queues", "--json", *args],
                              env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **env}, cwd=cwd,
                              capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)

    out = queues()
    assert out.returncode == 0, out.stderr
    assert [q["name"] for q in json.loads(out.stdout)] == ["from-file"]
    for named in (queues("--config", "other.toml"), queues(FORKQ_CONFIG="other.toml")):
        assert named.returncode == 1 and "127.0.0.1:1/0" in named.stderr, named.stderr
    # the variable and the flag still come first
    assert queues(FORKQ_REDIS_URL="redis://127.0.0.1:1/0").returncode == 1
    assert queues("--redis-url", redis_url, "--config", "other.toml").returncode == 0
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "pyproject.toml").write_text('[tool.forkq]\nredis-url = 5\n')
    out = queues(cwd=bad)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "redis-url" in out.stderr and "Traceback" not in out.stderr, out.stderr

    from webkit import Client as Browser, WebServer
    web = WebServer(redis_url)
    web.cmd = [sys.executable, "-m", "forkq", "web", "--port", str(web.port),
               "--config", str(tmp_path / "pyproject.toml")]
    web.env.pop("FORKQ_REDIS_URL", None)
    with web:
        page = Browser(web.base).get("/queues")
        assert page.status == 200 and "from-file" in page.text


@pytest.mark.timeout(30)
def test_busy_lists_running_jobs_longest_first(r, redis_url, workers):
    from corekit import core_jobs
    w = workers(extra_args=("--heartbeat-interval", "0.5"))  # the running jobs show at each beat
    first = core_jobs.sleepy.enqueue(20, "first")
    wait_until(lambda: len(api.running(r)) == 1, timeout=10, message="the first job running")
    second = core_jobs.sleepy.enqueue(20, "second")
    wait_until(lambda: len(api.running(r)) == 2, timeout=10, message="both jobs running")
    busy = ok_json("busy")
    assert [b["jid"] for b in busy] == [first, second]
    assert busy[0]["identity"] == w.identity and busy[0]["args"] == [20, "first"]
    assert busy[0]["running_for"] >= busy[1]["running_for"] >= 0
    table = run("busy").stdout.splitlines()
    assert table[0].split() == ["process", "queue", "jid", "class", "running", "progress", "args"]
    assert first in table[1] and second in table[2]


def strict_json(*args: str) -> object:
    """--json output read as a strict parser (jq, JSON.parse) would: NaN or Infinity fail."""
    out = run(*args, "--json")
    assert out.returncode == 0, (args, out.stdout, out.stderr)

    def refuse(constant: str) -> None:
        raise AssertionError(f"{args}: {constant} in --json output")
    return json.loads(out.stdout, parse_constant=refuse)


@pytest.mark.timeout(30)
def test_json_output_is_strict_json_when_payloads_hold_nan_or_infinity(r, redis_url):
    # any Sidekiq client may write these (Python's json.dumps does by default), and a Redis
    # score may be inf: each becomes null, the rest of the entry stays
    odd = '{"class": "K", "args": [NaN, 1.5], "jid": "%s", "queue": "q", "retry_count": NaN, ' \
          '"failed_at": Infinity, "enqueued_at": -Infinity, "error_class": "E"}'
    r.zadd("dead", {odd % ("a" * 24): float("inf")})
    r.zadd("retry", {odd % ("b" * 24): 1_700_000_000})
    r.sadd("queues", "q")
    r.lpush("queue:q", odd % ("c" * 24))
    r.sadd("processes", "host:1:abc")
    r.hset("host:1:abc:workers", "tid", json.dumps({"queue": "q", "payload": odd % ("d" * 24),
                                                    "run_at": float("nan")}))
    (dead,) = strict_json("dead", "list")
    assert dead["score"] is None and dead["retry_count"] is None
    assert dead["job"]["failed_at"] is None and dead["job"]["args"] == [None, 1.5]
    assert dead["job"]["error_class"] == "E" and dead["jid"] == "a" * 24
    (retry,) = strict_json("retry", "list")
    assert retry["score"] == 1_700_000_000 and retry["job"]["enqueued_at"] is None
    (queue,) = strict_json("queues")
    # the next job's -Infinity stamp is no time: latency unknown, 0 as for a missing one (as Sidekiq's)
    assert queue["name"] == "q" and queue["latency"] == 0
    (busy,) = strict_json("busy")
    assert busy["jid"] == "d" * 24 and busy["run_at"] is None and busy["args"] == [None, 1.5]
    assert strict_json("stats")["dead"] == 1


@pytest.mark.timeout(30)
def test_malformed_selects_only_what_was_never_a_runnable_job(r, redis_url):
    from forkq.retry import MALFORMED_QUEUE, dead_entry_for_malformed
    fill(r, "dead", [sk_job(i) for i in range(3)])
    # what forkq writes for a payload it could not parse, from a queue and from the retry set
    bad = [dead_entry_for_malformed(b'{"class": 3}', "default", "payload has no 'class' string", 1.0),
           dead_entry_for_malformed(b"\xff not json", MALFORMED_QUEUE, "payload is not valid UTF-8", 2.0)]
    fill(r, "dead", bad, base=1_800_000_000.0)
    r.zadd("dead", {b"[1, 2]": 1_900_000_000.0})  # a member no client wrote as a job
    listed = ok_json("dead", "list", "--malformed")
    assert [e["jid"] for e in listed] == [bad[0]["jid"], bad[1]["jid"], None]
    assert [e["class"] for e in listed[:2]] == ["forkq.MalformedJob"] * 2 and listed[2]["job"] == "[1, 2]"
    assert [e["jid"] for e in ok_json("dead", "list", "--malformed", "--jid", bad[1]["jid"])] == [bad[1]["jid"]]
    out = run("dead", "retry", "--malformed")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "delete" in out.stderr, out.stderr
    # offered only where it does something
    helps = {verb: run(name, verb, "--help").stdout for name, verb in
             (("dead", "retry"), ("dead", "delete"), ("retry", "retry-now"), ("retry", "kill"),
              ("schedule", "run-now"), ("schedule", "list"))}
    assert {verb for verb, text in helps.items() if "--malformed" in text} == {"delete", "kill", "list"}
    assert ok_json("dead", "delete", "--malformed") == {"set": "dead", "action": "delete", "count": 3}
    assert [e["jid"] for e in ok_json("dead", "list")] == ["%024x" % (i + 1) for i in range(3)]
    # the selector is one of the bulk ones: not beside another
    out = run("dead", "delete", "--malformed", "--all")
    assert out.returncode == 2 and "not allowed with" in out.stderr, out.stderr


@pytest.mark.timeout(60)
def test_a_kill_past_the_dead_sets_limit_says_how_many_were_dropped(r, redis_url):
    # the dead set keeps Sidekiq's newest 9,999: "kill: 10050 entries" alone promised
    # entries that are gone
    fill(r, "dead", [sk_job(i, klass="Old") for i in range(5)], base=1_600_000_000.0)
    fill(r, "retry", [sk_job(i) for i in range(10_050)])
    assert ok_json("retry", "kill", "--all") == {"set": "retry", "action": "kill", "count": 10_050,
                                                 "dropped": 56}
    assert r.zcard("dead") == 9_999 and r.zcard("retry") == 0
    assert not [e for e in api.dead(api.connect()).entries() if e.klass == "Old"]  # oldest first
    fill(r, "retry", [sk_job(i) for i in range(3)])
    out = run("retry", "kill", "--all")
    assert out.returncode == 0, out.stderr
    assert out.stdout == ("kill: 3 entries of retry moved to dead, which keeps only its newest 9,999 "
                          "entries (none older than 180 days): its 3 oldest were dropped\n")
    assert ok_json("schedule", "kill", "--all") == {"set": "schedule", "action": "kill", "count": 0,
                                                    "dropped": 0}


@pytest.mark.timeout(30)
def test_batch_prints_a_batchs_state_and_failures_and_refuses_an_unknown_one(r, redis_url):
    from forkq import batch
    client = forkq.Client(redis_url)
    b = forkq.Batch(description="nightly import", client=client)
    with b:
        first, _ = client.push_bulk("Import", [[1], [2]])
    batch.record_failure(r, {"bid": b.bid, "jid": first}, "ValueError", "bad \x1b[31mrow", "retry")
    out = run("batch", b.bid, url=redis_url)
    assert out.returncode == 0, out.stderr
    summary, failure = out.stdout.splitlines()[1], out.stdout.splitlines()[4]
    assert summary.split()[:7] == [b.bid, "nightly", "import", "running", "2", "2", "1"], out.stdout
    assert first in failure and "ValueError" in failure and "\x1b" not in out.stdout
    data = ok_json("batch", b.bid)
    assert (data["state"], data["total"], data["pending"], data["sealed"]) == ("running", 2, 2, True)
    assert data["failures"][first]["error_message"] == "bad \x1b[31mrow"
    missing = run("batch", "no-such-bid", url=redis_url)
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr.startswith("forkq: no batch 'no-such-bid' in Redis") and missing.stderr.count("\n") == 1


@pytest.mark.timeout(30)
def test_batches_lists_the_newest_first_with_states_and_counts(r, redis_url, capsys):
    from forkq import admin, batch, cli
    assert admin.BATCH_STATES == batch.STATES  # spelled out there for a fast --help
    client = forkq.Client(redis_url)
    with forkq.Batch(description="nightly import", client=client) as first:
        jid, _ = client.push_bulk("Import", [[1], [2]])
    batch.record_failure(r, {"bid": first.bid, "jid": jid}, "ValueError", "bad row", "retry")
    with forkq.Batch(description="done", client=client) as done:
        pass
    with pytest.raises(KeyError):
        with forkq.Batch(description="gave \x1b[31mup", client=client) as gave_up:
            raise KeyError("x")
    r.zadd(keys.BATCHES, {"expired-bid": 1.0})  # its keys are gone: not listed
    out = run("batches", "--limit", "2", url=redis_url)
    assert out.returncode == 0, out.stderr
    header, *rows = out.stdout.splitlines()
    assert header.split() == ["bid", "description", "created", "(UTC)", "state", "total", "pending",
                              "failed"]
    assert [row.split()[0] for row in rows] == [gave_up.bid, done.bid] and "\x1b" not in out.stdout
    assert rows[1].split()[-4:] == ["succeeded", "0", "0", "0"]
    capsys.readouterr()
    # in-process, the same argv (a second subprocess would double the test's time)
    assert cli.main(["batches", "--state", "running", "--state", "abandoned", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(b["bid"], b["state"], b["total"], b["pending"], b["failed"]) for b in data] == [
        (gave_up.bid, "abandoned", 0, 0, 0), (first.bid, "running", 2, 2, 1)]
    assert data[0]["description"] == "gave \x1b[31mup" and data[1]["description"] == "nightly import"
    assert data[1]["created_at"] == first.status().created_at
    assert r.zscore(keys.BATCHES, "expired-bid") is None



def test_batches_looks_at_scan_batches_at_most_and_says_more_may_exist(r, redis_url, capsys):
    from forkq import admin, batch, cli
    from test_batch import many_batches
    assert admin.BATCHES_SCAN == batch.LOOK_AT  # spelled out there for a fast --help
    gave_up, *_ = many_batches(r, ["abandoned", "succeeded", "succeeded", "succeeded"])
    assert cli.main(["batches", "--state", "abandoned", "--limit", "1", "--scan", "3"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "no batches in that state among the newest 3 in Redis",
        "... more may exist: looked at the newest 3 batches (--scan N looks further)"]
    assert cli.main(["batches", "--state", "abandoned", "--limit", "1", "--scan", "3", "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out) == [] and "more may exist" in out.err
    assert cli.main(["batches", "--state", "abandoned", "--limit", "1", "--scan", "4", "--json"]) == 0
    out = capsys.readouterr()
    assert [b["bid"] for b in json.loads(out.out)] == [gave_up] and out.err == ""

def test_tables_write_out_bidi_and_zero_width_characters():
    from forkq import admin
    assert admin._printable("pay\u202elaunch\u200b\x1b[31m") == "pay\\u202elaunch\\u200b\\x1b[31m"


@pytest.mark.timeout(60)
def test_push_pushes_by_name_or_through_the_app_and_refuses_bad_input_in_one_line(r, redis_url):
    out = run("push", "app.Report", "--args", '[7, "x"]', "--kwargs", '{"fmt": "pdf"}',
              "--queue", "reports", url=redis_url)
    assert out.returncode == 0, out.stderr
    (raw,) = r.lrange("queue:reports", 0, -1)
    job = json.loads(raw)
    assert (job["jid"], job["class"], job["args"], job["kwargs"]) == (out.stdout.strip(), "app.Report",
                                                                       [7, "x"], {"fmt": "pdf"})
    later = run("push", "app.Report", "--in", "300", "--json", url=redis_url)
    assert later.returncode == 0, later.stderr
    ((member, due),) = r.zrange("schedule", 0, -1, withscores=True)
    assert json.loads(member)["jid"] == json.loads(later.stdout)["jid"]
    assert time.time() + 290 < due < time.time() + 310
    # with the app: the job's own queue and options, and its signature checked
    app = str(REPO_ROOT / "tests" / "apps" / "core_jobs.py")
    named = run("push", "CustomName", "--args", "[1]", "--require", app, url=redis_url)
    assert named.returncode == 0, named.stderr
    assert json.loads(r.lindex("queue:mail", 0))["retry"] == 3
    for argv, says in [
        (["add", "--args", "[1]"], "positional argument"),           # add(a, b) given one
        (["add", "--args", "[1, 2", ], "JSON"),
        (["add", "--args", '{"a": 1}'], "JSON array"),
        (["add", "--kwargs", "[1]"], "JSON object"),
        (["add", "--args", "[NaN, 1]"], "JSON-native"),
        (["add", "--args", "[1, 2]", "--at", "2030-01-01T00:00:00"], "UTC offset"),
        (["add", "--args", "[1, 2]", "--in", "-5"], "--in"),
    ]:
        name, *rest = argv
        bad = run("push", f"tests.apps.core_jobs.{name}", *rest, "--require", app, url=redis_url)
        assert bad.returncode == 2 and says in bad.stderr, (argv, bad.stderr)
        assert bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr
    assert r.llen("queue:default") == 0 and r.zcard("schedule") == 1
    at = run("push", "app.Report", "--at", "2030-01-01T00:00:00Z", url=redis_url)
    assert at.returncode == 0, at.stderr
    assert 1893456000.0 in [s for _, s in r.zrange("schedule", 0, -1, withscores=True)]


@pytest.mark.timeout(10)
def test_push_says_when_a_scheduled_job_is_due_in_utc(redis_url, capsys, monkeypatch):
    """`forkq push --at/--in` prints the due time in UTC, named, as every other command
    does, whatever the host's zone (it printed local time without a zone)."""
    from forkq import cli
    monkeypatch.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    try:
        assert cli.main(["push", "app.Report", "--at", "2030-01-01T00:00:00Z",
                         "--redis-url", redis_url]) == 0
    finally:
        monkeypatch.undo()
        time.tzset()
    jid, _, due = capsys.readouterr().out.strip().partition(" ")
    assert len(jid) == 24 and due == "(due 2030-01-01 00:00:00 UTC)"


@pytest.mark.timeout(30)
def test_push_with_redis_down_is_one_line_and_exit_1(capsys):
    from forkq import cli
    import socket
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert cli.main(["push", "app.Report", "--redis-url", f"redis://127.0.0.1:{port}/0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("forkq: ") and err.count("\n") == 1 and "not pushed" in err, err


@pytest.mark.timeout(30)
def test_push_refuses_a_time_out_of_range_and_unencodable_or_too_deep_args_before_redis(
        r, redis_url, capsys):
    from forkq import cli
    for argv, says in [
        (["--at", "1e300"], "--at"),
        (["--in", "1e300"], "--in"),
        (["--args", '["\\ud800"]'], "UTF-8"),
        (["--args", "[" * 5000 + "]" * 5000], "deep"),
        (["--args", "[" * 500 + "]" * 500], "deep"),
        (["--kwargs", '{"a": ' + "[" * 500 + "]" * 500 + "}"], "deep"),
    ]:
        assert cli.main(["push", "app.Report", *argv, "--redis-url", redis_url]) == 2, argv
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1, (argv[0], err[:300])
    assert r.llen("queue:default") == 0 and r.zcard("schedule") == 0


@pytest.mark.timeout(30)
def test_push_refuses_a_function_path_the_app_declares_under_another_name(r, redis_url, capsys):
    # no worker of the app looks a job up by its function's path once it has a name
    from forkq import cli
    app = str(REPO_ROOT / "tests" / "apps" / "core_jobs.py")
    assert cli.main(["push", "tests.apps.core_jobs.named", "--require", app,
                     "--redis-url", redis_url]) == 2
    err = capsys.readouterr().err
    assert "'CustomName'" in err and err.count("\n") == 1, err
    assert r.llen("queue:default") == 0 and r.llen("queue:mail") == 0
