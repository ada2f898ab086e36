"""Helpers for plugin tests: register a test plugin the way rsagg finds real ones, read what rsagg publishes.

``add_plugin(monkeypatch, name, obj)`` makes ``obj`` one more entry point of the ``rsagg`` group for
the test's duration, so every ``Plugins`` the code under test builds (the harvester's, the publisher's,
a command's) loads it after the installed ones, exactly as it would a pip-installed plugin.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

import aggregator.plugins.manager
from aggregator.config import Config, ServerConfig
from aggregator.rs.model import Entry, Head
from aggregator.rs.parse import parse_bytes
from aggregator.store.blobs import FileBlobStore

from .apps import create_app

PUBLIC = "http://rsagg.test"


class FakeEntryPoint:
    """Quacks like ``aggregator.plugins.entrypoints.EntryPoint`` as far as ``Plugins`` looks at one."""

    def __init__(self, name: str, obj: Any, error: Exception | None = None) -> None:
        self.name, self.obj, self.error = name, obj, error
        self.group = aggregator.plugins.manager.GROUP
        self.value = f"tests:{name}"
        self.distribution = self.version = ""  # no distribution

    def load(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.obj


def add_plugin(monkeypatch: pytest.MonkeyPatch, name: str, obj: Any, error: Exception | None = None) -> None:
    """Register ``obj`` (a module, an object with ``@hookimpl`` methods) as entry point ``name``; several
    calls in one test load in call order. ``error``: loading it raises that instead."""
    previous = aggregator.plugins.manager.entry_points
    ep = FakeEntryPoint(name, obj, error)

    def entry_points(**kw: Any) -> list:
        eps = list(previous(**kw))
        return [*eps, ep] if kw.get("group") == aggregator.plugins.manager.GROUP else eps

    monkeypatch.setattr(aggregator.plugins.manager, "entry_points", entry_points)


@asynccontextmanager
async def published(cfg: Config) -> AsyncIterator[httpx.AsyncClient]:
    """The publishing app over ``cfg``'s store, in process; requests to ``PUBLIC`` reach it."""
    config = dataclasses.replace(cfg, server=ServerConfig(base_url=PUBLIC))
    with FileBlobStore(cfg.store_path / "blobs") as store:
        app = create_app(config, blobs=store, state_path=cfg.store_path / "state.db")
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url=PUBLIC) as client:
                yield client
        finally:
            app.state.publisher.pool.close()


async def document(client: httpx.AsyncClient, url: str) -> tuple[Head, list[Entry]]:
    r = await client.get(url)
    assert r.status_code == 200, (url, r.status_code, r.text)
    return parse_bytes(r.content, url)


async def listed(client: httpx.AsyncClient, set_name: str, doc: str) -> list[Entry]:
    """Entries of ``/SET/resourcelist.xml`` or ``/SET/changelist.xml``, through an index when there is one."""
    head, entries = await document(client, f"{PUBLIC}/{set_name}/{doc}")
    if not head.is_index:
        return entries
    out: list[Entry] = []
    for part in entries:
        out += (await document(client, part.loc))[1]
    return out
