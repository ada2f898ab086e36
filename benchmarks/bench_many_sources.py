"""Many small Sources against one big one: is a resource harvested from 300 Sources of 20 as cheap as one
from a single Source of 6,000?

The upstream is one server on loopback (hypercorn in a process of its own, ``aggregator.run.serving``) that
makes up the documents: for every Source ``/sI/`` a Capability List and a Resource List (md5 hashes,
lengths) of its resources ``/sI/r/J`` (0.5-2 KB of text each). Both cases configure their Sources by
their Capability List URL and run ``rsagg harvest --once`` with rsagg's defaults (nothing tuned: the same
``per_host``, ``workers``, batch size), each in a fresh folder, as a child process: wall time from start
to exit, CPU and peak RSS from ``os.wait4``. Cases, interleaved ``--repeat`` times (medians shown):

- ``one``: one Source of N×M resources;
- ``many``: N Sources of M resources each (N×M in all, the same bodies).

The table gives time, CPU, the ratio many/one of each, the extra CPU and memory per Source, and the load
average of the machine next to each run. ``--profile FILE`` also runs both cases under cProfile
and prints the functions whose time grows most from one to many (the per-source cost).

    python benchmarks/bench_many_sources.py                      # 300 x 20 vs 1 x 6000, 3 rounds
    python benchmarks/bench_many_sources.py --sources 100 --per-source 20 --repeat 1   # quick look
    python benchmarks/bench_many_sources.py --profile /tmp/many.prof --repeat 1
    python benchmarks/bench_many_sources.py --before /tmp/before   # another checkout, interleaved

``--before DIR``: DIR is another checkout of rsagg; each round then runs both cases for both checkouts
(the order turned round every round) and the table adds the before checkout's ratio and its CPU, so a
change is judged against the tree before it on the same machine at the same time.

``--threads``: the CPU of each run split by thread, read from ``/proc/PID/task`` while it runs (Linux):
the event loop's thread (the main one) and the others together (the state writer's thread, chiefly), with
the medians and the extra CPU of each per extra Source.

``--opcodes``: counting instead of timing. Each case runs once, with every Python opcode it executes
counted (``benchmarks/_opcodes.py``: all threads, each opcode for the nearest rsagg function on the stack),
and a third case, one Source of N×M/10, gives the opcodes per resource of one Source (the slope: start-up
cancels out). The table: each case's total, the slope, the start-up, the opcodes per extra Source, many/one
with start-up left out, and the 15 rsagg functions whose opcodes grow most per extra Source; with
``--before``, both checkouts side by side. A run takes about six times the CPU of an untraced one; the
count does not swing with the machine's load, but leaves out C code (SQLite, lxml, the kernel).

    python benchmarks/bench_many_sources.py --opcodes [--before /tmp/before]

``--phases``: what a small Source's extra CPU is made of, at full speed. Each case runs ``--repeat`` times
(interleaved rounds; each figure is its median over them), with the same settings as the timed runs,
under ``benchmarks/_phases.py``: every task step's CPU on the event loop
goes to the part its task is in (a sync, its discovery, its baseline, the Resource List's entries, the
pipeline's fetches and commits, each state write), or to the task's name; each state write's CPU in the
writer's thread to the function written; then the process's CPU, its write syscalls, the bytes it wrote
and its context switches. The table gives each part's own CPU in both cases and the extra per Source;
with ``--before DIR``, DIR's checkout runs the same cases and a second table sets each part's extra per
Source beside DIR's.

    python benchmarks/bench_many_sources.py --phases [--before /tmp/before]

``--latency MS``: the upstream answers each request MS milliseconds late (a trio sleep before it
answers: no CPU). At 0 (the default) the harvest is bound by the CPU of this machine, where rsagg, its
writer thread and the upstream share the cores; with a delay it is bound by the host's request slots, as
a harvest of real Sources is. Why both: at full speed, the more syncs run at once, the more CPU each
resource costs them (the threads and the upstream take turns on the cores), so the many case's CPU is
partly the price of its parallelism (docs/benchmarks.md, "Many sources", the thirteenth pass).
"""

