"""The values the state stores and returns: what a state backend (store/interface.py) speaks.

Frozen rows (``SourceRow``, ``SetRow``, ``DocumentRow``) are snapshots read from the state; ``Change``
and ``Cursor`` go in, ``Resource`` and ``LogRecord`` come out of the change pipeline. Times are aware
``datetime`` in UTC; how a backend stores them is its own business (store/state.py: fixed-width text).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from ..rs.model import Link


@dataclass(slots=True)
class Cursor:
    """Where incremental sync of a set stands in the upstream change stream (§12); None = unknown."""

    baseline_at: datetime | None = None  # `at` of the snapshot the baseline came from
    changelist_url: str | None = None  # change list we were reading last
    last_datetime: datetime | None = None  # datetime (or lastmod) of the last applied change
    same_datetime_count: int = 0  # changes with exactly last_datetime applied so far (ties)
    list_index: int = 0  # entries consumed in changelist_url (for lists without datetimes)
    list_until: datetime | None = None  # `until` of changelist_url when closed


@dataclass(slots=True)
class Change:
    """One change entering the store (from a Resource List, Change List, dump or notification)."""

    uri: str
    change: str  # created | updated | deleted
    sha256: str | None = None
    length: int | None = None
    type: str | None = None
    encoding: str | None = None
    hashes: dict[str, str] = field(default_factory=dict)  # upstream-announced tokens, verified
    lastmod: datetime | None = None
    upstream_datetime: datetime | None = None
    links: list[Link] = field(default_factory=list)
    md_extra: dict[str, str] = field(default_factory=dict)
    entry_extra: list[str] = field(default_factory=list)
    generation: int | None = None  # set when part of a baseline


@dataclass(slots=True)
class Resource:
    """A resource as held now (``deleted`` rows are tombstones that keep the last known content)."""

    id: int
    set_id: int
    uri: str
    sha256: str | None
    length: int | None
    type: str | None
    encoding: str | None
    hashes: dict[str, str]  # "sha-256" (ours) plus "md5"/"sha-1" when upstream announced them
    lastmod: datetime | None
    upstream_datetime: datetime | None
    links: list[Link]
    md_extra: dict[str, str]
    entry_extra: list[str]
    deleted: bool
    updated_at: datetime  # rsagg's clock: when this row last changed state
    generation: int | None


@dataclass(slots=True)
class LogRecord:
    """One changelog record: what rsagg republishes as a change (datetime is rsagg's own clock)."""

    seq: int
    set_id: int
    resource_id: int
    uri: str
    change: str
    datetime: datetime
    sha256: str | None
    length: int | None
    type: str | None


@dataclass(frozen=True, slots=True)
class SourceRow:
    """A configured upstream Source as the state knows it, with its status (``State.set_source_status``)."""

    name: str
    url: str
    state: str | None  # e.g. idle, discovering, baseline, incremental, syncing, error; None = never run
    last_error: str | None
    last_error_at: datetime | None
    last_success: datetime | None
    last_attempt: datetime | None
    next_attempt: datetime | None  # when the next try is due (backoff)
    failures: int  # consecutive failures
    progress_done: int | None
    progress_total: int | None
    progress_what: str | None  # what the progress counts, e.g. a Resource List URL
    created_at: datetime
    updated_at: datetime
    using_url: str | None  # the URL discovery used when the configured one failed


@dataclass(frozen=True, slots=True)
class SetRow:
    """One upstream Capability List of a Source: the unit of cursors, resources and the changelog."""

    id: int
    source: str
    capabilitylist_url: str
    name: str  # stable short name for republished paths
    generation: int  # last baseline generation begun
    baseline_generation: int | None  # the baseline in progress, None when none


@dataclass(frozen=True, slots=True)
class DocumentRow:
    """A fetched capability document's validators and kept body (answers a conditional request's 304)."""

    url: str
    source: str
    capability: str | None
    etag: str | None
    last_modified: str | None  # the HTTP header as received (RFC 9110 form, not W3C)
    sha256: str | None
    fetched_at: datetime


__all__ = ["Change", "Cursor", "DocumentRow", "LogRecord", "Resource", "SetRow", "SourceRow"]
