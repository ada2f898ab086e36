"""``benchmarks/bench_many_sources.py --phases`` gives every task step's CPU on the event loop to the part
its task is in, at full speed: a part's own CPU must leave out the parts called inside it and the other
tasks' steps, however the tasks interleave; a state write's CPU in the writer's thread must go to the
function written; the table's extra per Source must follow from the sums; and every part it names must
exist, or the figures it prints would silently lose that part."""

from __future__ import annotations

import functools
import importlib
import random
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import _phases


def burn(seconds: float) -> None:
    """Spend ``seconds`` of this thread's CPU (not of the wall clock: a loaded machine only slows it)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@pytest.mark.parametrize("seed", range(6))
def test_each_part_gets_its_own_cpu_however_tasks_interleave(seed: int) -> None:
    """Tasks in generated orders each burn known CPU in an outer part, an inner part it calls, and
    outside any part: each part's own sum is what was burnt in it, whatever ran between."""
    rng = random.Random(seed)
    sums = _phases.Sums()
    clock = _phases.StepClock(sums)
    spent = {"outer": 0.0, "inner": 0.0}

    async def inner(ms: float) -> None:
        burn(ms / 1000)
        await trio.sleep(0)  # another task runs here: not the inner part's
        burn(ms / 1000)

    timed_inner = _phases.in_part(inner, "inner", clock)

    async def outer(ms: float, inner_ms: float) -> None:
        burn(ms / 1000)
        await timed_inner(inner_ms)
        await trio.sleep(0)
        burn(ms / 1000)

    timed_outer = _phases.in_part(outer, "outer", clock)

    async def task(ms: float, inner_ms: float, loose_ms: float) -> None:
        burn(loose_ms / 1000)  # in no part: the task's name
        await timed_outer(ms, inner_ms)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(rng.randint(2, 5)):
                ms, inner_ms, loose = rng.uniform(1, 4), rng.uniform(1, 4), rng.uniform(1, 4)
                spent["outer"] += 2 * ms
                spent["inner"] += 2 * inner_ms
                nursery.start_soon(task, ms, inner_ms, loose)

    trio.run(main, instruments=[clock])
    for part in ("outer", "inner"):
        want = spent[part] / 1000
        # Each part's own CPU: what it burnt, plus a little of the wrappers' and trio's own work
        # (never another part's few milliseconds).
        assert want <= sums.cpu[part] < want + 0.0015 * sums.calls[part] + 0.001, (part, sums.cpu)
    assert sums.calls["outer"] == sums.calls["inner"]
    assert sums.cpu[_phases.TASK + "task"] >= 0.001
    assert _phases.SCHEDULER in sums.cpu


def test_an_async_generator_counts_each_step() -> None:
    sums = _phases.Sums()
    clock = _phases.StepClock(sums)

    async def entries(n: int):
        for i in range(n):
            burn(0.002)
            yield i

    timed = _phases.in_part(entries, "entries", clock)

    async def main() -> list[int]:
        gen = timed(3)
        got = [x async for x in gen]
        await gen.aclose()
        return got

    assert trio.run(main, instruments=[clock]) == [0, 1, 2]
    assert sums.calls["entries"] == 4  # three entries and the step that ends it
    assert sums.cpu["entries"] >= 0.006


@pytest.fixture
def restored(monkeypatch):
    """Every attribute ``install`` replaces, put back after the test."""
    for _label, module, attr in _phases.LOOP_PHASES:
        owner = importlib.import_module(module)
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        monkeypatch.setattr(owner, name, getattr(owner, name))
    from aggregator.harvest import context, writes

    monkeypatch.setattr(context.HarvestContext, "write", context.HarvestContext.write)
    monkeypatch.setattr(writes.SharedHops, "run", writes.SharedHops.run)
    monkeypatch.setattr(writes.SharedHops, "_run_all", writes.SharedHops._run_all)
    monkeypatch.setattr(writes.SharedHops, "_blobs_first", writes.SharedHops._blobs_first)
    monkeypatch.setattr(writes.AfterBlobs, "__call__", writes.AfterBlobs.__call__)
    monkeypatch.setattr(trio, "run", trio.run)


class Ctx:
    """The parts of HarvestContext that ``write`` uses (its hops in a worker thread, nothing riding)."""

    def __init__(self) -> None:
        self._later: dict = {}
        self.writer = object()

    def _progress_due(self) -> dict:
        return {}

    def _shared_writes(self) -> Any:
        from aggregator.harvest.writes import SharedHops
        from aggregator.store.calls import in_thread

        return SharedHops(functools.partial(in_thread, limiter=trio.CapacityLimiter(1)))


