"""The values the state stores and returns: what a state backend (store/interface.py) speaks.

Frozen rows (``SourceRow``, ``SetRow``, ``DocumentRow``) are snapshots read from the state; ``Change``
and ``Cursor`` go in, ``Resource`` and ``LogRecord`` come out of the change pipeline. Times are aware
``datetime`` in UTC; how a backend stores them is its dialect's business (store/sql/dialect.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from ..rs.model import Entry, Link
from ..rs.w3cdt import parse_w3c


def format_dt(dt: datetime | None) -> str | None:
    """Fixed-width W3C Datetime in UTC with microseconds, ``YYYY-MM-DDThh:mm:ss.ffffffZ`` (a valid W3C
    Datetime, §7): with a fixed width, text order equals time order (``w3cdt.format_w3c`` drops a zero
    fraction, and ``...:05Z`` sorts after ``...:05.1Z``, hence this writer). How the SQLite state stores
    times, and the text form callers compare or show."""
    if dt is None:
        return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    elif dt.utcoffset():
        dt = dt.astimezone(UTC)
    return dt.isoformat(timespec="microseconds")[:-6] + "Z"  # drop "+00:00"


def parse_dt(text: str | None) -> datetime | None:
    """``format_dt``'s text (or any W3C Datetime) back to an aware datetime; None stays None."""
    if text is None:
        return None
    if len(text) == 27 and text[26] == "Z":
        return datetime.fromisoformat(text)  # our own fixed form: the C parser is fastest
    return parse_w3c(text)


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
    progress_what: str | None  # the harvester's live figures as JSON (progress_text.progress_figures)
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


@dataclass(frozen=True, slots=True)
class Reconciliation:
    """The last reconciliation of a set with its Resource List (``harvest/reconcile.py``): when, against
    which lists, what it found and what it repaired. ``lists``: Resource List URL -> {"etag", "at"} as
    read then (a list whose ``at`` or ETag moves since is reconciled again)."""

    set_id: int
    reconciled_at: datetime
    cause: str  # why it ran: scheduled | list moved | never reconciled | incomplete | audit --repair
    lists: dict[str, dict[str, str | None]]
    differences: int  # entries that differed or could not be decided without a fetch
    repaired: dict[str, int]  # logged change kind (created, updated, deleted) -> repairs applied
    unrepaired: int  # differences whose repair failed (kept as retries)
    complete: bool  # every list was read (False: nothing held was deleted as unlisted)
    error: str | None = None


@dataclass(frozen=True, slots=True)
class ResourceValidators:
    """What the upstream answered with the held version of a resource (``sha256``): its ``ETag`` and
    ``Last-Modified``, sent back as ``If-None-Match`` / ``If-Modified-Since`` when it is re-checked, and
    the ``lastmod`` announced when that version was last fetched or confirmed (an entry announcing it
    again needs no fetch, though the held row keeps its own lastmod: a no-op changes no row; read back,
    the row's own lastmod when no other one confirmed it). ``last_modified`` is kept only as an
    IMF-fixdate (``store.sql.codec.http_date_in``)."""

    uri: str
    sha256: str
    etag: str | None
    last_modified: str | None
    lastmod: datetime | None = None


# -- retries (failed changes kept to be tried again; written with the batch that failed them) --------


@dataclass(frozen=True, slots=True)
class FailedChange:
    """A change whose fetch failed: kept with its upstream entry, to be tried again at the next sync."""

    entry: Entry  # the upstream entry as read (its ``loc`` is the URI)
    change: str  # created | updated | deleted, as upstream said
    kind: str  # the failure's kind (e.g. hash_mismatch, http_status)
    message: str


@dataclass(frozen=True, slots=True)
class RetryChanges:
    """Retry bookkeeping committed in the same transaction as a batch (``apply``/``finish_baseline``):
    ``failed`` are recorded (a repeat of a URI already waiting counts one more attempt and replaces its
    entry, change, kind and message), then the retries of the ``cleared`` URIs are forgotten."""

    failed: Sequence[FailedChange] = ()
    cleared: Sequence[str] = ()


