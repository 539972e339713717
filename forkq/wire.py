"""Hot-path commands sent on connections of our own, past redis-py's execute_command.

A command through execute_command spends about as long in the library's bookkeeping
(pool checkout, observability hooks, the retry wrapper) as in the round trip itself.
The two calls forkq makes most, a single push and the worker's claim, pack the command
and read the reply on a connection built from the client's own pool settings (so TLS,
unix sockets and ACL users work), and never resend: a connection that broke after the
command went out raises `Unanswered`, since the command may have run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import hiredis
import redis
from redis.connection import AbstractConnection


class Unanswered(redis.ConnectionError):
    """The connection broke after the command was sent: it may have run."""


def connection_factory(client: redis.Redis) -> Callable[[], AbstractConnection] | None:
    """Makes connections like `client`'s; None for Sentinel, whose connections find the
    primary when they connect and turn READONLY after a failover into a reconnect, which
    only redis-py's own path does."""
    from redis.sentinel import SentinelConnectionPool
    pool = client.connection_pool
    if isinstance(pool, SentinelConnectionPool):
        return None
    return lambda: pool.connection_class(**pool.connection_kwargs)


def run_script(conn: AbstractConnection, sha: str, body: str, args: tuple) -> Any:
    """EVALSHA `sha` with `args` (numkeys, keys..., argv...); the body after NOSCRIPT.

    An error reply leaves the connection in step; any other failure disconnects it, so
    the caller can keep using it (it reconnects on the next send)."""
    try:
        return _run_script(conn, sha, body, args)
    except redis.ResponseError:
        raise
    except BaseException:
        conn.disconnect()
        raise


def _run_script(conn: AbstractConnection, sha: str, body: str, args: tuple) -> Any:
    try:
        # an idle connection the server closed (restart, timeout) reads as EOF here;
        # reconnect before sending rather than lose the command to a dead socket
        if getattr(conn, "_sock", None) is not None and conn.can_read():
            conn.disconnect()
    except redis.ConnectionError:
        conn.disconnect()
    conn.send_packed_command(_pack(conn, "EVALSHA", sha, *args), check_health=False)
    try:
        try:
            return conn.read_response()
        except redis.exceptions.NoScriptError:  # a restarted Redis forgot it: send the body
            conn.send_packed_command(_pack(conn, "EVAL", body, *args), check_health=False)
            return conn.read_response()
    except redis.ConnectionError as exc:  # (a TimeoutError is not one: it stays as it is)
        raise Unanswered(str(exc)) from exc


def _pack(conn: AbstractConnection, *args: Any) -> Any:
    # hiredis packs str (as UTF-8), bytes, int and float as redis-py's encoder does, in
    # half the time: redis-py's packer first walks the arguments in Python
    if conn.encoder.encoding == "utf-8" and conn.encoder.encoding_errors == "strict":
        return [hiredis.pack_command(args)]
    return conn.pack_command(*args)
