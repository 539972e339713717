"""Security: no pickle, names resolve only through the registry, Redis passwords never leak.

Real processes throughout: a `forkq start --no-fork` worker fed payloads naming dangerous
callables, and a password-protected private redis-server watched by a master (JSON logs),
a --no-fork worker (text logs), `ctl status`, `--print-config` and the heartbeats in Redis,
also after the server is stopped mid-run.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from redis.backoff import NoBackoff
from redis.retry import Retry

from corekit import CORE_JOBS, records, workers, zset  # noqa: F401
from helpers import RedisServer, wait_until

REPO_ROOT = Path(__file__).resolve().parent.parent
FORKQ_DIR = REPO_ROOT / "forkq"


# -- no pickle ---------------------------------------------------------------------------------

UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve", "jsonpickle"}


def test_no_pickle_anywhere_in_forkq():
    offenders = []
    for path in sorted(FORKQ_DIR.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id == "__import__" and node.args
                  and isinstance(node.args[0], ast.Constant)):
                names = [node.args[0].value]
            for name in names:
                if name.split(".")[0] in UNSAFE_MODULES:
                    offenders.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} imports {name}")
        if "pickle" in path.read_text():
            offenders.append(f"{path.relative_to(REPO_ROOT)} mentions pickle")
    # the README's promise is that there is none at all, not even mentioned in a comment
    # except to say there is none
    offenders = [o for o in offenders
                 if not (o.endswith("mentions pickle") and _only_says_no_pickle(REPO_ROOT / o.split()[0]))]
    assert not offenders, offenders


def _only_says_no_pickle(path):
    lines = [ln for ln in path.read_text().splitlines() if "pickle" in ln]
    return all(ln.lstrip().startswith(("#", '"', "'")) or "no pickle" in ln for ln in lines)


# -- payloads naming callables that are not registered jobs ------------------------------------


@pytest.mark.timeout(30)
def test_a_payload_naming_any_unregistered_callable_never_runs_it(workers, r, tmp_path):
    m = {name: tmp_path / f"marker-{name}" for name in
         ("system", "call", "popen", "eval", "exec", "touch", "cli", "module")}
    hostile = [
        ("os.system", [f"touch {m['system']}"]),
        ("subprocess.call", [["touch", str(m["call"])]]),
        ("subprocess.Popen", [["touch", str(m["popen"])]]),
        ("builtins.eval", [f"open({str(m['eval'])!r}, 'w').close()"]),
        ("eval", [f"open({str(m['eval'])!r}, 'w').close()"]),
        ("builtins.exec", [f"open({str(m['exec'])!r}, 'w').close()"]),
        ("pathlib.Path.touch", [str(m["touch"])]),
        ("forkq.cli.main", [["start", "--print-config"]]),
        ("forkq.cli.main", [["ctl", "stop", "--all"]]),
        # a real function of the required module that is not a job: it would write core:ran
        ("tests.apps.core_jobs.note", ["pwned"]),
        ("tests.apps.core_jobs.store", []),
        ("tests.apps.core_jobs.SomeFunctionThatIsNotAJob", [f"touch {m['module']}"]),
        # attribute paths and dunders reach nothing either
        ("tests.apps.core_jobs.record.__globals__", []),
        ("tests.apps.core_jobs.os.system", [f"touch {m['system']}"]),
        ("__import__", ["os"]),
        # `wrapped` is only a display name: it never picks the code to run
        ("ActiveJob::QueueAdapters::SidekiqAdapter::JobWrapper", ["wrapped"]),
    ]
    for i, (cls, args) in enumerate(hostile):
        r.lpush("queue:default", json.dumps({"class": cls, "args": args, "jid": f"{i:024x}",
                                             "retry": True, "queue": "default",
                                             "wrapped": "tests.apps.core_jobs.record"}))
    # the only processor takes jobs in order: once this has run, every hostile one was handled
    r.lpush("queue:default", json.dumps({"class": "tests.apps.core_jobs.record", "args": ["last"],
                                         "jid": "f" * 24, "queue": "default"}))
    worker = workers(concurrency=1)

    wait_until(lambda: worker.assert_alive() or records(r, "record"), timeout=15,
               message="the good job after the hostile ones")
    entries = wait_until(lambda: (lambda z: z if len(z) == len(hostile) else None)(zset(r, "retry")),
                         timeout=5, message=f"{len(hostile)} entries in retry")
    by_jid = {job["jid"]: job for job, _ in entries}
    for i, (cls, _) in enumerate(hostile):
        job = by_jid[f"{i:024x}"]
        assert "UnknownJob" in job["error_class"], job
        assert repr(cls) in job["error_message"], job
        assert job["retry_count"] == 0
    assert [rec["args"] for rec in records(r)] == [["last"]]  # note("pwned") never ran
    assert not [p for p in m.values() if p.exists()]
    assert r.zcard("dead") == 0
    worker.assert_alive()


# -- Redis passwords ---------------------------------------------------------------------------

PASSWORD = "Xq7-s3cr3t-FORKQ-pw-91zz"


class PasswordRedis(RedisServer):
    """A private redis-server that demands PASSWORD (requirepass)."""

    def _command(self):
        return super()._command() + ["--requirepass", PASSWORD]

    def client(self, **kwargs):
        kwargs.setdefault("password", PASSWORD)
        return super().client(**kwargs)

    @property
    def secret_url(self):
        return f"redis://:{PASSWORD}@127.0.0.1:{self.port}/0"


def _env(url):
    env = {k: v for k, v in os.environ.items() if k not in ("FORKQ_PIDFILE", "FORKQ_CONFIG")}
    env["FORKQ_REDIS_URL"] = url
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


def _forkq(env, *args, timeout=30):
    return subprocess.run([sys.executable, "-m", "forkq", *args], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def spawn(tmp_path):
    """spawn(env, log_name, *args): a `forkq start` in its own session, killed at teardown."""
    procs = []

    def start(env, log_name, *args):
        log = tmp_path / log_name
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "forkq", "start", "--require", str(CORE_JOBS),
                                     *args], env=env, cwd=REPO_ROOT, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(proc)
        return proc, log

    try:
        yield start
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.mark.timeout(60)
def test_the_redis_password_never_appears_in_logs_status_config_or_heartbeats(spawn, tmp_path):
    with PasswordRedis() as server:
        env = _env(server.secret_url)
        r = server.client()
        # sanity: the password is really needed, and really in the URL we hand out (asked
        # once: redis-py would retry the refusal with backoff for about 3 s)
        with pytest.raises(Exception, match="(?i)auth"):
            RedisServer.client(server, retry=Retry(NoBackoff(), 0)).ping()

        pidfile = tmp_path / "forkq.pid"
        master, master_log = spawn(env, "master.json.log", "--processes", "1", "--concurrency", "1",
                                   "--log-format", "json", "--log-level", "debug",
                                   "--heartbeat-interval", "1", "--pidfile", str(pidfile))
        single, single_log = spawn(env, "single.text.log", "--no-fork", "--concurrency", "1",
                                   "--log-format", "text", "--log-level", "debug",
                                   "--heartbeat-interval", "1")

        def alive():
            for proc, log in ((master, master_log), (single, single_log)):
                assert proc.poll() is None, log.read_text()[-3000:]

        wait_until(lambda: alive() or r.scard("processes") >= 2, timeout=20,
                   message="heartbeats of the master's child and the --no-fork worker")
        # a job per worker type, so job lines are in the logs too
        for tag in ("a", "b", "c", "d"):
            r.lpush("queue:default", json.dumps({"class": "tests.apps.core_jobs.record", "args": [tag],
                                                 "jid": tag * 24, "queue": "default"}))
        wait_until(lambda: alive() or r.llen("core:ran") == 4, timeout=10, message="4 jobs ran")

        # process titles and command lines (what `ps` shows every user on the host)
        import psutil
        procs = [psutil.Process(master.pid), psutil.Process(single.pid)]
        procs += psutil.Process(master.pid).children(recursive=True)
        titles = "\n".join(" ".join(p.cmdline()) for p in procs)
        assert "forkq" in titles

        status = _forkq(env, "ctl", "status", "--pidfile", str(pidfile))
        assert status.returncode == 0, status.stderr
        assert f"master pid {master.pid}" in status.stdout
        check = _forkq(env, "ctl", "check", "--pidfile", str(pidfile))
        printed = _forkq(env, "start", "--print-config", "--require", str(CORE_JOBS))
        assert printed.returncode == 0, printed.stderr
        assert "***" in printed.stdout and str(server.port) in printed.stdout

        # everything forkq wrote to Redis: heartbeats (info JSON), stats, in-flight hashes
        stored = []
        for key in r.keys("*"):
            kind = r.type(key)
            if kind == b"hash":
                stored += [k + b"=" + v for k, v in r.hgetall(key).items()]
            elif kind == b"string":
                stored.append(r.get(key))
            elif kind == b"set":
                stored += list(r.smembers(key))
            elif kind == b"list":
                stored += r.lrange(key, 0, -1)
            elif kind == b"zset":
                stored += r.zrange(key, 0, -1)
        infos = [json.loads(r.hget(ident, "info")) for ident in r.smembers("processes")]
        assert len(infos) >= 2 and all("hostname" in info for info in infos)
        r.close()

        # Redis goes away mid-run: both workers log it; a worker booting now logs it too
        server.stop()
        wait_until(lambda: alive() or ("Redis unreachable" in master_log.read_text()
                                       and "Redis unreachable" in single_log.read_text()),
                   timeout=20, message="'Redis unreachable' in both logs")
        late, late_log = spawn(env, "late.text.log", "--no-fork", "--log-format", "text")
        wait_until(lambda: "fetching paused" in late_log.read_text(), timeout=20,
                   message="the late worker's 'fetching paused' line")
        down_status = _forkq(env, "ctl", "status", "--pidfile", str(pidfile))
        down_check = _forkq(env, "ctl", "check", "--pidfile", str(pidfile))
        remote = _forkq(env, "ctl", "quiet", "--all")
        alive()

    texts = {
        "master log (json)": master_log.read_text(),
        "worker log (text)": single_log.read_text(),
        "late worker log (text)": late_log.read_text(),
        "ctl status": status.stdout + status.stderr,
        "ctl check": check.stdout + check.stderr,
        "--print-config": printed.stdout + printed.stderr,
        "ctl status, Redis down": down_status.stdout + down_status.stderr,
        "ctl check, Redis down": down_check.stdout + down_check.stderr,
        "ctl quiet --all, Redis down": remote.stdout + remote.stderr,
        "process titles": titles,
        "Redis contents": "\n".join(v.decode("utf-8", "replace") for v in stored),
    }
    assert "Redis unreachable at boot" in texts["late worker log (text)"]
    leaks = {where: text for where, text in texts.items() if PASSWORD in text}
    assert not leaks, {where: [ln for ln in text.splitlines() if PASSWORD in ln][:3]
                       for where, text in leaks.items()}
    # the password is not hidden by accident (a URL that was never printed): the masked form is
    assert ":***@" in texts["--print-config"]
    assert ":***@" in texts["late worker log (text)"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", [[], ["--no-fork"]])
def test_credentials_redis_refuses_at_start_are_one_line_and_exit_2(tmp_path, mode):
    """A wrong password or ACL user is a setting to fix, not an outage to wait out: start
    used to take it for an unreachable Redis and retry forever."""
    with PasswordRedis() as server:
        r = server.client()
        r.execute_command("ACL", "SETUSER", "worker", "on", ">right-pw", "~*", "&*", "+@all")
        r.close()
        urls = {
            "no password": f"redis://127.0.0.1:{server.port}/0",
            "wrong password": f"redis://:wrong-{PASSWORD}@127.0.0.1:{server.port}/0",
            "wrong ACL password": f"redis://worker:wrong-{PASSWORD}@127.0.0.1:{server.port}/0",
            "unknown ACL user": f"redis://nobody:{PASSWORD}@127.0.0.1:{server.port}/0",
        }
        for case, url in urls.items():
            out = _forkq(_env(url), "start", "--require", str(CORE_JOBS), "--processes", "1",
                         "--pidfile", str(tmp_path / "forkq.pid"), *mode, timeout=30)
            err = out.stderr.strip()
            assert out.returncode == 2, (case, out.returncode, out.stdout[-2000:], out.stderr[-2000:])
            assert "\n" not in err and "Traceback" not in out.stderr, (case, out.stderr)
            assert err.startswith("forkq: Redis refused the credentials"), (case, err)
            assert f"127.0.0.1:{server.port}" in err and PASSWORD not in out.stdout + out.stderr, (case, err)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", [["queues"], ["dead", "list"], ["ctl", "quiet", "--all"]])
def test_credentials_redis_refuses_are_named_by_admin_commands_and_ctl(command):
    """They said "cannot reach Redis", as for a server that is down, though it answered:
    the fix is the password in the URL, as start says."""
    with PasswordRedis() as server:
        for url in (f"redis://127.0.0.1:{server.port}/0",
                    f"redis://:wrong-{PASSWORD}@127.0.0.1:{server.port}/0"):
            out = _forkq(_env(url), *command)
            err = out.stderr.strip()
            assert out.returncode == 1 and "\n" not in err and "Traceback" not in out.stderr, out.stderr
            assert err.startswith("forkq: Redis at redis://") and "refused the credentials" in err, err
            assert f"127.0.0.1:{server.port}" in err and PASSWORD not in err, err


@pytest.mark.timeout(60)
def test_a_password_changed_under_a_running_master_is_retried_not_fatal(spawn, tmp_path):
    # the start-up check must not reach a running worker: Redis refusing it later (a
    # password rotated before the workers' settings) is logged and retried until it is fixed
    with PasswordRedis() as server:
        env = _env(server.secret_url)
        r = server.client()
        master, log = spawn(env, "master.log", "--processes", "1", "--concurrency", "1",
                            "--log-format", "json", "--heartbeat-interval", "1",
                            "--pidfile", str(tmp_path / "forkq.pid"))
        wait_until(lambda: master.poll() is None and r.scard("processes") == 1, timeout=20,
                   message=f"the child's heartbeat\n{log.read_text()[-3000:]}")
        child = psutil.Process(master.pid).children()[0].pid
        r.acl_log_reset()
        r.config_set("requirepass", "rotated")
        r.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")

        def refused_logins() -> int:  # Redis counts the AUTHs it refused in its ACL log
            assert master.poll() is None, log.read_text()[-3000:]
            return sum(int(e["count"]) for e in r.acl_log() if e["reason"] in ("auth", b"auth"))
        wait_until(lambda: refused_logins() >= 3, timeout=20, message="three refused logins")
        assert psutil.Process(master.pid).children()[0].pid == child  # retried, not restarted
        r.config_set("requirepass", PASSWORD)
        r.lpush("queue:default", json.dumps({"class": "tests.apps.core_jobs.record", "args": ["back"],
                                             "jid": "e" * 24, "queue": "default"}))
        wait_until(lambda: master.poll() is None and r.llen("core:ran") == 1, timeout=30,
                   message=f"the job ran once the password was back\n{log.read_text()[-3000:]}")
        r.close()


@pytest.mark.timeout(60)
def test_credentials_redis_refuses_are_named_by_a_push_and_the_dashboard():
    """The library's RedisUnavailable and the dashboard's 503 said "cannot reach Redis",
    as the commands did, for a server that answered and refused the password."""
    from wsgiref.util import setup_testing_defaults

    import forkq
    from forkq.web import make_app
    with PasswordRedis() as server:
        url = f"redis://:wrong-{PASSWORD}@127.0.0.1:{server.port}/0"
        for push in (lambda c: c.push("X", [1]), lambda c: c.push_bulk("X", [[1], [2]])):
            with pytest.raises(forkq.RedisUnavailable) as info:
                push(forkq.Client(url))
            message = str(info.value)
            assert "refused the credentials" in message and "not pushed" in message, message
            assert not info.value.maybe_pushed and PASSWORD not in message, message
        environ: dict = {"PATH_INFO": "/queues"}
        setup_testing_defaults(environ)
        answer: list = []
        body = b"".join(make_app(url)(environ, lambda status, headers: answer.append(status)))
        assert answer == ["503 Service Unavailable"], answer
        assert b"refused the credentials" in body and PASSWORD.encode() not in body, body[-2000:]
