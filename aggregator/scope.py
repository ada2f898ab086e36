"""The source whose work the running trio task does, for everything that labels or routes by source.

A context variable: trio tasks inherit it from the task that started them (the Fetcher starts its
document downloads with the caller's context), so a request, a metric or a deferred state write learns
its source without being told. ``sync_source`` and ``Pipeline.run`` set it (``harvest/access.py``
``for_source``); outside a sync it is "".
"""

from __future__ import annotations

from contextvars import ContextVar

#: The source whose work the current trio task does ("" outside a sync).
current_source: ContextVar[str] = ContextVar("rsagg_metrics_source", default="")

__all__ = ["current_source"]
