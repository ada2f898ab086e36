"""Opening a state handle: where the configured state lives and which backend opens it.

The one module that knows the state's file name and picks the backend from the location: a
``postgresql://`` URL is a PostgreSQL database (store/postgres.py, the ``rsagg[postgresql]`` extra),
anything else the SQLite file (store/state.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from .interface import StateUnavailable
from .state import State, local_commit_mark

if TYPE_CHECKING:
    from ..config import Config
    from .interface import StateStore

#: The state database's file name inside ``[store] path``: spelled here only (``state_path``).
STATE_FILE = "state.db"
#: URL schemes of the PostgreSQL backend.
POSTGRES_SCHEMES = ("postgresql", "postgres")


def state_path(config: Config) -> Path | str:
    """The state database of a configured rsagg: ``[store] state`` when it names one (a ``postgresql://``
    URL), else ``STATE_FILE`` in the store folder."""
    return config.store.state or Path(config.store_path) / STATE_FILE


def open_state(config: Config, *, readonly: bool = False, **options: Any) -> StateStore:
    """Open the configured state (created and migrated unless ``readonly``) with ``[store]
    synchronous``; ``options`` are ``State``'s other keyword arguments (``cache_mib``, ``clock``...)."""
    options.setdefault("synchronous", config.store.synchronous)
    return connect(state_path(config), readonly=readonly, **options)


def check_writable(config: Config) -> None:
    """Before harvesting: the configured SQLite state can be written, else ``StateUnavailable`` naming
    the file (one line, exit 1: cli.py). A PostgreSQL state says so at its first write."""
    location = state_path(config)
    if isinstance(location, Path) and location.exists():
        with State(location, synchronous=config.store.synchronous) as st:
            st.check_writable()


def connect(location: Path | str, *, readonly: bool = False, **options: Any) -> StateStore:
    """The state at ``location`` (what ``state_path`` gives): the one factory every opener goes through,
    so the backend is chosen here, from the location."""
    if isinstance(location, str) and "://" in location:
        scheme = location.split("://", 1)[0].lower()
        if scheme not in POSTGRES_SCHEMES:
            raise ValueError(f"no state backend for {scheme}:// locations (a SQLite file or postgresql://)")
        try:
            from .postgres import PostgresState
        except ImportError as exc:  # the optional extra is missing: one line, exit 1 (cli.py)
            need = "pip install 'rsagg[postgresql]'"
            raise StateUnavailable(f"a postgresql:// state needs psycopg ({need}): {exc}") from None
        return PostgresState(location, readonly=readonly, **options)
    return State(location, readonly=readonly, **options)


__all__ = ["STATE_FILE", "check_writable", "connect", "local_commit_mark", "open_state", "state_path"]
