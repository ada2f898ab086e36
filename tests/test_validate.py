"""The validator: a minimal failing document per rule, every spec example, and ``rsagg validate``."""

from __future__ import annotations

import gzip
import http.server
import json
import socket
import textwrap
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import ClassVar

import pytest

from aggregator.cli import main
from aggregator.rs.model import Entry, Head, Link, Md
from aggregator.rs.validate import (
    ERROR,
    WARNING,
    Checker,
    Issue,
    check_source,
    validate_source,
    validate_stream,
)

EXAMPLES = Path(__file__).parent / "data" / "spec-examples"
SM = "http://www.sitemaps.org/schemas/sitemap/0.9"
RS = "http://www.openarchives.org/rs/terms/"
UP = '<rs:ln rel="up" href="http://example.com/capabilitylist.xml"/>'


def doc(body: str, root: str = "urlset") -> bytes:
    """A document whose root element is line 1, so the body starts at line 2."""
    body = textwrap.dedent(body).strip("\n")
    return f'<{root} xmlns="{SM}" xmlns:rs="{RS}">\n{body}\n</{root}>\n'.encode()


def md(capability: str, **attrs: str) -> str:
    """A top-level rs:md; ``from_`` spells from."""
    extra = "".join(f' {k.rstrip("_")}="{v}"' for k, v in attrs.items())
    return f'<rs:md capability="{capability}"{extra}/>'


T1, T2, T3 = "2013-01-02T00:00:00Z", "2013-01-03T00:00:00Z", "2013-01-04T00:00:00Z"


def found(data: bytes) -> list[tuple[str, int | None, str]]:
    return [(i.rule, i.line, i.severity) for i in validate_source(data)]


def assert_issue(data: bytes, rule: str, line: int | None, severity: str = ERROR) -> None:
    got = found(data)
    assert (rule, line, severity) in got, got


# --- one minimal failing document per rule -----------------------------------------------------------------
RL = '<rs:md capability="resourcelist" at="2013-01-03T09:00:00Z"/>'
CL = '<rs:md capability="changelist" from="2013-01-03T00:00:00Z"/>'
CAPL = '<rs:md capability="capabilitylist"/><rs:ln rel="up" href="http://example.com/sd.xml"/>'
RDM = '<rs:md capability="resourcedump-manifest" at="2013-01-03T09:00:00Z"/>'
CDM = '<rs:md capability="changedump-manifest" from="2013-01-02T00:00:00Z" until="2013-01-03T00:00:00Z"/>'

