"""Start-up of one-shot commands: each command's wall time from exec to exit (median of N runs, the
commands taking turns), its CPU time, and the load average beside each figure. ``python -c pass`` is
the floor every Python command pays.

    python benchmarks/bench_startup.py [--runs 11] [--bytecode] [--before DIR]

``--bytecode`` times the commands as an installed rsagg runs them, from cached bytecode (``__pycache__``,
written by one warm-up round): without it, a ``PYTHONDONTWRITEBYTECODE`` in the environment makes every
run compile rsagg's own modules from source, which the table's first line says.

``--before DIR`` times the same commands in another checkout too (the tree before a change, e.g. a
detached ``git worktree`` of main), the two trees taking turns command by command, so both columns meet
the same load; ``--root DIR`` times another checkout alone. A checkout with a ``.venv`` of its own is run
by that venv's Python (its plugins, installed editable from its tree, are its own), else by this one.

The commands that read a configuration run against a small one in a temporary folder (one source, an
empty store), so the figure is start-up and the command's own small work, not a harvest. They find the
snapshot of the configuration checked by an untimed first run (``aggregator/config_cache.py``, in a
cache folder of the temporary one), as every run after the first does; "status, no snapshot" turns the
snapshot off (``RSAGG_CACHE_DIR=``): a first run, or a configuration holding a secret.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _headline import headline

ROOT = Path(__file__).resolve().parent.parent
#: The target for one-shot commands (seconds of wall time on an idle machine).
TARGET = 0.15
#: ``status`` checking its configuration in full (a first run): shown, not the headline (see above).
NO_SNAPSHOT = "status, no snapshot"


def python_of(root: Path) -> str:
    """The interpreter that runs ``root``'s rsagg: its own ``.venv`` when it has one (its plugins are
    installed there, editable, from its own tree), else this one."""
    own = root / ".venv" / "bin" / "python"
    return str(own) if own.exists() else sys.executable


def commands(folder: Path, python: str = sys.executable) -> list[tuple[str, list[str]]]:
    """(label, argv) of each command timed; ``folder`` holds ``rsagg.toml`` and a sample document."""
    rsagg = [python, "-m", "aggregator"]
    config = str(folder / "rsagg.toml")
    doc = str(folder / "resourcelist.xml")
    return [
        ("python -c pass", [python, "-c", "pass"]),
        ("rsagg --version", [*rsagg, "--version"]),
        ("rsagg --help", [*rsagg, "--help"]),
        ("rsagg audit --help", [*rsagg, "audit", "--help"]),
        ("rsagg run --help", [*rsagg, "run", "--help"]),
        ("rsagg validate FILE", [*rsagg, "validate", doc]),
        ("rsagg status -c", [*rsagg, "status", "-c", config]),
        (NO_SNAPSHOT, ["env", "RSAGG_CACHE_DIR=", *rsagg, "status", "-c", config]),
        ("rsagg retries -c", [*rsagg, "retries", "-c", config]),
        ("rsagg plugins", [*rsagg, "plugins"]),
        ("import aggregator.cli", [python, "-c", "import aggregator.cli"]),
    ]


def prepare(folder: Path) -> None:
    (folder / "rsagg.toml").write_text(
        f'[store]\npath = "{folder / "data"}"\n\n[[sources]]\nname = "a"\n'
        'url = "http://127.0.0.1:9/.well-known/resourcesync"\n'
    )
    (folder / "resourcelist.xml").write_text(
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        '<urlset xmlns="http://www.sitemaps.org/schemas/sitemap/0.9" '
        'xmlns:rs="http://www.openarchives.org/rs/terms/">\n'
        '<rs:md capability="resourcelist" at="2024-01-01T00:00:00Z"/>\n'
        "<url><loc>http://example.org/a</loc></url>\n</urlset>\n"
    )


def time_one(argv: list[str], cwd: Path, root: Path, *, bytecode: bool = False) -> tuple[float, float]:
    """Wall and CPU seconds of one run of ``argv`` (its exit status is not checked: help exits 0)."""
    env = {
        **os.environ,
        "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "RSAGG_CACHE_DIR": str(cwd / "cache"),
    }
    if bytecode:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    _, _, usage = os.wait4(proc.pid, 0)
    return time.perf_counter() - start, usage.ru_utime + usage.ru_stime


def main(argv: list[str] | None = None) -> int:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=fmt)
    parser.add_argument("--runs", type=int, default=11, help="runs of each command (median shown)")
    parser.add_argument(
        "--root", type=Path, default=ROOT, help="the rsagg checkout to time (default: this one)"
    )
    parser.add_argument(
        "--before", type=Path, default=None, help="a checkout to time too, taking turns (before/after)"
    )
    parser.add_argument(
        "--bytecode", action="store_true", help="cached bytecode, as installed (one warm-up round first)"
    )
    args = parser.parse_args(argv)
    roots = [args.root.resolve()] if args.before is None else [args.before.resolve(), args.root.resolve()]
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        folder = Path(tmp)
        prepare(folder)
        argvs = {root: dict(commands(folder, python_of(root))) for root in roots}
        cases = commands(folder)
        keys = [(label, root) for label, _ in cases for root in roots]
        walls: dict[tuple[str, Path], list[float]] = {key: [] for key in keys}
        cpus: dict[tuple[str, Path], list[float]] = {key: [] for key in keys}
        loads: dict[str, list[float]] = {label: [] for label, _ in cases}
        if args.bytecode:  # writes __pycache__ beside the sources, as pip does on install
            for label, _ in cases:
                for root in roots:
                    time_one(argvs[root][label], folder, root, bytecode=True)
        else:  # the configuration's snapshot, as any run after the first finds it
            for root in roots:
                time_one(argvs[root]["rsagg status -c"], folder, root)
        for run in range(args.runs):  # the commands (and the trees) take turns: a burst of load hits all
            for label, _ in cases:
                loads[label].append(os.getloadavg()[0])
                for root in roots if run % 2 == 0 else roots[::-1]:
                    wall, cpu = time_one(argvs[root][label], folder, root, bytecode=args.bytecode)
                    walls[label, root].append(wall)
                    cpus[label, root].append(cpu)
    cached = args.bytecode or not os.environ.get("PYTHONDONTWRITEBYTECODE")
    state = "written" if cached else "not written (PYTHONDONTWRITEBYTECODE: what lacks one compiles each run)"
    med = statistics.median
    if args.before is None:
        root = roots[0]
        print(f"rsagg from {root} ({python_of(root)}); bytecode cache: {state}")
        print(
            f"start-up, median of {args.runs} runs each (target for one-shot commands: {TARGET:.2f} s wall)"
        )
        print(f"{'command':<24} {'wall s':>8} {'min s':>8} {'cpu s':>8} {'load 1m':>8}")
        for label, _ in cases:
            w, c = walls[label, root], cpus[label, root]
            print(f"{label:<24} {med(w):8.3f} {min(w):8.3f} {med(c):8.3f} {med(loads[label]):8.2f}")
        slowest = max(
            (label for label, _ in cases if label not in ("python -c pass", NO_SNAPSHOT)),
            key=lambda k: med(walls[k, root]),
        )
        headline(f"start-up, slowest one-shot command ({slowest})",
                 f"{med(walls[slowest, root]):.3f} s wall, {med(cpus[slowest, root]):.3f} s CPU (medians)",
                 f"≤ {TARGET:.2f} s")  # fmt: skip
        return 0
    before, after = roots
    print(f"before: rsagg from {before} ({python_of(before)})")
    print(f"after:  rsagg from {after} ({python_of(after)})\nbytecode cache: {state}")
    print(
        f"start-up, median of {args.runs} runs each, the trees taking turns "
        f"(target for one-shot commands: {TARGET:.2f} s wall)"
    )
    print("(cpu min: the least CPU time of the runs, the steadiest figure on a loaded machine)")
    head = ("wall before", "wall after", "cpu before", "cpu after", "min before", "min after", "load 1m")
    print(f"{'command':<24} " + " ".join(f"{h:>11}" for h in head))
    for label, _ in cases:
        wb, wa = med(walls[label, before]), med(walls[label, after])
        cb, ca = med(cpus[label, before]), med(cpus[label, after])
        mb, ma = min(cpus[label, before]), min(cpus[label, after])
        figures = " ".join(f"{f:>11.3f}" for f in (wb, wa, cb, ca, mb, ma))
        print(f"{label:<24} {figures} {med(loads[label]):>11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
