"""Harvest only some of a Source's resources: by media type, by URL, by size.

Why: an aggregator often wants part of a Source (its PDFs, one collection's URLs, nothing over 1 GB);
deciding from what the Resource List or Change List already says (``loc`` and ``rs:md`` ``type`` and
``length``, §7) costs no request at all. A skipped entry is not fetched; rsagg then treats it as not
held (a copy it held is deleted: a filter narrowed later shrinks the aggregation).

Configuration, globally and/or per source (the source's table overlays the global one key by key)::

    [plugins.resourcefilter]
    types = ["text/*", "application/pdf"]   # rs:md type must match one glob (case-insensitive)
    exclude_types = ["text/html"]           # ... and none of these
    include = ['^https://example\\.org/data/']  # loc must match one regex (re.search)
    exclude = ['\\.tmp$']                    # ... and none of these
    min_length = 1                          # rs:md length bounds, in bytes (inclusive)
    max_length = 1_000_000_000
    keep_untyped = true                     # entries without rs:md type pass the type tests
    keep_unsized = true                     # entries without rs:md length pass the size tests

    [[sources]]
    name = "museum"
    url = "https://museum.example.org/.well-known/resourcesync"
    plugins.resourcefilter = { types = ["image/*"] }

A source whose effective settings name no test (none of ``types``, ``exclude_types``, ``include``,
``exclude``, ``min_length``, ``max_length``) is not filtered: the plugin has no say (None). A source's
``plugins.resourcefilter = { enabled = false }`` turns it off for that source only. Media types are
compared without parameters (``text/plain; charset=utf-8`` is ``text/plain``).
"""

from __future__ import annotations

import fnmatch
import functools
import json
import re
from dataclasses import dataclass
from typing import Any

from aggregator.plugin_api import hookimpl

NAME = "resourcefilter"
#: Settings that make the plugin filter a source (the others only tune these).
TESTS = frozenset({"types", "exclude_types", "include", "exclude", "min_length", "max_length"})
SETTINGS = TESTS | {"keep_untyped", "keep_unsized", "enabled"}


@dataclass(frozen=True)
class Rules:
    types: tuple[str, ...] = ()
    exclude_types: tuple[str, ...] = ()
    include: tuple[re.Pattern[str], ...] = ()
    exclude: tuple[re.Pattern[str], ...] = ()
    min_length: int | None = None
    max_length: int | None = None
    keep_untyped: bool = True
    keep_unsized: bool = True

    def keep(self, loc: str, media_type: str | None, length: int | None) -> bool:
        """Whether an entry with this ``loc``, rs:md ``type`` and ``length`` is harvested."""
        if self.include and not any(p.search(loc) for p in self.include):
            return False
        if any(p.search(loc) for p in self.exclude):
            return False
        if self.types or self.exclude_types:
            mt = media_type.split(";", 1)[0].strip().lower() if media_type else ""
            if not mt:
                if not self.keep_untyped:
                    return False
            elif (self.types and not _matches(mt, self.types)) or _matches(mt, self.exclude_types):
                return False
        if self.min_length is not None or self.max_length is not None:
            if length is None:
                return self.keep_unsized
            if self.min_length is not None and length < self.min_length:
                return False
            if self.max_length is not None and length > self.max_length:
                return False
        return True


def _matches(media_type: str, globs: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(media_type, g) for g in globs)


def _strings(settings: dict[str, Any], key: str) -> tuple[str, ...]:
    value = settings.get(key, ())
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{NAME}: {key} must be a list of strings, not {value!r}")
    return tuple(value)


def _length(settings: dict[str, Any], key: str) -> int | None:
    value = settings.get(key)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise ValueError(f"{NAME}: {key} must be a non-negative integer, not {value!r}")
    return value


def _flag(settings: dict[str, Any], key: str) -> bool:
    value = settings.get(key, True)
    if not isinstance(value, bool):
        raise ValueError(f"{NAME}: {key} must be true or false, not {value!r}")
    return value


def _regexes(settings: dict[str, Any], key: str) -> tuple[re.Pattern[str], ...]:
    out = []
    for pattern in _strings(settings, key):
        try:
            out.append(re.compile(pattern))
        except re.error as exc:
            raise ValueError(f"{NAME}: {key}: bad regular expression {pattern!r}: {exc}") from None
    return tuple(out)


def rules_from(settings: dict[str, Any]) -> Rules | None:
    """The rules a settings table describes; None when it names no test (or ``enabled = false``).

    Raises ValueError naming the setting for unknown keys and wrong values (a typo must not silently
    harvest everything).
    """
    unknown = sorted(set(settings) - SETTINGS)
    if unknown:
        raise ValueError(
            f"{NAME}: unknown setting(s) {', '.join(unknown)} (known: {', '.join(sorted(SETTINGS))})"
        )
    if settings.get("enabled") is False or not TESTS & set(settings):
        return None
    return Rules(
        types=tuple(t.lower() for t in _strings(settings, "types")),
        exclude_types=tuple(t.lower() for t in _strings(settings, "exclude_types")),
        include=_regexes(settings, "include"),
        exclude=_regexes(settings, "exclude"),
        min_length=_length(settings, "min_length"),
        max_length=_length(settings, "max_length"),
        keep_untyped=_flag(settings, "keep_untyped"),
        keep_unsized=_flag(settings, "keep_unsized"),
    )


@functools.lru_cache(maxsize=256)
def _cached_rules(frozen: str) -> Rules | None:
    return rules_from(json.loads(frozen))


def rules_for(settings: dict[str, Any]) -> Rules | None:
    """``rules_from``, built once per distinct settings table (the filter runs for every entry)."""
    return _cached_rules(json.dumps(settings, sort_keys=True, default=str))


@hookimpl
def rsagg_filter_harvest(plugin, source, entry, metadata):
    rules = rules_for(plugin.settings(NAME, source))
    if rules is None:
        return None
    md = entry.md
    return rules.keep(entry.loc, md.type if md else None, md.length if md else None)


@hookimpl
def rsagg_startup(plugin, config):
    """Check every source's settings once at start, so a mistake is reported before the first harvest."""
    rules_for(plugin.settings(NAME))
    for src in config.sources:
        rules_for(plugin.settings(NAME, src.name))
