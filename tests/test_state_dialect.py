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


@pytest.mark.parametrize("seed", range(4))
def test_a_kept_last_modified_reads_back_byte_for_byte(seed: int) -> None:
    """``http_date_in`` keeps exactly the IMF-fixdates ``http_date_out`` writes (RFC 9110 §5.6.7, as
    ``email.utils`` writes them): random times round-trip, and of random one-character edits of them
    every value kept reads back as given (a wrong weekday, month, digit or letter case is dropped)."""
    import random
    from datetime import UTC, datetime, timedelta
    from email.utils import format_datetime

    from aggregator.store.sql.codec import http_date_in, http_date_out

    rng = random.Random(seed)
    alphabet = "0123456789 :,ADFGJMNOSTWabceghilnoprtuvy"
    first = datetime(1000, 1, 1, tzinfo=UTC)
    span = int((datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC) - first).total_seconds()) + 1
    kept = dropped = 0
    for _ in range(500):
        dt = first + timedelta(seconds=rng.randrange(span))
        text = http_date_out(dt)
        assert text == format_datetime(dt, usegmt=True) and http_date_in(text) == dt
        i = rng.randrange(len(text))
        edited = text[:i] + rng.choice(alphabet) + text[i + 1 :]
        got = http_date_in(edited)
        if got is None:
            dropped += 1
        else:
            kept += 1
            assert http_date_out(got) == edited
    assert kept > 0 and dropped > 0
