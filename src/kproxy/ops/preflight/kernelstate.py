"""The node's dataplane as ops.snapshot.take() records it, read section by section on demand.

Same document shape and commands as take() (the nftables section, kube-proxy's own
tables, comes from the same function); a check that needs nothing of a section never
runs its command. At 10,000 services on an iptables-nft node reading a section it does
not need costs seconds.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Iterator, Mapping
from typing import Any

from kproxy.ops.preflight.access import NodeAccess
from kproxy.ops.snapshot import FORMAT, nftables_section
from kproxy.ops.snapshot import SECTIONS as SNAPSHOT_SECTIONS

# The command of each section (None: the nftables tables), as ops.snapshot.take() reads them.
_COMMANDS: dict[str, tuple[str, ...] | None] = dict(SNAPSHOT_SECTIONS)
SECTIONS = tuple(_COMMANDS)


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

    def _nftables(self, section: str) -> dict[str, Any]:
        def run(argv: list[str]) -> tuple[int, str, str]:
            proc = self.access.run(argv)
            return proc.returncode, proc.stdout or "", proc.stderr or ""

        return nftables_section(run, section)

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
            argv = _COMMANDS[key]
            self._sections[key] = self._nftables(key) if argv is None else self._section(list(argv))
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
