"""Lenient in, truthful out: what rsagg tolerated in a Source's documents, and what it could not read.

Real Sources deviate from the specification (docs/interop.md names who does what). A deviation rsagg
can read past is *noted*: logged once per document and rule (with the line), counted in
``rsagg_upstream_deviations_total{source,rule}``, and listed per source in ``rsagg status`` and
``/status.json``. A list rsagg cannot read at all is *skipped*: the sync goes on with the other lists,
but the source is ``degraded`` (never "ok") with the list named, and ``harvest --once`` exits 1.

The harvest code deep down (list walks, dump manifests, the document parser's value problems) reports
through ``deviation()``; the ``Deviations`` of the running sync is found in a context variable, which
trio tasks inherit from the task that started them (as ``scope.current_source``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

log = logging.getLogger("rsagg.harvest")

#: The rules rsagg tolerates (rule id -> what was seen and why it is read anyway); listed in
#: docs/harvesting.md.
RULES: dict[str, str] = {
    "relative-loc": "a relative <loc> or href (§7: absolute URIs); resolved against the document's URL",
    "rel-case": "a relation type not in lower case (RFC 8288 §2.1.1: compared case-insensitively)",
    "dump-path-no-slash": "a manifest path without the leading '/' (§11.2, §13.2); read from the "
    "package root",
    "index-as-urlset": "an index written as <urlset> whose entries are capability documents (§10.2, "
    "§12.2); read as an index",
    "list-as-sitemapindex": "a Change List written as <sitemapindex> of changes; read as a list",
    "capability-repeated": "several entries for one capability in a Capability List (§9: one); all read",
    "loc-as-text": "<url>URI</url>: the URI as the entry's text, no <loc> (§7: mandatory); read as its <loc>",
    "md-before-loc": "<rs:md> before <loc> in an entry (§7 and the sitemap schema: <loc> first); read anyway",
    "late-head-link": "a document's <rs:ln> after its first entry (§7: before them); read as the document's",
    "at-missing": "a Resource List without rs:md at (§10.1: mandatory); the baseline has no start time",
    "list-in-urlset": "a <urlset> entry that is itself a Resource List (§10.2 wants a <sitemapindex>); "
    "found by fetching it and followed as a part",
    "unknown-capability": "a capability rsagg does not know (another specification's, §9); not read",
    "value": "a value that is not what §7 allows (a bad date, an unknown attribute...); ignored",
    "memento-hash-differs": "a memento link whose hash differs from its entry's (§14.6 says identical); the "
    "memento is checked against its own (§7: a link's attributes pertain to the linked resource)",
    "memento-no-hash": "a memento link with no usable hash, on an entry with none: stored unverified",
    "memento-unavailable": "a memento that could not be fetched or verified; <loc> served the same version "
    "(the entry's hash checked), which was kept",
    "memento-on-deletion": "a deletion with a memento link (§14.6 links a version; a deletion has none): "
    "the deletion is applied, the memento not fetched",
    "version-out-of-order": "a memento version older than one rsagg holds (a replayed or repeated entry): "
    "not made current, the changelog only goes forward",
}


@dataclass
class Note:
    """One rule seen in one source's sync: how often, and the first place it was seen."""

    rule: str
    count: int
    url: str | None
    line: int | None
    message: str

    def as_dict(self) -> dict:
        return {"rule": self.rule, "count": self.count, "url": self.url, "line": self.line,
                "message": self.message}  # fmt: skip


@dataclass
class Deviations:
    """What one sync (or audit) of one source tolerated and skipped."""

    source: str
    #: ``metrics.Metrics.deviation`` or None (tests, the validator).
    count: Callable[[str, str], None] | None = None
    notes: dict[str, Note] = field(default_factory=dict)
    #: list URL -> why it could not be read.
    skipped: dict[str, str] = field(default_factory=dict)
    _logged: set[tuple[str | None, str]] = field(default_factory=set)

    def note(self, rule: str, url: str | None, line: int | None, message: str) -> None:
        if self.count is not None:
            self.count(self.source, rule)
        seen = self.notes.get(rule)
        if seen is None:
            self.notes[rule] = Note(rule, 1, url, line, message)
        else:
            seen.count += 1
        if (url, rule) not in self._logged:  # once per document and rule
            self._logged.add((url, rule))
            log.warning("source=%s url=%s line %s: %s [tolerated: %s]", self.source, url, line, message, rule)

    def skip(self, url: str, reason: str) -> None:
        """A list that could not be read: the source cannot be in sync."""
        seen = self.skipped.get(url)
        if seen is None or reason not in seen:
            log.error("source=%s url=%s list skipped: %s", self.source, url, reason)
        # Several things not read in one list are all named.
        self.skipped[url] = reason if seen is None or reason in seen else f"{seen}; {reason}"

    def skipped_text(self) -> str | None:
        if not self.skipped:
            return None
        return "skipped: " + "; ".join(f"{u} ({why})" for u, why in self.skipped.items())


_current: ContextVar[Deviations | None] = ContextVar("rsagg_deviations", default=None)


@contextmanager
def collecting(deviations: Deviations) -> Iterator[Deviations]:
    """Make ``deviation()`` calls of this task (and the tasks it starts) land in ``deviations``."""
    token = _current.set(deviations)
    try:
        yield deviations
    finally:
        try:
            _current.reset(token)
        except ValueError:  # an async generator closed from another context (an audit stopped early)
            _current.set(None)


def deviation(rule: str, url: str | None, line: int | None, message: str) -> None:
    """Note a tolerated deviation for the running sync (only logged when none is collecting)."""
    d = _current.get()
    if d is not None:
        d.note(rule, url, line, message)
    else:
        log.warning("url=%s line %s: %s [tolerated: %s]", url, line, message, rule)


def skip(url: str, reason: str) -> None:
    """Name a list the running sync could not read (the source is then degraded)."""
    d = _current.get()
    if d is not None:
        d.skip(url, reason)
    else:
        log.error("url=%s list skipped: %s", url, reason)


def current() -> Deviations | None:
    return _current.get()


__all__ = ["RULES", "Deviations", "Note", "collecting", "current", "deviation", "skip"]
