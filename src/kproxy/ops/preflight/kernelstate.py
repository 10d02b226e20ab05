"""The node's dataplane as ops.snapshot.take() records it, read section by section on demand.

Same document shape and commands as take(), with one difference that matters at scale:
the nftables section lists only kube-proxy's own tables (`nft -j list table ip
kube-proxy`), not the whole ruleset. On an iptables-nft node the ruleset holds every
iptables rule too: at 10,000 services `nft -j list ruleset` took 54 s here and even
`nft list tables` 28 s (nft fetches its whole cache), while the table listing takes 0.4 s.
A check that needs nothing of a section never runs its command.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Iterator, Mapping
from typing import Any

from kproxy.ops.preflight.access import NodeAccess
from kproxy.ops.snapshot import FORMAT

NFT_TABLES = (("ip", "kube-proxy"), ("ip6", "kube-proxy"))

_COMMANDS: dict[str, list[str]] = {
    "iptables-nft": ["iptables-nft-save"],
    "iptables-legacy": ["iptables-legacy-save"],
    "ipset": ["ipset", "save"],
    "ipvs": ["ipvsadm", "-S", "-n"],
    "kube-ipvs0": ["ip", "-j", "addr", "show", "dev", "kube-ipvs0"],
}
SECTIONS = (*_COMMANDS, "nftables")


class KernelState(Mapping[str, Any]):
    def __init__(self, access: NodeAccess) -> None:
        self.access = access
        self._meta: dict[str, Any] = {
            "format": FORMAT,
            "taken_at": time.time(),
            "host": platform.node(),
            "kernel": access.kernel_release(),
            "netns": access.netns,
        }
        self._sections: dict[str, Any] = {}

    def _section(self, argv: list[str]) -> dict[str, Any]:
        proc = self.access.run(argv)
        return {
            "command": " ".join(argv),
            "ok": proc.returncode == 0,
            "output": proc.stdout if proc.returncode == 0 else "",
            "error": (proc.stderr or "").strip(),
        }

    def _nftables(self) -> dict[str, Any]:
        items: list[Any] = []
        errors = []
        for family, name in NFT_TABLES:
            proc = self.access.run(["nft", "-j", "list", "table", family, name])
            if proc.returncode == 0:
                try:
                    items += json.loads(proc.stdout or "{}").get("nftables", [])
                except ValueError as err:
                    errors.append(f"{family} {name}: {err}")
            elif "No such file or directory" not in proc.stderr:
                errors.append(f"{family} {name}: {proc.stderr.strip()}")
        return {
            "command": "nft -j list table ip kube-proxy; nft -j list table ip6 kube-proxy",
            "ok": not errors,
            "output": json.dumps({"nftables": items}),
            "error": "; ".join(errors),
        }

    def __getitem__(self, key: str) -> Any:
        if key in self._meta:
            return self._meta[key]
        if key == "conntrack":
            return {
                "count": self.access.sysctl_int("net/netfilter/nf_conntrack_count"),
                "max": self.access.sysctl_int("net/netfilter/nf_conntrack_max"),
            }
        if key not in SECTIONS:
            raise KeyError(key)
        if key not in self._sections:
            self._sections[key] = (
                self._nftables() if key == "nftables" else self._section(_COMMANDS[key])
            )
        return self._sections[key]

    def __iter__(self) -> Iterator[str]:
        yield from self._meta
        yield from SECTIONS
        yield "conntrack"

    def __len__(self) -> int:
        return len(self._meta) + len(SECTIONS) + 1

    def document(self) -> dict[str, Any]:
        """Every section read (the ones not read yet now), as one JSON-able dict."""
        return {k: self[k] for k in self}
