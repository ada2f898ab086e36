"""Throughput and memory of our document writer and parser, next to the resync 2.0.1 client's parser.

Writes a Resource List Index (default 1,000,000 entries in 20 parts) with ``aggregator.rs.write.write_split``,
then parses the parts with ``aggregator.rs.parse.iter_document`` (with and without its compiled fast
path) and with resync's ``Sitemap().parse_xml``
into one ``ResourceList`` (what resync does when it reads an index). Every task runs in its own
subprocess; the parent reads that child's peak RSS from ``os.wait4``, so each figure is per task.

    python benchmarks/bench_documents.py                  # full size
    python benchmarks/bench_documents.py --entries 100000 # quick
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASE_URL = "http://bench.example.org/"
TARGETS = {"parse": 300_000, "write": 200_000, "rss_mb": 100}


# -- tasks (run in a child process) ----------------------------------------------------------------------


def make_entries(n: int):
    """Typical Resource List entries: loc, lastmod, rs:md hash + length + type (about 230 bytes written)."""
    from aggregator.rs.model import Entry, Md

    t0 = datetime(2024, 1, 1, tzinfo=UTC)
    second = timedelta(seconds=1)
    for i in range(n):
        yield Entry(
            loc=f"{BASE_URL}collection/item/{i:08d}.html",
            lastmod=t0 + i * second,
            md=Md(hash=f"sha-256:{i:064x}", length=1000 + i % 100_000, type="text/html"),
        )


def task_make(args: argparse.Namespace) -> dict:
    """Reference: only building the entries, to show what part of the write time is the writer's."""
    start = time.perf_counter()
    n = sum(1 for _ in make_entries(args.entries))
    return {"entries": n, "seconds": time.perf_counter() - start}


def task_write(args: argparse.Namespace) -> dict:
    from aggregator.rs.model import Head, Link, Md
    from aggregator.rs.write import write_split

    folder = Path(args.dir)
    head = Head(
        md=Md(capability="resourcelist", at=datetime(2024, 6, 1, tzinfo=UTC)),
        links=[Link(rel="up", href=f"{BASE_URL}capabilitylist.xml")],
    )
    per_part = math.ceil(args.entries / args.parts)
    start = time.perf_counter()
    result = write_split(
        head,
        make_entries(args.entries),
        index_url=f"{BASE_URL}resourcelist-index.xml",
        part_url=lambda n: f"{BASE_URL}resourcelist-part{n:03d}.xml",
        open_part=lambda n: open(folder / f"resourcelist-part{n:03d}.xml", "wb"),
        open_index=lambda: open(folder / "resourcelist-index.xml", "wb"),
        max_entries=per_part,
    )
    seconds = time.perf_counter() - start
    size = sum(p.bytes for p in result.parts) + result.index_bytes
    return {"entries": result.entry_count, "seconds": seconds, "parts": result.part_count, "bytes": size}


def part_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("resourcelist-part*.xml"))


def task_parse(args: argparse.Namespace) -> dict:
    from aggregator.rs.model import Entry
    from aggregator.rs.parse import iter_document

    files = part_files(Path(args.dir))
    start = time.perf_counter()
    n = 0
    for path in files:
        for item in iter_document(path, BASE_URL + path.name):
            if isinstance(item, Entry):
                n += 1
    return {"entries": n, "seconds": time.perf_counter() - start, "files": len(files)}


def task_resync(args: argparse.Namespace) -> dict:
    from resync.resource_list import ResourceList
    from resync.sitemap import Sitemap

    files = part_files(Path(args.dir))
    start = time.perf_counter()
    resources = ResourceList()
    for path in files:
        with open(path, "rb") as fh:
            Sitemap().parse_xml(fh=fh, resources=resources, sitemapindex=False)
    return {"entries": len(resources), "seconds": time.perf_counter() - start, "files": len(files)}


TASKS = {
    "make": task_make,
    "write": task_write,
    "parse": task_parse,
    "parse-pure": task_parse,
    "resync": task_resync,
}
LABELS = {
    "make": "build Entry objects only (reference)",
    "write": "rsagg write_split (index + parts)",
    "parse": "rsagg parse (iter_document)",
    "parse-pure": "rsagg parse, pure Python (no speedups)",
    "resync": "resync 2.0.1 parse (Sitemap.parse_xml)",
}