CASES = [
    # (rule, severity, line, document)
    ("md-missing", ERROR, 1, doc("<url><loc>http://e.com/a</loc></url>")),
    ("capability-missing", ERROR, 1, doc('<rs:md at="2013-01-03T09:00:00Z"/>')),
    # §6.1, §9: other specifications may define capabilities; one unknown here is only a warning
    ("capability-unknown", WARNING, 1, doc('<rs:md capability="resourcelists"/>')),
    ("index-not-allowed", ERROR, 1, doc(RDM, root="sitemapindex")),
    ("index-not-allowed", WARNING, 1, doc(CAPL, root="sitemapindex")),
    ("at-required", ERROR, 1, doc(f'<rs:md capability="resourcelist"/>\n{UP}')),
    ("from-required", ERROR, 1, doc(f'<rs:md capability="changedump"/>\n{UP}')),
    ("until-required", ERROR, 1, doc(md("change-notification", from_=T2))),
    ("at-not-allowed", ERROR, 1, doc(md("changelist", from_=T2, at=T2))),
    ("from-not-allowed", ERROR, 1, doc(md("resourcelist", at=T2, from_=T2) + UP)),
    ("completed-not-allowed", ERROR, 1, doc(md("changelist", from_=T2, completed=T3))),
    ("until-not-allowed", ERROR, 1, doc(md("resourcedump", at=T2, until=T3) + UP)),
    ("at-not-allowed", WARNING, 1, doc('<rs:md capability="description" at="2013-01-03T09:00:00Z"/>')),
    ("completed-before-at", ERROR, 1, doc(md("resourcelist", at=T2, completed=T1) + UP)),
    ("until-before-from", ERROR, 1, doc(md("changelist", from_=T2, until=T1))),
    # §7 says entry at/completed/from/until are "only used for" some documents (no "must"): warnings
    ("at-not-allowed", WARNING, 3, doc(f"""
        {RL}
        <url><loc>http://e.com/a</loc><rs:md at="2013-01-03T09:00:00Z"/></url>
    """)),
    ("completed-not-allowed", WARNING, 3, doc(f"""
        {RL}
        <url><loc>http://e.com/a</loc><rs:md completed="2013-01-03T09:00:00Z"/></url>
    """)),
    ("from-not-allowed", WARNING, 3, doc(f"""
        {CL}
        <url><loc>http://e.com/a</loc><rs:md change="created" from="2013-01-03T09:00:00Z"/></url>
    """)),
    ("until-not-allowed", WARNING, 3, doc(f"""
        {CDM}
        <url><loc>http://e.com/a</loc><rs:md change="deleted" until="2013-01-03T00:00:00Z"/></url>
    """)),
    ("from-recommended", WARNING, 4, doc(f"""
        <rs:md capability="changelist" from="2013-01-01T00:00:00Z"/>
        {UP}
        <sitemap><loc>http://e.com/cl1.xml</loc></sitemap>
    """, root="sitemapindex")),
    ("chronological-order", ERROR, 4, doc(f"""
        {CL}
        <url><loc>http://e.com/a</loc><rs:md change="updated" datetime="2013-01-03T12:00:00Z"/></url>
        <url><loc>http://e.com/b</loc><rs:md change="updated" datetime="2013-01-03T11:00:00Z"/></url>
    """)),
    ("chronological-order", WARNING, 4, doc(f"""
        {CL}
        <url><loc>http://e.com/a</loc><lastmod>2013-01-03T12:00:00Z</lastmod><rs:md change="updated"/></url>
        <url><loc>http://e.com/b</loc><lastmod>2013-01-03T11:00:00Z</lastmod><rs:md change="updated"/></url>
    """)),
    ("chronological-order", ERROR, 5, doc(f"""
        <rs:md capability="changelist" from="2013-01-01T00:00:00Z"/>
        {UP}
        <sitemap><loc>http://e.com/2.xml</loc><rs:md from="2013-01-02T00:00:00Z"/></sitemap>
        <sitemap><loc>http://e.com/1.xml</loc><rs:md from="2013-01-01T00:00:00Z"/></sitemap>
    """, root="sitemapindex")),
    ("datetime-outside-interval", ERROR, 3, doc(f"""
        {CDM}
        <url><loc>http://e.com/a</loc><rs:md change="deleted" datetime="2013-01-01T12:00:00Z"/></url>
    """)),
    ("datetime-outside-interval", ERROR, 3, doc(f"""
        {CDM}
        <url><loc>http://e.com/a</loc><rs:md change="deleted" datetime="2013-01-04T12:00:00Z"/></url>
    """)),
    ("up-link-missing", ERROR, 1, doc('<rs:md capability="capabilitylist"/>')),
    ("up-link-missing", ERROR, 1, doc(RL)),
    ("up-link-missing", WARNING, 1, doc(CL)),
    ("describedby-missing", WARNING, 1, doc(CAPL)),
    ("capability-entry-missing", ERROR, 3, doc(f"""
        {CAPL}
        <url><loc>http://e.com/rl.xml</loc></url>
    """)),
    ("capability-duplicate", ERROR, 4, doc(f"""
        {CAPL}
        <url><loc>http://e.com/rl.xml</loc><rs:md capability="resourcelist"/></url>
        <url><loc>http://e.com/rl2.xml</loc><rs:md capability="resourcelist"/></url>
    """)),
    ("capability-unknown", WARNING, 3, doc(f"""
        {CAPL}
        <url><loc>http://e.com/x.xml</loc><rs:md capability="everything"/></url>
    """)),
    ("capability-not-allowed", ERROR, 3, doc(f"""
        {CAPL}
        <url><loc>http://e.com/sd.xml</loc><rs:md capability="description"/></url>
    """)),
    ("hub-link-missing", ERROR, 3, doc(f"""
        {CAPL}
        <url><loc>http://e.com/topic</loc><rs:md capability="change-notification"/></url>
    """)),
    ("capability-not-allowed", ERROR, 3, doc("""
        <rs:md capability="description"/>
        <url><loc>http://e.com/rl.xml</loc><rs:md capability="resourcelist"/></url>
    """)),
    ("path-missing", ERROR, 3, doc(f"""
        {RDM}
        <url><loc>http://e.com/a</loc><rs:md type="text/plain"/></url>
    """)),
    ("path-leading-slash", ERROR, 3, doc(f"""
        {RDM}
        <url><loc>http://e.com/a</loc><rs:md path="resources/a" type="text/plain"/></url>
    """)),
    ("path-on-deletion", WARNING, 3, doc(f"""
        {CDM}
        <url><loc>http://e.com/a</loc><rs:md change="deleted" path="/changes/a"/></url>
    """)),
    ("type-missing", WARNING, 3, doc(f"""
        {RDM}
        <url><loc>http://e.com/a</loc><rs:md path="/resources/a"/></url>
    """)),
    ("path-not-allowed", WARNING, 3, doc(f"""
        {RL}
        <url><loc>http://e.com/a</loc><rs:md path="/a"/></url>
    """)),
    ("change-required", ERROR, 3, doc(f"""
        {CL}
        <url><loc>http://e.com/a</loc></url>
    """)),
    ("change-required", ERROR, 3, doc(f"""
        {CDM}
        <url><loc>http://e.com/a</loc><rs:md path="/changes/a" type="text/plain"/></url>
    """)),
    ("change-unknown", ERROR, 3, doc(f"""
        {CL}
        <url><loc>http://e.com/a</loc><rs:md change="modified"/></url>
    """)),
    ("change-not-allowed", WARNING, 3, doc(f"""
        {RL}
        <url><loc>http://e.com/a</loc><rs:md change="created"/></url>
    """)),
    ("datetime-not-allowed", WARNING, 3, doc(f"""
        {RL}
        <url><loc>http://e.com/a</loc><rs:md datetime="2013-01-03T09:00:00Z"/></url>
    """)),
    ("pri-range", ERROR, 3, doc(f"""
        {RL}
        <url><loc>http://e.com/a</loc><rs:ln rel="duplicate" href="http://m.e.com/a" pri="0"/></url>
    """)),
    ("pri-range", ERROR, 3, doc(f"""
        {RL}
        <url><loc>http://e.com/a</loc><rs:ln rel="duplicate" href="http://m.e.com/a" pri="1000000"/></url>
    """)),
    ("hash-token", WARNING, 3, doc(f"""
        {RL}
        <url><loc>http://e.com/a</loc><rs:md hash="md5:xyz"/></url>
    """)),
    ("hash-token", WARNING, 3, doc(f"""
        {RL}
        <url><loc>http://e.com/a</loc><rs:ln rel="duplicate" href="http://m.e.com/a" hash="sha1:00"/></url>
    """)),
    ("changefreq-unknown", ERROR, 3, doc(f"""
        {RL}
        <url><loc>http://e.com/a</loc><changefreq>sometimes</changefreq></url>
    """)),
    ("w3c-datetime", ERROR, 3, doc(f"""
        {RL}
        <url><loc>http://e.com/a</loc><lastmod>2013-01-02T13:00:00</lastmod></url>
    """)),
    ("w3c-datetime", ERROR, 2, doc(f'<rs:md capability="resourcelist" at="2013-01-03T09:00"/>\n{UP}')),
    ("datetime-form", WARNING, 2, doc(f'<rs:md capability="resourcelist" at="2013-01-03"/>\n{UP}')),
    # libxml2 gives an element the line where its start tag ends
    ("datetime-form", WARNING, 4, doc(f"""
        {RL}
        <url><loc>http://e.com/a</loc><rs:ln rel="duplicate" href="http://m.e.com/a"
                modified="2013-01-02T13:00:00+01:00"/></url>
    """)),
    ("ln-rel-missing", ERROR, 3, doc(f"""
        {RL}
        <url><loc>http://e.com/a</loc><rs:ln href="http://m.e.com/a"/></url>
    """)),
    ("ln-href-missing", ERROR, 3, doc(f"""
        {RL}
        <url><loc>http://e.com/a</loc><rs:ln rel="duplicate"/></url>
    """)),
    ("loc-duplicate", WARNING, 4, doc(f"""
        {RL}
        <url><loc>http://e.com/a</loc></url>
        <url><loc>http://e.com/a</loc></url>
    """)),
    ("attribute-prefixed", ERROR, 3, doc(f"""
        {RL}
        <url><loc>http://e.com/a</loc><rs:md rs:length="12"/></url>
    """)),
    ("change-required", ERROR, 3, doc("""
        <rs:md capability="framework-notification"/>
        <url><loc>http://e.com/rl.xml</loc><rs:md capability="resourcelist"/></url>
    """)),
    ("capability-entry-missing", ERROR, 3, doc("""
        <rs:md capability="framework-notification"/>
        <url><loc>http://e.com/rl.xml</loc><rs:md change="created"/></url>
    """)),
    ("capability-not-allowed", ERROR, 3, doc("""
        <rs:md capability="framework-notification"/>
        <url><loc>http://e.com/rl.xml</loc><rs:md change="created" capability="resourcedump-manifest"/></url>
    """)),
    ("index-not-allowed", ERROR, 1, doc(
        '<rs:md capability="change-notification" from="2013-01-03T00:00:00Z" until="2013-01-03T01:00:00Z"/>',
        root="sitemapindex")),
    ("hash-token", WARNING, 3, doc(f"""
        {RL}
        <url><loc>http://e.com/a</loc><rs:md hash="sha-512:{"ab" * 32}"/></url>
    """)),
    ("patch-type-missing", ERROR, 3, doc(f"""
        {CL}
        <url><loc>http://e.com/a</loc><rs:md change="updated"/>
          <rs:ln rel="http://www.openarchives.org/rs/terms/patch" href="http://e.com/a-diff"/></url>
    """)),
    ("patch-path-missing", ERROR, 3, doc(f"""
        {CDM}
        <url><loc>http://e.com/a</loc>
          <rs:md change="updated" path="/changes/a" type="application/json"/>
          <rs:ln rel="http://www.openarchives.org/rs/terms/patch" href="http://e.com/a-diff"
                 type="application/json-patch"/></url>
    """)),
    ("rel-unknown", ERROR, 3, doc(f"""
        {RL}
        <url><loc>http://e.com/a</loc><rs:ln rel="mirror" href="http://m.e.com/a"/></url>
    """)),
    ("rel-unknown", ERROR, 3, doc(f"""
        {RL}
        <url><loc>http://e.com/a</loc><rs:ln rel="duplicate mirror" href="http://m.e.com/a"/></url>
    """)),
    ("rel-unknown", ERROR, 1, doc(f'{RL}<rs:ln rel="capabilitylist" href="http://example.com/c.xml"/>')),
    ("loc-relative", ERROR, 3, doc(f"""
        {RL}
        <url><loc>/resources/a</loc></url>
    """)),
    ("loc-relative", ERROR, 3, doc(f"""
        {RL}
        <url><loc>a.html</loc></url>
    """)),
    ("loc-relative", ERROR, 3, doc("""
        <rs:md capability="description"/>
        <url><loc>//e.com/capabilitylist.xml</loc><rs:md capability="capabilitylist"/></url>
    """)),
    # An rs:ln href is a URI like <loc> (§7): relative is an error, on the document and on an entry.
    ("href-relative", ERROR, 1, doc(f'{RL}<rs:ln rel="up" href="capabilitylist.xml"/>')),
    ("href-relative", ERROR, 3, doc(f"""
        {RL}
        <url><loc>http://e.com/a</loc><rs:ln rel="duplicate" href="/mirror/a"/></url>
    """)),
    ("capability-on-entry", WARNING, 3, doc(f"""
        {RL}{UP}
        <url><loc>http://e.com/rl-2.xml</loc><rs:md capability="resourcelist"/></url>
    """)),
    # What a harvester tolerates is still an error of the document (POD 2020 shapes).
    ("loc-missing", ERROR, 3, doc(f"""
        {RL}{UP}
        <url>http://e.com/a</url>
    """)),
    ("element-order", ERROR, 3, doc(f"""
        {RL}{UP}
        <url><rs:md length="3"/><loc>http://e.com/a</loc></url>
    """)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("rule", "severity", "line", "data"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)]
)
def test_rule(rule: str, severity: str, line: int, data: bytes) -> None:
    assert_issue(data, rule, line, severity)


