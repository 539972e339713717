"""What Redis operators do to a server under a running forkq: ACL users restricted to the
commands forkq needs (or short of one), the server closing idle connections (`timeout`),
scripts flushed, a long script making Redis answer BUSY.

Each test runs a real `forkq start --processes 2` (or a real Waiters thread) against a
private redis-server, and checks afterwards that every job ran exactly once and nothing
stayed in a private structure.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import redis

import forkq
from forkq import keys
from forkq.fetch import ReliableFetch, Waiters
from forkq.queues import QueueOrder
from helpers import CommandHolder, RedisServer, forkq_command, json_lines, stop_gracefully, wait_until

REPO = Path(__file__).resolve().parent.parent
APP = REPO / "tests" / "apps" / "chaos_jobs.py"
OPS_APP = REPO / "tests" / "apps" / "redisops_jobs.py"


def _start(url: str, tmp: Path, *args: str, app: Path = APP, queue: str = "chaos",
           concurrency: int = 5, log: str = "log", env: dict[str, str] | None = None,
           constants: dict[str, float] | None = None) -> subprocess.Popen:
    env = dict(os.environ, FORKQ_REDIS_URL=url, PYTHONPATH=str(REPO), **(env or {}))
    return subprocess.Popen(
        forkq_command("start", "--require", str(app), "--queue", queue,
                      "--processes", "2", "--concurrency", str(concurrency), "--heartbeat-interval", "0.5",
                      "--log-format", "json", "--pidfile", str(tmp / f"{log}.pid"), *args, constants=constants),
        env=env, cwd=REPO, stdout=open(tmp / log, "w"), stderr=subprocess.STDOUT,
        start_new_session=True)


def _runs(r) -> Counter:
    """How many times each chaos job ran to its end."""
    return Counter(int(v) for v in r.hvals("chaos:execs"))


def _private(r) -> list[bytes]:
    return [k for pat in ("forkq:inflight:*", "forkq:landing:*") for k in r.scan_iter(pat)]


def _events(tmp: Path, text: str, log: str = "log") -> list[dict]:
    return [e for e in json_lines(tmp / log) if text in (e.get("event") or "")]


def _tracebacks(tmp: Path, log: str = "log") -> list[str]:
    """Tracebacks in a log: logged with an exception, or printed by a process that died."""
    lines = (tmp / log).read_text().splitlines()
    return ([e["event"] for e in json_lines(tmp / log) if "exception" in e]
            + [line for line in lines if line.startswith("Traceback")])


@contextlib.contextmanager
def _busy(server) -> Iterator[None]:
    """Someone's long script: Redis answers BUSY to every other command (after 100 ms, not
    the default 5 s) until SCRIPT KILL ends it on the way out."""
    admin = server.client()
    admin.config_set("lua-time-limit", 100)
    looping = server.client(socket_timeout=120)

    def run() -> None:
        with contextlib.suppress(redis.ResponseError):  # "Script killed by user"
            looping.eval("local stop = tonumber(redis.call('TIME')[1]) + 100 "
                         "while tonumber(redis.call('TIME')[1]) < stop do end return 1", 0)

    def answers_busy() -> bool:
        try:
            admin.ping()
        except redis.ResponseError as exc:
            return str(exc).startswith("BUSY ")
        return False

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        wait_until(answers_busy, timeout=10, message="Redis answering BUSY")
        yield
    finally:
        wait_until(lambda: _script_killed(admin), timeout=10, message="the script killed")
        thread.join(10)
        admin.close()
        looping.close()


def _script_killed(admin) -> bool:
    try:
        admin.script_kill()
    except redis.ResponseError as exc:
        return str(exc).startswith("NOTBUSY")
    return False


def _acl_user(r, *rules: str) -> None:
    r.acl_setuser("fq", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
                  commands=list(rules))


@pytest.mark.timeout(90)
def test_an_acl_user_without_client_still_runs_every_job_once(own_redis, tmp_path):
    """The blocking waits asked CLIENT ID (to end them early at a stop) before blocking, and
    took the refusal for a failed wait: they never blocked, so a worker that went idle
    never saw another job, with a warning a second per queue."""
    r = own_redis.client()
    _acl_user(r, "+@all", "-client")
    master = _start(f"redis://fq:pw@127.0.0.1:{own_redis.port}/0", tmp_path)
    try:
        wait_until(lambda: r.hlen(keys.OWNERS) == 2, timeout=20, message="children registered")
        # idle: their waits are what must see these jobs arrive
        wait_until(lambda: sum(c.get("cmd") == "blmove" for c in r.client_list()) == 2,
                   timeout=10, message="both children blocking on the empty queue")
        n = 300
        forkq.Client(own_redis.url).push_bulk("chaos.record", [[i, i % 10 == 0] for i in range(n)],
                                              queue="chaos")
        wait_until(lambda: len(_runs(r)) == n, timeout=30, message="every job ran")
        assert stop_gracefully(master) == 0
    finally:
        stop_gracefully(master)
    assert set(_runs(r).values()) == {1}
    assert _private(r) == [] and r.llen("queue:chaos") == 0 and r.zcard("retry") == 0
    assert len(_events(tmp_path, "CLIENT ID refused")) == 2  # a line per child, not a second
    assert _events(tmp_path, "blocking wait failed") == []


@pytest.mark.timeout(60)
def test_a_stop_ends_a_blocking_wait_whose_connection_the_server_timed_out(own_redis):
    """With the server's `timeout` set, a waiter's connection idle while its worker was busy
    is closed, and redis-py reconnects it silently before the next BLMOVE. The id asked once
    named the closed connection, so CLIENT UNBLOCK at a stop or quiet reached nobody and the
    wait ran on to its block timeout."""
    admin = own_redis.client()
    fetch = ReliableFetch(own_redis.client(), "test:1:000000000000", QueueOrder([("default", 0)]),
                          block_timeout=30.0, direct=False)
    woken = threading.Event()
    waiters = Waiters(fetch, lambda: own_redis.client(socket_timeout=40), woken.set, lambda exc: None)

    def blocked() -> list[int]:
        return [c["id"] for c in admin.client_list() if c.get("cmd") == "blmove"
                and c.get("flags") == "b"]

    try:
        waiters.start()
        waiters.arm()
        (first,) = wait_until(blocked, message="the waiter blocking in BLMOVE")
        forkq.Client(own_redis.url).push_bulk("Any", [[1]])
        assert woken.wait(5)  # it caught the job and disarmed itself, as for a busy worker
        admin.config_set("timeout", 1)
        wait_until(lambda: first not in [c["id"] for c in admin.client_list()], timeout=10,
                   message="the server closing the idle waiter's connection")
        waiters.arm()  # the worker idle again
        (second,) = wait_until(blocked, message="the waiter blocking again")
        assert second != first
        waiters.quiet()
        wait_until(lambda: blocked() == [], timeout=5, message="the blocking wait ended by quiet")
    finally:
        admin.config_set("timeout", 0)
        waiters.stop(2)
        admin.close()


@pytest.mark.timeout(60)
def test_a_stop_closes_a_blocking_wait_it_could_not_end(own_redis):
    """Without CLIENT a stop cannot end a blocking wait early, and with a --timeout shorter
    than the block the wait outlived the stop's final requeue, which unregisters the
    process: a job pushed then went into a landing list no recovery looks at."""
    admin = own_redis.client()
    _acl_user(admin, "+@all", "-client")
    url = f"redis://fq:pw@127.0.0.1:{own_redis.port}/0"
    identity = "test:1:000000000000"
    fetch = ReliableFetch(redis.Redis.from_url(url), identity, QueueOrder([("default", 0)]),
                          block_timeout=30.0, direct=False)
    waiters = Waiters(fetch, lambda: redis.Redis.from_url(url, socket_timeout=40),
                      threading.Event().set, lambda exc: None)

    def blocked() -> int:
        return sum(c.get("cmd") == "blmove" and c.get("flags") == "b" for c in admin.client_list())

    try:
        waiters.start()
        waiters.arm()
        wait_until(lambda: blocked() == 1, message="the waiter blocking in BLMOVE")
        waiters.stop(0.2)
        wait_until(lambda: blocked() == 0, timeout=5, message="the blocking wait dropped by stop")
        forkq.Client(own_redis.url).push_bulk("Any", [[1]])
        assert admin.llen("queue:default") == 1
        assert admin.llen(keys.landing(identity, "default")) == 0
    finally:
        waiters.stop(0)
        admin.close()


@pytest.mark.timeout(60)
def test_a_stop_ends_a_blocking_wait_that_reached_redis_just_after_its_unblock(own_redis):
    """A stop sent just after a worker started (its waiter still connecting) or as a wait
    was on its way to Redis found nothing blocked to unblock, and the BLMOVE that landed
    a moment later blocked for its whole timeout: about one stop in five right after a
    start took 2 s more. The BLMOVE is held on its way here, past the stop's unblock."""
    admin = own_redis.client()
    holder = CommandHolder(own_redis.port, marker=b"BLMOVE")
    fetch = ReliableFetch(own_redis.client(), "test:1:000000000000", QueueOrder([("default", 0)]),
                          block_timeout=30.0, direct=False)
    waiters = Waiters(fetch, lambda: redis.Redis(port=holder.port, socket_timeout=40),
                      threading.Event().set, lambda exc: None)

    def unblocks() -> int:
        return admin.info("commandstats").get("cmdstat_client|unblock", {}).get("calls", 0)

    stopper = threading.Thread(target=waiters.stop, args=(20,))
    try:
        waiters.start()
        waiters.arm()
        assert holder.holding.wait(5), "the waiter's BLMOVE never went out"
        stopper.start()
        wait_until(unblocks, timeout=5, message="the stop's CLIENT UNBLOCK")
        holder.release.set()  # the BLMOVE reaches Redis now, with the unblock behind it
        released = time.monotonic()
        stopper.join(10)
        took = time.monotonic() - released
        assert not stopper.is_alive() and took < 2, f"the stop took {took:.1f}s after the wait blocked"
    finally:
        holder.close()
        waiters.stop(0)
        if stopper.ident is not None:  # started
            stopper.join(25)
        admin.close()


