"""Loading plugins and calling hooks with each plugin isolated from the others.

Order of registration: the default plugins (rsagg's own behaviour) first, then third-party plugins from
the ``rsagg`` entry-point group. pluggy calls the most recently registered first, so a third-party
plugin answers a ``firstresult`` hook before the default does. The configuration can disable any plugin
(``[plugins.NAME] enabled = false``) and gives each its own settings table, globally and per source.

Every hook call goes through pluggy's own call loop (``pm.hook.NAME(...)``), so its semantics hold:
``firstresult`` hooks stop at the first non-None answer, ``wrapper=True`` (and old-style
``hookwrapper=True``) implementations wrap the call and may change its result, ``tryfirst``/``trylast``
order the implementations. Isolation is added at registration, not by a loop of our own: when a plugin
is registered, each of its hook implementations (``HookImpl.function``) is replaced by a shim that calls
the original and, if it raises, logs the plugin's name and the hook, counts it in ``failures`` (exported
as a metric) and answers None — "no say" — so pluggy moves on to the next implementation. A result that
is an awaitable is wrapped the same way, so a coroutine that raises later is isolated too. A wrapper's
shim is a generator that delegates to the wrapper: a wrapper that raises before or after its ``yield``
is counted and the call goes on with the result it would have had without that wrapper. pluggy keeps
the implementation's ``argnames`` from the original function, so each still receives only what it asks
for.

Plugins fail closed: a privacy filter that is silently off is worse than a daemon that does not start.
An installed plugin that does not load (import error, a broken object), a hook implementation whose
name is no rsagg hook (``rsagg_filter_published``: pluggy's ``check_pending``), and a function named
``rsagg_*`` without ``@hookimpl`` (pluggy ignores it) are each a ``PluginError`` (a ``ConfigError``:
one line, exit 2) naming the plugin and the hook. A plugin disabled by ``[plugins.NAME] enabled =
false`` is not loaded at all: the operator's way to start without it.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
from collections import Counter
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pluggy

import aggregator.hookspecs as hookspecs  # the module itself: pluggy reads its specs

from ..errors import ConfigError
from .entrypoints import entry_points  # not importlib.metadata's: a tenth of a one-shot command's start

if TYPE_CHECKING:  # pydantic loads with a configuration, not with the plugins (``rsagg plugins``)
    from ..config import Config

log = logging.getLogger("rsagg.plugins")

#: rsagg's own behaviour, registered as plugins (name -> module).
DEFAULT_PLUGINS = {
    "filesystem": "aggregator.store.defaults",
    "jsonpatch": "aggregator.harvest.defaults",
    "linkpolicy": "aggregator.publish.defaults",
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


class PluginError(ConfigError):
    """A plugin that does not load or implements what is no rsagg hook: rsagg refuses to start."""


class Plugins:
    """The plugin manager of one rsagg process."""

    def __init__(
        self,
        global_settings: Mapping[str, Mapping[str, Any]] | None = None,
        source_settings: Mapping[str, Mapping[str, Mapping[str, Any]]] | None = None,
        *,
        entry_point_plugins: bool = True,
        file: str = "(no configuration file)",
    ) -> None:
        self.pm = pluggy.PluginManager(GROUP)
        self.pm.add_hookspecs(hookspecs)
        self.context = PluginContext(global_settings or {}, source_settings or {})
        self.failures: Counter[str] = Counter()  # plugin name -> exceptions raised (metrics read this)
        self.versions: dict[str, str] = {}
        for name, module in DEFAULT_PLUGINS.items():
            self._register(importlib.import_module(module), name)
            self.versions[name] = "builtin"
        off = {name for name, table in (global_settings or {}).items() if table.get("enabled") is False}
        self.disabled: list[str] = []
        if entry_point_plugins:
            for ep in entry_points(group=GROUP):
                if self.pm.get_plugin(ep.name) is not None or ep.name in self.disabled:
                    continue
                if ep.name in off:  # not even imported: the operator's way to start without it
                    self.disabled.append(ep.name)
                    log.info("plugin %s disabled by configuration", ep.name)
                    continue
                try:
                    obj = ep.load()
                except Exception as exc:  # fail closed: a filter that did not load filters nothing
                    raise PluginError(
                        file, f"plugins.{ep.name}",
                        f"plugin {ep.name} ({ep.value}) failed to load: {type(exc).__name__}: "
                        f"{_one_line(exc)} (fix or uninstall it, or set [plugins.{ep.name}] enabled = false)",
                    ) from None  # fmt: skip
                self._register(obj, ep.name, file)
                # The distribution the scan found (the first of its name on sys.path, as ``version()``
                # would find it again by a second scan of sys.path for each plugin).
                self.versions[ep.name] = ep.version or "unknown"
        for name in sorted(off):
            if self.pm.get_plugin(name) is not None:
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
            file=config.file,
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

    def call(self, hook: str, **kwargs: Any) -> Any:
        """Call a hook through pluggy, each implementation isolated: one that raises is logged and counted.

        Returns what pluggy returns: the list of non-None answers (most recently registered first, as
        ordered by ``tryfirst``/``trylast``), or for a ``firstresult`` hook the first answer or None.
        ``plugin`` (the ``PluginContext``) is passed automatically to hooks whose specification takes it.
        """
        caller = getattr(self.pm.hook, hook)
        if caller.spec is not None and "plugin" in caller.spec.argnames:
            kwargs = {"plugin": self.context, **kwargs}
        return caller(**kwargs)

    async def acall(self, hook: str, **kwargs: Any) -> list[Any]:
        """Like ``call`` for hooks whose answers may be awaitables: each is awaited (still isolated)."""
        out = []
        for result in self.call(hook, **kwargs):
            if inspect.isawaitable(result):
                result = await result
            if result is not None:
                out.append(result)
        return out

    def first(self, hook: str, **kwargs: Any) -> Any:
        """The answer of a ``firstresult`` hook: the first non-None one (later implementations not called)."""
        caller = getattr(self.pm.hook, hook)
        if caller.spec is None or not caller.spec.opts.get("firstresult"):
            raise TypeError(f"{hook} is not a firstresult hook")
        return self.call(hook, **kwargs)

    def merged(self, hook: str) -> dict[str, Any]:
        """Merge the dicts returned by a registration hook; later plugins override earlier keys."""
        merged: dict[str, Any] = {}
        for table in reversed(self.call(hook)):
            merged.update(table)
        return merged

    def _register(self, plugin: object, name: str, file: str = "(no configuration file)") -> None:
        """Register with pluggy, then put an isolating shim before each of the plugin's hook functions.

        Refused (``PluginError``, nothing of the plugin left registered): an implementation of no rsagg
        hook (pluggy's ``check_pending``: a misspelt ``rsagg_filter_published`` would never be called),
        a function named ``rsagg_*`` pluggy does not see (no ``@hookimpl``), or what pluggy refuses
        (arguments the hook does not have)."""
        for attr in dir(plugin):
            if attr.startswith("rsagg_") and callable(getattr(plugin, attr, None)):
                if not hasattr(getattr(plugin, attr), f"{GROUP}_impl"):
                    raise PluginError(
                        file, f"plugins.{name}",
                        f"plugin {name}: {attr} is not marked @hookimpl, so rsagg would never call it",
                    )  # fmt: skip
        try:
            self.pm.register(plugin, name=name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(file, f"plugins.{name}", f"plugin {name}: {_one_line(exc)}") from None
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            self.pm.unregister(name=name)
            hooks = _unknown_hooks(plugin)
            raise PluginError(
                file, f"plugins.{name}",
                f"plugin {name} implements {', '.join(hooks) or _one_line(exc)}, which is no rsagg hook "
                f"(misspelt? the hooks: {', '.join(hookspec_names())})",
            ) from None  # fmt: skip
        for caller in self.pm.get_hookcallers(plugin) or []:
            for impl in caller.get_hookimpls():
                if impl.plugin is plugin:
                    wrap: Callable[[str, str, Any], Callable[..., Any]] = (
                        self._isolated_wrapper if impl.wrapper or impl.hookwrapper else self._isolated
                    )
                    # pluggy types HookImpl.function Final; rsagg wraps each in place to isolate plugin errors
                    impl.function = wrap(name, caller.name, impl.function)  # type: ignore[misc]

    def _isolated(self, name: str, hook: str, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def shim(*args: Any, **kwargs: Any) -> Any:
            try:
                result = function(*args, **kwargs)
            except Exception as exc:
                self._failed(name, hook, exc)
                return None
            if inspect.isawaitable(result):
                return self._isolated_awaitable(name, hook, result)
            return result

        return shim

    async def _isolated_awaitable(self, name: str, hook: str, awaitable: Any) -> Any:
        try:
            return await awaitable
        except Exception as exc:
            self._failed(name, hook, exc)
            return None

    def _isolated_wrapper(
        self, name: str, hook: str, function: Callable[..., Generator[None, Any, Any]]
    ) -> Callable[..., Generator[None, Any, Any]]:
        """A generator that delegates to a wrapper; the wrapper failing leaves the call's result as is."""

        @functools.wraps(function)
        def shim(*args: Any, **kwargs: Any) -> Generator[None, Any, Any]:
            try:
                gen = function(*args, **kwargs)
                next(gen)
            except Exception as exc:  # StopIteration too: a wrapper that does not yield
                self._failed(name, hook, exc)
                return (yield)
            try:
                sent = yield
            except BaseException as below:  # raised further down the call: the wrapper sees it, as in pluggy
                try:
                    gen.throw(below)
                except StopIteration as stop:
                    return stop.value
                gen.close()
                raise RuntimeError(f"plugin {name}'s wrapper of {hook} yielded twice") from below
            try:
                gen.send(sent)
            except StopIteration as stop:
                return stop.value
            except Exception as exc:
                self._failed(name, hook, exc)
                return sent
            gen.close()
            self._failed(name, hook, RuntimeError("wrapper yielded twice"))
            return sent

        return shim

    def _failed(self, name: str, hook: str, exc: Exception) -> None:
        self.failures[name] += 1
        log.error("plugin %s raised in %s: %s: %s", name, hook, type(exc).__name__, exc, exc_info=exc)


def hookspec_names() -> list[str]:
    """Every rsagg hook's name (hookspecs.py)."""
    return sorted(n for n in dir(hookspecs) if n.startswith("rsagg_"))


def _unknown_hooks(plugin: object) -> list[str]:
    """The plugin's ``@hookimpl`` functions whose names are no rsagg hook."""
    known = set(hookspec_names())
    out = []
    for attr in dir(plugin):
        opts = getattr(getattr(plugin, attr, None), f"{GROUP}_impl", None)
        if isinstance(opts, dict) and (opts.get("specname") or attr) not in known:
            out.append(opts.get("specname") or attr)
    return sorted(out)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
