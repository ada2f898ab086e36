"""What ``harvest/access.py``'s ``for_source`` costs: an async generator of N entries (as ``rsagg audit``
streams a Resource List through ``expected_entries``) iterated bare and wrapped, and a coroutine called N
times bare and wrapped; microseconds per item, printed as a table.

    python benchmarks/bench_for_source.py [N]
"""

from __future__ import annotations

import sys
import time
from collections.abc import AsyncGenerator

import trio

from aggregator.harvest.access import for_source


async def entries(source: str, n: int) -> AsyncGenerator[int, None]:
    for i in range(n):
        yield i


async def call(source: str) -> int:
    return 1


wrapped_entries = for_source(entries)
wrapped_call = for_source(call)


async def timed(n: int) -> list[tuple[str, float]]:
    rows = []
    for name, gen in (("async generator, bare", entries), ("async generator, for_source", wrapped_entries)):
        start = time.perf_counter()
        async for _ in gen("s", n):
            pass
        rows.append((name, (time.perf_counter() - start) / n * 1e6))
    for name, fn in (("coroutine call, bare", call), ("coroutine call, for_source", wrapped_call)):
        start = time.perf_counter()
        for _ in range(n):
            await fn("s")
        rows.append((name, (time.perf_counter() - start) / n * 1e6))
    return rows


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200_000
    rows = trio.run(timed, n)
    print(f"{'N = ' + format(n, ','):<32} {'us/item':>8}")
    for name, us in rows:
        print(f"{name:<32} {us:>8.2f}")


if __name__ == "__main__":
    main()
