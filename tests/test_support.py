"""Shared test code lives in tests/support: no module imports a test module or a conftest.

A test module imported by another ties the two together (a test_* name imported runs twice,
a helper's home is wherever it was first needed); a conftest is pytest's to load."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).parent.parent
IMPORTERS = sorted([*ROOT.glob("tests/**/*.py"), *ROOT.glob("bench/**/*.py")])


def _is_test_module(dotted: str) -> bool:
    """tests.test_x, tests.conftest, tests.uml.test_x, tests.uml.conftest, ..."""
    parts = dotted.split(".")
    if parts[0] != "tests" or len(parts) < 2:
        return False
    return any(p.startswith("test_") or p == "conftest" for p in parts[1:])


def imported_modules(path: Path) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of every module the file imports, at any depth of the file."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
            # `from tests import test_x` names the module in the imported names.
            for alias in node.names:
                yield node.lineno, f"{node.module}.{alias.name}"


def test_the_check_recognises_test_modules() -> None:
    assert _is_test_module("tests.test_switch")
    assert _is_test_module("tests.conftest")
    assert _is_test_module("tests.uml.conftest")
    assert _is_test_module("tests.uml.test_switch_ipvs")
    assert not _is_test_module("tests.support.objects")
    assert not _is_test_module("tests.support")
    assert not _is_test_module("kproxy.switch")


def test_no_module_imports_a_test_module_or_a_conftest() -> None:
    bad: dict[str, str] = {}
    for path in IMPORTERS:
        for line, name in imported_modules(path):
            if _is_test_module(name):
                bad.setdefault(f"{path.relative_to(ROOT)}:{line}", name)
    found = [f"{where} imports {name}" for where, name in bad.items()]
    assert not found, "move shared test code to tests/support:\n" + "\n".join(found)
