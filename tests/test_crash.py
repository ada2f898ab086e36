"""Crash safety of the harvester (docs/architecture.md invariant 2): kill -9 at any instant, restart, audit.

``rsagg harvest --once`` runs as a subprocess against a demo Upstream served by this test. It is killed
with SIGKILL at 10 random instants during a baseline and at 10 during an incremental run, restarted after
each kill, and finally run to completion. Afterwards: ``audit`` in sync; no state row naming a missing
blob and, after gc, no blob nobody names; no temp files; no unfinished baseline; a changelog in which no
change is applied twice (per URI a consistent sequence of records; the baseline logged each upstream
resource once; after it, each record maps to its own upstream change, in order); the cursor at the last
upstream change.

Kill instants are drawn uniformly between the end of Python's imports (nothing can touch the store
before) and the expected end of the run, from uninterrupted runs on scratch stores first (start-up cost:
a run with nothing to do) scaled by the work left, since a restart resumes after the last committed
batch. Restarts alternate between ``use_dumps`` on and off, so both ways of each phase are crashed
(Resource Dump / Resource List for the baseline, Change Dump packages / Change Lists for the incremental
run) and mixed. A kill that lands after the process already finished is harmless and reported as such.
RSAGG_CRASH_SEED=N replays a run (the seed is printed).
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import sys
import threading
import time
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx
import pytest
import trio

from aggregator.commands.gc import collect_garbage
from aggregator.config import load_config
from aggregator.harvest import dumps
from aggregator.rs.parse import DocumentReader
from aggregator.store.blobs import FileBlobStore
from aggregator.store.lock import LOCK_NAME
from aggregator.store.rows import parse_dt
from aggregator.store.state import State
from aggregator.testing.upstream import ChangeRecord, Upstream

from .harvesting import audit
from .test_dumps import entry_for, make_zip, manifest_xml

# Kills rsagg processes (kill -9) and restarts them.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
N_RESOURCES = 800
KILLS_PER_PHASE = 10
RUN_TIMEOUT = 120.0

Log = list[tuple[str, str, str | None]]  # (uri, change, sha256) in seq order


@dataclass
class Run:
    killed: bool
    seconds: float  # from the start of the process to its end
    first_request: float | None  # from the start to its first request to the upstream
    kill_at: str = ""

    @property
    def work(self) -> float:
        """Seconds from the first request to the end: what a run spends on the upstream's documents."""
        return self.seconds - (self.first_request or 0.0)


