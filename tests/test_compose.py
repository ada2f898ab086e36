"""The composition root (run/compose.py): each stage is handed its parts, typed, at construction."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
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


# -- structure: parts are built in run/ only, handed in at construction --------------------------------

ROOT = Path(__file__).resolve().parent.parent / "aggregator"

#: What builds a part: opening a state handle, loading plugins, opening a blob store, the one HTTP client,
#: a publisher's reader pool, and every stage's part. Called only by the composition (run/), the test
#: doubles (aggregator/testing) and, for the state, store/ itself (where the backends are). The commands
#: call the composition's own builders (run/parts.py: ``state_handle``, ``load_plugins``...) instead.
STATE_OPENERS = frozenset({"open_state", "connect", "State", "PostgresState"})
PART_BUILDERS = STATE_OPENERS | {
    "Plugins.from_config", "open_blob_store", "Fetcher", "ReaderPool", "Publisher", "create_app",
    "HarvestContext", "Offload", "Metrics", "DumpBuilder", "Hub", "Notifier", "Subscriber", "Node",
    "delivery_client",
}  # fmt: skip


def _called(node: ast.Call) -> str:
    """``f(...)`` -> "f", ``a.b(...)`` -> "a.b"; a module's own function (``sqlite3.connect``) keeps its
    module in the name, so it is not taken for rsagg's ``connect``."""
    f = node.func
    if isinstance(f, ast.Name):
        return f.id
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
        value = f.value.id
        return f.attr if value in {"state", "postgres", "compose", "parts", "build"} else f"{value}.{f.attr}"
    return ""


def _builder_calls(path: Path) -> set[str]:
    return {
        name
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
        if isinstance(node, ast.Call) and (name := _called(node)) in PART_BUILDERS
    }


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)


CALLS = {_module(p): _builder_calls(p) for p in sorted(ROOT.rglob("*.py"))}


def test_the_scan_sees_the_builders() -> None:
    """The check below can fail: it finds the calls the composition makes (direct, through a module)."""
    assert {"open_state", "connect", "Plugins.from_config", "open_blob_store"} <= CALLS[
        "aggregator.run.parts"
    ]
    assert {"Fetcher", "HarvestContext", "Metrics", "Offload"} <= CALLS["aggregator.run.compose"]
    assert "connect" not in CALLS["aggregator.store.inline"]  # sqlite3.connect: its own file, not the state


def test_only_the_composition_builds_parts() -> None:
    """No module below run/ opens a state handle, loads plugins, opens the blob store or builds a stage's
    part: it is handed them (the test doubles of aggregator/testing build their own, as tests do)."""
    found = []
    for module, calls in CALLS.items():
        if module.startswith(("aggregator.run.", "aggregator.testing.")):
            continue
        if module.startswith("aggregator.store."):
            calls = calls - STATE_OPENERS  # where the state's backends are opened from
        found += [f"{module} calls {name}()" for name in sorted(calls)]
    assert not found, "; ".join(found)


#: The types of parts: a constructor parameter of one of these has no default (no fallback built inside).
PART_TYPES = re.compile(
    r"\b(Plugins|BlobStore|StateStore|Metrics|ServedCounter|Fetcher|ReaderPool|Offload|DumpBuilder|Hub|"
    r"Notifier|Subscriber|HostShares|AsyncClient|Harvester|PatchApplier|ViewOf)\b"
)


def _names_a_part(annotation: str) -> bool:
    """A part, or a factory of one (``Callable[[], StateStore]``); not a callback that is handed one
    (``Callable[[StateStore], Site]``: its argument list is left out)."""
    return PART_TYPES.search(re.sub(r"Callable\[\[[^\]]*\]", "Callable[", annotation)) is not None


def _stages() -> list[type]:
    from aggregator.harvest.offload import Offload
    from aggregator.publish.app import Publisher, ReaderPool
    from aggregator.publish.dumps import DumpBuilder
    from aggregator.publish.fastpath import HotCache, ResourceFastPath
    from aggregator.run.cluster import Node
    from aggregator.websub.hub import Hub
    from aggregator.websub.notifier import Notifier
    from aggregator.websub.subscriber import Subscriber

    return [Publisher, ReaderPool, DumpBuilder, HotCache, ResourceFastPath, Node, Hub, Notifier, Subscriber,
            Offload]  # fmt: skip


def test_stage_constructors_have_no_defaulted_parts() -> None:
    """A stage gets its parts at construction, never a default it builds itself (``x or Plugins...``)."""
    defaulted = []
    for cls in _stages():
        for p in inspect.signature(cls.__init__).parameters.values():  # type: ignore[misc]
            if p.default is not p.empty and _names_a_part(str(p.annotation)):
                defaulted.append(f"{cls.__name__}({p.name}: {p.annotation} = {p.default!r})")
    for f in dataclasses.fields(HarvestContext):
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        if has_default and _names_a_part(str(f.type)):
            defaulted.append(f"HarvestContext.{f.name}: {f.type}")
    assert not defaulted, "; ".join(defaulted)


def test_the_defaulted_parts_check_can_fail() -> None:
    """The annotation match finds a part type inside a union or a callable."""
    assert _names_a_part("Hub | None") and _names_a_part("Callable[[], StateStore]")
    assert not _names_a_part("HubLimits | None") and not _names_a_part("Callable[[StateStore], Site] | None")
