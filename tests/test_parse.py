"""aggregator.rs.parse: streaming, hardened reading of ResourceSync documents (spec §7)."""

from __future__ import annotations

import io
import pickle
import random
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import psutil
import pytest
from lxml import etree

from aggregator.rs import parse as parse_mod
from aggregator.rs.model import RS_NS, SITEMAP_NS, Entry, Head
from aggregator.rs.parse import (
    DEFAULT_MAX_BYTES,
    DocumentError,
    DocumentReader,
    iter_document,
    parse_bytes,
    read_document,
)
from aggregator.rs.w3cdt import DatetimeError, parse_w3c

EXAMPLES_DIR = Path(__file__).parent / "data" / "spec-examples"
EXAMPLES = sorted(EXAMPLES_DIR.glob("*.xml"))
ROOT_OPEN = f'<urlset xmlns="{SITEMAP_NS}" xmlns:rs="{RS_NS}">'
INDEX_OPEN = f'<sitemapindex xmlns="{SITEMAP_NS}" xmlns:rs="{RS_NS}">'


def doc(
    body: str, *, prolog: str = '<?xml version="1.0" encoding="UTF-8"?>\n', root: str = ROOT_OPEN
) -> bytes:
    close = "</sitemapindex>" if root.startswith("<sitemapindex") else "</urlset>"
    return (prolog + root + "\n" + body + "\n" + close + "\n").encode()


def feed_in(data: bytes, sizes: Iterator[int], **kw) -> list[Head | Entry]:
    reader = DocumentReader("http://example.com/doc.xml", **kw)
    items: list[Head | Entry] = []
    pos = 0
    while pos < len(data):
        n = next(sizes)
        items += reader.feed(data[pos : pos + n])
        pos += n
    items += reader.close()
    return items


def ones() -> Iterator[int]:
    while True:
        yield 1


def random_sizes(seed: int) -> Iterator[int]:
    rnd = random.Random(seed)
    while True:
        yield rnd.choice((1, 2, 3, 7, 64, 500, 4096, 70_000))


def comparable(items: list[Head | Entry]) -> list[tuple]:
    """Items with their line numbers (``line`` is not part of dataclass equality)."""
    return [(type(i).__name__, i, i.line) for i in items]


def collect() -> tuple[list[tuple[int | None, str]], parse_mod.Problem]:
    problems: list[tuple[int | None, str]] = []
    return problems, lambda line, message: problems.append((line, message))


def generated(n: int, *, pretty: bool = False) -> Iterator[bytes]:
    """A Resource List of ``n`` typical entries, produced in chunks (never whole in memory)."""
    yield doc("", root=ROOT_OPEN).split(b"\n</urlset>")[0]
    yield b'<rs:md capability="resourcelist" at="2024-01-03T09:00:00Z"/>\n'
    fmt = (
        "  <url>\n    <loc>http://example.com/res/{i}</loc>\n"
        "    <lastmod>2023-05-{d:02d}T10:11:12Z</lastmod>\n"
        '    <rs:md hash="md5:{h:032x}" length="{i}" type="text/html"/>\n  </url>\n'
        if pretty
        else "<url><loc>http://example.com/res/{i}</loc><lastmod>2023-05-{d:02d}T10:11:12Z</lastmod>"
        '<rs:md hash="md5:{h:032x}" length="{i}" type="text/html"/></url>\n'
    )
    batch = []
    for i in range(n):
        batch.append(fmt.format(i=i, d=i % 28 + 1, h=i * 7919))
        if len(batch) == 5000:
            yield "".join(batch).encode()
            batch = []
    yield ("".join(batch) + "</urlset>\n").encode()


# -- the specification's examples ----------------------------------------------------------------------