class Harvester:
    """``rsagg harvest -c CONFIG --once`` on one store, as a subprocess; output goes to harvest.log."""

    def __init__(self, folder: Path, up: Upstream) -> None:
        folder.mkdir(parents=True)
        self.store = folder / "data"
        self.config = folder / "rsagg.toml"
        self.log = folder / "harvest.log"
        self.up = up
        self.runs = 0

    def configure(self, *, use_dumps: bool) -> None:
        # Small batches: many blob commits and state transactions per run for the kills to land in.
        self.config.write_text(
            f"[store]\npath = {json.dumps(str(self.store))}\n\n"
            "[harvest]\nworkers = 8\nper_host = 8\nbatch_size = 24\nretries = 2\n"
            "backoff_base = 0.01\nbackoff_max = 0.05\ntimeout = 10\n"
            f"use_dumps = {json.dumps(use_dumps)}\n\n"
            f'[[sources]]\nname = "up"\nurl = {json.dumps(self.up.well_known_url)}\n'
        )

    async def run(self, *, after_start: float | None = None, after_first_request: float | None = None) -> Run:
        """Run once to its end, or SIGKILL it that many seconds after its start or its first request."""
        self.runs += 1
        cmd = [sys.executable, "-m", "aggregator", "harvest", "-c", str(self.config), "--once"]
        paths = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONFAULTHANDLER": "1"}
        if after_start is not None:
            kill_at = f"{after_start:.2f} s after the start"
        elif after_first_request is not None:
            kill_at = f"{after_first_request:.2f} s after the first request"
        else:
            kill_at = ""
        first: float | None = None
        with self.log.open("ab") as out:
            out.write(f"=== run {self.runs}: kill {kill_at or 'never'} ===\n".encode())
            out.flush()
            requests = self.up.counts.total()
            start = time.monotonic()
            proc = await trio.lowlevel.open_process(cmd, stdout=out, stderr=out, cwd=REPO, env=env)
            try:
                with trio.move_on_after(RUN_TIMEOUT):
                    async with trio.open_nursery() as nursery:

                        async def exited() -> None:
                            await proc.wait()
                            nursery.cancel_scope.cancel()

                        async def kill_time() -> None:
                            nonlocal first
                            if after_start is not None:
                                await trio.sleep(after_start)
                                nursery.cancel_scope.cancel()
                            while self.up.counts.total() == requests:
                                await trio.sleep(0.002)
                            first = time.monotonic() - start
                            if after_first_request is not None:
                                await trio.sleep(after_first_request)
                                nursery.cancel_scope.cancel()

                        nursery.start_soon(exited)
                        nursery.start_soon(kill_time)
            finally:
                killed = proc.returncode is None
                if killed:
                    proc.kill()  # SIGKILL: nothing of the harvester's cleanup runs
                with trio.CancelScope(shield=True):
                    await proc.wait()
        seconds = time.monotonic() - start
        assert not (killed and not kill_at), f"no result within {RUN_TIMEOUT} s:\n{self.tail()}"
        assert killed or proc.returncode == 0, f"harvest failed ({proc.returncode}):\n{self.tail()}"
        return Run(killed, seconds, first, kill_at)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def query(self, sql: str, params: tuple = ()) -> list[tuple]:
        """Read the state directly (only while no harvest runs); [] before the schema exists."""
        if not (self.store / "state.db").exists():
            return []
        con = sqlite3.connect(self.store / "state.db")
        try:
            return con.execute(sql, params).fetchall()
        except sqlite3.OperationalError as exc:
            if "no such table" in str(exc):  # killed before the schema was created
                return []
            raise
        finally:
            con.close()

    def live(self) -> dict[str, str]:
        return dict(self.query("SELECT uri, lower(hex(sha256)) FROM resources WHERE deleted = 0"))

    def changelog(self) -> Log:
        return self.query(
            "SELECT r.uri, CASE c.change WHEN 0 THEN 'created' WHEN 1 THEN 'updated' ELSE 'deleted' END, "
            "lower(hex(c.sha256)) FROM changelog c "
            "JOIN resources r ON r.id = c.resource_id ORDER BY c.seq"
        )

    def cursor_datetime(self) -> datetime | None:
        rows = self.query("SELECT last_datetime FROM cursors")
        return parse_dt(rows[0][0]) if rows else None


async def warm_up(up: Upstream, document: str) -> None:
    """Have the upstream build (and cache) its dump packages now, so that timed runs do not pay for it."""
    async with httpx.AsyncClient() as client:
        (await client.get(up.doc_url(document), timeout=30)).raise_for_status()


def expected_store(up: Upstream) -> dict[str, str]:
    return {up.url(p): v.sha256 for p, v in up.resources().items()}


@dataclass
class Timing:
    """From uninterrupted runs: how long a run works after its first request to the upstream."""

    first_request: float  # from the start of the process to its first request: imports, opening the store
    full: dict[bool, float]  # work of a whole run, by use_dumps

    def expected(self, use_dumps: bool, left: float) -> float:
        """The work of a run with the fraction ``left`` of a whole run's work to do (roughly: a run with
        nothing left still discovers the source and reads lists; a baseline closes its generation)."""
        return self.full[use_dumps] * (0.2 + 0.8 * left)

    def finished_early(self, use_dumps: bool, expected: float, run: Run) -> None:
        """A run finished before its kill: the machine is faster now than measured; adjust."""
        self.full[use_dumps] *= max(0.2, run.work / expected)