from __future__ import annotations

import argparse
import atexit
import base64
import hashlib
import json
import os
import pstats
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from _harness import ROOT, Finished, lifespan, plugins_off, run_child, serve_until_sigterm
from _headline import headline
from _opcodes import Counts, Figures
from _opcodes import table as opcodes_table
from _phases import Phases
from _phases import compare as phases_compare
from _phases import table as phases_table

TARGET = 1.3  # many/one, per resource
#: ``--latency``: read by the upstream's process (set by ``main`` for every upstream it starts).
LATENCY_ENV = "RSAGG_BENCH_LATENCY_MS"

#: ``--opcodes``: the counter (run in place of ``python -m aggregator``) and the modules it imports before it
#: counts (the harvest's own imports, the same in every case: left out, they cost no traced time).
OPCODES = Path(__file__).resolve().parent / "_opcodes.py"
#: ``--phases``: the runner that sums the CPU of a harvest's parts.
PHASES = Path(__file__).resolve().parent / "_phases.py"
PRELOAD = ("aggregator.commands.harvest", "aggregator.harvest.source", "aggregator.run.compose")
RS = "http://www.openarchives.org/rs/terms/"
SM = "http://www.sitemaps.org/schemas/sitemap/0.9"


# -- the upstream: documents made up on request (child process) ----------------------------------------


def bodies(sources: int, per_source: int, seed: int = 1) -> list[bytes]:
    """The ``sources * per_source`` resource bodies, the same in both cases (``/sI/r/J`` is body I*M+J)."""
    rng = random.Random(seed)
    return [rng.randbytes(rng.randrange(256, 1024)).hex().encode() for _ in range(sources * per_source)]