# -- driver ----------------------------------------------------------------------------------------------


def run_task(args: argparse.Namespace) -> dict:
    """Child side: run one task and add the CPU seconds it used (less sensitive to a busy machine)."""
    cpu = time.process_time()
    result = TASKS[args.task](args)
    result["cpu"] = time.process_time() - cpu
    return result


def run_child(task: str, args: argparse.Namespace, folder: Path) -> dict:
    cmd = [sys.executable, __file__, "--task", task, "--dir", str(folder), "--entries", str(args.entries),
           "--parts", str(args.parts)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if task == "parse-pure":
        env["RSAGG_PURE_PYTHON"] = "1"  # the reader without its fast path (aggregator/rs/_speedups.pyx)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env)
    out = proc.stdout.read()  # type: ignore[union-attr]
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"task {task} failed with exit code {proc.returncode}")
    result = json.loads(out)
    result["rss_mb"] = usage.ru_maxrss / 1024  # Linux: kilobytes
    result["task"] = task
    return result


def table(rows: list[dict]) -> str:
    resync = next((r for r in rows if r["task"] == "resync"), None)
    lines = [
        f"{'task':<40} {'entries':>10} {'seconds':>8} {'cpu s':>7} {'entries/s':>10} {'peak RSS MB':>11}"
        "  vs resync",
        "-" * 110,
    ]
    for r in rows:
        rate = r["entries"] / r["seconds"] if r["seconds"] else float("inf")
        versus = ""
        if resync and r["task"].startswith("parse"):
            resync_rate = resync["entries"] / resync["seconds"]
            versus = f"{rate / resync_rate:.1f}x faster, {r['rss_mb'] / resync['rss_mb']:.2f}x the RSS"
        elif r["task"] == "resync":
            versus = "1.0x"
        lines.append(
            f"{LABELS[r['task']]:<40} {r['entries']:>10,} {r['seconds']:>8.2f} {r['cpu']:>7.2f}"
            f" {rate:>10,.0f} {r['rss_mb']:>11.1f}  {versus}"
        )
    return "\n".join(lines)


def verdicts(rows: list[dict]) -> list[str]:
    out = []
    by = {r["task"]: r for r in rows}
    for task in ("parse", "write"):
        if task in by:
            rate = by[task]["entries"] / by[task]["seconds"]
            ok = rate >= TARGETS[task]
            out.append(
                f"{task}: {rate:,.0f} entries/s (target >= {TARGETS[task]:,}) {'OK' if ok else 'MISSED'}"
            )
            rss = by[task]["rss_mb"]
            ok = rss < TARGETS["rss_mb"]
            out.append(
                f"{task}: peak RSS {rss:.1f} MB (target < {TARGETS['rss_mb']} MB) {'OK' if ok else 'MISSED'}"
            )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--entries", type=int, default=1_000_000, help="entries in the Resource List (1,000,000)")
    p.add_argument("--parts", type=int, default=20, help="parts under the index (20)")
    p.add_argument("--dir", help="where to write the documents (default: a temporary folder, removed after)")
    p.add_argument("--tasks", default="make,write,parse,parse-pure,resync", help="comma-separated subset")
    p.add_argument("--task", choices=sorted(TASKS), help=argparse.SUPPRESS)  # child mode
    args = p.parse_args(argv)
    if args.task:
        print(json.dumps(run_task(args)))
        return 0

    tasks = [t for t in args.tasks.split(",") if t]
    with tempfile.TemporaryDirectory(prefix="rsagg-bench-") as tmp:
        folder = Path(args.dir) if args.dir else Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        print(f"{args.entries:,} entries in {args.parts} parts, documents in {folder}", flush=True)
        print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs", flush=True)
        rows = []
        for task in tasks:
            rows.append(run_child(task, args, folder))
            r = rows[-1]
            extra = f", {r['parts']} parts, {r['bytes'] / 1e6:.1f} MB" if task == "write" else ""
            print(f"  {task}: {r['entries']:,} entries in {r['seconds']:.2f} s{extra}", flush=True)
        counts = {r["entries"] for r in rows}
        if len(counts) != 1:
            print(f"WARNING: tasks saw different entry counts: {sorted(counts)}")
        print(f"load average after: {os.getloadavg()[0]:.2f}")
        print()
        print(table(rows))
        print()
        for line in verdicts(rows):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
