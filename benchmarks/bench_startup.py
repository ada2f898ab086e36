"""Start-up of one-shot commands: each command's wall time from exec to exit (median of N runs, the
commands taking turns), its CPU time, and the load average beside each figure. ``python -c pass`` is
the floor every Python command pays.

    python benchmarks/bench_startup.py [--runs 11] [--bytecode]

``--bytecode`` times the commands as an installed rsagg runs them, from cached bytecode (``__pycache__``,
written by one warm-up round): without it, a ``PYTHONDONTWRITEBYTECODE`` in the environment makes every
run compile rsagg's own modules from source, which the table's first line says.

The commands that read a configuration run against a small one in a temporary folder (one source, an
empty store), so the figure is start-up and the command's own small work, not a harvest.
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

ROOT = Path(__file__).resolve().parent.parent
#: The target for one-shot commands (seconds of wall time on an idle machine).
TARGET = 0.15


def commands(folder: Path) -> list[tuple[str, list[str]]]:
    """(label, argv) of each command timed; ``folder`` holds ``rsagg.toml`` and a sample document."""
    rsagg = [sys.executable, "-m", "aggregator"]
    config = str(folder / "rsagg.toml")
    doc = str(folder / "resourcelist.xml")
    return [
        ("python -c pass", [sys.executable, "-c", "pass"]),
        ("rsagg --version", [*rsagg, "--version"]),
        ("rsagg --help", [*rsagg, "--help"]),
        ("rsagg audit --help", [*rsagg, "audit", "--help"]),
        ("rsagg run --help", [*rsagg, "run", "--help"]),
        ("rsagg validate FILE", [*rsagg, "validate", doc]),
        ("rsagg status -c", [*rsagg, "status", "-c", config]),
        ("rsagg retries -c", [*rsagg, "retries", "-c", config]),
        ("rsagg plugins", [*rsagg, "plugins"]),
        ("import aggregator.cli", [sys.executable, "-c", "import aggregator.cli"]),
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
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
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
        "--bytecode", action="store_true", help="cached bytecode, as installed (one warm-up round first)"
    )
    args = parser.parse_args(argv)
    root = args.root.resolve()
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        folder = Path(tmp)
        prepare(folder)
        cases = commands(folder)
        walls: dict[str, list[float]] = {label: [] for label, _ in cases}
        cpus: dict[str, list[float]] = {label: [] for label, _ in cases}
        loads: dict[str, list[float]] = {label: [] for label, _ in cases}
        if args.bytecode:  # writes __pycache__ beside the sources, as pip does on install
            for _, cmd in cases:
                time_one(cmd, folder, root, bytecode=True)
        for _ in range(args.runs):  # the commands take turns, so a burst of load hits them alike
            for label, cmd in cases:
                loads[label].append(os.getloadavg()[0])
                wall, cpu = time_one(cmd, folder, root, bytecode=args.bytecode)
                walls[label].append(wall)
                cpus[label].append(cpu)
    cached = args.bytecode or not os.environ.get("PYTHONDONTWRITEBYTECODE")
    state = "written" if cached else "not written (PYTHONDONTWRITEBYTECODE: what lacks one compiles each run)"
    print(f"rsagg from {root}; bytecode cache: {state}")
    print(f"start-up, median of {args.runs} runs each (target for one-shot commands: {TARGET:.2f} s wall)")
    print(f"{'command':<24} {'wall s':>8} {'min s':>8} {'cpu s':>8} {'load 1m':>8}")
    for label, _ in cases:
        print(
            f"{label:<24} {statistics.median(walls[label]):8.3f} {min(walls[label]):8.3f} "
            f"{statistics.median(cpus[label]):8.3f} {statistics.median(loads[label]):8.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
