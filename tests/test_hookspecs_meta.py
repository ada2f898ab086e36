"""Every hook is specified, documented and tested: a new hook without all three fails here.

(datasette keeps the same discipline: one flat hookspecs.py, every hook in the plugin docs.)
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from aggregator import hookspecs

from . import test_hooks

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs" / "plugins.md"


def _hooks() -> dict[str, object]:
    return {
        name: fn
        for name, fn in vars(hookspecs).items()
        if callable(fn) and hasattr(fn, f"{hookspecs.hookspec.project_name}_spec")
    }


HOOKS = _hooks()


def signature(name: str) -> str:
    """``name(arg, ...)`` as the docs must show it."""
    return f"{name}({', '.join(inspect.signature(HOOKS[name]).parameters)})"


def test_there_are_hooks_and_they_are_all_named_rsagg_something():
    assert len(HOOKS) >= 10
    assert all(name.startswith("rsagg_") for name in HOOKS)


@pytest.mark.parametrize("name", sorted(HOOKS))
def test_hook_has_a_one_line_docstring(name: str):
    doc = HOOKS[name].__doc__
    assert doc and doc.strip(), f"{name} has no docstring"
    assert "\n" not in doc.strip(), f"{name}: the docstring is one line (details go in docs/plugins.md)"
    assert doc.strip().endswith("."), name


@pytest.mark.parametrize("name", sorted(HOOKS))
def test_hook_is_documented_with_its_signature(name: str):
    assert signature(name) in DOCS.read_text(), f"docs/plugins.md does not show {signature(name)}"


@pytest.mark.parametrize("name", sorted(HOOKS))
def test_hook_has_its_own_test(name: str):
    test = getattr(test_hooks, f"test_hook_{name}", None)
    assert inspect.iscoroutinefunction(test) or inspect.isfunction(test), (
        f"tests/test_hooks.py: no test_hook_{name}"
    )


def test_docs_and_tests_name_no_hook_that_does_not_exist():
    documented = set(re.findall(r"^#+ `?(rsagg_\w+)\(", DOCS.read_text(), re.M))
    assert documented == set(HOOKS), "one heading per hook in docs/plugins.md"
    tested = {n.removeprefix("test_hook_") for n in vars(test_hooks) if n.startswith("test_hook_")}
    assert tested == set(HOOKS)
