"""rediss+sentinel:// URLs: Sentinel with TLS to the sentinels and to the Redis servers.

Real processes only: a primary and a replica that listen on TLS only (`--port 0`), require
a client certificate and a password, and replicate over TLS; one sentinel, TLS only as
well, that talks TLS to them (`tls-replication yes`, with the client certificate as its
own); a real `forkq start --no-fork` worker; and a plain redis-server the jobs record
into (CORE_RECORD_URL). The certificates are test_tls.py's `certs` fixture.
"""

from __future__ import annotations

import json
import shutil
import time

import pytest
import redis
from redis.sentinel import SentinelManagedSSLConnection

import forkq
from forkq.client import connect, mask_url
from helpers import ForkqWorker, RedisServer, wait_until
from test_tls import PASSWORD, TLSRedisServer, certs  # noqa: F401 (certs: a fixture)

SERVICE = "mymaster"
TLS_ENV = ("FORKQ_REDIS_CA", "FORKQ_REDIS_CERT", "FORKQ_REDIS_KEY")

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl binary")


class TLSNode(TLSRedisServer):
    """A TLS-only Redis server that replicates over TLS, as a primary or (replicaof) a
    replica; its outgoing replication link shows the client certificate."""

    def __init__(self, certs, replicaof=None, **kwargs):
        super().__init__(certs, **kwargs)
        self.replicaof = replicaof

    def _command(self):
        command = super()._command() + [
            "--tls-replication", "yes",
            "--tls-client-cert-file", self.certs["client_cert"],
            "--tls-client-key-file", self.certs["client_key"],
            "--masterauth", PASSWORD,
            "--repl-diskless-sync-delay", "0",  # a replica in sync at once, not after 5 s
        ]
        if self.replicaof:
            command += ["--replicaof", "127.0.0.1", str(self.replicaof)]
        return command

    def __repr__(self):  # RedisServer's shows self.url, a method here: its repr recurses
        return f"<TLSNode 127.0.0.1:{self.port} pid={self.pid} dir={self.dir}>"


class TLSSentinel(RedisServer):
    """`redis-server sentinel.conf --sentinel` on TLS only, monitoring SERVICE over TLS.

    A quorum of 1 with a single sentinel is enough for a test (never for production)."""

    def __init__(self, certs, primary_port, **kwargs):
        super().__init__(**kwargs)
        self.certs = certs
        self.primary_port = primary_port

    def _command(self):
        c = self.certs
        conf = self.dir / "sentinel.conf"  # the sentinel rewrites it: it must be its own
        conf.write_text(
            f"bind 127.0.0.1\nport 0\ntls-port {self.port}\ndir {self.dir}\n"
            f"tls-cert-file {c['server_cert']}\ntls-key-file {c['server_key']}\n"
            f"tls-ca-cert-file {c['ca']}\ntls-auth-clients yes\n"
            # TLS to the monitored servers too, showing them the client certificate
            f"tls-replication yes\n"
            f"tls-client-cert-file {c['client_cert']}\ntls-client-key-file {c['client_key']}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary_port} 1\n"
            f"sentinel auth-pass {SERVICE} {PASSWORD}\n"
            f"sentinel down-after-milliseconds {SERVICE} 1000\n"
            f"sentinel failover-timeout {SERVICE} 5000\n"
        )
        return [self.binary, str(conf), "--sentinel", "--logfile", ""]

    def client(self, **kwargs):
        kwargs.setdefault("decode_responses", True)
        return redis.Redis(host="127.0.0.1", port=self.port, ssl=True,
                           ssl_ca_certs=self.certs["ca"], ssl_certfile=self.certs["client_cert"],
                           ssl_keyfile=self.certs["client_key"], **kwargs)

    def ask(self, *command):
        conn = self.client(socket_timeout=2)
        try:
            return conn.execute_command("SENTINEL", *command)
        finally:
            conn.close()


@pytest.fixture
def tls_cluster(certs):
    """(primary, replica, sentinel), TLS only, the replica in sync and known to the sentinel."""
    servers = []
    try:
        primary = TLSNode(certs).start()
        servers.append(primary)
        replica = TLSNode(certs, replicaof=primary.port).start()
        servers.append(replica)
        sentinel = TLSSentinel(certs, primary.port).start()
        servers.append(sentinel)
        wait_until(lambda: replica.client(socket_timeout=2).info("replication")
                   .get("master_link_status") == "up", timeout=10, interval=0.05,
                   message="the replica in sync over TLS")
        wait_until(lambda: any("s_down" not in r["flags"] and "disconnected" not in r["flags"]
                               for r in sentinel.ask("REPLICAS", SERVICE)),
                   timeout=10, interval=0.05,
                   message=f"the sentinel knows the replica; its log:\n{sentinel.log_tail()}")
        yield primary, replica, sentinel
    finally:
        for server in reversed(servers):
            server.close()


@pytest.fixture
def no_tls_env(monkeypatch):
    for name in TLS_ENV:
        monkeypatch.delenv(name, raising=False)