def _held_jobs(own_redis, r, tmp: Path, n: int, constants: dict[str, float] | None = None) -> subprocess.Popen:
    """A master with two children holding `n` ops.hold jobs in flight (they wait on ops:hold,
    kept in `r`, the shared server, out of reach of what is done to own_redis)."""
    r.set("ops:hold", 1)
    master = _start(own_redis.url, tmp, "--timeout", "0.5", app=OPS_APP, queue="ops",
                    concurrency=2, env={"OPS_RECORD_URL": _url(r)}, constants=constants)
    conn = own_redis.client()
    try:
        wait_until(lambda: conn.hlen(keys.OWNERS) == 2, timeout=20, message="children registered")
        forkq.Client(own_redis.url).push_bulk("ops.hold", [[i] for i in range(n)], queue="ops")
        wait_until(lambda: sum(conn.hlen(keys.inflight(o.decode())) for o in conn.hkeys(keys.OWNERS)) == n,
                   timeout=20, message="every job in flight")
    except BaseException:
        stop_gracefully(master)  # the caller never gets it to stop
        raise
    finally:
        conn.close()
    return master


def _url(r) -> str:
    kw = r.connection_pool.connection_kwargs
    return f"redis://{kw['host']}:{kw['port']}/0"


def _held_runs(r) -> Counter:
    return Counter(int(v) for v in r.hvals("ops:runs"))


