"""The parser's compiled fast path (aggregator/rs/_speedups.pyx) gives exactly what the Python path gives.

Every document is read twice, once with the speedups and once without (``RSAGG_PURE_PYTHON`` in one
process), and the items, their source lines, the problems reported and the errors raised must be equal.
"""

from __future__ import annotations

import gc
import os
import random
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from aggregator.rs import parse as parse_mod
from aggregator.rs.model import RS_NS, SITEMAP_NS, Entry, Head
from aggregator.rs.parse import DocumentError, DocumentReader

EXAMPLES = sorted((Path(__file__).parent / "data" / "spec-examples").glob("*.xml"))
PROLOG = '<?xml version="1.0" encoding="UTF-8"?>\n'
OPEN = f'{PROLOG}<urlset xmlns="{SITEMAP_NS}" xmlns:rs="{RS_NS}">\n'
INDEX_OPEN = f'{PROLOG}<sitemapindex xmlns="{SITEMAP_NS}" xmlns:rs="{RS_NS}">\n'
HEAD = (
    '<rs:md capability="changelist" from="2024-01-01T00:00:00Z"/>\n<rs:ln rel="up" href="http://e.org/cl"/>\n'
)


def read(data: bytes, fast: bool, chunk: int = 0) -> tuple[list, list, list, str | None]:
    """Items, their lines, the problems and the error (if any) of one read."""
    problems: list[tuple[int | None, str]] = []
    reader = DocumentReader("http://e.org/doc.xml", on_problem=lambda line, msg: problems.append((line, msg)))
    reader._speedups = parse_mod._speedups if fast else None
    items: list[Head | Entry] = []
    error = None
    try:
        if chunk:
            for i in range(0, len(data), chunk):
                items += reader.feed(data[i : i + chunk])
        else:
            items += reader.feed(data)
        items += reader.close()
    except DocumentError as exc:
        error = str(exc)
    return items, [item.line for item in items], problems, error


def assert_same(data: bytes, chunk: int = 0) -> tuple[list, list]:
    fast = read(data, True, chunk)
    slow = read(data, False, chunk)
    assert fast == slow
    return fast[0], fast[2]


def urlset(*entries: str, head: str = HEAD) -> bytes:
    return (OPEN + head + "\n".join(entries) + "\n</urlset>\n").encode()


def test_speedups_are_compiled() -> None:
    """Wherever a C compiler is at hand, the install compiles the fast path and the reader uses it."""
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if os.environ.get("RSAGG_PURE_PYTHON"):
        assert parse_mod._speedups is None
    elif shutil.which(compiler):
        assert parse_mod.SPEEDUPS, "aggregator/rs/_speedups.pyx was not compiled: see pip install -e . -v"
    else:  # no compiler: the install still worked, and the Python path reads everything
        assert parse_mod._speedups is None


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_spec_examples_read_the_same(path: Path) -> None:
    items, _ = assert_same(path.read_bytes())
    assert items and isinstance(items[0], Head)


PLAIN = [
    "<url><loc>http://e.org/a</loc></url>",
    "<url><loc> http://e.org/spaces \n</loc><lastmod>2024-02-29T23:59:59Z</lastmod></url>",
    "<url><loc>http://e.org/%C3%A9/é?q=1&amp;r=2</loc><changefreq> daily </changefreq></url>",
    "<url><loc>http://e.org/c</loc><changefreq></changefreq><changefreq>weekly</changefreq></url>",
    '<url><loc>http://e.org/d</loc><rs:md change="updated" datetime="2024-01-01T10:00:00.5+01:00"'
    ' hash="md5:1e0d5cb8ef6ba40c99b14c0237be735e sha-256:abc" length="0042" type="text/plain"'
    ' encoding="gzip" path="/d" capability="resourcelist" at="2024-01-01" completed="2024-01-01T00:00Z"'
    ' from="2023" until="2024-01"/></url>',
    '<url><loc>http://e.org/e</loc><rs:md change="deleted" datetime="2024-01-02T00:00:00Z"/>'
    '<rs:ln rel="duplicate" href="http://mirror.org/e" pri="1" modified="2024-01-02T00:00:00Z"'
    ' hash="sha-256:00" length="7" type="text/html" encoding="br" path="/e"/>'
    '<rs:ln rel="via" href="http://up.org/e"/></url>',
    "<url>\n  <loc>http://e.org/f</loc>\n  <lastmod>2024-01-01T00:00:00Z</lastmod>\n</url>",
    "<url><loc><![CDATA[http://e.org/cdata]]></loc></url>",
    "<url><!-- a comment --><loc>http://e.org/g</loc><?pi x?></url>",
    '<url><loc>http://e.org/h</loc><rs:md hash="" type="" length="9"/></url>',
]

