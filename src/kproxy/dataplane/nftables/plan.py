"""Plan nftables mode: Snapshot -> the desired contents of `table ip kube-proxy`.

Pure and deterministic (no kernel, no clock). The plan is a description of objects (the
fixed table setup, and per service port its chains, rules, affinity sets and map/set
elements), not a transaction: transaction.py turns a plan plus what the kernel already holds
into `nft -f` text. A second ("compact") layout can therefore be a sibling planner that
produces the same kinds of objects.

Layout and rule text are upstream kube-proxy's nftables mode (pkg/proxy/nftables/proxier.go
at kubernetes@531be812, whose expected outputs kubernetes@030880a5 proxier_test.go spells
out); services are planned sorted by ServicePortName. Each service's block is cached while
its ServicePort value is unchanged, which keeps partial syncs cheap. compact.py is the
sibling planner of kproxy's own "compact" layout; both share this module's table setup,
containers and the filter-side objects of a service port (`filter_side`).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from kproxy.dataplane.facts import NodeFacts, RuleOptions
from kproxy.dataplane.nftables import names as n
from kproxy.dataplane.nodepolicy import (
    NodePortAddresses,
    effective_node_port_addresses,
    local_traffic_detector,
)
from kproxy.model.objects import Endpoint, Lineage, ServicePort, ServicePortName, Snapshot

FAMILY = "ip"
ADDR_TYPE = "ipv4_addr"
NO_LOCALHOST = "ip daddr != 127.0.0.0/8"

# Base-chain priorities as numbers: nft 1.0.6 rejects the name "dstnat" on the output hook
# (measured), and upstream's knftables writes numbers for the same reason.
PRIORITY_DSTNAT = -100
PRIORITY_FILTER = 0
PRIORITY_SRCNAT = 100


@dataclass(frozen=True, slots=True)
class BaseChain:
    name: str
    type: str
    hook: str
    priority: int


BASE_CHAINS = (
    # Filter chains that must see the pre-DNAT destination (LoadBalancerSourceRanges).
    BaseChain(n.FILTER_PREROUTING_PRE_DNAT, "filter", "prerouting", PRIORITY_DSTNAT - 10),
    BaseChain(n.FILTER_OUTPUT_PRE_DNAT, "filter", "output", PRIORITY_DSTNAT - 10),
    BaseChain(n.FILTER_INPUT, "filter", "input", PRIORITY_FILTER),
    BaseChain(n.FILTER_FORWARD, "filter", "forward", PRIORITY_FILTER),
    BaseChain(n.FILTER_OUTPUT, "filter", "output", PRIORITY_FILTER),
    BaseChain(n.NAT_PREROUTING, "nat", "prerouting", PRIORITY_DSTNAT),
    BaseChain(n.NAT_OUTPUT, "nat", "output", PRIORITY_DSTNAT),
    BaseChain(n.NAT_POSTROUTING, "nat", "postrouting", PRIORITY_SRCNAT),
)

# (jumped-to chain, base chain it is jumped to from, extra match), in upstream's order.
JUMPS = (
    (n.NODEPORT_ENDPOINTS_CHECK_CHAIN, n.FILTER_INPUT, "ct state new"),
    (n.SERVICE_ENDPOINTS_CHECK_CHAIN, n.FILTER_INPUT, "ct state new"),
    (n.SERVICE_ENDPOINTS_CHECK_CHAIN, n.FILTER_FORWARD, "ct state new"),
    (n.SERVICE_ENDPOINTS_CHECK_CHAIN, n.FILTER_OUTPUT, "ct state new"),
    (n.FIREWALL_CHECK_CHAIN, n.FILTER_PREROUTING_PRE_DNAT, "ct state new"),
    (n.FIREWALL_CHECK_CHAIN, n.FILTER_OUTPUT_PRE_DNAT, "ct state new"),
    (n.SERVICES_CHAIN, n.NAT_OUTPUT, ""),
    (n.SERVICES_CHAIN, n.NAT_PREROUTING, ""),
    (n.MASQUERADING_CHAIN, n.NAT_POSTROUTING, ""),
    (n.CLUSTER_IPS_CHECK_CHAIN, n.FILTER_FORWARD, "ct state new"),
    (n.CLUSTER_IPS_CHECK_CHAIN, n.FILTER_OUTPUT, "ct state new"),
)
# Further top-level chains that must exist (created after the jumped-to ones).
OTHER_TOP_CHAINS = (
    n.SERVICES_CHAIN,
    n.CLUSTER_IPS_CHECK_CHAIN,
    n.MASQUERADING_CHAIN,
    n.MARK_MASQ_CHAIN,
)

VMAP_TYPE = f"{ADDR_TYPE} . inet_proto . inet_service : verdict"
PORT_VMAP_TYPE = "inet_proto . inet_service : verdict"
# (kind, name, type, comment) of the fixed sets and maps.
CONTAINERS = {
    n.CLUSTER_IPS_SET: ("set", ADDR_TYPE, "Active ClusterIPs"),
    n.NODEPORT_IPS_SET: ("set", ADDR_TYPE, "IPs that accept NodePort traffic"),
    n.NO_ENDPOINT_SERVICES_MAP: (
        "map",
        VMAP_TYPE,
        "vmap to drop or reject packets to services with no endpoints",
    ),
    n.NO_ENDPOINT_NODEPORTS_MAP: (
        "map",
        PORT_VMAP_TYPE,
        "vmap to drop or reject packets to service nodeports with no endpoints",
    ),
    n.FIREWALL_IPS_MAP: (
        "map",
        VMAP_TYPE,
        "destinations that are subject to LoadBalancerSourceRanges",
    ),
    n.SERVICE_IPS_MAP: ("map", VMAP_TYPE, "ClusterIP, ExternalIP and LoadBalancer IP traffic"),
    n.SERVICE_NODEPORTS_MAP: ("map", PORT_VMAP_TYPE, "NodePort traffic"),
}
# The compact layout's containers (compact.py). The endpoint maps are declared with
# `typeof`: a numgen value has no named type nft accepts in a concatenation. There is one
# map per protocol because the data must name it: nft 1.0.6 cannot read `th dport` back
# there (it then rejects every later transaction on the table), and a `tcp dport` in the
# data makes nft put `meta l4proto tcp` in front of the DNAT of every rule using the map.
_ENDPOINT_MAP_TYPES = {
    n.SERVICE_ENDPOINTS_MAP: (
        "ip daddr . meta l4proto . th dport . numgen random mod 1",
        f"{ADDR_TYPE} . inet_proto . inet_service . numgen",
        "endpoint of a service address by its numgen slot",
    ),
    n.NODEPORT_ENDPOINTS_MAP: (
        "meta l4proto . th dport . numgen random mod 1",
        "inet_proto . inet_service . numgen",
        "endpoint of a service nodeport by its numgen slot",
    ),
}
for _base, (_key, _, _comment) in _ENDPOINT_MAP_TYPES.items():
    for _proto in n.ENDPOINT_MAP_PROTOCOLS:
        CONTAINERS[n.endpoint_map(_base, _proto)] = (
            "map",
            f"typeof {_key} : ip daddr . {_proto} dport",
            f"{_comment} ({_proto})",
        )
CONTAINERS[n.HAIRPIN_SET] = (
    "set",
    f"{ADDR_TYPE} . {ADDR_TYPE}",
    "endpoint IP . the same IP: a connection an endpoint makes to itself",
)
# Key and value types of the containers declared with typeof, in netlink.encode_key's terms.
NETLINK_TYPES = {
    n.endpoint_map(base, proto): (key_type, f"{ADDR_TYPE} . inet_service")
    for base, (_, key_type, _) in _ENDPOINT_MAP_TYPES.items()
    for proto in n.ENDPOINT_MAP_PROTOCOLS
}


def type_clause(type_: str) -> str:
    """The `type X` / `typeof X` clause of a container's definition."""
    return type_ if type_.startswith("typeof ") else f"type {type_}"


