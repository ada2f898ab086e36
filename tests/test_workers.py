"""``server.workers = 2``: a real ``rsagg run`` serves from two processes on one port; the harvest, the
plugins' start-up and the notifier run once; what only the daemon answers is forwarded to it."""

from __future__ import annotations

import json
import os
import signal
import socket
import tempfile
from pathlib import Path
from typing import BinaryIO

import httpx
import pytest
import trio

from aggregator.publish.uris import rsagg_uri
from aggregator.run.workers import metrics_folder
from aggregator.testing.upstream import Upstream

from .harvesting import start_daemon

# Runs `rsagg run` with two serving processes.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
GUARD = 60
N = 12


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """The serving worker processes of ``pid`` (``aggregator.run.workers``): not its other children,
    such as the niced dump worker (``run/dumpworker.py``) or the harvest's page workers."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out += [int(c) for c in text if _is_serving_worker(int(c))]
    return out


def _is_serving_worker(pid: int) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:  # gone already
        return False
    return b"aggregator.run.workers" in argv


def listening(port: int) -> int:
    """Sockets listening on ``port`` (one per serving process)."""
    rows = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    return sum(int(f[1].split(":")[1], 16) == port and f[3] == "0A" for f in rows)


def owners(port: int, client_ports: set[int]) -> dict[int, int]:
    """Client port -> pid of the process holding the server side of that connection."""
    inodes: dict[str, int] = {}
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        local, remote, inode = f[1], f[2], f[9]
        if int(local.split(":")[1], 16) == port and int(remote.split(":")[1], 16) in client_ports:
            inodes[f"socket:[{inode}]"] = int(remote.split(":")[1], 16)
    found: dict[int, int] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target in inodes:
                    found[inodes[target]] = int(proc.name)
        except OSError:
            continue
    return found


async def test_two_serving_processes_one_harvest(tmp_path: Path):
    up = Upstream(resource_dump=False, change_dump=False)
    for i in range(N):
        up.create(f"r{i}.txt", f"resource {i}\n".encode(), "text/plain")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    events = tmp_path / "events.jsonl"
    store = tmp_path / "data"
    async with up.serving() as ubase:
        config = tmp_path / "rsagg.toml"
        config.write_text(
            f'[server]\nlisten = "127.0.0.1:{port}"\nbase_url = "{base}"\nworkers = 2\n'
            f'[store]\npath = "{store}"\n'
            "[harvest]\njitter = 0\nretries = 1\nbackoff_base = 0.01\nbackoff_max = 0.05\ntimeout = 10\n"
            f"[plugins.example]\nevents_file = '{events}'\n"
            f'[[sources]]\nname = "up"\nurl = "{ubase}"\ninterval = 3600\n'
        )
        log = (tmp_path / "daemon.log").open("ab")
        daemon = await start_daemon(config, log)
        try:
            async with httpx.AsyncClient(timeout=30) as client:
                last = rsagg_uri(base, "up", up.url(f"r{N - 1}.txt"))

                with trio.fail_after(GUARD):
                    while True:  # harvested, and the worker up
                        try:
                            if (await client.get(last)).status_code == 200 and listening(port) == 2:
                                break
                        except httpx.TransportError:
                            pass
                        await trio.sleep(0.2)
                [worker] = children(daemon.pid)

                # connections land on both processes (SO_REUSEPORT spreads them); every one is answered
                streams = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(24)]
                try:
                    path = last[len(base) :].encode()
                    for s in streams:
                        await s.send_all(b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n")
                    for s in streams:
                        data = b""
                        with trio.fail_after(GUARD):
                            while not data.endswith(f"resource {N - 1}\n".encode()):
                                chunk = await s.receive_some(65536)
                                assert chunk
                                data += chunk
                        assert data.startswith(b"HTTP/1.1 200 ")
                    ports = {s.socket.getsockname()[1] for s in streams}
                    held = owners(port, ports)
                    assert set(held.values()) == {daemon.pid, worker}, held
                finally:
                    for s in streams:
                        await s.aclose()

                # what only the daemon knows, asked on fresh connections (some land on the worker):
                # the same answers, forwarded
                caps = set()
                for _ in range(12):
                    async with httpx.AsyncClient(timeout=30) as fresh:
                        r = await fresh.get(f"{base}/up/capabilitylist.xml")
                        assert r.status_code == 200
                        caps.add(r.content)
                        m = await fresh.get(f"{base}/metrics")
                        assert m.status_code == 200 and "rsagg_http_requests_total" in m.text
                        assert (await fresh.post(f"{base}/up/resourcelist.xml")).status_code == 405
                assert len(caps) == 1 and b"changelist.xml" in caps.pop()

                # one harvest, one start-up: the worker runs no background job
                lines = [json.loads(line) for line in events.read_text().splitlines()]
                assert sum(e["event"] == "startup" for e in lines) == 1
                stored = [e["uri"] for e in lines if e["event"] == "stored"]
                assert len(stored) == len(set(stored)) == N
        finally:
            daemon.send_signal(signal.SIGTERM)
            with trio.move_on_after(GUARD):
                await daemon.wait()
            log.close()
        assert daemon.returncode == 0
        with trio.fail_after(GUARD):  # the worker goes with the daemon
            while Path(f"/proc/{worker}").exists() and "zombie" not in _state(worker):
                await trio.sleep(0.1)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (OSError, IndexError):
        return "zombie"


def _served(text: str, route: str) -> float:
    """Sum of ``rsagg_http_requests_total`` over the series of ``route``."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("rsagg_http_requests_total{") and f'route="{route}"' in line
    )


