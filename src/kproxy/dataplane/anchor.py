"""A conntrack anchor: one tiny rule that keeps connection tracking alive in a namespace.

The kernel runs conntrack in a namespace only while some rule uses it.
When the last such rule goes, for example between removing one proxy mode's rules and
installing the next, established NAT connections are forwarded untranslated and die. The
anchor holds conntrack for the whole of a mode switch. It is an nftables table when
nftables works here, else an iptables-legacy chain (UML kernels lack nf_tables for ip).
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from collections.abc import Sequence

from kproxy.host.commands import in_netns, run_command

log = logging.getLogger("kproxy.anchor")

TABLE = "kproxy-anchor"
CHAIN = "KPROXY-CT-ANCHOR"
# Both halves are needed (measured here): a rule using conntrack keeps tracking on, and
# nat-type base chains keep the NAT hooks registered, without which established
# connections lose their translation even though conntrack still knows them.
NFT_ANCHOR = f"""\
add table ip {TABLE} {{ comment "kproxy: keeps conntrack and NAT active during a mode switch" ; }}
add chain ip {TABLE} ct-anchor {{ type filter hook prerouting priority -150 ; policy accept ; }}
flush chain ip {TABLE} ct-anchor
add rule ip {TABLE} ct-anchor ct state invalid counter
add chain ip {TABLE} nat-prerouting {{ type nat hook prerouting priority 100 ; policy accept ; }}
add chain ip {TABLE} nat-input {{ type nat hook input priority 100 ; policy accept ; }}
add chain ip {TABLE} nat-output {{ type nat hook output priority 100 ; policy accept ; }}
add chain ip {TABLE} nat-postrouting {{ type nat hook postrouting priority 200 ; policy accept ; }}
"""


class ConntrackAnchor:
    def __init__(self, netns: str | None = None, *, use_nft: bool = True) -> None:
        self.netns = netns
        self.use_nft = use_nft
        self.kind: str | None = None

    def _run(
        self, argv: Sequence[str], data: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        argv = in_netns(argv, self.netns)
        return run_command(argv, data)

    def install(self) -> str:
        """Put the anchor in place (idempotent); returns "nftables" or "iptables-legacy"."""
        nft = self.use_nft and shutil.which("nft") is not None
        if nft and self._run(["nft", "-f", "-"], NFT_ANCHOR).returncode == 0:
            self.kind = "nftables"
        else:
            # Listing the legacy nat table instantiates it, which registers the NAT hooks.
            self._run(["iptables-legacy", "-t", "nat", "-S"])
            self._run(["iptables-legacy", "-t", "mangle", "-N", CHAIN])
            rule = ["-m", "conntrack", "--ctstate", "INVALID"]
            rule += ["-m", "comment", "--comment", "kproxy anchor"]
            if self._run(["iptables-legacy", "-t", "mangle", "-C", CHAIN, *rule]).returncode != 0:
                proc = self._run(["iptables-legacy", "-t", "mangle", "-A", CHAIN, *rule])
                if proc.returncode != 0:
                    raise RuntimeError(f"cannot install a conntrack anchor: {proc.stderr.strip()}")
            self.kind = "iptables-legacy"
        log.info("conntrack anchor in place (%s)", self.kind)
        return self.kind

    def present(self) -> bool:
        if self._run(["nft", "list", "table", "ip", TABLE]).returncode == 0:
            return True
        return shutil.which("iptables-legacy") is not None and (
            self._run(["iptables-legacy", "-t", "mangle", "-S", CHAIN]).returncode == 0
        )

    def remove(self) -> None:
        if shutil.which("nft"):
            self._run(["nft", "delete", "table", "ip", TABLE])
        if self.kind == "iptables-legacy":
            self._run(["iptables-legacy", "-t", "mangle", "-F", CHAIN])
            self._run(["iptables-legacy", "-t", "mangle", "-X", CHAIN])
        self.kind = None
