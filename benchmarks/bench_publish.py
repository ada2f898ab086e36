"""Republishing at scale: streaming the Resource List Index and its parts, and resource GETs.

Fills a fresh store (temporary folder) with N resources (default 1,000,000) of one source/set, starts
the rsagg publisher in its own process and, from this process:

* streams ``/SET/resourcelist.xml`` (the index) and every part with httpx: time to first byte of the index
  and of each part, total time, bytes, bytes/s, entries counted; then stops the server (SIGTERM) and
  reads its peak RSS from ``os.wait4`` (target: under 150 MB);
* ``--rounds`` times (default 2), each time by a fresh server with no cached rendering: the best
  round counts;
* streams them again: now from the cached renderings (``publish/doccache.py``);
* rsagg runs with its own plugins only, as deployed (``--plugins`` keeps third-party ones installed here,
  such as the test suite's example plugin, whose publish filter is called for every entry);
* runs a bounded GET load on 2,000 resource URLs taken from the lists against a fresh rsagg server, rsagg
  behind nginx with ``server.offload = "x-accel"`` (the shipped ``config/nginx.conf``), and static file
  servers holding the same bytes as files ``r/<i>.txt`` (nginx when installed, ``python -m http.server``):
  requests/s and the ratios. All four are up at once and take turns, ``--rounds`` times (default 2);
  each one's best round counts. Load generator: ``wrk`` when installed (``-d 10s -c 32 -t 2``), else an
  httpx client in its own process (bounded request count). Beside each rate: the CPU time the server's
  processes (nginx: master and workers; rsagg behind nginx: both) spent per request, median round;
* ``--floor`` (instead of the above): the least any answer cache can cost next to nginx static, a hit of
  the smallest answer (two header lines) in a bare ``proxy_cache`` location (``floor_conf``), beside the
  shipped configuration's hit of that answer and of rsagg's (hits only), by req/s, server CPU per
  request (with the kernel's share) and nginx's instructions per request (callgrind), with where a
  hit's instructions go (``FLOOR_FUNCTIONS``);
* ``--before DIR``: one more rsagg alone, run from the tree ``DIR`` (a worktree of an earlier commit,
  with its own ``.venv`` if it has one), on the same store and taking turns with the others: before
  and after, interleaved.

Every server listens on 127.0.0.1 and is stopped at the end, also on errors.

    python benchmarks/bench_publish.py                      # full size (1,000,000 resources)
    python benchmarks/bench_publish.py --resources 100000   # quick
    python benchmarks/bench_publish.py --floor --resources 20000 --duration 4 --warmup 1 --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _harness import third_party_plugins
from _headline import headline

ROOT = Path(__file__).resolve().parent.parent
SOURCE = "bench"
TARGET_RSS_MB = 150
BLOBS = 300
BATCH = 10_000
PICK = 2_000
LOC = re.compile(rb"<loc>([^<]+)</loc>")
RESOURCE_NO = re.compile(r"/r/(\d+)\.txt$")


def blob_bytes(k: int) -> bytes:
    return (f"resource body {k}\n" * (1 + k % 40)).encode()


def upstream_uri(i: int) -> str:
    return f"http://upstream.example/r/{i}.txt"


def record_round(
    name: str, n: int, r: dict, cpu_us: float, cpus: dict[str, list[float]], best: dict[str, dict]
) -> None:
    """One round of server ``name``'s GET load ``r``: its CPU per request kept, the machine's load over
    the run beside it, a line printed, and ``best[name]`` the round of most req/s so far."""
    cpus.setdefault(name, []).append(cpu_us)
    r["load"] = os.getloadavg()[0]
    print(
        f"  round {n + 1}: {name} {r['rps']:,.0f} req/s, {cpu_us:.1f} us CPU/req (load {r['load']:.2f})",
        flush=True,
    )
    if name not in best or r["rps"] > best[name]["rps"]:
        best[name] = r


def bench_config(
    store: Path, port: int, offload: str = "none", plugins: bool = False, cache_seconds: int | None = None
):
    """rsagg as deployed: its own plugins only (``plugins``: also the installed third-party ones, e.g.
    a development environment's example plugin, whose publish filter is called for every entry)."""
    from aggregator.config import parse_config

    return parse_config(
        {
            "server": {
                "listen": f"127.0.0.1:{port}",
                "base_url": f"http://127.0.0.1:{port}",
                "offload": offload,
                **({} if cache_seconds is None else {"offload_cache_seconds": cache_seconds}),
            },
            "store": {"path": str(store)},
            "sources": [{"name": SOURCE, "url": "http://upstream.example/.well-known/resourcesync"}],
            "notifications": {"enabled": False},
            "plugins": {} if plugins else {name: {"enabled": False} for name in third_party_plugins()},
        }
    )


# -- child modes -----------------------------------------------------------------------------------------


def fill(store: Path, n: int) -> dict:
    """N resources over BLOBS distinct small blobs, applied in batches of BATCH changes."""
    from aggregator.store.blobs import FileBlobStore
    from aggregator.store.rows import Change
    from aggregator.store.state import State

    start = time.perf_counter()
    blobs = FileBlobStore(store / "blobs")
    infos = []
    try:
        for k in range(BLOBS):
            data = blob_bytes(k)
            blobs.put_bytes(data)
            infos.append((hashlib.sha256(data).hexdigest(), len(data)))
    finally:
        blobs.close()
    state = State(store / "state.db")
    try:
        state.upsert_source(SOURCE, "http://upstream.example/.well-known/resourcesync")
        set_id = state.ensure_set(SOURCE, "http://upstream.example/capabilitylist.xml")
        for lo in range(0, n, BATCH):
            changes = []
            for i in range(lo, min(n, lo + BATCH)):
                sha, length = infos[i % BLOBS]
                changes.append(Change(upstream_uri(i), "created", sha, length, "text/plain"))
            state.apply(set_id, changes)
        name = state.sets(SOURCE)[0].name
    finally:
        state.close()
    return {"seconds": time.perf_counter() - start, "set": name}


def serve_rsagg(
    store: Path, port: int, offload: str, plugins: bool, dumps: str = "off", cache_seconds: int | None = None
) -> None:
    """The publisher alone; ``dumps``: also build a Resource Dump of the whole set over and over meanwhile
    (as the daemon does at its interval, here without pause and without skipping an unchanged set), in a
    trio worker thread at normal priority (``thread``), in a niced thread (``low``:
    ``schedule.run_low_priority``, the daemon's way before) or as the daemon does (``process``: a niced
    worker process of its own, ``run/dumpworker.py``), so a GET load shows what building dumps costs
    serving."""
    from functools import partial

    import trio

    from aggregator.observe.metrics import Metrics
    from aggregator.run.parts import load_plugins, publisher_app
    from aggregator.run.serving import serve
    from aggregator.store.blobs import FileBlobStore

    blobs = FileBlobStore(store / "blobs")
    config = bench_config(store, port, offload, plugins, cache_seconds)
    loaded = load_plugins(config)
    metrics = Metrics(plugins=lambda: [loaded], store=blobs)
    app = publisher_app(config, blobs=blobs, plugins=loaded, metrics=metrics, state_path=store / "state.db")
    if dumps == "off":
        trio.run(serve, app, "127.0.0.1", port)
        return
    if dumps == "process":
        import trio_parallel

        from aggregator.run.dumpworker import _lower_priority

        async def in_process() -> None:
            async with (
                trio_parallel.open_worker_context(init=_lower_priority) as ctx,
                trio.open_nursery() as nursery,
            ):
                nursery.start_soon(
                    partial(ctx.run_sync, build_in_worker, store, port, plugins, kill_on_cancel=True)
                )
                await serve(app, "127.0.0.1", port)

        trio.run(in_process)
        return
    from aggregator.publish.schedule import build_due, run_low_priority
    from aggregator.run.parts import dump_builder

    builder = dump_builder(config, blobs, get_config=lambda: config, get_plugins=lambda: loaded)
    assert builder is not None
    builder._changed_since = lambda run, ids: True  # a benchmark: build again every round

    async def build_forever() -> None:
        while True:
            build = partial(build_due, builder, resource_dumps=True)
            if dumps == "low":
                await run_low_priority(build)
            else:
                await trio.to_thread.run_sync(build, abandon_on_cancel=True)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(build_forever)
            await serve(app, "127.0.0.1", port)

    trio.run(main)


def build_in_worker(store: Path, port: int, plugins: bool) -> None:
    """``--dumps process``: in the niced dump worker process (``run/dumpworker.py``'s ``init``), the
    builder opened as that worker opens it, building the whole set's Resource Dump over and over."""
    from aggregator.publish.schedule import build_due
    from aggregator.run.parts import dump_builder, load_plugins
    from aggregator.store.blobs import FileBlobStore

    config = bench_config(store, port, "none", plugins)
    loaded = load_plugins(config)
    builder = dump_builder(
        config, FileBlobStore(store / "blobs"), get_config=lambda: config, get_plugins=lambda: loaded
    )
    assert builder is not None
    builder._changed_since = lambda run, ids: True  # a benchmark: build again every round
    while True:
        build_due(builder, resource_dumps=True)


def load(urls_file: Path, requests: int, concurrency: int, timeout: float) -> dict:
    """Bounded GET load: ``requests`` GETs over the URLs, ``concurrency`` workers, ``timeout`` overall."""
    import httpx
    import trio

    urls = urls_file.read_text().split()
    result = {"ok": 0, "errors": 0, "bytes": 0}

    async def main() -> None:
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(limits=limits, timeout=10) as client:
            counter = iter(range(requests))

            async def worker() -> None:
                for n in counter:
                    try:
                        r = await client.get(urls[n % len(urls)])
                        if r.status_code == 200:
                            result["ok"] += 1
                            result["bytes"] += len(r.content)
                        else:
                            result["errors"] += 1
                    except httpx.HTTPError:
                        result["errors"] += 1

            with trio.move_on_after(timeout):
                async with trio.open_nursery() as nursery:
                    for _ in range(concurrency):
                        nursery.start_soon(worker)

    start = time.perf_counter()
    trio.run(main)
    result["seconds"] = time.perf_counter() - start
    return result


# -- parent helpers --------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(root: Path = ROOT) -> dict[str, str]:
    """The environment of a child: the tree ``root`` first on its path (``--before``: another tree)."""
    return {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def wait_until_up(url: str, proc: subprocess.Popen, limit: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server for {url} exited with code {proc.returncode}")
        try:
            httpx.get(url, timeout=2)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise SystemExit(f"{url} did not answer within {limit:.0f} s")


class Servers:
    """Every server process we start, stopped (SIGTERM, then SIGKILL) and reaped with its peak RSS."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, cmd: list[str], root: Path = ROOT, **kw) -> subprocess.Popen:
        proc = subprocess.Popen(cmd, env=child_env(root), **kw)
        self.procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen) -> tuple[float, float]:
        """Stop one server; its peak RSS in MB: VmHWM read just before SIGTERM (the server's own address
        space) and ru_maxrss from ``os.wait4`` (which, on Linux, also counts the forked copy of this
        parent process before exec: a floor of this process's peak, so VmHWM is the figure to judge)."""
        self.procs.remove(proc)
        if proc.returncode is not None:
            return 0.0, 0.0
        hwm = 0.0
        try:
            for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    hwm = int(line.split()[1]) / 1024
        except OSError:
            pass
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if not pid and time.monotonic() > deadline:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
            if pid:
                proc.returncode = os.waitstatus_to_exitcode(status)
                return hwm, usage.ru_maxrss / 1024  # Linux: kilobytes
            time.sleep(0.05)

    def stop_all(self) -> None:
        for proc in list(self.procs):
            self.stop(proc)


def start_rsagg(
    servers: Servers,
    store: Path,
    offload: str = "none",
    plugins: bool = False,
    dumps: str = "off",
    cache_seconds: int | None = None,
    tree: Path | None = None,
) -> tuple[subprocess.Popen, str]:
    """An rsagg publisher on ``store``; ``tree``: run from that source tree (and its ``.venv``)."""
    port = free_port()
    python, script = sys.executable, __file__
    if tree is not None:
        venv = tree / ".venv" / "bin" / "python"
        python, script = (
            str(venv) if venv.exists() else python,
            str(tree / "benchmarks" / Path(__file__).name),
        )
    cmd = [python, script, "--serve", str(store), "--port", str(port), "--offload", offload]
    cmd += ["--plugins"] if plugins else []
    cmd += ["--dumps", dumps]
    cmd += [] if cache_seconds is None else ["--offload-cache-seconds", str(cache_seconds)]
    proc = servers.start(cmd, root=tree or ROOT)
    base = f"http://127.0.0.1:{port}"
    wait_until_up(base + "/robots.txt", proc)
    return proc, base


def stream(client, url: str, picks: list[bytes], want: int) -> dict:
    """GET one document, streamed: TTFB, seconds, bytes, <url> count, up to ``want`` first locs."""
    start = time.perf_counter()
    ttfb = None
    size = count = 0
    tail = b""
    head = b""
    with client.stream("GET", url) as r:
        r.raise_for_status()
        for chunk in r.iter_raw():
            if ttfb is None:
                ttfb = time.perf_counter() - start
            size += len(chunk)
            # (no copy of the chunk: this client shares the machine with the server it measures)
            count += chunk.count(b"<url>") + (tail + chunk[:4]).count(b"<url>")
            tail = (tail + chunk)[-4:] if len(chunk) < 4 else chunk[-4:]
            if len(head) < 200_000:
                head += chunk
    picks.extend(LOC.findall(head)[:want])
    return {
        "index": b"<sitemapindex" in head[:2000],
        "ttfb": ttfb or 0.0,
        "seconds": time.perf_counter() - start,
        "bytes": size,
        "entries": count,
    }


def stream_lists(base: str, set_name: str, n: int) -> tuple[dict, list[str]]:
    import httpx

    index_url = f"{base}/{set_name}/resourcelist.xml"
    locs: list[bytes] = []
    with httpx.Client(timeout=300) as client:
        start = time.perf_counter()
        index = stream(client, index_url, locs, 10**9)
        parts = [loc.decode() for loc in locs] if index["index"] else []
        # The index streamed above lists the parts; a lone <urlset> (small N) holds the entries itself.
        resources: list[bytes] = [] if parts else locs
        per_part = max(1, PICK // max(1, len(parts)) + 1)
        stats = [stream(client, url, resources, per_part) for url in parts]
        total = time.perf_counter() - start
    size = index["bytes"] + sum(s["bytes"] for s in stats)
    entries = sum(s["entries"] for s in stats) if parts else index["entries"]
    ttfbs = [s["ttfb"] for s in stats] or [index["ttfb"]]
    result = {
        "index_ttfb": index["ttfb"],
        "part_ttfb_max": max(ttfbs),
        "part_ttfb_mean": sum(ttfbs) / len(ttfbs),
        "parts": len(parts),
        "seconds": total,
        "bytes": size,
        "entries": entries,
    }
    return result, [u.decode() for u in resources[:PICK]]


def report(what: str, r: dict) -> None:
    print(
        f"streamed index + {r['parts']} parts ({what}): {r['entries']:,} entries, "
        f"{r['bytes'] / 1e6:.1f} MB in {r['seconds']:.2f} s, index TTFB {r['index_ttfb'] * 1000:.1f} ms",
        flush=True,
    )


def body_of(i: int, size: int = 0) -> bytes:
    """Resource ``i``'s bytes: its blob's (``blob_bytes``), or ``size`` bytes of them repeated."""
    data = blob_bytes(i % BLOBS)
    return data if not size else (data * (size // len(data) + 1))[:size]


def write_static(folder: Path, urls: list[str], size: int = 0) -> list[str]:
    """The picked resources' bytes (``body_of``) as files ``folder/r/<i>.txt``; their paths."""
    (folder / "r").mkdir(parents=True, exist_ok=True)
    paths = []
    for url in urls:
        m = RESOURCE_NO.search(url)
        if m is None:
            raise SystemExit(f"unexpected resource URL {url}")
        i = int(m.group(1))
        (folder / "r" / f"{i}.txt").write_bytes(body_of(i, size))
        paths.append(f"/r/{i}.txt")
    for p in [folder, folder / "r", *folder.glob("r/*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)  # nginx workers may run as another user
    return paths


def nginx_binary() -> str | None:
    return shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)


def start_nginx_with(
    servers: Servers, conf_text: str, work: Path, wrap: list[str] | None = None
) -> subprocess.Popen | None:
    """nginx with ``conf_text`` in the prefix folder ``work``; ``wrap``: under that command (valgrind),
    as one process (no master, no workers)."""
    nginx = nginx_binary()
    if nginx is None:
        return None
    work.mkdir(parents=True, exist_ok=True)
    conf = work / "nginx.conf"
    conf_text = re.sub(r"(?m)^user [^;\n]*;\n", "", conf_text)  # config/nginx.conf names www-data
    conf.write_text(("user root;\n" if os.geteuid() == 0 else "") + conf_text)  # workers read our files
    options = "daemon off;" + (" master_process off;" if wrap else "")
    return servers.start(
        [*(wrap or []), nginx, "-p", str(work), "-c", str(conf), "-g", options],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def shipped_settings() -> tuple[str, str]:
    """The shipped ``config/nginx.conf``'s worker, events and http-level settings (up to its first
    ``upstream``, without the maps of rsagg's variables and with two workers, as the offloading nginx
    runs here), and the lines a server compared with it puts in its server block: the
    ``open_file_cache`` lines, and how the resources' location sends a body (``sendfile``,
    ``tcp_nopush``, ``output_buffers``): what every nginx compared with it takes."""
    text = (ROOT / "config" / "nginx.conf").read_text()
    head = text[: text.index("    upstream rsagg {")]  # worker, events and http-level settings ...
    head = re.sub(r"(?ms)^    map .*?^    }\n", "", head)  # ... but the maps of rsagg's variables
    file_cache = "".join(re.findall(r"(?m)^ *open_file_cache\w* [^;]*;\n", text))
    assert file_cache, "config/nginx.conf has no open_file_cache: update bench_publish.shipped_settings"
    resources = re.search(r"(?ms)^        location ~ \^/\[\^/\]\+/r/ \{\n(.*?)^        \}", text)
    assert resources, "config/nginx.conf has no resources' location: update bench_publish.shipped_settings"
    sending = re.findall(r"(?m)^ *((?:sendfile|tcp_nopush|output_buffers) [^;]*;)", resources.group(1))
    server = file_cache + "".join(f"        {line}\n" for line in sending)
    return head.replace("worker_processes auto;", "worker_processes 2;"), server


def static_conf(folder: Path, port: int) -> str:
    """nginx serving ``folder`` statically with the shipped ``config/nginx.conf``'s settings (like with
    like: its worker, connection and http settings, ``open_file_cache`` included, and its resources'
    way of sending a body), only the server's locations replaced by a plain ``root``; the same two
    workers as the offloading nginx."""
    head, file_cache = shipped_settings()
    return head + (
        f"    server {{\n        listen 127.0.0.1:{port};\n        root {folder};\n"
        f"        default_type text/plain;\n{file_cache}    }}\n}}\n"
    )


def start_nginx(servers: Servers, folder: Path, work: Path) -> tuple[subprocess.Popen, str] | None:
    """nginx serving ``folder`` statically, configured as the shipped ``config/nginx.conf`` is."""
    port = free_port()
    proc = start_nginx_with(servers, static_conf(folder, port), work)
    return _nginx_up(servers, proc, f"http://127.0.0.1:{port}")


def start_nginx_offload(
    servers: Servers, rsagg: str, blobs: Path, work: Path, conf: Path | None = None
) -> tuple[subprocess.Popen, str] | None:
    """nginx in front of rsagg (``server.offload = "x-accel"``) with the shipped ``config/nginx.conf``
    (``conf``: another one, e.g. an older tree's, whose marked lines are the same)."""
    port = free_port()
    proc = start_nginx_with(servers, offload_conf(rsagg, blobs, port, conf), work)
    return _nginx_up(servers, proc, f"http://127.0.0.1:{port}")


def offload_conf(rsagg: str, blobs: Path, port: int, conf: Path | None = None) -> str:
    """``conf`` (the shipped ``config/nginx.conf``) with its marked lines set: rsagg at ``rsagg``, the
    blobs in ``blobs``, listening on ``port`` (its second server on a free port)."""
    files = free_port()
    text = (conf or ROOT / "config" / "nginx.conf").read_text()
    for old, new in (
        ("server 127.0.0.1:8080;", f"server {rsagg.split('//', 1)[1]};"),
        ("listen 127.0.0.1:8000;", f"listen 127.0.0.1:{port};"),
        ("server 127.0.0.1:8001;", f"server 127.0.0.1:{files};"),  # nginx's own second server, if any
        ("listen 127.0.0.1:8001;", f"listen 127.0.0.1:{files};"),
        ("alias /var/lib/rsagg/blobs/;", f"alias {blobs}/;"),
        ("root /var/lib/rsagg/blobs;", f"root {blobs};"),  # (config/nginx.conf before the answer cache)
        ("worker_processes auto;", "worker_processes 2;"),
    ):
        text = text.replace(old, new)
    return text


def _nginx_up(
    servers: Servers, proc: subprocess.Popen | None, base: str
) -> tuple[subprocess.Popen, str] | None:
    if proc is None:
        return None
    try:
        wait_until_up(base + "/", proc, 10)
    except SystemExit as e:
        print(f"  nginx skipped: {e}", flush=True)
        servers.stop(proc)
        return None
    return proc, base


def nginx_instructions(
    servers: Servers, conf_text: str, work: Path, port: int, paths: list[str], seconds: int
) -> dict | None:
    """nginx's own instructions per request (user space, libraries included; valgrind's callgrind), as
    one process with ``conf_text``: every path fetched twice (nginx's answer cache filled, then its files
    opened), the counters zeroed, then ``seconds`` of wrk (c=4) counted. Unlike req/s and CPU time, this
    count does not swing with the machine's load: it tells what one configuration asks of nginx next to
    another. None when valgrind or wrk is missing."""
    import httpx

    valgrind, control, wrk = (shutil.which(n) for n in ("valgrind", "callgrind_control", "wrk"))
    if not (valgrind and control and wrk):
        return None
    out = work / "callgrind.out"
    proc = start_nginx_with(
        servers, conf_text, work, [valgrind, "--tool=callgrind", f"--callgrind-out-file={out}"]
    )
    assert proc is not None
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(base + "/", proc, 120)
        with httpx.Client(timeout=60) as client:
            for _ in range(2):  # the answer cache filled, then every file opened once (open_file_cache)
                for path in paths:
                    client.get(base + path)
        subprocess.run([control, "-z", str(proc.pid)], capture_output=True, check=True)
        script = work / "paths.lua"
        quoted = ",".join(json.dumps(p[1:]) for p in paths)
        script.write_text(
            f"local paths = {{{quoted}}}\nlocal i = 0\nrequest = function()\n  i = i + 1\n"
            '  return wrk.format("GET", "/" .. paths[(i % #paths) + 1])\nend\n'
        )
        cmd = [wrk, "-d", f"{seconds}s", "-c", "4", "-t", "1", "-s", str(script), base + "/"]
        text = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 120).stdout
        subprocess.run([control, "-d", str(proc.pid)], capture_output=True, check=True)
    finally:
        servers.stop(proc)
    done = re.search(r"(\d+) requests in", text)
    dumps = sorted(work.glob("callgrind.out.*"))  # the counted run's (-d); callgrind.out: from then to exit
    if done is None or not dumps:
        return None
    requests = int(done.group(1))
    total, parse = callgrind_costs(dumps[0], "ngx_http_parse_header_line")
    return {"requests": requests, "ir": total / requests, "parse": parse / requests, "dump": dumps[0]}


def callgrind_costs(dump: Path, function: str) -> tuple[int, int]:
    """A callgrind dump's total instructions and those of ``function`` itself (not its callees)."""
    names: dict[str, str] = {}
    total = own = 0
    current = ""
    after_call = False
    for line in dump.read_text().splitlines():
        m = re.match(r"(c?fn)=\((\d+)\)(?: (.*))?$", line)
        if m:
            if m.group(3):
                names[m.group(2)] = m.group(3)
            if m.group(1) == "fn":
                current = names.get(m.group(2), "")
            continue
        if line.startswith("calls="):
            after_call = True  # the next cost line is the call's inclusive cost, not this function's
            continue
        if line[:1].isdigit() or line[:1] in "+-*":
            fields = line.split()
            if len(fields) >= 2 and not after_call:
                total += int(fields[1])
                own += int(fields[1]) if current == function else 0
            after_call = False
    return total, own


def process_cpu(pids: list[int]) -> float:
    """CPU seconds (user + system) used so far by ``pids`` and their child processes (nginx's workers)."""
    return sum(process_times(pids))


def process_times(pids: list[int]) -> tuple[float, float]:
    """CPU seconds in user space and in the kernel used so far by ``pids`` and their child processes."""
    import psutil

    user = system = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.Error):  # gone meanwhile
            proc = psutil.Process(pid)
            for p in [proc, *proc.children()]:
                with contextlib.suppress(psutil.Error):
                    times = p.cpu_times()
                    user += times.user
                    system += times.system
    return user, system


def run_load(
    name: str,
    base: str,
    paths: list[str],
    work: Path,
    args: argparse.Namespace,
    pids: list[int] | None = None,
) -> dict:
    urls = [base + p for p in paths]
    wrk = shutil.which("wrk")
    if wrk and not args.no_wrk:
        script = work / f"{name}.lua"
        quoted = ",".join(json.dumps(u.split("/", 3)[3]) for u in urls)
        script.write_text(
            f"local paths = {{{quoted}}}\nlocal i = 0\n"
            "request = function()\n  i = i + 1\n"
            '  return wrk.format("GET", "/" .. paths[(i % #paths) + 1])\nend\n'
        )
        cmd = [wrk, "-d", f"{args.duration}s", "-c", str(args.concurrency), "-t", "2", "--timeout", "10s",
               "-s", str(script), base + "/"]  # fmt: skip
        warm_cpu = 0.0
        if args.warmup:  # every server gets the same: first lookups, OS caches, nginx's open files
            warm = [*cmd[:2], f"{args.warmup}s", *cmd[3:]]
            pids = pids or []
            before = process_cpu(pids)
            subprocess.run(warm, capture_output=True, timeout=args.warmup + 60)
            warm_cpu = process_cpu(pids) - before
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.duration + 60).stdout
        rate = re.search(r"Requests/sec:\s+([\d.]+)", out)
        done = re.search(r"(\d+) requests in ([\d.]+)(\w+)", out)
        bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
        errs = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
        errors = (int(bad.group(1)) if bad else 0) + (sum(map(int, errs.groups())) if errs else 0)
        return {
            "rps": float(rate.group(1)) if rate else 0.0,
            "requests": int(done.group(1)) if done else 0,
            "errors": errors,
            "tool": "wrk",
            "warm_cpu": warm_cpu,
        }
    urls_file = work / f"{name}.urls"
    urls_file.write_text("\n".join(urls))
    cmd = [sys.executable, __file__, "--load", str(urls_file), "--requests", str(args.requests),
           "--concurrency", str(args.concurrency), "--timeout", "60"]  # fmt: skip
    r = json.loads(subprocess.run(cmd, capture_output=True, env=child_env(), timeout=120, check=True).stdout)
    return {"rps": r["ok"] / r["seconds"], "requests": r["ok"], "errors": r["errors"], "tool": "httpx"}


def count_instructions(
    servers: Servers,
    store: Path,
    static: Path,
    work: Path,
    paths: list[str],
    rsagg_paths: list[str],
    confs: dict[str, Path | None],
    args: argparse.Namespace,
) -> dict[str, dict]:
    """``--instructions``: nginx static and each offloading configuration under callgrind, in turn."""
    counted: dict[str, dict] = {}
    port = free_port()
    got = nginx_instructions(
        servers, static_conf(static, port), work / "count-static", port, paths, args.duration
    )
    if got is None:
        print("  --instructions: valgrind (callgrind) or wrk is not installed", flush=True)
        return counted
    counted["nginx"] = got
    rsagg, base = start_rsagg(servers, store, "x-accel", args.plugins, cache_seconds=600)  # hits only
    try:
        for name, conf in confs.items():
            port = free_port()
            text = offload_conf(base, store / "blobs", port, conf)
            slug = re.sub(r"[^a-z]+", "-", name).strip("-")
            got = nginx_instructions(servers, text, work / f"count-{slug}", port, rsagg_paths, args.duration)
            if got is not None:
                counted[name] = got
    finally:
        servers.stop(rsagg)
    for name, c in counted.items():
        print(
            f"  {name}: {c['ir']:,.0f} instructions per request, {c['parse']:,.0f} of them parsing header "
            f"lines ({c['requests']:,} requests counted)",
            flush=True,
        )
    return counted


# -- the floor: what any cache hit costs next to a static file --------------------------------------------


def serve_answers(port: int, expires: int, size: int = 0) -> None:
    """``--floor``'s upstream: the bytes of ``r/<i>.txt`` (as ``write_static`` writes them) under any
    path ending so, with the fewest header lines an answer can have (Content-Type, Content-Length;
    ``expires``: also ``X-Accel-Expires``, which the shipped configuration needs to keep an answer).
    nginx keeps this answer's header block verbatim in its cache file: the least a hit can re-read."""
    import socketserver

    extra = b"X-Accel-Expires: %d\r\n" % expires if expires else b""

    class Handler(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            while True:
                line = self.rfile.readline()
                if not line:
                    return
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass  # the request's header lines: nothing in them changes the answer
                m = re.search(rb"/r/(\d+)\.txt ", line)
                body = body_of(int(m.group(1)), size) if m else b""
                status = b"200 OK" if m else b"404 Not Found"
                head = b"HTTP/1.1 %s\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n" % (
                    status,
                    len(body),
                )
                self.wfile.write(head + (extra if m else b"") + b"\r\n" + body)
                self.wfile.flush()

    class Server(socketserver.ThreadingTCPServer):
        allow_reuse_address = True
        daemon_threads = True

    with Server(("127.0.0.1", port), Handler) as server:
        server.serve_forever()


def start_answers(servers: Servers, expires: int, size: int = 0) -> tuple[subprocess.Popen, str]:
    """A ``serve_answers`` upstream in its own process; its base URL."""
    port = free_port()
    cmd = [sys.executable, __file__, "--answers", str(port), "--answers-expires", str(expires)]
    cmd += ["--body-bytes", str(size)] if size else []
    proc = servers.start(cmd)
    base = f"http://127.0.0.1:{port}"
    wait_until_up(base + "/", proc)
    return proc, base


def floor_conf(upstream: str, port: int) -> str:
    """The least a cache hit can be: the shipped settings (as ``static_conf``, its way of sending a body
    included), one location that answers every GET from ``proxy_cache`` (key ``$uri``, answers kept an
    hour by ``proxy_cache_valid``, one page read per hit) whose answers come from ``upstream``
    (``serve_answers``: two header lines). No regular expression, no ``if``, no ranges, no second
    server."""
    head, file_cache = shipped_settings()
    return head + (
        "    proxy_cache_path floor levels=1:2 keys_zone=floor:10m max_size=1g inactive=60m\n"
        "                     use_temp_path=off;\n"
        f"    upstream answers {{\n        server {upstream.split('//', 1)[1]};\n"
        "        keepalive 64;\n    }\n"
        f"    server {{\n        listen 127.0.0.1:{port};\n{file_cache}"
        "        location / {\n"
        "            proxy_pass http://answers;\n"
        "            proxy_http_version 1.1;\n"
        '            proxy_set_header Connection "";\n'
        "            proxy_cache floor;\n"
        "            proxy_cache_key $uri;\n"
        "            proxy_cache_valid 200 60m;\n"
        "            proxy_buffer_size 4k;\n"
        "        }\n    }\n}\n"
    )


def shipped_minimal_conf(upstream: str, blobs: Path, port: int) -> str:
    """The shipped ``config/nginx.conf`` (``offload_conf``) whose answer cache is filled from
    ``upstream`` (``serve_answers`` with ``X-Accel-Expires``) instead of its second server: the
    shipped front server's work per hit on the smallest cached answer."""
    text = offload_conf(upstream, blobs, port)
    text, n = re.subn(
        r"(upstream rsagg_files \{\n\s*server )[^;]+;", rf"\g<1>{upstream.split('//', 1)[1]};", text
    )
    assert n == 1, "config/nginx.conf has no upstream rsagg_files: update bench_publish.shipped_minimal_conf"
    return text


#: The line of the shipped resources' location that sends a hit's body without ``sendfile``.
SENDFILE_OFF = "        sendfile off;\n"

#: ``--floor``'s cases, as its table's columns name them.
SHORT = {
    "nginx static": "static",
    "hit, smallest answer": "smallest",
    "hit, smallest answer, shipped conf": "shipped",
    "hit, rsagg's answer, shipped conf": "rsagg's",
    "nginx static, sendfile on": "static sf",
    "hit, smallest answer, sendfile on": "small. sf",
}

#: Functions whose inclusive instructions per request ``--floor`` prints: where a hit's cost goes (the
#: names nginx exports; Debian's binary has no symbols for its static functions).
FLOOR_FUNCTIONS = {
    "ngx_http_process_request": "the request, read to finalized",
    "ngx_http_core_content_phase": "  its content phase (file, or cache)",
    "ngx_http_file_cache_create_key": "    cache key (MD5)",
    "ngx_http_file_cache_open": "    cache entry open (shm, open file, pread)",
    "ngx_http_parse_status_line": "    cached status line parsed",
    "ngx_http_parse_header_line": "    cached (static: request) header lines parsed",
    "ngx_http_send_header": "    answer's header written",
    "ngx_http_output_filter": "    body sent",
    "ngx_open_cached_file": "  open_file_cache lookups",
    "ngx_http_complex_value": "  complex values (key, map, if)",
}


def callgrind_inclusive(dump: Path, functions: list[str]) -> dict[str, int]:
    """Inclusive instructions of ``functions`` in a callgrind dump (``callgrind_annotate
    --inclusive=yes``); missing ones count 0."""
    annotate = shutil.which("callgrind_annotate")
    if annotate is None:
        return {}
    text = subprocess.run(
        [annotate, "--inclusive=yes", "--threshold=100", str(dump)], capture_output=True, text=True
    ).stdout
    out = dict.fromkeys(functions, 0)
    for line in text.splitlines():
        m = re.match(r"\s*([\d,]+) \([^)]*\)\s+\S*:(\w+)", line) or re.match(r"\s*([\d,]+)\s+\S*:(\w+)", line)
        if m and m.group(2) in out:
            out[m.group(2)] = max(out[m.group(2)], int(m.group(1).replace(",", "")))
    return out


def run_floor(args: argparse.Namespace) -> int:
    """``--floor``: nginx static, a cache hit of the smallest answer (``floor_conf``), the shipped
    configuration's hit of the smallest answer (``shipped_minimal_conf``) and of rsagg's answer (hits
    only: rsagg keeps its answers 600 s), each by wrk (the servers taking turns, ``--rounds``, the best
    counting; the CPU per request of the median round) and by nginx's own instructions per request
    (callgrind, one process), with where a hit's instructions go."""
    import httpx

    servers = Servers()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="rsagg-bench-floor-") as tmp:
        store, static, work = Path(tmp) / "store", Path(tmp) / "static", Path(tmp) / "work"
        work.mkdir()
        try:
            print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs", flush=True)
            cmd = [sys.executable, __file__, "--fill", str(store), "--resources", str(args.resources)]
            filled = json.loads(subprocess.run(cmd, capture_output=True, env=child_env(), check=True).stdout)
            rsagg, rsagg_base = start_rsagg(servers, store, "x-accel", args.plugins, cache_seconds=600)
            _, urls = stream_lists(rsagg_base, filled["set"], args.resources)
            if args.body_bytes:  # large bodies: as many resources as make 64 MB (at least 8)
                urls = urls[: max(8, 64_000_000 // args.body_bytes)]
            paths = write_static(static, urls, args.body_bytes)
            rsagg_paths = ["/" + u.split("/", 3)[3] for u in urls]
            plain, plain_base = start_answers(servers, 0, args.body_bytes)
            expiring, expiring_base = start_answers(servers, 3600, args.body_bytes)
            cases = {  # name: (configuration for a port, paths, the upstream's process)
                "nginx static": (lambda port: static_conf(static, port), paths, None),
                "hit, smallest answer": (lambda port: floor_conf(plain_base, port), paths, plain),
                "hit, smallest answer, shipped conf": (
                    lambda port: shipped_minimal_conf(expiring_base, store / "blobs", port),
                    rsagg_paths,
                    expiring,
                ),
                "hit, rsagg's answer, shipped conf": (
                    lambda port: offload_conf(rsagg_base, store / "blobs", port),
                    rsagg_paths,
                    rsagg,
                ),
            }
            if args.body_bytes:  # rsagg's store holds small blobs only
                del cases["hit, rsagg's answer, shipped conf"]
            if SENDFILE_OFF in static_conf(static, 0):  # the same two, as nginx sends a file by default
                cases["nginx static, sendfile on"] = (
                    lambda port: static_conf(static, port).replace(SENDFILE_OFF, ""),
                    paths,
                    None,
                )
                cases["hit, smallest answer, sendfile on"] = (
                    lambda port: floor_conf(plain_base, port).replace(SENDFILE_OFF, ""),
                    paths,
                    plain,
                )
            targets: dict[str, tuple[str, list[str], list[int]]] = {}
            for name, (conf, ps, upstream) in cases.items():
                port = free_port()
                slug = re.sub(r"[^a-z]+", "-", name).strip("-")
                started = _nginx_up(
                    servers, start_nginx_with(servers, conf(port), work / slug), f"http://127.0.0.1:{port}"
                )
                if started is None:
                    raise SystemExit(f"--floor: nginx did not start for {name}")
                targets[name] = (started[1], ps, [started[0].pid] + ([upstream.pid] if upstream else []))
                with httpx.Client(timeout=30) as client:  # every answer cached before the first count
                    for path in ps:
                        client.get(started[1] + path).raise_for_status()
            cpus: dict[str, list[float]] = {}
            kernel: dict[str, list[float]] = {}  # the kernel's share of the CPU, per round
            for n in range(max(1, args.rounds)):
                for name, (base, ps, pids) in targets.items():
                    # (the kernel's share: over the warm-up and the measured run alike)
                    user, system = process_times(pids)
                    r = run_load(re.sub(r"[^a-z]+", "-", name).strip("-"), base, ps, work, args, pids)
                    after = process_times(pids)
                    per = 1e6 / max(1, r["requests"])
                    cpu = sum(after) - user - system - r.pop("warm_cpu", 0.0)
                    kernel.setdefault(name, []).append(
                        (after[1] - system) / (sum(after) - user - system or 1)
                    )
                    record_round(name, n, r, cpu * per, cpus, results)
            for name, values in cpus.items():
                results[name]["cpu_us"] = sorted(values)[len(values) // 2]
                results[name]["kernel"] = sorted(kernel[name])[len(values) // 2]
            for name, (conf, ps, _) in cases.items():
                port = free_port()
                slug = re.sub(r"[^a-z]+", "-", name).strip("-")
                got = nginx_instructions(servers, conf(port), work / f"count-{slug}", port, ps, args.duration)
                if got is None:
                    print("  --floor: no instruction counts (valgrind, callgrind_control or wrk missing?)")
                    break
                inclusive = callgrind_inclusive(got.pop("dump"), list(FLOOR_FUNCTIONS))
                got["functions"] = {f: v / got["requests"] for f, v in inclusive.items()}
                results[name].update(got)
                print(f"  {name}: {got['ir']:,.0f} instructions per request", flush=True)
        finally:
            servers.stop_all()
        print(f"load average after: {os.getloadavg()[0]:.2f}")
    print()
    print(floor_table(results, args.concurrency))
    return 0


def floor_table(results: dict[str, dict], concurrency: int) -> str:
    """``--floor``'s table: per case req/s (best round), server CPU per request (median round) and
    nginx's instructions per request, each beside nginx static's as a ratio (static / case for costs),
    then the inclusive instructions per request of ``FLOOR_FUNCTIONS``."""
    static = results["nginx static"]
    lines = [
        f"{'resource GETs, wrk c=' + str(concurrency):<36} {'req/s':>8} {'ratio':>6} {'load':>5} "
        f"{'CPU us':>7} {'kernel':>6} {'ratio':>6} {'instr.':>7} {'ratio':>6}",
        "-" * 97,
    ]
    for name, r in results.items():
        ir = r.get("ir")
        lines.append(
            f"{name:<36} {r['rps']:>8,.0f} {r['rps'] / static['rps']:>5.2f}x {r['load']:>5.2f} "
            f"{r['cpu_us']:>7.1f} {r['kernel']:>6.0%} {static['cpu_us'] / r['cpu_us']:>5.2f}x "
            + (f"{ir:>7,.0f} {static['ir'] / ir:>5.2f}x" if ir and static.get("ir") else f"{'':>7} {'':>6}")
        )
    if all("functions" in r for r in results.values()):
        lines += [
            "",
            f"{'nginx instructions per request, inclusive':<50}"
            + "".join(f"{SHORT.get(n, n[:9]):>10}" for n in results),
            f"{'all of them':<50}" + "".join(f"{r['ir']:>10,.0f}" for r in results.values()),
        ]
        for function, what in FLOOR_FUNCTIONS.items():
            values = [r["functions"].get(function, 0) for r in results.values()]
            lines.append(f"{what:<50}" + "".join(f"{v:>10,.0f}" for v in values))
    lines.append("")
    for base, hit, what in (
        (
            "nginx static",
            "hit, smallest answer",
            "the floor (a hit of the smallest cached answer / nginx static)",
        ),
        ("nginx static, sendfile on", "hit, smallest answer, sendfile on", "the same, both with sendfile on"),
    ):
        if base in results and hit in results:
            a, b = results[base], results[hit]
            by = [f"{b['rps'] / a['rps']:.2f}x by req/s", f"{a['cpu_us'] / b['cpu_us']:.2f}x by CPU"]
            by += [f"{a['ir'] / b['ir']:.2f}x by nginx's instructions"] if "ir" in a and "ir" in b else []
            lines.append(f"{what}: {', '.join(by)}")
    return "\n".join(lines)


def row(metric: str, value: str, target: str = "", ok: bool | None = None) -> str:
    verdict = "" if ok is None else ("OK" if ok else "MISSED")
    return f"{metric:<44} {value:>18}  {target:<12} {verdict}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--resources", type=int, default=1_000_000, help="resources in the state (1,000,000)")
    p.add_argument("--concurrency", type=int, default=32, help="concurrent connections of the GET load (32)")
    p.add_argument("--duration", type=int, default=10, help="seconds of wrk load per server (10)")
    p.add_argument("--warmup", type=int, default=3, help="seconds of unmeasured wrk load first (3)")
    p.add_argument("--requests", type=int, default=10_000, help="GETs per server without wrk (10,000)")
    p.add_argument(
        "--rounds", type=int, default=2, help="GET loads per server, taking turns; best counts (2)"
    )
    p.add_argument("--no-wrk", action="store_true", help="use the httpx load generator even if wrk is here")
    p.add_argument("--no-nginx", action="store_true", help="do not compare with nginx")
    p.add_argument(
        "--before",
        metavar="DIR",
        help="also load an rsagg alone run from the source tree DIR (e.g. a worktree of main), interleaved",
    )
    p.add_argument(
        "--offload-cache-seconds",
        type=int,
        metavar="N",
        help="rsagg behind nginx: server.offload_cache_seconds (default: rsagg's default, 10)",
    )
    p.add_argument(
        "--nginx-conf-before",
        metavar="CONF",
        help="also run rsagg behind nginx with this configuration (e.g. an older tree's config/nginx.conf, "
        "same marked lines), taking turns with the others: before and after in the same run",
    )
    p.add_argument(
        "--instructions",
        action="store_true",
        help="also count nginx's own instructions per request (valgrind's callgrind, one process, hits "
        "only: rsagg behind it keeps its answers 600 s) for nginx static and rsagg behind nginx: "
        "a per-hit cost that does not swing with the machine's load",
    )
    p.add_argument(
        "--dumps",
        choices=("off", "thread", "low", "process"),
        default="off",
        help="rsagg alone builds Resource Dumps without pause meanwhile: in a trio worker thread (thread), "
        "a niced thread of its own (low: the daemon before) or as the daemon does, a niced worker "
        "process of its own (process); the table says which",
    )
    p.add_argument(
        "--plugins",
        action="store_true",
        help="keep the installed third-party plugins (default: rsagg's own only, as deployed)",
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="instead of the above: the floor of rsagg behind nginx, a cache hit of the smallest answer "
        "(two header lines, a bare proxy_cache location) next to nginx static, the shipped configuration "
        "on that answer and on rsagg's (hits only), by req/s, CPU and nginx's instructions per request",
    )
    p.add_argument("--answers", type=int, metavar="PORT", help=argparse.SUPPRESS)  # child: floor upstream
    p.add_argument("--answers-expires", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument(
        "--body-bytes",
        type=int,
        default=0,
        metavar="N",
        help="--floor: every body N bytes long (the small blobs' bytes repeated) instead of the blobs' "
        "16-720 bytes, rsagg's answer left out (its store holds small blobs): what large answers cost",
    )
    p.add_argument("--fill", metavar="STORE", help=argparse.SUPPRESS)  # child: fill the store
    p.add_argument("--serve", metavar="STORE", help=argparse.SUPPRESS)  # child: rsagg publisher
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--offload", default="none", help=argparse.SUPPRESS)
    p.add_argument("--load", metavar="URLS", help=argparse.SUPPRESS)  # child: httpx load generator
    p.add_argument("--timeout", type=float, default=60.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.fill:
        print(json.dumps(fill(Path(args.fill), args.resources)))
        return 0
    if args.serve:
        serve_rsagg(
            Path(args.serve), args.port, args.offload, args.plugins, args.dumps, args.offload_cache_seconds
        )
        return 0
    if args.load:
        print(json.dumps(load(Path(args.load), args.requests, args.concurrency, args.timeout)))
        return 0
    if args.answers:
        serve_answers(args.answers, args.answers_expires, args.body_bytes)
        return 0
    if args.floor:
        return run_floor(args)

    servers = Servers()
    with tempfile.TemporaryDirectory(prefix="rsagg-bench-publish-") as tmp:
        store, static, work = Path(tmp) / "store", Path(tmp) / "static", Path(tmp) / "work"
        work.mkdir()
        try:
            print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs", flush=True)
            others = third_party_plugins()
            if others:
                kept = "kept (--plugins)" if args.plugins else "disabled (--plugins keeps them)"
                print(f"third-party plugins installed: {', '.join(others)}: {kept}", flush=True)
            cmd = [sys.executable, __file__, "--fill", str(store), "--resources", str(args.resources)]
            # In a child, so that this process (forked for every server) stays small.
            filled = json.loads(subprocess.run(cmd, capture_output=True, env=child_env(), check=True).stdout)
            set_name = filled["set"]
            print(f"filled {args.resources:,} resources in {filled['seconds']:.1f} s", flush=True)

            # Rendered from the state by a fresh server (no cached rendering), ``--rounds`` times, the
            # best counting; then once more from the renderings the last round cached.
            best: dict | None = None
            picked: list[str] = []
            for n in range(max(1, args.rounds)):
                shutil.rmtree(store / "cache", ignore_errors=True)
                proc, base = start_rsagg(servers, store, plugins=args.plugins)
                fresh, urls = stream_lists(base, set_name, args.resources)
                report(f"rendered, round {n + 1}", fresh)
                if best is None or fresh["seconds"] < best["seconds"]:
                    best = fresh
                picked = picked or urls
                if n + 1 < max(1, args.rounds):
                    servers.stop(proc)
            assert best is not None
            lists = best
            warm, _ = stream_lists(base, set_name, args.resources)  # from the cached renderings
            report("cached", warm)
            rss, rss_wait4 = servers.stop(proc)

            paths = write_static(static, picked)
            loads: dict[str, dict] = {}
            rsagg_paths = ["/" + u.split("/", 3)[3] for u in picked]
            # Every server is up at once (idle ones cost nothing) and the loads take turns, ``--rounds``
            # times: each server's best round counts, so a burst of other work on the shared machine
            # does not decide a ratio alone.
            # (each with the processes whose CPU time it costs: nginx's master and workers, rsagg)
            targets: dict[str, tuple[str, list[str], list[int]]] = {}
            alone, base = start_rsagg(servers, store, plugins=args.plugins, dumps=args.dumps)
            targets["rsagg"] = (base, rsagg_paths, [alone.pid])
            if args.before:
                before, base = start_rsagg(
                    servers, store, plugins=args.plugins, dumps=args.dumps, tree=Path(args.before).resolve()
                )
                targets["rsagg (before)"] = (base, rsagg_paths, [before.pid])
            confs: dict[str, Path | None] = {}
            if not args.no_nginx and nginx_binary():
                confs = {"rsagg+nginx": None}
                if args.nginx_conf_before:
                    confs["rsagg+nginx-before"] = Path(args.nginx_conf_before)
                for name, conf in confs.items():
                    rsagg, base = start_rsagg(
                        servers, store, "x-accel", args.plugins, cache_seconds=args.offload_cache_seconds
                    )
                    started = start_nginx_offload(servers, base, store / "blobs", work / name, conf)
                    if started:
                        targets[name] = (started[1], rsagg_paths, [started[0].pid, rsagg.pid])
                started = start_nginx(servers, static, work / "nginx")
                if started:
                    targets["nginx"] = (started[1], paths, [started[0].pid])
            port = free_port()
            proc = servers.start(
                [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory",
                 str(static)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            wait_until_up(f"http://127.0.0.1:{port}/", proc)
            targets["http.server"] = (f"http://127.0.0.1:{port}", paths, [proc.pid])
            cpus: dict[str, list[float]] = {}
            for n in range(max(1, args.rounds)):
                for name, (base, ps, pids) in targets.items():
                    cpu = process_cpu(pids)
                    slug = re.sub(r"[^a-z]+", "-", name).strip("-")
                    r = run_load(slug, base, ps, work, args, pids)
                    # the servers' CPU time per request of the measured run (warm-up excluded as far as
                    # wrk's own warm-up run ends before; a shared machine does not inflate it as req/s)
                    cpu = process_cpu(pids) - cpu - r.pop("warm_cpu", 0.0)
                    record_round(name, n, r, cpu / max(1, r["requests"]) * 1e6, cpus, loads)
            for name, values in cpus.items():
                loads[name]["cpu_us"] = sorted(values)[len(values) // 2]  # the median round
            counted: dict[str, dict] = {}
            if args.instructions and "nginx" in targets:
                counted = count_instructions(servers, store, static, work, paths, rsagg_paths, confs, args)
            load_rss, load_rss_wait4 = servers.stop(alone)
            for name, r in loads.items():
                print(
                    f"  GET load {name} ({r['tool']}): {r['rps']:,.0f} req/s, {r['errors']} errors",
                    flush=True,
                )
        finally:
            servers.stop_all()
        print(f"load average after: {os.getloadavg()[0]:.2f}")

    mb = lists["bytes"] / 1e6
    warm_rate = warm["entries"] / warm["seconds"]
    fresh_rate = lists["entries"] / lists["seconds"]
    lines = [
        row("metric", "value", "target", None).rstrip(),
        "-" * 84,
        row("resources in the state", f"{args.resources:,}"),
        row("entries streamed (index parts)", f"{lists['entries']:,}", f"= {args.resources:,}",
            lists["entries"] == args.resources == warm["entries"]),
        row("parts under the index", f"{lists['parts']}"),
        row("index time to first byte (rendered)", f"{lists['index_ttfb'] * 1000:.1f} ms", "< 50 ms",
            lists["index_ttfb"] < 0.05),
        row("index time to first byte (cached)", f"{warm['index_ttfb'] * 1000:.1f} ms", "< 50 ms",
            warm["index_ttfb"] < 0.05),
        row("part time to first byte, mean", f"{lists['part_ttfb_mean'] * 1000:.1f} ms"),
        row("part time to first byte, max", f"{lists['part_ttfb_max'] * 1000:.1f} ms"),
        row("total time, index + all parts", f"{lists['seconds']:.2f} s"),
        row("bytes streamed", f"{mb:.1f} MB"),
        row("throughput (rendered)", f"{mb / lists['seconds']:.2f} MB/s"),
        row("entries/s (rendered from the state)", f"{fresh_rate:,.0f}", ">= 150,000", fresh_rate >= 150_000),
        row("entries/s (cached renderings)", f"{warm_rate:,.0f}", ">= 150,000", warm_rate >= 150_000),
        row("rsagg peak RSS (streaming, VmHWM)", f"{rss:.1f} MB", f"< {TARGET_RSS_MB} MB",
            rss < TARGET_RSS_MB),
        row("rsagg peak RSS (streaming, wait4)", f"{rss_wait4:.1f} MB"),
        row("rsagg peak RSS (GET load, VmHWM)", f"{load_rss:.1f} MB", f"< {TARGET_RSS_MB} MB",
            load_rss < TARGET_RSS_MB),
        row("rsagg peak RSS (GET load, wait4)", f"{load_rss_wait4:.1f} MB"),
    ]  # fmt: skip
    for name, r in loads.items():
        lines.append(row(f"GET {name} ({r['tool']}, c={args.concurrency})", f"{r['rps']:,.0f} req/s",
                         f"load {r['load']:.2f}"))  # fmt: skip
        if "cpu_us" in r:  # servers' CPU (nginx master + workers, rsagg) per request, median round
            lines.append(row(f"  GET {name} server CPU per request", f"{r['cpu_us']:.1f} us"))
        lines.append(row(f"  GET {name} errors / requests", f"{r['errors']} / {r['requests']:,}"))
    if args.dumps != "off":
        lines.append(f"rsagg alone built Resource Dumps meanwhile (--dumps {args.dumps})")
    if "nginx" in loads:
        lines.append("nginx (static) runs with the shipped config/nginx.conf's settings (open_file_cache...)")
    for ours, theirs, target in (("rsagg", "http.server", 1.0), ("rsagg", "nginx", 0.25),
                                 ("rsagg (before)", "nginx", 0.25),
                                 ("rsagg+nginx", "nginx", 0.9),
                                 ("rsagg+nginx-before", "nginx", 0.9)):  # fmt: skip
        if ours in loads and theirs in loads and loads[theirs]["rps"]:
            ratio = loads[ours]["rps"] / loads[theirs]["rps"]
            goal = f">= {target}x" if target else ""
            lines.append(
                row(f"ratio {ours} / {theirs}", f"{ratio:.3f}x", goal, ratio >= target if target else None)
            )
            if theirs == "nginx":
                cpu = loads[ours].get("cpu_us"), loads[theirs].get("cpu_us")
                by_cpu = f", {cpu[1] / cpu[0]:.2f}× by CPU per request" if all(cpu) else ""
                headline(f"serving: {ours} / nginx static, resource GETs (c={args.concurrency})",
                         f"{ratio:.2f}× by req/s{by_cpu}", f"≥ {target}×")  # fmt: skip
    for name, c in counted.items():
        lines.append(row(f"nginx instructions per request, {name}", f"{c['ir']:,.0f}"))
        lines.append(row("  of which parsing header lines", f"{c['parse']:,.0f}"))
    for ours in ("rsagg+nginx", "rsagg+nginx-before"):
        if ours in counted and "nginx" in counted:
            ratio = counted["nginx"]["ir"] / counted[ours]["ir"]
            lines.append(row(f"ratio {ours} / nginx by nginx's instructions", f"{ratio:.3f}x"))
    for ours in ("rsagg+nginx", "rsagg+nginx-before"):  # nginx static's CPU per request over ours
        if loads.get(ours, {}).get("cpu_us") and loads.get("nginx", {}).get("cpu_us"):
            ratio = loads["nginx"]["cpu_us"] / loads[ours]["cpu_us"]
            lines.append(row(f"ratio {ours} / nginx by CPU per request", f"{ratio:.3f}x"))
    print()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