def test_clean_minimal_documents_have_no_issues() -> None:
    """The fixtures above are only failing because of the one thing each case adds."""
    for head in (f"{RL}\n{UP}", f"{CL}\n{UP}", f"{CAPL}\n<rs:ln rel='describedby' href='http://e.com/i'/>"):
        assert found(doc(head)) == []
    rdm = doc(f"""
        {RDM}
        {UP}
        <url><loc>http://e.com/a</loc><rs:md path="/resources/a" type="text/plain"/></url>
    """)
    assert found(rdm) == []


def test_sha512_tokens_are_well_formed() -> None:
    """sha-512 is a well-formed token (§7 names md5 and sha-256 as examples, not as the only ones)."""
    digest = "0123456789abcdef" * 8
    data = doc(f"""
        {RL}
        {UP}
        <url><loc>http://e.com/a</loc><rs:md hash="sha-512:{digest} md5:{"0" * 32}"/>
          <rs:ln rel="duplicate" href="http://m.e.com/a" hash="SHA-512:{digest.upper()}"/></url>
    """)
    assert found(data) == []


def test_relation_types_compare_case_insensitively() -> None:
    """RFC 8288 §2.1.1: registered relation types are case-insensitive, so UP is up, HUB is hub; URIs and
    §6.3.3's resourcesync are relation types too."""
    capl = doc("""
        <rs:md capability="capabilitylist"/>
        <rs:ln rel="UP" href="http://example.com/sd.xml"/>
        <rs:ln rel="DescribedBy" href="http://example.com/about"/>
        <url><loc>http://e.com/topic</loc><rs:md capability="change-notification"/>
          <rs:ln rel="Hub" href="http://hub.e.com/"/></url>
    """)
    assert found(capl) == []
    extension = doc(f"""
        {RL}
        {UP}
        <url><loc>http://e.com/a</loc><rs:ln rel="http://example.org/rel/mirror" href="http://m.e.com/a"/>
          <rs:ln rel="urn:example:rel" href="http://m.e.com/b"/>
          <rs:ln rel="resourcesync" href="http://e.com/capabilitylist.xml"/></url>
    """)
    assert found(extension) == []


