"""rsagg's own Resource Dumps and Change Dumps (§11, §13): aggregator/publish/dumps.py.

The store is filled directly (blobs, then State.apply), the packages are built, and then read back the way
a Destination would: by our own harvester's ``read_package`` (every item verified) and our validator.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import zipfile
from contextlib import aclosing
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette

from aggregator.harvest.dumps import DumpLimits, fetch_package, member_name, read_package
from aggregator.harvest.fetch import Fetcher
from aggregator.publish import documents
from aggregator.publish.dumps import DumpBuilder, DumpBuildError, PackageInfo, dump_routes, referenced_hashes
from aggregator.publish.links import LinkPolicy
from aggregator.publish.uris import rsagg_uri
from aggregator.rs.model import Link
from aggregator.rs.parse import parse_bytes
from aggregator.rs.validate import ERROR, validate_source
from aggregator.rs.write import iter_document_bytes
from aggregator.store.blobs import FileBlobStore
from aggregator.store.rows import Change
from aggregator.store.sets import PublishedSet
from aggregator.store.state import State

from .httpserver import serve_app
from .test_publish import VERSION_RELS

BASE = "http://rsagg.test"
T0 = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC)


class Clock:
    """Moves one second per call: every changelog record and every snapshot time is distinct."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        self.now += timedelta(seconds=1)
        return self.now


class Env:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.clock = Clock()
        self.state = State(root / "state.db", clock=self.clock)
        self.blobs = FileBlobStore(root / "blobs")
        self.state.upsert_source("src", "https://up.example/.well-known/resourcesync")
        self.set_a = self.state.ensure_set("src", "https://up.example/a/capabilitylist.xml")
        self.set_b = self.state.ensure_set("src", "https://up.example/b/capabilitylist.xml")
        self.builders: list[DumpBuilder] = []

    def builder(self, **kw) -> DumpBuilder:
        kw.setdefault("base_url", BASE)
        b = DumpBuilder(self.state, self.blobs, clock=self.clock, **kw)
        self.builders.append(b)
        return b

    def put(self, set_id: int, uri: str, content: bytes, change: str = "created", type_: str = "text/plain"):
        info = self.blobs.put_bytes(content)
        md5 = hashlib.md5(content).hexdigest()
        ch = Change(
            uri, change, info.sha256, len(content), type_, hashes={"sha-256": info.sha256, "md5": md5}
        )
        return self.state.apply(set_id, [ch])

    def delete(self, set_id: int, uri: str):
        return self.state.apply(set_id, [Change(uri, "deleted")])

    def close(self) -> None:
        for b in self.builders:
            b.close()
        self.blobs.close()
        self.state.close()


@pytest.fixture
def env(tmp_path: Path):
    e = Env(tmp_path)
    yield e
    e.close()


def content(i: int) -> bytes:
    return f"resource number {i}\n".encode() * (i + 1)


def zip_path(env: Env, p: PackageInfo) -> Path:
    path = env.blobs.local_path(p.sha256)
    assert path is not None and path.is_file()
    return path


async def read_back(env: Env, p: PackageInfo, dest: FileBlobStore) -> list:
    """Every item of a package as our harvester yields it (verified against the manifest), committed."""
    items = []
    async with aclosing(read_package(zip_path(env, p), p.url, dest, limits=DumpLimits())) as it:
        async for item in it:
            items.append(item)
    dest.commit([i.blob for i in items if i.blob is not None])
    return items


def errors(data: bytes, url: str) -> list:
    return [i for i in validate_source(data, url) if i.severity == ERROR]


def manifest_of(env: Env, p: PackageInfo) -> bytes:
    with zipfile.ZipFile(zip_path(env, p)) as zf:
        return zf.read("manifest.xml")


def served(env: Env, sha: str) -> bytes:
    with env.blobs.open(sha) as f:
        return f.read()


# --- Resource Dumps ----------------------------------------------------------------------------------------


