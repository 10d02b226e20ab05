"""`kproxy render --proxy-mode nftables`: the transaction a first full sync applies."""

from __future__ import annotations

from collections.abc import Iterable

from kproxy.dataplane.facts import NodeFacts, RuleOptions
from kproxy.dataplane.nftables.layouts import DEFAULT_LAYOUT, make_planner
from kproxy.dataplane.nftables.transaction import TableState, write_sync
from kproxy.model.objects import Snapshot


def render_full(
    snapshot: Snapshot,
    facts: NodeFacts,
    options: RuleOptions,
    *,
    service_cidrs: Iterable[str] = (),
    layout: str = DEFAULT_LAYOUT,
) -> str:
    """The `nft -f` script of a full sync onto a node without the layout's table: one
    command per line, valid input for `nft -f`, deterministic (services by name)."""
    plan = make_planner(layout, facts, options, service_cidrs=service_cidrs).plan(snapshot)
    return write_sync(plan, TableState(), full=True, recreate_base_chains=True).tx.text()