def test_complete_patch_links_are_clean() -> None:
    """§14.4 as its Example 27 shows it, and inside a Change Dump Manifest with the patch's path."""
    cl = doc(f"""
        {CL}
        {UP}
        <url><loc>http://e.com/a</loc><rs:md change="updated"/>
          <rs:ln rel="http://www.openarchives.org/rs/terms/patch" href="http://e.com/a-diff"
                 type="application/json-patch"/></url>
    """)
    assert found(cl) == []
    cdm = doc(f"""
        {CDM}
        {UP}
        <url><loc>http://e.com/a</loc><rs:md change="updated" path="/changes/a" type="application/json"/>
          <rs:ln rel="http://www.openarchives.org/rs/terms/patch" href="http://e.com/a-diff"
                 type="application/json-patch" path="/changes/a-diff"/></url>
    """)
    assert found(cdm) == []


def test_more_than_50000_entries_is_one_error_at_the_first_entry_too_many() -> None:
    urls = "\n".join(f"<url><loc>http://e.com/{i}</loc></url>" for i in range(50_002))
    report = check_source(doc(f"{RL}\n{UP}\n{urls}"))
    assert report.entries == 50_002
    # The body starts at line 2; head and up take lines 2 and 3, entry n (from 1) is on line n + 3.
    assert [(i.rule, i.line, i.severity) for i in report.issues] == [("entries-limit", 50_004, ERROR)]
    exactly = "\n".join(f"<url><loc>http://e.com/{i}</loc></url>" for i in range(50_000))
    assert check_source(doc(f"{RL}\n{UP}\n{exactly}")).issues == []


