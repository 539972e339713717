"""What a careless operator or a stray writer to Redis can throw at the commands: each gets
one readable line and a non-zero exit (or a quiet success), never a traceback or a hang.
Real `python -m forkq` subprocesses against a real Redis."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from forkq.queues import QueueOrder
from helpers import free_port, wait_until
from test_admin_cli import REPO_ROOT, run


def one_line(out: subprocess.CompletedProcess, code: int, *expected: str) -> str:
    assert out.returncode == code, (out.args, out.returncode, out.stdout, out.stderr)
    err = out.stderr.strip()
    assert "Traceback" not in out.stderr and "\n" not in err, out.stderr
    for text in expected:
        assert text in err, (text, err)
    return err


@pytest.mark.timeout(30)
def test_a_malformed_heartbeat_breaks_neither_processes_nor_remote_ctl(r, redis_url):
    """One bad entry in `processes`, from anything on any host, must not fail every
    host's liveness probe or the listing."""
    r.sadd("processes", "bad-beat", "bad-info", "not-a-hash")
    r.hset("bad-beat", mapping={"beat": "notafloat", "busy": "2.5", "rss": "x", "info": '{"hostname": "h"}'})
    r.hset("bad-info", mapping={"beat": "1e400", "info": "[1, 2]"})
    r.set("not-a-hash", "x")
    out = run("processes")
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert "bad-beat" in out.stdout and "bad-info" in out.stdout
    # none says it is forkq: --all leaves them alone and names them, --identity reaches one
    out = run("ctl", "quiet", "--all")
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "left alone, not forkq (Ruby Sidekiq?): bad-beat bad-info" in out.stderr
    out = run("ctl", "quiet", "--identity", "bad-info")
    assert out.returncode == 0 and out.stdout.split() == ["TSTP", "->", "bad-info"], out.stderr


@pytest.mark.timeout(60)
def test_a_redis_that_answers_with_errors_is_one_line_not_a_worker_that_idles(r, redis_url):
    """A database index Redis does not have: no retry can help, so start refuses (exit 2)
    instead of running a worker that never fetches anything."""
    bad = redis_url.rsplit("/", 1)[0] + "/99"
    one_line(run("start", "--no-fork", "--require", "os", url=bad, timeout=30), 2,
             "DB index is out of range")
    one_line(run("queues", url=bad), 1, "DB index is out of range")
    r.sadd("queues", "wrongtype")
    r.set("queue:wrongtype", "x")
    one_line(run("queues"), 1, "WRONGTYPE")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("flag", ["--host", "--identity"])
def test_an_empty_remote_target_is_refused_not_taken_for_the_local_master(r, redis_url, tmp_path, flag):
    one_line(run("ctl", "stop", flag, "", "--pidfile", str(tmp_path / "none.pid")), 2,
             flag, "must not be empty")


def run_env(*args: str, env: dict[str, str], timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "forkq", *args], env={**os.environ, **env},
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


@pytest.mark.timeout(60)
def test_values_set_empty_are_refused_by_ctl_admin_and_web(r, redis_url, tmp_path):
    """A secret or template that resolved to nothing: each command says which setting is
    empty (exit 2) instead of reading it as unset, which meant Redis at localhost, the
    default pidfile, or a dashboard without its password."""
    pidfile = str(tmp_path / "none.pid")
    one_line(run("ctl", "status", "--pidfile", pidfile, url=""), 2, "FORKQ_REDIS_URL", "--redis-url")
    one_line(run_env("ctl", "status", env={"FORKQ_PIDFILE": ""}), 2, "FORKQ_PIDFILE", "--pidfile")
    one_line(run_env("ctl", "status", "--pidfile", pidfile, env={"FORKQ_CONFIG": ""}), 2, "FORKQ_CONFIG")
    one_line(run("ctl", "status", "--pidfile", ""), 2, "--pidfile", "must not be empty")
    one_line(run("ctl", "status", "--pidfile", pidfile, "--config", ""), 2, "--config", "must not be empty")
    one_line(run("queues", "--redis-url", ""), 2, "--redis-url", "must not be empty")
    one_line(run("dead", "list", url=""), 2, "FORKQ_REDIS_URL", "--redis-url")
    port = str(free_port())
    one_line(run("web", "--port", port, "--password", ""), 2, "--password", "must not be empty")
    for name in ("FORKQ_WEB_PASSWORD", "FORKQ_WEB_TOKEN", "FORKQ_WEB_SECRET"):
        one_line(run_env("web", "--port", port, env={name: ""}), 2, name, "must not be empty")
    one_line(run("web", "--port", port, url=""), 2, "FORKQ_REDIS_URL", "--redis-url")