def test_examples_are_there() -> None:
    # The parametrized tests below would silently vanish if the folder moved.
    assert len(EXAMPLES) >= 37


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_parses_like_plain_lxml(path: Path) -> None:
    data = path.read_bytes()
    head, entries = parse_bytes(data, str(path))

    root = etree.fromstring(data)
    local = etree.QName(root).localname
    assert head.root == local
    assert head.line == root.sourceline
    md = root.find(f"{{{RS_NS}}}md")
    assert head.capability == md.get("capability")
    entry_tag = f"{{{SITEMAP_NS}}}{'url' if local == 'urlset' else 'sitemap'}"
    expected = root.findall(entry_tag)
    assert len(entries) == len(expected) > 0
    for entry, el in zip(entries, expected, strict=True):
        assert entry.loc == el.findtext(f"{{{SITEMAP_NS}}}loc").strip()
        assert entry.line == el.sourceline
        assert len(entry.links) == len(el.findall(f"{{{RS_NS}}}ln"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_chunked_like_one_feed(path: Path) -> None:
    data = path.read_bytes()
    whole = feed_in(data, iter([len(data)]))
    assert isinstance(whole[0], Head) and all(isinstance(i, Entry) for i in whole[1:])
    assert comparable(feed_in(data, ones())) == comparable(whole)
    assert comparable(feed_in(data, random_sizes(hash(path.name)))) == comparable(whole)


def test_example_values() -> None:
    head, entries = parse_bytes((EXAMPLES_DIR / "resourcesync_ex_14.xml").read_bytes())
    assert head.md.at == datetime(2013, 1, 3, 9, 0, tzinfo=UTC)
    assert head.md.completed == datetime(2013, 1, 3, 9, 1, tzinfo=UTC)
    assert head.link("up").href == "http://example.com/dataset1/capabilitylist.xml"
    assert entries[1].md.length == 14599
    assert entries[1].md.type == "application/pdf"
    assert entries[1].hashes == {
        "md5": "1e0d5cb8ef6ba40c99b14c0237be735e",
        "sha-256": "854f61290e2e197a11bc91063afce22e43f8ccc655237050ace766adc68dc784",
    }
    _, entries = parse_bytes((EXAMPLES_DIR / "resourcesync_ex_24.xml").read_bytes())
    assert [ln.pri for ln in entries[0].links] == [1, 2, 3]
    assert entries[0].links[2].modified == datetime(2013, 1, 3, 18, 0, 23, tzinfo=UTC)
    head, entries = parse_bytes((EXAMPLES_DIR / "resourcesync_ex_20.xml").read_bytes())
    assert head.is_index and head.md.from_ == datetime(2013, 1, 1, tzinfo=UTC)
    assert entries[0].md.until == datetime(2013, 1, 2, tzinfo=UTC)


# -- a richer document: everything the reader keeps, fed in every way ---------------------------------

RICH = doc(
    """<?pi ignored?><!-- a comment -->
<rs:ln rel="up" href="http://example.com/caps.xml" xml:lang="en"/>
<rs:md capability="changelist" from="2013-01-03T00:00:00Z" until="2013-01-04T00:00:00+01:00"/>
<x:provenance xmlns:x="urn:x">harvested <x:by>rsagg</x:by></x:provenance>
<url>
  <loc>
     http://example.com/a?x=1&amp;y=&#x41;
  </loc>
  <lastmod> 2013-01-03T09:00:00+01:00 </lastmod>
  <changefreq> daily </changefreq>
  <rs:md change="updated" datetime="2013-01-03T08:00:00Z" hash="md5:1584abdf8ebdc9802ac0c6a7402c03b6"
         length="8876" type="text/html" encoding="gzip" x:flag="yes" xmlns:x="urn:x"/>
  <rs:ln rel="duplicate" href="http://mirror.example.com/a" pri="2" modified="2013-01-03T07:00:00.250Z"
         length="10" hash="sha-256:00" type="text/plain" encoding="br" path="/a"/>
  <image:image xmlns:image="http://www.google.com/schemas/sitemap-image/1.1">
    <image:loc>http://example.com/a.png</image:loc>
  </image:image>
</url>
<url><loc><![CDATA[http://example.com/b]]></loc><rs:md change="deleted"/></url>
<url><loc>http://example.com/c</loc><priority>0.5</priority></url>"""
)


def test_rich_document_values() -> None:
    problems, on_problem = collect()
    head, entries = parse_bytes(RICH, "rich.xml", on_problem=on_problem)
    assert problems == []
    assert head.md.capability == "changelist"
    assert head.md.until == datetime(2013, 1, 3, 23, 0, tzinfo=UTC)
    assert head.links[0].extra == {"{http://www.w3.org/XML/1998/namespace}lang": "en"}
    assert head.extra == ['<x:provenance xmlns:x="urn:x">harvested <x:by>rsagg</x:by></x:provenance>']

    a, b, c = entries
    assert a.loc == "http://example.com/a?x=1&y=A"  # whitespace stripped, references resolved
    assert a.lastmod == datetime(2013, 1, 3, 8, 0, tzinfo=UTC)  # 09:00+01:00 is 08:00Z
    assert a.lastmod == a.md.datetime
    assert a.changefreq == "daily"
    assert (a.md.change, a.md.length, a.md.type, a.md.encoding) == ("updated", 8876, "text/html", "gzip")
    assert a.md.extra == {"{urn:x}flag": "yes"}  # foreign attribute kept, Clark notation
    (ln,) = a.links
    assert (ln.rel, ln.href, ln.pri, ln.length, ln.type, ln.encoding, ln.path, ln.hash) == (
        "duplicate", "http://mirror.example.com/a", 2, 10, "text/plain", "br", "/a", "sha-256:00",
    )  # fmt: skip
    assert ln.modified == datetime(2013, 1, 3, 7, 0, 0, 250000, tzinfo=UTC)
    (image,) = a.extra
    el = etree.fromstring(image)  # a standalone, namespace-complete XML string without the tail
    assert el.tag == "{http://www.google.com/schemas/sitemap-image/1.1}image"
    assert el.findtext("{http://www.google.com/schemas/sitemap-image/1.1}loc") == "http://example.com/a.png"
    assert not image.endswith("\n") and SITEMAP_NS not in image
    assert b.loc == "http://example.com/b" and b.md.change == "deleted" and b.lastmod is None
    assert c.md is None and len(c.extra) == 1 and etree.fromstring(c.extra[0]).text == "0.5"
    assert head.line == 2
    assert [e.line for e in entries] == [7, 21, 22]


def test_rich_document_chunked_like_one_feed() -> None:
    whole = feed_in(RICH, iter([len(RICH)]))
    assert len(whole) == 4
    assert comparable(feed_in(RICH, ones())) == comparable(whole)
    for seed in range(5):
        assert comparable(feed_in(RICH, random_sizes(seed))) == comparable(whole)


def test_head_comes_out_when_first_entry_starts() -> None:
    reader = DocumentReader()
    cut = RICH.index(b"http://example.com/a?")
    first = reader.feed(RICH[:cut])
    assert len(first) == 1 and isinstance(first[0], Head) and first[0].capability == "changelist"
    rest = reader.feed(RICH[cut:]) + reader.close()
    assert [type(i) for i in rest] == [Entry, Entry, Entry]


def test_head_of_a_document_without_entries() -> None:
    reader = DocumentReader()
    assert reader.feed(doc('<rs:md capability="resourcelist" at="2013-01-03T09:00:00Z"/>')) == []
    (head,) = reader.close()
    assert head.capability == "resourcelist" and head.line == 2


def test_utf16_document() -> None:
    text = RICH.decode().replace('encoding="UTF-8"', 'encoding="UTF-16"')
    data = text.encode("utf-16")
    assert comparable(feed_in(data, ones())) == comparable(feed_in(RICH, iter([len(RICH)])))


def test_sources_path_file_bytes(tmp_path: Path) -> None:
    path = tmp_path / "rich.xml"
    path.write_bytes(RICH)
    expected = comparable(list(iter_document(RICH)))
    assert comparable(list(iter_document(path))) == expected
    assert comparable(list(iter_document(str(path)))) == expected
    assert comparable(list(iter_document(io.BytesIO(RICH)))) == expected
    head, entries = read_document(io.BytesIO(RICH))
    assert isinstance(head, Head) and comparable([head, *entries]) == expected
    with pytest.raises(DocumentError) as err:
        list(iter_document(path, max_bytes=100))
    assert err.value.url == str(path)  # a path names itself in errors when no url is given


# -- datetimes --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("2013-01-03T09:00:00+01:00", datetime(2013, 1, 3, 8, 0, tzinfo=UTC)),
        ("2013-01-03T08:00:00Z", datetime(2013, 1, 3, 8, 0, tzinfo=UTC)),
        ("2013-01-03T01:30:00-02:30", datetime(2013, 1, 3, 4, 0, tzinfo=UTC)),
        ("2013-01-03T00:30:00+01:00", datetime(2013, 1, 2, 23, 30, tzinfo=UTC)),
        ("2013-01-03T09:00:00.5Z", datetime(2013, 1, 3, 9, 0, 0, 500000, tzinfo=UTC)),
        ("2013-01-03T09:00Z", datetime(2013, 1, 3, 9, 0, tzinfo=UTC)),
        ("2013-01-03", datetime(2013, 1, 3, tzinfo=UTC)),
        ("2013", datetime(2013, 1, 1, tzinfo=UTC)),
    ],
)
def test_datetimes_normalised_to_utc(value: str, expected: datetime) -> None:
    _, (entry,) = parse_bytes(doc(f"<url><loc>http://a</loc><lastmod>{value}</lastmod></url>"))
    assert entry.lastmod == expected
    assert entry.lastmod.utcoffset().total_seconds() == 0


