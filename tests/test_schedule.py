"""The daemon's dump schedule: dumps are built, advertised in the Capability List, and readable."""

from __future__ import annotations

from pathlib import Path

import httpx
import trio

from aggregator.config import parse_config
from aggregator.publish.schedule import dump_app_options, run_dumps
from aggregator.rs.parse import parse_bytes
from aggregator.rs.validate import validate_source
from aggregator.run.compose import open_context
from aggregator.testing.upstream import Upstream

from .apps import create_app, open_dump_builder
from .harvesting import harvest
from .httpserver import serve_app


async def test_dumps_built_on_schedule_and_advertised(tmp_path: Path):
    up = Upstream(resource_dump=False, change_dump=False)
    up.bulk_create(12)
    async with up.serving() as base:
        raw = {
            "store": {"path": str(tmp_path / "data")},
            "harvest": {"retries": 1, "backoff_base": 0.01},
            "publish": {"dump_interval": 3600, "changelist_size": 5},
            "sources": [{"name": "up", "url": base}],
        }
        config = parse_config(raw, str(tmp_path / "rsagg.toml"))
        assert (await harvest(config))["up"].ok
        async with open_context(config) as ctx:
            stop = trio.Event()
            builder = open_dump_builder(config, ctx.blobs)
            options = dump_app_options(builder, {})
            app = create_app(config, blobs=ctx.blobs, state_path=config.store_path / "state.db", **options)
            async with serve_app(app) as ours, httpx.AsyncClient() as client, trio.open_nursery() as nursery:
                nursery.start_soon(run_dumps, builder, lambda: ctx.config, stop.wait)
                # One build round commits the Change Dump packages before the Resource Dump: wait for
                # both (waiting for "any dump" raced the second commit on a loaded machine).
                with trio.fail_after(60):
                    while not set(builder.available("up")) >= {"resourcedump", "changedump"}:
                        await trio.sleep(0.05)
                stop.set()
                cap = (await client.get(f"{ours}/up/capabilitylist.xml")).content
                _, entries = parse_bytes(cap)
                caps = {e.capability: e.loc for e in entries}
                assert "resourcedump" in caps and "changedump" in caps  # 12 changes: two closed windows
                for url in (caps["resourcedump"], caps["changedump"]):
                    doc = (await client.get(url.replace(config.server.base_url, ours))).content
                    assert [i for i in validate_source(doc, url) if i.severity == "error"] == []
                    _, packages = parse_bytes(doc)
                    assert packages
                    zip_url = packages[0].loc.replace(config.server.base_url, ours)
                    got = await client.get(zip_url)
                    assert got.status_code == 200 and got.content[:2] == b"PK"
        # dump_interval = 0: no dumps, nothing advertised
        config0 = parse_config({**raw, "publish": {"dump_interval": 0}}, str(tmp_path / "rsagg.toml"))
        async with open_context(config0) as ctx:
            assert dump_app_options(open_dump_builder(config0, ctx.blobs), {"x": 1}) == {"x": 1}
