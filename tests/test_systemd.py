"""forkq.systemd against real AF_UNIX datagram sockets standing in for systemd's."""

from __future__ import annotations

import errno
import os
import socket
import time

import pytest

from forkq import systemd


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def listener(tmp_path, monkeypatch):
    """A bound datagram socket on a filesystem path, announced in NOTIFY_SOCKET."""
    path = tmp_path / "n.sock"
    if len(str(path)) >= 100:  # sun_path holds 108 bytes; keep the failure readable
        pytest.fail(f"tmp_path too long for a unix socket: {path}")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(5)  # a bound on a recv that must already have data, not a wait
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    yield sock
    sock.close()


@pytest.fixture
def abstract_listener(monkeypatch):
    """A bound datagram socket in Linux's abstract namespace, announced as @name."""
    name = f"forkq-test-{os.getpid()}-{os.urandom(4).hex()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
    yield sock
    sock.close()


def nothing_queued(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        sock.recv(4096)
    except BlockingIOError:
        return True
    return False


# -- what goes on the wire ------------------------------------------------------------


@pytest.mark.timeout(10)
def test_notify_joins_fields_with_newlines_in_one_datagram(listener):
    assert systemd.notify("READY=1", "STATUS=4/4 children, 3 busy") is True
    assert listener.recv(4096) == b"READY=1\nSTATUS=4/4 children, 3 busy"
    assert nothing_queued(listener)  # one datagram, not one per field


@pytest.mark.timeout(10)
def test_ready_with_status(listener):
    assert systemd.ready("4/4 children, 0 busy") is True
    assert listener.recv(4096) == b"READY=1\nSTATUS=4/4 children, 0 busy"


@pytest.mark.timeout(10)
def test_ready_without_status(listener):
    assert systemd.ready() is True
    assert listener.recv(4096) == b"READY=1"


@pytest.mark.timeout(10)
def test_status_watchdog_stopping_bytes(listener):
    assert systemd.status("3/4 children, 12 busy, quiet") is True
    assert systemd.watchdog() is True
    assert systemd.stopping() is True
    assert systemd.stopping("draining 5 jobs") is True
    assert listener.recv(4096) == b"STATUS=3/4 children, 12 busy, quiet"
    assert listener.recv(4096) == b"WATCHDOG=1"
    assert listener.recv(4096) == b"STOPPING=1"
    assert listener.recv(4096) == b"STOPPING=1\nSTATUS=draining 5 jobs"


@pytest.mark.timeout(10)
def test_status_is_utf8(listener):
    assert systemd.status("queue café: 2 busy") is True
    assert listener.recv(4096) == "STATUS=queue café: 2 busy".encode()


@pytest.mark.timeout(10)
def test_a_newline_in_a_field_cannot_add_an_assignment(listener):
    assert systemd.status("job failed\nREADY=1\r\nMAINPID=1") is True
    assert listener.recv(4096) == b"STATUS=job failed READY=1  MAINPID=1"


@pytest.mark.timeout(10)
def test_abstract_namespace_socket(abstract_listener):
    assert systemd.ready("2/2 children, 0 busy") is True
    assert abstract_listener.recv(4096) == b"READY=1\nSTATUS=2/2 children, 0 busy"


# -- when there is nothing to tell, or nobody to tell it to ----------------------------


@pytest.mark.timeout(10)
def test_unset_notify_socket_returns_false_and_sends_nothing(listener, monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert systemd.notify("READY=1") is False
    assert systemd.ready("x") is False
    assert systemd.status("x") is False
    assert systemd.watchdog() is False
    assert systemd.stopping() is False
    assert nothing_queued(listener)


@pytest.mark.parametrize("value", ["", "@", "relative/n.sock", "vsock:2:1234"])
@pytest.mark.timeout(10)
def test_unusable_notify_socket_values_return_false(value, monkeypatch):
    monkeypatch.setenv("NOTIFY_SOCKET", value)
    assert systemd.notify("READY=1") is False


@pytest.mark.timeout(10)
def test_no_fields_sends_nothing(listener):
    assert systemd.notify() is False
    assert nothing_queued(listener)


@pytest.mark.timeout(10)
def test_missing_socket_path_returns_false_without_raising(tmp_path, monkeypatch):
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone.sock"))
    assert systemd.notify("READY=1") is False
    assert systemd.watchdog() is False


@pytest.mark.timeout(10)
def test_socket_file_with_nobody_listening_returns_false(tmp_path, monkeypatch):
    # systemd restarted or went away: the socket file is still there, nothing reads it
    path = tmp_path / "dead.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.close()
    assert path.exists()
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    assert systemd.notify("WATCHDOG=1") is False


@pytest.mark.timeout(10)
def test_missing_abstract_name_returns_false(monkeypatch):
    monkeypatch.setenv("NOTIFY_SOCKET", f"@forkq-test-nobody-{os.urandom(6).hex()}")
    assert systemd.status("x") is False


@pytest.mark.timeout(10)
def test_socket_creation_failure_returns_false(listener, monkeypatch):
    def no_more_fds(*args, **kwargs):
        raise OSError(errno.EMFILE, "Too many open files")
    monkeypatch.setattr(systemd.socket, "socket", no_more_fds)
    assert systemd.notify("READY=1") is False


@pytest.mark.timeout(10)
def test_a_full_receive_queue_drops_the_message_instead_of_blocking(listener, monkeypatch):
    # Nobody reads the listener, so its queue fills and a blocking send would hang the
    # master's loop; notify gives up after SEND_TIMEOUT_S and returns False.
    monkeypatch.setattr(systemd, "SEND_TIMEOUT_S", 0.05)
    payload = "STATUS=" + "x" * 4000
    results = []
    for _ in range(100_000):
        started = time.monotonic()
        ok = systemd.notify(payload)
        elapsed = time.monotonic() - started
        results.append(ok)
        if not ok:
            break
    assert results[0] is True, "the first datagram should fit"
    assert results[-1] is False, "the queue never filled up"
    assert elapsed < 2.0, f"a send into a full queue blocked {elapsed:.2f}s"


# -- watchdog interval ---------------------------------------------------------------


@pytest.mark.timeout(10)
def test_watchdog_interval_unset_is_none():
    assert systemd.watchdog_interval() is None


@pytest.mark.timeout(10)
def test_watchdog_interval_is_half_the_period(monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")  # WatchdogSec=30
    assert systemd.watchdog_interval() == 15.0
    monkeypatch.setenv("WATCHDOG_USEC", "500000")
    assert systemd.watchdog_interval() == 0.25


@pytest.mark.timeout(10)
def test_watchdog_interval_with_our_pid(monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert systemd.watchdog_interval() == 15.0


@pytest.mark.timeout(10)
def test_watchdog_interval_for_another_pid_is_none(monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    assert systemd.watchdog_interval() is None


@pytest.mark.parametrize("usec", ["", "0", "-5", "abc", "1.5", " 30000000", "3e7",
                                  str(2**64 - 1), "٣٠"])
@pytest.mark.timeout(10)
def test_watchdog_interval_rejects_bad_usec(usec, monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", usec)
    assert systemd.watchdog_interval() is None


@pytest.mark.parametrize("pid", ["", "abc", "-1"])
@pytest.mark.timeout(10)
def test_watchdog_interval_rejects_bad_pid(pid, monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.setenv("WATCHDOG_PID", pid)
    assert systemd.watchdog_interval() is None


@pytest.mark.timeout(10)
def test_forked_child_inherits_no_watchdog(monkeypatch):
    # the master's environment names the master; a child forked from it must not ping
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(w, repr(systemd.watchdog_interval()).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        in_child = f.read()
    os.waitpid(pid, 0)
    assert in_child == b"None"
    assert systemd.watchdog_interval() == 15.0  # the master still has one


@pytest.mark.timeout(10)
def test_drop_environment(monkeypatch, listener):
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    systemd.drop_environment()
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        assert name not in os.environ
    assert systemd.watchdog_interval() is None
    assert systemd.ready() is False
    assert nothing_queued(listener)
