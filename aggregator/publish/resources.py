"""Serving republished resources from the blob store (RFC 9110 semantics; spec §6.3.3, §14.8).

- 200 with the stored bytes, Content-Type (stored type, else application/octet-stream),
  Content-Length, Content-Encoding when the upstream had one (the bytes are the encoded ones);
- ``ETag: "<sha256>"`` (strong: content-addressed, so equal tags mean equal bytes) and
  ``Last-Modified`` = rsagg's ``updated_at`` of the row (our own clock, as in our lists);
- If-Match, else If-Unmodified-Since false -> 412; then If-None-Match, else If-Modified-Since -> 304
  (RFC 9110 §13.2.2 order);
- a single ``Range`` -> 206 (If-Range honoured); several ranges: multipart from starlette's
  FileResponse for local blobs, the full 200 from other backends (RFC 9110 allows ignoring Range);
- deleted (a tombstone) -> 410 Gone; never held -> 404;
- every answer about a set carries ``Link: <BASE/SET/capabilitylist.xml>; rel="resourcesync"``
  (§6.3.3: the Capability List covering the resource).

Local blobs (``BlobStore.local_path``) get starlette's FileResponse answers (Range, HEAD, If-Range,
multipart). Small ones (``SMALL_BLOB``) are read in the worker-thread call that looked the row up and
answered from memory (HEADs of any size too, without reading): one thread hop per request instead of
five, which cost far more than the work. Big ones go out through FileResponse itself, as do the Range
headers only it decides (several ranges, malformed -> 400, unsatisfiable -> 416). Other backends are
streamed from ``BlobStore.open`` in a worker thread.
"""

from __future__ import annotations

import os
import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from email.utils import format_datetime, parsedate_to_datetime
from pathlib import Path
from typing import BinaryIO

import trio
from starlette.requests import Request
from starlette.responses import FileResponse, Response, StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from ..store.blobs import BlobStore
from ..store.rows import Resource

CHUNK = 64 * 1024
#: Local blobs up to this size are read whole (or the span asked for) and answered from memory.
SMALL_BLOB = 256 * 1024
DEFAULT_TYPE = "application/octet-stream"
#: One span, ``bytes=a-b``: ``a-``, ``-n`` (headers are Latin-1: no digits but 0-9 can occur).
_RANGE = re.compile(r"bytes=([0-9]*)-([0-9]*)\Z")
_HEADER_SAFE = re.compile(r"[\x20-\x7e]+\Z")


def http_date(dt: datetime) -> str:
    return format_datetime(dt.astimezone(UTC), usegmt=True)


def etag_of(r: Resource) -> str:
    return f'"{r.sha256}"'


def _etag_match(header: str, etag: str) -> bool:
    """If-None-Match uses the weak comparison (RFC 9110 §13.1.2): ``W/`` is ignored."""
    if header.strip() == "*":
        return True
    tags = [t.strip() for t in header.split(",")]
    return any((t[2:] if t.startswith("W/") else t) == etag for t in tags)


class LiteRequest:
    """What answering a resource reads of a request (the method, a few headers by lower-case name):
    the hot route (``fastpath.py``) builds one without starlette's Request."""

    __slots__ = ("headers", "method")

    def __init__(self, method: str, headers: dict[str, str]) -> None:
        self.method, self.headers = method, headers


AnyRequest = Request | LiteRequest


def conditional_answer(request: AnyRequest, r: Resource, headers: dict[str, str]) -> Response | None:
    """412 or 304 for a live resource when the request's preconditions say so (RFC 9110 §13.2.2 order:
    If-Match, else If-Unmodified-Since, then If-None-Match, else If-Modified-Since); None: answer it."""
    if precondition_failed(request, r):
        return Response(status_code=412, headers=conditional_headers(headers))
    if not_modified(request, r):
        return Response(status_code=304, headers=conditional_headers(headers))
    return None


def precondition_failed(request: AnyRequest, r: Resource) -> bool:
    """If-Match (strong comparison: a weak tag never matches, RFC 9110 §13.1.1), else If-Unmodified-Since
    (§13.1.4), is false for the resource as held: 412."""
    im = request.headers.get("if-match")
    if im is not None:
        if im.strip() == "*":
            return False
        return etag_of(r) not in [t.strip() for t in im.split(",")]
    ius = request.headers.get("if-unmodified-since")
    if ius:
        since = _http_time(ius)
        return since is not None and r.updated_at.replace(microsecond=0) > since
    return False


def _http_time(value: str) -> datetime | None:
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def not_modified(request: AnyRequest, r: Resource) -> bool:
    """RFC 9110 §13.2.2: If-None-Match decides when present, else If-Modified-Since (GET/HEAD)."""
    return validators_match(request, etag_of(r), r.updated_at)


