"""``benchmarks/bench_many_sources.py --opcodes`` counts every Python opcode instead of timing: the count
must go to the nearest function of the package on the stack (library code for its rsagg caller), in every
thread, the same for the same work; and the table's figures must follow from the totals it prints."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import _opcodes
import bench_many_sources

LIBRARY = """
def loop(n):
    total = 0
    for i in range(n):
        total += i
    return total
"""
PACKAGE = """
import oplib

def work(n):
    return oplib.loop(n) + 1

def twice(n):
    return work(n) + work(n)
"""


@pytest.fixture
def package(tmp_path: Path, monkeypatch):
    """A package ``oppkg`` (the counted one, as ``aggregator``) whose functions call a library module
    outside it (``oplib``, as trio or lxml)."""
    (tmp_path / "oppkg").mkdir()
    (tmp_path / "oppkg" / "__init__.py").write_text("")
    (tmp_path / "oppkg" / "mod.py").write_text(PACKAGE)
    (tmp_path / "oplib.py").write_text(LIBRARY)
    monkeypatch.syspath_prepend(str(tmp_path))
    import oplib
    import oppkg.mod

    yield oppkg.mod, oplib, _opcodes.OpcodeCounter(str(tmp_path / "oppkg"))
    for name in ("oplib", "oppkg", "oppkg.mod"):
        sys.modules.pop(name, None)


def counted(counter: _opcodes.OpcodeCounter, f, *args) -> dict[str, int]:
    before = counter.by_owner()
    sys.settrace(counter.trace)
    try:
        f(*args)
    finally:
        sys.settrace(None)
    after = counter.by_owner()
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


@pytest.mark.parametrize("n", [0, 1, 10, 250])
def test_library_opcodes_count_for_the_nearest_package_function(package, n: int) -> None:
    mod, lib, counter = package
    base = counted(counter, mod.work, 0)
    got = counted(counter, mod.work, n)
    assert set(got) == {"oppkg/mod.py:work"}  # the library's loop counts for its caller
    if n:
        assert got["oppkg/mod.py:work"] > base["oppkg/mod.py:work"]
    # The same work counts the same, and the loop adds the same for each turn.
    assert counted(counter, mod.work, n) == got
    per_turn = (
        counted(counter, mod.work, 2)["oppkg/mod.py:work"]
        - counted(counter, mod.work, 1)["oppkg/mod.py:work"]
    )
    assert got["oppkg/mod.py:work"] == base["oppkg/mod.py:work"] + n * per_turn
    # A nested package function owns its own opcodes; the outer one only its own.
    both = counted(counter, mod.twice, n)
    assert both["oppkg/mod.py:work"] == 2 * got["oppkg/mod.py:work"]
    assert both["oppkg/mod.py:twice"] == counted(counter, mod.twice, 0)["oppkg/mod.py:twice"] > 0
    # No package frame on the stack: no owner.
    alone = counted(counter, lib.loop, n)
    assert set(alone) == {_opcodes.NO_OWNER}


def test_threads_started_later_are_counted_too(package) -> None:
    mod, _lib, counter = package
    alone = counted(counter, mod.work, 100)["oppkg/mod.py:work"]

    def in_threads() -> None:
        threads = [threading.Thread(target=mod.work, args=(100,)) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    threading.settrace(counter.trace)
    try:
        got = counted(counter, in_threads)
    finally:
        threading.settrace(None)  # type: ignore[arg-type]
    assert got["oppkg/mod.py:work"] == 3 * alone
    assert got.get(_opcodes.NO_OWNER, 0) > 0  # threading's code and this test's: no package frame


def figures(one: int, small: int, many: int, n: int = 3, m: int = 2, k: int = 1) -> _opcodes.Figures:
    owners_one = {"aggregator/a.py:f": one // 2, "aggregator/b.py:g": one - one // 2}
    owners_many = {"aggregator/a.py:f": one // 2 + (many - one) // 3, "aggregator/c.py:h": 0}
    owners_many["aggregator/b.py:g"] = many - sum(owners_many.values())
    return _opcodes.Figures(
        _opcodes.Counts(one, owners_one), _opcodes.Counts(small, {"aggregator/a.py:f": small}),
        _opcodes.Counts(many, owners_many), n, m, k,
    )  # fmt: skip


def rows(text: str) -> dict[str, list[str]]:
    """The table's figure rows: label -> the values (after, before)."""
    head, _, _ = text.partition("\n\n")
    return {line[:44].strip(): line[44:].split() for line in head.splitlines()[1:]}


