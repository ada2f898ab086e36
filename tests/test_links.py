"""The link policy (publish/links.py, spec §14.8): via, dropped relations, rewrites, the rest kept."""

from __future__ import annotations

from datetime import UTC, datetime

from aggregator.config import PublishConfig
from aggregator.publish.links import LinkPolicy
from aggregator.rs.model import PATCH_REL, Link
from aggregator.store.rows import LogRecord, Resource

T0 = datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC)
T1 = datetime(2024, 2, 1, tzinfo=UTC)
SHA = "a" * 64
MD5 = "b" * 32
HELD = {"http://up.example/meta1.xml": "http://agg.example/s/r/http/up.example/meta1.xml"}


def uri_of(href: str) -> str | None:
    return HELD.get(href)


def res(links: list[Link], **kw) -> Resource:
    fields = dict(
        id=1, set_id=1, uri="http://up.example/r1", sha256=SHA, length=10, type="text/plain", encoding=None,
        hashes={"sha-256": SHA, "md5": MD5}, lastmod=T0, upstream_datetime=None, links=links, md_extra={},
        entry_extra=[], deleted=False, updated_at=T1, generation=None,
    )  # fmt: skip
    fields.update(kw)
    return Resource(**fields)


UPSTREAM_LINKS = [
    Link("collection", "http://up.example/coll/1"),
    Link("canonical", "http://up.example/generic/r1"),
    Link("duplicate", "http://mirror.example/r1", pri=1),
    Link(PATCH_REL, "http://up.example/r1.patch", type="application/json-patch+json"),
    Link("describedby", "http://up.example/meta1.xml", type="application/xml"),
    Link("describes", "http://elsewhere.example/thing"),
    Link("alternate", "http://up.example/r1.html", type="text/html"),
    Link("memento", "http://up.example/2024/r1", modified=T0),
    Link("license", "https://creativecommons.org/licenses/by/4.0/"),
]


def test_default_policy():
    out = LinkPolicy().links(res(UPSTREAM_LINKS), uri_of=uri_of)
    assert out[0] == Link(
        "via",
        "http://up.example/r1",
        modified=T0,
        hash=f"sha-256:{SHA} md5:{MD5}",
        length=10,
        type="text/plain",
    )
    assert out[1:] == [
        Link("describedby", HELD["http://up.example/meta1.xml"], type="application/xml"),  # our copy
        Link("describes", "http://elsewhere.example/thing"),  # not harvested: kept as is
        Link("alternate", "http://up.example/r1.html", type="text/html"),
        Link("license", "https://creativecommons.org/licenses/by/4.0/"),  # memento: rsagg names its own
    ]


def test_keep_collection_and_canonical_when_configured():
    policy = LinkPolicy.from_config(PublishConfig(keep_collection_links=True, keep_canonical_links=True))
    rels = [ln.rel for ln in policy.links(res(UPSTREAM_LINKS), uri_of=uri_of)]
    assert rels == [
        "via",
        "collection",
        "canonical",
        "describedby",
        "describes",
        "alternate",
        "license",
    ]
    only_collection = LinkPolicy(keep_collection=True)
    assert "canonical" not in [ln.rel for ln in only_collection.links(res(UPSTREAM_LINKS), uri_of=uri_of)]


def test_existing_via_is_kept_unchanged_and_alone():
    origin = Link(
        "via", "http://origin.example/r1", modified=T0, hash=f"md5:{MD5}", length=10, type="text/plain",
        extra={"{http://example.org/ns}note": "x"},
    )  # fmt: skip
    out = LinkPolicy().links(res([Link("alternate", "http://x/"), origin]), uri_of=uri_of)
    assert out == [origin, Link("alternate", "http://x/")]


def test_several_upstream_vias_keep_the_best_pri():
    a = Link("via", "http://a.example/", pri=3)
    b = Link("via", "http://b.example/", pri=2)
    c = Link("via", "http://c.example/")  # no pri: 999,999 (§7)
    assert LinkPolicy().links(res([a, c, b]), uri_of=uri_of) == [b]


def test_rel_case_and_missing_lastmod():
    r = res(
        [Link("Duplicate", "http://m/"), Link("CANONICAL", "http://c/")], lastmod=None, upstream_datetime=T1
    )
    out = LinkPolicy().links(r, uri_of=uri_of)
    assert [ln.rel for ln in out] == ["via"]
    assert out[0].modified == T1  # no upstream lastmod: the upstream change datetime


def test_superseded_and_deleted_records():
    old_sha = "c" * 64
    rec = LogRecord(7, 1, 1, "http://up.example/r1", "updated", T0, old_sha, 4, "text/csv")
    out = LinkPolicy().links(res(UPSTREAM_LINKS), uri_of=uri_of, record=rec)
    assert out[0] == Link("via", "http://up.example/r1", hash=f"sha-256:{old_sha}", length=4, type="text/csv")
    gone = LogRecord(8, 1, 1, "http://up.example/r1", "deleted", T1, None, None, None)
    assert LinkPolicy().links(res(UPSTREAM_LINKS), uri_of=uri_of, record=gone)[0] == Link(
        "via", "http://up.example/r1"
    )
    # A chained via of a superseded version keeps only where it points.
    origin = Link("via", "http://origin.example/r1", modified=T0, hash=f"md5:{MD5}")
    assert LinkPolicy().links(res([origin]), uri_of=uri_of, record=rec) == [
        Link("via", "http://origin.example/r1")
    ]
    # The record of the version the row still holds gets the full via.
    same = LogRecord(9, 1, 1, "http://up.example/r1", "created", T0, SHA, 10, "text/plain")
    assert LinkPolicy().links(res([]), uri_of=uri_of, record=same)[0].hash == f"sha-256:{SHA} md5:{MD5}"
