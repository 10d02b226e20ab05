"""Every module of kproxy imports: a module only the kernel tests reach (the daemon's, a
mode's) would otherwise break unnoticed by the unit tests."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import kproxy

MODULES = sorted(
    m.name for m in pkgutil.walk_packages(kproxy.__path__, prefix="kproxy.") if not m.ispkg
)


def test_the_walk_finds_the_modules() -> None:
    assert "kproxy.daemon" in MODULES and "kproxy.cluster.rollout.controller" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_module_imports(name: str) -> None:
    importlib.import_module(name)
