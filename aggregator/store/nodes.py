"""Which cluster nodes are alive and which sources' notifications they follow, read from their rows.

Pure functions of ``NodeRow``s (the ``nodes`` table: heartbeats, ``follows``) and the configuration: the
node loop (``run/cluster.py``) balances by them, the subscriber (``websub/subscriber.py``) keeps a
subscription while a live node follows its source, and ``rsagg status`` counts live nodes.
"""

from __future__ import annotations

from datetime import datetime

from ..config import Config
from .rows import NodeRow


def alive(nodes: list[NodeRow], now: datetime) -> list[NodeRow]:
    """The nodes whose last heartbeat still holds (and that did not stop cleanly)."""
    return [n for n in nodes if n.expires_at > now and n.stopped_at is None]


def follows(config: Config) -> list[str]:
    """The sources whose notification channels this node follows, as its heartbeat says them
    (``NodeRow.follows``)."""
    return [s.name for s in config.sources if s.enabled and config.notifications_on(s)]


def followed_by_live(nodes: list[NodeRow], now: datetime) -> set[str] | None:
    """The sources some live node follows, as their last heartbeats said; None when a live node did not
    say (then nothing may be taken for an orphan). A node whose configuration a rolling change has not
    reached yet still names the source: its subscriptions stay."""
    named: set[str] = set()
    for node in alive(nodes, now):
        if node.follows is None:
            return None
        named.update(node.follows)
    return named


__all__ = ["alive", "followed_by_live", "follows"]
