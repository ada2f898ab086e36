"""Changes learnt from a change notification (Notification §4), through the one pipeline.

websub/subscriber.py receives, verifies and orders the notifications of the channels rsagg follows; what
a notice *changes* is harvest's business, like a Change List's entries: this module places the notice's
entries on the set's cursor and hands those not yet applied to ``harvest/pipeline.py`` (docs/
architecture.md invariant 1). ``NotifiedHarvest`` is what the composition hands the subscriber (its
``Harvester``): syncs and notices of one process's harvest context.

Placing: entries at or before the cursor (datetime + ties, ``lists.Position``) were applied already — by
the Change List or an earlier notice — and are skipped, so notifications and polling never apply a change
twice; the cursor keeps its Change List position (URL, index), so the next poll reads on from where it
was. Entries without time, out of forward chronological order, or tied with the cursor's datetime at the
notice's ``from`` (a group of same-time changes cut between two notices) cannot be placed: the caller
polls the Change List instead.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Sequence
from dataclasses import replace
from datetime import datetime

import trio

from ..config import SourceConfig
from ..rs.model import CHANGES, Entry
from ..rs.w3cdt import format_w3c, utcnow
from .access import for_source
from .context import HarvestContext
from .discovery import SetInfo
from .lists import ListRef, Position, resolve, when
from .pipeline import Pipeline, Work
from .source import sync_source

log = logging.getLogger("rsagg.subscriber")


class NotifiedHarvest:
    """Syncs and notification notices of ``ctx``'s harvest, for websub/subscriber.py."""

    def __init__(self, ctx: HarvestContext) -> None:
        self.ctx = ctx

    @for_source
    async def sync(self, src: SourceConfig) -> list[SetInfo]:
        """One sync of the source (as its poll task would); the sets it discovered (their channels)."""
        return (await sync_source(self.ctx, src)).discovered

    @for_source
    async def apply_notice(
        self,
        src: SourceConfig,
        capabilitylist_url: str,
        topic: str,
        from_: datetime,
        entries: Sequence[Entry],
    ) -> tuple[int, int] | None:
        """Apply a change notice's entries (relative ``loc`` resolved against ``topic``) on the cursor of
        the source's set of ``capabilitylist_url``: (entries taken, changes logged); None when they
        cannot be placed on the cursor or could not be applied (then the caller polls)."""
        resolved = [resolve(e, topic) for e in entries]  # relative <loc>: vs the topic
        sets = await self.ctx.read(self.ctx.reader.sets, src.name)
        set_id = next((s.id for s in sets if s.capabilitylist_url == capabilitylist_url), None)
        cursor = await self.ctx.read(self.ctx.reader.cursor, set_id) if set_id is not None else None
        if set_id is None or cursor is None:
            return None  # no baseline yet: the sync does it
        pos = Position(cursor)
        keep = ListRef(cursor.changelist_url or "", None, cursor.list_until)
        work: list[Work] = []
        previous: datetime | None = None
        for entry in resolved:
            t = when(entry)
            if t is None or (previous is not None and t < previous):
                return None  # no time, or not in forward chronological order: not placeable
            previous = t
            if entry.change not in CHANGES:
                log.warning("source=%s %s: change %r skipped", src.name, topic, entry.change)
                continue
            if cursor.last_datetime is not None and t == cursor.last_datetime and t <= from_:
                return None  # a same-time group cut between two notices: which of it is applied?
            if cursor.last_datetime is None and cursor.baseline_at is not None and t < cursor.baseline_at:
                continue  # before the snapshot the baseline came from
            if pos.is_applied(t, keep.url, 0):
                continue
            after = replace(pos.advance(t, keep, cursor.list_index), changelist_url=cursor.changelist_url)
            work.append(Work(entry, entry.change or "", after))
        if not work:
            log.info(
                "source=%s %s: nothing new in the notification (%d entries)", src.name, topic, len(resolved)
            )
            await self._succeeded(src)
            return 0, 0

        async def items() -> AsyncGenerator[Work, None]:
            for w in work:
                yield w

        try:
            stats = await Pipeline(self.ctx, set_id, src.name).run(items())
        except trio.Cancelled:
            raise
        except Exception as exc:
            log.error("source=%s applying a notification failed: %s: %s", src.name, type(exc).__name__, exc)
            return None
        for f in stats.failures:
            log.warning(
                "source=%s url=%s from a notification failed (%s): %s", src.name, f.uri, f.kind, f.message
            )
        if not stats.failures:
            await self._succeeded(src)
        return len(work), sum(stats.applied.values())

    async def _succeeded(self, src: SourceConfig) -> None:
        """A notice applied whole is a successful sync of what it announced: "last success" (status, the
        home page, ``rsagg_source_last_success_timestamp_seconds``) moves with it, as with a poll. The
        source's state is the last full sync's and stays."""
        await self.ctx.write(self.ctx.writer.set_source_status, src.name, last_success=format_w3c(utcnow()))


__all__ = ["NotifiedHarvest"]