@pytest.mark.parametrize(
    "value",
    [
        "2013-01-02T13:00:00Z", "2013-01-02T24:00:00Z", "2013-02-30T00:00:00Z", "2013-01-02T13:00:60Z",
        "2013-W01-1T00:00:0Z", "2013-01-02T130000.0Z", "2013-01-02 13:00:00Z", "2013-01-02T13:00:0\u0663Z",
        "\uff12\uff10\uff11\uff13-01-02T13:00:00Z", "2013-01-02T13:00:00", "2013-01-02T13:00:00+01:00",
        "x" * 20,
    ],
)  # fmt: skip
def test_fast_datetime_path_agrees_with_w3cdt(value: str) -> None:
    try:
        expected = parse_w3c(value)
    except DatetimeError:
        with pytest.raises(DatetimeError):
            parse_mod._w3c(value)
    else:
        assert parse_mod._w3c(value) == expected


# -- value problems ---------------------------------------------------------------------------------------

BAD_VALUES = doc(
    """<rs:md capability="resourcelist" at="2013-01-03T09:00:00Z"/>
<url>
  <loc>http://example.com/a</loc>
  <lastmod>yesterday</lastmod>
</url>
<url>
  <loc>http://example.com/b</loc>
  <rs:md length="12kB" type="text/html"/>
</url>"""
)


