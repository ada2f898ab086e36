"""One upstream Source: discover its sets, then baseline or incremental sync for each (§5.2)."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import trio

from ..config import SourceConfig
from ..errors import StoreFailure, environmental_leaf, leading_line, operator_line, store_failure
from ..rs.model import CHANGELIST, RESOURCEDUMP, RESOURCELIST
from ..rs.w3cdt import format_w3c, utcnow
from ..store.interface import LeaseLost, StateStore
from ..store.rows import Cursor
from .access import for_source
from .audit import still_listed
from .baseline import run_baseline
from .context import HarvestContext
from .deviations import Deviations, collecting
from .discovery import SetInfo, discover
from .incremental import run_incremental
from .lists import GapError, Validators
from .oaipmh import sync_oaipmh
from .pipeline import Failure, Pipeline, PipelineStats, Work, first_error
from .progress import Progress
from .reconcile import ReconcileResult, due, reconcile, record_baseline

log = logging.getLogger("rsagg.harvest")


@dataclass
class SourceResult:
    name: str
    ok: bool = True
    error: str | None = None
    sets: int = 0
    baselines: int = 0
    gaps: int = 0
    stats: list[PipelineStats] = field(default_factory=list)
    #: The sets as discovered in this sync (their notification channels included).
    discovered: list[SetInfo] = field(default_factory=list)
    #: Tolerated deviations (``Note.as_dict``) and lists that could not be read (URL -> reason).
    deviations: list[dict] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    #: The store could not be written (errors.StoreFailure): its one line. Not the upstream's fault.
    store_failure: str | None = None
    #: The reconciliations with the Resource List this sync ran (harvest/reconcile.py).
    reconciled: list[ReconcileResult] = field(default_factory=list)

    @property
    def degraded(self) -> bool:
        """Some advertised list could not be read: the source is not in sync, whatever else went well."""
        return bool(self.skipped)

    @property
    def failures(self) -> list[Failure]:
        return [f for s in self.stats for f in s.failures]


@for_source
async def retry_failed(ctx: HarvestContext, set_id: int, source: str, uris: set[str]) -> PipelineStats | None:
    """Try again the changes of a set whose fetch failed in an earlier run (the state's retries) and that
    are still waiting (``uris``: those waiting when this sync started), through the one pipeline; they
    move no cursor. A change that applies now leaves the list."""
    waiting = [w for w in await ctx.read(ctx.reader.pending_retries, set_id) if w[0].loc in uris]
    if not waiting:
        return None

    async def items() -> AsyncGenerator[Work, None]:
        for entry, change, _ in waiting:
            yield Work(entry, change)

    stats = await Pipeline(ctx, set_id, source).run(items())
    log.info(
        "source=%s retried %d failed change(s): %d still failing", source, len(waiting), len(stats.failures)
    )
    return stats


@for_source
async def end_unlisted_retries(
    ctx: HarvestContext,
    info: SetInfo,
    set_id: int,
    source: str,
    stats: PipelineStats,
    attempts: dict[str, int],
) -> int:
    """End the retries that failed again for URIs the upstream no longer lists: retrying those can never
    succeed, and would keep the source in error while audit says in sync. They leave ``stats`` (the sync
    is not failed by them) and stay visible as ended (the state's retries). The lists are read only when a
    failing retry reaches attempt 2, 4, 8, ... (``attempts``: before this run), so a Source whose
    resource keeps failing while listed is not re-read on every poll. Returns how many ended."""
    failed = {f.uri for f in stats.failed.values()}  # keyed by URI, or by version (harvest/versions.py)
    due = {uri for uri in failed if uri in attempts and (attempts[uri] + 1) & attempts[uri] == 0}
    if not due:
        return 0
    try:
        listed = await still_listed(ctx, info, source, due)
    except Exception as exc:  # the lists could not be read now: the retries stay, the next run checks
        log.warning("source=%s set=%s could not check which failed changes are still listed: %s",
                    source, info.capabilitylist_url, exc)  # fmt: skip
        return 0
    gone = sorted(due - listed)
    if not gone:
        return 0
    await ctx.write(ctx.writer.end_retries, set_id, gone, "no longer listed upstream")
    for key, f in list(stats.failed.items()):
        if f.uri in gone:
            del stats.failed[key]
    shown = ", ".join(gone[:5]) + (f" and {len(gone) - 5} more" if len(gone) > 5 else "")
    log.warning(
        "source=%s set=%s retries ended for %d failed change(s) whose URI the upstream no longer lists "
        "(shown by rsagg retries and status until rsagg retries --clear): %s",
        source, info.capabilitylist_url, len(gone), shown,
    )  # fmt: skip
    return len(gone)


@for_source
async def sync_source(ctx: HarvestContext, src: SourceConfig) -> SourceResult:
    """Bring one source up to date; never raises for upstream problems (they are the result).

    Waits its turn first when many Sources of its host sync at once (``harvest/admission.py``)."""
    async with ctx.admissions.admitted(src.url, ctx.fetcher.host_limit):
        return await _sync_admitted(ctx, src)


async def _sync_admitted(ctx: HarvestContext, src: SourceConfig) -> SourceResult:
    try:
        with collecting(Deviations(src.name, ctx.metrics.deviation)) as deviations:
            return await _sync_source(ctx, src, deviations)
    except StoreFailure as exc:
        # The machine's problem (disk full, state read-only or away, store folder gone), not the
        # upstream's: one line, recorded where the state still takes it; the next sync tries again.
        line = operator_line(exc)
        log.error("source=%s sync failed: %s", src.name, line)
        ctx.progress_finished(src.name)
        ctx.drop_later(src.name)  # what waited may be what the store refused: the error line alone
        try:
            await ctx.write(ctx.writer.set_source_status, src.name, state="error", last_error=line)
        except StoreFailure:
            ctx.metrics.failure_not_recorded(src.name, line)
        ctx.metrics.sync_finished(src.name, False, 0.0, exc)
        return SourceResult(src.name, ok=False, error=line, store_failure=line)


async def _sync_source(ctx: HarvestContext, src: SourceConfig, deviations: Deviations) -> SourceResult:
    result = SourceResult(src.name)
    started = time.monotonic()
    stopped_by: Exception | None = None
    # The status writes ride along with the sync's next state write (one thread hop, not one each).
    ctx.write_later(src.name, ctx.writer.upsert_source, src.name, src.url)
    ctx.write_later(
        src.name, ctx.writer.set_source_status, src.name, state="syncing", last_attempt=format_w3c(utcnow()),
        progress_done=0, progress_total=None, progress_what=None,
    )  # fmt: skip
    ctx.progress.pop(src.name, None)
    progress = Progress(src.name, ctx.progress_update)
    closing = _Closing(ctx, src.name, result, deviations, progress)
    try:
        if src.kind == "oai-pmh":  # its one set: the records of (metadata_prefix, set)
            progress.next_set()
            result.stats.append(await sync_oaipmh(ctx, src, progress))
            result.sets, sets = 1, []
        else:
            fallback: list[str | None] = []  # what discovery used instead of a failing src.url (status)
            # The documents read by this source's last discovery are asked for conditionally: an
            # unchanged Source Description or Capability List costs a 304 (HarvestContext.discovered).
            known = ctx.discovered.setdefault(src.name, {})
            sets = await discover(ctx.fetcher, src.url, on_fallback=fallback.append, known=known)
            using = fallback[0] if fallback else None
            ctx.write_later(src.name, ctx.writer.set_source_status, src.name, using_url=using)
            result.sets = len(sets)
        result.discovered = sets
        for info in sets:
            # A baseline is opened with the set only for a set that offers its snapshot now (one read
            # from an archive, or none at all, opens its own or none, as ``run_baseline`` decides).
            snapshot = RESOURCELIST in info.capabilities or RESOURCEDUMP in info.capabilities
            set_id, cursor, opened, empty = await ctx.write(
                _open_set, ctx.writer, src.name, info.capabilitylist_url, CHANGELIST in info.capabilities,
                snapshot,
            )  # fmt: skip
            # failed in earlier runs: URI -> attempts so far (none in a set that holds nothing)
            waiting = {} if empty else {
                e.loc: n for e, _, n in await ctx.read(ctx.reader.pending_retries, set_id)
            }  # fmt: skip
            baseline = cursor is None or CHANGELIST not in info.capabilities
            if not baseline:
                assert cursor is not None
                try:
                    result.stats.append(
                        await run_incremental(
                            ctx, info, set_id, src.name, cursor, use_dumps=ctx.config.use_dumps(src)
                        )
                    )
                except GapError as exc:
                    log.warning(
                        "source=%s gap in the change stream, recovering with a baseline: %s", src.name, exc
                    )
                    result.gaps += 1
                    baseline = True
            if baseline:
                # A set without Change List is re-read on every poll: fetch its list conditionally.
                polled = cursor is not None and CHANGELIST not in info.capabilities
                progress.next_set()
                # The sync's last step when no other set, no retry and no reconciliation bookkeeping
                # (a Change List's) comes after it: its final status may ride with its end.
                last_step = info is sets[-1] and not waiting and CHANGELIST not in info.capabilities
                stats = await run_baseline(
                    ctx, info, set_id, src.name, use_dumps=ctx.config.use_dumps(src) and not polled,
                    progress=progress.add, total=progress.set_total,
                    validators=Validators(partial(ctx.read, ctx.reader.document), conditional=polled),
                    opened=opened, empty=empty, closing=closing.ahead if last_step else None,
                )  # fmt: skip
                if stats is not None:
                    result.baselines += 1
                    result.stats.append(stats)
                    if CHANGELIST in info.capabilities and await _baseline_finished(ctx, src.name, set_id):
                        await record_baseline(ctx, info, set_id)
            else:
                # A Change List is a hint; the Resource List says what exists (harvest/reconcile.py).
                cause, heads = await due(ctx, info, set_id, ctx.config.reconcile_interval(src))
                if cause is not None:
                    # A URI whose fetch failed in this sync is not fetched again now (it waits as a
                    # retry), unless the failure was a digest that did not match: the Change List's
                    # announcement may be stale, the Resource List's is current. A lost version
                    # (§14.6 memento, harvest/versions.py) is not: the list names the same memento.
                    failures = [f for st in result.stats for f in st.failures]
                    failed = {f.uri: f.kind for f in failures}
                    again = {f.uri for f in failures if f.kind != "fixity" or f.version is not None}
                    rec = await reconcile(ctx, info, set_id, src.name, cause, heads,
                                          exclude=set(waiting) | again, watch=set(failed))  # fmt: skip
                    for st in result.stats:  # failures the reconciliation settled are superseded
                        for uri in rec.settled:
                            st.failed.pop(uri, None)
                    result.reconciled.append(rec)
                    if rec.stats is not None:
                        result.stats.append(rec.stats)
            # After the sync, not before: a failed change that a newer one has superseded (a stale entry
            # whose successor a killed run never reached) is cleared by that newer change first.
            retried = await retry_failed(ctx, set_id, src.name, set(waiting)) if waiting else None
            if retried is not None:
                await end_unlisted_retries(ctx, info, set_id, src.name, retried, waiting)
                result.stats.append(retried)
    except (trio.Cancelled, LeaseLost):  # LeaseLost: another cluster node holds the source now
        raise
    except Exception as exc:  # an upstream problem must never take the daemon down
        if isinstance(exc, ExceptionGroup):  # a nursery's: its error names the problem, not the group
            leaf = first_error(exc)
            if isinstance(leaf, LeaseLost):
                raise leaf from None
            exc = leaf if isinstance(leaf, Exception) else exc
        env = environmental_leaf(exc)
        if env is not None:  # the store, not the upstream: sync_source reports it (one line)
            raise store_failure(env, str(ctx.config.store_path)) from None
        stopped_by = exc
        result.ok = False
        result.error = leading_line(exc)  # the root cause first (errors.root_cause)
        log.error("source=%s url=%s sync failed: %s", src.name, src.url, result.error)
    if result.ok and result.failures:
        result.ok = False
        first = result.failures[0]
        result.error = f"{len(result.failures)} resource(s) failed, e.g. {first.uri}: {first.message}"
    result.deviations = [n.as_dict() for n in deviations.notes.values()]
    result.skipped = dict(deviations.skipped)
    state = "ok" if result.ok else "error"
    if deviations.skipped:  # lenient in, truthful out: never "ok" with a list unread
        state = "degraded" if result.ok else state
        result.ok = False
        result.error = "; ".join(filter(None, [result.error, deviations.skipped_text()]))
    fields_ = {"state": state, "last_error": result.error,
               "progress_done": progress.done, "progress_total": progress.total}  # fmt: skip
    ctx.progress_finished(src.name)
    if not closing.written_as(fields_, result.deviations, result.skipped):
        ctx.write_later(src.name, ctx.writer.put_upstream_notes, src.name, result.deviations, result.skipped)
        if result.ok:
            fields_["last_success"] = format_w3c(utcnow())
        await ctx.write(ctx.writer.set_source_status, src.name, **fields_)
    ctx.metrics.sync_finished(
        src.name, result.ok, time.monotonic() - started, stopped_by, degraded=state == "degraded"
    )
    # The error's traceback holds this frame, whose local held the error: a cycle that would keep the
    # whole failed sync (its pipeline, documents, tasks' frames) for the garbage collector.
    stopped_by = None
    return result


class _Closing:
    """A sync's final status, written ahead in the transaction that ends its last step (a baseline:
    ``run_baseline``'s ``closing``) when the sync's outcome is known by then: nothing failed, nothing
    was skipped, and no step follows (the caller offers it only then). The end of the sync writes the
    status itself unless it is exactly the one written (``written_as``): an outcome changed since (a
    snapshot refused as empty, an error) is written as always. Why: the final status was a thread hop
    and a transaction of its own, a good part of a small Source's cost (benchmarks/bench_many_sources.py).
    Its "ok" is then committed with the data that makes it true, not after it."""

    def __init__(
        self, ctx: HarvestContext, name: str, result: SourceResult, deviations: Deviations, progress: Progress
    ) -> None:
        self._ctx, self._name, self._result = ctx, name, result
        self._deviations, self._progress = deviations, progress
        self._fields: dict[str, object] | None = None
        self._notes: list[dict] = []
        self._written = False  # set by the write, in the writer's thread, before the caller resumes

    def ahead(self, stats: PipelineStats) -> Callable[[], None] | None:
        """The status write to make with the baseline's end, or None when the outcome is not "ok"
        (``stats``: the last step's figures, every failure of it in)."""
        result, deviations = self._result, self._deviations
        if not result.ok or result.failures or stats.failed or deviations.skipped:
            return None
        progress = self._progress
        fields: dict[str, object] = {"state": "ok", "last_error": None, "progress_done": progress.done,
                                     "progress_total": progress.total}  # fmt: skip
        notes = [n.as_dict() for n in deviations.notes.values()]
        self._fields, self._notes = fields, notes
        writer, name, success = self._ctx.writer, self._name, format_w3c(utcnow())

        def write() -> None:
            writer.put_upstream_notes(name, notes, {})
            writer.set_source_status(name, **fields, last_success=success)
            self._written = True

        return write

    def written_as(self, fields: Mapping[str, object], notes: list[dict], skipped: dict[str, str]) -> bool:
        """The status the sync ends with (``fields``, its upstream notes) is the one written ahead, and
        no write waits to ride along with it (``write_later``). A status written ahead that the end
        overtook (it is offered only when nothing can, so never but for a fault of rsagg's) is logged
        and written again; its success time stays that of the baseline's end."""
        if not self._written:
            return False
        if fields != self._fields or notes != self._notes or skipped:
            log.warning("source=%s the status written with the last baseline's end was overtaken "
                        "(%s, %s): written again", self._name, fields.get("state"),
                        fields.get("last_error"))  # fmt: skip
            return False
        return not self._ctx.later_waiting(self._name)


def _open_set(
    writer: StateStore, source: str, capabilitylist_url: str, changelist: bool, snapshot: bool
) -> tuple[int, Cursor | None, int | None, bool]:
    """The set (created on first sight), its cursor, when it is to be baselined whatever comes next
    (no cursor yet, or no Change List: re-read on every poll) its new baseline generation, and whether
    it holds nothing at all (asked only of a set never baselined: one seen for the first time has no
    row and no retry for its sync to read first, ``Pipeline``'s ``empty``): one write call, one thread
    hop, where these were two and reads (in the same order: the set, then the baseline opened before
    its snapshot is asked for, ``baseline.run_baseline``)."""
    set_id = writer.ensure_set(source, capabilitylist_url)
    cursor = writer.cursor(set_id)
    opened = writer.begin_baseline(set_id) if snapshot and (cursor is None or not changelist) else None
    return set_id, cursor, opened, cursor is None and writer.holds_nothing(set_id)


async def _baseline_finished(ctx: HarvestContext, source: str, set_id: int) -> bool:
    """The set's last baseline finished (none is open): its store is what the snapshot listed."""
    sets = await ctx.read(ctx.reader.sets, source)
    return any(s.id == set_id and s.baseline_generation is None for s in sets)


class FollowedSources(Protocol):
    """Who runs the sources whose notification channels rsagg follows (websub/subscriber.py's
    ``Subscriber``): a sync of such a source is theirs to run."""

    def follows(self, src: SourceConfig) -> bool: ...

    async def run_source(self, src: SourceConfig) -> None: ...


async def poll_source(ctx: HarvestContext, src: SourceConfig, follow: FollowedSources | None = None) -> None:
    """The daemon's per-source task: sync, sleep the interval with jitter, forever (until cancelled).

    A source ``follow`` follows is run by it instead: the same syncs, plus notifications in between.
    Not wrapped in ``for_source``: the syncs act for the source themselves, and the subscriber's own
    requests (to a hub) are made for no source (outbound.py ``AddressPolicy.current_source``).
    """
    if follow is not None and follow.follows(src):
        await follow.run_source(src)
        return
    interval = ctx.config.interval(src)
    jitter = ctx.config.harvest.jitter
    while True:
        await sync_source(ctx, src)
        await trio.sleep(max(0.0, interval * (1 + random.uniform(-jitter, jitter))))
