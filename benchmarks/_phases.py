"""What each part of a harvest costs in CPU, at full speed: ``bench_many_sources.py --phases``.

Run as a child process in place of ``python -m aggregator``::

    python benchmarks/_phases.py --out phases.json -- harvest --once -c rsagg.toml

The event loop's thread: a trio instrument reads the thread's CPU (``time.thread_time``) at the start and
end of every task step and gives it to the part the task is in then. A part is a call of one of a few
functions of the harvest (``LOOP_PHASES``, and every state write), wrapped so that each call marks its
task as in that part until it returns. Parts nest within a task (a discovery inside a sync), and each
step's CPU goes to the innermost one, so every figure is a part's own CPU, that of the parts inside it left
out. A step in no part goes to its task's name; the loop's CPU between steps goes to the scheduler. The
attribution is exact however many syncs run at once: a step belongs to one task.

The state writer's thread: each write call's CPU in that thread, by the function written (the writes
riding along with it included; the blobs a write commits itself before its rows apart).

The process: its CPU, its I/O counters (``/proc/self/io``: write syscalls, bytes) and its context
switches (``getrusage``).

Why not a profiler or the opcode counter: both slow the harvest (cProfile about twice, the counter six
times), which changes how its tasks and threads wait; the instrument costs about 4 µs a task step.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import json
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _harness import run_cli

#: (label, module, attribute): coroutine functions (or async generator functions: each step a call) run by
#: the event loop's tasks, wrapped where their callers look them up.
LOOP_PHASES = (
    ("sync (the rest of it)", "aggregator.harvest.source", "_sync_admitted"),
    ("discovery", "aggregator.harvest.source", "discover"),
    ("baseline (the rest of it)", "aggregator.harvest.source", "run_baseline"),
    ("the Resource List's entries", "aggregator.harvest.baseline", "resource_list_entries"),
    ("pipeline: state reads at its start", "aggregator.harvest.pipeline", "Pipeline._prime"),
    ("pipeline: resource fetches", "aggregator.harvest.pipeline", "Pipeline._work_one"),
    ("pipeline: batch commits", "aggregator.harvest.pipeline", "Pipeline._flush_part"),
)
#: The event loop's side of every state write (its thread hop), by the function written.
WRITE_LOOP = "state write: "
#: The state writer's thread, by the function written.
WRITE_THREAD = "writer thread: "
#: The writer thread's part outside the writes themselves: a shared transaction's begin and commit
#: (aggregator/harvest/writes.py) ...
SHARED = "a hop's shared transaction"
#: ... and the blobs of a hop's writes, committed together (one ``small.db`` transaction).
SHARED_BLOBS = "a hop's blobs, committed together"
#: The blobs a write commits itself before its rows (``writes.AfterBlobs``: a write alone in its hop, or
#: one whose blobs the hop could not commit with the others'), apart from its rows: so that the blobs'
#: cost is comparable between a case whose hops hold one write and one whose hops hold many.
OWN_BLOBS = "a write's own blobs"
#: A task step in no part, by the task's name.
TASK = "task, no part: "
#: The event loop's thread between task steps (trio's scheduler, the I/O wait's syscalls).
SCHEDULER = "the scheduler, between task steps"


@dataclass
class Sums:
    """CPU seconds and calls, by part."""

    cpu: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, label: str, seconds: float, calls: int = 1) -> None:
        self.cpu[label] = self.cpu.get(label, 0.0) + seconds
        self.calls[label] = self.calls.get(label, 0) + calls


class StepClock:
    """The trio instrument: each task step's CPU to the innermost part its task is in."""

    def __init__(self, sums: Sums) -> None:
        self.sums = sums
        self._stacks: dict[object, list[str]] = {}
        self._task: Any = None
        self._mark = 0.0
        self._run_start = 0.0
        self._in_steps = 0.0  # the CPU given to parts and tasks so far: the rest is the scheduler's

    # -- trio.abc.Instrument's hooks (duck-typed: trio checks the methods, not the class) --

    def before_run(self) -> None:
        self._run_start = time.thread_time()

    def after_run(self) -> None:
        total = time.thread_time() - self._run_start
        self.sums.add(SCHEDULER, total - self._in_steps, 0)

    def before_task_step(self, task: Any) -> None:
        self._task, self._mark = task, time.thread_time()

    def after_task_step(self, task: Any) -> None:
        self._flush()
        self._task = None

    # -- the parts --

    def _flush(self) -> None:
        now = time.thread_time()
        stack = self._stacks.get(self._task)
        label = stack[-1] if stack else TASK + str(self._task.name).rpartition(".")[2]
        self.sums.add(label, now - self._mark, 0)
        self._in_steps += now - self._mark
        self._mark = now

    def part(self, label: str) -> _Part:
        """``with``: the current task is in ``label`` inside (outside a task step: nothing marked)."""
        return _Part(self, label)

    def _enter(self, label: str) -> bool:
        if self._task is None:
            return False
        self._flush()
        self._stacks.setdefault(self._task, []).append(label)
        self.sums.add(label, 0.0)
        return True

    def _leave(self) -> None:
        self._flush()
        stack = self._stacks[self._task]
        stack.pop()
        if not stack:
            del self._stacks[self._task]