def test_on_problem_collects_bad_datetime_and_length_with_lines() -> None:
    problems, on_problem = collect()
    _, (a, b) = parse_bytes(BAD_VALUES, on_problem=on_problem)
    assert [line for line, _ in problems] == [6, 10]
    assert "lastmod" in problems[0][1] and "yesterday" in problems[0][1]
    assert "length" in problems[1][1] and "12kB" in problems[1][1]
    assert a.lastmod is None and a.loc == "http://example.com/a"
    assert b.md.length is None and b.md.type == "text/html"


def test_value_problem_raises_without_on_problem() -> None:
    with pytest.raises(DocumentError) as err:
        parse_bytes(BAD_VALUES, "http://example.com/rl.xml")
    assert err.value.line == 6 and err.value.url == "http://example.com/rl.xml"
    assert str(err.value).startswith("http://example.com/rl.xml:6: ")


def test_more_value_problems() -> None:
    body = """<rs:md capability="resourcelist"/>
<url><lastmod>2013-01-01</lastmod></url>
<url><loc>   </loc></url>
<url><loc>http://a</loc><loc>http://b</loc><rs:md/><rs:md change="x"/></url>
<url><loc>http://c</loc><rs:md bogus="1" rs:at="2013-01-01" at="never"/><rs:ln pri="-1"/></url>
<rs:md capability="changelist"/>"""
    problems, on_problem = collect()
    _, entries = parse_bytes(doc(body), on_problem=on_problem)
    assert [e.loc for e in entries] == [None, None, "http://a", "http://c"]
    assert entries[2].md.change is None  # the first rs:md is the one kept
    md = entries[3].md
    assert md.extra == {"bogus": "1", f"{{{RS_NS}}}at": "2013-01-01"} and md.at is None
    ln = entries[3].links[0]
    assert (ln.rel, ln.href, ln.pri) == (None, None, None)
    lines = [line for line, _ in problems]
    assert lines == [4, 5, 6, 6, 7, 7, 7, 7, 7, 7, 8]
    text = "\n".join(m for _, m in problems)
    words = ["without <loc>", "more than one <loc>", "more than one <rs:md>", "'bogus'", "rs namespace"]
    words += ["at='never'", "without rel", "without href", "pri='-1'", "after the first entry"]
    for word in words:
        assert word in text


