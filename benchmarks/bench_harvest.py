"""Baseline harvest speed and memory: `rsagg harvest --once` next to resync 2.0.1 `resync-sync --baseline`.

The upstream favours neither tool: a folder of small files whose Source documents (Resource List with md5
hashes, Capability List, Source Description at ``/.well-known/resourcesync``) are written by resync's own
``resync-build``, served by a minimal static file server (hypercorn, one process of its own) that can add
a fixed latency to every request. Both tools discover from the site root, as they would on the web.

Cases, on the same files and documents: (a) plain loopback, (b) every request answered after
``--latency-ms`` (50 ms). Each tool runs as a child process in a fresh folder; the parent takes the wall
time from start to exit and the child's peak RSS from ``os.wait4``, then checks that the tool really holds
every resource (resync: the files on disk and its "SYNCED" line; rsagg: its exit code and ``rsagg status``).
Finally, the memory run: rsagg alone harvesting ``--big`` resources (200,000) listed by a Resource List
Index (resync-build splits lists above 50,000 entries), also without added latency.

resync fetches one resource at a time, so at 50 ms it manages ~19 resources/s (10,000 take ~9 minutes).
``--resync-sample M`` runs it at 50 ms on a Resource List of the first M resources only and extrapolates
(conservatively: its start-up time is measured apart and not multiplied); the table says so.

Before and after (``--before DIR``): DIR is another checkout of rsagg (e.g. ``git worktree add /tmp/before
main``, with its parser extension built: ``python setup.py build_ext --inplace`` there, or the ``.so``
copied). Case a (0 ms) is then run for both checkouts on the same site, interleaved ``--repeat`` times per
size of ``--compare`` (e.g. ``10000,50000``), each run with the machine's load average next to it; the
table gives CPU microseconds per resource (the child's user + system time / resources, start-up included),
resources/s, the medians and the ratio, and with two sizes or more the marginal CPU per resource (the slope
between the smallest and the largest size: start-up and documents left out). ``--compare-only`` runs just
that (no resync, no case b, no memory run).

Like with like: each tool runs with its defaults (rsagg: ``harvest.per_host = 8``, ``workers = 16``;
resync: one request at a time), and the table says so. ``--per-host N`` gives rsagg ``per_host = N`` and
``workers = N`` instead (resync has no such setting), printed in the table too: rsagg's polite defaults
cap a 50 ms upstream at 160 resources/s, which is what they are for.

    python benchmarks/bench_harvest.py                        # 10,000 at 0 and 50 ms + 200,000 (~20 min)
    python benchmarks/bench_harvest.py --resync-sample 1000   # resync extrapolated at 50 ms (~5 min)
    python benchmarks/bench_harvest.py --resources 2000 --no-big --resync-sample 200   # quick look
    python benchmarks/bench_harvest.py --before /tmp/before --compare 10000,50000 --compare-only
"""

from __future__ import annotations

import argparse
import email.utils
import json
import mimetypes
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from _harness import ROOT, harvest_once, lifespan, run_child, serve_until_sigterm
from _headline import headline

#: rsagg's default ``harvest.per_host`` (aggregator/config.py): requests at a time to one host.
DEFAULT_PER_HOST = 8
TARGETS = {"ratio_latency": 20.0, "ratio_loopback": 1.0, "big_rss_mb": 150.0}
FILES_PER_DIR = 100  # the sample for resync is made of whole folders


# -- the upstream: a static file server with optional latency (child process) ---------------------------


def static_app(root: str, latency: float):
    """An ASGI app serving the files under ``root`` (GET/HEAD), each answer ``latency`` seconds late."""
    import trio

    base = os.path.realpath(root)

    async def app(scope, receive, send):
        if await lifespan(scope, receive, send):
            return
        if scope["type"] != "http":
            return
        if latency:
            await trio.sleep(latency)
        path = os.path.realpath(os.path.join(base, scope["path"].lstrip("/")))
        status, headers, body = 404, [], b"not found\n"
        if scope["method"] not in ("GET", "HEAD"):
            status, body = 405, b"method not allowed\n"
        elif path.startswith(base + os.sep) and os.path.isfile(path):
            with open(path, "rb") as f:
                mtime = os.fstat(f.fileno()).st_mtime
                body = f.read()
            status = 200
            ctype = mimetypes.guess_type(path)[0] or "application/octet-stream"
            headers = [
                (b"content-type", ctype.encode()),
                (b"last-modified", email.utils.formatdate(mtime, usegmt=True).encode()),
            ]
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})

    return app


