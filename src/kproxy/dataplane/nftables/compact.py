"""Plan the "compact" nftables layout: Snapshot -> the desired contents of
`table ip kproxy-compact`, pure and deterministic like plan.py, whose objects it produces.

Why: upstream's layout gives every service port a chain and every endpoint one more, all
reachable from the base chains through verdict maps, and the kernel validates every
reachable chain at each commit, so a commit's cost grows with the number of services.
Here the per-service state is map elements, and the chains are few and shared:

* filter side: as upstream (cluster-ips, no-endpoint-services/-nodeports for REJECT/DROP,
  firewall-ips and cluster-ips-check, same base chains and priorities);
* `services` (nat prerouting/output) looks the destination up in service-ips
  (`ip daddr . meta l4proto . th dport`) or service-nodeports (`meta l4proto . th dport`),
  as upstream, but the verdicts go to shared chains named for what they do and how many
  endpoints they spread over:

    dnat/internal/N             ClusterIP: masquerade off-cluster sources, then pick 1 of N
    dnat/external/N             externalIP / LB IP, Cluster policy: masquerade, pick 1 of N
    dnat/external-local/N/M     ... Local policy: pod and node-local sources short-circuit
                                to the N cluster endpoints (node-local ones masqueraded),
                                everything else picks 1 of the M local endpoints
    dnat/nodeport/N, dnat/nodeport-local/N/M   the same for NodePorts

  A pick is one rule per protocol: `meta l4proto udp dnat to ip daddr . meta l4proto .
  th dport . numgen random mod N map @service-endpoints-udp` (NodePorts: `meta l4proto .
  th dport . numgen ... map @nodeport-endpoints-udp`), whose elements map each destination
  and slot 0..N-1 to an endpoint; a Local policy's local endpoints take slots N..N+M-1 of
  the same destination (`numgen random mod M offset N`). The maps are per protocol because
  a map's data type names the protocol of its port, and nft lets the DNAT match only that
  protocol (plan.py).
* hairpin: an endpoint that reaches itself through a service is masqueraded as upstream's
  endpoint chains do it; the check moves to `masquerading` (nat postrouting), where the
  chosen endpoint is known: `ct status dnat ip saddr . ip daddr @hairpin-endpoints`, with
  one element "IP . IP" per endpoint IP.

Exact spread: a service port with N endpoints gets exactly N slots, one each, and its
chain draws `numgen random mod N` -- the same N. No slot table is shared between endpoint
counts, so no endpoint gets an extra slot (no modulo bias); each endpoint is picked with
the probability upstream's `numgen random mod N vmap` gives it.

Chains stay independent of the number of services: one per (kind, endpoint counts) in
use. Per-service chains remain where maps cannot say it:

* ClientIP affinity: upstream keeps a client's endpoint in per-endpoint timeout sets
  shared by every way into the service (ClusterIP, NodePort, LB IP), updated before the
  DNAT; a map keyed by destination would split that by entry point. A service port with
  affinity gets upstream's chains and sets unchanged (plan.py), reached through the same
  service-ips / service-nodeports maps.
* LoadBalancerSourceRanges: upstream's firewall chain of the service (its ACL), as in
  plan.filter_side.

The table has its own name so that both layouts can be in the kernel at once while a node
switches between them (make before break), and `kproxy-` marks it as kproxy's for cleanup.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable

from kproxy.dataplane.facts import NodeFacts, RuleOptions
from kproxy.dataplane.nftables import names as n
from kproxy.dataplane.nftables.plan import (
    COMPACT_SERVICE_CONTAINERS,
    Chain,
    Element,
    NftablesPlan,
    NftablesPlanner,
    ServiceBlock,
    TableSetup,
    filter_side,
    port_reach,
)
from kproxy.model.objects import Endpoint, ServicePort, Snapshot

LAYOUT = "compact"
ADDR_KEY = "ip daddr . meta l4proto . th dport"
PORT_KEY = "meta l4proto . th dport"
HAIRPIN_RULE = f"ct status dnat ip saddr . ip daddr @{n.HAIRPIN_SET} jump {n.MARK_MASQ_CHAIN}"


def compact_setup(upstream: TableSetup) -> TableSetup:
    """Upstream's table setup in the compact table, with the endpoint maps and the hairpin
    check in front of the masquerading decision."""
    rules = list(upstream.masquerade_rules)
    first = next(i for i, (chain, _) in enumerate(rules) if chain == n.MASQUERADING_CHAIN)
    rules.insert(first, (n.MASQUERADING_CHAIN, HAIRPIN_RULE))
    return dataclasses.replace(
        upstream,
        table=n.COMPACT_TABLE,
        table_comment=n.COMPACT_TABLE_COMMENT,
        service_containers=COMPACT_SERVICE_CONTAINERS,
        early_containers=(n.HAIRPIN_SET, *n.ENDPOINT_MAPS),
        masquerade_rules=tuple(rules),
        netlink_element_adds=True,
    )


def shared_chain_name(kind: str, *counts: int) -> str:
    return n.SHARED_PREFIX + "/".join([kind, *map(str, counts)])


class CompactPlanner(NftablesPlanner):
    """Builds compact plans; per-service blocks are cached as in NftablesPlanner, and the
    shared chains in use are counted as blocks enter and leave the cache."""

    layout = LAYOUT

    def __init__(
        self, facts: NodeFacts, options: RuleOptions, *, service_cidrs: Iterable[str] = ()
    ) -> None:
        super().__init__(facts, options, service_cidrs=service_cidrs)
        self.setup = compact_setup(self.setup)
        self._uses: Counter[str] = Counter()
        self._shared: dict[str, Chain] = {}

    def plan(self, snapshot: Snapshot) -> NftablesPlan:
        plan = super().plan(snapshot)
        plan.shared = {name: self._shared_chain(name) for name in sorted(self._uses)}
        plan.shared_rules = sum(len(c.rules) for c in plan.shared.values())
        return plan

    def _forget(self) -> None:
        super()._forget()
        self._uses.clear()
        self._shared.clear()

    def _count(self, block: ServiceBlock, sign: int) -> None:
        super()._count(block, sign)
        for name in block.shared:
            self._uses[name] += sign
            if not self._uses[name]:
                del self._uses[name]

    # --- one service port ------------------------------------------------------------------

    def _build(self, sp: ServicePort) -> ServiceBlock:
        if sp.affinity_timeout is not None:
            return super()._build(sp)
        r = port_reach(sp, self.node_ip)
        elements, fw = filter_side(sp, r)
        spn = str(sp.name)
        proto = sp.protocol.lower
        shared: list[str] = []

        def dispatch(container: str, key: str, chain: str, lists: tuple[tuple[Endpoint, ...], ...]):
            value_map = (
                n.SERVICE_IPS_MAP
                if container == n.SERVICE_ENDPOINTS_MAP
                else (n.SERVICE_NODEPORTS_MAP)
            )
            endpoints_map = n.endpoint_map(container, proto)
            # The comment names the service port: the shared chain does not (readers).
            elements.append(Element(value_map, key, f"goto {chain}", spn))
            slot = 0
            for endpoints in lists:
                for ep in endpoints:
                    value = f"{ep.ip} . {ep.port}"
                    elements.append(Element(endpoints_map, f"{key} . {slot}", value))
                    slot += 1
            if chain not in shared:
                shared.append(chain)

        internal = sp.internal_endpoints
        if r.has_internal and internal:
            chain = shared_chain_name("internal", len(internal))
            dispatch(n.SERVICE_ENDPOINTS_MAP, r.cluster_key, chain, (internal,))
        if r.has_endpoints and sp.is_external and sp.cluster_endpoints:
            cluster = sp.cluster_endpoints
            if sp.external_policy_local:
                local = sp.local_endpoints
                lists: tuple[tuple[Endpoint, ...], ...] = (cluster, local)
                kind, counts = "-local", (len(cluster), len(local))
            else:
                lists, kind, counts = (cluster,), "", (len(cluster),)
            for key in r.external_keys:
                chain = shared_chain_name("external" + kind, *counts)
                dispatch(n.SERVICE_ENDPOINTS_MAP, key, chain, lists)
            if r.nodeport_key:
                chain = shared_chain_name("nodeport" + kind, *counts)
                dispatch(n.NODEPORT_ENDPOINTS_MAP, r.nodeport_key, chain, lists)
        if shared:
            seen: set[str] = set()
            for ep in sp.reachable_endpoints:
                if ep.ip not in seen:
                    seen.add(ep.ip)
                    elements.append(Element(n.HAIRPIN_SET, f"{ep.ip} . {ep.ip}"))

        chains = (fw,) if fw is not None else ()
        return ServiceBlock(
            name=sp.name,
            chains=chains,
            rule_count=sum(len(c.rules) for c in chains),
            endpoint_chains=frozenset(),
            affinity_sets=(),
            elements=tuple(elements),
            no_local_internal=r.has_endpoints and not r.has_internal,
            no_local_external=r.has_endpoints and not r.has_external,
            shared=tuple(shared),
        )

    # --- the shared chains -----------------------------------------------------------------

    def _shared_chain(self, name: str) -> Chain:
        chain = self._shared.get(name)
        if chain is None:
            chain = self._shared[name] = Chain(name, self._shared_rules(name))
        return chain

    def _shared_rules(self, name: str) -> tuple[str, ...]:
        kind, *numbers = name[len(n.SHARED_PREFIX) :].split("/")
        counts = [int(x) for x in numbers]
        by_port = kind.startswith("nodeport")
        key, container = (
            (PORT_KEY, n.NODEPORT_ENDPOINTS_MAP) if by_port else (ADDR_KEY, n.SERVICE_ENDPOINTS_MAP)
        )

        def pick(count: int, offset: int = 0, prefix: str = "", comment: str = "") -> list[str]:
            """One DNAT rule per protocol, each with its protocol's map."""
            at = f" offset {offset}" if offset else ""
            tail = f' comment "{comment}"' if comment else ""
            return [
                f"{prefix}meta l4proto {proto} dnat to {key} . numgen random mod {count}{at}"
                f" map @{n.endpoint_map(container, proto)}{tail}"
                for proto in n.ENDPOINT_MAP_PROTOCOLS
            ]

        mark_masq = f"jump {n.MARK_MASQ_CHAIN}"
        detector = self.detector
        if kind == "internal":
            rules: list[str] = []
            if self.options.masquerade_all:
                rules.append(mark_masq)
            elif detector.implemented:
                rules.append(f"{detector.if_not_local_nft} {mark_masq}")
            return (*rules, *pick(counts[0]))
        if kind in ("external", "nodeport"):
            return (mark_masq, *pick(counts[0]))
        if kind in ("external-local", "nodeport-local"):
            cluster, local = counts
            rules = []
            if detector.implemented:
                rules += pick(cluster, 0, f"{detector.if_local_nft} ", "short-circuit pod traffic")
            rules.append(f'fib saddr type local {mark_masq} comment "masquerade local traffic"')
            rules += pick(cluster, 0, "fib saddr type local ", "short-circuit local traffic")
            if local:
                rules += pick(local, cluster)
            return tuple(rules)
        raise ValueError(f"not a shared chain of the compact layout: {name!r}")
