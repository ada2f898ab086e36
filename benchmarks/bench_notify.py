"""Latency of a change along a chain upstream -> A -> B -> C, with notifications and with polling.

Three rsagg daemons run in this process (the real ``run_daemon``: server, harvester, hub, notifier,
subscriber), each harvesting the previous one; the upstream is the demo ``Upstream`` notifying through
rsagg's ``Hub`` embedded in it. ``--changes`` resources are created at the upstream, one every
``--gap`` seconds. When C holds them all, the Change Lists of A, B and C are read over HTTP and every
entry is matched to its upstream change by its ``via`` link (kept unchanged along the chain, §14.8).

Latency of a hop = the datetime of the entry in this node's Change List (rsagg's clock when the change
was applied: the moment it appears there) minus the datetime of the same change one step before (the
upstream's change datetime for A). All clocks are this machine's. Modes:

- ``notifications``: notifications on, ``interval = notified_interval = 3600`` (changes can only travel
  by notification; a warm-up change first takes each channel past its first notice, which is taken by
  polling because it continues nothing);
- ``polling``: notifications off, ``interval = 1`` s.

Both with the default ``jitter = 0.1`` (without it equal poll periods lock in phase and every change
of a hop waits the same time, which says more about the phase than about polling).

    python benchmarks/bench_notify.py                 # both modes, 200 changes
    python benchmarks/bench_notify.py --changes 50 --modes notifications
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aggregator.harvest.context import HarvestContext  # noqa: E402
from aggregator.rs.parse import parse_bytes  # noqa: E402
from aggregator.rs.w3cdt import utcnow  # noqa: E402
from aggregator.store.state import State  # noqa: E402
from aggregator.testing.notify import UpstreamNotifier  # noqa: E402
from aggregator.testing.upstream import Upstream  # noqa: E402
from tests.notifying import node_config, rsagg_node, wait_until  # noqa: E402

TARGET_P99_MS = 300.0
HOPS = ("A", "B", "C")


def settings(mode: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(source settings, [notifications] settings) of every node."""
    if mode == "notifications":
        return {"interval": 3600, "notified_interval": 3600}, {}
    return {"interval": 1}, {"enabled": False}


def live_count(ctx: HarvestContext) -> int:
    with State(ctx.config.store_path / "state.db", readonly=True) as st:
        return st.count_live([s.id for s in st.sets()])


def idle(ctx: HarvestContext) -> bool:
    notes = ctx.notifications
    if notes is None or notes.subscriber is None:
        return True
    now = utcnow()
    subs = notes.subscriber.subscriptions()
    return bool(subs) and all(s.live(now) for s in subs) and notes.subscriber.idle("up")


async def change_datetimes(client: httpx.AsyncClient, base: str) -> dict[str, datetime]:
    """via href (the upstream URI) -> datetime of its created entry in a node's Change List."""
    r = await client.get(f"{base}/up/changelist.xml")
    head, entries = parse_bytes(r.content)
    if head.is_index:
        parts = entries
        entries = []
        for part in parts:
            entries += parse_bytes((await client.get(part.loc)).content)[1]
    out: dict[str, datetime] = {}
    for e in entries:
        via = next((ln.href for ln in e.links if ln.rel == "via"), None)
        if via is not None and e.change == "created" and e.md is not None and e.md.datetime is not None:
            out.setdefault(via, e.md.datetime)
    return out


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[k]


async def run_mode(mode: str, n: int, gap: float, folder: Path) -> dict[str, list[float]]:
    source, notifications = settings(mode)
    up = Upstream(changes_per_list=None, resource_dump=False, change_dump=False)
    up.bulk_create(5)
    notifier = UpstreamNotifier(up)
    nodes: list[tuple[str, HarvestContext]] = []
    async with up.serving() as base, trio.open_nursery() as nursery, httpx.AsyncClient(timeout=30) as client:
        await nursery.start(notifier.run)

        async def chain(upstream: str, names: tuple[str, ...]) -> dict[str, list[float]]:
            if names:
                cfg = node_config(
                    folder / mode / names[0],
                    upstream,
                    source=source,
                    notifications=notifications,
                    harvest={"jitter": 0.1},
                )
                async with rsagg_node(cfg) as (url, ctx):
                    await wait_until(lambda: live_count(ctx) == 5, f"{names[0]}'s baseline", limit=60)
                    nodes.append((url, ctx))
                    return await chain(f"{url}/.well-known/resourcesync", names[1:])
            return await measure()

        async def measure() -> dict[str, list[float]]:
            ctxs = [ctx for _, ctx in nodes]
            if mode == "notifications":
                for ctx in ctxs:
                    await wait_until(lambda ctx=ctx: idle(ctx), "channels live", limit=60)
                up.create("warm-up.txt", b"warm up")
                await wait_until(lambda: live_count(ctxs[-1]) == 6, "warm-up at C", limit=60)
                for ctx in ctxs:
                    await wait_until(lambda ctx=ctx: idle(ctx), "quiet", limit=60)
            expected = live_count(ctxs[-1]) + n
            records = []
            for i in range(n):
                records.append(up.create(f"bench-{i:04d}.txt", f"change {i}\n".encode()))
                await trio.sleep(gap)
            await wait_until(lambda: live_count(ctxs[-1]) == expected, "every change at C", limit=120)
            upstream_dt = {up.url(r.path): r.datetime for r in records}
            seen = [await change_datetimes(client, url) for url, _ in nodes]
            out: dict[str, list[float]] = {hop: [] for hop in HOPS}
            for uri, t_up in upstream_dt.items():
                before = t_up
                for hop, dts in zip(HOPS, seen, strict=True):
                    t = dts[uri]
                    out[hop].append((t - before).total_seconds() * 1000)
                    before = t
            out["total"] = [sum(v) for v in zip(*(out[h] for h in HOPS), strict=True)]
            return out

        result = await chain(f"{base}/.well-known/resourcesync", HOPS)
        nursery.cancel_scope.cancel()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--changes", type=int, default=200)
    p.add_argument("--gap", type=float, default=0.05, help="seconds between upstream changes")
    p.add_argument(
        "--modes", nargs="+", default=["notifications", "polling"], choices=["notifications", "polling"]
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    rows = []
    with tempfile.TemporaryDirectory(prefix="rsagg-bench-notify-") as tmp:
        for mode in args.modes:
            started = time.perf_counter()
            result = trio.run(run_mode, mode, args.changes, args.gap, Path(tmp))
            for hop in (*HOPS, "total"):
                v = result[hop]
                rows.append((mode, hop, len(v), statistics.median(v), percentile(v, 99), max(v)))
            print(f"# {mode}: {time.perf_counter() - started:.1f} s", file=sys.stderr)
    print(f"{args.changes} upstream changes, one every {args.gap * 1000:.0f} ms; latency per hop in ms")
    print(f"{'mode':<14} {'hop':<6} {'n':>4} {'p50':>9} {'p99':>9} {'max':>9}")
    ok = True
    for mode, hop, count, p50, p99, mx in rows:
        flag = ""
        if mode == "notifications" and hop in HOPS:
            flag = "  ok" if p99 < TARGET_P99_MS else f"  over target {TARGET_P99_MS:.0f}"
            ok &= p99 < TARGET_P99_MS
        print(f"{mode:<14} {hop:<6} {count:>4} {p50:>9.1f} {p99:>9.1f} {mx:>9.1f}{flag}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
