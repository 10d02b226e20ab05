"""Tests in this folder run inside a User-Mode Linux guest (a kernel with ip_vs).

tests/test_uml.py boots one guest and runs `pytest tests/uml` in it; the hooks below stream
each test's result to the host as JSON lines, which the outer tests turn into one outer
pass/fail/skip per inner test. The `lab` / `lab_module` fixtures from tests/conftest.py
work here unchanged (the guest has private /run and /tmp).

Inside the guest:
- use `iptables-legacy` / `iptables-legacy-restore` (the UML kernel has no nf_tables ip
  family, G9): the `guest` fixture names them;
- every module in kproxy.lab.uml.GUEST_MODULES was loaded at boot; `guest.modules` says
  which loaded, `guest.require(...)` fails the test naming a missing one.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kproxy.lab.uml import RUN_DIR_ENV, in_uml

REPORT_ENV = "KPROXY_UML_REPORT"
IPTABLES = "iptables-legacy"
IPTABLES_RESTORE = "iptables-legacy-restore"
IPTABLES_SAVE = "iptables-legacy-save"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Someone ran tests/uml/... directly on the host: it needs ip_vs, which only the guest has.
    if in_uml():
        return
    skip = pytest.mark.skip(reason="needs the UML guest: run tests/test_uml.py instead")
    for item in items:
        if Path(str(item.path)).is_relative_to(Path(__file__).parent):
            item.add_marker(skip)


# -- results for the host ---------------------------------------------------------------


def _emit(record: dict[str, Any]) -> None:
    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(record) + "\n")
        out.flush()
        # Through hostfs straight to the host: if the guest is killed later, what was
        # reported so far survives.
        os.fsync(out.fileno())


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr or "")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    record: dict[str, Any] = {
        "nodeid": report.nodeid,
        "when": report.when,
        "outcome": report.outcome,
        "duration": report.duration,
    }
    if hasattr(report, "wasxfail"):
        record["xfail"] = report.wasxfail
    if report.failed:
        record["longrepr"] = report.longreprtext
        sections = [f"--- {name} ---\n{text}" for name, text in report.sections if text.strip()]
        record["sections"] = "\n".join(sections)[-6000:]
    elif report.skipped:
        record["reason"] = _skip_reason(report)
    _emit(record)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _emit(
            {
                "nodeid": report.nodeid,
                "when": "collect",
                "outcome": "failed",
                "longrepr": report.longreprtext,
            }
        )


# -- fixtures ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Guest:
    """Facts about the UML guest the tests run in."""

    run_dir: Path | None
    modules: dict[str, str] = field(default_factory=dict)
    iptables: str = IPTABLES
    iptables_restore: str = IPTABLES_RESTORE
    iptables_save: str = IPTABLES_SAVE

    def require(self, *modules: str) -> None:
        missing = [m for m in modules if self.modules.get(m, "missing") == "missing"]
        if missing:
            pytest.fail(f"kernel modules missing in the UML guest: {', '.join(missing)}")


def _load_guest() -> Guest:
    run_dir = os.environ.get(RUN_DIR_ENV)
    modules: dict[str, str] = {}
    if run_dir:
        text = (Path(run_dir) / "modules.txt").read_text()
        for line in text.splitlines():
            name, _, state = line.partition(" ")
            modules[name] = state
    return Guest(Path(run_dir) if run_dir else None, modules)


@pytest.fixture(scope="session")
def guest() -> Guest:
    if not in_uml():
        pytest.fail(f"not inside a UML guest ({RUN_DIR_ENV} unset): run tests/test_uml.py")
    return _load_guest()
