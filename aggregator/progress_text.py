"""The one wording of progress (done / expected, rate, ETA): the harvester's log lines, ``harvest
--once``'s progress line, ``rsagg status`` and the status page all say it the same way.
"""

from __future__ import annotations

import json


def format_duration(seconds: float | None) -> str:
    """``1h02m``, ``3m05s``, ``42s``; "?" when unknown."""
    if seconds is None or seconds != seconds or seconds < 0:
        return "?"
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def figures(done: int, total: int | None, elapsed: float | None, *, rate: float | None = None) -> dict:
    """done, total, percent, rate (per second) and eta_seconds (None when unknown). ``rate``: what the
    harvester measured over its last seconds (harvest/progress.py), else the average since ``elapsed``."""
    if rate is None:
        rate = done / elapsed if elapsed and elapsed > 0 and done else None
    left = max(0, total - done) if total else None
    return {
        "done": done,
        "total": total,
        "percent": round(100.0 * min(done, total) / total, 1) if total else None,
        "rate": round(rate, 2) if rate is not None else None,
        "eta_seconds": round(left / rate, 1) if rate and left is not None else None,
    }


def describe(p: dict) -> str:
    """``1234/5000 (24.7%), 120.0/s, ETA 31s`` from ``figures``; ``1234 so far (total not known yet),
    120.0/s`` while a plain Resource List is still being read (it is counted once read)."""
    text = f"{p['done']}/{p['total']}" if p.get("total") else f"{p['done']} so far (total not known yet)"
    if p.get("percent") is not None:
        text += f" ({p['percent']:.1f}%)"
    if p.get("rate"):
        text += f", {p['rate']:.1f}/s"
    if p.get("eta_seconds") is not None:
        text += f", ETA {format_duration(p['eta_seconds'])}"
    return text


def progress_figures(rate: float | None) -> str | None:
    """What the harvester saves beside done/total (the sources table's ``progress_what``): a JSON object
    of its live figures, so that a status read from the state shows the rate the harvester measures."""
    return json.dumps({"rate": round(rate, 2)}) if rate is not None else None


def saved_rate(text: str | None) -> float | None:
    """The rate ``progress_figures`` saved; None for anything else (older rows, other text)."""
    try:
        rate = json.loads(text)["rate"] if text else None
    except (ValueError, TypeError, KeyError):
        return None
    return float(rate) if isinstance(rate, int | float) else None


__all__ = ["describe", "figures", "format_duration", "progress_figures", "saved_rate"]
