"""What a state read costs from the event loop: directly, and through a worker thread (``trio.to_thread``).

``store/calls.py`` keeps SQLite's reads direct (a few microseconds on a local file) and sends a server
backend's (PostgreSQL: a network round trip each) to worker threads; this prints the figures behind that
choice: ``version()`` (the hot resource route's per-request check) and ``cursor()`` (a harvest read).

    python benchmarks/bench_state_calls.py [--calls 5000]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import trio

from aggregator.store.state import State


async def measure(st: State, calls: int) -> list[tuple[str, float, float]]:
    out = []
    for name, fn in (("version()", st.version), ("cursor(1)", partial(st.cursor, 1))):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        direct = (time.perf_counter() - start) / calls
        start = time.perf_counter()
        for _ in range(calls):
            await trio.to_thread.run_sync(fn)
        hop = (time.perf_counter() - start) / calls
        out.append((name, direct, hop))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=5000)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        st = State(Path(d) / "state.db")
        try:
            st.upsert_source("bench", "http://bench.example/")
            st.ensure_set("bench", "http://bench.example/capabilitylist.xml")
            rows = trio.run(measure, st, args.calls)
        finally:
            st.close()
    head = f"{'SQLite call':<12} {'direct µs':>10} {'thread hop µs':>14} {'hop / direct':>13}"
    print(head + "\n" + "-" * len(head))
    for name, direct, hop in rows:
        print(f"{name:<12} {direct * 1e6:>10.1f} {hop * 1e6:>14.1f} {hop / direct:>12.0f}x")


if __name__ == "__main__":
    main()