def validators_match(request: AnyRequest, etag: str, last_modified: datetime | None) -> bool:
    """True when the request's If-None-Match (else If-Modified-Since) says its copy is current: 304."""
    inm = request.headers.get("if-none-match")
    if inm is not None:
        return _etag_match(inm, etag[2:] if etag.startswith("W/") else etag)
    ims = request.headers.get("if-modified-since")
    if ims and last_modified is not None:
        since = _http_time(ims)
        return since is not None and last_modified.replace(microsecond=0) <= since
    return False


def _token(value: str | None) -> str | None:
    """A stored upstream value fit for an HTTP header (visible ASCII and spaces), else None."""
    if value and _HEADER_SAFE.match(value):
        return value
    return None


def resource_headers(r: Resource, link: str) -> dict[str, str]:
    """The headers of a 200 for a live resource (Content-Length and Content-Range are added per answer)."""
    h = {
        "etag": etag_of(r),
        "last-modified": http_date(r.updated_at),
        "link": link,
        "content-type": _token(r.type) or DEFAULT_TYPE,
        "accept-ranges": "bytes",
    }
    encoding = _token(r.encoding)
    if encoding:
        h["content-encoding"] = encoding
    return h


def gone(link: str | None, status: int) -> Response:
    """404 (never held) or 410 (deleted upstream): plain text, with the resourcesync link if known."""
    text = "gone: deleted at the source\n" if status == 410 else "not found\n"
    return Response(
        text, status_code=status, media_type="text/plain", headers={"link": link} if link else None
    )


def resource_answer(request: Request, r: Resource, blobs: BlobStore, link: str) -> Response | None:
    """The response for a held resource (live or tombstone), blocking (stat, read of a local blob): for
    the worker thread that looked the row up. None when the blob is in a non-local store: then
    ``remote_response`` gives it, without tying the caller's database connection to the store's calls.
    """
    if r.deleted or not r.sha256:
        return gone(link, 410)
    headers = resource_headers(r, link)
    early = conditional_answer(request, r, headers)
    if early is not None:
        return early
    inline = blobs.read_inline(r.sha256)
    if inline is not None:
        answer = memory_response(request, headers, inline)
        if answer is not None:
            return answer
        # Several ranges, a malformed or unsatisfiable one: FileResponse decides those, from the file
        # the store writes for whoever reads its blobs as files (``blob_name``), as for any local blob.
        blobs.blob_name(r.sha256)
    path = blobs.local_path(r.sha256)
    if path is None:
        return None
    return _local(request, r, path, headers)


async def remote_response(request: Request, r: Resource, blobs: BlobStore, link: str) -> Response:
    """The response for a live resource whose blob is in a non-local store (``resource_answer`` gave
    None): streamed from ``BlobStore.open``."""
    assert r.sha256 is not None
    try:
        size = await trio.to_thread.run_sync(blobs.size, r.sha256)
    except (FileNotFoundError, KeyError):
        return _missing(r)
    return _stream_blob(request, r, blobs, size, resource_headers(r, link))


def conditional_headers(headers: dict[str, str]) -> dict[str, str]:
    """The headers of a 304: the validators and the link, not the representation's type, encoding or
    ranges (RFC 9110 §15.4.5)."""
    return {k: v for k, v in headers.items() if k in ("etag", "last-modified", "link")}


