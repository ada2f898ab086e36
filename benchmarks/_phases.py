"""What each part of a sync costs in CPU, at full speed: ``bench_many_sources.py --phases``.

Run as a child process in place of ``python -m aggregator``::

    python benchmarks/_phases.py --out phases.json -- harvest --once -c rsagg.toml

It wraps a few functions of the harvest (``LOOP_PHASES``) so that each call adds the CPU time of the thread
that runs it (``time.thread_time``, across its awaits) to its phase, and every state write the CPU it
takes in the state writer's thread, by the function it runs (the writes riding along with it included).
It runs the command, then writes to ``--out`` those sums, the process's CPU, its I/O counters
(``/proc/self/io``: write syscalls, bytes) and its context switches (``getrusage``). The command's exit code
is this process's.

Why not a profiler or the opcode counter: both slow the harvest (cProfile about twice, the counter six
times), which changes how its tasks and threads wait; a wrapper costs a few microseconds a call.

Valid only when one sync runs at a time: an await's CPU is then that sync's. The benchmark runs both cases
with ``per_host = 1`` and ``workers = 1`` (printed), and this runner admits one sync per request slot of a
host (``admission.PER_SLOT = 1``). The phases nest (a baseline is part of its sync); the table says how.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _harness import run_cli

#: (label, module, attribute): async functions (or async generator functions, each step counted) of the
#: event loop's thread, wrapped where their callers look them up. Indented labels are parts of the one
#: above them.
LOOP_PHASES = (
    ("a sync, once admitted", "aggregator.harvest.source", "_sync_admitted"),
    ("  discovery", "aggregator.harvest.source", "discover"),
    ("  the baseline", "aggregator.harvest.source", "run_baseline"),
    ("    the Resource List's entries", "aggregator.harvest.baseline", "resource_list_entries"),
    ("    pipeline: state read at its start", "aggregator.harvest.pipeline", "Pipeline._prime"),
    ("    pipeline: a resource fetched", "aggregator.harvest.pipeline", "Pipeline._work_one"),
    ("    pipeline: a batch committed", "aggregator.harvest.pipeline", "Pipeline._flush_part"),
)
#: The loop's side of every state write (its thread hop), by the function written, under this prefix.
WRITE_LOOP = "  state write, event loop: "
#: The state writer's thread, by the function written.
WRITE_THREAD = "state write, writer thread: "


@dataclass
class Sums:
    """CPU seconds and calls, by phase."""

    cpu: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, label: str, seconds: float) -> None:
        self.cpu[label] = self.cpu.get(label, 0.0) + seconds
        self.calls[label] = self.calls.get(label, 0) + 1


def timed_async(fn: Callable, label: str, sums: Sums) -> Callable:
    """``fn`` (a coroutine function) adding the CPU of its thread while it runs, awaits included."""

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return await fn(*args, **kwargs)
        finally:
            sums.add(label, time.thread_time() - start)

    return wrapper


def timed_agen(fn: Callable, label: str, sums: Sums) -> Callable:
    """``fn`` (an async generator function) adding the CPU of each of its steps (one call per step)."""

    class Steps:
        def __init__(self, agen: Any) -> None:
            self._agen = agen

        def __aiter__(self) -> Steps:
            return self

        async def __anext__(self) -> Any:
            start = time.thread_time()
            try:
                return await self._agen.__anext__()
            finally:
                sums.add(label, time.thread_time() - start)

        async def aclose(self) -> None:
            await self._agen.aclose()

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Steps:
        return Steps(fn(*args, **kwargs))

    return wrapper


def install(sums: Sums) -> list[str]:
    """Wrap the phases and the state writes; returns the phases this checkout lacks (left out)."""
    import inspect

    missing = []
    for label, module, attr in LOOP_PHASES:
        owner: Any = importlib.import_module(module)
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        fn = getattr(owner, name, None)
        if fn is None:
            missing.append(f"{module}.{attr}")
            continue
        wrap = timed_agen if inspect.isasyncgenfunction(fn) else timed_async
        setattr(owner, name, wrap(fn, label, sums))
    from aggregator.harvest import context

    naming = {"name": "?"}  # set by a write just before it enters its hop (no await in between)
    write, run = context.HarvestContext.write, context._SharedHops.run

    @functools.wraps(write)
    async def timed_write(self: Any, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        name = getattr(fn, "__name__", type(fn).__name__)
        naming["name"] = name
        start = time.thread_time()
        try:
            return await write(self, fn, *args, **kwargs)
        finally:
            sums.add(WRITE_LOOP + name, time.thread_time() - start)

    @functools.wraps(run)
    async def timed_run(self: Any, call: Callable[[], Any]) -> Any:
        label = WRITE_THREAD + naming["name"]

        def timed_call() -> Any:
            start = time.thread_time()
            try:
                return call()
            finally:
                sums.add(label, time.thread_time() - start)

        return await run(self, timed_call)

    context.HarvestContext.write = timed_write  # type: ignore[method-assign]
    context._SharedHops.run = timed_run  # type: ignore[method-assign]
    from aggregator.harvest import admission

    admission.PER_SLOT = 1  # one sync per request slot: with per_host = 1, one at a time
    return missing


def proc_io(text: str) -> dict[str, int]:
    """``/proc/PID/io``'s counters (``syscw: 123`` lines)."""
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if value.strip().isdigit():
            out[key.strip()] = int(value)
    return out


