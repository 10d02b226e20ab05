"""The registry of modes: one spec per mode of kproxy/modes.py, cheap to import; the
Dataplane base class's defaults."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kproxy.config import MODES as CONFIG_MODES
from kproxy.dataplane.base import AVAILABLE_MODES, Dataplane, DataplaneUnavailable, OwnedObject
from kproxy.dataplane.registry import SPECS, mode_spec
from kproxy.modes import MODES


def test_one_tuple_of_modes_and_a_spec_for_each() -> None:
    assert CONFIG_MODES is MODES and AVAILABLE_MODES is MODES
    assert tuple(SPECS) == MODES
    assert all(spec.name == mode for mode, spec in SPECS.items())
    with pytest.raises(DataplaneUnavailable, match="not available in this build"):
        mode_spec("bpf")


def test_the_daemon_imports_no_mode_it_does_not_run() -> None:
    """kproxy run loads its own mode when it creates it; the registry and the leftover
    cleanup name the other modes' functions without importing them."""
    probe = (
        "import sys; sys.argv = ['kproxy', 'run']; import kproxy.cli, kproxy.daemon; "
        "print('\\n'.join(m for m, mod in sys.modules.items() if mod is not None))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    loaded = proc.stdout.split()
    assert "kproxy.dataplane.registry" in loaded and "kproxy.leftovers" in loaded
    packages = tuple(f"kproxy.dataplane.{m}." for m in ("nftables", "ipvs", "userspace"))
    assert [m for m in loaded if m.startswith(packages)] == []
    assert "kproxy.dataplane.iptables.proxier" not in loaded


class Minimal(Dataplane):
    mode = "minimal"

    def __init__(self) -> None:
        self.cleaned = 0

    def cleanup(self, *, dry_run: bool = False) -> list[OwnedObject]:
        self.cleaned += 1
        return [OwnedObject("nft-table", "nftables", "ip minimal", "a test's")]


def test_a_dataplane_without_optional_capabilities_gets_the_defaults() -> None:
    dp = Minimal()
    removed, draining = dp.retire()
    assert [o.name for o in removed] == ["ip minimal"] and draining is None and dp.cleaned == 1
    assert dp.iptables_flavour is None and not dp.moves_udp_flows
    dp.distrust_kernel()
    dp.close()
    with pytest.raises(NotImplementedError):
        dp.drifted()


def test_userspace_mode_moves_its_udp_flows_itself() -> None:
    from kproxy.dataplane.userspace.proxier import UserspaceDataplane

    assert UserspaceDataplane.moves_udp_flows