def test_every_part_exists_and_writes_are_named_by_their_function(restored) -> None:
    """A renamed function would drop out of the table without a word: install names what it lacks."""
    sums = _phases.Sums()
    _clock, missing = _phases.install(sums)
    assert missing == []
    from aggregator.harvest import context

    def set_status(n: int) -> int:
        burn(0.01)
        return n * 2

    async def main() -> int:
        return await context.HarvestContext.write(Ctx(), set_status, 21)  # type: ignore[arg-type]

    assert trio.run(main) == 42  # the instrument is handed to trio.run by install
    assert sums.calls[_phases.WRITE_THREAD + "set_status"] == 1
    assert sums.cpu[_phases.WRITE_THREAD + "set_status"] >= 0.01  # in the writer's thread
    assert sums.calls[_phases.WRITE_LOOP + "set_status"] == 1
    assert sums.cpu[_phases.WRITE_LOOP + "set_status"] < 0.01  # the loop's side only
    assert sums.calls[_phases.WRITE_THREAD + _phases.SHARED] == 1  # the hop's own part, the call's left out
    assert sums.cpu[_phases.WRITE_THREAD + _phases.SHARED] < 0.01
    assert _phases.SCHEDULER in sums.cpu


def test_a_writes_own_blobs_are_timed_apart_from_its_rows(restored) -> None:
    """A write alone in its hop commits its blobs itself (``AfterBlobs``): their CPU goes to the part of
    its own, not to the write's (so one Source's blobs compare with many Sources' committed together)."""
    sums = _phases.Sums()
    _phases.install(sums)
    from aggregator.harvest import context, writes

    committed: list[list[str]] = []

    def commit(writers: list) -> None:
        burn(0.03)
        committed.append(list(writers))

    def apply_rows(n: int) -> int:
        burn(0.01)
        return n * 2

    async def main() -> int:
        write = writes.AfterBlobs(["blob"], commit, apply_rows, 21)  # type: ignore[list-item]
        return await context.HarvestContext.write(Ctx(), write)  # type: ignore[arg-type]

    assert trio.run(main) == 42
    assert committed == [["blob"]]  # committed, once, before the rows
    assert sums.calls[_phases.WRITE_THREAD + _phases.OWN_BLOBS] == 1
    assert sums.cpu[_phases.WRITE_THREAD + _phases.OWN_BLOBS] >= 0.03
    rows = sums.cpu[_phases.WRITE_THREAD + "apply_rows"]  # named as the function the write runs
    assert 0.01 <= rows < 0.03  # its rows only: the blobs' CPU left out


def phases(cpu: dict[str, float], calls: dict[str, int], process: float, **io: int) -> _phases.Phases:
    return _phases.Phases(cpu, calls, process, {k: v for k, v in io.items() if k != "switches"},
                          io.get("switches", 0))  # fmt: skip


@pytest.mark.parametrize("sources", [2, 11, 300])
def test_the_tables_extra_per_source_follows_from_the_sums(sources: int) -> None:
    sync = _phases.LOOP_PHASES[0][0]
    write = _phases.WRITE_THREAD + "_apply_batch"
    tasks = {_phases.TASK + f"t{i}": 0.001 * i for i in range(15)}
    one = phases({sync: 1.0, write: 0.2, **tasks}, {sync: 1, write: 24}, 2.0, syscw=1000, wchar=2048,
                 switches=10)  # fmt: skip
    many = phases({sync: 1.0 + 0.003 * (sources - 1), write: 0.5, **{k: 2 * v for k, v in tasks.items()}},
                  {sync: sources, write: sources}, 2.0 + 0.004 * (sources - 1),
                  syscw=1000 + 90 * (sources - 1), wchar=2048 + 1024 * 174 * (sources - 1),
                  switches=10 + 21 * (sources - 1))  # fmt: skip
    text = _phases.table(one, many, sources, 20, top=12)
    rows = {line[:52].strip(): line[52:].split() for line in text.splitlines()}
    assert rows[sync][-1] == "3.000"  # ms per extra Source
    assert rows["_apply_batch"] == ["24", "200.0", str(sources), "500.0", f"{300 / (sources - 1):.3f}"]
    shown = [x for x in rows if x.startswith(_phases.TASK)]
    assert shown == [_phases.TASK + f"t{i}" for i in range(14, 2, -1)]  # the 12 that grow most, first
    assert rows["3 more tasks, no part"][:2] == ["3.0", "6.0"]  # the rest summed: t0, t1, t2
    assert rows["CPU, user + system (ms)"][-1] == "4.000"
    assert rows["write syscalls (sockets and files)"][-1] == "90.000"
    assert rows["KB written (sockets and files)"][-1] == "174.000"
    assert rows["context switches"][-1] == "21.000"
    assert "read syscalls" not in rows  # not given: not shown