def serve_main(folder: str, port: int, latency: float) -> int:
    """Child mode: serve ``folder``; print the base URL once listening; stop on SIGTERM."""
    return serve_until_sigterm(static_app(folder, latency), port)


class Server:
    """The upstream in its own process; ``restart`` keeps the port (the documents name it)."""

    def __init__(self, folder: Path, log: Path) -> None:
        self.folder, self.log = folder, log
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.base = ""

    def start(self, latency: float) -> str:
        cmd = [sys.executable, __file__, "--serve", str(self.folder), "--port", str(self.port),
               "--latency", str(latency)]  # fmt: skip
        with self.log.open("ab") as err:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err)
        line = self.proc.stdout.readline().decode().strip()  # type: ignore[union-attr]
        if not line.startswith("http://"):
            self.proc.kill()
            raise SystemExit(f"the static server did not start (see {self.log})")
        self.base = line
        self.port = int(line.rsplit(":", 1)[1])
        return self.base

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def restart(self, latency: float) -> str:
        self.stop()
        return self.start(latency)

    def cpu(self) -> float:
        """CPU seconds the server process has used so far (Linux /proc)."""
        assert self.proc is not None
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- the site: files + documents written by resync-build ---------------------------------------------


def tool(name: str) -> str:
    """A console script of this environment (next to the interpreter), else from PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        raise SystemExit(f"{name} not found: pip install resync==2.0.1")
    return found


def write_files(site: Path, n: int, seed: int = 1) -> int:
    """``n`` text files of 0.5-4 KB under res/DDDD/ (FILES_PER_DIR each); returns the bytes written."""
    rng = random.Random(seed)
    total = 0
    for i in range(n):
        folder = site / "res" / f"{i // FILES_PER_DIR:04d}"
        if i % FILES_PER_DIR == 0:
            folder.mkdir(parents=True, exist_ok=True)
        data = rng.randbytes(rng.randrange(256, 2048)).hex().encode()
        (folder / f"{i:07d}.txt").write_bytes(data)
        total += len(data)
    return total


def build(*args: str) -> None:
    out = subprocess.run([tool("resync-build"), *args], capture_output=True, text=True)
    if out.returncode != 0 or "Error" in out.stderr:
        raise SystemExit(f"resync-build {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}")


def write_documents(site: Path, base: str, sample: int = 0) -> None:
    """Resource List (first: it scans the folder), Capability List, Source Description; a sample list."""
    mapping = f"{base}={site}"
    build("--write-resourcelist", "--outfile", str(site / "resourcelist.xml"), "--hash", "md5",
          "--capabilitylist-link", f"{base}/capabilitylist.xml", mapping)  # fmt: skip
    build("--write-capabilitylist", f"resourcelist={base}/resourcelist.xml",
          "--outfile", str(site / "capabilitylist.xml"),
          "--sourcedescription-link", f"{base}/.well-known/resourcesync", mapping)  # fmt: skip
    (site / ".well-known").mkdir(exist_ok=True)
    build("--write-sourcedescription", f"{base}/capabilitylist.xml",
          "--outfile", str(site / ".well-known" / "resourcesync"), mapping)  # fmt: skip
    if sample:
        folders = [str(site / "res" / f"{d:04d}") for d in range(sample // FILES_PER_DIR)]
        build("--write-resourcelist", "--paths", ",".join(folders), "--hash", "md5",
              "--outfile", str(site / "sample-resourcelist.xml"), mapping)  # fmt: skip


def make_site(site: Path, n: int, server: Server, sample: int = 0) -> str:
    site.mkdir(parents=True)
    start = time.perf_counter()
    size = write_files(site, n)
    base = server.start(0.0)  # first the port, then the documents that name it
    write_documents(site, base, sample)
    print(f"  {n:,} files ({size / 1e6:.1f} MB) and their documents in {time.perf_counter() - start:.1f} s,"
          f" served at {base}", flush=True)  # fmt: skip
    return base


# -- running the tools -----------------------------------------------------------------------------------


@dataclass
class Run:
    case: str
    tool: str
    resources: int
    wall: float
    rss_mb: float
    server_cpu: float = 0.0  # CPU seconds the upstream spent serving this run
    cpu: float = 0.0  # CPU seconds (user + system) of the tool's process
    load: float = 0.0  # the machine's 1-minute load average when the run started
    note: str = ""
    extrapolated_from: int = 0
    ok: bool = True
    problems: list[str] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.resources / self.wall if self.wall else float("inf")

    @property
    def cpu_us(self) -> float:
        """CPU microseconds per resource (start-up included)."""
        return self.cpu / self.resources * 1e6 if self.resources else 0.0


def run_rsagg(
    case: str, base: str, n: int, folder: Path, per_host: int | None = None, root: Path = ROOT
) -> Run:
    load = os.getloadavg()[0]
    done = harvest_once(folder, base, per_host=per_host, root=root)
    run = Run(case, "rsagg", n, done.wall, done.rss_mb, cpu=done.cpu, load=load)
    if done.code != 0:
        run.problems.append(f"exit code {done.code} (see {folder}/rsagg.err)")
    status = subprocess.run(
        [sys.executable, "-m", "aggregator", "status", "-c", "rsagg.toml", "--json"],
        cwd=folder, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(root)},
    )  # fmt: skip
    try:
        src = json.loads(status.stdout)["sources"][0]
        if src["resources"] != n or src["state"] != "ok":
            run.problems.append(f"rsagg status: {src['resources']:,} resources, state {src['state']}")
    except (ValueError, KeyError, IndexError):
        run.problems.append(f"rsagg status unreadable: {status.stdout[:200]} {status.stderr[:200]}")
    run.ok = not run.problems
    return run


def resync_startup(folder: Path) -> float:
    """Wall time of resync-sync starting and exiting (interpreter + imports): not per resource."""
    folder.mkdir(parents=True, exist_ok=True)
    return min(run_child([tool("resync-sync"), "--help"], folder, "startup").wall for _ in range(3))


def run_resync(case: str, base: str, n: int, folder: Path, sample: int = 0, startup: float = 0.0) -> Run:
    folder.mkdir(parents=True)
    cmd = [tool("resync-sync"), "--baseline", "--hash", "md5"]
    expected = n
    if sample:
        cmd += ["--sitemap", f"{base}/sample-resourcelist.xml"]
        expected = sample
    cmd += [base, "dst"]
    load = os.getloadavg()[0]
    done = run_child(cmd, folder, "resync")
    wall, code = done.wall, done.code
    text = (folder / "resync.out").read_text(errors="replace") + (folder / "resync.err").read_text(
        errors="replace"
    )
    held = sum(len(files) for _, _, files in os.walk(folder / "dst"))
    run = Run(case, "resync", expected, wall, done.rss_mb, cpu=done.cpu, load=load)
    if code != 0 or "FatalError" in text or f"created={expected}," not in text:
        run.problems.append(f"resync did not report {expected:,} created (see {folder}/resync.err)")
    if held != expected:
        run.problems.append(f"resync holds {held:,} files, expected {expected:,}")
    if sample and not run.problems:
        # Conservative: only the per-resource part grows with n (start-up is paid once).
        run.extrapolated_from = sample
        run.wall = startup + (wall - startup) * n / sample
        run.resources = n
        run.note = f"extrapolated from {sample:,} resources in {wall:.1f} s"
    run.ok = not run.problems
    return run


# -- output ----------------------------------------------------------------------------------------------


def settings(per_host: int | None) -> str:
    """What each tool ran with, for the table (like with like: the defaults unless ``--per-host``)."""
    ours = (f"rsagg per_host = {per_host}, workers = {per_host} (explicit)" if per_host
            else "rsagg defaults (per_host = 8, workers = 16)")  # fmt: skip
    return f"{ours}; resync-sync defaults (one request at a time)"


def table(runs: list[Run], settings: str = "") -> str:
    head = (f"{'case':<26} {'tool':<7} {'resources':>10} {'wall s':>9} {'resources/s':>12}"
            f" {'CPU us/res':>11} {'peak RSS MB':>12} {'ratio':>8} {'upstream CPU s':>15}"
            f" {'load':>5}  note")  # fmt: skip
    lines = [head, "-" * (len(head) + 30)]
    for r in runs:
        ref = next((x for x in runs if x.case == r.case and x.tool == "resync"), None)
        ratio = f"{r.rate / ref.rate:.1f}x" if ref else "-"
        note = r.note + ("" if r.ok else ("; " if r.note else "") + "FAILED: " + "; ".join(r.problems))
        lines.append(f"{r.case:<26} {r.tool:<7} {r.resources:>10,} {r.wall:>9.1f} {r.rate:>12,.1f}"
                     f" {r.cpu_us:>11,.0f} {r.rss_mb:>12.1f} {ratio:>8} {r.server_cpu:>15.1f} {r.load:>5.2f}"
                     f"  {note}")  # fmt: skip
    lines.append(f"settings: {settings}" if settings else "settings: not recorded")
    lines.append("ratio = resources/s of the tool / resources/s of resync in the same case;")
    lines.append("upstream CPU = CPU time the static server spent on the run (for a sample: on the sample)")
    return "\n".join(lines)


def verdicts(runs: list[Run], latency_case: str, loopback_case: str, big_case: str) -> list[str]:
    out = []

    def pair(case: str) -> tuple[Run | None, Run | None]:
        by = {r.tool: r for r in runs if r.case == case}
        return by.get("rsagg"), by.get("resync")

    for case, target, words in ((latency_case, TARGETS["ratio_latency"], "faster than resync"),
                                (loopback_case, TARGETS["ratio_loopback"], "resync's speed")):  # fmt: skip
        ours, theirs = pair(case)
        if ours and theirs and ours.ok and theirs.ok:
            ratio = ours.rate / theirs.rate
            how = " (resync extrapolated)" if theirs.extrapolated_from else ""
            out.append(f"{case}: rsagg {ratio:.1f}x resync{how} (target >= {target:g}x {words})"
                       f" {'OK' if ratio >= target else 'MISSED'}")  # fmt: skip
    big = next((r for r in runs if r.case == big_case), None)
    if big and big.ok:
        ok = big.rss_mb < TARGETS["big_rss_mb"]
        out.append(f"{big_case}: peak RSS {big.rss_mb:.1f} MB (target < {TARGETS['big_rss_mb']:g} MB)"
                   f" {'OK' if ok else 'MISSED'}")  # fmt: skip
    bad = [r for r in runs if not r.ok]
    if bad:
        out.append(
            "INCOMPLETE RUNS: " + "; ".join(f"{r.case}/{r.tool}: {', '.join(r.problems)}" for r in bad)
        )
    return out


# -- before and after: two checkouts of rsagg, interleaved -------------------------------------------------


def compare(work: Path, sizes: list[int], before: Path, repeat: int, per_host: int | None) -> list[str]:
    """Case a (0 ms) for the checkout ``before`` and this one, interleaved, per size; the table's lines."""
    runs: list[tuple[int, str, Run]] = []
    for n in sizes:
        server = Server(work / f"cmp-site-{n}", work / f"cmp-server-{n}.log")
        try:
            base = make_site(work / f"cmp-site-{n}", n, server)
            for i in range(repeat):
                for label, root in (("before", before), ("after", ROOT)):
                    print(f"  {n:,} resources, {label} #{i + 1} (load {os.getloadavg()[0]:.2f}) ...", end=" ",
                          flush=True)  # fmt: skip
                    folder = work / "runs" / f"cmp-{n}-{label}-{i}"
                    cpu_before = server.cpu()
                    run = run_rsagg(f"a) loopback {n}", base, n, folder, per_host, root=root)
                    run.server_cpu = server.cpu() - cpu_before
                    runs.append((n, label, run))
                    failed = "" if run.ok else "  FAILED: " + "; ".join(run.problems)
                    print(f"{run.wall:.1f} s, {run.cpu_us:,.0f} us CPU/resource{failed}", flush=True)
                    shutil.rmtree(folder / "data", ignore_errors=True)
        finally:
            server.stop()
    head = (f"{'resources':>10} {'checkout':<8} {'run':>4} {'load':>5} {'wall s':>8} {'resources/s':>12}"
            f" {'CPU s':>7} {'CPU us/res':>11}")  # fmt: skip
    lines = [f"before = {before}, after = {ROOT}; 0 ms (case a); {settings(per_host)}", head, "-" * len(head)]
    for n, label, r in runs:
        i = sum(1 for m, lab, _ in runs[: runs.index((n, label, r)) + 1] if m == n and lab == label)
        bad = "" if r.ok else "  FAILED"
        lines.append(f"{n:>10,} {label:<8} {i:>4} {r.load:>5.2f} {r.wall:>8.1f} {r.rate:>12,.0f}"
                     f" {r.cpu:>7.2f} {r.cpu_us:>11,.0f}{bad}")  # fmt: skip
    lines.append("medians:")
    med: dict[tuple[int, str], tuple[float, float, float]] = {}
    for n in sizes:
        for label in ("before", "after"):
            mine = [r for m, lab, r in runs if m == n and lab == label and r.ok]
            if mine:
                med[n, label] = (
                    statistics.median(r.cpu_us for r in mine),
                    statistics.median(r.rate for r in mine),
                    statistics.median(r.cpu for r in mine),
                )
        if (n, "before") in med and (n, "after") in med:
            b, a = med[n, "before"], med[n, "after"]
            lines.append(f"  {n:>10,}: CPU us/resource {b[0]:,.0f} -> {a[0]:,.0f} ({b[0] / a[0]:.2f}x fewer);"
                         f" resources/s {b[1]:,.0f} -> {a[1]:,.0f} ({a[1] / b[1]:.2f}x)")  # fmt: skip
    lo, hi = min(sizes), max(sizes)
    if lo != hi and all((n, lab) in med for n in (lo, hi) for lab in ("before", "after")):
        slope = {lab: (med[hi, lab][2] - med[lo, lab][2]) / (hi - lo) * 1e6 for lab in ("before", "after")}
        lines.append(f"  marginal CPU per resource ({lo:,} -> {hi:,}): {slope['before']:,.0f} -> "
                     f"{slope['after']:,.0f} us ({slope['before'] / slope['after']:.2f}x fewer)")  # fmt: skip
    return lines


