"""The harvester end to end against a real HTTP upstream (aggregator.testing.upstream) on 127.0.0.1."""

from __future__ import annotations

import hashlib
from pathlib import Path

from aggregator.store.blobs import FileBlobStore
from aggregator.testing.upstream import StepClock, Upstream, canonical_json

from .harvesting import audit, changelog, harvest, held, make_config
from .httpserver import serve_app


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def expected_store(up: Upstream) -> dict[str, str]:
    return {up.url(p): v.sha256 for p, v in up.resources().items()}


async def test_baseline_then_incremental_in_sync(tmp_path: Path):
    up = Upstream(changes_per_list=7, resource_dump=False, change_dump=False)
    up.bulk_create(120)
    async with up.serving() as base:
        cfg = make_config(tmp_path / "data", {"up": f"{base}/.well-known/resourcesync"})
        result = (await harvest(cfg))["up"]
        assert result.ok, result.error
        assert result.baselines == 1
        assert held(cfg) == expected_store(up)
        assert await audit(cfg) == []
        log = changelog(cfg)
        assert len(log) == 120 and {c for _, c, _ in log} == {"created"}

        # Upstream changes: updates, deletions, creations spread over several closed lists + the open one.
        for i in range(10):
            up.update(f"r{i:06d}.txt", f"new content {i}".encode())
        for i in range(10, 15):
            up.delete(f"r{i:06d}.txt")
        for i in range(5):
            up.create(f"new{i}.txt", f"fresh {i}".encode())
        up.update("r000000.txt", b"second update")
        assert len(up.change_lists()) >= 3
        result = (await harvest(cfg))["up"]
        assert result.ok, result.error
        assert result.baselines == 0
        assert held(cfg) == expected_store(up)
        assert await audit(cfg) == []
        new = changelog(cfg)[120:]
        assert sorted(c for _, c, _ in new).count("deleted") == 5
        assert sorted(c for _, c, _ in new).count("created") == 5
        # r0 updated twice upstream: the first (stale) entry cannot verify; the second supersedes it.
        assert sum(1 for u, c, _ in new if c == "updated") in (10, 11)

        # Nothing new upstream: a third harvest applies nothing (no change applied twice).
        before = changelog(cfg)
        up.reset_counts()
        result = (await harvest(cfg))["up"]
        assert result.ok and changelog(cfg) == before
        assert not any("/res/" in p for p in up.counts), "no resource refetched"


async def test_resource_list_index_and_dump_baselines(tmp_path: Path):
    up = Upstream(resourcelist_page_size=40)
    up.bulk_create(130)
    async with up.serving() as base:
        # From the Resource Dump (advertised, preferred): resources are not fetched one by one.
        cfg = make_config(tmp_path / "dump", {"up": base})
        up.reset_counts()
        assert (await harvest(cfg))["up"].ok
        assert held(cfg) == expected_store(up)
        assert not any("/res/" in p for p in up.counts)
        assert await audit(cfg) == []
        # From the Resource List Index (dumps off): every part read.
        cfg2 = make_config(tmp_path / "list", {"up": base}, use_dumps=False)
        up.reset_counts()
        assert (await harvest(cfg2))["up"].ok
        assert held(cfg2) == expected_store(up)
        assert sum(1 for p in up.counts if "resourcelist-" in p) == 4


async def test_hostile_dump_falls_back_and_writes_nothing_outside(tmp_path: Path):
    up = Upstream(hostile_dump="traversal")
    up.bulk_create(20)
    before = sorted(p for p in tmp_path.rglob("*"))
    async with up.serving() as base:
        cfg = make_config(tmp_path / "data", {"up": base})
        r = (await harvest(cfg))["up"]
        assert r.ok, r.error
        assert held(cfg) == expected_store(up)
    outside = [p for p in tmp_path.rglob("*") if p not in before and tmp_path / "data" not in p.parents]
    assert outside == [tmp_path / "data"]


async def test_hash_mismatch_is_rejected_and_reported(tmp_path: Path):
    up = Upstream(wrong_hash={"r000003.txt"}, resource_dump=False)
    up.bulk_create(10)
    async with up.serving() as base:
        cfg = make_config(tmp_path / "data", {"up": base})
        r = (await harvest(cfg))["up"]
        assert not r.ok
        assert [f.uri for f in r.failures] == [up.url("r000003.txt")]
        assert r.failures[0].kind == "fixity"
        assert "r000003.txt" in r.error
        store = held(cfg)
        assert up.url("r000003.txt") not in store and len(store) == 9
        blobs = FileBlobStore(cfg.store_path / "blobs")
        assert not blobs.exists(up.resources()["r000003.txt"].sha256)
        assert [(d.kind, d.uri) for d in await audit(cfg)] == [("missing", up.url("r000003.txt"))]


