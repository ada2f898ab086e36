"""Parse speed of a Resource List whose entries give ``<rs:md>`` before ``<loc>`` (POD, 2020) against
the usual order, with the parser's compiled fast path and without it.

    python benchmarks/bench_entry_order.py                    # 100,000 entries
    python benchmarks/bench_entry_order.py --entries 1000000
"""

from __future__ import annotations

import argparse
import time

from aggregator.rs import parse

NS = 'xmlns="http://www.sitemaps.org/schemas/sitemap/0.9" xmlns:rs="http://www.openarchives.org/rs/terms/"'


def document(entries: int, md_first: bool) -> bytes:
    parts = [f'<urlset {NS}><rs:md capability="resourcelist" at="2021-01-01T00:00:00Z"/>']
    for i in range(entries):
        loc = f"<loc>http://example.org/r/{i}</loc><lastmod>2020-11-10T12:00:00Z</lastmod>"
        md = f'<rs:md hash="md5:{i:032x}" length="{i}" type="application/marc"/>'
        parts.append(f"<url>{md + loc if md_first else loc + md}</url>")
    parts.append("</urlset>")
    return "".join(parts).encode()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", type=int, default=100_000)
    args = ap.parse_args()
    print(f"{'order':<16}{'path':<10}{'entries':>10}{'seconds':>9}{'entries/s':>12}")
    for md_first in (False, True):
        data = document(args.entries, md_first)
        for fast in (True, False):
            if fast and not parse.SPEEDUPS:
                continue
            reader = parse.DocumentReader(on_problem=lambda line, msg: None,
                                          on_tolerated=lambda rule, line, msg: None)  # fmt: skip
            reader._speedups = parse._speedups if fast else None
            t = time.perf_counter()
            n = sum(1 for item in [*reader.feed(data), *reader.close()] if isinstance(item, parse.Entry))
            dt = time.perf_counter() - t
            order = "rs:md first" if md_first else "loc first"
            print(f"{order:<16}{'compiled' if fast else 'python':<10}{n:>10,}{dt:>9.2f}{n / dt:>12,.0f}")


if __name__ == "__main__":
    main()
