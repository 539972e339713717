"""`forkq web` over real HTTP: a real `forkq web` subprocess on a free port, against the
real Redis fixture, with data pushed by forkq (and by Ruby Sidekiq where installed).

What it checks: the pages show what is in Redis, paging and search work, state changes need
a POST with a CSRF token (and nothing changes without one), quiet/stop land on `-signals`,
auth and the bind rule hold, hostile payload text comes back escaped, and a prefix
(SCRIPT_NAME) shows up in every link.
"""

from __future__ import annotations

import base64
import json
import re
import sys
import time
import zlib
from urllib.parse import quote

import pytest

import forkq
from forkq import keys
from corekit import workers  # noqa: F401  (a fixture)
from helpers import wait_until
from test_ctl import start_master  # noqa: F401  (a fixture)
from webkit import Client, WebServer, ruby_backtrace, run_forkq


@pytest.fixture(scope="module")
def web(redis_server):
    """One open (no auth) dashboard for the module; tests flush Redis through redis_url."""
    with WebServer(redis_server.url) as server:
        yield server


@pytest.fixture
def browser(web, redis_url):
    return Client(web.base)


def dead_job(i: int, klass: str = "HardJob", queue: str = "default", **extra) -> dict:
    """A dead/retry entry as Sidekiq 6.4 writes it."""
    job = {"retry": True, "queue": queue, "args": [i], "class": klass, "jid": "%024x" % (i + 1),
           "created_at": 1700000000.5, "enqueued_at": 1700000000.6, "error_message": f"boom {i}",
           "error_class": "RuntimeError", "failed_at": 1700000001.0, "retry_count": 3}
    job.update(extra)
    return job


def fill(r, key: str, jobs: list[dict], base: float | None = None) -> None:
    # recent scores: killing trims dead entries older than 180 days, as Sidekiq does
    base = time.time() - 3600 if base is None else base
    pipe = r.pipeline(transaction=False)
    for i, job in enumerate(jobs):
        pipe.zadd(key, {json.dumps(job): base + i})
    pipe.execute()


def jids_on(page) -> list[str]:
    return re.findall(r'<tr data-jid="([^"]*)"', page.text)


def heartbeat(r, identity: str, master: str | None = None, slot: int | None = None, quiet: bool = False) -> None:
    """A live process's heartbeat in Sidekiq's format, with nobody reading its -signals."""
    info = {"hostname": "web-test", "pid": 4242, "queues": ["default"], "concurrency": 5,
            "identity": identity, "started_at": time.time()}
    if master:
        info.update(master=master, slot=slot)
    r.sadd("processes", identity)
    r.hset(identity, mapping={"info": json.dumps(info), "busy": 1, "beat": time.time(),
                              "quiet": "true" if quiet else "false", "rss": 20480})


# -- pages show what is in Redis ----------------------------------------------------


@pytest.mark.timeout(30)
def test_overview_shows_queues_totals_and_stats_json(browser, r, redis_url):
    c = forkq.Client(redis_url)
    for i in range(3):
        c.push("app.Mail", [i], queue="mail")
    c.push("app.Resize", [1], queue="images")
    r.set("stat:processed", 1234)
    r.set("stat:failed", 56)
    fill(r, "dead", [dead_job(1)])
    page = browser.get("/")
    assert page.status == 200
    assert re.search(r"<td><a href=\"/queues/mail\">mail</a></td><td class=\"num\">3</td>", page.text), page.text
    assert re.search(r"<td><a href=\"/queues/images\">images</a></td><td class=\"num\">1</td>", page.text)
    assert 'data-stat="processed">1,234<' in page.text
    assert 'id="rate-chart"' in page.text
    stats = browser.get("/stats.json").json()
    assert stats["processed"] == 1234 and stats["failed"] == 56
    assert stats["enqueued"] == 4 and stats["dead"] == 1


@pytest.mark.timeout(60)
def test_pages_show_jobs_ruby_sidekiq_pushed(sidekiq_ruby, browser, redis_url, r):
    jid = sidekiq_ruby.push(redis_url, "InteropJob", [1, "two"], queue="rubyq")
    later = sidekiq_ruby.push(redis_url, "InteropJob", [3], queue="rubyq", at=time.time() + 3600)
    assert re.search(r"<td><a href=\"/queues/rubyq\">rubyq</a></td><td class=\"num\">1</td>", browser.get("/").text)
    scheduled = browser.get("/scheduled")
    assert jids_on(scheduled) == [later]
    assert "InteropJob" in scheduled.text and "rubyq" in scheduled.text
    assert ">Run now</button>" in scheduled.text and ">Retry</button>" not in scheduled.text
    found = browser.get(f"/search?q={later}")
    assert later in found.text and jid not in found.text


@pytest.mark.timeout(90)
def test_a_job_ruby_sidekiq_failed_is_shown_and_killed_and_its_process_quieted(
        sidekiq_ruby, browser, redis_url, r, tmp_path):
    hostile = "<script>alert(1)</script>"
    with sidekiq_ruby.server(redis_url, log_path=tmp_path / "sidekiq.log") as sidekiq:
        jid = sidekiq_ruby.push(redis_url, "FailingJob", [hostile])
        wait_until(lambda: r.zcard("retry") == 1, timeout=30, message=f"Sidekiq's retry entry\n{sidekiq.log_tail()}")
        page = browser.get("/retries")
        assert jids_on(page) == [jid]
        assert "ArgumentError" in page.text and "FailingJob always fails" in page.text
        assert hostile not in page.text
        kill = re.search(r'name="do" value="(kill\|[^"]+)"', page.text).group(1)
        browser.post("/retries/action", {"do": kill}, csrf=page.csrf)
        assert r.zcard("retry") == 0 and jid.encode() in r.zrange("dead", 0, -1)[0]

        identity = re.search(r'<tr data-identity="([^"]+)"', browser.get("/processes").text).group(1)
        assert f":{sidekiq.proc.pid}:" in identity
        browser.post("/processes/signal", {"do": f"quiet|identity|{identity}"})
        # Ruby Sidekiq reads its -signals list at its next heartbeat and says it is quiet
        wait_until(lambda: r.hget(identity, "quiet") == b"true", timeout=30, interval=0.1,
                   message=f"Sidekiq quiet\n{sidekiq.log_tail()}")
        assert '<span class="tag quiet">quiet</span>' in browser.get("/processes").text


