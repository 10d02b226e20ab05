"""Plan iptables mode: Snapshot -> iptables-restore input, rule-compatible with upstream.

Pure and deterministic: no kernel, no clock. Services are written sorted by
ServicePortName (upstream iterates a Go map, so its order is random); the rules of one
service and the chain names are upstream's. Each service's rules are computed once into a
ServiceBlock and cached while its ServicePort value is unchanged, which is what makes
partial syncs and repeated renders cheap.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from kproxy.dataplane.facts import NodeFacts, RuleOptions
from kproxy.dataplane.iptables import names
from kproxy.dataplane.nodepolicy import (
    NodePortAddresses,
    local_traffic_detector,
    localhost_node_ports_enabled,
)
from kproxy.model.objects import Endpoint, ServicePort, ServicePortName, Snapshot

# Top-level chains, in the order upstream declares them.
FILTER_TOP_CHAINS = (
    "KUBE-SERVICES",
    "KUBE-EXTERNAL-SERVICES",
    "KUBE-FORWARD",
    "KUBE-NODEPORTS",
    "KUBE-PROXY-FIREWALL",
)
NAT_TOP_CHAINS = ("KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING", "KUBE-MARK-MASQ")
KUBELET_FIREWALL_CHAIN = "KUBE-FIREWALL"
LARGE_CLUSTER_ENDPOINTS = 1000
CT_INVALID_COUNTER = "ct_state_invalid_dropped_pkts"
LOCALHOST_NODEPORTS_COUNTER = "localhost_nps_accepted_pkts"

# Jumps from built-in chains into ours: (table, chain, extra match args, comment, target).
# Upstream checks these with -C and inserts them at position 1 when missing, full syncs only.
JUMPS: tuple[tuple[str, str, str, str, str], ...] = (
    (
        "filter",
        "INPUT",
        "-m conntrack --ctstate NEW",
        "kubernetes externally-visible service portals",
        "KUBE-EXTERNAL-SERVICES",
    ),
    (
        "filter",
        "FORWARD",
        "-m conntrack --ctstate NEW",
        "kubernetes externally-visible service portals",
        "KUBE-EXTERNAL-SERVICES",
    ),
    ("filter", "INPUT", "", "kubernetes health check service ports", "KUBE-NODEPORTS"),
    (
        "filter",
        "FORWARD",
        "-m conntrack --ctstate NEW",
        "kubernetes service portals",
        "KUBE-SERVICES",
    ),
    (
        "filter",
        "OUTPUT",
        "-m conntrack --ctstate NEW",
        "kubernetes service portals",
        "KUBE-SERVICES",
    ),
    ("filter", "FORWARD", "", "kubernetes forwarding rules", "KUBE-FORWARD"),
    (
        "filter",
        "INPUT",
        "-m conntrack --ctstate NEW",
        "kubernetes load balancer firewall",
        "KUBE-PROXY-FIREWALL",
    ),
    (
        "filter",
        "OUTPUT",
        "-m conntrack --ctstate NEW",
        "kubernetes load balancer firewall",
        "KUBE-PROXY-FIREWALL",
    ),
    (
        "filter",
        "FORWARD",
        "-m conntrack --ctstate NEW",
        "kubernetes load balancer firewall",
        "KUBE-PROXY-FIREWALL",
    ),
    ("nat", "OUTPUT", "", "kubernetes service portals", "KUBE-SERVICES"),
    ("nat", "PREROUTING", "", "kubernetes service portals", "KUBE-SERVICES"),
    ("nat", "POSTROUTING", "", "kubernetes postrouting rules", "KUBE-POSTROUTING"),
)
# kubelet's chain, which kube-proxy also ensures: plain jumps from INPUT and OUTPUT.
KUBELET_FIREWALL_JUMPS = (
    ("filter", "INPUT", "KUBE-FIREWALL"),
    ("filter", "OUTPUT", "KUBE-FIREWALL"),
)


def jump_rule(chain: str, extra: str, comment: str, target: str) -> str:
    """A jump as iptables-save prints it (also valid restore input after -A/-I)."""
    middle = f"{extra} " if extra else ""
    return f'{chain} {middle}-m comment --comment "{comment}" -j {target}'


@dataclass(frozen=True, slots=True)
class ServiceBlock:
    """Everything one service port contributes to a restore."""

    filter_rules: tuple[str, ...]  # in the top-level filter chains
    nat_top_rules: tuple[str, ...]  # in nat KUBE-SERVICES / KUBE-NODEPORTS
    chains: tuple[str, ...]  # nat chains this service owns (SVC/SVL/EXT/FW/SEP)
    # The rules of those chains as restore lines joined by newlines: one string instead of
    # ~40 per service (at 10,000 services, 24 MB of object headers less in the cache, and
    # a restore input joined from 10,000 parts instead of 430,000).
    # Cached blocks have no text (IptablesRenderer.block), only the count.
    chain_text: str
    chain_rule_count: int


@dataclass
class IptablesPlan:
    """One sync's restore input, kept in parts so the applier can omit or split them."""

    filter_chains: list[str] = field(default_factory=list)
    filter_rules: list[str] = field(default_factory=list)
    nat_top_chains: list[str] = field(default_factory=list)
    nat_top_rules: list[str] = field(default_factory=list)
    # Blocks of the services whose chains this sync (re)writes, in service order.
    blocks: list[ServiceBlock] = field(default_factory=list)
    # Every service chain that exists after this restore (written now or kept from before).
    active_chains: set[str] = field(default_factory=set)
    stale_chains: list[str] = field(default_factory=list)
    rewritten: set[ServicePortName] = field(default_factory=set)
    large_cluster: bool = False
    rules_total: dict[str, int] = field(default_factory=dict)

    def text(
        self,
        *,
        include_filter: bool = True,
        include_nat_top: bool = True,
        jumps: Mapping[str, Sequence[str]] | None = None,
    ) -> str:
        """The whole restore input (optionally without the parts known to be unchanged).
        jumps: extra lines per table (the jumps from built-in chains a sync adds, chain
        declarations among them), written into that table's section."""
        jumps = jumps or {}
        parts = self.filter_section(jumps.get("filter", ())) if include_filter else []
        nat = self.nat_section(
            self.blocks,
            include_top=include_nat_top,
            stale=self.stale_chains,
            jumps=jumps.get("nat", ()),
        )
        return "\n".join(parts + nat) + "\n" if parts or nat else ""

    def filter_section(self, jumps: Sequence[str] = ()) -> list[str]:
        decls, rules = _declarations_first(jumps)
        return ["*filter", *self.filter_chains, *decls, *self.filter_rules, *rules, "COMMIT"]

    def nat_section(
        self,
        blocks: Iterable[ServiceBlock],
        *,
        include_top: bool,
        stale: Iterable[str] = (),
        jumps: Sequence[str] = (),
    ) -> list[str]:
        blocks = list(blocks)
        stale = list(stale)
        if not blocks and not stale and not include_top and not jumps:
            return []
        decls, jump_rules = _declarations_first(jumps)
        parts = ["*nat", *decls]
        if include_top:
            parts += self.nat_top_chains
        for b in blocks:
            parts += [f":{c} - [0:0]" for c in b.chains]
        parts += [f":{c} - [0:0]" for c in stale]
        if include_top:
            parts += self.nat_top_rules
        parts += [b.chain_text for b in blocks if b.chain_text]
        parts += [f"-X {c}" for c in stale]
        parts += jump_rules
        parts.append("COMMIT")
        return parts

    def rules_written(self, *, include_filter: bool, include_nat_top: bool) -> dict[str, int]:
        nat = sum(b.chain_rule_count for b in self.blocks)
        if include_nat_top:
            nat += len(self.nat_top_rules)
        return {"filter": len(self.filter_rules) if include_filter else 0, "nat": nat}