def netlink_types(container: str) -> tuple[str, str | None]:
    """(key type, data type or None for sets and verdict maps) of a container."""
    if container in NETLINK_TYPES:
        return NETLINK_TYPES[container]
    return CONTAINERS[container][1].split(" : ", 1)[0], None


# The containers whose elements belong to services (diffed every sync, like upstream's
# nftElementStorage); nodeport-ips is rewritten on full syncs only.
SERVICE_CONTAINERS = (
    n.CLUSTER_IPS_SET,
    n.SERVICE_IPS_MAP,
    n.FIREWALL_IPS_MAP,
    n.NO_ENDPOINT_SERVICES_MAP,
    n.NO_ENDPOINT_NODEPORTS_MAP,
    n.SERVICE_NODEPORTS_MAP,
)
COMPACT_SERVICE_CONTAINERS = (
    *SERVICE_CONTAINERS,
    *n.ENDPOINT_MAPS,
    n.HAIRPIN_SET,
)
# Either layout's: what a writer of elements treats as service-owned.
ALL_SERVICE_CONTAINERS = frozenset(COMPACT_SERVICE_CONTAINERS)
REJECT_CHAIN_COMMENT = "helper for @no-endpoint-services / @no-endpoint-nodeports"


class Element(NamedTuple):
    """One element of a set (value "") or verdict map, in nft's own text form. A tuple: a
    full sync handles hundreds of thousands of them."""

    container: str
    key: str  # "172.30.0.41 . tcp . 80"
    value: str = ""  # "goto service-...", "drop"
    comment: str | None = None