@pytest.mark.timeout(60)
def test_processes_page_groups_a_real_masters_children(browser, r, redis_url, start_master):
    m = start_master(processes=2)
    m.wait_ready(r)
    page = browser.get("/processes")
    assert page.status == 200
    identities = re.findall(r'<tr data-identity="([^"]+)"', page.text)
    assert len(identities) == 2
    group = re.search(r"master <code>([^<]+)</code>", page.text).group(1)
    assert f":{m.pid}:" in group  # the master's identity names its pid
    for child in m.children():
        assert f'<td class="num">{child}</td>' in page.text
    assert page.text.count('<span class="tag ok">running</span>') == 2


@pytest.mark.timeout(30)
def test_busy_page_lists_running_jobs(browser, r, redis_url):
    heartbeat(r, "web-test:1:aaa")
    work = {"queue": "default", "run_at": int(time.time()) - 5,
            "payload": json.dumps({"class": "SlowJob", "args": ["<b>x</b>"], "jid": "f" * 24})}
    r.hset("web-test:1:aaa:workers", "tid1", json.dumps(work))
    page = browser.get("/busy")
    assert "SlowJob" in page.text and "f" * 24 in page.text
    assert "<b>x</b>" not in page.text and "&lt;b&gt;x&lt;/b&gt;" in page.text


# -- paging and search ----------------------------------------------------------------


@pytest.mark.timeout(30)
def test_dead_pages_newest_first_and_retries_soonest_first(browser, r, redis_url):
    jobs = [dead_job(i) for i in range(60)]
    fill(r, "dead", jobs)
    fill(r, "retry", jobs)
    want = [j["jid"] for j in jobs]
    dead = [jids_on(browser.get(f"/dead?page={n}")) for n in (1, 2, 3)]
    assert [len(p) for p in dead] == [25, 25, 10]
    assert sum(dead, []) == want[::-1]
    assert "page 1 of 3" in browser.get("/dead").text
    retries = [jids_on(browser.get(f"/retries?page={n}")) for n in (1, 2, 3)]
    assert sum(retries, []) == want
    assert jids_on(browser.get("/retries?page=99")) == want[50:]  # past the end: the last page
    assert jids_on(browser.get("/retries?page=nonsense")) == want[:25]


@pytest.mark.timeout(30)
def test_search_finds_by_jid_and_by_class_across_sets(browser, r, redis_url):
    fill(r, "dead", [dead_job(i) for i in range(30)] + [dead_job(100, klass="Other")])
    fill(r, "retry", [dead_job(200, klass="Other")])
    target = dead_job(7)["jid"]
    by_jid = browser.get(f"/search?q={target}")
    assert jids_on(by_jid) == [target]
    by_class = browser.get("/search?q=Other")
    assert sorted(jids_on(by_class)) == sorted([dead_job(100)["jid"], dead_job(200)["jid"]])
    assert jids_on(browser.get("/search?q=NoSuchThing")) == []


@pytest.mark.timeout(30)
def test_a_batch_page_shows_its_counts_and_escaped_failures_and_its_jobs_link_to_it(browser, r, redis_url):
    from forkq import batch
    client = forkq.Client(redis_url)
    b = forkq.Batch(description="import <b>42</b>", client=client)
    with b:
        first, second = client.push_bulk("Import", [[1], [2]])
    batch.record_failure(r, {"bid": b.bid, "jid": first}, "ValueError",
                         "bad <script>x</script>\x1b[31m", "dead")
    fill(r, "dead", [dead_job(1, jid=first, bid=b.bid)])
    page = browser.get(f"/batches/{b.bid}")
    assert page.status == 200, page
    assert "running" in page.text and "import &lt;b&gt;42&lt;/b&gt;" in page.text
    assert "&lt;script&gt;" in page.text and "<script>x" not in page.text and "\x1b" not in page.text
    assert first in page.text and second not in page.text  # only the failed one is listed
    link = f'href="/batches/{b.bid}"'
    assert link in browser.get(job_link(browser.get("/dead"), "dead")).text
    assert link in browser.get(f"/search?q={b.bid}").text
    assert browser.get("/batches/no-such-bid").status == 404


@pytest.mark.timeout(30)
def test_the_batches_page_lists_them_newest_first_escaped_and_linked(browser, r, redis_url):
    from forkq import batch
    client = forkq.Client(redis_url)
    with forkq.Batch(description="plain", client=client) as older:
        jid, _ = client.push_bulk("Import", [[1], [2]])
    batch.record_failure(r, {"bid": older.bid, "jid": jid}, "ValueError", "x", "retry")
    with forkq.Batch(description='<script>alert(1)</script>"\x1b[31m\u202e', client=client) as hostile:
        pass
    r.zadd(keys.BATCHES, {"expired-bid": time.time()})  # newest, but its keys are gone
    page = browser.get("/batches")
    assert page.status == 200, page
    rows = re.findall(r'<a href="/batches/([^"]+)"><code>', page.text)
    assert rows == [hostile.bid, older.bid]
    assert "<script>alert" not in page.text and "\x1b" not in page.text and "\u202e" not in page.text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;&#34;\\u001b[31m\\u202e" in page.text
    assert re.search(r'<td class="num">2</td>\s*<td class="num">2</td>\s*<td class="num">1</td>', page.text)
    assert '<a href="/batches" class="current">Batches</a>' in page.text  # in the nav
    assert '<a href="/batches" class="current">' in browser.get(f"/batches/{older.bid}").text
    succeeded = browser.get("/batches?state=succeeded")
    assert re.findall(r'<a href="/batches/([^"]+)"><code>', succeeded.text) == [hostile.bid]
    assert browser.get("/batches?state=<b>").status == 400
    assert r.zscore(keys.BATCHES, "expired-bid") is None



