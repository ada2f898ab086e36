"""Every Python opcode a command of rsagg executes, counted: a cost figure that does not swing with the
machine's load as CPU time does (``bench_many_sources.py --opcodes``).

Run as a child process in place of ``python -m aggregator``::

    python benchmarks/_opcodes.py --out ops.json [--preload MODULE] -- harvest --once -c rsagg.toml

It imports ``aggregator.cli`` (and each ``--preload`` module: their imports are not counted), turns on
``sys.settrace`` with ``frame.f_trace_opcodes`` in this thread and in every thread started later
(``threading.settrace``), runs the command, and writes to ``--out`` the opcodes executed, by *owner*: the
nearest frame of the ``aggregator`` package on the stack (the function itself when it is rsagg's; library
code counts for the rsagg function that called it, trio's scheduler loop for the one that called
``trio.run``; code with no rsagg frame under it, such as a worker thread's own loop, for none). A
function is named by its module's path in the package and its qualified name, without its line (the same
function in another checkout is the same row; two lambdas of one function share one). The command's exit
code is this process's.

What is not counted: code in C (SQLite, lxml, hashing, the interpreter itself, the kernel), and the
Python code that runs before the counter starts. The counts depend on the run's timing where rsagg
does (which writes share a thread hop, how often a task waits for a slot, when a timer fires), and the
counter slows the run about six times, which changes those parts: a guide to where Python work goes, not
a measure of what a change saves in CPU (docs/benchmarks.md, "Many sources").
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from _harness import run_cli

#: The owner of the opcodes run with no frame of the ``aggregator`` package on the stack.
NO_OWNER = "(no rsagg frame: the worker threads' own loops)"


class OpcodeCounter:
    """The counting trace functions. A frame's opcodes go to a cell of its owner and thread, found once
    per call (or resumption) of the frame, so the per-opcode work is one increment; a cell per thread so
    that no increment of two threads is lost between its load and its store."""

    def __init__(self, package: str) -> None:
        self.package = package.rstrip(os.sep) + os.sep
        self.name = Path(package).name
        #: (thread ident, owner code or None) -> (cell, the frame's local trace function)
        self._tracers: dict[tuple[int, object], object] = {}
        self._cells: list[tuple[object, list[int]]] = []
        self._lock = threading.Lock()

    def _owner(self, frame):  # -> CodeType | None
        package = self.package
        while frame is not None:
            code = frame.f_code
            if code.co_filename.startswith(package):
                return code
            frame = frame.f_back
        return None

    def _new_tracer(self, key: tuple[int, object]):
        cell = [0]

        def local(frame, event, arg):
            if event == "opcode":
                cell[0] += 1
            return local

        with self._lock:
            self._cells.append((key[1], cell))
            self._tracers[key] = local
        return local

    def trace(self, frame, event, arg):
        """The global trace function: a frame's call (or resumption) picks its owner's counting cell."""
        if event != "call":
            return None
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        key = (threading.get_ident(), self._owner(frame))
        tracer = self._tracers.get(key)
        return tracer if tracer is not None else self._new_tracer(key)

    def by_owner(self) -> dict[str, int]:
        """The opcodes counted so far, by owner (``aggregator/path/in/it.py:Qualified.name``: the same
        name for the same function in another checkout)."""
        out: dict[str, int] = {}
        with self._lock:
            cells = list(self._cells)
        for code, cell in cells:
            if code is None:
                name = NO_OWNER
            else:
                path = code.co_filename[len(self.package) :].replace(os.sep, "/")  # type: ignore[attr-defined]
                name = f"{self.name}/{path}:{code.co_qualname}"  # type: ignore[attr-defined]
            out[name] = out.get(name, 0) + cell[0]
        return out


def count_main(argv: list[str] | None = None) -> int:
    """Child mode: run ``aggregator.cli.main`` with the arguments after ``--`` under the counter."""
    p = argparse.ArgumentParser(description="run an rsagg command with its Python opcodes counted")
    p.add_argument("--out", type=Path, required=True, help="where to write the counts (JSON)")
    p.add_argument("--preload", action="append", default=[], help="a module to import before counting")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then rsagg's arguments")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    sys.argv = ["rsagg", *command]
    import aggregator
    import aggregator.cli  # imported before counting, as the preloads are

    for module in args.preload:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:  # an older checkout without it: imported while counted, then
            if exc.name != module:
                raise
    counter = OpcodeCounter(str(Path(aggregator.__file__).resolve().parent))
    threading.settrace(counter.trace)
    sys.settrace(counter.trace)
    try:
        return run_cli(command)
    finally:
        sys.settrace(None)
        threading.settrace(None)  # type: ignore[arg-type]
        owners = counter.by_owner()
        args.out.write_text(json.dumps({"total": sum(owners.values()), "owners": owners}))


# -- reading the counts: bench_many_sources.py's table ------------------------------------------------


@dataclass
class Counts:
    """The counts of one run (what ``count_main`` wrote)."""

    total: int
    owners: dict[str, int]

    @classmethod
    def read(cls, path: Path) -> Counts:
        data = json.loads(path.read_text())
        return cls(int(data["total"]), {k: int(v) for k, v in data["owners"].items()})


@dataclass
class Figures:
    """One checkout's figures: the one case of N×M resources, a smaller one case of K (for the slope),
    and the many case of N Sources of M."""

    one: Counts
    small: Counts
    many: Counts
    sources: int  # N
    per_source: int  # M
    small_resources: int  # K

    @property
    def resources(self) -> int:
        return self.sources * self.per_source

    @property
    def per_resource(self) -> float:
        """Opcodes per resource of one Source: the slope between the two one cases (start-up cancels)."""
        return (self.one.total - self.small.total) / (self.resources - self.small_resources)

    @property
    def start_up(self) -> float:
        """The one case's opcodes for no resource: its total less the slope times its resources."""
        return self.one.total - self.per_resource * self.resources

    @property
    def per_extra_source(self) -> float:
        return (self.many.total - self.one.total) / (self.sources - 1)

    @property
    def ratio(self) -> float:
        """What a resource costs from N Sources of M over what it costs from one Source of N×M, start-up
        left out of both."""
        return (self.many.total - self.start_up) / (self.one.total - self.start_up)

    def extra_by_owner(self) -> dict[str, float]:
        """Opcodes per extra Source by owner: (many − one) / (N − 1)."""
        names = set(self.one.owners) | set(self.many.owners)
        k = self.sources - 1
        return {n: (self.many.owners.get(n, 0) - self.one.owners.get(n, 0)) / k for n in names}