ENCODED = f"""<urlset xmlns="{SM}" xmlns:rs="{RS}">
{RL}{UP}
<url><loc>http://e.com/caf\u00e9</loc></url>
</urlset>
"""


@pytest.mark.parametrize(
    ("data", "name"),
    [
        (f'<?xml version="1.0" encoding="ISO-8859-1"?>\n{ENCODED}'.encode("latin-1"), "ISO-8859-1"),
        (f"<?xml version='1.0' encoding='windows-1252' ?>\n{ENCODED}".encode("cp1252"), "windows-1252"),
        (f'<?xml version="1.0" encoding="UTF-16"?>\n{ENCODED}'.encode("utf-16"), "UTF-16"),
        (ENCODED.encode("utf-16"), "UTF-16"),  # byte-order mark, no declaration
        (ENCODED.encode("utf-16-be"), "UTF-16"),  # neither: the parser refuses it as well
        (ENCODED.encode("utf-32"), "UTF-32"),
    ],
)
def test_document_not_in_utf8(data: bytes, name: str) -> None:
    issues = validate_source(data)
    assert issues[0].rule == "encoding-not-utf8" and issues[0].line == 1 and issues[0].severity == ERROR
    assert name in issues[0].message
    assert all(i.rule in ("encoding-not-utf8", "malformed") for i in issues), issues


@pytest.mark.parametrize(
    "data",
    [
        ENCODED.encode(),
        b"\xef\xbb\xbf" + ENCODED.encode(),  # UTF-8 byte-order mark
        f'<?xml version="1.0" encoding="utf-8"?>\n{ENCODED}'.encode(),
        f'<?xml version="1.0" encoding="US-ASCII"?>\n{ENCODED}'.encode("ascii", "xmlcharrefreplace"),
    ],
)
def test_utf8_documents_pass_the_encoding_check(data: bytes) -> None:
    assert validate_source(data) == []


def test_encoding_declaration_split_across_feeds() -> None:
    """Bytes arrive in any pieces (a URL is validated while it downloads)."""
    data = f'<?xml version="1.0" encoding="ISO-8859-1"?>\n{ENCODED}'.encode("latin-1")
    checker = Checker()
    issues = [i for b in range(len(data)) for i in checker.feed(data[b : b + 1])] + checker.close()
    assert [(i.rule, i.line) for i in issues] == [("encoding-not-utf8", 1)]


def test_entries_without_order_keys_and_equal_datetimes_are_in_order() -> None:
    data = doc(f"""
        {CL}
        {UP}
        <url><loc>http://e.com/a</loc><rs:md change="updated" datetime="2013-01-03T11:00:00Z"/></url>
        <url><loc>http://e.com/b</loc><rs:md change="updated" datetime="2013-01-03T11:00:00Z"/></url>
        <url><loc>http://e.com/c</loc><rs:md change="updated"/></url>
        <url><loc>http://e.com/d</loc><lastmod>2000-01-01T00:00:00Z</lastmod><rs:md change="deleted"/></url>
    """)
    assert found(data) == []


def test_changelist_up_warning_only_where_text_does_not_say_mandatory() -> None:
    """§12.2 makes up mandatory for a Change List Index; §12.1 does not list it for a Change List."""
    index = doc('<rs:md capability="changelist" from="2013-01-01T00:00:00Z"/>', root="sitemapindex")
    assert ("up-link-missing", 1, ERROR) in found(index)
    assert ("up-link-missing", 1, WARNING) in found(doc(CL))


def test_source_description_index_is_allowed() -> None:
    """§8: several Source Descriptions "must" be grouped by a Source Description Index."""
    data = doc(
        """
        <rs:md capability="description"/>
        <rs:ln rel="describedby" href="http://e.com/about"/>
        <sitemap><loc>http://e.com/sd1.xml</loc></sitemap>
        """,
        root="sitemapindex",
    )
    assert found(data) == []


def test_malformed_document_gives_one_issue_and_stops() -> None:
    issues = validate_source(b'<urlset xmlns="' + SM.encode() + b'">\n<url><loc>x</loc>\n</urlset>')
    assert [i.rule for i in issues if i.rule == "malformed"] == ["malformed"]
    assert issues[-1].rule == "malformed"
    assert all(i.severity == ERROR for i in issues if i.rule == "malformed")


