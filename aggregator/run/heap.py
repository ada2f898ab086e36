"""The garbage collector of a long-lived rsagg process (``rsagg run``, ``rsagg harvest``), set once.

Why: a harvest allocates many short-lived containers (entries, requests, tasks), and with CPython's
default first-generation threshold (700 allocations) the collector ran about 600 times in a harvest of
300 small Sources, each time walking the young objects of every Source in progress: a tenth of the
harvest's CPU (benchmarks/bench_many_sources.py, docs/benchmarks.md "Many sources"). A larger threshold
makes those collections rarer (each walks a few more objects); what start-up built (modules,
configuration, plugins), which lives as long as the process, is moved out of the collector's reach
(``gc.freeze``) so that the full collections do not walk it again and again.

Only the commands' own processes call this: a library user's (or a test's) process keeps its settings.
"""

from __future__ import annotations

import gc

#: Allocations of container objects (net) between two collections of the youngest generation.
YOUNG_THRESHOLD = 10_000


def settle() -> None:
    """Call once start-up is done: freeze what exists now, collect the youngest generation less often."""
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(max(YOUNG_THRESHOLD, gc.get_threshold()[0]), older, oldest)