@dataclass(frozen=True, slots=True)
class Chain:
    name: str
    rules: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class AffinitySet:
    name: str
    timeout: int


@dataclass(frozen=True, slots=True)
class ServiceBlock:
    """Everything one service port owns in the table."""

    name: ServicePortName
    # Chains in the order upstream creates them (endpoint chains first).
    chains: tuple[Chain, ...]
    endpoint_chains: frozenset[str]
    affinity_sets: tuple[AffinitySet, ...]
    elements: tuple[Element, ...]
    # For sync_proxy_rules_no_local_endpoints_total.
    no_local_internal: bool = False
    no_local_external: bool = False
    rule_count: int = 0
    # Chains the block uses that other blocks share (the compact layout's dispatch chains).
    shared: tuple[str, ...] = ()


@dataclass(frozen=True)
class TableSetup:
    """The fixed part of the table, rewritten on every full sync (upstream's setupNFTables).

    Each field is one step of upstream's order; transaction.write_setup writes them."""

    base_chains: tuple[BaseChain, ...]
    # (jumped-to chain, base chain, rule in the base chain)
    jumps: tuple[tuple[str, str, str], ...]
    top_chains: tuple[str, ...]
    masquerade_rules: tuple[tuple[str, str], ...]
    cluster_ips_check_rules: tuple[str, ...]
    # None: nodePortAddresses matches every local address (the set is deleted).
    nodeport_ips: tuple[str, ...] | None
    service_endpoints_check_rule: str
    nodeport_endpoints_check_rule: str
    firewall_check_rule: str
    services_rules: tuple[str, ...]
    mark: str
    table: str = n.TABLE
    table_comment: str = n.TABLE_COMMENT
    # The containers whose elements services own (diffed on every sync).
    service_containers: tuple[str, ...] = SERVICE_CONTAINERS
    # Containers created right after the table (setup rules refer to them).
    early_containers: tuple[str, ...] = ()
    # Service elements go to the kernel over netlink, all of a sync's changes in one batch
    # (Transaction.netlink_adds); a full sync adds them in plan order as bulk ops and
    # refills the containers rather than diffing them against a listing.
    netlink_element_adds: bool = False

    @property
    def rules(self) -> list[tuple[str, str]]:
        """Every (chain, rule) of the setup, in the order they are written."""
        out = [(src, rule) for _, src, rule in self.jumps]
        out += self.masquerade_rules
        out += [(n.CLUSTER_IPS_CHECK_CHAIN, r) for r in self.cluster_ips_check_rules]
        out += [
            (n.REJECT_CHAIN, "reject"),
            (n.SERVICE_ENDPOINTS_CHECK_CHAIN, self.service_endpoints_check_rule),
            (n.NODEPORT_ENDPOINTS_CHECK_CHAIN, self.nodeport_endpoints_check_rule),
            (n.FIREWALL_CHECK_CHAIN, self.firewall_check_rule),
        ]
        out += [(n.SERVICES_CHAIN, r) for r in self.services_rules]
        return out


