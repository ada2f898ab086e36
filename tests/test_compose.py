"""The composition root (run/compose.py): each stage is handed its parts, typed, at construction."""

from __future__ import annotations

import sqlite3
import typing
from pathlib import Path

import pytest
import trio

from aggregator.config import Config, parse_config
from aggregator.harvest.context import HarvestContext
from aggregator.harvest.notices import NotifiedHarvest
from aggregator.run.compose import open_assembly, start_node


def test_the_harvest_context_has_no_untyped_slots() -> None:
    """Nothing is parked on the harvest context for other stages to pick up later."""
    # Its field types are imported for type checking only (rsagg status loads this module without the
    # harvest's libraries): resolve them in a namespace that has them.
    import trio

    from aggregator.harvest import context
    from aggregator.harvest.fetch import Fetcher
    from aggregator.harvest.offload import Offload, StoreRecipe
    from aggregator.harvest.patch import PatchApplier
    from aggregator.observe.metrics import Metrics
    from aggregator.store.interface import StateStore

    names = {"trio": trio, "Fetcher": Fetcher, "Offload": Offload, "StoreRecipe": StoreRecipe,
             "PatchApplier": PatchApplier, "Metrics": Metrics, "StateStore": StateStore}  # fmt: skip
    hints = typing.get_type_hints(HarvestContext, globalns={**vars(context), **names})
    assert not [name for name, hint in hints.items() if hint is typing.Any]
    assert "notifications" not in hints and "dumps" not in hints


def _config(tmp_path: Path, **sections: dict) -> Config:
    raw = {"store": {"path": str(tmp_path / "data")}, "sources": [], **sections}
    return parse_config(raw, str(tmp_path / "rsagg.toml"))


async def test_assemble_wires_dumps_and_notifications(tmp_path: Path) -> None:
    config = _config(tmp_path, publish={"dump_interval": 3600})
    async with open_assembly(config) as parts:
        ctx = parts.harvest
        notes = parts.notifications
        assert parts.dumps is not None and notes is not None and notes.hub is not None
        try:
            assert notes.notifier.wake in ctx.commit_listeners  # a harvest commit wakes the notifier
            view = notes.notifier.view_of(config, ctx.reader, notes.notifier.capabilities)
            assert view.site.dumps_available == parts.dumps.available  # it advertises the dumps
            assert parts.followed is notes.subscriber is not None  # poll_source hands followed sources over
            harvester = notes.subscriber.harvester
            assert isinstance(harvester, NotifiedHarvest) and harvester.ctx is ctx
            for part in (notes.hub, notes.notifier, notes.subscriber):  # a state handle of its own each
                assert part.state is not ctx.writer and part.state is not ctx.reader
            assert parts.dumps.state is not ctx.writer
            paths = {getattr(r, "path", None) for r in parts.app(config).routes}
            assert {"/hub", "/{set}/resourcedump.xml"} <= paths
            roles = parts.roles()  # what one cluster node at a time does
            assert set(roles) == {"@dumps", "@hub", "@orphans"}
            assert roles["@orphans"] == notes.subscriber.run_orphans  # unsubscribes what no node follows
        finally:
            await notes.aclose()


async def test_assemble_without_harvest_or_dumps_or_notifications(tmp_path: Path) -> None:
    config = _config(tmp_path, publish={"dump_interval": 0})
    async with open_assembly(config, harvest=False) as parts:
        assert parts.dumps is None and parts.notifications is not None
        try:
            assert parts.notifications.subscriber is None and parts.followed is None
            assert set(parts.roles()) == {"@dumps", "@hub"}  # no subscriber: no orphans to look for
        finally:
            await parts.notifications.aclose()
    config = _config(tmp_path, publish={"dump_interval": 0}, notifications={"enabled": False})
    async with open_assembly(config) as parts:
        assert parts.notifications is None and parts.followed is None and parts.harvest.commit_listeners == ()


async def test_a_cluster_node_gets_a_state_handle_of_its_own_closed_once_it_left(tmp_path: Path) -> None:
    """compose.py opens the node's handle (not the harvester's: beats never queue behind a harvest batch)
    and closes it after the node has left the cluster (released its leases, marked itself stopped)."""
    config = _config(
        tmp_path,
        cluster={"enabled": True, "node": "A"},
        publish={"dump_interval": 0},
        notifications={"enabled": False},
    )
    async with open_assembly(config) as parts:
        ctx = parts.harvest
        scope = trio.CancelScope()
        async with trio.open_nursery() as nursery:
            node = start_node(
                parts, nursery, scope, start=lambda src, fence: None, stop=lambda name: trio.Event()
            )
            assert node.state is not ctx.writer and node.state is not ctx.reader
            with trio.fail_after(60):
                while node.beats < 1 or not node.roles_held:
                    await trio.sleep(0.01)
            assert [n.name for n in node.state.nodes()] == ["A"]
            scope.cancel()
        (row,) = ctx.reader.nodes()
        assert row.name == "A" and row.stopped_at is not None  # it left before its handle closed
        leases = ctx.reader.leases()  # the "@dumps" role's
        assert leases and all(lease.node is None for lease in leases)  # released
        with pytest.raises(sqlite3.ProgrammingError):  # closed
            node.state.nodes()
