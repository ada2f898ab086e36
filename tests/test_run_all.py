"""``benchmarks/run_all.py`` runs every benchmark: a script added later is held to it (nothing is run)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _run_all():
    spec = importlib.util.spec_from_file_location("run_all", BENCHMARKS / "run_all.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["run_all"] = module
    spec.loader.exec_module(module)
    return module


def test_every_benchmark_script_is_in_run_all() -> None:
    listed = {b.script for b in _run_all().BENCHES}
    on_disk = {p.name for p in BENCHMARKS.glob("bench_*.py")}
    assert on_disk - listed == set(), "add them to benchmarks/run_all.py BENCHES"
    assert listed - on_disk == set(), "run_all.py names a script that is gone"


def test_names_are_unique_and_only_is_checked(capsys) -> None:
    run_all = _run_all()
    names = [b.name for b in run_all.BENCHES]
    assert len(names) == len(set(names))
    with pytest.raises(SystemExit) as exc:
        run_all.main(["--only", "no-such-benchmark"])
    assert exc.value.code == 2
    assert "no benchmark named no-such-benchmark" in capsys.readouterr().err


def _headline_module():
    spec = importlib.util.spec_from_file_location("_headline", BENCHMARKS / "_headline.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("figure", "value", "target"),
    [
        ("harvest CPU per resource", "477 µs (2.0×)", "3× fewer"),
        ("start-up, status", "0.12 s", ""),
        ("serving alone / nginx", "0.31×", "≥ 0.25×"),
        ("  spaced  ", " 1 ", " t "),
    ],
)
def test_a_printed_headline_is_read_back(capsys, figure: str, value: str, target: str) -> None:
    run_all = _run_all()
    _headline_module().headline(figure, value, target)
    line = capsys.readouterr().out
    assert run_all.parse_headline(line) == run_all.Headline(figure.strip(), value.strip(), target.strip())


@pytest.mark.parametrize("bad", ["a|b", "a\nb"])
def test_a_headline_part_that_would_break_the_table_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="headline part"):
        _headline_module().headline("figure", bad)


@pytest.mark.parametrize(
    "line",
    [
        "plain output\n",
        "headline | only a figure\n",
        "headline |  | value | target\n",
        "x headline | a | b | c",
    ],
)
def test_other_lines_are_not_headlines(line: str) -> None:
    assert _run_all().parse_headline(line) is None


def test_run_all_gathers_headlines_with_the_load(tmp_path: Path, monkeypatch, capsys) -> None:
    run_all = _run_all()
    script = tmp_path / "bench_fake.py"
    script.write_text(
        "print('a table row')\n"
        "print('headline | rate | 12 req/s | >= 10 req/s')\n"
        "print('headline | memory | 80 MB | ')\n"
    )
    monkeypatch.setattr(run_all, "HERE", tmp_path)
    monkeypatch.setattr(run_all, "BENCHES", [run_all.Bench("fake", "bench_fake.py")])
    out_file = tmp_path / "headlines.md"
    assert run_all.main(["--markdown", str(out_file)]) == 0
    printed = capsys.readouterr().out
    assert "[fake] a table row" in printed
    table = out_file.read_text().splitlines()
    assert table[0].startswith("| benchmark | figure | value | target | load average |")
    assert table[2].startswith("| fake | rate | 12 req/s | >= 10 req/s | ")
    assert table[3].startswith("| fake | memory | 80 MB | - | ")
    assert len(table) == 4 and table[2] in printed


def test_targets_runs_only_the_benchmarks_with_target_sizes(tmp_path: Path, monkeypatch, capsys) -> None:
    run_all = _run_all()
    assert {b.name for b in run_all.BENCHES if b.targets is not None} >= {
        "startup",
        "state_size",
        "publish",
        "harvest",
        "oaipmh",
        "many_sources",
    }
    for name in ("a", "b"):
        (tmp_path / f"bench_{name}.py").write_text("import sys\nprint('args', *sys.argv[1:])\n")
    monkeypatch.setattr(run_all, "HERE", tmp_path)
    monkeypatch.setattr(
        run_all,
        "BENCHES",
        [
            run_all.Bench("a", "bench_a.py", ("--full",), ("--quick",), ("--target-size",)),
            run_all.Bench("b", "bench_b.py", ("--full",), ("--quick",)),
        ],
    )
    assert run_all.main(["--targets"]) == 0
    printed = capsys.readouterr().out
    assert "[a] args --target-size" in printed and "[b]" not in printed
    assert run_all.main(["--quick"]) == 0
    printed = capsys.readouterr().out
    assert "[a] args --quick" in printed and "[b] args --quick" in printed


def test_every_benchmark_with_targets_prints_its_headlines() -> None:
    """The README's figures are the headline table of ``--targets``: a benchmark run there says which of
    its figures answer a target, or the table silently lacks it."""
    for bench in _run_all().BENCHES:
        if bench.targets is not None:
            text = (BENCHMARKS / bench.script).read_text()
            assert "from _headline import headline" in text and "headline(" in text, bench.script