@dataclass
class NftablesPlan:
    setup: TableSetup
    blocks: dict[ServicePortName, ServiceBlock] = field(default_factory=dict)
    # Rules in all blocks (kept by the planner, so a plan need not count them).
    block_rules: int = 0
    # The blocks of the planner's previous plan, and what changed since: service ports whose
    # block was built anew, and those that are gone (lets a writer skip unchanged ports).
    base: dict[ServicePortName, ServiceBlock] | None = None
    rebuilt: set[ServicePortName] = field(default_factory=set)
    removed: set[ServicePortName] = field(default_factory=set)
    # Chains that blocks share (by name), and their rules in total.
    shared: dict[str, Chain] = field(default_factory=dict)
    shared_rules: int = 0

    def service_chains(self) -> set[str]:
        return {c.name for b in self.blocks.values() for c in b.chains}

    def affinity_sets(self) -> dict[str, int]:
        return {s.name: s.timeout for b in self.blocks.values() for s in b.affinity_sets}

    def elements(self) -> dict[str, dict[str, Element]]:
        """container -> key -> element; for a key two services claim, the later (in
        ServicePortName order) wins, as the last writer does upstream."""
        out: dict[str, dict[str, Element]] = {c: {} for c in self.setup.service_containers}
        for name in sorted(self.blocks):
            for el in self.blocks[name].elements:
                out[el.container][el.key] = el
        return out

    @property
    def rules_total(self) -> int:
        return len(self.setup.rules) + self.block_rules + self.shared_rules


def nodeport_addresses(options: RuleOptions, facts: NodeFacts) -> tuple[str, ...] | None:
    """IPv4 addresses NodePorts answer on; None = every local address (match-all).

    nftables mode reads an empty nodePortAddresses as "primary" and never serves NodePorts
    on loopback addresses."""
    entries = effective_node_port_addresses(options.node_port_addresses, "nftables")
    return NodePortAddresses.from_entries(entries).addresses(
        facts.node_ips, facts.local_addresses, include_loopback=False
    )


def table_setup(
    facts: NodeFacts, options: RuleOptions, service_cidrs: Iterable[str] = ()
) -> TableSetup:
    mark = options.masquerade_mark
    jumps = tuple(
        (dst, src, f"{extra} jump {dst}" if extra else f"jump {dst}") for dst, src, extra in JUMPS
    )
    top: list[str] = []
    for chain in [dst for dst, _, _ in JUMPS] + list(OTHER_TOP_CHAINS):
        if chain not in top:
            top.append(chain)
    check = [
        f'ip daddr @{n.CLUSTER_IPS_SET} reject comment "Reject traffic to invalid ports of'
        ' ClusterIPs"'
    ]
    cidrs = [str(ipaddress.ip_network(c, strict=False)) for c in service_cidrs if ":" not in c]
    if cidrs:
        check.append(
            f'ip daddr {{ {",".join(cidrs)} }} drop comment "Drop traffic to unallocated'
            ' ClusterIPs"'
        )
    np_ips = nodeport_addresses(options, facts)
    vmap = "meta l4proto . th dport vmap"
    np_match = NO_LOCALHOST if np_ips is None else f"ip daddr @{n.NODEPORT_IPS_SET}"
    np_dispatch = f"fib daddr type local {NO_LOCALHOST}" if np_ips is None else np_match
    dest = "ip daddr . meta l4proto . th dport vmap"
    return TableSetup(
        base_chains=BASE_CHAINS,
        jumps=jumps,
        top_chains=tuple(top),
        masquerade_rules=(
            (n.MARK_MASQ_CHAIN, f"mark set mark or {mark}"),
            (n.MASQUERADING_CHAIN, f"mark and {mark} == 0 return"),
            (n.MASQUERADING_CHAIN, f"mark set mark xor {mark}"),
            (n.MASQUERADING_CHAIN, "masquerade fully-random"),
        ),
        cluster_ips_check_rules=tuple(check),
        nodeport_ips=np_ips,
        service_endpoints_check_rule=f"{dest} @{n.NO_ENDPOINT_SERVICES_MAP}",
        nodeport_endpoints_check_rule=f"{np_match} {vmap} @{n.NO_ENDPOINT_NODEPORTS_MAP}",
        firewall_check_rule=f"{dest} @{n.FIREWALL_IPS_MAP}",
        services_rules=(
            f"{dest} @{n.SERVICE_IPS_MAP}",
            f"{np_dispatch} {vmap} @{n.SERVICE_NODEPORTS_MAP}",
        ),
        mark=mark,
    )