async def test_resource_dump_packages_are_read_back_verified_and_valid(env: Env, tmp_path: Path) -> None:
    uris = {f"https://up.example/a/res{i}.txt": content(i) for i in range(25)}
    for uri, data in uris.items():
        env.put(env.set_a, uri, data)
    env.put(env.set_b, "https://up.example/b/other.txt", b"from set b")
    b = env.builder(max_entries=10)

    packages = b.build_resource_dump("art", [env.set_a])

    assert [p.part for p in packages] == [1, 2, 3]
    assert [p.entries for p in packages] == [10, 10, 5]
    assert all(
        p.kind == "resourcedump" and p.url == f"{BASE}/art/resourcedump/{p.number}.zip" for p in packages
    )
    dest = FileBlobStore(tmp_path / "dest")
    got: dict[str, bytes] = {}
    paths: list[str] = []
    for p in packages:
        items = await read_back(env, p, dest)
        assert len(items) == p.entries
        for item in items:
            assert item.info is not None and item.entry.md is not None
            assert item.info.length == item.entry.md.length
            assert set(item.entry.hashes) == {
                "sha-256",
                "md5",
            }  # both announced, both verified by read_package
            paths.append(item.entry.md.path)
            with dest.open(item.info.sha256) as f:
                got[item.entry.loc] = f.read()
        manifest = manifest_of(env, p)
        assert served(env, p.manifest_sha256) == manifest  # the rel="contents" copy is the same bytes
        assert errors(manifest, p.manifest_url) == []
        head, entries = parse_bytes(manifest)
        assert head.capability == "resourcedump-manifest"
        assert head.md.at == p.at and head.md.completed == p.completed
        assert head.link("up").href == f"{BASE}/art/capabilitylist.xml"
    dest.close()
    assert len(paths) == len(set(paths)) == 25
    assert all(path.startswith("/resources/") for path in paths)
    expected = {rsagg_uri(BASE, "art", uri): data for uri, data in uris.items()}
    assert got == expected  # set b's resource is not in set a's dump

    doc_head, doc_entries = b.resource_dump_document("art")
    data = b"".join(iter_document_bytes(doc_head, doc_entries))
    assert errors(data, f"{BASE}/art/resourcedump.xml") == []
    head, entries = parse_bytes(data)
    assert head.capability == "resourcedump" and head.md.at == packages[0].at
    assert head.md.completed == packages[-1].completed
    assert [e.loc for e in entries] == [p.url for p in packages]
    for e, p in zip(entries, packages, strict=True):
        assert e.md.type == "application/zip" and e.md.length == p.length == zip_path(env, p).stat().st_size
        assert e.hashes == {"sha-256": p.sha256}
        assert [(ln.rel, ln.href) for ln in e.links] == [("contents", p.manifest_url)]
        assert p.manifest_url == f"{BASE}/art/resourcedump/{p.number}/manifest.xml"
    assert b.available("art") == {
        "resourcedump": f"{BASE}/art/resourcedump.xml",
        "resourcedump-archive": f"{BASE}/art/resourcedump-archive.xml",
    }


def test_packages_are_cut_by_bytes_and_a_big_resource_gets_its_own(env: Env) -> None:
    for i, size in enumerate([100, 100, 500, 100]):
        env.put(env.set_a, f"https://up.example/a/{i}", bytes([65 + i]) * size)
    b = env.builder(max_bytes=250)
    packages = b.build_resource_dump("art", [env.set_a])
    assert [(p.entries, p.bytes) for p in packages] == [(2, 200), (1, 500), (1, 100)]


def test_run_is_skipped_when_nothing_changed_and_old_runs_are_pruned(env: Env) -> None:
    env.put(env.set_a, "https://up.example/a/x", b"one")
    b = env.builder(keep=2)
    first = b.build_resource_dump("art", [env.set_a])
    assert len(first) == 1
    assert b.build_resource_dump("art", [env.set_a]) == []  # no change since: nothing built
    env.put(env.set_b, "https://up.example/b/y", b"other set")
    assert b.build_resource_dump("art", [env.set_a]) == []  # a change elsewhere does not count
    env.put(env.set_a, "https://up.example/a/x", b"two")
    second = b.build_resource_dump("art", [env.set_a])
    third = b.build_resource_dump("art", [env.set_a], force=True)
    assert len(second) == len(third) == 1
    # keep=2: the first run is gone (rows and blobs), the second is still downloadable
    assert b.package("art", "resourcedump", first[0].number) is None
    assert not env.blobs.exists(first[0].sha256) and not env.blobs.exists(first[0].manifest_sha256)
    assert b.package("art", "resourcedump", second[0].number) == second[0]
    assert env.blobs.exists(second[0].sha256)
    assert b.resource_dump_packages("art") == third
    refs = list(b.referenced_hashes())
    assert refs == sorted(refs) == list(referenced_hashes(env.state))  # what gc must keep
    assert set(refs) == {
        second[0].sha256,
        second[0].manifest_sha256,
        third[0].sha256,
        third[0].manifest_sha256,
    }


