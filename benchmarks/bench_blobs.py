"""Blob store throughput: FileBlobStore (local disk, fsync) next to S3BlobStore (a local SeaweedFS).

For each backend and blob size: write ``count`` distinct random blobs the way the harvester does
(``begin``/``write``/``finish``, then ``commit`` in batches of ``--batch``), then read each back whole
through ``open``. Times are wall clock for the whole phase; MB = 10^6 bytes. SeaweedFS runs on this
machine (``weed mini``, started and stopped here), so the S3 figures show the protocol and client
cost on loopback, not a remote store's latency.

    python benchmarks/bench_blobs.py                        # 2,000 x 1 KB and 100 x 1 MB, both backends
    python benchmarks/bench_blobs.py --backends fs --small 500
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aggregator.store.blobs import FileBlobStore  # noqa: E402


def write_phase(store, blobs: list[bytes], batch: int) -> float:
    start = time.perf_counter()
    for i in range(0, len(blobs), batch):
        writers = []
        for data in blobs[i : i + batch]:
            w = store.begin()
            w.write(data)
            w.finish()
            writers.append(w)
        store.commit(writers)
    return time.perf_counter() - start


def read_phase(store, hashes: list[str]) -> tuple[float, int]:
    start = time.perf_counter()
    total = 0
    for h in hashes:
        with store.open(h) as f:
            total += len(f.read())
    return time.perf_counter() - start, total


def bench(name: str, store, size: int, count: int, batch: int) -> dict:
    blobs = [os.urandom(size) for _ in range(count)]
    hashes = [hashlib.sha256(b).hexdigest() for b in blobs]
    write_s = write_phase(store, blobs, batch)
    read_s, total = read_phase(store, hashes)
    assert total == size * count, "read back fewer bytes than written"
    mb = size * count / 1e6
    return {
        "backend": name,
        "size": size,
        "count": count,
        "write_mbs": mb / write_s,
        "write_bps": count / write_s,
        "read_mbs": mb / read_s,
        "read_bps": count / read_s,
    }


def human(size: int) -> str:
    return f"{size // 1_000_000} MB" if size >= 1_000_000 else f"{size // 1000} KB"


def table(rows: list[dict]) -> str:
    head = f"{'backend':<22} {'size':>6} {'count':>6} {'write MB/s':>11} {'write blobs/s':>14}"
    head += f" {'read MB/s':>10} {'read blobs/s':>13}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['backend']:<22} {human(r['size']):>6} {r['count']:>6,} {r['write_mbs']:>11.1f}"
            f" {r['write_bps']:>14,.0f} {r['read_mbs']:>10.1f} {r['read_bps']:>13,.0f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", type=int, default=2000, help="number of 1 KB blobs (2,000)")
    p.add_argument("--large", type=int, default=100, help="number of 1 MB blobs (100)")
    p.add_argument("--batch", type=int, default=100, help="blobs per commit (100)")
    p.add_argument("--backends", default="fs,s3", help="comma-separated: fs, s3")
    args = p.parse_args(argv)
    backends = [b for b in args.backends.split(",") if b]
    cases = [(1000, args.small), (1_000_000, args.large)]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="rsagg-bench-blobs-") as tmp:
        base = Path(tmp)
        if "fs" in backends:
            for size, count in cases:
                with FileBlobStore(base / f"fs-{size}") as store:
                    rows.append(bench("filesystem (fsync)", store, size, count, args.batch))
        if "s3" in backends:
            from rsagg_s3 import create_store

            from tests.seaweedfs import run_seaweedfs

            with run_seaweedfs(base / "seaweedfs") as sw:
                for size, count in cases:
                    store = create_store(
                        sw.settings(f"bench-{size}", create_bucket=True), base / f"s3-{size}"
                    )
                    try:
                        rows.append(bench("s3 (SeaweedFS, local)", store, size, count, args.batch))
                    finally:
                        store.close()
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
