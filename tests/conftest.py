"""Fixtures shared by the test modules."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from aggregator.store.blobs import FileBlobStore

from . import pgserver

#: Fixtures that start a real peer (a PostgreSQL server): every test using one, directly or through another
#: fixture, is marked ``slow``, so that ``python -m pytest -m "not slow"`` runs the unit tests only. (A
#: fixture that asks for ``pg_server`` with ``request.getfixturevalue`` marks its "postgresql" param
#: itself: ``pytest.param("postgresql", marks=pytest.mark.slow)``.)
SLOW_FIXTURES = frozenset({"pg_server"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``slow`` the tests that ask for a fixture of SLOW_FIXTURES (the whole fixture closure counts);
    modules that start other peers (nginx, SeaweedFS, Chromium, systemd-nspawn, subprocesses) mark
    themselves with ``pytestmark = pytest.mark.slow``."""
    for item in items:
        if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", autouse=True)
def _config_snapshots(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The commands the tests run keep their configuration snapshots (aggregator/config_cache.py) in the
    session's folder, not in the user's cache; tests/test_config_cache.py points each at its own."""
    before = os.environ.get("RSAGG_CACHE_DIR")
    os.environ["RSAGG_CACHE_DIR"] = str(tmp_path_factory.mktemp("rsagg-cache"))
    yield
    if before is None:
        os.environ.pop("RSAGG_CACHE_DIR", None)
    else:
        os.environ["RSAGG_CACHE_DIR"] = before


@pytest.fixture
def store(tmp_path: Path) -> Iterator[FileBlobStore]:
    """A FileBlobStore in the test's folder (test_s3store.py has its own ``store``: an S3BlobStore)."""
    s = FileBlobStore(tmp_path / "blobs")
    yield s
    s.close()


@pytest.fixture
def file_store(tmp_path: Path) -> Iterator[FileBlobStore]:
    """A FileBlobStore that writes every blob as a file (``inline_bytes=0``): for the file mechanics."""
    s = FileBlobStore(tmp_path / "blobs", inline_bytes=0)
    yield s
    s.close()


@pytest.fixture(scope="session")
def pg_server() -> Iterator[pgserver.PgServer]:
    """One private PostgreSQL server for the session (tests/pgserver.py), started by the first test that
    asks; ``pg_server.fresh_url()`` gives each test an empty schema of its own."""
    if not pgserver.available():
        pytest.fail(f"PostgreSQL 15 is not installed ({pgserver.BIN}): apt-get install -y postgresql-15")
    with pgserver.running() as server:
        yield server