@pytest.mark.parametrize(
    ("body", "rule"),
    [
        ("<url><lastmod>2013-01-02T13:00:00Z</lastmod></url>", "loc-missing"),
        ("<url><loc>  </loc></url>", "loc-missing"),
        ('<url><loc>http://e.com/a</loc><rs:ln href="http://m.e.com/a"/></url>', "ln-rel-missing"),
        ('<url><loc>http://e.com/a</loc><rs:ln rel="" href="http://m.e.com/a"/></url>', "ln-rel-missing"),
        ('<url><loc>http://e.com/a</loc><rs:ln rel="duplicate" href=""/></url>', "ln-href-missing"),
        ('<url><loc>http://e.com/a</loc><rs:md size="12"/></url>', "attribute-unknown"),
        ('<url><loc>http://e.com/a</loc><rs:md rs:length="12"/></url>', "attribute-prefixed"),
        ('<url><loc>http://e.com/a</loc><rs:md length="-1"/></url>', "value"),
        ("<url><loc>http://e.com/a</loc><lastmod>yesterday</lastmod></url>", "value"),
        ('<url><loc>http://e.com/a</loc><rs:ln rel="duplicate" href="http://m" pri="high"/></url>', "value"),
    ],
)
def test_each_problem_is_reported_once(body: str, rule: str) -> None:
    """Problems the parser reports itself are not reported again by the rules."""
    issues = validate_source(doc(f"{RL}\n{UP}\n{body}"))
    assert [(i.rule, i.line, i.severity) for i in issues] == [(rule, 4, ERROR)]


def test_entry_of_the_wrong_root_is_malformed() -> None:
    """A <sitemap> in a <urlset> is refused by the parser: one ``malformed`` issue, nothing after it."""
    data = doc(f"""
        {RL}
        {UP}
        <sitemap><loc>http://e.com/a</loc></sitemap>
        <url><loc>http://e.com/b</loc><changefreq>often</changefreq></url>
    """)
    issues = validate_source(data)
    assert [(i.rule, i.line) for i in issues] == [("malformed", 4)]


def test_gzip_document_is_read() -> None:
    data = gzip.compress(doc(f"{RL}\n{UP}\n<url><loc>http://e.com/a</loc></url>"))
    report = check_source(data)
    assert report.entries == 1 and report.valid and report.issues == []


def test_gzip_bomb_stops_at_the_byte_cap() -> None:
    bomb = gzip.compress(doc(f"{RL}\n{UP}")[:-10] + b" " * 50_000_000, compresslevel=9)
    report = check_source(bomb, max_bytes=1_000_000)
    assert [i.rule for i in report.issues] == ["malformed"]
    assert "max_bytes" in report.issues[0].message


