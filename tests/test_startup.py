"""Start-up stays light: building the command line imports no library a command does not use.

Every one-shot command (``rsagg --version``, ``--help``, ``COMMAND --help``, ``validate``) pays for what
``aggregator.cli`` and the command modules import at their top. The guard is structural (which modules
are in ``sys.modules`` in a fresh interpreter), not a timing: benchmarks/bench_startup.py has the times.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from aggregator.cli import COMMANDS

#: Libraries no command needs to build its parser or print its help. A prefix matches its submodules.
HEAVY = (
    "trio", "trio_parallel", "httpx", "httpcore", "h11", "h2", "starlette", "hypercorn", "boto3",
    "botocore", "lxml", "pydantic", "pydantic_core", "sqlite_utils", "prometheus_client", "pluggy",
    "psycopg", "psycopg_pool", "jinja2", "aggregator.config", "aggregator.store", "aggregator.harvest",
    "aggregator.publish", "aggregator.websub", "aggregator.run.daemon", "aggregator.run.compose",
    # the standard library's heavier parts that only a command's work needs (``demo``'s free port and
    # temporary store, the probe of the store folder by ``status`` and ``harvest``)
    "socket", "tempfile", "random",
)  # fmt: skip

_PROBE = """
import io, json, sys, contextlib
from aggregator import cli
argv = json.loads(sys.argv[1])
out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
    try:
        cli.main(argv) if argv else cli.build_parser()
    except SystemExit:
        pass
print(json.dumps(sorted(sys.modules)))
"""


def _loaded(argv: list[str]) -> list[str]:
    """The modules a fresh interpreter holds after running ``rsagg ARGV`` (or building the parser)."""
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(argv)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parent,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def _heavy(modules: list[str]) -> list[str]:
    return [m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY)]


# Every command's --help, the top-level help and version, and the bare parser: generated from COMMANDS,
# so a command added later is held to the same rule.
CASES = [[], ["--help"], ["--version"], *([name, "--help"] for name in COMMANDS)]


@pytest.mark.parametrize("argv", CASES, ids=lambda a: " ".join(a) or "parser")
def test_the_command_line_imports_nothing_heavy(argv: list[str]) -> None:
    """Only the standard library and rsagg's light modules are loaded to parse and print help.
    ``--version`` alone loads the document parser: it says whether the compiled fast path loads, which
    only importing it proves."""
    allowed = ("lxml",) if argv == ["--version"] else ()
    heavy = _heavy(_loaded(argv))
    assert [m for m in heavy if m.split(".")[0] not in allowed] == []


def test_the_probe_sees_heavy_imports() -> None:
    """The guard can fail: running ``validate`` on a document does load the parser (lxml)."""
    doc = Path(__file__).parent / "data"
    files = sorted(doc.rglob("*.xml"))[:1] if doc.is_dir() else []
    if not files:
        pytest.skip("no sample document")
    loaded = _heavy(_loaded(["validate", str(files[0])]))
    assert "lxml" in loaded or "lxml.etree" in loaded


def test_version_names_the_document_parser() -> None:
    """``--version`` still says which document parser runs, looked up only when asked."""
    done = subprocess.run(
        [sys.executable, "-m", "aggregator", "--version"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0
    assert done.stdout.startswith("rsagg ") and "document parser:" in done.stdout


def test_loading_the_plugins_imports_no_storage_client() -> None:
    """``rsagg plugins`` loads every installed plugin (as status, retries and harvest do): the S3 plugin
    imports boto3 only when a store is made (plugins/rsagg-s3)."""
    pytest.importorskip("rsagg_s3")
    loaded = _loaded(["plugins", "--json"])
    assert "rsagg_s3" in loaded  # the plugin was loaded ...
    assert [m for m in loaded if m.split(".")[0] in ("boto3", "botocore", "s3transfer")] == []  # ... alone


def test_the_xml_plugins_load_without_the_xml_library() -> None:
    """The shipped plugins that work on XML (xmlpatch, metadatafilter) import lxml when a hook of theirs
    is called (tests/test_xmlpatch.py, tests/test_plugins.py call them), not when they are loaded: every
    ``status``, ``retries`` and ``plugins`` loads them."""
    pytest.importorskip("rsagg_xmlpatch")
    pytest.importorskip("rsagg_metadatafilter")
    loaded = _loaded(["plugins", "--json"])
    assert {"rsagg_xmlpatch", "rsagg_metadatafilter"} <= set(loaded)  # the plugins were loaded ...
    assert [m for m in loaded if m.split(".")[0] == "lxml"] == []  # ... without lxml


#: What a command that reads the configuration and the state (``status``, ``retries``) or loads the plugins
#: (``plugins``) does not use: the harvest's and the server's libraries and modules, and the document
#: parser (lxml: the shipped XML plugins import it when a hook of theirs is called, not when loaded). The
#: configuration (pydantic), the state (sqlite3) and pluggy are theirs to load.
NOT_READING = (
    "trio", "trio_parallel", "httpx", "httpcore", "h11", "h2", "starlette", "hypercorn", "boto3", "lxml",
    "botocore", "prometheus_client", "psycopg", "psycopg_pool", "jinja2", "aggregator.publish",
    "aggregator.websub", "aggregator.run.daemon", "aggregator.run.compose", "aggregator.run.cluster",
    "aggregator.observe.metrics", "aggregator.net.outbound",
    "aggregator.harvest.fetch", "aggregator.harvest.patch",
    "aggregator.harvest.offload", "aggregator.harvest.metadata", "aggregator.rs.parse",
    "aggregator.rs.write",
)  # fmt: skip
#: ``rsagg plugins`` does not open the state either.
NOT_LISTING = (*NOT_READING, "sqlite_utils", "aggregator.store.state")


#: Loaded with the plugins wherever they load: the stages' default plugins (a few lines each, importing
#: their stage's code only when a hook is called) and the empty package faces above them.
DEFAULT_PLUGINS = (
    "aggregator.harvest", "aggregator.harvest.defaults", "aggregator.publish", "aggregator.publish.defaults",
)  # fmt: skip


def _matching(modules: list[str], names: tuple[str, ...]) -> list[str]:
    return [
        m for m in modules if m not in DEFAULT_PLUGINS and any(m == h or m.startswith(h + ".") for h in names)
    ]


@pytest.fixture(scope="module")
def configured(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A configuration with one source and a state made (so ``status`` and ``retries`` open it)."""
    from aggregator.config import load_config
    from aggregator.store.open import open_state

    folder = tmp_path_factory.mktemp("startup")
    config = folder / "rsagg.toml"
    config.write_text(
        f'[store]\npath = "{folder / "data"}"\n\n[[sources]]\nname = "a"\n'
        'url = "http://127.0.0.1:9/.well-known/resourcesync"\n'
    )
    (folder / "data").mkdir()
    with open_state(load_config(config)):
        pass
    return config


