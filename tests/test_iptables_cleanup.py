"""The iptables leftover listing: a dry run told the chain names reads no save when nothing
goes, and lists what the save-based way lists when something does."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

import pytest

from kproxy.dataplane.iptables.backend import IptablesBackend
from kproxy.dataplane.iptables.cleanup import cleanup, going_chains, keeps_chain

SAVE = """\
*nat
:PREROUTING ACCEPT [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-SVC-AAAA - [0:0]
:KUBE-NODE-PORT - [0:0]
-A PREROUTING -j KUBE-SERVICES
-A KUBE-SERVICES -j KUBE-NODE-PORT
COMMIT
"""


class SaveOnly:
    """The tools: a save (counted), nothing else."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.saves = 0

    def __call__(self, argv: Sequence[str], _data: str | None) -> subprocess.CompletedProcess[str]:
        assert argv[0] == "iptables-nft-save", argv
        self.saves += 1
        return subprocess.CompletedProcess(list(argv), 0, self.text, "")


@pytest.fixture
def tools() -> SaveOnly:
    return SaveOnly(SAVE)


def backend(tools: SaveOnly) -> IptablesBackend:
    return IptablesBackend("nft", runner=tools)


def test_nothing_goes_by_the_names_no_save_is_read(tools: SaveOnly) -> None:
    listed = {"nat": ["PREROUTING", "KUBE-SERVICES", "KUBE-SVC-AAAA"], "filter": ["KUBE-FIREWALL"]}
    assert going_chains(listed, keeps_chain) == {}
    assert cleanup(backend(tools), dry_run=True, keep=keeps_chain, listed=listed) == []
    assert tools.saves == 0


def test_something_goes_the_save_says_what_jumps_to_it(tools: SaveOnly) -> None:
    listed = {"nat": ["PREROUTING", "KUBE-SERVICES", "KUBE-SVC-AAAA", "KUBE-NODE-PORT"]}
    assert going_chains(listed, keeps_chain) == {"nat": ["KUBE-NODE-PORT"]}
    found = cleanup(backend(tools), dry_run=True, keep=keeps_chain, listed=listed)
    unlisted = cleanup(backend(tools), dry_run=True, keep=keeps_chain)
    assert found == unlisted and tools.saves == 2
    assert [(o.kind, o.name) for o in found] == [
        ("iptables-rule", "-A KUBE-SERVICES -j KUBE-NODE-PORT"),
        ("iptables-chain", "KUBE-NODE-PORT"),
    ]
