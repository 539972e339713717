"""rediss:// URLs with a CA, a client certificate and key, against a real TLS redis-server.

The certificates are made in tmp_path with the `openssl` binary: a CA, a server
certificate for the IP 127.0.0.1 (so hostname checking stays on) and a client
certificate. The server requires client certificates (`--tls-auth-clients yes`) and a
password. A real `forkq start --processes 1` runs the jobs, which record into a plain
redis-server (CORE_RECORD_URL).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import ssl
import subprocess
import sys

import pytest
import redis

import forkq
from helpers import REPO_ROOT, RedisServer, _die_with_parent, _tail, wait_until

PASSWORD = "tls-hunter2"

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl binary")


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def _make_certs(d, ca_key_usage=True):
    """{"ca", "server_cert", "server_key", "client_cert", "client_key"}: paths (str)."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    # a CA without keyUsage passes Python 3.12's checks but not 3.13's (VERIFY_X509_STRICT
    # is on by default there): the client refused the server and every test here errored
    usage = ["-addext", "keyUsage=critical,keyCertSign,cRLSign"] if ca_key_usage else []
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
             "-subj", "/CN=forkq test CA", *usage, cwd=d)
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"),
                      ("client", "extendedKeyUsage=clientAuth\n")):
        (d / f"{name}.ext").write_text(ext)
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN=forkq test {name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.crt", "-days", "2",
                 "-extfile", f"{name}.ext", cwd=d)
    return {"ca": str(d / "ca.crt"), "server_cert": str(d / "server.crt"),
            "server_key": str(d / "server.key"), "client_cert": str(d / "client.crt"),
            "client_key": str(d / "client.key")}


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return _make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def certs_without_ca_key_usage(tmp_path_factory):
    """What a bare `openssl req -x509` CA signs: fine for Python 3.12, refused by 3.13."""
    return _make_certs(tmp_path_factory.mktemp("lax-certs"), ca_key_usage=False)


class TLSRedisServer(RedisServer):
    """A RedisServer listening on TLS only, requiring a client certificate and a password."""

    def __init__(self, certs, **kwargs):
        super().__init__(**kwargs)
        self.certs = certs

    def _command(self):
        command = super()._command()
        i = command.index("--port")
        command[i + 1] = "0"  # no plain TCP at all
        return command + [
            "--tls-port", str(self.port),
            "--tls-cert-file", self.certs["server_cert"],
            "--tls-key-file", self.certs["server_key"],
            "--tls-ca-cert-file", self.certs["ca"],
            "--tls-auth-clients", "yes",
            "--requirepass", PASSWORD,
        ]

    def client(self, **kwargs):
        kwargs.setdefault("decode_responses", False)
        return redis.Redis(host="127.0.0.1", port=self.port, db=0, password=PASSWORD, ssl=True,
                           ssl_ca_certs=self.certs["ca"], ssl_certfile=self.certs["client_cert"],
                           ssl_keyfile=self.certs["client_key"], **kwargs)

    def url(self, query=""):
        return f"rediss://:{PASSWORD}@127.0.0.1:{self.port}/0" + (f"?{query}" if query else "")


@pytest.fixture
def tls_redis(certs):
    with TLSRedisServer(certs) as server:
        yield server


def _query(certs, cert=True):
    q = f"ssl_ca_certs={certs['ca']}&ssl_cert_reqs=required"
    if cert:
        q += f"&ssl_certfile={certs['client_cert']}&ssl_keyfile={certs['client_key']}"
    return q


def _forkq(args, env, log_path=None, **kwargs):
    env = dict(os.environ, **env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    for name in ("FORKQ_REDIS_CA", "FORKQ_REDIS_CERT", "FORKQ_REDIS_KEY"):
        env.setdefault(name, "")
    return [sys.executable, "-m", "forkq", *args], env


def _start_master(url, tls_env, record_url, tmp_path):
    """A real `forkq start --processes 1` master (debug logging) in its own session."""
    log_path = tmp_path / "forkq.log"
    cmd, env = _forkq(["start", "--processes", "1", "--concurrency", "2", "--log-level", "debug",
                       "--require", "tests/apps/core_jobs.py", "--heartbeat-interval", "0.5",
                       "--pidfile", str(tmp_path / "forkq.pid"), "--log-format", "text"],
                      dict(tls_env, FORKQ_REDIS_URL=url, CORE_RECORD_URL=record_url))
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=_die_with_parent)
    return proc, log_path


def _stop(proc, graceful=True):
    """SIGTERM the master; then SIGKILL its session (only the master and its child)."""
    if graceful and proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _ran(record):
    return [json.loads(x) for x in record.lrange("core:ran", 0, -1)]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("options_from", ["query", "env"])
