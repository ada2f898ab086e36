"""Acceptance: rsagg harvests a Source that nobody here wrote, at full Resource List Index size.

The upstream is 60,000 small files described by ``resync-build`` (resync 2.0.1, the reference
implementation, from PyPI) and served by Python's stock ``http.server``. Above 50,000
entries resync-build writes a Resource List Index with two parts (§10.2); its Capability List links ``up``
to a Source Description at the well-known URI (§6.3.2, §8, §9), which http.server serves as
``application/octet-stream`` (no file extension). rsagg is given only the bare site root, so discovery
must find the well-known URI.

Everything runs as separate processes, the way an operator would run them: the server, resync-build and
``rsagg harvest --once`` / ``audit`` / ``status``. What is checked does not rely on rsagg alone: the
server's access log says what was fetched, and the state database is compared with the files on disk.

1. harvest: every resource fetched exactly once; audit in sync; status shows 60,000; the store holds
   exactly the files' contents.
2. upstream changes (100 modified, half of them with the same length; 50 deleted; 50 added), documents
   rebuilt. resync-build writes no Change List, so rsagg re-baselines from the new Resource List: it must
   fetch only the 150 changed or new files, log exactly those changes, and be in sync again.
3. a harvest with nothing changed upstream fetches no resource and logs nothing.

Slow by design (60,000 resources through real HTTP); phase times are printed (``pytest -s``).
"""

from __future__ import annotations

import hashlib
import json
import re
import resource
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from aggregator.rs.parse import parse_bytes
from aggregator.store.sql.codec import LOG_KINDS

from .harvesting import rsagg as run_rsagg

# 60,000 files described by resync-build, served by http.server, harvested by rsagg processes.
pytestmark = pytest.mark.slow

RESYNC_BUILD = Path(sys.executable).parent / "resync-build"
COUNT = 60_000  # above 50,000: resync-build writes a Resource List Index (§10.2)
MODIFIED, DELETED, ADDED = 100, 50, 50
SOURCE = "resync"
#: Generous per-command limit so that a hang fails the test instead of wedging the suite.
COMMAND_TIMEOUT = 900
_LOG_LINE = re.compile(r'"GET (\S+) HTTP/1\.[01]" (\d{3}) ')


# -- the upstream: files, resync-build, http.server ------------------------------------------------


def resource_path(i: int) -> str:
    """Site-relative path of resource ``i`` (1,000 files per folder)."""
    return f"res/{i // 1000:03d}/r{i:05d}.txt"


def write_resources(site: Path) -> None:
    for i in range(COUNT):
        path = site / resource_path(i)
        if i % 1000 == 0:
            path.parent.mkdir(parents=True)
        path.write_bytes(b"resource %d\n" % i)


@dataclass
class StaticSite:
    """``python -m http.server`` over ``root``; its access log (stderr) goes to ``log``."""

    root: Path
    log: Path
    proc: subprocess.Popen
    base: str  # http://127.0.0.1:PORT, no trailing slash
    _seen_lines: int = 0

    def new_requests(self) -> list[tuple[str, int]]:
        """(path, status) of every GET logged since the last call.

        http.server logs a request in ``send_response``, before the body is written: once a client
        has its answer, the line is in the file.
        """
        lines = self.log.read_text().splitlines()
        fresh, self._seen_lines = lines[self._seen_lines :], len(lines)
        out = []
        for line in fresh:
            m = _LOG_LINE.search(line)
            if m:
                out.append((m.group(1), int(m.group(2))))
        return out


@pytest.fixture
def site(tmp_path: Path) -> Iterator[StaticSite]:
    root = tmp_path / "site"
    root.mkdir()
    log = tmp_path / "access.log"
    # Port 0: the server binds a free port itself and prints it, so no other process can take it between
    # our choice and its bind. Its default HTTP/1.0 (a connection per request) is kept on purpose: with
    # --protocol HTTP/1.1 it writes headers and body in two sends, and Nagle + delayed ACK stall every
    # keep-alive response ~40 ms (about 180 requests/s at 8 connections).
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "http.server", "--bind", "127.0.0.1", "--directory", str(root), "0"],
            stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, text=True,
        )  # fmt: skip
    try:
        assert proc.stdout is not None
        banner = proc.stdout.readline()  # "Serving HTTP on 127.0.0.1 port 41234 (http://...) ..."
        m = re.search(r"port (\d+)", banner)
        assert m, f"http.server did not start: {banner!r} {log.read_text()!r}"
        yield StaticSite(root, log, proc, f"http://127.0.0.1:{m.group(1)}")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def resync_build(*args: str, cwd: Path) -> None:
    done = subprocess.run(
        [str(RESYNC_BUILD), *args], cwd=cwd, capture_output=True, text=True, timeout=COMMAND_TIMEOUT
    )
    out = done.stdout + done.stderr
    # resync 2.0.1 exits 0 even after a FatalError: read its output too.
    assert done.returncode == 0 and "Error" not in out, out