class NftablesPlanner:
    """Builds plans; keeps per-service blocks between calls while their inputs are equal."""

    layout = "upstream"

    def __init__(
        self, facts: NodeFacts, options: RuleOptions, *, service_cidrs: Iterable[str] = ()
    ) -> None:
        self.facts = facts
        self.options = options
        self.service_cidrs = tuple(service_cidrs)
        self.setup = table_setup(facts, options, self.service_cidrs)
        node_ip = next((ip for ip in facts.node_ips if ":" not in ip), None)
        self.node_ip = ipaddress.ip_address(node_ip) if node_ip else None
        self._detector_cidrs: tuple[str, ...] = ()
        self.detector = local_traffic_detector(options, ())
        self._cache: dict[ServicePortName, tuple[ServicePort, ServiceBlock]] = {}
        self._rules = 0  # rules of the cached blocks
        self._last: dict[ServicePortName, ServiceBlock] | None = None
        self._handed_out: dict[ServicePortName, ServiceBlock] | None = None
        # id(ServicePort) -> (that ServicePort, its block), for identity hits.
        self._by_id: dict[int, tuple[ServicePort, ServiceBlock]] = {}
        # Where the last planned snapshot came from (its tracker's change log).
        self._lineage: Lineage | None = None

    def plan(self, snapshot: Snapshot) -> NftablesPlan:
        """The plan of a snapshot; blocks are in no particular order (the transaction
        writer sorts what it writes).

        When the snapshot's tracker says which ports it re-derived since the last planned
        snapshot, only those are visited. Otherwise a ServicePort the tracker kept (the same
        object as last time) is recognised by identity without hashing its name, so an
        unchanged service costs a dict lookup by id(); only new and changed ports are
        planned."""
        if snapshot.node.pod_cidrs != self._detector_cidrs:
            self._detector_cidrs = snapshot.node.pod_cidrs
            self.detector = local_traffic_detector(self.options, snapshot.node.pod_cidrs)
            self._forget()
        last = self._last
        plan = NftablesPlan(self.setup, base=self._handed_out)
        blocks = plan.blocks if last is None else last.copy()
        plan.blocks = blocks
        lineage = snapshot.lineage
        changed = None if lineage is None or last is None else lineage.changed_since(self._lineage)
        if changed is not None:
            self._plan_changed(plan, snapshot, changed)
        else:
            self._plan_all(plan, snapshot, last)
        self._lineage = lineage
        plan.block_rules = self._rules
        # The planner keeps its own copy: what callers do with plan.blocks cannot leak
        # into the next plan.
        self._last = plan.blocks.copy()
        self._handed_out = plan.blocks
        return plan

    def _plan_changed(
        self, plan: NftablesPlan, snapshot: Snapshot, changed: frozenset[ServicePortName]
    ) -> None:
        """Only the ports the snapshot's tracker re-derived since the last plan's snapshot
        can differ from the last plan: visit those alone."""
        blocks = plan.blocks
        for name in sorted(changed):
            sp = snapshot.services.get(name)
            if sp is None or ":" in sp.cluster_ip:  # gone, or the other family
                if blocks.pop(name, None) is not None:
                    self._evict(name)
                    plan.removed.add(name)
                continue
            block = self._block(sp)
            if blocks.get(name) is not block:
                plan.rebuilt.add(name)
                blocks[name] = block

    def _plan_all(
        self,
        plan: NftablesPlan,
        snapshot: Snapshot,
        last: dict[ServicePortName, ServiceBlock] | None,
    ) -> None:
        blocks = plan.blocks
        by_id = self._by_id
        present = 0  # ports of the snapshot that were in the last plan
        for name, sp in snapshot.services.items():
            hit = by_id.get(id(sp))
            if hit is not None and hit[0] is sp:
                present += 1
                if last is None:
                    blocks[name] = hit[1]
                continue
            if last is not None and name in last:
                present += 1
            if ":" in sp.cluster_ip:  # other family (dual stack is not built yet)
                if blocks.pop(name, None) is not None:
                    present -= 1
                    self._evict(name)
                    plan.removed.add(name)
                continue
            block = self._block(sp)
            if last is None or last.get(name) is not block:
                plan.rebuilt.add(name)
            blocks[name] = block
        if last is not None and present < len(last):
            for gone in set(last) - snapshot.services.keys():
                if blocks.pop(gone, None) is not None:
                    self._evict(gone)
                    plan.removed.add(gone)

    def _forget(self) -> None:
        """Drop every cached block (the rules of all of them depend on what changed)."""
        self._cache.clear()
        self._by_id.clear()
        self._rules = 0
        self._last = None
        self._handed_out = None

    def _count(self, block: ServiceBlock, sign: int) -> None:
        """Account for a block entering (+1) or leaving (-1) the cache."""
        self._rules += sign * block.rule_count

    def _evict(self, name: ServicePortName) -> None:
        hit = self._cache.pop(name, None)
        if hit is not None:
            self._count(hit[1], -1)
            self._by_id.pop(id(hit[0]), None)

    def _block(self, sp: ServicePort) -> ServiceBlock:
        """The block of sp (cached). Only plan() may call this: it keeps the last plan,
        the cache and the identity index in step."""
        hit = self._cache.get(sp.name)
        if hit is not None and (hit[0] is sp or hit[0] == sp):
            if hit[0] is not sp:  # equal, a new object: remember the new one
                self._by_id.pop(id(hit[0]), None)
                self._by_id[id(sp)] = (sp, hit[1])
                self._cache[sp.name] = (sp, hit[1])
            return hit[1]
        blk = self._build(sp)
        if hit is not None:
            self._count(hit[1], -1)
            self._by_id.pop(id(hit[0]), None)
        self._count(blk, +1)
        self._cache[sp.name] = (sp, blk)
        self._by_id[id(sp)] = (sp, blk)
        return blk

    # --- one service port ------------------------------------------------------------------

    def _build(self, sp: ServicePort) -> ServiceBlock:
        proto = sp.protocol.lower
        base = n.service_base(sp.name)
        cluster_chain = n.SERVICE_PREFIX + base
        local_chain = n.LOCAL_PREFIX + base
        external_chain = n.EXTERNAL_PREFIX + base
        affinity = sp.affinity_timeout is not None
        r = port_reach(sp, self.node_ip)

        reachable = sp.reachable_endpoints
        ep_base = {ep.addr: n.endpoint_base(sp.name, ep.ip, ep.port) for ep in reachable}

        chain_rules: dict[str, list[str]] = {}

        def ensure(chain: str) -> None:
            chain_rules.setdefault(chain, [])

        for ep in reachable:
            ensure(n.ENDPOINT_PREFIX + ep_base[ep.addr])
        uses_cluster_chain = bool(sp.cluster_endpoints) and sp.uses_cluster_endpoints
        if uses_cluster_chain:
            ensure(cluster_chain)
        uses_local_chain = bool(sp.local_endpoints) and sp.uses_local_endpoints
        if uses_local_chain:
            ensure(local_chain)

        internal_chain = local_chain if sp.internal_policy_local else cluster_chain
        external_policy_chain = local_chain if sp.external_policy_local else cluster_chain
        uses_external_chain = r.has_endpoints and sp.is_external
        if uses_external_chain:
            ensure(external_chain)
        elements, fw = filter_side(sp, r)
        if fw is not None:
            chain_rules[fw.name] = list(fw.rules)

        if r.has_internal:
            elements.append(Element(n.SERVICE_IPS_MAP, r.cluster_key, f"goto {internal_chain}"))
        if r.has_endpoints:
            for key in r.external_keys:
                elements.append(Element(n.SERVICE_IPS_MAP, key, f"goto {external_chain}"))
            if r.nodeport_key:
                elements.append(
                    Element(n.SERVICE_NODEPORTS_MAP, r.nodeport_key, f"goto {external_chain}")
                )

        mark_masq = f"jump {n.MARK_MASQ_CHAIN}"
        detector = self.detector
        if r.has_internal:
            head = f"ip daddr {sp.cluster_ip}"
            if self.options.masquerade_all:
                chain_rules.setdefault(internal_chain, []).append(f"{head} {mark_masq}")
            elif detector.implemented:
                chain_rules.setdefault(internal_chain, []).append(
                    f"{head} {detector.if_not_local_nft} {mark_masq}"
                )
        if uses_external_chain:
            ext = chain_rules[external_chain]
            if not sp.external_policy_local:
                ext.append(mark_masq)
            else:
                if detector.implemented:
                    ext.append(
                        f'{detector.if_local_nft} goto {cluster_chain} comment "short-circuit pod'
                        ' traffic"'
                    )
                ext.append(f'fib saddr type local {mark_masq} comment "masquerade local traffic"')
                ext.append(
                    f'fib saddr type local goto {cluster_chain} comment "short-circuit local'
                    ' traffic"'
                )
            if r.has_external:
                ext.append(f"goto {external_policy_chain}")
        if fw is not None:  # the firewall chain last, as upstream creates it
            chain_rules[fw.name] = chain_rules.pop(fw.name)

        sets: list[AffinitySet] = []
        if affinity:
            assert sp.affinity_timeout is not None
            sets = [
                AffinitySet(n.AFFINITY_PREFIX + ep_base[ep.addr], sp.affinity_timeout)
                for ep in reachable
            ]
        if uses_cluster_chain:
            _dispatch(chain_rules[cluster_chain], sp.cluster_endpoints, ep_base, affinity)
        if uses_local_chain:
            _dispatch(chain_rules[local_chain], sp.local_endpoints, ep_base, affinity)
        for ep in reachable:
            epb = ep_base[ep.addr]
            rules = chain_rules[n.ENDPOINT_PREFIX + epb]
            rules.append(f"ip saddr {ep.ip} {mark_masq}")
            if affinity:
                rules.append(f"update @{n.AFFINITY_PREFIX}{epb} {{ ip saddr }}")
            rules.append(f"meta l4proto {proto} dnat to {ep.addr}")

        return ServiceBlock(
            name=sp.name,
            chains=tuple(Chain(c, tuple(r)) for c, r in chain_rules.items()),
            rule_count=sum(len(r) for r in chain_rules.values()),
            endpoint_chains=frozenset(n.ENDPOINT_PREFIX + b for b in ep_base.values()),
            affinity_sets=tuple(sets),
            elements=tuple(elements),
            no_local_internal=r.has_endpoints and not r.has_internal,
            no_local_external=r.has_endpoints and not r.has_external,
        )