def test_truncated_gzip_is_malformed() -> None:
    data = gzip.compress(doc(f"{RL}\n{UP}\n<url><loc>http://e.com/a</loc></url>"))
    issues = validate_source(data[: len(data) // 2])
    assert issues[-1].rule == "malformed"


def test_issues_per_rule_are_capped_but_counted() -> None:
    urls = "\n".join(
        f"<url><loc>http://e.com/{i}</loc><changefreq>often</changefreq></url>" for i in range(30)
    )
    report = check_source(doc(f"{RL}\n{UP}\n{urls}"), max_per_rule=5)
    shown = [i for i in report.issues if i.rule == "changefreq-unknown"]
    assert len(shown) == 6 and "25 more" in shown[-1].message
    assert report.errors == 30 and not report.valid


def test_duplicate_window_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    import aggregator.rs.validate as v

    monkeypatch.setattr(v, "LOC_WINDOW", 2)
    urls = "\n".join(f"<url><loc>http://e.com/{n}</loc></url>" for n in ("a", "b", "c", "a", "c"))
    issues = validate_source(doc(f"{RL}\n{UP}\n{urls}"))
    assert [(i.rule, i.line) for i in issues] == [("loc-duplicate", 8)]  # "a" fell out of the window


# --- validate_stream with model objects -------------------------------------------------------------------
def t(s: str) -> datetime:
    return datetime.fromisoformat(s).replace(tzinfo=UTC)


def test_validate_stream_model_objects() -> None:
    head = Head(
        md=Md(capability="changelist", from_=t("2013-01-03T00:00:00")),
        links=[Link("up", "http://e.com/cl")],
        line=1,
    )
    entries = [
        Entry("http://e.com/a", md=Md(change="created", datetime=t("2013-01-03T10:00:00")), line=5),
        Entry("http://e.com/b", md=Md(change="gone", datetime=t("2013-01-03T09:00:00")), line=9),
        Entry("http://e.com/c", md=None, line=12),
    ]
    got = [(i.rule, i.line) for i in validate_stream([head, *entries])]
    assert got == [("change-unknown", 9), ("chronological-order", 9), ("change-required", 12)]


def test_validate_stream_is_lazy_and_needs_head_first() -> None:
    def items():
        yield Head(
            md=Md(capability="resourcelist", at=t("2013-01-03T00:00:00")),
            links=[Link("up", "http://e.com/cl")],
        )
        while True:  # an endless list: the validator must not try to hold it
            yield Entry("http://e.com/a", changefreq="often", line=3)

    stream = validate_stream(items())
    first = [next(stream) for _ in range(3)]
    assert [i.rule for i in first] == ["changefreq-unknown", "changefreq-unknown", "loc-duplicate"]
    with pytest.raises(ValueError):
        list(validate_stream([Entry("http://e.com/a")]))


# --- the specification's own examples ----------------------------------------------------------------------
#: Where the validator objects to an example of the specification, and why (for the README).
EXPECTED_OBJECTIONS: dict[str, set[tuple[str, str]]] = {
    # §1.3 walkthrough examples are cut down: no rel="up" (mandatory in §10.1 / §11.1).
    "resourcesync_ex_1.xml": {("up-link-missing", ERROR)},
    "resourcesync_ex_2.xml": {("up-link-missing", ERROR)},
    "resourcesync_ex_4.xml": {("up-link-missing", ERROR)},
    # §12.1 / §11.2 / §10.2 text lists no rel="up" for these, so its absence is only a warning.
    "resourcesync_ex_3.xml": {("up-link-missing", WARNING)},
    "resourcesync_ex_5.xml": {("up-link-missing", WARNING), ("type-missing", WARNING)},
    "resourcesync_ex_8.xml": {("up-link-missing", WARNING)},
    # §14.4 patch example: base64-looking digests are not hex tokens (NOTES.md: warn, never match).
    "resourcesync_ex_27.xml": {("hash-token", WARNING)},
}


def example_files() -> list[Path]:
    return sorted(EXAMPLES.glob("*.xml"))


@pytest.mark.skipif(not EXAMPLES.is_dir(), reason="spec examples not available")
@pytest.mark.parametrize("path", example_files(), ids=lambda p: p.name)
def test_spec_example(path: Path) -> None:
    issues = validate_source(path)
    assert {(i.rule, i.severity) for i in issues} == EXPECTED_OBJECTIONS.get(path.name, set()), issues


def test_expected_objections_name_real_examples() -> None:
    names = {p.name for p in example_files()}
    assert set(EXPECTED_OBJECTIONS) <= names
    assert len(names) >= 30


FRAMEWORK_EXAMPLES = {
    # Framework Notification 1.0 examples 1, 2 and 8 (not in examples/; copied from the text).
    "fn_ex_1": doc("""
        <rs:ln rel="up" href="http://example.com/dataset1/capabilitylist.xml"/>
        <rs:md capability="framework-notification"/>
        <url>
          <loc>http://example.com/resourceset1/resourcelist.xml</loc>
          <rs:md change="created" datetime="2013-01-03T00:07:22Z" capability="resourcelist"/>
        </url>
    """),
    "fn_ex_2": doc("""
        <rs:md capability="framework-notification"/>
        <url>
          <loc>http://example.com/dataset1/resourcelist.xml</loc>
          <rs:md change="created" capability="resourcelist"/>
          <rs:ln rel="index" href="http://example.com/dataset1/resourcelist-index.xml"/>
        </url>
        <url>
          <loc>http://example.com/dataset1/resourcedump.xml</loc>
          <rs:md change="created" capability="resourcedump"/>
        </url>
        <url>
          <loc>http://example.com/dataset1/changelist.xml</loc>
          <rs:md change="updated" capability="changelist"/>
        </url>
    """),
    "fn_ex_8": doc("""
        <rs:ln rel="describedby" href="http://example.com/info_about_set1_of_resources.xml"/>
        <rs:ln rel="up" href="http://example.com/source_description.xml"/>
        <rs:md capability="capabilitylist"/>
        <url><loc>http://example.com/dataset1/resourcelist.xml</loc><rs:md capability="resourcelist"/></url>
        <url><loc>http://example.com/dataset1/changelist.xml</loc><rs:md capability="changelist"/></url>
        <url>
          <loc>http://example.com/dataset1/framework/</loc>
          <rs:ln rel="hub" href="http://hub.example.org/pubsubhubbub/"/>
          <rs:md capability="framework-notification"/>
        </url>
    """),
}


@pytest.mark.parametrize("name", sorted(FRAMEWORK_EXAMPLES))
def test_framework_notification_examples(name: str) -> None:
    assert validate_source(FRAMEWORK_EXAMPLES[name]) == []


# --- CLI ---------------------------------------------------------------------------------------------------
def write(tmp_path: Path, name: str, data: bytes) -> str:
    p = tmp_path / name
    p.write_bytes(data)
    return str(p)


GOOD = doc(f"{RL}\n{UP}\n<url><loc>http://e.com/a</loc></url>")
BAD = doc(f"{RL}\n<url><loc>http://e.com/a</loc><changefreq>often</changefreq></url>")  # lines 1 and 3


def test_cli_valid_document(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "good.xml", GOOD)
    assert main(["validate", path]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [f"{path}: Resource List, 1 entries: valid (0 error(s), 0 warning(s))"]


def test_cli_errors_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good, bad = write(tmp_path, "good.xml", GOOD), write(tmp_path, "bad.xml", BAD)
    assert main(["validate", good, bad]) == 1
    out = capsys.readouterr().out.splitlines()
    assert f"{bad}:1: error: up-link-missing: " in "\n".join(out)
    assert any(line.startswith(f"{bad}:3: error: changefreq-unknown: ") for line in out)
    assert out[-1] == f"{bad}: Resource List, 1 entries: invalid (2 error(s), 0 warning(s))"


def test_cli_names_rule_and_line_of_the_new_checks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = f"""<?xml version="1.0" encoding="ISO-8859-1"?>
<urlset xmlns="{SM}" xmlns:rs="{RS}">
{CL}{UP}
<url><loc>res/a</loc><rs:md change="updated" path="/a"/></url>
<url><loc>http://e.com/b</loc><rs:md change="updated"/><rs:ln rel="Mirror" href="http://m.e.com/b"/></url>
<url><loc>http://e.com/c</loc><rs:md change="updated"/>
  <rs:ln rel="http://www.openarchives.org/rs/terms/patch" href="http://e.com/c-diff"/></url>
</urlset>
""".encode("latin-1")
    path = write(tmp_path, "cl.xml", data)
    assert main(["validate", path]) == 1
    out = capsys.readouterr().out.splitlines()
    for expected in (
        f"{path}:1: error: encoding-not-utf8: ",
        f"{path}:4: error: loc-relative: ",
        f"{path}:4: warning: path-not-allowed: ",
        f"{path}:5: error: rel-unknown: relation type 'mirror'",
        f"{path}:6: error: patch-type-missing: ",
    ):
        assert any(line.startswith(expected) for line in out), (expected, out)
    assert out[-1] == f"{path}: Change List, 3 entries: invalid (4 error(s), 1 warning(s))"


def test_cli_warnings_only_exit_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "cl.xml", doc(CL))
    assert main(["validate", path]) == 0
    assert f"{path}:1: warning: up-link-missing:" in capsys.readouterr().out


def test_cli_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good, bad = write(tmp_path, "good.xml", GOOD), write(tmp_path, "bad.xml", BAD)
    assert main(["validate", "--json", good, bad]) == 1
    result = json.loads(capsys.readouterr().out)
    d_good, d_bad = result["documents"]
    assert d_good == {
        "source": good, "kind": "Resource List", "capability": "resourcelist", "entries": 1, "valid": True,
        "errors": 0, "warnings": 0, "issues": [],
    }  # fmt: skip
    assert d_bad["valid"] is False and d_bad["entries"] == 1
    assert [(i["line"], i["rule"], i["severity"]) for i in d_bad["issues"]] == [
        (1, "up-link-missing", "error"),
        (3, "changefreq-unknown", "error"),
    ]


def test_cli_malformed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "broken.xml", b"<urlset")
    assert main(["validate", path]) == 1
    assert ": error: malformed: " in capsys.readouterr().out


def test_cli_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(tmp_path / "nope.xml")
    assert main(["validate", path, write(tmp_path, "bad.xml", BAD)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{path}: error: fetch: ")


def test_cli_max_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "good.xml", GOOD)
    assert main(["validate", "--max-bytes", "64", path]) == 1
    assert ": error: malformed: " in capsys.readouterr().out


def test_cli_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["validate"])
    assert exc.value.code == 2


class _Handler(http.server.BaseHTTPRequestHandler):
    documents: ClassVar[dict[str, bytes]] = {}

    def do_GET(self) -> None:
        body = self.documents.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server():
    _Handler.documents = {"/good.xml": GOOD, "/bad.xml": BAD}
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


def test_cli_url(server: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "--json", f"{server}/good.xml", f"{server}/bad.xml"]) == 1
    docs = json.loads(capsys.readouterr().out)["documents"]
    assert [(d["source"], d["valid"], d["entries"]) for d in docs] == [
        (f"{server}/good.xml", True, 1),
        (f"{server}/bad.xml", False, 1),
    ]


def test_cli_url_http_error(server: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", f"{server}/missing.xml"]) == 2
    assert capsys.readouterr().err.strip() == f"{server}/missing.xml: error: fetch: HTTP 404 Not Found"


def test_cli_unreachable_url(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:  # a port nobody listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/capabilitylist.xml"
        assert main(["validate", "--json", url]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"{url}: error: fetch: ConnectError")
    (d,) = json.loads(captured.out)["documents"]
    assert d["valid"] is False and d["error"].startswith("ConnectError")


def test_issue_defaults_to_error() -> None:
    assert Issue(3, "x", "y").severity == ERROR
