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
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "aggregator"

#: Imports that break a rule today, each with the reason it is still there. A new violation fails the
#: test; removing one of these makes the test ask for its entry to go too.
KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {}


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
#: module -> the modules of aggregator/ it imports, typing-only imports included (the cycle check).
TYPED = {
    mod: {imp for imp in found if imp in _PARSED and imp != mod and not mod.startswith(imp + ".")}
    for mod, (found, _) in _PARSED.items()
}
#: module -> the modules of aggregator/ it imports when it runs (the cycle check).
GRAPH = {
    mod: {
        imp
        for imp in run
        if imp in _PARSED and imp != mod and not mod.startswith(imp + ".")  # a parent package runs first
    }
    for mod, (_, run) in _PARSED.items()
}


def _a(*names: str) -> tuple[str, ...]:
    return tuple(f"aggregator.{n}" for n in names)


@dataclass(frozen=True)
class Rule:
    """Modules under ``importers`` (but not under ``exempt``) import nothing under ``forbidden``; or,
    with ``only``, nothing of rsagg (its package ``aggregator`` included) outside ``only``."""

    name: str
    why: str
    importers: tuple[str, ...]
    forbidden: tuple[str, ...] = ()
    only: tuple[str, ...] | None = None
    exempt: tuple[str, ...] = ()

    def breaks(self, imp: str) -> bool:
        if self.only is not None:
            return _under(imp, "aggregator") and not any(_under(imp, a) for a in self.only)
        return any(_under(imp, f) for f in self.forbidden)

    def breaches(self, modules: Mapping[str, Iterable[str]]) -> set[tuple[str, str]]:
        return {
            (mod, imp)
            for mod, imports in modules.items()
            if any(_under(mod, i) for i in self.importers) and not any(_under(mod, e) for e in self.exempt)
            for imp in imports
            if self.breaks(imp)
        }


#: The ground floor: what every part may use.
GROUND = _a("config", "config_cache", "errors", "scope", "redact", "progress_text", "hookspecs")
#: The floor above it: the state, the blobs, published sets; the outbound policy and retries.
FLOORS = _a("store", "net")
#: What runs the parts, and who may start them.
RUNNERS = _a("run", "commands", "cli")

RULES = [
    Rule(
        "rs/", "the ResourceSync document model imports nothing of rsagg but itself", _a("rs"), only=_a("rs")
    ),
    Rule(
        "the ground floor",
        "config, config_cache, errors, scope, redact, progress_text, hookspecs: rs/ and each other",
        GROUND,
        only=(*GROUND, "aggregator.rs"),
    ),
    Rule(
        "store/ and net/",
        "they import nothing above them: the ground floor, rs/ and each other",
        FLOORS,
        only=(*FLOORS, *GROUND, "aggregator.rs"),
    ),
    Rule(
        "harvest/",
        "a sibling: it imports none of publish/, websub/, observe/ or what runs it",
        _a("harvest"),
        forbidden=_a("publish", "websub", "observe", "run", "commands", "cli"),
    ),
    Rule(
        "publish/",
        "a sibling: it imports none of harvest/, websub/, observe/ or what runs it",
        _a("publish"),
        forbidden=_a("harvest", "websub", "observe", "run", "commands", "cli"),
    ),
    Rule(
        "websub/",
        "a sibling: the subscriber drives harvests through the Harvester it is handed, the "
        "notifier publishes what it is handed",
        _a("websub"),
        forbidden=_a("publish", "harvest", "observe", "run"),
    ),
    Rule(
        "observe/",
        "metrics, status and logs read the state and count what they are told",
        _a("observe"),
        forbidden=_a("harvest", "publish", "websub", "run"),
    ),
    Rule(
        "run/",
        "only run/, commands/ and cli import it (and the test kit, which serves its fake Sources "
        "with run/serving.py)",
        ("aggregator",),
        forbidden=_a("run"),
        exempt=(*RUNNERS, "aggregator.testing"),
    ),
    Rule(
        "plugins/",
        "the plugin manager stands on the floors: rsagg's own hook implementations live in the stages "
        "(store/, harvest/, publish/ defaults.py), registered by module name",
        _a("plugins"),
        only=(*GROUND, *FLOORS, "aggregator.plugins", "aggregator.rs"),
    ),
    Rule(
        "run/workers.py",
        "a serving worker runs the app the composition builds for it (worker_app): it imports no stage",
        _a("run.workers"),
        forbidden=_a("harvest", "publish", "store", "websub"),
    ),
    Rule(
        "aggregator.testing",
        "test doubles: runtime code never imports them (the demo command shows one off)",
        ("aggregator",),
        forbidden=_a("testing"),
        exempt=_a("testing", "commands.demo"),
    ),
]


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
    assert "aggregator.publish.app" in MODULES["aggregator.run.parts"]  # imported inside a function
    assert "aggregator.publish.app" in GRAPH["aggregator.run.parts"]  # ... which runs
    assert "aggregator.websub.hub" in MODULES["aggregator.run.compose"]  # inside TYPE_CHECKING
    assert "aggregator.websub.hub" not in GRAPH["aggregator.run.compose"]  # ... which never runs
    assert "aggregator.store.rows" in MODULES["aggregator.observe.report"]  # a name resolved to its module
    assert len(MODULES) > 50


def _probe(rule: Rule) -> tuple[str, str, str]:
    """A module the rule checks, an import that breaks it, and one that does not."""
    importer = next(
        f"{i}.probe" for i in rule.importers if not any(_under(f"{i}.probe", e) for e in rule.exempt)
    )
    if rule.only is not None:
        return importer, "aggregator.probe_elsewhere", f"{rule.only[0]}.probe"
    return importer, f"{rule.forbidden[0]}.probe", "aggregator.rs.probe"


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_each_rule_can_fail(rule: Rule) -> None:
    """Shown a module that breaks it, each rule says so; shown one that keeps it, it does not."""
    importer, bad, good = _probe(rule)
    assert rule.breaches({importer: {bad, good}}) == {(importer, bad)}
    for exempt in rule.exempt:
        assert not rule.breaches({f"{exempt}.probe": {bad}})


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_rule(rule: Rule) -> None:
    for package in (*rule.importers, *(rule.only or ()), *rule.forbidden, *rule.exempt):
        assert any(_under(m, package) for m in MODULES), f"{package} is gone: update the rule {rule.name}"
    new = rule.breaches(MODULES) - KNOWN_EXCEPTIONS.keys()
    assert not new, f"{rule.name} ({rule.why}): " + ", ".join(f"{m} imports {i}" for m, i in sorted(new))


def test_cycles_are_found() -> None:
    """The cycle finder reports a cycle, however long, and nothing on a graph without one."""
    assert cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    assert cycles({"a": ["a"]}) == [["a"]]
    assert cycles({"a": ["b", "c"], "b": ["c"], "c": []}) == []
    chain = {str(i): [str(i + 1)] for i in range(5000)}  # deep: no recursion limit
    assert cycles(chain) == [] and cycles({**chain, "5000": ["0"]}) == [sorted(str(i) for i in range(5001))]


def test_no_import_cycle() -> None:
    """No module of aggregator/ imports itself through others, typing-only imports included: a type a
    module needs from one that imports it is a protocol of its own or lives lower down."""
    graph = {mod: {imp for imp in imps if (mod, imp) not in KNOWN_EXCEPTIONS} for mod, imps in TYPED.items()}
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
