"""Helpers for tests of blob stores and of what writes into them."""

from __future__ import annotations

from typing import Any


def temp_files(store: Any) -> list[str]:
    """The files in a blob store's temp folder (its lock file aside): what a writer left behind."""
    return sorted(p.name for p in store.tmp.iterdir() if p.name != ".lock")
