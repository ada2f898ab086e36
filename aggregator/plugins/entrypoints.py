"""The entry points of one group, read from the installed distributions without importing
``importlib.metadata``.

Every command that loads the plugins (``status``, ``retries``, ``harvest``, ``run``, ``plugins``) looks
up the ``rsagg`` group. ``importlib.metadata`` costs more to import (it brings email, zipfile, csv, socket,
tempfile: about 10 ms of a one-shot command's start-up, benchmarks/bench_startup.py) than the lookup
itself. This reads the same files the same way for the common layout: the folders of ``sys.path``, each
distribution's ``*.dist-info`` or ``*.egg-info`` folder, the first of a name on ``sys.path`` winning, its
``entry_points.txt`` in order, its version from the ``Version:`` header of ``METADATA`` (``PKG-INFO``).
Anything else (a zip or egg on ``sys.path``, an import finder that lists distributions of its own, a line
it cannot read) is handed to ``importlib.metadata`` itself, so the answer is always its answer
(tests/test_entrypoints.py compares the two on every group installed).
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from dataclasses import dataclass
from typing import Any

_SEPARATORS = re.compile(r"[-_.]+")
#: importlib.metadata's pattern of an entry point's value: ``module[:attr]`` and optional ``[extras]``.
_VALUE = re.compile(r"(?P<module>[\w.]+)\s*(:\s*(?P<attr>[\w.]+)\s*)?((?P<extras>\[.*\])\s*)?$")


class _Unusual(Exception):
    """A layout this reader leaves to importlib.metadata."""


@dataclass(frozen=True)
class EntryPoint:
    """What the plugin manager uses of an entry point: ``name``, ``value``, ``load()`` and the name and
    version of the distribution that declares it."""

    name: str
    value: str
    group: str
    distribution: str
    version: str

    def load(self) -> Any:
        """The object named by ``value``: its module imported, then its attributes followed."""
        match = _VALUE.match(self.value)
        if match is None:
            raise ValueError(f"not an entry point value: {self.value!r}")
        obj = importlib.import_module(match["module"])
        for attr in filter(None, (match["attr"] or "").split(".")):
            obj = getattr(obj, attr)
        return obj


def entry_points(group: str) -> list[EntryPoint]:
    """The entry points of ``group``, in importlib.metadata's order."""
    try:
        return _read(group)
    except _Unusual:
        return _from_metadata(group)


def _from_metadata(group: str) -> list[EntryPoint]:
    from importlib.metadata import entry_points as found

    return [
        EntryPoint(ep.name, ep.value, ep.group, *((ep.dist.name, ep.dist.version) if ep.dist else ("", "")))
        for ep in found(group=group)
    ]


def _normalized(name: str) -> str:
    return _SEPARATORS.sub("-", name).lower().replace("-", "_")


def _read(group: str) -> list[EntryPoint]:
    from importlib.machinery import PathFinder

    if any(hasattr(f, "find_distributions") and f is not PathFinder for f in sys.meta_path):
        raise _Unusual("a finder of distributions besides the path's")
    seen: set[str] = set()
    out: list[EntryPoint] = []
    for entry in sys.path:
        folder = entry or "."
        if folder.lower().endswith(".egg"):
            raise _Unusual(folder)
        try:
            children = os.listdir(folder)
        except NotADirectoryError:
            raise _Unusual(folder) from None  # a zip on sys.path
        except OSError:
            continue
        for child in children:
            stem, dot, ext = child.rpartition(".")
            if not dot or ext.lower() not in ("dist-info", "egg-info"):
                continue
            name = _normalized(stem.lower().partition("-")[0])
            if name in seen:
                continue
            seen.add(name)
            path = os.path.join(folder, child)
            text = _text(path, "entry_points.txt")
            if text:
                out += _parse(text, group, path, ext.lower())
    return out


def _text(path: str, name: str) -> str | None:
    try:
        with open(os.path.join(path, name), encoding="utf-8") as f:
            return f.read()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError):
        return None


def _parse(text: str, group: str, path: str, ext: str) -> list[EntryPoint]:
    """The ``group`` section's ``name = value`` lines (importlib.metadata's reading: stripped lines,
    ``#`` comments and blank lines skipped)."""
    out: list[EntryPoint] = []
    section = None
    for line in map(str.strip, text.splitlines()):
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line.strip("[]")
            continue
        if section is None:
            continue
        name, eq, value = line.partition("=")
        if not eq:
            raise _Unusual(f"{path}: {line!r}")
        if section == group:
            out.append(EntryPoint(name.strip(), value.strip(), group, *_name_version(path, ext)))
    return out


def _name_version(path: str, ext: str) -> tuple[str, str]:
    """The ``Name`` and ``Version`` headers of the distribution's metadata."""
    text = _text(path, "METADATA" if ext == "dist-info" else "PKG-INFO")
    if text is None:
        raise _Unusual(f"{path}: no metadata")
    headers: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break  # the end of the headers
        key, colon, value = line.partition(":")
        if colon and not key[:1].isspace():
            headers.setdefault(key.strip().lower(), value.strip())
    if "name" not in headers or "version" not in headers:
        raise _Unusual(f"{path}: no name or version")
    return headers["name"], headers["version"]