@pytest.mark.timeout(30)
def test_out_of_range_numbers_are_refused(redis_url, tmp_path):
    one_line(run("start", "--concurrency", "1000000", "--require", "os"), 2, "at most 1000")
    one_line(run("start", "--processes", "99999", "--require", "os"), 2, "at most 1024")
    config = tmp_path / "forkq.toml"
    config.write_text("processes = inf\n")
    one_line(run("start", "--config", str(config), "--require", "os"), 2, "processes")
    config.write_text("timeout = 1e400\n")
    one_line(run("start", "--config", str(config), "--require", "os"), 2, "timeout")
    one_line(run("stats", "--days", "99999999999"), 2, "--days")
    one_line(run("start", "--require", ".", "--no-fork"), 2, "--require")
    one_line(run("start", "--queue", "\udcff", "--no-fork", "--require", "os"), 2, "UTF-8")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("url, says", [
    # ssl_ca_cert for ssl_ca_certs: it was a TypeError traceback from the first PING
    ("rediss://:hunter2@127.0.0.1:6380/0?ssl_cert_reqs=none&ssl_ca_cert=/x",
     "unknown TLS option 'ssl_ca_cert'"),
    # the same traceback for any parameter redis-py has no parser for, on any scheme
    ("redis://:hunter2@127.0.0.1:6380/0?socket_timout=2", "unknown query parameter 'socket_timout'"),
    ("redis://:hunter2@127.0.0.1:6380/0?ssl_cert_reqs=none", "ssl_cert_reqs is a TLS option: write rediss://"),
    ("unix://:hunter2@/tmp/redis.sock?bogus=1", "unknown query parameter 'bogus'"),
])
def test_a_misspelled_url_option_is_one_line_naming_it(url, says):
    err = one_line(run("start", "--redis-url", url, "--require", "os"), 2, says, ":***@")
    assert "hunter2" not in err


@pytest.mark.timeout(30)
def test_a_closed_pipe_ends_quietly(r, redis_url):
    r.zadd("dead", {json.dumps({"class": "A", "args": [i], "jid": f"j{i}", "queue": "q"}): i
                    for i in range(20_000)})
    env_cmd = f"{sys.executable} -m forkq dead list --limit 20000 | head -1"
    out = subprocess.run(["bash", "-o", "pipefail", "-c", env_cmd], capture_output=True, text=True,
                         timeout=30, cwd=REPO_ROOT)
    assert "Traceback" not in out.stderr and out.stderr == "", out.stderr
    assert out.stdout.count("\n") == 1