async def test_mirrors_patches_and_retry_after(tmp_path: Path):
    up = Upstream(mirror="broken", json_patches=True, resource_dump=False, change_dump=False)
    for i in range(5):
        up.create(f"d{i}.json", canonical_json({"n": i, "tags": ["a"]}), "application/json")
    async with up.serving() as base:
        cfg = make_config(tmp_path / "data", {"up": base})
        # Broken mirror first (lower pri), then loc: every resource still arrives intact.
        assert (await harvest(cfg))["up"].ok
        assert held(cfg) == expected_store(up)
        # JSON Patch updates: applied to the stored version, verified, no fetch of the resource itself.
        for i in range(5):
            up.patch_json(f"d{i}.json", {"n": i, "tags": ["a", "b"]})
        up.mirror = None
        up.serve_503 = {"/default/patch/6.json": 2}
        up.reset_counts()
        r = (await harvest(cfg))["up"]
        assert r.ok, r.error
        assert held(cfg) == expected_store(up)
        assert not any("/res/d" in p for p in up.counts), up.counts
        assert up.counts["/default/patch/6.json"] == 3  # two 503s with Retry-After, then success
        assert await audit(cfg) == []


async def test_gap_is_recovered_by_a_fresh_baseline(tmp_path: Path):
    up = Upstream(changes_per_list=3, resource_dump=False, change_dump=False)
    up.bulk_create(10)
    async with up.serving() as base:
        cfg = make_config(tmp_path / "data", {"up": base})
        assert (await harvest(cfg))["up"].ok
        for i in range(9):
            up.update(f"r{i:06d}.txt", f"v2 {i}".encode())
        up.drop_oldest_changelists = 4  # the Source pruned the lists we still needed
        r = (await harvest(cfg))["up"]
        assert r.ok, r.error
        assert r.gaps == 1 and r.baselines == 1
        assert held(cfg) == expected_store(up)
        assert await audit(cfg) == []


async def test_audit_reports_differences(tmp_path: Path):
    up = Upstream(resource_dump=False)
    up.bulk_create(6)
    async with up.serving() as base:
        cfg = make_config(tmp_path / "data", {"up": base})
        assert (await harvest(cfg))["up"].ok
        up.change_list = False  # audit must compare with the list itself now
        up.update("r000001.txt", b"resource r000001.TXT\n")  # same length: the hash must tell
        up.delete("r000002.txt")
        up.create("r9.txt", b"new")
        kinds = sorted((d.kind, d.uri.rsplit("/", 1)[1]) for d in await audit(cfg))
        assert kinds == [("extra", "r000002.txt"), ("hash", "r000001.txt"), ("missing", "r9.txt")]


def recording(app, statuses: list[tuple[str, int]]):
    """Wrap an ASGI app to record (path, status) of every response."""

    async def wrapped(scope, receive, send):
        async def send_and_record(message):
            if message["type"] == "http.response.start":
                statuses.append((scope["path"], message["status"]))
            await send(message)

        await app(scope, receive, send_and_record)

    return wrapped


async def test_conditional_get_skips_unchanged_documents(tmp_path: Path):
    """The open Change List, and the Resource List of a list-only set, are fetched conditionally;
    their ETag is remembered only after the changes read with them are applied."""
    up = Upstream(resource_dump=False, change_dump=False)
    up.bulk_create(5)
    statuses: list[tuple[str, int]] = []
    async with serve_app(recording(up.app(), statuses)) as base:
        up.public_url = base
        cfg = make_config(tmp_path / "data", {"up": base})
        assert (await harvest(cfg))["up"].ok
        up.update("r000001.txt", b"v2")
        assert (await harvest(cfg))["up"].ok  # reads the open list, then remembers its ETag
        before, statuses[:] = changelog(cfg), []
        assert (await harvest(cfg))["up"].ok
        assert changelog(cfg) == before
        assert ("/default/changelist.xml", 304) in statuses
        # A change after the 304: the list's ETag changes, and the change arrives.
        up.update("r000002.txt", b"v2 of r2")
        assert (await harvest(cfg))["up"].ok
        assert held(cfg) == expected_store(up)

        # A set without Change List: its Resource List is fetched conditionally on every poll.
        up.change_list = False
        cfg2 = make_config(tmp_path / "list-only", {"up": base}, use_dumps=False)
        assert (await harvest(cfg2))["up"].ok
        before, statuses[:] = changelog(cfg2), []
        r = (await harvest(cfg2))["up"]
        assert r.ok and r.baselines == 0 and changelog(cfg2) == before
        assert ("/default/resourcelist.xml", 304) in statuses
        up.delete("r000003.txt")
        r = (await harvest(cfg2))["up"]
        assert r.ok and r.baselines == 1
        assert held(cfg2) == expected_store(up)


