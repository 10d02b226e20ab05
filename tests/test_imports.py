"""Every module of kproxy imports: a module only the kernel tests reach (the daemon's, a
mode's) would otherwise break unnoticed by the unit tests."""

from __future__ import annotations

import importlib
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

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


def test_every_name_of_the_config_package_resolves() -> None:
    import kproxy.config

    assert all(getattr(kproxy.config, name) is not None for name in kproxy.config.__all__)


def test_status_loads_neither_the_config_models_nor_pydantic() -> None:
    """`kproxy status` runs often (scripts; the fault rig, in a UML guest where every module
    loaded costs the guest's one CPU): what it imports stays small."""
    code = (
        "import sys, kproxy.cli, kproxy.ops.control, kproxy.server.admin; "
        "print(sorted(m for m in ('pydantic', 'yaml', 'kproxy.config.schema') if m in sys.modules))"
    )
    src = str(Path(kproxy.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": src}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
