"""The publisher's bounded pool of database connections (server.max_readers): a crawl that asks for many
documents at once waits a little, then gets 503 + Retry-After; a connection never given back cannot
keep its slot for good."""

from __future__ import annotations

import dataclasses
import gc
from pathlib import Path

import pytest
import trio

import aggregator.publish.app as app_module
from aggregator.config import ConfigError, parse_config
from aggregator.publish.app import ReaderPool, ServerBusy
from aggregator.publish.uris import rsagg_uri
from aggregator.store.interface import StateStore
from aggregator.store.open import connect
from aggregator.store.state import State

from .test_publish import publishing
from .test_resource_get import BLOBS, UP, filled


def _opener(db: Path):  # as the composition opens the publisher's readers (run/parts.py)
    def open_reader() -> StateStore:
        return connect(db, readonly=True, cache_mib=16)

    return open_reader


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "state.db"
    State(path).close()
    return path


async def test_at_most_max_open_then_busy(db: Path) -> None:
    pool = ReaderPool(_opener(db), max_idle=1, max_open=2, wait=0.2)
    a, b = await pool.acquire(), await pool.acquire()
    assert pool.in_use == 2
    start = trio.current_time()
    with pytest.raises(ServerBusy, match="all 2 database connections busy"):
        await pool.acquire()
    assert trio.current_time() - start >= 0.2
    pool.release(a)
    pool.release(a)  # twice: no effect
    assert pool.in_use == 1
    c = await pool.acquire()
    assert c is a  # the idle one, reused
    pool.release(b)
    pool.release(c)
    assert pool.in_use == 0
    pool.close()


async def test_a_waiting_request_gets_the_next_free_connection(db: Path) -> None:
    pool = ReaderPool(_opener(db), max_open=1, wait=5)
    held = await pool.acquire()
    got: list[State] = []

    async def waiter() -> None:
        got.append(await pool.acquire())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.sleep(0.1)
        assert got == []
        pool.release(held)
    assert got == [held]
    pool.release(held)
    pool.close()


async def test_a_connection_never_given_back_frees_its_slot_when_collected(db: Path) -> None:
    pool = ReaderPool(_opener(db), max_open=1, wait=1)
    lost = await pool.acquire()
    assert pool.in_use == 1
    del lost  # a response that was never sent, say
    await trio.sleep(0)  # trio lets go of the last result it handed this task
    gc.collect()
    assert pool.in_use == 0
    pool.release(await pool.acquire())
    pool.close()


async def test_busy_server_answers_503_and_serves_again(tmp_path: Path, monkeypatch) -> None:
    pools: list[ReaderPool] = []
    init = ReaderPool.__init__

    def capture(self: ReaderPool, *args, **kw) -> None:
        init(self, *args, **kw)
        pools.append(self)

    monkeypatch.setattr(ReaderPool, "__init__", capture)
    monkeypatch.setattr(app_module, "READER_WAIT", 0.2)
    cfg = filled(tmp_path)
    cfg = dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, max_readers=1))
    async with publishing(cfg) as (base, client):
        (pool,) = pools
        assert pool.max_open == 1
        held = await pool.acquire()
        resource = rsagg_uri(base, "up", UP + "small.txt")
        for url in (base + "/.well-known/resourcesync", base + "/up/resourcelist.xml", resource):
            r = await client.get(url)
            assert r.status_code == 503 and r.headers["retry-after"] == "5", url
        pool.release(held)
        assert (await client.get(base + "/up/resourcelist.xml")).status_code == 200
        r = await client.get(resource)
        assert r.status_code == 200 and r.content == BLOBS["small.txt"][0]
        metrics = (await client.get(base + "/metrics")).text
        busy = [
            line
            for line in metrics.splitlines()
            if line.startswith("rsagg_http_requests_total{") and 'code="503"' in line
        ]
        assert any('route="/{set}/r/{rest:path}"' in line for line in busy), busy


def test_max_readers_is_checked() -> None:
    assert parse_config({"server": {"max_readers": 4}}).server.max_readers == 4
    with pytest.raises(ConfigError, match=r"server\.max_readers"):
        parse_config({"server": {"max_readers": 0}})
