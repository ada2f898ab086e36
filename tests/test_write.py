"""The streaming writer: structure, escaping, foreign markup, chunking, and splitting under an index.

Output is checked with lxml directly (not with our own parser) so that these tests stand on their own.
"""

from __future__ import annotations

import io
import random
import re
from datetime import UTC, datetime, timedelta, timezone

import pytest
from lxml import etree

from aggregator.rs import write as write_mod
from aggregator.rs.model import LN_ATTRS, MD_ATTRS, RS_NS, SITEMAP_NS, SITEMAPINDEX, Entry, Head, Link, Md
from aggregator.rs.w3cdt import format_w3c
from aggregator.rs.write import iter_document_bytes, write_document, write_split

S = f"{{{SITEMAP_NS}}}"
RS = f"{{{RS_NS}}}"
T0 = datetime(2013, 1, 3, 9, 0, 0, tzinfo=UTC)


def doc(head: Head, entries) -> bytes:
    out = io.BytesIO()
    write_document(out, head, entries)
    return out.getvalue()


def rl_head(**kw) -> Head:
    return Head(
        md=Md(capability="resourcelist", at=T0, **kw), links=[Link("up", "http://example.com/cap.xml")]
    )


def resource(i: int) -> Entry:
    return Entry(
        loc=f"http://example.com/res{i}",
        lastmod=T0 - timedelta(hours=i),
        md=Md(hash=f"md5:{i:032x}", length=1000 + i, type="text/html"),
    )


