"""The documentation: every configuration key documented, no dangling relative link, a strict site build.

The configuration reference is generated from ``aggregator/config.py`` by ``docs/hooks/config_reference.py``
(a mkdocs hook); these tests hold the model to it: a key without a meaning fails here and in the build.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import subprocess
import sys
import typing
from pathlib import Path
from types import ModuleType

import pytest
from markdown.extensions.toc import slugify

from aggregator.config import Config

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # inspect.getsource finds a module's classes through sys.modules
    spec.loader.exec_module(module)
    return module


ref = _load(DOCS / "hooks" / "config_reference.py", "rsagg_docs_config_reference")


# --- the configuration reference ---------------------------------------------------------------------


def _model_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every key path of the model, walked independently of the generator (pydantic's own field table)."""
    out: list[str] = []
    hints = typing.get_type_hints(cls)
    for name in (f.name for f in dataclasses.fields(cls)):  # type: ignore[arg-type]
        if cls is Config and name == "file":
            continue
        hint = hints[name]
        args = typing.get_args(hint)
        if dataclasses.is_dataclass(hint):
            out += _model_keys(hint, f"{name}.")
        elif typing.get_origin(hint) is tuple and args and dataclasses.is_dataclass(args[0]):
            out += _model_keys(args[0], f"{name}[].")
        else:
            out.append(prefix + name)
    return out


def test_every_configuration_key_has_a_meaning():
    missing = ref.undocumented()
    assert not missing, f"add a #: comment above these fields in aggregator/config.py: {missing}"


def test_the_reference_lists_every_key_with_type_and_default():
    keys = {k.key: k for k in ref.keys()}
    assert sorted(keys) == sorted(_model_keys())
    page = ref.markdown()
    for path, k in keys.items():
        assert k.type and k.default, path
        array, _, name = path.partition("[].")
        shown = (
            f"`[[{array}]]` `{name}`" if name else "`[plugins.NAME]`" if path == "plugins" else f"`{path}`"
        )
        assert f"| {shown} |" in page, path
    assert "| `notifications.notified_interval` | number (> 0) | `3600` |" in page


def test_every_auth_key_is_documented():
    """``[sources.auth]`` is a table checked by hand (``AUTH_KEYS``), not a dataclass: its keys are shown
    on the configuration page by hand, and this holds the page to the set."""
    from aggregator.config import AUTH_KEYS

    page = (DOCS / "configuration.md").read_text(encoding="utf-8")
    assert [k for k in sorted(AUTH_KEYS) if k not in page] == []


def test_the_reference_reads_every_form_of_meaning(tmp_path: Path):
    """A model written in each form the generator accepts, and one field with none: the generator finds
    the three meanings and names the one key without, so an undocumented new key cannot slip through."""
    source = tmp_path / "rsagg_docs_model_sample.py"
    source.write_text(
        "from pydantic import Field\n"
        "from pydantic.dataclasses import dataclass\n\n\n"
        "@dataclass\n"
        "class Sample:\n"
        "    #: Seconds between two things,\n"
        "    #: on two lines.\n"
        "    above: float = 1.0\n"
        "    trailing: int = 2  # how many, trailing\n"
        '    described: str = Field(default="x", description="from Field")\n'
        "    # a plain comment above is not a meaning\n"
        "    bare: bool = True\n"
        "    #: a block that belongs to the next field, not to ``bare``\n"
        "    last: int = 0  # fmt: skip\n"
    )
    module = _load(source, "rsagg_docs_model_sample")
    keys = {k.key: k for k in ref._walk(module.Sample, "[sample]", "sample.")}
    assert keys["sample.above"].meaning == "Seconds between two things, on two lines."
    assert keys["sample.trailing"].meaning == "how many, trailing"
    assert keys["sample.described"].meaning == "from Field"
    assert keys["sample.bare"].meaning == ""
    assert keys["sample.last"].meaning == "a block that belongs to the next field, not to ``bare``"
    assert keys["sample.above"].type == "number" and keys["sample.above"].default == "`1`"
    assert keys["sample.described"].default == '`"x"`'


def test_the_build_hook_refuses_an_undocumented_key(monkeypatch):
    from mkdocs.exceptions import PluginError

    monkeypatch.setattr(ref, "undocumented", lambda: ["server.new_key"])
    with pytest.raises(PluginError, match=r"server\.new_key"):
        ref.on_page_markdown(f"# Configuration\n\n{ref.MARKER}\n", page=None, config=None, files=None)
    assert ref.on_page_markdown("no marker here", page=None, config=None, files=None) == "no marker here"


# --- links ---------------------------------------------------------------------------------------------

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def _anchors(page: Path) -> set[str]:
    text = _FENCE.sub("", page.read_text(encoding="utf-8"))
    return {slugify(h.replace("`", ""), "-") for h in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, re.M)}


def _relative_links(page: Path) -> list[str]:
    text = _CODE.sub("", _FENCE.sub("", page.read_text(encoding="utf-8")))
    return [t for t in _LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page: Path):
    """Each relative link names an existing file (and, into a Markdown page, an existing heading)."""
    problems = []
    for target in _relative_links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            problems.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            problems.append(f"{target}: no heading #{anchor} in {file.name}")
    assert not problems, problems


def test_link_checker_sees_a_dangling_link(tmp_path: Path):
    page = tmp_path / "p.md"
    page.write_text("# Title\n\n[a](missing.md) [b](#title) [c](https://x.org/y.md) `[d](e.md)`\n")
    assert _relative_links(page) == ["missing.md", "#title"]
    assert _anchors(page) == {"title"}


# --- the site ------------------------------------------------------------------------------------------


def test_mkdocs_build_strict(tmp_path: Path):
    """The site builds with no warning: no dangling link or anchor, no page left out of the nav."""
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WARNING" not in done.stderr, done.stderr
    page = (tmp_path / "site" / "configuration.html").read_text(encoding="utf-8")
    assert "notifications.notified_interval" in page and ref.MARKER not in page
