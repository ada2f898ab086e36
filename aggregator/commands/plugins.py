"""List the plugins rsagg loads: name, version, where from, enabled, hooks implemented."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported when the command runs, not at start-up (aggregator/cli.py)
    from ..plugins.manager import Plugins
from ._common import add_global_arguments

#: Loading plugins logs at info; this listing shows only warnings unless asked.
DEFAULT_LOG_LEVEL = "warning"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_global_arguments(p)  # -c is optional here: with it, its [plugins.NAME] tables apply
    p.add_argument("--json", action="store_true")


def _declared_hooks(obj: Any) -> list[str]:
    from ..plugins.manager import GROUP

    """Hooks a plugin object implements, read from pluggy's markers (for plugins not registered)."""
    return sorted(
        name
        for name in dir(obj)
        if name.startswith("rsagg_") and hasattr(getattr(obj, name, None), f"{GROUP}_impl")
    )


def collect(plugins: Plugins) -> list[dict[str, Any]]:
    """One row per plugin known to the manager, in loading order (defaults first, then entry points)."""
    from ..plugins.entrypoints import entry_points
    from ..plugins.manager import DEFAULT_PLUGINS, GROUP

    eps = {ep.name: ep for ep in entry_points(group=GROUP)}
    names = list(dict.fromkeys([*plugins.versions, *plugins.disabled, *plugins.failures]))
    rows = []
    for name in names:
        ep = eps.get(name) if name not in DEFAULT_PLUGINS else None
        row: dict[str, Any] = {
            "name": name,
            "version": plugins.versions.get(name, "unknown"),
            "origin": "builtin" if name in DEFAULT_PLUGINS else "entry point",
            "module": DEFAULT_PLUGINS.get(name) or (ep.value if ep else None),
            "distribution": ep.distribution or None if ep else None,
            "enabled": name not in plugins.disabled and plugins.pm.get_plugin(name) is not None,
            "loaded": plugins.pm.get_plugin(name) is not None or name in plugins.disabled,
            "hooks": [],
        }
        if plugins.pm.get_plugin(name) is not None:
            row["hooks"] = plugins.hooks_of(name)
        elif name in plugins.disabled:
            try:
                module = (
                    importlib.import_module(DEFAULT_PLUGINS[name])
                    if name in DEFAULT_PLUGINS or ep is None
                    else ep.load()
                )
                row["hooks"] = _declared_hooks(module)
            except Exception:  # it loaded once; if it does not now, there is nothing more to show
                pass
        rows.append(row)
    return rows


def run(args: argparse.Namespace) -> int:
    from ..errors import ConfigError
    from ..observe.logs import setup_logging
    from ..run.parts import load_plugins

    setup_logging(args.log_level, args.log_format)
    try:
        if args.config:  # pydantic loads only with a configuration to read
            from ..config import load_config

            plugins = load_plugins(load_config(args.config))
        else:
            plugins = load_plugins(None)
    except ConfigError as exc:
        print(f"rsagg: config error: {exc}", file=sys.stderr)
        return 2
    rows = collect(plugins)
    if args.json:
        json.dump({"plugins": rows}, sys.stdout, indent=2)
        print()
        return 0
    print(f"{'PLUGIN':<16} {'VERSION':<10} {'ORIGIN':<36} {'ENABLED':<8} HOOKS")
    for r in rows:
        origin = r["origin"] if r["origin"] == "builtin" else f"entry point: {r['distribution'] or '?'}"
        enabled = "yes" if r["enabled"] else ("no" if r["loaded"] else "FAILED")
        print(f"{r['name']:<16} {r['version']:<10} {origin:<36} {enabled:<8} {', '.join(r['hooks']) or '-'}")
    return 0