def upstream_app(sources: int, per_source: int, big: int, counts: Counter[str] | None = None):
    """An ASGI app: ``/sI/capabilitylist.xml``, ``/sI/resourcelist.xml``, ``/sI/r/J`` for I < ``sources``
    (``per_source`` resources each), and ``/big/...`` of ``big`` resources (the same bodies). ``counts``:
    the requests it answered, by kind (document, resource, other)."""
    data = bodies(max(sources, 1), per_source) if sources else bodies(1, big)
    md5 = [hashlib.md5(b).hexdigest() for b in data]

    def capabilitylist(base: str) -> bytes:
        return (
            f'<?xml version="1.0" encoding="UTF-8"?>\n<urlset xmlns="{SM}" xmlns:rs="{RS}">'
            f'<rs:md capability="capabilitylist"/>'
            f'<url><loc>{base}resourcelist.xml</loc><rs:md capability="resourcelist"/></url></urlset>\n'
        ).encode()

    def resourcelist(base: str, first: int, count: int) -> bytes:
        lines = [
            f'<?xml version="1.0" encoding="UTF-8"?>\n<urlset xmlns="{SM}" xmlns:rs="{RS}">'
            f'<rs:ln rel="up" href="{base}capabilitylist.xml"/>'
            f'<rs:md capability="resourcelist" at="2026-01-01T00:00:00Z" completed="2026-01-01T00:00:01Z"/>'
        ]
        for j in range(count):
            k = first + j
            lines.append(
                f"<url><loc>{base}r/{j}</loc><lastmod>2026-01-01T00:00:00Z</lastmod>"
                f'<rs:md hash="md5:{md5_b64[k]}" length="{len(data[k])}" type="text/plain"/></url>'
            )
        lines.append("</urlset>\n")
        return "\n".join(lines).encode()

    md5_b64 = [base64.b64encode(bytes.fromhex(h)).decode() for h in md5]

    delay = float(os.environ.get(LATENCY_ENV) or 0) / 1000

    async def app(scope, receive, send):
        if await lifespan(scope, receive, send):
            return
        if scope["type"] != "http":
            return
        if delay:
            import trio

            await trio.sleep(delay)
        host = dict(scope["headers"]).get(b"host", b"127.0.0.1").decode()
        path = scope["path"]
        status, ctype, body = 404, "text/plain", b"not found\n"
        parts = path.strip("/").split("/")
        if parts[0] == "big" and big:
            first, count, base = 0, big, f"http://{host}/big/"
        elif parts[0].startswith("s") and parts[0][1:].isdigit() and int(parts[0][1:]) < sources:
            i = int(parts[0][1:])
            first, count, base = i * per_source, per_source, f"http://{host}/{parts[0]}/"
        else:
            count = -1
        if count >= 0:
            if parts[1:] == ["capabilitylist.xml"]:
                status, ctype, body = 200, "application/xml", capabilitylist(base)
            elif parts[1:] == ["resourcelist.xml"]:
                status, ctype, body = 200, "application/xml", resourcelist(base, first, count)
            elif len(parts) == 3 and parts[1] == "r" and parts[2].isdigit() and int(parts[2]) < count:
                status, body = 200, data[first + int(parts[2])]
        if counts is not None:
            counts["resource" if status == 200 and ctype == "text/plain" else
                   "document" if status == 200 else "other"] += 1  # fmt: skip
        headers = [(b"content-type", ctype.encode()), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


def serve_main(sources: int, per_source: int, big: int, counts_file: str = "") -> int:
    """Child mode: serve the made-up Sources; print the base URL once listening; stop on SIGTERM, then
    write the requests answered, by kind, to ``counts_file`` (JSON)."""
    counts: Counter[str] = Counter()
    if counts_file:
        atexit.register(lambda: Path(counts_file).write_text(json.dumps(counts)))
    return serve_until_sigterm(upstream_app(sources, per_source, big, counts))


class Upstream:
    """The upstream server process of one case."""

    def __init__(self, sources: int, per_source: int, big: int, log: Path) -> None:
        self.counts_file = log.parent / f"upstream-{os.getpid()}-{id(self)}.json"
        cmd = [sys.executable, __file__, "--serve", "--sources", str(sources), "--per-source",
               str(per_source), "--big", str(big), "--counts", str(self.counts_file)]  # fmt: skip
        with log.open("ab") as err:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err)
        line = self.proc.stdout.readline().decode().strip()  # type: ignore[union-attr]
        if not line.startswith("http://"):
            self.proc.kill()
            raise SystemExit(f"the upstream did not start (see {log})")
        self.base = line.rstrip("/")

    def stop(self) -> dict[str, int]:
        """Stop it; the requests it answered, by kind."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        try:
            return json.loads(self.counts_file.read_text())
        except (OSError, ValueError):
            return {}


# -- the runs ------------------------------------------------------------------------------------------


@dataclass
class Run:
    case: str
    sources: int
    resources: int
    done: Finished
    load: float
    #: The checkout that ran ("after": this one; "before": ``--before``).
    tree: str = "after"
    #: Requests the upstream answered, by kind (document, resource, other).
    requests: dict[str, int] = field(default_factory=dict)
    #: ``--threads``: CPU seconds of the event loop's thread and of the process's other threads.
    threads: tuple[float, float] | None = None

    @property
    def per_resource_ms(self) -> float:
        return self.done.wall / self.resources * 1000


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each live thread of ``pid`` (``/proc/PID/task/TID/stat``)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended meanwhile
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


def run_watched(cmd: list[str], cwd: Path, root: Path) -> tuple[Finished, tuple[float, float]]:
    """``run_child``, and the CPU of the child's threads, sampled every 20 ms until it exits: (the main
    thread's, the other threads' together; a thread that ended counts with its last sample)."""
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    seen: dict[int, float] = {}
    with (cwd / "rsagg.out").open("wb") as out, (cwd / "rsagg.err").open("wb") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=err, env=env)
        done = threading.Event()

        def watch() -> None:
            while not done.wait(0.02):
                seen.update(thread_cpu(proc.pid))

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        done.set()
        watcher.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    main = seen.pop(proc.pid, 0.0)
    return Finished(wall, proc.returncode, usage), (main, sum(seen.values()))


def config_text(base: str, sources: int) -> str:
    """rsagg's configuration: defaults, the store in ``data``, ``sources`` Sources (0: the big one),
    third-party plugins off (``_harness.plugins_off``)."""
    lines = ['[store]\npath = "data"\n']
    if sources == 0:
        lines.append(f'[[sources]]\nname = "big"\nurl = "{base}/big/capabilitylist.xml"\n')
    for i in range(sources):
        lines.append(f'[[sources]]\nname = "s{i}"\nurl = "{base}/s{i}/capabilitylist.xml"\n')
    return "\n".join(lines) + plugins_off()


def harvest(
    work: Path,
    name: str,
    base: str,
    sources: int,
    total: int,
    profile: str = "",
    root: Path = ROOT,
    threads: bool = False,
    opcodes: Path | None = None,
    phases: Path | None = None,
) -> Run:
    """``rsagg harvest --once`` of ``sources`` Sources (0: the big one) of ``total`` resources in all, in
    ``work/name``; every Source must end ok with every resource fetched. ``profile``: under cProfile, into
    that file; ``opcodes``: under the opcode counter, its counts into that file; ``phases``: the CPU of its
    parts summed into that file."""
    folder = work / name
    folder.mkdir(parents=True)
    (folder / "rsagg.toml").write_text(config_text(base, sources))
    cmd = [sys.executable]
    if profile:
        cmd += ["-m", "cProfile", "-o", profile]
    if opcodes is not None:
        cmd += [str(OPCODES), "--out", str(opcodes), *(f"--preload={m}" for m in PRELOAD), "--"]
    elif phases is not None:
        cmd += [str(PHASES), "--out", str(phases), "--"]
    else:
        cmd += ["-m", "aggregator"]
    cmd += ["harvest", "--once", "-c", "rsagg.toml", "--log-level", "warning"]
    load = os.getloadavg()[0]
    split = None
    if threads:
        done, split = run_watched(cmd, folder, root)
    else:
        done = run_child(cmd, folder, "rsagg", root)
    out = (folder / "rsagg.out").read_text()
    ok = out.count(": ok: ")
    if done.code != 0 or ok != max(sources, 1):
        raise SystemExit(f"{name}: rsagg exited {done.code} with {ok} source(s) ok (see {folder})")
    fetched = sum(int(line.split(" entries, ")[1].split(" fetched")[0]) for line in out.splitlines()
                  if ": ok: " in line)  # fmt: skip
    if fetched != total:
        raise SystemExit(f"{name}: {fetched} resources fetched, expected {total} (see {folder})")
    return Run("many" if sources else "one", max(sources, 1), total, done, load, threads=split)


def one_round(
    work: Path, r: int, n: int, m: int, before: Path | None = None, threads: bool = False
) -> list[Run]:
    runs = []
    trees = [("after", ROOT)] + ([("before", before)] if before else [])
    cases = [(tree, sources) for tree in trees for sources in (0, n)]
    for (tree, root), sources in cases if r % 2 == 0 else cases[::-1]:  # interleaved, the order turned
        up = Upstream(n if sources else 0, m, 0 if sources else n * m, work / "upstream.log")
        try:
            name = f"{tree}-{'many' if sources else 'one'}-{r}"
            runs.append(harvest(work, name, up.base, sources, n * m, root=root, threads=threads))
        finally:
            counts = up.stop()
        runs[-1].requests = counts
        runs[-1].tree = tree
    return runs


def median(runs: list[Run], case: str, f) -> float:
    return statistics.median(f(r) for r in runs if r.case == case)


def table(all_runs: list[Run], n: int, m: int) -> str:
    """Every run, then the medians and ratios of this checkout's runs (and the ``--before`` one's ratio)."""
    rows = [
        f"{'case':<31} {'time s':>8} {'CPU s':>8} {'of it sys':>9} {'RSS MB':>8} {'ms/res':>8} {'load':>6} "
        f"{'docs':>6} {'res':>6}"
    ]
    split = all(r.threads is not None for r in all_runs)
    if split:
        rows[0] += f" {'loop s':>7} {'others s':>8}"
    for r in all_runs:
        label = f"{r.tree} {r.case} ({r.sources} x {r.resources // r.sources})"
        rows.append(f"{label:<31} {r.done.wall:8.2f} {r.done.cpu:8.2f} {r.done.usage.ru_stime:9.2f} "
                    f"{r.done.rss_mb:8.1f} {r.per_resource_ms:8.3f} {r.load:6.2f} "
                    f"{r.requests.get('document', 0):6d} {r.requests.get('resource', 0):6d}")  # fmt: skip
        if split and r.threads is not None:
            rows[-1] += f" {r.threads[0]:7.2f} {r.threads[1]:8.2f}"
    runs = [r for r in all_runs if r.tree == "after"]
    t1, tn = median(runs, "one", lambda r: r.done.wall), median(runs, "many", lambda r: r.done.wall)
    c1, cn = median(runs, "one", lambda r: r.done.cpu), median(runs, "many", lambda r: r.done.cpu)
    m1, mn = median(runs, "one", lambda r: r.done.rss_mb), median(runs, "many", lambda r: r.done.rss_mb)
    rows.append("")
    rows.append(f"medians: one {t1:.2f} s / {c1:.2f} s CPU / {m1:.1f} MB; many {tn:.2f} s / {cn:.2f} s CPU / "
                f"{mn:.1f} MB")  # fmt: skip
    # The CPU is the figure to judge by: the time swings with the machine's load (docs/benchmarks.md).
    verdict = "met" if cn / c1 <= TARGET else "NOT met"
    rows.append(f"many/one: {tn / t1:.2f}x the time, {cn / c1:.2f}x the CPU (target <= {TARGET}x of the CPU: "
                f"{verdict})")  # fmt: skip
    d1 = median(runs, "one", lambda r: sum(r.requests.values()))
    dn = median(runs, "many", lambda r: sum(r.requests.values()))
    rows.append(f"per extra source: {(cn - c1) / (n - 1) * 1000:+.1f} ms CPU, "
                f"{(mn - m1) * 1024 / (n - 1):+.0f} KB, {(dn - d1) / (n - 1):+.2f} requests")  # fmt: skip
    if split:
        for i, what in ((0, "event loop thread"), (1, "other threads (the state writer)")):
            h1 = median(runs, "one", lambda r: r.threads[i])  # noqa: B023 (used at once)
            hn = median(runs, "many", lambda r: r.threads[i])  # noqa: B023
            rows.append(f"{what}: one {h1:.2f} s, many {hn:.2f} s CPU, "
                        f"{(hn - h1) / (n - 1) * 1000:+.1f} ms per extra source")  # fmt: skip
    before = [r for r in all_runs if r.tree == "before"]
    if before:
        b1 = median(before, "one", lambda r: r.done.cpu)
        bn = median(before, "many", lambda r: r.done.cpu)
        rows.append(f"before (--before, the same rounds): one {b1:.2f} s CPU, many {bn:.2f} s CPU, "
                    f"many/one {bn / b1:.2f}x the CPU (this checkout: {cn / c1:.2f}x); many: {bn / cn:.2f}x "
                    f"the CPU of this checkout's")  # fmt: skip
    return "\n".join(rows)


def count_opcodes(work: Path, n: int, m: int, small: int, root: Path = ROOT, tree: str = "after") -> Figures:
    """One run of each case under the opcode counter (``_opcodes.py``): one Source of N×M, one of
    ``small`` (for the slope), N Sources of M; each checked as the timed runs are."""
    counts = {}
    for case, sources, total in (("one", 0, n * m), ("small", 0, small), ("many", n, n * m)):
        up = Upstream(n if sources else 0, m, 0 if sources else total, work / "upstream.log")
        out = work / f"opcodes-{tree}-{case}.json"
        try:
            harvest(work, f"opcodes-{tree}-{case}", up.base, sources, total, root=root, opcodes=out)
        finally:
            up.stop()
        counts[case] = Counts.read(out)
        print(f"{tree} {case} ({max(sources, 1)} x {total // max(sources, 1)}): {counts[case].total:,} "
              f"opcodes, load average {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
    return Figures(counts["one"], counts["small"], counts["many"], n, m, small)


def sum_phases(
    work: Path, n: int, m: int, before: Path | None = None, r: int = 0
) -> dict[str, tuple[Phases, Phases]]:
    """One run of each case with the CPU of its parts summed (``_phases.py``): tree -> (one, many). With
    ``before``, that checkout's runs too, interleaved with this one's (after one, before one, before many,
    after many; the other way round in odd rounds ``r``), so that a drift of the machine, or a run's
    place in the round, weighs on both alike."""
    trees = [("after", ROOT)] + ([("before", before)] if before else [])
    order = [(t, 0) for t in trees] + [(t, n) for t in reversed(trees)]
    if r % 2:
        order.reverse()
    got: dict[tuple[str, int], Phases] = {}
    for (tree, root), sources in order:
        case = "many" if sources else "one"
        up = Upstream(n if sources else 0, m, 0 if sources else n * m, work / "upstream.log")
        out = work / f"phases-{tree}-{case}-{r}.json"
        try:
            harvest(work, f"phases-{tree}-{case}-{r}", up.base, sources, n * m, root=root, phases=out)
        finally:
            up.stop()
        got[tree, sources] = runs = Phases.read(out)
        load = os.getloadavg()[0]
        print(f"{tree} {case}: {runs.process_cpu:.2f} s CPU, load average {load:.2f}", flush=True)
        if runs.missing:
            print(f"  not in that checkout, left out: {', '.join(runs.missing)}")
    return {tree: (got[tree, 0], got[tree, n]) for tree, _ in trees}


def show_profile(one: str, many: str, top: int = 40) -> None:
    """The functions whose own time grows most from the one case to the many case (the per-source cost;
    main thread only: state writes in worker threads are not in it)."""
    a, b = pstats.Stats(one).stats, pstats.Stats(many).stats  # type: ignore[attr-defined]
    rows = []
    for key, (_cc, nc, tt, ct, _) in b.items():
        _cc1, nc1, tt1, ct1, _ = a.get(key, (0, 0, 0.0, 0.0, None))
        rows.append((tt - tt1, ct - ct1, nc - nc1, key))
    print(f"\n{'own s +':>8} {'cum s +':>8} {'calls +':>8}  function (many - one)")
    for dt, dc, dn, (file, line, name) in sorted(rows, reverse=True)[:top]:
        print(f"{dt:8.3f} {dc:8.3f} {dn:8d}  {name} {Path(file).name}:{line}")
    print(f"\n{'cum s +':>8} {'own s +':>8} {'calls +':>8}  function, by cumulative (many - one)")
    for dt, dc, dn, (file, line, name) in sorted(rows, key=lambda r: r[1], reverse=True)[:top]:
        print(f"{dc:8.3f} {dt:8.3f} {dn:8d}  {name} {Path(file).name}:{line}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sources", type=int, default=300, help="N: Sources in the many case (default 300)")
    p.add_argument("--per-source", type=int, default=20, help="M: resources per Source (default 20)")
    p.add_argument("--repeat", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument(
        "--profile",
        metavar="FILE",
        help="also run both cases under cProfile (into FILE.one, FILE.many) and show the difference",
    )
    p.add_argument("--before", type=Path, help="another checkout of rsagg, run in the same rounds")
    p.add_argument("--keep", action="store_true", help="keep the work folder")
    p.add_argument(
        "--threads", action="store_true", help="also split each run's CPU by thread (event loop / others)"
    )
    p.add_argument(
        "--opcodes",
        action="store_true",
        help="count Python opcodes instead of timing: each case once, under the counter (see above)",
    )
    p.add_argument(
        "--phases",
        action="store_true",
        help="the CPU of each part of a harvest, at full speed: each case once (see above)",
    )
    p.add_argument(
        "--latency", type=float, default=0.0, metavar="MS",
        help="the upstream answers each request MS ms late (default 0: full speed; see above)",
    )  # fmt: skip
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--big", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--counts", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        return serve_main(args.sources, args.per_source, args.big, args.counts)
    n, m = args.sources, args.per_source
    if args.latency < 0:
        p.error("--latency: a delay, 0 or more milliseconds")
    os.environ[LATENCY_ENV] = str(args.latency)  # for every upstream process started below
    if args.before and not (args.before / "aggregator").is_dir():
        p.error(f"--before {args.before}: no aggregator/ package there")
    if args.opcodes and (n < 2 or n * m < 2):
        p.error("--opcodes: needs at least 2 Sources and 2 resources")
    if args.opcodes and (args.profile or args.threads):
        p.error("--opcodes: counts instead of timing; --profile and --threads time (run them apart)")
    if args.phases and (args.opcodes or args.profile or args.threads or n < 2):
        p.error("--phases: runs apart from --opcodes, --profile and --threads, with at least 2 Sources")
    work = Path(tempfile.mkdtemp(prefix="rsagg-many-"))
    from importlib.metadata import entry_points

    plugins = ", ".join(sorted(ep.name for ep in entry_points(group="rsagg"))) or "none"
    print(f"work folder {work}; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}; "
          f"{n} sources x {m} resources vs 1 x {n * m}; upstream latency {args.latency:g} ms; "
          f"rsagg defaults; plugins installed: {plugins}",
          flush=True)  # fmt: skip
    runs: list[Run] = []
    try:
        if args.opcodes:
            small = max(1, n * m // 10)
            after = count_opcodes(work, n, m, small)
            before = count_opcodes(work, n, m, small, args.before, "before") if args.before else None
            print(opcodes_table(after, before, target=TARGET))
            print(f"load average after: {os.getloadavg()[0]:.2f}")
            return 0
        if args.phases:
            rounds = [sum_phases(work, n, m, args.before, r) for r in range(args.repeat)]
            # Each part's figure: its median over the rounds (one, many: each case's median).
            parts = {
                tree: (
                    Phases.median([x[tree][0] for x in rounds]),
                    Phases.median([x[tree][1] for x in rounds]),
                )
                for tree in rounds[0]
            }
            print(phases_table(*parts["after"], n, m))
            if "before" in parts:
                print()
                print(phases_compare(parts["after"], parts["before"], n))
            print(f"load average after: {os.getloadavg()[0]:.2f}")
            return 0
        for r in range(args.repeat):
            got = one_round(work, r, n, m, args.before, args.threads)
            runs += got
            print(f"round {r + 1}: " + ", ".join(f"{x.tree} {x.case} {x.done.cpu:.2f} s CPU" for x in got),
                  flush=True)  # fmt: skip
        if runs:
            print(table(runs, n, m))
            mine = [r for r in runs if r.tree == "after"]
            c1, cn = median(mine, "one", lambda r: r.done.cpu), median(mine, "many", lambda r: r.done.cpu)
            m1, mn = (
                median(mine, "one", lambda r: r.done.rss_mb),
                median(mine, "many", lambda r: r.done.rss_mb),
            )
            extra = f"{(cn - c1) / (n - 1) * 1000:+.1f} ms, {(mn - m1) * 1024 / (n - 1):+.0f} KB"
            headline(f"many Sources: CPU of {n} × {m} over 1 × {n * m}",
                     f"{cn / c1:.2f}× ({extra} per extra Source)", f"≤ {TARGET}×")  # fmt: skip
        if args.profile:
            for sources in (0, n):
                up = Upstream(n if sources else 0, m, 0 if sources else n * m, work / "upstream.log")
                try:
                    harvest(work, f"profile-{sources}", up.base, sources, n * m,
                            profile=f"{args.profile}.{'many' if sources else 'one'}")  # fmt: skip
                finally:
                    up.stop()
            show_profile(f"{args.profile}.one", f"{args.profile}.many")
        print(f"load average after: {os.getloadavg()[0]:.2f}")
    finally:
        if not args.keep:
            import shutil

            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