def phases_main(argv: list[str] | None = None) -> int:
    """Child mode: run ``aggregator.cli.main`` with the arguments after ``--``, its phases timed."""
    p = argparse.ArgumentParser(description="run an rsagg command with the CPU of its phases summed")
    p.add_argument("--out", type=Path, required=True, help="where to write the sums (JSON)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then rsagg's arguments")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    sys.argv = ["rsagg", *command]
    import aggregator.cli  # noqa: F401 (the harvest's modules loaded, to be wrapped)

    sums = Sums()
    missing = install(sums)
    try:
        return run_cli(command)
    finally:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        try:
            io = proc_io(Path("/proc/self/io").read_text())
        except OSError:  # not Linux
            io = {}
        args.out.write_text(json.dumps({
            "cpu": sums.cpu, "calls": sums.calls, "missing": missing,
            "process_cpu": usage.ru_utime + usage.ru_stime,
            "io": io, "switches": usage.ru_nvcsw + usage.ru_nivcsw,
        }))  # fmt: skip


# -- reading the sums: bench_many_sources.py's table ---------------------------------------------------


@dataclass
class Phases:
    """One run's sums (what ``phases_main`` wrote)."""

    cpu: dict[str, float]
    calls: dict[str, int]
    process_cpu: float
    io: dict[str, int]
    switches: int

    @classmethod
    def read(cls, path: Path) -> Phases:
        d = json.loads(path.read_text())
        return cls(d["cpu"], d["calls"], d["process_cpu"], d["io"], d["switches"])


def table(one: Phases, many: Phases, sources: int, per_source: int) -> str:
    """Each phase's calls and CPU in both cases and its extra CPU per extra Source ((many − one) / (N − 1)),
    then the process's CPU, I/O and context switches the same way."""
    k = sources - 1
    head = f"{'phase (CPU of its thread)':<58} {'one: calls':>10} {'ms':>9} {'many: calls':>11} {'ms':>9} " \
           f"{'extra ms/Source':>15}"  # fmt: skip
    rows = [head, "-" * len(head)]
    loop = [label for label, _, _ in LOOP_PHASES]
    writes = sorted({x for x in (*one.cpu, *many.cpu) if x.startswith(WRITE_LOOP)})
    thread = sorted({x for x in (*one.cpu, *many.cpu) if x.startswith(WRITE_THREAD)})

    def row(label: str, a: float, ca: int | str, b: float, cb: int | str, scale: float = 1000.0) -> None:
        rows.append(f"{label:<58} {ca!s:>10} {a * scale:9.1f} {cb!s:>11} {b * scale:9.1f} "
                    f"{(b - a) / k * scale:15.3f}")  # fmt: skip

    rows.append("the event loop's thread")
    for label in (*loop[:1], *writes, *loop[1:]):
        if label in one.cpu or label in many.cpu:
            row(label, one.cpu.get(label, 0.0), one.calls.get(label, 0),
                many.cpu.get(label, 0.0), many.calls.get(label, 0))  # fmt: skip
    rows.append("the state writer's thread")
    for label in thread:
        row("  " + label[len(WRITE_THREAD) :], one.cpu.get(label, 0.0), one.calls.get(label, 0),
            many.cpu.get(label, 0.0), many.calls.get(label, 0))  # fmt: skip
    rows.append("the process")
    row("  CPU, user + system (ms)", one.process_cpu, "", many.process_cpu, "")
    for key, what in (("syscw", "write syscalls (sockets and files)"), ("wchar", "KB written (sockets and "
                      "files)"), ("syscr", "read syscalls")):  # fmt: skip
        if key in one.io and key in many.io:
            scale = 1 / 1024 if key == "wchar" else 1.0
            row(f"  {what}", one.io[key], "", many.io[key], "", scale)
    row("  context switches", one.switches, "", many.switches, "", 1.0)
    rows.append(f"({per_source} resources a Source in the many case; 'extra' is (many − one) / {k}, in the "
                f"unit of its row; the indented phases are parts of the one above)")  # fmt: skip
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(phases_main())
