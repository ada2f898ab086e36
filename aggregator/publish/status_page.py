"""The operator's views of the publisher: the home page with live status, ``/status.json``, ``/metrics``.

The home page lists each source (state, resources, lag, last sync, last error, progress) and each
published set with its documents. It is plain HTML that works without scripts; a dozen lines of script
poll ``status.json`` every REFRESH_SECONDS and refill the tables. The rows come from
``aggregator/status.py``, the same function as ``rsagg status``.

``/metrics``: a plain route returning the Prometheus text format 0.0.4 (prometheus-client's ASGI app,
mounted, would answer ``/metrics`` with a redirect to ``/metrics/``).
"""

from __future__ import annotations

import html
import json
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from .. import status
from ..metrics import CONTENT_TYPE
from ..store.state import State

if TYPE_CHECKING:
    from .app import Publisher

REFRESH_SECONDS = 3
_e = html.escape


def _status(pub: Publisher, state: State) -> dict[str, Any]:
    return status.collect(state, pub.config)


async def status_json(request: Request) -> Response:
    pub: Publisher = request.app.state.publisher
    body = await pub.run(lambda state: _status(pub, state))
    return JSONResponse(body, headers={"cache-control": "no-store"})


async def metrics(request: Request) -> Response:
    """Refresh what is read from the state (and the store's size), then expose; both in a worker thread."""
    pub: Publisher = request.app.state.publisher

    def scrape(state: State) -> bytes:
        pub.metrics.refresh_from_state(state)
        return pub.metrics.exposition()

    return Response(await pub.run(scrape), media_type=CONTENT_TYPE, headers={"cache-control": "no-store"})


def _source_row(r: dict) -> str:
    progress = r["progress"]["text"] if r.get("progress") else ""
    name = r["name"] + ("" if r.get("configured", True) else " (removed)")
    when = status.short_time(r.get("last_success"))
    cells = (name, r["state"], r["resources"], r.get("lag") or "-", when, progress, status.notes_text(r))
    return "<tr>" + "".join(f"<td>{_e(str(c))}</td>" for c in cells) + "</tr>"


#: Refills the tables from status.json (the same cells as _source_row); keeps the page if a poll fails.
SCRIPT = r"""
const ENTITIES = {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"};
const esc = (v) => String(v ?? "").replace(/[&<>"]/g, (c) => ENTITIES[c]);
const row = (r) => "<tr>" + [r.name + (r.configured === false ? " (removed)" : ""), r.state, r.resources,
  r.lag || "-", (r.last_success || "-").replace(/\.\d+Z$/, "Z"), r.progress ? r.progress.text : "",
  [r.last_error, (r.deviations || []).length
    ? "tolerated: " + r.deviations.map((d) => d.rule + " x" + d.count).join(", ") : ""]
    .filter(Boolean).join(" — ")]
  .map((c) => "<td>" + esc(c) + "</td>").join("") + "</tr>";
async function refresh() {
  try {
    const s = await (await fetch("status.json", {cache: "no-store"})).json();
    document.querySelector("#sources tbody").innerHTML = s.sources.map(row).join("");
    const items = document.querySelectorAll("li[data-set]");
    if (items.length !== s.sets.length) { location.reload(); return; }  // a set appeared or went
    for (const li of items) {
      const set = s.sets.find((x) => x.name === li.dataset.set);
      const text = li.querySelector("strong").nextSibling;  // ": N resources from ... — "
      if (set && text) text.textContent = text.textContent.replace(/\d+/, set.resources);
    }
    document.getElementById("updated").textContent = s.time;
  } catch (e) { /* server restarting: try again at the next tick */ }
}
setInterval(refresh, REFRESH_MS);
"""


async def home(request: Request) -> Response:
    pub: Publisher = request.app.state.publisher

    def build(state: State) -> tuple[Any, dict, dict]:
        site = pub.site(state)
        dumps = {name: site.dumps_available(name) or {} for name in site.sets}
        return site, _status(pub, state), dumps

    site, st, dumps = await pub.run(build)
    sources = "\n".join(_source_row(r) for r in st["sources"])
    if not st["sources"]:
        sources = '<tr><td colspan="7">no sources configured</td></tr>'
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
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>rsagg — ResourceSync aggregator</title>
<style>
body {{ font-family: sans-serif; margin: 2em; }}
table {{ border-collapse: collapse; }}
th, td {{ text-align: left; padding: 0.2em 0.8em; border-bottom: 1px solid #ddd; }}
.muted {{ color: #666; font-size: smaller; }}
</style></head>
<body>
<h1>rsagg — ResourceSync aggregator</h1>
<p>This server republishes resources harvested from other ResourceSync Sources
(<a href="https://www.openarchives.org/rs/1.1/resourcesync">ResourceSync 1.1</a>), each with a
<code>rel="via"</code> link to its origin. Start at the
<a href="{_e(site.well_known)}">Source Description</a>.</p>
<h2>Sources</h2>
<table id="sources">
<thead><tr><th>Source</th><th>State</th><th>Resources</th><th>Lag</th><th>Last success</th><th>Progress</th>
<th>Last error</th></tr></thead>
<tbody>
{sources}
</tbody>
</table>
<h2>Sets</h2>
<ul>
{sets}
</ul>
<p class="muted">Status at <span id="updated">{_e(st["time"])}</span>, refreshed every {REFRESH_SECONDS} s
· <a href="status.json">status.json</a> · <a href="metrics">metrics</a></p>
<script>{script}</script>
</body></html>
"""
    return HTMLResponse(page, headers={"cache-control": "no-store"})


__all__ = ["home", "metrics", "status_json"]
