"""The state's hot paths on both backends: a batch of changes applied, resource reads, a changelog page,
a Resource List's listing, a Change List's log range, a TimeGate's ``version_at()``,
``version()`` and ``cursor()``; the best of several repeats (robust on a loaded machine).

The SQL is written once for both backends (aggregator/store/sql/); ``--root`` times another checkout
of rsagg (e.g. the tree before a change) with the same script, for a before/after table. PostgreSQL
runs in a private server (tests/pgserver.py) unless ``--no-pg``.

    python benchmarks/bench_state_paths.py [--batch 1000] [--no-pg] [--cpu] [--root ../other-checkout]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import time
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


#: What ``best`` times: wall time, or (``--cpu``) this process's CPU time: all of a SQLite call's
#: work, the client's share of a PostgreSQL call's (steadier than wall time on a loaded machine).
TIMER: Callable[[], float] = time.perf_counter


def best(fn: Callable[[], Any], number: int, repeat: int = 7) -> float:
    """Seconds per call: the best of ``repeat`` rounds of ``number`` calls."""
    return min(timeit.repeat(fn, number=number, repeat=repeat, timer=TIMER)) / number


def measure(st: Any, batch: int) -> dict[str, float]:
    from aggregator.store.rows import Change

    def sha(i: int) -> str:
        return hashlib.sha256(str(i).encode()).hexdigest()

    st.upsert_source("s", "http://x.example/sd.xml")
    sid = st.ensure_set("s", "http://x.example/cl.xml")
    created, updated = iter(range(10**9)), iter(range(1, 10**9))

    def create() -> None:
        b = next(created) * batch
        st.apply(sid, [Change(f"http://x.example/r/{i}", "created", sha256=sha(i), length=i)
                       for i in range(b, b + batch)])  # fmt: skip

    def update() -> None:
        v = next(updated)
        st.apply(sid, [Change(f"http://x.example/r/{i}", "updated", sha256=sha(i * 7 + v), length=i)
                       for i in range(batch)])  # fmt: skip

    uris = [f"http://x.example/r/{i}" for i in range(batch)]

    out = {
        f"apply {batch} created (ms)": best(create, 1, 9) * 1e3,
        f"apply {batch} updated (ms)": best(update, 1, 9) * 1e3,
    }
    res = st.resource(sid, "http://x.example/r/5")  # updated 9 times: a history of 10 versions
    first = next(iter(st.iter_versions(res.id))).datetime
    return out | {
        f"resources({batch}) (ms)": best(lambda: st.resources(sid, uris), 3) * 1e3,
        "resource() (µs)": best(lambda: st.resource(sid, "http://x.example/r/5"), 200) * 1e6,
        "changelog page of 1000 (ms)": best(lambda: sum(1 for _ in st.iter_changelog(limit=1000)), 3) * 1e3,
        # a Resource List's rows (publish/listing.py) and a Change List window's records with their rows
        "live listing of 1000 (ms)": best(
            lambda: sum(1 for _ in st.iter_live_listing([sid], until_id=1000)), 3
        )
        * 1e3,
        "log range of 1000 (ms)": best(lambda: sum(1 for _ in st.iter_log_range([sid], 0, 1000)), 3) * 1e3,
        # a TimeGate's choice (publish/versions.py) of a row's oldest version, its whole history walked
        "version_at() (µs)": best(lambda: st.version_at(res.id, first), 200) * 1e6,
        "version() (µs)": best(st.version, 1000) * 1e6,
        "cursor() (µs)": best(lambda: st.cursor(sid), 1000) * 1e6,
    }


def child(batch: int, pg: bool, cpu: bool = False) -> None:
    """Run in the checkout on ``sys.path``: print one line per backend and figure."""
    global TIMER
    if cpu:
        TIMER = time.process_time
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from aggregator.store.open import connect
    except ImportError:  # a checkout from before store/open.py
        from aggregator.store.state import connect  # type: ignore[attr-defined,no-redef]
    with tempfile.TemporaryDirectory() as d:
        st = connect(Path(d) / "state.db")
        for name, value in measure(st, batch).items():
            print(f"sqlite\t{name}\t{value}")
        st.close()
    if pg:
        import pgserver

        with pgserver.running() as server:
            st = connect(server.fresh_url())
            for name, value in measure(st, batch).items():
                print(f"postgresql\t{name}\t{value}")
            st.close()


def run(root: Path, batch: int, pg: bool, cpu: bool = False) -> dict[tuple[str, str], float]:
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    argv = [sys.executable, __file__, "--child", "--batch", str(batch)] + ([] if pg else ["--no-pg"])
    argv += ["--cpu"] if cpu else []
    out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout
    return {(b, n): float(v) for b, n, v in (line.split("\t") for line in out.splitlines())}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1000)
    p.add_argument("--no-pg", action="store_true", help="SQLite only")
    p.add_argument("--root", type=Path, help="another rsagg checkout to time beside this one")
    p.add_argument("--cpu", action="store_true", help="time this process's CPU, not the wall clock")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.batch, not args.no_pg, args.cpu)
        return
    trees = [("this", ROOT)] + ([("--root", args.root.resolve())] if args.root else [])
    results = [run(root, args.batch, not args.no_pg, args.cpu) for _, root in trees]
    head = f"{'backend':<11} {'path':<30}" + "".join(f" {label:>10}" for label, _ in trees)
    print(head + "\n" + "-" * len(head))
    for key in results[0]:
        print(f"{key[0]:<11} {key[1]:<30}" + "".join(f" {r.get(key, float('nan')):>10.1f}" for r in results))


if __name__ == "__main__":
    main()