def build_documents(site: StaticSite) -> None:
    """Resource List (Index), Capability List and Source Description, as resync-build writes them."""
    base, root = site.base, site.root
    # --paths: only the resources are scanned, not the documents written by earlier runs; the mapping
    # covers the whole site so that the index's part URLs (next to --outfile) map too.
    resync_build(
        "--write-resourcelist", "--outfile", str(root / "resourcelist.xml"), "--hash", "md5",
        "--capabilitylist-link", f"{base}/capabilitylist.xml", "--paths", str(root / "res"),
        f"{base}={root}", cwd=root.parent,
    )  # fmt: skip
    resync_build(
        "--write-capabilitylist", f"resourcelist={base}/resourcelist.xml",
        "--sourcedescription-link", f"{base}/.well-known/resourcesync",
        "--outfile", str(root / "capabilitylist.xml"), cwd=root.parent,
    )  # fmt: skip
    (root / ".well-known").mkdir(exist_ok=True)
    resync_build(
        "--write-sourcedescription", f"{base}/capabilitylist.xml",
        "--outfile", str(root / ".well-known" / "resourcesync"), cwd=root.parent,
    )  # fmt: skip


# -- rsagg, run as an operator would ---------------------------------------------------------------


def rsagg(*args: str, config: Path) -> subprocess.CompletedProcess[str]:
    return run_rsagg(*args, config=config, timeout=COMMAND_TIMEOUT)


def harvest(config: Path) -> str:
    done = rsagg("harvest", "--once", config=config)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{SOURCE}: ok:" in done.stdout, done.stdout + done.stderr
    return done.stdout


def assert_in_sync(config: Path) -> None:
    done = rsagg("audit", config=config)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1] == f"{SOURCE}: in sync", done.stdout


def status_resources(config: Path) -> int:
    done = rsagg("status", "--json", config=config)
    assert done.returncode == 0, done.stdout + done.stderr
    (row,) = [r for r in json.loads(done.stdout)["sources"] if r["name"] == SOURCE]
    assert row["state"] == "ok" and row["last_error"] is None, row
    return row["resources"]


def held(db: Path) -> dict[str, str]:
    """uri -> sha256 of every live resource in rsagg's state database."""
    with sqlite3.connect(db) as c:
        return dict(c.execute("SELECT uri, lower(hex(sha256)) FROM resources WHERE deleted = 0"))


def changelog_since(db: Path, seq: int) -> tuple[int, Counter[str]]:
    """(last seq, change kinds counted) of the changelog records after ``seq``."""
    with sqlite3.connect(db) as c:
        last = c.execute("SELECT coalesce(max(seq), 0) FROM changelog").fetchone()[0]
        kinds = Counter(
            {
                LOG_KINDS[code]: n
                for code, n in c.execute(
                    "SELECT change, count(*) FROM changelog WHERE seq > ? GROUP BY 1", (seq,)
                )
            }
        )
    return last, kinds


def on_disk(site: StaticSite) -> dict[str, str]:
    """uri -> sha256 of every resource file the upstream serves now."""
    res = site.root / "res"
    return {
        f"{site.base}/{p.relative_to(site.root).as_posix()}": hashlib.sha256(p.read_bytes()).hexdigest()
        for p in res.rglob("*")
        if p.is_file()
    }


def resource_gets(requests: list[tuple[str, int]]) -> Counter[str]:
    return Counter(path for path, _ in requests if path.startswith("/res/"))


