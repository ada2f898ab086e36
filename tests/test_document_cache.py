"""Cacheable documents: validators, conditional GETs, Cache-Control by kind, and renderings reused.

Closed Change List windows and Resource List parts whose rows did not change are answered from their
cached rendering (the builder is not called again); everything else is built again when its version
moved, and says so in its ETag.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from aggregator.publish import app as app_module
from aggregator.publish import documents
from aggregator.rs.parse import parse_bytes
from aggregator.testing.upstream import Upstream

from .harvesting import harvest, make_config
from .test_publish import publishing, with_publish


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the list documents built from the state (not answered from a cached rendering)."""
    calls: list[str] = []
    for name in ("resource_list_part", "change_list_window", "resource_list"):
        real = getattr(documents, name)

        def counted(*args, _real=real, _name=name, **kw):
            calls.append(_name)
            return _real(*args, **kw)

        monkeypatch.setattr(documents, name, counted)
    return calls


async def test_validators_and_conditional_gets_on_every_document(tmp_path: Path, monkeypatch, built):
    monkeypatch.setattr(documents, "MAX_ENTRIES", 4)
    up = Upstream(changes_per_list=None, resource_dump=False, change_dump=False)
    up.bulk_create(10)
    async with up.serving() as ubase:
        cfg = with_publish(make_config(tmp_path / "data", {"up": ubase}), changelist_size=4)
        assert (await harvest(cfg))["up"].ok
        async with publishing(cfg) as (base, client):
            urls = [f"{base}/.well-known/resourcesync", f"{base}/up/capabilitylist.xml",
                    f"{base}/up/resourcelist.xml", f"{base}/up/changelist.xml"]  # fmt: skip
            index = parse_bytes((await client.get(urls[2])).content, urls[2])[1]
            windows = parse_bytes((await client.get(urls[3])).content, urls[3])[1]
            assert len(index) == 3 and len(windows) == 3  # parts of 4, 4, 2; windows 1-2 closed, 3 open
            urls += [e.loc for e in index] + [e.loc for e in windows]
            first: dict[str, bytes] = {}
            for url in urls:
                r = await client.get(url)
                assert r.status_code == 200, url
                first[url] = r.content
                etag, lm, cc = r.headers["etag"], r.headers["last-modified"], r.headers["cache-control"]
                closed = url in (windows[0].loc, windows[1].loc)
                assert cc == ("public, max-age=86400" if closed else "public, max-age=10"), url
                for headers in (
                    {"if-none-match": etag},
                    {"if-modified-since": lm},
                    {"if-none-match": f"x, {etag}"},
                ):
                    again = await client.get(url, headers=headers)
                    assert again.status_code == 304 and again.content == b"", (url, headers)
                    assert again.headers["etag"] == etag
                r = await client.get(url, headers={"if-none-match": '"other"', "if-modified-since": lm})
                assert r.status_code == 200 and r.content  # If-None-Match decides (RFC 9110 §13.2.2)
                head = await client.head(url)
                assert head.status_code == 200 and head.headers["etag"] == etag and head.content == b""

            # the lists again: all from their cached renderings, byte for byte
            built.clear()
            for url in urls[2:]:
                assert (await client.get(url)).content == first[url]
            assert built == []

            # a change in the last part: that part, the index and the open window are built again;
            # the untouched parts and the closed windows are not
            etags = {u: (await client.get(u)).headers["etag"] for u in urls}
            up.update("r000009.txt", b"changed\n")
            assert (await harvest(cfg))["up"].ok
            built.clear()
            changed = {u for u in urls if (await client.get(u)).headers["etag"] != etags[u]}
            assert changed == {urls[2], urls[3], index[2].loc, windows[2].loc}
            assert sorted(built) == ["change_list_window", "resource_list", "resource_list_part"]
            assert b"changed" not in first[index[2].loc]
            new_part = (await client.get(index[2].loc)).content
            assert new_part != first[index[2].loc]
            assert (await client.get(index[0].loc)).content == first[index[0].loc]
            assert (await client.get(windows[0].loc)).content == first[windows[0].loc]


async def test_an_interrupted_rendering_is_not_cached(tmp_path: Path, monkeypatch, built):
    up = Upstream(resource_dump=False, change_dump=False)
    up.bulk_create(3)
    async with up.serving() as ubase:
        cfg = make_config(tmp_path / "data", {"up": ubase})
        assert (await harvest(cfg))["up"].ok
        real = app_module.iter_document_bytes

        def broken(head, entries, **kw):
            yield from real(head, entries, **kw)
            raise RuntimeError("stream broke")

        async with publishing(cfg) as (base, client):
            monkeypatch.setattr(app_module, "iter_document_bytes", broken)
            with pytest.raises(Exception):  # noqa: B017 - the connection breaks, whatever httpx calls it
                await client.get(f"{base}/up/resourcelist.xml")
            monkeypatch.setattr(app_module, "iter_document_bytes", real)
            built.clear()
            r = await client.get(f"{base}/up/resourcelist.xml")
            assert r.status_code == 200 and built == ["resource_list"]  # rendered again, whole
            assert len(parse_bytes(r.content, f"{base}/up/resourcelist.xml")[1]) == 3
