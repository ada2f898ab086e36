"""OAI-PMH harvest speed: rsagg (harvest + store + republish) next to sickle 0.7, records/s.

The repository is PyPI ``oaipmh``'s data provider (tests/oaiserver.py) in a process of its own, with
``--records`` oai_dc records in pages of ``--page`` and a fixed latency per request (0 and 50 ms). Its
answers are cached by query (a warm-up walk fills the cache; tokens are deterministic), so both harvesters
meet a server that answers as fast as the network allows and the figures measure the harvesters. Each
harvester also makes one untimed walk before the timed pairs.

- sickle: ``Sickle(url).ListRecords(metadataPrefix="oai_dc", ignore_deleted=False)`` iterated to the end
  (each record parsed to a Record, as its users get them), in this process.
- rsagg: ``harvest_once`` into a fresh store, in this process: each page parsed, its records canonicalised,
  hashed and stored as blobs in rsagg's worker processes (``harvest.processes``, kept between runs as a
  daemon keeps them), then each record's row, changelog record and the cursor committed
  (``harvest/oaipmh.py``); then the republished Resource List is streamed once from the store
  (``republish`` column), and the store checked to hold every record.

    python benchmarks/bench_oaipmh.py                      # 20,000 records, pages of 100, 0 and 50 ms
    python benchmarks/bench_oaipmh.py --records 5000       # quicker
    python benchmarks/bench_oaipmh.py --repeat 1           # one sickle/rsagg pair per latency (default 3)
    python benchmarks/bench_oaipmh.py --inline-bytes 0     # every record a file of its own (no small.db)
    python benchmarks/bench_oaipmh.py --processes 0        # page work in rsagg's threads, no worker process
    python benchmarks/bench_oaipmh.py --no-settle          # rsagg with Python's default garbage collector

Garbage collector: each harvester with its own process's settings. rsagg's commands (``rsagg harvest``,
``rsagg run``) set theirs once started (``run/heap.py``: start-up's objects frozen, a larger first-generation
threshold), so rsagg's runs call ``harvest_once`` with ``settle=True`` as ``rsagg harvest`` does; sickle's
runs get Python's default thresholds back (the objects frozen by then are this benchmark's and rsagg's
imports, which sickle's own process would not hold). ``--no-settle``: rsagg with Python's defaults too, as
this benchmark ran it until it ran rsagg the way its commands do.

CPU: seconds of CPU per run, user + system: sickle's is this process's; rsagg's is this process's (the event
loop and the state writer's thread) plus its worker processes' (the page work), given as "main + workers".
The load average is read after each pair; a row gives the range over its pairs.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _headline import headline

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
TARGET = 1.0  # rsagg records/s / sickle records/s, rsagg storing every record
DEFAULT_GC = gc.get_threshold()  # Python's, before anything changed them


def serve(port_file: str, records: int, page: int, latency: float) -> None:
    """The child: the OAI-PMH server, its answers cached by query string."""
    from functools import partial

    import trio

    from aggregator.run.serverguard import ServerLimits
    from aggregator.run.serving import serve as serve_asgi
    from tests.oaiserver import OaiApp, Repository

    repo = Repository()
    repo.bulk_add(0, records)
    app = OaiApp(repo, page_size=page)
    cache: dict[bytes, list] = {}

    async def cached(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        key = scope["query_string"]
        if latency:
            await trio.sleep(latency)
        if key not in cache:
            messages: list = []

            async def keep(msg):
                messages.append(msg)

            await app(scope, receive, keep)
            cache[key] = messages
        for msg in cache[key]:
            await send(msg)

    async def main():
        async with trio.open_nursery() as nursery:
            # sickle opens a connection per request: no cap on one client's open connections (429)
            no_cap = ServerLimits(max_connections_per_client=0)
            base = await nursery.start(partial(serve_asgi, cached, limits=no_cap))
            repo.base_url = f"{base}/oai"
            Path(port_file).write_text(base)

    trio.run(main)


def start_server(records: int, page: int, latency: float) -> tuple[subprocess.Popen, str]:
    port_file = tempfile.mktemp(prefix="oai-bench-")
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", port_file, str(records), str(page), str(latency)],
        stdin=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while not (os.path.exists(port_file) and Path(port_file).read_text()):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("the OAI-PMH server did not start")
        time.sleep(0.05)
    base = Path(port_file).read_text()
    os.unlink(port_file)
    return proc, f"{base}/oai"


def warm_up(url: str) -> int:
    import httpx

    from aggregator.harvest.oaipage import parse_page
    from aggregator.harvest.oaipmh import request_url

    pages = 0
    with httpx.Client(timeout=60) as client:
        client.get(request_url(url, verb="Identify"))
        next_url = request_url(url, verb="ListRecords", metadataPrefix="oai_dc")
        while next_url:
            page = parse_page(client.get(next_url).content, next_url)
            pages += 1
            next_url = request_url(url, verb="ListRecords", resumptionToken=page.token) if page.token else ""
    return pages


def cpu_seconds(server: subprocess.Popen) -> tuple[float, float]:
    """CPU seconds used so far (user + system) by this process and by its other children (rsagg's
    worker processes; the OAI-PMH server's process is not counted)."""
    import psutil

    own = resource.getrusage(resource.RUSAGE_SELF)
    children = 0.0
    for child in psutil.Process().children(recursive=True):
        if child.pid == server.pid:
            continue
        try:
            times = child.cpu_times()
        except psutil.NoSuchProcess:  # gone meanwhile (a worker idle for 10 minutes)
            continue
        children += times.user + times.system
    return own.ru_utime + own.ru_stime, children


def run_sickle(url: str) -> tuple[float, int]:
    from sickle import Sickle

    gc.set_threshold(*DEFAULT_GC)  # a plain Python process's collector (rsagg's runs set their own)
    start = time.perf_counter()
    n = sum(1 for _ in Sickle(url, timeout=60).ListRecords(metadataPrefix="oai_dc", ignore_deleted=False))
    return time.perf_counter() - start, n


def run_rsagg(
    url: str, folder: Path, inline_bytes: int | None = None, processes: int | None = None,
    server: subprocess.Popen | None = None, settle: bool = True,
) -> tuple[float, int, float, tuple[float, float]]:  # fmt: skip
    from functools import partial

    import httpx
    import trio

    from aggregator.commands.harvest import harvest_once
    from aggregator.config import parse_config
    from aggregator.observe.metrics import Metrics
    from aggregator.plugins.manager import DEFAULT_PLUGINS, Plugins
    from aggregator.run.parts import blob_store, load_plugins, publisher_app
    from aggregator.store.state import State

    settings: dict = {"store": {"path": str(folder / "data")},
                      "sources": [{"name": "oai", "url": url, "kind": "oai-pmh"}]}  # fmt: skip
    if inline_bytes is not None:
        settings["store"]["settings"] = {"inline_bytes": inline_bytes}
    if processes is not None:
        settings["harvest"] = {"processes": processes}
    # rsagg with its built-in plugins only: an installed filter plugin (the test suite's, or
    # rsagg-resourcefilter) is asked about every record even where it has no rules for the source
    installed = set(Plugins(entry_point_plugins=True).names()) - set(DEFAULT_PLUGINS)
    settings["plugins"] = {name: {"enabled": False} for name in sorted(installed)}
    cfg = parse_config(settings, str(folder / "bench.toml"))
    cpu_before = cpu_seconds(server) if server is not None else (0.0, 0.0)
    start = time.perf_counter()
    if not settle:
        gc.set_threshold(*DEFAULT_GC)
    (result,) = trio.run(partial(harvest_once, cfg, [], settle=settle))  # settle: as ``rsagg harvest``
    took = time.perf_counter() - start
    cpu_after = cpu_seconds(server) if server is not None else (0.0, 0.0)
    cpu = (cpu_after[0] - cpu_before[0], cpu_after[1] - cpu_before[1])
    if not result.ok:
        raise SystemExit(f"rsagg failed: {result.error}")
    with State(cfg.store_path / "state.db") as st:
        held = st.count_live([s.id for s in st.sets("oai")])
    plugins = load_plugins(cfg)
    blobs = blob_store(cfg, plugins)
    metrics = Metrics(plugins=lambda: [plugins], store=blobs)
    app = publisher_app(
        cfg, blobs=blobs, plugins=plugins, metrics=metrics, state_path=cfg.store_path / "state.db"
    )

    async def republish() -> float:
        t = time.perf_counter()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url=cfg.server.base_url) as client:
            r = await client.get("/oai/resourcelist.xml")
            assert r.status_code == 200 and r.text.count("<url>") == held, r.status_code
        return time.perf_counter() - t

    try:
        served = trio.run(republish)
    finally:
        app.state.publisher.pool.close()
        blobs.close()
    return took, held, served, cpu


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=20_000)
    ap.add_argument("--page", type=int, default=100)
    ap.add_argument("--latencies", default="0,50", help="ms per request, comma-separated")
    ap.add_argument("--workdir", help="where rsagg's store goes (default: a temporary folder), e.g. a tmpfs "
                    "to take the disk out of the figures")  # fmt: skip
    ap.add_argument("--inline-bytes", type=int, help="[store.settings] inline_bytes of rsagg's store "
                    "(default: the store's own; 0: a file per record, as before small.db)")  # fmt: skip
    ap.add_argument("--processes", type=int, help="harvest.processes of rsagg (default: the config's "
                    "default; 0: page work in the daemon's threads)")  # fmt: skip
    ap.add_argument("--no-settle", dest="settle", action="store_false", help="rsagg with Python's default "
                    "garbage collector (default: as its commands set it, run/heap.py)")  # fmt: skip
    ap.add_argument("--repeat", type=int, default=3, help="sickle/rsagg pairs per latency, run in turn; "
                    "the table gives the medians (on a shared machine one run says little)")  # fmt: skip
    args = ap.parse_args()
    rows = []
    for ms in [float(x) for x in args.latencies.split(",")]:
        proc, url = start_server(args.records, args.page, ms / 1000)
        pairs = []
        try:
            pages = warm_up(url)
            # One untimed run of each first: sickle's first walk in a process ran at half its speed
            # (requests' first connections and imports), which made the first pair's ratio look better.
            run_sickle(url)
            with tempfile.TemporaryDirectory(prefix="rsagg-bench-oaipmh-", dir=args.workdir) as d:
                run_rsagg(url, Path(d), args.inline_bytes, args.processes, settle=args.settle)
            for _ in range(args.repeat):
                before = cpu_seconds(proc)[0]
                s_took, s_n = run_sickle(url)
                s_cpu = cpu_seconds(proc)[0] - before
                with tempfile.TemporaryDirectory(prefix="rsagg-bench-oaipmh-", dir=args.workdir) as d:
                    r_took, r_n, served, r_cpu = run_rsagg(
                        url, Path(d), args.inline_bytes, args.processes, server=proc, settle=args.settle
                    )
                assert s_n == args.records and r_n == args.records, (s_n, r_n)
                pairs.append((s_n / s_took, r_n / r_took, served, s_cpu, *r_cpu, os.getloadavg()[0]))
        finally:
            proc.kill()
            proc.wait()
        s, r, served, s_cpu, r_main, r_workers, _ = (statistics.median(x) for x in zip(*pairs, strict=True))
        ratios = sorted(rr / ss for ss, rr, *_ in pairs)
        load = [p[-1] for p in pairs]
        rows.append(
            (ms, pages, s, r, statistics.median(ratios), ratios, served, s_cpu, r_main, r_workers, load)
        )
    print(
        f"\nOAI-PMH harvest, {args.records:,} oai_dc records in pages of {args.page} (PyPI oaipmh server), "
        f"medians of {args.repeat} runs each; rsagg's store: inline_bytes "
        f"{'default' if args.inline_bytes is None else args.inline_bytes}, harvest.processes "
        f"{'default' if args.processes is None else args.processes}; rsagg's garbage collector: "
        f"{'as its commands set it (run/heap.py)' if args.settle else 'Python defaults (--no-settle)'}.\n"
        "sickle: fetches and parses each record (requests + lxml), stores nothing. rsagg: fetches, parses, "
        "canonicalises, hashes (sha-256, md5) and stores each record as a durable blob, then commits its "
        "row, changelog record and the walk's cursor (one transaction per page or batch); checked after "
        "each run to hold every record.\n"
    )
    print(
        "| latency | pages | sickle records/s | sickle CPU s | rsagg records/s "
        "| rsagg CPU s (main + workers) | ratio (each run) | target | load average "
        "| republish: Resource List streamed |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for ms, pages, s, r, ratio, ratios, served, s_cpu, r_main, r_workers, load in rows:
        ok = "ok" if ratio >= TARGET else "MISSED"
        each = ", ".join(f"{x:.2f}" for x in ratios)
        print(
            f"| {ms:.0f} ms | {pages} | {s:,.0f} | {s_cpu:.2f} | {r:,.0f} | {r_main:.2f} + {r_workers:.2f} "
            f"| {ratio:.2f}x ({each}) | >= {TARGET}x {ok} | {min(load):.1f}-{max(load):.1f} "
            f"| {served:.2f} s |"
        )
        cpu = f"CPU {r_main + r_workers:.2f} vs {s_cpu:.2f} s"
        headline(f"OAI-PMH records/s, rsagg / sickle, {ms:.0f} ms per request",
                 f"{ratio:.2f}× ({r:,.0f} vs {s:,.0f} records/s; {cpu})", f"≥ {TARGET}×")  # fmt: skip


if __name__ == "__main__":
    main()
