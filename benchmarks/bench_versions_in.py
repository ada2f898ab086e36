"""What keeping every version costs (§14.6 mementos, ``harvest/versions.py``): one incremental harvest
after each of ``--resources`` resources was updated ``--updates`` times between two polls, with and
without ``rel="memento"`` links upstream.

The upstream is the test Source (``aggregator/testing/upstream.py``) served in this process, on the same
trio loop as the harvester: the times are for comparing the two columns, not absolute speeds. Printed per
case: versions in rsagg's history after the harvest, upstream GETs of resources and mementos, seconds of
the incremental harvest, bytes of the new versions kept (distinct blobs the history names).

    python benchmarks/bench_versions_in.py                       # 1,000 resources x 3 updates
    python benchmarks/bench_versions_in.py --resources 200 --updates 5
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import trio

from aggregator.commands.harvest import harvest_once
from aggregator.config import parse_config
from aggregator.store.open import open_state
from aggregator.testing.upstream import Upstream


def config(store: Path, url: str):
    settings = {"retries": 2, "backoff_base": 0.01, "backoff_max": 0.05, "timeout": 30}
    return parse_config(
        {"store": {"path": str(store)}, "harvest": settings, "sources": [{"name": "up", "url": url}]},
        str(store.parent / "bench.toml"),
    )


def version_bytes(cfg) -> int:
    """Bytes of the distinct versions the history names (what gc keeps; blobs are content-addressed)."""
    with open_state(cfg) as state:
        return sum(dict((r.sha256, r.length or 0) for r in state.iter_changelog() if r.sha256).values())


async def case(mementos: bool, resources: int, updates: int, folder: Path) -> dict[str, float]:
    up = Upstream(mementos=mementos, resource_dump=False, change_dump=False, changes_per_list=None)
    paths = up.bulk_create(resources, size=2048)
    async with up.serving() as base:
        cfg = config(folder / "data", base + "/.well-known/resourcesync")
        await harvest_once(cfg, [])
        before = version_bytes(cfg)
        for k in range(updates):
            for p in paths:
                up.update(p, (f"{p} version {k + 1}\n".encode() + b"x" * 2048)[:2048])
        up.reset_counts()
        started = time.perf_counter()
        [result] = await harvest_once(cfg, [])
        seconds = time.perf_counter() - started
    with open_state(cfg) as state:
        versions = sum(1 for r in state.iter_changelog() if r.change == "updated")
    gets = sum(n for p, n in up.counts.items() if "/res/" in p or "/memento/" in p)
    return {
        "ok": float(result.ok),
        "versions": versions,
        "gets": gets,
        "seconds": seconds,
        "blob_mb": (version_bytes(cfg) - before) / 2**20,
    }


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--resources", type=int, default=1000)
    ap.add_argument("--updates", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for mementos in (False, True):
        with tempfile.TemporaryDirectory() as tmp:
            rows.append((mementos, await case(mementos, args.resources, args.updates, Path(tmp))))
    print(f"{args.resources} resources x {args.updates} updates between two polls, one incremental harvest")
    print(
        f"{'memento links':>14} {'sync ok':>8} {'versions kept':>14} {'GETs':>7} {'seconds':>8} "
        f"{'new versions MB':>16}"
    )
    for mementos, r in rows:
        print(
            f"{'yes' if mementos else 'no':>14} {'yes' if r['ok'] else 'no':>8} {int(r['versions']):>14} "
            f"{int(r['gets']):>7} {r['seconds']:>8.2f} {r['blob_mb']:>16.2f}"
        )


if __name__ == "__main__":
    trio.run(main)
