"""Every hook of aggregator/hookspecs.py, one ``test_hook_<name>`` each, exercised end to end.

A test plugin is registered as one more entry point (``plugintesting.add_plugin``), so the harvester's,
the publisher's and the commands' own plugin managers load it like an installed plugin; the demo
Upstream is served on 127.0.0.1 and harvested for real. ``rsagg_startup``/``rsagg_shutdown`` run
``rsagg harvest --once`` and ``rsagg run`` as processes, with the example plugin (tests/example_plugin,
installed with pip) writing its events to a file. test_hookspecs_meta.py checks that no hook lacks one.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import sys
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
import trio

from aggregator.config import Config, parse_config
from aggregator.hookspecs import hookimpl
from aggregator.publish.uris import rsagg_uri
from aggregator.rs.model import Link
from aggregator.store.blobs import FileBlobStore
from aggregator.store.state import State
from aggregator.testing.upstream import PATCH_TYPE, Upstream, canonical_json

from .apps import open_dump_builder
from .harvesting import changelog, harvest, held
from .plugintesting import PUBLIC, add_plugin, listed, published

REPO = Path(__file__).resolve().parent.parent
GUARD = 60  # seconds: a hung step fails the test instead of hanging the suite (not a timing assertion)


def make_config(folder: Path, url: str, name: str = "up", **tables: Any) -> Config:
    """One source, fast retries, the store in ``folder``; ``tables``: more top-level tables (store...)."""
    store_table = {"path": str(folder), **tables.pop("store", {})}
    return parse_config(
        {
            "store": store_table,
            "harvest": {"retries": 2, "backoff_base": 0.01, "backoff_max": 0.05, "timeout": 10},
            "sources": [{"name": name, "url": url}],
            **tables,
        },
        str(folder.parent / "test.toml"),
    )


def res_path(name: str, set_name: str = "default") -> str:
    """The request path of an Upstream resource (what ``Upstream.counts`` is keyed by)."""
    return f"/{set_name}/res/{name}"


def state_rows(cfg: Config, uri: str) -> list:
    """The resource rows of ``uri`` as a *separate* connection sees them (i.e. committed)."""
    with State(cfg.store_path / "state.db", readonly=True) as st:
        return [r for r in st.iter_resources(include_deleted=True) if r.uri == uri]


async def ok(cfg: Config, name: str = "up") -> None:
    result = (await harvest(cfg))[name]
    assert result.ok, result.error


# ---------------------------------------------------------------------------------------------------
# registration hooks


class RecordingStores:
    """A blob store backend ``recording``: FileBlobStore at ``settings["path"]``, calls recorded."""

    def __init__(self) -> None:
        self.created: list[tuple[dict, Path]] = []

    def create(self, settings: dict, root: Path) -> FileBlobStore:
        self.created.append((dict(settings), Path(root)))
        return FileBlobStore(Path(settings["path"]))

    @hookimpl
    def rsagg_blob_stores(self):
        return {"recording": self.create}


async def test_hook_rsagg_blob_stores(tmp_path: Path, monkeypatch):
    stores = RecordingStores()
    add_plugin(monkeypatch, "recording", stores)
    up = Upstream(resource_dump=False, change_dump=False)
    up.bulk_create(3)
    elsewhere = tmp_path / "elsewhere"
    async with up.serving() as base:
        cfg = make_config(
            tmp_path / "data", base, store={"backend": "recording", "settings": {"path": str(elsewhere)}}
        )
        await ok(cfg)
    assert stores.created and all(c == ({"path": str(elsewhere)}, cfg.store_path) for c in stores.created)
    hashes = {v.sha256 for v in up.resources().values()}
    assert set(held(cfg).values()) == hashes
    with FileBlobStore(elsewhere) as chosen:
        assert all(chosen.exists(h) for h in hashes)
    default_dir = cfg.store_path / "blobs"
    assert not any(p.name in hashes for p in default_dir.rglob("*")), "blobs went to the default store"
    assert not (default_dir / "small.db").exists(), "blobs went to the default store"


class OldStore:
    """A backend written before ``read_inline`` joined the blob store interface."""

    def __init__(self, inner: FileBlobStore) -> None:
        self.inner = inner
        self.closed = False

    def close(self) -> None:
        self.closed = True
        self.inner.close()

    def __getattr__(self, name: str) -> Any:
        if name == "read_inline":
            raise AttributeError(name)
        return getattr(self.inner, name)


def test_a_backend_lacking_part_of_the_interface_is_refused_by_name(tmp_path: Path, monkeypatch):
    from aggregator.config import ConfigError
    from aggregator.harvest.context import open_blob_store
    from aggregator.plugins.manager import Plugins

    made: list[OldStore] = []

    class Old:
        @hookimpl
        def rsagg_blob_stores(self):
            return {
                "old": lambda settings, root: made.append(OldStore(FileBlobStore(root / "b"))) or made[-1]
            }

    add_plugin(monkeypatch, "old", Old())
    cfg = parse_config({"store": {"path": str(tmp_path), "backend": "old"}}, str(tmp_path / "rsagg.toml"))
    with pytest.raises(ConfigError) as caught:
        open_blob_store(cfg, Plugins.from_config(cfg))
    assert "store.backend" in str(caught.value) and "lacks read_inline" in str(caught.value)
    assert made and made[0].closed  # what it opened is closed again


class RecordingJsonPatch:
    """Overrides the built-in JSON Patch applier (a later plugin's media types win), counting uses."""

    def __init__(self) -> None:
        self.applied: list[tuple[bytes, bytes]] = []

    def apply(self, current: bytes, patch: bytes) -> bytes:
        self.applied.append((current, patch))
        return canonical_json(jsonpatch.JsonPatch(json.loads(patch)).apply(json.loads(current)))

    @hookimpl
    def rsagg_patch_formats(self):
        return {PATCH_TYPE: self.apply}


async def test_hook_rsagg_patch_formats(tmp_path: Path, monkeypatch):
    patches = RecordingJsonPatch()
    add_plugin(monkeypatch, "recordingpatch", patches)
    up = Upstream(json_patches=True, resource_dump=False, change_dump=False)
    before = {"title": "a", "n": 1}
    up.create("doc.json", canonical_json(before), "application/json")
    async with up.serving() as base:
        cfg = make_config(tmp_path / "data", base)
        await ok(cfg)
        assert patches.applied == []  # nothing to patch in a baseline
        rec = up.patch_json("doc.json", {"title": "a", "n": 2})
        assert rec.patch is not None
        up.reset_counts()
        await ok(cfg)
    assert patches.applied == [(canonical_json(before), rec.patch)]
    assert held(cfg) == {up.url("doc.json"): up.resources()["doc.json"].sha256}
    assert up.counts[res_path("doc.json")] == 0, "fetched by patch, not from loc"


# ---------------------------------------------------------------------------------------------------
# harvest-side filter


class SkipByName:
    """Synchronous filter: False for entries whose loc contains one of ``hidden``."""

    def __init__(self, *hidden: str) -> None:
        self.hidden = set(hidden)
        self.calls: list[tuple[str, str, bool]] = []

    @hookimpl
    def rsagg_filter_harvest(self, plugin, source, entry, metadata):
        self.calls.append((source, entry.loc, callable(metadata)))
        return False if any(h in entry.loc for h in self.hidden) else None


class AsyncSkip:
    """An ``async def`` implementation: returns a coroutine the harvester awaits."""

    @hookimpl
    async def rsagg_filter_harvest(self, plugin, source, entry, metadata):
        await trio.lowlevel.checkpoint()
        return False if "async-skip" in entry.loc else True


async def test_hook_rsagg_filter_harvest(tmp_path: Path, monkeypatch):
    skip = SkipByName("skip-me")
    add_plugin(monkeypatch, "skip", skip)
    add_plugin(monkeypatch, "asyncskip", AsyncSkip())

    # Incremental: skipped entries are never fetched; a held copy of a newly skipped entry is deleted.
    up = Upstream(resource_dump=False, change_dump=False)
    for name in ("keep.txt", "skip-me.txt", "async-skip.txt"):
        up.create(name, name.encode())
    async with up.serving() as base:
        cfg = make_config(tmp_path / "inc", base)
        await ok(cfg)
        assert set(held(cfg)) == {up.url("keep.txt")}
        assert up.counts[res_path("skip-me.txt")] == 0 and up.counts[res_path("async-skip.txt")] == 0
        assert ("up", up.url("keep.txt"), True) in skip.calls  # source name, the entry, a metadata callable

        skip.hidden.add("keep.txt")
        up.update("keep.txt", b"keep v2")
        up.create("new.txt", b"new")
        up.reset_counts()
        await ok(cfg)
        assert set(held(cfg)) == {up.url("new.txt")}
        assert (up.url("keep.txt"), "deleted", None) in changelog(cfg)
        assert up.counts[res_path("keep.txt")] == 0

    # Baseline (a set without Change List is re-read each time): a skipped entry is not marked seen,
    # so the copy held from before is tombstoned when the baseline finishes.
    skip.hidden.clear()
    up2 = Upstream(change_list=False, resource_dump=False, change_dump=False)
    up2.create("a.txt", b"a")
    up2.create("b.txt", b"b")
    async with up2.serving() as base:
        cfg2 = make_config(tmp_path / "base", base)
        await ok(cfg2)
        assert set(held(cfg2)) == {up2.url("a.txt"), up2.url("b.txt")}
        skip.hidden.add("b.txt")
        up2.update("a.txt", b"a v2")  # the Resource List changes: the next harvest is a new baseline
        await ok(cfg2)
        assert held(cfg2) == {up2.url("a.txt"): up2.resources()["a.txt"].sha256}
        assert [c for u, c, _ in changelog(cfg2) if u == up2.url("b.txt")] == ["created", "deleted"]


# ---------------------------------------------------------------------------------------------------
# publish-side hooks


class HideSecrets:
    def __init__(self) -> None:
        self.sets: set[str] = set()

    @hookimpl
    def rsagg_filter_publish(self, plugin, set_name, resource):
        self.sets.add(set_name)
        return False if "secret" in resource.uri else None


async def test_hook_rsagg_filter_publish(tmp_path: Path, monkeypatch):
    hide = HideSecrets()
    add_plugin(monkeypatch, "hide", hide)
    up = Upstream(resource_dump=False, change_dump=False)
    up.create("open.txt", b"open")
    up.create("secret.txt", b"secret")
    async with up.serving() as base:
        cfg = make_config(tmp_path / "data", base)
        await ok(cfg)
    assert len(held(cfg)) == 2  # harvested both; only publishing hides one
    shown, secret = rsagg_uri(PUBLIC, "up", up.url("open.txt")), rsagg_uri(PUBLIC, "up", up.url("secret.txt"))
    async with published(cfg) as client:
        assert [e.loc for e in await listed(client, "up", "resourcelist.xml")] == [shown]
        assert [e.loc for e in await listed(client, "up", "changelist.xml")] == [shown]
        assert (await client.get(shown)).status_code == 200
        assert (await client.get(secret)).status_code == 404
    assert hide.sets == {"up"}


class OwnLinks:
    """A link policy of its own: a via link to a landing page and a license, nothing else."""

    def __init__(self) -> None:
        self.records: list[Any] = []

    @hookimpl
    def rsagg_republish_links(self, plugin, set_name, resource, uri_of, record):
        self.records.append(record)
        return [Link("via", resource.uri + "#landing"), Link("license", "https://creativecommons.org/cc0/")]


VERSION_RELS_ORDER = ("memento", "timegate", "timemap")


async def test_hook_rsagg_republish_links(tmp_path: Path, monkeypatch):
    links = OwnLinks()
    add_plugin(monkeypatch, "ownlinks", links)
    up = Upstream(resource_dump=False, change_dump=False, mirror="ok")  # mirrors: dropped by the default
    up.create("a.txt", b"a")
    async with up.serving() as base:
        cfg = make_config(tmp_path / "data", base)
        await ok(cfg)
    expected = [
        Link("via", up.url("a.txt") + "#landing"),
        Link("license", "https://creativecommons.org/cc0/"),
    ]
    async with published(cfg) as client:
        # the plugin decides the upstream's links; rsagg's own §14.6 links (publish/versions.py) follow
        (entry,) = await listed(client, "up", "resourcelist.xml")
        assert entry.links[:2] == expected and [ln.rel for ln in entry.links[2:]] == [*VERSION_RELS_ORDER]
        (change,) = await listed(client, "up", "changelist.xml")
        assert change.links[:2] == expected and [ln.rel for ln in change.links[2:]] == [*VERSION_RELS_ORDER]
    assert None in links.records and any(r is not None and r.change == "created" for r in links.records)


# ---------------------------------------------------------------------------------------------------
# events after commits


class StoreEvents:
    """Records stored/deleted/published events, with what a separate connection sees at that moment."""

    def __init__(self, db: Path) -> None:
        self.db = db
        self.stored: list[tuple] = []
        self.deleted: list[tuple] = []
        self.published: list[tuple] = []

    def _rows(self, uri: str) -> list:
        with State(self.db, readonly=True) as st:
            return [r for r in st.iter_resources(include_deleted=True) if r.uri == uri]

    @hookimpl
    def rsagg_resource_stored(self, plugin, source, set_name, uri, change, sha256):
        (row,) = self._rows(uri)
        self.stored.append((source, set_name, uri, change, sha256, row.sha256, row.deleted))

    @hookimpl
    def rsagg_resource_deleted(self, plugin, source, set_name, uri):
        (row,) = self._rows(uri)
        self.deleted.append((source, set_name, uri, row.deleted))

    @hookimpl
    def rsagg_change_published(self, plugin, set_name, seq, uri, change, datetime):
        with State(self.db, readonly=True) as st:
            (rec,) = st.iter_changelog(seq - 1, limit=1)
        self.published.append((set_name, seq, uri, change, datetime, (rec.seq, rec.uri, rec.change)))


async def test_hook_rsagg_resource_stored(tmp_path: Path, monkeypatch):
    events = StoreEvents(tmp_path / "data" / "state.db")
    add_plugin(monkeypatch, "events", events)
    up = Upstream(resource_dump=False, change_dump=False)
    up.create("a.txt", b"a")
    up.create("b.txt", b"b")
    async with up.serving() as base:
        cfg = make_config(tmp_path / "data", base)
        await ok(cfg)
        sha = {p: v.sha256 for p, v in up.resources().items()}
        # committed before the hook runs: another connection already sees the new row
        assert sorted(events.stored) == sorted(
            ("up", "up", up.url(p), "created", sha[p], sha[p], False) for p in ("a.txt", "b.txt")
        )
        up.update("a.txt", b"a v2")
        up.delete("b.txt")
        await ok(cfg)
        new = up.resources()["a.txt"].sha256
        assert events.stored[2:] == [("up", "up", up.url("a.txt"), "updated", new, new, False)]
        await ok(cfg)  # nothing changed upstream: nothing stored
        assert len(events.stored) == 3


async def test_hook_rsagg_resource_deleted(tmp_path: Path, monkeypatch):
    events = StoreEvents(tmp_path / "data" / "state.db")
    add_plugin(monkeypatch, "events", events)
    up = Upstream(resource_dump=False, change_dump=False)
    up.create("a.txt", b"a")
    up.create("b.txt", b"b")
    async with up.serving() as base:
        cfg = make_config(tmp_path / "data", base)
        await ok(cfg)
        assert events.deleted == []
        up.delete("b.txt")
        up.update("a.txt", b"a v2")
        await ok(cfg)
        assert events.deleted == [("up", "up", up.url("b.txt"), True)]  # the tombstone is committed
        await ok(cfg)
        assert len(events.deleted) == 1


async def test_hook_rsagg_change_published(tmp_path: Path, monkeypatch):
    events = StoreEvents(tmp_path / "data" / "state.db")
    add_plugin(monkeypatch, "events", events)
    up = Upstream(resource_dump=False, change_dump=False)
    up.bulk_create(3)
    async with up.serving() as base:
        cfg = make_config(tmp_path / "data", base)
        await ok(cfg)
        up.update("r000000.txt", b"v2")
        up.delete("r000001.txt")
        await ok(cfg)
    with State(cfg.store_path / "state.db", readonly=True) as st:
        names = {s.id: s.name for s in st.sets()}
        log = list(st.iter_changelog())
    assert len(log) == 5
    # one call per record appended, in changelog order, each readable when the hook ran
    assert events.published == [
        (names[r.set_id], r.seq, r.uri, r.change, r.datetime, (r.seq, r.uri, r.change)) for r in log
    ]


# ---------------------------------------------------------------------------------------------------
# startup and shutdown: real processes with the installed example plugin


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_config(folder: Path, upstream: str) -> Path:
    folder.mkdir(parents=True)
    port = _free_port()
    path = folder / "rsagg.toml"
    path.write_text(
        f'[server]\nlisten = "127.0.0.1:{port}"\nbase_url = "http://127.0.0.1:{port}"\n'
        '[store]\npath = "data"\n'
        "[harvest]\nretries = 2\nbackoff_base = 0.01\nbackoff_max = 0.05\ntimeout = 10\n"
        "[notifications]\nenabled = false\n"
        f'[plugins.example]\nevents_file = "{folder / "events.jsonl"}"\n'
        f'[[sources]]\nname = "up"\nurl = "{upstream}"\n'
    )
    return path


def _events(config: Path) -> list[dict]:
    path = config.parent / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def _rsagg(*args: str, log: Path, **kw: Any) -> trio.Process:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    with log.open("ab") as out:
        return await trio.lowlevel.open_process(
            [sys.executable, "-m", "aggregator", *args], env=env, stdout=out, stderr=out, **kw
        )


async def _one_shot(config: Path) -> list[dict]:
    """``rsagg harvest --once``: its events, once it has exited."""
    proc = await _rsagg("harvest", "--once", "-c", str(config), log=config.parent / "out.log")
    assert await proc.wait() == 0, (config.parent / "out.log").read_text()
    return _events(config)


async def _daemon(config: Path) -> list[dict]:
    """``rsagg run`` until it has harvested, then SIGTERM (as systemd stops it): its events."""
    proc = await _rsagg("run", "-c", str(config), log=config.parent / "out.log")
    try:
        db = config.parent / "data" / "state.db"
        while True:
            row = None
            if db.exists():  # (a reader must not create it)
                try:
                    with State(db, readonly=True) as st:
                        row = st.source("up")
                except (RuntimeError, sqlite3.Error):  # created but not migrated yet
                    pass
            if row is not None and row.last_success:
                break
            assert proc.poll() is None, (config.parent / "out.log").read_text()
            await trio.sleep(0.05)
        during = _events(config)  # the daemon is running: started, not shut down
        proc.send_signal(signal.SIGTERM)
        assert await proc.wait() == 0, (config.parent / "out.log").read_text()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert "shutdown" not in [e["event"] for e in during], during
    assert "startup" in [e["event"] for e in during], during
    return _events(config)


#: (kind, config file, events) of both runs: computed by whichever of the two tests runs first.
_LIFECYCLE: list[tuple[str, Path, list[dict]]] = []


async def _startup_and_shutdown(
    tmp_path_factory: pytest.TempPathFactory,
) -> list[tuple[str, Path, list[dict]]]:
    """A one-shot harvest and the daemon, run side by side against one Upstream (once per session)."""
    if _LIFECYCLE:
        return _LIFECYCLE
    folder = tmp_path_factory.mktemp("lifecycle")
    up = Upstream(resource_dump=False, change_dump=False)
    up.bulk_create(3)
    out: dict[str, list[dict]] = {}
    with trio.fail_after(GUARD):
        async with up.serving() as base:
            configs = {kind: _write_config(folder / kind, base) for kind in ("once", "run")}

            async def run(kind: str) -> None:
                out[kind] = await (_one_shot if kind == "once" else _daemon)(configs[kind])

            async with trio.open_nursery() as nursery:
                for kind in configs:
                    nursery.start_soon(run, kind)
    _LIFECYCLE[:] = [(kind, configs[kind], out[kind]) for kind in configs]
    return _LIFECYCLE


async def test_hook_rsagg_startup(tmp_path_factory: pytest.TempPathFactory):
    for kind, config, events in await _startup_and_shutdown(tmp_path_factory):
        starts = [e for e in events if e["event"] == "startup"]
        assert len(starts) == 1, (kind, events)
        assert events[0] == starts[0], f"{kind}: startup is the first event"
        assert starts[0]["config"] == str(config), kind  # it gets the configuration


async def test_hook_rsagg_shutdown(tmp_path_factory: pytest.TempPathFactory):
    for kind, _, events in await _startup_and_shutdown(tmp_path_factory):
        assert [e["event"] for e in events].count("shutdown") == 1, (kind, events)
        assert events[-1]["event"] == "shutdown", f"{kind}: shutdown is the last event"


async def test_publish_filter_reaches_dump_packages(tmp_path: Path, monkeypatch):
    """A hidden resource must not ship inside the Resource Dump or the Change Dump packages either."""
    import zipfile

    from aggregator.publish.schedule import build_due
    from aggregator.run.compose import open_context

    add_plugin(monkeypatch, "hide", HideSecrets())
    up = Upstream(resource_dump=False, change_dump=False)
    up.create("open.txt", b"open")
    up.create("secret.txt", b"top secret bytes")
    up.create("open2.txt", b"open two")
    async with up.serving() as base:
        cfg = make_config(tmp_path / "data", base, publish={"dump_interval": 3600, "changelist_size": 2})
        await ok(cfg)
    assert len(held(cfg)) == 3
    async with open_context(cfg) as ctx:
        builder = open_dump_builder(ctx.config, ctx.blobs, ctx.plugins)
        assert builder is not None
        assert await trio.to_thread.run_sync(lambda: build_due(builder, resource_dumps=True)) >= 2
        with sqlite3.connect(cfg.store_path / "state.db") as c:
            rows = c.execute("SELECT kind, sha256 FROM publish_dumps").fetchall()
        assert {kind for kind, _ in rows} == {"resourcedump", "changedump"}
        for kind, sha in rows:
            with ctx.blobs.open(sha) as f, zipfile.ZipFile(f) as zf:
                manifest = zf.read("manifest.xml")
                assert b"secret" not in manifest, kind
                assert all(zf.read(n) != b"top secret bytes" for n in zf.namelist()), kind
                assert b"open.txt" in manifest or b"open2.txt" in manifest, kind
