"""Rendered documents kept on disk, so a list is built from the state once per version, not per request.

A closed Change List window never changes (§12.1); a Resource List part whose rows did not change
since it was rendered would render the same again (but for ``at``). ``DocumentResponse`` writes what it
streams into a ``CacheWriter`` as well; once the whole document went out, the file is renamed into the
cache under ``<name>@<version>`` and later requests for that version get the file (sendfile) instead of
a rendering: what a CDN or nginx cache would do, inside rsagg.

Files live under ``store.path/cache/documents/<fingerprint>/``: the fingerprint covers everything
besides the state that decides a document's bytes (base URL, sets, publish and plugin settings, list
sizes), so a configuration change starts a fresh cache (older folders are removed at start-up).
Bounded by ``max_bytes``: the least recently used files go first. A crash leaves at most temp files,
removed at the next start.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger("rsagg.publish")

#: Disk the cache may use (a 1,000,000-entry Resource List renders to about 430 MB).
DEFAULT_MAX_BYTES = 1024 * 1024 * 1024
_TMP = ".tmp-"


def fingerprint(*parts: object) -> str:
    """A short stable name for the inputs of a rendering (``repr`` of frozen config dataclasses)."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


class CacheWriter:
    """One rendering on its way into the cache: bytes go to a temp file; ``commit`` publishes it."""

    def __init__(self, cache: DocumentCache, name: str, version: str) -> None:
        self.cache, self.name, self.version = cache, name, version
        fd, tmp = tempfile.mkstemp(prefix=_TMP, dir=cache.folder)
        self.tmp = Path(tmp)
        self._file = os.fdopen(fd, "wb")
        self.size = 0

    def write(self, chunk: bytes) -> None:
        self._file.write(chunk)
        self.size += len(chunk)

    def commit(self) -> None:
        """No fsync: a cache file lost in a power cut is rendered again (its name is atomic)."""
        self._file.close()
        try:
            self.cache._add(self.name, self.version, self.tmp, self.size)
        except OSError as exc:  # the folder went away (another configuration's process): not cached
            log.warning("document cache %s: %s", self.cache.folder, exc)
            self.tmp.unlink(missing_ok=True)

    def abort(self) -> None:
        self._file.close()
        self.tmp.unlink(missing_ok=True)


class DocumentCache:
    """Rendered documents by (name, version); thread-safe (renderings finish in worker threads)."""

    def __init__(self, root: Path, fingerprint: str, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.folder = root / fingerprint
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._files: OrderedDict[str, tuple[str, int]] = OrderedDict()  # name -> (version, size), LRU
        self._bytes = 0
        root.mkdir(parents=True, exist_ok=True)
        for old in root.iterdir():  # renderings of another configuration
            if old.name != fingerprint:
                shutil.rmtree(old, ignore_errors=True)
        self.folder.mkdir(exist_ok=True)
        for f in sorted(self.folder.iterdir(), key=lambda p: p.stat().st_mtime):
            name, sep, version = f.name.rpartition("@")
            if f.name.startswith(_TMP) or not sep:
                f.unlink(missing_ok=True)
                continue
            self._files[name] = (version, f.stat().st_size)
            self._bytes += f.stat().st_size

    def _path(self, name: str, version: str) -> Path:
        return self.folder / f"{name}@{version}"

    def open(self, name: str, version: str) -> BinaryIO | None:
        """The cached rendering of that version, opened (a newer one may replace it meanwhile), or None."""
        with self._lock:
            held = self._files.get(name)
            if held is None or held[0] != version:
                return None
            self._files.move_to_end(name)
        try:
            return open(self._path(name, version), "rb")  # the caller closes it
        except OSError:
            return None

    def writer(self, name: str, version: str) -> CacheWriter | None:
        """A writer for a rendering of ``name`` at ``version``; None if the cache cannot take it now."""
        try:
            return CacheWriter(self, name, version)
        except OSError as exc:
            log.warning("document cache %s: %s", self.folder, exc)
            return None

    def _add(self, name: str, version: str, tmp: Path, size: int) -> None:
        with self._lock:
            old = self._files.pop(name, None)
            if old is not None:
                self._bytes -= old[1]
                self._path(name, old[0]).unlink(missing_ok=True)
            os.replace(tmp, self._path(name, version))
            self._files[name] = (version, size)
            self._bytes += size
            while self._bytes > self.max_bytes and len(self._files) > 1:
                victim, (v, n) = next(iter(self._files.items()))
                del self._files[victim]
                self._bytes -= n
                with contextlib.suppress(OSError):
                    self._path(victim, v).unlink()


__all__ = ["DEFAULT_MAX_BYTES", "CacheWriter", "DocumentCache", "fingerprint"]
