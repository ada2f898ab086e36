"""Prior versions (publish/versions.py): TimeGate negotiations and TimeMaps, next to plain resource GETs.

Fills a fresh store (temporary folder) with ``--resources`` resources (default 1,000) of 5 versions each
and one resource of ``--versions`` versions (default 10,000), starts the rsagg publisher in its own
process (``server.offload = "none"``, rsagg's own plugins only) and, from this process, in the same run:

* plain resource GETs of the current versions (the baseline: the hot route);
* memento GETs (a random version of a random resource);
* both again, the same requests (what the hot route keeps in memory answers them);
* TimeGate negotiations (``Accept-Datetime`` at a random instant of the history; the 302 not followed);
* the TimeMap of the long history: time to first byte, total time to read every page (``rel="next"``),
  mementos listed (a second read shows the effect of warm caches).

Each load is a bounded number of requests from ``--concurrency`` httpx workers (default 8, one process);
requests/s and the ratio to plain GETs, and the server process's CPU time per request (``/proc``, in
clock ticks: use 1,000 requests or more; far less sensitive than requests/s to the rest of a shared
machine's load). Prints the table and the load average (this machine is shared: compare rows of one
run, not runs).

    python benchmarks/bench_memento.py                 # 1,000 x 5 versions + one of 10,000
    python benchmarks/bench_memento.py --requests 500  # quicker
    python benchmarks/bench_memento.py --retention 200 10 20000   # disk per [publish] versions policy
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
UP = "http://upstream.example/"
LONG = UP + "long.html"
T0 = datetime(2024, 1, 1, tzinfo=UTC)
STEP = timedelta(minutes=7)


def body(uri: str, version: int) -> bytes:
    return f"{uri} version {version}\n".encode() * 4


def fill(store: Path, resources: int, versions: int) -> list[datetime]:
    """The store; returns the datetimes of the long history's versions."""
    from aggregator.store.blobs import FileBlobStore
    from aggregator.store.rows import Change
    from aggregator.store.state import State

    store.mkdir(parents=True)
    blobs = FileBlobStore(store / "blobs")
    clock = [T0]
    times: list[datetime] = []
    with State(store / "state.db", clock=lambda: clock[0]) as st:
        st.upsert_source("bench", UP + ".well-known/resourcesync")
        sid = st.ensure_set("bench", UP + "capabilitylist.xml")
        for v in range(5):
            batch = []
            for i in range(resources):
                uri = f"{UP}r/{i}.html"
                data = body(uri, v)
                info = blobs.put_bytes(data)
                batch.append(
                    Change(uri, "created" if v == 0 else "updated", info.sha256, len(data), "text/html")
                )
            clock[0] += STEP
            st.apply(sid, batch)
        for v in range(versions):
            data = body(LONG, v)
            info = blobs.put_bytes(data)
            clock[0] += STEP
            times.append(clock[0])
            st.apply(
                sid, [Change(LONG, "created" if v == 0 else "updated", info.sha256, len(data), "text/html")]
            )
    blobs.close()
    return times


def retention_costs(work: Path, resources: int, versions: int, size: int) -> list[tuple[str, int, int]]:
    """What each ``[publish] versions`` policy leaves on disk after ``rsagg gc``: ``resources`` resources
    of ``versions`` versions each (``size`` bytes, incompressible), one version a day per resource, the
    last today. Returns (policy, blob bytes, blob files) per policy."""
    from aggregator.commands.gc import collect_garbage
    from aggregator.store.blobs import FileBlobStore
    from aggregator.store.retention import parse_retention
    from aggregator.store.rows import Change
    from aggregator.store.state import State

    now = datetime.now(UTC)
    seed = work / "seed"
    seed.mkdir(parents=True)
    blobs = FileBlobStore(seed / "blobs")
    rnd = random.Random(2)
    clock = [now - timedelta(days=versions - 1)]
    with State(seed / "state.db", clock=lambda: clock[0]) as st:
        st.upsert_source("bench", UP + ".well-known/resourcesync")
        sid = st.ensure_set("bench", UP + "capabilitylist.xml")
        for v in range(versions):
            clock[0] = now - timedelta(days=versions - 1 - v)
            batch = []
            for i in range(resources):
                data = rnd.randbytes(size)
                info = blobs.put_bytes(data)
                batch.append(Change(f"{UP}c/{i}", "created" if v == 0 else "updated", info.sha256, size))
            st.apply(sid, batch)
    blobs.close()
    out = []
    for policy in ["all", 1, 3, "3d", "7d"]:
        copy = work / f"p-{policy}"
        shutil.copytree(seed, copy)
        blobs = FileBlobStore(copy / "blobs")
        with State(copy / "state.db") as st:
            collect_garbage(st, blobs, grace=0, retention=parse_retention(policy).at_time(now))
        files = [f for f in (copy / "blobs").rglob("*") if f.is_file()]
        out.append((str(policy), sum(f.stat().st_size for f in files), len(files)))
        blobs.close()
    return out


