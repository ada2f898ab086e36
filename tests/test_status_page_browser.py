"""The status page in a real browser (Debian's Chromium driven by Playwright): states coloured, a long
error on one line with the whole text on demand, baseline progress whose rate and ETA agree with the
resource count. Screenshots are left in the test's temporary folder (``status.png``, ``error-open.png``).
"""

from __future__ import annotations

import re
import shutil
from datetime import timedelta
from pathlib import Path

import pytest
import trio

from aggregator.config import parse_config
from aggregator.rs.w3cdt import utcnow
from aggregator.run.compose import open_context
from aggregator.store.state import State
from aggregator.testing.upstream import Upstream

from .apps import create_app
from .harvesting import harvest
from .httpserver import serve_app

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
pytestmark = [
    pytest.mark.slow,  # drives a real Chromium
    pytest.mark.skipif(
        not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed (.ci/run installs it)"
    ),
]

LONG_ERROR = (
    "DiscoveryError: https://repository.example.org/rs/capabilitylist.xml: no ResourceSync Capability List "
    "or Source Description found (tried "
    + "; ".join(f"https://mirror{i}.example.org/.well-known/resourcesync: HTTP 50{i % 4}" for i in range(12))
    + ") THE-END-OF-THE-ERROR"
)


def _browse(url: str, shots: Path) -> dict:
    """Everything the assertions need, read the way a person sees it (computed styles, boxes, clicks)."""
    from playwright.sync_api import sync_playwright

    out: dict = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(url)
            page.screenshot(path=str(shots / "status.png"), full_page=True)

            def row(name: str) -> str:
                return f'tr[data-source="{name}"]'

            out["colours"] = {
                name: page.eval_on_selector(f"{row(name)} .badge", "e => getComputedStyle(e).backgroundColor")
                for name in ("good", "broken", "busy")
            }
            out["states"] = {
                name: page.inner_text(f"{row(name)} .badge") for name in ("good", "broken", "busy")
            }
            summary = f"{row('broken')} details.error summary"
            out["summary"] = page.inner_text(summary)
            out["summary_height"] = page.eval_on_selector(summary, "e => e.getBoundingClientRect().height")
            out["font_size"] = page.eval_on_selector(summary, "e => parseFloat(getComputedStyle(e).fontSize)")
            pre = f"{row('broken')} details.error pre"
            out["whole_visible_before"] = page.is_visible(pre)
            page.click(summary)
            out["whole_visible_after"] = page.is_visible(pre)
            out["whole"] = page.inner_text(pre)
            page.screenshot(path=str(shots / "error-open.png"), full_page=True)
            # The page refreshes itself; an error the reader opened stays open.
            page.evaluate("refresh()")
            out["still_open"] = page.is_visible(pre)
            cells = page.eval_on_selector_all(f"{row('busy')} td", "tds => tds.map(td => td.innerText)")
            out["busy_cells"] = cells
            out["bar"] = page.eval_on_selector(f"{row('busy')} progress", "e => [e.value, e.max]")
        finally:
            browser.close()
    return out


def _rgb(css: str) -> tuple[int, int, int]:
    r, g, b = (int(x) for x in re.findall(r"\d+", css)[:3])
    return r, g, b


async def test_status_page_in_chromium(tmp_path: Path) -> None:
    up = Upstream(resource_dump=False, change_dump=False)
    up.bulk_create(40)
    async with up.serving() as base:
        config = parse_config(
            {
                "store": {"path": str(tmp_path / "data")},
                "harvest": {"retries": 1, "backoff_base": 0.01},
                "publish": {"dump_interval": 0},
                "sources": [{"name": n, "url": base} for n in ("good", "broken", "busy")],
            },
            str(tmp_path / "rsagg.toml"),
        )
        assert all(r.ok for r in (await harvest(config)).values())
    # A baseline under way (40 of an expected 160 done, begun 20 s ago) and a source in error.
    with State(config.store_path / "state.db") as state:
        held = state.count_resources(state.sets("busy")[0].id)
        state.set_source_status(
            "busy", state="syncing", progress_done=held, progress_total=4 * held,
            last_attempt=utcnow() - timedelta(seconds=20),
        )  # fmt: skip
        state.set_source_status("broken", state="error", last_error=LONG_ERROR)
    async with open_context(config) as ctx:
        app = create_app(config, blobs=ctx.blobs, state_path=config.store_path / "state.db")
        async with serve_app(app) as ours:
            seen = await trio.to_thread.run_sync(_browse, f"{ours}/", tmp_path)

    # States: coloured badges, each its own colour, none the neutral grey.
    assert seen["states"] == {"good": "ok", "broken": "error", "busy": "syncing"}
    colours = {k: _rgb(v) for k, v in seen["colours"].items()}
    r, g, b = colours["good"]
    assert g > r and g > b  # green
    r, g, b = colours["broken"]
    assert r > g and r > b  # red
    r, g, b = colours["busy"]
    assert b > r and b > g  # blue

    # The long error: one line, cut, the whole text only when asked for.
    assert seen["summary_height"] < 2 * seen["font_size"] * 1.3
    assert "THE-END-OF-THE-ERROR" not in seen["summary"] and seen["summary"].endswith("…")
    assert not seen["whole_visible_before"] and seen["whole_visible_after"] and seen["still_open"]
    assert seen["whole"] == LONG_ERROR

    # Baseline progress: done agrees with the Resources column; rate and ETA follow from it.
    cells = seen["busy_cells"]
    resources = int(cells[2])
    m = re.fullmatch(r"(\d+)/(\d+) \(([\d.]+)%\), ([\d.]+)/s, ETA (?:(\d+)m)?(\d+)s", cells[5].strip())
    assert m, cells[5]
    done, total, percent, rate = int(m[1]), int(m[2]), float(m[3]), float(m[4])
    eta = int(m[5] or 0) * 60 + int(m[6])
    assert done == resources == held and total == 4 * held and percent == 25.0
    assert 0.5 * held / 20 < rate <= held / 20 * 1.01  # begun 20 s (or a little more, if slow) ago
    assert abs(eta - (total - done) / rate) <= 1
    assert seen["bar"] == [done, total]
