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
    "aggregator.publish", "aggregator.websub", "aggregator.daemon", "aggregator.compose",
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