def test_proc_io_reads_the_kernels_counters() -> None:
    text = "rchar: 10\nwchar: 20\nsyscr: 3\nsyscw: 4\nread_bytes: 0\ncancelled_write_bytes: 0\n"
    assert _phases.proc_io(text) == {
        "rchar": 10, "wchar": 20, "syscr": 3, "syscw": 4, "read_bytes": 0, "cancelled_write_bytes": 0,
    }  # fmt: skip


def test_the_comparison_sets_each_parts_extra_beside_the_other_checkouts() -> None:
    """``--before``: per part, this checkout's extra per Source, the other's, and the change; a part only
    one checkout has counts 0 in the other."""
    sources, k = 101, 100
    part, new, old = "discovery", _phases.TASK + "new", _phases.TASK + "old"
    after = (phases({part: 1.0, new: 0.0}, {}, 2.0), phases({part: 1.04, new: 0.01}, {}, 2.3))
    before = (phases({part: 1.0, old: 0.0}, {}, 2.0), phases({part: 1.05, old: 0.02}, {}, 2.4))
    text = _phases.compare(after, before, sources)
    rows = {line[:52].strip(): line[52:].split() for line in text.splitlines()}
    assert rows[part] == [f"{0.04 / k * 1000:.3f}", f"{0.05 / k * 1000:.3f}", f"{-0.01 / k * 1000:+.3f}"]
    assert rows[new] == ["0.100", "0.000", "+0.100"]
    assert rows[old] == ["0.000", "0.200", "-0.200"]
    assert rows["the process, CPU"] == ["3.000", "4.000", "-1.000"]
    assert list(rows)[2] == part  # the parts that weigh most first


def test_a_plain_function_counts_its_own_cpu_within_the_step() -> None:
    """A plain (not async) function wrapped as a part: its call's CPU is its own, the rest of the task
    step stays with the part around it."""
    sums = _phases.Sums()
    clock = _phases.StepClock(sums)

    def parse(ms: float) -> int:
        burn(ms / 1000)
        return 7

    timed_parse = _phases.in_part(parse, "parse", clock)

    async def fetch() -> int:
        burn(0.003)
        got = timed_parse(5)
        burn(0.003)
        return got

    timed_fetch = _phases.in_part(fetch, "fetch", clock)
    assert trio.run(timed_fetch, instruments=[clock]) == 7
    assert sums.calls["parse"] == 1
    assert 0.005 <= sums.cpu["parse"] < 0.0065
    assert 0.006 <= sums.cpu["fetch"] < 0.0075
    assert timed_parse(0) == 7  # outside a task step: called, nothing marked


@pytest.mark.parametrize("seed", range(5))
def test_the_rounds_median_is_each_figures_median(seed: int) -> None:
    """``--repeat``: each part's figure is its median over the rounds, a part a round lacks counting 0
    there, so one noisy round does not decide it."""
    rng = random.Random(seed)
    labels = [f"part{i}" for i in range(6)]
    runs = []
    for _ in range(rng.choice([1, 2, 3, 5])):
        present = [x for x in labels if rng.random() < 0.8]
        cpu = {x: rng.uniform(0, 2) for x in present}
        calls = {x: rng.randrange(1, 50) for x in present}
        runs.append(
            phases(cpu, calls, rng.uniform(1, 3), syscw=rng.randrange(100), switches=rng.randrange(100))
        )
    med = _phases.Phases.median(runs)
    for x in {x for r in runs for x in r.cpu}:
        values = sorted(r.cpu.get(x, 0.0) for r in runs)
        mid = len(values) // 2
        want = values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
        assert med.cpu[x] == pytest.approx(want)
    assert min(r.process_cpu for r in runs) <= med.process_cpu <= max(r.process_cpu for r in runs)
    assert min(r.switches for r in runs) <= med.switches <= max(r.switches for r in runs)