def test_pruning_keeps_a_blob_the_state_still_names(env: Env) -> None:
    env.put(env.set_a, "https://up.example/a/x", b"one")
    b = env.builder(keep=1)
    first = b.build_resource_dump("art", [env.set_a])[0]
    # Someone harvested our manifest as a resource (chained aggregation): its blob must survive pruning.
    env.put(env.set_b, "https://elsewhere.example/manifest.xml", served(env, first.manifest_sha256))
    env.put(env.set_a, "https://up.example/a/x", b"two")
    b.build_resource_dump("art", [env.set_a])
    assert b.package("art", "resourcedump", first.number) is None
    assert not env.blobs.exists(first.sha256)
    assert env.blobs.exists(first.manifest_sha256)


def test_emptied_set_gets_an_empty_resource_dump(env: Env) -> None:
    env.put(env.set_a, "https://up.example/a/x", b"one")
    b = env.builder()
    assert len(b.build_resource_dump("art", [env.set_a])) == 1
    env.delete(env.set_a, "https://up.example/a/x")
    assert b.build_resource_dump("art", [env.set_a]) == []
    head, entries = b.resource_dump_document("art")
    assert entries == [] and head.md.at is not None
    assert "resourcedump" in b.available("art")


def test_damaged_blob_fails_the_run_and_publishes_nothing(env: Env) -> None:
    env.put(env.set_a, "https://up.example/a/good", b"good bytes")
    [ch] = env.put(env.set_a, "https://up.example/a/bad", b"bad bytes!")
    key = bytes.fromhex(ch.sha256)  # a small blob: a row of small.db
    with sqlite3.connect(env.blobs.root / "small.db") as db:  # same length, other content
        db.execute("UPDATE blobs SET data = ? WHERE sha256 = ?", (b"BAD bytes!", key))
    b = env.builder(max_entries=1)
    with pytest.raises(DumpBuildError, match="damaged"):
        b.build_resource_dump("art", [env.set_a])
    assert b.resource_dump_packages("art") == [] and b.available("art") == {}
    assert [p.name for p in env.blobs.tmp.iterdir() if p.name != ".lock"] == []  # temp ZIPs aborted
    env.blobs.delete(ch.sha256)
    with pytest.raises(DumpBuildError, match="missing"):
        b.build_resource_dump("art", [env.set_a])


async def test_hostile_uris_give_safe_unique_member_paths(env: Env, tmp_path: Path) -> None:
    uris = [
        "https://up.example/a/../../etc/passwd",
        "https://up.example/a/..",
        "https://up.example/a/dir/",
        "https://up.example/a/dir",
        "https://up.example/a/x?q=1&r=/../2",
        "https://up.example/a/x?q=2",
        "https://up.example/a/caf%C3%A9%20cr%C3%A8me.txt",
        "https://up.example/a/C:\\windows\\evil",
        "https://up.example/a/.hidden",
        "https://up.example/a/" + "long" * 200,
    ]
    for i, uri in enumerate(uris):
        env.put(env.set_a, uri, f"content {i}".encode())
    b = env.builder()
    [p] = b.build_resource_dump("art", [env.set_a])
    dest = FileBlobStore(tmp_path / "dest")
    items = await read_back(env, p, dest)
    dest.close()
    paths = [i.entry.md.path for i in items]
    assert len(set(paths)) == len(uris)
    for path in paths:
        member_name(path)  # raises on anything unsafe
        assert len(path) < 140
    with zipfile.ZipFile(zip_path(env, p)) as zf:
        assert sorted(zf.namelist()) == sorted(["manifest.xml", *(path[1:] for path in paths)])


