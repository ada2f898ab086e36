"""Bytes of state per small resource, on both backends, and the time schema step 15 takes to convert a
state in place.

A state is filled with N small resources as harvests leave them: a realistic URI (~80 characters),
sha-256, md5 (rsagg stores it for every resource), length, type and the Resource List's lastmod, one
"created" change each in a baseline, then one "updated" change for a tenth of them; and, as a harvest
from a static server (nginx, Apache) keeps them for conditional re-checks, the upstream's validators of
every version fetched: an ETag and a Last-Modified header (tests/test_bench_state_size.py checks that
a harvest leaves no table or column the fill does not). ``--earlier-fill``: no baseline, lastmod or
validators, the fill of the figures before schema step 18 (which left out the table a harvest wrote the
validators to).
SQLite: the file after a checkpoint and VACUUM, and per table and index from ``dbstat`` when the library
has it; PostgreSQL (a private server, tests/pgserver.py): ``pg_total_relation_size`` of ``resources``,
``changelog`` and (before step 18) ``resource_validators`` after ``VACUUM FULL``.

``--root`` fills the same state with another rsagg checkout (e.g. the tree before a change) for a
before/after table, and then times this tree opening that state: the migration from the other tree's
schema version to this one's (``migrate`` rows, seconds, and the bytes it leaves).

    python benchmarks/bench_state_size.py [--n 20000] [--no-pg] [--root ../other-checkout]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from _headline import headline

#: Bytes per small resource before schema steps 15-16 (100,000 resources, the tree before step 15,
#: ``--root`` a worktree of edbbb8e^, the figures of docs/benchmarks.md): the target is half of them.
#: As a harvest leaves the state, and with the earlier fill (``--earlier-fill``).
ORIGINAL = {"sqlite file": 1070, "postgresql resources' tables": 1265}
ORIGINAL_WITHOUT_VALIDATORS = {"sqlite file": 698, "postgresql resources' tables": 878}

ROOT = Path(__file__).resolve().parent.parent
#: The tables the resources live in, and their indexes (SQLite names; PostgreSQL counts them with the table);
#: resource_validators until schema step 18 (then the validators are columns of resources).
TABLES = ("resources", "changelog", "resource_validators")
#: A Last-Modified as a static server sends it (IMF-fixdate, RFC 9110 §5.6.7).
HTTP_DATE = "%a, %d %b %Y %H:%M:%S GMT"


def uri(i: int) -> str:
    return f"https://repository.example.edu/fedora/objects/demo:{i:07d}/datastreams/DC/content"


def fill(st: Any, n: int, realistic: bool = True) -> None:
    """N created, then a tenth updated, in batches of 1,000 (as a harvest applies them), each batch's
    validators (harvest/pipeline.py ``_apply_batch``)."""
    from aggregator.store.rows import Change, Cursor, ResourceValidators

    t0 = datetime(2024, 1, 1, tzinfo=UTC)

    def change(i: int, kind: str, v: int, generation: int | None = None) -> Change:
        body = f"{i}/{v}".encode()
        return Change(uri(i), kind, hashlib.sha256(body).hexdigest(), 200 + i % 800, "application/xml",
                      hashes={"md5": hashlib.md5(body).hexdigest()},
                      lastmod=t0 + timedelta(seconds=i * 7 + v * 86400) if realistic else None,
                      generation=generation)  # fmt: skip

    def kept(ch: Change) -> ResourceValidators:  # nginx's ETag: "<mtime hex>-<length hex>"
        assert ch.sha256 is not None and ch.lastmod is not None and ch.length is not None
        etag = f'"{int(ch.lastmod.timestamp()):x}-{ch.length:x}"'
        return ResourceValidators(ch.uri, ch.sha256, etag, ch.lastmod.strftime(HTTP_DATE), ch.lastmod)

    # with the batch, as a harvest writes them (since schema step 18); an older tree after it
    one_call = "validators" in inspect.signature(st.apply).parameters

    def write(sid: int, changes: list[Change]) -> None:
        got = [kept(ch) for ch in changes] if realistic else []
        if one_call:
            st.apply(sid, changes, validators=got)
            return
        st.apply(sid, changes)
        if got:
            st.put_resource_validators(sid, got)

    st.upsert_source("s", "https://repository.example.edu/.well-known/resourcesync")
    sid = st.ensure_set("s", "https://repository.example.edu/capabilitylist.xml")
    gen = st.begin_baseline(sid) if realistic else None  # a first harvest is a baseline
    for b in range(0, n, 1000):
        write(sid, [change(i, "created", 0, gen) for i in range(b, min(n, b + 1000))])
    if gen is not None:
        st.finish_baseline(sid, gen, Cursor(baseline_at=t0))
    for b in range(0, n, 10000):
        write(sid, [change(i, "updated", 1) for i in range(b, min(n, b + 10000), 10)])


def sqlite_sizes(path: Path) -> dict[str, int]:
    import sqlite3

    c = sqlite3.connect(path)
    c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    c.execute("VACUUM")
    c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    out = {"file": path.stat().st_size}
    with contextlib.suppress(sqlite3.Error):  # dbstat: only when the library was built with it
        objects = dict(c.execute("SELECT name, tbl_name FROM sqlite_master WHERE type IN ('table', 'index')"))
        for name, size in c.execute("SELECT name, sum(pgsize) FROM dbstat GROUP BY name"):
            table = objects.get(name, name)
            if table in TABLES:
                out[f"{table}: {'table' if name == table else 'index ' + name}"] = size
    c.close()
    return out


def pg_sizes(url: str) -> dict[str, int]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        tables = [t for t in TABLES if conn.execute("SELECT to_regclass(%s)", (t,)).fetchone()[0]]
        for t in tables:
            conn.execute(f"VACUUM FULL {t}")
        out = {}
        for t in tables:
            heap, total = conn.execute(
                "SELECT pg_table_size(%s::regclass), pg_total_relation_size(%s::regclass)", (t, t)
            ).fetchone()
            out[f"{t}: table (with TOAST)"] = heap
            out[f"{t}: indexes"] = total - heap
        out["resources' tables"] = sum(out.values())
        return out


def child(mode: str, n: int, db: Path, url: str | None, realistic: bool = True) -> None:
    """In the checkout on ``sys.path``: fill (or, ``open``, migrate) the states, print JSON figures."""
    from aggregator.store.open import connect

    out: dict[str, Any] = {}
    for backend, location in (("sqlite", db), ("postgresql", url)):
        if location is None:
            continue
        t0 = time.perf_counter()
        with connect(location) as st:
            migrated = time.perf_counter() - t0
            if mode == "fill":
                fill(st, n, realistic)
            out[f"{backend} schema version"] = st.schema_version
        if mode == "open":
            out[f"{backend} migration (s)"] = migrated
        sizes = sqlite_sizes(db) if backend == "sqlite" else pg_sizes(str(location))
        out.update({f"{backend} {k}": v for k, v in sizes.items()})
    print(json.dumps(out))


def run(root: Path, mode: str, n: int, db: Path, url: str | None, realistic: bool = True) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    argv = [sys.executable, __file__, "--child", mode, "--n", str(n), "--db", str(db)]
    argv += [] if realistic else ["--earlier-fill"]
    argv += ["--url", url] if url else []
    out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True, cwd=root).stdout
    return json.loads(out.splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=20000, help="resources")
    p.add_argument("--no-pg", action="store_true", help="SQLite only")
    p.add_argument("--root", type=Path, help="another rsagg checkout to fill beside this one, then migrate")
    p.add_argument("--earlier-fill", action="store_true", help="the fill before schema step 18's figures")
    p.add_argument("--child", choices=("fill", "open"), help=argparse.SUPPRESS)
    p.add_argument("--db", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.child, args.n, args.db, args.url, not args.earlier_fill)
        return
    with contextlib.ExitStack() as stack:
        d = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        server = None
        if not args.no_pg:
            sys.path.insert(0, str(ROOT / "tests"))
            import pgserver

            server = stack.enter_context(pgserver.running())
        columns: list[tuple[str, dict[str, Any]]] = []
        trees = [("this", ROOT)] + ([("--root", args.root.resolve())] if args.root else [])
        for i, (label, root) in enumerate(trees):
            url = server.fresh_url() if server else None
            columns.append((label, run(root, "fill", args.n, d / f"{i}.db", url, not args.earlier_fill)))
            if label == "--root":  # this tree opens the other's state: the migration
                columns.append(("migrated", run(ROOT, "open", args.n, d / f"{i}.db", url)))
        keys = list(dict.fromkeys(k for _, col in columns for k in col))
        head = f"{'per resource (bytes) / figure':<58}" + "".join(f" {label:>10}" for label, _ in columns)
        what = "the earlier fill" if args.earlier_fill else "with lastmod and validators"
        print(f"{args.n} small resources, {args.n // 10} updated once, {what}\n{head}\n{'-' * len(head)}")
        for k in keys:
            cells = []
            for _, col in columns:
                v = col.get(k)
                if v is None:
                    cells.append(f" {'-':>10}")
                elif "version" in k or "(s)" in k:
                    cells.append(f" {v:>10.2f}" if isinstance(v, float) else f" {v:>10}")
                else:
                    cells.append(f" {v / args.n:>10.1f}")
            print(f"{k:<58}" + "".join(cells))
        originals = ORIGINAL_WITHOUT_VALIDATORS if args.earlier_fill else ORIGINAL
        for key, original in originals.items():
            value = columns[0][1].get(key)
            if value is not None:
                ours = value / args.n
                headline(f"state bytes per small resource, {key.split()[0]} (n={args.n}, {what})",
                         f"{ours:.0f} B ({ours / original:.2f}× the {original} B before steps 15-16)",
                         f"≤ {original / 2:.0f} B")  # fmt: skip


if __name__ == "__main__":
    main()