READING = [["status"], ["status", "--json"], ["retries"], ["retries", "--json"], ["plugins", "--json"]]


@pytest.mark.parametrize("argv", READING, ids=" ".join)
def test_commands_that_read_load_no_harvest_library(argv: list[str], configured: Path) -> None:
    """``status``, ``retries`` and ``plugins`` run (their output is checked below) without the harvest's
    libraries: they load the configuration, the state and the plugins, no event loop, HTTP client or
    metrics registry (benchmarks/bench_startup.py has the times)."""
    loaded = _loaded([*argv, "-c", str(configured)])
    assert "aggregator.config" in loaded and "pluggy" in loaded  # the command did run its work ...
    if argv[0] != "plugins":
        assert "aggregator.store.state" in loaded  # ... and read the state
    assert _matching(loaded, NOT_LISTING if argv[0] == "plugins" else NOT_READING) == []


def test_plugins_without_a_configuration_loads_no_state_and_no_pydantic() -> None:
    """Without ``-c`` there is no configuration to validate: pydantic is not loaded either."""
    loaded = _loaded(["plugins"])
    assert "pluggy" in loaded and "aggregator.harvest.defaults" in loaded
    assert _matching(loaded, (*NOT_LISTING, "pydantic", "pydantic_core", "aggregator.config")) == []


@pytest.mark.parametrize("argv", READING, ids=" ".join)
def test_commands_that_read_still_work(argv: list[str], configured: Path) -> None:
    """Their output with the imports moved: the source, the (empty) retries, the built-in plugins."""
    done = subprocess.run(
        [sys.executable, "-m", "aggregator", *argv, "-c", str(configured)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    if "--json" not in argv:
        assert done.stdout.strip(), done.stderr
        return
    out = json.loads(done.stdout)
    if argv[0] == "status":
        assert [s["name"] for s in out["sources"]] == ["a"]
    elif argv[0] == "retries":
        assert out == {"retries": [], "cleared": 0}
    else:
        assert {"filesystem", "jsonpatch", "linkpolicy"} <= {p["name"] for p in out["plugins"]}
        assert {"rsagg_patch_formats", "rsagg_republish_links"} <= {
            h for p in out["plugins"] for h in p["hooks"]
        }


@pytest.mark.parametrize("command", ["status", "retries"])
def test_a_configuration_checked_before_loads_without_pydantic(command: str, configured: Path) -> None:
    """The second run of a command on the same file builds the configuration from its snapshot
    (aggregator/config_cache.py): pydantic, a third of the start-up, is not imported."""
    first = _loaded([command, "-c", str(configured)])
    assert "aggregator.store.state" in first  # the command did its work
    loaded = _loaded([command, "-c", str(configured)])
    assert "aggregator.store.state" in loaded and "aggregator.config" in loaded
    assert _matching(loaded, ("pydantic", "pydantic_core", "annotated_types")) == []