class IptablesRenderer:
    """Builds restore input; keeps per-service blocks between calls while inputs are equal."""

    def __init__(self, facts: NodeFacts, options: RuleOptions) -> None:
        self.facts = facts
        self.options = options
        self.mark = options.masquerade_mark
        self.localhost_nodeports = localhost_node_ports_enabled(options)
        self._cache: dict[ServicePortName, tuple[ServicePort, bool, ServiceBlock]] = {}
        self._detector_cidrs: tuple[str, ...] = ()
        self._large: bool | None = None  # large-cluster mode of the last plan
        self.detector = local_traffic_detector(options, ())

    def block(self, sp: ServicePort, large: bool, *, with_chains: bool = True) -> ServiceBlock:
        """The service's block. The cache keeps blocks without their chain text: only a sync
        that writes the service's chains needs it (a partial sync writes a few services, a
        full sync, at most hourly, all of them), and at 10,000 services the text is 33 MB."""
        hit = self._cache.get(sp.name)
        if (
            not with_chains
            and hit is not None
            and hit[1] == large
            and (hit[0] is sp or hit[0] == sp)
        ):
            return hit[2]
        blk = self._build_block(sp, large)
        self._cache[sp.name] = (sp, large, replace(blk, chain_text=""))
        return blk

    def plan(
        self,
        snapshot: Snapshot,
        *,
        rewrite: set[ServicePortName] | None = None,
        existing_chains: Iterable[str] = (),
    ) -> IptablesPlan:
        """rewrite=None: full sync (every service chain written). Otherwise only those services'
        chains are written and the others are left as the kernel has them (a partial sync).
        existing_chains: service chains known to exist in the kernel, to find stale ones. In
        a partial sync they are the chains of this renderer's previous plan, so only the
        chains of services that changed or went away can have become stale."""
        if snapshot.node.pod_cidrs != self._detector_cidrs:
            self._detector_cidrs = snapshot.node.pod_cidrs
            self.detector = local_traffic_detector(self.options, snapshot.node.pod_cidrs)
            self._cache.clear()
            rewrite = None  # every service's rules depend on the detector
        ports = snapshot.sorted_ports()
        large = sum(len(sp.endpoints) for sp in ports) > LARGE_CLUSTER_ENDPOINTS
        if large != self._large:
            self._large = large
            rewrite = None  # every service's comments change with large-cluster mode
        # Chains of the previous blocks of services written now or gone: a partial sync's
        # only candidates for stale chains.
        replaced: list[tuple[str, ...]] = []
        plan = IptablesPlan(large_cluster=large)
        plan.filter_chains = [f":{c} - [0:0]" for c in FILTER_TOP_CHAINS]
        plan.nat_top_chains = [f":{c} - [0:0]" for c in NAT_TOP_CHAINS]
        mark = self.mark
        nat_rules = plan.nat_top_rules
        nat_rules += [
            f"-A KUBE-POSTROUTING -m mark ! --mark {mark}/{mark} -j RETURN",
            f"-A KUBE-POSTROUTING -j MARK --xor-mark {mark}",
            '-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT"'
            " -j MASQUERADE" + (" --random-fully" if self.facts.random_fully else ""),
            f"-A KUBE-MARK-MASQ -j MARK --or-mark {mark}",
        ]
        filter_rules = plan.filter_rules
        if self.localhost_nodeports:
            plan.filter_chains.append(f":{KUBELET_FIREWALL_CHAIN} - [0:0]")
            filter_rules.append(
                '-A KUBE-FIREWALL -m comment --comment "block incoming localnet connections"'
                " -d 127.0.0.0/8 ! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT"
                " -j DROP"
            )
        active = plan.active_chains
        chain_rule_count = 0
        for sp in ports:
            write = rewrite is None or sp.name in rewrite
            if write and rewrite is not None and (old := self._cache.get(sp.name)) is not None:
                replaced.append(old[2].chains)
            blk = self.block(sp, large, with_chains=write)
            filter_rules += blk.filter_rules
            nat_rules += blk.nat_top_rules
            active.update(blk.chains)
            chain_rule_count += blk.chain_rule_count
            if write:
                plan.blocks.append(blk)
                plan.rewritten.add(sp.name)
        if len(self._cache) > len(ports):
            # Services that are gone (a cache entry per service name ever seen would grow
            # with churn for the daemon's whole life).
            for name in [n for n in self._cache if n not in snapshot.services]:
                replaced.append(self._cache.pop(name)[2].chains)
        nat_rules += self._nodeports_tail()
        if rewrite is None:
            candidates: Iterable[str] = existing_chains
        else:
            # At 10,000 services this is ~10 chains instead of a walk over 110,000.
            exists = existing_chains if isinstance(existing_chains, set) else set(existing_chains)
            candidates = {c for chains in replaced for c in chains if c in exists}
        plan.stale_chains = sorted(
            c for c in candidates if names.is_service_chain(c) and c not in active
        )
        filter_rules += self._forward_rules()
        plan.rules_total = {"filter": len(filter_rules), "nat": len(nat_rules) + chain_rule_count}
        return plan

    def _nodeports_tail(self) -> list[str]:
        comment = '-m comment --comment "kubernetes service nodeports; NOTE: this must be the last rule in this chain"'
        ips = NodePortAddresses.from_entries(self.options.node_port_addresses).addresses(
            self.facts.node_ips,
            self.facts.local_addresses,
            include_loopback=self.localhost_nodeports,
        )
        if ips is None:
            dest = "-m addrtype --dst-type LOCAL"
            if not self.localhost_nodeports:
                dest += " ! -d 127.0.0.0/8"
            return [f"-A KUBE-SERVICES {comment} {dest} -j KUBE-NODEPORTS"]
        return [f"-A KUBE-SERVICES {comment} -d {ip} -j KUBE-NODEPORTS" for ip in ips]

    def _forward_rules(self) -> list[str]:
        mark = self.mark
        out = []
        if not self.facts.tcp_be_liberal:
            acct = ""
            if CT_INVALID_COUNTER in self.facts.nfacct_counters:
                acct = f" -m nfacct --nfacct-name {CT_INVALID_COUNTER}"
            out.append(f"-A KUBE-FORWARD -m conntrack --ctstate INVALID{acct} -j DROP")
        out.append(
            f'-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules"'
            f" -m mark --mark {mark}/{mark} -j ACCEPT"
        )
        out.append(
            '-A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack rule"'
            " -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT"
        )
        return out

    # --- one service port ------------------------------------------------------------------

    def _build_block(self, sp: ServicePort, large: bool) -> ServiceBlock:
        name = str(sp.name)
        proto = sp.protocol.lower
        match = f"-m {proto} -p {proto}"
        suffix = names.port_proto_hash(sp.name)
        svc_chain = names.SVC_PREFIX + suffix
        svl_chain = names.SVL_PREFIX + suffix
        ext_chain = names.EXT_PREFIX + suffix
        fw_chain = names.FW_PREFIX + suffix

        has_endpoints = sp.any_endpoints
        has_internal = sp.has_internal_endpoints
        has_external = sp.has_external_endpoints
        uses_cluster_chain = bool(sp.cluster_endpoints) and sp.uses_cluster_endpoints
        uses_local_chain = bool(sp.local_endpoints) and sp.uses_local_endpoints
        internal_chain = svl_chain if sp.internal_policy_local else svc_chain
        external_policy_chain = svl_chain if sp.external_policy_local else svc_chain
        uses_ext_chain = has_endpoints and sp.is_external
        uses_fw_chain = (
            has_endpoints and bool(sp.load_balancer_ips) and bool(sp.load_balancer_source_ranges)
        )
        lb_chain = fw_chain if uses_fw_chain else ext_chain

        if not has_endpoints:
            int_target, int_comment = "REJECT", f'"{name} has no endpoints"'
            ext_target, ext_comment = "REJECT", int_comment
        else:
            int_target, int_comment = "ACCEPT", ""
            ext_target, ext_comment = "ACCEPT", ""
            if not has_internal:
                int_target, int_comment = "DROP", f'"{name} has no local endpoints"'
            if not has_external:
                ext_target, ext_comment = "DROP", f'"{name} has no local endpoints"'

        filt: list[str] = []
        top: list[str] = []
        cip = f"-d {sp.cluster_ip} --dport {sp.port}"
        if has_internal:
            top.append(
                f'-A KUBE-SERVICES -m comment --comment "{name} cluster IP" {match} {cip} -j {internal_chain}'
            )
        else:
            filt.append(
                f"-A KUBE-SERVICES -m comment --comment {int_comment} {match} {cip} -j {int_target}"
            )

        for ip in sp.external_ips:
            dst = f"-d {ip} --dport {sp.port}"
            if has_endpoints:
                top.append(
                    f'-A KUBE-SERVICES -m comment --comment "{name} external IP" {match} {dst} -j {ext_chain}'
                )
            if not has_external:
                filt.append(
                    f"-A KUBE-EXTERNAL-SERVICES -m comment --comment {ext_comment} {match} {dst} -j {ext_target}"
                )

        for ip in sp.load_balancer_ips:
            dst = f"-d {ip} --dport {sp.port}"
            if has_endpoints:
                top.append(
                    f'-A KUBE-SERVICES -m comment --comment "{name} loadbalancer IP" {match} {dst} -j {lb_chain}'
                )
            if uses_fw_chain:
                filt.append(
                    f'-A KUBE-PROXY-FIREWALL -m comment --comment "{name} traffic not accepted by {fw_chain}"'
                    f" {match} {dst} -j DROP"
                )
        if not has_external:
            for ip in sp.load_balancer_ips:
                filt.append(
                    f"-A KUBE-EXTERNAL-SERVICES -m comment --comment {ext_comment} {match}"
                    f" -d {ip} --dport {sp.port} -j {ext_target}"
                )

        if sp.node_port:
            if has_endpoints:
                if (
                    self.localhost_nodeports
                    and LOCALHOST_NODEPORTS_COUNTER in self.facts.nfacct_counters
                ):
                    top.append(
                        f"-A KUBE-NODEPORTS -m comment --comment {name} {match} -d 127.0.0.0/8"
                        f" --dport {sp.node_port} -m nfacct --nfacct-name {LOCALHOST_NODEPORTS_COUNTER}"
                        f" -j {ext_chain}"
                    )
                top.append(
                    f"-A KUBE-NODEPORTS -m comment --comment {name} {match} --dport {sp.node_port} -j {ext_chain}"
                )
            if not has_external:
                filt.append(
                    f"-A KUBE-EXTERNAL-SERVICES -m comment --comment {ext_comment} -m addrtype --dst-type LOCAL"
                    f" {match} --dport {sp.node_port} -j {ext_target}"
                )

        if sp.health_check_node_port:
            filt.append(
                f'-A KUBE-NODEPORTS -m comment --comment "{name} health check node port"'
                f" -m tcp -p tcp --dport {sp.health_check_node_port} -j ACCEPT"
            )

        if not has_endpoints:
            return ServiceBlock(tuple(filt), tuple(top), (), "", 0)

        chains: list[str] = []
        rules: list[str] = []
        if has_internal:
            base = f'-A {internal_chain} -m comment --comment "{name} cluster IP" {match} {cip}'
            if self.options.masquerade_all:
                rules.append(f"{base} -j KUBE-MARK-MASQ")
            elif self.detector.implemented:
                rules.append(f"{base} {self.detector.if_not_local} -j KUBE-MARK-MASQ")

        if uses_ext_chain:
            chains.append(ext_chain)
            if not sp.external_policy_local:
                rules.append(
                    f'-A {ext_chain} -m comment --comment "masquerade traffic for {name} external destinations"'
                    " -j KUBE-MARK-MASQ"
                )
            else:
                if self.detector.implemented:
                    rules.append(
                        f'-A {ext_chain} -m comment --comment "pod traffic for {name} external destinations"'
                        f" {self.detector.if_local} -j {svc_chain}"
                    )
                rules.append(
                    f'-A {ext_chain} -m comment --comment "masquerade LOCAL traffic for {name} external'
                    ' destinations" -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ'
                )
                rules.append(
                    f'-A {ext_chain} -m comment --comment "route LOCAL traffic for {name} external'
                    f' destinations" -m addrtype --src-type LOCAL -j {svc_chain}'
                )
            if has_external:
                rules.append(f"-A {ext_chain} -j {external_policy_chain}")

        if uses_fw_chain:
            chains.append(fw_chain)
            head = f'-A {fw_chain} -m comment --comment "{name} loadbalancer IP"'
            allow_from_node = False
            node_ips = [ipaddress.ip_address(ip) for ip in self.facts.node_ips[:1]]
            for cidr in sp.load_balancer_source_ranges:
                rules.append(f"{head} -s {cidr} -j {ext_chain}")
                net = ipaddress.ip_network(cidr, strict=False)
                if any(ip in net for ip in node_ips):
                    allow_from_node = True
            if allow_from_node:
                for ip in sp.load_balancer_ips:
                    rules.append(f"{head} -s {ip} -j {ext_chain}")
            rules.append(
                f'-A {fw_chain} -m comment --comment "other traffic to {name} will be dropped by'
                ' KUBE-PROXY-FIREWALL"'
            )

        seps = names.sep_chains(sp.name, sp.reachable_endpoints)
        if uses_cluster_chain:
            chains.append(svc_chain)
            _dispatch(rules, sp, svc_chain, sp.cluster_endpoints, seps, large)
        if uses_local_chain:
            chains.append(svl_chain)
            _dispatch(rules, sp, svl_chain, sp.local_endpoints, seps, large)

        comment = "" if large else f"-m comment --comment {name} "
        dnat = f"{match} -j DNAT --to-destination"
        affinity = sp.affinity_timeout is not None
        for ep in sp.reachable_endpoints:
            addr = ep.addr
            sep = seps[addr]
            chains.append(sep)
            rules.append(f"-A {sep} {comment}-s {ep.ip} -j KUBE-MARK-MASQ")
            if affinity:
                rules.append(f"-A {sep} {comment}-m recent --name {sep} --set {dnat} {addr}")
            else:
                rules.append(f"-A {sep} {comment}{dnat} {addr}")
        return ServiceBlock(tuple(filt), tuple(top), tuple(chains), "\n".join(rules), len(rules))


