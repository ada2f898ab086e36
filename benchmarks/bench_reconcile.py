"""Reconciliation of a big set with its Resource List: time, peak memory and the GETs it makes.

The store holds N resources of one set (written straight into a fresh SQLite state, as a baseline would
have left them); the Source's Resource List lists the same N with ``md5`` digests, lengths and lastmods,
except for D differences: 40 % updated (the list announces another digest), 30 % created (listed, not
held), 30 % deleted (held, not listed). Its Change List is empty: only reconciliation can find them.
``rsagg harvest --once`` then runs as a child process: discovery, the empty Change List, the Resource
List's head, and the reconciliation (never reconciled yet, so due). Beside it, a plain parse of the same
list by rsagg's parser in a child process of its own: the floor any reconciliation stands on.

Reported: wall time and peak RSS of both, the reconciliation's GETs of resources (they must be the
updated and created ones only, each once: deletions need none), what it repaired, and the load average.

    python benchmarks/bench_reconcile.py                      # 1,000,000 entries, 100 differences
    python benchmarks/bench_reconcile.py --entries 200000     # a quicker look
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from _harness import HARVEST_ONCE, ROOT, lifespan, run_child

sys.path.insert(0, str(ROOT))

AT = datetime(2024, 6, 1, tzinfo=UTC)
LASTMOD = "2024-05-01T00:00:00Z"


def body(i: int, version: int = 0) -> bytes:
    return f"resource {i} version {version}\n".encode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the Source: documents from files, resources computed from their path, each resource GET logged ------


def source_app(folder: str, log_path: str):
    """An ASGI app: ``/x.xml`` from ``folder``; ``/r/NNNNNNN`` is resource N at the version the file
    ``versions.json`` names (0 by default); every resource request is appended to ``log_path``."""
    versions = {int(k): v for k, v in json.loads(Path(folder, "versions.json").read_text()).items()}
    log = open(log_path, "a", buffering=1)  # open for the server's life

    async def app(scope, receive, send):
        if await lifespan(scope, receive, send):
            return
        path = scope["path"]
        status, ctype, data = 404, b"text/plain", b"not found\n"
        if path.startswith("/r/"):
            log.write(path + "\n")
            i = int(path[3:])
            status, ctype, data = 200, b"text/plain", body(i, versions.get(i, 0))
        elif path.endswith(".xml") and "/" not in path[1:]:
            f = Path(folder, path[1:])
            if f.is_file():
                status, ctype, data = 200, b"application/xml", f.read_bytes()
        elif path == "/.well-known/resourcesync":
            status, ctype, data = 200, b"application/xml", Path(folder, "description.xml").read_bytes()
        headers = [(b"content-type", ctype), (b"content-length", str(len(data)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})

    return app


def serve(folder: str, port: int, log_path: str) -> None:
    import trio
    from hypercorn.config import Config
    from hypercorn.trio import serve as hypercorn_serve

    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    trio.run(hypercorn_serve, source_app(folder, log_path), config)


# -- building the Source's documents and the store ----------------------------------------------------


def plan(n: int, d: int) -> tuple[list[int], list[int], list[int]]:
    """(updated, created, deleted) entry numbers, spread over the list."""
    updated_n, created_n = d * 4 // 10, d * 3 // 10
    step = max(1, n // max(1, d))
    picks = list(range(step // 2, n, step))[:d]
    return picks[:updated_n], picks[updated_n : updated_n + created_n], picks[updated_n + created_n :]


def write_documents(
    folder: Path, base: str, n: int, updated: set[int], created: set[int], deleted: set[int]
) -> None:
    """The Resource List lists every entry but the deleted ones, the updated ones at version 1."""
    at = AT.strftime("%Y-%m-%dT%H:%M:%SZ")
    head = '<?xml version="1.0" encoding="UTF-8"?>\n'
    ns = (
        'xmlns="http://www.sitemaps.org/schemas/sitemap/0.9" xmlns:rs="http://www.openarchives.org/rs/terms/"'
    )
    with (folder / "resourcelist.xml").open("w") as f:
        f.write(head + f"<urlset {ns}>\n")
        f.write(f'<rs:ln rel="up" href="{base}/capabilitylist.xml"/>\n')
        f.write(f'<rs:md capability="resourcelist" at="{at}"/>\n')
        for i in range(n):
            if i in deleted:
                continue
            data = body(i, 1 if i in updated else 0)
            md5 = hashlib.md5(data).hexdigest()
            f.write(f"<url><loc>{base}/r/{i:07d}</loc><lastmod>{LASTMOD}</lastmod>")
            f.write(f'<rs:md hash="md5:{md5}" length="{len(data)}"/></url>\n')
        f.write("</urlset>\n")
    (folder / "changelist.xml").write_text(
        head + f'<urlset {ns}>\n<rs:ln rel="up" href="{base}/capabilitylist.xml"/>\n'
        f'<rs:md capability="changelist" from="{at}"/>\n</urlset>\n'
    )
    (folder / "capabilitylist.xml").write_text(
        head + f'<urlset {ns}>\n<rs:ln rel="up" href="{base}/.well-known/resourcesync"/>\n'
        f'<rs:md capability="capabilitylist"/>\n'
        f'<url><loc>{base}/resourcelist.xml</loc><rs:md capability="resourcelist"/></url>\n'
        f'<url><loc>{base}/changelist.xml</loc><rs:md capability="changelist"/></url>\n</urlset>\n'
    )
    (folder / "description.xml").write_text(
        head + f'<urlset {ns}>\n<rs:md capability="description"/>\n'
        f'<url><loc>{base}/capabilitylist.xml</loc><rs:md capability="capabilitylist"/></url>\n</urlset>\n'
    )
    (folder / "versions.json").write_text(json.dumps({str(i): 1 for i in updated}))


def fill_store(store: Path, base: str, n: int, created: set[int]) -> None:
    """What a baseline of the list at version 0 left: every entry but the created ones, and a cursor."""
    from aggregator.rs.w3cdt import parse_w3c
    from aggregator.store.rows import Change, Cursor
    from aggregator.store.state import State

    lastmod = parse_w3c(LASTMOD)
    store.mkdir(parents=True)
    with State(store / "state.db") as st:
        st.upsert_source("bench", f"{base}/")
        set_id = st.ensure_set("bench", f"{base}/capabilitylist.xml")
        batch: list[Change] = []
        for i in range(n):
            if i in created:
                continue
            data = body(i)
            hashes = {"md5": hashlib.md5(data).hexdigest(), "sha-256": hashlib.sha256(data).hexdigest()}
            batch.append(Change(f"{base}/r/{i:07d}", "created", hashes["sha-256"], len(data), "text/plain",
                                hashes=hashes, lastmod=lastmod))  # fmt: skip
            if len(batch) == 20_000:
                st.apply(set_id, batch)
                batch = []
        st.apply(set_id, batch, Cursor(baseline_at=AT, last_datetime=AT))


PARSE = """
import sys, time
from aggregator.rs.parse import DocumentReader
reader = DocumentReader("file:resourcelist.xml", max_bytes=2**40)
n = 0
with open(sys.argv[1], "rb") as f:
    while chunk := f.read(1 << 16):
        n += sum(1 for x in reader.feed(chunk) if hasattr(x, "loc"))