# -- structure --------------------------------------------------------------------------------------------


def error_of(data: bytes, **kw) -> DocumentError:
    _, on_problem = collect()  # structural errors raise even with on_problem
    with pytest.raises(DocumentError) as err:
        feed_in(data, iter([len(data)]), on_problem=on_problem, **kw)
    e = err.value
    assert e.url == "http://example.com/doc.xml" and isinstance(e.line, int) and e.line >= 1
    assert str(e) == f"{e.url}:{e.line}: {e.reason}"
    return e


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b"<html><body/></html>", ["root element is <html>"]),
        (b'<urlset xmlns="http://www.google.com/schemas/sitemap/0.84"><url/></urlset>', ["namespace"]),
        (b'<urlset xmlns="https://www.sitemaps.org/schemas/sitemap/0.9"/>', ["namespace", SITEMAP_NS]),
        (b"<urlset/>", ["namespace"]),
        (
            doc("", root=f'<urlset xmlns="{SITEMAP_NS}" xmlns:rs="http://www.openarchives.org/rs/terms">'),
            [RS_NS],
        ),
        (doc("", root=f'<urlset xmlns="{SITEMAP_NS}" xmlns:rs="urn:other">'), ["prefix rs", RS_NS]),
        (
            doc('<url xmlns:r="http://openarchives.org/rs/terms/"><loc>http://a</loc><r:md/></url>'),
            ["namespace"],
        ),
        (doc("<sitemap><loc>http://a</loc></sitemap>"), ["<sitemap> not allowed in <urlset>"]),
        (doc("<url><loc>http://a</loc></url>", root=INDEX_OPEN), ["<url> not allowed in <sitemapindex>"]),
        (doc("<url><loc>http://a</loc><url><loc>http://b</loc></url></url>"), ["<url> nested in <url>"]),
        (doc("<url><loc>http://a?x=1&y=2</loc></url>"), ["not well-formed", "unescaped '&'"]),
        (doc("<url><loc>http://a</loc></url>") + b"<more/>", ["not well-formed"]),
        (b"", ["empty document"]),
        (b"   \n", ["no XML element"]),
    ],
)
def test_structural_errors(data: bytes, words: list[str]) -> None:
    e = error_of(data)
    for word in words:
        assert word in e.reason


def test_wrong_root_is_refused_before_the_document_is_read() -> None:
    data = b"<rss>" + b"<item>x</item>" * 10_000
    reader = DocumentReader()
    with pytest.raises(DocumentError) as err:
        reader.feed(data[:4096])
    assert "<rss>" in err.value.reason
    with pytest.raises(DocumentError):  # a failed reader stays failed
        reader.feed(data[4096:])
    with pytest.raises(DocumentError):
        reader.close()


def test_truncated_document() -> None:
    data = b"".join(generated(50))
    cut = data[: data.index(b"/res/30<")]
    reader = DocumentReader("http://example.com/rl.xml")
    items = reader.feed(cut)
    assert len(items) == 1 + 30  # the head and every complete entry were handed out already
    with pytest.raises(DocumentError) as err:
        reader.close()
    assert "truncated" in err.value.reason and err.value.line == cut.count(b"\n") + 1


