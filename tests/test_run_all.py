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