@pytest.mark.timeout(90)
def test_a_stop_while_redis_answers_busy_exits_0_and_loses_nothing(own_redis, r, tmp_path):
    """Someone's script running past busy-reply-threshold: Redis answers BUSY to everything.
    A stop then raised out of the children's final requeue (a traceback, exit 1) and out of
    the master's requeue of its children (exit 1, the other children left running on their
    own). Now each write it cannot make is one line, the master exits 0, and the jobs stay
    in the children's private hashes, where the next forkq recovers them."""
    # the stop waits out STOP_PATIENCE_S in the master's final requeue: 1.5 s, not 4
    master = _held_jobs(own_redis, r, tmp_path, 4, constants={"STOP_PATIENCE_S": 1.5})
    try:
        with _busy(own_redis):
            master.send_signal(signal.SIGTERM)
            assert master.wait(40) == 0
        assert _tracebacks(tmp_path) == []
        assert _events(tmp_path, "Redis is busy running a script at stop")
        # the next forkq on this host recovers the stopped one's jobs at boot
        r.delete("ops:hold")
        again = _start(own_redis.url, tmp_path, app=OPS_APP, queue="ops", log="log2",
                       env={"OPS_RECORD_URL": _url(r)})
        try:
            wait_until(lambda: len(_held_runs(r)) == 4, timeout=30, message="every job ran")
            assert stop_gracefully(again) == 0
        finally:
            stop_gracefully(again)
    finally:
        stop_gracefully(master)
    assert set(_held_runs(r).values()) == {1}
    conn = own_redis.client()
    assert _private(conn) == [] and conn.llen("queue:ops") == 0 and conn.hlen(keys.OWNERS) == 0