async def crash_phase(
    name: str, h: Harvester, rng: random.Random, timing: Timing, left: Callable[[bool], float]
) -> None:
    """KILLS_PER_PHASE runs killed at random instants (``use_dumps`` on and off in turn), then one run
    to completion. ``left(use_dumps)``: the fraction of a whole run's work still to do.

    The first kill lands before the first request (opening the store: schema, temp file clean-up); the
    others uniformly over the expected work of the run, timed from its first request, since start-up
    times vary a lot on a loaded machine.
    """
    started = time.monotonic()
    for i in range(KILLS_PER_PHASE):
        use_dumps = i % 2 == 0
        h.configure(use_dumps=use_dumps)
        todo = left(use_dumps)
        expected = timing.expected(use_dumps, todo)
        if i == 0:
            run = await h.run(after_start=rng.uniform(0.05, timing.first_request))
        else:
            run = await h.run(after_first_request=rng.uniform(0, expected))
            if not run.killed:
                timing.finished_early(use_dumps, expected, run)
        how = "killed" if run.killed else f"finished first, in {run.seconds:.2f} s"
        print(
            f"{name} {i + 1} (dumps {'on' if use_dumps else 'off'}, {todo:.0%} left, work expected "
            f"{expected:.2f} s): kill {run.kill_at}: {how}"
        )
    h.configure(use_dumps=False)
    await h.run()
    print(f"{name}: {KILLS_PER_PHASE} kills and restarts in {time.monotonic() - started:.1f} s")


def make_changes(up: Upstream, rng: random.Random) -> None:
    """Updates, deletions and creations, interleaved, spread over many closed Change Lists + the open one.

    With the hard cases: updated twice (the first entry names a version that is gone), updated to the
    same bytes, deleted and re-created (other bytes, same bytes), created then updated or deleted, updated
    then deleted.
    """
    data = {p: v.data for p, v in up.resources().items()}
    paths = sorted(data)
    rng.shuffle(paths)
    take = iter(paths)

    def some(n: int) -> list[str]:
        return [next(take) for _ in range(n)]

    scripts: list[list[tuple]] = [
        *([("update", p, b"v2 " + data[p])] for p in some(120)),
        *([("update", p, b"v2 " + data[p]), ("update", p, b"v3 " + data[p])] for p in some(30)),
        *([("update", p, data[p])] for p in some(5)),
        *([("delete", p)] for p in some(40)),
        *([("delete", p), ("create", p, b"reborn " + data[p])] for p in some(15)),
        *([("delete", p), ("create", p, data[p])] for p in some(5)),
        *([("update", p, b"last words " + data[p]), ("delete", p)] for p in some(15)),
        *([("create", f"new{i:04d}.txt", f"new {i}\n".encode())] for i in range(50)),
        *([("create", p, b"v1 " + p.encode()), ("update", p, b"v2 " + p.encode())] for p in _names("cu", 15)),
        *([("create", p, b"short-lived\n"), ("delete", p)] for p in _names("cd", 15)),
    ]
    while scripts:  # interleave at random, keeping each path's own order
        script = scripts[rng.randrange(len(scripts))]
        op, path, *data_ = script.pop(0)
        if op == "delete":
            up.delete(path)
        else:
            getattr(up, op)(path, *data_)
        if not script:
            scripts.remove(script)


def _names(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i:03d}.txt" for i in range(n)]


