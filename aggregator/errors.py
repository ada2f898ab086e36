"""Errors shared across the stages: the one place metrics learn what kind of failure stopped a sync,
without importing the stage that raised it (the import rules of docs/architecture.md)."""

from __future__ import annotations


class CountedError(Exception):
    """A failure with a ``kind``: the label of ``rsagg_errors_total`` it is counted under (one of
    ``metrics.ERROR_KINDS``). Subclasses set it per class or per instance."""

    kind: str = "sync"


__all__ = ["CountedError"]