def number(value: str) -> float:
    return float(value.replace(",", "").rstrip("×"))


def check_table(text: str, n: int, m: int, k: int) -> None:
    """The figures of every column follow from its three totals; the function list is not empty."""
    got = rows(text)
    columns = len(got[f"one Source of {n * m}"])
    for c in range(columns):
        totals = (f"one Source of {n * m}", f"one Source of {k}", f"{n} Sources of {m}")
        one, small, many = (number(got[label][c]) for label in totals)
        assert min(one, small, many) > 0
        slope = (one - small) / (n * m - k)
        start = one - slope * n * m
        assert number(got["per resource (one Source, the slope)"][c]) == pytest.approx(slope, abs=0.5)
        assert number(got[f"start-up (one less the slope × {n * m})"][c]) == pytest.approx(start, abs=0.5)
        per_source = number(got["per extra Source ((many − one) / (N − 1))"][c])
        assert per_source == pytest.approx((many - one) / (n - 1), abs=0.5)
        assert number(got["many/one, start-up left out"][c]) == pytest.approx(
            (many - start) / (one - start), abs=0.005
        )
    functions = text.split("they call):\n", 1)[1].splitlines()[1:]
    assert functions and all(line.split()[-1].startswith("aggregator/") for line in functions)


def test_the_table_follows_from_the_totals() -> None:
    after, before = figures(1_000_000, 400_000, 1_700_000), figures(1_100_000, 500_000, 2_000_000)
    text = _opcodes.table(after, before, target=1.3)
    check_table(text, 3, 2, 1)
    got = rows(text)
    assert got["one Source of 6"] == ["1,000,000", "1,100,000"]
    assert got["per resource (one Source, the slope)"] == ["120,000", "120,000"]
    assert got["per extra Source ((many − one) / (N − 1))"] == ["350,000", "450,000"]
    assert got["many/one, start-up left out"] == ["1.97×", "2.25×"]
    assert got["per extra Source allowed by ≤ 1.3×"] == ["108,000", "108,000"]
    lines = text.split("they call):\n", 1)[1].splitlines()
    assert lines[0].split() == ["after", "before", "function"]
    # Ranked by the larger of the two columns; a function of one tree only shows 0 in the other.
    assert [line.split()[-1] for line in lines[1:]] == [
        "aggregator/b.py:g", "aggregator/a.py:f", "aggregator/c.py:h",
    ]  # fmt: skip


@pytest.mark.slow  # three harvests under the counter: about 10 s on a loaded machine
def test_a_tiny_harvest_is_counted_and_its_table_is_consistent(capsys) -> None:
    assert bench_many_sources.main(["--opcodes", "--sources", "3", "--per-source", "2"]) == 0
    out = capsys.readouterr().out
    text = "opcodes " + out.split("\nopcodes ", 1)[1].split("\nload average after")[0]
    check_table(text, 3, 2, 1)
    functions = text.split("they call):\n", 1)[1].splitlines()[1:]
    assert any("aggregator/harvest/" in line for line in functions)


@pytest.mark.parametrize("latency_ms", [0, 20, 250])
def test_the_upstream_answers_each_request_as_late_as_latency_says(monkeypatch, latency_ms: int) -> None:
    """``--latency``: each answer waits that long (trio's clock, jumped: no real time is waited for)."""
    import trio
    import trio.testing

    monkeypatch.setenv(bench_many_sources.LATENCY_ENV, str(latency_ms))
    app = bench_many_sources.upstream_app(2, 3, 0)
    sent: list[tuple[float, dict]] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append((trio.current_time(), message))

    async def main() -> None:
        scope = {"type": "http", "path": "/s1/r/2", "headers": [(b"host", b"up.example")]}
        await app(scope, receive, send)

    clock = trio.testing.MockClock(autojump_threshold=0)
    trio.run(main, clock=clock)
    (at, start), (_, body) = sent
    assert start["status"] == 200 and body["body"]  # the resource, as without a delay
    assert at == pytest.approx(latency_ms / 1000)
