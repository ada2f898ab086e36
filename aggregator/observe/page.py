"""The operator's views of the publisher: the home page with live status, ``/status.json``, ``/metrics``.

The home page lists each source (state, resources, lag, last sync, last error, progress) and each
published set with its documents. It is plain HTML that works without scripts (states are coloured
badges; an error shows one line and opens to its whole text); a dozen lines of script fetch the page
again every REFRESH_SECONDS and swap its tables in, so the rows are rendered in one place. They come
from ``aggregator/observe/report.py``, the same function as ``rsagg status`` and ``/status.json``.

``/metrics``: a plain route returning the Prometheus text format 0.0.4 (prometheus-client's ASGI app,
mounted, would answer ``/metrics`` with a redirect to ``/metrics/``).
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Route

from ..store.interface import StateStore
from ..store.lock import harvester_running
from . import report as status
from .metrics import CONTENT_TYPE, Metrics

if TYPE_CHECKING:
    from ..config import Config
    from .metrics import Metrics

T = TypeVar("T")


class Publisher(Protocol):
    """What these views read from the app they are mounted in (``request.app.state.publisher``,
    publish/app.py's ``Publisher``): its configuration, metrics, site, and a state call."""

    config: Config
    metrics: Metrics

    def site(self, state: StateStore) -> Any: ...

    async def run(self, fn: Callable[..., T], *args: Any) -> T: ...


REFRESH_SECONDS = 3
_e = html.escape

STYLE = """
body { font-family: sans-serif; margin: 2em; }
table { border-collapse: collapse; table-layout: auto; }
th, td { text-align: left; padding: 0.2em 0.8em; border-bottom: 1px solid #ddd; vertical-align: top; }
.muted, .note { color: #666; font-size: smaller; }
.badge { display: inline-block; padding: 0.05em 0.6em; border-radius: 0.8em; font-weight: bold;
  color: #fff; background: #777; }
.badge.ok { background: #1a7f37; }
.badge.busy { background: #0969da; }
.badge.bad { background: #cf222e; }
.badge.warn { background: #9a6700; }
.badge.idle { background: #6e7781; }
details.error { max-width: 40em; }
details.error summary { white-space: nowrap; overflow: hidden; text-overflow: ellipsis; cursor: pointer;
  color: #cf222e; }
details.error pre { white-space: pre-wrap; overflow-wrap: anywhere; background: #f6f8fa; padding: 0.5em;
  margin: 0.3em 0; }
progress { width: 8em; vertical-align: middle; }
td.lag, td.success, td.progress { white-space: nowrap; }
.note { max-width: 30em; overflow-wrap: anywhere; }
"""


def status_routes(metrics: Metrics) -> list[BaseRoute]:
    """``/``, ``/status.json`` and ``/metrics`` over ``metrics`` (this process's): the composition hands
    them to the publisher app, which knows nothing of observe/."""
    get = ["GET", "HEAD"]

    async def home_page(request: Request) -> Response:
        return await home(request, metrics)

    async def status_json_page(request: Request) -> Response:
        return await status_json(request, metrics)

    async def metrics_page(request: Request) -> Response:
        return await exposition(request, metrics)

    return [
        Route("/", home_page, methods=get),
        Route("/status.json", status_json_page, methods=get),
        Route("/metrics", metrics_page, methods=get),
    ]


def _status(pub: Publisher, state: StateStore, metrics: Metrics) -> dict[str, Any]:
    return status.collect(
        state,
        pub.config,
        running=harvester_running(pub.config.store_path),
        unrecorded=metrics.unrecorded_failures,
    )


async def status_json(request: Request, metrics: Metrics) -> Response:
    pub: Publisher = request.app.state.publisher
    body = await pub.run(lambda state: _status(pub, state, metrics))
    return JSONResponse(body, headers={"cache-control": "no-store"})


async def exposition(request: Request, metrics: Metrics) -> Response:
    """Refresh what is read from the state (and the store's size), then expose; both in a worker thread."""
    pub: Publisher = request.app.state.publisher

    def scrape(state: StateStore) -> bytes:
        metrics.refresh_from_state(state)
        return metrics.exposition()

    return Response(await pub.run(scrape), media_type=CONTENT_TYPE, headers={"cache-control": "no-store"})


#: State -> colour class of its badge. ``degraded`` (a sync that skipped or bent something) has its
#: colour ready for when the harvester reports it.
STATE_CLASSES = {
    "ok": "ok", "syncing": "busy", "error": "bad", "degraded": "warn", "interrupted": "warn", "new": "idle",
}  # fmt: skip


def _state_cell(r: dict) -> str:
    state = str(r.get("state") or "new")
    return f'<span class="badge {STATE_CLASSES.get(state, "idle")}">{_e(state)}</span>'


def _name_cell(r: dict) -> str:
    name = _e(r["name"]) + ("" if r.get("configured", True) else ' <span class="muted">(removed)</span>')
    notes = "".join(f'<div class="note">{_e(n)}</div>' for n in status.notes(r))
    return name + notes


def _progress_cell(r: dict) -> str:
    p = r.get("progress")
    if not p:
        return ""
    bar = f'<progress max="{p["total"]}" value="{p["done"]}"></progress> ' if p.get("total") else ""
    return f'{bar}<span class="progress">{_e(p["text"])}</span>'


def _error_cell(r: dict) -> str:
    """One line (cut by the server and by CSS); the whole text on demand, without scripts."""
    whole = status.one_line(r.get("last_error"))
    if not whole:
        return ""
    short = status.one_line(whole, status.ERROR_CELL)
    return (
        f'<details class="error"><summary title="show the whole error">{_e(short)}</summary>'
        f"<pre>{_e(r.get('last_error') or '')}</pre></details>"
    )


#: The Sources table: header, class and cell of each column, in order (one place to add a column).
SOURCE_COLUMNS: list[tuple[str, str, Any]] = [
    ("Source", "source", _name_cell),
    ("State", "state", _state_cell),
    ("Resources", "resources", lambda r: _e(str(r["resources"]))),
    ("Lag", "lag", lambda r: _e(status.lag_text(r))),
    ("Last success", "success", lambda r: _e(status.short_time(r.get("last_success")))),
    ("Progress", "progress", _progress_cell),
    ("Last error", "error", _error_cell),
]


def _source_row(r: dict) -> str:
    cells = "".join(f'<td class="{key}">{cell(r)}</td>' for _, key, cell in SOURCE_COLUMNS)
    return f'<tr data-source="{_e(r["name"])}">{cells}</tr>'


#: Refills the page's tables from the page itself (one rendering, on the server), keeping open the
#: errors a reader opened; keeps the page as it is if a poll fails (server restarting).
SCRIPT = r"""
async function refresh() {
  try {
    const html = await (await fetch(location.pathname, {cache: "no-store"})).text();
    const fresh = new DOMParser().parseFromString(html, "text/html");
    const open = new Set([...document.querySelectorAll("#sources details[open]")]
      .map((d) => d.closest("tr").dataset.source));
    for (const id of ["sources", "sets", "updated"]) {
      const now = fresh.getElementById(id);
      if (now) document.getElementById(id).innerHTML = now.innerHTML;
    }
    for (const tr of document.querySelectorAll("#sources tr[data-source]")) {
      const d = tr.querySelector("details");
      if (d && open.has(tr.dataset.source)) d.open = true;
    }
  } catch (e) { /* server restarting: try again at the next tick */ }
}
setInterval(refresh, REFRESH_MS);
"""


async def home(request: Request, metrics: Metrics) -> Response:
    pub: Publisher = request.app.state.publisher

    def build(state: StateStore) -> tuple[Any, dict, dict]:
        site = pub.site(state)
        dumps = {name: site.dumps_available(name) or {} for name in site.sets}
        return site, _status(pub, state, metrics), dumps

    site, st, dumps = await pub.run(build)
    sources = "\n".join(_source_row(r) for r in st["sources"])
    if not st["sources"]:
        sources = f'<tr><td colspan="{len(SOURCE_COLUMNS)}">no sources configured</td></tr>'
    items = []
    for s in st["sets"]:
        name = s["name"]
        docs = [
            ("Capability List", site.capabilitylist(name)),
            ("Resource List", site.resourcelist(name)),
            ("Change List", site.changelist(name)),
            *sorted(dumps.get(name, {}).items()),
        ]
        links = " · ".join(f'<a href="{_e(url)}">{_e(label)}</a>' for label, url in docs)
        ps = site.sets.get(name)
        about = f' — <a href="{_e(ps.describedby)}">about</a>' if ps is not None and ps.describedby else ""
        from_ = f" from {_e(', '.join(s['sources']))}" if s["sources"] else ""
        items.append(
            f'<li data-set="{_e(name)}"><strong>{_e(name)}</strong>: {s["resources"]} resources{from_} — '
            f"{links}{about}</li>"
        )
    sets = "\n".join(items) or "<li>nothing harvested yet</li>"
    script = SCRIPT.replace("REFRESH_MS", json.dumps(REFRESH_SECONDS * 1000))
    head = "".join(f"<th>{_e(title)}</th>" for title, _, _ in SOURCE_COLUMNS)
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>rsagg — ResourceSync aggregator</title>
<style>{STYLE}</style></head>
<body>
<h1>rsagg — ResourceSync aggregator</h1>
<p>This server republishes resources harvested from other ResourceSync Sources
(<a href="https://www.openarchives.org/rs/1.1/resourcesync">ResourceSync 1.1</a>), each with a
<code>rel="via"</code> link to its origin. Start at the
<a href="{_e(site.well_known)}">Source Description</a>.</p>
<h2>Sources</h2>
<table id="sources">
<thead><tr>{head}</tr></thead>
<tbody>
{sources}
</tbody>
</table>
<p class="muted">Lag: for a set followed through its Change List, the time since the last change applied;
for a set read from its Resource List alone, the time since the last successful read of that list.</p>
<h2>Sets</h2>
<ul id="sets">
{sets}
</ul>
<p class="muted">Status at <span id="updated">{_e(st["time"])}</span>, refreshed every {REFRESH_SECONDS} s
· <a href="{_e(site.home)}status.json">status.json</a> · <a href="{_e(site.home)}metrics">metrics</a></p>
<script>{script}</script>
</body></html>
"""
    return HTMLResponse(page, headers={"cache-control": "no-store"})


__all__ = ["exposition", "home", "status_json", "status_routes"]
