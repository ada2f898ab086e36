"""The state seam (aggregator/store/interface.py): ``State`` is a ``StateStore``, rows are typed values,
and only the store knows where the state lives."""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from pathlib import Path

import pytest

import aggregator
from aggregator.store import interface
from aggregator.store.interface import StateStore
from aggregator.store.open import STATE_FILE, connect
from aggregator.store.rows import DocumentRow, SetRow, SourceRow
from aggregator.store.state import State

PROTOCOL_METHODS = sorted(
    name for name, value in vars(StateStore).items() if callable(value) and not name.startswith("_")
)


def test_protocol_lists_the_methods_callers_use() -> None:
    assert {"apply", "finish_baseline", "sets", "sources", "iter_log_range", "referenced_hashes"} <= set(
        PROTOCOL_METHODS
    )
    assert set(interface.__all__) >= {"StateStore", "SourceRow", "SetRow", "DocumentRow"}


@pytest.mark.parametrize("name", PROTOCOL_METHODS)
def test_state_implements_every_protocol_method_alike(name: str) -> None:
    """Structural conformance, checked the way a second backend would be: same parameter names, kinds
    and defaults, same return type (tests/test_state_postgres.py checks PostgresState so)."""
    assert_implements(State, name)


def assert_implements(cls: type, name: str) -> None:
    assert hasattr(cls, name), f"{cls.__name__} lacks StateStore.{name}"
    want, got = getattr(StateStore, name), getattr(cls, name)
    want_sig, got_sig = inspect.signature(want), inspect.signature(got)
    shape = [(p.name, p.kind, p.default) for p in want_sig.parameters.values()]
    assert [(p.name, p.kind, p.default) for p in got_sig.parameters.values()] == shape, name
    assert typing.get_type_hints(got).get("return") == typing.get_type_hints(want).get("return"), name


def test_rows_are_frozen_values(tmp_path: Path) -> None:
    with State(tmp_path / STATE_FILE) as st:
        st.upsert_source("src", "https://example.org/sd.xml")
        sid = st.ensure_set("src", "https://example.org/cl.xml")
        st.put_document("https://example.org/cl.xml", "src", "capabilitylist", etag='"e"', last_modified=None,
                        sha256=None)  # fmt: skip
        source, (set_row,), doc = st.sources()[0], st.sets("src"), st.document("https://example.org/cl.xml")
    assert isinstance(source, SourceRow) and source.name == "src" and source.state is None
    assert set_row == SetRow(sid, "src", "https://example.org/cl.xml", "src", 0, None)
    assert isinstance(doc, DocumentRow) and doc.etag == '"e"'
    with pytest.raises(dataclasses.FrozenInstanceError):
        set_row.name = "other"  # type: ignore[misc]


#: Modules that still open the state by path themselves: none (the WebSub tables are behind the seam).
STILL_BY_PATH: set[str] = set()
#: Modules that may speak SQL: the shared SQL state (store/sql/), the SQLite and PostgreSQL backends, the
#: audit's scratch set of URIs seen (a temporary file of its own, not the state) and the filesystem blob
#: store's small blobs (a database of the blob store, not the state).
SQL_SPEAKERS = {"store/state.py", "store/postgres.py", "harvest/audit.py", "store/inline.py"}
SQL_PACKAGE = "store/sql/"
SQL_MARKS = ("import sqlite3", "sqlite_utils import", ".execute(")


def test_only_the_store_knows_where_the_state_lives() -> None:
    root = Path(aggregator.__file__).parent
    spelled = {
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if f'"{STATE_FILE}"' in p.read_text(encoding="utf-8")
    }
    assert spelled - STILL_BY_PATH == {"store/open.py"}


def test_only_the_backend_speaks_sql() -> None:
    """No sqlite3 connection, cursor or SQL text crosses the seam: a second backend replaces one module."""
    root = Path(aggregator.__file__).parent
    speakers = {
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if any(w in p.read_text(encoding="utf-8") for w in SQL_MARKS)
    }
    # errors.py reads sqlite3's exception classes only (a full disk, a read-only file: one line for the
    # operator); it opens no connection and runs no SQL.
    assert {p for p in speakers if not p.startswith(SQL_PACKAGE)} == SQL_SPEAKERS | {"errors.py"}
    errors = (root / "errors.py").read_text(encoding="utf-8")
    used = set(re.findall(r"sqlite3\.(\w+)", errors))
    assert used and all(name.endswith("Error") for name in used), used


def test_the_factory_names_a_location_it_cannot_open(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no state backend for mysql://"):
        connect("mysql://rsagg@db.example.org/rsagg")
    with connect(tmp_path / STATE_FILE) as st:  # a path: the SQLite file, created and migrated
        assert isinstance(st, State) and st.sources() == []