async def test_compression_stays_within_readers_ratio_caps(env: Env, tmp_path: Path) -> None:
    zeros = bytes(3 * 2**20)  # deflates ~1000:1; our reader refuses more than 200:1
    text = b"".join(f"line {i}: some fairly ordinary text\n".encode() for i in range(20_000))
    rnd = os.urandom(200_000)
    env.put(env.set_a, "https://up.example/a/zeros.bin", zeros, type_="application/octet-stream")
    env.put(env.set_a, "https://up.example/a/text.txt", text)
    env.put(env.set_a, "https://up.example/a/random.txt", rnd)
    env.put(env.set_a, "https://up.example/a/photo.jpg", b"\xff\xd8" * 5000, type_="image/jpeg")
    b = env.builder()
    [p] = b.build_resource_dump("art", [env.set_a])
    with zipfile.ZipFile(zip_path(env, p)) as zf:
        methods = {i.filename.rsplit("/", 1)[-1]: i.compress_type for i in zf.infolist()}
    assert methods["zeros.bin"] == zipfile.ZIP_STORED
    assert methods["text.txt"] == zipfile.ZIP_DEFLATED
    assert methods["random.txt"] == zipfile.ZIP_STORED  # incompressible: not worth it
    assert methods["photo.jpg"] == zipfile.ZIP_STORED  # already-compressed type
    assert methods["manifest.xml"] == zipfile.ZIP_DEFLATED
    dest = FileBlobStore(tmp_path / "dest")
    assert len(await read_back(env, p, dest)) == 4
    dest.close()


# --- Change Dumps ------------------------------------------------------------------------------------------


def changes(env: Env) -> None:
    """Global seqs 1..12 with N=5: windows 1 (1-5), 2 (6-10) closed, 3 (11-12) open.

    Window 2 holds set b only, so set a gets packages for window 1 only (window 3 is open)."""
    env.put(env.set_a, "https://up.example/a/1", b"v1")  # 1 created
    env.put(env.set_a, "https://up.example/a/2", b"two")  # 2 created
    env.put(env.set_a, "https://up.example/a/1", b"v2")  # 3 updated
    env.delete(env.set_a, "https://up.example/a/2")  # 4 deleted
    env.put(env.set_b, "https://up.example/b/1", b"b1")  # 5 (set b, inside a's window)
    for i in range(5):  # 6..10: set b only
        env.put(env.set_b, f"https://up.example/b/x{i}", f"b{i}".encode())
    env.put(env.set_a, "https://up.example/a/3", b"three")  # 11
    env.put(env.set_a, "https://up.example/a/1", b"v3")  # 12


async def test_change_dumps_cover_closed_windows_only_and_read_back(env: Env, tmp_path: Path) -> None:
    changes(env)
    b = env.builder()
    built = b.build_change_dumps("art", [env.set_a], 5)
    assert [p.number for p in built] == [1]
    [p] = built
    assert p.url == f"{BASE}/art/changedump/1.zip" and p.entries == 4
    records = list(env.state.iter_changelog())
    assert p.from_ == env.state.history_start([env.set_a])  # the start of the set's history
    assert p.until == records[4].datetime  # the last record of window 1 (any set)
    assert p.from_ <= records[0].datetime

    manifest = manifest_of(env, p)
    assert errors(manifest, p.manifest_url) == []
    assert served(env, p.manifest_sha256) == manifest
    head, entries = parse_bytes(manifest)
    assert head.capability == "changedump-manifest"
    assert (head.md.from_, head.md.until) == (p.from_, p.until)
    assert [(e.md.change, e.md.path is None) for e in entries] == [
        ("created", False), ("created", False), ("updated", False), ("deleted", True),
    ]  # fmt: skip
    assert [e.md.datetime for e in entries] == [r.datetime for r in records[:4]]

    dest = FileBlobStore(tmp_path / "dest")
    items = await read_back(env, p, dest)
    got = []
    for item in items:
        if item.blob is None:
            got.append((item.entry.change, item.entry.loc, None))
        else:
            with dest.open(item.info.sha256) as f:
                got.append((item.entry.change, item.entry.loc, f.read()))
    dest.close()

    def url(set_name: str, uri: str) -> str:
        return rsagg_uri(BASE, set_name, uri)

    assert got == [
        ("created", url("art", "https://up.example/a/1"), b"v1"),
        ("created", url("art", "https://up.example/a/2"), b"two"),
        ("updated", url("art", "https://up.example/a/1"), b"v2"),  # a past version, kept for the dump
        ("deleted", url("art", "https://up.example/a/2"), None),
    ]

    # Nothing new while window 3 is open; once it closes, exactly one more package (immutable ones stay).
    assert b.build_change_dumps("art", [env.set_a], 5) == []
    env.put(env.set_b, "https://up.example/b/close1", b"c1")
    env.put(env.set_b, "https://up.example/b/close2", b"c2")
    env.put(env.set_b, "https://up.example/b/close3", b"c3")  # seq 15 closes window 3
    [p3] = b.build_change_dumps("art", [env.set_a], 5)
    assert (p3.number, p3.entries) == (3, 2)
    # back to back with the previous package: window 2 held nothing of set a (documents.Windows)
    assert (p3.from_, p3.until) == (p.until, next(env.state.iter_changelog(14)).datetime)
    assert b.change_dump_packages("art") == [p, p3]
    assert b.build_change_dumps("art", [env.set_a], 5) == []

    doc_head, doc_entries = b.change_dump_document("art")
    data = b"".join(iter_document_bytes(doc_head, doc_entries))
    assert errors(data, f"{BASE}/art/changedump.xml") == []
    head, entries = parse_bytes(data)
    assert head.capability == "changedump" and head.md.from_ == p.from_ and head.md.until is None
    assert [(e.loc, e.md.from_, e.md.until) for e in entries] == [(q.url, q.from_, q.until) for q in (p, p3)]
    assert b.available("art") == {
        "changedump": f"{BASE}/art/changedump.xml",
        "changedump-archive": f"{BASE}/art/changedump-archive.xml",
    }


