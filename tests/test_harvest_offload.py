"""harvest/offload.py: page work in worker processes, with the daemon's own blob store."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from aggregator.harvest.oaipage import OaiError, store_page
from aggregator.harvest.offload import Offload, OffloadError, StoreRecipe
from aggregator.store.blobs import FileBlobStore
from aggregator.store.defaults import create_store

from .faultystores import full_disk

PAGE = b"""<OAI-PMH xmlns="http://www.openarchives.org/OAI/2.0/"><ListRecords>
<record><header><identifier>oai:x:1</identifier><datestamp>2026-01-01</datestamp></header>
<metadata><dc xmlns="http://www.openarchives.org/OAI/2.0/oai_dc/">one</dc></metadata></record>
<record><header status="deleted"><identifier>oai:x:2</identifier><datestamp>2026-01-02</datestamp></header>
</record></ListRecords></OAI-PMH>"""
ONE = b'<dc xmlns="http://www.openarchives.org/OAI/2.0/oai_dc/">one</dc>'


def pid_of(blobs: object) -> int:
    return os.getpid()


def die(blobs: object) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def store_in(tmp_path: Path) -> tuple[FileBlobStore, StoreRecipe]:
    recipe = StoreRecipe(create_store, {}, tmp_path)
    return create_store({}, tmp_path), recipe


async def test_a_page_is_stored_by_a_worker_process_in_the_daemons_store(tmp_path: Path):
    blobs, recipe = store_in(tmp_path)
    offload = Offload(blobs, recipe, processes=1)
    assert offload.processes == 1
    assert await offload.run(pid_of) != os.getpid()
    page, stored, error = await offload.run(store_page, PAGE, "http://h/oai")
    assert error is None and page.records == []  # the contents stayed in the worker
    (one, two) = stored
    assert one[:3] == ("oai:x:1", one[1], False) and two[2] is True and two[3] is None
    assert one[4] == len(ONE)
    # committed by the worker: durable and visible to the daemon's own handle of the store
    assert blobs.exists(one[3]) and blobs.read_inline(one[3]) == ONE
    blobs.close()


async def test_errors_travel_back_to_the_walk(tmp_path: Path):
    """A page that is not XML raises OaiError naming the URL where the page is awaited; a store that
    fails returns the page with the error, which the walk raises in walk order."""
    blobs, _ = store_in(tmp_path)
    offload = Offload(blobs, StoreRecipe(full_disk, {"fail_on": "one"}, tmp_path), processes=1)
    with pytest.raises(OaiError, match="http://h/broken"):
        await offload.run(store_page, b"<OAI-PMH><ListRecords>", "http://h/broken")
    _, stored, error = await offload.run(store_page, PAGE, "http://h/oai")
    assert stored == [] and isinstance(error, OSError) and "No space left" in str(error)
    assert not any((tmp_path / "blobs" / "tmp").glob("rsagg-*"))  # nothing half-written left
    blobs.close()


async def test_a_worker_that_dies_fails_its_job_and_the_next_job_gets_a_new_one(tmp_path: Path):
    blobs, recipe = store_in(tmp_path)
    offload = Offload(blobs, recipe, processes=1)
    before = await offload.run(pid_of)
    with pytest.raises(OffloadError, match=r"died while it ran die.*harvest\.processes = 0"):
        await offload.run(die)
    after = await offload.run(pid_of)
    assert after not in (before, os.getpid())
    blobs.close()


async def test_a_backend_that_cannot_travel_or_no_processes_runs_in_threads(tmp_path: Path):
    blobs, recipe = store_in(tmp_path)
    unpicklable = StoreRecipe(lambda settings, root: create_store(settings, root), {}, tmp_path)
    for offload in (Offload(blobs, unpicklable, processes=2), Offload(blobs, recipe, processes=0)):
        assert offload.processes == 0
        assert await offload.run(pid_of) == os.getpid()
        _, stored, error = await offload.run(store_page, PAGE, "http://h/oai")
        assert error is None and blobs.exists(stored[0][3])
    blobs.close()


async def test_what_a_worker_stores_is_counted_by_the_daemons_metrics(tmp_path: Path):
    """The worker's store has no metrics of its own: its commits reach the daemon's ``on_commit``."""
    blobs, recipe = store_in(tmp_path)
    commits: list[tuple[list, list]] = []
    blobs.on_commit = lambda written, found: commits.append((written, found))
    offload = Offload(blobs, recipe, processes=1)
    _, stored, _ = await offload.run(store_page, PAGE, "http://h/oai")
    await offload.run(store_page, PAGE, "http://h/oai")  # the same record again: found, not written
    sha = stored[0][3]
    assert [([(i.sha256, i.length) for i in w], [(i.sha256, i.length) for i in f]) for w, f in commits] == [
        ([(sha, len(ONE))], []),
        ([], [(sha, len(ONE))]),
    ]
    blobs.close()