def test_byte_cap_counts_fed_bytes() -> None:
    data = doc("<url><loc>http://a</loc></url>\n" * 100)
    _, entries = parse_bytes(data, max_bytes=len(data))
    assert len(entries) == 100
    e = error_of(data, max_bytes=len(data) - 1)
    assert f"max_bytes={len(data) - 1}" in e.reason and e.line == data[:-1].count(b"\n") + 1
    reader = DocumentReader(max_bytes=1000)
    reader.feed(data[:600])
    with pytest.raises(DocumentError) as err:
        reader.feed(data[600:1200])
    assert "max_bytes=1000" in err.value.reason
    assert DEFAULT_MAX_BYTES == 256 * 1024 * 1024


def test_document_error_fields_and_pickling() -> None:
    e = DocumentError(None, 7, "bad")
    assert (e.url, e.line, e.reason, str(e)) == (None, 7, "bad", "<document>:7: bad")
    copy = pickle.loads(pickle.dumps(DocumentError("http://a/", 3, "worse")))
    assert (copy.url, copy.line, copy.reason, str(copy)) == ("http://a/", 3, "worse", "http://a/:3: worse")
    assert isinstance(copy, ValueError)


def test_feed_input_types() -> None:
    reader = DocumentReader()
    items = reader.feed(bytearray(RICH[:100])) + reader.feed(memoryview(RICH)[100:]) + reader.close()
    assert comparable(items) == comparable(list(iter_document(RICH)))
    with pytest.raises(TypeError):
        DocumentReader().feed(RICH.decode())  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        reader.feed(b"<more/>")


# -- hostile documents ------------------------------------------------------------------------------------


@pytest.fixture
def secret_file(tmp_path: Path) -> tuple[Path, str]:
    secret = f"TOPSECRET-{uuid.uuid4().hex}"
    path = tmp_path / "secret.txt"
    path.write_text(secret)
    return path, secret


def assert_secret_never_appears(data: bytes, secret: str) -> DocumentError:
    """Every way of feeding: the error is raised and the file's content is nowhere."""
    seen: list[str] = []
    for sizes in (iter([len(data)]), ones()):
        problems, on_problem = collect()
        reader = DocumentReader("http://evil.example/doc.xml", on_problem=on_problem)
        with pytest.raises(DocumentError) as err:
            pos = 0
            for n in sizes:
                if pos >= len(data):
                    break
                seen += [repr(i) for i in reader.feed(data[pos : pos + n])]
                pos += n
            seen += [repr(i) for i in reader.close()]
        seen += [str(err.value), repr(problems)]
        assert "entit" in err.value.reason and "not allowed" in err.value.reason
    assert not any(secret in s for s in seen)
    return err.value


def test_external_entity_to_local_file(secret_file: tuple[Path, str]) -> None:
    path, secret = secret_file
    data = doc(
        "<url><loc>http://a/&xxe;</loc><rs:md type='&xxe;'/></url>",
        prolog=f'<?xml version="1.0"?>\n<!DOCTYPE urlset [<!ENTITY xxe SYSTEM "{path.as_uri()}">]>\n',
    )
    e = assert_secret_never_appears(data, secret)
    assert "'xxe'" in e.reason and e.line == 3


def test_external_parameter_entity_to_local_file(secret_file: tuple[Path, str]) -> None:
    path, secret = secret_file
    data = doc(
        "<url><loc>http://a/</loc></url>",
        prolog=f'<!DOCTYPE urlset [<!ENTITY % ext SYSTEM "{path.as_uri()}"> %ext;]>\n',
    )
    assert_secret_never_appears(data, secret)


def test_external_dtd_entities_stay_unresolved(tmp_path: Path, secret_file: tuple[Path, str]) -> None:
    path, secret = secret_file
    dtd = tmp_path / "evil.dtd"
    dtd.write_text(f'<!ENTITY xxe SYSTEM "{path.as_uri()}">')
    for body in (
        "<url><loc>http://a/&xxe;</loc></url>",
        "<url><loc>http://a/</loc><rs:md type='x&xxe;'/></url>",
    ):
        data = doc(body, prolog=f'<!DOCTYPE urlset SYSTEM "{dtd.as_uri()}">\n')
        e = assert_secret_never_appears(data, secret)
        assert "entity 'xxe' not allowed" in e.reason


