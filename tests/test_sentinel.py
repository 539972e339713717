"""redis+sentinel:// URLs: clients, workers and the master follow a failover.

Real processes only: a primary and a replica redis-server, one sentinel watching them, a
real `forkq start --processes 1` master with its child, and a third, plain redis-server
that the jobs record into (CORE_RECORD_URL), so the record of what ran does not itself
depend on the failover being tested.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import ExitStack

import pytest
import redis

import forkq
from forkq.client import connect, mask_url
from helpers import CommandCutter, REPO_ROOT, RedisServer, _die_with_parent, _tail, free_port, wait_until

SERVICE = "mymaster"


class PrimaryServer(RedisServer):
    """A RedisServer that sends a new replica its full copy at once: by default Redis 7
    waits 5 s (repl-diskless-sync-delay) for more replicas to share one transfer."""

    def _command(self):
        return super()._command() + ["--repl-diskless-sync-delay", "0"]


class ReplicaServer(RedisServer):
    """A RedisServer that starts as a replica of 127.0.0.1:primary_port."""

    def __init__(self, primary_port, **kwargs):
        super().__init__(**kwargs)
        self.primary_port = primary_port

    def _command(self):
        return super()._command() + ["--replicaof", "127.0.0.1", str(self.primary_port)]


class SentinelServer(RedisServer):
    """`redis-server sentinel.conf --sentinel`, monitoring SERVICE at 127.0.0.1:primary_port.

    A quorum of 1 with a single sentinel is enough for a test (never for production)."""

    def __init__(self, primary_port, **kwargs):
        super().__init__(**kwargs)
        self.primary_port = primary_port

    def _command(self):
        conf = self.dir / "sentinel.conf"  # the sentinel rewrites it: it must be its own
        conf.write_text(
            f"bind 127.0.0.1\nport {self.port}\ndir {self.dir}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary_port} 1\n"
            f"sentinel down-after-milliseconds {SERVICE} 1000\n"
            f"sentinel failover-timeout {SERVICE} 5000\n"
        )
        return [self.binary, str(conf), "--sentinel", "--logfile", ""]

    def primary_port_now(self):
        conn = self.client(decode_responses=True, socket_timeout=2)
        try:
            addr = conn.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
            return int(addr[1]) if addr else None
        finally:
            conn.close()

    def replicas_known(self):
        conn = self.client(decode_responses=True, socket_timeout=2)
        try:
            rows = conn.execute_command("SENTINEL", "REPLICAS", SERVICE)
        finally:
            conn.close()
        return [r for r in rows if "s_down" not in r["flags"] and "disconnected" not in r["flags"]]


@pytest.fixture
def cluster():
    """(primary, replica, sentinel), started, the replica in sync and known to the sentinel."""
    servers = []
    try:
        primary = PrimaryServer().start()
        servers.append(primary)
        replica = ReplicaServer(primary.port).start()
        servers.append(replica)
        sentinel = SentinelServer(primary.port).start()
        servers.append(sentinel)

        def in_sync():
            info = replica.client(socket_timeout=2).info("replication")
            return info.get("master_link_status") == "up"
        wait_until(in_sync, timeout=10, interval=0.05, message="replica in sync")
        wait_until(sentinel.replicas_known, timeout=15, interval=0.1,
                   message="the sentinel knows the replica")
        yield primary, replica, sentinel
    finally:
        for server in reversed(servers):
            server.close()


@pytest.mark.timeout(10)
@pytest.mark.parametrize("scheme", ["redis+sentinel", "rediss+sentinel"])
def test_a_missing_sentinel_address_is_told_in_the_scheme_used(scheme):
    with pytest.raises(ValueError) as info:
        connect(f"{scheme}://127.0.0.1:1,/svc")
    assert str(info.value) == (f"bad Redis URL '{scheme}://127.0.0.1:1,/svc': no sentinel "
                               f"address: write {scheme}://HOST:PORT[,HOST:PORT...]/SERVICE")


@pytest.fixture
def watched():
    """(primary, sentinel): a redis-server and one sentinel that names it, no replica."""
    with PrimaryServer() as primary, SentinelServer(primary.port) as sentinel:
        wait_until(lambda: sentinel.primary_port_now() == primary.port, timeout=10,
                   interval=0.05, message="the sentinel names the primary")
        yield primary, sentinel


class ClosingPort:
    """A listener that accepts each connection and closes it at once, counting them: a
    sentinel dead behind a live socket. A client only sees the close after the accept, so
    by the time a call returns, every connection it made has been counted."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.05)  # to notice close() without a second socket to wake it
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._open = True
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while self._open:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            conn.close()

    def close(self):
        self._open = False
        self._thread.join(5)
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def black_hole(stack):
    """A loopback port whose connects neither succeed nor fail until they time out, as to
    a host that drops packets: a listener that never accepts, its queue filled, so the
    kernel drops each further SYN. Its sockets close with `stack`."""
    listener = stack.enter_context(socket.create_server(("127.0.0.1", 0), backlog=0))
    port = listener.getsockname()[1]
    for _ in range(16):
        probe = stack.enter_context(socket.socket())
        probe.settimeout(0.2)
        try:
            probe.connect(("127.0.0.1", port))
        except TimeoutError:
            return port  # the queue is full: this SYN was dropped
    raise AssertionError("the accept queue never filled")


