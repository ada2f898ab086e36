"""Patching (§14.4): JSON Patch applied to the stored version, kept only when it matches the announcement."""

from __future__ import annotations

import hashlib
import json
from collections import Counter

import jsonpatch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from aggregator.harvest.fetch import Expected, Fetcher
from aggregator.harvest.patch import apply_json_patch, builtin_patch_formats, fetch_by_patch
from aggregator.rs.model import PATCH_REL, Link
from aggregator.store.blobs import FileBlobStore
from tests.blobtesting import temp_files
from tests.httpserver import serve_app

OLD = {"title": "Résumé", "tags": ["a", "b"], "n": 1}
NEW = {"title": "Résumé", "tags": ["a", "b", "c"], "n": 2, "extra": {"k": None}}
PATCH = jsonpatch.make_patch(OLD, NEW).to_string().encode()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def patch_app(hits: Counter[str]) -> Starlette:
    async def patch(request: Request) -> Response:
        hits[request.url.path] += 1
        return Response(PATCH, media_type="application/json-patch+json")

    async def broken(request: Request) -> Response:
        hits[request.url.path] += 1
        return Response(
            b'[{"op": "remove", "path": "/no/such/member"}]', media_type="application/json-patch+json"
        )

    return Starlette(routes=[Route("/patch", patch), Route("/broken", broken)])


def link(href: str, type_: str | None = "application/json-patch+json", **kw: object) -> Link:
    return Link(rel=PATCH_REL, href=href, type=type_, **kw)  # type: ignore[arg-type]


async def test_json_patch_applied_and_verified(store: FileBlobStore) -> None:
    hits: Counter[str] = Counter()
    current = json.dumps(OLD).encode()
    new = json.dumps(NEW).encode()
    expected = Expected({"sha-256": sha256(new)}, len(new))
    async with serve_app(patch_app(hits)) as base, Fetcher() as f:
        ln = link(f"{base}/patch", hash=f"sha-256:{sha256(PATCH)}", length=len(PATCH))
        got = await fetch_by_patch(f, ln, current, expected, store, builtin_patch_formats())
    assert got is not None
    assert got.url == f"{base}/patch"
    assert got.info.sha256 == sha256(new) and got.info.length == len(new)
    assert got.blob.state == "finished" and not store.exists(got.info.sha256)  # the caller commits
    store.commit([got.blob])
    with store.open(got.info.sha256) as fh:
        assert fh.read() == new
    assert hits["/patch"] == 1


async def test_result_hash_mismatch_gives_none(store: FileBlobStore) -> None:
    hits: Counter[str] = Counter()
    current = json.dumps(OLD).encode()
    expected = Expected({"sha-256": sha256(b"some other version")}, None)
    async with serve_app(patch_app(hits)) as base, Fetcher() as f:
        got = await fetch_by_patch(
            f, link(f"{base}/patch"), current, expected, store, builtin_patch_formats()
        )
    assert got is None
    assert hits["/patch"] == 1
    assert temp_files(store) == []  # the wrong result was dropped


async def test_unusable_patches_give_none(store: FileBlobStore) -> None:
    hits: Counter[str] = Counter()
    current = json.dumps(OLD).encode()
    new = json.dumps(NEW).encode()
    expected = Expected({"sha-256": sha256(new)}, len(new))
    formats = builtin_patch_formats()
    async with serve_app(patch_app(hits)) as base, Fetcher(retries=0) as f:
        # Unknown media type (§14.4: ignore it and fetch loc): not even fetched.
        assert (
            await fetch_by_patch(
                f, link(f"{base}/patch", "application/x-tiff-diff"), current, expected, store, formats
            )
            is None
        )
        assert await fetch_by_patch(f, link(f"{base}/patch", None), current, expected, store, formats) is None
        assert hits["/patch"] == 0
        # The patch document itself fails its own announced hash.
        bad_ln = link(f"{base}/patch", hash=f"sha-256:{sha256(b'x')}")
        assert await fetch_by_patch(f, bad_ln, current, expected, store, formats) is None
        # The patch cannot be fetched.
        assert await fetch_by_patch(f, link(f"{base}/missing"), current, expected, store, formats) is None
        # The patch does not apply to what we hold.
        assert await fetch_by_patch(f, link(f"{base}/broken"), current, expected, store, formats) is None
        # Nothing announced to verify the result against.
        assert (
            await fetch_by_patch(f, link(f"{base}/patch"), current, Expected({}, len(new)), store, formats)
            is None
        )
    assert hits["/patch"] == 1 and hits["/broken"] == 1
    assert temp_files(store) == []


def test_json_patch_keeps_the_current_serialisation() -> None:
    for dumps in (
        lambda v: json.dumps(v),
        lambda v: json.dumps(v, separators=(",", ":")),
        lambda v: json.dumps(v, indent=2) + "\n",
        lambda v: json.dumps(v, indent=4, ensure_ascii=False, sort_keys=True),
    ):
        assert apply_json_patch(dumps(OLD).encode("utf-8"), PATCH) == dumps(NEW).encode("utf-8")


def test_builtin_formats() -> None:
    formats = builtin_patch_formats()
    # RFC 6902's registered type, and the spelling of §14.4 Example 27.
    assert set(formats) == {"application/json-patch+json", "application/json-patch"}