def _declarations_first(lines: Sequence[str]) -> tuple[list[str], list[str]]:
    """(chain declarations, other lines): declarations go first in a section."""
    return [x for x in lines if x.startswith(":")], [x for x in lines if not x.startswith(":")]


def _dispatch(
    rules: list[str],
    sp: ServicePort,
    chain: str,
    endpoints: tuple[Endpoint, ...],
    seps: dict[str, str],
    large: bool,
) -> None:
    """SVC/SVL -> SEP rules: affinity checks first, then the probability ladder."""
    name = str(sp.name)
    head = f"-A {chain} "
    if sp.affinity_timeout is not None:
        for ep in endpoints:
            sep = seps[ep.addr]
            comment = "" if large else f'-m comment --comment "{name} -> {ep.addr}" '
            rules.append(
                f"{head}{comment}-m recent --name {sep} --rcheck --seconds {sp.affinity_timeout} --reap -j {sep}"
            )
    n = len(endpoints)
    last = n - 1
    for i, ep in enumerate(endpoints):
        addr = ep.addr
        comment = "" if large else f'-m comment --comment "{name} -> {addr}" '
        if i < last:
            rules.append(
                f"{head}{comment}-m statistic --mode random --probability {probability(n - i)} -j {seps[addr]}"
            )
        else:
            rules.append(f"{head}{comment}-j {seps[addr]}")


_PROBABILITIES: dict[int, str] = {}


def probability(n: int) -> str:
    """1/n the way upstream formats it (Go's %0.10f)."""
    p = _PROBABILITIES.get(n)
    if p is None:
        p = _PROBABILITIES[n] = f"{1.0 / n:.10f}"
    return p


def render_full(snapshot: Snapshot, facts: NodeFacts, options: RuleOptions) -> str:
    """The restore input of a full sync on a node with no stale chains."""
    return IptablesRenderer(facts, options).plan(snapshot).text()
