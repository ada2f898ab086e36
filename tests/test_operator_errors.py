"""Every operator mistake ends in one message naming the configuration key (or option), exit 1 or 2, and
no traceback: each command run against each broken configuration and environment (a table)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from aggregator.cli import build_parser, main
from aggregator.store.lock import store_lock

# Runs the rsagg command as processes (a full disk, a lost store, a second harvester).
pytestmark = pytest.mark.slow

SOURCE = '[[sources]]\nname = "a"\nurl = "http://127.0.0.1:9/rs/capabilitylist.xml"\n'


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port something else listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(tmp_path: Path, case: str, port: int) -> tuple[Path, str]:
    """(config file, the key or option the message must name) of a broken configuration."""
    listen = f'[server]\nlisten = "127.0.0.1:{port}"\n'
    store = f'[store]\npath = "{tmp_path / "data"}"\n'
    (tmp_path / "afile").write_text("a file where a folder is expected\n")
    afile = tmp_path / "afile"
    s3 = f'{listen}{store}backend = "s3"\n'
    text, key = {
        "store under /proc": (f'{listen}[store]\npath = "/proc/rsagg-test-data"\n{SOURCE}', "store.path"),
        "store below a file": (f'{listen}[store]\npath = "{afile / "data"}"\n{SOURCE}', "store.path"),
        "store is a file": (f'{listen}[store]\npath = "{afile}"\n{SOURCE}', "store.path"),
        "unknown plugin": (f"{listen}{store}[plugins.nosuch]\nx = 1\n{SOURCE}", "plugins.nosuch"),
        "s3 without boto3": (f'{s3}[store.settings]\nbucket = "b"\n{SOURCE}', "store.backend"),
        "s3 without bucket": (f"{s3}{SOURCE}", "store.settings"),
        "empty file": ("", "sources"),
        "no sources": (f"{listen}{store}", "sources"),
        "port in use": (f"{listen}{store}{SOURCE}", "server.listen"),
    }[case]  # fmt: skip
    path = tmp_path / "rsagg.toml"
    path.write_text(text)
    return path, key


CASES = [
    "store under /proc",
    "store below a file",
    "store is a file",
    "unknown plugin",
    "s3 without boto3",
    "s3 without bucket",
    "empty file",
    "no sources",
    "port in use",
]
COMMANDS = [["harvest", "--once"], ["run"], ["audit"], ["status"], ["gc"], ["retries"]]
#: Where a command has nothing wrong to report: gc works on a store whose sources were all removed
#: (docs/operations.md) and exits 0.
FINE = {("no sources", "gc"), ("empty file", "gc")}
#: Only ``run`` listens: the other commands are not run against a busy port.
NOT_CONCERNED = {("port in use", c[0]) for c in COMMANDS if c != ["run"]}


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except BaseException as exc:  # a traceback would reach the operator
        pytest.fail(f"rsagg {' '.join(argv)} raised {type(exc).__name__}: {exc}")
    out, err = capsys.readouterr()
    return code, out + err


@pytest.mark.parametrize("case", CASES)
def test_every_command_names_the_broken_key(
    case: str,
    tmp_path: Path,
    busy_port: int,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path, key = _config(tmp_path, case, busy_port)
    if case == "s3 without boto3":
        import rsagg_s3

        monkeypatch.setattr(rsagg_s3, "boto3", None)
    for command in COMMANDS:
        if (case, command[0]) in NOT_CONCERNED:
            continue
        code, text = _run([*command, "-c", str(path)], capsys)
        if (case, command[0]) in FINE:
            assert code == 0, text
            continue
        assert code in (1, 2), f"{command}: exit {code}: {text}"
        assert "Traceback" not in text
        assert key in text, f"{command}: {key!r} not named in: {text}"
        assert len(text.strip().splitlines()[-1]) < 400  # one line, not a dump


@pytest.mark.parametrize("case", ["port in use", "data is a file", "data under /proc"])
def test_demo_names_the_option(
    case: str, tmp_path: Path, busy_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "afile").write_text("x")
    argv, named = {
        "port in use": (["demo", "--port", str(busy_port), "--resources", "5"], "--port"),
        "data is a file": (["demo", "--port", "0", "--data", str(tmp_path / "afile")], "--data"),
        "data under /proc": (["demo", "--port", "0", "--data", "/proc/rsagg-test-demo"], "--data"),
    }[case]
    code, text = _run(argv, capsys)
    assert code in (1, 2) and "Traceback" not in text and named in text, text


def test_harvest_refused_while_another_process_harvests_the_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = _config(tmp_path, "port in use", _free_port())  # a good configuration
    data = tmp_path / "data"
    data.mkdir()
    with store_lock(data, "rsagg run"):
        for command in (["harvest", "--once"], ["gc", "--grace", "0"], ["run"]):
            code, text = _run([*command, "-c", str(path)], capsys)
            assert code == 1 and "store.path" in text and "rsagg run (pid" in text, text
        code, text = _run(["gc", "-c", str(path)], capsys)  # with its grace period gc needs no lock
        assert code == 0 and "removed 0 unreferenced blob(s)" in text, text
    # Serving alone does not take the lock; the lock is gone with its holder.
    with store_lock(data, "rsagg harvest --once"):
        pass


def test_lock_released_when_its_holder_dies(tmp_path: Path) -> None:
    """A killed holder leaves nothing stuck: the kernel drops a flock with the process."""
    code = (
        "import os, sys\nfrom pathlib import Path\nfrom aggregator.store.lock import store_lock\n"
        "with store_lock(Path(sys.argv[1]), 'x'):\n    os._exit(0)\n"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=60)
    with store_lock(tmp_path, "next"):
        assert "next (pid" in (tmp_path / "rsagg.lock").read_text()


def test_global_options_before_or_after_the_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = _config(tmp_path, "port in use", _free_port())
    for argv in (
        ["--log-level", "debug", "status", "-c", str(path)],
        ["-c", str(path), "--log-format", "json", "status"],
        ["status", "-c", str(path), "--log-level", "warning"],
    ):
        code, text = _run(argv, capsys)
        assert code == 0 and text.startswith("SOURCE"), (argv, text)
    code, text = _run(["status"], capsys)
    assert code == 2 and "-c/--config FILE is required" in text
    args = build_parser().parse_args(["--log-level", "error", "status", "-c", "x"])
    assert args.log_level == "error" and args.config == "x"
    args = build_parser().parse_args(["-c", "a", "status", "-c", "b"])
    assert args.config == "b"  # after the command wins


def test_help_lists_every_command_on_whole_lines() -> None:
    env = {**os.environ, "COLUMNS": "100"}
    out = subprocess.run(
        [sys.executable, "-m", "aggregator", "--help"], capture_output=True, text=True, env=env, timeout=60
    ).stdout
    block = out.split("COMMAND\n", 2)[-1].split("\noptions:")[0]
    entries = " ".join(block.split())
    for name in ("validate", "harvest", "audit", "status", "retries", "gc", "run", "demo", "plugins"):
        assert f" {name} " in f" {entries} "
    # Every summary is a whole sentence: none stops mid-phrase as the first docstring line used to.
    assert "each published set." in entries and "and each published " not in entries.replace(
        "and each published set.", ""
    )


def test_demo_log_lines_say_what_they_mean(tmp_path: Path) -> None:
    """The start-up line names where rsagg listens and what it publishes as, each once."""
    run = subprocess.run(
        [sys.executable, "-m", "aggregator", "demo", "--port", "0", "--resources", "5", "--duration", "2",
         "--data", str(tmp_path / "demo")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    line = next(x for x in run.stderr.splitlines() if "listening on" in x)
    assert re.search(r"listening on http://127\.0\.0\.1:\d+, publishing as http://127\.0\.0\.1:\d+", line)
    assert "serving http" not in run.stderr and "does not continue None" not in run.stderr
    assert (tmp_path / "demo" / "rsagg.lock").exists()  # the demo's store was locked while it ran


def test_discovery_error_says_each_reason_once() -> None:
    from aggregator.harvest.discovery import DiscoveryError

    why = "network: ConnectError: all attempts to connect to 127.0.0.1:9 failed"
    tried = [(f"http://127.0.0.1:9{p}", why) for p in ("/x", "/.well-known/resourcesync", "/robots.txt")]
    text = str(DiscoveryError("http://127.0.0.1:9/x", tried))
    assert text.count(why) == 1 and all(u in text for u, _ in tried)


def test_sync_left_by_a_dead_process_shows_as_interrupted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from aggregator.store.state import State

    path, _ = _config(tmp_path, "port in use", _free_port())
    data = tmp_path / "data"
    data.mkdir()
    with State(data / "state.db") as state:
        state.upsert_source("a", "http://127.0.0.1:9/rs/capabilitylist.xml")
        state.set_source_status("a", state="syncing", progress_done=5, progress_total=10)

    def shown() -> dict:
        assert main(["status", "-c", str(path), "--json"]) == 0
        return json.loads(capsys.readouterr().out)["sources"][0]

    assert shown()["state"] == "syncing"  # no process ever locked this store: nothing known
    with store_lock(data, "rsagg harvest"):
        row = shown()
        assert row["state"] == "syncing" and row["progress"]["done"] == 5  # its harvester runs
    row = shown()  # the harvester is gone, the row still says syncing: it was interrupted
    assert row["state"] == "interrupted" and row["progress"] is None
    assert main(["status", "-c", str(path)]) == 0
    assert "the next harvest resumes it" in capsys.readouterr().out
    # A status probe holds the lock shared for an instant: a harvester starting then waits, not refuses.
    import fcntl
    import threading

    fd = os.open(data / "rsagg.lock", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    threading.Timer(0.3, os.close, [fd]).start()
    with store_lock(data, "rsagg harvest"):
        pass


def test_docs_document_every_command_and_its_options() -> None:
    """Each command and each of its options appears in the operator's reference (docs/operations.md, the
    demo's options in docs/install.md)."""
    docs = Path(__file__).parent.parent / "docs"
    readme = (docs / "operations.md").read_text() + (docs / "install.md").read_text()
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, p in sub.choices.items():
        assert f"`rsagg {name}" in readme, name
        for action in p._actions:
            longest = max(action.option_strings, key=len, default=None)
            if longest and longest not in (
                "--help",
                "--config",
                "--log-level",
                "--log-format",
                "--max-lines",
            ):
                assert longest in readme, f"rsagg {name} {longest} is not in docs/operations.md"
    for phrase in (
        "--port 0",
        "-c CONFIG` is always needed",
        "## Lag",
        "## One harvesting process per store",
    ):
        assert phrase in readme, phrase


