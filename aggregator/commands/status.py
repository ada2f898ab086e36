"""Show each source: state, resources held, last success, position in the change stream, last error."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime

from ..rs.w3cdt import format_w3c
from ..store.state import State
from ._common import add_config_arguments, start


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--json", action="store_true")


def _time(value: datetime | str | None) -> str | None:
    """State returns source times as datetimes; JSON and the table want W3C text."""
    return format_w3c(value) if isinstance(value, datetime) else value


def collect(state: State, names: list[str]) -> list[dict]:
    """Per-source status rows, configured sources first (a source never harvested shows as 'new')."""
    known = {s["name"]: s for s in state.sources()}
    rows = []
    for name in [*names, *sorted(set(known) - set(names))]:
        s = known.get(name, {})
        positions = []
        for st in state.sets(name) if s else []:
            cur = state.cursor(st["id"])
            pos = cur.last_datetime if cur else None
            positions.append(
                {
                    "set": st["capabilitylist_url"],
                    "resources": state.count_resources(st["id"]),
                    "position": format_w3c(pos) if pos else None,
                    "baseline_at": format_w3c(cur.baseline_at) if cur and cur.baseline_at else None,
                }
            )
        rows.append(
            {
                "name": name,
                "configured": name in names,
                "state": s.get("state") or "new",
                "resources": state.count_resources(source=name) if s else 0,
                "last_success": _time(s.get("last_success")),
                "last_attempt": _time(s.get("last_attempt")),
                "last_error": s.get("last_error"),
                "progress": [s.get("progress_done"), s.get("progress_total")],
                "sets": positions,
            }
        )
    return rows


def run(args: argparse.Namespace) -> int:
    config = start(args)
    if config is None:
        return 2
    db = config.store_path / "state.db"
    if not db.exists():
        rows = [
            {"name": s.name, "configured": True, "state": "new", "resources": 0, "sets": []}
            for s in config.sources
        ]
    else:
        state = State(db)
        try:
            rows = collect(state, [s.name for s in config.sources])
        finally:
            state.close()
    if args.json:
        json.dump({"sources": rows}, sys.stdout, indent=2)
        print()
        return 0
    header = f"{'SOURCE':<20} {'STATE':<8} {'RESOURCES':>10} {'LAST SUCCESS':<22} {'POSITION':<28} LAST ERROR"
    print(header)
    for r in rows:
        pos = ", ".join(p["position"] or "-" for p in r["sets"]) or "-"
        name = r["name"] + ("" if r["configured"] else " (removed)")
        print(
            f"{name:<20} {r['state']:<8} {r['resources']:>10} {r.get('last_success') or '-':<22} "
            f"{pos:<28} {r.get('last_error') or ''}"
        )
    return 0
