"""The kernel state of one network namespace, as a leftover check reads it.

Each mode's spec (dataplane/registry.py) says what in it that mode owns, and removes it.
The parts are read only when a mode asks (a running mode never reads its own). This class
reads the live kernel; preflight's serves the reads it already made
(ops/preflight/dataplane.py).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kproxy.defaults import DEFAULT_STATE_DIR
from kproxy.host.commands import in_netns

if TYPE_CHECKING:
    from kproxy.dataplane.iptables.backend import IptablesBackend
    from kproxy.dataplane.nftables.cleanup import TableBackend

IPTABLES_FLAVOURS = ("nft", "legacy")


class KernelDump:
    def __init__(self, netns: str | None = None, *, state_dir: Path | None = None) -> None:
        self.netns = netns
        self.state_dir = state_dir or DEFAULT_STATE_DIR

    def run(self, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        """A command inside the namespace."""
        return subprocess.run(
            in_netns(argv, self.netns), capture_output=True, text=True, check=False
        )

    def iptables(self, flavour: str) -> IptablesBackend | None:
        """The backend to read (and remove through); None: no kube-proxy chain is there."""
        from kproxy.dataplane.iptables.backend import IptablesBackend

        return IptablesBackend(flavour, netns=self.netns)

    def nft_tables(self) -> TableBackend | None:
        """The nftables tables (and their removal); None: no nft here."""
        if shutil.which("nft") is None:
            return None
        from kproxy.dataplane.nftables.backend import NftBackend

        return NftBackend(netns=self.netns)

    def nft_table_exists(self, family: str, name: str) -> bool:
        """One table looked up by name (listing every table dumps all of their objects
        first: 28 s at 10,000 services on an iptables-nft node)."""
        if shutil.which("nft") is None:
            return False
        from kproxy.dataplane.nftables.backend import NftBackend

        return NftBackend(netns=self.netns).table_exists(family, name)