ODD = [
    "<url><lastmod>2024-01-01T00:00:00Z</lastmod></url>",  # no loc
    "<url><loc></loc></url>",
    "<url><loc>  </loc></url>",
    "<url><loc>http://e.org/1</loc><loc>http://e.org/2</loc></url>",
    "<url><loc>http://e.org/3<x:b xmlns:x='urn:x'/>tail</loc></url>",
    "<url><loc>http://e.org/4</loc><lastmod>2024-02-30T00:00:00Z</lastmod></url>",
    "<url><loc>http://e.org/5</loc><lastmod>2024-13-01T00:00:00Z</lastmod></url>",
    "<url><loc>http://e.org/6</loc><lastmod>2024-01-01T24:00:00Z</lastmod></url>",
    "<url><loc>http://e.org/7</loc><lastmod>2024-01-01T00:00:00X</lastmod></url>",
    "<url><loc>http://e.org/8</loc><lastmod>2024-W01</lastmod></url>",
    "<url><loc>http://e.org/9</loc><lastmod></lastmod><lastmod>2024-01-01T00:00:00Z</lastmod></url>",
    '<url><loc>http://e.org/10</loc><rs:md length=" 5"/></url>',
    '<url><loc>http://e.org/11</loc><rs:md length="-5"/></url>',
    '<url><loc>http://e.org/12</loc><rs:md length="123456789012345678901234567890"/></url>',
    '<url><loc>http://e.org/13</loc><rs:md length="½"/></url>',
    '<url><loc>http://e.org/14</loc><rs:md colour="red"/></url>',
    '<url><loc>http://e.org/15</loc><rs:md xmlns:x="urn:x" x:colour="red"/></url>',
    '<url><loc>http://e.org/16</loc><rs:md rs:hash="md5:00"/></url>',
    '<url><loc>http://e.org/17</loc><rs:md hash="a"/><rs:md hash="b"/></url>',
    '<url><loc>http://e.org/18</loc><rs:ln href="http://e.org/x"/></url>',
    '<url><loc>http://e.org/19</loc><rs:ln rel="alternate"/></url>',
    '<url><loc>http://e.org/20</loc><rs:ln rel="a" href="b" pri=" 3 "/></url>',
    '<url><loc>http://e.org/21</loc><rs:ln rel="a" href="b" pri="x"/></url>',
    '<url><loc>http://e.org/22</loc><rs:ln rel="a" href="b" modified="yesterday"/></url>',
    '<url><loc>http://e.org/23</loc><rs:md datetime="2024-01-01T00:00:00Z" until="nope"/></url>',
    "<url><loc>http://e.org/24</loc><x:extra xmlns:x='urn:x'>kept</x:extra></url>",
    "<url><loc>http://e.org/25</loc><image>no namespace</image></url>",
    f"<url><loc>http://e.org/26</loc><rs:other xmlns:rs='{RS_NS}'/></url>",
    "<url><loc>http://e.org/27</loc><priority>0.5</priority></url>",
    "<url><loc>http://e.org/28</loc><url><loc>http://e.org/nested</loc></url></url>",
    "<url><loc>http://e.org/29</loc><sitemap><loc>http://e.org/s</loc></sitemap></url>",
    "<url xmlns='urn:not-sitemaps'><loc>http://e.org/30</loc></url>",
    f"<rs:md xmlns:rs='{RS_NS}' capability='late'/>",
    "<url><loc>http://e.org/31</loc><lastmod>2024-01-01T00:00:00Z<b/></lastmod></url>",
    "<url><loc>http://e.org/32</loc><changefreq>daily<b/></changefreq></url>",
    '<url><loc>http://e.org/33</loc><rs:md hash="a&#10;b" length="&#49;"/></url>',
    # POD (2020): <rs:md> before <loc>, and <url>URI</url>; a document's rs:ln after the entries
    '<url><rs:md hash="md5:00" length="3"/><loc>http://e.org/34</loc><lastmod>2024-01-01T00:00:00Z</lastmod></url>',
    "<url>http://e.org/35</url>",
    f"<rs:ln xmlns:rs='{RS_NS}' rel='next' href='http://e.org/page-2'/>",
]


@pytest.mark.parametrize("entry", PLAIN, ids=range(len(PLAIN)))
def test_plain_entries_read_the_same(entry: str) -> None:
    items, problems = assert_same(urlset(entry, PLAIN[0]))
    assert problems == []
    assert len(items) == 3


