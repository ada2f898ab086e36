"""The Fetcher alone: CPU per resource GET on the lean path (``aggregator/net/lean.py``) and on httpx.

Why apart from bench_harvest.py: a harvest's CPU is the fetch plus the pipeline, the parser and the store;
this takes the fetch alone. One Fetcher setting, ``Fetcher.resource`` for ``--resources`` small files
(0.5-4 KB, the same as bench_harvest.py's) from the same static upstream (its own process), ``--tasks`` at
a time (the default ``per_host``: 8), verified and written to a blob store as a harvest does (then
discarded); the two paths take turns ``--rounds`` times. CPU is this process's user + system time over the
fetches only; the load average is printed beside each figure.

    python benchmarks/bench_fetch.py                      # 10,000 resources, 3 rounds
    python benchmarks/bench_fetch.py --resources 2000 --rounds 1
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _harness import ROOT

sys.path.insert(0, str(ROOT))


def fetch_all(base: str, n: int, tasks: int, lean: bool, blobs: Path) -> tuple[float, float, int]:
    """(wall s, CPU s, connections the lean pool opened) for fetching the ``n`` resources once."""
    import trio
    from bench_harvest import FILES_PER_DIR

    from aggregator.harvest.fetch import Expected, Fetcher
    from aggregator.net import outbound
    from aggregator.store.blobs import FileBlobStore

    urls = [f"{base}/res/{i // FILES_PER_DIR:04d}/{i:07d}.txt" for i in range(n)]
    out: list[tuple[float, float, int]] = []

    async def main() -> None:
        store = FileBlobStore(blobs)
        async with Fetcher(policy=outbound.AddressPolicy(allow=outbound.LOOPBACK)) as f:
            if not lean:
                f._lean = None
            todo = iter(urls)

            async def worker() -> None:
                for url in todo:
                    got = await f.resource([url], Expected({}), store)
                    got.blob.abort()

            cpu, wall = time.process_time(), time.perf_counter()
            async with trio.open_nursery() as nursery:
                for _ in range(tasks):
                    nursery.start_soon(worker)
            opened = f._lean.connections_opened if f._lean is not None else 0
            out.append((time.perf_counter() - wall, time.process_time() - cpu, opened))

    trio.run(main)
    return out[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--resources", type=int, default=10_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tasks", type=int, default=8, help="GETs at a time (rsagg's default per_host: 8)")
    args = p.parse_args(argv)
    from bench_harvest import Server, write_files

    work = Path(tempfile.mkdtemp(prefix="rsagg-bench-fetch-"))
    server = Server(work / "site", work / "server.log")
    rows: list[tuple[str, int, float, float, float, int]] = []
    try:
        (work / "site").mkdir()
        write_files(work / "site", args.resources)
        base = server.start(0.0)
        print(f"{args.resources:,} files served at {base}; {os.cpu_count()} CPUs", flush=True)
        for i in range(args.rounds):
            for path in ("httpx", "lean"):
                load = os.getloadavg()[0]
                wall, cpu, opened = fetch_all(
                    base, args.resources, args.tasks, path == "lean", work / "blobs"
                )
                rows.append((path, i + 1, load, wall, cpu, opened))
                print(f"  {path} #{i + 1} (load {load:.2f}): {wall:.1f} s, "
                      f"{cpu / args.resources * 1e6:,.0f} us CPU/resource", flush=True)  # fmt: skip
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    n = args.resources
    print()
    head = (f"{'path':<6} {'round':>5} {'load':>5} {'wall s':>7} {'GETs/s':>8} {'CPU us/GET':>11}"
            f" {'connections':>12}")  # fmt: skip
    print(head)
    print("-" * len(head))
    for path, i, load, wall, cpu, opened in rows:
        print(f"{path:<6} {i:>5} {load:>5.2f} {wall:>7.1f} {n / wall:>8,.0f} {cpu / n * 1e6:>11,.0f}"
              f" {opened if path == 'lean' else '-':>12}")  # fmt: skip
    med = {path: statistics.median(cpu / n * 1e6 for p_, _, _, _, cpu, _ in rows if p_ == path)
           for path in ("httpx", "lean")}  # fmt: skip
    print(f"median CPU us per GET: httpx {med['httpx']:,.0f}, lean {med['lean']:,.0f}"
          f" ({med['httpx'] / med['lean']:.2f}x fewer); {args.tasks} GETs at a time")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