def serve(store: Path, port: int) -> None:
    from importlib.metadata import entry_points

    import trio

    from aggregator.config import parse_config
    from aggregator.observe.metrics import Metrics
    from aggregator.plugins.manager import GROUP
    from aggregator.run.parts import load_plugins, publisher_app
    from aggregator.run.serving import serve as serve_app
    from aggregator.store.blobs import FileBlobStore

    third_party = sorted({ep.name for ep in entry_points(group=GROUP)})  # e.g. the tests' example plugin
    config = parse_config(
        {
            "server": {"listen": f"127.0.0.1:{port}", "base_url": f"http://127.0.0.1:{port}"},
            "store": {"path": str(store)},
            "sources": [{"name": "bench", "url": UP + ".well-known/resourcesync"}],
            "notifications": {"enabled": False},
            "plugins": {n: {"enabled": False} for n in third_party},
        }
    )
    blobs, plugins = FileBlobStore(store / "blobs"), load_plugins(config)
    metrics = Metrics(plugins=lambda: [plugins], store=blobs)
    app = publisher_app(config, blobs=blobs, plugins=plugins, metrics=metrics, state_path=store / "state.db")
    trio.run(serve_app, app, "127.0.0.1", port)


def load(requests: list[tuple[str, dict[str, str]]], concurrency: int, expect: int) -> tuple[float, int]:
    """(requests/s, answers that were not ``expect``)."""
    import httpx
    import trio

    bad = [0]

    async def main() -> None:
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(limits=limits, timeout=30) as client:
            it = iter(requests)

            async def worker() -> None:
                for url, headers in it:
                    r = await client.get(url, headers=headers)
                    if r.status_code != expect:
                        bad[0] += 1

            async with trio.open_nursery() as nursery:
                for _ in range(concurrency):
                    nursery.start_soon(worker)

    start = time.perf_counter()
    trio.run(main)
    return len(requests) / (time.perf_counter() - start), bad[0]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its threads so far (Linux ``/proc``): what a
    row cost the server, much less sensitive than requests/s to the other work of a shared machine."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timemap(url: str) -> tuple[float, float, int, int]:
    """(time to first byte of the first page, total over every page, mementos, pages)."""
    import httpx

    start = time.perf_counter()
    first = None
    mementos = pages = 0
    with httpx.Client(timeout=120) as client:
        next_url: str | None = url
        while next_url is not None:
            text = b""
            with client.stream("GET", next_url) as r:
                for chunk in r.iter_raw():
                    if first is None:
                        first = time.perf_counter() - start
                    text += chunk
            pages += 1
            page = text.decode()
            mementos += len(re.findall(r'rel="[^"]*memento"', page))
            m = re.search(r'<([^>]*)>;rel="next"', page)
            next_url = m.group(1) if m else None
    return first or 0.0, time.perf_counter() - start, mementos, pages


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--resources", type=int, default=1000)
    p.add_argument("--versions", type=int, default=10_000)
    p.add_argument("--requests", type=int, default=2000, help="requests per load row")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument(
        "--retention",
        nargs=3,
        type=int,
        metavar=("RESOURCES", "VERSIONS", "BYTES"),
        help="only measure the disk each [publish] versions policy leaves after gc",
    )
    p.add_argument("--serve", nargs=2, metavar=("STORE", "PORT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve(Path(args.serve[0]), int(args.serve[1]))
        return

    from aggregator.publish.uris import rsagg_path
    from aggregator.publish.versions import stamp

    work = Path(tempfile.mkdtemp(prefix="bench_memento_"))
    proc = None
    try:
        if args.retention:
            res, ver, size = args.retention
            costs = retention_costs(work / "retention", res, ver, size)
            print(f"[publish] versions after rsagg gc: {res} resources x {ver} versions of {size} bytes,")
            print("one version a day, the last today")
            print(f"{'versions =':<14} {'blob bytes':>14} {'blobs':>8} {'vs all':>7}")
            for policy, nbytes, files in costs:
                print(f"{policy!r:<14} {nbytes:>14,} {files:>8} {nbytes / costs[0][1]:>6.0%}")
            return
        t = time.perf_counter()
        times = fill(work / "data", args.resources, args.versions)
        print(
            f"filled {args.resources} x 5 versions + 1 x {args.versions} in {time.perf_counter() - t:.1f} s"
        )
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        proc = subprocess.Popen([sys.executable, __file__, "--serve", str(work / "data"), str(port)], env=env)
        base = f"http://127.0.0.1:{port}"
        import httpx

        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(base + "/robots.txt", timeout=2)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit("the publisher did not start") from None
                time.sleep(0.1)

        rnd = random.Random(1)
        n, res = args.requests, args.resources
        uris = [f"{UP}r/{rnd.randrange(res)}.html" for _ in range(n)]
        plain = [(f"{base}/bench/r/{rsagg_path(u)}", {}) for u in uris]
        history = [T0 + STEP * (v + 1) for v in range(5)]
        mementos = [(f"{base}/bench/memento/{stamp(rnd.choice(history))}/{rsagg_path(u)}", {}) for u in uris]
        gates = []
        for u in uris:
            when = T0 + timedelta(seconds=rnd.uniform(0, 6 * STEP.total_seconds()))
            gates.append(
                (
                    f"{base}/bench/timegate/{rsagg_path(u)}",
                    {"accept-datetime": when.strftime("%a, %d %b %Y %H:%M:%S GMT")},
                )
            )
        long_gates = []
        for _ in range(n):
            when = rnd.choice(times) + timedelta(seconds=rnd.uniform(0, 60))
            long_gates.append(
                (
                    f"{base}/bench/timegate/{rsagg_path(LONG)}",
                    {"accept-datetime": when.strftime("%a, %d %b %Y %H:%M:%S GMT")},
                )
            )
        rows = []
        load(plain[:200], args.concurrency, 200)  # warm up: connections, pools, page cache
        for label, requests, expect in [
            ("plain resource GET (current version)", plain, 200),
            ("memento GET (5-version histories)", mementos, 200),
            ("plain resource GET, same again", plain, 200),
            ("memento GET, same again", mementos, 200),
            ("TimeGate 302 (5-version histories)", gates, 302),
            (f"TimeGate 302 ({args.versions}-version history)", long_gates, 302),
        ]:
            cpu = cpu_seconds(proc.pid)
            rate, bad = load(requests, args.concurrency, expect)
            rows.append((label, rate, bad, (cpu_seconds(proc.pid) - cpu) / len(requests)))
        base_rate, base_cpu = rows[0][1], rows[0][3]
        tm_url = f"{base}/bench/timemap/{rsagg_path(LONG)}"
        maps = [timemap(tm_url), timemap(tm_url)]

        print()
        print(
            f"{'request':<44} {'req/s':>9} {'vs plain':>9} {'server CPU/req':>15} {'vs plain':>9}"
            f" {'not ok':>7}"
        )
        for label, rate, bad, cpu in rows:
            print(
                f"{label:<44} {rate:>9.0f} {rate / base_rate:>8.2f}x {cpu * 1e6:>13.0f}us "
                f"{cpu / base_cpu if base_cpu else float('nan'):>8.2f}x {bad:>7}"
            )
        print()
        title = f"TimeMap of {args.versions} versions"
        print(f"{title:<32} {'first byte':>11} {'total':>9} {'mementos':>9} {'pages':>6}")
        for label, (ttfb, total, count, pages) in zip(("first read", "second read"), maps, strict=True):
            print(f"{label:<32} {ttfb * 1000:>9.1f}ms {total * 1000:>7.0f}ms {count:>9} {pages:>6}")
        print()
        print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}, {os.cpu_count()} cores, "
              f"concurrency {args.concurrency}, {n} requests per row")  # fmt: skip
        blobs = sum(f.stat().st_size for f in (work / "data" / "blobs").rglob("*") if f.is_file())
        state_mb = (work / "data" / "state.db").stat().st_size / 1e6
        print(f"store: state {state_mb:.1f} MB, blobs {blobs / 1e6:.1f} MB")
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
