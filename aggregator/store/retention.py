"""Which prior versions rsagg keeps (``[publish] versions``): all, the last N, or those younger than a
duration (docs/versions.md). One definition for gc (which blobs stay), the mementos (410 beyond it) and
the TimeMaps (which versions they list), so what is listed is what is served.

A *version* is a changelog record that is not a deletion (its blob is that version's bytes). It is
retained when

- ``all``: always;
- ``last N``: it is one of the N newest versions of its resource row (so the current one always is);
- ``younger D``: it was still current D ago or later, i.e. no record followed it, or the record that
  followed it (an update or the deletion) is younger than D. A resource's current version is therefore
  always retained, and a deleted resource's last version for D after the deletion.

Independent of the policy, gc keeps every record after ``floor_seq`` (records no Change Dump package
holds yet: rsagg's Change Dumps are built from the changelog when a window closes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from ..config import parse_versions
from .sql.codec import DELETED_CODE


class RetentionError(ValueError):
    """A ``[publish] versions`` value that is none of "all", a count or a duration."""


@dataclass(frozen=True)
class Retention:
    """A parsed ``[publish] versions``: ``last`` (N newest versions) or ``younger`` (seconds), or
    neither (all)."""

    last: int | None = None
    younger: float | None = None
    #: gc only: records with a higher seq are kept whatever the policy (not in a Change Dump yet).
    floor_seq: int | None = None
    #: The instant the policy is applied at (None: now): gc and tests may fix it.
    at: datetime | None = None

    @property
    def keeps_all(self) -> bool:
        return self.last is None and self.younger is None

    def with_floor(self, seq: int | None) -> Retention:
        return replace(self, floor_seq=seq)

    def at_time(self, when: datetime) -> Retention:
        return replace(self, at=when)

    def describe(self) -> str:
        if self.last is not None:
            return f"the last {self.last} version(s)"
        if self.younger is not None:
            return f"versions superseded less than {self.younger:g} s ago"
        return "every version"

    def retained(self, newer: int, superseded: datetime | None, now: datetime) -> bool:
        """Whether a version is retained: ``newer`` versions of its row follow it (counted up to
        ``last``), and the record that followed it (None: none did) is dated ``superseded``."""
        if self.last is not None:
            return newer < self.last
        if self.younger is not None:
            return superseded is None or superseded > now - timedelta(seconds=self.younger)
        return True


def parse_retention(value: Any) -> Retention:
    """``"all"``, a positive integer (the last N versions) or a duration ``"<number><s|m|h|d|w>"``
    (versions superseded less than that long ago; the grammar is ``config.parse_versions``);
    RetentionError names the value otherwise."""
    try:
        last, younger = parse_versions(value)
    except ValueError as e:
        raise RetentionError(str(e)) from None
    return Retention(last=last, younger=younger)


def retained_sql(retention: Retention | None, when: Callable[[datetime], Any]) -> str:
    """``SELECT sha256 FROM changelog ...`` of the records ``retention`` keeps (SQLite and PostgreSQL:
    window functions, no placeholders; ``when`` writes a datetime as an SQL literal the store compares
    with a changelog datetime: ``Dialect.literal_row``)."""
    if retention is None or retention.keeps_all:
        return "SELECT sha256 FROM changelog WHERE sha256 IS NOT NULL"
    floor = "" if retention.floor_seq is None else f" OR seq > {int(retention.floor_seq)}"
    if retention.last is not None:
        cond = f"rank <= {int(retention.last)}"
    else:
        from ..rs.w3cdt import utcnow

        assert retention.younger is not None
        cutoff = when((retention.at or utcnow()) - timedelta(seconds=retention.younger))
        cond = f"superseded IS NULL OR superseded > {cutoff}"
    return (
        "SELECT sha256 FROM (SELECT seq, sha256, "
        f"row_number() OVER (PARTITION BY resource_id, change = {DELETED_CODE} ORDER BY seq DESC) AS rank, "
        "lead(datetime) OVER (PARTITION BY resource_id ORDER BY seq) AS superseded "
        f"FROM changelog) AS v WHERE sha256 IS NOT NULL AND ({cond}{floor})"
    )


__all__ = ["Retention", "RetentionError", "parse_retention", "retained_sql"]
