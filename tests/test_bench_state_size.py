"""``benchmarks/bench_state_size.py`` fills a state as a harvest leaves it: every table a harvest writes
a row in for each resource, and every column it fills there, the fill writes too. A figure that leaves
one out flatters the state (the validators table was left out until schema step 18: about 40 % of the
bytes of a harvested state)."""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path

from aggregator.store.open import connect
from aggregator.testing.upstream import Upstream
from tests.harvesting import harvest, make_config

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_state_size

N = 8


def per_resource(path: Path, n: int) -> dict[str, set[str]]:
    """The tables of the state at ``path`` holding a row (or more) per resource, each with the columns
    some of those rows fill."""
    c = sqlite3.connect(path)
    out = {}
    for (table,) in c.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
    ):
        if c.execute(f"SELECT count(*) FROM {table}").fetchone()[0] < n:
            continue
        columns = [r[1] for r in c.execute(f"PRAGMA table_info({table})")]
        filled = f"SELECT 1 FROM {table} WHERE {{}} IS NOT NULL LIMIT 1"
        out[table] = {col for col in columns if c.execute(filled.format(col)).fetchone()}
    c.close()
    return out


async def test_the_fill_writes_what_a_harvest_writes_for_each_resource(tmp_path: Path) -> None:
    up = Upstream(sets=["a"], resource_dump=False, change_dump=False, change_list=False)
    for j in range(N):
        up.create(f"r{j}.txt", f"resource {j}".encode(), set_name="a")
    async with up.serving():
        config = make_config(tmp_path / "store", {"a": up.doc_url("capabilitylist.xml", "a")})
        assert (await harvest(config))["a"].ok
    harvested = per_resource(Path(config.store.path) / "state.db", N)
    with connect(tmp_path / "fill.db") as st:
        bench_state_size.fill(st, N)
    filled = per_resource(tmp_path / "fill.db", N)
    assert {"resources", "changelog"} <= harvested.keys()
    assert harvested.keys() <= filled.keys(), harvested.keys() - filled.keys()
    for table, columns in harvested.items():
        assert columns <= filled[table], (table, columns - filled[table])