def _url(sentinel_port, query=""):
    return (f"rediss+sentinel://:{PASSWORD}@127.0.0.1:{sentinel_port}/{SERVICE}/0"
            + (f"?{query}" if query else ""))


def _files(certs):
    return (f"ssl_ca_certs={certs['ca']}&ssl_certfile={certs['client_cert']}"
            f"&ssl_keyfile={certs['client_key']}")


# -- the URL, in-process --------------------------------------------------------------------


@pytest.mark.timeout(20)
def test_tls_sentinel_url_makes_tls_connections_to_sentinels_and_servers(certs, no_tls_env):
    url = ("rediss+sentinel://app:hunter2@127.0.0.1:1,[::1]:2/svc/3?sentinel_password=s3cret&"
           f"{_files(certs)}&ssl_cert_reqs=required&ssl_check_hostname=false")
    pool = connect(url).connection_pool
    assert pool.connection_class is SentinelManagedSSLConnection
    kwargs = pool.connection_kwargs
    assert (kwargs["username"], kwargs["password"], kwargs["db"]) == ("app", "hunter2", 3)
    tls = {"ssl_ca_certs": certs["ca"], "ssl_certfile": certs["client_cert"],
           "ssl_keyfile": certs["client_key"], "ssl_cert_reqs": "required",
           "ssl_check_hostname": False}  # a bool, as redis-py reads it from a rediss:// URL
    assert {k: kwargs[k] for k in tls} == tls
    sentinels = pool.sentinel_manager.sentinels
    assert [(s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs["port"])
            for s in sentinels] == [("127.0.0.1", 1), ("::1", 2)]
    for s in sentinels:
        assert s.connection_pool.connection_class is redis.SSLConnection
        skw = s.connection_pool.connection_kwargs
        assert {k: skw[k] for k in tls} == tls
        assert skw["password"] == "s3cret"  # the sentinels' own, not the servers'
    masked = mask_url(url)
    assert "hunter2" not in masked and "s3cret" not in masked
    assert masked.startswith("rediss+sentinel://app:***@127.0.0.1:1,[::1]:2/svc/3?")
    assert "sentinel_password=***" in masked


@pytest.mark.timeout(20)
def test_tls_environment_variables_fill_in_for_a_tls_sentinel_url(certs, monkeypatch):
    monkeypatch.setenv("FORKQ_REDIS_CA", certs["ca"])
    monkeypatch.setenv("FORKQ_REDIS_CERT", certs["client_cert"])
    monkeypatch.setenv("FORKQ_REDIS_KEY", certs["client_key"])
    pool = connect(f"rediss+sentinel://127.0.0.1:1/svc?ssl_keyfile={certs['server_key']}"
                   ).connection_pool
    for kwargs in [pool.connection_kwargs] + [
            s.connection_pool.connection_kwargs for s in pool.sentinel_manager.sentinels]:
        assert kwargs["ssl_ca_certs"] == certs["ca"]
        assert kwargs["ssl_certfile"] == certs["client_cert"]
        assert kwargs["ssl_keyfile"] == certs["server_key"]  # the URL wins over the environment
    # a plain redis+sentinel:// URL ignores them, as redis:// does
    plain = connect("redis+sentinel://127.0.0.1:1/svc").connection_pool
    assert plain.connection_class is not SentinelManagedSSLConnection
    assert "ssl_ca_certs" not in plain.connection_kwargs
    assert "ssl_ca_certs" not in plain.sentinel_manager.sentinels[0].connection_pool.connection_kwargs