@pytest.mark.timeout(30)
def test_a_filtered_batches_page_looks_at_the_newest_look_at_batches_and_says_so(browser, r):
    """/batches?state= read the whole index (up to 10,000 batches, 182 round trips)."""
    from forkq import batch
    from test_batch import many_batches
    bids = many_batches(r, ["abandoned"] + ["succeeded"] * batch.LOOK_AT + ["running"])
    page = browser.get("/batches?state=abandoned")
    assert page.status == 200, page
    assert f"No batches abandoned among the newest {batch.LOOK_AT:,} in Redis." in page.text
    assert "More may exist" in page.text and "forkq batches --state abandoned --scan N" in page.text
    running = browser.get("/batches?state=running")
    assert re.findall(r'<a href="/batches/([^"]+)"><code>', running.text) == [bids[-1]]
    assert "More may exist" in running.text
    assert "More may exist" not in browser.get("/batches").text

# -- one job's page -------------------------------------------------------------------


def job_link(page, slug: str) -> str:
    """The first entry's link on a set page, as a path for Client.get."""
    found = re.search(rf'<a href="(/{slug}/[^"]+)" class="job">', page.text)
    assert found, f"no job link on the {slug} page:\n{page.text[:3000]}"
    return found.group(1)


BACKTRACE = ["app/jobs/hard_job.rb:12:in `perform'", "sidekiq/processor.rb:196:in `execute_job'"]


@pytest.mark.timeout(30)
def test_each_set_links_every_entry_to_a_page_with_every_field_and_the_backtrace(browser, r, redis_url):
    job = dead_job(1, queue="mail", args=[1, "two", {"three": 3}], error_message="line one\nline two",
                   error_backtrace=ruby_backtrace(BACKTRACE), retried_at=1700000050.0,
                   bid="b-123", tags=["vip"], backtrace=True)
    for key in ("dead", "retry", "schedule"):
        fill(r, key, [job], base=1800000000.0)
    buttons = {"dead": ["Retry", "Delete"], "retries": ["Retry", "Delete", "Kill"],
               "scheduled": ["Run now", "Delete", "Kill"]}
    scores = {"dead": "Died", "retries": "Next retry", "scheduled": "Scheduled for"}
    for slug in ("dead", "retries", "scheduled"):
        page = browser.get(job_link(browser.get(f"/{slug}"), slug))
        assert page.status == 200
        text = page.text
        assert "<h1>HardJob <small>" in text
        assert '<tr><th>Queue</th><td><a href="/queues/mail">mail</a></td></tr>' in text
        assert "<code>1</code><code>&#34;two&#34;</code><code>{&#34;three&#34;: 3}</code>" in text
        assert f"<code>{job['jid']}</code>" in text
        assert "<tr><th>Created</th><td>2023-11-14 22:13:20 UTC <small>(" in text
        assert "<tr><th>Enqueued</th><td>2023-11-14 22:13:20 UTC" in text
        assert "<tr><th>Failed</th><td>2023-11-14 22:13:21 UTC" in text
        assert "<tr><th>Retried</th><td>2023-11-14 22:14:10 UTC" in text
        assert f"<tr><th>{scores[slug]}</th><td>2027-01-15 08:00:00 UTC" in text
        assert "<tr><th>Retry count</th><td>3</td></tr>" in text
        for extra in ('<tr><th>Batch</th><td><a href="/batches/b-123"><code>b-123</code></a></td></tr>',
                      "<tr><th>tags</th><td><code>[&#34;vip&#34;]</code>",
                      "<tr><th>retry</th><td><code>true</code>"):
            assert extra in text
        assert "<tr><th>Class</th><td>RuntimeError</td></tr>" in text
        assert '<pre class="message">line one\nline two</pre>' in text
        assert ('<pre class="backtrace">app/jobs/hard_job.rb:12:in `perform&#39;\n'
                "sidekiq/processor.rb:196:in `execute_job&#39;\n</pre>") in text
        assert re.findall(r'<button name="do" value="[a-z]+\|[^"]+"[^>]*>([^<]+)</button>', text) == buttons[slug]
        assert '<a href="/' + slug + '" class="current">' in text


@pytest.mark.timeout(60)
def test_a_job_page_shows_the_backtrace_a_real_forkq_worker_stored(browser, r, redis_url, workers):
    workers()
    jid = forkq.Client(redis_url).push("tests.apps.core_jobs.fail_backtrace", ["page"], retry=0,
                                       backtrace=True)
    wait_until(lambda: r.zcard("dead") == 1, timeout=15, message="the job in the dead set")
    page = browser.get(job_link(browser.get("/dead"), "dead"))
    assert f"<code>{jid}</code>" in page.text
    stored = re.search(r'<pre class="backtrace">(.*?)</pre>', page.text, re.S).group(1)
    # the frames, as a Ruby backtrace has them; the message is shown once, as the error's
    assert "in _deep_raise" in stored and "deep page" not in stored
    assert "deep page" in re.search(r'<pre class="message">(.*?)</pre>', page.text, re.S).group(1)


@pytest.mark.timeout(30)
def test_a_job_page_acts_through_the_list_endpoint_and_a_gone_job_is_a_404(browser, r, redis_url):
    fill(r, "dead", [dead_job(1)])
    fill(r, "retry", [dead_job(2)])
    link = job_link(browser.get("/dead"), "dead")
    page = browser.get(link)
    retry = re.search(r'name="do" value="(retry\|[^"]+)"', page.text).group(1)
    assert browser.post("/dead/action", {"do": retry}, csrf="").status == 403  # the guard holds
    assert r.zcard("dead") == 1
    resp = browser.post("/dead/action", {"do": retry, "back": "/dead"}, csrf=page.csrf)
    assert resp.status == 303 and resp.headers["Location"] == "/dead"
    assert r.zcard("dead") == 0 and json.loads(r.lindex("queue:default", 0))["jid"] == dead_job(1)["jid"]
    gone = browser.get(link)
    assert gone.status == 404
    assert "This job is not in Dead any more" in gone.text and '<a href="/dead">' in gone.text
    retry_key = job_link(browser.get("/retries"), "retries").removeprefix("/retries/")
    for path in ("/dead/garbage", "/dead/nan~abc", "/dead/inf~abc", "/retries/1e999~ab",
                 "/dead/" + retry_key,  # a real key, of another set
                 "/dead/" + quote("<script>x</script>")):
        page = browser.get(path)
        assert page.status == 404 and "not in " in page.text and "Traceback" not in page.text, path
        assert "<script>x" not in page.text
    assert browser.get("/retries/" + retry_key).status == 200
    assert browser.post("/retries/" + retry_key, {}).status == 405
    assert browser.get("/dead/action").status == 405  # still the list's endpoint, not a job key


