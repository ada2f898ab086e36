"""The import rules of the house (docs/architecture.md), checked on the source like trio's export tests.

Every module under ``aggregator/`` is parsed with ``ast`` (nothing is imported, so a module's import
side effects do not matter) and each ``import``/``from ... import`` it contains, at any depth (lazy
imports inside functions and ``TYPE_CHECKING`` blocks count too), is resolved to an absolute module name.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "aggregator"

#: Imports that break a rule today, each with the reason it is still there. A new violation fails the
#: test; removing one of these makes the test ask for its entry to go too.
KNOWN_EXCEPTIONS: set[tuple[str, str]] = set()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of the modules ``path`` imports (``from a import b`` yields ``a`` and ``a.b``:
    ``b`` may be a submodule)."""
    name = _module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


MODULES = {_module_name(p): _imports(p) for p in sorted(ROOT.rglob("*.py"))}


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _violations(
    importers: str, forbidden: tuple[str, ...], allowed: tuple[str, ...] = ()
) -> set[tuple[str, str]]:
    return {
        (mod, imp)
        for mod, imports in MODULES.items()
        if _under(mod, importers) and not any(_under(mod, a) for a in allowed)
        for imp in imports
        if any(_under(imp, f) for f in forbidden)
    }


def _check(found: set[tuple[str, str]], rule: str) -> None:
    new = found - KNOWN_EXCEPTIONS
    assert not new, f"{rule}: " + ", ".join(f"{m} imports {i}" for m, i in sorted(new))


def test_the_parser_sees_imports() -> None:
    """The check can fail: the parser resolves relative and lazy imports (a known one of each)."""
    assert "aggregator.run.compose" in MODULES["aggregator.run.daemon"]  # from .compose import ...
    assert "aggregator.testing.upstream" in MODULES["aggregator.commands.demo"]  # from ..testing.upstream
    assert "aggregator.publish.app" in MODULES["aggregator.run.parts"]  # imported inside a function
    assert "aggregator.websub.hub" in MODULES["aggregator.run.compose"]  # inside TYPE_CHECKING
    assert len(MODULES) > 50


def test_harvest_and_publish_are_siblings() -> None:
    """harvest/ and publish/ stand side by side on the store: neither imports the other, and neither
    imports websub/ (which sits above both: the subscriber drives harvests, the notifier reads what
    publish/ builds)."""
    _check(_violations("aggregator.harvest", ("aggregator.publish", "aggregator.websub")), "harvest/")
    _check(_violations("aggregator.publish", ("aggregator.harvest", "aggregator.websub")), "publish/")


def test_websub_does_not_import_harvest() -> None:
    """The subscriber drives harvests without knowing how they are done: the composition hands it a
    ``Harvester`` (harvest/notices.py), so websub/ imports nothing of harvest/."""
    _check(_violations("aggregator.websub", ("aggregator.harvest",)), "websub/")


def test_websub_does_not_import_publish() -> None:
    """The notifier writes the documents the publisher serves without importing publish/: it reads them
    through ``websub/views.py``'s protocols, which the composition implements (run/parts.py)."""
    _check(_violations("aggregator.websub", ("aggregator.publish",)), "websub/")


def test_serving_workers_get_their_app_from_the_composition() -> None:
    """A serving worker process runs the publisher app ``run/compose.py`` builds (``worker_app``): it
    builds no part of its own, so it imports no stage."""
    stages = ("aggregator.harvest", "aggregator.publish", "aggregator.store", "aggregator.websub")
    _check(_violations("aggregator.run.workers", stages), "run/workers.py")


def test_publish_does_not_import_observe() -> None:
    """The status routes (``/``, ``/status.json``, ``/metrics``) and the served-request metrics are handed
    to the publisher app by the composition; publish/ defines the narrow ``ServedCounter`` it reports to."""
    _check(_violations("aggregator.publish", ("aggregator.observe",)), "publish/")


#: The layer that builds and runs the stages (the composition root, the daemon, the command line).
COMPOSITION = ("aggregator.run.compose", "aggregator.run.daemon", "aggregator.commands", "aggregator.cli")
#: The stages and the floors they stand on.
STAGES = ("aggregator.harvest", "aggregator.publish", "aggregator.websub", "aggregator.store",
          "aggregator.rs")  # fmt: skip


def test_stages_are_handed_their_parts() -> None:
    """Nothing below the composition imports it: a stage gets its parts handed in (compose.py), it never
    reaches up for them."""
    for stage in STAGES:
        _check(_violations(stage, COMPOSITION), stage)


def test_the_store_is_a_floor() -> None:
    """store/ (the state seam and its backend, the blob store) stands on rs/ and config only: no stage
    above it is imported from below."""
    above = ("aggregator.harvest", "aggregator.publish", "aggregator.websub", *COMPOSITION)
    _check(_violations("aggregator.store", above), "store/")


#: Code every layer may use, or that shows the state to operators (status, metrics, the cluster's node
#: loop, published sets, the errors module): it stands on the floors, so publish/ (the status page) and the
#: daemon alike may import it, and it never reaches into a stage.
SHARED = (
    "aggregator.observe.report", "aggregator.observe.metrics", "aggregator.run.cluster",
    "aggregator.store.sets", "aggregator.errors",
    "aggregator.progress_text", "aggregator.net.retry", "aggregator.net.outbound",
)  # fmt: skip


def test_shared_code_stands_on_the_floors() -> None:
    """status, metrics and the other shared modules import only rs/, store/, config, plugins and each
    other: never harvest/, publish/, websub/ or the composition."""
    stages = ("aggregator.harvest", "aggregator.publish", "aggregator.websub", *COMPOSITION)
    for module in SHARED:
        assert module in MODULES, f"{module} is gone: update SHARED"
        _check(_violations(module, stages), module)


def test_the_hub_stands_alone() -> None:
    """The embedded WebSub hub serves any subscriber: it uses neither harvest/ nor publish/ (the Link
    header parser it shares with discovery lives in rs/)."""
    found = _violations("aggregator.websub.hub", ("aggregator.harvest", "aggregator.publish"))
    _check(found, "websub/hub.py")


def test_runtime_never_imports_the_test_doubles() -> None:
    """``aggregator.testing`` is for tests (and the ``rsagg demo`` command that shows one off)."""
    found = _violations(
        "aggregator", ("aggregator.testing",), allowed=("aggregator.testing", "aggregator.commands.demo")
    )
    _check(found, "aggregator.testing is imported by runtime code")


def test_rs_is_the_ground_floor() -> None:
    """rs/ (the ResourceSync document model) imports nothing of rsagg but itself."""
    found = {
        (mod, imp)
        for mod, imports in MODULES.items()
        if _under(mod, "aggregator.rs")
        for imp in imports
        if _under(imp, "aggregator") and not _under(imp, "aggregator.rs")
    }
    _check(found, "rs/")


def test_known_exceptions_are_still_real() -> None:
    """An exception that no longer exists must leave the list (so the list only shrinks)."""
    gone = [f"{m} -> {i}" for m, i in sorted(KNOWN_EXCEPTIONS) if i not in MODULES.get(m, set())]
    assert not gone, f"no longer imported, drop from KNOWN_EXCEPTIONS: {gone}"
