"""``benchmarks/bench_many_sources.py --phases`` sums the CPU of a sync's parts at full speed: a wrapped
coroutine must add its thread's CPU across its awaits, an async generator each step's, a state write its
hop's CPU in the writer's thread under the function written; the table's extra per Source must follow from
the sums; and every phase it names must exist, or the figures it prints would silently lose that part."""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path

import pytest
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import _phases


def burn(seconds: float) -> None:
    """Spend ``seconds`` of this thread's CPU (not of the wall clock: a loaded machine only slows it)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_coroutine_adds_its_threads_cpu_across_its_awaits() -> None:
    sums = _phases.Sums()

    async def work(n: int) -> int:
        burn(0.01)
        await trio.sleep(0)
        burn(0.01)
        return n + 1

    timed = _phases.timed_async(work, "work", sums)

    async def main() -> list[int]:
        return [await timed(1), await timed(2)]

    assert trio.run(main) == [2, 3]
    assert sums.calls == {"work": 2}
    assert sums.cpu["work"] >= 0.04  # both halves of both calls, the await between them included
    assert timed.__name__ == "work"


def test_an_async_generator_adds_each_steps_cpu() -> None:
    sums = _phases.Sums()

    async def entries(n: int):
        for i in range(n):
            burn(0.005)
            yield i

    timed = _phases.timed_agen(entries, "entries", sums)

    async def main() -> list[int]:
        gen = timed(3)
        got = [x async for x in gen]
        await gen.aclose()
        return got

    assert trio.run(main) == [0, 1, 2]
    assert sums.calls == {"entries": 4}  # three entries and the step that ends it
    assert sums.cpu["entries"] >= 0.015


@pytest.fixture
def restored(monkeypatch):
    """Every attribute ``install`` replaces, put back after the test."""
    for _label, module, attr in _phases.LOOP_PHASES:
        owner = importlib.import_module(module)
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        monkeypatch.setattr(owner, name, getattr(owner, name))
    from aggregator.harvest import admission, context

    monkeypatch.setattr(context.HarvestContext, "write", context.HarvestContext.write)
    monkeypatch.setattr(context._SharedHops, "run", context._SharedHops.run)
    monkeypatch.setattr(admission, "PER_SLOT", admission.PER_SLOT)


def test_every_phase_exists_and_writes_are_named_by_their_function(restored) -> None:
    """A renamed function would drop out of the table without a word: install names what it lacks."""
    sums = _phases.Sums()
    assert _phases.install(sums) == []
    from aggregator.harvest import admission, context

    assert admission.PER_SLOT == 1

    class Ctx:
        """The parts of HarvestContext that ``write`` uses."""

        def __init__(self) -> None:
            self._later: dict = {}
            self._writes = None
            self._write_limiter = trio.CapacityLimiter(1)
            self.writer = object()

        def _progress_due(self) -> dict:
            return {}

    def set_status(n: int) -> int:
        burn(0.01)
        return n * 2

    async def main() -> int:
        return await context.HarvestContext.write(Ctx(), set_status, 21)  # type: ignore[arg-type]

    assert trio.run(main) == 42
    assert sums.calls[_phases.WRITE_THREAD + "set_status"] == 1
    assert sums.cpu[_phases.WRITE_THREAD + "set_status"] >= 0.01  # in the writer's thread
    assert sums.calls[_phases.WRITE_LOOP + "set_status"] == 1


def phases(cpu: dict[str, float], calls: dict[str, int], process: float, **io: int) -> _phases.Phases:
    return _phases.Phases(cpu, calls, process, {k: v for k, v in io.items() if k != "switches"},
                          io.get("switches", 0))  # fmt: skip


@pytest.mark.parametrize("sources", [2, 11, 300])
def test_the_tables_extra_per_source_follows_from_the_sums(sources: int) -> None:
    sync = _phases.LOOP_PHASES[0][0]
    write = _phases.WRITE_THREAD + "_apply_batch"
    one = phases({sync: 1.0, write: 0.2}, {sync: 1, write: 24}, 2.0, syscw=1000, wchar=2048, switches=10)
    many = phases({sync: 1.0 + 0.003 * (sources - 1), write: 0.5}, {sync: sources, write: sources},
                  2.0 + 0.004 * (sources - 1), syscw=1000 + 90 * (sources - 1),
                  wchar=2048 + 1024 * 174 * (sources - 1), switches=10 + 21 * (sources - 1))  # fmt: skip
    text = _phases.table(one, many, sources, 20)
    rows = {line[:58].strip(): line[58:].split() for line in text.splitlines()}
    assert rows[sync][-1] == "3.000"  # ms per extra Source
    assert rows["_apply_batch"] == ["24", "200.0", str(sources), "500.0", f"{300 / (sources - 1):.3f}"]
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