@pytest.mark.timeout(30)
def test_keyword_arguments_show_next_to_the_args_escaped(browser, r, redis_url):
    fill(r, "dead", [dead_job(1, kwargs={"locale": "fr", HOSTILE: [HOSTILE]}), dead_job(2)])
    r.lpush("queue:default", json.dumps(dead_job(3, kwargs={"note": HOSTILE})))
    listing = browser.get("/dead").text
    assert "<code>[1]</code> <code>{&#34;locale&#34;: &#34;fr&#34;, &#34;&lt;script&gt;" in listing
    assert re.search(r"<code>\[2\]</code>\s*<details>", listing)  # no kwargs: the args alone
    assert "<code>{&#34;note&#34;: &#34;&lt;script&gt;" in browser.get("/queues/default").text
    key = re.findall(r'<a href="/dead/([^"]+)" class="job">', listing)[-1]  # job 1: the oldest
    page = browser.get(f"/dead/{key}").text
    assert "<tr><th>Keyword arguments</th>" in page
    assert "<code>locale=&#34;fr&#34;</code>" in page
    assert "<code>&lt;script&gt;alert(&#34;x&#34;)" in page and "<script>alert" not in page
    assert "<th>kwargs</th>" not in page  # a row of its own, not among the other fields


@pytest.mark.timeout(30)
def test_a_job_page_escapes_hostile_fields_and_caps_huge_ones(browser, r, redis_url):
    hostile = dead_job(1, klass=HOSTILE, queue=HOSTILE, args=[HOSTILE, "\x1b[1mbold"],
                       error_class=HOSTILE, error_message=HOSTILE, jid=HOSTILE,
                       error_backtrace=ruby_backtrace([HOSTILE, "\u202eevil"]),
                       **{HOSTILE: HOSTILE}, failed_at=float("nan"), created_at="yesterday")
    huge = dead_job(2, args=["x" * 1_000_000] + list(range(5_000)), error_message="y" * 500_000,
                    **{f"extra{i:05}": i for i in range(20_000)})
    bomb = dead_job(3, error_backtrace=base64.b64encode(zlib.compress(b"[" * (64 << 20))).decode())
    broken = dead_job(4, error_backtrace="not base64 or zlib")
    fill(r, "dead", [hostile, huge, bomb, broken])
    r.zadd("dead", {b"\xff<script>not json": time.time()})
    pages = [browser.get(f"/dead/{key}") for key in
             re.findall(r'<a href="/dead/([^"]+)" class="job">', browser.get("/dead").text)]
    assert [p.status for p in pages] == [200] * 5
    assert len(browser.get("/dead").text) < 600_000  # the list's payloads are cut too
    for page in pages:
        assert "<script>alert" not in page.text and "<img src=x" not in page.text
        assert "<script>not" not in page.text and "\x1b" not in page.text and "\u202e" not in page.text
        assert len(page.text) < 400_000
    unparseable, broken_page, bomb_page, huge_page, hostile_page = pages  # newest first
    assert '<span class="tag bad">unparseable</span>' in unparseable.text
    assert "&lt;script&gt;not json" in unparseable.text
    text = hostile_page.text
    assert f"<th>{HOSTILE}</th>" not in text and "<th>&lt;script&gt;alert(&#34;x&#34;)" in text
    assert "<code>&#34;\\u001b[1mbold&#34;</code>" in text  # the argument's escape as written
    assert "\\u202eevil" in text  # the bidi override written out, not obeyed
    assert '<pre class="backtrace">&lt;script&gt;' in text
    assert "<tr><th>Failed</th><td><code>NaN</code>" in text
    assert "<tr><th>Created</th><td><code>&#34;yesterday&#34;</code>" in text
    text = huge_page.text
    assert "(990,002 more characters)" in text  # the 1,000,000 x and their quotes, after 10,000
    assert "… and 4,901 more arguments" in text
    assert "(490,000 more characters)" in text  # the message
    assert "<th>extra00199</th>" in text and "<th>extra00200</th>" not in text
    assert "and 19,801 more fields" in text  # the 20,000, and `retry`, less the 200 shown
    assert "The backtrace inflates to more than 1,048,576 bytes: not shown." in bomb_page.text
    assert "The backtrace cannot be decoded" in broken_page.text


# -- a queue's jobs ---------------------------------------------------------------------


def slowlog_lranges(r) -> list[tuple[int, int]]:
    """The (start, stop) of every LRANGE the slow log saw (it logs every command while
    slowlog-log-slower-than is 0)."""
    return [(int(e["command"].split()[2]), int(e["command"].split()[3]))
            for e in r.slowlog_get(1000) if e["command"].startswith(b"LRANGE")]


@pytest.mark.timeout(30)
def test_a_queue_page_pages_through_its_jobs_and_never_reads_the_whole_list(browser, r, redis_url):
    c = forkq.Client(redis_url)
    jids = [c.push("app.Mail", [i], queue="mail") for i in range(60)]
    c.push("app.Other", [1], queue="other")
    r.sadd("queues", "idle")  # a queue with nothing in it now
    listing = browser.get("/queues")
    assert re.search(r'<td><a href="/queues/mail">mail</a></td><td class="num">60</td>', listing.text)
    assert '<a href="/queues/idle">idle</a>' in listing.text
    assert '<a href="/queues" class="current">Queues</a>' in listing.text
    r.config_set("slowlog-log-slower-than", 0)
    try:
        r.slowlog_reset()
        newest = [jids_on(browser.get(f"/queues/mail?page={n}")) for n in (1, 2, 3)]
        oldest = [jids_on(browser.get(f"/queues/mail?direction=asc&page={n}")) for n in (1, 2, 3)]
        ranges = slowlog_lranges(r)
    finally:
        r.config_set("slowlog-log-slower-than", 10000)
    assert [len(p) for p in newest] == [25, 25, 10]
    assert sum(newest, []) == jids[::-1]  # as Sidekiq shows a queue: the last pushed first
    assert sum(oldest, []) == jids  # the next to run first
    assert len(ranges) == 6 and all(stop - start == 24 for start, stop in ranges), ranges
    page = browser.get("/queues/mail?direction=asc&page=2")
    assert "page 2 of 3" in page.text
    assert 'href="/queues/mail?direction=asc&amp;page=3" rel="next"' in page.text
    assert jids_on(browser.get("/queues/mail?page=99")) == jids[9::-1]  # past the end: the last page
    assert "This queue is empty." in browser.get("/queues/idle").text
    missing = browser.get("/queues/nosuch")
    assert missing.status == 404 and "There is no queue named nosuch." in missing.text
    # every list that names a queue links to it
    fill(r, "dead", [dead_job(1, queue="mail")])
    assert '<td><a href="/queues/mail">mail</a></td>' in browser.get("/dead").text
    assert '<a href="/queues/other">other</a>' in browser.get("/").text