@dataclass(frozen=True, slots=True)
class PortReach:
    """Where a service port's traffic may go, the same in every layout: its destinations
    (element keys) and whether each kind of traffic has endpoints."""

    has_endpoints: bool
    has_internal: bool  # ClusterIP traffic has endpoints
    has_external: bool  # external traffic (externalIPs, LB IPs, NodePort) has endpoints
    cluster_key: str  # "172.30.0.41 . tcp . 80"
    external_ip_keys: tuple[str, ...]
    lb_keys: tuple[str, ...]
    nodeport_key: str  # "tcp . 3001", "" without a NodePort
    # The LoadBalancerSourceRanges (IPv4) and whether this node's IP is inside one of them.
    source_ranges: tuple[str, ...]
    lb_ips: tuple[str, ...]
    allow_from_node: bool

    @property
    def external_keys(self) -> tuple[str, ...]:
        return self.external_ip_keys + self.lb_keys


def port_reach(sp: ServicePort, node_ip: ipaddress.IPv4Address | None) -> PortReach:
    proto = sp.protocol.lower
    has_endpoints = sp.any_endpoints
    lb_ips = tuple(ip for ip in sp.load_balancer_ips if ":" not in ip)
    ext_ips = [ip for ip in sp.external_ips if ":" not in ip]
    ranges = [ipaddress.ip_network(c.strip(), strict=False) for c in sp.load_balancer_source_ranges]
    ranges = [r for r in ranges if r.version == 4]
    return PortReach(
        has_endpoints=has_endpoints,
        has_internal=has_endpoints and (not sp.internal_policy_local or bool(sp.local_endpoints)),
        has_external=has_endpoints and (not sp.external_policy_local or bool(sp.local_endpoints)),
        cluster_key=f"{sp.cluster_ip} . {proto} . {sp.port}",
        external_ip_keys=tuple(f"{ip} . {proto} . {sp.port}" for ip in ext_ips),
        lb_keys=tuple(f"{ip} . {proto} . {sp.port}" for ip in lb_ips),
        nodeport_key=f"{proto} . {sp.node_port}" if sp.node_port else "",
        source_ranges=tuple(str(r) for r in ranges),
        lb_ips=lb_ips,
        allow_from_node=node_ip is not None and any(node_ip in r for r in ranges),
    )


