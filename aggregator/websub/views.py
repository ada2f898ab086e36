"""What the notifier reads of rsagg's published documents, as protocols websub/ defines.

Why: notifications are views of the same documents the publisher serves (the Capability List entries,
the Change List entries and windows, the link policy and the publish filter), but websub/ and publish/
are siblings that import nothing of each other. The composition (``run/parts.py``) implements these
with publish/'s own functions and hands them to the ``Notifier`` at construction.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Protocol

from ..config import Config
from ..rs.model import Entry
from ..store.interface import StateStore
from ..store.rows import LogRecord, Resource
from ..store.sets import PublishedSet


class PublishedView(Protocol):
    """The published site for one configuration and state, as the app would serve it now."""

    @property
    def base_url(self) -> str: ...

    @property
    def sets(self) -> Mapping[str, PublishedSet]: ...

    @property
    def changelist_size(self) -> int: ...

    @property
    def well_known(self) -> str: ...

    def capabilitylist(self, name: str) -> str: ...

    def changelist(self, name: str) -> str: ...

    def changelist_window(self, name: str, k: int) -> str: ...

    def shows(self, set_name: str, row: Resource | None) -> bool:
        """Whether a changelog record is published (the publish filter)."""
        ...

    def dumps(self, set_name: str) -> dict[str, str]:
        """capability -> URL of the set's dumps (none when dumps are off)."""
        ...

    def capability_entries(self, ps: PublishedSet) -> list[Entry]:
        """The entries of the set's Capability List (§9)."""
        ...

    def change_entries(
        self, state: StateStore, ps: PublishedSet, records: Sequence[tuple[LogRecord, Resource | None]]
    ) -> list[Entry]:
        """Change List entries (§12.1) of changelog records, exactly as the Change Lists write them."""
        ...

    def change_windows(self, state: StateStore, ps: PublishedSet, now: datetime) -> tuple[list[int], int]:
        """The Change List windows listed for the set, and the open one."""
        ...


#: ``view_of(config, state, extra_capabilities)``: the published view the notifier plans a round with.
ViewOf = Callable[[Config, StateStore, Callable[[str], list[Entry]]], PublishedView]

__all__ = ["PublishedView", "ViewOf"]
