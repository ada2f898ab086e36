"""A serving worker (``server.workers``) exits only when told: SIGTERM from the daemon, or the daemon gone.

It once exited with status 0 about 11 s after start: ``PR_SET_PDEATHSIG`` fires when the *thread* that
started the child ends, and trio starts processes from its cached worker threads, which end after 10 s
idle (``trio._core._thread_cache.IDLE_TIMEOUT``: the test holds those threads until the worker serves,
then lets them end at once, so it needs no 10 s wait).
"""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

import pytest
import trio
import trio._core._thread_cache as thread_cache

from aggregator.run.workers import Workers

# Starts and kills worker processes.
pytestmark = pytest.mark.slow

GUARD = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(tmp_path: Path, port: int) -> Path:
    config = tmp_path / "rsagg.toml"
    config.write_text(
        f'[server]\nlisten = "127.0.0.1:{port}"\nbase_url = "http://127.0.0.1:{port}"\n'
        f'[store]\npath = "{tmp_path / "data"}"\n[[sources]]\nname = "up"\nurl = "http://127.0.0.1:9/"\n'
    )
    return config


async def robots(port: int) -> bool:
    """Whether a fresh connection to ``port`` gets robots.txt (a worker answers it itself)."""
    try:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
    except OSError:
        return False
    try:
        await stream.send_all(b"GET /robots.txt HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = b""
        with trio.move_on_after(GUARD):
            while chunk := await stream.receive_some(65536):
                data += chunk
        return data.startswith(b"HTTP/1.1 200")
    except OSError:
        return False
    finally:
        await stream.aclose()


def trio_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("Trio thread")}


async def test_a_worker_outlives_the_thread_that_started_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.INFO, logger="rsagg.workers")
    monkeypatch.setattr(thread_cache, "IDLE_TIMEOUT", 600)  # the spawning thread stays, for now
    port = free_port()
    workers = Workers(write_config(tmp_path, port), 1, "127.0.0.1", port, "http://127.0.0.1:9")
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(workers.run, nursery, stop.wait)
        try:
            with trio.fail_after(GUARD):
                while not await robots(port):
                    await trio.sleep(0.1)
            proc = workers.procs[0]
            spawners = trio_threads()
            assert spawners
            # Now let every idle thread end, as trio's would after 10 s idle: each is given one short job
            # (all at once, so each takes one), after which it waits IDLE_TIMEOUT for the next and ends.
            monkeypatch.setattr(thread_cache, "IDLE_TIMEOUT", 0.05)
            async with trio.open_nursery() as kick:
                for _ in range(len(spawners) + 2):
                    kick.start_soon(partial(trio.to_thread.run_sync, time.sleep, 0.2))
            with trio.fail_after(GUARD):  # the threads trio started it from have ended
                while spawners & trio_threads():
                    await trio.sleep(0.05)
            await trio.sleep(1.0)  # a SIGTERM at the thread's end would have stopped it by now
            assert proc.returncode is None and await robots(port)
            assert workers.procs[0] is proc
            assert "exited" not in caplog.text
        finally:
            stop.set()
    assert proc.returncode is not None


class _Quitter(Workers):
    """Workers whose process exits 0 at once, as the worker that "exited after 11 s" did."""

    def command(self) -> list[str]:
        return [sys.executable, "-c", "pass"]


async def test_an_unexpected_worker_exit_is_an_error_and_the_worker_is_started_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.INFO, logger="rsagg.workers")
    workers = _Quitter(tmp_path / "none.toml", 1, "127.0.0.1", 1, "http://127.0.0.1:9")
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(workers.run, nursery, stop.wait)
        with trio.fail_after(GUARD):
            while caplog.text.count("worker 1 started") < 2:
                await trio.sleep(0.05)
        stop.set()
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert errors and "exited unexpectedly with status 0" in errors[0].getMessage()


async def test_a_worker_told_to_restart_is_no_error_and_one_whose_daemon_is_gone_stops(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.INFO, logger="rsagg.workers")
    port = free_port()
    config = write_config(tmp_path, port)
    workers = Workers(config, 1, "127.0.0.1", port, "http://127.0.0.1:9")
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(workers.run, nursery, stop.wait)
        with trio.fail_after(GUARD):
            while not await robots(port):
                await trio.sleep(0.1)
            first = workers.procs[0]
            workers.restart()
            while "restarted" not in caplog.text:
                await trio.sleep(0.05)
        stop.set()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert first.returncode == 0

    # the daemon gone (its end of the pipe closed, however it died): the worker stops by itself
    log = (tmp_path / "worker.log").open("wb")
    proc = await trio.lowlevel.open_process(workers.command(), stdin=subprocess.PIPE, stdout=log, stderr=log)
    try:
        with trio.fail_after(GUARD):
            while not await robots(port):
                await trio.sleep(0.1)
            assert proc.stdin is not None
            await proc.stdin.aclose()
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
        log.close()
    assert "the daemon is gone" in (tmp_path / "worker.log").read_text()