def filter_side(sp: ServicePort, r: PortReach) -> tuple[list[Element], Chain | None]:
    """A service port's objects on the filter side, the same in every layout: its ClusterIP
    in cluster-ips, REJECT/DROP for destinations without endpoints, and the firewall chain of
    LoadBalancerSourceRanges (a service's own ACL) with its firewall-ips elements."""
    spn = str(sp.name)
    if not r.has_endpoints:
        internal_verdict = external_verdict = f"goto {n.REJECT_CHAIN}"
    else:
        internal_verdict = external_verdict = "drop"
    elements = [Element(n.CLUSTER_IPS_SET, sp.cluster_ip)]
    if not r.has_internal:
        elements.append(Element(n.NO_ENDPOINT_SERVICES_MAP, r.cluster_key, internal_verdict, spn))
    if not r.has_external:
        for key in r.external_keys:
            elements.append(Element(n.NO_ENDPOINT_SERVICES_MAP, key, external_verdict, spn))
        if r.nodeport_key:
            elements.append(
                Element(n.NO_ENDPOINT_NODEPORTS_MAP, r.nodeport_key, external_verdict, spn)
            )
    if not (r.lb_keys and r.source_ranges):
        return elements, None
    fw_chain = n.FIREWALL_PREFIX + n.service_base(sp.name)
    for key in r.lb_keys:
        elements.append(Element(n.FIREWALL_IPS_MAP, key, f"goto {fw_chain}"))
    sources = list(r.source_ranges)
    if r.allow_from_node:
        sources += r.lb_ips
    return elements, Chain(fw_chain, (f"ip saddr != {{ {' , '.join(sources)} }} drop",))


def _dispatch(
    rules: list[str], endpoints: tuple[Endpoint, ...], ep_base: dict[str, str], affinity: bool
) -> None:
    """Service/local chain -> endpoint chains: affinity lookups, then one numgen vmap."""
    if affinity:
        for ep in endpoints:
            b = ep_base[ep.addr]
            rules.append(f"ip saddr @{n.AFFINITY_PREFIX}{b} goto {n.ENDPOINT_PREFIX}{b}")
    entries = " , ".join(
        f"{i} : goto {n.ENDPOINT_PREFIX}{ep_base[ep.addr]}" for i, ep in enumerate(endpoints)
    )
    rules.append(f"numgen random mod {len(endpoints)} vmap {{ {entries} }}")
