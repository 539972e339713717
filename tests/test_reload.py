"""`forkq start --reload`: the watcher in-process, and one real master that reloads.

The master test runs `python -m forkq start --reload --processes 2` in a temp app directory
and edits its jobs.py the way a developer would; each job records, in Redis, the VERSION
of the code that ran it. Waiting is always a deadline (wait_until), never a fixed sleep.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from forkq import cli, reload
from helpers import forkq_command, wait_until

REPO_ROOT = Path(__file__).resolve().parent.parent


# -- reexec, in a script that runs it and then, exec'd, runs again ---------------------------

# a master's traps, as Supervisor.run sets them: stop signals go to a self-pipe, read by
# stop_pending (what reexec is given)
MASTER_TRAPS = """
r, w = os.pipe()
os.set_blocking(r, False)
os.set_blocking(w, False)
signal.set_wakeup_fd(w)
for sig in reload.STOP_SIGNALS:
    signal.signal(sig, lambda *a: None)

def stop_pending():
    try:
        return bool(set(os.read(r, 256)) & set(reload.STOP_SIGNALS))
    except BlockingIOError:
        return False
"""


def _reexec_twice(tmp_path: Path, first: str, again: str = 'print("again", flush=True)',
                  **run: object) -> subprocess.CompletedProcess:
    """Run a script whose first run does `first` (which calls reload.reexec) and whose
    exec'd run does `again` and exits."""
    script = tmp_path / "again.py"
    script.write_text(
        "import atexit, multiprocessing, os, signal, subprocess, sys, threading, time\n"
        f"sys.path.insert(0, {str(REPO_ROOT)!r})\n"
        "from forkq import cli, reload\n"
        'if os.environ.get("ROUND") == "2":\n'
        + textwrap.indent(textwrap.dedent(again).strip("\n"), "    ") + "\n"
        "    sys.exit(0)\n"
        'os.environ["ROUND"] = "2"\n'
        + textwrap.dedent(first))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=15, **run)


# -- the watcher -----------------------------------------------------------------------------


def _touch(path: Path, text: str) -> None:
    """Write `text`, with an mtime past the last one: two writes in one coarse clock tick
    must still differ, as two saves seconds apart do."""
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(text)
    st = path.stat()
    if st.st_mtime_ns <= before:
        os.utime(path, ns=(st.st_atime_ns, before + 1_000_000))