@pytest.mark.timeout(30)
def test_crash_suspects_are_counted_per_queue_and_listed_escaped_on_the_queue_page(browser, r, redis_url):
    c = forkq.Client(redis_url)
    queued = c.push("app.Mail", [1], queue="mail")
    c.push("app.Other", [1], queue="other")
    assert "Suspects" not in browser.get("/queues").text  # no column while there are none
    # as a dead child leaves them: on the queue's suspects list, each with a crash count
    hostile = {"class": HOSTILE, "args": [HOSTILE], "jid": "a" * 24, "queue": "mail", "enqueued_at": 1700000000.0}
    plain = {"class": "app.Mail", "args": [2], "jid": "b" * 24, "queue": "mail", "enqueued_at": 1700000000.0}
    r.lpush(keys.suspects("mail"), json.dumps(plain), json.dumps(hostile))
    r.set(keys.CRASH_PREFIX + "b" * 24, 2)
    r.set(keys.CRASH_PREFIX + "a" * 24, 1)
    r.lpush(keys.suspects("gone"), json.dumps(dict(plain, queue="gone")))  # not in `queues`

    row = r'<td><a href="/queues/{}">{}</a></td><td class="num">1</td><td class="num{}">{}</td>'
    overview = browser.get("/").text
    assert '<table id="queue-table">' in overview  # the column is not hidden
    assert re.search(row.format("mail", "mail", " suspects", 2), overview), overview
    assert re.search(row.format("other", "other", " suspects", 0), overview)
    listing = browser.get("/queues").text
    assert re.search(row.format("mail", "mail", "", 2), listing), listing
    stats = browser.get("/stats.json").json()
    assert stats["suspects"] == 2 and {q["name"]: q["suspects"] for q in stats["queues"]} == {"mail": 2, "other": 0}

    page = browser.get("/queues/mail")
    assert '<a href="#suspects">2 crash suspects</a>' in page.text
    # next to run first (the rightmost), each with its crash count; payload text escaped
    assert re.findall(r'<tr data-suspect="([^"]*)"', page.text) == ["b" * 24, "a" * 24]
    assert re.findall(r'<td class="num">(\d+)</td>\s*</tr>', page.text) == ["2", "1"]
    assert "<script>alert" not in page.text and "&lt;script&gt;alert(" in page.text
    assert jids_on(page) == [queued]  # the queued job, listed apart
    # a queue someone took out of the `queues` set still shows the suspects it has left
    gone = browser.get("/queues/gone")
    assert gone.status == 200 and "1 crash suspect</a>" in gone.text
    assert browser.get("/queues/nosuch").status == 404


@pytest.mark.timeout(30)
def test_deleting_a_queued_job_removes_exactly_that_job_even_after_the_queue_moved(browser, r, redis_url):
    c = forkq.Client(redis_url)
    name = "odd name/with%?#"
    jids = [c.push("app.Mail", [i], queue=name) for i in range(5)]
    path = "/queues/" + quote(name)
    page = browser.get(path + "?page=1")
    assert jids_on(page) == jids[::-1]
    target = jids[2]
    row = page.text[page.text.index(f'<tr data-jid="{target}">'):]
    button = re.search(r'name="do" value="(delete\|[^"]+)"', row).group(1)
    back = re.search(r'name="back" value="([^"]+)"', page.text).group(1)
    assert browser.post(path, {"do": button}, csrf="").status == 403
    assert r.llen("queue:" + name) == 5
    more = [c.push("app.Mail", [i], queue=name) for i in range(5, 25)]  # its index moves on
    r.rpop("queue:" + name)  # and a worker takes the oldest
    resp = browser.post(path, {"do": button, "back": back}, csrf=page.csrf)
    assert resp.status == 303 and resp.headers["Location"] == path + "?page=1"
    left = [json.loads(raw)["jid"] for raw in r.lrange("queue:" + name, 0, -1)]
    assert left == [j for j in (jids + more)[::-1] if j not in (target, jids[0])]
    assert "delete: 1 job" in browser.get(path).text
    assert browser.post(path, {"do": button}, csrf=page.csrf).status == 303  # gone: nothing more
    assert r.llen("queue:" + name) == 23
    assert "delete: 0 jobs" in browser.get(path).text
    for bad in ("garbage", "²~ab", "9" * 40 + "~ab", "-1~ab"):
        assert browser.post(path, {"do": f"delete|{bad}"}, csrf=page.csrf).status == 303, bad
    assert browser.post(path, {"do": "explode|0~ab"}, csrf=page.csrf).status == 400
    assert r.llen("queue:" + name) == 23



@pytest.mark.timeout(30)
def test_a_queued_job_pushed_far_past_its_page_is_still_found_and_deleted(browser, r, redis_url):
    c = forkq.Client(redis_url)
    target = c.push("app.Mail", ["target"], queue="busy")
    page = browser.get("/queues/busy")
    button = re.search(r'name="do" value="(delete\|[^"]+)"', page.text).group(1)
    # a busy queue: 5,000 newer jobs since the page was read, past the lookup's first window
    c.push_bulk("app.Mail", [[i] for i in range(5_000)], queue="busy")
    assert browser.post("/queues/busy", {"do": button}, csrf=page.csrf).status == 303
    left = [json.loads(raw)["jid"] for raw in r.lrange("queue:busy", 0, -1)]
    assert len(left) == 5_000 and target not in left

# -- state changes: POST + CSRF -------------------------------------------------------


