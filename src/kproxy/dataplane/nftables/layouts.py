"""The layouts of nftables mode, the one place that knows which exist: upstream's (the
default, `table ip kube-proxy`, drop-in compatible) and kproxy's compact one (compact.py,
`table ip kproxy-compact`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from kproxy.dataplane.facts import NodeFacts, RuleOptions
from kproxy.dataplane.nftables import names as n
from kproxy.dataplane.nftables.plan import NftablesPlanner

UPSTREAM: Final = "upstream"
COMPACT: Final = "compact"
LAYOUTS: Final = (UPSTREAM, COMPACT)
DEFAULT_LAYOUT: Final = UPSTREAM
TABLES: Final = {UPSTREAM: n.TABLE, COMPACT: n.COMPACT_TABLE}


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown nftables layout {layout!r} (known: {', '.join(LAYOUTS)})")
    return layout


def make_planner(
    layout: str, facts: NodeFacts, options: RuleOptions, *, service_cidrs: Iterable[str] = ()
) -> NftablesPlanner:
    """The planner of a layout."""
    if check_layout(layout) == COMPACT:
        from kproxy.dataplane.nftables.compact import CompactPlanner

        return CompactPlanner(facts, options, service_cidrs=service_cidrs)
    return NftablesPlanner(facts, options, service_cidrs=service_cidrs)