def test_change_dump_of_several_state_sets_merges_them_in_seq_order(env: Env) -> None:
    changes(env)
    b = env.builder()
    built = b.build_change_dumps("all", [env.set_b, env.set_a], 5)
    assert [(p.number, p.entries) for p in built] == [(1, 5), (2, 5)]
    _, entries = parse_bytes(manifest_of(env, built[0]))
    assert [e.md.datetime for e in entries] == [r.datetime for r in list(env.state.iter_changelog())[:5]]


# --- HTTP --------------------------------------------------------------------------------------------------


async def test_routes_serve_documents_packages_and_manifests(env: Env) -> None:
    env.put(env.set_a, "https://up.example/a/x", b"hello")
    changes(env)
    b = env.builder()
    [rd] = b.build_resource_dump("art", [env.set_a])
    [cd] = b.build_change_dumps("art", [env.set_a], 5)
    app = Starlette(routes=dump_routes(b))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE) as c:
        for doc in ("resourcedump", "changedump"):
            r = await c.get(f"/art/{doc}.xml")
            assert r.status_code == 200 and r.headers["content-type"].startswith("application/xml")
            assert errors(r.content, str(r.url)) == []
            assert parse_bytes(r.content)[0].capability == doc
            # validators, conditional GET and Cache-Control, as every document (more packages may come)
            etag, lm = r.headers["etag"], r.headers["last-modified"]
            assert r.headers["cache-control"] == "public, max-age=10"
            for cond in ({"If-None-Match": etag}, {"If-Modified-Since": lm}):
                again = await c.get(f"/art/{doc}.xml", headers=cond)
                assert again.status_code == 304 and again.headers["etag"] == etag, cond
            assert (await c.get(f"/art/{doc}.xml", headers={"If-None-Match": '"x"'})).content == r.content
            size = len((await c.get(f"/art/{doc}.xml")).content)
            r = await c.head(f"/art/{doc}.xml")
            assert r.status_code == 200 and r.content == b"" and r.headers["etag"] == etag
            assert r.headers["content-length"] == str(size)
        for p in (rd, cd):
            r = await c.get(p.url)
            assert r.status_code == 200
            assert r.headers["content-type"] == "application/zip"
            assert r.headers["etag"] == f'"{p.sha256}"'
            assert int(r.headers["content-length"]) == p.length == len(r.content)
            assert hashlib.sha256(r.content).hexdigest() == p.sha256
            assert r.headers["cache-control"] == "public, max-age=86400"  # a package never changes
            assert (await c.get(p.url, headers={"If-None-Match": f'"{p.sha256}"'})).status_code == 304
            r = await c.get(p.url, headers={"Range": "bytes=0-3"})
            assert r.status_code == 206 and r.content == b"PK\x03\x04"
            r = await c.head(p.url)
            assert r.status_code == 200 and r.content == b"" and int(r.headers["content-length"]) == p.length
            r = await c.get(p.manifest_url)
            assert r.status_code == 200 and r.headers["content-type"].startswith("application/xml")
            assert r.content == manifest_of(env, p)
        for missing in (
            "/other/resourcedump.xml", "/other/changedump.xml", f"/art/resourcedump/{rd.number + 100}.zip",
            "/art/changedump/2.zip", "/art/changedump/2/manifest.xml", "/art/changedump/99.zip",
            "/art/resourcedump/0/manifest.xml",
        ):  # fmt: skip
            assert (await c.get(missing)).status_code == 404, missing