class _Part:
    """One call's stay in a part (``StepClock.part``): a plain class, as cheap as a context can be."""

    __slots__ = ("_clock", "_label", "_marked")

    def __init__(self, clock: StepClock, label: str) -> None:
        self._clock, self._label, self._marked = clock, label, False

    def __enter__(self) -> None:
        self._marked = self._clock._enter(self._label)

    def __exit__(self, *exc: object) -> None:
        if self._marked:
            self._clock._leave()


def in_part(fn: Callable, label: str, clock: StepClock) -> Callable:
    """``fn`` (a coroutine function, an async generator function: each step, or a plain function: its
    call within a task step) marking its task as in ``label`` while it runs."""
    if not inspect.iscoroutinefunction(fn) and not inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        def plain(*args: Any, **kwargs: Any) -> Any:
            with clock.part(label):
                return fn(*args, **kwargs)

        return plain
    if not inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def call(*args: Any, **kwargs: Any) -> Any:
            with clock.part(label):
                return await fn(*args, **kwargs)

        return call

    class Steps:
        def __init__(self, agen: Any) -> None:
            self._agen = agen

        def __aiter__(self) -> Steps:
            return self

        async def __anext__(self) -> Any:
            with clock.part(label):
                return await self._agen.__anext__()

        async def aclose(self) -> None:
            await self._agen.aclose()

    @functools.wraps(fn)
    def steps(*args: Any, **kwargs: Any) -> Steps:
        return Steps(fn(*args, **kwargs))

    return steps


