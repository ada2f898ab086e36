"""One harvesting process per store: an advisory lock (``fcntl.flock``) on ``STORE/rsagg.lock``.

``rsagg run`` (unless ``--no-harvest``), ``rsagg harvest`` and ``rsagg gc`` hold it while they run: two
harvesters on one store would fetch the same changes twice and race each other's cursors, and ``gc`` could
delete a blob a harvest has committed but not yet recorded. The second process refuses to start with a
message naming the holder. The kernel drops the lock when its holder exits, however it exits, so a crash
leaves nothing to clean up (the file and the pid it holds stay, and mean nothing once unlocked).
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK_NAME = "rsagg.lock"


class StoreLocked(Exception):
    """Another process holds the store's lock; ``str()`` names the store and that process."""


@contextmanager
def store_lock(root: Path, what: str) -> Iterator[None]:
    """Hold the store's lock for the block; raise StoreLocked at once when another process holds it.

    ``what`` (e.g. ``"rsagg run"``) is written to the lock file so the refused process can name it.
    """
    path = root / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "another process"
            raise StoreLocked(
                f"store.path {root} is in use by {holder}: only one harvesting process per store "
                "(stop it first, or let it do the harvesting)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{what} (pid {os.getpid()})\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


__all__ = ["LOCK_NAME", "StoreLocked", "store_lock"]