@pytest.mark.timeout(30)
def test_post_without_csrf_is_rejected_and_nothing_changes(browser, r, redis_url):
    fill(r, "dead", [dead_job(i) for i in range(5)])
    page = browser.get("/dead")
    assert page.status == 200
    attempts = [
        browser.post("/dead/action", {"bulk": "delete-all"}, csrf=""),                  # no token
        browser.post("/dead/action", {"bulk": "delete-all"}, csrf=page.csrf + "x"),     # forged
        browser.post("/dead/action", {"bulk": "delete-all"}, csrf=page.csrf,            # other site
                     headers={"Origin": "http://evil.example"}),
        browser.post("/dead/action", {"bulk": "delete-all"}, csrf=page.csrf,
                     headers={"Sec-Fetch-Site": "cross-site"}),
        Client(browser_base(browser)).post("/dead/action", {"bulk": "delete-all"},     # no cookie
                                           csrf=page.csrf),
    ]
    assert [p.status for p in attempts] == [403] * 5
    assert r.zcard("dead") == 5
    assert browser.get("/dead/action").status == 405  # a GET never acts
    assert r.zcard("dead") == 5


def browser_base(c: Client) -> str:
    return f"http://{c.host}:{c.port}{c.prefix}"


@pytest.mark.timeout(30)
def test_retry_delete_and_kill_buttons_change_redis(browser, r, redis_url):
    fill(r, "dead", [dead_job(i) for i in range(3)])
    fill(r, "retry", [dead_job(i) for i in range(10, 14)])
    dead_page = browser.get("/dead")
    retry_btn = re.search(r'name="do" value="(retry\|[^"]+)"', dead_page.text).group(1)
    resp = browser.post("/dead/action", {"do": retry_btn, "back": "/dead"}, csrf=dead_page.csrf)
    assert resp.status == 303 and resp.headers["Location"] == "/dead"
    assert r.zcard("dead") == 2 and r.llen("queue:default") == 1
    moved = json.loads(r.lindex("queue:default", 0))
    assert moved["jid"] == dead_job(2)["jid"]  # the newest dead job is the first row
    assert "retry: 1 job" in browser.get("/dead").text  # the flash message

    page = browser.get("/retries")
    keys = re.findall(r'name="key" value="([^"]+)"', page.text)
    browser.post("/retries/action", [("bulk", "kill"), ("key", keys[0]), ("key", keys[1])], csrf=page.csrf)
    assert r.zcard("retry") == 2 and r.zcard("dead") == 4
    page = browser.get("/retries")
    delete_btn = re.search(r'name="do" value="(delete\|[^"]+)"', page.text).group(1)
    browser.post("/retries/action", {"do": delete_btn}, csrf=page.csrf)
    assert r.zcard("retry") == 1
    browser.post("/dead/action", {"bulk": "retry-all"}, csrf=page.csrf)
    assert r.zcard("dead") == 0 and r.llen("queue:default") == 5
    browser.post("/retries/action", {"bulk": "delete-all"}, csrf=page.csrf)
    assert r.zcard("retry") == 0


@pytest.mark.timeout(30)
def test_a_stale_button_for_a_job_already_gone_changes_nothing(browser, r, redis_url):
    fill(r, "dead", [dead_job(1)])
    page = browser.get("/dead")
    btn = re.search(r'name="do" value="(retry\|[^"]+)"', page.text).group(1)
    r.delete("dead")
    resp = browser.post("/dead/action", {"do": btn}, csrf=page.csrf)
    assert resp.status == 303 and r.llen("queue:default") == 0
    assert browser.post("/dead/action", {"do": "retry|garbage"}, csrf=page.csrf).status == 303
    assert browser.post("/dead/action", {"do": "kill|1.0~ab"}, csrf=page.csrf).status == 400  # dead can't be killed


@pytest.mark.timeout(30)
def test_quiet_and_stop_land_on_the_signals_lists(browser, r, redis_url):
    for slot in (0, 1):
        heartbeat(r, f"web-test:10{slot}:kid", master="web-test:100:boss", slot=slot)
    heartbeat(r, "web-test:200:alone")
    page = browser.get("/processes")
    assert "Quiet all" in page.text
    browser.post("/processes/signal", {"do": "quiet|master|web-test:100:boss"}, csrf=page.csrf)
    assert r.lrange("web-test:100:kid-signals", 0, -1) == [b"TSTP"]
    assert r.lrange("web-test:101:kid-signals", 0, -1) == [b"TSTP"]
    assert r.llen("web-test:200:alone-signals") == 0
    resp = browser.post("/processes/signal", {"do": "stop|identity|web-test:200:alone"}, csrf=page.csrf)
    assert resp.status == 303
    assert r.lrange("web-test:200:alone-signals", 0, -1) == [b"TERM"]
    assert r.ttl("web-test:200:alone-signals") > 0
    assert "stop: signalled 1 process" in browser.get("/processes").text
    assert browser.post("/processes/signal", {"do": "explode|identity|x"}, csrf=page.csrf).status == 400


# -- security: escaping, headers, auth, bind ------------------------------------------


@pytest.mark.timeout(10)
def test_only_loopback_addresses_count_as_loopback():
    from forkq.web.security import is_loopback
    assert all(map(is_loopback, ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "10.0.0.1", "192.0.2.1", "example.com",
                                     "localhost.example.com", "127.0.0.1.nip.io", ""]))


HOSTILE = '<script>alert("x")</script><img src=x onerror=alert(1)>'


@pytest.mark.timeout(30)
def test_hostile_payload_text_is_escaped_everywhere(browser, r, redis_url):
    job = dead_job(1, klass=HOSTILE, queue="q<i>", args=[HOSTILE, {"k": HOSTILE}],
                   error_class=HOSTILE, error_message=HOSTILE, jid=HOSTILE)
    fill(r, "dead", [job])
    fill(r, "retry", [job])
    r.zadd("schedule", {b"\xff<script>not json": 1})
    r.sadd("queues", HOSTILE)
    r.lpush("queue:" + HOSTILE, json.dumps(job), b"\xff<script>not json")
    pages = [browser.get(p) for p in ("/", "/dead", "/retries", "/scheduled", "/search?q=" + quote(HOSTILE),
                                      "/queues", "/queues/" + quote(HOSTILE))]
    for page in pages:
        assert page.status == 200
        assert "<script>alert" not in page.text and "<img src=x" not in page.text
        assert "<script>not" not in page.text
    assert "&lt;script&gt;alert(" in pages[1].text
    headers = pages[1].headers
    assert "script-src 'self'" in headers["Content-Security-Policy"]
    assert "frame-ancestors 'none'" in headers["Content-Security-Policy"]
    assert headers["X-Frame-Options"] == "DENY"
    assert headers["Cache-Control"] == "no-store"
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert "<script>" not in re.sub(r'<script src="[^"]+" defer></script>', "", pages[1].text)