def test_doctype_without_entities_is_fine() -> None:
    _, entries = parse_bytes(doc("<url><loc>http://a</loc></url>", prolog="<!DOCTYPE urlset>\n"))
    assert entries[0].loc == "http://a"


@pytest.mark.parametrize(
    "body",
    [
        "<url><loc>http://a/&undeclared;</loc></url>",
        "<url><loc>http://a/</loc><rs:md type='&undeclared;'/></url>",
        "&undeclared;<url><loc>http://a/</loc></url>",
    ],
)
def test_undeclared_entity_without_doctype(body: str) -> None:
    for sizes in (iter([10_000]), ones()):
        with pytest.raises(DocumentError) as err:
            feed_in(doc(body), sizes)
        assert "entity 'undeclared' not allowed" in err.value.reason
        assert err.value.line == 3


def test_internal_entity_declaration_refused() -> None:
    e = error_of(doc("<url><loc>&x;</loc></url>", prolog='<!DOCTYPE urlset [<!ENTITY x "http://a">]>\n'))
    assert "entity 'x' not allowed" in e.reason


LAUGHS = "".join(f'<!ENTITY l{i} "{f"&l{i - 1};" * 10}">' for i in range(1, 10))


@pytest.mark.parametrize(
    "data",
    [
        doc("<url><loc>&l9;</loc></url>", prolog=f'<!DOCTYPE urlset [<!ENTITY l0 "lol">{LAUGHS}]>\n'),
        doc("", prolog=f'<!DOCTYPE urlset [<!ENTITY l0 "lol">{LAUGHS}]>\n').replace(
            b"<urlset ", b'<urlset a="&l9;" '
        ),
        doc(
            "<url><loc>&b;&b;&b;&b;</loc></url>",
            prolog=f'<!DOCTYPE urlset [<!ENTITY b "{"x" * 100_000}">]>\n',
        ),
    ],
    ids=["billion-laughs", "billion-laughs-in-attribute", "quadratic-blowup"],
)
def test_entity_expansion_bombs(data: bytes) -> None:
    rss = psutil.Process().memory_info().rss
    for sizes in (iter([len(data)]), random_sizes(1)):
        with pytest.raises(DocumentError) as err:
            feed_in(data, sizes)
        assert "entit" in err.value.reason
    assert psutil.Process().memory_info().rss - rss < 50 * 1024 * 1024


