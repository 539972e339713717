"""Prometheus metrics (`forkq start --metrics-port`): a real master, real children, real HTTP.

Each test runs `python -m forkq start --processes 2` against a real redis-server, scrapes
`/metrics` over HTTP and reads it with prometheus_client's own parser. Counts are summed by
the master from the deltas its children send over their pipes, so the tests check the sums
across both children, across a child's death, and with Redis frozen. Waiting is always a
deadline (wait_until), never a fixed sleep.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

import forkq
from forkq import keys, metrics
from helpers import free_port, wait_until
from test_supervisor import REPO_ROOT, Master, start_master  # noqa: F401  (fixture)

APP = Path(__file__).resolve().parent / "apps" / "metrics_jobs.py"
PIDS = "metrics:pids"


# -- scraping ---------------------------------------------------------------------------------


def scrape(port: int, timeout: float = 5.0) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels): value} from GET /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def total(samples: dict, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def counters(samples: dict) -> dict:
    """The samples that must never go down: every _total, _count, _sum and _bucket."""
    return {k: v for k, v in samples.items() if k[0].startswith("forkq_")
            and k[0].endswith(("_total", "_count", "_sum", "_bucket"))}


def assert_monotonic(before: dict, after: dict) -> None:
    for key, old in before.items():
        assert key in after, f"{key} vanished"
        assert after[key] >= old, f"{key} went down: {old} -> {after[key]}"


def metered(start_master, port: int, **kwargs) -> Master:
    args = ["--metrics-port", port, "--metrics-bind", "127.0.0.1", *kwargs.pop("args", ())]
    m = start_master(app=APP, args=args, **kwargs)
    m.wait_slots()
    wait_until(lambda: m.check() and _answers(port), timeout=10, message=f"metrics on :{port}\n{m.tail()}")
    return m


def _answers(port: int) -> bool:
    try:
        scrape(port, timeout=2)
        return True
    except (urllib.error.URLError, ConnectionError, OSError):
        return False


def listening_ports(pid: int) -> set[int]:
    conns = psutil.Process(pid).net_connections(kind="tcp")
    return {c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN}


# -- the endpoint ----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_jobs_processed_and_failed_are_summed_by_class_and_queue_across_children(start_master, redis_url, r):
    port = free_port()
    m = metered(start_master, port, processes=2, concurrency=2, args=["--queue", "default", "--queue", "other"])
    client = forkq.Client(redis_url)
    # sleeping jobs keep every thread busy, so both children take a share
    client.push_bulk("metrics.ok", [[0.05]] * 30)
    client.push_bulk("metrics.ok", [[0.0]] * 7, queue="other")
    client.push_bulk("metrics.boom", [[]] * 9, queue="other")

    def done():
        m.check()
        s = scrape(port)
        return s if total(s, "forkq_jobs_processed_total") >= 46 else None
    s = wait_until(done, timeout=30, interval=0.1, message=f"46 jobs counted\n{m.tail()}")

    expected = {("metrics.ok", "default"): (30, 0), ("metrics.ok", "other"): (7, 0),
                ("metrics.boom", "other"): (9, 9)}
    for (klass, queue), (processed, failed) in expected.items():
        labels = {"class": klass, "queue": queue}
        assert value(s, "forkq_jobs_processed_total", **labels) == processed, labels
        assert value(s, "forkq_jobs_failed_total", **labels) == failed, labels
        assert value(s, "forkq_job_duration_seconds_count", **labels) == processed, labels
        assert value(s, "forkq_job_duration_seconds_bucket", le="+Inf", **labels) == processed, labels
    assert total(s, "forkq_jobs_processed_total") == 46
    # a 50 ms job lands above the 25 ms bucket and within the 100 ms one (machine allowing)
    ok_default = {"class": "metrics.ok", "queue": "default"}
    assert value(s, "forkq_job_duration_seconds_bucket", le="0.025", **ok_default) == 0
    assert value(s, "forkq_job_duration_seconds_sum", **ok_default) >= 30 * 0.05
    # both children did their share, and the master added them up
    assert len(set(r.lrange(PIDS, 0, -1))) == 2
    assert value(s, "forkq_children") == 2
    assert {value(s, "forkq_threads", slot=str(i)) for i in (0, 1)} == {2}
    assert all(value(s, "forkq_child_rss_bytes", slot=str(i)) > 1_000_000 for i in (0, 1))
    # one child a slot: its largest is all of it
    assert all(value(s, "forkq_child_rss_max_bytes", slot=str(i)) == value(s, "forkq_child_rss_bytes", slot=str(i))
               for i in (0, 1))
    assert value(s, "forkq_metrics_rejected_total") == 0
    # the master's own process metrics come from the client library
    assert value(s, "process_resident_memory_bytes") > 0


@pytest.mark.timeout(60)
def test_busy_threads_and_queue_size_and_latency(start_master, redis_url, r):
    port = free_port()
    m = metered(start_master, port, processes=2, concurrency=1)
    client = forkq.Client(redis_url)
    client.push_bulk("metrics.hold", [[30]] * 2)
    # a backlog on a queue nobody works: its size and age are read from Redis at each scrape
    client.push_bulk("metrics.ok", [[0]] * 25, queue="backlog")
    # and two of its jobs wait as crash suspects, which nobody runs either
    r.lpush(keys.suspects("backlog"), *[json.dumps({"class": "metrics.ok", "args": [0], "jid": j * 24,
                                                    "queue": "backlog"}) for j in "ab"])
    r.hset(keys.PAUSED, "backlog", "{}")  # and it is paused

    def busy():
        s = scrape(port)
        return s if sum(value(s, "forkq_busy_threads", slot=str(i)) or 0 for i in (0, 1)) == 2 else None
    s = wait_until(busy, timeout=10, interval=0.05, message=f"2 busy threads\n{m.tail()}")
    assert value(s, "forkq_queue_size", queue="backlog") == 25
    assert value(s, "forkq_queue_size", queue="default") == 0
    assert value(s, "forkq_queue_suspects", queue="backlog") == 2
    assert value(s, "forkq_queue_suspects", queue="default") == 0
    assert value(s, "forkq_queue_paused", queue="backlog") == 1
    assert value(s, "forkq_queue_paused", queue="default") == 0
    assert value(s, "forkq_redis_up") == 1
    first = value(s, "forkq_queue_latency_seconds", queue="backlog")
    assert 0 <= first < 30
    wait_until(lambda: value(scrape(port), "forkq_queue_latency_seconds", queue="backlog") > first,
               timeout=5, interval=0.05, message="latency grows while the backlog waits")


@pytest.mark.timeout(90)
def test_a_sigkilled_child_counts_as_a_crash_restart_and_counters_never_go_down(start_master, redis_url, r):
    port = free_port()
    m = metered(start_master, port, processes=2, concurrency=2, args=["--timeout", "2"])
    client = forkq.Client(redis_url)
    client.push_bulk("metrics.ok", [[0.0]] * 20)
    client.push_bulk("metrics.boom", [[]] * 5)
    before = wait_until(lambda: (s := scrape(port)) and total(s, "forkq_jobs_processed_total") == 25 and s,
                        timeout=20, interval=0.05, message=f"25 jobs counted\n{m.tail()}")
    assert value(before, "forkq_child_restarts_total", reason="crash") == 0
    assert value(before, "forkq_jobs_requeued_total") == 0

    # two jobs in flight in each child, then one child dies with its two; short ones, as
    # they run again (alone, as crash suspects) before the replacement takes other work
    client.push_bulk("metrics.hold", [[1.5]] * 4)
    wait_until(lambda: sum(value(scrape(port), "forkq_busy_threads", slot=str(i)) or 0 for i in (0, 1)) == 4,
               timeout=10, interval=0.05, message="4 busy threads")
    slots = m.slots()
    os.kill(slots[0], signal.SIGKILL)

    def restarted():
        s = scrape(port)
        return s if value(s, "forkq_child_restarts_total", reason="crash") == 1 else None
    after = wait_until(restarted, timeout=10, interval=0.05, message=f"a crash restart counted\n{m.tail()}")
    assert value(after, "forkq_jobs_requeued_total") >= 2  # the two holds the dead child had
    assert value(after, "forkq_child_restarts_total", reason="memory") == 0
    assert value(after, "forkq_child_restarts_total", reason="hang") == 0
    assert_monotonic(counters(before), counters(after))

    # the replacement's counts add to what its predecessor sent: nothing starts over
    m.wait_slots()
    client.push_bulk("metrics.ok", [[0.0]] * 10, queue="default")
    final = wait_until(lambda: (s := scrape(port)) and value(s, "forkq_jobs_processed_total", **{
        "class": "metrics.ok", "queue": "default"}) == 30 and s, timeout=20, interval=0.05,
        message=f"30 ok jobs counted\n{m.tail()}")
    assert_monotonic(counters(after), counters(final))
    assert value(final, "forkq_jobs_failed_total", **{"class": "metrics.boom", "queue": "default"}) == 5


@pytest.mark.timeout(60)
def test_memory_recycles_are_counted_by_reason(start_master, redis_url):
    port = free_port()
    # every child is over 1 MB: the master recycles them, one at a time, for ever
    m = metered(start_master, port, processes=2, concurrency=1, args=["--max-memory", "1"])
    s = wait_until(lambda: (s := scrape(port)) and value(s, "forkq_child_restarts_total", reason="memory") >= 2
                   and s, timeout=30, interval=0.1, message=f"two memory recycles counted\n{m.tail()}")
    assert value(s, "forkq_child_restarts_total", reason="crash") == 0


@pytest.mark.timeout(90)
def test_a_frozen_redis_does_not_hold_up_the_scrape(own_redis, tmp_path):
    port = free_port()
    # after the failed scrape Redis is not asked for 1 s, not 2: the wait once it is back
    m = Master(own_redis.url, tmp_path / "m", processes=2, concurrency=1, app=APP,
               args=["--metrics-port", port, "--metrics-bind", "127.0.0.1", "--timeout", "2"],
               constants={"REDIS_BACKOFF_FIRST_S": 1.0}).start()
    try:
        m.wait_slots()
        wait_until(lambda: _answers(port), timeout=10, message=f"metrics on :{port}\n{m.tail()}")
        assert value(scrape(port), "forkq_redis_up") == 1
        own_redis.pause()  # SIGSTOP: connections are accepted, nothing is answered
        try:
            for attempt in range(3):
                t0 = time.monotonic()
                s = scrape(port, timeout=10)
                took = time.monotonic() - t0
                # The first one waits out the 1 s Redis timeout; later ones do not try Redis.
                # Either may also wait for the master's own orphan sweep, which every 15 s
                # gives a frozen Redis up to 5 s: the loop is single-threaded.
                assert took < 7.0, (attempt, took)
                assert value(s, "forkq_redis_up") == 0
                assert value(s, "forkq_children") == 2
                assert value(s, "forkq_queue_size", queue="default") is None
        finally:
            own_redis.resume()
        # back once the pause after the failure is over
        wait_until(lambda: value(scrape(port), "forkq_redis_up") == 1, timeout=20, interval=0.2,
                   message=f"queue sizes back after Redis resumed\n{m.tail()}")
    finally:
        m.signal(signal.SIGTERM)
        try:
            m.wait(30)
        finally:
            m.kill()


@pytest.mark.timeout(60)
def test_a_silent_client_does_not_block_the_master(start_master, redis_url):
    port = free_port()
    # silent connections cut after 2.5 s, not 5: still longer than the scrape may take
    m = metered(start_master, port, processes=1, concurrency=1, constants={"HTTP_TIMEOUT_S": 2.5})
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
    half = socket.create_connection(("127.0.0.1", port))
    half.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never finishes its headers
    try:
        t0 = time.monotonic()
        scrape(port)
        assert time.monotonic() - t0 < 2.0
        # and the master still does its job: a child killed now is replaced at once
        (pid,) = m.slots().values()
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: (p := m.slots().get(0)) not in (None, pid), timeout=5, interval=0.02,
                   message="a replacement child")
        # the silent ones are cut after a few seconds rather than held forever
        for sock in idle + [half]:
            sock.settimeout(15)
            assert sock.recv(100) == b""
    finally:
        for sock in idle + [half]:
            sock.close()


@pytest.mark.timeout(60)
def test_other_paths_and_methods(start_master, redis_url):
    port = free_port()
    metered(start_master, port, processes=1, concurrency=1)
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/nope", timeout=5)
    assert err.value.code == 404
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", data=b"x", method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=5)
    assert err.value.code == 405
    # Prometheus asks for OpenMetrics when it can: the library's negotiation answers
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                 headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert resp.headers["Content-Type"].startswith("application/openmetrics-text")
        assert resp.read().decode().rstrip().endswith("# EOF")


@pytest.mark.timeout(60)
def test_children_do_not_hold_the_metrics_port(start_master, redis_url):
    port = free_port()
    m = metered(start_master, port, processes=2, concurrency=1)
    assert port in listening_ports(m.pid)
    for pid in m.slots().values():
        assert port not in listening_ports(pid), f"child {pid} inherited the listening socket"
    # with the master gone (SIGKILL), nobody answers on the port any more
    children = list(m.slots().values())
    m.proc.kill()
    m.proc.wait(5)
    wait_until(lambda: not _answers(port), timeout=5, interval=0.05, message="port closed with the master")
    wait_until(lambda: all(not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE
                           for p in children), timeout=10, interval=0.05, message="children gone")


@pytest.mark.timeout(60)
def test_metrics_are_off_by_default(start_master, redis_url):
    m = start_master(app=APP, processes=2, concurrency=1)
    slots = m.wait_slots()
    for pid in [m.pid, *slots.values()]:
        assert listening_ports(pid) == set(), pid


# -- configuration ---------------------------------------------------------------------------------


def run_start(*args: str, env: dict | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, **(env or {}))
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), full_env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "forkq", "start", "--require", str(APP), *args],
                          env=full_env, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT)


def one_line(out: subprocess.CompletedProcess, *fragments: str) -> None:
    assert out.returncode == 2, (out.returncode, out.stderr)
    err = out.stderr.strip()
    assert "\n" not in err and "Traceback" not in err, err
    for f in fragments:
        assert f in err, (f, err)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("args, env, fragments", [
    (["--metrics-port", "0"], {}, ["--metrics-port", "1-65535", "'0'"]),
    (["--metrics-port", "http"], {}, ["--metrics-port", "'http'"]),
    ([], {"FORKQ_METRICS_PORT": "70000"}, ["FORKQ_METRICS_PORT", "--metrics-port", "1-65535"]),
    ([], {"FORKQ_METRICS_BIND": "not an address"}, ["FORKQ_METRICS_BIND", "--metrics-bind", "IP address"]),
])
def test_bad_metrics_settings_fail_in_one_line(args, env, fragments, tmp_path):
    one_line(run_start("--pidfile", str(tmp_path / "p"), *args, env=env), *fragments)


@pytest.mark.timeout(30)
def test_metrics_settings_from_a_file(tmp_path):
    path = tmp_path / "forkq.toml"
    path.write_text('metrics-port = 9123\nmetrics_bind = "::"\n')
    out = run_start("--config", str(path), "--print-config")
    assert out.returncode == 0, out.stderr
    assert "metrics-port         = 9123" in out.stdout
    assert "metrics-bind         = '::'" in out.stdout


@pytest.mark.timeout(30)
def test_a_taken_port_fails_in_one_line(redis_url, tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        out = run_start("--pidfile", str(tmp_path / "p"), "--metrics-port", str(port),
                        "--metrics-bind", "127.0.0.1", "--processes", "1")
    one_line(out, "--metrics-port", str(port), "cannot listen")


# -- the pipe protocol, without processes ----------------------------------------------------------


@pytest.mark.timeout(10)
def test_deltas_add_up_and_every_line_fits_an_atomic_pipe_write():
    tables = [metrics.JobTable() for _ in range(3)]
    for i in range(300):
        tables[i % 3].observe(f"Klass{i % 150}" + "x" * 40, "q", 0.02 * (i % 7), failed=i % 5 == 0)
    reporter = metrics.DeltaReporter(tables)
    agg = metrics.Aggregates()
    r, w = os.pipe()
    try:
        assert reporter.send(w) > 1  # more than one line's worth: split
        data = b""
        while select.select([r], [], [], 0)[0]:
            data += os.read(r, 65536)
        lines = data.split(b"\n")[:-1]
        assert all(len(line) + 1 <= select.PIPE_BUF for line in lines)
        for line in lines:
            assert line.startswith(b"M")
            agg.add(line[1:])
        assert sum(sum(row[2:]) for row in agg.jobs.values()) == 300  # processed
        assert sum(row[0] for row in agg.jobs.values()) == 60  # failed
        assert len(agg.jobs) == 150
        # nothing new: nothing sent; then only what moved
        assert reporter.send(w) == 0
        tables[0].observe("Klass0" + "x" * 40, "q", 7.0, failed=True)
        assert reporter.send(w) == 1
        (line,) = os.read(r, 65536).split(b"\n")[:-1]
        assert json.loads(line[1:]) == [["Klass0" + "x" * 40, "q", 1, 7.0,
                                         [0] * 10 + [1] + [0] * 4]]
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.timeout(10)
def test_a_full_pipe_keeps_the_deltas_for_later_instead_of_blocking():
    table = metrics.JobTable()
    reporter = metrics.DeltaReporter([table])
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        while True:  # fill the pipe
            try:
                os.write(w, b"B0\n" * 1000)
            except BlockingIOError:
                break
        table.observe("A", "q", 0.001, failed=False)
        t0 = time.monotonic()
        assert reporter.send(w) == 0
        assert time.monotonic() - t0 < 0.5
        while select.select([r], [], [], 0)[0]:  # the master catches up
            os.read(r, 65536)
        assert reporter.send(w) == 1
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.timeout(10)
def test_garbage_lines_are_counted_not_added():
    agg = metrics.Aggregates()
    ones = b"[1,0,0,0,0,0,0,0,0,0,0,0,0,0,0]"
    for bad in (b"not json", b"{}", b'[["A","q",-1,0.0,' + ones + b"]]", b'[["A","q",0,"x",' + ones + b"]]",
                b'[["A","q",0,NaN,' + ones + b"]]", b'[["A","q",0,0.0,[1,0]]]', b'[["A","q",0,0.0,"abcdefghijklmno"]]'):
        agg.add(bad)
    assert agg.rejected == 7 and agg.jobs == {}
    agg.add(b'[["A","q",0,0.5,' + ones + b"]]")
    assert agg.rejected == 7 and agg.jobs == {("A", "q"): [0, 0.5, 1] + [0] * 14}


@pytest.mark.timeout(10)
def test_made_up_class_names_cannot_grow_memory_without_bound():
    table = metrics.JobTable()
    for i in range(metrics.CHILD_KEYS + 100):
        table.observe(f"Junk{i}", "q", 0.0, failed=True)
    assert len(table.rows) == metrics.CHILD_KEYS + 1
    assert table.rows[(metrics.OTHER, "q")][0] == 100  # all failed


# -- the Kubernetes manifest -----------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_kubernetes_scrape_annotation_names_the_port_forkq_serves_on(capsys):
    yaml = pytest.importorskip("yaml")
    from forkq import cli
    manifest = REPO_ROOT / "deploy" / "kubernetes" / "deployment.yaml"
    (deployment,) = [d for d in yaml.safe_load_all(manifest.read_text()) if d and d["kind"] == "Deployment"]
    template = deployment["spec"]["template"]
    (container,) = [c for c in template["spec"]["containers"] if c["name"] == "forkq"]
    args = cli.build_parser().parse_args(container["command"][1:])
    settings, _ = cli.settings_from(args)
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == settings.metrics_port
    assert annotations["prometheus.io/path"] == "/metrics"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == settings.metrics_port
    assert settings.metrics_bind in ("0.0.0.0", "::"), "a scraper outside the pod must reach it"


@pytest.mark.timeout(10)
def test_the_largest_child_of_a_slot_is_exported_beside_the_slots_sum():
    """While a recycled child drains beside its replacement, forkq_child_rss_bytes adds up
    both (one series a slot), and an alert comparing it with --max-memory fired though
    neither child was near the limit. forkq_child_rss_max_bytes is the largest one child's:
    here the test process, with a `sleep` as the slot's other child."""
    from forkq.settings import Settings
    from forkq.supervisor import Supervisor
    from test_supervisor import _close_master, _pinging_children
    sup = Supervisor(Settings(processes=1))
    made = _pinging_children(sup, range(2))
    small = subprocess.Popen(["sleep", "30"])
    try:
        sup.children.clear()
        for (child, _w, _r), pid in zip(made, (os.getpid(), small.pid)):
            child.slot, child.pid = 0, pid
            sup.children[pid] = child
        sleeper = psutil.Process(small.pid)
        # in its sleep, past the loader: its memory stays put while the master reads it
        wait_until(lambda: sleeper.status() == psutil.STATUS_SLEEPING, timeout=5)
        before = sleeper.memory_info().rss
        families = {f.name: f for f in metrics.Collector(sup, metrics.Aggregates(),
                                                         metrics.QueueReader(None))._children()}
        after = sleeper.memory_info().rss
        (summed,) = families["forkq_child_rss_bytes"].samples
        (largest,) = families["forkq_child_rss_max_bytes"].samples
        assert summed.labels == largest.labels == {"slot": "0"}
        assert largest.value > after and before <= summed.value - largest.value <= after
    finally:
        small.kill()
        small.wait()
        _close_master(sup, made)
