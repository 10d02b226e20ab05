"""The layouts of nftables mode, the one place that knows which exist: upstream's (the
default, `table ip kube-proxy`, drop-in compatible) and kproxy's compact one (compact.py,
`table ip kproxy-compact`), and how kproxy names them.

Naming: the config's `mode` and the Node's mode annotation stay `nftables` in both layouts
(upstream's schema has no layout); everything kproxy reports about a node's dataplanes
(the readers of list/trace/verify/doctor, snapshot sections, leftovers, switch records)
names nftables mode in a layout by dataplane_name(): `nftables` for upstream's, as
before, `nftables-compact` for the compact one. A switch names its target as a mode and,
for nftables, a layout (`kproxy switch --to nftables --nftables-layout compact`);
target_name() is that pair as one word, parse_target() its inverse.

Cheap to import (no planner): the registry, the readers and the daemon use the names.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Final

from kproxy.dataplane.nftables import names as n

if TYPE_CHECKING:
    from kproxy.dataplane.facts import NodeFacts, RuleOptions
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


MODE: Final = "nftables"
# The tables each layout's dataplane owns (family, name): what it removes, and what is left
# over of it while the other layout runs.
OWN_TABLES: Final = {
    UPSTREAM: (("ip", n.TABLE), ("ip6", n.TABLE)),
    COMPACT: (("ip", n.COMPACT_TABLE),),
}


def dataplane_name(layout: str) -> str:
    """ "nftables" (upstream's layout) or "nftables-compact"."""
    return MODE if layout == UPSTREAM else f"{MODE}-{check_layout(layout)}"


DATAPLANES: Final = {dataplane_name(layout): layout for layout in LAYOUTS}


def target_name(mode: str, layout: str | None) -> str:
    """A switch target as one word: the mode, or nftables mode's dataplane name."""
    return dataplane_name(layout) if mode == MODE and layout else mode


def parse_target(name: str) -> tuple[str, str | None]:
    """target_name()'s inverse: "nftables-compact" -> ("nftables", "compact"); "nftables" ->
    ("nftables", None) (the layout left to whoever creates it); other modes -> (mode, None)."""
    if name in DATAPLANES and name != MODE:
        return MODE, DATAPLANES[name]
    return name, None


def switch_layout(mode: str, named: str | None, started_with: str | None) -> str | None:
    """nftables mode's layout a switch to `mode` goes to: the one named, else the one the
    running kproxy was started with (`kproxy run --nftables-layout`), else the default;
    None for other modes."""
    if mode != MODE:
        return None
    return check_layout(named or started_with or DEFAULT_LAYOUT)


def describe(mode: str, layout: str | None) -> str:
    """For messages: "nftables (compact layout)"; a mode alone otherwise."""
    return f"{mode} ({layout} layout)" if mode == MODE and layout and layout != UPSTREAM else mode


def make_planner(
    layout: str, facts: NodeFacts, options: RuleOptions, *, service_cidrs: Iterable[str] = ()
) -> NftablesPlanner:
    """The planner of a layout."""
    from kproxy.dataplane.nftables.plan import NftablesPlanner

    if check_layout(layout) == COMPACT:
        from kproxy.dataplane.nftables.compact import CompactPlanner

        return CompactPlanner(facts, options, service_cidrs=service_cidrs)
    return NftablesPlanner(facts, options, service_cidrs=service_cidrs)
