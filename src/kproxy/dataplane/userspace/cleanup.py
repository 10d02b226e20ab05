"""What of a node is userspace mode's: its chains (kept by a leftover cleanup while it runs)
and, for a node running another mode, the workers and the policy route it left."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kproxy.dataplane.base import OwnedObject
from kproxy.dataplane.userspace.control import SUBDIR
from kproxy.dataplane.userspace.render import CANARY_CHAIN, CHAINS, ROUTE_TABLE, RULE_PRIORITY

if TYPE_CHECKING:
    from kproxy.dataplane.kernel_dump import KernelDump

OUR_CHAINS = frozenset(c for chains in CHAINS.values() for c in chains)


def userspace_chain(chain: str) -> bool:
    """The chains userspace mode writes (a leftover cleanup in this mode keeps them)."""
    return chain in OUR_CHAINS or chain == CANARY_CHAIN


def keeps_chain(_table: str, chain: str) -> bool:
    return userspace_chain(chain)


def leftovers(dump: KernelDump, *, remove: bool) -> list[OwnedObject]:
    """The workers of the dump's state dir and the policy route, removed unless not remove,
    when userspace mode left a trace of them (its state subdirectory, its rule or route):
    the listing itself loads the whole mode."""
    traces = (dump.state_dir / SUBDIR).exists() or any(
        dump.run(["ip", *argv]).stdout.strip()
        for argv in (
            ["rule", "show", "pref", str(RULE_PRIORITY)],
            ["route", "show", "table", str(ROUTE_TABLE)],
        )
    )
    if not traces:
        return []
    from kproxy.dataplane.userspace.proxier import clean_userspace_leftovers

    return clean_userspace_leftovers(dump.state_dir, netns=dump.netns, dry_run=not remove)