@pytest.mark.timeout(30)
def test_odd_payload_text_and_scores_are_shown_not_crashed_on(browser, r, redis_url):
    # json.dumps writes the lone surrogate as the escape "\\ud800" and NaN as NaN, as a
    # careless client would; json.loads (and so forkq) reads both back
    job = dead_job(1, args=["\ud800", "\u202eevil"], error_message="\x1b[31mred\x1b[0m",
                   failed_at=float("nan"))
    r.zadd("dead", {json.dumps(job): time.time()})
    r.zadd("retry", {json.dumps(dead_job(2)): float("inf")})
    r.zadd("schedule", {'{"class":"Deep","args":' + "[" * 1020 + "]" * 1020 + "}": time.time()})
    pages = {p: browser.get(p) for p in ("/dead", "/retries", "/scheduled")}
    assert {p: page.status for p, page in pages.items()} == dict.fromkeys(pages, 200)
    dead = pages["/dead"].text
    assert "\\u001b[31mred\\u001b[0m" in dead and "\x1b" not in dead  # ANSI codes written out
    assert "\\ud800" in dead and "\\u202eevil" in dead and "\u202e" not in dead
    assert jids_on(pages["/retries"]) == [dead_job(2)["jid"]]
    assert "Deep" in pages["/scheduled"].text


@pytest.mark.timeout(30)
def test_non_loopback_bind_refuses_without_a_password_or_token(redis_url):
    for bind in ("0.0.0.0", "::", "192.0.2.1", "example.com"):
        out = run_forkq("web", "--bind", bind, "--port", "1", "--redis-url", redis_url)
        assert out.returncode != 0
        assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
        assert "--password or --token" in out.stderr
    out = run_forkq("web", "--port", "http")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "--port" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.timeout(40)
def test_a_taken_port_is_one_line_and_term_stops_cleanly(redis_url):
    with WebServer(redis_url) as web:
        out = run_forkq("web", "--port", str(web.port), "--redis-url", redis_url)
        assert out.returncode == 1 and out.stdout == ""
        assert out.stderr.strip().splitlines() == [f"forkq: cannot listen on 127.0.0.1:{web.port}: "
                                                   "Address already in use"]
        assert web.stop() == 0


@pytest.mark.timeout(40)
def test_password_means_basic_auth_on_every_page(redis_url, r):
    fill(r, "dead", [dead_job(1)])
    with WebServer(redis_url, "--bind", "0.0.0.0", env={"FORKQ_WEB_PASSWORD": "s3cret"}) as web:
        anon = Client(web.base)
        for path in ("/", "/dead", "/stats.json", "/no-such-page"):
            page = anon.get(path)
            assert page.status == 401 and page.headers["WWW-Authenticate"].startswith("Basic")
        assert anon.post("/dead/action", {"bulk": "delete-all"}, csrf="x").status == 401
        assert Client(web.base, auth=("admin", "wrong")).get("/").status == 401
        good = Client(web.base, auth=("anyone", "s3cret"))
        assert good.get("/dead").status == 200
        good.post("/dead/action", {"bulk": "delete-all"})
        assert r.zcard("dead") == 0


@pytest.mark.timeout(40)
def test_token_works_as_bearer_or_through_the_login_form(redis_url, r):
    with WebServer(redis_url, "--token", "tok-123") as web:
        anon = Client(web.base)
        resp = anon.get("/dead")
        assert resp.status == 303 and resp.headers["Location"] == "/login"
        assert anon.get("/stats.json").status == 401
        assert Client(web.base, bearer="nope").get("/stats.json").status == 401
        assert Client(web.base, bearer="tok-123").get("/stats.json").status == 200
        login = anon.get("/login")
        assert anon.post("/login", {"token": "wrong"}, csrf=login.csrf).status == 401
        assert anon.post("/login", {"token": "tok-123"}, csrf="").status == 403  # CSRF here too
        resp = anon.post("/login", {"token": "tok-123"}, csrf=login.csrf)
        assert resp.status == 303 and "forkq_session" in anon.cookies
        assert anon.get("/dead").status == 200
        anon.post("/logout", {}, csrf=anon.get("/").csrf)
        assert anon.get("/dead").status == 303


@pytest.mark.timeout(60)
def test_wrong_passwords_from_one_address_are_refused_for_a_window_on_every_server(redis_url, r):
    env = {"FORKQ_WEB_PASSWORD": "s3cret"}
    with WebServer(redis_url, "--login-limit", "3", env=env) as one, \
            WebServer(redis_url, "--login-limit", "3", env=env) as two:
        assert Client(one.base, auth=("a", "guess1")).get("/").status == 401
        assert Client(two.base, auth=("a", "guess2")).get("/").status == 401
        assert Client(one.base, auth=("a", "guess3")).get("/").status == 401
        # the count is in Redis: the fourth try is refused on either server
        for web in (one, two):
            refused = Client(web.base, auth=("a", "guess4")).get("/")
            assert refused.status == 429 and 0 < int(refused.headers["Retry-After"]) <= 60
            # the right password too, for the rest of the window: no guess can be confirmed
            assert Client(web.base, auth=("a", "s3cret")).get("/").status == 429
        # a visit without credentials is no guess: it still gets the challenge
        assert Client(one.base).get("/").status == 401
        (key,) = r.keys("forkq:web:auth-failures:*")
        assert key == b"forkq:web:auth-failures:127.0.0.1" and 0 < r.ttl(key) <= 60
        r.delete(key)  # the window ends
        assert Client(two.base, auth=("a", "s3cret")).get("/").status == 200