@pytest.mark.timeout(20)
@pytest.mark.parametrize("query, env, problem", [
    ("ssl_cert_reqs=sometimes", {}, "ssl_cert_reqs must be one of none, optional, required"),
    ("ssl_ca_certs=/nonexistent/ca.crt", {}, "ssl_ca_certs: no such file '/nonexistent/ca.crt'"),
    ("", {"FORKQ_REDIS_CERT": "/nonexistent/client.crt"}, "ssl_certfile: no such file"),
    ("ssl_cafile=ca.crt", {}, "unknown TLS option 'ssl_cafile'"),
    ("ssl_min_version=tls1.2", {}, "ssl_min_version: bad value"),
])
def test_bad_tls_sentinel_options_are_one_valueerror_with_passwords_masked(
        query, env, problem, no_tls_env, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    url = f"rediss+sentinel://:hunter2@127.0.0.1:1/svc?sentinel_password=s3cret&{query}"
    with pytest.raises(ValueError) as info:
        forkq.Client(url).push("X", [1])
    message = str(info.value)
    assert message.startswith("bad Redis URL 'rediss+sentinel://:***@127.0.0.1:1/svc?")
    assert problem in message
    assert "hunter2" not in message and "s3cret" not in message


@pytest.mark.timeout(20)
def test_tls_options_on_a_plain_sentinel_url_are_refused_not_ignored(certs, no_tls_env):
    with pytest.raises(ValueError, match="ssl_ca_certs is a TLS option: write rediss"
                                         r"\+sentinel:// for TLS"):
        connect(f"redis+sentinel://127.0.0.1:1/svc?ssl_ca_certs={certs['ca']}")


@pytest.mark.timeout(10)
@pytest.mark.parametrize("scheme", ["rediss", "rediss+sentinel"])
def test_the_private_key_password_is_masked_too(scheme):
    masked = mask_url(f"{scheme}://:hunter2@127.0.0.1:1/svc?ssl_keyfile=k.pem&ssl_password=s3cret"
                      "&sentinel_password=other")
    assert masked == (f"{scheme}://:***@127.0.0.1:1/svc?ssl_keyfile=k.pem&ssl_password=***"
                      "&sentinel_password=***")


# -- against real TLS servers and sentinel ---------------------------------------------------


@pytest.mark.timeout(30)
def test_worker_runs_a_job_pushed_through_tls_sentinel(tls_cluster, own_redis, certs, tmp_path,
                                                       monkeypatch):
    primary, replica, sentinel = tls_cluster
    # the CA from the URL, the client certificate from the environment, as rediss:// allows
    monkeypatch.setenv("FORKQ_REDIS_CERT", certs["client_cert"])
    monkeypatch.setenv("FORKQ_REDIS_KEY", certs["client_key"])
    monkeypatch.delenv("FORKQ_REDIS_CA", raising=False)
    monkeypatch.setenv("CORE_RECORD_URL", own_redis.url)
    url = _url(sentinel.port, f"ssl_ca_certs={certs['ca']}")

    jid = forkq.Client(url).push("tests.apps.core_jobs.record", ["over tls sentinel"])
    server = primary.client()
    assert [json.loads(j)["jid"] for j in server.lrange("queue:default", 0, -1)] == [jid]

    record = own_redis.client()
    worker = ForkqWorker(url, "tests/apps/core_jobs.py", log_path=tmp_path / "forkq.log")
    try:
        with worker:
            def ran():
                worker.assert_alive()
                return [r for r in map(json.loads, record.lrange("core:ran", 0, -1))
                        if r["args"] == ["over tls sentinel"]]
            try:
                wait_until(ran, timeout=15, interval=0.05, message="the job ran")
                wait_until(lambda: server.scard("processes") >= 1, timeout=10, interval=0.05,
                           message="a heartbeat on the primary")
            except AssertionError as exc:
                raise AssertionError(f"{exc}\nforkq log:\n{worker.log_tail()}") from None
        assert worker.proc.returncode == 0, worker.log_tail()
        assert server.llen("queue:default") == 0
    finally:
        record.close()
        server.close()
    text = worker.log_path.read_text(errors="replace")
    assert text.strip(), "the worker logged nothing"
    assert PASSWORD not in text


@pytest.mark.timeout(30)
def test_a_plain_sentinel_url_against_tls_sentinels_is_one_readable_error(tls_cluster, no_tls_env):
    primary, replica, sentinel = tls_cluster
    url = f"redis+sentinel://:{PASSWORD}@127.0.0.1:{sentinel.port}/{SERVICE}/0"
    started = time.monotonic()
    with pytest.raises(forkq.RedisUnavailable) as info:
        forkq.Client(url).push("X", [1])
    elapsed = time.monotonic() - started
    message = str(info.value)
    assert elapsed < 15, f"took {elapsed:.1f}s: {message}"  # redis-py's retries, no hang
    assert message.startswith(f"cannot reach Redis at redis+sentinel://:***@127.0.0.1:{sentinel.port}/")
    assert f"no sentinel named a primary for '{SERVICE}' (127.0.0.1:{sentinel.port}: " in message
    assert "(if the sentinels require TLS, write rediss+sentinel://)" in message
    assert "\n" not in message and "<redis" not in message and len(message) < 500
    assert PASSWORD not in message
    assert primary.client().llen("queue:default") == 0


@pytest.mark.timeout(30)
def test_a_tls_sentinel_url_without_the_client_certificate_says_so(tls_cluster, certs, no_tls_env):
    primary, replica, sentinel = tls_cluster
    with pytest.raises(forkq.RedisUnavailable) as info:
        forkq.Client(_url(sentinel.port, f"ssl_ca_certs={certs['ca']}")).push("X", [1])
    message = str(info.value)
    assert "no client certificate was given" in message
    assert PASSWORD not in message
    assert primary.client().llen("queue:default") == 0


@pytest.mark.timeout(40)
def test_a_push_after_a_failover_reaches_the_new_primary_over_tls(tls_cluster, certs, no_tls_env):
    primary, replica, sentinel = tls_cluster
    client = forkq.Client(_url(sentinel.port, _files(certs)))
    assert client.push("X", ["before"])
    assert primary.client().llen("queue:default") == 1
    primary.kill()

    def promoted():  # and the failover over: until then the sentinel reports the primary down
        state = sentinel.ask("MASTER", SERVICE)
        return int(state["port"]) == replica.port and state["flags"] == "master"
    wait_until(promoted, timeout=20, interval=0.05,
               message=f"the sentinel promoted the replica; its log:\n{sentinel.log_tail()}")
    # the same client, whose pool still holds a connection to the old primary
    assert client.push("X", ["after"])
    pushed = [json.loads(j)["args"] for j in replica.client().lrange("queue:default", 0, -1)]
    assert ["after"] in pushed
