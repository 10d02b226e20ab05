"""Plan ipvs mode: Snapshot + node facts + options -> the desired IPVS, ipset and iptables state.

Pure and deterministic (no kernel, no clock), like upstream's syncProxyRules minus the
kernel calls: per service port the virtual servers (ClusterIP, externalIPs, LoadBalancer
IPs, one per node IP for a NodePort) with their real servers, the addresses kube-ipvs0 must
hold, the ipset entries, and the small iptables layer whose rules depend only on which sets
are non-empty. Each service port's part is computed once into a ServiceBlock and reused
while its ServicePort value (and the node's addresses) stay the same.

kproxy extensions: the annotations ipvs.kproxy.io/scheduler and
ipvs.kproxy.io/persistence-timeout override the scheduler and the persistence timeout of
one Service; invalid values are reported as problems (the proxier logs them) and ignored.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, field

from kproxy.dataplane.facts import NodeFacts, RuleOptions
from kproxy.dataplane.ipvs import names as n
from kproxy.dataplane.nodepolicy import NodePortAddresses, local_traffic_detector
from kproxy.model.objects import Endpoint, ServicePort, ServicePortName, Snapshot

PROTOCOL_NUMBERS = {"TCP": 6, "UDP": 17, "SCTP": 132}
PROTOCOL_NAMES = {v: k for k, v in PROTOCOL_NUMBERS.items()}


@dataclass(frozen=True, slots=True, order=True)
class VSKey:
    """What identifies a virtual server: protocol, address, port."""

    protocol: str  # "TCP" | "UDP" | "SCTP"
    address: str
    port: int

    def __str__(self) -> str:
        return f"{self.protocol} {self.address}:{self.port}"


Dest = tuple[str, int]  # a real server: (ip, port)


@dataclass(frozen=True, slots=True)
class VirtualServer:
    key: VSKey
    scheduler: str
    flags: int = 0
    timeout: int = 0
    destinations: tuple[Dest, ...] = ()
    # The address belongs on kube-ipvs0 (ClusterIPs; external/LB IPs not on another interface).
    bind: bool = False

    @property
    def attributes(self) -> tuple[str, int, int]:
        """What SET_SERVICE changes in place: scheduler, flags, persistence timeout."""
        return self.scheduler, self.flags, self.timeout


@dataclass(frozen=True, slots=True)
class ServiceBlock:
    """Everything one service port contributes to a sync."""

    virtual_servers: tuple[VirtualServer, ...]
    entries: tuple[tuple[str, str], ...]  # (set name, entry as `ipset save` prints it)
    # LoadBalancer IPs whose source ranges do not include the node: (ip, proto, port).
    no_node_access: tuple[tuple[str, str, int], ...] = ()
    problems: tuple[str, ...] = ()


@dataclass
class IpvsPlan:
    virtual_servers: dict[VSKey, VirtualServer] = field(default_factory=dict)
    owners: dict[VSKey, ServicePortName] = field(default_factory=dict)
    bind_addresses: set[str] = field(default_factory=set)
    # Every set kproxy manages -> its entries (empty sets included: they must exist).
    sets: dict[str, set[str]] = field(default_factory=dict)
    nat_rules: list[str] = field(default_factory=list)
    filter_rules: list[str] = field(default_factory=list)
    node_port_ips: tuple[str, ...] = ()
    problems: list[str] = field(default_factory=list)
    blocks: dict[ServicePortName, ServiceBlock] = field(default_factory=dict)

    def iptables_text(self) -> str:
        """The iptables-restore input (for --noflush), nat then filter like upstream."""
        nat = ["*nat", *(f":{c} - [0:0]" for c in n.NAT_CHAINS), *self.nat_rules, "COMMIT"]
        filt = [
            "*filter",
            *(f":{c} - [0:0]" for c in n.FILTER_CHAINS),
            *self.filter_rules,
            "COMMIT",
        ]
        return "\n".join(nat + filt) + "\n"

    @property
    def rules_total(self) -> dict[str, int]:
        return {"nat": len(self.nat_rules), "filter": len(self.filter_rules)}


def is_ipv4(address: str) -> bool:
    parts = address.split(".")
    return len(parts) == 4 and all(p.isdigit() and p.isascii() and int(p) < 256 for p in parts)


def set_net(cidr: str) -> str:
    """A source range the way `ipset save` prints it: the network address, /32 left out."""
    net = ipaddress.ip_network(cidr, strict=False)
    return str(net.network_address) if net.prefixlen == net.max_prefixlen else str(net)


def node_port_ips(
    options: RuleOptions, facts: NodeFacts, node_addresses: Iterable[str]
) -> tuple[str, ...]:
    """The addresses that get a NodePort virtual server (upstream: not loopback; every
    address of the node except kube-ipvs0's, or those nodePortAddresses selects)."""
    usable = sorted(
        {a for a in node_addresses if is_ipv4(a) and not a.startswith("127.")},
        key=lambda a: tuple(int(p) for p in a.split(".")),
    )
    # Only the node's own addresses, never kube-ipvs0's: upstream matches the CIDRs against
    # every interface, which turns ClusterIPs inside such a CIDR into NodePort addresses.
    picked = NodePortAddresses.from_entries(options.node_port_addresses).addresses(
        facts.node_ips, usable, include_loopback=False
    )
    return tuple(usable) if picked is None else picked


def _destinations(endpoints: Iterable[Endpoint]) -> tuple[Dest, ...]:
    return tuple(sorted({(e.ip, e.port) for e in endpoints if is_ipv4(e.ip)}))


class IpvsPlanner:
    """Builds IpvsPlans; keeps per-service blocks between calls while their inputs are equal."""

    def __init__(self, facts: NodeFacts, options: RuleOptions) -> None:
        self.facts = facts
        self.options = options
        self.scheduler = options.ipvs_scheduler or n.DEFAULT_SCHEDULER
        self.mark = options.masquerade_mark
        self.node_ip = next((ip for ip in facts.node_ips if is_ipv4(ip)), "")
        self._node_ip_obj = ipaddress.ip_address(self.node_ip) if self.node_ip else None
        self.detector = local_traffic_detector(options, ())
        self._detector_cidrs: tuple[str, ...] = ()
        self._addresses: frozenset[str] | None = None
        self._np_ips: tuple[str, ...] = ()
        self._cache: dict[ServicePortName, tuple[ServicePort, ServiceBlock]] = {}

    def plan(self, snapshot: Snapshot, node_addresses: Iterable[str] | None = None) -> IpvsPlan:
        """node_addresses: the node's addresses on interfaces other than kube-ipvs0
        (default: the facts' local addresses)."""
        addresses = frozenset(
            self.facts.local_addresses if node_addresses is None else node_addresses
        )
        if addresses != self._addresses:
            self._addresses = addresses
            self._np_ips = node_port_ips(self.options, self.facts, addresses)
            self._cache.clear()
        if snapshot.node.pod_cidrs != self._detector_cidrs:
            self._detector_cidrs = snapshot.node.pod_cidrs
            self.detector = local_traffic_detector(self.options, snapshot.node.pod_cidrs)
        plan = IpvsPlan(node_port_ips=self._np_ips)
        sets: dict[str, set[str]] = {name: set() for name in n.SET_NAMES}
        plan.sets = sets
        seen_problems: set[str] = set()
        no_node_access: list[tuple[str, str, int]] = []
        vss = plan.virtual_servers
        cache = self._cache
        live: set[ServicePortName] = set()
        for name in sorted(snapshot.services):
            sp = snapshot.services[name]
            live.add(name)
            hit = cache.get(name)
            if hit is not None and (hit[0] is sp or hit[0] == sp):
                block = hit[1]
            else:
                block = self._block(sp)
                cache[name] = (sp, block)
            plan.blocks[name] = block
            for vs in block.virtual_servers:
                other = plan.owners.get(vs.key)
                if other is not None:
                    seen_problems.add(
                        f"service {name}: virtual server {vs.key} is already programmed for "
                        f"{other}; this service port does not get it"
                    )
                    continue
                vss[vs.key] = vs
                plan.owners[vs.key] = name
                if vs.bind:
                    plan.bind_addresses.add(vs.key.address)
            for set_name, entry in block.entries:
                sets[set_name].add(entry)
            no_node_access.extend(block.no_node_access)
            seen_problems.update(block.problems)
        for gone in [k for k in cache if k not in live]:
            del cache[gone]
        sets[n.IPVS_IPS] = set(plan.bind_addresses)
        plan.problems = sorted(seen_problems)
        self._iptables(plan, sets, sorted(set(no_node_access)))
        return plan

    # --- one service port ---------------------------------------------------------------

    def _scheduling(self, sp: ServicePort) -> tuple[str, int, int, list[str]]:
        problems: list[str] = []
        who = f"service {sp.name.service}"
        scheduler = self.scheduler
        wanted = sp.annotation(n.SCHEDULER_ANNOTATION)
        if wanted:
            if wanted in n.SCHEDULERS:
                scheduler = wanted
            else:
                problems.append(
                    f"{who}: annotation {n.SCHEDULER_ANNOTATION}={wanted!r} is not an IPVS "
                    f"scheduler ({', '.join(n.SCHEDULERS)}); using {scheduler}"
                )
        flags = 0
        timeout = 0
        if sp.affinity_timeout is not None:
            flags |= n.FLAG_PERSISTENT
            timeout = sp.affinity_timeout
        text = sp.annotation(n.PERSISTENCE_ANNOTATION)
        if text:
            value = int(text) if text.isascii() and text.isdigit() else 0
            if 1 <= value <= n.MAX_PERSISTENCE_TIMEOUT:
                flags |= n.FLAG_PERSISTENT
                timeout = value
            else:
                problems.append(
                    f"{who}: annotation {n.PERSISTENCE_ANNOTATION}={text!r} must be a whole "
                    f"number of seconds from 1 to {n.MAX_PERSISTENCE_TIMEOUT}; ignored"
                )
        if scheduler == "mh":
            flags |= n.FLAG_SCHED2  # upstream: mh hashes source address and port
        return scheduler, flags, timeout, problems

    def _block(self, sp: ServicePort) -> ServiceBlock:
        scheduler, flags, timeout, problems = self._scheduling(sp)
        proto = sp.protocol.value
        lp = sp.protocol.lower
        port = sp.port
        addresses = self._addresses or frozenset()
        entries: list[tuple[str, str]] = []
        vss: list[VirtualServer] = []
        no_node_access: list[tuple[str, str, int]] = []

        def vs(address: str, vport: int, dests: tuple[Dest, ...], bind: bool) -> None:
            vss.append(
                VirtualServer(VSKey(proto, address, vport), scheduler, flags, timeout, dests, bind)
            )

        # Hairpin: a local endpoint reaching itself through the service is masqueraded.
        for ep in sp.endpoints:
            if ep.is_local and is_ipv4(ep.ip):
                entries.append((n.LOOP_BACK, f"{ep.ip},{lp}:{ep.port},{ep.ip}"))

        cluster = _destinations(sp.cluster_endpoints)
        local = _destinations(sp.local_endpoints)
        # Local policy falls back to every cluster endpoint when none is local (PR #97081).
        internal = (local or cluster) if sp.internal_policy_local else cluster
        external = (local or cluster) if sp.external_policy_local else cluster

        if sp.cluster_ip and is_ipv4(sp.cluster_ip):
            entries.append((n.CLUSTER_IP, f"{sp.cluster_ip},{lp}:{port}"))
            vs(sp.cluster_ip, port, internal, True)

        for ip in sp.external_ips:
            if not is_ipv4(ip):
                continue
            target = n.EXTERNAL_IP_LOCAL if sp.external_policy_local else n.EXTERNAL_IP
            entries.append((target, f"{ip},{lp}:{port}"))
            vs(ip, port, external, ip not in addresses)

        for ip in sp.load_balancer_ips:
            if not is_ipv4(ip):
                continue
            entry = f"{ip},{lp}:{port}"
            entries.append((n.LOAD_BALANCER, entry))
            if sp.external_policy_local:
                entries.append((n.LOAD_BALANCER_LOCAL, entry))
            if sp.load_balancer_source_ranges:
                entries.append((n.LOAD_BALANCER_FW, entry))
                allow_from_node = False
                for cidr in sp.load_balancer_source_ranges:
                    net = ipaddress.ip_network(cidr, strict=False)
                    if net.version != 4:
                        continue
                    entries.append((n.LOAD_BALANCER_SOURCE_CIDR, f"{entry},{set_net(cidr)}"))
                    if self._node_ip_obj is not None and self._node_ip_obj in net:
                        allow_from_node = True
                if allow_from_node:
                    # Traffic from the node to its own LB IP (hairpinned by a route) is let in.
                    entries.append((n.LOAD_BALANCER_SOURCE_IP, f"{entry},{ip}"))
                else:
                    no_node_access.append((ip, lp, port))
            vs(ip, port, external, ip not in addresses)

        if sp.node_port and self._np_ips:
            np = sp.node_port
            # bitmap:port for TCP/UDP; SCTP needs hash:ip,port (one entry per node IP).
            keys = [f"{ip},sctp:{np}" for ip in self._np_ips] if proto == "SCTP" else [str(np)]
            entries += [(n.NODE_PORT_SETS[proto], k) for k in keys]
            if sp.external_policy_local:
                entries += [(n.NODE_PORT_LOCAL_SETS[proto], k) for k in keys]
            for ip in self._np_ips:
                vs(ip, np, external, False)

        if sp.health_check_node_port:
            entries.append((n.HEALTH_CHECK_NODE_PORT, str(sp.health_check_node_port)))

        return ServiceBlock(tuple(vss), tuple(entries), tuple(no_node_access), tuple(problems))

    # --- the iptables layer ---------------------------------------------------------------

    def _iptables(
        self,
        plan: IpvsPlan,
        sets: dict[str, set[str]],
        no_node_access: list[tuple[str, str, int]],
    ) -> None:
        """Upstream's writeIptablesRules, rule for rule and in its order."""
        nat = plan.nat_rules
        filt = plan.filter_rules
        mark = self.mark

        def comment(name: str) -> str:
            return f'-m comment --comment "{n.SET_INFO[name].comment}"'

        nat.append("-A KUBE-SERVICES -s 127.0.0.0/8 -j RETURN")
        # (set, table, from chain, target, match directions, protocol match)
        linked = (
            (n.LOOP_BACK, nat, "KUBE-POSTROUTING", "MASQUERADE", "dst,dst,src", ""),
            (n.LOAD_BALANCER, nat, "KUBE-SERVICES", "KUBE-LOAD-BALANCER", "dst,dst", ""),
            (n.LOAD_BALANCER_LOCAL, nat, "KUBE-LOAD-BALANCER", "RETURN", "dst,dst", ""),
            (n.NODE_PORT_LOCAL_TCP, nat, "KUBE-NODE-PORT", "RETURN", "dst", "tcp"),
            (n.NODE_PORT_TCP, nat, "KUBE-NODE-PORT", "KUBE-MARK-MASQ", "dst", "tcp"),
            (n.NODE_PORT_LOCAL_UDP, nat, "KUBE-NODE-PORT", "RETURN", "dst", "udp"),
            (n.NODE_PORT_UDP, nat, "KUBE-NODE-PORT", "KUBE-MARK-MASQ", "dst", "udp"),
            (n.NODE_PORT_LOCAL_SCTP, nat, "KUBE-NODE-PORT", "RETURN", "dst,dst", "sctp"),
            (n.NODE_PORT_SCTP, nat, "KUBE-NODE-PORT", "KUBE-MARK-MASQ", "dst,dst", "sctp"),
            (
                n.LOAD_BALANCER_FW,
                filt,
                "KUBE-PROXY-FIREWALL",
                "KUBE-SOURCE-RANGES-FIREWALL",
                "dst,dst",
                "",
            ),
            (
                n.LOAD_BALANCER_SOURCE_CIDR,
                filt,
                "KUBE-SOURCE-RANGES-FIREWALL",
                "RETURN",
                "dst,dst,src",
                "",
            ),
            (
                n.LOAD_BALANCER_SOURCE_IP,
                filt,
                "KUBE-SOURCE-RANGES-FIREWALL",
                "RETURN",
                "dst,dst,src",
                "",
            ),
        )
        for name, rules, chain, target, dirs, proto in linked:
            if not sets[name]:
                continue
            p = f" -p {proto}" if proto else ""
            rules.append(
                f"-A {chain}{p} {comment(name)} -m set --match-set {name} {dirs} -j {target}"
            )

        if sets[n.CLUSTER_IP]:
            head = f"-A KUBE-SERVICES {comment(n.CLUSTER_IP)} -m set --match-set {n.CLUSTER_IP}"
            if self.options.masquerade_all:
                nat.append(f"{head} dst,dst -j KUBE-MARK-MASQ")
            elif self.detector.implemented:
                nat.append(f"{head} dst,dst {self.detector.if_not_local} -j KUBE-MARK-MASQ")
            else:
                # No way to tell pod traffic: masquerade node-originated traffic whose source
                # is a VIP (kube-ipvs0 makes a VIP the source of connections to VIPs).
                nat.append(f"{head} src,dst -j KUBE-MARK-MASQ")

        def external_accepts(head: str) -> None:
            # From off the machine (not a bridge port, not a local source), and to VIPs that
            # are local addresses (cloud LBs in the local table) stay accepted.
            nat.append(
                f"{head} -m physdev ! --physdev-is-in -m addrtype ! --src-type LOCAL -j ACCEPT"
            )
            nat.append(f"{head} -m addrtype --dst-type LOCAL -j ACCEPT")

        if sets[n.EXTERNAL_IP]:
            head = (
                f"-A KUBE-SERVICES {comment(n.EXTERNAL_IP)} -m set --match-set "
                f"{n.EXTERNAL_IP} dst,dst"
            )
            nat.append(f"{head} -j KUBE-MARK-MASQ")
            external_accepts(head)
        if sets[n.EXTERNAL_IP_LOCAL]:
            external_accepts(
                f"-A KUBE-SERVICES {comment(n.EXTERNAL_IP_LOCAL)} -m set --match-set "
                f"{n.EXTERNAL_IP_LOCAL} dst,dst"
            )

        nat.append("-A KUBE-SERVICES -m addrtype --dst-type LOCAL -j KUBE-NODE-PORT")
        nat.append("-A KUBE-LOAD-BALANCER -j KUBE-MARK-MASQ")
        filt.append("-A KUBE-SOURCE-RANGES-FIREWALL -j DROP")
        for ip, proto, port in no_node_access:
            # The node reaching an LB IP whose source ranges exclude it: IPVS makes src and
            # dst the LB IP, which KUBE-SOURCE-RANGES-FIREWALL cannot see (#119656).
            filt.append(
                f"-A KUBE-IPVS-OUT-FILTER -s {ip} -m ipvs --vaddr {ip} --vproto {proto}"
                f" --vport {port} -j DROP"
            )
        for name in (n.CLUSTER_IP, n.LOAD_BALANCER):
            if sets[name]:
                nat.append(f"-A KUBE-SERVICES -m set --match-set {name} dst,dst -j ACCEPT")
        filt.append(
            f'-A KUBE-FORWARD -m comment --comment "kubernetes forwarding rules"'
            f" -m mark --mark {mark}/{mark} -j ACCEPT"
        )
        filt.append(
            '-A KUBE-FORWARD -m comment --comment "kubernetes forwarding conntrack rule"'
            " -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT"
        )
        hc = n.HEALTH_CHECK_NODE_PORT
        filt.append(f"-A KUBE-NODE-PORT {comment(hc)} -m set --match-set {hc} dst -j ACCEPT")
        # Reach host ports through a VIP only for services (#72236).
        for name, dirs in (
            (n.LOAD_BALANCER, "dst,dst"),
            (n.CLUSTER_IP, "dst,dst"),
            (n.EXTERNAL_IP, "dst,dst"),
            (n.EXTERNAL_IP_LOCAL, "dst,dst"),
            (hc, "dst"),
        ):
            filt.append(f"-A KUBE-IPVS-FILTER -m set --match-set {name} {dirs} -j RETURN")
        filt.append(
            "-A KUBE-IPVS-FILTER -m conntrack --ctstate NEW"
            f" -m set --match-set {n.IPVS_IPS} dst -j REJECT"
        )
        nat.append(f"-A KUBE-POSTROUTING -m mark ! --mark {mark}/{mark} -j RETURN")
        nat.append(f"-A KUBE-POSTROUTING -j MARK --xor-mark {mark}")
        nat.append(
            '-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT"'
            " -j MASQUERADE" + (" --random-fully" if self.facts.random_fully else "")
        )
        nat.append(f"-A KUBE-MARK-MASQ -j MARK --or-mark {mark}")


def plan_full(
    snapshot: Snapshot,
    facts: NodeFacts,
    options: RuleOptions,
    node_addresses: Iterable[str] | None = None,
) -> IpvsPlan:
    return IpvsPlanner(facts, options).plan(snapshot, node_addresses)