@pytest.mark.timeout(90)
def test_a_child_dying_while_redis_answers_busy_leaves_the_master_running(own_redis, r, tmp_path):
    """The master's requeue of a dead child's jobs met BUSY and raised out of its loop: the
    master died with a traceback and took every other child down with it."""
    master = _held_jobs(own_redis, r, tmp_path, 4)
    try:
        children = [c.pid for c in psutil.Process(master.pid).children()]
        with _busy(own_redis):
            os.kill(children[0], signal.SIGKILL)
            wait_until(lambda: _events(tmp_path, "cannot requeue a dead child's jobs yet"), timeout=10,
                       message="the master waiting to requeue")
            assert master.poll() is None
        r.delete("ops:hold")
        wait_until(lambda: len(_held_runs(r)) == 4, timeout=30, message="every job ran")
        assert master.poll() is None
        assert stop_gracefully(master) == 0
    finally:
        stop_gracefully(master)
    assert set(_held_runs(r).values()) == {1}
    assert _tracebacks(tmp_path) == []
    conn = own_redis.client()
    assert _private(conn) == [] and conn.llen("queue:ops") == 0


class _NoScriptCommand(RedisServer):
    """A redis-server with SCRIPT renamed away, as some hardened setups have it: EVAL and
    EVALSHA work, SCRIPT LOAD does not."""

    def _command(self):
        return super()._command() + ["--rename-command", "SCRIPT", ""]


@pytest.mark.timeout(90)
def test_scripts_run_on_a_redis_without_the_script_command(tmp_path):
    """NOSCRIPT was answered with SCRIPT LOAD (redis-py's Script), which such a Redis
    refuses: every failed job stayed in the retry set for good, the scheduler logging a
    traceback each poll. Only the claim, which sends the body with EVAL, worked."""
    with _NoScriptCommand() as server:
        conn = server.client()
        master = _start(server.url, tmp_path, "--poll-interval", "0.2")
        try:
            n = 200
            # every other job fails once: back through the retry set and move_due.lua
            forkq.Client(server.url).push_bulk("chaos.record", [[i, i % 2 == 0] for i in range(n)],
                                               queue="chaos")
            conn.lpush("queue:chaos", b"not a job")  # to dead through to_dead.lua
            wait_until(lambda: len(_runs(conn)) == n, timeout=40, message="every job ran")
            wait_until(lambda: conn.zcard("dead") == 1, timeout=10, message="the garbage in dead")
            assert stop_gracefully(master) == 0
        finally:
            stop_gracefully(master)
        assert set(_runs(conn).values()) == {1}
        assert _private(conn) == [] and conn.zcard("retry") == 0 and conn.llen("queue:chaos") == 0
        assert _tracebacks(tmp_path) == []


@pytest.mark.timeout(30)
def test_a_script_queued_on_a_pipeline_runs_on_a_redis_without_the_script_command():
    """Queued on a MULTI (a kept result's write beside its job's dead entry, an admin
    kill), redis-py's Script sent SCRIPT EXISTS and LOAD before the pipeline, which such a
    Redis refuses: that outcome write failed at every try."""
    from forkq import scripts
    with _NoScriptCommand() as server:
        conn = server.client()
        conn.hset("inflight", "1", "x")
        release = scripts.load(conn, "release")
        pipe = conn.pipeline(transaction=True)
        pipe.set("before", 1)
        release(keys=["inflight"], args=[1, "1"], client=pipe)
        assert pipe.execute() == [True, 1]
        assert conn.hlen("inflight") == 0


def _denied(conn, command: str) -> int:
    return sum(int(e["count"]) for e in conn.acl_log() if e["object"] == command)


@pytest.mark.timeout(90)
def test_an_acl_user_without_evalsha_gets_one_line_and_runs_the_jobs_once_it_is_fixed(own_redis, tmp_path):
    """NOPERM for the claim was a traceback every back-off (2 s) in each child, and at a stop
    the final requeue raised too: the children died with a traceback and the master exited
    1. Now it is one line per child, as for a Redis refusing writes, and once the ACL is
    fixed the jobs run, each once."""
    r = own_redis.client()
    _acl_user(r, "+@all", "-evalsha")
    master = _start(f"redis://fq:pw@127.0.0.1:{own_redis.port}/0", tmp_path)
    try:
        n = 100
        forkq.Client(own_redis.url).push_bulk("chaos.record", [[i, False] for i in range(n)],
                                              queue="chaos")
        wait_until(lambda: _denied(r, "evalsha") >= 8, timeout=30, message="claims refused, again and again")
        assert len(_events(tmp_path, "fetch failed: Redis refuses a command to this ACL user")) == 2
        r.acl_setuser("fq", enabled=True, commands=["+evalsha"])
        wait_until(lambda: len(_runs(r)) == n, timeout=30, message="every job ran once allowed to")
        assert stop_gracefully(master) == 0
    finally:
        stop_gracefully(master)
    assert set(_runs(r).values()) == {1}
    assert _private(r) == [] and r.llen("queue:chaos") == 0
    assert _tracebacks(tmp_path) == []