async def test_metrics_count_every_serving_process(tmp_path: Path, monkeypatch):
    """``/metrics`` (wherever it lands) counts the requests of the daemon and of every worker, and keeps
    counting those of a worker that was killed; the workers' metric folder goes with the daemon, and one
    a killed daemon left behind goes at the next start."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the daemon's private folder for its workers' files
    stale = tmp_path / "rsagg-worker-metrics-stale"
    stale.mkdir()
    (stale / "counter_1.db").write_bytes(b"left by a daemon that was killed")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    up = Upstream(resource_dump=False, change_dump=False)
    up.create("a.txt", b"a\n", "text/plain")
    async with up.serving() as ubase:
        config = tmp_path / "rsagg.toml"
        config.write_text(
            f'[server]\nlisten = "127.0.0.1:{port}"\nbase_url = "{base}"\nworkers = 3\n'
            f'[store]\npath = "{tmp_path / "data"}"\n'
            f'[[sources]]\nname = "up"\nurl = "{ubase}"\ninterval = 3600\n'
        )
        log = (tmp_path / "daemon.log").open("ab")
        daemon = await start_daemon(config, log)
        await _count_every_process(tmp_path, daemon, log, port, stale)


async def _count_every_process(
    tmp_path: Path, daemon: trio.Process, log: BinaryIO, port: int, stale: Path
) -> None:
    base = f"http://127.0.0.1:{port}"
    get = b"GET /robots.txt HTTP/1.1\r\nHost: x\r\n\r\n"

    async def burst(connections: int, each: int) -> set[int]:
        """``connections`` new connections, ``each`` GETs on each; the pids that answered."""
        streams = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(connections)]
        try:
            for s in streams:
                await s.send_all(get * each)
            for s in streams:
                data = b""
                with trio.fail_after(GUARD):
                    while data.count(b"HTTP/1.1 200 ") < each or not data.endswith(b"\n"):
                        chunk = await s.receive_some(65536)
                        assert chunk
                        data += chunk
            held = owners(port, {s.socket.getsockname()[1] for s in streams})
            return set(held.values())
        finally:
            for s in streams:
                await s.aclose()

    async def count(expected: float) -> float:
        """The robots.txt requests /metrics reports, once it reports ``expected`` (or the last seen); each
        scrape on a new connection, so they land on every process."""
        seen = -1.0
        with trio.move_on_after(GUARD):
            while seen != expected:
                async with httpx.AsyncClient(timeout=30) as client:
                    r = await client.get(f"{base}/metrics")
                assert r.status_code == 200
                seen = _served(r.text, "/robots.txt")
                if seen != expected:
                    await trio.sleep(0.2)
        return seen

    try:
        with trio.fail_after(GUARD):
            while listening(port) != 3:
                assert daemon.returncode is None, (tmp_path / "daemon.log").read_text()
                await trio.sleep(0.2)
        workers = children(daemon.pid)
        assert len(workers) == 2
        [folder] = [p for p in tmp_path.iterdir() if p.name.startswith("rsagg-worker-metrics-")]
        assert not stale.exists()
        assert (
            f"PROMETHEUS_MULTIPROC_DIR={folder}".encode() in Path(f"/proc/{workers[0]}/environ").read_bytes()
        )

        answered = await burst(12, 5)
        assert len(answered) > 1, answered  # (the kernel spread them: some went to a worker)
        assert await count(60) == 60

        # a worker killed: what it counted stays counted (no counter goes back)...
        os.kill(workers[0], signal.SIGKILL)
        with trio.fail_after(GUARD):
            while Path(f"/proc/{workers[0]}").exists() and "zombie" not in _state(workers[0]):
                await trio.sleep(0.1)
        for _ in range(6):
            assert await count(60) == 60
        # ... and the one started in its place counts on top
        with trio.fail_after(GUARD):
            while len(set(children(daemon.pid)) - set(workers)) != 1 or listening(port) != 3:
                await trio.sleep(0.2)
        await burst(12, 5)
        assert await count(120) == 120
    finally:
        daemon.send_signal(signal.SIGTERM)
        with trio.move_on_after(GUARD):
            await daemon.wait()
        log.close()
    assert daemon.returncode == 0
    assert not folder.exists()


def test_metrics_folder_of_a_live_daemon_stays(tmp_path: Path, monkeypatch):
    """A daemon's workers' folder is removed by the next daemon only once its lock is released (the
    daemon is gone), never while it runs."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    first, lock = metrics_folder()
    (first / "counter_1.db").write_bytes(b"")
    second, lock2 = metrics_folder()
    assert first != second and first.exists() and second.exists()
    assert not list(tmp_path.glob(".rsagg-worker-metrics-*"))  # (renamed once locked)
    os.close(lock)  # the first daemon is gone
    third, lock3 = metrics_folder()
    assert not first.exists() and second.exists() and third.exists()
    os.close(lock2)
    os.close(lock3)
