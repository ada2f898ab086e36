"""A misbehaving client against a running daemon: does a well-behaved client still get served, and does
the daemon's memory stay bounded?

Starts ``rsagg run`` (one disabled source, public base URL, listening on 127.0.0.1) in its own process,
then for ``--seconds`` (default 20) runs, from 127.0.0.2, at once:

* a subscription flood: ``--flooders`` clients POSTing ``hub.mode=subscribe`` with callbacks on distinct
  ``*.flood.invalid`` hosts (never resolvable) as fast as they are answered;
* slowloris: ``--slow`` connections dripping a header line every second;
* slow readers: ``--readers`` connections asking for ``/metrics`` and never reading;

while a well-behaved client (127.0.0.1) GETs ``/status.json`` in a loop. Prints a table: answers by
status, the polite client's requests and latency (median, p99, max), the daemon's RSS before and at the
end (from /proc). Everything is bounded in time and stopped at the end, also on errors.

    python benchmarks/bench_abuse.py
    python benchmarks/bench_abuse.py --seconds 60 --flooders 16 --slow 200
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def main(args: argparse.Namespace) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    folder = Path(tempfile.mkdtemp(prefix="rsagg-abuse-"))
    (folder / "rsagg.toml").write_text(
        f'[server]\nlisten = "127.0.0.1:{port}"\nbase_url = "https://agg.example.org"\n'
        '[store]\npath = "data"\n'
        # `rsagg run` wants a source; a disabled one harvests nothing (serving is what is measured)
        '[[sources]]\nname = "none"\nurl = "http://127.0.0.1:9/"\nenabled = false\n'
    )
    log = (folder / "daemon.log").open("wb")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "aggregator", "run", "-c", str(folder / "rsagg.toml")],
        stdout=log,
        stderr=log,
        env=env,
    )
    statuses: collections.Counter[str] = collections.Counter()
    latencies: list[float] = []
    try:
        async with httpx.AsyncClient(timeout=30) as polite:
            with trio.fail_after(60):
                while True:
                    try:
                        if (await polite.get(f"{url}/status.json")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    await trio.sleep(0.1)
            rss_before = rss_mb(proc.pid)
            end = time.monotonic() + args.seconds

            async def flooder(k: int) -> None:
                transport = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
                async with httpx.AsyncClient(timeout=30, transport=transport) as c:
                    i = 0
                    while time.monotonic() < end:
                        form = {"hub.mode": "subscribe", "hub.topic": "https://agg.example.org/",
                                "hub.callback": f"http://c{k}-{i}.flood.invalid/cb"}  # fmt: skip
                        try:
                            r = await c.post(f"{url}/hub", data=form)
                            statuses[f"flood {r.status_code}"] += 1
                        except httpx.TransportError as exc:
                            statuses[f"flood {type(exc).__name__}"] += 1
                        i += 1

            async def slowloris() -> None:
                try:
                    stream = await trio.open_tcp_stream("127.0.0.1", port, local_address="127.0.0.2")
                except OSError:
                    statuses["slowloris refused at connect"] += 1
                    return
                try:
                    await stream.send_all(b"GET / HTTP/1.1\r\n")
                    while time.monotonic() < end:
                        await stream.send_all(b"X-a: b\r\n")
                        await trio.sleep(1.0)
                    statuses["slowloris still open at the end"] += 1
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    statuses["slowloris closed by the server"] += 1
                finally:
                    await stream.aclose()

            async def reader() -> None:
                stream = await trio.open_tcp_stream("127.0.0.1", port, local_address="127.0.0.2")
                try:
                    await stream.send_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 50)
                    await trio.sleep(max(0.0, end - time.monotonic()))
                finally:
                    await stream.aclose()

            async def polite_loop() -> None:
                while time.monotonic() < end:
                    t = time.perf_counter()
                    r = await polite.get(f"{url}/status.json")
                    latencies.append(time.perf_counter() - t)
                    statuses[f"polite {r.status_code}"] += 1
                    await trio.sleep(0.05)

            with trio.fail_after(args.seconds + 60):
                async with trio.open_nursery() as nursery:
                    for k in range(args.flooders):
                        nursery.start_soon(flooder, k)
                    for _ in range(args.slow):
                        nursery.start_soon(slowloris)
                    for _ in range(args.readers):
                        nursery.start_soon(reader)
                    nursery.start_soon(polite_loop)
            rss_after = rss_mb(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        shutil.rmtree(folder, ignore_errors=True)
    latencies.sort()
    print(f"{'what':<40} {'value':>12}")
    for key in sorted(statuses):
        print(f"{key:<40} {statuses[key]:>12}")
    if latencies:
        p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
        print(f"{'polite latency median (ms)':<40} {statistics.median(latencies) * 1000:>12.1f}")
        print(f"{'polite latency p99 (ms)':<40} {p99 * 1000:>12.1f}")
        print(f"{'polite latency max (ms)':<40} {latencies[-1] * 1000:>12.1f}")
    print(f"{'daemon RSS before (MB)':<40} {rss_before:>12.1f}")
    print(f"{'daemon RSS at the end (MB)':<40} {rss_after:>12.1f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--flooders", type=int, default=8)
    parser.add_argument("--slow", type=int, default=100)
    parser.add_argument("--readers", type=int, default=10)
    trio.run(main, parser.parse_args())