def _local(request: Request, r: Resource, path: Path, headers: dict[str, str]) -> Response:
    """What FileResponse answers, built here when it needs no more than one span of a small blob (or no
    bytes: HEAD), since FileResponse reads through several worker-thread hops; FileResponse otherwise."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return _missing(r)
    head = request.method == "HEAD"
    span = _span(request, headers, st.st_size) if head or st.st_size <= SMALL_BLOB else None
    if span is None:
        return _FileAnswer(path, headers=headers, stat_result=st)
    status, start, end = span
    if head:
        return Response(status_code=status, headers=headers)
    try:
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read(end - start)
    except FileNotFoundError:  # removed since the stat
        return _missing(r)
    return Response(data, status_code=status, headers=headers)


class _FileAnswer(FileResponse):
    """FileResponse without Accept-Ranges on a 206, as every other answer here (and nginx's)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_206(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 206:
                message["headers"] = [(k, v) for k, v in message["headers"] if k != b"accept-ranges"]
            await send(message)

        await super().__call__(scope, receive, send_206)


def _span(request: AnyRequest, headers: dict[str, str], size: int) -> tuple[int, int, int] | None:
    """``_file_span``, and its Content-Length (+ Content-Range) added to ``headers`` (in FileResponse's
    order); None (headers untouched) when FileResponse must decide."""
    span = _file_span(request, headers, size)
    if span is not None:
        status, start, end = span
        headers["content-length"] = str(end - start)
        if status == 206:
            headers["content-range"] = f"bytes {start}-{end - 1}/{size}"
            del headers["accept-ranges"]  # as nginx answers a 206 (RFC 9110 §14.3: optional)
    return span


def memory_response(request: AnyRequest, headers: dict[str, str], data: bytes) -> Response | None:
    """The answer ``_local`` gives for a small blob, from its bytes in memory (``headers`` is consumed);
    None when FileResponse must decide (several ranges, 400, 416)."""
    span = _span(request, headers, len(data))
    if span is None:
        return None
    status, start, end = span
    if request.method == "HEAD":
        return Response(status_code=status, headers=headers)
    return Response(data[start:end] if status == 206 else data, status_code=status, headers=headers)


def head_response(request: AnyRequest, headers: dict[str, str], size: int) -> Response | None:
    """The answer ``_local`` gives to a HEAD of a local blob of ``size`` bytes (``headers`` consumed)."""
    span = _span(request, headers, size)
    return None if span is None else Response(status_code=span[0], headers=headers)


def _file_span(request: AnyRequest, headers: dict[str, str], size: int) -> tuple[int, int, int] | None:
    """(status, start, end exclusive) as FileResponse decides them for one span of the blob (whole: no
    Range, or an If-Range that does not match; a single satisfiable ``bytes=a-b``); None for every other
    Range header, which FileResponse answers itself (multipart, 400, 416)."""
    rng = request.headers.get("range")
    if rng is None:
        return 200, 0, size
    if_range = request.headers.get("if-range")
    if if_range is not None and if_range not in (headers["etag"], headers["last-modified"]):
        return 200, 0, size
    m = _RANGE.match(rng)  # as written: FileResponse decides every other form
    if m is None:
        return None
    a, b = m.groups()
    if a:
        start, end = int(a), (int(b) + 1 if b and int(b) < size else size)
    elif b:
        start, end = max(size - int(b), 0), size
    else:
        return None
    if start >= size or start >= end:  # 416, 400
        return None
    return 206, start, end


def _missing(r: Resource) -> Response:
    # The state names a blob the store lacks (deleted by hand, a gc bug): a server-side fault.
    return Response(
        f"content of {r.uri} is missing from the store\n", status_code=500, media_type="text/plain"
    )


def single_range(header: str | None, size: int) -> tuple[int, int] | str | None:
    """``Range: bytes=a-b`` -> (start, end exclusive); None for "send it all" (absent, malformed or
    several ranges); "unsatisfiable" for a range starting beyond the end (-> 416)."""
    if not header:
        return None
    m = _RANGE.match(header.strip().replace(" ", ""))
    if m is None:
        return None
    a, b = m.groups()
    if not a and not b:
        return None
    if not a:  # suffix: the last b bytes
        n = int(b)
        if n == 0:
            return "unsatisfiable"
        return max(0, size - n), size
    start = int(a)
    end = size if not b else min(int(b) + 1, size)
    if b and int(b) < start:
        return None
    if start >= size:
        return "unsatisfiable"
    return start, end


def _stream_blob(
    request: Request, r: Resource, blobs: BlobStore, size: int, headers: dict[str, str]
) -> Response:
    rng = single_range(request.headers.get("range"), size)
    if_range = request.headers.get("if-range")
    if if_range is not None and if_range.strip() not in (headers["etag"], headers["last-modified"]):
        rng = None
    if rng == "unsatisfiable":
        return Response(
            status_code=416, headers={"content-range": f"bytes */{size}", "link": headers["link"]}
        )
    status, start, end = 200, 0, size
    if isinstance(rng, tuple):
        status, (start, end) = 206, rng
        headers["content-range"] = f"bytes {start}-{end - 1}/{size}"
        del headers["accept-ranges"]
    headers["content-length"] = str(end - start)
    if request.method == "HEAD":
        return Response(status_code=status, headers=headers)
    assert r.sha256 is not None
    return StreamingResponse(_read(blobs, r.sha256, start, end), status_code=status, headers=headers)


async def _read(blobs: BlobStore, sha256: str, start: int, end: int) -> AsyncIterator[bytes]:
    f: BinaryIO = await trio.to_thread.run_sync(blobs.open, sha256)
    try:
        await trio.to_thread.run_sync(f.seek, start)
        left = end - start
        while left > 0:
            chunk = await trio.to_thread.run_sync(f.read, min(CHUNK, left))
            if not chunk:
                return
            left -= len(chunk)
            yield chunk
    finally:
        f.close()


__all__ = [
    "SMALL_BLOB",
    "LiteRequest",
    "conditional_answer",
    "conditional_headers",
    "etag_of",
    "gone",
    "head_response",
    "http_date",
    "memory_response",
    "not_modified",
    "precondition_failed",
    "remote_response",
    "resource_answer",
    "resource_headers",
    "single_range",
    "validators_match",
]
