"""``rsagg gc`` with a grace period: only unreferenced blobs stored long enough ago go, beside harvesters.

Ages are set explicitly (a file's mtime, a row's ``stored_at``): no test waits for the clock.
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from aggregator.commands.gc import Garbage, collect_garbage
from aggregator.store.blobs import FileBlobStore
from aggregator.store.inline import INLINE_FILE
from aggregator.store.lock import harvester_running
from aggregator.store.rows import Change
from aggregator.store.state import State

RSAGG = str(Path(sys.executable).parent / "rsagg")
HOUR = 3600.0
BIG = 20 * 1024  # above INLINE_BYTES: stored as a file


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def age_file(store: FileBlobStore, data: bytes, seconds: float) -> None:
    path = store.local_path(sha(data))
    assert path is not None and path.is_file()
    t = time.time() - seconds
    os.utime(path, (t, t))


def age_row(root: Path, data: bytes, seconds: float) -> None:
    with sqlite3.connect(root / INLINE_FILE) as conn:
        key = bytes.fromhex(sha(data))
        cur = conn.execute("UPDATE blobs SET stored_at = ? WHERE sha256 = ?", (time.time() - seconds, key))
        assert cur.rowcount == 1


@pytest.fixture
def store(tmp_path: Path) -> Iterator[FileBlobStore]:
    with FileBlobStore(tmp_path / "blobs") as s:
        yield s


def blobs_of(n: int, *, big: bool) -> list[bytes]:
    return [bytes([i]) * (BIG if big else 100) + b"x" for i in range(n)]


@pytest.mark.parametrize("big", [True, False], ids=["files", "rows"])
def test_only_unreferenced_blobs_older_than_the_grace_period_go(
    tmp_path: Path, store: FileBlobStore, big: bool
) -> None:
    named_old, old, young = blobs_of(3, big=big)
    for data in (named_old, old, young):
        store.put_bytes(data)
        assert (store.read_inline(sha(data)) is None) == big  # stored where this case means to
    age = age_file if big else (lambda s, d, t: age_row(s.root, d, t))
    age(store, named_old, 2 * HOUR)
    age(store, old, 2 * HOUR)
    age(store, young, HOUR - 60)
    with State(tmp_path / "state.db") as st:
        st.upsert_source("s", "http://example.org/")
        set_id = st.ensure_set("s", "http://example.org/cl.xml")
        st.apply(set_id, [Change(uri="http://example.org/r", change="created", sha256=sha(named_old),
                                 length=len(named_old))])  # fmt: skip
        assert collect_garbage(st, store, grace=HOUR, dry_run=True) == Garbage(1, len(old), 1)
        assert store.exists(sha(old))
        assert collect_garbage(st, store, grace=HOUR) == Garbage(1, len(old), 1)
        assert store.exists(sha(named_old)) and store.exists(sha(young)) and not store.exists(sha(old))
        assert collect_garbage(st, store, grace=0) == Garbage(1, len(young), 0)  # the old behaviour
    assert list(store.iter_hashes()) == [sha(named_old)]


@pytest.mark.parametrize("big", [True, False], ids=["files", "rows"])
def test_a_blob_stored_again_counts_as_recent(tmp_path: Path, store: FileBlobStore, big: bool) -> None:
    """A harvest that finds the blob stored already (dedup) is about to name it: gc must keep it."""
    (data,) = blobs_of(1, big=big)
    store.put_bytes(data)
    if big:
        age_file(store, data, 2 * HOUR)
    else:
        age_row(store.root, data, 2 * HOUR)
    ((_, before),) = store.iter_stored()
    assert before < time.time() - HOUR
    store.put_bytes(data)  # dedup
    ((_, after),) = store.iter_stored()
    assert after > time.time() - HOUR
    with State(tmp_path / "state.db") as st:
        assert collect_garbage(st, store, grace=HOUR) == Garbage(0, 0, 1)
    assert store.exists(sha(data))


@pytest.mark.parametrize("big", [True, False], ids=["files", "rows"])
def test_a_blob_stored_again_after_gc_listed_it_stays(store: FileBlobStore, big: bool) -> None:
    """gc listed the blob as old, then a commit stored it again: the conditional delete keeps it."""
    (data,) = blobs_of(1, big=big)
    store.put_bytes(data)
    if big:
        age_file(store, data, 2 * HOUR)
    else:
        age_row(store.root, data, 2 * HOUR)
    cutoff = time.time() - HOUR
    ((_, stored_at),) = store.iter_stored()
    assert stored_at < cutoff  # gc's listing: old
    store.put_bytes(data)  # a harvest dedups onto it
    assert store.delete(sha(data), stored_before=cutoff) is False
    assert store.open(sha(data)).read() == data
    assert list(store.tmp.glob("blob-*")) == []  # a file set aside went back
    assert store.delete(sha(data), stored_before=time.time() + 60) is True
    assert not store.exists(sha(data))


def test_an_inline_database_without_stored_at_gets_it(tmp_path: Path) -> None:
    """small.db made before rows had ``stored_at``: the column is added, every row counted as recent."""
    root = tmp_path / "blobs"
    root.mkdir()
    with sqlite3.connect(root / INLINE_FILE) as conn:
        conn.execute("CREATE TABLE blobs (sha256 BLOB PRIMARY KEY, data BLOB NOT NULL)")
        conn.execute("INSERT INTO blobs VALUES (?, ?)", (bytes.fromhex(sha(b"old row")), b"old row"))
    opened = time.time()
    with FileBlobStore(root) as store:
        ((name, stored_at),) = store.iter_stored()
        assert name == sha(b"old row") and stored_at >= opened - 1
        store.put_bytes(b"new row")
        assert store.read_inline(sha(b"new row")) == b"new row"
    with FileBlobStore(root) as store:  # opened again: nothing to add
        assert [s for s, _ in store.iter_stored()] == sorted([sha(b"old row"), sha(b"new row")])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rsagg(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([RSAGG, *argv], capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # a daemon process
def test_gc_runs_beside_a_running_daemon(tmp_path: Path) -> None:
    """``rsagg gc`` removes only the old unreferenced blobs while ``rsagg run`` holds the store; with
    ``--grace 0`` it is refused."""
    data_dir = tmp_path / "data"
    config = tmp_path / "rsagg.toml"
    config.write_text(
        f'[server]\nlisten = "127.0.0.1:{_free_port()}"\n[store]\npath = "{data_dir}"\n'
        '[[sources]]\nname = "a"\nurl = "http://127.0.0.1:9/rs/capabilitylist.xml"\n'  # nothing listens
    )
    log = open(tmp_path / "daemon.log", "wb")
    daemon = subprocess.Popen([RSAGG, "run", "-c", str(config)], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 60
        while not harvester_running(data_dir):
            assert daemon.poll() is None, (tmp_path / "daemon.log").read_text()
            assert time.monotonic() < deadline, "rsagg run did not take the store lock within 60 s"
            time.sleep(0.1)
        big_old, big_young = blobs_of(2, big=True)
        small_old, small_young = blobs_of(2, big=False)
        with FileBlobStore(data_dir / "blobs") as store:
            for data in (big_old, big_young, small_old, small_young):
                store.put_bytes(data)
            age_file(store, big_old, 2 * HOUR)
            age_row(store.root, small_old, 2 * HOUR)
            age_file(store, big_young, HOUR / 2)
            age_row(store.root, small_young, HOUR / 2)

            refused = _rsagg("gc", "-c", str(config), "--grace", "0")
            assert refused.returncode == 1 and "in use by rsagg run (pid" in refused.stderr, refused

            done = _rsagg("gc", "-c", str(config), "--grace", str(HOUR))
            assert done.returncode == 0, done
            assert (
                f"removed 2 unreferenced blob(s), {len(big_old) + len(small_old)} bytes; "
                "kept 2 unreferenced blob(s) stored less than 3600 s ago" in done.stdout
            ), done
            assert [store.exists(sha(d)) for d in (big_old, big_young, small_old, small_young)] == [
                False, True, False, True,
            ]  # fmt: skip
        assert daemon.poll() is None and harvester_running(data_dir)  # the daemon never noticed
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait(timeout=30)
        log.close()


def test_a_file_a_killed_gc_set_aside_is_put_back_at_start(tmp_path: Path) -> None:
    """gc renames a blob file aside before it decides (a commit may have just stored it again); killed
    in between, the next process to open the store alone puts it back, or drops it when stored anew."""
    root = tmp_path / "blobs"
    with FileBlobStore(root, inline_bytes=0) as store:
        kept, again = store.put_bytes(b"set aside by a killed gc"), store.put_bytes(b"stored anew")
        for info in (kept, again):
            os.rename(store.local_path(info.sha256), store.tmp / f"gc-{info.sha256}.0badcafe")
        store.put_bytes(b"stored anew")  # a commit meanwhile: its own file
        assert not store.exists(kept.sha256)
    with FileBlobStore(root, inline_bytes=0) as store:
        assert store.open(kept.sha256).read() == b"set aside by a killed gc"
        assert store.open(again.sha256).read() == b"stored anew"
        assert [p.name for p in store.tmp.iterdir() if p.name != ".lock"] == []
