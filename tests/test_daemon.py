"""The daemon as systemd runs it: a real ``rsagg run -c CONFIG`` process against a demo Upstream.

The test plays systemd: it binds its own AF_UNIX datagram socket, passes it as ``$NOTIFY_SOCKET`` with a
short ``$WATCHDOG_USEC``, and reads what the daemon reports (READY=1, WATCHDOG=1, RELOADING=1,
STOPPING=1). The Upstream serves several sets, one per configured source, and counts requests per path,
which tells which source polled. Reloads are SIGHUPs after rewriting the config file, stops SIGTERMs.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import trio

from aggregator.config import load_config, parse_config
from aggregator.run import sdnotify
from aggregator.run.compose import open_context
from aggregator.run.daemon import ListenError, run_daemon
from aggregator.run.hotswap import HotSwapApp
from aggregator.store.blobs import FileBlobStore
from aggregator.store.rows import SourceRow
from aggregator.store.state import State
from aggregator.testing.upstream import Upstream

from .harvesting import audit, harvest

# Runs rsagg daemon processes (signals, watchdog, SIGTERM mid-harvest).
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
WATCHDOG_USEC = 600_000  # pings every 0.3 s
GUARD = 30  # seconds: a hung step fails the test instead of hanging the suite


def _free_port() -> int:
    # The daemon binds what its config says (port 0 is not a valid listen port there).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Notifications:
    """systemd's side of sd_notify: a datagram socket collecting every message the daemon sends."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / "notify.sock"
        self.sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.messages: list[str] = []

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await self.sock.bind(str(self.path))
        task_status.started()
        with self.sock:
            while True:
                self.messages.append((await self.sock.recv(4096)).decode())

    def count(self, line: str) -> int:
        return sum(line in m.split("\n") for m in self.messages)

    async def wait_for(self, line: str, *, after: int = 0) -> int:
        """Index of the first message from ``after`` on holding ``line``; waits for it."""
        while True:
            for i in range(after, len(self.messages)):
                if line in self.messages[i].split("\n"):
                    return i
            await trio.sleep(0.02)


class DaemonProcess:
    """``python -m aggregator run -c CONFIG`` with its log in a file."""

    def __init__(self, folder: Path, upstream: str, port: int) -> None:
        self.folder = folder
        self.config = folder / "rsagg.toml"
        self.store = folder / "data"
        self.log = folder / "daemon.log"
        self.upstream = upstream
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.proc: trio.Process | None = None

    def configure(
        self, sources: dict[str, tuple[str, float]], *, extra: str = "", use_dumps: bool = True
    ) -> None:
        """Sources: name -> (set of the Upstream, poll interval)."""
        text = (
            f'[server]\nlisten = "127.0.0.1:{self.port}"\nbase_url = "{self.url}"\n'
            f'[store]\npath = "data"\n'
            "[harvest]\njitter = 0\nretries = 2\nbackoff_base = 0.01\nbackoff_max = 0.05\ntimeout = 10\n"
            f"workers = 4\nbatch_size = 8\nuse_dumps = {str(use_dumps).lower()}\n{extra}\n"
        )
        for name, (set_name, interval) in sources.items():
            text += (
                f'[[sources]]\nname = "{name}"\nurl = "{self.upstream}/{set_name}/capabilitylist.xml"\n'
                f"interval = {interval}\n"
            )
        self.config.write_text(text)

    async def start(self, notify: Notifications) -> None:
        env = {
            **os.environ,
            "NOTIFY_SOCKET": str(notify.path),
            "WATCHDOG_USEC": str(WATCHDOG_USEC),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        }
        env.pop("WATCHDOG_PID", None)
        cmd = [sys.executable, "-m", "aggregator", "run", "-c", str(self.config), "--log-level", "info"]
        with self.log.open("ab") as out:
            self.proc = await trio.lowlevel.open_process(cmd, env=env, stdout=out, stderr=out)

    def signal(self, signum: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(signum)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def source_row(self, name: str) -> SourceRow | None:
        db = self.store / "state.db"
        if not db.exists():
            return None
        with State(db, readonly=True) as state:
            return state.source(name)

    def resources_of(self, name: str) -> int:
        with State(self.store / "state.db", readonly=True) as state:
            return state.count_resources(source=name)

    async def wait_harvested(self, name: str) -> SourceRow:
        while True:
            row = self.source_row(name)
            if row is not None and row.last_success:
                return row
            assert row is None or row.state != "error", row
            await trio.sleep(0.05)

    async def kill(self) -> None:
        print(f"--- {self.log}\n{self.log_text()}")  # shown when the test fails
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


def requests_of(up: Upstream, set_name: str) -> int:
    return sum(n for path, n in up.counts.items() if path.startswith(f"/{set_name}/"))


def _upstream(sets: tuple[str, ...], per_set: int) -> Upstream:
    up = Upstream(sets=sets, changes_per_list=None)
    for name in sets:
        up.bulk_create(per_set, prefix=f"{name}-", set_name=name)
    return up


@pytest.fixture
def short_tmp():
    # AF_UNIX paths are limited to ~107 bytes: pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="rsagg-d-") as d:
        yield Path(d)


async def test_ready_watchdog_and_reloads(short_tmp: Path) -> None:
    up = _upstream(("alpha", "beta", "gamma"), 5)
    notify = Notifications(short_tmp)
    async with trio.open_nursery() as nursery, up.serving() as upstream:
        await nursery.start(notify.run)
        d = DaemonProcess(short_tmp, upstream, _free_port())
        # a: untouched by the reload (long interval: any request after its first sync is a restart);
        # b: polls often, then removed; gamma's source c is added by the reload.
        d.configure({"a": ("alpha", 1000), "b": ("beta", 0.2)})
        try:
            with trio.fail_after(GUARD):
                await d.start(notify)
                await notify.wait_for("READY=1")
                async with httpx.AsyncClient() as client:
                    assert (await client.get(d.url + "/")).status_code == 200  # READY means serving

                    await d.wait_harvested("a")
                    await d.wait_harvested("b")
                    while up.counts["/beta/capabilitylist.xml"] < 3:  # b polls again and again
                        await trio.sleep(0.05)
                    while notify.count("WATCHDOG=1") < 3:
                        await trio.sleep(0.05)

                    # Reload: b removed, c added, a untouched.
                    alpha_before = requests_of(up, "alpha")
                    d.configure({"a": ("alpha", 1000), "c": ("gamma", 1000)})
                    mark = len(notify.messages)
                    d.signal(signal.SIGHUP)
                    reloading = await notify.wait_for("RELOADING=1", after=mark)
                    assert any(
                        line.startswith("MONOTONIC_USEC=") for line in notify.messages[reloading].split("\n")
                    )
                    await notify.wait_for("READY=1", after=reloading + 1)
                    await d.wait_harvested("c")
                    assert d.resources_of("c") == 5, "the added source was harvested"
                    beta_after = requests_of(up, "beta")
                    pings = notify.count("WATCHDOG=1")
                    while notify.count("WATCHDOG=1") < pings + 3:  # ~0.9 s: b (every 0.2 s) would poll again
                        await trio.sleep(0.05)
                    assert requests_of(up, "beta") == beta_after, "the removed source still polls"
                    assert requests_of(up, "alpha") == alpha_before, "the untouched source was restarted"
                    assert "source=b removed" in d.log_text()
                    assert (await client.get(d.url + "/")).status_code == 200

                    # Reload: a's settings changed -> a restarts (syncs at once); the counter is sensitive.
                    d.configure({"a": ("alpha", 999), "c": ("gamma", 1000)})
                    mark = len(notify.messages)
                    d.signal(signal.SIGHUP)
                    await notify.wait_for("READY=1", after=await notify.wait_for("RELOADING=1", after=mark))
                    while requests_of(up, "alpha") == alpha_before:
                        await trio.sleep(0.05)
                    assert "source=a url or settings changed: restarted" in d.log_text()

                    # Reload with a broken file: refused with FILE: KEY, the daemon keeps serving.
                    good = d.config.read_text()
                    d.config.write_text(good.replace("workers = 4", 'workers = "many"'))
                    mark = len(notify.messages)
                    d.signal(signal.SIGHUP)
                    await notify.wait_for("READY=1", after=await notify.wait_for("RELOADING=1", after=mark))
                    refused = [line for line in d.log_text().splitlines() if "reload refused" in line]
                    assert refused and f"{d.config}: harvest.workers:" in refused[-1]
                    assert (await client.get(d.url + "/")).status_code == 200
                    assert d.proc is not None and d.proc.returncode is None

                mark = len(notify.messages)
                d.signal(signal.SIGTERM)
                assert await d.proc.wait() == 0
                await notify.wait_for("STOPPING=1", after=mark)
        finally:
            await d.kill()
        assert "Traceback" not in d.log_text()
        nursery.cancel_scope.cancel()


async def test_sigterm_during_harvest_leaves_a_consistent_store(short_tmp: Path) -> None:
    up = _upstream(("big",), 200)
    up.latency = 0.02  # every request: a harvest takes seconds, so SIGTERM lands in the middle
    notify = Notifications(short_tmp)
    async with trio.open_nursery() as nursery, up.serving() as upstream:
        await nursery.start(notify.run)
        d = DaemonProcess(short_tmp, upstream, _free_port())
        d.configure({"big": ("big", 1000)}, use_dumps=False)  # resource by resource, many small commits
        try:
            with trio.fail_after(GUARD):
                await d.start(notify)
                await notify.wait_for("READY=1")
                while sum(n for p, n in up.counts.items() if p.startswith("/big/res/")) < 40:
                    await trio.sleep(0.02)
                row = d.source_row("big")
                assert row is not None and row.state == "syncing"  # a harvest is in progress
                mark = len(notify.messages)
                d.signal(signal.SIGTERM)
                with trio.fail_after(10):
                    assert await d.proc.wait() == 0
                await notify.wait_for("STOPPING=1", after=mark)
        finally:
            await d.kill()
        assert "Traceback" not in d.log_text()

        # Blob before state: no row names a missing blob, whatever was in flight at the signal.
        blobs = FileBlobStore(d.store / "blobs")
        with State(d.store / "state.db", readonly=True) as state:
            held = [r.sha256 for r in state.iter_resources()]
        assert 0 < len(held) < 200, "the harvest was interrupted"
        assert all(blobs.exists(sha) for sha in held)

        # A fresh one-shot harvest completes from there and the store is in sync with the upstream.
        up.latency = 0.0
        config = load_config(d.config)
        config = replace(config, harvest=replace(config.harvest, batch_size=256))
        results = await harvest(config)
        assert results["big"].ok, results["big"].error
        assert await audit(config) == []
        with State(d.store / "state.db", readonly=True) as state:
            assert state.count_resources() == 200
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------------------------------------- units


async def test_sdnotify_abstract_socket_and_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.ready() is False  # no supervisor: nothing sent, nothing raised
    name = f"rsagg-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind("\0" + name)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sdnotify.ready("serving") and sdnotify.status("a\nb") and sdnotify.stopping()
        assert s.recv(100) == b"READY=1\nSTATUS=serving"
        assert s.recv(100) == b"STATUS=a b"
        assert s.recv(100) == b"STOPPING=1"
    monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)  # the socket is gone: reported, not raised
    assert sdnotify.watchdog() is False


