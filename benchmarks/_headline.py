"""The one line a benchmark prints per headline figure, which ``run_all.py`` gathers into its last table.

    headline | harvest CPU per resource, 0 ms | 477 µs (2.0× fewer than before the lean path) | 3× fewer

The README's figures are that table: a benchmark says here which of its figures answer a target.
"""

from __future__ import annotations

PREFIX = "headline | "


def headline(figure: str, value: str, target: str = "") -> None:
    """Print one headline figure; ``target`` is what it is held to ("" when none)."""
    for part in (figure, value, target):
        if "|" in part or "\n" in part:
            raise ValueError(f"a headline part holds '|' or a newline: {part!r}")
    print(f"{PREFIX}{figure} | {value} | {target}", flush=True)
