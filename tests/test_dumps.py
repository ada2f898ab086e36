"""Reading Resource Dump / Change Dump packages (§11, §13) safely: aggregator/harvest/dumps.py."""

from __future__ import annotations

import hashlib
import random
import struct
import warnings
import zipfile
import zlib
from contextlib import aclosing
from pathlib import Path

import pytest
import trio

from aggregator.harvest import dumps
from aggregator.harvest.deviations import Deviations, collecting
from aggregator.harvest.dumps import DumpError, DumpItem, DumpLimits, member_name, read_package
from aggregator.store.blobs import FileBlobStore

URL = "http://example.com/dump/part1.zip"
MiB = 1 << 20


def md5(b: bytes) -> str:
    return hashlib.md5(b).hexdigest()


def sha256(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def manifest_xml(entries: list[dict], capability: str = "resourcedump-manifest") -> bytes:
    """A manifest as an upstream would write it; entry keys: loc, path, change, hash, length, type."""
    when = (
        'at="2013-01-03T09:00:00Z"'
        if capability == "resourcedump-manifest"
        else 'from="2013-01-02T00:00:00Z"'
    )
    out = [
        '<?xml version="1.0" encoding="UTF-8"?>',
        '<urlset xmlns="http://www.sitemaps.org/schemas/sitemap/0.9" xmlns:rs="http://www.openarchives.org/rs/terms/">',
        '<rs:ln rel="up" href="http://example.com/dataset1/capabilitylist.xml"/>',
        f'<rs:md capability="{capability}" {when}/>',
    ]
    for e in entries:
        attrs = " ".join(
            f'{k}="{e[k]}"' for k in ("change", "hash", "length", "type", "path") if e.get(k) is not None
        )
        out.append(f"<url><loc>{e['loc']}</loc><rs:md {attrs}/></url>")
    out.append("</urlset>")
    return "\n".join(out).encode()


def entry_for(loc: str, path: str, content: bytes, **kw) -> dict:
    return {"loc": loc, "path": path, "hash": f"md5:{md5(content)} sha-256:{sha256(content)}",
            "length": len(content), "type": "text/plain", **kw}  # fmt: skip


def make_zip(
    dest: Path, members: list[tuple[str, bytes]], manifest: bytes | None, method: int = zipfile.ZIP_DEFLATED
) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Duplicate name" is what one test wants
        with zipfile.ZipFile(dest, "w", compression=method) as zf:
            if manifest is not None:
                zf.writestr("manifest.xml", manifest)
            for name, data in members:
                zf.writestr(name, data)
    return dest


def files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def env(tmp_path):
    """A blob store under tmp_path/store and a folder for packages, both under tmp_path."""
    store = FileBlobStore(tmp_path / "store")
    pkgs = tmp_path / "pkgs"
    pkgs.mkdir()
    yield store, pkgs
    store.close()


async def collect(path: Path, store, limits: DumpLimits | None = None) -> list[DumpItem]:
    """What a careful caller does: keep the writers, abort them all if the package is rejected."""
    items: list[DumpItem] = []
    try:
        async with aclosing(read_package(path, URL, store, limits=limits or DumpLimits())) as it:
            async for item in it:
                items.append(item)
    except BaseException:
        for item in items:
            if item.blob is not None:
                item.blob.abort()
        raise
    return items


async def assert_rejected(path: Path, store, match: str, limits: DumpLimits | None = None) -> DumpError:
    root = path.parent.parent
    before = files(root)
    with pytest.raises(DumpError, match=match) as exc_info:
        await collect(path, store, limits)
    assert files(root) == before, "a rejected package left files behind"
    assert list(store.iter_hashes()) == []
    assert [p.name for p in (store.root / "tmp").iterdir()] == [".lock"]
    assert URL in str(exc_info.value)
    return exc_info.value


# -- the good cases ---------------------------------------------------------------------------------


async def test_resource_dump_package(env):
    store, pkgs = env
    res1, res2 = b"<html>one</html>" * 50, bytes(range(256)) * 300
    entries = [entry_for("http://example.com/res1", "/resources/res1", res1),
               entry_for("http://example.com/res2", "/resources/res2", res2)]  # fmt: skip
    path = make_zip(
        pkgs / "p.zip", [("resources/res1", res1), ("resources/res2", res2), ("extra.bin", b"not listed")],
        manifest_xml(entries),
    )  # fmt: skip
    items = await collect(path, store)
    assert [i.entry.loc for i in items] == ["http://example.com/res1", "http://example.com/res2"]
    for item, data in zip(items, (res1, res2), strict=True):
        assert item.info is not None and item.blob is not None
        assert item.info.sha256 == sha256(data)
        assert item.info.length == len(data)
        assert item.info.hashes["md5"] == md5(data)
        assert item.entry.md is not None and item.entry.md.type == "text/plain"
    assert list(store.iter_hashes()) == []  # nothing committed by read_package itself
    store.commit([i.blob for i in items if i.blob is not None])
    assert sorted(store.iter_hashes()) == sorted([sha256(res1), sha256(res2)])
    with store.open(sha256(res2)) as f:
        assert f.read() == res2
    assert not store.exists(sha256(b"not listed"))  # the manifest is the only index


async def test_paths_without_leading_slash_are_read_and_noted(env):
    """resync-build and CORE write ``path="res/x"``: read from the package root, noted once per entry."""
    store, pkgs = env
    data = b"no slash"
    path = make_zip(pkgs / "p.zip", [("recid_1/a.txt", data)],
                    manifest_xml([entry_for("http://example.com/a", "recid_1/a.txt", data)]))  # fmt: skip
    noted = Deviations("s")
    with collecting(noted):
        items = await collect(path, store)
    assert [(i.entry.loc, i.info.sha256) for i in items] == [("http://example.com/a", sha256(data))]
    store.commit([i.blob for i in items if i.blob is not None])
    assert noted.notes["dump-path-no-slash"].count == 1 and noted.notes["dump-path-no-slash"].line == 5
    assert not noted.skipped


async def test_stored_members_and_no_hash(env):
    """Members without hash/length in the manifest are still stored (only SHA-256 computed)."""
    store, pkgs = env
    data = b"x" * 5000
    m = manifest_xml([{"loc": "http://example.com/a", "path": "/a"}])
    items = await collect(make_zip(pkgs / "p.zip", [("a", data)], m, zipfile.ZIP_STORED), store)
    assert len(items) == 1 and items[0].info is not None
    assert items[0].info.sha256 == sha256(data)
    assert set(items[0].info.hashes) == {"sha-256"}
    items[0].blob.abort()


async def test_change_dump_with_deletion(env):
    store, pkgs = env
    v1, v2, pdf = b"version 1", b"version 2 is longer", b"%PDF-1.4 ..."
    entries = [
        entry_for("http://example.com/res7.html", "/changes/res7.html", v1, change="created"),
        entry_for("http://example.com/res9.pdf", "/changes/res9.pdf", pdf, change="updated"),
        {"loc": "http://example.com/res5.tiff", "change": "deleted"},
        entry_for("http://example.com/res7.html", "/changes/res7-v2.html", v2, change="updated"),
    ]
    path = make_zip(
        pkgs / "c.zip",
        [("changes/res7.html", v1), ("changes/res9.pdf", pdf), ("changes/res7-v2.html", v2)],
        manifest_xml(entries, "changedump-manifest"),
    )
    items = await collect(path, store)
    assert [(i.entry.loc, i.entry.change) for i in items] == [
        ("http://example.com/res7.html", "created"),
        ("http://example.com/res9.pdf", "updated"),
        ("http://example.com/res5.tiff", "deleted"),
        ("http://example.com/res7.html", "updated"),
    ]
    assert items[2].blob is None and items[2].info is None
    assert [i.info.sha256 for i in items if i.info] == [sha256(v1), sha256(pdf), sha256(v2)]
    for i in items:
        if i.blob:
            i.blob.abort()


async def test_many_small_members_span_hops(env):
    """More members than one thread hop handles, and a member larger than one hop's budget."""
    store, pkgs = env
    big = random.Random(1).randbytes(dumps.CHUNK * 2 + 123)
    members = [(f"r/{n}", f"resource {n}".encode()) for n in range(dumps.MEMBERS_PER_HOP + 40)]
    members.append(("r/big", big))
    entries = [entry_for(f"http://example.com/{name}", f"/{name}", data) for name, data in members]
    items = await collect(make_zip(pkgs / "p.zip", members, manifest_xml(entries)), store)
    assert [i.info.sha256 for i in items if i.info] == [sha256(d) for _, d in members]
    assert items[-1].blob.tmp_path.read_bytes() == big  # finished, not committed (a commit here costs fsyncs)
    for i in items:
        i.blob.abort()


async def test_stopping_early_aborts_unyielded_writers(env):
    store, pkgs = env
    # Members bigger than dumps.SPOOL: each goes to a temp file (smaller ones stay in memory).
    members = [(f"r/{n}", f"resource {n}".encode() * 8000) for n in range(20)]
    entries = [entry_for(f"http://example.com/{name}", f"/{name}", data) for name, data in members]
    path = make_zip(pkgs / "p.zip", members, manifest_xml(entries))
    async with aclosing(read_package(path, URL, store, limits=DumpLimits())) as it:
        async for item in it:
            first = item
            break
    # Only the writer handed out is left; the ones finished in the same hop were aborted.
    assert [p.name for p in (store.root / "tmp").iterdir() if p.name != ".lock"] == [first.blob.tmp_path.name]
    first.blob.abort()


# -- hostile names ----------------------------------------------------------------------------------


@pytest.mark.parametrize("good", ["/a", "/resources/res1", "/a b/c%2e%2e/ünï", "/x/urn:isbn:1"])
def test_member_name_accepts(good):
    assert member_name(good) == good[1:]


@pytest.mark.parametrize(
    "bad",
    [None, "", "/", "relative/x", "/../../etc/x", "/a/../b", "/a/./b", "/a//b", "/a/", "//server/share/x",
     "..\\x", "/..\\x", "/a\\b", "C:\\Windows\\x", "/C:/x", "/c:x", "/a\x00b", "/a\nb"],
)  # fmt: skip
def test_member_name_refuses(bad):
    with pytest.raises(ValueError):
        member_name(bad)


@pytest.mark.parametrize("path", ["/../../etc/x", "..\\x", "/..\\x", "C:/x", "/C:/x", "//etc/x", "/a/./x"])
async def test_path_traversal_rejected(env, path):
    store, pkgs = env
    data = b"owned"
    # The ZIP really holds members with the hostile names (zipfile writes them as given).
    members = [("../../etc/x", data), ("..\\x", data), ("C:/x", data), ("etc/x", data), ("a/x", data)]
    m = manifest_xml([entry_for("http://example.com/x", path, data)])
    err = await assert_rejected(
        make_zip(pkgs / "p.zip", members, m), store, "unsafe or invalid manifest path"
    )
    assert err.path == path


# -- zip bombs and caps -----------------------------------------------------------------------------


async def test_member_beyond_size_cap(env):
    store, pkgs = env
    zeros = bytes(8 * MiB)
    m = manifest_xml([entry_for("http://example.com/z", "/z", zeros)])
    path = make_zip(pkgs / "p.zip", [("z", zeros)], m)
    assert path.stat().st_size < 64 * 1024
    await assert_rejected(
        path, store, "max_member_bytes", DumpLimits(max_member_bytes=4 * MiB, max_ratio=10_000)
    )


async def test_member_beyond_ratio(env):
    store, pkgs = env
    zeros = bytes(8 * MiB)  # deflates about 1000:1
    m = manifest_xml([entry_for("http://example.com/z", "/z", zeros)])
    await assert_rejected(make_zip(pkgs / "p.zip", [("z", zeros)], m), store, "compression ratio exceeds 200")


async def test_small_compressible_member_is_fine(env):
    """A page of zeros (ratio ~100 but tiny) is normal content, not a bomb."""
    store, pkgs = env
    zeros = bytes(100_000)
    m = manifest_xml([entry_for("http://example.com/z", "/z", zeros)])
    items = await collect(make_zip(pkgs / "p.zip", [("z", zeros)], m), store, DumpLimits(max_ratio=50))
    assert items[0].info.length == len(zeros)
    items[0].blob.abort()


async def test_total_uncompressed_cap(env):
    store, pkgs = env
    rnd = random.Random(2)
    members = [(f"m{n}", rnd.randbytes(2 * MiB)) for n in range(3)]
    m = manifest_xml([entry_for(f"http://example.com/{n}", f"/{n}", d) for n, d in members])
    await assert_rejected(
        make_zip(pkgs / "p.zip", members, m), store, "max_total_uncompressed",
        DumpLimits(max_total_uncompressed=5 * MiB),
    )  # fmt: skip


def _lie_about_size(data: bytearray, name: bytes, size: int, crc: int | None = None) -> None:
    """Rewrite the uncompressed size (and optionally CRC) in the local and central headers of a member."""
    pos, hits = 0, 0
    while (pos := data.find(b"PK\x01\x02", pos)) != -1:
        n_len = struct.unpack_from("<H", data, pos + 28)[0]
        if bytes(data[pos + 46 : pos + 46 + n_len]) == name:
            struct.pack_into("<I", data, pos + 24, size)
            if crc is not None:
                struct.pack_into("<I", data, pos + 16, crc)
            local = struct.unpack_from("<I", data, pos + 42)[0]
            struct.pack_into("<I", data, local + 22, size)
            if crc is not None:
                struct.pack_into("<I", data, local + 14, crc)
            hits += 1
        pos += 4
    assert hits == 1


async def test_header_lying_about_size(env):
    """The header says 1000 bytes, the stream inflates to 4 MiB: never more than 1000 come out."""
    store, pkgs = env
    zeros = bytes(4 * MiB)
    m = manifest_xml([{"loc": "http://example.com/z", "path": "/z", "length": 1000}])
    path = make_zip(pkgs / "p.zip", [("z", zeros)], m)
    raw = bytearray(path.read_bytes())
    _lie_about_size(raw, b"z", 1000)
    path.write_bytes(raw)
    await assert_rejected(path, store, "cannot read member.*CRC")
    # Same lie with a CRC that matches the truncated stream: only the announced 1000 bytes are stored.
    _lie_about_size(raw, b"z", 1000, crc=zlib.crc32(bytes(1000)))
    path.write_bytes(raw)
    items = await collect(path, store)
    assert items[0].info.length == 1000 and items[0].info.sha256 == sha256(bytes(1000))
    items[0].blob.abort()


class _CountingStore:
    """Wraps a store to record how many bytes each writer received."""

    def __init__(self, store):
        self.store = store
        self.written: list[int] = []

    def begin(self, algorithms=frozenset()):
        w = self.store.begin(algorithms)
        idx = len(self.written)
        self.written.append(0)
        orig = w.write
        outer = self

        class Proxy:
            tmp_path = w.tmp_path

            def write(self, chunk):
                outer.written[idx] += len(chunk)
                orig(chunk)

            finish, abort = w.finish, w.abort

        return Proxy()


async def test_streaming_caps_hold_without_header_checks(env, monkeypatch):
    """Defence in depth: with the header checks switched off, the byte counts still stop the read."""
    store, pkgs = env
    monkeypatch.setattr(dumps, "_check_header", lambda *a: None)
    zeros = bytes(16 * MiB)
    m = manifest_xml([{"loc": "http://example.com/z", "path": "/z"}])
    path = make_zip(pkgs / "p.zip", [("z", zeros)], m)
    counting = _CountingStore(store)
    limits = DumpLimits(max_member_bytes=3 * MiB, max_ratio=10_000)
    with pytest.raises(DumpError, match="inflates beyond max_member_bytes"):
        await collect(path, counting, limits)
    assert 0 < counting.written[0] <= 3 * MiB
    counting.written.clear()
    with pytest.raises(DumpError, match="member compression ratio exceeds 200"):
        await collect(path, counting)
    assert counting.written[0] <= 201 * path.stat().st_size
    counting.written.clear()
    m = manifest_xml([{"loc": "http://example.com/z", "path": "/z", "length": 1000}])
    path = make_zip(pkgs / "p.zip", [("z", zeros)], m)
    with pytest.raises(DumpError, match="length mismatch: manifest says 1000, member is longer"):
        await collect(path, counting)
    assert counting.written[0] <= 1000
    assert [p.name for p in (store.root / "tmp").iterdir()] == [".lock"]


async def test_cancellation_aborts_writers(env):
    store, pkgs = env
    big = random.Random(4).randbytes(3 * dumps.CHUNK)
    members = [("a", b"first"), ("b", big)]
    entries = [entry_for(f"http://example.com/{n}", f"/{n}", d) for n, d in members]
    path = make_zip(pkgs / "p.zip", members, manifest_xml(entries))
    got = []
    with trio.CancelScope() as scope:
        async with aclosing(read_package(path, URL, store, limits=DumpLimits())) as it:
            async for item in it:
                got.append(item)
                scope.cancel()  # the next checkpoint inside read_package is cancelled mid-package
    assert scope.cancelled_caught and [i.entry.loc for i in got] == ["http://example.com/a"]
    left = [p.name for p in (store.root / "tmp").iterdir() if p.name != ".lock"]
    assert left == []  # the big member in progress was aborted; the small one handed out is in memory
    assert got[0].blob.tmp_path is None and got[0].blob.held() == b"first"
    got[0].blob.abort()


async def test_too_many_members(env):
    store, pkgs = env
    members = [(f"m{n}", b"x") for n in range(12)]
    m = manifest_xml([entry_for("http://example.com/0", "/m0", b"x")])
    await assert_rejected(
        make_zip(pkgs / "p.zip", members, m), store, "max_members=10", DumpLimits(max_members=10)
    )


async def test_manifest_size_cap(env):
    store, pkgs = env
    entries = [entry_for(f"http://example.com/{n}", "/a", b"a") for n in range(50)]
    m = manifest_xml(entries)
    assert len(m) > 4000
    await assert_rejected(
        make_zip(pkgs / "p.zip", [("a", b"a")], m),
        store,
        "max_manifest_bytes",
        DumpLimits(max_manifest_bytes=4000),
    )


# -- broken packages --------------------------------------------------------------------------------


async def test_manifest_names_missing_file(env):
    store, pkgs = env
    m = manifest_xml([entry_for("http://example.com/a", "/resources/a", b"a"),
                      entry_for("http://example.com/b", "/resources/missing", b"b")])  # fmt: skip
    err = await assert_rejected(make_zip(pkgs / "p.zip", [("resources/a", b"a")], m), store, "not in the ZIP")
    assert err.path == "/resources/missing" and "/resources/missing" in str(err)


async def test_hash_mismatch(env):
    store, pkgs = env
    good, bad = b"good content", b"tampered!!!!"
    assert len(good) == len(bad)
    entries = [entry_for("http://example.com/a", "/a", good), entry_for("http://example.com/b", "/b", good)]
    path = make_zip(pkgs / "p.zip", [("a", good), ("b", bad)], manifest_xml(entries))
    err = await assert_rejected(path, store, r"md5 mismatch: manifest says [0-9a-f]{32}, member has")
    assert err.path == "/b" and "sha-256 mismatch" in str(err)


async def test_length_mismatch(env):
    store, pkgs = env
    data = b"twelve bytes"
    entry = entry_for("http://example.com/a", "/a", data) | {"length": 11, "hash": None}
    err = await assert_rejected(
        make_zip(pkgs / "p.zip", [("a", data)], manifest_xml([entry])),
        store,
        "length mismatch: manifest says 11",
    )
    assert err.path == "/a"


async def test_duplicate_member_names(env):
    store, pkgs = env
    m = manifest_xml([entry_for("http://example.com/a", "/a", b"one")])
    path = make_zip(pkgs / "p.zip", [("a", b"one"), ("a", b"two")], m)
    err = await assert_rejected(path, store, "duplicate member name")
    assert err.path == "a"


@pytest.mark.parametrize(
    ("manifest", "match"),
    [
        (None, "no manifest.xml"),
        (b"<html><body>no</body></html>", "bad manifest"),
        (b"<urlset", "bad manifest"),
        (manifest_xml([], "resourcelist"), "expected a Resource Dump or Change Dump Manifest"),
        (
            manifest_xml([{"loc": "http://example.com/a", "change": "updated"}], "changedump-manifest"),
            "no path",
        ),
    ],
)
async def test_bad_manifest(env, manifest, match):
    store, pkgs = env
    await assert_rejected(make_zip(pkgs / "p.zip", [("a", b"a")], manifest), store, match)


async def test_not_a_zip(env):
    store, pkgs = env
    path = pkgs / "p.zip"
    path.write_bytes(b"<html>this is an error page</html>")
    await assert_rejected(path, store, "not a readable ZIP package")


async def test_corrupt_member_stream(env):
    store, pkgs = env
    data = random.Random(3).randbytes(50_000)
    m = manifest_xml([entry_for("http://example.com/a", "/a", data)])
    path = make_zip(pkgs / "p.zip", [("a", data)], m, zipfile.ZIP_STORED)
    raw = bytearray(path.read_bytes())
    at = raw.index(data[:64])
    raw[at + 1000 : at + 1010] = b"\x00" * 10
    path.write_bytes(bytes(raw))
    await assert_rejected(path, store, "cannot read member.*CRC")


async def test_partial_failure_leaves_nothing(env):
    """Good members first, then a bad one: the careful caller's aborts leave the store as it was."""
    store, pkgs = env
    members = [(f"m{n}", f"member {n}".encode()) for n in range(30)]
    entries = [entry_for(f"http://example.com/{n}", f"/{n}", d) for n, d in members]
    entries[-1]["hash"] = "md5:" + "0" * 32
    await assert_rejected(make_zip(pkgs / "p.zip", members, manifest_xml(entries)), store, "md5 mismatch")


def test_zip_helper_really_writes_hostile_names(tmp_path):
    path = make_zip(tmp_path / "p.zip", [("../../etc/x", b"1")], None)
    with zipfile.ZipFile(path) as zf:
        assert zf.namelist() == ["../../etc/x"]
