"""A snapshot of the last configuration checked, so that a command started again on the same file builds
it without pydantic (importing pydantic and building its validators is about a third of the start-up of
``rsagg status``; benchmarks/bench_startup.py).

The snapshot is the checked ``Config`` written as tagged JSON, under a key that is a SHA-256 of all that
the check depends on: the config file's bytes, the path it was named by (``Config.file``: relative store
paths are taken from it), the sources of ``config.py`` (the models and their rules: a new rsagg that
changes them changes it) and of this module (the format), the Python version and the installed pydantic
and pydantic-core files. The configuration reads no other file and no environment variable, so nothing
else can change what a check of the same bytes gives; any other byte misses, and a miss is checked in
full (errors come from there, as without the cache; a configuration that fails is never written).

Where: ``$RSAGG_CACHE_DIR`` (empty: no snapshot), else ``$XDG_CACHE_HOME/rsagg``, else ``~/.cache/rsagg``;
in its ``config/`` folder, made 0700, one file per config path (its latest), written 0600 through a
rename. A snapshot is read only from a folder and a file the user owns that no one else may write or
read; anything else, an unreadable or malformed file, or a folder that cannot be written, is a miss.

Secrets: a configuration may hold some inline (secret-looking keys of ``[store.settings]``, of plugin
tables and of sources' plugin tables, as ``redact`` recognises them; a URL with a password there or in
``store.state``). Such a configuration is not
written at all: its secrets stay in the config file alone, protected as the operator protects it, and
no copy outlives a rotation. (Credentials named by ``*_file``/``*_env`` keys are references, read when a
harvest starts, not values of the configuration.)
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .config import MODELS, Config, _trusted, parse_toml, read_config_file

#: The environment variable naming the cache folder (set empty to turn snapshots off).
CACHE_ENV = "RSAGG_CACHE_DIR"
_FORMAT = b"rsagg-config-snapshot-1"


def cache_folder() -> Path | None:
    """The folder of the snapshots, or None when they are off."""
    base = os.environ.get(CACHE_ENV)
    if base is None:
        xdg = os.environ.get("XDG_CACHE_HOME", "")
        base = os.path.join(xdg if os.path.isabs(xdg) else os.path.expanduser("~/.cache"), "rsagg")
    return Path(base, "config") if base else None


def _schema() -> bytes:
    """What the check of the same bytes depends on besides them: the models and their rules (the source of
    config.py: an rsagg that changes them changes it), this format, the versions of Python and pydantic."""
    from importlib.util import find_spec

    parts = [_FORMAT, sys.version.encode()]
    for module in (sys.modules[Config.__module__], sys.modules[__name__]):
        parts.append(Path(str(module.__file__)).read_bytes())
    for name in ("pydantic", "pydantic_core"):  # an upgrade rewrites their files
        spec = find_spec(name)
        origin = spec.origin if spec is not None else None
        st = os.stat(origin) if origin else None
        parts.append(f"{origin}:{st.st_size}:{st.st_mtime_ns}".encode() if st else b"-")
    return hashlib.sha256(b"\0".join(hashlib.sha256(p).digest() for p in parts)).digest()


def snapshot_key(raw: bytes, file: str) -> str:
    """The key of a configuration read from ``file`` (as named) holding ``raw``."""
    digest = hashlib.sha256()
    for part in (_schema(), file.encode("utf-8", "surrogateescape"), raw):
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.hexdigest()


def load_config_cached(path: str | Path) -> Config:
    """``config.load_config``, from the snapshot when the same file was checked before."""
    file = str(path)
    raw = read_config_file(path)
    folder = cache_folder()
    if folder is None:
        return parse_toml(raw, file)
    try:
        key = snapshot_key(raw, file)
    except OSError:  # a source file gone: no key to trust
        return parse_toml(raw, file)
    name = hashlib.sha256(os.path.abspath(file).encode("utf-8", "surrogateescape")).hexdigest()[:32]
    where = folder / f"{name}.json"
    hit = _read(where, key)
    if hit is not None:
        return hit
    config = parse_toml(raw, file)  # a ConfigError leaves the snapshot as it was
    if not holds_secrets(config):
        _write(where, key, config)
    return config


def holds_secrets(config: Config) -> bool:
    """Whether the configuration holds a secret itself (not only a reference to one): a secret-looking
    key in ``[store.settings]``, a plugin's table or a source's plugin table (``redact.secret_settings``),
    or a URL with a password anywhere in those tables or in ``store.state``."""
    from .redact import secret_settings

    tables: list[Any] = [config.store.settings, config.plugins, *(s.plugins for s in config.sources)]
    if any(secret_settings(t) for t in tables):
        return True
    return any(_password_in(v) for v in [config.store.state, *tables])


def _password_in(value: Any) -> bool:
    if isinstance(value, str):
        if "@" not in value or "://" not in value:
            return False
        try:
            return urlsplit(value.strip()).password is not None
        except ValueError:
            return True  # not a URL one can read: assume the worst
    if isinstance(value, dict):
        return any(_password_in(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_password_in(v) for v in value)
    return False


# --- the snapshot's form: JSON, every container tagged ---------------------------------------------------
# A list is a JSON array; a tuple {"t": [...]}; a table {"d": {...}}; a model {"c": NAME, "f": {...}}. Only
# the model classes of config.py are rebuilt; any other value (a TOML date in a plugin table) is not
# written.


class _Unsnapshottable(Exception):
    pass


#: The model classes' field names, in order: what ``encode`` writes of each (asked once per class, not
#: for each instance: a configuration of 300 Sources asked ``dataclasses.fields`` 300 times).
_FIELDS: dict[type, tuple[str, ...]] = {
    cls: tuple(f.name for f in fields(cls))
    for name, cls in MODELS.items()
    if is_dataclass(cls) and name == cls.__name__
}
#: The values JSON holds as they are (exact types: a subclass, e.g. an IntEnum, has no tag).
_PLAIN = frozenset({type(None), bool, int, float, str})


def encode(value: Any) -> Any:
    """``value`` as JSON data (raises _Unsnapshottable for what the form has no tag for)."""
    kind = type(value)
    if kind in _PLAIN:
        return value
    if kind is list:
        return [encode(v) for v in value]
    if kind is tuple:
        return {"t": [encode(v) for v in value]}
    if kind is dict and all(type(k) is str for k in value):
        return {"d": {k: encode(v) for k, v in value.items()}}
    names = _FIELDS.get(kind)
    if names is not None:
        got = {n: getattr(value, n) for n in names}  # a Source's 17 fields, most of them plain
        return {"c": kind.__name__, "f": {n: v if type(v) in _PLAIN else encode(v) for n, v in got.items()}}
    raise _Unsnapshottable(kind.__name__)


def decode(data: Any) -> Any:
    """The value ``encode`` wrote (KeyError, TypeError or ValueError when it is not in that form)."""
    with _trusted():  # checked when it was written: its models made as pydantic made them, unchecked
        return _decode(data)


def _decode(data: Any) -> Any:
    if isinstance(data, list):
        return [v if type(v) in _PLAIN else _decode(v) for v in data]
    if not isinstance(data, dict):
        return data
    if data.keys() == {"t"}:
        return tuple(v if type(v) in _PLAIN else _decode(v) for v in data["t"])
    if data.keys() == {"d"}:
        return {k: v if type(v) in _PLAIN else _decode(v) for k, v in data["d"].items()}
    if data.keys() == {"c", "f"}:
        cls = MODELS[data["c"]]
        return cls(**{k: v if type(v) in _PLAIN else _decode(v) for k, v in data["f"].items()})
    raise ValueError(f"not a tagged value: {sorted(data)}")


def _read(where: Path, key: str) -> Config | None:
    try:
        fd = os.open(where, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            if not _private(os.fstat(f.fileno())) or not _private(os.stat(where.parent)):
                return None
            text = f.read()
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("key") != key:
            return None
        config = decode(data["config"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return config if isinstance(config, Config) else None


def _private(st: os.stat_result) -> bool:
    """Owned by this user, and no one else may write it (nor read it: a snapshot is as private as a
    file of the user's own)."""
    return st.st_uid == os.getuid() and not st.st_mode & 0o077


def _write(where: Path, key: str, config: Config) -> None:
    """Write the snapshot through a rename; silently nothing when the folder cannot be written or the
    configuration does not come back whole from its form (compared by ``repr``: tuple or list, 1 or 1.0)."""
    try:
        encoded = encode(config)
        text = json.dumps({"key": key, "config": encoded}, ensure_ascii=False, allow_nan=False)
        if repr(decode(json.loads(text)["config"])) != repr(config):
            return
    except (_Unsnapshottable, ValueError, TypeError):
        return
    tmp = where.with_name(f".{where.name}.{os.getpid()}.tmp")
    try:
        where.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not _private(os.stat(where.parent)):
            return
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, where)
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass
