"""Several serving processes on one port (``server.workers``): the daemon and ``workers - 1`` more.

A crawl of a big Source is resource GETs and list streams, and one Python process answers them on one
core. With ``server.workers = N`` the daemon starts N - 1 worker processes (``python -m
aggregator.run.workers``); each binds ``server.listen`` with SO_REUSEPORT, as the daemon does, and the
kernel spreads new connections over the N sockets.

Only serving multiplies. A worker answers, from the state and the store as the daemon does, what
needs no process of its own: resources, Resource Lists and their parts, Change Lists and their
windows, ``robots.txt`` and the Source Description (``LOCAL``). Everything else -- the home page,
``/status.json`` and ``/metrics`` (the daemon's counters), Capability Lists (they list the dumps and the
notification channels, which the daemon knows), dumps, the WebSub hub and callbacks, other methods --
is forwarded to the daemon over a loopback listener of its own and answered there: the harvester, the
hub, the notifier and the dump builder run once, in the daemon. A worker exits only when told: SIGTERM
(the daemon stopping, or restarting it) or the daemon gone (the pipe on its standard input reaches end of
file, however the daemon died). One that exits otherwise is logged as an error and started again. A
reload (SIGHUP) restarts the workers with the new configuration.

Why a pipe and not ``PR_SET_PDEATHSIG``: Linux sends that signal when the *thread* that started the child
ends, not the process, and trio starts processes from its worker threads, which end after 10 s idle: a
worker then got SIGTERM and exited with status 0 about 11 s after it started, the daemon alive and well.

``/metrics`` counts what every process served: a worker runs prometheus-client in multiprocess mode
(``PROMETHEUS_MULTIPROC_DIR``, a private folder of the daemon's: ``metrics_folder``) and the daemon adds
the workers' serving families (requests, their durations, clients refused) to its own when scraped
(``Metrics._collect_served``). A request a worker forwards is counted once, by the daemon. The client
address: nothing behind the server reads it; the connections-per-client cap is applied by the process
that holds the client's connection (so per process), the loopback listener has none.

Caveats: each worker keeps its own cache of rendered documents (the same files, so a rendering one
process made is not reused by another until it renders that version itself); the counter files of
every worker that ran stay (small sparse files, read at each scrape) until the daemon stops.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import httpx
import trio
from starlette.types import ASGIApp, Receive, Scope, Send

if TYPE_CHECKING:
    from ..observe.metrics import Metrics

log = logging.getLogger("rsagg.workers")

#: What a worker answers itself (GET and HEAD of these paths); the rest goes to the daemon.
LOCAL = re.compile(
    r"/[^/]+/(r/.*|resourcelist\.xml|resourcelist/[0-9]+-([0-9]+|end)\.xml|changelist\.xml|changelist/[0-9]+\.xml)"
    r"|/robots\.txt|/\.well-known/resourcesync",
    re.DOTALL,
)
#: A request target the daemon can be asked for over its loopback listener: origin-form (RFC 9112
#: §3.2.1), printable ASCII, no fragment. Anything else (absolute-form, ``*``, ``#``, control bytes) is
#: answered 400 here instead of being forwarded (it is no path of the daemon's).
_ORIGIN_FORM = re.compile(rb"/[\x21-\x7e]*")
#: Hop-by-hop headers (RFC 9110 §7.6.1): not forwarded either way.
HOP = frozenset((b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade",
                 b"proxy-connection", b"host", b"content-length"))  # fmt: skip
#: Not passed back: hop-by-hop, and what this process's server writes itself.
_NOT_BACK = (HOP - {b"content-length"}) | {b"date", b"server"}
#: Restart delays of a worker that keeps exiting (seconds).
BACKOFF = (1.0, 2.0, 5.0, 10.0, 30.0)
#: The daemon's private folder (in the temporary folder) where its workers' metric files go.
METRICS_PREFIX = "rsagg-worker-metrics-"


class Forwarding:
    """A worker's ASGI app: ``LOCAL`` requests to the publisher app, the others to the daemon."""

    def __init__(self, app: ASGIApp, daemon_url: str) -> None:
        self.app = app
        self.daemon = httpx.URL(daemon_url)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=5.0), follow_redirects=False)
        self.state = SimpleNamespace(fast_lane=getattr(getattr(app, "state", None), "fast_lane", None))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            try:
                await self.app(scope, receive, send)
            finally:
                await self.client.aclose()
            return
        if scope["type"] != "http":
            return
        if scope["method"] in ("GET", "HEAD") and LOCAL.fullmatch(scope["path"]):
            await self.app(scope, receive, send)
            return
        await self.forward(scope, receive, send)

    async def forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = bytearray()
        while True:  # (the server's guard bounds its size and time)
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        raw = scope.get("raw_path") or scope["path"].encode("utf-8", "surrogateescape")
        if scope.get("query_string"):
            raw += b"?" + scope["query_string"]
        if not _ORIGIN_FORM.fullmatch(raw) or b"#" in raw:
            await _plain(send, 400, b"bad request: the target must be a path (origin-form)\n")
            return
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in HOP]
        try:
            request = self.client.build_request(
                scope["method"], self.daemon.copy_with(raw_path=raw), headers=headers, content=bytes(body)
            )
        except (httpx.InvalidURL, UnicodeError, ValueError):  # what the check above let through
            await _plain(send, 400, b"bad request: the target is no URL path\n")
            return
        try:
            response = await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            log.warning("worker: forwarding %s %s failed: %s", scope["method"], scope["path"], exc)
            await _plain(send, 502, b"bad gateway: the daemon did not answer\n")
            return
        try:
            out = [(k, v) for k, v in response.headers.raw if k.lower() not in _NOT_BACK]
            await send({"type": "http.response.start", "status": response.status_code, "headers": out})
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await response.aclose()


async def _plain(send: Send, status: int, text: bytes) -> None:
    head = [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(text))]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": text})


# -- the daemon's side -------------------------------------------------------------------------------


def metrics_folder() -> tuple[Path, int]:
    """A new private folder for the workers' metric files and the descriptor of its lock (held while the
    daemon lives: ``flock``, released however the process ends). Folders whose daemon is gone (killed
    before it could remove its own) are removed first, so files neither pile up nor count twice."""
    tmp = Path(tempfile.gettempdir())
    for old in tmp.glob(METRICS_PREFIX + "*"):
        _remove_unlocked(old)
    # made under another name and renamed once locked: the sweep above never sees it unlocked
    new = Path(tempfile.mkdtemp(prefix="." + METRICS_PREFIX))
    fd = os.open(new, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        path = tmp / new.name[1:]
        new.rename(path)
    except OSError:
        os.close(fd)
        shutil.rmtree(new, ignore_errors=True)
        raise
    return path, fd


def _remove_unlocked(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:  # another user's (0700), or gone
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # a running daemon's
        os.close(fd)
        return
    try:
        shutil.rmtree(path, ignore_errors=True)
    finally:
        os.close(fd)


class Workers:
    """The daemon's worker processes: started, started again when one exits, stopped with the daemon.

    Their serving metrics: each worker runs prometheus-client in multiprocess mode
    (``PROMETHEUS_MULTIPROC_DIR``: a private folder of the daemon's, ``metrics_folder``), and the daemon's
    ``/metrics`` adds what they wrote to its own counts (``Metrics.count_workers``). The counter and
    histogram files of a worker that exited stay until the daemon stops, so no sum goes back."""

    def __init__(
        self,
        config_path: Path,
        count: int,
        host: str,
        port: int,
        daemon_url: str,
        metrics: Metrics | None = None,
    ) -> None:
        self.config_path, self.count, self.host, self.port = config_path, count, host, port
        self.daemon_url = daemon_url
        self.metrics = metrics
        self.procs: dict[int, trio.Process] = {}
        self.stopping = False
        self._told: set[int] = set()  # pids asked to exit (restart): their exit is expected
        self.metrics_dir: Path | None = None

    def command(self) -> list[str]:
        return [sys.executable, "-m", "aggregator.run.workers", "--config", str(self.config_path),
                "--host", self.host, "--port", str(self.port), "--daemon", self.daemon_url,
                "--watch-stdin"]  # fmt: skip

    async def run(self, nursery: trio.Nursery, stop_when: Callable[[], Awaitable[Any]]) -> None:
        lock = None
        try:
            self.metrics_dir, lock = metrics_folder()
        except OSError as exc:
            log.warning("workers: no folder for their metrics (%s): /metrics counts the daemon's only", exc)
        try:
            if self.metrics is not None and self.metrics_dir is not None:
                self.metrics.count_workers(str(self.metrics_dir))
            for i in range(self.count):
                nursery.start_soon(self._keep, i, name=f"worker {i + 1}")
            await stop_when()
            await self.stop()
        finally:
            if self.metrics is not None:
                self.metrics.count_workers(None)
            if self.metrics_dir is not None and lock is not None:
                shutil.rmtree(self.metrics_dir, ignore_errors=True)
                os.close(lock)

    async def _keep(self, i: int) -> None:
        failures = 0
        env = dict(os.environ)
        if self.metrics_dir is not None:
            env["PROMETHEUS_MULTIPROC_DIR"] = str(self.metrics_dir)
        while not self.stopping:
            # stdin: a pipe whose other end only this process holds; the worker stops at its end of file
            # (the daemon gone, however it died). Its write end is never written to.
            proc = await trio.lowlevel.open_process(self.command(), stdin=subprocess.PIPE, env=env)
            self.procs[i] = proc
            log.info("worker %d started (pid %d)", i + 1, proc.pid)
            started = trio.current_time()
            try:
                code = await proc.wait()
            finally:
                if proc.stdin is not None:
                    with contextlib.suppress(Exception):
                        await proc.stdin.aclose()
            self.procs.pop(i, None)
            self._exited(proc.pid)
            told = proc.pid in self._told
            self._told.discard(proc.pid)
            if self.stopping:
                return
            failures = 0 if told or trio.current_time() - started > 60 else failures + 1
            delay = BACKOFF[min(failures, len(BACKOFF) - 1)] if failures else 0.0
            if told:
                log.info("worker %d (pid %d) restarted (exit status %s)", i + 1, proc.pid, code)
            else:  # a worker exits only when told: whatever the status, this is a fault
                log.error(
                    "worker %d (pid %d) exited unexpectedly with status %s after %.1f s: again in %.0f s",
                    i + 1, proc.pid, code, trio.current_time() - started, delay,
                )  # fmt: skip
            await trio.sleep(delay)

    def _exited(self, pid: int) -> None:
        """What ``prometheus_client.multiprocess.mark_process_dead`` does for the "live" gauges, for all the
        gauges of a worker (the daemon shows none of them); its counters and histograms stay."""
        if self.metrics_dir is not None:
            for f in self.metrics_dir.glob(f"gauge_*_{pid}.db"):
                with contextlib.suppress(OSError):
                    f.unlink()

    def restart(self) -> None:
        """SIGTERM every worker: each is started again (with the configuration file as it is now)."""
        for proc in list(self.procs.values()):
            if proc.returncode is None:
                self._told.add(proc.pid)
                proc.send_signal(signal.SIGTERM)

    async def stop(self) -> None:
        self.stopping = True
        procs = list(self.procs.values())
        for proc in procs:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
        with trio.move_on_after(10):
            for proc in procs:
                await proc.wait()
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


# -- a worker process --------------------------------------------------------------------------------


async def _until_stdin_closes() -> str:
    """Returns once standard input reaches end of file: the daemon (the pipe's only writer) is gone."""
    stream = trio.lowlevel.FdStream(os.dup(0))
    try:
        while await stream.receive_some(4096):
            pass  # nothing is ever written; read and ignore
    finally:
        await stream.aclose()
    return "the daemon is gone (standard input closed)"


async def serve_worker(
    config_path: Path, host: str, port: int, daemon_url: str, *, watch_stdin: bool = False
) -> None:
    from ..config_cache import load_config_cached
    from .compose import worker_app
    from .serverguard import ServerLimits
    from .serving import serve

    config = load_config_cached(config_path)  # the daemon checked it: from its snapshot, without pydantic
    with worker_app(config) as (app, metrics):
        limits = ServerLimits(
            max_connections_per_client=config.server.max_connections_per_client,
            on_refused=metrics.server_refused_hook,
        )
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            stop = trio.Event()

            async def stop_on_signal() -> None:
                async for signum in signals:
                    log.info("worker (pid %d): %s, stopping", os.getpid(), signal.Signals(signum).name)
                    stop.set()
                    return

            async def stop_when_orphaned() -> None:
                why = await _until_stdin_closes()
                log.warning("worker (pid %d): %s, stopping", os.getpid(), why)
                stop.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(stop_on_signal)
                if watch_stdin:
                    nursery.start_soon(stop_when_orphaned)
                await nursery.start(
                    partial(serve, Forwarding(app, daemon_url), host, port, shutdown_trigger=stop.wait,
                            limits=limits, reuse_port=True)
                )  # fmt: skip
                await stop.wait()
                nursery.cancel_scope.deadline = trio.current_time() + 5


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m aggregator.run.workers", description="an rsagg serving worker"
    )
    p.add_argument("--config", required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--daemon", required=True, help="the daemon's loopback URL for what a worker forwards")
    p.add_argument(
        "--watch-stdin", action="store_true", help="stop when standard input closes (the daemon's pipe)"
    )
    args = p.parse_args(argv)
    from ..observe.logs import setup_logging

    setup_logging(os.environ.get("RSAGG_LOG_LEVEL", "info"), os.environ.get("RSAGG_LOG_FORMAT", "text"))
    serve = partial(serve_worker, watch_stdin=args.watch_stdin)
    trio.run(serve, Path(args.config), args.host, args.port, args.daemon)
    return 0


if __name__ == "__main__":
    sys.exit(main())