@pytest.mark.timeout(40)
def test_wrong_tokens_at_the_login_form_are_limited_and_the_limit_can_be_turned_off(redis_url, r):
    with WebServer(redis_url, "--token", "tok-123", "--login-limit", "2") as web:
        stale = Client(web.base)
        stale.cookies["forkq_session"] = "from-an-old-login"
        for _ in range(4):  # a page left open, refreshing: not guesses, never refused
            assert stale.get("/stats.json").status == 401
        browser = Client(web.base)
        csrf = browser.get("/login").csrf
        assert browser.post("/login", {"token": "a"}, csrf=csrf).status == 401
        assert browser.post("/login", {"token": "b"}, csrf=csrf).status == 401
        assert browser.post("/login", {"token": "tok-123"}, csrf=csrf).status == 429
        assert Client(web.base, bearer="tok-123").get("/stats.json").status == 429
    r.flushall()
    with WebServer(redis_url, "--token", "tok-123", "--login-limit", "0") as web:
        for guess in range(15):
            assert Client(web.base, bearer=f"no-{guess}").get("/stats.json").status == 401
        assert Client(web.base, bearer="tok-123").get("/stats.json").status == 200
        assert not r.keys("forkq:web:auth-failures:*")
    out = run_forkq("web", "--login-limit", "-1")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "--login-limit must be at least 0" in out.stderr


# -- mounted under a prefix ----------------------------------------------------------


def _links(text: str) -> list[str]:
    return re.findall(r'(?:href|src|action)="([^"]+)"', text)


@pytest.mark.timeout(40)
def test_url_prefix_puts_the_prefix_on_every_link_and_form(redis_url, r):
    fill(r, "dead", [dead_job(i) for i in range(30)])
    forkq.Client(redis_url).push("app.Mail", [1])
    with WebServer(redis_url, "--url-prefix", "/ops/forkq", prefix="/ops/forkq") as web:
        browser = Client(web.base)
        page = browser.get("/dead")
        assert page.status == 200
        links = _links(page.text)
        assert links and all(link.startswith("/ops/forkq/") for link in links), links
        assert "/ops/forkq/dead?page=2" in links
        assert "Path=/ops/forkq/" in page.headers["Set-Cookie"]
        for other in (browser.get(job_link(page, "ops/forkq/dead").removeprefix("/ops/forkq")),
                      browser.get("/queues"), browser.get("/queues/default")):
            assert other.status == 200
            links = _links(other.text)
            assert links and all(link.startswith("/ops/forkq/") for link in links), links
        resp = browser.post("/dead/action", {"bulk": "retry-all", "back": "/dead?page=2"}, csrf=page.csrf)
        assert resp.status == 303 and resp.headers["Location"] == "/ops/forkq/dead?page=2"
        assert r.zcard("dead") == 0


MOUNTED = """
import sys, waitress
from forkq.web import make_app, mount
def site(environ, start_response):
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"the host site"]
dashboard = make_app(sys.argv[1], authorize=lambda environ: environ.get("HTTP_X_ADMIN") == "yes")
waitress.serve(mount(site, "/admin/jobs", dashboard), host="127.0.0.1",
               port=int(sys.argv[2]), _quiet=True)
"""


@pytest.mark.timeout(40)
def test_mount_serves_the_dashboard_inside_another_wsgi_app(redis_url, r):
    fill(r, "retry", [dead_job(1)])
    server = WebServer(redis_url, prefix="/admin/jobs")
    server.cmd = [sys.executable, "-c", MOUNTED, redis_url, str(server.port)]
    with server as web:
        browser = Client(web.base)
        admin = {"X-Admin": "yes"}  # what the host site's own login check looks at
        assert browser.get("/retries").status == 403  # authorize() said no
        page = browser.get("/retries", headers=admin)
        links = _links(page.text)
        assert all(link.startswith("/admin/jobs/") for link in links), links
        assert jids_on(page) == [dead_job(1)["jid"]]
        assert browser.post("/retries/action", {"bulk": "kill-all"}, csrf=page.csrf).status == 403
        assert r.zcard("retry") == 1
        browser.post("/retries/action", {"bulk": "kill-all"}, csrf=page.csrf, headers=admin)
        assert r.zcard("dead") == 1
        outer = Client(f"http://127.0.0.1:{web.port}")
        assert outer.get("/elsewhere").text == "the host site"


@pytest.mark.timeout(30)
def test_redis_down_is_a_readable_503(redis_url, own_redis):
    url = own_redis.url
    with WebServer(url) as web:
        own_redis.stop()
        page = Client(web.base).get("/dead")
        assert page.status == 503 and "cannot reach Redis" in page.text
        assert "Traceback" not in page.text


@pytest.mark.timeout(30)
def test_a_key_of_the_wrong_type_is_a_readable_500(browser, r, redis_url):
    r.set("dead", "not a sorted set")
    page = browser.get("/dead")
    assert page.status == 500 and "Redis answered: WRONGTYPE" in page.text
    assert browser.get("/retries").status == 200


@pytest.mark.timeout(30)
def test_pause_and_resume_buttons_pause_the_queue_and_show_who_and_why(browser, r, redis_url):
    forkq.Client(redis_url).push("app.Mail", ["x"], queue="mailq")
    page = browser.get("/queues")
    assert 'value="pause"' in page.text and "paused" not in page.text
    hostile = "<script>alert(1)</script> provider down"
    resp = browser.post("/queues/mailq", {"do": "pause", "reason": hostile, "back": "/queues"},
                        csrf=page.csrf)
    assert resp.status == 303 and resp.headers["Location"] == "/queues"
    record = json.loads(r.hget("forkq:paused", "mailq"))
    assert record["reason"] == hostile and record["by"].startswith("dashboard (")
    listing = browser.get("/queues")
    assert 'value="resume"' in listing.text and ">paused<" in listing.text
    assert "<script>" not in listing.text
    one = browser.get("/queues/mailq")
    assert 'id="paused"' in one.text and "provider down" in one.text and "<script>" not in one.text
    browser.post("/queues/mailq", {"do": "resume"}, csrf=one.csrf)
    assert not r.hexists("forkq:paused", "mailq")
    assert r.llen("queue:mailq") == 1  # pausing and resuming touch no job
    # a queue paused before anything was pushed to it has a page, not a 404
    browser.post("/queues/later", {"do": "pause"}, csrf=one.csrf)
    assert browser.get("/queues/later").status == 200