def replay(log: Log) -> dict[str, str]:
    """Replay the changelog, failing on records that mean a change was applied twice or out of order;
    returns the uri -> sha256 of what it says is held."""
    live: dict[str, str] = {}
    last: dict[str, str | None] = {}
    for uri, change, sha in log:
        if change == "created":
            assert uri not in live, f"{uri}: created twice without a deletion in between"
            assert sha, f"{uri}: created without a hash"
        else:
            assert uri in live, f"{uri}: {change} while not held"
        assert sha is None or last.get(uri) != sha, f"{uri}: two consecutive records of sha256 {sha}"
        last[uri] = sha
        if change == "deleted":
            del live[uri]
        else:
            live[uri] = sha
    return live


def check_each_change_logged_once(
    log: Log, changes: list[ChangeRecord], url_of: Callable[[str], str]
) -> None:
    """Each record maps to its own upstream change: per URI, the records are an ordered subsequence of the
    upstream changes (same kind of change and the bytes of that version)."""
    upstream: dict[str, list[ChangeRecord]] = {}
    for rec in changes:
        upstream.setdefault(url_of(rec.path), []).append(rec)
    used: dict[str, int] = {}
    for uri, change, sha in log:
        todo, i = upstream.get(uri, []), used.get(uri, 0)
        while i < len(todo):
            rec, i = todo[i], i + 1
            if (change == "deleted") == (rec.change == "deleted") and (
                rec.version is None or rec.version.sha256 == sha
            ):
                break
        else:
            raise AssertionError(f"{uri}: record {change} {sha} is not one of the upstream changes left")
        used[uri] = i


def check_no_temp_files(h: Harvester) -> None:
    """Nothing but the database and the blobs after a clean run. Checked before anything opens the store
    again: opening a FileBlobStore empties its temp area, which would hide a leak."""
    blobs = h.store / "blobs"
    temps = sorted(p.name for p in (blobs / "tmp").iterdir() if p.name != ".lock")
    assert temps == [], f"temp files left after a clean run: {temps[:5]}"
    others = sorted(
        str(p.relative_to(h.store)) for p in h.store.rglob("*")
        if p.is_file() and blobs not in p.parents and not p.name.startswith("state.db")
        and p.name != LOCK_NAME  # the store's lock file (store/lock.py): kept, meaningless once unlocked
    )  # fmt: skip
    assert others == [], f"files left in the store after a clean run: {others[:5]}"


def check_store(h: Harvester) -> int:
    """No row names a missing blob; no unfinished baseline; gc leaves exactly the blobs that are named.
    Returns how many blobs gc removed (committed by a run killed before its state transaction)."""
    named = {sha for (sha,) in h.query("SELECT lower(hex(sha256)) FROM resources WHERE sha256 IS NOT NULL")}
    named |= {sha for (sha,) in h.query("SELECT lower(hex(sha256)) FROM changelog WHERE sha256 IS NOT NULL")}
    with FileBlobStore(h.store / "blobs") as blobs:
        missing = sorted(sha for sha in named if not blobs.exists(sha))
        assert not missing, f"{len(missing)} blob(s) named by the state are not stored, e.g. {missing[0]}"
        with State(h.store / "state.db") as state:
            removed = collect_garbage(state, blobs, grace=0).removed
        assert set(blobs.iter_hashes()) == named
    assert h.query("SELECT name FROM sets WHERE baseline_generation IS NOT NULL") == []
    assert h.query("SELECT state FROM sources") == [("ok",)]
    return removed