# ---------------------------------------------------------------------------------------------------
# Runtime failures: the machine, not the configuration. Each is caused for real (a read-only file, a
# full filesystem, the store folder removed, the state's server stopped) at a point of the harvest's own
# making (the upstream's Nth resource request), never at a moment of the clock.


class _OnNthResource:
    """ASGI: runs ``action`` (once, in a thread, before answering) when the upstream is asked for its
    ``n``th resource: a failure in the middle of a baseline."""

    def __init__(self, app: object, n: int, action: object) -> None:
        self.app, self.n, self.action, self.seen = app, n, action, 0

    async def __call__(self, scope: dict, receive: object, send: object) -> None:
        if scope["type"] == "http" and "/res/" in scope["path"] and self.action is not None:
            self.seen += 1
            if self.seen == self.n:
                import trio

                action, self.action = self.action, None
                await trio.to_thread.run_sync(action)
        await self.app(scope, receive, send)  # type: ignore[operator]


@contextlib.contextmanager
def _read_only(path: Path) -> Iterator[str]:
    """``path`` made read-only for rsagg: what a restore or a tool run as root leaves. Root writes
    through a mode, so as root the file is made immutable (chattr +i), else its mode is 0444."""
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
            pytest.skip("chattr +i is not supported on this filesystem (and root writes through a mode)")
        try:
            yield "chattr +i"
        finally:
            subprocess.run(["chattr", "-i", str(path)], check=True)
    else:
        path.chmod(0o444)
        try:
            yield "chmod 0444"
        finally:
            path.chmod(0o644)


