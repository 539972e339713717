"""Take docs/dashboard.png: the dashboard's overview under load, in headless Chromium.

    python3 docs/screenshot.py [--seconds 40] [--out docs/dashboard.png]

Starts a private redis-server, `forkq start --processes 2` running docs/screenshot_jobs.py,
a feeder that enqueues a varying stream of jobs (some fail, so retry and dead fill up) and
`forkq web`, then photographs the overview once the chart has a history. Needs
redis-server, chromium, chromium-driver and selenium (`pip install -e '.[test]'`).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import forkq  # noqa: E402
import redis  # noqa: E402


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"screenshot: timed out waiting for {what}")
        time.sleep(0.1)


def start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdin=subprocess.DEVNULL,
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)


def feed(url: str, stop: threading.Event) -> None:
    """Enqueue a stream whose rate swings between ~50 and ~750 jobs a second, so the
    chart has shape; the peaks outrun the workers for a while, so queues show depth."""
    from docs.screenshot_jobs import render_thumbnail, send_receipt, sync_crm
    forkq.configure(url)
    n = 0
    began = time.monotonic()
    while not stop.is_set():
        rate = 300 + 200 * math.sin((time.monotonic() - began) / 8)
        batch = max(1, int(rate / 5))
        render_thumbnail.enqueue_many([(n + i,) for i in range(batch)])
        send_receipt.enqueue_many([(n + i,) for i in range(batch // 3)])
        sync_crm.enqueue_many([(n + i,) for i in range(batch // 3)])
        n += batch
        stop.wait(0.2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="seconds of chart history in the picture")
    parser.add_argument("--out", default=str(ROOT / "docs" / "dashboard.png"))
    args = parser.parse_args()
    for tool in ("redis-server", "chromium", "chromedriver"):
        if not shutil.which(tool):
            raise SystemExit(f"screenshot: {tool} is missing (apt-get install redis-server chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    work = Path(tempfile.mkdtemp(prefix="forkq-screenshot-"))
    redis_port, web_port = free_port(), free_port()
    url = f"redis://127.0.0.1:{redis_port}/0"
    env = dict(os.environ, FORKQ_REDIS_URL=url, PYTHONPATH=str(ROOT))
    procs: list[subprocess.Popen] = []
    stop = threading.Event()
    driver = None
    try:
        procs.append(start(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1",
                            "--save", "", "--dir", str(work)], env, work / "redis.log"))
        conn = redis.Redis.from_url(url)
        wait_for(lambda: _pings(conn), 10, "redis-server")
        # a queue nobody works on, filled a few minutes ago: the latency column has a value
        from docs.screenshot_jobs import render_thumbnail
        forkq.configure(url)
        render_thumbnail.options(queue="reports").enqueue_many([(i,) for i in range(1200)])
        procs.append(start([sys.executable, "-m", "forkq", "start", "--processes", "2",
                            "--concurrency", "5", "--require", "docs/screenshot_jobs.py",
                            "--queue", "images,2", "--queue", "mail", "--queue", "default",
                            "--pidfile", str(work / "forkq.pid")], env, work / "forkq.log"))
        wait_for(lambda: conn.scard("processes") >= 2, 20, "two forkq children heartbeating")
        feeder = threading.Thread(target=feed, args=(url, stop), daemon=True)
        feeder.start()
        procs.append(start([sys.executable, "-m", "forkq", "web", "--port", str(web_port)], env,
                           work / "web.log"))
        wait_for(lambda: _answers(web_port), 20, "forkq web")

        options = webdriver.ChromeOptions()
        options.binary_location = shutil.which("chromium")
        for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                     "--disable-background-networking", "--disable-component-update", "--disable-sync",
                     "--disable-dev-shm-usage", "--hide-scrollbars", "--window-size=1280,1000",
                     f"--user-data-dir={work / 'chromium'}"):
            options.add_argument(flag)
        driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
        time.sleep(args.seconds / 3)  # waiting for load to build up, not for synchronisation
        driver.get(f"http://127.0.0.1:{web_port}/")
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.set_window_size(1280, min(max(height, 800), 1600))
        time.sleep(args.seconds)  # the chart's history: one point every 2 s
        driver.save_screenshot(args.out)
        print(f"screenshot: wrote {args.out}")
        return 0
    finally:
        stop.set()
        if driver is not None:
            driver.quit()
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(work, ignore_errors=True)


def _pings(conn: redis.Redis) -> bool:
    try:
        return bool(conn.ping())
    except redis.ConnectionError:
        return False


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
