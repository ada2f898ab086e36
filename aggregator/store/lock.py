"""One harvesting process per store: an advisory lock (``fcntl.flock``) on ``STORE/rsagg.lock``.

``rsagg run`` (unless ``--no-harvest``), ``rsagg harvest`` and ``rsagg gc --grace 0`` hold it while they
run: two harvesters on one store would fetch the same changes twice and race each other's cursors, and
``gc --grace 0`` could delete a blob a harvest has committed but not yet recorded. ``gc`` with a grace
period takes no lock (``commands/gc.py``: it never removes a blob stored recently). The second process
refuses to start with a message naming the holder. The kernel drops the lock when its holder exits,
however it exits, so a crash leaves nothing to clean up (the file and the pid it holds stay, and mean
nothing once unlocked).
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK_NAME = "rsagg.lock"


class StoreLocked(Exception):
    """Another process holds the store's lock; ``str()`` names the store and that process."""


#: Seconds a starting process keeps trying: ``harvester_running`` holds the lock for an instant.
WAIT_SECONDS = 2.0


@contextmanager
def store_lock(root: Path, what: str, *, wait: float = WAIT_SECONDS, shared: bool = False) -> Iterator[None]:
    """Hold the store's lock for the block; raise StoreLocked when another process holds it (after
    ``wait`` seconds of trying, so that a status probe at the same instant does not refuse a start).

    ``what`` (e.g. ``"rsagg run"``) is written to the lock file so the refused process can name it.
    ``shared``: the nodes of a cluster (``cluster.py``) hold it shared, beside each other; a plain
    harvester or ``gc --grace 0`` (exclusive) is refused while any of them runs, and they while it runs.
    """
    path = root / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "another process"
                raise StoreLocked(
                    f"store.path {root} is in use by {holder}: only one harvesting process per store "
                    "(stop it first, or let it do the harvesting; several nodes need [cluster] enabled)"
                ) from None
        if not shared:  # the nodes of a cluster keep the name the first of them wrote
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{what} (pid {os.getpid()})\n".encode(), 0)
        elif os.fstat(fd).st_size == 0:
            os.pwrite(fd, f"{what} (cluster nodes)\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def harvester_running(root: Path) -> bool | None:
    """Whether a process holds the store's lock (a harvest, ``run``, ``gc --grace 0``), this one included: a
    source still marked "syncing" while none does was interrupted (``report.py``). None when no process
    ever locked this store (harvests run in-process by a program of its own). Takes the lock for
    an instant, never waits (exclusive, so that cluster nodes holding it shared are seen too)."""
    try:
        fd = os.open(root / LOCK_NAME, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # releases the shared lock if it was taken
    return False


__all__ = ["LOCK_NAME", "StoreLocked", "harvester_running", "store_lock"]