@contextlib.contextmanager
def _small_filesystem(folder: Path, size: str) -> Iterator[dict]:
    """``folder`` on a filesystem of ``size`` (a tmpfs; root only) that a harvest fills: the options
    for ``subprocess.run``. Where mounting is not allowed, a file size limit (RLIMIT_FSIZE: Python
    ignores SIGXFSZ, so a write past it fails with EFBIG) on the harvesting process instead."""
    folder.mkdir(parents=True, exist_ok=True)
    mounted = (
        os.geteuid() == 0
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True
        ).returncode
        == 0
    )
    if mounted:
        try:
            yield {}
        finally:
            subprocess.run(["umount", "-l", str(folder)], check=True)
        return
    import resource

    limit = 1_000_000

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    yield {"preexec_fn": cap}


def _rsagg(*argv: str, config: Path, timeout: float = 180, **options: object) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent), "COLUMNS": "200"}
    done = subprocess.run(
        [sys.executable, "-m", "aggregator", *argv, "-c", str(config)],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=config.parent, **options,  # type: ignore[arg-type]
    )  # fmt: skip
    return done.returncode, done.stdout + done.stderr


def _says_it_in_one_line(code: int, text: str, command: str, named: str, what: tuple[str, ...]) -> None:
    """Exit 1; no traceback or exception group; every line short; the last names the file or URL and
    what happened, as ``rsagg COMMAND: ...``."""
    assert code == 1, text
    assert "Traceback" not in text and "Exception Group" not in text and "\n  |" not in text, text
    lines = text.strip().splitlines()
    assert all(len(line) < 500 for line in lines), text  # a line each, not a dump
    last = lines[-1]
    assert last.startswith(f"rsagg {command}: ") and named in last, text
    assert any(w in last for w in what), text


