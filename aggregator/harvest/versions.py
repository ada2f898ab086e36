"""Prior versions of resources (§14.6): each version a Source describes, fetched from its memento.

A change entry (Change List, notification, Resource List) may carry ``<rs:ln rel="memento">``: the
time-specific URI of exactly the version that entry describes (§14.6, first approach, Example 29). The
time-generic ``<loc>`` serves only the current version, so when rsagg learns of several changes of one
resource at once (it was down, or the Source changed twice between polls) only the last one could be
fetched from ``<loc>``; the intermediate ones would fail fixity and be lost. With a memento link each
change is fetched from its own time-specific URI and enters the one change pipeline
(``harvest/pipeline.py``) as its own changelog record, in order.

The rules (docs/versions-in.md has the table):

- **Which hash.** A memento is verified against the link's own ``hash``/``length``: §7 says the
  attributes of an ``<rs:ln>`` "pertain to the related resource", and the related resource here is the
  memento. §14.6 notes they are identical to the entry's ``<rs:md>`` (Example 29); when they differ the
  Source contradicts itself, and rsagg believes each attribute about the resource it describes: the
  memento's bytes are checked against the link (deviation ``memento-hash-differs``), ``<loc>``'s against
  ``<rs:md>``. A link without a usable hash inherits the entry's (§14.6: identical); with neither, the
  memento is taken unverified like any hashless entry (deviation ``memento-no-hash``).
- **Memento unavailable** (404, refused by the outbound policy, fixity): ``<loc>`` is fetched instead,
  but only when the entry has a hash to prove that ``<loc>`` still serves that very version (deviation
  ``memento-unavailable``); otherwise the change fails, as a *lost version*: a failure that a later
  change of the same resource does not supersede (``pipeline.Failure.version``), so the sync is not ok.
- **Several memento links:** tried in ``pri`` order, like mirrors (§14.2).
- **Order:** a memento version older than the one rsagg holds (a replayed or repeated entry: §12.1 lists
  changes in forward chronological order, once per change) is not made current: the changelog only
  grows forward (deviation ``version-out-of-order``). The same version
  listed twice in order is a no-op in the state (an unchanged hash is never logged twice).
- **A deletion** has no content: its memento link is not fetched (deviation ``memento-on-deletion``).
- **Another origin, redirects:** a memento URI is fetched by the one Fetcher like a mirror: the outbound
  address policy applies on every hop, the source's credentials go only to its own origin
  (``harvest/access.py``), redirects are followed and the final bytes are what is verified.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from datetime import datetime

from ..rs.fixity import mismatches
from ..rs.model import Entry, Link
from ..store.blobs import BlobStore
from ..store.rows import Resource
from .deviations import deviation
from .fetch import Expected, FetchedResource, Fetcher, FetchError

log = logging.getLogger("rsagg.harvest")

MEMENTO = "memento"


def memento_links(entry: Entry) -> list[Link]:
    """The entry's ``rel="memento"`` links with an ``href`` (§14.6: mandatory), best ``pri`` first."""
    return [ln for ln in entry.links_by_rel(MEMENTO) if ln.href]


def memento_expected(entry: Entry, link: Link) -> Expected:
    """What the memento must be: the link's own ``hash``/``length`` (§7: they pertain to the linked
    resource); a link without a usable hash inherits the entry's ``<rs:md>`` (§14.6, Example 29: the
    values are identical)."""
    own = link.hashes
    if own:
        return Expected(own, link.length)
    length = link.length if link.length is not None else (entry.md.length if entry.md else None)
    return Expected(entry.hashes, length)


def version_time(entry: Entry) -> datetime | None:
    """When the version an entry describes came to be: the change's ``datetime`` (§12.1), else the
    memento's ``modified`` (§14.6), else ``lastmod``."""
    md = entry.md
    if md is not None and md.datetime is not None:
        return md.datetime
    for ln in memento_links(entry):
        if ln.modified is not None:
            return ln.modified
    return entry.lastmod


