"""The snapshot of a checked configuration (aggregator/config_cache.py): never stale, never a secret, never
trusted from a file someone else could have written, and read without pydantic."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from aggregator.config import Config, ConfigError, load_config
from aggregator.config_cache import CACHE_ENV, cache_folder, decode, encode, load_config_cached

EXAMPLE = Path(__file__).resolve().parent.parent / "config" / "example.toml"

#: A configuration touching every kind of value the snapshot holds: sections, arrays of tables, tuples
#: (addresses, allow, sets.sources), tables of any TOML value (plugin settings), None, floats from ints.
RICH = """
[server]
base_url = "http://127.0.0.1:8080/"
workers = 2

[store]
path = "data"
settings = { inline_bytes = 512, nested = { list = [1, 2.5, "x", [true]] } }

[harvest]
interval = 60
jitter = 0.25

[outbound]
allow = ["10.1.0.0/16", " fd00:1::/64"]

[[sources]]
name = "museum"
url = "http://127.0.0.1:8000/.well-known/resourcesync"
addresses = ["10.0.0.5/32"]
plugins = { linkpolicy = { keep = ["a", "b"] } }
note = "a note"

[[sources]]
name = "library"
kind = "oai-pmh"
url = "https://example.org/oai"
interval = 5
set = "books"

[[sets]]
name = "all"
sources = ["museum", "library"]

[plugins.jsonpatch]
enabled = true
depth = 3
"""


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(folder))
    return folder / "config"


def _outcome(load: object, path: Path) -> str:
    """What loading gives, as text: the configuration's repr (tuples, floats and all) or the error."""
    try:
        return repr(load(path))  # type: ignore[operator]
    except ConfigError as exc:
        return f"ConfigError: {exc}"