@pytest.mark.timeout(60)
def test_a_dead_first_sentinel_is_asked_once_per_discovery_not_retried(watched):
    primary, sentinel = watched
    with ClosingPort() as dead:
        url = f"redis+sentinel://127.0.0.1:{dead.port},127.0.0.1:{sentinel.port}/{SERVICE}/0"
        client = forkq.Client(url)
        for i in range(3):
            assert client.push("X", [i])
        # once: the sentinel that answered is asked first from then on (redis-py retried
        # the dead one 10 times, with backoff, before asking the next)
        assert dead.accepted == 1
        # a new client in this process asks the sentinel that answered first too: every
        # Client, worker pool and forked child used to pay for the dead one again
        assert forkq.Client(url).push("X", ["new client"])
        assert dead.accepted == 1

        nobody = f"redis+sentinel://127.0.0.1:{dead.port},127.0.0.1:{free_port()}/{SERVICE}/0"
        with pytest.raises(forkq.RedisUnavailable) as info:
            forkq.Client(nobody).push("X", ["lost"])
        assert dead.accepted == 2
    message = str(info.value)
    assert f"no sentinel named a primary for '{SERVICE}' (127.0.0.1:{dead.port}: " in message
    assert "Connection refused" in message and "<redis" not in message and "\n" not in message
    assert primary.client().llen("queue:default") == 4


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dead", ["refused", "black-holed"])
def test_a_dead_first_sentinel_costs_a_new_client_one_connect_timeout_at_most(watched, dead):
    primary, sentinel = watched
    with ExitStack() as stack:
        port = free_port() if dead == "refused" else black_hole(stack)
        url = (f"redis+sentinel://127.0.0.1:{port},127.0.0.1:{sentinel.port}/{SERVICE}/0"
               "?socket_connect_timeout=0.25")
        started = time.monotonic()
        assert forkq.Client(url).push("X", [dead])
        elapsed = time.monotonic() - started
    # redis-py's retries took about 4 s of backoff, plus 11 connect timeouts when black-holed
    assert elapsed < 1, f"{elapsed:.2f}s"
    assert primary.client().llen("queue:default") == 1


@pytest.mark.timeout(60)
def test_a_black_holed_first_sentinel_is_paid_for_once_per_process(watched):
    """Each Client (and each worker connection pool, child and CLI command) builds its own
    Sentinel manager; the one that answered is remembered for the process."""
    primary, sentinel = watched
    with ExitStack() as stack:
        url = (f"redis+sentinel://127.0.0.1:{black_hole(stack)},127.0.0.1:{sentinel.port}"
               f"/{SERVICE}/0?socket_connect_timeout=2")
        assert forkq.Client(url).push("X", ["first"])  # pays one connect timeout
        started = time.monotonic()
        for i in range(3):
            assert forkq.Client(url).push("X", [i])
        elapsed = time.monotonic() - started
    assert elapsed < 1, f"three new clients took {elapsed:.2f}s"
    assert primary.client().llen("queue:default") == 4