def older_than_held(entry: Entry, held: Resource | None) -> bool:
    """True when the entry describes a version older than the one held (compared like with like: the
    change's datetime with the held change's, the memento's ``modified`` with the held ``lastmod``).
    A tombstone counts by its deletion's datetime: a replayed change from before it revives nothing."""
    if held is None:
        return False
    md = entry.md
    if md is not None and md.datetime is not None and held.upstream_datetime is not None:
        return md.datetime < held.upstream_datetime
    if held.deleted or not held.sha256:
        return False
    modified = next((ln.modified for ln in memento_links(entry) if ln.modified is not None), None)
    if modified is not None and held.lastmod is not None:
        return modified < held.lastmod
    return False


def note_deletion(entry: Entry) -> None:
    """A deletion's memento link is not fetched: a deletion has no content to keep (§12.1)."""
    if memento_links(entry):
        deviation(
            "memento-on-deletion", entry.loc, None,
            f"{entry.loc}: a deletion carries a memento link; the deletion is applied, the memento "
            "not fetched",
        )  # fmt: skip


async def fetch_version(
    fetcher: Fetcher, entry: Entry, locations: Sequence[str], store: BlobStore
) -> FetchedResource:
    """Fetch and verify the version ``entry`` describes from its memento links, else from ``locations``
    (mirrors, then ``<loc>``) when the entry's hash can prove they still serve it. Raises FetchError
    naming every URL tried when the version cannot be had (a lost version)."""
    failures: list[FetchError] = []
    announced = entry.hashes
    for link in memento_links(entry):
        expected = memento_expected(entry, link)
        if not expected.hashes:
            deviation("memento-no-hash", link.href, None,
                      f"{entry.loc}: memento {link.href} has no usable hash, nor has the entry: stored "
                      "unverified")  # fmt: skip
        elif (
            link.hashes
            and announced
            and (mismatches(announced, link.hashes) or not set(announced) & set(link.hashes))
        ):
            deviation("memento-hash-differs", link.href, None,
                      f"{entry.loc}: memento hash {link.hash} differs from the entry's "
                      f"{entry.md.hash if entry.md else None}; the memento is checked against its own "
                      "(§7)")  # fmt: skip
        try:
            return await fetcher.resource([link.href], expected, store)
        except FetchError as exc:
            log.info("url=%s memento %s not usable: %s", entry.loc, link.href, exc)
            failures.append(exc)
    if announced:
        length = entry.md.length if entry.md else None
        try:
            got = await fetcher.resource(list(locations), Expected(announced, length), store)
        except FetchError as exc:
            failures.append(exc)
        else:
            if failures:
                deviation("memento-unavailable", entry.loc, None,
                          f"{entry.loc}: memento not usable ({failures[0]}); <loc> still serves the version "
                          "the entry describes (hash checked)")  # fmt: skip
            return got
    last = failures[-1]
    when = version_time(entry)
    reasons = "; ".join(dict.fromkeys(str(f) for f in failures))
    what = f"version of {when.isoformat()}" if when else "version"
    raise FetchError(
        last.url, last.kind, f"{entry.loc}: {what} lost (no memento served it): {reasons}", status=last.status
    ) from last


class RecentVersions:
    """The newest version time per URI among the last ``size`` changes committed, in commit order.

    Why: a change's stored row is looked up before the changes ahead of it commit (up to the
    pipeline's in-flight bound), so ``older_than_held`` cannot see a newer version of the same URI
    that is a few changes ahead in the same run; this window can. Bounded (invariant 4): beyond the
    window the row lookup sees every committed change.
    """

    def __init__(self, size: int) -> None:
        self.size = max(1, size)
        self._times: OrderedDict[str, datetime] = OrderedDict()

    def admit(self, uri: str, when: datetime | None) -> bool:
        """Record a change of ``uri`` at ``when``; False when a newer version of it came before."""
        if when is None:
            return True
        seen = self._times.get(uri)
        if seen is not None and when < seen:
            return False
        self._times[uri] = when
        self._times.move_to_end(uri)
        while len(self._times) > self.size:
            self._times.popitem(last=False)
        return True


__all__ = [
    "MEMENTO",
    "RecentVersions",
    "fetch_version",
    "memento_expected",
    "memento_links",
    "note_deletion",
    "older_than_held",
    "version_time",
]
