"""systemd's notification protocol (sd_notify(3)), so ``Type=notify`` units know when rsagg is up.

A notification is one datagram of ``KEY=VALUE`` lines sent to the AF_UNIX socket named by
``$NOTIFY_SOCKET`` (a leading ``@`` means Linux's abstract namespace). Without that variable every call
is a no-op, so the same code runs under systemd, in a terminal and in tests. Sending never raises: a
service must not fail because its supervisor went away.
"""

from __future__ import annotations

import logging
import os
import socket
import time

import trio

log = logging.getLogger("rsagg.sdnotify")

_sock: socket.socket | None = None


def _address() -> str | None:
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return None
    if addr[0] == "@":
        return "\0" + addr[1:]
    if addr[0] != "/":  # sd_notify(3) accepts only absolute paths and abstract names (vsock is not ours)
        return None
    return addr


def notify(message: str) -> bool:
    """Send one notification; True when it was sent (False: no socket configured, or sending failed)."""
    global _sock
    addr = _address()
    if addr is None:
        return False
    try:
        if _sock is None:
            _sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        _sock.sendto(message.encode("utf-8"), addr)
    except OSError as exc:
        log.debug("sd_notify %r to %r failed: %s", message, addr, exc)
        return False
    return True


def ready(status_text: str | None = None) -> bool:
    """Start-up (or a reload) is complete: systemd considers the unit active."""
    return notify("READY=1" + (f"\nSTATUS={status_text}" if status_text else ""))


def reloading() -> bool:
    """A reload begins; ``ready()`` ends it. systemd >= 253 (``Type=notify-reload``) wants the time."""
    usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    return notify(f"RELOADING=1\nMONOTONIC_USEC={usec}")


def stopping() -> bool:
    """Shutdown begins (so systemd does not read the exit as a crash in progress)."""
    return notify("STOPPING=1")


def watchdog() -> bool:
    """Keep-alive for ``WatchdogSec=``."""
    return notify("WATCHDOG=1")


def status(text: str) -> bool:
    """Free-form one-line status shown by ``systemctl status``."""
    return notify("STATUS=" + text.replace("\n", " "))


def watchdog_interval() -> float | None:
    """Seconds between keep-alives (half the timeout, as sd_watchdog_enabled(3) advises), or None when
    no watchdog is expected from this process (``$WATCHDOG_PID`` names another one)."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    pid = os.environ.get("WATCHDOG_PID")
    if pid and pid != str(os.getpid()):
        return None
    return int(usec) / 2 / 1_000_000


async def watchdog_task() -> None:
    """Ping the watchdog while the event loop is alive; returns at once when no watchdog is set.

    Running as a trio task is the point: when the loop hangs (a blocking call on the trio thread), the
    pings stop and systemd restarts the service.
    """
    interval = watchdog_interval()
    if interval is None:
        return
    while True:
        watchdog()
        await trio.sleep(interval)
