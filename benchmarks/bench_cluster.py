"""rsagg as a cluster of nodes, and with its state in PostgreSQL: two parts, each printing its table.

Part "nodes" (``main_cluster``): harvest throughput with 1, 2 and 3 ``rsagg run`` nodes (cluster.py) over
latency-bound Sources, and the time a dead node's sources take to be taken over. 20 upstream Sources,
each its own host (127.0.0.2, 127.0.0.3, ...: politeness is per host), every request answered after
``--latency`` (50 ms). A node's ``harvest.max_connections`` (``--connections``, 2) stands for what one
machine's network gives it: more nodes, more connections. The nodes start first (the upstreams refuse
connections until then), so that the leases are spread before the clock starts; the clock runs from the
upstreams' start to the moment the shared state holds every upstream resource. Takeover: with every
source harvested, one of three nodes is killed with SIGKILL; the time until every source it held is
granted to another node, against ``cluster.lease_seconds``. Targets: 3 nodes >= 2.5x one node; takeover
<= 2x the lease time.

Part "pg" (``main_pg``): single-node PostgreSQL vs SQLite. The same baseline harvest, ``rsagg harvest
--once`` of ``--resources`` small files from a latency-free local upstream (bench_harvest.py's static
server and resync-build documents), once with the state in SQLite (``[store] path``) and once in a
PostgreSQL 15 server (``[store] state = "postgresql://..."``) started for the run by tests/pgserver.py
with fsync and full-page writes ON (as in production). Both use ``[store] synchronous = "NORMAL"``
(SQLite: WAL, no fsync per commit; PostgreSQL: ``synchronous_commit = off``). Runs alternate (SQLite,
PostgreSQL, ...) ``--repeat`` times on one upstream; each run's state is checked to hold every resource.
Target: PostgreSQL >= 0.7x SQLite's resources/s. After each run, the Resource List of the harvested
set is rendered from that state as the publisher does (``documents.resource_list_part`` with
``lines=True``, bytes out): entries/s per backend; for PostgreSQL also from whole rows (``iter_live``
in place of ``iter_live_listing``: the path before it gave ``ListingRow`` tuples).

    python benchmarks/bench_cluster.py                 # both parts (~4 min)
    python benchmarks/bench_cluster.py --part nodes [--sources 20] [--per-source 60] [--latency 0.05]
    python benchmarks/bench_cluster.py --part pg [--resources 20000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

import _harness  # noqa: E402 - rsagg harvest --once, configured and run
import bench_harvest  # noqa: E402 - the upstream site and its server
import psutil  # noqa: E402
import trio  # noqa: E402

from aggregator.publish import documents  # noqa: E402
from aggregator.publish.links import LinkPolicy  # noqa: E402
from aggregator.rs.w3cdt import utcnow  # noqa: E402
from aggregator.rs.write import iter_document_bytes  # noqa: E402
from aggregator.store.open import connect  # noqa: E402
from aggregator.store.sets import PublishedSet  # noqa: E402
from aggregator.testing.upstream import Upstream  # noqa: E402
from tests import pgserver  # noqa: E402
from tests.clustering import NodeProcess, SharedState, free_port, sources_toml, wait_for  # noqa: E402

TARGET_PG_VS_SQLITE = 0.7


@dataclass
class Run:
    backend: str
    resources: int
    wall: float
    held: int
    code: int
    cpu: float = 0.0  # CPU seconds of the rsagg process
    db_cpu: float = 0.0  # CPU seconds of the PostgreSQL server during the run
    listing: float = 0.0  # Resource List entries/s rendered from this state
    listing_whole: float = 0.0  # the same from whole rows (PostgreSQL only)

    @property
    def rate(self) -> float:
        return self.resources / self.wall

    @property
    def ok(self) -> bool:
        return self.code == 0 and self.held == self.resources


def harvest(folder: Path, base: str, n: int, state: str) -> Run:
    """``rsagg harvest --once`` into a fresh store folder with the state at ``state`` ("" = SQLite)."""
    server_before = server_cpu()
    done = _harness.harvest_once(folder, base, state=state)
    with connect(state or folder / "data" / "state.db") as st:
        held = st.count_resources()
    run = Run("postgresql" if state else "sqlite", n, done.wall, held, done.code)
    run.cpu = done.cpu
    run.listing = listing_rate(state or folder / "data" / "state.db")
    if state:
        run.listing_whole = listing_rate(state, whole=True)
    if state:
        time.sleep(1.0)  # the postmaster reaps the ended backends (a zombie's CPU time is not readable)
        run.db_cpu = server_cpu() - server_before
    return run


def listing_rate(location: str | Path, *, whole: bool = False, rounds: int = 3) -> float:
    """Resource List entries/s rendered from the state at ``location`` (the best of ``rounds``);
    ``whole``: from ``iter_live``'s whole rows instead of ``iter_live_listing``'s tuples."""
    with connect(location, readonly=True) as st:
        if whole:
            st.iter_live_listing = st.iter_live  # type: ignore[method-assign]
        [row] = st.sets("bench")
        ps = PublishedSet("bench", (row.id,))
        site = documents.Site("http://rsagg.example/pub", {"bench": ps}, LinkPolicy(), 10)
        best = float("inf")
        for _ in range(rounds):
            start = time.perf_counter()
            head, entries = documents.resource_list_part(site, st, ps, 0, None, utcnow(), lines=True)
            size = sum(len(b) for b in iter_document_bytes(head, entries, flush_head=True))
            best = min(best, time.perf_counter() - start)
        count = st.count_resources()
    assert size > count * 100, "the list is not whole"
    return count / best


def server_cpu() -> float:
    """CPU seconds used so far by the PostgreSQL server processes on the machine (ours is the only one)."""
    total = 0.0
    for p in psutil.process_iter(["name", "cpu_times"]):
        t = p.info["cpu_times"]
        if p.info["name"] in ("postgres", "postmaster") and t is not None:
            total += t.user + t.system + t.children_user + t.children_system  # + the ended backends
    return total


def main_pg(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--resources", type=int, default=5_000, help="resources harvested per run (5,000)")
    p.add_argument("--repeat", type=int, default=2, help="runs per backend, alternating (2)")
    p.add_argument(
        "--workdir", help="where the site and runs go (default: a temporary folder, removed after)"
    )
    args = p.parse_args(argv)
    if not pgserver.available():
        raise SystemExit(f"PostgreSQL 15 is not installed ({pgserver.BIN}): apt-get install -y postgresql-15")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="rsagg-bench-cluster-"))
    work.mkdir(parents=True, exist_ok=True)
    n = args.resources
    runs: list[Run] = []
    server = bench_harvest.Server(work / "site", work / "server.log")
    try:
        print(f"work folder {work}; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}", flush=True)
        base = bench_harvest.make_site(work / "site", n, server)
        with pgserver.running(durable=True) as pg:
            print(f"  PostgreSQL 15 at 127.0.0.1:{pg.port} (fsync on)", flush=True)
            for i in range(args.repeat):
                for backend in ("sqlite", "postgresql"):
                    state = pg.fresh_database() if backend == "postgresql" else ""
                    print(f"  run {i + 1} {backend}: rsagg harvest --once ...", end=" ", flush=True)
                    run = harvest(work / "runs" / f"{backend}-{i}", base, n, state)
                    runs.append(run)
                    failed = f"  FAILED (exit {run.code}, {run.held:,} held)"
                    print(f"{run.wall:.1f} s" + ("" if run.ok else failed), flush=True)
    finally:
        server.stop()
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}\n")
    print("single-node PostgreSQL vs SQLite (baseline harvest, latency-free local upstream)")
    head = (f"{'state':<12} {'runs':>5} {'resources':>10} {'median s':>9} {'resources/s':>12} {'ratio':>7}"
            f" {'rsagg CPU s':>12} {'server CPU s':>13}")  # fmt: skip
    print(head + "\n" + "-" * len(head))
    rate = {}
    for backend in ("sqlite", "postgresql"):
        mine = [r for r in runs if r.backend == backend and r.ok]
        if not mine:
            print(f"{backend:<12} no complete run")
            continue
        wall = statistics.median(r.wall for r in mine)
        cpu, db_cpu = statistics.median(r.cpu for r in mine), statistics.median(r.db_cpu for r in mine)
        rate[backend] = n / wall
        ratio = rate[backend] / rate["sqlite"] if "sqlite" in rate else float("nan")
        print(f"{backend:<12} {len(mine):>5} {n:>10,} {wall:>9.1f} {rate[backend]:>12,.0f} {ratio:>6.2f}x"
              f" {cpu:>12.1f} {db_cpu:>13.1f}")  # fmt: skip
    print("(medians; CPU s: of the rsagg process, and of the PostgreSQL server during the run)")
    print("\nResource List rendering (documents.resource_list_part, lines=True, bytes out), entries/s")
    head = f"{'state':<26} {'entries':>8} {'entries/s':>11} {'vs SQLite':>10}"
    print(head + "\n" + "-" * len(head))
    sqlite_list = statistics.median([r.listing for r in runs if r.backend == "sqlite" and r.ok] or [0])
    pg_ok = [r for r in runs if r.backend == "postgresql" and r.ok]
    for label, value in (
        ("sqlite", sqlite_list),
        ("postgresql (ListingRow)", statistics.median([r.listing for r in pg_ok] or [0])),
        ("postgresql (whole rows)", statistics.median([r.listing_whole for r in pg_ok] or [0])),
    ):
        vs = f"{value / sqlite_list:.2f}x" if sqlite_list else "-"
        print(f"{label:<26} {n:>8,} {value:>11,.0f} {vs:>10}")
    ok = all(r.ok for r in runs)
    if len(rate) == 2:
        ratio = rate["postgresql"] / rate["sqlite"]
        verdict = "OK" if ratio >= TARGET_PG_VS_SQLITE else "MISSED"
        print(f"\nPostgreSQL {ratio:.2f}x SQLite (target >= {TARGET_PG_VS_SQLITE}x) {verdict}")
    if not ok:
        print(
            "INCOMPLETE RUNS: "
            + "; ".join(f"{r.backend}: exit {r.code}, {r.held:,} held" for r in runs if not r.ok)
        )
    return 0 if ok else 1


# ---------------------------------------------------------------- part nodes: 1, 2, 3 nodes; takeover

LEASE = 3.0


def _held(db: SharedState) -> dict[str, str]:
    with db.open() as st:
        now = utcnow()
        return {
            le.source: le.node
            for le in st.leases()
            if le.node and le.expires_at and le.expires_at > now and not le.source.startswith("@")
        }


def _count(db: SharedState) -> int:
    with db.open() as st:
        return st.count_resources()


def _upstreams(n: int, per_source: int, latency: float) -> list[Upstream]:
    ups = []
    for i in range(n):
        up = Upstream(changes_per_list=None, resource_dump=False, change_dump=False, latency=latency)
        up.bulk_create(per_source, prefix=f"u{i}-")
        ups.append(up)
    return ups


def _harvest_toml(connections: int) -> str:
    return (
        "[harvest]\njitter = 0\nretries = 2\nbackoff_base = 0.01\nbackoff_max = 0.05\ntimeout = 30\n"
        f"workers = 16\nper_host = 8\nmax_connections = {connections}\nbatch_size = 16\nuse_dumps = false\n"
        "[publish]\ndump_interval = 0\n"
    )


async def bench_nodes(n_nodes: int, args: argparse.Namespace, folder: Path, url: str | None) -> float:
    """Resources per second harvested by ``n_nodes`` nodes from ``args.sources`` latency-bound Sources."""
    ups = _upstreams(args.sources, args.per_source, args.latency)
    hosts = [f"127.0.0.{i + 2}" for i in range(args.sources)]
    ports = [free_port(h) for h in hosts]
    sources = {
        f"s{i:02d}": f"http://{h}:{p}/.well-known/resourcesync"
        for i, (h, p) in enumerate(zip(hosts, ports, strict=True))
    }
    store = folder / "store"
    db = SharedState(store, url)
    nodes = [NodeProcess(folder, f"node{i}", store) for i in range(1, n_nodes + 1)]
    body = _harvest_toml(args.connections) + sources_toml(sources, interval=0.5)
    for n in nodes:
        n.configure(body, base_url=nodes[0].url, lease_seconds=LEASE, store_extra=db.store_extra)
    try:
        for n in nodes:
            await n.start()
        for n in nodes:
            await n.wait_serving()
        await wait_for(
            lambda: (
                db.exists() and len(_held(db)) == args.sources and len(set(_held(db).values())) == n_nodes
            ),
            "the leases spread over the nodes",
        )
        total = args.sources * args.per_source
        async with AsyncExitStack() as stack:
            start = time.monotonic()
            for up, host, port in zip(ups, hosts, ports, strict=True):
                await stack.enter_async_context(up.serving(host, port))
            await wait_for(lambda: _count(db) >= total, "every resource harvested", timeout=600)
            return total / (time.monotonic() - start)
    finally:
        for n in nodes:
            await n.kill()


async def bench_takeover(args: argparse.Namespace, folder: Path, url: str | None) -> tuple[float, int]:
    """Seconds from a SIGKILL of one of three nodes until all its sources are held by the others."""
    ups = _upstreams(args.sources, 5, 0.0)
    store = folder / "store"
    db = SharedState(store, url)
    async with AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(up.serving()) for up in ups]
        sources = {f"s{i:02d}": f"{u}/.well-known/resourcesync" for i, u in enumerate(urls)}
        nodes = [NodeProcess(folder, f"node{i}", store) for i in (1, 2, 3)]
        for n in nodes:
            n.configure(_harvest_toml(16) + sources_toml(sources, interval=0.5), base_url=nodes[0].url,
                        lease_seconds=LEASE, store_extra=db.store_extra)  # fmt: skip
        try:
            for n in nodes:
                await n.start()
            await wait_for(lambda: db.exists() and len(set(_held(db).values())) == 3, "leases on three nodes")
            await wait_for(lambda: _count(db) >= len(ups) * 5, "every resource harvested")
            victims = [s for s, n in _held(db).items() if n == "node1"]
            start = time.monotonic()
            await nodes[0].kill()
            await wait_for(
                lambda: all(_held(db).get(s) in ("node2", "node3") for s in victims), "takeover", timeout=120
            )
            return time.monotonic() - start, len(victims)
        finally:
            for n in nodes:
                await n.kill()


async def main_cluster(args: argparse.Namespace) -> None:
    state = args.state
    if state == "postgresql" and not pgserver.available():
        print(f"PostgreSQL 15 is not installed ({pgserver.BIN}): the nodes share a SQLite state instead")
        state = "sqlite"
    with contextlib.ExitStack() as stack:
        pg = stack.enter_context(pgserver.running(durable=True)) if state == "postgresql" else None
        await _main_cluster(args, pg)


async def _main_cluster(args: argparse.Namespace, pg: pgserver.PgServer | None) -> None:
    print(
        f"{args.sources} Sources x {args.per_source} resources, {args.latency * 1000:.0f} ms per request, "
        f"harvest.max_connections = {args.connections} per node, cluster.lease_seconds = {LEASE}, "
        f"state: {'PostgreSQL 15 (fsync on)' if pg else 'SQLite (WAL, one machine)'}, blobs: filesystem"
    )
    rates = {}
    for n in (1, 2, 3):
        with tempfile.TemporaryDirectory(prefix="rsagg-bench-cluster-") as d:
            rates[n] = await bench_nodes(n, args, Path(d), pg.fresh_database() if pg else None)
        print(
            f"  {n} node(s): {rates[n]:7.1f} resources/s  ({rates[n] / rates[1]:.2f}x one node)", flush=True
        )
    with tempfile.TemporaryDirectory(prefix="rsagg-bench-cluster-") as d:
        seconds, moved = await bench_takeover(args, Path(d), pg.fresh_database() if pg else None)
    print(
        f"  takeover of {moved} sources after a SIGKILL: {seconds:.2f} s ({seconds / LEASE:.2f}x the lease)"
    )
    print()
    print("| nodes | resources/s | vs one node |")
    print("|---|---|---|")
    for n, r in rates.items():
        print(f"| {n} | {r:.1f} | {r / rates[1]:.2f}x (target for 3: >= 2.5x) |")
    print(f"| takeover | {seconds:.2f} s | {seconds / LEASE:.2f}x lease (target <= 2x) |")


def parse_nodes_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sources", type=int, default=20)
    p.add_argument("--per-source", type=int, default=60)
    p.add_argument("--latency", type=float, default=0.05)
    p.add_argument("--connections", type=int, default=2, help="harvest.max_connections of each node")
    p.add_argument("--state", choices=("postgresql", "sqlite"), default="postgresql",
                   help="the state the nodes share (postgresql: a server started for the run)")  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--part", choices=("all", "nodes", "pg"), default="all")
    known, rest = p.parse_known_args(argv)
    if known.part == "all" and {"-h", "--help"} & set(rest):  # the parts' own parsers never see it here
        print(__doc__)
        return 0
    code = 0
    if known.part in ("all", "nodes"):
        nodes_args = [
            a
            for a in rest
            if a.split("=")[0] in ("--sources", "--per-source", "--latency", "--connections", "--state")
        ]
        trio.run(main_cluster, parse_nodes_args(nodes_args if known.part == "all" else rest))
    if known.part in ("all", "pg"):
        pg_args = [a for a in rest if a.split("=")[0] in ("--resources", "--repeat", "--workdir")]
        code = main_pg(pg_args if known.part == "all" else rest)
    return code


if __name__ == "__main__":
    sys.exit(main())
