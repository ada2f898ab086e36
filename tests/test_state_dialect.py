"""The state's SQL is written once (aggregator/store/sql/): the backends define no method of the seam
but their plumbing, and the dialect rewrites the shared SQLite spelling for PostgreSQL."""

from __future__ import annotations

import inspect

import pytest

from aggregator.store.interface import StateStore
from aggregator.store.postgres import PostgresState
from aggregator.store.sql.dialect import POSTGRES, SQLITE
from aggregator.store.state import State

PROTOCOL_METHODS = sorted(n for n, v in vars(StateStore).items() if callable(v) and not n.startswith("_"))
#: What a backend may define itself: closing its connections, its version counter (PRAGMA data_version, a
#: sequence) and SQLite's one-pass numbering of live rows (a window function over one cursor).
BACKEND_OWN = {State: {"close", "version", "iter_live_part_boundaries"}, PostgresState: {"close", "version"}}


@pytest.mark.parametrize("backend", [State, PostgresState], ids=lambda c: c.__name__)
def test_every_method_of_the_seam_is_written_once_in_store_sql(backend: type) -> None:
    own = {n for n in PROTOCOL_METHODS if n in vars(backend)}
    assert own <= BACKEND_OWN[backend], (
        f"{backend.__name__} writes its own {sorted(own - BACKEND_OWN[backend])}"
    )
    for name in set(PROTOCOL_METHODS) - own:
        module = inspect.getmodule(getattr(backend, name))
        assert module is not None and module.__name__.startswith("aggregator.store.sql."), name


REWRITES = [
    ("SELECT 1 FROM t WHERE a = ? AND b = ?", "SELECT 1 FROM t WHERE a = %s AND b = %s"),
    ("x IN (SELECT value FROM json_each(?))", "x = ANY(%s)"),
    ("s.id NOT IN (SELECT value FROM json_each(?)) LIMIT ?", "s.id <> ALL(%s) LIMIT %s"),
    ("WHERE set_id = ? AND deleted = 0 AND id > ?", "WHERE set_id = %s AND NOT deleted AND id > %s"),
    ("ON r.id = c.id WHERE r.deleted = 0", "ON r.id = c.id WHERE NOT r.deleted"),
    ("SET undeleted = 0", "SET undeleted = 0"),  # a column that merely ends in "deleted"
    ("SELECT count(*) FROM resources", "SELECT count(*) FROM resources"),
]


@pytest.mark.parametrize(("sqlite", "postgres"), REWRITES)
def test_the_postgres_dialect_rewrites_the_shared_spelling(sqlite: str, postgres: str) -> None:
    assert SQLITE.sql(sqlite) == sqlite
    assert POSTGRES.sql(sqlite) == postgres


def test_every_shared_statement_reads_in_postgres_without_sqlite_spellings() -> None:
    """Whatever a shared module passes (the string constants of store/sql/), PostgreSQL gets no ``?``,
    no json_each and no integer flag for ``deleted``."""
    import ast
    from pathlib import Path

    import aggregator.store.sql as package

    found = 0
    for path in Path(package.__file__).parent.glob("*.py"):
        if path.name == "dialect.py":  # the spellings themselves
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "?" in node.value:
                text = POSTGRES.sql(node.value)
                if any(k in node.value for k in ("SELECT", "INSERT", "UPDATE", "DELETE", "WHERE")):
                    found += 1
                    assert "?" not in text and "json_each" not in text and "deleted = 0" not in text, text
    assert found > 50  # the scan saw the shared SQL