def test_watchdog_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    assert sdnotify.watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_USEC", "3000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert sdnotify.watchdog_interval() == 1.5
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert sdnotify.watchdog_interval() == 1.5
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))  # meant for another process
    assert sdnotify.watchdog_interval() is None


def _app(events: list[str], name: str, fail: bool = False) -> Callable:
    async def app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    events.append(f"{name} up")
                    scope["state"]["name"] = name
                    kind = "failed" if fail else "complete"
                    await send({"type": f"lifespan.startup.{kind}", "message": "no"})
                    if fail:
                        return
                else:
                    events.append(f"{name} down")
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        events.append(f"{name} served {scope['state'].get('name')}")

    return app


async def test_hotswap_runs_each_apps_lifespan() -> None:
    events: list[str] = []
    async with trio.open_nursery() as nursery:
        swap = HotSwapApp(_app(events, "one"), nursery)
        to_server, from_server = trio.open_memory_channel(4)
        replies, server_inbox = trio.open_memory_channel(4)
        nursery.start_soon(swap, {"type": "lifespan", "state": {}}, from_server.receive, replies.send)
        await to_server.send({"type": "lifespan.startup"})
        assert (await server_inbox.receive())["type"] == "lifespan.startup.complete"
        await swap({"type": "http", "state": {}}, None, None)
        await swap.replace(_app(events, "two"))
        await swap({"type": "http", "state": {}}, None, None)
        with pytest.raises(RuntimeError, match="no"):
            await swap.replace(_app(events, "three", fail=True))
        await swap({"type": "http", "state": {}}, None, None)  # still "two"
        await to_server.send({"type": "lifespan.shutdown"})
        assert (await server_inbox.receive())["type"] == "lifespan.shutdown.complete"
    assert events == [
        "one up", "one served one", "two up", "one down", "two served two", "three up", "two served two",
        "two down",
    ]  # fmt: skip


async def test_port_in_use_is_one_clear_error(tmp_path: Path) -> None:
    async def never_called(scope, receive, send) -> None:
        raise AssertionError("no request expected")

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config = parse_config(
            {"server": {"listen": f"127.0.0.1:{port}"}, "store": {"path": str(tmp_path / "data")}},
            str(tmp_path / "rsagg.toml"),
        )
        with pytest.raises(
            ListenError, match=f"rsagg.toml: server.listen: cannot listen on 127.0.0.1:{port}: "
        ):
            await run_daemon(config, harvest=False, app_factory=lambda config, ctx: never_called)


async def test_cancelled_commits_finish_before_the_task_ends(tmp_path: Path) -> None:
    """What makes SIGTERM safe: cancelling a task waits for its state/blob commit thread to finish."""
    config = parse_config({"store": {"path": str(tmp_path / "data")}}, str(tmp_path / "rsagg.toml"))
    finished: list[str] = []

    def slow(what: str, *_: object) -> None:
        time.sleep(0.3)
        finished.append(what)

    class SlowBlobs:
        def commit(self, writers: list) -> None:
            slow("blobs")

    async with open_context(config) as ctx:
        ctx.blobs = SlowBlobs()  # type: ignore[assignment]
        for name, call in (("state", lambda: ctx.write(slow, "state")),
                           ("blobs", lambda: ctx.commit_blobs([object()]))):  # fmt: skip
            seen = None
            with trio.move_on_after(0.05) as scope:
                await call()  # the deadline passes while the thread runs: it is not abandoned...
                seen = finished[-1:]
                await trio.lowlevel.checkpoint()  # ...and the cancellation comes at the next checkpoint
            assert scope.cancelled_caught and seen == [name]
