"""Progress of long work (a baseline of many resources): done / expected, rate, ETA.

Why here and not in the pipeline: the pipeline only says "n more done" (its ``progress`` callback); a
source's ``Progress`` adds up its sets, logs a line every LOG_EVERY seconds, and hands the numbers to
``HarvestContext.progress_update`` (kept in memory for ``harvest --once``'s progress line, saved in the
sources table for ``rsagg status`` and the status page). ``progress_text.describe`` is the one
wording of all three.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TextIO

import trio

from ..progress_text import describe, figures

log = logging.getLogger("rsagg.harvest")

#: Seconds between two progress lines in the log.
LOG_EVERY = 10.0
#: The rate shown is the resources counted over about this many seconds (what arrives now), not since
#: the sync began: discovery and a dump package's download and first pass count nothing, and would
#: make the rate of a whole run read far below what arrives.
RATE_WINDOW = 30.0


class Progress:
    """Resources done by one source's sync; ``expected`` adds up the sets (each set's estimate)."""

    def __init__(
        self,
        name: str,
        report: Callable[[str, int, int | None, float | None], None],
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
        self._samples: deque[tuple[float, int]] = deque()  # (time, done) within RATE_WINDOW

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
        self._report(self.name, self.done, self.total, self.rate())

    def add(self, n: int) -> None:
        now = self._clock()
        self.done += n  # the first batch only starts the clock: how long it took is not known
        self._samples.append((now, self.done))
        while len(self._samples) > 2 and now - self._samples[1][0] >= RATE_WINDOW:
            self._samples.popleft()
        self._report(self.name, self.done, self.total, self.rate())
        if now - self._logged >= LOG_EVERY:
            self._logged = now
            log.info("source=%s baseline progress: %s", self.name, describe(self.figures()))

    def rate(self) -> float | None:
        """Resources per second over the last RATE_WINDOW seconds of counting; None before a second
        batch has come (one batch alone spans no time)."""
        if len(self._samples) < 2:
            return None
        (t0, d0), (t1, d1) = self._samples[0], self._samples[-1]
        return (d1 - d0) / (t1 - t0) if t1 > t0 else None

    def figures(self) -> dict:
        return figures(self.done, self.total, self._clock() - self.started, rate=self.rate())


def bar(p: dict, width: int = 12) -> str:
    """``[#####.......] `` once the total is known (the terminal's progress bar), else nothing."""
    if p.get("percent") is None:
        return ""
    filled = round(width * min(100.0, p["percent"]) / 100)
    return f"[{'#' * filled}{'.' * (width - filled)}] "


class ProgressLine:
    """``harvest --once`` on a terminal: one line, redrawn in place, with every source's progress.

    ``live`` is ``HarvestContext.progress`` (source -> (done, expected[, rate])). Log records clear the line
    before they are written (``while_shown``), and the next tick draws it again below them.
    """

    def __init__(self, stream: TextIO, live: Mapping[str, tuple], *, width: int = 0) -> None:
        self.stream = stream
        self.live = live
        self.width = width
        self._first: dict[str, float] = {}
        self._shown = False

    def text(self, now: float | None = None) -> str:
        now = time.monotonic() if now is None else now
        parts = []
        for name, (done, total, *rate) in sorted(self.live.items()):
            started = self._first.setdefault(name, now)
            p = figures(done, total, now - started, rate=rate[0] if rate else None)
            parts.append(f"{name}: {bar(p)}{describe(p)}")
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


__all__ = ["LOG_EVERY", "RATE_WINDOW", "Progress", "ProgressLine", "bar"]