async def test_change_dumps_used_to_catch_up(tmp_path: Path):
    """Many changes in closed intervals arrive through Change Dump packages, not one GET each."""
    # A step clock: the dump-or-lists decision weighs time intervals, which must not depend on load.
    up = Upstream(changes_per_list=10, resource_dump=False, clock=StepClock())
    up.bulk_create(20)
    async with up.serving() as base:
        cfg = make_config(tmp_path / "data", {"up": base})
        assert (await harvest(cfg))["up"].ok
        for round_ in range(3):
            for i in range(10):
                up.update(f"r{i:06d}.txt", f"round {round_} of {i}".encode())
        up.delete("r000019.txt")
        up.create("late.txt", b"in the open list")
        up.reset_counts()
        r = (await harvest(cfg))["up"]
        assert r.ok, r.error
        assert any(p.endswith(".zip") for p in up.counts), up.counts
        fetched = [p for p in up.counts if "/res/" in p]
        assert len(fetched) <= 2, fetched  # only what the open list adds, not the 30 dumped updates
        assert held(cfg) == expected_store(up)
        assert await audit(cfg) == []
        # Nothing applied twice: each URI's last logged sha is the upstream's, and a rerun adds nothing.
        before = changelog(cfg)
        assert (await harvest(cfg))["up"].ok and changelog(cfg) == before


async def test_failed_changes_are_retried_at_the_next_sync(tmp_path: Path):
    """The cursor moves past a change whose fetch failed; the change itself waits and is retried."""
    up = Upstream(resource_dump=False, change_dump=False)
    up.bulk_create(5)
    async with up.serving() as base:
        cfg = make_config(tmp_path / "data", {"up": base})  # 2 retries per request
        assert (await harvest(cfg))["up"].ok
        up.update("r000001.txt", b"version two")
        up.serve_503 = {"/default/res/r000001.txt": 3}  # outlasts the retries of this run
        r = (await harvest(cfg))["up"]
        assert not r.ok and [(f.uri, f.kind) for f in r.failures] == [(up.url("r000001.txt"), "http")]
        assert held(cfg)[up.url("r000001.txt")] != up.resources()["r000001.txt"].sha256
        # No new change upstream: the failed one is retried from the list of failures, and applies.
        r = (await harvest(cfg))["up"]
        assert r.ok, r.error
        assert held(cfg) == expected_store(up)
        assert await audit(cfg) == []
        r = (await harvest(cfg))["up"]  # nothing left to retry
        assert r.ok and sum(s.seen for s in r.stats) == 0


async def test_a_baseline_ends_the_retries_of_resources_it_no_longer_lists(tmp_path: Path):
    """A change whose fetch failed waits to be retried. When a gap forces a baseline whose snapshot no
    longer lists the resource (its deletion was among the changes the gap lost), that retry is over:
    retrying it would fail (404) at every sync from then on, and the source would never be ok again."""
    up = Upstream(changes_per_list=3, resource_dump=False, change_dump=False)
    up.bulk_create(5)
    async with up.serving() as base:
        cfg = make_config(tmp_path / "data", {"up": base})
        assert (await harvest(cfg))["up"].ok
        up.create("brief.txt", b"here for a moment")
        up.serve_503 = {"/default/res/brief.txt": 3}  # outlasts the retries of this run
        r = (await harvest(cfg))["up"]
        assert not r.ok and [f.uri for f in r.failures] == [up.url("brief.txt")]
        up.delete("brief.txt")
        for i in range(5):
            up.update(f"r{i:06d}.txt", f"v2 {i}".encode())
        up.drop_oldest_changelists = 3  # up to the list with the deletion: gone
        r = (await harvest(cfg))["up"]
        assert r.gaps == 1 and r.baselines == 1
        assert r.ok, r.error
        assert held(cfg) == expected_store(up)
        assert await audit(cfg) == []
        r = (await harvest(cfg))["up"]  # nothing left to retry
        assert r.ok and sum(s.seen for s in r.stats) == 0, r.error