@pytest.mark.parametrize("entry", ODD, ids=range(len(ODD)))
def test_odd_entries_read_the_same(entry: str) -> None:
    """Entries the fast path hands back to Python: same entries, same problems at the same lines."""
    assert_same(urlset(PLAIN[0], entry, PLAIN[6]))


def test_every_entry_together_in_small_chunks() -> None:
    odd = [entry for entry in ODD if read(urlset(entry), False)[3] is None]  # not the fatal ones
    assert len(odd) > 25
    data = urlset(*(PLAIN + odd) * 3)
    for chunk in (0, 1, 7, 100, 4096):
        items, problems = assert_same(data, chunk)
        assert problems, "the odd entries report problems"
        assert len(items) > len(PLAIN) * 3


def test_sitemapindex() -> None:
    body = "\n".join(
        [
            '<rs:md capability="resourcelist" at="2024-01-01T00:00:00Z"/>',
            '<sitemap><loc>http://e.org/p1.xml</loc><rs:md at="2024-01-01T00:00:00Z"/></sitemap>',
            "<sitemap><loc>http://e.org/p2.xml</loc><lastmod>2024-01-01T00:00:00Z</lastmod></sitemap>",
            "<url><loc>http://e.org/wrong-here</loc></url>",
        ]
    )
    fast = read((INDEX_OPEN + body + "\n</sitemapindex>\n").encode(), True)
    assert fast == read((INDEX_OPEN + body + "\n</sitemapindex>\n").encode(), False)
    assert fast[3] and "<url> not allowed in <sitemapindex>" in fast[3]


def test_head_comes_first_and_is_complete() -> None:
    for head in ("", HEAD, HEAD + "<x:foreign xmlns:x='urn:x'/>\n"):
        items, _ = assert_same(urlset(*PLAIN, head=head), chunk=50)
        assert isinstance(items[0], Head) and not any(isinstance(i, Head) for i in items[1:])


def test_lines_above_65535() -> None:
    """libxml2 stores lines beyond 65534 outside the node; the fast path must find the same ones."""
    lines = [f"<url><loc>http://e.org/{i}</loc></url>" for i in range(66_000)]
    lines[65_600] = "<url>\n<loc>http://e.org/split</loc>\n</url>"
    lines[65_700] = "<url><loc>http://e.org/bad</loc><lastmod>no</lastmod></url>"
    items, problems = assert_same(urlset(*lines, head=""), chunk=65536)
    assert items[-1].line == 66_000 + 2 + 2  # two extra lines in the split entry; entries start on line 3
    assert problems == [(65_700 + 3 + 2, "<lastmod> is not a W3C Datetime: 'no'")]


def test_random_mutations_read_the_same() -> None:
    """Bounded fuzz: 400 damaged documents; both paths give the same items, problems or error."""
    rnd = random.Random(20261121)
    base = urlset(*(PLAIN + ODD)).decode()
    pieces = ["<", ">", "/", '"', "&amp;", "&#0;", "Z", "2024", "rs:", "<rs:ln/>", "</url>", " x='1'", "\n"]
    for _ in range(400):
        text = base
        for _ in range(rnd.randint(1, 4)):
            i = rnd.randrange(len(text))
            if rnd.random() < 0.5:
                text = text[:i] + text[i + rnd.randint(1, 12) :]
            else:
                text = text[:i] + rnd.choice(pieces) + text[i:]
        assert_same(text.encode(), chunk=rnd.choice((0, 64, 1000)))


def test_objects_built_in_c_behave_like_python_ones() -> None:
    items, _ = assert_same(urlset(PLAIN[5], PLAIN[4]))
    entry = items[1]
    assert entry.md.change == "deleted" and entry.links[0].priority == 1
    assert entry.links_by_rel("via")[0].href == "http://up.org/e"
    entry.md.hash = "md5:" + "0" * 32  # mutable like any dataclass instance
    assert entry.hashes == {"md5": "0" * 32}
    assert repr(entry).startswith("Entry(loc='http://e.org/e'")
    del items, entry
    gc.collect()  # objects allocated in C are tracked and freed by the GC like the others


def test_speedups_refuse_another_lxml() -> None:
    """Compiled against one lxml, they must not read the structures of another: the Python path is used."""
    code = (
        "import lxml.etree; lxml.etree.__version__ = '0.0.1'\n"
        "from aggregator.rs import parse\n"
        "print(parse.SPEEDUPS)\n"
    )
    env = {**os.environ, "RSAGG_PURE_PYTHON": ""}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "False"
    if parse_mod.SPEEDUPS:  # compiled here: the warning names both versions
        assert "compiled fast path not used" in run.stderr and "0.0.1" in run.stderr
