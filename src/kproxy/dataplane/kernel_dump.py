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
from kproxy.host.commands import in_netns, run_command

if TYPE_CHECKING:
    from kproxy.dataplane.iptables.backend import IptablesBackend
    from kproxy.dataplane.nftables.cleanup import TableBackend

IPTABLES_FLAVOURS = ("nft", "legacy")
IPTABLES_TABLES = frozenset(("filter", "nat", "mangle", "raw", "security"))


class KernelDump:
    def __init__(self, netns: str | None = None, *, state_dir: Path | None = None) -> None:
        self.netns = netns
        self.state_dir = state_dir or DEFAULT_STATE_DIR

    def run(self, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        """A command inside the namespace."""
        return run_command(in_netns(argv, self.netns))

    def iptables(self, flavour: str) -> IptablesBackend | None:
        """The backend to read (and remove through); None: no kube-proxy chain is there,
        because the flavour has no table at all (then a scan costs one cheap look)."""
        from kproxy.dataplane.iptables.backend import IptablesBackend

        if not self.iptables_tables_exist(flavour):
            return None
        return IptablesBackend(flavour, netns=self.netns)

    def iptables_tables_exist(self, flavour: str) -> bool:
        """Whether the flavour has any table here; True when that cannot be told. Legacy's
        tables are named in /proc; iptables-nft's are nf_tables tables of the ip family
        with iptables' table names, seen in one netlink table listing."""
        if flavour == "legacy":
            names = self.legacy_tables()
            return names is None or bool(names)
        from kproxy.dataplane.nftables.backend import NftBackend, NftError

        try:
            tables = NftBackend(netns=self.netns).tables()
        except (NftError, OSError):
            return True
        return any(t.family == "ip" and t.name in IPTABLES_TABLES for t in tables)

    def iptables_chains(self, flavour: str) -> list[str]:
        """The names of every chain in the flavour's iptables tables, no rule read where
        the backend allows: iptables-nft's from one netlink chain dump (nft's own listing
        would first cache every object of every table, kube-proxy's nft table included),
        legacy's from its save (the kernel hands the whole table over in any case), only
        when it has a table."""
        if flavour == "nft":
            if not self.iptables_tables_exist("nft"):
                return []  # an nftables node's own chains would all be dumped for nothing
            return [
                name
                for table, names in self.nft_chains_by_table("ip").items()
                if table in IPTABLES_TABLES
                for name in names
            ]
        if self.legacy_tables() == []:
            return []
        save = self.run(["iptables-legacy-save"])
        return [
            line[1:].split()[0]
            for line in save.stdout.splitlines()
            if line.startswith(":") and len(line) > 1
        ]

    def iptables_chain_listing(self, flavour: str) -> dict[str, list[str]] | None:
        """iptables-nft: every chain name per iptables table, from one netlink dump (no
        rule read); None for legacy, or when that dump is not possible here."""
        listed = self.nft_chain_listing("ip") if flavour == "nft" else None
        if listed is None:
            return None
        return {table: names for table, names in listed.items() if table in IPTABLES_TABLES}

    def legacy_tables(self) -> list[str] | None:
        """The tables iptables-legacy has here (None: that cannot be told). Named in /proc:
        a legacy tool that reads a missing table creates it, and it stays until the
        namespace goes."""
        names = self.run(["cat", "/proc/net/ip_tables_names"])
        return names.stdout.split() if names.returncode == 0 else None

    def chain_rules(self, flavour: str, table: str, chain: str) -> list[str]:
        """The '-A' lines of one iptables chain, none when it or its table is not there,
        read alone (`iptables -S CHAIN`: iptables-nft fetches that chain only, where a
        save fetches every rule of the family)."""
        from kproxy.dataplane.iptables.backend import IptablesBackend, IptablesError

        if flavour == "legacy" and table not in (self.legacy_tables() or ()):
            return []
        backend = IptablesBackend(flavour, netns=self.netns, runner=self.tool_runner)
        try:
            return backend.list_chain(table, chain) or []
        except IptablesError:
            return []

    def tool_runner(
        self, argv: Sequence[str], input_data: str | None
    ) -> subprocess.CompletedProcess[str]:
        """The runner of the tools given netns= (they enter the namespace themselves)."""
        return run_command(argv, input_data)

    def nft_chains_by_table(self, family: str) -> dict[str, list[str]]:
        """Every chain name of one nftables family, per table (names only, over netlink)."""
        return self.nft_chain_listing(family) or {}

    def nft_chain_listing(self, family: str) -> dict[str, list[str]] | None:
        """nft_chains_by_table(), None when the dump is not possible here."""
        from kproxy.dataplane.nftables.netlink import NetlinkError, NftNetlink

        try:
            client = NftNetlink(self.netns, family=family)
            try:
                return client.chains_by_table()
            finally:
                client.close()
        except (NetlinkError, OSError, KeyError):
            return None

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
