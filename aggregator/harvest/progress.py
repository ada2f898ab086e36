"""Progress of long work (a baseline of many resources): done / expected, rate, ETA.

Why here and not in the pipeline: the pipeline only says "n more done" (its ``progress`` callback); a
source's ``Progress`` adds up its sets, logs a line every LOG_EVERY seconds, and hands the numbers to
``HarvestContext.progress_update`` (kept in memory for ``harvest --once``'s progress line, saved in the
sources table for ``rsagg status`` and the status page). ``describe`` is the one wording of all three.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TextIO

import trio

log = logging.getLogger("rsagg.harvest")

#: Seconds between two progress lines in the log.
LOG_EVERY = 10.0


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


def figures(done: int, total: int | None, elapsed: float | None) -> dict:
    """done, total, percent, rate (per second) and eta_seconds (None when unknown)."""
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


class Progress:
    """Resources done by one source's sync; ``expected`` adds up the sets (each set's estimate)."""

    def __init__(
        self,
        name: str,
        report: Callable[[str, int, int | None], None],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self._report = report
        self._clock = clock
        self.started = clock()
        self.done = 0
        self._before = 0  # done when the current set began
        self._set_total: int | None = None
        self._logged = self.started

    @property
    def total(self) -> int | None:
        return self._before + self._set_total if self._set_total is not None else None

    def next_set(self) -> None:
        """A new set's baseline begins: its estimate adds to what the earlier sets did."""
        self._before = self.done
        self._set_total = None

    def set_total(self, n: int) -> None:
        """The current set's expected resources (refined while its list is read)."""
        self._set_total = n
        self._report(self.name, self.done, self.total)

    def add(self, n: int) -> None:
        self.done += n
        self._report(self.name, self.done, self.total)
        now = self._clock()
        if now - self._logged >= LOG_EVERY:
            self._logged = now
            log.info("source=%s baseline progress: %s", self.name, describe(self.figures()))

    def figures(self) -> dict:
        return figures(self.done, self.total, self._clock() - self.started)


class ProgressLine:
    """``harvest --once`` on a terminal: one line, redrawn in place, with every source's progress.

    ``live`` is ``HarvestContext.progress`` (source -> (done, expected)). Log records clear the line
    before they are written (``while_shown``), and the next tick draws it again below them.
    """

    def __init__(self, stream: TextIO, live: Mapping[str, tuple[int, int | None]], *, width: int = 0) -> None:
        self.stream = stream
        self.live = live
        self.width = width
        self._first: dict[str, float] = {}
        self._shown = False

    def text(self, now: float | None = None) -> str:
        now = time.monotonic() if now is None else now
        parts = []
        for name, (done, total) in sorted(self.live.items()):
            started = self._first.setdefault(name, now)
            parts.append(f"{name}: {describe(figures(done, total, now - started))}")
        return " | ".join(parts)

    def draw(self) -> None:
        text = self.text()
        if not text:
            return
        if self.width:
            text = text[: self.width - 1]
        self.stream.write("\r\x1b[K" + text)
        self.stream.flush()
        self._shown = True

    def clear(self) -> None:
        if self._shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._shown = False

    async def run(self, every: float = 0.5) -> None:
        """Redraw until cancelled."""
        while True:
            self.draw()
            await trio.sleep(every)

    @contextmanager
    def while_shown(self) -> Iterator[None]:
        """Clear the line before any log record goes to the terminal; clear it at the end."""
        line = self

        class _Clear(logging.Filter):
            def filter(self, record: logging.LogRecord) -> bool:
                line.clear()
                return True

        handlers = logging.getLogger().handlers
        flt = _Clear()
        for h in handlers:
            h.addFilter(flt)
        try:
            yield
        finally:
            for h in handlers:
                h.removeFilter(flt)
            self.clear()


__all__ = ["LOG_EVERY", "Progress", "ProgressLine", "describe", "figures", "format_duration"]