def _snapshots(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.json")) if cache.is_dir() else []


def test_a_snapshot_gives_the_same_configuration(tmp_path: Path, cache: Path) -> None:
    path = tmp_path / "rsagg.toml"
    path.write_text(RICH)
    checked = load_config(path)
    assert repr(load_config_cached(path)) == repr(checked)  # a miss: checked, then written
    assert len(_snapshots(cache)) == 1
    again = load_config_cached(path)  # a hit
    assert repr(again) == repr(checked) and again == checked and hash(again.server) == hash(checked.server)
    assert isinstance(again.sources, tuple) and isinstance(again.sources[0].addresses, tuple)
    assert again.store.settings["nested"]["list"] == [1, 2.5, "x", [True]]
    assert again.store_path == tmp_path / "data"


def _edit(rng: random.Random, text: str) -> str:
    """One random edit: a character inserted, deleted or changed (digits often: the file stays valid), a
    line dropped, doubled or swapped with the next."""
    lines = text.split("\n")
    kind = rng.randrange(6)
    if kind == 0 and len(lines) > 1:  # a line swapped with the next
        i = rng.randrange(len(lines) - 1)
        lines[i], lines[i + 1] = lines[i + 1], lines[i]
        return "\n".join(lines)
    if kind == 1:
        i = rng.randrange(len(lines))
        lines.insert(i, lines[i]) if rng.random() < 0.5 else lines.pop(i)
        return "\n".join(lines)
    i = rng.randrange(len(text) + 1)
    if kind == 2:  # a digit where there is one: a number changes and the file usually stays valid
        digits = [j for j, c in enumerate(text) if c.isdigit()]
        if digits:
            j = rng.choice(digits)
            return text[:j] + rng.choice("0123456789") + text[j + 1 :]
    if kind == 3:
        return text[:i] + rng.choice('abz019 ."=[]_-/\n#') + text[i:]
    if kind == 4:
        return text[:i] + text[i + 1 :]
    return text[:i] + rng.choice("aeiou0123 /") + text[i + 1 :]


@pytest.mark.parametrize("seed", range(4))
def test_random_edits_never_give_a_stale_configuration(tmp_path: Path, cache: Path, seed: int) -> None:
    """The property: after any sequence of edits to the file (going back to earlier versions too, with
    its modification time and size kept), what the cached load gives is what a full check gives, the
    configuration or the same error."""
    rng = random.Random(seed)
    path = tmp_path / "rsagg.toml"
    good = [RICH, EXAMPLE.read_text()]  # versions that load: edits start from one of them
    seen = list(good)
    hits = valid = 0
    for _ in range(150):
        if rng.random() < 0.2:
            text = rng.choice(seen)  # back to an earlier version: its snapshot was overwritten since
        else:
            text = rng.choice(good)
            for _ in range(rng.randint(1, 2)):
                text = _edit(rng, text)
            seen.append(text)
        stat = path.stat() if path.exists() else None
        path.write_text(text)
        if stat is not None and rng.random() < 0.5:
            os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the same time: only the bytes tell
        before = [p.read_bytes() for p in _snapshots(cache)]
        cached = _outcome(load_config_cached, path)
        assert cached == _outcome(load_config, path)
        if not cached.startswith("ConfigError"):
            valid += 1
            good.append(text)
        hits += before == [p.read_bytes() for p in _snapshots(cache)] and bool(before)
        assert _outcome(load_config_cached, path) == cached  # and again, from the snapshot if valid
    assert valid > 20 and hits > 5  # the walk did go through valid files and hits, not only errors


def test_the_path_it_was_named_by_is_part_of_the_key(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Config.file`` and the relative store path come from the name given: the same bytes named another
    way are checked again."""
    (tmp_path / "rsagg.toml").write_text(RICH)
    monkeypatch.chdir(tmp_path)
    absolute = load_config_cached(tmp_path / "rsagg.toml")
    relative = load_config_cached("rsagg.toml")
    assert absolute.file == str(tmp_path / "rsagg.toml") and relative.file == "rsagg.toml"
    assert repr(relative) == repr(load_config("rsagg.toml"))


BROKEN = [
    ("[server]\nworkers = 0\n", "server.workers: must be at least 1"),
    ("[[sources]]\nname = 'a'\nurl = 'ftp://x/'\n", "sources[0].url: not an http(s) URL"),
    ("[server\n", "not valid TOML"),
    ("[nope]\n", "nope: unknown section"),
]


@pytest.mark.parametrize(("text", "says"), BROKEN, ids=[b[1] for b in BROKEN])
def test_a_broken_file_gives_the_same_error_and_no_snapshot(
    tmp_path: Path, cache: Path, text: str, says: str
) -> None:
    path = tmp_path / "rsagg.toml"
    path.write_text(RICH)
    load_config_cached(path)
    written = [p.read_bytes() for p in _snapshots(cache)]
    path.write_text(text)
    with pytest.raises(ConfigError) as cached:
        load_config_cached(path)
    with pytest.raises(ConfigError) as checked:
        load_config(path)
    assert str(cached.value) == str(checked.value) and says in str(cached.value)
    assert [p.read_bytes() for p in _snapshots(cache)] == written  # the good one's snapshot stays as is


SECRETS = {
    "store.settings": ('[store.settings]\nsecret_access_key = "AKIAsecretvalue"\n', ""),
    "plugin": ('[plugins.s3sink]\napi_key = "sk-0123456789"\n', ""),
    "state URL": ('[store]\nstate = "postgresql://rsagg:hunter22@db:5432/rsagg"\n', ""),
    "source plugin": ("", 'plugins = { sink = { nested = { password = "hunter22x" } } }\n'),
    "URL in a table": ('[store.settings]\nendpoint = "https://u:hunter22@s3.example/"\n', ""),
    "URL in a list": ("", 'plugins = { sink = { mirrors = ["http://a/", "http://u:p@b/"] } }\n'),
}


@pytest.mark.parametrize(("top", "in_source"), SECRETS.values(), ids=SECRETS)
def test_a_configuration_holding_a_secret_is_not_written(
    tmp_path: Path, cache: Path, top: str, in_source: str
) -> None:
    path = tmp_path / "rsagg.toml"
    path.write_text(top + '[[sources]]\nname = "a"\nurl = "http://x/"\n' + in_source)
    assert repr(load_config_cached(path)) == repr(load_config(path))
    assert _snapshots(cache) == []
    path.write_text('[[sources]]\nname = "a"\nurl = "http://x/"\n')  # the same file without it is
    load_config_cached(path)
    assert len(_snapshots(cache)) == 1


def test_snapshots_are_private_and_others_are_not_trusted(tmp_path: Path, cache: Path) -> None:
    path = tmp_path / "rsagg.toml"
    path.write_text(RICH)
    load_config_cached(path)
    (snap,) = _snapshots(cache)
    assert snap.stat().st_mode & 0o777 == 0o600 and cache.stat().st_mode & 0o777 == 0o700
    # A snapshot that says something else under the right key: read when private, refused when another
    # may have written it (group or world bits).
    data = json.loads(snap.read_text())
    data["config"]["f"]["server"]["f"]["workers"] = 7
    snap.write_text(json.dumps(data))
    assert load_config_cached(path).server.workers == 7  # proves the file is what a hit reads ...
    snap.chmod(0o644)
    assert load_config_cached(path).server.workers == 2  # ... and that a readable one is not trusted
    assert snap.stat().st_mode & 0o777 == 0o600  # (and was written again)
    cache.chmod(0o755)
    data = json.loads(snap.read_text())
    data["config"]["f"]["server"]["f"]["workers"] = 7
    snap.write_text(json.dumps(data))
    assert load_config_cached(path).server.workers == 2  # a folder others may read: not trusted either


@pytest.mark.parametrize(
    "damage",
    ["", "{", '{"key": 1}', "[]", '{"key": "K", "config": {"c": "Evil", "f": {}}}', "\xff\xfe"],
)
def test_a_damaged_snapshot_is_a_miss(tmp_path: Path, cache: Path, damage: str) -> None:
    path = tmp_path / "rsagg.toml"
    path.write_text(RICH)
    load_config_cached(path)
    (snap,) = _snapshots(cache)
    key = json.loads(snap.read_text())["key"]
    snap.write_text(damage.replace('"K"', json.dumps(key)), encoding="latin-1")
    assert repr(load_config_cached(path)) == repr(load_config(path))
    assert json.loads(snap.read_text())["key"] == key  # written again


def test_no_snapshot_when_turned_off_or_unwritable(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "rsagg.toml"
    path.write_text(RICH)
    monkeypatch.setenv(CACHE_ENV, "")
    assert cache_folder() is None
    assert repr(load_config_cached(path)) == repr(load_config(path))
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocker))  # a folder that cannot be made
    assert repr(load_config_cached(path)) == repr(load_config(path))


def test_the_cache_folder_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_folder() == tmp_path / "rsagg" / "config"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")  # the XDG rule: a relative path is ignored
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_folder() == tmp_path / "home" / ".cache" / "rsagg" / "config"


def test_values_the_form_has_no_tag_for_are_not_written(tmp_path: Path, cache: Path) -> None:
    """A TOML date in a plugin table: the configuration loads, unsnapshotted."""
    path = tmp_path / "rsagg.toml"
    path.write_text('[store.settings]\nsince = 2024-01-01\n[[sources]]\nname = "a"\nurl = "http://x/"\n')
    assert repr(load_config_cached(path)) == repr(load_config(path))
    assert _snapshots(cache) == []


def test_the_form_round_trips_and_rebuilds_only_the_models() -> None:
    config = Config()
    assert repr(decode(json.loads(json.dumps(encode(config))))) == repr(config)
    with pytest.raises(KeyError):
        decode({"c": "Path", "f": {}})


def test_a_hit_does_not_import_pydantic(tmp_path: Path, cache: Path) -> None:
    path = tmp_path / "rsagg.toml"
    path.write_text(RICH)
    probe = (
        "import sys; from aggregator.config_cache import load_config_cached as load; "
        f"c = load({str(path)!r}); print(c.sources[0].name, 'pydantic' in sys.modules)"
    )
    env = {**os.environ, CACHE_ENV: str(cache.parent)}
    runs = [
        subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
        for _ in range(2)
    ]
    assert [r.stdout.split() for r in runs] == [["museum", "True"], ["museum", "False"]], runs[0].stderr


#: Values tried in every key of the model: most are refused, those taken make configurations of every shape.
POOL = [0, -1, 2, 1.5, 0.0, 1e9, "5", "", "x", "FULL", True, False, [], ["a"], [1], {},
        {"a": [1, {"b": 2.5}]}, "http://x/", "10.0.0.0/8", "127.0.0.1:80", "30d", "all", "/hub", "/a/",
        "oai-pmh", "é✓"]  # fmt: skip


def _keys(cls: type, prefix: tuple[str, ...]) -> list[tuple[str, ...]]:
    import dataclasses
    import typing

    out: list[tuple[str, ...]] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint, args = hints[f.name], typing.get_args(hints[f.name])
        if dataclasses.is_dataclass(hint):
            out += _keys(hint, (*prefix, f.name))  # type: ignore[arg-type]
        elif typing.get_origin(hint) is tuple and args and dataclasses.is_dataclass(args[0]):
            out += _keys(args[0], (*prefix, f.name))
        elif (cls, f.name) != (Config, "file"):
            out.append((*prefix, f.name))
    return out


def test_every_configuration_the_model_takes_comes_back_whole_from_its_snapshot() -> None:
    """Generated: each key of the model set to each value of POOL (in [[sources]] and [[sets]] too); every
    configuration that passes the check comes back from the snapshot's form equal, repr for repr."""
    from aggregator.config import parse_config

    taken = 0
    for key in _keys(Config, ()):
        for value in POOL:
            data: dict = {
                "sources": [{"name": "a", "url": "http://x/"}],
                "sets": [{"name": "s", "sources": ["a"]}],
            }
            table = data
            for part in key[:-1]:
                table = table[part][0] if part in ("sources", "sets") else table.setdefault(part, {})
            table[key[-1]] = value
            try:
                config = parse_config(data, "t.toml")
            except ConfigError:
                continue
            taken += 1
            assert repr(decode(json.loads(json.dumps(encode(config))))) == repr(config), (key, value)
    assert taken > 150  # (197 today: the pool does reach every kind of key)