def table(after: Figures, before: Figures | None = None, top: int = 15, target: float = 0.0) -> str:
    """The figures of this checkout (and of ``before``, side by side), then the ``top`` rsagg functions by
    opcodes per extra Source (own opcodes and those of the library code they call)."""
    n, m, k = after.sources, after.per_source, after.small_resources
    trees = [("after", after)] + ([("before", before)] if before is not None else [])
    rows = [f"{'opcodes':<44}" + "".join(f" {name:>14}" for name, _ in trees)]

    def row(label: str, value, fmt: str = "{:,.0f}") -> None:
        rows.append(f"{label:<44}" + "".join(f" {fmt.format(value(f)):>14}" for _, f in trees))

    row(f"one Source of {n * m}", lambda f: f.one.total)
    row(f"one Source of {k}", lambda f: f.small.total)
    row(f"{n} Sources of {m}", lambda f: f.many.total)
    row("per resource (one Source, the slope)", lambda f: f.per_resource)
    row(f"start-up (one less the slope × {n * m})", lambda f: f.start_up)
    row("per extra Source ((many − one) / (N − 1))", lambda f: f.per_extra_source)
    row("many/one, start-up left out", lambda f: f.ratio, "{:.2f}×")
    row("  per extra Source, with no rsagg frame", lambda f: f.extra_by_owner().get(NO_OWNER, 0.0))
    if target:
        # The extra opcodes per Source that a ratio of ``target`` allows: (target − 1) × (one − start-up).
        row(f"per extra Source allowed by ≤ {target}×",
            lambda f: (target - 1) * (f.one.total - f.start_up) / (n - 1))  # fmt: skip
    extra = {name: f.extra_by_owner() for name, f in trees}
    names = {x for e in extra.values() for x in e if x != NO_OWNER}
    ranked = sorted(names, key=lambda x: -max(e.get(x, 0.0) for e in extra.values()))[:top]
    rows.append("")
    rows.append(f"the top {top} rsagg functions by opcodes per extra Source (their own and the library code "
                f"they call):")  # fmt: skip
    rows.append("".join(f"{name:>10} " for name, _ in trees) + " function")
    for x in ranked:
        rows.append("".join(f"{extra[name].get(x, 0.0):>10,.0f} " for name, _ in trees) + f" {x}")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(count_main())
