"""A ResourceSync document streamed to a client as it is rendered from the state (or read from its
cached rendering): the response the publisher app and the TimeMaps share."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING

import trio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ..rs.write import iter_document_bytes
from .doccache import CacheWriter

if TYPE_CHECKING:
    from ..rs.model import Doc

log = logging.getLogger("rsagg.publish")

XML = "application/xml"
#: A document stream is cut after this long (hypercorn does not notice every stalled client).
DOCUMENT_DEADLINE = 3600.0
#: Bytes of a rendering handed over per worker-thread call (each call costs wake-ups on both sides).
DOC_CHUNK = 256 * 1024


class DocumentResponse(StreamingResponse):
    """A ResourceSync document streamed as it is read from the state (or from its cached rendering);
    gives its connection back to the pool when done, whatever happened (finished, client gone,
    deadline). ``tee``: the rendering also goes there, committed to the cache once whole."""

    def __init__(
        self,
        doc: Doc | Iterator[bytes],
        release: Callable[[], None],
        *,
        headers: dict[str, str] | None = None,
        tee: CacheWriter | None = None,
    ) -> None:
        chunks = (
            iter_document_bytes(*doc, chunk_size=DOC_CHUNK, flush_head=True)
            if isinstance(doc, tuple)
            else doc
        )
        self._chunks = _teed(chunks, tee) if tee is not None else chunks
        self._release = release
        super().__init__(self._body(), media_type=XML, headers=headers)

    async def _body(self) -> AsyncIterator[bytes]:
        try:
            while True:
                chunk = await trio.to_thread.run_sync(next, self._chunks, None)
                if chunk is None:
                    return
                yield chunk
        finally:
            close = getattr(self._chunks, "close", None)
            if close is not None:
                close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            with trio.move_on_after(DOCUMENT_DEADLINE) as cs:
                await super().__call__(scope, receive, send)
            if cs.cancelled_caught:
                log.warning("document %s cut after %.0f s", scope.get("path"), DOCUMENT_DEADLINE)
        finally:
            with trio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            self._release()


def _teed(chunks: Iterator[bytes], writer: CacheWriter) -> Iterator[bytes]:
    """``chunks``, written to ``writer`` too: committed when the last one went out, else dropped."""
    whole = False
    try:
        for chunk in chunks:
            writer.write(chunk)
            yield chunk
        whole = True
    finally:
        if whole:
            writer.commit()
        else:
            writer.abort()


__all__ = ["DOCUMENT_DEADLINE", "DOC_CHUNK", "XML", "DocumentResponse"]