class Files:
    """open_part/open_index targets that keep what was written and notice being closed."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.open: set[str] = set()

    def _stream(self, name: str) -> io.BytesIO:
        assert name not in self.data, f"{name} opened twice"
        files = self
        files.open.add(name)

        class Stream(io.BytesIO):
            def close(self) -> None:
                if not self.closed:
                    files.data[name] = self.getvalue()
                    files.open.discard(name)
                super().close()

        return Stream()

    def part(self, n: int) -> io.BytesIO:
        return self._stream(f"part{n}")

    def index(self) -> io.BytesIO:
        return self._stream("index")


def split(head: Head, entries, **kw):
    files = Files()
    result = write_split(
        head,
        entries,
        index_url="http://example.com/rl-index.xml",
        part_url=lambda n: f"http://example.com/rl-part{n}.xml",
        open_part=files.part,
        open_index=files.index,
        **kw,
    )
    assert not files.open, "every stream is closed"
    return result, files.data


# -- one document ----------------------------------------------------------------------------------------


def test_structure_of_a_resource_list():
    head = rl_head(completed=T0 + timedelta(minutes=1))
    entries = [resource(1), resource(2)]
    entries[1].links = [Link("duplicate", "http://mirror.example.com/res2", pri=1)]
    data = doc(head, entries)
    assert data.startswith(b'<?xml version="1.0" encoding="UTF-8"?>\n<urlset ')
    root = etree.fromstring(data)
    assert root.tag == S + "urlset"
    assert root.nsmap == {None: SITEMAP_NS, "rs": RS_NS}
    kids = list(root)
    assert [k.tag for k in kids] == [RS + "md", RS + "ln", S + "url", S + "url"]
    assert dict(kids[0].attrib) == {
        "capability": "resourcelist",
        "at": "2013-01-03T09:00:00Z",
        "completed": "2013-01-03T09:01:00Z",
    }
    assert dict(kids[1].attrib) == {"rel": "up", "href": "http://example.com/cap.xml"}
    url = kids[3]
    assert [c.tag for c in url] == [S + "loc", S + "lastmod", RS + "md", RS + "ln"]
    assert url.findtext(S + "loc") == "http://example.com/res2"
    assert url.findtext(S + "lastmod") == "2013-01-03T07:00:00Z"
    assert dict(url.find(RS + "md").attrib) == {
        "hash": "md5:00000000000000000000000000000002",
        "length": "1002",
        "type": "text/html",
    }
    assert dict(url.find(RS + "ln").attrib) == {
        "rel": "duplicate",
        "href": "http://mirror.example.com/res2",
        "pri": "1",
    }


def test_attribute_order_is_the_model_order():
    md = Md(path="/p", encoding="gzip", type="t/x", length=5, hash="md5:x", until=T0, from_=T0, completed=T0,
            at=T0, datetime=T0, change="updated", capability="c")  # fmt: skip
    ln = Link("r", "h", path="/p", encoding="e", type="t", length=1, hash="md5:y", modified=T0, pri=2)
    data = doc(
        Head(md=Md(capability="changelist", from_=T0)), [Entry("http://x/", md=md, links=[ln])]
    ).decode()
    md_names = re.findall(r" (\w+)=", re.search(r"<url><loc>[^<]*</loc>(<rs:md[^>]*>)", data).group(1))
    assert md_names == list(MD_ATTRS)
    ln_names = re.findall(r" (\w+)=", re.search(r"(<rs:ln[^>]*>)", data).group(1))
    assert ln_names == list(LN_ATTRS)


def test_sitemapindex_has_sitemap_children():
    head = Head(root=SITEMAPINDEX, md=Md(capability="resourcelist", at=T0))
    root = etree.fromstring(doc(head, [Entry("http://example.com/p1.xml", md=Md(at=T0))]))
    assert root.tag == S + "sitemapindex"
    assert [k.tag for k in root] == [RS + "md", S + "sitemap"]
    assert root.find(S + "sitemap").find(RS + "md").get("at") == "2013-01-03T09:00:00Z"


def test_write_document_returns_the_entry_count():
    out = io.BytesIO()
    assert write_document(out, rl_head(), (resource(i) for i in range(7))) == 7
    assert len(etree.fromstring(out.getvalue()).findall(S + "url")) == 7


def test_times_are_written_in_utc_with_z():
    plus_one = timezone(timedelta(hours=1))
    head = Head(md=Md(capability="changelist", from_=datetime(2013, 1, 3, 10, 0, tzinfo=plus_one)))
    e = Entry(
        "http://example.com/a",
        lastmod=datetime(2013, 1, 2, 13, 0, 0, 250000, tzinfo=UTC),
        md=Md(change="updated", datetime=datetime(2013, 1, 2, 20, 30, tzinfo=timezone(timedelta(hours=-5)))),
        links=[Link("via", "http://o/", modified=datetime(2013, 1, 1, 0, 0))],  # naive: read as UTC
    )
    root = etree.fromstring(doc(head, [e]))
    assert root.find(RS + "md").get("from") == "2013-01-03T09:00:00Z"
    url = root.find(S + "url")
    assert url.findtext(S + "lastmod") == "2013-01-02T13:00:00.25Z"
    assert url.find(RS + "md").get("datetime") == "2013-01-03T01:30:00Z"
    assert url.find(RS + "ln").get("modified") == "2013-01-01T00:00:00Z"


def test_fast_time_format_matches_format_w3c():
    rnd = random.Random(7)
    zones = [UTC, timezone(timedelta(hours=5, minutes=30)), timezone(timedelta(hours=-8))]
    for _ in range(2000):
        dt = datetime(1, 1, 1, tzinfo=UTC) + timedelta(seconds=rnd.randrange(0, 315_000_000_000))
        dt = dt.astimezone(rnd.choice(zones)).replace(microsecond=rnd.choice([0, 0, 1, 500000, 999999]))
        assert write_mod._dt(dt) == format_w3c(dt)


def test_empty_document():
    root = etree.fromstring(doc(rl_head(), []))
    assert [k.tag for k in root] == [RS + "md", RS + "ln"]


def test_bad_root_is_refused():
    with pytest.raises(ValueError, match="root"):
        doc(Head(root="feed"), [])


# -- escaping --------------------------------------------------------------------------------------------

TRICKY = "a&b<c>d\"e'f]]>g é ∑ 𝄞"


def test_text_and_attributes_are_escaped_and_read_back_exactly():
    e = Entry(
        loc="http://example.com/?q=" + TRICKY,
        changefreq="daily",
        md=Md(type=TRICKY, path="/with\ttab\nand\r\nnewlines", extra={"{http://x/}v": TRICKY}),
        links=[Link(rel="alternate", href="http://example.com/x?a=1&b=2", type='t"q')],
    )
    data = doc(rl_head(), [e])
    url = etree.fromstring(data).find(S + "url")
    assert url.findtext(S + "loc") == "http://example.com/?q=" + TRICKY
    md = url.find(RS + "md")
    assert md.get("type") == TRICKY
    assert md.get("path") == "/with\ttab\nand\r\nnewlines"  # char refs survive attribute normalization
    assert md.get("{http://x/}v") == TRICKY
    assert url.find(RS + "ln").get("href") == "http://example.com/x?a=1&b=2"
    assert url.find(RS + "ln").get("type") == 't"q'
    assert b"]]>" not in data
    assert "𝄞".encode() in data  # UTF-8, not character references


@pytest.mark.parametrize(
    "bad", ["\x00", "\x01", "\x0b", "\x0c", "\x1f", "\ud800", "\udfff", "\ufffe", "\uffff"]
)
@pytest.mark.parametrize("where", ["loc", "hash", "href", "extra", "changefreq"])
def test_characters_xml_forbids_raise_naming_the_entry(bad, where):
    loc = "http://example.com/bad"
    e = Entry(loc=loc, md=Md(hash="md5:1"), links=[Link("duplicate", "http://m/")])
    if where == "loc":
        e.loc = loc + bad
    elif where == "hash":
        e.md.hash = "md5:1" + bad
    elif where == "href":
        e.links[0].href = "http://m/" + bad
    elif where == "extra":
        e.md.extra = {"{http://x/}a": bad}
    else:
        e.changefreq = bad
    with pytest.raises(ValueError, match=re.escape(repr(e.loc))) as info:
        doc(rl_head(), [resource(1), e])
    assert f"U+{ord(bad):04X}" in str(info.value)


def test_bad_character_in_head_is_reported():
    with pytest.raises(ValueError, match="head"):
        doc(Head(md=Md(capability="resourcelist\x00")), [])


def test_non_integer_length_or_pri_is_refused():
    with pytest.raises(ValueError, match="res-x"):
        doc(rl_head(), [Entry("http://example.com/res-x", md=Md(length='1" injected="x'))])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="integer"):
        doc(rl_head(), [Entry("http://example.com/y", links=[Link("d", "h", pri="1")])])  # type: ignore[arg-type]


def test_entry_without_loc_is_refused():
    with pytest.raises(ValueError, match="loc"):
        doc(rl_head(), [Entry(loc="")])


# -- foreign markup --------------------------------------------------------------------------------------

DC = "http://purl.org/dc/elements/1.1/"
XML_LANG = "{http://www.w3.org/XML/1998/namespace}lang"


def test_foreign_attributes_are_preserved_with_declared_prefixes():
    extra = {f"{{{DC}}}creator": "Ann", "{http://example.org/a}x": "1", XML_LANG: "en", "plain": "p"}
    e1 = Entry("http://example.com/1", md=Md(hash="md5:1", extra=extra), links=[Link("up", "u", extra=extra)])
    e2 = Entry("http://example.com/2", md=Md(extra={"{http://example.org/a}x": "2"}))
    head = Head(md=Md(capability="resourcelist", at=T0, extra={f"{{{DC}}}date": "2013"}))
    data = doc(head, [e1, e2])
    root = etree.fromstring(data)
    assert root.find(RS + "md").get(f"{{{DC}}}date") == "2013"
    urls = root.findall(S + "url")
    assert dict(urls[0].find(RS + "md").attrib) == {"hash": "md5:1", **extra}
    assert dict(urls[0].find(RS + "ln").attrib) == {"rel": "up", "href": "u", **extra}
    assert dict(urls[1].find(RS + "md").attrib) == {"{http://example.org/a}x": "2"}
    text = data.decode()
    # One stable prefix per namespace within the document, declared where used; xml: never declared.
    prefix = re.search(r'xmlns:(\w+)="http://example.org/a"', text).group(1)
    assert text.count(f'xmlns:{prefix}="http://example.org/a"') == 3
    assert f'{prefix}:x="2"' in text
    assert "xmlns:xml" not in text
    # Extras after the model attributes, sorted by key.
    tag = re.search(r"<url><loc>http://example.com/1</loc>(<rs:md[^>]*>)", text).group(1)
    names = [n for n in re.findall(r" ([\w:]+)=", tag) if not n.startswith("xmlns")]
    dc_prefix = re.search(rf'xmlns:(\w+)="{DC}"', tag).group(1)
    assert names == ["hash", "plain", f"{prefix}:x", f"{dc_prefix}:creator", "xml:lang"]  # Clark keys sorted


def test_same_input_same_bytes():
    def entries():
        return [Entry("http://example.com/1", md=Md(extra={"{http://b/}y": "1", "{http://a/}x": "2"}))]

    assert doc(rl_head(), entries()) == doc(rl_head(), entries())


@pytest.mark.parametrize(
    "key",
    ["hash", "xmlns", "{http://x/}a b", "1abc", "{http://x/}", "a:b", "{http://www.w3.org/2000/xmlns/}p"],
)
def test_unwritable_extra_attribute_names_are_refused(key):
    with pytest.raises(ValueError, match="res1"):
        doc(rl_head(), [Entry("http://example.com/res1", md=Md(extra={key: "v"}))])


def test_foreign_elements_are_written_verbatim():
    title = f'<dc:title xmlns:dc="{DC}">A &amp; B</dc:title>'
    other = '<x:thing xmlns:x="http://example.org/x" a="1"><x:sub/></x:thing>'
    head = rl_head()
    head.extra = [other]
    data = doc(head, [Entry("http://example.com/1", md=Md(type="t"), extra=[title, other])])
    assert title.encode() in data and data.count(other.encode()) == 2
    root = etree.fromstring(data)
    assert root.find("{http://example.org/x}thing") is not None
    url = root.find(S + "url")
    assert [c.tag for c in url] == [S + "loc", RS + "md", f"{{{DC}}}title", "{http://example.org/x}thing"]
    assert url.findtext(f"{{{DC}}}title") == "A & B"


def test_sitemap_priority_goes_after_changefreq():
    priority = f'<priority xmlns="{SITEMAP_NS}">0.5</priority>'
    e = Entry(
        "http://example.com/1",
        changefreq="daily",
        md=Md(type="t"),
        extra=[f'<x:a xmlns:x="{DC}"/>', priority],
    )
    url = etree.fromstring(doc(rl_head(), [e])).find(S + "url")
    assert [c.tag for c in url] == [S + "loc", S + "changefreq", S + "priority", RS + "md", f"{{{DC}}}a"]


@pytest.mark.parametrize(
    "bad",
    [
        "<a>",
        "</url><url><loc>http://evil/</loc>",
        "<p:x/>",  # undeclared prefix
        '<!DOCTYPE x [<!ENTITY e "boom">]><x>&e;</x>',
        '<?xml version="1.0"?><x/>',
        "<x>\x01</x>",
        "<x>&undefined;</x>",
    ],
)
def test_malformed_foreign_elements_are_refused(bad):
    with pytest.raises(ValueError, match="res1"):
        doc(rl_head(), [Entry("http://example.com/res1", extra=[bad])])


# -- chunks ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [1, 100, 4096, 65536])
def test_chunks_concatenate_to_write_document_output(chunk_size):
    entries = [resource(i) for i in range(300)]
    chunks = list(iter_document_bytes(rl_head(), entries, chunk_size=chunk_size))
    assert b"".join(chunks) == doc(rl_head(), entries)
    if chunk_size <= 4096:
        assert len(chunks) > 1
        assert all(len(c) < chunk_size + 300 for c in chunks)  # about chunk_size: at most one entry over


def test_entries_are_pulled_lazily():
    pulled = []

    def entries():
        for i in range(10_000):
            pulled.append(i)
            yield resource(i)

    chunks = iter_document_bytes(rl_head(), entries(), chunk_size=1000)
    next(chunks)
    assert 0 < len(pulled) < 100


# -- split -----------------------------------------------------------------------------------------------


def parse(data: bytes):
    return etree.fromstring(data)


def test_no_split_when_everything_fits():
    result, files = split(rl_head(), [resource(i) for i in range(5)], max_entries=5)
    assert not result.indexed and result.part_count == 0 and result.entry_count == 5
    assert set(files) == {"index"}
    assert result.index_bytes == len(files["index"])
    root = parse(files["index"])
    assert root.tag == S + "urlset"
    assert [ln.get("rel") for ln in root.findall(RS + "ln")] == ["up"]
    assert len(root.findall(S + "url")) == 5
    assert files["index"] == doc(rl_head(), [resource(i) for i in range(5)])


def test_no_entries_gives_an_empty_single_document():
    result, files = split(rl_head(), [], max_entries=5)
    assert (result.indexed, result.entry_count, set(files)) == (False, 0, {"index"})


def test_split_by_max_entries_resource_list():
    head = rl_head(completed=T0 + timedelta(minutes=10))
    entries = [resource(i) for i in range(12)]
    result, files = split(head, iter(entries), max_entries=5)
    assert result.indexed and result.entry_count == 12 and result.part_count == 3
    assert set(files) == {"part1", "part2", "part3", "index"}
    assert [p.entries for p in result.parts] == [5, 5, 2]
    assert [p.number for p in result.parts] == [1, 2, 3]
    assert [p.url for p in result.parts] == [f"http://example.com/rl-part{n}.xml" for n in (1, 2, 3)]
    locs = []
    for n, info in enumerate(result.parts, 1):
        data = files[f"part{n}"]
        assert info.bytes == len(data)
        root = parse(data)
        assert root.tag == S + "urlset"
        assert [k.tag for k in root][:3] == [RS + "md", RS + "ln", RS + "ln"]
        assert dict(root.find(RS + "md").attrib) == {
            "capability": "resourcelist",
            "at": "2013-01-03T09:00:00Z",
            "completed": "2013-01-03T09:10:00Z",
        }
        links = [(ln.get("rel"), ln.get("href")) for ln in root.findall(RS + "ln")]
        assert links == [("up", "http://example.com/cap.xml"), ("index", "http://example.com/rl-index.xml")]
        locs += [u.findtext(S + "loc") for u in root.findall(S + "url")]
    assert locs == [e.loc for e in entries]

    index = parse(files["index"])
    assert index.tag == S + "sitemapindex"
    assert result.index_bytes == len(files["index"])
    assert dict(index.find(RS + "md").attrib) == {
        "capability": "resourcelist",
        "at": "2013-01-03T09:00:00Z",
        "completed": "2013-01-03T09:10:00Z",
    }
    assert [(ln.get("rel"), ln.get("href")) for ln in index.findall(RS + "ln")] == [
        ("up", "http://example.com/cap.xml")
    ]
    sitemaps = index.findall(S + "sitemap")
    assert [s.findtext(S + "loc") for s in sitemaps] == [p.url for p in result.parts]
    for s in sitemaps:
        assert dict(s.find(RS + "md").attrib) == {
            "at": "2013-01-03T09:00:00Z",
            "completed": "2013-01-03T09:10:00Z",
        }


def test_split_by_max_bytes():
    entries = [resource(i) for i in range(10, 50)]  # all entries the same size
    one_entry = len(doc(rl_head(), [resource(10)])) - len(doc(rl_head(), []))
    max_bytes = 1000 + 3 * one_entry // 2
    result, files = split(rl_head(), entries, max_bytes=max_bytes)
    assert result.indexed
    sizes = [len(files[f"part{p.number}"]) for p in result.parts]
    assert sizes == [p.bytes for p in result.parts]
    assert max(sizes) <= max_bytes
    part_head = sizes[1] - result.parts[1].entries * one_entry  # urlset start, md, links, end tag
    per_part = (max_bytes - part_head) // one_entry  # as many as fit, cut before exceeding
    assert per_part >= 2
    assert [p.entries for p in result.parts[:-1]] == [per_part] * (result.part_count - 1)
    assert 0 < result.parts[-1].entries <= per_part
    locs = [
        u.findtext(S + "loc") for p in result.parts for u in parse(files[f"part{p.number}"]).iter(S + "url")
    ]
    assert locs == [e.loc for e in entries]


def test_split_non_ascii_counts_bytes():
    entries = [Entry(f"http://example.com/{'é' * 100}/{i}") for i in range(10)]
    result, files = split(rl_head(), entries, max_bytes=1000)
    assert result.indexed
    for p in result.parts:
        assert len(files[f"part{p.number}"]) == p.bytes <= 1000


def test_entry_larger_than_max_bytes_is_refused():
    with pytest.raises(ValueError, match="max_bytes"):
        split(rl_head(), [resource(1), Entry("http://example.com/" + "x" * 2000)], max_bytes=1500)


def changelist_entries(n: int) -> list[Entry]:
    return [
        Entry(f"http://example.com/c{i}", md=Md(change="updated", datetime=T0 + timedelta(hours=i)))
        for i in range(n)
    ]


def test_split_change_list_parts_cover_back_to_back_intervals():
    start = T0 - timedelta(days=1)
    head = Head(md=Md(capability="changelist", from_=start), links=[Link("up", "http://example.com/cap.xml")])
    result, files = split(head, changelist_entries(11), max_entries=4)
    assert result.part_count == 3
    spans = []
    for p in result.parts:
        root = parse(files[f"part{p.number}"])
        md = root.find(RS + "md")
        assert md.get("capability") == "changelist"
        spans.append((md.get("from"), md.get("until")))
        assert (p.md.from_, p.md.until) == (
            start if p.number == 1 else T0 + timedelta(hours=4 * (p.number - 1) - 1),
            None if p.number == 3 else T0 + timedelta(hours=4 * p.number - 1),
        )
        assert [ln.get("rel") for ln in root.findall(RS + "ln")] == ["up", "index"]
    assert spans == [
        ("2013-01-02T09:00:00Z", "2013-01-03T12:00:00Z"),
        ("2013-01-03T12:00:00Z", "2013-01-03T16:00:00Z"),
        ("2013-01-03T16:00:00Z", None),  # the last part is open like its head (§12.2)
    ]
    index = parse(files["index"])
    assert dict(index.find(RS + "md").attrib) == {"capability": "changelist", "from": "2013-01-02T09:00:00Z"}
    assert [
        (s.find(RS + "md").get("from"), s.find(RS + "md").get("until")) for s in index.iter(S + "sitemap")
    ] == spans


def test_split_closed_change_list_last_part_ends_at_head_until():
    until = T0 + timedelta(days=2)
    head = Head(md=Md(capability="changelist", from_=T0, until=until))
    result, files = split(head, changelist_entries(6), max_entries=3)
    assert [p.md.until for p in result.parts] == [T0 + timedelta(hours=2), until]
    assert parse(files["part2"]).find(RS + "md").get("until") == "2013-01-05T09:00:00Z"


def test_split_part_spills_to_a_temporary_file(monkeypatch):
    monkeypatch.setattr(write_mod, "_SPOOL_MEMORY", 100)
    monkeypatch.setattr(write_mod, "_FLUSH_BYTES", 50)
    head = Head(md=Md(capability="changelist", from_=T0))
    result, files = split(head, changelist_entries(25), max_entries=10)
    assert [p.entries for p in result.parts] == [10, 10, 5]
    locs = [u.findtext(S + "loc") for n in (1, 2, 3) for u in parse(files[f"part{n}"]).iter(S + "url")]
    assert locs == [f"http://example.com/c{i}" for i in range(25)]
    one, _ = split(head, changelist_entries(10), max_entries=10)
    assert not one.indexed


def test_existing_index_link_is_not_duplicated():
    head = rl_head()
    head.links.append(Link("index", "http://old.example.com/index.xml"))
    _, files = split(head, [resource(i) for i in range(4)], max_entries=2)
    rels = [(ln.get("rel"), ln.get("href")) for ln in parse(files["part1"]).findall(RS + "ln")]
    assert rels == [("up", "http://example.com/cap.xml"), ("index", "http://example.com/rl-index.xml")]
    assert [ln.get("rel") for ln in parse(files["index"]).findall(RS + "ln")] == ["up"]


@pytest.mark.parametrize(
    "head",
    [
        Head(md=Md(capability="capabilitylist")),
        Head(md=Md(capability="change-notification", from_=T0, until=T0)),
        Head(root=SITEMAPINDEX, md=Md(capability="resourcelist", at=T0)),
    ],
)
def test_documents_that_must_not_be_split(head):
    with pytest.raises(ValueError, match="split"):
        split(head, [Entry(f"http://example.com/{i}") for i in range(3)], max_entries=2)
    result, _ = split(head, [Entry(f"http://example.com/{i}") for i in range(2)], max_entries=2)
    assert not result.indexed


def test_streams_are_closed_on_error():
    def entries():
        yield from (resource(i) for i in range(7))
        yield Entry("http://example.com/bad\x00")

    files = Files()
    with pytest.raises(ValueError, match="bad"):
        write_split(rl_head(), entries(), index_url="i", part_url=str, open_part=files.part,
                    open_index=files.index, max_entries=3)  # fmt: skip
    assert not files.open and "part1" in files.data