# -- the embedded WebSub hub ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HubSubscription:
    """A verified subscription of the embedded hub (WebSub §5.3.1); ``id`` is never reused."""

    id: int
    topic: str
    callback: str
    secret: str | None  # hub.secret as given (the hub signs with it); None = none
    lease_seconds: int
    lease_expires: datetime
    created: datetime
    verified: datetime  # last successful verification (renewals move it)


@dataclass(frozen=True, slots=True)
class HubRequestState:
    """What the hub's tables hold for a (topic, callback) pair when a subscription request comes in."""

    waiting: int  # verifications waiting, all pairs
    pending: bool  # a verification of this pair is waiting (the request replaces it)
    subscribed: bool  # this pair is an active subscription (a subscribe request is a renewal)


@dataclass(frozen=True, slots=True)
class HubVerification:
    """A subscription request waiting for its verification of intent (WebSub §5.3) or denial (§5.2)."""

    id: int  # 0 for one not yet queued; a newer request for the pair gets a new id
    mode: str  # subscribe | unsubscribe | denied
    topic: str
    callback: str
    secret: str | None
    lease_seconds: int | None  # the lease granted (clamped) for subscribe
    reason: str | None  # hub.reason for denied


@dataclass(frozen=True, slots=True)
class HubDelivery:
    """The oldest pending delivery of one subscription, with what the POST needs (WebSub §7)."""

    id: int
    subscription_id: int
    callback: str
    secret: str | None
    attempts: int  # failed attempts so far
    body: bytes
    content_type: str
    link: str  # the Link header sent with it


@dataclass(frozen=True, slots=True)
class HubBacklog:
    """How much work waits in the hub: verifications and deliveries."""

    verifications: int
    deliveries: int


# -- rsagg's own notification channels and the subscriptions to upstream channels ------------------


@dataclass
class NotifyChannel:
    """One of rsagg's notification channels (a topic): how far it has published (a working copy)."""

    topic: str
    set_name: str
    kind: str  # change-notification | framework-notification
    last_seq: int  # changelog seq published up to (change channels)
    last_until: datetime | None  # until of the latest payload: the next one's from
    body: bytes = b""  # the latest payload (the topic document)
    snapshot: dict[str, list[Any]] = field(default_factory=dict)  # framework: url -> JSON-able list


@dataclass(frozen=True, slots=True)
class NotifyNotice:
    """A verified delivery on an upstream channel waiting in the shared inbox (migration 10) for the node
    that holds its source: ``token`` names the subscription, ``body`` is the payload as received; a row
    with ``token`` "" and no body asks that node for a poll (a dropped or unusable delivery)."""

    id: int
    source: str
    token: str
    body: bytes


@dataclass
class NotifySubscription:
    """A subscription of rsagg to one upstream channel of one set of one source (a working copy);
    ``id`` 0 until stored (``add_notify_subscription`` gives it one)."""

    id: int
    token: str  # callback path segment: BASE/_websub/<token>
    secret: str  # hub.secret (needed to check signatures)
    source: str
    capabilitylist_url: str
    kind: str  # change-notification | framework-notification
    topic: str
    hub: str
    wanted: bool = True  # False: being unsubscribed (then forgotten)
    pending: str | None = None  # "subscribe" | "unsubscribe": a request of ours awaiting verification
    requested: datetime | None = None
    lease_seconds: int | None = None
    lease_expires: datetime | None = None
    verified: datetime | None = None
    last_until: datetime | None = None  # until of the last change notification taken
    failures: int = 0
    next_attempt: datetime | None = None

    def live(self, now: datetime) -> bool:
        return self.wanted and self.lease_expires is not None and self.lease_expires > now