RUNTIME = [
    "read-only state",
    "full disk",
    "store disappears",
    pytest.param("postgresql goes away", marks=pytest.mark.slow),  # a PostgreSQL server of its own
]


@pytest.mark.parametrize("case", RUNTIME)
async def test_runtime_failures_are_one_line(case: str, tmp_path: Path) -> None:
    import trio

    from aggregator.run.serving import serving
    from aggregator.testing.upstream import Upstream

    from . import pgserver

    data = tmp_path / "data"
    up = Upstream(resource_dump=False, change_dump=False)
    up.bulk_create(60, size=64 * 1024)  # 3.8 MB: more than the small filesystem holds
    up.create("big.bin", bytes(2 * 2**20))  # and one file more than the file size limit allows
    stack = contextlib.ExitStack()
    options: dict = {}
    state = ""
    action = None
    if case == "full disk":
        options = stack.enter_context(_small_filesystem(data, "1m"))
    elif case == "store disappears":
        action = partial(shutil.rmtree, data)
    elif case == "postgresql goes away":
        pg = stack.enter_context(pgserver.running())  # a server of its own: this test stops it
        state = f'state = "{pg.fresh_url()}"\n'
        action = pg.pause
    with stack:
        app = _OnNthResource(up.app(), 20, action)
        async with serving(app, "127.0.0.1", 0) as base:
            up.base_url = base
            config = tmp_path / "rsagg.toml"
            config.write_text(
                f'[server]\nlisten = "127.0.0.1:{_free_port()}"\n'
                f'[store]\npath = "{data}"\n{state}'
                "[harvest]\nretries = 1\nbackoff_base = 0.01\ntimeout = 10\n"
                f'[[sources]]\nname = "a"\nurl = "{base}/.well-known/resourcesync"\n'
            )
            harvest = partial(_rsagg, "harvest", "--once", config=config, **options)
            if case == "read-only state":
                app.action = None
                code, text = await trio.to_thread.run_sync(harvest)
                assert code == 0, text
                with _read_only(data / "state.db"):
                    for command in (["harvest", "--once"], ["run"]):  # refused at start, before any work
                        code, text = await trio.to_thread.run_sync(partial(_rsagg, *command, config=config))
                        _says_it_in_one_line(
                            code, text, command[0], str(data / "state.db"), ("readonly", "read-only")
                        )
                        assert "writable by the user rsagg runs as" in text
                    for command in (["status"], ["audit"]):  # what only reads works on a read-only copy
                        code, text = await trio.to_thread.run_sync(partial(_rsagg, *command, config=config))
                        assert code == 0, text
                return
            code, text = await trio.to_thread.run_sync(harvest)
    named, what = {
        "full disk": (str(data), ("ENOSPC", "EFBIG", "disk is full")),
        "store disappears": (str(data), ("ENOENT", "disk I/O error", "unable to open")),
        "postgresql goes away": (f"127.0.0.1:{pg.port}" if state else "", ("unavailable",)),
    }[case]
    _says_it_in_one_line(code, text, "harvest", named, what)
    assert app.action is None  # the failure came mid-run, as meant


