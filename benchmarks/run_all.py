"""Run every benchmark, one after the other, and print every table with the machine's load beside it.

    python benchmarks/run_all.py                 # the full sizes (an hour or more; on a quiet machine)
    python benchmarks/run_all.py --quick         # small sizes: a few minutes, to see that all run
    python benchmarks/run_all.py --only publish,startup [--quick]
    python benchmarks/run_all.py --targets       # the benchmarks with speed targets, at sizes that show them

Each benchmark runs as a child process with this interpreter; its output is shown as it comes, each line
prefixed with the benchmark's name. The load average (1 minute) is sampled every second while it runs:
the header of its table and the summary at the end give its range next to the figures (a benchmark that
ran while the load was high says so). A benchmark that fails is reported and the others still run.

A benchmark marks the figures that answer a target with a ``headline | figure | value | target`` line
(``benchmarks/_headline.py``); the last table gathers them, each with the load average while its
benchmark ran: the README's figures are that table (``--markdown FILE`` writes it as Markdown too).

The rules the benchmarks keep (docs/benchmarks.md): each tool runs with its defaults, or both with the
same explicit settings printed in the table; each static server with the shipped configuration.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _headline import PREFIX

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


@dataclass(frozen=True)
class Bench:
    """One benchmark script with its full-size and its quick arguments, and those of ``--targets``
    (``None``: it has no target figure)."""

    name: str
    script: str
    full: tuple[str, ...] = ()
    quick: tuple[str, ...] = ()
    targets: tuple[str, ...] | None = None


#: Every benchmark, the cheap ones first. The quick sizes show that each runs and roughly how it does;
#: only the full sizes give the figures quoted in docs/benchmarks.md and the README.
BENCHES = [
    Bench("startup", "bench_startup.py", (), ("--runs", "3"), ("--runs", "7", "--bytecode")),
    Bench("for_source", "bench_for_source.py", (), ("20000",)),
    Bench("entry_order", "bench_entry_order.py", (), ("--entries", "10000")),
    Bench("state_calls", "bench_state_calls.py", (), ("--calls", "500")),
    Bench("state_paths", "bench_state_paths.py", (), ("--batch", "200", "--no-pg")),
    Bench("state_size", "bench_state_size.py", (), ("--n", "2000", "--no-pg"), ("--n", "100000")),
    Bench("documents", "bench_documents.py", (), ("--entries", "20000", "--parts", "2")),
    Bench("blobs", "bench_blobs.py", (), ("--small", "200", "--large", "10", "--backends", "fs")),
    Bench("publish", "bench_publish.py", (),
          ("--resources", "5000", "--duration", "3", "--warmup", "1", "--rounds", "1", "--requests", "2000"),
          ("--resources", "20000", "--duration", "5", "--warmup", "2", "--rounds", "3")),
    Bench("fetch", "bench_fetch.py", (), ("--resources", "1000", "--rounds", "1")),
    Bench("harvest", "bench_harvest.py", ("--resync-sample", "1000"),
          ("--resources", "1000", "--no-big", "--resync-sample", "100"),
          ("--resources", "10000", "--no-big", "--resync-sample", "500")),
    Bench("oaipmh", "bench_oaipmh.py", (), ("--records", "1000", "--repeat", "1"),
          ("--records", "20000", "--repeat", "3")),
    Bench("notify", "bench_notify.py", (), ("--changes", "20")),
    Bench("abuse", "bench_abuse.py", (), ("--seconds", "5")),
    Bench("cluster", "bench_cluster.py", (),
          ("--resources=500", "--repeat=1", "--sources=12", "--per-source=5")),
    Bench("many_sources", "bench_many_sources.py", (), ("--sources", "30", "--repeat", "1"),
          ("--repeat", "3")),
    Bench("reconcile", "bench_reconcile.py", (), ("--entries", "20000")),
    Bench("versions_in", "bench_versions_in.py", (), ("--resources", "100")),
    Bench("memento", "bench_memento.py", (),
          ("--resources", "100", "--versions", "500", "--requests", "300")),
]  # fmt: skip


@dataclass(frozen=True)
class Headline:
    """A figure a benchmark printed as answering a target."""

    figure: str
    value: str
    target: str


def parse_headline(line: str) -> Headline | None:
    """The headline a benchmark's output line carries, if it is one (``_headline.py`` writes them)."""
    if not line.startswith(PREFIX):
        return None
    parts = [p.strip() for p in line[len(PREFIX) :].rstrip("\n").split("|")]
    if len(parts) != 3 or not parts[0] or not parts[1]:
        return None
    return Headline(*parts)


