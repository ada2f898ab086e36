"""The entry-point reader (aggregator/plugins/entrypoints.py) gives importlib.metadata's answer: on every
group installed here, and on made-up layouts (a name twice on sys.path, egg-info, comments, odd lines, a
zip on the path)."""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
import zipfile
from pathlib import Path

import pytest

from aggregator.plugins import entrypoints
from aggregator.plugins.entrypoints import entry_points


def _theirs(group: str) -> list[tuple[str, str, str, str, str]]:
    importlib.invalidate_caches()
    return [
        (ep.name, ep.value, ep.group, ep.dist.name, ep.dist.version)  # type: ignore[union-attr]
        for ep in importlib.metadata.entry_points(group=group)
    ]


def _ours(group: str) -> list[tuple[str, str, str, str, str]]:
    return [(ep.name, ep.value, ep.group, ep.distribution, ep.version) for ep in entry_points(group)]


def _read_alone(group: str) -> list[tuple[str, str, str, str, str]]:
    """Our reading, failing rather than handing over to importlib.metadata."""
    return [(ep.name, ep.value, ep.group, ep.distribution, ep.version) for ep in entrypoints._read(group)]


def test_every_installed_group_reads_as_importlib_metadata_reads_it() -> None:
    groups = {ep.group for dist in importlib.metadata.distributions() for ep in dist.entry_points}
    assert {"rsagg", "console_scripts"} <= groups
    for group in sorted(groups):
        assert _read_alone(group) == _theirs(group), group


def test_the_shipped_plugins_load_from_it() -> None:
    eps = {ep.name: ep for ep in entry_points("rsagg")}
    assert eps["example"].load() is importlib.import_module("rsagg_example_plugin")
    assert eps["example"].distribution == "rsagg-example-plugin"


def _dist(site: Path, folder: str, name: str, version: str, eps: str | None, *, egg: bool = False) -> None:
    d = site / folder
    d.mkdir(parents=True)
    (d / ("PKG-INFO" if egg else "METADATA")).write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nSummary: x\n\nVersion: 9.9 (the body)\n"
    )
    if eps is not None:
        (d / "entry_points.txt").write_text(eps)


LAYOUT = {
    "first": [
        ("alpha-1.0.dist-info", "alpha", "1.0", "[g]\na = alpha.mod:obj.attr\nb=alpha\n[other]\nc = x\n"),
        ("Beta_Pkg-2.0.dist-info", "Beta.Pkg", "2.0", "# comment\n\n  [g]  \n  d = beta : f [extra]\n"),
        ("gamma.egg-info", "gamma", "0.1.dev0", "[g]\ne = gamma\n"),
        ("nothing-1.0.dist-info", "nothing", "1.0", None),
        ("top-1.0.dist-info", "top", "1.0", "; not a comment for them = value\n[g]\nf = top\n"),
    ],
    "second": [
        ("alpha-0.5.dist-info", "alpha", "0.5", "[g]\nshadowed = alpha.old\n"),  # alpha is found first above
        ("beta.pkg-1.0.dist-info", "beta-pkg", "1.0", "[g]\nshadowed2 = beta\n"),  # the same normalized name
        ("delta-3.dist-info", "delta", "3", "[g]\na = delta\n"),  # the same entry-point name, another dist
    ],
}


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    folders = []
    for label, dists in LAYOUT.items():
        folder = tmp_path / label
        for name, dist, version, eps in dists:
            _dist(folder, name, dist, version, eps, egg=name.endswith(".egg-info"))
        folders.append(folder)
    monkeypatch.setattr(sys, "path", [str(f) for f in folders] + [str(tmp_path / "missing")])
    return folders


@pytest.mark.parametrize("group", ["g", "other", "none"])
def test_a_made_up_layout_reads_the_same(site: list[Path], group: str) -> None:
    assert _read_alone(group) == _theirs(group)


def test_the_first_distribution_of_a_name_wins(site: list[Path]) -> None:
    names = [(name, dist) for name, _, _, dist, _ in _read_alone("g")]
    assert ("shadowed", "alpha") not in names and ("a", "delta") in names and ("a", "alpha") in names


def test_what_it_cannot_read_is_read_by_importlib_metadata(
    site: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    archive = tmp_path / "dists.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("zipped-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: zipped\nVersion: 1.0\n")
        z.writestr("zipped-1.0.dist-info/entry_points.txt", "[g]\nz = zipped\n")
    monkeypatch.setattr(sys, "path", [*sys.path, str(archive)])
    with pytest.raises(entrypoints._Unusual):
        entrypoints._read("g")
    assert ("z", "zipped", "g", "zipped", "1.0") in _ours("g")
    assert _ours("g") == _theirs("g")
    (site[0] / "top-1.0.dist-info" / "entry_points.txt").write_text("[g]\nno equals sign\n")
    monkeypatch.setattr(sys, "path", [str(site[0])])
    with pytest.raises(entrypoints._Unusual):
        entrypoints._read("g")


def test_a_value_loads_module_and_attributes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "ep_probe_mod.py").write_text("class A:\n    class B:\n        x = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ep = entrypoints.EntryPoint("n", "ep_probe_mod:A.B [extra]", "g", "d", "1")
    assert ep.load().x == 1
    assert entrypoints.EntryPoint("n", "ep_probe_mod", "g", "d", "1").load().__name__ == "ep_probe_mod"
