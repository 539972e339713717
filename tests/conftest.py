"""Shared fixtures: a real redis-server per session, private ones on demand, Ruby Sidekiq.

    redis_server  (session)  the shared RedisServer
    redis_url     (function) FLUSHALLs the shared server, sets FORKQ_REDIS_URL, returns the URL
    r             (function) a redis.Redis (bytes replies) on the shared server, flushed
    own_redis     (function) a fresh private RedisServer, for tests that stop/kill/pause Redis
    sidekiq_ruby  (function) helpers.SidekiqRuby, or the test is skipped if Ruby Sidekiq is missing
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import REDIS_MISSING, RedisServer, SidekiqRuby, sidekiq_ruby_problem  # noqa: E402


def _require_redis_server():
    if shutil.which("redis-server") is None:
        pytest.fail(REDIS_MISSING, pytrace=False)


@pytest.fixture(autouse=True)
def _no_default_client_left():
    """forkq's default client is made once per process, from FORKQ_REDIS_URL as it is then:
    one a test made without redis_url (pointing at 6379) or at its own server must not
    serve the next test in this worker, which would push there."""
    yield
    import forkq.client
    forkq.client._default = None


@pytest.fixture(scope="session")
def redis_server():
    """One redis-server shared by the whole run (tests get it flushed via redis_url)."""
    _require_redis_server()
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server, monkeypatch):
    """The shared server's URL, emptied with FLUSHALL; also exported as FORKQ_REDIS_URL."""
    if not redis_server.running:
        # A test stopped or killed the shared server (it should use own_redis);
        # bring it back so one mistake does not fail every later test.
        redis_server.start()
    if redis_server.paused:
        redis_server.resume()
    client = redis_server.client()
    try:
        client.flushall()
    finally:
        client.close()
    monkeypatch.setenv("FORKQ_REDIS_URL", redis_server.url)
    return redis_server.url


@pytest.fixture
def r(redis_url, redis_server):
    """A redis.Redis (decode_responses=False) on the freshly flushed shared server."""
    client = redis_server.client()
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def own_redis():
    """A private RedisServer, started; stopped and its directory removed at teardown.

    It does not touch FORKQ_REDIS_URL: use monkeypatch.setenv with own_redis.url.
    """
    _require_redis_server()
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def _sidekiq_ruby_session():
    problem = sidekiq_ruby_problem()
    if problem:
        return problem
    return SidekiqRuby()


@pytest.fixture
def sidekiq_ruby(_sidekiq_ruby_session):
    """helpers.SidekiqRuby: paths to tests/interop/*.rb and ways to run them.

    Skips the test when `ruby` is missing or `require "sidekiq"` fails.
    """
    if isinstance(_sidekiq_ruby_session, str):
        pytest.skip(
            "Ruby Sidekiq not installed: apt-get install ruby-sidekiq "
            f"({_sidekiq_ruby_session})"
        )
    return _sidekiq_ruby_session