class Phases:
    """Wall time and CPU of child processes (rsagg, resync-build) per phase, printed at the end.

    Not asserted (speed belongs in benchmarks/); it shows where the time of this long test goes.
    """

    def __init__(self) -> None:
        self.rows: list[tuple[str, float, float]] = []

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t, cpu = time.monotonic(), self._cpu()
        yield
        self.rows.append((name, time.monotonic() - t, self._cpu() - cpu))

    @staticmethod
    def _cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime

    def __str__(self) -> str:
        return ", ".join(f"{n} {w:.1f} s (children CPU {c:.1f} s)" for n, w, c in self.rows)


# -- the test --------------------------------------------------------------------------------------


def test_harvest_resync_build_source_served_by_http_server(tmp_path: Path, site: StaticSite):
    phase = Phases()
    t0 = time.monotonic()
    with phase("upstream"):
        write_resources(site.root)
        build_documents(site)

    # The upstream as written: an index of two parts, the well-known URI served (as a generic type).
    head, parts = parse_bytes((site.root / "resourcelist.xml").read_bytes())
    assert head.is_index and head.capability == "resourcelist" and len(parts) == 2
    got = httpx.get(f"{site.base}/.well-known/resourcesync")
    assert got.status_code == 200, got
    head, entries = parse_bytes(got.content)
    assert head.capability == "description" and [e.loc for e in entries] == [
        f"{site.base}/capabilitylist.xml"
    ]
    print(f"\nhttp.server serves /.well-known/resourcesync as {got.headers.get('content-type')!r}")
    site.new_requests()

    config = tmp_path / "rsagg.toml"
    # per_host 4: http.server listens with socketserver's backlog of 5; 8 connections opened at once
    # overflow it and each dropped SYN costs a 1 s retransmit (tuning for a small server, as an operator
    # would; the harvest is as correct with 8, only slower).
    config.write_text(
        f'[store]\npath = "{tmp_path / "store"}"\n\n[harvest]\nper_host = 4\n\n'
        f'[[sources]]\nname = "{SOURCE}"\nurl = "{site.base}/"\n'  # the bare site root
    )
    db = tmp_path / "store" / "state.db"

    # 1. First harvest: discovery from the site root, baseline from the index; every resource once.
    with phase("harvest 1"):
        harvest(config)
    requests = site.new_requests()
    assert ("/.well-known/resourcesync", 200) in requests
    gets = resource_gets(requests)
    assert len(gets) == COUNT and set(gets.values()) == {1}, gets.most_common(3)
    assert held(db) == on_disk(site)
    last, kinds = changelog_since(db, 0)
    assert kinds == {"created": COUNT}
    with phase("audit 1"):
        assert_in_sync(config)
    assert status_resources(config) == COUNT

    # 2. Upstream changes; resync-build rebuilds its Resource List (it has no Change List to offer).
    changed = []
    for i in range(MODIFIED):
        path = site.root / resource_path(i)
        # Half keep their length (only the hash tells), half grow.
        path.write_bytes(b"RESOURCE %d\n" % i if i % 2 else b"resource %d, modified\n" % i)
        changed.append(resource_path(i))
    for i in range(MODIFIED, MODIFIED + DELETED):
        (site.root / resource_path(i)).unlink()
    (site.root / "res" / "new").mkdir()
    for i in range(ADDED):
        (site.root / "res" / "new" / f"n{i:03d}.txt").write_bytes(b"new resource %d\n" % i)
        changed.append(f"res/new/n{i:03d}.txt")
    with phase("rebuild"):
        build_documents(site)

    with phase("harvest 2"):
        harvest(config)
    gets = resource_gets(site.new_requests())
    assert sorted(gets) == sorted(f"/{p}" for p in changed) and set(gets.values()) == {1}
    assert held(db) == on_disk(site)
    last2, kinds = changelog_since(db, last)
    assert kinds == {"updated": MODIFIED, "deleted": DELETED, "created": ADDED}
    with phase("audit 2"):
        assert_in_sync(config)
    assert status_resources(config) == COUNT

    # 3. Nothing changed upstream: nothing fetched, nothing logged.
    with phase("harvest 3"):
        harvest(config)
    assert resource_gets(site.new_requests()) == Counter()
    assert changelog_since(db, last2) == (last2, Counter())
    assert status_resources(config) == COUNT

    print(f"{phase}; total {time.monotonic() - t0:.1f} s")
