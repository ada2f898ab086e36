"""What the harvest benchmarks share: ``rsagg harvest --once`` of one Source, configured and run as a child
process in a fresh folder, timed from start to exit, with the child's resource usage from ``os.wait4``.

Used by bench_harvest.py (rsagg next to resync) and bench_cluster.py (SQLite next to PostgreSQL).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: rsagg's ``per_host`` and ``workers`` where a benchmark compares rsagg with itself (bench_cluster.py:
#: SQLite next to PostgreSQL); its polite defaults (8 requests at a time per host) would cap a 50 ms
#: upstream at 160 resources/s. Next to another tool (bench_harvest.py) each runs with its defaults.
PER_HOST = 64
HARVEST_ONCE = [sys.executable, "-m", "aggregator", "harvest", "--once", "-c", "rsagg.toml",
                "--log-level", "warning"]  # fmt: skip


def run_cli(command: list[str]) -> int:
    """``aggregator.cli.main(command)`` as a child process's whole work (the runners ``_opcodes.py`` and
    ``_phases.py``, which set up their measure before and read it after): its exit code, a SystemExit's
    included."""
    from aggregator.cli import main

    code: int | str | None
    try:
        code = main(command)
    except SystemExit as exc:
        code = exc.code
    return code if isinstance(code, int) else (0 if code is None else 1)


def third_party_plugins() -> list[str]:
    """Plugins installed from outside rsagg (entry points), e.g. the test suite's example plugin."""
    from importlib.metadata import entry_points

    from aggregator.plugins.manager import GROUP

    return sorted({ep.name for ep in entry_points(group=GROUP)})


def plugins_off() -> str:
    """Configuration tables turning every third-party plugin off: rsagg as deployed, its own plugins
    only, whatever this environment has installed (the development one holds the test suite's example
    plugin, which is told of every stored resource: 50-90 µs a resource of a harvest, in single runs)."""
    return "".join(f"\n[plugins.{json.dumps(name)}]\nenabled = false\n" for name in third_party_plugins())


@dataclass
class Finished:
    """A child process that ran to its end."""

    wall: float  # seconds from start to exit
    code: int  # exit code
    usage: resource.struct_rusage

    @property
    def rss_mb(self) -> float:
        return self.usage.ru_maxrss / 1024  # Linux: ru_maxrss in KiB

    @property
    def cpu(self) -> float:
        return self.usage.ru_utime + self.usage.ru_stime


def run_child(cmd: list[str], cwd: Path, name: str, root: Path = ROOT) -> Finished:
    """Run ``cmd`` in ``cwd``, ``root`` (this checkout) first on PYTHONPATH; output goes to NAME.out and
    NAME.err there."""
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with (cwd / f"{name}.out").open("wb") as out, (cwd / f"{name}.err").open("wb") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    return Finished(wall, proc.returncode, usage)


def harvest_once(
    folder: Path, base: str, *, state: str = "", per_host: int | None = PER_HOST, root: Path = ROOT
) -> Finished:
    """``rsagg harvest --once`` of the Source at ``base`` into a fresh store folder ``folder``
    (``rsagg.toml``, the store in ``data``); ``state``: a ``[store] state`` location ("": SQLite);
    ``per_host``: ``harvest.per_host`` and ``harvest.workers`` (None: rsagg's defaults); ``root``: the
    checkout whose rsagg runs (another one to compare with: bench_harvest.py ``--before``). Third-party
    plugins are off (``plugins_off``)."""
    folder.mkdir(parents=True)
    line = f'state = "{state}"\n' if state else ""
    harvest = f"\n[harvest]\nper_host = {per_host}\nworkers = {per_host}\n" if per_host else ""
    (folder / "rsagg.toml").write_text(
        f'[store]\npath = "data"\n{line}{harvest}\n[[sources]]\nname = "bench"\nurl = "{base}/"\n'
        + plugins_off()
    )
    return run_child(HARVEST_ONCE, folder, "rsagg", root)


async def lifespan(scope, receive, send) -> bool:
    """Answer an ASGI lifespan scope (startup, then shutdown) for a benchmark's upstream app; True when
    ``scope`` was one (the app then has nothing more to do)."""
    if scope["type"] != "lifespan":
        return False
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return True


def serve_until_sigterm(app, port: int = 0) -> int:
    """Child mode of a benchmark's upstream: serve ``app`` on 127.0.0.1 (``port``, 0 = any), print its
    base URL once listening, stop on SIGTERM."""
    import signal

    import trio

    sys.path.insert(0, str(ROOT))
    from aggregator.run.serving import serve

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(lambda task_status: serve(app, port=port, task_status=task_status))
            print(url, flush=True)
            with trio.open_signal_receiver(signal.SIGTERM) as signals:
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    return

    trio.run(main)
    return 0
