"""The test harness itself: RedisServer really keeps, loses and pauses Redis as promised."""

import os
import time

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from helpers import RedisServer, free_port, wait_until


def _no_retry_client(server, timeout):
    return server.client(socket_timeout=timeout, socket_connect_timeout=timeout,
                         retry=Retry(NoBackoff(), 0))


@pytest.mark.timeout(10)
def test_wait_until_returns_the_truthy_value():
    calls = []

    def predicate():
        calls.append(1)
        return len(calls) >= 3 and "done"

    assert wait_until(predicate, timeout=5) == "done"
    assert len(calls) == 3


@pytest.mark.timeout(10)
def test_wait_until_raises_with_message_and_last_value():
    with pytest.raises(AssertionError, match=r"the thing.*last value: 0"):
        wait_until(lambda: 0, timeout=0.05, message="the thing")


@pytest.mark.timeout(10)
def test_free_port_is_bindable_loopback_port():
    import socket

    port = free_port()
    assert port != 6379
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


@pytest.mark.timeout(10)
def test_redis_url_fixture_flushes_and_exports(redis_url, r):
    assert os.environ["FORKQ_REDIS_URL"] == redis_url
    assert redis_url.startswith("redis://127.0.0.1:") and ":6379/" not in redis_url
    assert r.dbsize() == 0
    r.set("left-behind", b"1")  # the next test's flush removes it


@pytest.mark.timeout(30)
def test_data_survives_restart(own_redis):
    client = own_redis.client()
    client.rpush("queue:default", b"job-1", b"job-2")
    old_pid, port, directory = own_redis.pid, own_redis.port, own_redis.dir

    own_redis.restart()

    assert own_redis.pid != old_pid
    assert (own_redis.port, own_redis.dir) == (port, directory)
    assert own_redis.client().lrange("queue:default", 0, -1) == [b"job-1", b"job-2"]


@pytest.mark.timeout(30)
def test_pause_makes_clients_time_out_and_resume_brings_them_back(own_redis):
    client = _no_retry_client(own_redis, 0.2)
    assert client.ping()

    own_redis.pause()
    try:
        started = time.monotonic()
        with pytest.raises(redis.TimeoutError):
            client.ping()
        assert time.monotonic() - started < 5
    finally:
        own_redis.resume()

    fresh = _no_retry_client(own_redis, 2.0)
    assert wait_until(lambda: fresh.ping(), timeout=5, message="PING after resume")


@pytest.mark.timeout(30)
def test_kill_then_start_comes_back_on_the_same_port(own_redis):
    own_redis.client().set("written-before-kill", b"yes")
    port = own_redis.port

    own_redis.kill()
    assert not own_redis.running
    with pytest.raises(redis.ConnectionError):
        _no_retry_client(own_redis, 0.5).ping()

    own_redis.start()
    assert own_redis.port == port
    # SIGKILL skips shutdown, but the write already reached the AOF file.
    assert own_redis.client().get("written-before-kill") == b"yes"


@pytest.mark.timeout(30)
def test_context_manager_stops_server_and_removes_its_dir():
    with RedisServer() as server:
        assert server.client().ping()
        pid, directory = server.pid, server.dir
    assert not server.running
    assert not directory.exists()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