n += sum(1 for x in reader.close() if hasattr(x, "loc"))
print(n)
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--entries", type=int, default=1_000_000, help="resources in the set (default 1,000,000)")
    p.add_argument("--differences", type=int, default=100, help="entries that differ (default 100)")
    p.add_argument("--serve", nargs=3, metavar=("FOLDER", "PORT", "LOG"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve(args.serve[0], int(args.serve[1]), args.serve[2])
        return 0
    n, d = args.entries, args.differences
    updated, created, deleted = (set(x) for x in plan(n, d))
    with tempfile.TemporaryDirectory(prefix="bench-reconcile-") as tmp:
        work = Path(tmp)
        site, log = work / "site", work / "requests.log"
        site.mkdir()
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        t = time.perf_counter()
        write_documents(site, base, n, updated, created, deleted)
        fill_store(work / "run" / "data", base, n, created)
        prepared = time.perf_counter() - t
        size = (site / "resourcelist.xml").stat().st_size
        server = subprocess.Popen([sys.executable, __file__, "--serve", str(site), str(port), str(log)],
                                  cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
        try:
            for _ in range(200):
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    break
                except OSError:
                    time.sleep(0.05)
            parse = run_child([sys.executable, "-c", PARSE, str(site / "resourcelist.xml")], work, "parse")
            listed = int((work / "parse.out").read_text())
            (work / "run" / "rsagg.toml").write_text(
                '[store]\npath = "data"\n[harvest]\nretries = 1\n'
                f'[[sources]]\nname = "bench"\nurl = "{base}/"\n'
            )
            log.write_text("")
            rec = run_child([*HARVEST_ONCE, "--log-level", "warning"], work / "run", "rsagg")
            load = os.getloadavg()
        finally:
            server.terminate()
            server.wait(10)
        gets = log.read_text().split()
        wanted = {f"/r/{i:07d}" for i in updated | created}
        db = sqlite3.connect(work / "run" / "data" / "state.db")
        row = db.execute(
            "SELECT cause, differences, repaired, unrepaired, complete FROM reconciliations"
        ).fetchone()
        live = db.execute("SELECT count(*) FROM resources WHERE deleted = 0").fetchone()[0]
        db.close()
        want = {"updated": len(updated), "created": len(created), "deleted": len(deleted)}
        ok = (
            rec.code == 0
            and listed == n - len(deleted)
            and sorted(gets) == sorted(wanted)
            and live == n - len(deleted)
            and row is not None
            and json.loads(row[2]) == {k: v for k, v in want.items() if v}
        )
        print(f"\nReconciliation of a set of {n:,} resources with {d} differences "
              f"({len(updated)} updated, {len(created)} created, {len(deleted)} deleted); "
              f"Resource List {size / 2**20:.0f} MiB; store prepared in {prepared:.0f} s")  # fmt: skip
        print(f"{'':34} {'wall s':>8} {'CPU s':>8} {'peak RSS MB':>12}")
        print(f"{'plain parse of the list':34} {parse.wall:>8.1f} {parse.cpu:>8.1f} {parse.rss_mb:>12.0f}")
        print(f"{'rsagg harvest --once (reconcile)':34} {rec.wall:>8.1f} {rec.cpu:>8.1f} {rec.rss_mb:>12.0f}")
        print(f"reconcile / parse (wall): {rec.wall / parse.wall:.1f}x")
        print(f"resource GETs: {len(gets)} (expected {len(wanted)}: the updated and created ones, each once)")
        print(f"reconciliation row: {row}")
        print(f"load average (1, 5, 15 min) at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
              f"on {os.cpu_count()} CPUs")  # fmt: skip
        print("checks:", "ok" if ok else "FAILED")
        if not ok:
            print((work / "run" / "rsagg.err").read_text()[-3000:])
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
