"""What rsagg is doing, computed in one place for ``rsagg status`` (table, ``--json``), the home page
and ``/status.json``: each source (state, resources, lag, last sync, last error, progress) and each
published set.

Everything comes from the state database, so any process can show it: the harvester saves a running
baseline's progress every few seconds (``HarvestContext.progress_update``); rate and ETA follow from
the progress and the time the sync began (``last_attempt``) and last saved it (``updated_at``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from ..config import Config
from ..progress_text import describe, figures, format_duration, saved_rate
from ..rs.w3cdt import format_w3c, utcnow
from ..store.interface import StateStore
from ..store.nodes import alive
from ..store.rows import Reconciliation, SourceRow
from ..store.sets import published_sets


def _time(value: datetime | str | None) -> str | None:
    """State gives source times as datetimes; JSON and the table want W3C text."""
    return format_w3c(value) if isinstance(value, datetime) else value


def _progress(s: SourceRow | None) -> dict | None:
    """done/total/percent/rate/eta of the running sync; None when none runs or it counted nothing."""
    if s is None or s.state != "syncing" or not s.progress_done:
        return None
    start, saved = s.last_attempt, s.updated_at
    elapsed = (
        (saved - start).total_seconds()
        if isinstance(start, datetime) and isinstance(saved, datetime)
        else None
    )
    p = figures(s.progress_done, s.progress_total, elapsed, rate=saved_rate(s.progress_what))
    p["text"] = describe(p)
    return p


def lag_since(cur: Any, last_success: datetime | None) -> tuple[datetime | None, str | None]:
    """(time the lag counts from, basis) of one set.

    Followed through a Change List: the datetime of the last change applied (or the snapshot's ``at``).
    Read from its Resource List alone (no Change List: the cursor never names one): the upstream cannot
    say when it changed, so rsagg is as fresh as its last successful read of that list, which each poll
    does (a conditional GET that finds it unchanged counts too). The list's own ``at`` would make the
    lag grow forever while the store and the upstream agree. Followed through a Change List whose
    changes carry no ``datetime`` (§7, §12.1: it *may* be given; the position then stays at the
    snapshot's ``at``): likewise the last poll that read every list completely (a degraded or failed
    poll is no success), basis "change list read"."""
    if cur is None:
        return None, None
    pos = cur.last_datetime or cur.baseline_at
    if cur.changelist_url is None and isinstance(last_success, datetime):
        return (max(pos, last_success) if pos else last_success), "resource list"
    undated = cur.changelist_url is not None and (
        cur.last_datetime is None or cur.last_datetime == cur.baseline_at
    )
    if undated and isinstance(last_success, datetime):
        return (max(pos, last_success) if pos else last_success), "change list read"
    return pos, "change list" if pos else None


def reconciliation_row(rec: Reconciliation | None) -> dict | None:
    """A set's last reconciliation with its Resource List (``harvest/reconcile.py``), as shown."""
    if rec is None:
        return None
    return {
        "at": format_w3c(rec.reconciled_at),
        "cause": rec.cause,
        "differences": rec.differences,
        "repaired": sum(rec.repaired.values()),
        "repaired_by_kind": dict(rec.repaired),
        "unrepaired": rec.unrepaired,
        "complete": rec.complete,
        "error": rec.error,
    }


def _reconciled(sets: list[dict]) -> dict | None:
    """A source's reconciliations summed over its sets: the latest time, repairs and what is left."""
    recs = [x["reconciliation"] for x in sets if x.get("reconciliation")]
    if not recs:
        return None
    return {
        "at": max(r["at"] for r in recs),
        "repaired": sum(r["repaired"] for r in recs),
        "unrepaired": sum(r["unrepaired"] for r in recs),
        "complete": all(r["complete"] for r in recs),
    }


def source_rows(state: StateStore, names: Sequence[str], *, now: datetime | None = None) -> list[dict]:
    """One row per source, configured ones first (a source never harvested shows as 'new'), then
    sources the state still holds but the configuration no longer names."""
    now = now or utcnow()
    known = {s.name: s for s in state.sources()}
    waiting = state.retries_by_source()
    rows = []
    for name in [*names, *sorted(set(known) - set(names))]:
        s = known.get(name)
        sets: list[dict[str, Any]] = []
        newest: datetime | None = None
        bases: set[str] = set()
        for st in state.sets(name) if s else []:
            cur = state.cursor(st.id)
            pos = (cur.last_datetime or cur.baseline_at) if cur else None
            since, basis = lag_since(cur, s.last_success if s else None)
            if since is not None and basis is not None:  # lag_since gives a basis with every `since`
                bases.add(basis)
                newest = since if newest is None or since > newest else newest
            sets.append(
                {
                    "set": st.name,
                    "capabilitylist": st.capabilitylist_url,
                    "resources": state.count_resources(st.id),
                    "position": format_w3c(pos) if pos else None,
                    "baseline_at": format_w3c(cur.baseline_at) if cur and cur.baseline_at else None,
                    "lag_basis": basis,
                    "reconciliation": reconciliation_row(state.reconciliation(st.id)),
                }
            )
        notes = state.upstream_notes(name) if s else {"deviations": [], "skipped": []}
        reconciled = _reconciled(sets)
        shown = (s.state if s else None) or "new"
        if shown == "ok" and reconciled and (reconciled["unrepaired"] or not reconciled["complete"]):
            shown = "degraded"  # never "ok" while the Resource List says otherwise (harvest/reconcile.py)
        rows.append(
            {
                "name": name,
                "configured": name in names,
                "url": s.url if s else None,
                # When ``url`` failed and discovery found the Source elsewhere: what it answered and
                # what is harvested instead (the operator should configure that).
                "using": s.using_url if s else None,
                "state": shown,
                "resources": sum(x["resources"] for x in sets),
                "position": format_w3c(newest) if newest else None,
                "lag_basis": " + ".join(sorted(bases)) or None,
                "lag_seconds": round(max(0.0, (now - newest).total_seconds()), 1) if newest else None,
                "lag": format_duration(max(0.0, (now - newest).total_seconds())) if newest else None,
                "retries": waiting.get(name, {"waiting": 0, "ended": 0}),
                "last_success": _time(s.last_success if s else None),
                "last_attempt": _time(s.last_attempt if s else None),
                "last_error": s.last_error if s else None,
                "progress": _progress(s),
                "sets": sets,
                "reconciled": reconciled,
                # Lenient in, truthful out (harvest/deviations.py): what the last sync read past, and
                # the lists it could not read (then the state is "degraded", never "ok").
                "deviations": notes["deviations"],
                "skipped": notes["skipped"],
            }
        )
    return rows


def set_rows(state: StateStore, config: Config) -> list[dict]:
    """The published sets (``store/sets.py``) with their resources, sources and Capability List."""
    state_sets = state.sets()
    source_of = {s.id: s.source for s in state_sets}
    base = config.server.base_url
    return [
        {
            "name": ps.name,
            "resources": state.count_live(ps.set_ids),
            "sources": sorted({source_of[i] for i in ps.set_ids if i in source_of}),
            "capabilitylist": f"{base}/{ps.name}/capabilitylist.xml",
        }
        for ps in published_sets(config, state_sets).values()
    ]


def _interrupted(rows: list[dict], running: bool | None) -> list[dict]:
    """A source left "syncing" by a process that is gone (killed, crashed: nothing holds the store's
    lock) is shown as interrupted, not as a sync that goes on; the next harvest resumes it."""
    if running is not False:
        return rows
    for r in rows:
        if r["state"] == "syncing":
            r["state"], r["progress"] = "interrupted", None
    return rows


def cluster_rows(state: StateStore, *, now: datetime | None = None) -> dict[str, Any] | None:
    """The nodes of a cluster (``run/cluster.py``) and who holds which source; None when no node ever ran."""
    now = now or utcnow()
    nodes, leases = state.nodes(), state.leases()
    if not nodes and not leases:
        return None
    live = {n.name for n in alive(nodes, now)}
    held = [le for le in leases if le.node and le.expires_at and le.expires_at > now]
    return {
        "nodes": [
            {
                "name": n.name,
                "alive": n.name in live,
                "host": n.host,
                "pid": n.pid,
                "url": n.url,
                "started_at": _time(n.started_at),
                "heartbeat_at": _time(n.heartbeat_at),
                "stopped_at": _time(n.stopped_at),
                "sources": sorted(le.source for le in held if le.node == n.name),
            }
            for n in nodes
        ],
        "leases": [
            {
                "source": le.source,
                "node": le.node if le in held else None,
                "epoch": le.epoch,
                "granted_at": _time(le.granted_at),
                "expires_at": _time(le.expires_at),
            }
            for le in leases
        ],
    }


def collect(
    state: StateStore,
    config: Config,
    *,
    now: datetime | None = None,
    running: bool | None = None,
    unrecorded: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Everything the status displays show (``rsagg status --json`` prints exactly this). ``running``:
    whether a harvesting process holds the store (``store/lock.py``; None: not known). In a cluster each
    source row names the node harvesting it (``node``), and ``cluster`` lists the nodes and leases.
    ``unrecorded``: source -> a store failure this process met that the state could not record (the
    daemon's ``Metrics.unrecorded_failures``): shown as the source's error, saying so."""
    now = now or utcnow()
    rows = source_rows(state, [s.name for s in config.sources], now=now)
    said = {s.name: s.note for s in config.sources if s.note}
    for r in rows:
        r["note"] = said.get(r["name"])
    for r in rows:
        line = (unrecorded or {}).get(r["name"])
        if line:
            r["state"], r["progress"] = "error", None
            r["last_error"] = f"{line} [not recorded in the state: it could not be written]"
    cluster = cluster_rows(state, now=now)
    if cluster is not None:
        holder = {le["source"]: le["node"] for le in cluster["leases"]}
        for r in rows:
            r["node"] = holder.get(r["name"])
            if r["state"] == "syncing" and r["node"] is None:  # its node died: the next holder resumes it
                r["state"], r["progress"] = "interrupted", None
        if any(n["alive"] for n in cluster["nodes"]):
            running = None  # nodes on other machines do not show in this machine's lock: trust the leases
    out = {
        "time": format_w3c(now),
        "sources": _interrupted(rows, running),
        "sets": set_rows(state, config),
        "changelog_last_seq": state.last_seq(),
    }
    if cluster is not None:
        out["cluster"] = cluster
    return out


def unharvested(config: Config) -> dict[str, Any]:
    """The status before the state database exists."""
    return {
        "time": format_w3c(utcnow()),
        "sources": [
            {
                "name": s.name,
                "configured": True,
                "url": s.url,
                "state": "new",
                "resources": 0,
                "sets": [],
                "deviations": [],
                "skipped": [],
            }
            for s in config.sources
        ],
        "sets": [],
        "changelog_last_seq": 0,
    }


def short_time(value: str | None) -> str:
    """W3C time to the second for displays (``2024-05-01T10:00:00.123456Z`` -> ``2024-05-01T10:00:00Z``)."""
    return re.sub(r"\.\d+Z$", "Z", value) if value else "-"


def progress_text(row: dict) -> str:
    return row["progress"]["text"] if row.get("progress") else ""


def lag_text(row: dict) -> str:
    return row.get("lag") or "-"


#: Characters of an error shown in a table cell (the whole text is in ``--json`` / on demand on the page).
ERROR_CELL = 100


def notes(row: dict) -> list[str]:
    """What a source row needs said besides its cells: the configured note, lists skipped (the source
    cannot be in sync), deviations tolerated, the URL harvested when discovery led elsewhere, retries
    waiting or ended."""
    out = [row["note"]] if row.get("note") else []  # the operator's own line ([[sources]] note)
    out += [f"SKIPPED, so not in sync: {k['url']}: {k['reason']}" for k in row.get("skipped") or []]
    tolerated = ", ".join(f"{d['rule']} x{d['count']}" for d in row.get("deviations") or [])
    if tolerated:
        out.append(f"tolerated: {tolerated}")
    if row.get("using"):
        out.append(f"configured URL not used: {row['using']}")
    if row.get("state") == "interrupted":
        out.append("the harvesting process stopped during this sync; the next harvest resumes it")
    rec = row.get("reconciled")
    if rec:
        out.append(f"reconciled at {short_time(rec['at'])}, {rec['repaired']} repaired")
        if rec["unrepaired"]:
            out.append(f"reconciliation: {rec['unrepaired']} difference(s) NOT repaired, so not in sync")
        if not rec["complete"]:
            out.append("reconciliation incomplete (a Resource List was not read), so not in sync")
    r = row.get("retries") or {}
    if r.get("waiting") or r.get("ended"):
        ended = f", {r['ended']} ended (URI no longer listed upstream)" if r.get("ended") else ""
        out.append(f"retries: {r.get('waiting', 0)} waiting{ended}; see rsagg retries")
    return out


def table(status: dict[str, Any]) -> str:
    """The text ``rsagg status`` prints."""
    head = ("SOURCE", "STATE", "RESOURCES", "LAG", "LAST SUCCESS", "PROGRESS", "LAST ERROR")
    row = "{:<20} {:<11} {:>10} {:>7} {:<22} {:<34} {}"
    lines = [row.format(*head)]
    cut = False
    for r in status["sources"]:
        name = r["name"] + ("" if r["configured"] else " (removed)")
        error = one_line(r.get("last_error"), ERROR_CELL)
        cut |= len(error) < len(one_line(r.get("last_error")))
        cells = (name, r["state"], r["resources"], lag_text(r), short_time(r.get("last_success")),
                 progress_text(r) or "-", error)  # fmt: skip
        lines.append(row.format(*cells).rstrip())
        for note in notes(r):
            lines.append(f"  {note}")
    if not status["sources"]:
        lines.append("(no sources configured)")
    if cut:
        lines.append("(errors cut to one line: rsagg status --json has the whole text)")
    tolerated = [(r["name"], d) for r in status["sources"] for d in r.get("deviations") or []]
    if tolerated:
        lines += ["", "{:<20} {:<24} {:>7} {}".format("SOURCE", "TOLERATED DEVIATION", "COUNT", "FIRST SEEN")]
        for name, d in tolerated:
            where = f"{d['url']}:{d['line']}" if d.get("line") else d.get("url") or "-"
            lines.append(f"{name:<20} {d['rule']:<24} {d['count']:>7} {where}: {d['message']}")
    cluster = status.get("cluster")
    if cluster:
        lines += ["", "{:<24} {:<8} {:<22} {:>7} {}".format("NODE", "STATE", "HEARTBEAT", "SOURCES", "HOLDS")]
        for n in cluster["nodes"]:
            state = "alive" if n["alive"] else "stopped" if n["stopped_at"] else "dead"
            held, beat = ", ".join(n["sources"]) or "-", short_time(n["heartbeat_at"])
            lines.append(f"{n['name']:<24} {state:<8} {beat:<22} {len(n['sources']):>7} {held}")
        free = [le["source"] for le in cluster["leases"] if le["node"] is None]
        if free:
            lines.append(f"not held by any node (taken at the next heartbeat): {', '.join(free)}")
    if status["sets"]:
        lines += ["", "{:<20} {:>10} {:<30} {}".format("SET", "RESOURCES", "SOURCES", "CAPABILITY LIST")]
        for s in status["sets"]:
            sources = ", ".join(s["sources"]) or "-"
            lines.append(f"{s['name']:<20} {s['resources']:>10} {sources:<30} {s['capabilitylist']}")
    return "\n".join(lines)


__all__ = [
    "ERROR_CELL",
    "cluster_rows",
    "collect",
    "lag_since",
    "lag_text",
    "notes",
    "one_line",
    "progress_text",
    "reconciliation_row",
    "set_rows",
    "short_time",
    "source_rows",
    "table",
    "unharvested",
]


def one_line(text: str | None, limit: int | None = None) -> str:
    """An error message for a table cell or a line: whitespace collapsed, cut to ``limit`` with "…"."""
    flat = " ".join((text or "").split())
    if limit is not None and len(flat) > limit:
        return flat[: limit - 1].rstrip() + "…"
    return flat