@pytest.mark.timeout(30)
@pytest.mark.parametrize("unbuffered", ["", "1"])
def test_print_config_into_a_closed_pipe_ends_quietly(tmp_path, unbuffered):
    """`forkq start --print-config | head -1`: the reader may be gone before the write."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FORKQ_", "PYTHONUNBUFFERED"))}
    env["PYTHONPATH"] = str(REPO_ROOT)
    if unbuffered:
        env["PYTHONUNBUFFERED"] = unbuffered
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        out = subprocess.run([sys.executable, "-m", "forkq", "start", "--print-config"], stdout=write_end,
                             stderr=subprocess.PIPE, text=True, timeout=20, cwd=tmp_path, env=env)
    finally:
        os.close(write_end)
    assert out.returncode == 0 and out.stderr == "", (out.returncode, out.stderr)


@pytest.mark.timeout(30)
def test_ctrl_c_while_ctl_stop_waits_is_one_line(tmp_path):
    """A master that takes its time to stop (here a stand-in that notes the TERM and
    stays), and an operator who gives up waiting."""
    termed = tmp_path / "termed"
    stand_in = subprocess.Popen([sys.executable, "-c", (
        "import setproctitle, signal, time, sys\n"
        "setproctitle.setproctitle('forkq master [stand-in]')\n"
        f"signal.signal(signal.SIGTERM, lambda *a: open({str(termed)!r}, 'w').close())\n"
        "print('up', flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert stand_in.stdout.readline() == "up\n"
        pidfile = tmp_path / "forkq.pid"
        pidfile.write_text(f"{stand_in.pid}\n")
        ctl = subprocess.Popen([sys.executable, "-m", "forkq", "ctl", "stop", "--pidfile", str(pidfile)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_until(termed.exists, timeout=20, message="ctl stop sent TERM")
        ctl.send_signal(signal.SIGINT)
        _, err = ctl.communicate(timeout=20)
        assert ctl.returncode == 130 and err == "forkq: interrupted\n", (ctl.returncode, err)
    finally:
        stand_in.kill()
        stand_in.wait()


@pytest.mark.timeout(30)
def test_control_characters_from_payloads_do_not_reach_the_terminal(r, redis_url):
    job = {"class": "A", "args": [], "jid": "esc", "queue": "q",
           "error_class": "RuntimeError", "error_message": "boom \x1b[31mRED\x1b[0m\nsecond line"}
    r.zadd("dead", {json.dumps(job): 1})
    out = run("dead", "list")
    assert out.returncode == 0, out.stderr
    assert "\x1b" not in out.stdout and len(out.stdout.splitlines()) == 2


@pytest.mark.timeout(30)
def test_retry_all_skips_an_entry_it_cannot_write_back_and_retries_the_rest(r, redis_url):
    r.zadd("dead", {'{"class":"A","args":[NaN],"jid":"nan1","queue":"q"}': 1,
                    '{"class":"A","args":[1],"jid":"good","queue":"q"}': 2})
    out = run("dead", "retry", "--all")
    assert out.returncode == 0, out.stderr
    assert [json.loads(x)["jid"] for x in r.lrange("queue:q", 0, -1)] == ["good"]
    one_line(run("dead", "retry", "--jid", "nan1"), 1, "no runnable job")


def test_weighted_queue_order_is_quick_with_huge_weights_and_keeps_the_odds():
    order = QueueOrder([("a", 10_000_000), ("b", 1)])
    started = time.perf_counter()
    firsts = collections.Counter(order()[0] for _ in range(1000))
    assert time.perf_counter() - started < 1.0
    assert firsts["a"] >= 995
    order = QueueOrder([("a", 3), ("b", 1)])
    firsts = collections.Counter(order()[0] for _ in range(20_000))
    assert 0.72 < firsts["a"] / 20_000 < 0.78  # 3 of 4, as Sidekiq's weighted order


@pytest.mark.timeout(30)
def test_a_url_argparse_echoes_back_has_its_password_masked():
    # `ctl` takes no --redis-url: argparse's "unrecognized arguments" repeated the URL whole
    url = "rediss://:hunter2@127.0.0.1:6380/0?sentinel_password=sesame"
    err = one_line(run("ctl", "status", "--redis-url", url), 2, "unrecognized arguments",
                   "rediss://:***@127.0.0.1:6380/0?sentinel_password=***")
    assert "hunter2" not in err and "sesame" not in err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, help_", [
    (["ctl", "status", "--redis-url", "redis://h:1/0"], "forkq ctl status --help"),
    (["start", "--no-such-flag"], "forkq start --help"),
    (["dead", "list", "--no-such-flag"], "forkq dead list --help"),
    (["queues", "extra"], "forkq queues --help"),
])
def test_a_stray_argument_points_at_its_own_commands_help(args, help_):
    # it pointed at `forkq --help`, which lists none of the subcommand's flags: a user who
    # gave ctl a --redis-url (start takes one) learnt nothing about what ctl takes instead
    one_line(run(*args), 2, "unrecognized arguments", f"(see {help_})")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, env, says", [
    (["suspects", "q\udcff"], {}, "the argument (q\\xff) is not valid UTF-8"),
    (["dead", "delete", "--jid", "\udcff"], {}, "the value of --jid (\\xff) is not valid UTF-8"),
    (["retry", "delete", "--jid=a\udcff"], {}, "the value of --jid (a\\xff) is not valid UTF-8"),
    (["start", "-q\udcff"], {}, "the value of -q (\\xff) is not valid UTF-8"),
    (["web", "--password", "pw\udcff"], {}, "the value of --password is not valid UTF-8"),
    (["ctl", "status", "--redis-url", "redis://:pw\udcff@h:1"], {},
     "the value of --redis-url (redis://:***@h:1) is not valid UTF-8"),
    (["web"], {"FORKQ_WEB_PASSWORD": "pw\udcff"}, "FORKQ_WEB_PASSWORD is not valid UTF-8"),
    (["queues"], {"FORKQ_REDIS_URL": "redis://h\udcff:1/0"}, "FORKQ_REDIS_URL is not valid UTF-8"),
])
def test_bytes_that_are_not_utf8_are_named_in_one_line(args, env, says, monkeypatch):
    """They used to surface as "'utf-8' codec can't encode character '\\udcff'", naming
    neither the argument nor the variable."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    err = one_line(run(*args), 2, says, "only file paths may be other bytes")
    assert "pw" not in err  # a password is named, never shown


