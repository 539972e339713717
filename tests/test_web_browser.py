"""The dashboard in a real browser: Debian's headless Chromium driven through selenium and
chromedriver, against a real `forkq web` and a real Redis (and a real forkq for Quiet).

Skipped, saying why, when chromium, chromedriver or selenium is missing
(`apt-get install -y chromium chromium-driver`; .ci/run does this).
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time

import pytest

from helpers import wait_until
from test_ctl import start_master  # noqa: F401  (a fixture)
from webkit import WebServer, ruby_backtrace

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
CHROME_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", "--window-size=1280,900"]


def _missing() -> str | None:
    if not shutil.which(CHROMIUM):
        return f"{CHROMIUM} is missing: apt-get install -y chromium chromium-driver"
    if not shutil.which(CHROMEDRIVER):
        return "chromedriver is missing: apt-get install -y chromium-driver"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed: pip install -e '.[test]'"
    return None


pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))


@pytest.fixture(scope="module")
def _chromium():
    """One headless Chromium (its own profile directory) for the module: each start took
    about a second."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    profile = tempfile.mkdtemp(prefix="forkq-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROME_FLAGS + [f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(20)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
def chrome(_chromium):
    """The module's Chromium, as a test would find a new one: no cookies (the last test's
    flash message or CSRF token) and nothing in its console log. Left on a blank page, so
    that the last page's script stops polling a server that is gone."""
    _chromium.execute_cdp_cmd("Network.clearBrowserCookies", {})
    console_errors(_chromium)  # reading the log empties it
    try:
        yield _chromium
    finally:
        _chromium.get("about:blank")


@pytest.fixture
def web(redis_url):
    with WebServer(redis_url) as server:
        yield server


def console_errors(driver) -> list[str]:
    try:
        return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    except Exception:  # not every driver keeps a console log
        return []


@pytest.mark.timeout(60)
def test_overview_chart_gets_data_points_and_shows_the_rate(chrome, web, r):
    from selenium.webdriver.common.by import By
    chrome.get(web.base + "/")
    canvas = chrome.find_element(By.ID, "rate-chart")

    def busy_and_charted():
        r.incrby("stat:processed", 50)  # as if workers were finishing jobs between polls
        # the first point needs 3.5 s of polls (one every 2 s); a second makes a line
        return int(canvas.get_attribute("data-points") or 0) >= 2
    wait_until(busy_and_charted, timeout=30, interval=0.2, message="two chart points")
    rate = chrome.find_element(By.ID, "rate-now").text
    assert re.match(r"[0-9.]+ processed/s", rate) and not rate.startswith("0.0 "), rate
    # the live totals follow Redis too
    shown = chrome.find_element(By.CSS_SELECTOR, '[data-stat="processed"]').text.replace(",", "")
    assert int(shown) > 0
    # something was drawn: the canvas is not one flat colour
    painted = chrome.execute_script(
        "var c = document.getElementById('rate-chart'), d = c.getContext('2d')"
        ".getImageData(0, 0, c.width, c.height).data, seen = {};"
        "for (var i = 0; i < d.length; i += 4 * 97) seen[d[i] + ',' + d[i+1] + ',' + d[i+2]] = 1;"
        "return Object.keys(seen).length;")
    assert painted > 2
    assert console_errors(chrome) == []


@pytest.mark.timeout(60)
def test_overview_queue_table_follows_redis_and_treats_names_as_text(chrome, web, r, redis_url):
    from selenium.webdriver.common.by import By
    import forkq
    from forkq import keys
    chrome.get(web.base + "/")
    name = "<b>late</b>"
    forkq.Client(redis_url).push("Anything", [1], queue=name)

    def cells() -> list[str]:
        # read in one script: the poll replaces the rows every 2 s, so cells found in one
        # call may be gone (stale) by the next
        return chrome.execute_script(
            "return Array.from(document.querySelectorAll('#queue-rows td'), td => td.textContent)")
    wait_until(lambda: cells()[:2] == [name, "1"], timeout=15, interval=0.2,
               message="the new queue in the live table")
    assert chrome.find_elements(By.CSS_SELECTOR, "#queue-rows b") == []
    # the Suspects column stays hidden until a queue has crash suspects, then shows live
    column = chrome.find_element(By.CSS_SELECTOR, "#queue-table th.suspects")  # not redrawn
    assert not column.is_displayed()
    r.lpush(keys.suspects(name), json.dumps({"class": "Anything", "args": [2], "jid": "s" * 24}))
    wait_until(lambda: column.is_displayed() and cells()[:3] == [name, "1", "1"], timeout=15,
               interval=0.2, message="the Suspects column in the live table")


@pytest.mark.timeout(60)
def test_clicking_retry_on_the_dead_page_moves_the_job(chrome, web, r):
    from selenium.webdriver.common.by import By
    job = {"class": "HardJob", "args": [1], "jid": "b" * 24, "queue": "mail", "retry": True,
           "error_class": "RuntimeError", "error_message": "boom", "retry_count": 25,
           "failed_at": time.time() - 60, "enqueued_at": time.time() - 120}
    r.zadd("dead", {json.dumps(job): time.time() - 60})
    chrome.get(web.base + "/dead")
    row = chrome.find_element(By.CSS_SELECTOR, f'tr[data-jid="{"b" * 24}"]')
    row.find_element(By.CSS_SELECTOR, 'button[value^="retry|"]').click()
    wait_until(lambda: r.llen("queue:mail") == 1, timeout=15, message="the job back on queue:mail")
    assert r.zcard("dead") == 0
    assert json.loads(r.lindex("queue:mail", 0))["jid"] == "b" * 24
    wait_until(lambda: "retry: 1 job" in chrome.page_source, timeout=10, message="the flash message")
    assert chrome.current_url.rstrip("/").endswith("/dead")


BACKTRACE = ["app/jobs/hard_job.rb:12:in `perform'", "<script>alert(1)</script>",
             "sidekiq/processor.rb:196:in `execute_job'"]


def dead_entry(r, jid: str) -> None:
    job = {"class": "HardJob", "args": [1, "<b>two</b>"], "jid": jid, "queue": "mail", "retry": True,
           "error_class": "RuntimeError", "error_message": "boom", "retry_count": 25,
           "failed_at": time.time() - 60, "enqueued_at": time.time() - 120,
           "backtrace": True, "error_backtrace": ruby_backtrace(BACKTRACE)}
    r.zadd("dead", {json.dumps(job): time.time() - 60})


@pytest.mark.timeout(60)
def test_a_dead_jobs_page_shows_its_decoded_backtrace_and_retries_it(chrome, web, r):
    from selenium.webdriver.common.by import By
    dead_entry(r, "c" * 24)
    chrome.get(web.base + "/dead")
    chrome.find_element(By.CSS_SELECTOR, f'tr[data-jid="{"c" * 24}"] a.job').click()
    wait_until(lambda: "/dead/" in chrome.current_url, timeout=10, message="the job's page")
    assert chrome.find_element(By.TAG_NAME, "h1").text == "HardJob in Dead"
    assert chrome.find_element(By.CSS_SELECTOR, "pre.backtrace").text == "\n".join(BACKTRACE)
    assert chrome.find_elements(By.CSS_SELECTOR, "pre.backtrace script") == []
    cells = {row.find_element(By.TAG_NAME, "th").text: row.find_element(By.TAG_NAME, "td").text
             for row in chrome.find_elements(By.CSS_SELECTOR, "table.job tr")}
    assert cells["JID"] == "c" * 24 and cells["Queue"] == "mail" and cells["Retry count"] == "25"
    assert cells["Arguments"].split("\n") == ["1", '"<b>two</b>"']
    assert cells["Message"] == "boom" and cells["backtrace"] == "true"
    assert console_errors(chrome) == []
    chrome.find_element(By.CSS_SELECTOR, 'form.job-actions button[value^="retry|"]').click()
    wait_until(lambda: "retry: 1 job" in chrome.page_source, timeout=10, message="the flash message")
    assert chrome.current_url.rstrip("/").endswith("/dead")
    assert r.zcard("dead") == 0 and json.loads(r.lindex("queue:mail", 0))["jid"] == "c" * 24


@pytest.mark.timeout(60)
def test_a_job_page_whose_job_has_gone_is_a_404_that_leads_back(chrome, web, r):
    from selenium.webdriver.common.by import By
    dead_entry(r, "d" * 24)
    chrome.get(web.base + "/dead")
    chrome.find_element(By.CSS_SELECTOR, "a.job").click()
    wait_until(lambda: "/dead/" in chrome.current_url, timeout=10, message="the job's page")
    r.delete("dead")  # another operator deleted it meanwhile
    chrome.refresh()
    assert chrome.find_element(By.TAG_NAME, "h1").text == "404 Not Found"
    assert "This job is not in Dead any more" in chrome.find_element(By.CSS_SELECTOR, "p.error").text
    chrome.find_element(By.LINK_TEXT, "‹ back to Dead").click()
    wait_until(lambda: "No dead jobs." in chrome.page_source, timeout=10, message="the dead list")


@pytest.mark.timeout(60)
def test_the_live_queue_table_links_to_a_queue_page_that_deletes_a_job(chrome, web, r, redis_url):
    from selenium.webdriver.common.by import By
    import forkq
    chrome.get(web.base + "/")
    name = "<b>odd</b>/name"
    c = forkq.Client(redis_url)
    keep, drop = c.push("Keep", [1], queue=name), c.push("Drop", [2], queue=name)
    # the row the page's script drew from stats.json, not the one the server drew
    wait_until(lambda: chrome.find_elements(By.CSS_SELECTOR, "#queue-rows a"), timeout=15,
               interval=0.2, message="the new queue's link in the live table")
    chrome.find_element(By.CSS_SELECTOR, "#queue-rows a").click()
    wait_until(lambda: "/queues/" in chrome.current_url, timeout=10, message="the queue's page")
    assert chrome.find_element(By.TAG_NAME, "h1").text == f"Queue {name} 2 jobs"
    assert [row.get_attribute("data-jid") for row in chrome.find_elements(By.CSS_SELECTOR, "tr[data-jid]")] == [drop, keep]
    chrome.find_element(By.CSS_SELECTOR, f'tr[data-jid="{drop}"] button[value^="delete|"]').click()
    wait_until(lambda: "delete: 1 job" in chrome.page_source, timeout=10, message="the flash message")
    assert [json.loads(raw)["jid"] for raw in r.lrange(f"queue:{name}", 0, -1)] == [keep]
    assert chrome.find_element(By.TAG_NAME, "h1").text == f"Queue {name} 1 job"
    assert console_errors(chrome) == []


@pytest.mark.timeout(90)
def test_quiet_button_quiets_a_real_running_forkq(chrome, web, r, redis_url, start_master):
    from selenium.webdriver.common.by import By
    # a heartbeat a second, not 5 s: the remote quiet is read at the next one
    m = start_master("--heartbeat-interval", "1", processes=2)
    m.wait_ready(r)
    chrome.get(web.base + "/processes")
    rows = chrome.find_elements(By.CSS_SELECTOR, "tr[data-identity]")
    assert len(rows) == 2
    identity = rows[0].get_attribute("data-identity")
    other = rows[1].get_attribute("data-identity")
    rows[0].find_element(By.CSS_SELECTOR, 'button[value^="quiet|"]').click()
    wait_until(lambda: "quiet: signalled 1 process" in chrome.page_source, timeout=10,
               message="the flash message")
    # the child reads its -signals list at its next heartbeat and reports itself quiet
    wait_until(lambda: r.hget(identity, "quiet") == b"true", timeout=20, interval=0.1,
               message=f"{identity} heartbeat quiet\n{m.tail()}")
    # a child passes a remote quiet to its master, which quiets all its children
    wait_until(lambda: r.hget(other, "quiet") == b"true", timeout=20, interval=0.1,
               message=f"{other} heartbeat quiet too\n{m.tail()}")
    chrome.get(web.base + "/processes")
    row = chrome.find_element(By.CSS_SELECTOR, f'tr[data-identity="{identity}"]')
    assert row.find_element(By.CSS_SELECTOR, "td.state").text == "quiet"