class Master:
    """`python -m forkq start --processes 1 ...` as a subprocess in its own session."""

    def __init__(self, url, record_url, tmp_path):
        self.log_path = tmp_path / "forkq.log"
        env = dict(os.environ, FORKQ_REDIS_URL=url, CORE_RECORD_URL=record_url,
                   PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p))
        cmd = [sys.executable, "-m", "forkq", "start", "--processes", "1", "--concurrency", "2",
               "--require", "tests/apps/core_jobs.py", "--heartbeat-interval", "0.5",
               "--pidfile", str(tmp_path / "forkq.pid"), "--log-format", "text"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=_die_with_parent)

    def log(self):
        return _tail(self.log_path, 60)

    def wait(self, predicate, timeout, what):
        """wait_until(predicate), failing at once if the master exits; the log on failure."""
        def check():
            self.assert_alive()
            return predicate()
        try:
            return wait_until(check, timeout=timeout, interval=0.05, message=what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nforkq log:\n{self.log()}") from None

    def assert_alive(self):
        assert self.proc.poll() is None, f"forkq master exited:\n{self.log()}"

    def stop(self):
        """SIGTERM the master, then SIGKILL its whole session (master and child) regardless."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: only our processes
        except ProcessLookupError:
            pass
        self.proc.wait()


def _ran(record, kind="record"):
    return [json.loads(x) for x in record.lrange("core:ran", 0, -1) if json.loads(x)["job"] == kind]


def _child_beats(conn):
    """{identity: beat} of the heartbeats of forkq children (processes with a master) on conn."""
    beats = {}
    for member in conn.smembers("processes"):
        info = conn.hget(member, "info")
        if info and json.loads(info).get("master"):
            beats[member] = float(conn.hget(member, "beat") or 0)
    return beats


def test_sentinel_url_is_parsed_and_masked():
    url = "redis+sentinel://app:hunter2@127.0.0.1:1,[::1]:2,other/svc/3?sentinel_password=s3cret"
    conn = connect(url)
    kwargs = conn.connection_pool.connection_kwargs
    assert (kwargs["username"], kwargs["password"], kwargs["db"]) == ("app", "hunter2", 3)
    assert conn.connection_pool.service_name == "svc"
    sentinels = conn.connection_pool.sentinel_manager.sentinels
    assert [(s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs["port"])
            for s in sentinels] == [("127.0.0.1", 1), ("::1", 2), ("other", 26379)]
    assert all(s.connection_pool.connection_kwargs["password"] == "s3cret" for s in sentinels)
    masked = mask_url(url)
    assert "hunter2" not in masked and "s3cret" not in masked
    assert masked == ("redis+sentinel://app:***@127.0.0.1:1,[::1]:2,other/svc/3"
                      "?sentinel_password=***")


@pytest.mark.parametrize("url", [
    "redis+sentinel://:hunter2@127.0.0.1:26379",  # no service
    "redis+sentinel://:hunter2@127.0.0.1:26379/svc/notadb",
    "redis+sentinel://:hunter2@127.0.0.1:nope/svc",
    "redis+sentinel://:hunter2@127.0.0.1:26379/svc?bogus=1",
])
def test_bad_sentinel_url_is_a_valueerror_with_password_masked(url):
    with pytest.raises(ValueError, match="bad Redis URL") as info:
        forkq.Client(url).push("X", [1])
    assert "hunter2" not in str(info.value)


@pytest.mark.timeout(60)
@pytest.mark.timeout(30)
def test_a_push_through_sentinel_whose_reply_is_lost_is_not_sent_again():
    """redis-py's own path resends a command on a broken connection: a push whose reply
    was lost would be in the queue twice. The sentinel here names the primary at a proxy
    that swallows the LPUSH's reply."""
    with PrimaryServer() as primary:
        cutter = CommandCutter(primary.port, b"LPUSH")
        try:
            with SentinelServer(cutter.port) as sentinel:
                client = forkq.Client(f"redis+sentinel://127.0.0.1:{sentinel.port}/{SERVICE}/0")
                with pytest.raises(forkq.RedisUnavailable) as info:
                    client.push("X", [1])
                assert cutter.cut.is_set()
                assert info.value.maybe_pushed
                admin = primary.client()
                assert admin.llen("queue:default") == 1
                client.push("X", [2])
                assert [json.loads(j)["args"] for j in admin.lrange("queue:default", 0, -1)] == [[2], [1]]
        finally:
            cutter.close()


@pytest.mark.timeout(30)
def test_a_push_refused_as_readonly_under_sentinel_says_it_was_not_pushed():
    """A primary demoted behind the sentinel's back (a healed partition) answers READONLY
    on a pooled connection. redis-py's Sentinel connection turns that into a dropped
    connection; the push was refused all the same, and the caller must hear so, not "may
    have been pushed". (A failover the sentinel runs kills the old primary's clients, so
    they reconnect to the new one: the failover test covers that.)"""
    with PrimaryServer() as primary, RedisServer() as elsewhere, \
            SentinelServer(primary.port) as sentinel:
        client = forkq.Client(f"redis+sentinel://127.0.0.1:{sentinel.port}/{SERVICE}/0")
        client.push("X", [1])
        admin = primary.client()
        admin.replicaof("127.0.0.1", elsewhere.port)
        with pytest.raises(forkq.RedisUnavailable, match="read-only") as info:
            client.push("X", [2])
        assert not info.value.maybe_pushed
        # (the first job may still be there: the demoted server loads its new primary's
        # empty data set in its own time)
        for server in (admin, elsewhere.client()):
            assert [2] not in [json.loads(j)["args"] for j in server.lrange("queue:default", 0, -1)]


def test_jobs_and_worker_survive_a_failover(cluster, own_redis, tmp_path):
    primary, replica, sentinel = cluster
    url = f"redis+sentinel://127.0.0.1:{sentinel.port}/{SERVICE}/0"
    record = own_redis.client()
    client = forkq.Client(url)
    n = 40
    jids = client.push_bulk("tests.apps.core_jobs.sleepy", [[0.05, i] for i in range(n)])
    assert primary.client().llen("queue:default") == n  # the sentinel sent us to the primary

    master = Master(url, own_redis.url, tmp_path)
    try:
        master.wait(lambda: _child_beats(primary.client()), 15, "a child heartbeat")
        master.wait(lambda: len(_ran(record, "end")) >= 5, 15, "some jobs ran before the failover")

        # Replication is asynchronous: a push acknowledged just before the primary dies may
        # never reach the replica, and then Redis itself has lost it. WAIT after one write on
        # this connection returns once the replica has everything written before it,
        # including every job pushed above, so no job can be lost by Redis here. (Fetches and
        # acks after this point may be lost; that only makes a job run twice.)
        before = primary.client()
        before.set("forkq:test:marker", 1)
        assert before.execute_command("WAIT", 1, 2000) == 1
        failed_over_at = time.time()
        primary.kill()
        assert len(_ran(record, "end")) < n  # jobs were left to run across the failover

        wait_until(lambda: sentinel.primary_port_now() == replica.port, timeout=20, interval=0.1,
                   message=f"the sentinel promoted the replica; sentinel log:\n{sentinel.log_tail()}")
        new_primary = replica.client()
        assert new_primary.info("replication")["role"] == "master"

        # the worker kept running and beats on the new primary
        master.wait(lambda: any(b > failed_over_at for b in _child_beats(new_primary).values()),
                    20, "a child heartbeat on the new primary")

        # an enqueue after the failover succeeds (the same client, which still has a pool
        # from before) and the worker runs it
        late = client.push("tests.apps.core_jobs.record", ["after failover"])
        assert late

        def all_done():
            ended = {r["args"][0] for r in _ran(record, "end")}
            late_ran = any(r["args"] == ["after failover"] for r in _ran(record))
            return ended >= set(range(n)) and late_ran
        master.wait(all_done, 25, "every job ran")
        master.assert_alive()
        assert new_primary.llen("queue:default") == 0
        assert len(jids) == n
    finally:
        master.stop()
        record.close()
