"""rsagg with its state in PostgreSQL: how it compares with the embedded SQLite state.

Part "single-node PostgreSQL vs SQLite": the same baseline harvest, ``rsagg harvest --once`` of
``--resources`` small files from a latency-free local upstream (bench_harvest.py's static server and
resync-build documents), once with the state in SQLite (``[store] path``) and once in a PostgreSQL 15
server (``[store] state = "postgresql://..."``) started for the run by tests/pgserver.py with fsync and
full-page writes ON (as in production). Both use ``[store] synchronous = "NORMAL"`` (SQLite: WAL, no
fsync per commit; PostgreSQL: ``synchronous_commit = off``). Runs alternate (SQLite, PostgreSQL, ...)
``--repeat`` times on one upstream; each run's state is checked to hold every resource. Target:
PostgreSQL >= 0.7x SQLite's resources/s.

    python benchmarks/bench_cluster.py                      # 5,000 resources, 2 runs each (~2 min)
    python benchmarks/bench_cluster.py --resources 20000 --repeat 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

import bench_harvest  # noqa: E402 - the upstream site and its server
import psutil  # noqa: E402

from aggregator.store.state import connect  # noqa: E402
from tests import pgserver  # noqa: E402

TARGET_PG_VS_SQLITE = 0.7
PER_HOST = 64


@dataclass
class Run:
    backend: str
    resources: int
    wall: float
    held: int
    code: int
    cpu: float = 0.0  # CPU seconds of the rsagg process
    db_cpu: float = 0.0  # CPU seconds of the PostgreSQL server during the run

    @property
    def rate(self) -> float:
        return self.resources / self.wall

    @property
    def ok(self) -> bool:
        return self.code == 0 and self.held == self.resources


def harvest(folder: Path, base: str, n: int, state: str) -> Run:
    """``rsagg harvest --once`` into a fresh store folder with the state at ``state`` ("" = SQLite)."""
    folder.mkdir(parents=True)
    line = f'state = "{state}"\n' if state else ""
    (folder / "rsagg.toml").write_text(
        f'[store]\npath = "data"\n{line}\n[harvest]\nper_host = {PER_HOST}\nworkers = {PER_HOST}\n\n'
        f'[[sources]]\nname = "bench"\nurl = "{base}/"\n'
    )
    cmd = [
        sys.executable,
        "-m",
        "aggregator",
        "harvest",
        "--once",
        "-c",
        "rsagg.toml",
        "--log-level",
        "warning",
    ]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    server_before = server_cpu()
    with (folder / "rsagg.out").open("wb") as out, (folder / "rsagg.err").open("wb") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=folder, stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
    with connect(state or folder / "data" / "state.db") as st:
        held = st.count_resources()
    run = Run("postgresql" if state else "sqlite", n, wall, held, os.waitstatus_to_exitcode(status))
    run.cpu = usage.ru_utime + usage.ru_stime
    if state:
        time.sleep(1.0)  # the postmaster reaps the ended backends (a zombie's CPU time is not readable)
        run.db_cpu = server_cpu() - server_before
    return run


def server_cpu() -> float:
    """CPU seconds used so far by the PostgreSQL server processes on the machine (ours is the only one)."""
    total = 0.0
    for p in psutil.process_iter(["name", "cpu_times"]):
        t = p.info["cpu_times"]
        if p.info["name"] in ("postgres", "postmaster") and t is not None:
            total += t.user + t.system + t.children_user + t.children_system  # + the ended backends
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--resources", type=int, default=5_000, help="resources harvested per run (5,000)")
    p.add_argument("--repeat", type=int, default=2, help="runs per backend, alternating (2)")
    p.add_argument(
        "--workdir", help="where the site and runs go (default: a temporary folder, removed after)"
    )
    args = p.parse_args(argv)
    if not pgserver.available():
        raise SystemExit(f"PostgreSQL 15 is not installed ({pgserver.BIN}): apt-get install -y postgresql-15")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="rsagg-bench-cluster-"))
    work.mkdir(parents=True, exist_ok=True)
    n = args.resources
    runs: list[Run] = []
    server = bench_harvest.Server(work / "site", work / "server.log")
    try:
        print(f"work folder {work}; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}", flush=True)
        base = bench_harvest.make_site(work / "site", n, server)
        with pgserver.running(durable=True) as pg:
            print(f"  PostgreSQL 15 at 127.0.0.1:{pg.port} (fsync on)", flush=True)
            for i in range(args.repeat):
                for backend in ("sqlite", "postgresql"):
                    state = pg.fresh_database() if backend == "postgresql" else ""
                    print(f"  run {i + 1} {backend}: rsagg harvest --once ...", end=" ", flush=True)
                    run = harvest(work / "runs" / f"{backend}-{i}", base, n, state)
                    runs.append(run)
                    failed = f"  FAILED (exit {run.code}, {run.held:,} held)"
                    print(f"{run.wall:.1f} s" + ("" if run.ok else failed), flush=True)
    finally:
        server.stop()
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}\n")
    print("single-node PostgreSQL vs SQLite (baseline harvest, latency-free local upstream)")
    head = (f"{'state':<12} {'runs':>5} {'resources':>10} {'median s':>9} {'resources/s':>12} {'ratio':>7}"
            f" {'rsagg CPU s':>12} {'server CPU s':>13}")  # fmt: skip
    print(head + "\n" + "-" * len(head))
    rate = {}
    for backend in ("sqlite", "postgresql"):
        mine = [r for r in runs if r.backend == backend and r.ok]
        if not mine:
            print(f"{backend:<12} no complete run")
            continue
        wall = statistics.median(r.wall for r in mine)
        cpu, db_cpu = statistics.median(r.cpu for r in mine), statistics.median(r.db_cpu for r in mine)
        rate[backend] = n / wall
        ratio = rate[backend] / rate["sqlite"] if "sqlite" in rate else float("nan")
        print(f"{backend:<12} {len(mine):>5} {n:>10,} {wall:>9.1f} {rate[backend]:>12,.0f} {ratio:>6.2f}x"
              f" {cpu:>12.1f} {db_cpu:>13.1f}")  # fmt: skip
    print("(medians; CPU s: of the rsagg process, and of the PostgreSQL server during the run)")
    ok = all(r.ok for r in runs)
    if len(rate) == 2:
        ratio = rate["postgresql"] / rate["sqlite"]
        verdict = "OK" if ratio >= TARGET_PG_VS_SQLITE else "MISSED"
        print(f"\nPostgreSQL {ratio:.2f}x SQLite (target >= {TARGET_PG_VS_SQLITE}x) {verdict}")
    if not ok:
        print(
            "INCOMPLETE RUNS: "
            + "; ".join(f"{r.backend}: exit {r.code}, {r.held:,} held" for r in runs if not r.ok)
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
