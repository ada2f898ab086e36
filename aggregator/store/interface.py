"""The state seam: what harvest/, publish/, status and the commands may ask of rsagg's state.

``StateStore`` is a structural ``Protocol``: ``store/state.py``'s ``State`` (SQLite through sqlite-utils,
the embedded backend) satisfies it without naming it, and so must any other backend (a server database).
Callers annotate with ``StateStore`` and obtain one from ``store.state.open_state(config)``; only the
store knows where the state lives and how it is opened.

The rules every backend keeps (docs/architecture.md invariants 1-3):

- ``apply`` and ``finish_baseline`` write the resource rows, their changelog records, the cursor and the
  ``also`` bookkeeping in ONE transaction: a crash never half-applies a batch, never applies one twice.
- The changelog's ``seq`` only grows and is never reused; its ``datetime`` (rsagg's clock) never goes
  back, so seq order is datetime order.
- Resource ids are never reused (rows are tombstoned, not deleted); iterators page by id / seq and hold
  bounded memory whatever the size of the state.
- Rows come back as the values of ``store/rows.py`` (times as aware UTC ``datetime``), never as a
  backend's own row type.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol

from ..rs.model import Entry
from .rows import Change, Cursor, DocumentRow, LogRecord, Resource, SetRow, SourceRow

#: ``also(transaction, now)`` of ``apply``/``finish_baseline``: bookkeeping committed with the changes.
#: ``transaction`` is the backend's handle on the open transaction (``sqlite3.Connection`` for ``State``),
#: ``now`` the batch's changelog time in fixed-width W3C form.
Also = Callable[[Any, str], None]

#: A live resource row as ``iter_live_listing`` gives it when it has no links, md extras or entry extras
#: (the common case of a list of millions): ``(id, uri, sha256, length, type, encoding, md5, sha1, lastmod,
#: upstream_datetime, updated_at)`` with the times as UTC W3C text (``parse_w3c`` reads them; the
#: fixed-width form ``...T12:00:00.000000Z`` is what a list writer can copy without parsing). A plain
#: tuple, not a ``Resource``: building objects per row cost more than writing the entry.
_Text = str | None
ListingRow = tuple[int, str, _Text, int | None, _Text, _Text, _Text, _Text, _Text, _Text, str]


class StateStore(Protocol):
    """Sources, their documents and sets, the resources held, the changelog and the cursors."""

    def close(self) -> None: ...

    # -- sources ----------------------------------------------------------------------------------

    def upsert_source(self, name: str, url: str) -> None: ...

    def sources(self) -> list[SourceRow]: ...

    def source(self, name: str) -> SourceRow | None: ...

    def set_source_status(self, name: str, **fields: Any) -> None:
        """Update status columns (``SourceRow`` fields from ``state`` to ``using_url``); KeyError for an
        unknown source, ValueError for an unknown field."""
        ...

    def put_upstream_notes(
        self, source: str, deviations: Sequence[dict], skipped: Mapping[str, str]
    ) -> None: ...

    def upstream_notes(self, source: str) -> dict[str, list[dict]]: ...

    # -- documents --------------------------------------------------------------------------------

    def document(self, url: str) -> DocumentRow | None: ...

    def put_document(
        self,
        url: str,
        source: str,
        capability: str | None,
        *,
        etag: str | None,
        last_modified: str | None,
        sha256: str | None,
    ) -> None: ...

    # -- sets, cursors, the change pipeline -------------------------------------------------------

    def ensure_set(self, source: str, capabilitylist_url: str, *, name: str | None = None) -> int: ...

    def sets(self, source: str | None = None) -> list[SetRow]: ...

    def cursor(self, set_id: int) -> Cursor | None: ...

    def apply(
        self,
        set_id: int,
        changes: Sequence[Change],
        cursor: Cursor | None = None,
        also: Also | None = None,
    ) -> list[Change]: ...

    def begin_baseline(self, set_id: int) -> int: ...

    def finish_baseline(
        self, set_id: int, generation: int, cursor: Cursor, also: Also | None = None
    ) -> list[Change]: ...

    # -- retries: failed changes kept to be tried again at the set's next sync ----------------------

    def pending_retries(self, set_id: int) -> list[tuple[Entry, str, int]]: ...

    def retry_uris(self, set_id: int) -> set[str]: ...

    def end_retries(self, set_id: int, ended: Iterable[str], reason: str) -> None: ...

    def retry_rows(self, sources: Iterable[str] = ()) -> list[dict]: ...

    def clear_retries(self, sources: Iterable[str] = (), *, ended_only: bool = False) -> int: ...

    def retries_by_source(self) -> dict[str, dict[str, int]]: ...

    # -- reads ------------------------------------------------------------------------------------

    def resource(self, set_id: int, uri: str) -> Resource | None: ...

    def iter_resources(
        self,
        set_id: int | None = None,
        *,
        include_deleted: bool = False,
        after_id: int = 0,
        limit: int | None = None,
    ) -> Iterator[Resource]: ...

    def count_resources(
        self, set_id: int | None = None, *, source: str | None = None, include_deleted: bool = False
    ) -> int: ...

    def iter_changelog(
        self, after_seq: int = 0, *, set_id: int | None = None, limit: int | None = None
    ) -> Iterator[LogRecord]: ...

    def last_seq(self) -> int: ...

    def referenced_hashes(self) -> Iterator[str]:
        """Every sha256 gc must keep, each once, ascending, as of one instant."""
        ...

    # -- reads for publishing (a published set is a list of state sets) ---------------------------

    def history_start(self, set_ids: Sequence[int]) -> datetime | None: ...

    def count_live(self, set_ids: Sequence[int]) -> int: ...

    def live_part_boundaries(self, set_ids: Sequence[int], size: int) -> list[int]: ...

    def live_more_than(self, set_ids: Sequence[int], n: int) -> bool: ...

    def iter_live_part_boundaries(self, set_ids: Sequence[int], size: int) -> Iterator[int]: ...

    def live_part_boundary(self, set_id: int, after_id: int, size: int) -> int | None: ...

    def live_after(self, set_ids: Sequence[int], after_id: int) -> bool: ...

    def rows_version(
        self, set_ids: Sequence[int], after_id: int = 0, until_id: int | None = None
    ) -> tuple[int, datetime | None]: ...

    def set_last_seq(self, set_ids: Sequence[int]) -> int: ...

    def iter_live(
        self, set_ids: Sequence[int], *, after_id: int = 0, until_id: int | None = None
    ) -> Iterator[Resource]: ...

    def iter_live_listing(
        self, set_ids: Sequence[int], *, after_id: int = 0, until_id: int | None = None
    ) -> Iterator[ListingRow | Resource]:
        """``iter_live`` for writing lists: the rows without links or extras as ``ListingRow`` tuples,
        the others as ``Resource``; same rows, same order."""
        ...

    def resource_in(self, set_ids: Sequence[int], uri: str) -> Resource | None: ...

    def live_set_of(self, set_ids: Sequence[int], uri: str) -> int | None: ...

    def iter_log_range(
        self, set_ids: Sequence[int], after_seq: int = 0, until_seq: int | None = None
    ) -> Iterator[tuple[LogRecord, Resource | None]]: ...

    def log_windows(self, set_ids: Sequence[int], size: int) -> list[int]: ...

    def log_datetime(self, seq: int) -> datetime | None: ...


__all__ = [
    "Also",
    "Change",
    "Cursor",
    "DocumentRow",
    "LogRecord",
    "Resource",
    "SetRow",
    "SourceRow",
    "StateStore",
]