# -- rsagg's own Resource Dumps and Change Dumps ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DumpPart:
    """A dump package just built (its ZIP and manifest blobs committed), to be recorded."""

    sha256: str  # the ZIP blob
    length: int
    manifest_sha256: str  # manifest.xml, a blob of its own
    manifest_length: int
    entries: int
    bytes: int  # bitstream bytes (uncompressed)
    at: datetime | None = None  # Resource Dump package: §11.2 at / completed
    completed: datetime | None = None
    from_: datetime | None = None  # Change Dump package: §13.2 from / until
    until: datetime | None = None


@dataclass(frozen=True, slots=True)
class DumpRun:
    """One Resource Dump run: a snapshot of a published set cut into packages."""

    id: int  # never reused
    set_name: str
    at: datetime  # snapshot started (§11.1 at)
    completed: datetime  # snapshot completed (§11.1 completed)
    last_seq: int  # global changelog seq when the snapshot started
    set_ids: tuple[int, ...]  # the state sets it covers, ascending
    packages: int
    entries: int
    bytes: int
    created: datetime


@dataclass(frozen=True, slots=True)
class DumpPackage:
    """A recorded Resource Dump or Change Dump package; ``id`` is never reused (Resource Dump package
    URLs name it; Change Dump package URLs name the ``window``)."""

    id: int
    set_name: str
    kind: str  # resourcedump | changedump
    run: int | None  # resourcedump: its DumpRun.id
    part: int  # 1-based package number within the run (1 for changedump)
    window: int | None  # changedump: Change List window K
    first_seq: int | None  # changedump: the window is seq in (first_seq, last_seq]
    last_seq: int | None
    sha256: str
    length: int
    manifest_sha256: str
    manifest_length: int
    at: datetime | None
    completed: datetime | None
    from_: datetime | None
    until: datetime | None
    entries: int
    bytes: int
    created: datetime


@dataclass(frozen=True, slots=True)
class Fence:
    """A source's lease as one node holds it: every state write for the source carries it, and the
    backend refuses the write (``LeaseLost``) unless this grant is still the current one (its epoch)."""

    source: str
    node: str
    epoch: int  # grows by one at every grant of the source's lease, never reused


@dataclass(frozen=True, slots=True)
class NodeRow:
    """A ``rsagg run`` process of a cluster, as its heartbeats left it in the state."""

    name: str
    pid: int | None
    host: str | None  # the machine's hostname
    url: str | None  # where it serves (server.base_url)
    started_at: datetime
    heartbeat_at: datetime
    expires_at: datetime  # alive while heartbeat_at + cluster.lease_seconds has not passed
    stopped_at: datetime | None  # set by a clean stop
    #: The sources whose notification channels the node follows (enabled, notifications on), as its last
    #: heartbeat said; None: it did not say (then no node may take its subscriptions for orphans).
    follows: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class LeaseRow:
    """Who may harvest a source now (``node`` None: nobody; an expired lease may be taken over)."""

    source: str
    node: str | None
    epoch: int
    granted_at: datetime | None
    expires_at: datetime | None


@dataclass(frozen=True, slots=True)
class LeaseGrant:
    """One grant of a source's lease (the lease history): from ``granted_at`` to ``ended_at`` (None:
    still held); ``end_reason`` is released, expired or lost. Grants of a source never overlap."""

    source: str
    node: str
    epoch: int
    granted_at: datetime
    ended_at: datetime | None
    end_reason: str | None


__all__ = [
    "Change", "Cursor", "DocumentRow", "DumpPackage", "DumpPart", "DumpRun", "FailedChange", "Fence",
    "HubBacklog", "HubDelivery", "HubRequestState", "HubSubscription", "HubVerification", "LeaseGrant",
    "LeaseRow", "LogRecord", "NodeRow", "NotifyChannel", "NotifyNotice", "NotifySubscription", "Resource",
    "RetryChanges", "SetRow", "SourceRow",
]  # fmt: skip