@pytest.mark.timeout(10)
def test_the_watcher_sees_edits_deletions_and_new_py_files_but_not_editor_droppings(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("x = 1\n")
    b.write_text("y = 1\n")
    w = reload.Watcher([str(a), str(b)])
    assert w.changed() == []
    _touch(a, "x = 2\n")
    assert w.changed() == [str(a)]
    assert w.changed() == []                      # reported once
    for name in (".#b.py", "#b.py#", "b.py~", ".b.py.swp", "notes.txt"):
        (tmp_path / name).write_text("")
    assert w.changed() == []
    (tmp_path / "c.py").write_text("")
    assert w.changed() == [str(tmp_path / "c.py")]
    b.unlink()
    assert w.changed() == [str(b)]


@pytest.mark.timeout(10)
def test_a_file_saved_while_the_app_imported_counts_at_the_first_poll(tmp_path):
    a = tmp_path / "a.py"
    a.write_text("x = 1\n")
    saved = a.stat().st_mtime
    late = reload.Watcher([str(a)], since=saved - 1)     # import began before the save
    assert late.due() and late.changed() == [str(a)]
    early = reload.Watcher([str(a)], since=saved + 1)    # import began after it
    assert not early.due() and early.changed() == []
    ahead = time.time_ns() + 3600 * 10**9                 # a clock an hour ahead: not "during"
    os.utime(a, ns=(ahead, ahead))
    assert reload.Watcher([str(a)], since=saved - 1).changed() == []


@pytest.mark.timeout(10)
def test_the_apps_files_are_those_under_the_working_directory_not_installed_code(tmp_path, monkeypatch):
    import json as stdlib_module

    import redis as installed_module
    app = tmp_path / "proj"
    (app / "pkg").mkdir(parents=True)
    (app / "pkg" / "__init__.py").write_text("")
    (app / "pkg" / "tasks.py").write_text("VALUE = 1\n")
    elsewhere = tmp_path / "lib"
    elsewhere.mkdir()
    (elsewhere / "extra_jobs_for_reload.py").write_text("VALUE = 2\n")
    monkeypatch.chdir(app)
    monkeypatch.setattr(reload, "_started", None)
    monkeypatch.syspath_prepend(str(app))
    monkeypatch.syspath_prepend(str(elsewhere))
    for name in ("pkg", "pkg.tasks", "extra_jobs_for_reload"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    __import__("pkg.tasks")
    __import__("extra_jobs_for_reload")
    files = reload.app_files(["pkg.tasks"])
    assert str(app / "pkg" / "tasks.py") in files and str(app / "pkg" / "__init__.py") in files
    assert str(elsewhere / "extra_jobs_for_reload.py") not in files   # not under a root
    assert os.path.realpath(stdlib_module.__file__) not in files
    assert os.path.realpath(installed_module.__file__) not in files
    # a --require path adds its directory as a root
    assert str(elsewhere / "extra_jobs_for_reload.py") in reload.app_files(
        [str(elsewhere / "extra_jobs_for_reload.py")])


@pytest.mark.timeout(10)
def test_reload_with_no_fork_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["start", "--reload", "--no-fork", "-r", "nothing_here"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--reload" in err and "--no-fork" in err


@pytest.mark.timeout(10)
def test_a_stop_asked_for_during_the_reload_ends_the_master_instead():
    from forkq.settings import Settings
    from forkq.supervisor import Supervisor
    sup = Supervisor(Settings(processes=1))
    os.set_blocking(sup._sig_r, False)  # as run() leaves it
    try:
        sup.reloading = ["jobs.py"]
        assert sup.reload_wanted()
        os.write(sup._sig_w, bytes([signal.SIGINT]))   # Ctrl-C after the loop's last look
        assert not sup.reload_wanted() and sup.reloading is None
        sup.reloading, sup.state = ["jobs.py"], "stopping"
        sup.handle_stop(signal.SIGTERM)                 # ... or while the children stop
        assert not sup.reload_wanted()
    finally:
        os.close(sup._sig_r)
        os.close(sup._sig_w)


# -- a real master ---------------------------------------------------------------------------

JOBS = '''\
import atexit, os, time
import forkq, redis

VERSION = {version}
# what an app cleans up at exit, run once per code version, in the master that imported it
atexit.register(lambda: redis.Redis.from_url(os.environ["FORKQ_REDIS_URL"]).rpush(
    "reload:atexit", f"{{VERSION}}:{{os.getpid()}}"))

@forkq.job
def mark(n, hold=False):
    conn = redis.Redis.from_url(os.environ["FORKQ_REDIS_URL"])
    conn.rpush("reload:started", f"{{VERSION}}:{{n}}")
    while hold and not conn.exists("reload:release"):  # running across the change
        time.sleep(0.01)
    conn.rpush("reload:done", f"{{VERSION}}:{{n}}")
'''


def _push(r, n: int, hold: bool = False) -> None:
    payload = {"class": "jobs.mark", "args": [n, hold], "queue": "default", "retry": False,
               "jid": f"reload{n:018d}", "created_at": time.time(), "enqueued_at": time.time()}
    r.sadd("queues", "default")
    r.lpush("queue:default", json.dumps(payload))


@pytest.mark.timeout(20)
def test_an_atexit_handler_that_hangs_holds_the_reexec_only_as_long_as_an_exit_would(tmp_path):
    """reexec runs the app's atexit handlers, which an exec would skip; one that hangs gets
    the grace an exit gives (shortened here) and the process execs without it, same pid,
    the stop signals still blocked for the new run's handlers to take."""
    started = time.monotonic()
    out = _reexec_twice(tmp_path, '''
atexit.register(lambda: print("handler ran", flush=True))
atexit.register(lambda: time.sleep(60))  # runs first: handlers run last registered first
reload.ATEXIT_GRACE_S = 0.5
print("first", os.getpid(), flush=True)
reload.reexec()
''', again='''
blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
print("again", os.getpid(), sorted(int(s) for s in blocked & set(reload.STOP_SIGNALS)),
      flush=True)
''')
    took = time.monotonic() - started
    lines = out.stdout.splitlines()
    pid = lines[0].split()[1]
    stops = sorted(map(int, reload.STOP_SIGNALS))
    assert lines[0] == f"first {pid}" and lines[-1] == f"again {pid} {stops}", out
    assert "handler ran" not in out.stdout  # cut short behind the hanging one, as an exit's
    assert "atexit handlers are still running" in out.stdout + out.stderr
    assert took < 10, took


@pytest.mark.timeout(20)
def test_the_atexit_handlers_run_where_the_app_left_the_process_and_the_exec_where_it_began(tmp_path):
    """An app that chdirs at import has its atexit handlers run in its own directory, as
    at an exit (one removing a relative socket or lock file finds it), and the new run
    starts where forkq began. Before, reexec went back to the start directory first, and
    the handlers ran there."""
    (tmp_path / "app").mkdir()
    out = _reexec_twice(tmp_path, '''
reload.remember_start()
os.chdir("app")  # the app, at import
atexit.register(lambda: print("handler", os.getcwd(), flush=True))
reload.reexec()
''', again='''
print("again", os.getcwd(), flush=True)
''', cwd=tmp_path)
    assert out.stdout.splitlines() == [f"handler {tmp_path / 'app'}", f"again {tmp_path}"], out


@pytest.mark.timeout(20)
def test_a_stop_that_an_apps_thread_takes_during_the_atexit_handlers_cancels_the_reexec(tmp_path):
    """reexec blocks the stop signals in its own thread only: one sent while the app's
    atexit handlers run goes to a thread of the app's, and the master's trap writes it to
    the self-pipe. Before, nothing read it again: the stop was lost and the master started
    again. Now reexec looks once more after the handlers and returns (the master exits)."""
    out = _reexec_twice(tmp_path, f'''
{MASTER_TRAPS}
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()  # the app's thread

atexit.register(lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(0.2)))  # ctl stop
reload.reexec(stop_pending)
print("stopped instead", flush=True)
''')
    assert out.stdout.splitlines() == ["stopped instead"], out


@pytest.mark.timeout(20)
def test_a_stop_taken_during_a_hanging_atexit_handler_is_pending_in_the_new_run(tmp_path):
    """As above, but the handler hangs: the grace thread execs in its place, and the stop
    the app's thread took is pending (blocked) in the new run, which cli.start turns into
    an exit, instead of lost."""
    out = _reexec_twice(tmp_path, f'''
{MASTER_TRAPS}
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()  # the app's thread

reload.ATEXIT_GRACE_S = 0.5
atexit.register(lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(60)))
reload.reexec(stop_pending)
''', again='''
print("again", sorted(int(s) for s in signal.sigpending()), flush=True)
''')
    assert out.stdout.splitlines()[-1:] == [f"again {[int(signal.SIGTERM)]}"], out


@pytest.mark.timeout(20)
def test_a_stop_during_the_atexit_handlers_ends_the_wait_for_a_fix_instead_of_restarting(tmp_path):
    """Waiting for a fixed edit (cli._wait_for_fix), a stop raises StoppedWhileStarting in
    the main thread. One an app's thread took while reexec ran the atexit handlers was
    raised inside a handler, where atexit prints an exception and drops it: the stop was
    lost and forkq started again. Now it is noted, the handlers run on, and it is raised
    again for the wait's own handler once they are done: forkq exits."""
    out = _reexec_twice(tmp_path, '''
for sig in reload.STOP_SIGNALS:
    signal.signal(sig, cli._stop_while_starting)  # as the wait for a fix has them
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()  # the app's thread
atexit.register(lambda: print("last handler ran", flush=True))
atexit.register(lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(0.2)))  # ctl stop
try:
    reload.reexec()
except cli.StoppedWhileStarting as exc:
    print("stopped instead", exc, flush=True)
''')
    assert out.stdout.splitlines() == ["last handler ran", "stopped instead SIGTERM"], out
    assert "Exception ignored" not in out.stderr, out


@pytest.mark.timeout(20)
def test_a_stop_an_atexit_handler_takes_with_its_own_signal_handler_still_ends_the_wait(tmp_path):
    """As above, but the handler puts a signal handler of its own in place of reexec's
    (here Python's default SIGINT one: the Ctrl-C raises KeyboardInterrupt in it, which
    atexit prints and drops). A master's wakeup pipe still saw such a stop; the wait for a
    fix has none, and forkq started again. reexec now watches a wakeup pipe of its own when
    the process has none, and raises the stop again for the wait's handler."""
    out = _reexec_twice(tmp_path, '''
for sig in reload.STOP_SIGNALS:
    signal.signal(sig, cli._stop_while_starting)  # as the wait for a fix has them

def cleanup():  # an app's, restoring the SIGINT handler it found at import
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while it cleans up
    time.sleep(0.2)

atexit.register(cleanup)
try:
    reload.reexec()
except cli.StoppedWhileStarting as exc:
    print("stopped instead", exc, signal.getsignal(signal.SIGINT) is cli._stop_while_starting,
          signal.set_wakeup_fd(-1), flush=True)
''')
    assert out.stdout.splitlines() == ["stopped instead SIGINT True -1"], out


@pytest.mark.timeout(20)
def test_a_broken_app_that_trapped_term_at_import_does_not_keep_the_wait_for_a_fix_from_stopping(tmp_path):
    """An app that sets a SIGTERM handler of its own at import (a graceful shutdown for its
    service) and then fails to import: waiting for a fix, forkq must still end on `forkq
    ctl stop`. The wait put its stop handlers back only after a master had run; after a
    failed import the app's stayed, and TERM only called it."""
    (tmp_path / "jobs.py").write_text(
        "import signal\n"
        "signal.signal(signal.SIGTERM, lambda *a: print('app handler', flush=True))\n"
        "raise RuntimeError('broken edit')\n")
    out = tmp_path / "out.log"
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p))
    with open(out, "ab") as sink:
        proc = subprocess.Popen(forkq_command("start", "--reload", "--require", "jobs.py",
                                              "--pidfile", str(tmp_path / "forkq.pid")),
                                env=env, cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: "waiting for a change" in out.read_text(), timeout=15,
                   message="the wait after the broken import")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(5) == 0, out.read_text()
        assert "app handler" not in out.read_text()
        assert "stop requested while starting" in out.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("wakeup", ["master", "wait"])
def test_a_process_an_atexit_handler_forks_can_be_terminated_and_is_no_stop_of_forkqs(tmp_path, wakeup):
    """A process forked while the handlers run (multiprocessing's fork start method) kept
    reexec's `hold` as its TERM handler, so terminate() did nothing, and the wakeup pipe, so
    the TERM it got was written to forkq's: a master (`master`: its self-pipe) or the wait
    for a fix (`wait`: reexec's own pipe) took it for a stop and exited instead of starting
    again. Such a fork gets a plain Python process's signal handling."""
    out = _reexec_twice(tmp_path, f'''
stop_pending = None
if {wakeup!r} == "master":
{textwrap.indent(MASTER_TRAPS, "    ")}
else:
    for sig in reload.STOP_SIGNALS:
        signal.signal(sig, cli._stop_while_starting)  # as the wait for a fix has them

def cleanup():  # an app's, doing its last work in a process of its own
    p = multiprocessing.get_context("fork").Process(target=time.sleep, args=(10,))
    p.start()
    p.terminate()  # at once: before its at-fork hooks, maybe
    p.join(1)
    print("fork ended", p.exitcode, flush=True)
    if p.exitcode is None:
        p.kill()

atexit.register(cleanup)
reload.ATEXIT_GRACE_S = 10  # the handler ends first, either way
try:
    reload.reexec(stop_pending)
    print("stopped instead", flush=True)
except cli.StoppedWhileStarting as exc:
    print("stopped instead", exc, flush=True)
''')
    assert out.stdout.splitlines() == [f"fork ended {-signal.SIGTERM}", "again"], out


@pytest.mark.timeout(20)
def test_a_process_an_atexit_handler_starts_does_not_inherit_the_stop_signals_blocked(tmp_path):
    """reexec blocks TERM and INT around its last look and the exec, but runs the atexit
    handlers with them unblocked: a process a handler started inherited them blocked, and
    ignored `kill` and Ctrl-C for as long as it ran."""
    out = _reexec_twice(tmp_path, '''
SHOW = "import signal; print('blocked', sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])))"
atexit.register(lambda: subprocess.run([sys.executable, "-c", SHOW]))
reload.reexec()
''')
    assert out.stdout.splitlines() == ["blocked []", "again"], out


@pytest.mark.timeout(60)
def test_a_master_reloads_on_an_edit_keeps_its_pid_and_survives_a_syntax_error(redis_url, r, tmp_path):
    jobs = tmp_path / "jobs.py"
    jobs.write_text(JOBS.format(version=1))
    pidfile = tmp_path / "forkq.pid"
    out = tmp_path / "master.log"
    env = dict(os.environ, FORKQ_REDIS_URL=redis_url, PYTHONDONTWRITEBYTECODE="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p))
    cmd = forkq_command("start", "--reload", "--require", "jobs.py", "--processes", "2",
                        "--concurrency", "1", "--timeout", "10", "--pidfile", str(pidfile),
                        "--log-format", "json")
    with open(out, "ab") as sink:
        proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True)
    log = lambda: out.read_text(errors="replace")  # noqa: E731
    done = lambda: [x.decode() for x in r.lrange("reload:done", 0, -1)]  # noqa: E731

    def alive(value):
        assert proc.poll() is None, f"master exited with {proc.returncode}:\n{log()[-3000:]}"
        return value
    try:
        # a job that holds on until the reload has begun
        _push(r, 1, hold=True)
        wait_until(lambda: alive(r.lrange("reload:started", 0, -1)), timeout=15,
                   message="job 1 started")
        _touch(jobs, JOBS.format(version=22))
        wait_until(lambda: alive("reloading: jobs.py changed" in log()), timeout=10,
                   message="the reload's log line")
        _touch(jobs, JOBS.format(version=2))       # saved again during the stop: no second reload
        r.set("reload:release", 1)
        _push(r, 2)
        wait_until(lambda: alive("2:2" in done()), timeout=15, message="job 2 run by the new code")
        # the job running at the change finished once, with the code it started with
        assert done().count("1:1") == 1 and [x for x in done() if x.endswith(":1")] == ["1:1"]
        assert [x.decode() for x in r.lrange("reload:started", 0, -1)].count("1:1") == 1
        assert log().count('"master started"') == 2 and log().count("reloading:") == 1
        assert r.lrange("reload:atexit", 0, -1) == [f"1:{proc.pid}".encode()]
        assert int(pidfile.read_text()) == proc.pid
        assert {e["pid"] for e in map(json.loads, filter(None, log().splitlines()))
                if e.get("event") == "master started"} == {proc.pid}

        # a broken edit: the error, then a wait; the fix starts it again
        _touch(jobs, "VERSION = (\n")
        wait_until(lambda: alive("waiting for a change" in log()), timeout=15,
                   message="the wait after a syntax error")
        assert "SyntaxError" in log() and int(pidfile.read_text()) == proc.pid
        _push(r, 3)
        _touch(jobs, JOBS.format(version=333))
        wait_until(lambda: alive("333:3" in done()), timeout=15, message="job 3 after the fix")

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        # the broken edit's run had nothing registered; the last one's ran at its exit
        assert r.lrange("reload:atexit", 0, -1) == [f"{v}:{proc.pid}".encode() for v in (1, 2, 333)]
        assert not pidfile.exists()
        assert r.llen("queue:default") == 0
    finally:
        kids = []
        with contextlib.suppress(psutil.Error):
            kids = psutil.Process(proc.pid).children(recursive=True)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        for kid in kids:
            with contextlib.suppress(psutil.Error):
                kid.kill()
        proc.wait(10)