@pytest.mark.timeout(30)
def test_a_file_path_may_be_any_bytes(tmp_path):
    pidfile = os.fsdecode(bytes(tmp_path) + b"/forkq-\xff.pid")
    err = one_line(run("ctl", "status", "--pidfile", pidfile), 1, "no forkq master")
    assert "not valid UTF-8" not in err


@pytest.mark.timeout(30)
def test_stamps_no_clock_wrote_and_sidekiq_8_milliseconds_show_sane_ages(r, redis_url):
    """An enqueued_at of -1e300 printed a 300-digit latency; Sidekiq 8's run_at in
    milliseconds showed as a job running for a negative 56,000 years."""
    r.sadd("queues", "odd")
    r.lpush("queue:odd", json.dumps({"class": "A", "args": [], "jid": "odd", "enqueued_at": -1e300}))
    (odd,) = [q for q in json.loads(run("queues", "--json").stdout) if q["name"] == "odd"]
    assert odd["latency"] == 0
    assert max(map(len, run("queues").stdout.splitlines())) < 80

    identity = "rb:9:ms"
    r.sadd("processes", identity)
    r.hset(identity, mapping={"info": json.dumps({"hostname": "rb", "pid": 9}), "beat": time.time(),
                              "busy": 1})
    started_ms = int((time.time() - 90) * 1000)
    work = {"queue": "default", "run_at": started_ms,
            "payload": {"class": "A", "args": [], "jid": "ms", "enqueued_at": started_ms - 5000}}
    r.hset(identity + ":work", "tid", json.dumps(work))
    out = run("busy", "--json")
    assert out.returncode == 0, out.stderr
    (busy,) = json.loads(out.stdout)
    assert busy["jid"] == "ms" and 85 < busy["running_for"] < 200, busy


@pytest.mark.timeout(60)
def test_a_worker_with_no_jobs_registered_says_so_and_a_limit_of_0_is_told_plainly(redis_url, tmp_path):
    log_path = tmp_path / "worker.log"
    env = dict(os.environ, FORKQ_REDIS_URL=redis_url, PYTHONPATH=str(REPO_ROOT))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "forkq", "start", "--no-fork"], env=env,
                                cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: "worker started" in log_path.read_text(), timeout=30,
                   message="the worker started")
        assert "no jobs are registered" in log_path.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    # 2**62 is --limit's ceiling: no help to whoever gave 0
    one_line(run("dead", "list", "--limit", "0"), 2, "--limit must be at least 1, not 0")