def test_no_dump_no_references_and_no_state_sets_no_run(env: Env) -> None:
    assert list(referenced_hashes(env.state)) == []  # before any builder created the tables
    b = env.builder()
    assert b.build_resource_dump("art", []) == [] and b.build_change_dumps("art", [], 5) == []
    assert b.available("art") == {} and b.resource_dump_document("art") is None
    assert b.change_dump_document("art") is None


def test_configuration_is_checked(env: Env) -> None:
    with pytest.raises(ValueError):
        env.builder(max_entries=50_001)
    with pytest.raises(ValueError):
        env.builder(compression="zstd")
    with pytest.raises(ValueError):
        env.builder().build_change_dumps("art", [env.set_a], 0)


# --- the same entries as the Resource List and the Change List ---------------------------------------------


def strip_path(e):
    assert e.md is not None
    if e.md.change != "deleted":
        assert e.md.path is not None
    e.md.path = None
    return e


def test_manifests_say_what_the_lists_say(env: Env) -> None:
    link = Link("describedby", "https://up.example/a/meta.xml")
    info = env.blobs.put_bytes(b"described")
    env.state.apply(
        env.set_a,
        [Change("https://up.example/a/described", "created", info.sha256, 9, "text/plain", links=[link],
                hashes={"sha-256": info.sha256})],
    )  # fmt: skip
    env.put(env.set_a, "https://up.example/a/meta.xml", b"<meta/>", type_="application/xml")
    changes(env)
    ps = PublishedSet("art", (env.set_a,))
    site = documents.Site(BASE, {"art": ps}, LinkPolicy(), 5)
    b = env.builder(site=site)
    [rd] = b.build_resource_dump("art", [env.set_a])
    head, listed = documents.resource_list(site, env.state, ps, T0)
    _, manifest = parse_bytes(manifest_of(env, rd))
    assert [strip_path(e) for e in manifest] == list(listed)
    by_loc = {e.loc: e for e in manifest}
    described = by_loc[rsagg_uri(BASE, "art", "https://up.example/a/described")]
    # the link policy ran: via to the upstream, describedby rewritten to our copy
    # (and the §14.6 links of versions.py follow: memento, timegate, timemap)
    assert [(ln.rel, ln.href) for ln in described.links if ln.rel not in VERSION_RELS] == [
        ("via", "https://up.example/a/described"),
        ("describedby", rsagg_uri(BASE, "art", "https://up.example/a/meta.xml")),
    ]

    built = b.build_change_dumps("art", [env.set_a], 5)
    assert [p.number for p in built] == [1, 2]
    for p in built:
        head, listed = documents.change_list_window(site, env.state, ps, p.number, T0)
        mhead, manifest = parse_bytes(manifest_of(env, p))
        assert (mhead.md.from_, mhead.md.until) == (head.md.from_, head.md.until) == (p.from_, p.until)
        assert [strip_path(e) for e in manifest] == list(listed)


async def test_our_harvester_downloads_and_verifies_packages_over_http(env: Env, tmp_path: Path) -> None:
    """Over a real socket: the fetcher checks each package against the sha-256/length of its Resource
    Dump entry, then read_package checks every member against the manifest."""
    for i in range(12):
        env.put(env.set_a, f"https://up.example/a/{i}.txt", content(i))
    app = Starlette()
    async with serve_app(app) as base:
        b = env.builder(max_entries=5, base_url=base)  # URLs where the server is
        app.router.routes.extend(dump_routes(b))
        packages = b.build_resource_dump("art", [env.set_a])
        dest = FileBlobStore(tmp_path / "dest")
        got = []
        async with Fetcher() as fetcher:
            async with fetcher.document(f"{base}/art/resourcedump.xml") as doc:
                entries = [e async for e in doc.entries]
            assert [e.loc for e in entries] == [p.url for p in packages]
            for e in entries:
                async with aclosing(fetch_package(fetcher, e, dest, tmp_path, limits=DumpLimits())) as items:
                    async for item in items:
                        got.append(item.entry.loc)
                        item.blob.abort()
        dest.close()
    assert got == [rsagg_uri(base, "art", f"https://up.example/a/{i}.txt") for i in range(12)]


