"""`forkq ctl`: a master found through its pidfile, and processes anywhere through Redis.

Every master here is a real `python -m forkq start` in a session of its own (so its
process group is ours to SIGKILL at teardown), with its own pidfile under tmp_path; `ctl`
runs as a real `python -m forkq ctl` subprocess. Children are told apart by their
heartbeats in Redis (`info.master` names the master's pid), jobs come from
tests/apps/supervised_jobs.py (each run recorded in `sup:events`). Waiting is always a
deadline (helpers.wait_until), never a fixed sleep.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import forkq
from forkq import keys
from helpers import forkq_command, free_port, wait_until

REPO_ROOT = Path(__file__).resolve().parent.parent
JOBS_APP = Path(__file__).resolve().parent / "apps" / "supervised_jobs.py"
EVENTS = "sup:events"


# -- the master under test ---------------------------------------------------------------------


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("FORKQ_PIDFILE", "FORKQ_CONFIG")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env.update(extra or {})
    return env


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class Master:
    def __init__(self, workdir: Path, *args: str, processes: int = 2, concurrency: int = 1,
                 pidfile: bool = True, env: dict[str, str] | None = None,
                 constants: dict[str, float] | None = None) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.processes = processes
        self.pidfile = workdir / "forkq.pid"
        # constants: forkq module constants to run with (helpers.forkq_command)
        self.cmd = forkq_command("start", "--require", str(JOBS_APP), "--processes", str(processes),
                                 "--concurrency", str(concurrency), "--log-format", "json", *args,
                                 constants=constants)
        if pidfile:
            self.cmd += ["--pidfile", str(self.pidfile)]
        self.env = _env(env)
        self.log_path = workdir / "master.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Master":
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, env=self.env, cwd=self.workdir, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    def tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return f"--- {self.workdir.name} log ---\n" + "\n".join(text)

    def check(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"master exited with {self.proc.returncode}\n{self.tail()}")
        return True

    def wait_ready(self, r, pidfile: Path | None = None, timeout: float = 20.0) -> dict[int, dict]:
        """Until the pidfile names the master and every slot's child heartbeats: {slot: beat}."""
        pidfile = pidfile or self.pidfile

        def ready():
            self.check()
            beats = child_beats(r, self.pid)
            return beats if read_pidfile(pidfile) == self.pid and len(beats) == self.processes else None
        return wait_until(ready, timeout=timeout, interval=0.02,
                          message=f"pidfile and {self.processes} child heartbeats\n{self.tail()}")

    def children(self) -> list[int]:
        try:
            return sorted(c.pid for c in psutil.Process(self.pid).children() if not _gone(c.pid))
        except psutil.Error:
            return []

    def title(self) -> str:
        with contextlib.suppress(psutil.Error):
            return " ".join(psutil.Process(self.pid).cmdline())
        return ""

    def log_events(self, event: str) -> list[dict]:
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                entry = json.loads(line)
                if entry.get("event") == event:
                    out.append(entry)
        return out

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"master still running after {timeout:g}s\n{self.tail()}") from None

    def kill(self) -> None:
        if self.proc is None:
            return
        kids = []
        with contextlib.suppress(psutil.Error):
            kids = psutil.Process(self.pid).children(recursive=True)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        for kid in kids:
            with contextlib.suppress(psutil.Error):
                kid.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


@pytest.fixture
def start_master(redis_url, tmp_path):
    """start_master(*args, name=, processes=, concurrency=, pidfile=, env=) -> a started Master
    (cwd tmp_path/name, its own --pidfile there unless pidfile=False)."""
    started: list[Master] = []

    def start(*args: str, name: str | None = None, **kwargs) -> Master:
        m = Master(tmp_path / (name or f"master{len(started)}"), *args, **kwargs)
        started.append(m)
        return m.start()

    yield start
    for m in started:
        try:
            m.kill()
        finally:
            print(m.tail(60))  # shown when the test failed


@pytest.fixture
def sleeper():
    """A live process that is not a forkq master (`sleep 300`); killed at teardown."""
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


