"""Loading plugins and calling hooks with each plugin isolated from the others.

Order of registration: the default plugins (rsagg's own behaviour) first, then third-party plugins from
the ``rsagg`` entry-point group. pluggy calls the most recently registered first, so a third-party
plugin answers a ``firstresult`` hook before the default does. The configuration can disable any plugin
(``[plugins.NAME] enabled = false``) and gives each its own settings table, globally and per source.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points, version
from typing import Any

import pluggy

from . import hookspecs
from .config import Config, ConfigError

log = logging.getLogger("rsagg.plugins")

#: rsagg's own behaviour, registered as plugins (name -> module).
DEFAULT_PLUGINS = {
    "filesystem": "aggregator.default_plugins.filesystem",
    "jsonpatch": "aggregator.default_plugins.jsonpatch",
    "linkpolicy": "aggregator.default_plugins.linkpolicy",
}
GROUP = "rsagg"


@dataclass
class PluginContext:
    """What a hook implementation gets as ``plugin``: its settings, nothing else of rsagg's internals."""

    global_settings: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    source_settings: Mapping[str, Mapping[str, Mapping[str, Any]]] = field(default_factory=dict)

    def settings(self, name: str, source: str | None = None) -> dict[str, Any]:
        """The plugin's settings: ``[plugins.NAME]`` overlaid with the source's ``plugins.NAME`` table."""
        out = {k: v for k, v in self.global_settings.get(name, {}).items() if k != "enabled"}
        if source is not None:
            out.update(self.source_settings.get(source, {}).get(name, {}))
        return out


class Plugins:
    """The plugin manager of one rsagg process."""

    def __init__(
        self,
        global_settings: Mapping[str, Mapping[str, Any]] | None = None,
        source_settings: Mapping[str, Mapping[str, Mapping[str, Any]]] | None = None,
        *,
        entry_point_plugins: bool = True,
    ) -> None:
        self.pm = pluggy.PluginManager(GROUP)
        self.pm.add_hookspecs(hookspecs)
        self.context = PluginContext(global_settings or {}, source_settings or {})
        self.failures: Counter[str] = Counter()  # plugin name -> exceptions raised (metrics read this)
        self.versions: dict[str, str] = {}
        for name, module in DEFAULT_PLUGINS.items():
            self.pm.register(importlib.import_module(module), name=name)
            self.versions[name] = "builtin"
        if entry_point_plugins:
            for ep in entry_points(group=GROUP):
                if self.pm.get_plugin(ep.name) is not None:
                    continue
                try:
                    self.pm.register(ep.load(), name=ep.name)
                except Exception as exc:  # a broken third-party plugin must not stop rsagg
                    log.error("plugin %s (%s) failed to load: %s", ep.name, ep.value, exc)
                    self.failures[ep.name] += 1
                    continue
                dist = ep.dist.name if ep.dist else None
                self.versions[ep.name] = version(dist) if dist else "unknown"
        self.disabled: list[str] = []
        for name, table in (global_settings or {}).items():
            if table.get("enabled") is False and self.pm.get_plugin(name) is not None:
                self.pm.unregister(name=name)
                self.disabled.append(name)
                log.info("plugin %s disabled by configuration", name)

    @classmethod
    def from_config(cls, config: Config, *, entry_point_plugins: bool = True) -> Plugins:
        """The plugins a configuration asks for; naming a plugin that is not installed is a ConfigError."""
        global_settings = dict(config.plugins)
        # The built-in link policy takes its two switches from [publish] (where operators look for them).
        policy = {"keep_collection": config.publish.keep_collection_links,
                  "keep_canonical": config.publish.keep_canonical_links}  # fmt: skip
        global_settings["linkpolicy"] = {**policy, **global_settings.get("linkpolicy", {})}
        plugins = cls(
            global_settings,
            {s.name: s.plugins for s in config.sources if s.plugins},
            entry_point_plugins=entry_point_plugins,
        )
        known = set(plugins.names()) | set(plugins.disabled)
        for key, tables in [("plugins", config.plugins)] + [
            (f"sources[{i}].plugins", s.plugins) for i, s in enumerate(config.sources)
        ]:
            for name in tables:
                if name not in known:
                    raise ConfigError(
                        config.file,
                        f"{key}.{name}",
                        f"no such plugin (installed: {', '.join(sorted(known))})",
                    )
        return plugins

    def names(self) -> list[str]:
        return [name for name, _ in self.pm.list_name_plugin()]

    def hooks_of(self, name: str) -> list[str]:
        """Hooks a plugin implements (for ``rsagg plugins``)."""
        plugin = self.pm.get_plugin(name)
        callers = self.pm.get_hookcallers(plugin) or []
        return sorted(caller.name for caller in callers)

    def call(self, hook: str, **kwargs: Any) -> list[tuple[str, Any]]:
        """Call every implementation of a hook, each isolated: one that raises is logged and counted.

        Returns ``(plugin name, result)`` pairs in pluggy's call order (most recently registered first),
        leaving out None results. ``plugin`` is passed automatically to hooks that take it.
        """
        caller = getattr(self.pm.hook, hook)
        results = []
        for impl in reversed(caller.get_hookimpls()):
            args = {k: v for k, v in {"plugin": self.context, **kwargs}.items() if k in impl.argnames}
            try:
                result = impl.function(**args)
            except Exception as exc:
                self._failed(impl.plugin_name, hook, exc)
                continue
            if result is not None:
                results.append((impl.plugin_name, result))
        return results

    async def acall(self, hook: str, **kwargs: Any) -> list[tuple[str, Any]]:
        """Like ``call`` for hooks that may return awaitables (awaited here, still isolated)."""
        out = []
        for name, result in self.call(hook, **kwargs):
            if inspect.isawaitable(result):
                try:
                    result = await result
                except Exception as exc:
                    self._failed(name, hook, exc)
                    continue
            if result is not None:
                out.append((name, result))
        return out

    def first(self, hook: str, **kwargs: Any) -> Any:
        """The first non-None answer of a hook (firstresult semantics, isolated)."""
        results = self.call(hook, **kwargs)
        return results[0][1] if results else None

    def merged(self, hook: str) -> dict[str, Any]:
        """Merge the dicts returned by a registration hook; later plugins override earlier keys."""
        merged: dict[str, Any] = {}
        for _, table in reversed(self.call(hook)):
            merged.update(table)
        return merged

    def _failed(self, name: str, hook: str, exc: Exception) -> None:
        self.failures[name] += 1
        log.error("plugin %s raised in %s: %s: %s", name, hook, type(exc).__name__, exc, exc_info=exc)