async def test_the_daemon_keeps_serving_through_a_full_disk(tmp_path: Path) -> None:
    """``rsagg run`` on a store that fills up: each sync that meets it fails with one line naming the
    store; the daemon keeps running and serving what it holds (no traceback, no exit)."""
    import httpx
    import trio

    from aggregator.testing.upstream import Upstream

    data = tmp_path / "data"
    up = Upstream(resource_dump=False, change_dump=False)
    up.bulk_create(60, size=64 * 1024)
    up.create("big.bin", bytes(2 * 2**20))
    port = _free_port()
    log_path = tmp_path / "daemon.log"
    with _small_filesystem(data, "1m") as options:
        async with up.serving() as base, httpx.AsyncClient(timeout=30) as client:
            config = tmp_path / "rsagg.toml"
            config.write_text(
                f'[server]\nlisten = "127.0.0.1:{port}"\n[store]\npath = "{data}"\n'
                "[harvest]\njitter = 0\nretries = 1\nbackoff_base = 0.01\ntimeout = 10\n"
                f'[[sources]]\nname = "a"\nurl = "{base}/.well-known/resourcesync"\ninterval = 0.5\n'
            )
            env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
            with log_path.open("ab") as log:
                daemon = await trio.lowlevel.open_process(
                    [sys.executable, "-m", "aggregator", "run", "-c", str(config)],
                    env=env, stdout=log, stderr=log, **options,
                )  # fmt: skip
            try:
                with trio.fail_after(120):  # two syncs meet the full disk: the daemon survives each
                    while log_path.read_text().count("sync failed") < 2:
                        assert daemon.returncode is None, log_path.read_text()
                        await trio.sleep(0.2)
                home = await client.get(f"http://127.0.0.1:{port}/")
                status = await client.get(f"http://127.0.0.1:{port}/status.json")
                assert daemon.returncode is None
            finally:
                daemon.terminate()
                with trio.move_on_after(60):
                    await daemon.wait()
                if daemon.returncode is None:
                    daemon.kill()
    text = log_path.read_text()
    assert home.status_code == 200, text
    assert "Traceback" not in text and "Exception Group" not in text, text
    failed = [line for line in text.splitlines() if "sync failed" in line]
    assert all(str(data) in line and len(line) < 400 for line in failed), failed
    assert any(w in failed[0] for w in ("ENOSPC", "EFBIG", "disk is full")), failed
    assert status.status_code == 200, text  # the failure is what the status shows for the source
    (source,) = [s for s in status.json()["sources"] if s["name"] == "a"]
    assert source["state"] == "error" and str(data) in (source["last_error"] or ""), source


def _machine_failures(where: str) -> list[BaseException]:
    """Every failure errors.py knows how to say, as the OS, SQLite and trio raise them."""
    import sqlite3

    from aggregator import errors

    found: list[BaseException] = [OSError(n, os.strerror(n), f"{where}/blobs/x") for n in errors._OS_FIXES]
    found += [OSError(n, os.strerror(n)) for n in errors._OS_FIXES]  # a write() names no file
    found += [sqlite3.OperationalError(pattern) for pattern, _ in errors._SQLITE_FIXES]
    found += [BaseExceptionGroup("nursery", [ValueError("beside"), e]) for e in list(found)]
    return found


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_every_machine_failure_is_one_line_wherever_it_is_met(
    fmt: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The class, not the cases: each errno and SQLite message errors.py maps, bare or in an exception
    group, is one line naming the file (or the place given) with its fix, in the CLI's last resort and
    in a log record written with its traceback (``log.exception`` in a loop that survives it)."""
    import json
    import logging

    from aggregator import cli
    from aggregator.errors import environmental_leaf, operator_line
    from aggregator.observe.logs import setup_logging

    where = str(tmp_path / "store")
    setup_logging("info", fmt)
    for exc in _machine_failures(where):
        leaf = environmental_leaf(exc)
        assert leaf is not None, exc
        line = operator_line(leaf, where)
        assert "\n" not in line and where in line and "(" in line, line  # the place and the fix
        assert cli._expected(exc) is leaf
        try:
            raise exc
        except BaseException:
            logging.getLogger("rsagg.test").exception("round failed")
        err = capsys.readouterr().err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        text = json.loads(err)["message"] if fmt == "json" else err
        assert "round failed: " in text and line.split(": ", 1)[-1] in text, text
        if getattr(leaf, "filename", None):  # a record names the file when the error does
            assert where in text, text
    # a bug keeps its traceback
    try:
        raise ValueError("a bug")
    except ValueError:
        logging.getLogger("rsagg.test").exception("round failed")
    assert "Traceback" in capsys.readouterr().err or fmt == "json"