async def test_kill_9_at_random_instants_then_restart(tmp_path: Path):
    seed = int(os.environ.get("RSAGG_CRASH_SEED") or random.SystemRandom().randrange(2**32))
    print(f"crash test seed {seed} (RSAGG_CRASH_SEED={seed} replays it)")
    rng = random.Random(seed)
    up = Upstream(changes_per_list=7, resourcelist_page_size=300)
    up.bulk_create(N_RESOURCES)
    async with up.serving():
        await warm_up(up, "resourcedump.xml")
        # Uninterrupted runs on scratch stores: how long a run takes, with and without dumps.
        ref = {
            on: Harvester(tmp_path / f"reference-dumps-{'on' if on else 'off'}", up) for on in (True, False)
        }
        runs = {}
        for on, r in ref.items():
            r.configure(use_dumps=on)
            runs[on] = await r.run()
        first = max(r.first_request or 0 for r in runs.values())
        timing = Timing(first, {on: r.work for on, r in runs.items()})

        h = Harvester(tmp_path / "crashed", up)

        def baseline_left(use_dumps: bool) -> float:
            # A Resource Dump is read whole again; a Resource List run skips what is stored already.
            held = h.query("SELECT count(*) FROM resources")
            return 1.0 if use_dumps or not held else 1 - held[0][0] / N_RESOURCES

        await crash_phase("baseline", h, rng, timing, baseline_left)
        check_no_temp_files(h)
        baseline_log = h.changelog()
        assert sorted(baseline_log) == sorted(
            (uri, "created", sha) for uri, sha in expected_store(up).items()
        )
        assert h.live() == expected_store(up)
        check_store(h)
        baseline_at = h.cursor_datetime()
        assert baseline_at is not None

        make_changes(up, rng)
        await warm_up(up, "changedump.xml")
        changes = [c for c in up.changes() if c.datetime > baseline_at]
        assert len(up.change_lists()) > 30 and len(changes) == len(up.changes()) - N_RESOURCES
        timing.full = {on: (await r.run()).work for on, r in ref.items()}
        for r in ref.values():
            assert r.live() == expected_store(up)

        def incremental_left(_: bool) -> float:
            at = h.cursor_datetime()
            return sum(1 for c in changes if at is None or c.datetime > at) / len(changes)

        await crash_phase("incremental", h, rng, timing, incremental_left)
        check_no_temp_files(h)

        # The verdict.
        assert await audit(load_config(h.config)) == []
        assert h.live() == expected_store(up)
        log = h.changelog()
        assert log[:N_RESOURCES] == baseline_log
        assert replay(log) == h.live()
        check_each_change_logged_once(log[N_RESOURCES:], changes, up.url)
        assert h.cursor_datetime() == changes[-1].datetime
        assert h.query("SELECT same_datetime_count FROM cursors") == [(1,)]
        garbage = check_store(h)
        print(f"{h.runs} runs of the crashed store; {garbage} unnamed blob(s) collected by gc; {timing}")


async def test_dump_manifests_are_parsed_on_the_trio_thread(tmp_path: Path, monkeypatch):
    """The root cause of harvester aborts ("munmap_chunk(): invalid pointer") found by the test above.

    lxml parsers intern names in per-thread dictionaries: a DocumentReader must be created, fed and closed
    on one thread. dumps.py used to feed the manifest's reader from whichever trio worker thread was free,
    which corrupted memory once blob commits and state writes kept other workers busy.
    """
    threads: set[int] = set()

    class Recording(DocumentReader):
        def __init__(self, *args, **kwargs) -> None:
            threads.add(threading.get_ident())
            super().__init__(*args, **kwargs)

        def feed(self, data: bytes) -> list:
            threads.add(threading.get_ident())
            return super().feed(data)

        def close(self) -> list:
            threads.add(threading.get_ident())
            return super().close()

    monkeypatch.setattr(dumps, "DocumentReader", Recording)
    members = [(f"resources/r{i}.txt", f"resource {i}".encode()) for i in range(300)]
    manifest = manifest_xml(
        [
            entry_for(f"http://example.com/r{i}.txt", f"/{name}", data)
            for i, (name, data) in enumerate(members)
        ]
    )
    package = make_zip(tmp_path / "package.zip", members, manifest)
    with FileBlobStore(tmp_path / "store") as store:
        async with aclosing(dumps.read_package(package, "http://example.com/package.zip", store)) as items:
            got = [item async for item in items]
        for item in got:
            item.blob.abort()
    assert len(got) == 300
    assert threads == {threading.get_ident()}
