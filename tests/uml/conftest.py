"""Tests in this folder run inside a User-Mode Linux guest (a kernel with ip_vs).

tests/test_uml.py boots one guest and runs `pytest tests/uml` in it; the hooks below stream
each test's result to the host as JSON lines, which the outer tests turn into one outer
pass/fail/skip per inner test. The `lab` / `lab_module` fixtures from tests/conftest.py
work here unchanged (the guest has private /run and /tmp).

Inside the guest:
- use `iptables-legacy` / `iptables-legacy-restore` (Debian's UML kernels have no
  nf_tables ip family, G9; kproxy's own, `kproxy lab uml-kernel`, has it for nftables mode,
  `guest.require_nftables()` skips without it): the `guest` fixture names them;
- the `lab` / `lab_module` node namespaces carry kubelet's KUBE-IPTABLES-HINT chain in
  the legacy mangle table, as on a real node whose kubelet uses iptables-legacy, so
  `--iptables-backend auto` detects "legacy" there (an empty node would detect "nft");
- every module in kproxy.lab.uml.GUEST_MODULES was loaded at boot; `guest.modules` says
  which loaded, `guest.require(...)` fails the test naming a missing one;
- `block_module("ip_vs_sh", ...)` makes modules unavailable for one test, as on a node
  without them: unloaded (with the modules using them) and refused by modprobe, including
  the kernel's own autoload requests; restored afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kproxy.lab.topology import Lab
from kproxy.lab.uml import RUN_DIR_ENV, in_uml
from tests.support.uml import IPTABLES, Guest

REPORT_ENV = "KPROXY_UML_REPORT"
# kmod reads /run/modprobe.d, which is the guest's private tmpfs.
BLOCK_CONF = Path("/run/modprobe.d/kproxy-test-block.conf")


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


def _legacy_node(lab: Lab) -> Lab:
    # What kubelet does on a legacy-iptables node; kproxy's and upstream's cleanup keep it.
    lab.exec(lab.node_ns, [IPTABLES, "-t", "mangle", "-N", "KUBE-IPTABLES-HINT"])
    return lab


@pytest.fixture
def lab(lab: Lab) -> Iterator[Lab]:
    """tests/conftest.py's lab, its node marked as an iptables-legacy node (see above)."""
    yield _legacy_node(lab)


@pytest.fixture(scope="module")
def lab_module(lab_module: Lab) -> Iterator[Lab]:
    """tests/conftest.py's lab_module, its node marked as an iptables-legacy node."""
    yield _legacy_node(lab_module)


def _unload(name: str, removed: list[str]) -> None:
    """rmmod name and, first, every module holding it; record what went, in order."""
    sysdir = Path("/sys/module") / name
    if not (sysdir / "initstate").exists():
        return  # not loaded (or built in: then it cannot be blocked)
    for holder in sorted(p.name for p in (sysdir / "holders").iterdir()):
        _unload(holder, removed)
    # rmmod, not modprobe -r: that would also drop now-unused dependencies (nf_conntrack).
    proc = subprocess.run(["rmmod", name], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        refcnt = (sysdir / "refcnt").read_text().strip()
        pytest.fail(
            f"cannot unload {name} (refcnt {refcnt}): {proc.stderr.strip()}; block modules "
            "before the test creates state that uses them"
        )
    removed.append(name)


@pytest.fixture
def block_module(guest: Guest) -> Iterator[Callable[..., None]]:
    """Call with module names: they are unavailable until the test ends (see above)."""
    removed: list[str] = []
    blocked: list[str] = []

    def block(*names: str) -> None:
        for name in names:
            _unload(name, removed)
            blocked.append(name)
        BLOCK_CONF.parent.mkdir(exist_ok=True)
        BLOCK_CONF.write_text("".join(f"install {n} /bin/false\n" for n in blocked))

    yield block
    BLOCK_CONF.unlink(missing_ok=True)
    failed = []
    for name in reversed(removed):
        proc = subprocess.run(["modprobe", name], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            failed.append(f"{name}: {proc.stderr.strip()}")
    if failed:
        pytest.fail(f"could not reload blocked modules: {failed}")
