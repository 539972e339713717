"""Tell systemd how the master is doing: the sd_notify protocol, standard library only.

Under a unit with ``Type=notify`` (see ``systemd/forkq.service``) systemd passes the path of
a datagram socket in ``NOTIFY_SOCKET`` and waits for ``READY=1`` before it calls the
service started. The master uses this module to send ``READY=1`` once every child is up,
``STATUS=...`` lines that ``systemctl status`` shows, ``WATCHDOG=1`` pings when the unit
has ``WatchdogSec=`` set, and ``STOPPING=1`` when it begins a graceful stop.

Everything here is best effort. A notification that cannot be delivered (no systemd, a
socket that is gone, a full queue) is dropped and the call returns False: a master must
never die, or stall, over a status message. Outside systemd every call is a cheap no-op.

The protocol: one datagram of newline-separated ``KEY=VALUE`` assignments, sent to the
AF_UNIX SOCK_DGRAM socket named by ``NOTIFY_SOCKET``, an absolute path or, when it starts
with ``@``, a name in Linux's abstract namespace (the ``@`` stands for a leading NUL byte).
"""

from __future__ import annotations

import os
import socket

__all__ = ["notify", "ready", "status", "watchdog", "stopping", "watchdog_interval",
           "drop_environment", "SEND_TIMEOUT_S"]

# How long a send may block when systemd's receive queue is full. The master's loop calls
# this, so it is short; a dropped WATCHDOG=1 or STATUS= is replaced by the next one.
SEND_TIMEOUT_S = 0.5

# sd_watchdog_enabled() rejects this value ("infinity") as well as 0
_USEC_INFINITY = 2**64 - 1


def _address() -> str | None:
    """NOTIFY_SOCKET as an address socket.sendto() understands, or None when unusable."""
    name = os.environ.get("NOTIFY_SOCKET", "")
    if name.startswith("@") and len(name) > 1:
        return "\0" + name[1:]
    if name.startswith("/"):
        return name
    # unset, empty, relative, or a transport we don't speak (systemd 254+ also knows
    # "vsock:CID:PORT" for virtual machines); libsystemd refuses relative paths too
    return None


def notify(*fields: str) -> bool:
    """Send one datagram of ``KEY=VALUE`` fields, joined by newlines, to NOTIFY_SOCKET.

    Returns True if the datagram was handed to the kernel, False if NOTIFY_SOCKET is not
    set (nothing is done then) or the send failed for any reason. Never raises an OSError.
    A newline inside a field becomes a space, so free text (a status line naming a queue,
    say) cannot add an assignment of its own.
    """
    address = _address()
    if address is None or not fields:
        return False
    message = "\n".join(f.replace("\r", " ").replace("\n", " ") for f in fields)
    data = message.encode("utf-8", "replace")
    try:
        # one short-lived socket per call: nothing is cached, so nothing crosses a fork
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(SEND_TIMEOUT_S)
            sock.sendto(data, address)
    except OSError:  # includes TimeoutError; a notification is never worth dying for
        return False
    return True


def ready(status: str | None = None) -> bool:
    """The service is up (systemd finishes starting it); optionally with a status line."""
    if status is None:
        return notify("READY=1")
    return notify("READY=1", f"STATUS={status}")


def status(text: str) -> bool:
    """A one-line status that `systemctl status` shows, e.g. "4/4 children, 3 busy"."""
    return notify(f"STATUS={text}")


def watchdog() -> bool:
    """Ping the service watchdog (WatchdogSec=); send it every watchdog_interval() seconds."""
    return notify("WATCHDOG=1")


def stopping(status: str | None = None) -> bool:
    """The service is beginning to stop (a graceful drain may follow)."""
    if status is None:
        return notify("STOPPING=1")
    return notify("STOPPING=1", f"STATUS={status}")


def watchdog_interval() -> float | None:
    """Seconds between watchdog pings (half of WatchdogSec=), or None if there is no watchdog.

    None also when WATCHDOG_PID is set and names another process: systemd watches the main
    process only, and a forked child inherits the master's environment.
    """
    text = os.environ.get("WATCHDOG_USEC", "")
    if not (text.isascii() and text.isdigit()):
        return None
    usec = int(text)
    if usec <= 0 or usec >= _USEC_INFINITY:
        return None
    pid_text = os.environ.get("WATCHDOG_PID")
    if pid_text is not None:
        if not (pid_text.isascii() and pid_text.isdigit()) or int(pid_text) != os.getpid():
            return None
    return usec / 2 / 1_000_000


def drop_environment() -> None:
    """Forget NOTIFY_SOCKET and the watchdog variables in this process (for a forked child,
    so neither it nor the job code it runs notifies systemd in the master's name)."""
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        os.environ.pop(name, None)