@dataclass
class Outcome:
    name: str
    argv: list[str]
    code: int = 0
    wall: float = 0.0
    loads: list[float] = field(default_factory=list)
    headlines: list[Headline] = field(default_factory=list)

    @property
    def load(self) -> str:
        if not self.loads:
            return "-"
        return f"{min(self.loads):.2f}-{max(self.loads):.2f}"


def _sample_load(into: list[float], stop: threading.Event) -> None:
    while True:
        into.append(os.getloadavg()[0])
        if stop.wait(1.0):
            return


def run_one(bench: Bench, quick: bool, targets: bool = False) -> Outcome:
    """Run one benchmark, its output shown line by line, the load sampled meanwhile."""
    sizes = bench.targets if targets and bench.targets is not None else bench.quick if quick else bench.full
    argv = [sys.executable, str(HERE / bench.script), *sizes]
    out = Outcome(bench.name, argv[1:])
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_load, args=(out.loads, stop), daemon=True)
    shown = " ".join(a if a != str(HERE / bench.script) else f"benchmarks/{bench.script}" for a in argv[1:])
    print(f"\n=== {bench.name}: {shown}   (load average before: {os.getloadavg()[0]:.2f})", flush=True)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    start = time.perf_counter()
    sampler.start()
    try:
        proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            print(f"[{bench.name}] {line}", end="", flush=True)
            found = parse_headline(line)
            if found is not None:
                out.headlines.append(found)
        out.code = proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait()
        raise
    finally:
        stop.set()
        sampler.join()
        out.wall = time.perf_counter() - start
    state = "ok" if out.code == 0 else f"FAILED (exit {out.code})"
    print(f"=== {bench.name}: {state} in {out.wall:.1f} s, load average {out.load} while it ran", flush=True)
    return out


def headline_table(outcomes: list[Outcome]) -> str:
    """The headline figures of every benchmark that printed some, as a Markdown table."""
    rows = ["| benchmark | figure | value | target | load average |", "|---|---|---|---|---|"]
    for o in outcomes:
        for h in o.headlines:
            rows.append(f"| {o.name} | {h.figure} | {h.value} | {h.target or '-'} | {o.load} |")
    return "\n".join(rows) + "\n" if len(rows) > 2 else ""


def main(argv: list[str] | None = None) -> int:
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(description=__doc__, formatter_class=fmt)
    p.add_argument("--quick", action="store_true", help="small sizes: minutes, not hours")
    p.add_argument(
        "--targets",
        action="store_true",
        help="only the benchmarks with speed targets, at the sizes that show them (about half an hour)",
    )
    p.add_argument("--only", default="", help="comma-separated names: " + ", ".join(b.name for b in BENCHES))
    p.add_argument("--markdown", type=Path, help="also write the headline figures' table to this file")
    args = p.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - {b.name for b in BENCHES})
    if unknown:
        p.error(f"--only: no benchmark named {', '.join(unknown)}")
    chosen = [
        b for b in BENCHES if (not names or b.name in names) and (not args.targets or b.targets is not None)
    ]
    sizes = "target" if args.targets else "quick" if args.quick else "full"
    print(f"{os.cpu_count()} CPUs; {sizes} sizes; {len(chosen)} benchmark(s)")
    outcomes = [run_one(b, args.quick, args.targets) for b in chosen]
    print(f"\n{'benchmark':<14} {'result':<18} {'wall s':>8}  load average (1 min) while it ran")
    for o in outcomes:
        result = "ok" if o.code == 0 else f"FAILED (exit {o.code})"
        print(f"{o.name:<14} {result:<18} {o.wall:>8.1f}  {o.load}")
    table = headline_table(outcomes)
    if table:
        print(f"\nHeadline figures ({sizes} sizes)\n\n{table}", end="")
        if args.markdown is not None:
            args.markdown.write_text(table)
    return 0 if all(o.code == 0 for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
