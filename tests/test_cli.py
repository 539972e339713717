"""`python -m forkq start`: bad arguments fail in one line with exit code 2; --require forms."""

import os
import signal
import subprocess
import sys

import pytest

from corekit import CORE_JOBS, REPO_ROOT, CoreWorker, core_jobs, forkq_client  # noqa: F401
from corekit import wait_records
from helpers import wait_until


def _forkq(args, env_url, timeout=20):
    env = dict(os.environ)
    env["FORKQ_REDIS_URL"] = env_url
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "forkq", *args], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def _assert_one_line_error(out, *expected):
    assert out.returncode == 2, (out.returncode, out.stderr, out.stdout)
    err = out.stderr.strip()
    assert err and "\n" not in err, f"not one line on stderr:\n{out.stderr}"
    assert "Traceback" not in out.stderr + out.stdout
    for text in expected:
        assert text in err, err
    return err


START = ["start", "--no-fork", "--require", str(CORE_JOBS)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, expected", [
    (["--concurrency", "x"], ["--concurrency", "'x'"]),
    (["--concurrency", "0"], ["--concurrency", "at least 1"]),
    (["-c", "-3"], ["--concurrency"]),
    (["--queue", "a,0"], ["a,0", "weight"]),
    (["--queue", "a,x"], ["a,x"]),
    (["--queue", ",3"], [",3"]),
    (["--timeout", "0"], ["--timeout"]),
    (["--timeout", "soon"], ["--timeout", "'soon'"]),
    (["--poll-interval", "-1"], ["--poll-interval"]),
    (["--heartbeat-interval", "21"], ["--heartbeat-interval", "at most 20"]),
    (["--no-such-flag"], ["--no-such-flag"]),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_arguments_fail_in_one_line(redis_url, args, expected):
    _assert_one_line_error(_forkq(START + args, redis_url), *expected)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flag", ["--timeout", "--poll-interval", "--hang-timeout", "--recovery-delay"])
def test_a_time_setting_past_what_a_thread_can_wait_is_refused(redis_url, flag):
    # --timeout 1e10 was taken, and every child died of OverflowError at stop
    _assert_one_line_error(_forkq(["start", flag, "1e10", "--print-config"], redis_url),
                           flag, "at most")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("require, expected", [
    ("nonexistent_mod_for_forkq", ["nonexistent_mod_for_forkq"]),
    ("tests.apps.no_such_module", ["tests.apps.no_such_module"]),
    ("tests/apps/no_such_file.py", ["no_such_file.py", "no such file"]),
])
def test_bad_require_fails_in_one_line(redis_url, require, expected):
    out = _forkq(["start", "--no-fork", "--require", require], redis_url)
    _assert_one_line_error(out, "--require", *expected)


@pytest.mark.timeout(60)
def test_an_apps_own_value_error_at_import_keeps_its_traceback(redis_url):
    # it was printed as "forkq: invalid literal for int() with base 10: ''" and exit 2, as if
    # it were a bad forkq setting, with nothing saying which file raised it
    out = _forkq(["start", "--no-fork", "--require", "tests/apps/import_value_error.py"], redis_url)
    assert out.returncode == 1, (out.returncode, out.stderr)
    assert "Traceback" in out.stderr and "import_value_error.py" in out.stderr
    assert "ValueError: invalid literal for int()" in out.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("url", [
    "http://127.0.0.1:6379/0",
    "redis://:hunter2@127.0.0.1:notaport/0",
    "redis://127.0.0.1:6379/notadb",
])
def test_bad_redis_url_fails_in_one_line_with_password_masked(url):
    out = _forkq(START, url)
    err = _assert_one_line_error(out, "Redis URL")
    assert "hunter2" not in out.stderr + out.stdout
    if "hunter2" in url:
        assert ":***@" in err


@pytest.mark.timeout(30)
def test_no_command_fails_in_one_line(redis_url):
    _assert_one_line_error(_forkq([], redis_url))


@pytest.mark.timeout(30)
def test_require_by_dotted_module_registers_the_same_names(redis_url, forkq_client, r):
    worker = CoreWorker(redis_url, "tests.apps.core_jobs", concurrency=1,
                        extra_args=["-q", "default", "-t", "2"])
    with worker:
        worker.wait_ready(r)
        core_jobs.record.enqueue("dotted")
        (rec,) = wait_records(r, 1, worker, kind="record")
        assert rec["args"] == ["dotted"]
        assert worker.stop(timeout=15) == 0
    assert r.zcard("retry") == 0  # nothing failed as an unknown job


@pytest.mark.timeout(30)
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("mode", [[], ["--no-fork"]])
def test_a_stop_while_the_app_imports_exits_0_in_one_line(redis_url, tmp_path, sig, mode):
    """A TERM (systemd, Kubernetes) or a Ctrl-C while a slow app still imports: nothing
    was claimed, so exit 0 with one line, not a traceback and not death by the signal."""
    started = tmp_path / "importing"
    app = tmp_path / "slow_app.py"
    # short sleeps: a signal that lands between CPython's check for pending signals and the
    # start of a sleep's system call is handled only once that call returns, so one long
    # sleep made this test wait out its whole 20 s now and then
    app.write_text(f"import pathlib, time\npathlib.Path({str(started)!r}).touch()\n"
                   "for _ in range(200):\n    time.sleep(0.1)\n")
    env = dict(os.environ, FORKQ_REDIS_URL=redis_url)
    proc = subprocess.Popen([sys.executable, "-m", "forkq", "start", "--require", str(app), *mode],
                            env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True)
    try:
        wait_until(started.exists, message="the app started importing")
        proc.send_signal(getattr(signal, sig))
        out, _ = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert "stop requested while starting" in out
    assert sig in out


@pytest.mark.timeout(40)
@pytest.mark.parametrize("flags, expected", [
    ([], []),
    (["--heartbeat-interval", "5", "--recovery-delay", "12", "--hang-timeout", "10"], []),
    (["--hang-timeout", "30", "--recovery-delay", "30"], ["not above --hang-timeout"]),
])
def test_lease_timings_that_let_a_live_process_lose_its_jobs_are_warned_at_start(redis_url, tmp_path,
                                                                                 flags, expected):
    out_path = tmp_path / "out"
    env = dict(os.environ, FORKQ_REDIS_URL=redis_url)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    with open(out_path, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "forkq", "start", "--require", str(CORE_JOBS),
                                 "--processes", "1", "--log-format", "text",
                                 "--pidfile", str(tmp_path / "pid"), *flags],
                                env=env, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    try:
        # the timing warnings come before the master forks; "worker started" comes after
        wait_until(lambda: proc.poll() is None and "worker started" in out_path.read_text(),
                   timeout=20, message="the child to start")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        proc.kill()
    text = out_path.read_text()
    warned = [line for line in text.splitlines() if "--recovery-delay" in line]
    assert len(warned) == len(expected), text
    for line, phrase in zip(warned, expected):
        assert phrase in line


@pytest.mark.timeout(30)
@pytest.mark.parametrize("args", [["--version"], ["start", "--help"], ["start", "--concurrency", "0"],
                                  ["start", "--redis-url", "redis://:hunter2@h:1/0", "--bogus"]])
def test_commands_that_never_reach_redis_do_not_import_redis_py(args):
    """Importing redis-py is most of `forkq`'s start-up (0.25 s, 0.16 s without it): a
    --help, a --version or a refused flag (its URL masked) must not pay it."""
    code = ("import sys\nfrom forkq.cli import main\ntry:\n    main(sys.argv[1:])\n"
            "except SystemExit:\n    pass\nprint(sorted(m for m in sys.modules if m.split('.')[0] == 'redis'))")
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    out = subprocess.run([sys.executable, "-c", code, *args], env=env, cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=20, stdin=subprocess.DEVNULL)
    assert "Traceback" not in out.stderr, out.stderr
    assert "hunter2" not in out.stderr
    assert out.stdout.splitlines()[-1] == "[]", out.stdout.splitlines()[-1][:300]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_prints_the_package_version_and_exits_0(flag):
    import tomllib

    import forkq
    out = _forkq([flag], "redis://127.0.0.1:1/0")
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"forkq {forkq.__version__}\n"
    # the version an installed forkq reports is the one packaged
    with open(REPO_ROOT / "pyproject.toml", "rb") as f:
        assert tomllib.load(f)["project"]["version"] == forkq.__version__