# -- driver ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--resources", type=int, default=10_000, help="resources in the compared runs (10,000)")
    p.add_argument("--latency-ms", type=float, default=50.0, help="latency added per request in case b (50)")
    p.add_argument(
        "--big", type=int, default=200_000, help="resources in the rsagg-only memory run (200,000)"
    )
    p.add_argument(
        "--per-host", type=int, default=None, metavar="N", help="rsagg's per_host, workers (default: its own)"
    )
    p.add_argument("--no-big", dest="big", action="store_const", const=0, help="skip the memory run")
    p.add_argument("--resync-sample", type=int, default=0, metavar="M",
                   help="at the added latency, run resync on the first M resources and extrapolate"
                        f" (a multiple of {FILES_PER_DIR}; default 0: run it in full)")  # fmt: skip
    p.add_argument(
        "--before",
        type=Path,
        metavar="DIR",
        help="another rsagg checkout to compare with at 0 ms, interleaved (see above)",
    )
    p.add_argument(
        "--compare",
        default="",
        metavar="N,N",
        help="resources per compared site with --before (default: --resources)",
    )
    p.add_argument("--repeat", type=int, default=2, help="runs per checkout and size with --before (2)")
    p.add_argument("--compare-only", action="store_true", help="with --before: only the comparison")
    p.add_argument("--workdir", help="where sites and runs go (default: a temporary folder, removed after)")
    p.add_argument("--keep", action="store_true", help="keep the work folder")
    p.add_argument("--serve", help=argparse.SUPPRESS)  # child mode: the static server
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--latency", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        return serve_main(args.serve, args.port, args.latency)
    n = args.resources
    sample = args.resync_sample
    if sample and (sample % FILES_PER_DIR or not 0 < sample < n):
        p.error(f"--resync-sample must be a multiple of {FILES_PER_DIR} below --resources")

    work = Path(args.workdir or tempfile.mkdtemp(prefix="rsagg-bench-harvest-"))
    work.mkdir(parents=True, exist_ok=True)
    servers: list[Server] = []
    runs: list[Run] = []
    if args.before and not (args.before / "aggregator").is_dir():
        p.error(f"--before {args.before}: no aggregator/ package there")
    if args.compare_only and not args.before:
        p.error("--compare-only needs --before")
    if args.compare_only:
        sizes = [int(x) for x in (args.compare or str(n)).split(",")]
        print(f"work folder {work}; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}", flush=True)
        try:
            lines = compare(work, sizes, args.before.resolve(), args.repeat, args.per_host)
        finally:
            if not (args.keep or args.workdir):
                shutil.rmtree(work, ignore_errors=True)
        print(f"load average after: {os.getloadavg()[0]:.2f}")
        print()
        print("\n".join(lines))
        return 0
    loopback, delayed = "a) loopback", f"b) +{args.latency_ms:g} ms/request"
    big_case = "c) index, loopback"
    try:
        print(f"work folder {work}; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}", flush=True)
        print(f"settings: {settings(args.per_host)}", flush=True)
        server = Server(work / "site", work / "server.log")
        servers.append(server)
        base = make_site(work / "site", n, server, sample)
        startup = resync_startup(work / "runs" / "startup") if sample else 0.0

        for case, latency in ((loopback, 0.0), (delayed, args.latency_ms / 1000)):
            if latency:
                server.restart(latency)
            slug = case.split(")")[0]
            print(f"case {case}:", flush=True)
            use_sample = sample if latency else 0
            for name in ("resync", "rsagg"):  # resync first: the page cache is as warm for both
                folder = work / "runs" / f"{slug}-{name}"
                cpu_before = server.cpu()
                if name == "resync":
                    what = f" on the first {use_sample:,} (sample)" if use_sample else ""
                    print(f"  resync-sync --baseline{what} ...", end=" ", flush=True)
                    run = run_resync(case, base, n, folder, use_sample, startup)
                else:
                    print("  rsagg harvest --once ...", end=" ", flush=True)
                    run = run_rsagg(case, base, n, folder, args.per_host)
                run.server_cpu = server.cpu() - cpu_before
                runs.append(run)
                shown = f"{run.wall:.1f} s" + (f" ({run.note})" if run.note else "")
                print(shown + ("" if run.ok else "  FAILED: " + "; ".join(run.problems)), flush=True)
                if name == "resync" and run.ok:
                    shutil.rmtree(folder / "dst", ignore_errors=True)  # disk, and nothing else needs it
        server.stop()

        if args.big:
            print(f"case {big_case}: {args.big:,} resources, rsagg only", flush=True)
            big_server = Server(work / "big-site", work / "big-server.log")
            servers.append(big_server)
            big_base = make_site(work / "big-site", args.big, big_server)
            print("  rsagg harvest --once ...", end=" ", flush=True)
            cpu_before = big_server.cpu()
            run = run_rsagg(big_case, big_base, args.big, work / "runs" / "c-rsagg", args.per_host)
            run.server_cpu = big_server.cpu() - cpu_before
            runs.append(run)
            print(
                f"{run.wall:.1f} s" + ("" if run.ok else "  FAILED: " + "; ".join(run.problems)), flush=True
            )
            big_server.stop()
        if args.before:
            print("before / after, 0 ms:", flush=True)
            sizes = [int(x) for x in (args.compare or str(n)).split(",")]
            comparison = compare(work, sizes, args.before.resolve(), args.repeat, args.per_host)
    finally:
        for s in servers:
            s.stop()
        if not (args.keep or args.workdir):
            shutil.rmtree(work, ignore_errors=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print()
    print(table(runs, settings(args.per_host)))
    print()
    for line in verdicts(runs, delayed, loopback, big_case):
        print(line)
    if args.before:
        print()
        print("\n".join(comparison))
    at_zero = next((r for r in runs if r.case == loopback and r.tool == "rsagg" and r.ok), None)
    if at_zero is not None:  # the target is a third of the CPU of the tree before the lean path (--before)
        what = f"{at_zero.resources:,} resources, start-up included"
        headline(f"harvest at 0 ms: rsagg CPU per resource ({what})", f"{at_zero.cpu_us:,.0f} µs",
                 "≥ 3× fewer than before the lean path")  # fmt: skip
    ours = next((r for r in runs if r.case == delayed and r.tool == "rsagg" and r.ok), None)
    if ours and args.latency_ms > 0:  # per_host requests at a time, each one round trip: C / RTT
        limit = (args.per_host or DEFAULT_PER_HOST) / (args.latency_ms / 1000)
        print(f"{delayed}: rsagg {ours.rate:,.0f} resources/s = {ours.rate / limit:.2f} of its limit"
              f" per_host / latency = {limit:,.0f}/s (the ratio to resync is bounded by it)")  # fmt: skip
    return 0 if all(r.ok for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