def ctl(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "forkq", "ctl", *args], cwd=cwd, env=_env(env),
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def ok(out: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert out.returncode == 0, (out.args, out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr
    return out


def one_line_failure(out: subprocess.CompletedProcess, *expected: str) -> str:
    assert out.returncode != 0, (out.args, out.stdout, out.stderr)
    err = out.stderr.strip()
    assert err and "\n" not in err, f"not one line on stderr:\n{out.stderr}"
    assert "Traceback" not in out.stderr + out.stdout
    for text in expected:
        assert text in err, f"{text!r} not in {err!r}"
    return err


def read_pidfile(path: Path) -> int | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    return int(text) if text.strip().isdigit() else None


# -- Redis side --------------------------------------------------------------------------------


def beats(r) -> dict[str, dict]:
    """identity -> {"info", "quiet", "busy", "beat"} of every heartbeat in `processes`."""
    out = {}
    for member in r.smembers("processes"):
        h = r.hgetall(member)
        if not h:
            continue
        out[member.decode()] = {"info": json.loads(h[b"info"]), "quiet": h[b"quiet"].decode(),
                                "busy": int(h[b"busy"]), "beat": float(h[b"beat"])}
    return out


def child_beats(r, master_pid: int) -> dict[int, dict]:
    """slot -> heartbeat (with "identity") of each child of that master."""
    out = {}
    for identity, hb in beats(r).items():
        master = hb["info"].get("master") or ""
        if master.split(":")[1:2] == [str(master_pid)]:
            out[hb["info"]["slot"]] = dict(hb, identity=identity)
    return out


def push(url: str, name: str, *args) -> str:
    return forkq.Client(url).push(name, list(args))


def sup_events(r, event: str, tag: str) -> list[dict]:
    return [e for e in map(json.loads, r.lrange(EVENTS, 0, -1)) if e["event"] == event and e["tag"] == tag]


def wait_started(r, m: Master, tag: str) -> dict:
    def started():
        m.check()
        return sup_events(r, "start", tag)
    return wait_until(started, timeout=15, interval=0.02, message=f"job {tag} started\n{m.tail()}")[0]


def private_keys(r) -> list[bytes]:
    return [k for pattern in ("forkq:inflight:*", "forkq:landing:*") for k in r.scan_iter(match=pattern)]


def queued_jids(r, queue: str = "default") -> list[str]:
    return [json.loads(raw)["jid"] for raw in r.lrange(f"queue:{queue}", 0, -1)]


# -- pidfile ------------------------------------------------------------------------------------


@pytest.mark.timeout(40)
def test_pidfile_holds_the_master_pid_and_is_gone_after_ctl_stop(start_master, r, tmp_path):
    m = start_master()
    m.wait_ready(r)
    assert m.pidfile.read_text() == f"{m.pid}\n"
    # written atomically: through a temporary file in the same directory, none left behind
    assert sorted(p.name for p in m.pidfile.parent.iterdir() if "pid" in p.name) == ["forkq.pid"]

    out = ok(ctl("stop", "--pidfile", str(m.pidfile), cwd=tmp_path))
    assert f"master {m.pid} exited" in out.stdout
    assert m.proc.poll() == 0           # ctl stop returned only once the master had exited
    assert not m.pidfile.exists()


@pytest.mark.timeout(40)
def test_forkq_pidfile_env_is_the_default_for_start_and_ctl(start_master, r, tmp_path):
    path = tmp_path / "from-env.pid"
    m = start_master(pidfile=False, env={"FORKQ_PIDFILE": str(path)})
    m.wait_ready(r, pidfile=path)
    env = {"FORKQ_PIDFILE": str(path)}
    out = ok(ctl("status", cwd=tmp_path, env=env))
    assert f"master pid {m.pid}" in out.stdout
    ok(ctl("stop", "--timeout", "20", cwd=tmp_path, env=env))
    assert m.proc.poll() == 0           # exited before ctl stop returned
    assert not path.exists()


@pytest.mark.timeout(40)
def test_pidfile_from_tool_forkq_is_where_ctl_looks_by_default(start_master, r, tmp_path):
    # `ctl` looks where `start` wrote, and `start` took the path from [tool.forkq]
    app = tmp_path / "app"
    app.mkdir()
    path = tmp_path / "from-pyproject.pid"
    (app / "pyproject.toml").write_text(f'[tool.forkq]\npidfile = "{path}"\n')
    m = start_master(name="app", pidfile=False)
    m.wait_ready(r, pidfile=path)
    out = ok(ctl("status", cwd=app))
    assert f"master pid {m.pid}" in out.stdout
    ok(ctl("stop", cwd=app))
    assert m.proc.poll() == 0           # exited before ctl stop returned
    assert not path.exists()


@pytest.mark.timeout(40)
def test_ctl_works_beside_a_pyproject_that_is_not_toml_and_has_no_forkq_settings(start_master, r, tmp_path):
    m = start_master()
    m.wait_ready(r)
    project = tmp_path / "project"
    project.mkdir()
    # TOML 1.1 (a newline in an inline table), which Python 3.11's tomllib refuses
    (project / "pyproject.toml").write_text('[project]\nname = "x"\n[tool.other]\nmap = {\n  a = 1,\n}\n')
    out = ok(ctl("status", "--pidfile", str(m.pidfile), cwd=project))
    assert f"master pid {m.pid}" in out.stdout
    ok(ctl("stop", "--pidfile", str(m.pidfile), "--timeout", "20", cwd=project))
    assert m.proc.poll() == 0
    # one that means to configure forkq is still refused: its pidfile may be another one
    (project / "pyproject.toml").write_text('[tool.forkq]\npidfile = "/run/x.pid"\nbroken = = 1\n')
    one_line_failure(ctl("status", "--pidfile", str(m.pidfile), cwd=project), "pyproject.toml",
                     "not valid TOML")


# -- status and check ---------------------------------------------------------------------------

ROW = re.compile(r"^\s*(?P<slot>\d+|-)\s+(?P<pid>\d+)\s+(?P<busy>\d+/\d+|-)\s+(?P<rss>[\d.]+)\s+"
                 r"(?P<age>[\d.]+)s ago\s+(?P<state>.+?)\s*$")


def parse_status(stdout: str) -> tuple[int, int, list[dict]]:
    lines = stdout.splitlines()
    head = re.match(r"^master pid (\d+)\s+children (\d+)$", lines[0])
    assert head, stdout
    assert lines[1].split() == ["slot", "pid", "busy", "rss", "MB", "heartbeat", "state"], stdout
    rows = []
    for line in lines[2:]:
        match = ROW.match(line)
        assert match, f"unparsed status row {line!r}\n{stdout}"
        rows.append(match.groupdict())
    return int(head[1]), int(head[2]), rows


@pytest.mark.timeout(40)
def test_status_lists_every_child_with_slot_pid_busy_rss_and_heartbeat_age(start_master, r, redis_url, tmp_path):
    m = start_master("--heartbeat-interval", "1", processes=2, concurrency=3)
    m.wait_ready(r)
    push(redis_url, "sup.sleep", "long", 60)
    wait_started(r, m, "long")
    # the busy child's next heartbeat carries it
    wait_until(lambda: sum(hb["busy"] for hb in child_beats(r, m.pid).values()) == 1, timeout=5,
               message="a heartbeat with busy 1")

    out = ok(ctl("status", "--pidfile", str(m.pidfile), cwd=tmp_path))
    master, count, rows = parse_status(out.stdout)
    assert (master, count) == (m.pid, 2)
    assert sorted(int(row["slot"]) for row in rows) == [0, 1]
    assert sorted(int(row["pid"]) for row in rows) == m.children()
    beat_pids = {slot: hb["info"]["pid"] for slot, hb in child_beats(r, m.pid).items()}
    assert {int(row["slot"]): int(row["pid"]) for row in rows} == beat_pids
    assert sorted(row["busy"] for row in rows) == ["0/3", "1/3"]
    for row in rows:
        rss = psutil.Process(int(row["pid"])).memory_info().rss / 1_048_576
        assert 5 < float(row["rss"]) < 2000 and abs(float(row["rss"]) - rss) < 20, (row, rss)
        assert 0 <= float(row["age"]) < 3, row    # heartbeats every second
        assert row["state"] == "running"


@pytest.mark.timeout(40)
def test_check_is_healthy_then_fails_on_a_stale_child_heartbeat_then_on_a_dead_master(start_master, r, tmp_path):
    m = start_master("--heartbeat-interval", "0.5", processes=2)
    beats_by_slot = m.wait_ready(r)
    out = ok(ctl("check", "--pidfile", str(m.pidfile), cwd=tmp_path))
    assert out.stdout.startswith(f"ok: master {m.pid}, 2 children")

    # a child that stops heartbeating (stopped, so the master does not replace it yet)
    frozen = beats_by_slot[1]["info"]["pid"]
    os.kill(frozen, signal.SIGSTOP)
    try:
        out = wait_until(lambda: (o := ctl("check", "--max-age", "1.5", "--pidfile", str(m.pidfile),
                                           cwd=tmp_path)).returncode != 0 and o,
                         timeout=10, interval=0.1, message="check failing on a frozen child")
        one_line_failure(out, "unhealthy", str(m.pid), "1 without a recent heartbeat")
    finally:
        os.kill(frozen, signal.SIGCONT)
    ok(ctl("check", "--max-age", "1.5", "--pidfile", str(m.pidfile), cwd=tmp_path))

    # the master dies without cleaning up: its pidfile stays, naming a dead process
    os.killpg(m.pid, signal.SIGKILL)
    m.proc.wait(10)
    assert read_pidfile(m.pidfile) == m.pid
    err = one_line_failure(ctl("check", "--pidfile", str(m.pidfile), cwd=tmp_path), "stale pidfile")
    assert str(m.pid) in err and "not running" in err


@pytest.mark.timeout(40)
@pytest.mark.parametrize("case", ["missing", "empty", "dead pid", "not forkq"])
def test_missing_or_stale_pidfile_is_one_line_and_exit_1(tmp_path, sleeper, case):
    path = tmp_path / "forkq.pid"
    expected = {"missing": "missing", "empty": "missing or empty", "dead pid": "not running",
                "not forkq": "not a forkq master"}[case]
    if case == "empty":
        path.write_text("")
    elif case == "dead pid":
        gone = subprocess.Popen(["true"])
        gone.wait()
        path.write_text(f"{gone.pid}\n")
    elif case == "not forkq":
        path.write_text(f"{sleeper.pid}\n")
    # every action at once (they only read the pidfile)
    procs = {action: subprocess.Popen([sys.executable, "-m", "forkq", "ctl", action, "--pidfile", str(path)],
                                      cwd=tmp_path, env=_env(), stdin=subprocess.DEVNULL, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for action in ("status", "check", "quiet", "stop")}
    for action, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=30)
        out = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        assert out.returncode == 1, (action, out)
        one_line_failure(out, str(path), expected)
    assert sleeper.poll() is None, "ctl signalled a process that is not a forkq master"


@pytest.mark.timeout(20)
def test_a_master_that_exits_between_lookups_is_a_config_error_not_a_traceback(r):
    # `ctl status`/`check` look the master up, then list its children: it may exit in between
    from forkq import control
    from forkq.errors import ConfigError
    gone = subprocess.Popen(["true"])
    gone.wait()
    with pytest.raises(ConfigError, match=f"master {gone.pid} has exited"):
        control.children_of(gone.pid, r)


# -- quiet and stop through the pidfile ---------------------------------------------------------


@pytest.mark.timeout(40)
def test_ctl_quiet_shows_in_every_child_heartbeat_at_once_and_the_master_stays(start_master, r, redis_url, tmp_path):
    # heartbeats every 5 s: quiet must show at once, not at the next scheduled beat
    m = start_master("--heartbeat-interval", "5", processes=2)
    before = m.wait_ready(r)
    assert all(hb["quiet"] == "false" for hb in before.values())
    out = ok(ctl("quiet", "--pidfile", str(m.pidfile), cwd=tmp_path))
    assert f"master {m.pid}" in out.stdout
    wait_until(lambda: {hb["quiet"] for hb in child_beats(r, m.pid).values()} == {"true"},
               timeout=2, interval=0.02, message="every child heartbeat quiet within 2 s")
    m.check()
    assert {hb["info"]["pid"] for hb in child_beats(r, m.pid).values()} == set(m.children())
    status = ok(ctl("status", "--pidfile", str(m.pidfile), cwd=tmp_path))
    assert [row["state"] for row in parse_status(status.stdout)[2]] == ["quiet", "quiet"]

    # quiet children take nothing: a job pushed now is still queued after the stop
    jid = push(redis_url, "sup.quick", "after-quiet")
    ok(ctl("stop", "--pidfile", str(m.pidfile), cwd=tmp_path))
    assert m.proc.poll() == 0           # exited before ctl stop returned
    assert queued_jids(r) == [jid]
    assert not sup_events(r, "done", "after-quiet")


@pytest.mark.timeout(40)
def test_ctl_stop_timeout_on_a_busy_master_exits_nonzero_saying_it_still_runs(start_master, r, redis_url, tmp_path):
    m = start_master("--timeout", "30", "--heartbeat-interval", "20", processes=1)
    m.wait_ready(r)
    push(redis_url, "sup.sleep", "long", 60)
    wait_started(r, m, "long")
    started = time.monotonic()
    out = ctl("stop", "--timeout", "1", "--pidfile", str(m.pidfile), cwd=tmp_path)
    waited = time.monotonic() - started
    assert out.returncode == 1
    one_line_failure(out, f"master {m.pid}", "still running", "1s")
    assert 1 <= waited < 10, waited
    m.check()                              # still draining its job: not killed by ctl
    assert read_pidfile(m.pidfile) == m.pid
    # the draining child shows as quiet at once, not at its next beat, 20 s away
    wait_until(lambda: {hb["quiet"] for hb in child_beats(r, m.pid).values()} == {"true"},
               timeout=3, interval=0.05, message="the stopping child's heartbeat quiet")


@pytest.mark.timeout(40)
def test_ctl_stop_puts_the_running_job_back_and_leaves_no_private_keys(start_master, r, redis_url, tmp_path):
    m = start_master("--timeout", "1", processes=2)
    m.wait_ready(r)
    jid = push(redis_url, "sup.sleep", "long", 60)
    wait_started(r, m, "long")
    assert private_keys(r)                 # the job sits in its child's in-flight hash
    out = ok(ctl("stop", "--timeout", "20", "--pidfile", str(m.pidfile), cwd=tmp_path))
    assert "exited" in out.stdout
    assert m.proc.poll() == 0           # exited before ctl stop returned
    assert queued_jids(r) == [jid]
    assert private_keys(r) == []
    assert r.hlen("forkq:owners") == 0
    assert not sup_events(r, "done", "long")
    assert not m.pidfile.exists()


# -- remote: through each process's -signals list in Redis ----------------------------------


@pytest.mark.timeout(40)
def test_remote_quiet_all_quiets_two_masters_children_within_a_heartbeat(start_master, r, tmp_path):
    a = start_master("--heartbeat-interval", "1", processes=2)
    b = start_master("--heartbeat-interval", "1", processes=1)
    children = {**{hb["identity"]: a for hb in a.wait_ready(r).values()},
                **{hb["identity"]: b for hb in b.wait_ready(r).values()}}
    pids = (a.children(), b.children())
    out = ok(ctl("quiet", "--all", cwd=tmp_path))
    sent = time.monotonic()
    assert sorted(out.stdout.split()[2::3]) == sorted(children)     # "TSTP -> IDENTITY" lines
    assert set(out.stdout.split()[::3]) == {"TSTP"}

    # the first scheduled heartbeat after the push takes the signal, and the beat right after
    # it says quiet: the quiet beat comes at most one interval after the last beat before it
    before = {i: hb["beat"] for i, hb in beats(r).items() if i in children}
    first_quiet: dict[str, float] = {}

    def all_quiet():
        for i, hb in beats(r).items():
            if i in children and hb["quiet"] == "true":
                first_quiet.setdefault(i, hb["beat"])
        return len(first_quiet) == len(children)
    wait_until(all_quiet, timeout=2.5, interval=0.01, message="every child quiet within ~one heartbeat")
    assert time.monotonic() - sent < 2.5
    late = {i: round(first_quiet[i] - before[i], 2) for i in children}
    assert max(late.values()) < 1.5, f"quiet beats came this long after the last plain one: {late}"
    a.check(), b.check()
    assert (a.children(), b.children()) == pids                      # nobody stopped or restarted
    assert r.llen(next(iter(children)) + "-signals") == 0            # the signal was taken


@pytest.mark.timeout(40)
def test_remote_quiet_identity_quiets_that_childs_master_only(start_master, r, tmp_path):
    # The master is the unit: a child quieted alone would be replaced by one that takes
    # jobs again, so a quiet aimed at one child quiets its whole master, and no other.
    a = start_master("--heartbeat-interval", "1", processes=2)
    b = start_master("--heartbeat-interval", "1", processes=1)
    by_slot = a.wait_ready(r)
    other_master_child = b.wait_ready(r)[0]["identity"]
    target, sibling = by_slot[0]["identity"], by_slot[1]["identity"]
    out = ok(ctl("quiet", "--identity", target, cwd=tmp_path))
    assert out.stdout.strip() == f"TSTP -> {target}"
    quiet_seen = wait_until(lambda: beats(r)[target]["quiet"] == "true" and time.time(), timeout=2.5,
                            interval=0.02, message="the target child quiet")
    wait_until(lambda: beats(r)[sibling]["quiet"] == "true", timeout=5, interval=0.02,
               message="its sibling quiet too, through their master")
    # the other master's child heartbeats twice more and stays busy taking jobs
    wait_until(lambda: beats(r)[other_master_child]["beat"] > quiet_seen + 1, timeout=5, interval=0.05,
               message="two more heartbeats of the other master's child")
    assert beats(r)[other_master_child]["quiet"] == "false"

    missing = ctl("quiet", "--identity", "nohost:1:000000000000", cwd=tmp_path)
    assert missing.returncode == 1
    one_line_failure(missing, "no live process matches")


@pytest.mark.timeout(40)
def test_remote_ctl_given_a_masters_name_says_which_identity_to_give(start_master, r, tmp_path):
    # `forkq processes` shows each master's name in its own column: taken for an identity,
    # it got only "no live process matches", with nothing saying what to give instead
    m = start_master("--heartbeat-interval", "1", processes=1)
    child = m.wait_ready(r)[0]
    master = child["info"]["master"]
    err = one_line_failure(ctl("quiet", "--identity", master, cwd=tmp_path),
                           "no live process matches", f"{master} is a master",
                           f"--identity {child['identity']}")
    assert beats(r)[child["identity"]]["quiet"] == "false" and r.llen(child["identity"] + "-signals") == 0, err


@pytest.mark.timeout(40)
def test_remote_stop_identity_stops_that_childs_master_and_host_stops_the_rest(start_master, r, tmp_path):
    a = start_master("--heartbeat-interval", "1", processes=2)
    b = start_master("--heartbeat-interval", "1", processes=1)
    target = a.wait_ready(r)[1]["identity"]
    b_child = b.wait_ready(r)[0]
    b_pids = b.children()

    # a child asked to stop takes its whole master down: a child stopped alone would just be
    # replaced in its slot, and the stop would do nothing visible
    ok(ctl("stop", "--identity", target, cwd=tmp_path))
    assert a.wait_exit(10) == 0
    assert len(a.log_events("child started")) == 2, "a child was respawned"
    assert not a.pidfile.exists()
    b.check()
    assert b.children() == b_pids
    wait_until(lambda: beats(r)[b_child["identity"]]["beat"] > b_child["beat"], timeout=5,
               message="the other master's child still heartbeats")

    out = ok(ctl("stop", "--host", socket.gethostname(), cwd=tmp_path))
    assert out.stdout.split() == ["TERM", "->", b_child["identity"]]
    assert b.wait_exit(10) == 0
    assert len(b.log_events("child started")) == 1, "a child was respawned"
    assert not b.pidfile.exists()
    assert beats(r) == {}
    assert private_keys(r) == []


@pytest.mark.timeout(40)
def test_remote_quiet_makes_the_master_quiet_too(start_master, r, tmp_path):
    m = start_master("--heartbeat-interval", "1", processes=1)
    m.wait_ready(r)
    ok(ctl("quiet", "--all", cwd=tmp_path))
    wait_until(lambda: {hb["quiet"] for hb in child_beats(r, m.pid).values()} == {"true"}, timeout=2.5,
               message="child quiet")
    # what a local `ctl quiet` (TSTP) gives: the master's title says quiet
    wait_until(lambda: "quiet" in m.title(), timeout=2, message=f"master title quiet: {m.title()!r}")


@pytest.mark.timeout(30)
def test_remote_ctl_without_redis_is_one_line(tmp_path):
    out = ctl("quiet", "--all", cwd=tmp_path, env={"FORKQ_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"})
    assert out.returncode == 1
    one_line_failure(out, "cannot reach Redis")


@pytest.mark.timeout(60)
def test_check_fails_while_the_master_is_stuck_though_its_children_beat(start_master, r, tmp_path):
    """Children heartbeat whatever their master does: a master whose loop is stuck would
    neither replace a dead child nor answer a stop, and only its pidfile's age shows it."""
    m = start_master("--heartbeat-interval", "0.5", processes=1, constants={"PIDFILE_TOUCH_S": 1.0})
    m.wait_ready(r)
    # over the 1 s between the touches of a master whose loop turns, with room for a turn
    check = ("check", "--stuck-after", "2", "--pidfile", str(m.pidfile))
    ok(ctl(*check, cwd=tmp_path))
    os.kill(m.pid, signal.SIGSTOP)
    try:
        out = wait_until(lambda: (o := ctl(*check, cwd=tmp_path)).returncode != 0 and o,
                         timeout=20, interval=0.5, message="check failing on a stopped master")
        one_line_failure(out, "unhealthy", str(m.pid), "has not turned its loop")
    finally:
        os.kill(m.pid, signal.SIGCONT)
    wait_until(lambda: ctl(*check, cwd=tmp_path).returncode == 0, timeout=15, interval=0.5,
               message="check healthy again once the master runs")


@pytest.mark.timeout(60)
def test_a_second_master_on_a_chosen_pidfile_refuses_to_start(start_master, r, tmp_path):
    first = start_master(processes=1)
    first.wait_ready(r)
    second = subprocess.run(first.cmd, env=first.env, cwd=tmp_path, capture_output=True, text=True,
                            timeout=30, stdin=subprocess.DEVNULL)
    assert second.returncode == 2
    err = second.stderr.strip()
    assert "\n" not in err and "Traceback" not in err
    assert str(first.pidfile) in err and f"belongs to forkq master {first.pid}" in err
    assert read_pidfile(first.pidfile) == first.pid
    ok(ctl("check", "--pidfile", str(first.pidfile), cwd=tmp_path))


@pytest.mark.timeout(60)
def test_check_require_redis_fails_where_redis_cannot_be_reached(start_master, r, tmp_path):
    """Liveness judges a pod by its processes when Redis is away (restarting would not
    help); readiness must not call a pod with a wrong Redis URL ready."""
    m = start_master(processes=1)
    m.wait_ready(r)
    wrong = {"FORKQ_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
    out = ok(ctl("check", "--pidfile", str(m.pidfile), cwd=tmp_path, env=wrong))
    assert "Redis unreachable" in out.stdout
    one_line_failure(ctl("check", "--require-redis", "--pidfile", str(m.pidfile), cwd=tmp_path, env=wrong))


@pytest.mark.timeout(60)
def test_jobs_that_finish_while_quiet_are_acknowledged_before_the_stop(start_master, r, redis_url, tmp_path):
    """Quiet can last until the pod's grace period ends in SIGKILL: a job that finished
    meanwhile must already be off the in-flight hash, or it would run again."""
    m = start_master(processes=1, concurrency=2)
    (beat,) = m.wait_ready(r).values()
    identity = next(i for i, hb in beats(r).items() if hb["info"]["pid"] == beat["info"]["pid"])
    push(redis_url, "sup.sleep", "short", 1)
    push(redis_url, "sup.sleep", "long", 60)
    wait_started(r, m, "short")
    wait_started(r, m, "long")
    ok(ctl("quiet", "--pidfile", str(m.pidfile), cwd=tmp_path))
    wait_until(lambda: sup_events(r, "done", "short"), timeout=15, message="the short job done")
    # only the long job is left in flight, with the process still quiet and running
    wait_until(lambda: r.hlen(keys.inflight(identity)) == 1, timeout=5,
               message="the finished job's ack sent while quiet")
    m.check()
    os.killpg(m.pid, signal.SIGKILL)
    m.proc.wait(10)
    assert r.hlen(keys.inflight(identity)) == 1
