"""Prior versions in (§14.6): every version an upstream describes with a memento link enters rsagg's history.

End to end: an upstream changes a resource three times between two polls; after one harvest rsagg's
changelog holds the three versions byte for byte, its Change List lists them, and resync mirrors rsagg
as before. A generated table decides each way a memento can misbehave, and the pipeline keeps its
changelog going forward whatever order the entries come in.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncGenerator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from aggregator.harvest.context import open_blob_store
from aggregator.harvest.deviations import Deviations, collecting
from aggregator.harvest.pipeline import Pipeline, Work
from aggregator.harvest.versions import RecentVersions, memento_expected
from aggregator.plugins.manager import Plugins
from aggregator.publish.uris import rsagg_uri
from aggregator.rs.model import DELETED, Entry, Link, Md
from aggregator.rs.parse import parse_bytes
from aggregator.run.compose import open_context
from aggregator.store.open import open_state
from aggregator.testing.upstream import Upstream

from .harvesting import harvest, make_config
from .test_publish import expected_files, get_doc, local_files, publishing, resync

NAME = "up"


def versions_of(cfg, uri: str) -> list[tuple[str, str | None]]:
    """(change, sha256) of every changelog record of ``uri``, in order."""
    with open_state(cfg) as state:
        return [(r.change, r.sha256) for r in state.iter_changelog() if r.uri == uri]


def blob_bytes(cfg, sha256: str) -> bytes:
    with open_blob_store(cfg, Plugins.from_config(cfg)) as store, store.open(sha256) as f:
        return f.read()


async def test_three_changes_between_polls_all_reach_the_history(tmp_path: Path):
    up = Upstream(mementos=True, resource_dump=False, change_dump=False)
    up.create("a.txt", b"version zero\n")
    up.create("b.txt", b"left alone\n")
    async with up.serving() as ubase:
        cfg = make_config(tmp_path / "data", {NAME: ubase})
        assert (await harvest(cfg))[NAME].ok
        async with publishing(cfg) as (base, client):
            dest, cwd = tmp_path / "dest", tmp_path / "cwd"
            cwd.mkdir()
            out = await resync("--baseline", "--delete", base, str(dest), cwd=cwd)
            assert local_files(dest) == expected_files(up, base), out

            bodies = [b"version one\n", b"version two, longer\n", b"version three\n"]
            for body in bodies:
                up.update("a.txt", body)
            up.reset_counts()
            result = (await harvest(cfg))[NAME]
            assert result.ok, result.error

            # rsagg's history: the three versions, in order, each its own record, byte for byte.
            uri = up.url("a.txt")
            logged = versions_of(cfg, uri)
            assert [c for c, _ in logged] == ["created", "updated", "updated", "updated"]
            assert [blob_bytes(cfg, sha) for _, sha in logged[1:]] == bodies
            # Each version came from its own memento, none from the time-generic <loc>.
            assert up.counts["/default/res/a.txt"] == 0
            assert sum(n for p, n in up.counts.items() if p.startswith("/default/memento/")) == 3

            # rsagg's republished Change List lists the three changes with their hashes.
            head, entries = await get_doc(client, f"{base}/{NAME}/changelist.xml")
            if head.is_index:
                head, entries = await get_doc(client, entries[-1].loc)
            ours = rsagg_uri(base, NAME, uri)
            changes = [e for e in entries if e.loc == ours and e.md and e.md.change == "updated"]
            assert [e.hashes.get("sha-256") for e in changes] == [sha for _, sha in logged[1:]]
            # Each version was its own transaction: its own datetime on rsagg's clock, in order.
            times = [e.md.datetime for e in changes]  # type: ignore[union-attr]
            assert all(a < b for a, b in itertools.pairwise(times)), times
            # Upstream timegate/timemap links are republished as they were (publish/links.py).
            assert {ln.rel for ln in changes[-1].links} >= {"timegate", "timemap"}

            # resync mirroring rsagg is unaffected by the new links and versions.
            out = await resync(
                "--incremental", "--delete", "--changelist-uri", f"{base}/{NAME}/changelist.xml",
                base, str(dest), cwd=cwd,
            )  # fmt: skip
            assert "CHANGES APPLIED" in out, out
            assert local_files(dest) == expected_files(up, base)
            out = await resync("--audit", "--hash", "md5", base, str(dest), cwd=cwd)
            assert "IN SYNC" in out and "NOT IN SYNC" not in out, out


async def test_without_mementos_only_the_last_version_arrives(tmp_path: Path):
    """The control: the same story without memento links keeps only the last version (what §14.6 fixes)."""
    up = Upstream(resource_dump=False, change_dump=False)
    up.create("a.txt", b"version zero\n")
    async with up.serving() as ubase:
        cfg = make_config(tmp_path / "data", {NAME: ubase})
        assert (await harvest(cfg))[NAME].ok
        for body in (b"one\n", b"two\n", b"three\n"):
            up.update("a.txt", body)
        await harvest(cfg)
        logged = versions_of(cfg, up.url("a.txt"))
        assert [blob_bytes(cfg, sha) for _, sha in logged] == [b"version zero\n", b"three\n"]


# ---------------------------------------------------------------------------------------------------
# the class: every way a memento may misbehave, generated, against one rule each

FAULTS = [None, "missing", "corrupt", "nohash", "redirect", "redirect-current", "elsewhere"]
#: Faults after which the memento still yields the version it names.
USABLE = {None, "redirect", "nohash"}


def expected_outcome(fault: str | None, entry_hash_wrong: bool, updates: int) -> tuple[int, int, set[str]]:
    """The rule (harvest/versions.py): (versions logged, versions lost, deviation rules seen)."""
    rules: set[str] = set()
    # A link without a hash inherits the entry's (§14.6): wrong there, wrong for the memento too.
    memento_ok = fault in USABLE and not (fault == "nohash" and entry_hash_wrong)
    if memento_ok:
        if entry_hash_wrong and fault != "nohash":
            rules.add("memento-hash-differs")
        return updates, 0, rules
    if fault == "nohash":
        pass  # the inherited hash is the entry's own: no contradiction to note
    elif entry_hash_wrong:
        rules.add("memento-hash-differs")
    if fault == "redirect-current":  # the current version is what <loc> serves: its memento is good
        return 1, updates - 1, rules
    if entry_hash_wrong:  # <loc> cannot be proved to serve any of them
        return 0, updates, rules
    rules.add("memento-unavailable")  # the last one, from <loc>, its hash checked
    return 1, updates - 1, rules


CASES = list(itertools.product(FAULTS, [False, True], [1, 3]))


async def test_each_memento_fault_follows_its_rule(tmp_path: Path):
    up = Upstream(mementos=True, resource_dump=False, change_dump=False)
    paths = {case: f"r-{case[0]}-{int(case[1])}-{case[2]}.txt" for case in CASES}
    for path in paths.values():
        up.create(path, b"baseline of " + path.encode())
    async with up.serving() as ubase:
        cfg = make_config(tmp_path / "data", {NAME: ubase})
        assert (await harvest(cfg))[NAME].ok
        for (fault, wrong, updates), path in paths.items():
            if fault is not None:
                up.memento_faults[path] = fault  # type: ignore[assignment]
            if wrong:
                up.wrong_hash.add(path)
            for i in range(updates):
                up.update(path, f"{path} version {i + 1}\n".encode())
        result = (await harvest(cfg))[NAME]
        lost_by_uri: dict[str, int] = {}
        for f in result.failures:
            lost_by_uri[f.uri] = lost_by_uri.get(f.uri, 0) + 1
        seen_rules = {n["rule"] for n in result.deviations}
        all_rules: set[str] = set()
        for (fault, wrong, updates), path in paths.items():
            uri = up.url(path)
            logged, lost, rules = expected_outcome(fault, wrong, updates)
            all_rules |= rules
            records = versions_of(cfg, uri)[1:]
            got = [blob_bytes(cfg, sha) for _, sha in records]
            want = [f"{path} version {i + 1}\n".encode() for i in range(updates)][updates - logged :]
            assert got == want, (fault, wrong, updates)
            assert lost_by_uri.get(uri, 0) == lost, (fault, wrong, updates, result.failures)
        assert all_rules <= seen_rules, seen_rules
        # Never "ok" while a version the Source offered was skipped.
        assert not result.ok and "lost" in (result.error or "")


def test_a_link_hash_is_the_mementos_own():
    """§7: the link's attributes pertain to the linked resource; without a hash it inherits the entry's."""
    entry = Entry("http://x/a", md=Md(hash="md5:" + "1" * 32, length=5))
    own = Link("memento", "http://x/m", hash="md5:" + "2" * 32, length=7)
    assert memento_expected(entry, own).hashes == {"md5": "2" * 32}
    assert memento_expected(entry, own).length == 7
    bare = Link("memento", "http://x/m")
    assert memento_expected(entry, bare).hashes == {"md5": "1" * 32}
    assert memento_expected(entry, bare).length == 5


# ---------------------------------------------------------------------------------------------------
# order: the changelog only goes forward


def test_recent_versions_window_is_bounded_and_forward():
    from datetime import UTC, datetime, timedelta

    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    window = RecentVersions(2)
    assert window.admit("a", t0 + timedelta(1))
    assert not window.admit("a", t0)  # older than one admitted: refused
    assert window.admit("a", t0 + timedelta(1))  # the same time again: a repeat, the state no-ops it
    assert window.admit("b", t0) and window.admit("c", t0)
    assert window.admit("a", t0)  # "a" left the window: the stored row decides from here


async def _change_entries(up: Upstream, client: httpx.AsyncClient) -> list[Entry]:
    r = await client.get(up.doc_url("changelist.xml"))
    return parse_bytes(r.content, str(r.url))[1]


async def test_repeated_replayed_and_deleted_mementos(tmp_path: Path):
    up = Upstream(mementos=True, resource_dump=False, change_dump=False)
    up.create("a.txt", b"v0\n")
    up.create("gone.txt", b"soon gone\n")
    async with up.serving() as ubase, httpx.AsyncClient() as client:
        cfg = make_config(tmp_path / "data", {NAME: ubase})
        assert (await harvest(cfg))[NAME].ok
        up.update("a.txt", b"v1\n")
        up.update("a.txt", b"v2\n")
        listed = await _change_entries(up, client)
        entries = [e for e in listed if e.loc == up.url("a.txt")]
        born = next(e for e in listed if e.loc == up.url("gone.txt"))
        v1, v2 = entries[-2], entries[-1]
        gone = Entry(
            up.url("gone.txt"),
            md=Md(change=DELETED, datetime=v2.md.datetime),  # type: ignore[union-attr]
            links=[replace(v1.links[0], href=ubase + "/default/memento/unused/gone.txt")],
        )
        up.reset_counts()
        deviations = Deviations(NAME)
        async with open_context(cfg) as ctx:
            set_id = (await ctx.read(ctx.reader.sets))[0].id

            async def items(*listed: Entry) -> AsyncGenerator[Work, None]:
                for e in listed:
                    yield Work(e, e.md.change or "")  # type: ignore[union-attr]

            with collecting(deviations):
                # v1 twice in order, v2, v1 replayed after it, and a deletion with a memento link.
                stats = await Pipeline(ctx, set_id, NAME).run(items(v1, v1, v2, v1, gone))
                assert not stats.failures
                # A later run replays v1, and the creation of what was deleted since: the stored rows
                # are newer, nothing is fetched and nothing revives.
                before = sum(up.counts.values())
                await Pipeline(ctx, set_id, NAME).run(items(v1, born))
                assert sum(up.counts.values()) == before
        logged = versions_of(cfg, up.url("a.txt"))
        assert [blob_bytes(cfg, sha) for _, sha in logged] == [b"v0\n", b"v1\n", b"v2\n"]
        assert versions_of(cfg, up.url("gone.txt"))[-1] == ("deleted", None)
        assert not any("/memento/unused/" in p for p in up.counts)  # a deletion's memento: not fetched
        assert {"version-out-of-order", "memento-on-deletion"} <= set(deviations.notes)
        assert deviations.notes["version-out-of-order"].count == 3


@pytest.mark.parametrize("fault", ["missing", "corrupt"])
async def test_a_lost_intermediate_version_is_a_failure_not_ok(tmp_path: Path, fault: str):
    """The memento of an intermediate version fails while the current one works: the last version is
    applied, and the lost one is a failure of the sync that a later change does not supersede."""
    up = Upstream(mementos=True, resource_dump=False, change_dump=False)
    up.create("a.txt", b"v0\n")
    async with up.serving() as ubase:
        cfg = make_config(tmp_path / "data", {NAME: ubase})
        assert (await harvest(cfg))[NAME].ok
        up.memento_faults["a.txt"] = fault  # type: ignore[assignment]
        up.update("a.txt", b"v1\n")
        up.update("a.txt", b"v2\n")
        result = (await harvest(cfg))[NAME]
        assert not result.ok
        assert len(result.failures) == 1 and "lost" in result.failures[0].message
        logged = versions_of(cfg, up.url("a.txt"))
        assert [blob_bytes(cfg, sha) for _, sha in logged] == [b"v0\n", b"v2\n"]
        # The next sync has nothing new: it is ok again (the loss was said once, by the sync that met it).
        assert (await harvest(cfg))[NAME].ok


async def test_a_crash_between_versions_applies_none_twice(tmp_path: Path, monkeypatch):
    """Each version is its own batch here; the run dies before the second one's transaction. The restart
    reads on from the cursor that moved with the first: every version once, in order."""
    from aggregator.store.state import State

    up = Upstream(mementos=True, resource_dump=False, change_dump=False)
    up.create("a.txt", b"v0\n")
    async with up.serving() as ubase:
        cfg = make_config(tmp_path / "data", {NAME: ubase}, batch_size=1)
        assert (await harvest(cfg))[NAME].ok
        for body in (b"v1\n", b"v2\n", b"v3\n"):
            up.update("a.txt", body)
        real = State.apply
        calls = {"n": 0}

        def dying(self, set_id, changes, cursor=None, retries=None, validators=()):  # type: ignore[no-untyped-def]
            if changes:
                calls["n"] += 1
                if calls["n"] == 2:
                    raise RuntimeError("the process died here")
            return real(self, set_id, changes, cursor, retries, validators)

        monkeypatch.setattr(State, "apply", dying)
        assert not (await harvest(cfg))[NAME].ok
        assert [blob_bytes(cfg, sha) for _, sha in versions_of(cfg, up.url("a.txt"))] == [b"v0\n", b"v1\n"]
        monkeypatch.setattr(State, "apply", real)
        assert (await harvest(cfg))[NAME].ok
        logged = versions_of(cfg, up.url("a.txt"))
        assert [blob_bytes(cfg, sha) for _, sha in logged] == [b"v0\n", b"v1\n", b"v2\n", b"v3\n"]


async def test_a_notification_brings_each_version_too(tmp_path: Path):
    """A change notification's entries (Notification §4) carry the same memento links: the same rule."""
    from aggregator.harvest.notices import NotifiedHarvest

    up = Upstream(mementos=True, resource_dump=False, change_dump=False)
    up.create("a.txt", b"v0\n")
    async with up.serving() as ubase, httpx.AsyncClient() as client:
        cfg = make_config(tmp_path / "data", {NAME: ubase})
        up.reset_counts()
        assert (await harvest(cfg))[NAME].ok
        assert up.counts["/default/res/a.txt"] == 0  # the Resource List's version came from its memento
        for body in (b"v1\n", b"v2\n", b"v3\n"):
            up.update("a.txt", body)
        notice = [e for e in await _change_entries(up, client) if e.loc == up.url("a.txt")][-3:]
        async with open_context(cfg) as ctx:
            set_id = (await ctx.read(ctx.reader.sets))[0].id
            cursor = await ctx.read(ctx.reader.cursor, set_id)
            done = await NotifiedHarvest(ctx).apply_notice(
                cfg.sources[0],
                up.doc_url("capabilitylist.xml"),
                ubase + "/topic",
                cursor.last_datetime,
                notice,
            )
        assert done == (3, 3)
        logged = versions_of(cfg, up.url("a.txt"))
        assert [blob_bytes(cfg, sha) for _, sha in logged] == [b"v0\n", b"v1\n", b"v2\n", b"v3\n"]


async def test_the_last_version_lost_is_retried_from_its_memento(tmp_path: Path):
    """A change whose memento fails and whose <loc> cannot prove the version waits in the retries; once
    the memento answers again the retry brings that version."""
    up = Upstream(mementos=True, resource_dump=False, change_dump=False)
    up.create("a.txt", b"v0\n")
    async with up.serving() as ubase:
        cfg = make_config(tmp_path / "data", {NAME: ubase})
        assert (await harvest(cfg))[NAME].ok
        up.memento_faults["a.txt"] = "missing"
        up.wrong_hash.add("a.txt")  # the entry's hash is wrong: <loc> cannot stand in
        up.update("a.txt", b"v1\n")
        assert not (await harvest(cfg))[NAME].ok
        assert [blob_bytes(cfg, sha) for _, sha in versions_of(cfg, up.url("a.txt"))] == [b"v0\n"]
        del up.memento_faults["a.txt"]
        assert (await harvest(cfg))[NAME].ok
        assert [blob_bytes(cfg, sha) for _, sha in versions_of(cfg, up.url("a.txt"))] == [b"v0\n", b"v1\n"]
