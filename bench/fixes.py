"""Bench-side stand-ins for src/ fixes, used only when the production code fails a load.

The bench always tries the production IptablesDataplane first. When it fails in a way
listed here, the figures of that load come from the patched subclass below and the failure
is listed under "Problems" in BENCHMARKS.md, so a regression is measured and reported
instead of aborting the run.

Bug 1 (src/kproxy/dataplane/iptables/proxier.py, IptablesDataplane._pieces): on the nft
backend a full sync of more than SPLIT_THRESHOLD services is split, and the service-chain
pieces go first. Their KUBE-SVC rules jump to KUBE-MARK-MASQ, which only the later
top-level piece declares, so in an empty namespace (a fresh node) piece 1 is rejected:
"Chain 'KUBE-MARK-MASQ' does not exist". The sync then fails forever (every retry is a
full sync that starts with the same piece).
Fixed in src by 2f6f15a (a piece 0 creates the missing top-level chains first); the
fallback stays for regressions. Workaround here: the first piece also (re)writes
KUBE-MARK-MASQ with its single rule, an atomic flush-and-rewrite with identical content,
so it is harmless on a resync too.
"""

from __future__ import annotations

from typing import Any

from kproxy.dataplane.iptables.proxier import IptablesDataplane
from kproxy.dataplane.iptables.render import IptablesPlan

BUG1_MESSAGE = "Chain 'KUBE-MARK-MASQ' does not exist"


class MarkMasqFirstDataplane(IptablesDataplane):
    """IptablesDataplane whose split full sync declares KUBE-MARK-MASQ in its first piece."""

    def _pieces(self, plan: IptablesPlan, *args: Any, **kwargs: Any) -> list[str]:
        pieces: list[str] = super()._pieces(plan, *args, **kwargs)
        if len(pieces) < 2 or not pieces[0].startswith("*nat\n"):
            return pieces
        mark = self.options.masquerade_mark
        head = f"*nat\n:KUBE-MARK-MASQ - [0:0]\n-A KUBE-MARK-MASQ -j MARK --or-mark {mark}\n"
        return [head + pieces[0][len("*nat\n") :], *pieces[1:]]