def test_unresolved_entity_nodes_are_skipped_if_they_ever_get_through(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Belt and braces: were the log check to miss one, an entity node is neither text nor an extra.
    monkeypatch.setattr(DocumentReader, "_check_log", lambda self: None)
    data = doc("&e;<url>&e;<loc>http://a/&e;</loc></url>", prolog='<!DOCTYPE urlset SYSTEM "x.dtd">\n')
    head, (entry,) = parse_bytes(data)
    assert entry.loc == "http://a/" and entry.extra == [] and head.extra == []


def test_huge_text_node_refused() -> None:
    reader = DocumentReader()
    reader.feed(doc("").split(b"\n</urlset>")[0] + b"<url><loc>http://a/")
    with pytest.raises(DocumentError) as err:
        for _ in range(200):  # 10 MB + in 64 KiB chunks
            reader.feed(b"a" * 65536)
    assert "limit" in err.value.reason and "Text node too long" in err.value.reason


def test_deep_nesting_refused() -> None:
    e = error_of(doc("<url><loc>http://a</loc>" + "<x:a xmlns:x='urn:x'>" * 300 + "</x:a>" * 300 + "</url>"))
    assert "depth" in e.reason


def test_random_damage_gives_a_result_or_a_document_error() -> None:
    rnd = random.Random(7)
    seeds = [RICH, *(p.read_bytes() for p in EXAMPLES[:8])]
    tokens = [b"<", b">", b"&", b"&amp;", b"<!DOCTYPE urlset>", b"<url>", b"</url>", b"\x00", b"\xff", b"]]>"]
    tokens += [b"<![CDATA[", b"<!--", b"&#0;", b'"', b"xmlns:rs='urn:x'", b"<sitemap>", b"<rs:md at='x'/>"]
    outcomes = set()
    for _ in range(300):
        data = bytearray(rnd.choice(seeds))
        for _ in range(rnd.randint(1, 4)):
            pos = rnd.randrange(len(data))
            if rnd.random() < 0.5:
                data[pos:pos] = rnd.choice(tokens)
            else:
                del data[pos : pos + rnd.randint(1, 20)]
        try:
            feed_in(bytes(data), random_sizes(rnd.randrange(1000)), on_problem=lambda line, message: None)
            outcomes.add("parsed")
        except DocumentError as e:  # nothing else may escape, and it always says where
            assert isinstance(e.line, int) and e.reason
            outcomes.add("refused")
    assert outcomes == {"parsed", "refused"}


@pytest.mark.parametrize("seed", range(4))
def test_a_kept_parser_reads_the_next_document_as_a_new_one_would(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parsers are kept per thread from one document to the next (``_pull_parser``): generated runs of
    documents, good, damaged, refused (entities, wrong roots, truncations) and nested, each fed in random
    slices, give the same items or the same error as with a parser made for each."""
    rnd = random.Random(seed)
    seeds = [RICH, *(p.read_bytes() for p in EXAMPLES[:6])]
    odd = [
        doc("<url><loc>&l9;</loc></url>", prolog=f'<!DOCTYPE urlset [<!ENTITY l0 "lol">{LAUGHS}]>\n'),
        doc("<url><loc>http://a/&u;</loc></url>", prolog="<!DOCTYPE urlset>\n"),
        doc("<url><loc>http://a</loc></url>")[:-20],
        b"<html><body/></html>",
        doc(f"<url><loc>http://a</loc><x><urlset xmlns='{SITEMAP_NS}'/></x></url>"),
        b"",
    ]
    tokens = [b"<", b">", b"&", b"</url>", b"<!DOCTYPE urlset>", b"\xff", b"<rs:md at='x'/>"]

    def outcome(data: bytes, sizes: int) -> tuple:
        try:
            items = feed_in(data, random_sizes(sizes), on_problem=lambda line, message: None)
            return ("parsed", comparable(items))
        except DocumentError as e:
            return ("refused", str(e))

    kept = 0
    for _ in range(60):
        data = bytearray(rnd.choice(seeds + odd))
        if data and rnd.random() < 0.4:
            pos = rnd.randrange(len(data))
            data[pos:pos] = rnd.choice(tokens)
        sizes = rnd.randrange(1000)
        kept += bool(getattr(parse_mod._free_parsers, "parsers", None))
        again = outcome(bytes(data), sizes)  # with whatever parser the last documents left
        with monkeypatch.context() as m:
            m.setattr(parse_mod._free_parsers, "parsers", [], raising=False)
            alone = outcome(bytes(data), sizes)  # with a new parser
        assert again == alone, bytes(data)[:200]
    assert kept > 10  # parsers were kept and taken again


# -- memory -----------------------------------------------------------------------------------------------


@pytest.mark.slow  # 200,000 entries
def test_200k_entries_in_flat_memory() -> None:
    process = psutil.Process()
    list(iter_document(b"".join(generated(2000))))  # warm up lxml and the allocator
    base = peak = process.memory_info().rss
    reader = DocumentReader()
    count = 0
    last = None
    for chunk in generated(200_000):
        for item in reader.feed(chunk):
            count += 1
            last = item
            if count % 10_000 == 0:
                peak = max(peak, process.memory_info().rss)
    for item in reader.close():
        count += 1
        last = item
    peak = max(peak, process.memory_info().rss)
    assert count == 1 + 200_000
    assert last.loc == "http://example.com/res/199999" and last.md.length == 199_999
    assert last.line == 200_003  # line numbers past libxml2's old 65535 limit
    assert peak - base < 50 * 1024 * 1024, f"RSS grew by {(peak - base) / 2**20:.0f} MB"
