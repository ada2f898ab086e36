"""Published sets: what rsagg offers as one Capability List (spec §9), built from the state's sets.

The harvester keeps one state set per upstream Capability List (``StateStore.sets()``, each with a stable
URL-safe ``name``). By default every state set is published under its own name; a ``[[sets]]`` table
of the configuration groups all state sets of some sources under one name (one Capability List for a
museum and a gallery, say). Configured groups are published even before anything was harvested, so
their URLs are stable from the start. The publisher, the notifier's topics and the status view all
read them from here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from ..config import Config
from .rows import SetRow

log = logging.getLogger("rsagg.publish")
_warned: set[tuple[str, str]] = set()


@dataclass(frozen=True, slots=True)
class PublishedSet:
    name: str  # URL-safe: the first path segment of every URL of the set
    set_ids: tuple[int, ...]  # state sets whose resources and changelog records it shows
    describedby: str | None = None  # §8/§9: a document about the set


def published_sets(config: Config, state_sets: Iterable[SetRow]) -> dict[str, PublishedSet]:
    """Name -> published set: configured groups first (config order), then every state set whose
    source is in no group, under the state set's own name, by set id.

    A state set whose name a group already uses is left out (logged): the group's URLs win.
    """
    group_of = {src: g.name for g in config.sets for src in g.sources}
    members: dict[str, list[int]] = {g.name: [] for g in config.sets}
    loose: list[SetRow] = []
    for s in sorted(state_sets, key=lambda s: s.id):
        group = group_of.get(s.source)
        if group is not None:
            members[group].append(s.id)
        else:
            loose.append(s)
    out = {g.name: PublishedSet(g.name, tuple(members[g.name]), g.describedby) for g in config.sets}
    for s in loose:
        if s.name in out:
            if (s.name, s.source) not in _warned:  # once per process, not per request
                _warned.add((s.name, s.source))
                log.warning(
                    "state set %r of source %r is not published: configured set %r has that name",
                    s.name,
                    s.source,
                    s.name,
                )
            continue
        out[s.name] = PublishedSet(s.name, (s.id,))
    return out


__all__ = ["PublishedSet", "published_sets"]
