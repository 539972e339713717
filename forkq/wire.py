"""Hot-path commands sent on connections of our own, past redis-py's execute_command.

A command through execute_command spends about as long in the library's bookkeeping
(pool checkout, observability hooks, the retry wrapper) as in the round trip itself.
The two calls forkq makes most, a push and the worker's claim, pack their commands
and read the replies on a connection built from the client's own pool settings (so TLS,
unix sockets and ACL users work), and never resend: a connection that broke after the
command went out raises `Unanswered`, since the command may have run.
"""

from __future__ import annotations

import select
from collections.abc import Callable
from typing import Any

import hiredis
import redis
from redis.connection import AbstractConnection


class Unanswered(redis.ConnectionError):
    """The connection broke after the command was sent: it may have run."""


def connection_factory(client: redis.Redis) -> Callable[[], AbstractConnection]:
    """Makes connections like `client`'s. Under Sentinel they are redis-py's
    Sentinel-managed ones, which ask the sentinels for the primary each time they connect,
    and answer READONLY (a demoted primary) by disconnecting and raising a ConnectionError,
    which surfaces here as `Unanswered` with `readonly(exc)` true."""
    pool = client.connection_pool
    return lambda: pool.connection_class(**pool.connection_kwargs)


def readonly(exc: Unanswered) -> bool:
    """Whether the connection was dropped because the server answered READONLY: then
    nothing was written."""
    cause = exc.__cause__
    return cause is not None and isinstance(cause.__context__, redis.ReadOnlyError)


def run_script(conn: AbstractConnection, sha: str, body: str, args: tuple) -> Any:
    """EVALSHA `sha` with `args` (numkeys, keys..., argv...); the body after NOSCRIPT.

    An error reply leaves the connection in step; any other failure disconnects it, so
    the caller can keep using it (it reconnects on the next send)."""
    return _in_step(conn, _run_script, sha, body, args)


def run_commands(conn: AbstractConnection, *commands: tuple) -> Any:
    """Send `commands` in one write and read every reply; return the last one's. Failures
    as in run_script: an error reply (raised once every reply is read) leaves the
    connection in step, anything else disconnects it."""
    return _in_step(conn, _run_commands, commands)


def _in_step(conn: AbstractConnection, run: Callable[..., Any], *args: Any) -> Any:
    try:
        return run(conn, *args)
    except redis.ResponseError:
        raise
    except BaseException:
        conn.disconnect()
        raise


def _run_script(conn: AbstractConnection, sha: str, body: str, args: tuple) -> Any:
    _connect(conn)
    conn.send_packed_command(_pack(conn, "EVALSHA", sha, *args), check_health=False)
    try:
        try:
            return conn.read_response()
        except redis.exceptions.NoScriptError:  # a restarted Redis forgot it: send the body
            conn.send_packed_command(_pack(conn, "EVAL", body, *args), check_health=False)
            return conn.read_response()
    except redis.ConnectionError as exc:  # (a TimeoutError is not one: it stays as it is)
        raise Unanswered(str(exc)) from exc


def _run_commands(conn: AbstractConnection, commands: tuple[tuple, ...]) -> Any:
    _connect(conn)
    packed = [chunk for command in commands for chunk in _pack(conn, *command)]
    try:
        # once connected, a write that fails part way may have delivered whole commands
        conn.send_packed_command([b"".join(packed)], check_health=False)  # one write
        error = reply = None
        for _ in commands:
            try:
                reply = conn.read_response()
            except redis.ResponseError as exc:
                error = error or exc
        if error is not None:
            raise error
        return reply
    except redis.ConnectionError as exc:
        raise Unanswered(str(exc)) from exc


def _connect(conn: AbstractConnection) -> None:
    """Connect now, not inside the send: a Sentinel connection finds its primary only in
    connect(), and a failure here sent nothing, where one after it may have."""
    _drop_if_closed(conn)
    if getattr(conn, "_sock", None) is None:
        try:
            conn.connect()
        except redis.TimeoutError as exc:  # nothing was sent: not a lost reply
            raise redis.ConnectionError(str(exc)) from exc


def _drop_if_closed(conn: AbstractConnection) -> None:
    """An idle connection the server closed (restart, timeout) would take the command and
    lose it: anything readable on a connection at rest (EOF, an error) means reconnect
    before sending. One poll: redis-py's can_read costs several times more."""
    sock = getattr(conn, "_sock", None)
    if sock is None:
        return
    pending = getattr(sock, "pending", None)  # TLS: bytes decrypted and buffered already
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    if (pending is not None and pending()) or poller.poll(0):
        conn.disconnect()


def _pack(conn: AbstractConnection, *args: Any) -> Any:
    # hiredis packs str (as UTF-8), bytes, int and float as redis-py's encoder does, in
    # half the time: redis-py's packer first walks the arguments in Python
    if conn.encoder.encoding == "utf-8" and conn.encoder.encoding_errors == "strict":
        return [hiredis.pack_command(args)]
    return conn.pack_command(*args)
