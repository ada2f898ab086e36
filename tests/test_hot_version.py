"""The hot cache reads a SQLite state's version only when it may have moved (publish/fastpath.py).

A commit of any handle of this process moves ``local_commit_mark()``: the next request reads the version
again, so a same-process change shows at once. Without one, ``PRAGMA data_version`` is read at most once
per ``local_age``: another process's commit shows within it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from aggregator.publish.fastpath import Hot, HotCache
from aggregator.store.open import connect, local_commit_mark
from aggregator.store.state import State

KEY = b"/s/r/x"


class CountingReader:
    """A read-only state handle that counts its ``version()`` reads."""

    def __init__(self, path: Path) -> None:
        self.inner = connect(path, readonly=True)
        self.reads = 0

    def version(self) -> int:
        self.reads += 1
        return self.inner.version()

    def close(self) -> None:
        self.inner.close()


def _cache(path: Path, local_age: float) -> tuple[HotCache, list[CountingReader]]:
    readers: list[CountingReader] = []

    def open_reader() -> CountingReader:
        readers.append(CountingReader(path))
        return readers[-1]

    return HotCache(open_reader, local_age=local_age), readers  # type: ignore[arg-type]


#: Writes a harvester, ``rsagg gc`` or the publisher make, each through a handle of its own.
WRITES = [
    ("upsert_source", lambda st, i: st.upsert_source(f"s{i}", f"http://up{i}.example/")),
    ("set_source_status", lambda st, i: st.set_source_status("s", last_error=f"e{i}")),
    ("upsert_source moved", lambda st, i: st.upsert_source("s", f"http://moved{i}.example/")),
]


@pytest.mark.parametrize("name,write", WRITES, ids=[w[0] for w in WRITES])
async def test_a_commit_in_this_process_shows_at_once(tmp_path: Path, name: str, write) -> None:
    """However long ``local_age``, each commit of another handle of this process drops the cached
    answers at the next request; requests without a commit in between read no version at all."""
    path = tmp_path / "state.db"
    writer = State(path)
    writer.upsert_source("s", "http://up.example/")
    cache, readers = _cache(path, local_age=3600)
    try:
        assert await cache.fresh()
        for i in range(5):
            cache.put(KEY, Hot(404, None))
            for _ in range(20):  # no commit: the cached answer stands, no version read
                before = readers[0].reads
                assert cache.settled()  # the lane's shortcut agrees: no need to await fresh()
                assert await cache.fresh() and cache.get(KEY) is not None
                assert readers[0].reads == before
            mark = local_commit_mark()
            write(writer, i)
            assert local_commit_mark() != mark
            assert not cache.settled()
            before = readers[0].reads
            assert await cache.fresh() and cache.get(KEY) is None, f"{name} #{i} did not show"
            assert readers[0].reads == before + 1
    finally:
        cache.close()
        writer.close()


def test_a_rolled_back_transaction_does_not_move_the_mark(tmp_path: Path) -> None:
    """Only commits count: a write that fails leaves the mark (and the cache) as it was."""
    writer = State(tmp_path / "state.db")
    try:
        mark = local_commit_mark()
        with pytest.raises(RuntimeError), writer._write(fence=False) as conn:
            conn.execute("UPDATE sources SET url = 'http://x.example/'")
            raise RuntimeError("the write fails")
        assert local_commit_mark() == mark
    finally:
        writer.close()


async def test_another_process_commit_shows_after_local_age(tmp_path: Path) -> None:
    """A commit of another process does not move this process's mark: it shows once ``local_age``
    passed (here: kept with an hour, dropped with 0, which reads the version every request)."""
    path = tmp_path / "state.db"
    State(path).close()
    cache, _ = _cache(path, local_age=3600)
    try:
        assert await cache.fresh()
        cache.put(KEY, Hot(404, None))
        code = (
            "import sys; from aggregator.store.state import State; "
            "st = State(sys.argv[1]); st.upsert_source('o', 'http://o.example/'); st.close()"
        )
        subprocess.run([sys.executable, "-c", code, str(path)], check=True, timeout=120)
        assert cache.settled()
        assert await cache.fresh() and cache.get(KEY) is not None  # within local_age: kept
        cache.local_age = 0
        assert not cache.settled()
        assert await cache.fresh() and cache.get(KEY) is None  # read again: the commit shows
    finally:
        cache.close()
