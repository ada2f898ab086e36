"""The import rules of the house (docs/architecture.md, "Import rules"), checked on the source like trio's
export tests.

Every module under ``aggregator/`` is parsed with ``ast`` (nothing is imported, so a module's import
side effects do not matter) and each ``import``/``from ... import`` it contains, at any depth (lazy
imports inside functions and ``TYPE_CHECKING`` blocks count too), is resolved to an absolute module name.
The cycle check reads the same imports but those only under ``TYPE_CHECKING`` (never run).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "aggregator"

_COMPOSITION = "removed by the composition root change"
_STORE_SQL = "removed by store/sql"
#: Imports that break a rule today, each with the reason it is still there. A new violation fails the
#: test; removing one of these makes the test ask for its entry to go too.
KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {
    # websub/notifier.py reads what publish/ builds; websub/service.py builds publish's dump builder.
    ("aggregator.websub.notifier", "aggregator.publish.documents"): _COMPOSITION,
    ("aggregator.websub.notifier", "aggregator.publish.site"): _COMPOSITION,
    ("aggregator.websub.service", "aggregator.publish.dumps"): _COMPOSITION,
    # publish/app.py serves the status routes and takes the Metrics type.
    ("aggregator.publish.app", "aggregator.observe.metrics"): _COMPOSITION,
    ("aggregator.publish.app", "aggregator.observe"): _COMPOSITION,
    ("aggregator.publish.app", "aggregator.observe.page"): _COMPOSITION,
    # HarvestContext's default factory builds a Metrics when it is given none.
    ("aggregator.harvest.context", "aggregator.observe.metrics"): _COMPOSITION,
    # The two backends import each other (a cycle).
    ("aggregator.store.state", "aggregator.store.postgres"): _STORE_SQL,
    ("aggregator.store.postgres", "aggregator.store.state"): _STORE_SQL,
    # publish/versions.py streams its TimeMaps with publish/app.py's DocumentResponse (a cycle: app.py
    # imports versions.py): DocumentResponse moves out of app.py with the composition root change.
    ("aggregator.publish.versions", "aggregator.publish.app"): _COMPOSITION,
}


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path) -> tuple[set[str], set[str]]:
    """Absolute names of the modules ``path`` imports (``from a import b`` yields ``a`` and ``a.b``:
    ``b`` may be a submodule): all of them, and those run when the module runs (not only under
    ``if TYPE_CHECKING:``)."""
    name = _module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    tree = ast.parse(path.read_text(), filename=str(path))
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and _is_type_checking(node.test)
        for stmt in node.body
        for inner in ast.walk(stmt)
    }
    found: set[str] = set()
    run: set[str] = set()
    for node in ast.walk(tree):
        names: set[str] = set()
        if isinstance(node, ast.Import):
            names = {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            names = {module, *(f"{module}.{alias.name}" for alias in node.names)}
        found |= names
        if id(node) not in typing_only:
            run |= names
    return found, run


def _resolved(names: set[str], modules: set[str]) -> set[str]:
    """Each name as the module it is or is in (``aggregator.store.rows.SourceRow``: ``...rows``)."""
    out = set()
    for name in names:
        while _under(name, "aggregator") and name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        out.add(name)
    return out


_RAW = {_module_name(p): _imports(p) for p in sorted(ROOT.rglob("*.py"))}
_PARSED = {
    mod: (_resolved(found, set(_RAW)), _resolved(run, set(_RAW))) for mod, (found, run) in _RAW.items()
}
#: module -> every module name it imports (rules).
MODULES = {mod: found for mod, (found, _) in _PARSED.items()}
#: module -> the modules of aggregator/ it imports when it runs (the cycle check).
GRAPH = {
    mod: {
        imp
        for imp in run
        if imp in _PARSED and imp != mod and not mod.startswith(imp + ".")  # a parent package runs first
    }
    for mod, (_, run) in _PARSED.items()
}


def _violations(
    importers: str | Iterable[str], forbidden: Iterable[str], allowed: Iterable[str] = ()
) -> set[tuple[str, str]]:
    """(module, import) pairs where a module under ``importers`` (but not under ``allowed``) imports
    something under ``forbidden``."""
    importers = (importers,) if isinstance(importers, str) else tuple(importers)
    forbidden, allowed = tuple(forbidden), tuple(allowed)
    return {
        (mod, imp)
        for mod, imports in MODULES.items()
        if any(_under(mod, i) for i in importers) and not any(_under(mod, a) for a in allowed)
        for imp in imports
        if any(_under(imp, f) for f in forbidden)
    }


def _outside(importers: str | Iterable[str], allowed: Iterable[str]) -> set[tuple[str, str]]:
    """(module, import) pairs where a module under ``importers`` imports something of rsagg that is
    under none of ``allowed`` (the package ``aggregator`` itself, its version, is always allowed)."""
    importers = (importers,) if isinstance(importers, str) else tuple(importers)
    allowed = tuple(allowed)
    return {
        (mod, imp)
        for mod, imports in MODULES.items()
        if any(_under(mod, i) for i in importers)
        for imp in imports
        if _under(imp, "aggregator") and imp != "aggregator" and not any(_under(imp, a) for a in allowed)
    }


def _check(found: set[tuple[str, str]], rule: str) -> None:
    new = found - KNOWN_EXCEPTIONS.keys()
    assert not new, f"{rule}: " + ", ".join(f"{m} imports {i}" for m, i in sorted(new))


def _a(*names: str) -> tuple[str, ...]:
    return tuple(f"aggregator.{n}" for n in names)


#: The ground floor: what every part may use. It imports only rs/ and itself.
GROUND = _a("config", "errors", "scope", "redact", "progress_text", "hookspecs")
#: The floor above it: the state and the blobs, outbound policy and retries.
FLOORS = _a("store", "net")
#: What runs the parts (run/) and who may start them.
RUNNERS = _a("run", "commands", "cli")


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The import cycles of ``graph``: its strongly connected components of more than one module (or
    one that imports itself), each sorted (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in graph.get(node, ()):
                        found.append(sorted(component))
    return found


def test_the_parser_sees_imports() -> None:
    """The check can fail: the parser resolves relative, lazy and typing-only imports (a known one of
    each) and tells the typing-only ones apart."""
    assert "aggregator.run.compose" in MODULES["aggregator.run.daemon"]  # from .compose import ...
    assert "aggregator.testing.upstream" in MODULES["aggregator.commands.demo"]  # from ..testing.upstream
    assert "aggregator.publish.app" in MODULES["aggregator.run.compose"]  # imported inside a function
    assert "aggregator.publish.app" in GRAPH["aggregator.run.compose"]  # ... which runs
    assert "aggregator.websub.hub" in MODULES["aggregator.run.compose"]  # inside TYPE_CHECKING
    assert "aggregator.websub.hub" not in GRAPH["aggregator.run.compose"]  # ... which never runs
    assert len(MODULES) > 50


def test_the_rules_can_fail() -> None:
    """Each kind of check reports a breach it is shown (on imports that do exist)."""
    assert ("aggregator.run.daemon", "aggregator.run.compose") in _violations("aggregator.run", _a("run"))
    assert ("aggregator.observe.logs", "aggregator.redact") in _outside("aggregator.observe", _a("rs"))
    assert ("aggregator.run.daemon", "aggregator.run.compose") in _violations(
        "aggregator", _a("run"), allowed=_a("commands")
    )
    assert not _violations("aggregator.run.daemon", _a("run"), allowed=_a("run"))


def test_cycles_are_found() -> None:
    """The cycle finder reports a cycle, however long, and nothing on a graph without one."""
    assert cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    assert cycles({"a": ["a"]}) == [["a"]]
    assert cycles({"a": ["b", "c"], "b": ["c"], "c": []}) == []
    chain = {str(i): [str(i + 1)] for i in range(5000)}  # deep: no recursion limit
    assert cycles(chain) == [] and cycles({**chain, "5000": ["0"]}) == [sorted(str(i) for i in range(5001))]


def test_rs_is_the_ground_floor() -> None:
    """rs/ (the ResourceSync document model) imports nothing of rsagg but itself."""
    _check(_outside("aggregator.rs", _a("rs")), "rs/")


def test_the_ground_floor_stands_on_rs() -> None:
    """config, errors, scope, redact, progress_text and hookspecs import only rs/ and each other."""
    for module in GROUND:
        assert module in MODULES, f"{module} is gone: update GROUND"
    _check(_outside(GROUND, (*GROUND, "aggregator.rs")), "the ground floor")


def test_store_and_net_import_nothing_above_them() -> None:
    """store/ (the state seam and its backends, blobs, published sets) and net/ (outbound policy,
    retries) stand on the ground floor and each other."""
    _check(_outside(FLOORS, (*FLOORS, *GROUND, "aggregator.rs")), "store/ and net/")


def test_harvest_and_publish_are_siblings() -> None:
    """harvest/ and publish/ import none of each other, nor websub/, observe/ or what runs them: each
    is handed what it needs."""
    above = _a("websub", "observe", "run", "commands", "cli")
    _check(_violations("aggregator.harvest", ("aggregator.publish", *above)), "harvest/")
    _check(_violations("aggregator.publish", ("aggregator.harvest", *above)), "publish/")


def test_websub_is_a_sibling() -> None:
    """The subscriber drives harvests through a ``Harvester`` it is handed (harvest/notices.py), the
    notifier publishes what it is handed: websub/ imports nothing of publish/, harvest/, observe/, run/."""
    _check(_violations("aggregator.websub", _a("publish", "harvest", "observe", "run")), "websub/")


def test_observe_reads_the_state_only() -> None:
    """observe/ (metrics, the status report and page, logs) reads the state and counts what it is told:
    it imports nothing of harvest/, publish/, websub/ or run/."""
    _check(_violations("aggregator.observe", _a("harvest", "publish", "websub", "run")), "observe/")


def test_only_the_runners_import_run() -> None:
    """run/ (composition, daemon, cluster node, workers, serving) is imported only by run/, commands/
    and cli, and by the test kit (aggregator.testing serves its fake Sources with run/serving.py)."""
    _check(_violations("aggregator", _a("run"), allowed=(*RUNNERS, "aggregator.testing")), "run/")


def test_runtime_never_imports_the_test_doubles() -> None:
    """``aggregator.testing`` is for tests (and the ``rsagg demo`` command that shows one off)."""
    found = _violations(
        "aggregator", ("aggregator.testing",), allowed=("aggregator.testing", "aggregator.commands.demo")
    )
    _check(found, "aggregator.testing is imported by runtime code")


def test_no_import_cycle() -> None:
    """No module of aggregator/ imports itself through others (typing-only imports aside)."""
    graph = {mod: {imp for imp in imps if (mod, imp) not in KNOWN_EXCEPTIONS} for mod, imps in GRAPH.items()}
    found = cycles(graph)
    assert not found, "import cycles: " + "; ".join(
        " <-> ".join(cycle)
        + " ("
        + ", ".join(f"{a} -> {b}" for a in cycle for b in sorted(graph[a]) if b in cycle)
        + ")"
        for cycle in found
    )


def test_known_exceptions_are_still_real() -> None:
    """An exception that no longer exists must leave the list (so the list only shrinks)."""
    gone = [f"{m} -> {i}" for m, i in sorted(KNOWN_EXCEPTIONS) if i not in MODULES.get(m, set())]
    assert not gone, f"no longer imported, drop from KNOWN_EXCEPTIONS: {gone}"
