"""Prometheus metrics of one rsagg process (``/metrics`` on the publisher, ``config/grafana-dashboard.json``).

Why one ``Metrics`` object with its own ``CollectorRegistry`` instead of prometheus-client's global one:
tests run several harvesters and publishers in one process, and each must count only its own work. The
composition makes one per process (run/compose.py) and hands it to the harvest and the publisher app.

Where the numbers come from (what is wired where):

- harvest counters: the pipeline reports each committed batch (``committed``: resources created/updated
  and deleted, failures by ``Failure.kind``); ``sync_source`` reports each sync (``sync_finished``).
- upstream HTTP: the Fetcher's ``metrics_hook(host, status, seconds, bytes)`` (``fetch_hook``). The
  source label comes from a context variable set by ``sync_source`` and ``Pipeline.run`` (trio tasks
  inherit it from the task that starts them; the Fetcher starts its document downloads with the
  caller's context), never from the host or URL.
- blob store: ``FileBlobStore.on_commit(written, deduplicated)`` counts writes and dedup savings; the
  store's size is a walk of its folders in a background thread (at most every STORE_SCAN_EVERY seconds)
  plus what was written since.
- state (sources, cursors, changelog position, progress): read at scrape time (``refresh_from_state``),
  so lag is "now" minus the last applied change whenever Prometheus asks.
- plugins (``Plugins.failures``), hub and notifications (``Notifications.counters``: ``hub.``,
  ``notifier.``, ``subscriber.`` keys): read at scrape time from the objects that count them.
- served requests: ``ServedMetrics``, an ASGI middleware labelling by the matched route's path template.
  With ``server.workers``, the daemon's scrape adds what the worker processes counted
  (``SERVED_FAMILIES``, ``worker_families``; ``workers.py``).

Naming follows the Prometheus conventions: ``rsagg_`` prefix, counters end in ``_total``, base units
(``_seconds``, ``_bytes``), timestamps as ``_timestamp_seconds``, labels of low cardinality only
(``source``, ``set``, ``kind``, ``route``...; never a host or URL).
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from itertools import accumulate
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from .. import __version__
from ..errors import CountedError
from ..rs.parse import DocumentError
from ..scope import current_source
from ..store.inline import INLINE_FILE, inline_totals

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from ..store.interface import StateStore

log = logging.getLogger("rsagg.metrics")

#: Text exposition format 0.0.4 (what ``generate_latest`` writes).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: Seconds between two walks of a FileBlobStore's folders (its size in between: walk + writes since).
STORE_SCAN_EVERY = 600.0
#: Seconds a scrape waits for a store walk it started (a big store finishes in the background).
STORE_SCAN_WAIT = 1.0
#: Seconds between two counts of the resources held per source (a count reads an index).
COUNT_EVERY = 30.0

#: The families of serving (``ServedMetrics``, the fast lane, ``serverguard``): what the worker processes
#: count too, and the daemon's ``/metrics`` sums (``Metrics._collect_served``).
SERVED_FAMILIES = frozenset(
    ("rsagg_http_requests", "rsagg_http_request_duration_seconds", "rsagg_server_refused")
)

STATUS_CLASSES = ("2xx", "3xx", "4xx", "5xx", "error")
#: Error kinds always exposed (0 until they happen): the Fetcher's FetchError kinds, plugin failures,
#: and "sync" for a sync that failed for another reason (discovery, a malformed Capability List...).
#: "refused": the outbound address policy refused the connection (outbound.py).
#: "store": the machine's store could not be written or read (errors.StoreFailure: disk full, read-only
#: state, the store folder gone, the state's server away).
ERROR_KINDS = (
    "fixity", "parse", "http", "timeout", "network", "size", "patch", "dump", "plugin", "sync", "refused",
    "store",
)  # fmt: skip
#: The rules of ``outbound.REASONS`` (not imported: metrics imports no network code).
OUTBOUND_REASONS = ("loopback", "private", "link-local", "unspecified", "multicast", "reserved", "self")
#: ``serverguard.REASONS``: why the server cut a client off.
SERVER_REASONS = ("connections", "head_size", "head_time", "body_size", "body_time", "slow_reader")
FETCH_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
#: The ``le`` labels of ``FETCH_BUCKETS`` as exposed, ``+Inf`` last (``_collect_fetches``).
_FETCH_LE = (*map(floatToGoString, FETCH_BUCKETS), "+Inf")
#: Upper bounds of ``rsagg_sync_duration_seconds`` (seconds: 0.1 s to two days).
SYNC_BUCKETS = (0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 12 * 3600.0, 48 * 3600.0)
_SYNC_LE = (*map(floatToGoString, SYNC_BUCKETS), "+Inf")
#: The counter families of ``_collect_harvest``, in the order exposed: name, help, label names.
_HARVEST_COUNTERS = (
    ("rsagg_resources_harvested", "Resources stored (created or updated) by harvesting", ("source",)),
    ("rsagg_resources_deleted", "Resources tombstoned by harvesting", ("source",)),
    ("rsagg_syncs", "Syncs of a source finished, by result: ok, degraded, error", ("source", "result")),
    (
        "rsagg_upstream_deviations",
        "Deviations from the specification tolerated in upstream documents, by rule "
        "(aggregator/harvest/deviations.py)",
        ("source", "rule"),
    ),
    (
        "rsagg_reconciliations",
        "Reconciliations of a set with its Resource List (harvest/reconcile.py), by result: in_sync, "
        "repaired, unrepaired (a repair failed), incomplete (a list could not be read)",
        ("source", "result"),
    ),
    (
        "rsagg_reconcile_repairs",
        "Differences from the Resource List repaired by reconciliation, by the change applied "
        "(created: missed creation, updated: missed update, deleted: held but not listed)",
        ("source", "kind"),
    ),
)

#: Every rsagg family (as prometheus-client names them: counters without ``_total``) and its type; the
#: tests hold the exposition to this list and ``config/grafana-dashboard.json`` to what it exposes.
FAMILIES: dict[str, str] = {
    "rsagg_build_info": "gauge",
    # harvest
    "rsagg_resources_harvested": "counter",
    "rsagg_resources_deleted": "counter",
    "rsagg_syncs": "counter",
    "rsagg_upstream_deviations": "counter",
    "rsagg_reconciliations": "counter",
    "rsagg_reconcile_repairs": "counter",
    "rsagg_sync_duration_seconds": "histogram",
    "rsagg_fetched_bytes": "counter",
    "rsagg_upstream_requests": "counter",
    "rsagg_fetch_duration_seconds": "histogram",
    "rsagg_errors": "counter",
    "rsagg_plugin_failures": "counter",
    "rsagg_outbound_refused": "counter",
    "rsagg_server_refused": "counter",
    # sources and change stream (read from the state when scraped)
    "rsagg_source_last_success_timestamp_seconds": "gauge",
    "rsagg_source_last_attempt_timestamp_seconds": "gauge",
    "rsagg_source_state": "gauge",
    "rsagg_source_resources": "gauge",
    "rsagg_sync_lag_seconds": "gauge",
    "rsagg_sync_progress_done": "gauge",
    "rsagg_sync_progress_expected": "gauge",
    "rsagg_set_cursor_timestamp_seconds": "gauge",
    "rsagg_changelog_last_seq": "gauge",
    # blob store
    "rsagg_store_objects": "gauge",
    "rsagg_store_bytes": "gauge",
    "rsagg_store_written_objects": "counter",
    "rsagg_store_written_bytes": "counter",
    "rsagg_store_dedup_objects": "counter",
    "rsagg_store_dedup_saved_bytes": "counter",
    # served
    "rsagg_http_requests": "counter",
    "rsagg_http_request_duration_seconds": "histogram",
    # notifications
    "rsagg_hub_deliveries": "counter",
    "rsagg_hub_verifications": "counter",
    "rsagg_hub_publishes": "counter",
    "rsagg_notifications_published": "counter",
    "rsagg_notifications_received": "counter",
    "rsagg_notifications_verified": "counter",
    "rsagg_notifications_rejected": "counter",
    "rsagg_notifications_processed": "counter",
    "rsagg_upstream_subscriptions": "counter",
    # cluster (cluster.py): labelled with this process's node name
    "rsagg_cluster_node_info": "gauge",
    "rsagg_cluster_nodes_live": "gauge",
    "rsagg_cluster_leases_held": "gauge",
    "rsagg_cluster_lease_grants": "counter",
    "rsagg_cluster_leases_lost": "counter",
    "rsagg_cluster_fenced_writes": "counter",
}


def sample_names() -> set[str]:
    """The series names PromQL sees for FAMILIES (``_total`` counters, histogram ``_bucket``...)."""
    out: set[str] = set()
    for name, kind in FAMILIES.items():
        if kind == "counter":
            out.add(name + "_total")
        elif kind == "histogram":
            out.update(name + suffix for suffix in ("_bucket", "_sum", "_count"))
        else:
            out.add(name)
    return out


# ``x_created`` series next to every counter and histogram: Prometheus does not use them in text
# format 0.0.4 and they double the series; process-wide setting of prometheus-client.
disable_created_metrics()

# Hub (``websub/hub.py`` metrics(event, outcome)) and subscriber (``websub/subscriber.py`` COUNTERS)
# outcomes exposed with 0 before they first happen, so dashboards and alerts see the series.
HUB_DELIVERY = ("ok", "retry", "failed", "gone", "dropped")
HUB_VERIFICATION = ("subscribed", "unsubscribed", "failed", "denied")
NOTIFICATION_ACCEPTED = ("accepted", "duplicate", "overflow", "parse_error")  # signature verified
NOTIFICATION_REJECTED = ("unsigned", "bad_signature", "too_large", "unknown_callback")
NOTICE_OUTCOMES = ("applied", "duplicate", "known", "gap", "unplaceable", "framework")
SUBSCRIPTION_OUTCOMES = {
    "subscribe.requested": "requested",
    "subscribe.failed": "failed",
    "renewals": "renewed",
    "unsubscribe.requested": "unsubscribed",
}

_HEX2 = re.compile(r"[0-9a-f]{2}\Z")
_SHA256 = re.compile(r"[0-9a-f]{64}\Z")


def status_class(status: int | None) -> str:
    """ "2xx".."5xx" for an HTTP status, "error" when no response came (network error, timeout)."""
    if status is None or not 100 <= status < 600:
        return "error"
    return f"{status // 100}xx" if status >= 200 else "2xx"  # 1xx never ends a request: count as 2xx


def _timestamp(dt: datetime | None) -> float | None:
    return dt.timestamp() if dt is not None else None


class _Durations:
    """One source's durations per bucket of ``bounds`` (and bytes): its upstream requests
    (``Metrics.fetch_hook``, ``FETCH_BUCKETS``) or its syncs (``Metrics.sync_finished``, ``SYNC_BUCKETS``,
    no bytes), as prometheus-client's Histogram would count them."""

    __slots__ = ("bounds", "bytes", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...] = FETCH_BUCKETS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0
        self.bytes = 0

    def observe(self, seconds: float) -> None:
        if seconds == seconds:  # NaN: in no bucket, nor in the count (as prometheus-client's)
            self.counts[bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds

    def buckets(self, le: tuple[str, ...]) -> list[tuple[str, int]]:
        """(``le`` label, count at or below it) per bucket: ``le`` are the bounds as exposed."""
        return list(zip(le, accumulate(self.counts), strict=True))

    def copy(self) -> _Durations:
        other = _Durations(self.bounds)
        other.counts, other.sum, other.bytes = list(self.counts), self.sum, self.bytes
        return other


class _Callback(Collector):
    """Families computed when scraped (counts kept by other objects, values read from the state)."""

    def __init__(self, fn: Callable[[], Iterable[Metric]]) -> None:
        self._fn = fn

    def collect(self) -> Iterable[Metric]:
        try:
            return list(self._fn())
        except Exception:  # a scrape must not fail for one broken source of numbers
            log.exception("metrics collector failed")
            return []


class StoreSize:
    """Objects and bytes in a FileBlobStore: a walk of its folders and its small.db now and then, plus
    writes since (an inline blob with a file for a front end counts twice).

    Why not walk at every scrape: a store of millions of blobs takes seconds to walk. Blobs another
    process deletes (``rsagg gc``) are noticed at the next walk.
    """

    def __init__(self, every: float = STORE_SCAN_EVERY) -> None:
        self.every = every
        self.root: str | None = None
        self._lock = threading.Lock()
        self._base: tuple[int, int] | None = None
        self._since = [0, 0]  # objects, bytes written since the last walk began
        self._scanned_at = -float("inf")
        self._thread: threading.Thread | None = None
        self._done = threading.Event()

    def attach(self, store: Any) -> None:
        from ..store.blobs import FileBlobStore

        if isinstance(store, FileBlobStore):
            self.root = str(store.root)

    def added(self, objects: int, nbytes: int) -> None:
        with self._lock:
            self._since[0] += objects
            self._since[1] += nbytes

    def values(self) -> tuple[int, int] | None:
        with self._lock:
            if self._base is None:
                return None
            return self._base[0] + self._since[0], self._base[1] + self._since[1]

    def refresh(self, wait: float = STORE_SCAN_WAIT) -> None:
        """Start a walk when one is due; wait up to ``wait`` seconds for it (blocking: call in a thread)."""
        if self.root is None:
            return
        with self._lock:
            due = time.monotonic() - self._scanned_at >= self.every
            if due and self._thread is None:
                self._scanned_at = time.monotonic()
                self._done.clear()
                self._thread = threading.Thread(target=self._walk, name="rsagg-store-size", daemon=True)
                self._thread.start()
            running = self._thread is not None
        if running and wait > 0:
            self._done.wait(wait)

    def _walk(self) -> None:
        root = self.root
        assert root is not None
        with self._lock:
            before = list(self._since)
        objects = nbytes = 0
        try:
            for top in _dirs(root):
                for mid in _dirs(top.path):
                    with os.scandir(mid.path) as it:
                        for f in it:
                            if _SHA256.match(f.name):
                                try:
                                    nbytes += f.stat(follow_symlinks=False).st_size
                                except FileNotFoundError:
                                    continue
                                objects += 1
            rows, row_bytes = inline_totals(os.path.join(root, INLINE_FILE))
            objects, nbytes = objects + rows, nbytes + row_bytes
        except OSError as exc:
            log.warning("store size: cannot walk %s: %s", root, exc)
        else:
            with self._lock:
                # Writes counted while walking may be in the walk too: a small overcount until the next.
                self._since = [self._since[0] - before[0], self._since[1] - before[1]]
                self._base = (objects, nbytes)
        finally:
            with self._lock:
                self._thread = None
            self._done.set()


def _dirs(path: str) -> list[os.DirEntry[str]]:
    with os.scandir(path) as it:
        return [e for e in it if _HEX2.match(e.name) and e.is_dir(follow_symlinks=False)]


class Metrics:
    """Every metric family of one rsagg process, in its own registry (see the module docstring)."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        process: bool = True,
        plugins: Callable[[], Iterable[Any]] = tuple,
        store: Any = None,
        notifications: Callable[[], Any] | None = None,
    ) -> None:
        """Where scrape-time numbers come from, handed in by the composition: ``plugins``, a getter of
        every ``Plugins`` of the process (failures: the harvest's and each publisher app's); ``store``,
        the blob store (size; dedup via its ``on_commit``); ``notifications``, a getter of the
        ``Notifications`` (hub and subscriber counters)."""
        r = self.registry = registry if registry is not None else CollectorRegistry()
        #: source -> the one line of a store failure the state could not record (``failure_not_recorded``).
        self.unrecorded_failures: dict[str, str] = {}
        if process:  # process_* (CPU, memory, fds), python_gc_*, python_info
            ProcessCollector(registry=r)
            r.register(PLATFORM_COLLECTOR)
            r.register(GC_COLLECTOR)
        Gauge("rsagg_build_info", "rsagg version (always 1)", ["version"], registry=r).labels(
            __version__
        ).set(1)

        # -- harvest: the families of each source's syncs and batches (and the errors, by source and
        # kind), kept as plain sums under one lock and exposed when scraped (``_collect_harvest``, at this
        # place of the exposition; ``_collect_errors``). Why not prometheus-client's Counter and Histogram:
        # the first ``labels()`` of a source builds a child (for a histogram: a value and a lock per
        # bucket, each bucket's label) and every later one checks and looks it up again, about 3,000
        # Python opcodes per source harvested (benchmarks/bench_many_sources.py); a sum costs a dict
        # update. The exposition is the same, byte for byte (tests/test_metrics.py).
        self._lock = threading.Lock()
        self._harvested: dict[str, int] = {}  # source -> resources
        self._deleted: dict[str, int] = {}  # source -> resources
        self._syncs: dict[tuple[str, str], int] = {}  # (source, result) -> syncs
        self._deviations: dict[tuple[str, str], int] = {}  # (source, rule)
        self._reconciliations: dict[tuple[str, str], int] = {}  # (source, result)
        self._repairs: dict[tuple[str, str], int] = {}  # (source, kind) -> repairs
        self._sync_durations: dict[str, _Durations] = {}  # source -> its syncs' durations (no bytes)
        r.register(_Callback(self._collect_harvest))
        self._errors: dict[tuple[str, str], int] = {}  # (source, kind) -> errors; under ``_lock`` too
        #: The upstream requests' families (``fetch_hook``), kept as plain numbers and exposed when
        #: scraped (``_collect_fetches``): requests by (source, status class); per source its bytes, and
        #: its durations as counts per bucket of ``FETCH_BUCKETS`` (the last one: above them all) and
        #: their sum.
        self._requests: dict[tuple[str, str], int] = {}
        self._fetched: dict[str, _Durations] = {}
        self._fetch_lock = threading.Lock()

        self.outbound_refused = Counter(
            "rsagg_outbound_refused",
            "Outbound connections refused by the address policy, by rule (outbound.py)",
            ["reason"],
            registry=r,
        )
        for reason in OUTBOUND_REASONS:
            self.outbound_refused.labels(reason)
        self.server_refused = Counter(
            "rsagg_server_refused",
            "Clients the server cut off or refused, by bound (serverguard.py)",
            ["reason"],
            registry=None,  # a serving family: ``_collect_served``
        )
        for reason in SERVER_REASONS:
            self.server_refused.labels(reason)

        # -- blob store
        self.store_written_objects = Counter(
            "rsagg_store_written_objects", "Blobs written to the store (new content)", registry=r
        )
        self.store_written_bytes = Counter(
            "rsagg_store_written_bytes", "Bytes of blobs written to the store", registry=r
        )
        self.store_dedup_objects = Counter(
            "rsagg_store_dedup_objects", "Blobs not written because the store had them already", registry=r
        )
        self.store_dedup_bytes = Counter(
            "rsagg_store_dedup_saved_bytes", "Bytes not written because the store had the blob", registry=r
        )
        self.store_size = StoreSize()
        if store is not None:
            self.store_size.attach(store)
            if getattr(store, "on_commit", False) is None:  # FileBlobStore, not yet counted elsewhere
                store.on_commit = self.blobs_committed

        # -- served requests (with the worker processes' counts: ``_collect_served``)
        self.http_requests = Counter(
            "rsagg_http_requests",
            "Requests served by rsagg, by route (path template), method and code",
            ["route", "method", "code"],
            registry=None,
        )
        self.http_duration = Histogram(
            "rsagg_http_request_duration_seconds",
            "Time to serve a request (whole body sent)",
            ["route"],
            registry=None,
        )
        #: (route, method, code) -> its labelled children: ``labels()`` cost more than a hot resource GET's
        #: own work (a few routes x methods x codes: small).
        self._served: dict[tuple[str, str, int], tuple[Any, Any]] = {}

        # -- cluster nodes (cluster.py); a node label, so one dashboard shows every node of a cluster
        self.cluster_node_info = Gauge(
            "rsagg_cluster_node_info", "This process is a cluster node (always 1)", ["node"], registry=r
        )
        self.cluster_nodes_live = Gauge(
            "rsagg_cluster_nodes_live", "Live nodes of the cluster as this node last saw them", ["node"],
            registry=r,
        )  # fmt: skip
        self.cluster_leases_held = Gauge(
            "rsagg_cluster_leases_held", "Source leases this node holds", ["node"], registry=r
        )
        self.cluster_lease_grants = Counter(
            "rsagg_cluster_lease_grants", "Source leases granted to this node", ["node"], registry=r
        )
        self.cluster_leases_lost = Counter(
            "rsagg_cluster_leases_lost",
            "Source leases this node lost before releasing them (renewal refused, write refused)",
            ["node", "reason"],
            registry=r,
        )
        self.cluster_fenced_writes = Counter(
            "rsagg_cluster_fenced_writes",
            "State writes refused because this node's lease of the source was no longer current",
            ["node", "source"],
            registry=r,
        )

        # -- read when scraped
        self._plugins = plugins
        self._notifications: Callable[[], Any] = notifications or (lambda: None)
        self._state_snapshot: dict[str, Any] = {}
        self._counts: tuple[float, dict[str, int]] = (-float("inf"), {})
        r.register(_Callback(self._collect_fetches))
        r.register(_Callback(self._collect_errors))
        r.register(_Callback(self._collect_plugins))
        r.register(_Callback(self._collect_notifications))
        r.register(_Callback(self._collect_state))
        r.register(_Callback(self._collect_store))
        #: The worker processes' prometheus-client files (``count_workers``), None without workers.
        self.workers_dir: str | None = None
        r.register(_Callback(self._collect_served))

    # ------------------------------------------------------------------ wiring

    def count_workers(self, path: str | None) -> None:
        """Add the serving families the worker processes (``workers.py``) write in ``path`` to this
        process's own (None: this process's only)."""
        self.workers_dir = path

    # ------------------------------------------------------------------ hooks (called by rsagg)

    def fetch_hook(self, host: str, status: int | None, seconds: float, nbytes: int) -> None:
        """``Fetcher(metrics_hook=...)``: one upstream HTTP request finished (host is not a label).

        Plain sums rather than prometheus-client's Counter and Histogram objects: called for every
        request, where their locks, checks and bucket scan were about 1.5 % of a harvest's instructions
        at 0 ms (benchmarks/bench_harvest.py). The exposition is the same (tests/test_metrics.py)."""
        source = current_source.get()
        key = (source, status_class(status))
        with self._fetch_lock:
            self._requests[key] = self._requests.get(key, 0) + 1
            durations = self._fetched.get(source)
            if durations is None:
                durations = self._fetched[source] = _Durations()
            durations.observe(seconds)
            durations.bytes += nbytes

    def server_refused_hook(self, reason: str) -> None:
        """``ServerLimits(on_refused=...)``: one client cut off by a server bound."""
        self.server_refused.labels(reason).inc()

    def outbound_refused_hook(self, rule: str) -> None:
        """``AddressPolicy(on_refused=...)``: one connection refused by the outbound policy."""
        self.outbound_refused.labels(rule).inc()

    def committed(self, source: str, applied: Sequence[Any], failures: Iterable[Any]) -> None:
        """A pipeline batch is in the state: ``applied`` Changes (created/updated/deleted) and the
        ``Failure``s of the batch (counted by their kind)."""
        stored = sum(1 for ch in applied if ch.change != "deleted")
        deleted = len(applied) - stored
        if stored or deleted:
            with self._lock:
                if stored:
                    self._harvested[source] = self._harvested.get(source, 0) + stored
                if deleted:
                    self._deleted[source] = self._deleted.get(source, 0) + deleted
        for f in failures:
            self.error(source, f.kind)

    def reconciled(self, source: str, result: str, repaired: dict[str, int]) -> None:
        """A reconciliation ended (``harvest/reconcile.py``): its result and the repairs by kind."""
        with self._lock:
            key = (source, result)
            self._reconciliations[key] = self._reconciliations.get(key, 0) + 1
            for kind, n in repaired.items():
                if n:
                    key = (source, kind)
                    self._repairs[key] = self._repairs.get(key, 0) + n

    def deviation(self, source: str, rule: str) -> None:
        """An upstream deviation rsagg read past (``harvest/deviations.py``)."""
        with self._lock:
            self._deviations[(source, rule)] = self._deviations.get((source, rule), 0) + 1

    def error(self, source: str, kind: str) -> None:
        with self._lock:
            self._errors[(source, kind)] = self._errors.get((source, kind), 0) + 1

    def sync_finished(
        self,
        source: str,
        ok: bool,
        seconds: float,
        exc: BaseException | None = None,
        *,
        degraded: bool = False,
    ) -> None:
        """``sync_source`` ended; ``exc`` is what stopped it (counted as an error of its kind);
        ``degraded``: it went through but skipped a list (result "degraded", never "ok")."""
        key = (source, "ok" if ok else "degraded" if degraded else "error")
        with self._lock:  # (every error kind of a synced source is exposed: ``_collect_errors``)
            self._syncs[key] = self._syncs.get(key, 0) + 1
            durations = self._sync_durations.get(source)
            if durations is None:
                durations = self._sync_durations[source] = _Durations(SYNC_BUCKETS)
            durations.observe(seconds)
        if exc is not None:
            self.error(source, error_kind(exc))
        if ok or degraded:
            self.unrecorded_failures.pop(source, None)

    def failure_not_recorded(self, source: str, line: str) -> None:
        """A sync failed on the store and the state could not take the failure either (a full disk, a
        read-only file): kept here, in this process, so that its status pages say it instead of the
        state's stale "syncing" (``status.collect``'s ``unrecorded``). The next sync that ends clears it."""
        self.unrecorded_failures[source] = line

    def blobs_committed(self, written: Sequence[Any], deduplicated: Sequence[Any]) -> None:
        """``FileBlobStore.on_commit``: BlobInfos written now, and those the store already had."""
        if written:
            n = sum(i.length for i in written)
            self.store_written_objects.inc(len(written))
            self.store_written_bytes.inc(n)
            self.store_size.added(len(written), n)
        if deduplicated:
            self.store_dedup_objects.inc(len(deduplicated))
            self.store_dedup_bytes.inc(sum(i.length for i in deduplicated))

    def served(self, route: str, method: str, code: int, seconds: float) -> None:
        children = self._served.get((route, method, code))
        if children is None:
            children = (self.http_requests.labels(route, method, str(code)), self.http_duration.labels(route))
            self._served[(route, method, code)] = children
        children[0].inc()
        children[1].observe(seconds)

    # ------------------------------------------------------------------ scrape

    def refresh_from_state(self, state: StateStore, *, now: float | None = None) -> None:
        """Read sources, cursors and the changelog position (blocking: in a worker thread), and start a
        walk of the store when one is due. Called by ``/metrics`` before ``exposition``."""
        sources = state.sources()
        sets = state.sets()
        cursors = {s.id: state.cursor(s.id) for s in sets}
        mono = time.monotonic()
        if mono - self._counts[0] >= COUNT_EVERY:
            self._counts = (mono, {s.name: state.count_resources(source=s.name) for s in sources})
        self._state_snapshot = {
            "sources": sources,
            "sets": sets,
            "cursors": cursors,
            "last_seq": state.last_seq(),
            "counts": self._counts[1],
        }
        self.store_size.refresh()

    def exposition(self) -> bytes:
        """The registry in the text format 0.0.4."""
        return generate_latest(self.registry)

    # ------------------------------------------------------------------ scrape-time families

    def _collect_fetches(self) -> Iterator[Metric]:
        with self._fetch_lock:
            requests = dict(self._requests)
            fetched = {source: d.copy() for source, d in self._fetched.items()}
        nbytes = CounterMetricFamily(
            "rsagg_fetched_bytes",
            "Bytes of upstream response bodies (documents and resources)",
            labels=["source"],
        )
        for source, d in fetched.items():
            nbytes.add_metric([source], d.bytes)
        yield nbytes
        counts = CounterMetricFamily(
            "rsagg_upstream_requests",
            "HTTP requests to upstreams by status class (error: no response)",
            labels=["source", "status_class"],
        )
        for (source, status), n in requests.items():
            counts.add_metric([source, status], n)
        yield counts
        durations = HistogramMetricFamily(
            "rsagg_fetch_duration_seconds", "Upstream HTTP request duration, body included", labels=["source"]
        )
        for source, d in fetched.items():
            durations.add_metric([source], d.buckets(_FETCH_LE), d.sum)
        yield durations

    def _collect_harvest(self) -> Iterator[Metric]:
        """The families of ``committed``, ``sync_finished``, ``reconciled`` and ``deviation``: what
        prometheus-client's labelled Counters and Histogram would expose (a series once it happened,
        in the order the series first happened)."""
        with self._lock:
            counters = [
                dict(d)
                for d in (
                    self._harvested,
                    self._deleted,
                    self._syncs,
                    self._deviations,
                    self._reconciliations,
                    self._repairs,
                )
            ]
            durations = [(s, d.copy()) for s, d in self._sync_durations.items()]
        for (name, doc, labels), values in zip(_HARVEST_COUNTERS, counters, strict=True):
            fam = CounterMetricFamily(name, doc, labels=labels)
            for key, n in values.items():
                fam.add_metric(key if isinstance(key, tuple) else (key,), n)
            yield fam
        hist = HistogramMetricFamily(
            "rsagg_sync_duration_seconds", "Duration of a sync of a source", labels=["source"]
        )
        for source, d in durations:
            hist.add_metric([source], d.buckets(_SYNC_LE), d.sum)
        yield hist

    def _collect_errors(self) -> Iterator[Metric]:
        fam = CounterMetricFamily(
            "rsagg_errors",
            "Errors by kind: resource failures, failed syncs, plugin exceptions",
            labels=["source", "kind"],
        )
        with self._lock:
            errors = dict(self._errors)
            synced = {s for s, _ in self._syncs}  # every kind of a synced source: 0 until it happens
        sources = ({s for s, _ in errors} | synced) or {""}
        for source in sorted(sources):
            for kind in ERROR_KINDS:
                if kind != "plugin":
                    errors.setdefault((source, kind), 0)
        plugin_failures = sum(self._plugin_failures().values())
        errors[("", "plugin")] = errors.get(("", "plugin"), 0) + plugin_failures
        for (source, kind), n in sorted(errors.items()):
            fam.add_metric([source, kind], n)
        yield fam

    def _plugin_failures(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for plugins in self._plugins():
            for name in plugins.names():
                out.setdefault(name, 0)
            for name, n in plugins.failures.items():
                out[name] = out.get(name, 0) + n
        return out

    def _collect_plugins(self) -> Iterator[Metric]:
        fam = CounterMetricFamily("rsagg_plugin_failures", "Exceptions raised by plugins", labels=["plugin"])
        for name, n in sorted(self._plugin_failures().items()):
            fam.add_metric([name], n)
        yield fam

    def _collect_notifications(self) -> Iterator[Metric]:
        notes = self._notifications()
        c: Mapping[str, int] = notes.counters if notes is not None else {}

        def family(name: str, doc: str, label: str, prefix: str, known: Iterable[str]) -> Metric:
            fam = CounterMetricFamily(name, doc, labels=[label])
            values = {k[len(prefix) :]: v for k, v in c.items() if k.startswith(prefix)}
            for key in known:
                values.setdefault(key, 0)
            for key, v in sorted(values.items()):
                fam.add_metric([key], v)
            return fam

        yield family(
            "rsagg_hub_deliveries",
            "Hub deliveries to subscribers, by outcome (retry: will retry)",
            "outcome",
            "hub.delivery.",
            HUB_DELIVERY,
        )
        yield family(
            "rsagg_hub_verifications",
            "Hub intent verifications, by outcome",
            "outcome",
            "hub.verification.",
            HUB_VERIFICATION,
        )
        publishes = CounterMetricFamily("rsagg_hub_publishes", "Payloads the hub queued for subscribers")
        publishes.add_metric([], c.get("hub.publish.accepted", 0))
        yield publishes
        yield family(
            "rsagg_notifications_published",
            "rsagg's own notifications handed to the hub, by kind",
            "kind",
            "notifier.published.",
            ("change", "framework"),
        )
        yield family(
            "rsagg_notifications_received",
            "Upstream notification deliveries, by outcome",
            "outcome",
            "subscriber.delivery.",
            NOTIFICATION_ACCEPTED + NOTIFICATION_REJECTED,
        )
        verified = CounterMetricFamily(
            "rsagg_notifications_verified", "Upstream deliveries whose signature checked out"
        )
        verified.add_metric([], sum(c.get(f"subscriber.delivery.{k}", 0) for k in NOTIFICATION_ACCEPTED))
        yield verified
        rejected = CounterMetricFamily(
            "rsagg_notifications_rejected", "Upstream deliveries refused", labels=["reason"]
        )
        for k in NOTIFICATION_REJECTED:
            rejected.add_metric([k], c.get(f"subscriber.delivery.{k}", 0))
        yield rejected
        yield family(
            "rsagg_notifications_processed",
            "Upstream notifications taken up, by outcome",
            "outcome",
            "subscriber.notice.",
            NOTICE_OUTCOMES,
        )
        subs = CounterMetricFamily(
            "rsagg_upstream_subscriptions", "WebSub requests rsagg made to hubs", labels=["outcome"]
        )
        for key, outcome in SUBSCRIPTION_OUTCOMES.items():
            subs.add_metric([outcome], c.get(f"subscriber.{key}", 0))
        yield subs

    def _collect_state(self) -> Iterator[Metric]:
        snap = self._state_snapshot
        if not snap:
            return
        now = time.time()
        last_success = GaugeMetricFamily(
            "rsagg_source_last_success_timestamp_seconds",
            "End of the last successful sync",
            labels=["source"],
        )
        last_attempt = GaugeMetricFamily(
            "rsagg_source_last_attempt_timestamp_seconds", "Start of the last sync", labels=["source"]
        )
        state = GaugeMetricFamily(
            "rsagg_source_state", "1 for the state a source is in", labels=["source", "state"]
        )
        resources = GaugeMetricFamily("rsagg_source_resources", "Live resources held", labels=["source"])
        lag = GaugeMetricFamily(
            "rsagg_sync_lag_seconds",
            "Now minus the datetime of the last applied upstream change (the newest position of the "
            "source's sets in their change streams); for a set without Change List, minus its last read",
            labels=["source"],
        )
        done = GaugeMetricFamily(
            "rsagg_sync_progress_done", "Resources done in the running baseline", labels=["source"]
        )
        expected = GaugeMetricFamily(
            "rsagg_sync_progress_expected",
            "Resources expected in the running baseline (estimate)",
            labels=["source"],
        )
        cursor = GaugeMetricFamily(
            "rsagg_set_cursor_timestamp_seconds",
            "Datetime of the last applied change of a set (its change-stream cursor)",
            labels=["source", "set"],
        )
        from .report import lag_since  # the one definition of lag (report.py imports what imports this)

        positions: dict[str, float] = {}
        success = {s.name: s.last_success for s in snap["sources"]}
        for s in snap["sets"]:
            cur = snap["cursors"].get(s.id)
            ts = _timestamp(cur.last_datetime or cur.baseline_at) if cur is not None else None
            if ts is not None:
                cursor.add_metric([s.source, s.name], ts)
            since = _timestamp(lag_since(cur, success.get(s.source))[0])
            if since is not None:
                positions[s.source] = max(positions.get(s.source, since), since)
        for s in snap["sources"]:
            name = s.name
            for fam, value in ((last_success, s.last_success), (last_attempt, s.last_attempt)):
                if isinstance(value, datetime):
                    fam.add_metric([name], value.timestamp())
            state.add_metric([name, s.state or "new"], 1)
            if name in snap["counts"]:
                resources.add_metric([name], snap["counts"][name])
            if name in positions:
                lag.add_metric([name], max(0.0, now - positions[name]))
            if s.state == "syncing" and s.progress_done is not None:
                done.add_metric([name], s.progress_done)
                if s.progress_total:
                    expected.add_metric([name], s.progress_total)
        seq = GaugeMetricFamily("rsagg_changelog_last_seq", "Highest seq of rsagg's own change log")
        seq.add_metric([], snap["last_seq"])
        yield from (last_success, last_attempt, state, resources, lag, done, expected, cursor, seq)

    def _collect_served(self) -> Iterator[Metric]:
        """The serving families: this process's counts plus the workers' (summed per series, as
        prometheus-client's multiprocess mode sums processes; the files of a worker that exited stay, so
        a sum never goes back when a worker is started again)."""
        own = [
            fam for c in (self.http_requests, self.http_duration, self.server_refused) for fam in c.collect()
        ]
        theirs: dict[str, Metric] = {}
        if self.workers_dir is not None:
            try:
                theirs = {fam.name: fam for fam in worker_families(self.workers_dir)}
            except Exception:  # a scrape must not fail (nor lose this process's counts) for a bad file
                log.exception("metrics: cannot read the workers' counts in %s", self.workers_dir)
        for fam in own:
            other = theirs.get(fam.name)
            if other is not None:
                fam.samples = _sum_samples(fam.samples, other.samples)
            yield fam

    def _collect_store(self) -> Iterator[Metric]:
        values = self.store_size.values()
        if values is None:
            return
        objects = GaugeMetricFamily("rsagg_store_objects", "Blobs in the store")
        objects.add_metric([], values[0])
        size = GaugeMetricFamily("rsagg_store_bytes", "Bytes of the blobs in the store")
        size.add_metric([], values[1])
        yield objects
        yield size


def worker_families(path: str) -> list[Metric]:
    """The serving families of the worker processes that wrote their counters and histograms in
    ``path`` (``PROMETHEUS_MULTIPROC_DIR``), summed over them by prometheus-client.

    Why not the daemon in multiprocess mode too (one ``MultiProcessCollector`` for everything): that mode
    is chosen once per process, for every metric of it; the daemon's own families are per ``Metrics``
    object (several in one process in tests), its scrape-time collectors and gauges have semantics of
    their own, and only the serving families exist in the workers."""
    files = []
    for pattern in ("counter_*.db", "histogram_*.db"):
        for f in glob.glob(os.path.join(path, pattern)):
            with contextlib.suppress(OSError):
                if os.path.getsize(f) > 0:  # (0 bytes: a worker is creating it)
                    files.append(f)
    return [fam for fam in MultiProcessCollector.merge(files) if fam.name in SERVED_FAMILIES]


def _sum_samples(ours: list[Sample], theirs: Iterable[Sample]) -> list[Sample]:
    out = list(ours)
    index = {(s.name, frozenset(s.labels.items())): i for i, s in enumerate(out)}
    for s in theirs:
        i = index.get((s.name, frozenset(s.labels.items())))
        if i is None:
            index[(s.name, frozenset(s.labels.items()))] = len(out)
            out.append(s)
        else:
            out[i] = out[i]._replace(value=out[i].value + s.value)
    return out


def error_kind(exc: BaseException) -> str:
    """The ``rsagg_errors_total`` kind of an exception that stopped a sync."""
    if isinstance(exc, CountedError):
        return exc.kind
    if isinstance(exc, DocumentError):
        return "parse"
    return "sync"


class ServedMetrics:
    """ASGI middleware: requests served, labelled by the route's path template (``/{set}/r/{rest:path}``,
    not the raw path: one series per route, whatever the URLs). Starlette's router leaves the matched
    route in ``scope["route"]``; requests no route matched count as ``unmatched``."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        code = 500  # an exception before the response started becomes a 500

        async def send_status(message: Message) -> None:
            nonlocal code
            if message["type"] == "http.response.start":
                code = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            method = scope.get("method", "GET")
            method = method if method in ("GET", "HEAD", "POST") else "other"
            self.metrics.served(route, method, code, time.perf_counter() - start)


__all__ = [
    "CONTENT_TYPE",
    "FAMILIES",
    "SERVED_FAMILIES",
    "Metrics",
    "ServedMetrics",
    "StoreSize",
    "error_kind",
    "sample_names",
    "status_class",
    "worker_families",
]