def test_worker_runs_a_job_pushed_over_tls(tls_redis, own_redis, certs, tmp_path, options_from,
                                           monkeypatch):
    if options_from == "query":
        url, tls_env = tls_redis.url(_query(certs)), {}
    else:
        url = tls_redis.url()
        tls_env = {"FORKQ_REDIS_CA": certs["ca"], "FORKQ_REDIS_CERT": certs["client_cert"],
                   "FORKQ_REDIS_KEY": certs["client_key"]}
    for name, value in tls_env.items():
        monkeypatch.setenv(name, value)

    jid = forkq.Client(url).push("tests.apps.core_jobs.record", ["over tls"])
    server = tls_redis.client()
    assert [json.loads(j)["jid"] for j in server.lrange("queue:default", 0, -1)] == [jid]

    proc, log_path = _start_master(url, tls_env, own_redis.url, tmp_path)
    record = own_redis.client()
    try:
        def ran():
            assert proc.poll() is None, f"forkq exited:\n{_tail(log_path, 60)}"
            return [r for r in _ran(record) if r["args"] == ["over tls"]]
        try:
            wait_until(ran, timeout=15, interval=0.05, message="the job ran")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nforkq log:\n{_tail(log_path, 60)}") from None
        wait_until(lambda: server.scard("processes") >= 1, timeout=10, interval=0.05,
                   message="a heartbeat over TLS")
    finally:
        _stop(proc)
        record.close()
        server.close()
    text = log_path.read_text(errors="replace")
    assert text.strip(), "the worker logged nothing"
    assert PASSWORD not in text

    # --print-config shows the URL, masked
    cmd, env = _forkq(["start", "--print-config"], dict(tls_env, FORKQ_REDIS_URL=url))
    out = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert f"127.0.0.1:{tls_redis.port}" in out.stdout
    assert PASSWORD not in out.stdout + out.stderr


@pytest.mark.timeout(20)
def test_a_client_without_the_client_certificate_is_refused(tls_redis, certs, monkeypatch):
    for name in ("FORKQ_REDIS_CA", "FORKQ_REDIS_CERT", "FORKQ_REDIS_KEY"):
        monkeypatch.delenv(name, raising=False)
    client = forkq.Client(tls_redis.url(_query(certs, cert=False)))
    with pytest.raises(forkq.RedisUnavailable) as info:
        client.push("X", [1])
    message = str(info.value)
    assert PASSWORD not in message
    assert f"127.0.0.1:{tls_redis.port}" in message and ":***@" in message
    assert "no client certificate was given" in message  # not only Python's bare "EOF"
    assert tls_redis.client().llen("queue:default") == 0


@pytest.mark.timeout(20)
def test_a_worker_without_the_client_certificate_logs_the_refusal_masked(tls_redis, own_redis,
                                                                          certs, tmp_path):
    # the URL is in the worker's log here (Redis unreachable at boot): masked
    proc, log_path = _start_master(tls_redis.url(_query(certs, cert=False)), {}, own_redis.url,
                                   tmp_path)
    try:
        wait_until(lambda: "Redis unreachable at boot" in log_path.read_text(errors="replace"),
                   timeout=10, interval=0.05, message="the boot warning")
        assert proc.poll() is None  # it keeps trying, as for any Redis outage
    finally:
        _stop(proc, graceful=False)  # a graceful stop waits out its Redis retries: not tested here
    text = log_path.read_text(errors="replace")
    assert "rediss://:***@127.0.0.1" in text
    assert PASSWORD not in text
    # the advice a push gets, not only Python's bare EOF or reset
    assert "no client certificate was given" in text


@pytest.mark.timeout(30)
def test_an_admin_command_without_the_client_certificate_says_so(tls_redis, certs, monkeypatch):
    for name in ("FORKQ_REDIS_CA", "FORKQ_REDIS_CERT", "FORKQ_REDIS_KEY"):
        monkeypatch.delenv(name, raising=False)
    out = subprocess.run([sys.executable, "-m", "forkq", "stats", "--redis-url",
                          tls_redis.url(_query(certs, cert=False))],
                         capture_output=True, text=True, timeout=20)
    assert out.returncode == 1 and out.stdout == ""
    assert "cannot reach Redis at rediss://:***@127.0.0.1" in out.stderr
    assert "no client certificate was given" in out.stderr and PASSWORD not in out.stderr


@pytest.mark.timeout(20)
def test_a_server_certificate_from_another_ca_is_refused(tls_redis, certs, monkeypatch):
    # the system CAs, not ours: the server's certificate must not be trusted
    for name in ("FORKQ_REDIS_CA", "FORKQ_REDIS_CERT", "FORKQ_REDIS_KEY"):
        monkeypatch.delenv(name, raising=False)
    client = forkq.Client(tls_redis.url(
        f"ssl_certfile={certs['client_cert']}&ssl_keyfile={certs['client_key']}"))
    with pytest.raises(forkq.RedisUnavailable, match="certificate was not trusted") as info:
        client.push("X", [1])
    assert PASSWORD not in str(info.value)
    # ssl_cert_reqs=none turns the check off (the client certificate is still sent)
    assert forkq.Client(tls_redis.url(
        f"ssl_cert_reqs=none&ssl_certfile={certs['client_cert']}&ssl_keyfile={certs['client_key']}"
    )).push("X", [1])