# ---------------------------------------------------------------------------------------------------
# Archives (ResourceSync Archives draft): the kept runs and the Change Dump, found from the dumps


def _doc(make, *args) -> tuple:
    head, entries = make(*args)
    data = b"".join(iter_document_bytes(head, entries))
    return data, parse_bytes(data)


def test_kept_resource_dump_runs_are_listed_in_the_archive(env: Env) -> None:
    """Every kept run (``keep``) is an entry of the resourcedump-archive, oldest first, with its at and
    completed; each entry is that run's own Resource Dump document listing its packages; a pruned run
    leaves the archive; the Resource Dump and Capability List point at the archive."""
    b = env.builder(keep=2)
    runs = []
    for i in range(3):
        env.put(env.set_a, f"https://up.example/a/{i}", f"run {i}".encode())
        runs.append(b.build_resource_dump("art", [env.set_a]))
    data, (head, entries) = _doc(b.resource_dump_archive, "art")
    assert errors(data, f"{BASE}/art/resourcedump-archive.xml") == []
    assert head.capability == "resourcedump-archive"
    assert [ln.rel for ln in head.links] == ["up"]
    kept = runs[1:]  # keep=2: the first run was pruned
    kept_runs = b.runs("art")
    assert [e.loc for e in entries] == [f"{BASE}/art/resourcedump/run/{r.id}.xml" for r in kept_runs]
    for e, run, packages in zip(entries, kept_runs, kept, strict=True):
        assert (e.md.at, e.md.completed, e.lastmod) == (run.at, run.completed, run.completed)
        rdata, (rhead, rentries) = _doc(b.resource_dump_document, "art", run.id)
        assert errors(rdata, e.loc) == []
        assert [x.loc for x in rentries] == [p.url for p in packages]
        assert ("archives", f"{BASE}/art/resourcedump-archive.xml") in [
            (ln.rel, ln.href) for ln in rhead.links
        ]
    assert b.resource_dump_document("art", runs[0][0].run) is None  # pruned: gone from the archive too
    assert b.available("art")["resourcedump-archive"] == f"{BASE}/art/resourcedump-archive.xml"


def test_change_dump_archive(env: Env) -> None:
    changes(env)
    b = env.builder()
    b.build_change_dumps("art", [env.set_a], 5)
    data, (head, entries) = _doc(b.change_dump_archive, "art")
    assert errors(data, f"{BASE}/art/changedump-archive.xml") == []
    assert head.capability == "changedump-archive"
    (e,) = entries
    _, (chead, _) = _doc(b.change_dump_document, "art")
    assert e.loc == f"{BASE}/art/changedump.xml" and e.md.from_ == chead.md.from_ and e.md.until is None
    assert ("archives", f"{BASE}/art/changedump-archive.xml") in [(ln.rel, ln.href) for ln in chead.links]


async def test_archives_are_served(env: Env) -> None:
    b = env.builder(keep=3)
    for i in range(2):
        env.put(env.set_a, f"https://up.example/a/{i}", f"run {i}".encode())
        b.build_resource_dump("art", [env.set_a])
    async with serve_app(Starlette(routes=dump_routes(b))) as base, httpx.AsyncClient() as client:
        r = await client.get(f"{base}/art/resourcedump-archive.xml")
        assert r.status_code == 200
        _, entries = parse_bytes(r.content)
        assert len(entries) == 2
        for e in entries:
            path = e.loc.removeprefix(BASE)
            rr = await client.get(base + path)
            assert rr.status_code == 200 and parse_bytes(rr.content)[0].capability == "resourcedump"
        assert (await client.get(f"{base}/art/resourcedump/run/999.xml")).status_code == 404
        assert (await client.get(f"{base}/art/changedump-archive.xml")).status_code == 404