def install(sums: Sums) -> tuple[StepClock, list[str]]:
    """Wrap the parts and the state writes, and have ``trio.run`` take the instrument; returns it and the
    parts this checkout lacks (left out)."""
    clock = StepClock(sums)
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
        setattr(owner, name, in_part(fn, label, clock))
    import trio

    from aggregator.harvest import context

    try:
        from aggregator.harvest.writes import SharedHops as hops
    except ImportError:  # a tree from before harvest/writes.py (``--before``)
        hops = context._SharedHops  # type: ignore[attr-defined]
    naming = {"name": "?"}  # set by a write just before it enters its hop (no await in between)
    write, run, trio_run = context.HarvestContext.write, hops.run, trio.run
    run_all = getattr(hops, "_run_all", None)
    blobs_first = getattr(hops, "_blobs_first", None)
    after_blobs = getattr(importlib.import_module(hops.__module__), "AfterBlobs", None)  # (harvest/writes.py)
    after_blobs_call = after_blobs.__call__ if after_blobs is not None else None
    in_calls = threading.local()  # the writer thread's CPU in the calls of the hop it runs

    @functools.wraps(write)
    async def marked_write(self: Any, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        name = getattr(fn, "__name__", type(fn).__name__)
        naming["name"] = name
        with clock.part(WRITE_LOOP + name):
            return await write(self, fn, *args, **kwargs)

    @functools.wraps(run)
    async def timed_run(self: Any, call: Callable[[], Any], blobs: Any = ()) -> Any:
        label = WRITE_THREAD + naming["name"]

        def timed_call() -> Any:
            start, blobs_before = time.thread_time(), getattr(in_calls, "own_blobs", 0.0)
            try:
                return call()
            finally:
                spent = time.thread_time() - start
                sums.add(label, spent - (getattr(in_calls, "own_blobs", 0.0) - blobs_before))
                in_calls.spent = getattr(in_calls, "spent", 0.0) + spent

        return await run(self, timed_call, *([blobs] if blobs else []))

    def timed_run_all(self: Any, batch: Any, gathering: Any) -> None:
        """What a hop spends outside its calls: a shared transaction's begin and commit, and its
        blobs committed together (``writes.SharedHops``)."""
        in_calls.spent = in_calls.blobs = 0.0
        start = time.thread_time()
        try:
            run_all(self, batch, gathering)  # type: ignore[misc]
        finally:
            sums.add(WRITE_THREAD + SHARED, time.thread_time() - start - in_calls.spent - in_calls.blobs)

    def timed_blobs_first(self: Any, batch: Any) -> None:
        start = time.thread_time()
        try:
            blobs_first(self, batch)  # type: ignore[misc]
        finally:
            in_calls.blobs = time.thread_time() - start
            sums.add(WRITE_THREAD + SHARED_BLOBS, in_calls.blobs)

    def timed_after_blobs(self: Any) -> Any:
        """``AfterBlobs.__call__`` as it is, its blobs' commit timed apart (``OWN_BLOBS``)."""
        commit = self.commit

        def timed_commit(writers: Any) -> None:
            start = time.thread_time()
            try:
                commit(writers)
            finally:
                spent = time.thread_time() - start
                sums.add(WRITE_THREAD + OWN_BLOBS, spent)
                in_calls.own_blobs = getattr(in_calls, "own_blobs", 0.0) + spent

        self.commit = timed_commit
        return after_blobs_call(self)

    @functools.wraps(trio_run)
    def instrumented_run(*args: Any, **kwargs: Any) -> Any:
        kwargs["instruments"] = [*kwargs.get("instruments", ()), clock]
        return trio_run(*args, **kwargs)

    context.HarvestContext.write = marked_write  # type: ignore[method-assign]
    hops.run = timed_run  # type: ignore[method-assign]
    if run_all is not None and blobs_first is not None:
        hops._run_all = timed_run_all  # type: ignore[method-assign]
        hops._blobs_first = timed_blobs_first  # type: ignore[method-assign]
    if after_blobs is not None:
        after_blobs.__call__ = timed_after_blobs
    trio.run = instrumented_run
    return clock, missing


def proc_io(text: str) -> dict[str, int]:
    """``/proc/PID/io``'s counters (``syscw: 123`` lines)."""
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if value.strip().isdigit():
            out[key.strip()] = int(value)
    return out


def phases_main(argv: list[str] | None = None) -> int:
    """Child mode: run ``aggregator.cli.main`` with the arguments after ``--``, its parts' CPU summed."""
    p = argparse.ArgumentParser(description="run an rsagg command with the CPU of its parts summed")
    p.add_argument("--out", type=Path, required=True, help="where to write the sums (JSON)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then rsagg's arguments")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    sys.argv = ["rsagg", *command]
    import aggregator.cli  # noqa: F401 (the harvest's modules loaded, to be wrapped)

    sums = Sums()
    _, missing = install(sums)
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
    #: The parts the checkout that ran lacks (an older one): left out of its figures.
    missing: list[str] = field(default_factory=list)

    @classmethod
    def read(cls, path: Path) -> Phases:
        d = json.loads(path.read_text())
        return cls(d["cpu"], d["calls"], d["process_cpu"], d["io"], d["switches"], d.get("missing", []))

    @classmethod
    def median(cls, runs: list[Phases]) -> Phases:
        """Each figure's median over runs of one case (a part absent from a run counts as 0 there):
        rounds of the same case, so that one run's noise does not decide a part's figure."""

        def med(values: list[float]) -> float:
            return statistics.median(values)

        labels = {x for r in runs for x in r.cpu}
        keys = {x for r in runs for x in r.io}
        return cls(
            {x: med([r.cpu.get(x, 0.0) for r in runs]) for x in labels},
            {x: round(med([r.calls.get(x, 0) for r in runs])) for x in labels},
            med([r.process_cpu for r in runs]),
            {x: round(med([r.io.get(x, 0) for r in runs])) for x in keys},
            round(med([r.switches for r in runs])),
            sorted({m for r in runs for m in r.missing}),
        )


def table(one: Phases, many: Phases, sources: int, per_source: int, top: int = 12) -> str:
    """Each part's calls and own CPU in both cases and its extra per extra Source ((many − one) / (N − 1)),
    the event loop's parts by that extra (the ``top`` tasks outside any part, the others summed), then the
    writer's thread, then the process's CPU, I/O and context switches the same way."""
    k = sources - 1
    head = (f"{'part (own CPU of its thread)':<52} {'one: calls':>10} {'ms':>9} {'many: calls':>11} "
            f"{'ms':>9} {'extra ms/Source':>15}")  # fmt: skip
    rows = [head, "-" * len(head)]

    def row(label: str, a: float, ca: int | str, b: float, cb: int | str, scale: float = 1000.0) -> None:
        rows.append(f"{label[:52]:<52} {ca!s:>10} {a * scale:9.1f} {cb!s:>11} {b * scale:9.1f} "
                    f"{(b - a) / k * scale:15.3f}")  # fmt: skip

    def part(label: str, shown: str) -> None:
        row(shown, one.cpu.get(label, 0.0), one.calls.get(label, 0), many.cpu.get(label, 0.0),
            many.calls.get(label, 0))  # fmt: skip

    def extra(label: str) -> float:
        return many.cpu.get(label, 0.0) - one.cpu.get(label, 0.0)

    labels = set(one.cpu) | set(many.cpu)
    thread = sorted((x for x in labels if x.startswith(WRITE_THREAD)), key=extra, reverse=True)
    tasks = sorted((x for x in labels if x.startswith(TASK)), key=extra, reverse=True)
    loop = sorted((x for x in labels if not x.startswith((WRITE_THREAD, TASK))), key=extra, reverse=True)
    rows.append("the event loop's thread")
    for label in loop:
        part(label, "  " + label)
    for label in tasks[:top]:
        part(label, "  " + label)
    if tasks[top:]:
        rest = tasks[top:]
        row(f"  {len(rest)} more tasks, no part", sum(one.cpu.get(x, 0.0) for x in rest), "",
            sum(many.cpu.get(x, 0.0) for x in rest), "")  # fmt: skip
    rows.append("the state writer's thread")
    for label in thread:
        part(label, "  " + label[len(WRITE_THREAD) :])
    rows.append("the process")
    row("  CPU, user + system (ms)", one.process_cpu, "", many.process_cpu, "")
    for key, what in (("syscw", "write syscalls (sockets and files)"), ("wchar", "KB written (sockets and "
                      "files)"), ("syscr", "read syscalls")):  # fmt: skip
        if key in one.io and key in many.io:
            scale = 1 / 1024 if key == "wchar" else 1.0
            row(f"  {what}", one.io[key], "", many.io[key], "", scale)
    row("  context switches", one.switches, "", many.switches, "", 1.0)
    rows.append(f"({per_source} resources a Source in the many case; 'extra' is (many − one) / {k}, in the "
                f"unit of its row; a part's own CPU leaves out the parts called inside it)")  # fmt: skip
    return "\n".join(rows)


def compare(after: tuple[Phases, Phases], before: tuple[Phases, Phases], sources: int) -> str:
    """Each part's extra CPU per extra Source in this checkout and in the one before (``--before``), and
    the change: ``after`` and ``before`` are each (one, many)."""
    k = sources - 1

    def extra(runs: tuple[Phases, Phases], label: str) -> float:
        one, many = runs
        return (many.cpu.get(label, 0.0) - one.cpu.get(label, 0.0)) / k * 1000

    labels = sorted({x for runs in (after, before) for r in runs for x in r.cpu},
                    key=lambda x: -max(abs(extra(after, x)), abs(extra(before, x))))  # fmt: skip
    head = f"{'part: extra ms per Source':<52} {'after':>9} {'before':>9} {'change':>9}"
    rows = [head, "-" * len(head)]
    for label in labels:
        a, b = extra(after, label), extra(before, label)
        rows.append(f"{label[:52]:<52} {a:9.3f} {b:9.3f} {a - b:+9.3f}")
    a = (after[1].process_cpu - after[0].process_cpu) / k * 1000
    b = (before[1].process_cpu - before[0].process_cpu) / k * 1000
    rows.append(f"{'the process, CPU':<52} {a:9.3f} {b:9.3f} {a - b:+9.3f}")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(phases_main())
