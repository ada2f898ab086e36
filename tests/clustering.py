"""Helpers for cluster tests: ``rsagg run`` nodes as subprocesses sharing one store, and the checks on
the lease history that every cluster test makes."""

from __future__ import annotations

import itertools
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import httpx
import trio

from aggregator.store.interface import StateStore
from aggregator.store.open import connect
from aggregator.store.rows import LeaseGrant
from aggregator.store.state import State

REPO = Path(__file__).resolve().parent.parent


class SharedState:
    """The state every node of a test cluster shares: the SQLite file in the shared store, or a schema of
    the test PostgreSQL server (``url``). ``store_extra`` is the ``[store]`` line that names it."""

    def __init__(self, store: Path, url: str | None = None) -> None:
        self.store = store
        self.url = url
        self.location: Path | str = url or store / "state.db"
        self.store_extra = f'state = "{url}"\n' if url else ""

    def open(self) -> StateStore:
        return connect(self.location, readonly=True)

    def exists(self) -> bool:
        """Created and migrated by a node (a reader refuses a state that is not)."""
        if self.url is None and not self.store.joinpath("state.db").exists():
            return False
        try:
            self.open().close()
        except RuntimeError:  # not migrated yet
            return False
        return True


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def sources_toml(sources: dict[str, str], interval: float) -> str:
    return "".join(
        f'[[sources]]\nname = "{name}"\nurl = "{url}"\ninterval = {interval}\n'
        for name, url in sources.items()
    )


class NodeProcess:
    """``rsagg run -c CONFIG`` as one node of a cluster whose store is ``store`` (shared)."""

    def __init__(self, folder: Path, name: str, store: Path, *, state: str | None = None) -> None:
        self.folder = folder / name
        self.folder.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.store = store
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = self.folder / "rsagg.toml"
        self.log = self.folder / "node.log"
        self.proc: trio.Process | None = None

    def configure(
        self,
        body: str,
        *,
        base_url: str,
        lease_seconds: float,
        store_extra: str = "",
        notifications: bool = False,
    ) -> None:
        """``body``: the [harvest], [[sources]] ... every node shares; ``base_url``: the one URL all
        nodes publish as (a load balancer's), the rest is this node's."""
        self.config.write_text(
            f'[server]\nlisten = "127.0.0.1:{self.port}"\nbase_url = "{base_url}"\n'
            f'[store]\npath = "{self.store}"\n{store_extra}'
            f'[cluster]\nenabled = true\nnode = "{self.name}"\nlease_seconds = {lease_seconds}\n'
            f"[notifications]\nenabled = {str(notifications).lower()}\n"
            f"{body}"
        )

    async def start(self) -> None:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        }
        cmd = [sys.executable, "-m", "aggregator", "run", "-c", str(self.config), "--log-level", "info"]
        with self.log.open("ab") as out:
            self.proc = await trio.lowlevel.open_process(cmd, env=env, stdout=out, stderr=out)

    def signal(self, signum: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(signum)

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGCONT)  # a stopped process must run to die of SIGTERM
            self.proc.kill()
            await self.proc.wait()

    async def stop(self) -> int:
        """SIGTERM and wait: a clean stop (leases released)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        with trio.fail_after(60):
            return await self.proc.wait()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    async def get(self, path: str) -> httpx.Response:
        async with httpx.AsyncClient() as client:
            return await client.get(self.url + path, timeout=30)

    async def wait_serving(self) -> None:
        with trio.fail_after(60):
            while True:
                try:
                    if (await self.get("/.well-known/resourcesync")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                assert self.proc is not None and self.proc.returncode is None, self.log_text()[-3000:]
                await trio.sleep(0.1)


async def wait_for(check: Callable[[], object], what: str, timeout: float = 90.0) -> object:
    """Poll ``check`` until it returns something true (generous deadline; never asserts on time)."""
    with trio.move_on_after(timeout):
        while True:
            value = check()
            if value:
                return value
            await trio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def read_state(db: Path, fn: Callable[[State], object]) -> object:
    with State(db, readonly=True) as st:
        return fn(st)


def assert_no_overlap(history: Iterable[LeaseGrant]) -> None:
    """Per source: epochs 1, 2, 3 ... in order, each grant ending before the next begins, at most one
    grant still open (the last)."""
    by_source: dict[str, list[LeaseGrant]] = {}
    for g in history:
        by_source.setdefault(g.source, []).append(g)
    for source, grants in by_source.items():
        grants.sort(key=lambda g: g.epoch)
        assert [g.epoch for g in grants] == list(range(1, len(grants) + 1)), (source, grants)
        for a, b in itertools.pairwise(grants):
            assert a.ended_at is not None, f"{source}: epoch {a.epoch} never ended but {b.epoch} began"
            assert a.granted_at <= a.ended_at <= b.granted_at, f"{source}: {a} overlaps {b}"