@pytest.mark.parametrize("query, problem", [
    ("ssl_cert_reqs=sometimes", "ssl_cert_reqs must be one of"),
    ("ssl_ca_certs=/nonexistent/ca.crt", "ssl_ca_certs: no such file"),
])
def test_bad_tls_options_are_a_valueerror_with_password_masked(query, problem):
    with pytest.raises(ValueError, match=problem) as info:
        forkq.Client(f"rediss://:{PASSWORD}@127.0.0.1:6380/0?{query}").push("X", [1])
    assert PASSWORD not in str(info.value)


@pytest.mark.timeout(10)
def test_a_misspelled_tls_option_is_refused_by_connect_not_at_the_first_command():
    # ssl_ca_cert for ssl_ca_certs: redis-py handed it on to SSLConnection, whose
    # TypeError came with the first command
    url = f"rediss://:{PASSWORD}@127.0.0.1:6380/0?ssl_cert_reqs=none&ssl_ca_cert=/x"
    with pytest.raises(ValueError) as info:
        forkq.client.connect(url)
    assert str(info.value) == ("bad Redis URL 'rediss://:***@127.0.0.1:6380/0?ssl_cert_reqs=none"
                               "&ssl_ca_cert=/x': unknown TLS option 'ssl_ca_cert'")


def test_tls_environment_variables_fill_in_missing_options(certs, monkeypatch):
    monkeypatch.setenv("FORKQ_REDIS_CA", certs["ca"])
    monkeypatch.setenv("FORKQ_REDIS_CERT", certs["client_cert"])
    monkeypatch.setenv("FORKQ_REDIS_KEY", certs["client_key"])
    conn = forkq.client.connect(f"rediss://127.0.0.1:6380/0?ssl_keyfile={certs['server_key']}")
    kwargs = conn.connection_pool.connection_kwargs
    assert kwargs["ssl_ca_certs"] == certs["ca"]
    assert kwargs["ssl_certfile"] == certs["client_cert"]
    assert kwargs["ssl_keyfile"] == certs["server_key"]  # the URL wins over the environment
    # a plain redis:// URL ignores them
    plain = forkq.client.connect("redis://127.0.0.1:6380/0").connection_pool.connection_kwargs
    assert "ssl_ca_certs" not in plain


class _LaxCATLSRedisServer(TLSRedisServer):
    """Its own client (the start-up PING, the checks) does not verify the server: under
    Python 3.13 the CA that signed it is refused, which only the test's client may meet."""

    def client(self, **kwargs):
        return super().client(ssl_cert_reqs="none", **kwargs)


def _ssl_connection_takes(name):
    from redis.connection import SSLConnection
    return name in forkq.client._init_parameters(SSLConnection)


@pytest.mark.timeout(30)
def test_a_certificate_only_strict_checking_refuses_gets_a_hint_that_says_so(
        certs_without_ca_key_usage, monkeypatch):
    # Python 3.13 checks with VERIFY_X509_STRICT by default; older ones are asked to here
    for name in ("FORKQ_REDIS_CA", "FORKQ_REDIS_CERT", "FORKQ_REDIS_KEY"):
        monkeypatch.delenv(name, raising=False)
    lax = certs_without_ca_key_usage
    strict_by_default = bool(ssl.create_default_context().verify_flags & ssl.VERIFY_X509_STRICT)
    if not strict_by_default and not _ssl_connection_takes("ssl_include_verify_flags"):
        pytest.skip("neither this Python nor this redis-py checks strictly")
    query = _query(lax) + ("" if strict_by_default else "&ssl_include_verify_flags=VERIFY_X509_STRICT")
    with _LaxCATLSRedisServer(lax) as server:
        with pytest.raises(forkq.RedisUnavailable) as info:
            forkq.Client(server.url(query)).push("X", [1])
        message = str(info.value)
        assert "CA cert does not include key usage extension" in message  # OpenSSL's reason
        # the CA was given: telling the user to give it sent them in circles
        assert "give its CA" not in message
        assert "VERIFY_X509_STRICT" in message
        if _ssl_connection_takes("ssl_exclude_verify_flags"):
            # the way out the hint names works
            assert "ssl_exclude_verify_flags=VERIFY_X509_STRICT" in message
            assert forkq.Client(server.url(
                _query(lax) + "&ssl_exclude_verify_flags=VERIFY_X509_STRICT")).push("X", [1])
            assert server.client().llen("queue:default") == 1
