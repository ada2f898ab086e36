"""Parser and writer agree: parse -> write -> parse gives an equal model, and writing is idempotent.

Covers every example document of the specification (spec/examples) and a synthetic document with the
hard parts: escaping, non-ASCII, fractional seconds, foreign attributes and foreign elements.
"""

from __future__ import annotations

import io
from datetime import UTC, datetime
from pathlib import Path

import pytest

from aggregator.rs.model import Entry, Head, Link, Md
from aggregator.rs.parse import DocumentReader, iter_document, parse_bytes
from aggregator.rs.write import iter_document_bytes, write_document, write_split

EXAMPLES = sorted((Path(__file__).parent / "data" / "spec-examples").glob("*.xml"))


def read(source) -> tuple[Head, list[Entry]]:
    items = list(iter_document(source))
    head, entries = items[0], items[1:]
    assert isinstance(head, Head) and all(isinstance(e, Entry) for e in entries)
    return head, entries  # type: ignore[return-value]


def write(head: Head, entries: list[Entry]) -> bytes:
    out = io.BytesIO()
    assert write_document(out, head, entries) == len(entries)
    return out.getvalue()


def test_examples_are_there():
    assert len(EXAMPLES) >= 30


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_round_trips(path: Path):
    head, entries = read(path)
    assert entries, "every example lists something"
    data = write(head, entries)
    head2, entries2 = read(data)
    assert head2 == head
    assert entries2 == entries
    assert write(head2, entries2) == data  # a fixed point: same model, same bytes


def test_hard_content_round_trips():
    dc = "http://purl.org/dc/elements/1.1/"
    head = Head(
        md=Md(
            capability="changelist", from_=datetime(2013, 1, 3, tzinfo=UTC), extra={f"{{{dc}}}creator": "Zoë"}
        ),
        links=[Link("up", "http://example.com/cap.xml?a=1&b=2")],
        extra=[f'<dc:rights xmlns:dc="{dc}">CC &amp; BY</dc:rights>'],
    )
    entries = [
        Entry(
            loc='http://example.com/a?x=<1>&y="2"',
            lastmod=datetime(2013, 1, 2, 13, 0, 0, 123000, tzinfo=UTC),
            changefreq="daily",
            md=Md(
                change="updated",
                datetime=datetime(2013, 1, 3, 11, 0, 0, 5, tzinfo=UTC),
                hash="md5:1584abdf8ebdc9802ac0c6a7402c03b6 sha-256:" + "ab" * 32,
                length=0,
                type="text/html; charset=utf-8",
                encoding="gzip",
                extra={
                    "{http://example.org/ns}score": "0.5 & more",
                    "{http://www.w3.org/XML/1998/namespace}lang": "fr",
                },
            ),
            links=[
                Link(
                    "duplicate",
                    "http://mirror.example.com/a",
                    pri=1,
                    modified=datetime(2013, 1, 1, tzinfo=UTC),
                    hash="md5:1584abdf8ebdc9802ac0c6a7402c03b6",
                    length=8876,
                    type="text/html",
                    extra={"{http://example.org/ns}via": "x"},
                ),
                Link("describedby", "http://example.com/Größe/𝄞"),
            ],
            extra=[
                '<priority xmlns="http://www.sitemaps.org/schemas/sitemap/0.9">0.8</priority>',
                f'<dc:title xmlns:dc="{dc}">Café &lt;au lait&gt;</dc:title>',
            ],
        ),
        Entry(
            loc="http://example.com/b", md=Md(change="deleted", datetime=datetime(2013, 1, 3, 12, tzinfo=UTC))
        ),
    ]
    data = write(head, entries)
    head2, entries2 = read(data)
    assert head2 == head
    assert entries2 == entries
    assert write(head2, entries2) == data


def test_split_documents_round_trip(tmp_path: Path):
    head = Head(md=Md(capability="resourcelist", at=datetime(2013, 1, 3, 9, tzinfo=UTC)),
                links=[Link("up", "http://example.com/cap.xml")])  # fmt: skip
    entries = [Entry(f"http://example.com/r{i}", md=Md(hash=f"md5:{i:032x}", length=i)) for i in range(13)]
    result = write_split(
        head,
        entries,
        index_url="http://example.com/index.xml",
        part_url=lambda n: f"http://example.com/part{n}.xml",
        open_part=lambda n: (tmp_path / f"part{n}.xml").open("wb"),
        open_index=lambda: (tmp_path / "index.xml").open("wb"),
        max_entries=5,
    )
    assert result.part_count == 3
    index_head, sitemaps = read(tmp_path / "index.xml")
    assert index_head.is_index and index_head.md == head.md and index_head.links == head.links
    assert [s.loc for s in sitemaps] == [f"http://example.com/part{n}.xml" for n in (1, 2, 3)]
    again: list[Entry] = []
    for n in (1, 2, 3):
        part_head, part_entries = read(tmp_path / f"part{n}.xml")
        assert part_head.md == head.md
        assert part_head.link("index").href == "http://example.com/index.xml"  # type: ignore[union-attr]
        again += part_entries
    assert again == entries


def test_chunked_bytes_parse_like_the_document():
    head, entries = read(EXAMPLES[0])
    data = b"".join(iter_document_bytes(head, entries, chunk_size=7))
    assert parse_bytes(data) == (head, entries)


def test_writer_chunks_feed_the_push_parser():
    """rsagg to rsagg: a streamed response (writer chunks) read by the harvester's push parser."""
    head = Head(md=Md(capability="resourcelist", at=datetime(2013, 1, 3, 9, tzinfo=UTC)))
    entries = [Entry(f"http://example.com/r{i}", md=Md(hash=f"md5:{i:032x}", length=i)) for i in range(2000)]
    reader = DocumentReader("http://example.com/rl.xml")
    items = []
    for chunk in iter_document_bytes(head, entries, chunk_size=1000):
        items += reader.feed(chunk)
    items += reader.close()
    assert items[0] == head
    assert items[1:] == entries
