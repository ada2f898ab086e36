"""The state seam: what harvest/, publish/, status and the commands may ask of rsagg's state.

``StateStore`` is a structural ``Protocol``: the SQL state written once in store/sql/, run by the SQLite
backend (store/state.py, embedded) or the PostgreSQL one (store/postgres.py), satisfies it without naming
it. Callers annotate with ``StateStore`` and obtain one from ``store.open.open_state(config)``; only the
store knows where the state lives and how it is opened.

The rules every backend keeps (docs/architecture.md invariants 1-3):

- ``apply`` and ``finish_baseline`` write the resource rows, their changelog records, the cursor and the
  retry bookkeeping (``RetryChanges``) in ONE transaction: a crash never half-applies a batch, never
  applies one twice.
- The changelog's ``seq`` only grows and is never reused; its ``datetime`` (rsagg's clock) never goes
  back, so seq order is datetime order.
- Resource ids are never reused (rows are tombstoned, not deleted); iterators page by id / seq and hold
  bounded memory whatever the size of the state.
- Rows come back as the values of ``store/rows.py`` (times as aware UTC ``datetime``), never as a
  backend's own row type; nothing of a backend (connection, cursor, transaction) crosses this seam.
- Every writing method is one transaction of its own and commits before it returns (``version()``
  grows); reads need no snapshot across their statements unless their docstring says so. Every method
  is safe to call from any thread; a backend serialises what its connection needs serialised.
- Ids (``id`` of hub subscriptions, verifications, deliveries, notify subscriptions, dump runs and
  packages) are assigned by the backend, grow, and are never reused (SQLite ``AUTOINCREMENT``;
  PostgreSQL ``GENERATED ALWAYS AS IDENTITY`` / a sequence).
- Fencing (many ``rsagg run`` nodes on one state, ``cluster.py``): while a ``Fence`` is current
  (``fenced(fence)``, a context variable, so it follows the call into ``trio.to_thread`` worker threads),
  EVERY write method checks, inside its own transaction and before it writes, that the fence's lease is
  still granted to its node with its epoch and not expired, and raises ``LeaseLost`` otherwise, writing
  nothing. A node that stalled past its lease (SIGSTOP, a long GC pause, a partition) and lost the source
  to another node can therefore never overwrite the newer holder's rows, changelog or cursor. In
  PostgreSQL the check reads the lease row ``FOR SHARE``, so a concurrent grant waits for the write.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from datetime import datetime
from typing import Any, Protocol

from ..errors import StoreFailure
from ..rs.model import Entry
from .rows import (
    Change,
    Cursor,
    DocumentRow,
    DumpPackage,
    DumpPart,
    DumpRun,
    FailedChange,
    Fence,
    HubBacklog,
    HubDelivery,
    HubRequestState,
    HubSubscription,
    HubVerification,
    LeaseGrant,
    LeaseRow,
    LogRecord,
    NodeRow,
    NotifyChannel,
    NotifyNotice,
    NotifySubscription,
    Reconciliation,
    Resource,
    ResourceValidators,
    RetryChanges,
    SetRow,
    SourceRow,
)

#: A live resource row as ``iter_live_listing`` gives it when it has no links, md extras or entry extras
#: (the common case of a list of millions): ``(id, uri, sha256, length, type, encoding, md5, sha1, lastmod,
#: upstream_datetime, updated_at)`` with the times as UTC W3C text (``parse_w3c`` reads them; the
#: fixed-width form ``...T12:00:00.000000Z`` is what a list writer can copy without parsing). A plain
#: tuple, not a ``Resource``: building objects per row cost more than writing the entry.
_Text = str | None
ListingRow = tuple[int, str, _Text, int | None, _Text, _Text, _Text, _Text, _Text, _Text, str]


class EmptySnapshot(Exception):
    """``finish_baseline`` of a baseline that saw no resource while the set holds some: refused, nothing
    is swept. A snapshot that lists nothing (an empty or failed export, a list read as something else)
    must never delete everything held; the caller reports the source degraded."""


class StateUnavailable(StoreFailure):
    """The state cannot be reached (a server backend's server is down, refuses the login, ...): a sync
    that meets it fails and the next one tries again; at start-up rsagg stops with this one line (exit 1).
    Its message names the state's location without secrets."""


#: The lease the current task writes under (None: not in a cluster, or not a source's task).
FENCE: ContextVar[Fence | None] = ContextVar("rsagg_fence", default=None)


class LeaseLost(Exception):
    """A write under a fence whose lease is no longer current: another node holds the source now (or the
    lease expired). Nothing was written; the node must drop the source."""

    def __init__(self, fence: Fence, holder: str | None, epoch: int | None, why: str) -> None:
        super().__init__(
            f"source={fence.source}: node {fence.node} lost its lease (epoch {fence.epoch}): {why}; "
            f"the lease is now epoch {epoch} held by {holder or 'nobody'}: write refused"
        )
        self.fence, self.holder, self.epoch = fence, holder, epoch


@contextlib.contextmanager
def fenced(fence: Fence | None) -> Iterator[None]:
    """Run the block's state writes under ``fence`` (see the module docstring)."""
    token = FENCE.set(fence)
    try:
        yield
    finally:
        FENCE.reset(token)


class StateStore(Protocol):
    """Sources, their documents and sets, the resources held, the changelog and the cursors."""

    def close(self) -> None: ...

    def version(self) -> int:
        """A change counter: grows whenever anyone (this handle, another one, another process) commits a
        write to the state, and stays the same while nobody does. Cheap enough to call per HTTP request
        without a worker thread (the publisher's hot cache drops everything when it moved). Only
        equality matters to callers; a backend may use e.g. SQLite's ``PRAGMA data_version`` plus its
        own commits, or a PostgreSQL sequence bumped by every writing transaction (or
        ``pg_stat_database.xact_commit``-like counters) read in one round trip."""
        ...

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
        retries: RetryChanges | None = None,
        validators: Sequence[ResourceValidators] = (),
    ) -> list[Change]:
        """Apply a batch of changes, move the cursor, write ``retries`` and keep the upstream's
        ``validators`` of the versions fetched, in ONE transaction (store/sql/changes.py
        ``Changes.apply`` has the per-change rules)."""
        ...

    def begin_baseline(self, set_id: int) -> int: ...

    def finish_baseline(
        self, set_id: int, generation: int, cursor: Cursor, retries: RetryChanges | None = None
    ) -> list[Change]:
        """Tombstone what the baseline did not see, store the cursor, close the baseline and write
        ``retries``, in one transaction; raises EmptySnapshot (and changes nothing) when the baseline saw
        no resource of the set while it holds live ones. ``retries``: ``failed`` rows are upserted by (set_id,
        ``entry.loc``) — a new row has attempts 1, first_at = last_at = the batch's changelog time; an
        existing one gets attempts + 1 and the new change, entry, kind, message and last_at — then the
        rows of the ``cleared`` URIs of the set are deleted."""
        ...

    # -- retries: failed changes kept to be tried again at the set's next sync ----------------------

    def pending_retries(self, set_id: int) -> list[tuple[Entry, str, int]]:
        """(entry, change, attempts) of the set's retries not ended, oldest first_at first. The entry is
        stored as given to ``FailedChange`` (State: a one-entry ResourceSync document) and comes back
        equal."""
        ...

    def retry_uris(self, set_id: int) -> set[str]: ...

    def holds_nothing(self, set_id: int) -> bool:
        """No resource row (tombstones included) and no retry of the set: nothing for a sync to look up
        or to try again."""
        ...

    def end_retries(self, set_id: int, ended: Iterable[str], reason: str) -> None:
        """Mark the retries of ``ended`` URIs (not already ended) as ended: kind "ended", message
        ``f"{reason} (last failure: {kind}: {message})"``, last_at now."""
        ...

    def retry_rows(self, sources: Iterable[str] = ()) -> list[dict]: ...

    def clear_retries(self, sources: Iterable[str] = (), *, ended_only: bool = False) -> int: ...

    def retries_by_source(self) -> dict[str, dict[str, int]]: ...

    # -- reconciliation with the Resource List (harvest/reconcile.py) -------------------------------

    def reconciliation(self, set_id: int) -> Reconciliation | None:
        """The set's last reconciliation, None when it never had one."""
        ...

    def put_reconciliation(self, rec: Reconciliation) -> None:
        """Replace the set's last reconciliation with ``rec``."""
        ...

    def resource_validators(self, set_id: int, uris: Sequence[str]) -> dict[str, ResourceValidators]:
        """The upstream's validators of the versions the set holds of ``uris``, by uri (one read); a
        uri whose row is deleted, or holds no validators, is absent."""
        ...

    def put_resource_validators(self, set_id: int, rows: Sequence[ResourceValidators]) -> None:
        """Store (replace) the validators of the resources in ``rows``, each for the version it names:
        those of a version the set does not hold (any more) are dropped. A later change of a row's
        content drops its validators."""
        ...

    # -- reads ------------------------------------------------------------------------------------

    def resource(self, set_id: int, uri: str) -> Resource | None: ...

    def resources(self, set_id: int, uris: Sequence[str]) -> dict[str, Resource]:
        """The stored rows (tombstones too) of those of ``uris`` the set holds, by uri: ``resource`` for
        a batch in one read (the pipeline looks up every change it is given; a server backend would
        otherwise pay a round trip for each)."""
        ...

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

    def referenced_hashes(self, retention: Any = None) -> Iterator[str]:
        """Every sha256 gc must keep, each once, ascending, as of one instant (``retention``: a
        ``store.retention.Retention``, None keeps every changelog record's)."""
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

    # -- versions of one resource row (publish/versions.py; §14.6, RFC 7089) ------------------------

    def log_record(self, seq: int) -> LogRecord | None: ...

    def iter_versions(
        self, resource_id: int, after_seq: int = 0, limit: int | None = None
    ) -> Iterator[LogRecord]: ...

    def count_versions(self, resource_id: int, after_seq: int = 0, limit: int | None = None) -> int: ...

    def version_at(self, resource_id: int, when: datetime) -> LogRecord | None: ...

    # -- the embedded WebSub hub (websub/hub.py) ---------------------------------------------------
    # Four tables: subscriptions (unique per (topic, callback)), verifications waiting (unique per
    # (topic, callback): a newer request replaces the waiting one), payloads, and deliveries (one per
    # subscription and payload, deleted with their subscription; a payload no delivery names is deleted
    # by the writes that end deliveries). Deliveries of one subscription go out in id order.

    def hub_subscriptions(self, topic: str | None = None) -> list[HubSubscription]:
        """Every subscription (of ``topic``), expired or not, by id (at most the hub's
        ``max_subscriptions``: a list)."""
        ...

    def hub_backlog(self) -> HubBacklog:
        """How many verifications and deliveries wait."""
        ...

    def hub_request_state(self, topic: str, callback: str) -> HubRequestState:
        """For a new subscription request: how many verifications wait in all, whether one of this pair
        does, whether the pair is subscribed."""
        ...

    def hub_subscriber_callbacks(self) -> list[str]:
        """The callback URL of every distinct (topic, callback) pair that is subscribed or has a waiting
        ``subscribe`` verification (the hub counts them per host)."""
        ...

    def hub_queue_verification(self, request: HubVerification, requested: datetime) -> int:
        """Queue ``request`` (its ``id`` is ignored), replacing a waiting verification of the same
        (topic, callback) (the replacement gets a new id); returns the new id."""
        ...

    def hub_due_verifications(self, exclude: Sequence[int], limit: int) -> list[HubVerification]:
        """Up to ``limit`` waiting verifications whose id is not in ``exclude`` (in flight), by id."""
        ...

    def hub_finish_verification(
        self, verification: HubVerification, subscribe: bool | None, lease_expires: datetime, now: datetime
    ) -> bool:
        """End a verification, in one transaction: delete its row by id — False (and nothing else
        changes) when it is gone (a newer request replaced it). Then ``subscribe`` None: nothing more (a
        failed verification leaves the subscription as it was, WebSub §5.1); False: delete the pair's
        subscription (unsubscribed or denied) and the payloads left without delivery; True: insert the
        subscription, or for an existing pair update its secret, lease_seconds, lease_expires and
        ``verified`` (keeping its id and pending deliveries); ``created``/``verified`` = ``now``."""
        ...

    def hub_queue_payload(
        self,
        topic: str,
        body: bytes,
        content_type: str,
        link: str,
        now: datetime,
        max_pending_per_subscription: int,
    ) -> tuple[int, int]:
        """Store a payload and one delivery (due ``now``) for every subscription of ``topic`` whose lease
        ends after ``now``; then keep only the newest ``max_pending_per_subscription`` deliveries of
        each subscription of the topic (WebSub §7 self-imposed limits). One transaction; no subscriber:
        nothing stored. Returns (deliveries queued, deliveries dropped)."""
        ...

    def hub_expire(self, now: datetime) -> int:
        """Delete the subscriptions whose lease ended (``lease_expires <= now``; WebSub §5.3.1), their
        deliveries and orphaned payloads; returns how many subscriptions. Writes nothing when none."""
        ...

    def hub_next_lease_end(self) -> datetime | None:
        """The earliest ``lease_expires`` of all subscriptions (None: none)."""
        ...

    def hub_due_deliveries(
        self, now: datetime, exclude_subscriptions: Sequence[int], limit: int
    ) -> list[HubDelivery]:
        """Up to ``limit`` deliveries that may go out now: each the oldest (lowest id) pending delivery
        of its subscription, due (``next_attempt <= now``), of a subscription not in
        ``exclude_subscriptions``; by (next_attempt, id)."""
        ...

    def hub_next_delivery_due(self, exclude_subscriptions: Sequence[int]) -> datetime | None:
        """The earliest ``next_attempt`` among the oldest pending delivery of each subscription not in
        ``exclude_subscriptions`` (None: none)."""
        ...

    def hub_finish_delivery(self, delivery: HubDelivery, outcome: str, retry_at: datetime, error: str) -> str:
        """Record a delivery attempt, in one transaction; returns the final outcome. "ok": delete the
        delivery. "gone" (410): delete its subscription (and so its deliveries). "retry": when the
        subscription is gone or ``retry_at`` is not before its lease end, delete the delivery and return
        "failed"; else set attempts = ``delivery.attempts`` + 1, next_attempt = ``retry_at``,
        last_error = ``error[:500]``. Unless the result is "retry", delete payloads left without a
        delivery."""
        ...

    # -- rsagg's own notification channels (websub/notifier.py) -------------------------------------

    def notify_channels(self) -> list[NotifyChannel]:
        """Every saved channel (one per topic; a few per published set), by topic."""
        ...

    def put_notify_channels(self, channels: Sequence[NotifyChannel], drop: Sequence[str] = ()) -> None:
        """Insert or replace ``channels`` (by topic; ``snapshot`` is JSON-able) and delete the channels
        of the ``drop`` topics, in one transaction."""
        ...

    # -- rsagg's subscriptions to upstream channels (websub/subscriber.py) ----------------------------

    def notify_subscriptions(self, token: str | None = None) -> list[NotifySubscription]:
        """Every subscription, by id (a few per configured source: a list); or the one of ``token`` (a
        callback that reached a cluster node: an indexed read)."""
        ...

    def add_notify_subscription(self, subscription: NotifySubscription) -> int:
        """Store a new subscription (its ``id`` ignored; ``token`` unique) and return its id."""
        ...

    def put_notify_subscriptions(self, subscriptions: Sequence[NotifySubscription]) -> None:
        """Update stored subscriptions (every field, by id), in one transaction."""
        ...

    def delete_notify_subscription(self, subscription_id: int) -> None: ...

    # -- the shared inbox of upstream notifications (a cluster: websub/subscriber.py) ----------------
    # Any node's callback records a verified delivery; the node holding the source's lease takes it.

    def add_notify_notice(self, source: str, token: str, body: bytes, *, limit: int) -> str:
        """Record a delivery for ``source`` (never fenced: any node answers the hub). Deduplicated by
        (token, SHA-256 of body); at most ``limit`` rows per source: a full inbox records one poll
        request (token "") instead. Returns "added", "duplicate" or "full"."""
        ...

    def notify_notices(self, source: str, limit: int = 100) -> list[NotifyNotice]:
        """The oldest waiting notices of ``source``, in arrival order."""
        ...

    def delete_notify_notices(self, ids: Sequence[int]) -> None:
        """Taken by the source's holder (fenced like its other writes)."""
        ...

    # -- rsagg's own Resource Dumps and Change Dumps (publish/dumps.py) -------------------------------
    # A Resource Dump run has numbered packages (part 1..n); a Change Dump has one package per Change
    # List window (unique per (set_name, window)). Blob hashes are lowercase hex SHA-256. Every run and
    # package is recorded with the ``fingerprint`` of the publish filter and configuration it was built
    # under; reads return only those of the fingerprint asked for (the others are withdrawn).

    def dump_latest_run(self, set_name: str, fingerprint: str = "") -> DumpRun | None:
        """The set's newest Resource Dump run (highest id) built under ``fingerprint``."""
        ...

    def dump_runs(self, set_name: str, fingerprint: str = "") -> list[DumpRun]:
        """The set's kept Resource Dump runs built under ``fingerprint``, oldest first."""
        ...

    def dump_run_packages(self, run_id: int) -> list[DumpPackage]:
        """The packages of a run, by part."""
        ...

    def change_dump_packages(self, set_name: str, fingerprint: str = "") -> list[DumpPackage]:
        """The set's Change Dump packages built under ``fingerprint``, by window."""
        ...

    def dump_package(
        self, set_name: str, kind: str, number: int, fingerprint: str = ""
    ) -> DumpPackage | None:
        """A package built under ``fingerprint`` by its URL number: the package id for kind
        "resourcedump" (also of an older run still kept), the window for "changedump"; None for a number
        no row can have (negative, beyond 2**63 - 1); ValueError for another kind."""
        ...

    def has_change_dump(self, set_name: str, fingerprint: str = "") -> bool: ...

    def add_resource_dump(
        self,
        set_name: str,
        set_ids: Sequence[int],
        last_seq: int,
        at: datetime,
        completed: datetime,
        parts: Sequence[DumpPart],
        created: datetime,
        fingerprint: str = "",
    ) -> list[DumpPackage]:
        """Record a run (its packages, entries and bytes summed from ``parts``) and its packages (part
        1.. in the order given; ``created`` on all), in one transaction; returns the packages as stored,
        by part."""
        ...

    def prune_resource_dumps(self, set_name: str, keep: int) -> set[str]:
        """Delete all but the newest ``keep`` runs of the set and their packages, in one transaction;
        returns the ZIP and manifest hashes the deleted packages named (the caller deletes the blobs
        nothing else names)."""
        ...

    def withdraw_dumps(self, fingerprint: str) -> set[str]:
        """Delete every run and package not built under ``fingerprint`` (NULL: built before fingerprints
        were recorded), in one transaction; returns the hashes they named, as ``prune_resource_dumps``."""
        ...

    def add_change_dump(
        self,
        set_name: str,
        window: int,
        first_seq: int,
        last_seq: int,
        part: DumpPart,
        created: datetime,
        fingerprint: str = "",
    ) -> DumpPackage:
        """Record the Change Dump package of a window (``from_``/``until`` of ``part``); returns it."""
        ...

    def change_dump_seqs(self) -> dict[str, int]:
        """Per published set name, the highest changelog seq its Change Dump packages cover."""
        ...

    def dump_hashes(self) -> Iterator[str]:
        """Every blob a dump package names (ZIP and manifest), each once, ascending: gc merges it with
        ``referenced_hashes``."""
        ...

    # -- cluster: nodes and source leases (cluster.py); these never run under a fence ---------------

    def node_heartbeat(
        self,
        node: str,
        *,
        lease_seconds: float,
        pid: int | None,
        host: str | None,
        url: str | None,
        follows: Sequence[str] | None = None,
    ) -> None:
        """Record that ``node`` is alive for ``lease_seconds`` more (created on first beat), and the names
        of the sources whose notification channels it follows (``NodeRow.follows``; None: not said)."""
        ...

    def node_stopped(self, node: str) -> None:
        """A clean stop: the node is no longer alive (its leases are released separately)."""
        ...

    def nodes(self) -> list[NodeRow]: ...

    def claim_leases(
        self, node: str, sources: Sequence[str], *, want: int, lease_seconds: float
    ) -> list[Fence]:
        """Grant ``node`` up to ``want`` of ``sources`` whose lease is free or expired (each grant: a new
        epoch and a lease history row; an expired grant's history row ends at its expiry). Concurrent
        claimers never get the same source (PostgreSQL: ``FOR UPDATE SKIP LOCKED``)."""
        ...

    def renew_leases(self, fences: Sequence[Fence], *, lease_seconds: float) -> list[Fence]:
        """Extend the fences still current and unexpired; returns those (the others are lost)."""
        ...

    def release_lease(self, fence: Fence) -> bool:
        """Give the source up now (if ``fence`` is still current): another node may claim it at once."""
        ...

    def leases(self) -> list[LeaseRow]: ...

    def lease_history(self, source: str | None = None) -> list[LeaseGrant]:
        """Every grant (of one source), by source and epoch."""
        ...


__all__ = [
    "FENCE",
    "Change",
    "Cursor",
    "DocumentRow",
    "DumpPackage",
    "DumpPart",
    "DumpRun",
    "EmptySnapshot",
    "FailedChange",
    "Fence",
    "HubBacklog",
    "HubDelivery",
    "HubRequestState",
    "HubSubscription",
    "HubVerification",
    "LeaseGrant",
    "LeaseLost",
    "LeaseRow",
    "LogRecord",
    "NodeRow",
    "NotifyChannel",
    "NotifySubscription",
    "Resource",
    "RetryChanges",
    "SetRow",
    "SourceRow",
    "StateStore",
    "StateUnavailable",
    "fenced",
]
