"""Plan userspace mode: Snapshot -> listener table + iptables-restore input. Pure, deterministic.

Every TCP/UDP service port gets a *cluster* listener (for its ClusterIP) and, when it has a
NodePort, externalIPs or LoadBalancer IPs, an *external* listener: the two follow different
traffic policies (internalTrafficPolicy vs externalTrafficPolicy), so the worker must know
which destination a connection was sent to, and a separate proxy port says so without any
per-connection lookup. Proxy ports come from a port range; a port stays with its listener
for as long as the listener exists (the caller persists the allocation across restarts).

Rules, in upstream's old userspace chains, with kproxy's additions:

* nat KUBE-PORTALS-CONTAINER (PREROUTING) / KUBE-PORTALS-HOST (OUTPUT): ClusterIP,
  externalIP and LoadBalancer destinations -> DNAT to <node IP>:<proxy port>. Upstream used
  REDIRECT in the container chain; REDIRECT drops packets arriving on an interface without
  an IPv4 address (routed pod veths have none), so the node IP is used instead.
* nat KUBE-NODEPORT-CONTAINER / KUBE-NODEPORT-HOST: NodePorts, same targets.
* filter KUBE-PORTALS-CONTAINER (INPUT, FORWARD) / KUBE-PORTALS-HOST (OUTPUT): REJECT for
  service ports without endpoints, DROP for "no local endpoints" and for LoadBalancer
  traffic outside loadBalancerSourceRanges (only traffic that was not redirected reaches
  these rules with a service destination).
* filter KUBE-NODEPORT-NON-LOCAL (INPUT): accept redirected traffic to the proxy ports,
  drop new connections made to a proxy port directly (they would bypass source ranges).
* mangle KUBE-PORTALS-CONTAINER (PREROUTING): mark replies to the workers' transparent
  (source-preserving) backend sockets; a policy route delivers marked packets locally.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kproxy.dataplane.base import OwnedObject
from kproxy.dataplane.facts import NodeFacts, RuleOptions
from kproxy.dataplane.nodepolicy import (
    LocalTrafficDetector,
    NodePortAddresses,
    local_traffic_detector,
    localhost_node_ports_enabled,
)
from kproxy.model.objects import Endpoint, Protocol, ServicePort, Snapshot

PORTALS_CONTAINER = "KUBE-PORTALS-CONTAINER"
PORTALS_HOST = "KUBE-PORTALS-HOST"
NODEPORT_CONTAINER = "KUBE-NODEPORT-CONTAINER"
NODEPORT_HOST = "KUBE-NODEPORT-HOST"
NODEPORT_NON_LOCAL = "KUBE-NODEPORT-NON-LOCAL"
CANARY_CHAIN = "KUBE-PROXY-CANARY"
# Chains per table, in the order they are declared.
CHAINS: dict[str, tuple[str, ...]] = {
    "filter": (PORTALS_CONTAINER, PORTALS_HOST, NODEPORT_NON_LOCAL),
    "nat": (PORTALS_CONTAINER, PORTALS_HOST, NODEPORT_CONTAINER, NODEPORT_HOST),
    "mangle": (PORTALS_CONTAINER,),
}
TABLE_ORDER = ("filter", "nat", "mangle")

# fwmark of replies to transparent backend sockets, and the policy route that delivers them.
TPROXY_MARK = 0x00002000
ROUTE_TABLE = 2900
RULE_PRIORITY = 2900
# SO_MARK of the UDP replies workers send while their flows are handed to the next mode
# (proxier.py); a raw-table rule keeps them out of conntrack.
HANDOFF_MARK = 0x00001000
HANDOFF_COMMENT = "kproxy userspace: UDP replies of flows handed to the next mode"
HANDOFF_RULE = (
    f"OUTPUT -p udp -m mark --mark {HANDOFF_MARK:#x}/{HANDOFF_MARK:#x}"
    f' -m comment --comment "{HANDOFF_COMMENT}" -j CT --notrack'
)


def handoff_objects(where: str, rules: Iterable[str]) -> list[OwnedObject]:
    """The hand-off rules among raw-table rules of `where` ("iptables-legacy"): outside a
    switch they are what a crash during one left."""
    return [
        OwnedObject(
            "iptables-rule",
            f"{where} raw",
            rule,
            "kproxy userspace mode's UDP hand-off of a switch (left by a crash)",
        )
        for rule in rules
        if f'"{HANDOFF_COMMENT}"' in rule
    ]


DEFAULT_PORT_RANGE = (20000, 29999)

_PORTALS_COMMENT = "handle ClusterIPs; NOTE: this must be before the NodePort rules"
_NODEPORTS_COMMENT = "handle service NodePorts; NOTE: this must be the last rule in the chain"
# Jumps from built-in chains: (table, chain, extra match, comment, target, verb).
# -I puts a jump first, -A last (upstream appended the NodePort jumps).
JUMPS: tuple[tuple[str, str, str, str, str, str], ...] = (
    ("nat", "PREROUTING", "", _PORTALS_COMMENT, PORTALS_CONTAINER, "-I"),
    ("nat", "OUTPUT", "", _PORTALS_COMMENT, PORTALS_HOST, "-I"),
    (
        "nat",
        "PREROUTING",
        "-m addrtype --dst-type LOCAL",
        _NODEPORTS_COMMENT,
        NODEPORT_CONTAINER,
        "-A",
    ),
    ("nat", "OUTPUT", "-m addrtype --dst-type LOCAL", _NODEPORTS_COMMENT, NODEPORT_HOST, "-A"),
    (
        "filter",
        "INPUT",
        "",
        "Ensure that non-local NodePort traffic can flow",
        NODEPORT_NON_LOCAL,
        "-I",
    ),
    (
        "filter",
        "INPUT",
        "-m conntrack --ctstate NEW",
        "kubernetes service portals",
        PORTALS_CONTAINER,
        "-I",
    ),
    (
        "filter",
        "FORWARD",
        "-m conntrack --ctstate NEW",
        "kubernetes service portals",
        PORTALS_CONTAINER,
        "-I",
    ),
    (
        "filter",
        "OUTPUT",
        "-m conntrack --ctstate NEW",
        "kubernetes service portals",
        PORTALS_HOST,
        "-I",
    ),
    (
        "mangle",
        "PREROUTING",
        "",
        "kubernetes service portals: transparent proxy replies",
        PORTALS_CONTAINER,
        "-I",
    ),
)


def jump_rule(chain: str, extra: str, comment: str, target: str) -> str:
    middle = f"{extra} " if extra else ""
    return f'{chain} {middle}-m comment --comment "{comment}" -j {target}'


# --- proxy ports ------------------------------------------------------------------------------


def parse_port_range(text: str) -> tuple[int, int]:
    """kube-proxy's --proxy-port-range syntax: "", "N-M" or "N+size"; "" is the default."""
    text = text.strip()
    if not text:
        return DEFAULT_PORT_RANGE
    if "+" in text:
        base, size = (int(x) for x in text.split("+", 1))
        lo, hi = base, base + size
    elif "-" in text:
        lo, hi = (int(x) for x in text.split("-", 1))
    else:
        lo = hi = int(text)
    if not 0 < lo <= hi <= 65535:
        raise ValueError(f"invalid proxy port range {text!r}")
    return lo, hi


def _hash_port(key: str, lo: int, size: int) -> int:
    return lo + int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") % size


def allocate_ports(
    keys: Iterable[str],
    previous: Mapping[str, int],
    port_range: tuple[int, int] = DEFAULT_PORT_RANGE,
    avoid: Iterable[int] = (),
    bad: Iterable[int] = (),
) -> dict[str, int]:
    """A proxy port per listener key. Deterministic.

    A key keeps its `previous` port while that is in the range and not `bad` (known to be
    taken by another program). A new key gets its hash position in the range, probing
    upwards past ports already handed out, `bad` ones and `avoid` ones (ports that listeners
    being retired still hold)."""
    lo, hi = port_range
    size = hi - lo + 1
    wanted = sorted(set(keys))
    used = {p for p in bad if lo <= p <= hi}
    out: dict[str, int] = {}
    for key in wanted:
        port = previous.get(key)
        if port is not None and lo <= port <= hi and port not in used:
            out[key] = port
            used.add(port)
    used |= {p for p in avoid if lo <= p <= hi}
    if len(wanted) - len(out) > size - len(used):
        raise ValueError(f"{len(wanted)} listeners do not fit into the proxy port range {lo}-{hi}")
    for key in wanted:
        if key in out:
            continue
        port = _hash_port(key, lo, size)
        while port in used:
            port = lo if port == hi else port + 1
        out[key] = port
        used.add(port)
    return out


# --- the listener table -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Listener:
    """One proxy port and what a worker does with a connection that arrives there.

    source: "detect" (ClusterIP: keep the client address for pod clients, masquerade the
    others, as iptables mode's KUBE-MARK-MASQ rules do), "masquerade" (externalTrafficPolicy
    Cluster: always from the node), "local" (externalTrafficPolicy Local: keep the client
    address and use `targets`; pods and the node itself use `fallback`, the cluster
    endpoints, as upstream's KUBE-EXT chain does).
    """

    key: str
    service: str
    protocol: str  # "tcp" | "udp"
    scope: str  # "cluster" | "external"
    port: int
    targets: tuple[tuple[str, int], ...]
    fallback: tuple[tuple[str, int], ...] = ()
    source: str = "detect"
    affinity: int | None = None
    destinations: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "service": self.service,
            "protocol": self.protocol,
            "scope": self.scope,
            "port": self.port,
            "targets": [list(t) for t in self.targets],
            "fallback": [list(t) for t in self.fallback],
            "source": self.source,
            "affinity": self.affinity,
            "destinations": list(self.destinations),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Listener:
        return cls(
            key=str(data["key"]),
            service=str(data["service"]),
            protocol=str(data["protocol"]),
            scope=str(data["scope"]),
            port=int(data["port"]),
            targets=tuple((str(ip), int(p)) for ip, p in data.get("targets", ())),
            fallback=tuple((str(ip), int(p)) for ip, p in data.get("fallback", ())),
            source=str(data.get("source", "detect")),
            affinity=None if data.get("affinity") is None else int(data["affinity"]),
            destinations=tuple(data.get("destinations", ())),
        )


def listener_key(sp: ServicePort, scope: str) -> str:
    return f"{sp.name}/{sp.protocol.lower}/{scope}"


@dataclass
class UserspacePlan:
    listeners: list[Listener] = field(default_factory=list)
    rules: dict[str, list[str]] = field(default_factory=lambda: {t: [] for t in TABLE_ORDER})
    # Detector CIDRs the workers use to tell pod clients from others (None: no detector).
    local_cidrs: tuple[str, ...] | None = None
    masquerade_all: bool = False
    skipped: list[str] = field(default_factory=list)

    @property
    def ports(self) -> dict[str, int]:
        return {lst.key: lst.port for lst in self.listeners}

    def text(self, *, canary: bool = True) -> str:
        """iptables-restore input: every chain of ours declared (flushed) and rewritten."""
        out: list[str] = []
        for table in TABLE_ORDER:
            out.append(f"*{table}")
            out += [f":{c} - [0:0]" for c in CHAINS[table]]
            if canary and table == "nat":
                out.append(f":{CANARY_CHAIN} - [0:0]")
            out += self.rules[table]
            out.append("COMMIT")
        return "\n".join(out) + "\n"

    def rule_counts(self) -> dict[str, int]:
        return {t: len(r) for t, r in self.rules.items()}

    def worker_table(self) -> dict[str, Any]:
        """What the workers need (control.py adds generation and worker count)."""
        return {
            "local_cidrs": None if self.local_cidrs is None else list(self.local_cidrs),
            "masquerade_all": self.masquerade_all,
            "listeners": [lst.to_json() for lst in self.listeners],
        }

    def listener_table_text(self) -> str:
        """The listener table as comment lines (valid in restore input), one per listener."""
        lines = [
            "# kproxy userspace listeners: proxy port/protocol scope source service"
            " destinations -> endpoints"
        ]
        for lst in sorted(self.listeners, key=lambda x: x.port):
            eps = " ".join(f"{ip}:{p}" for ip, p in lst.targets) or "(none)"
            extra = ""
            if lst.fallback and lst.fallback != lst.targets:
                extra = " | pods and node: " + " ".join(f"{ip}:{p}" for ip, p in lst.fallback)
            aff = f" affinity={lst.affinity}s" if lst.affinity is not None else ""
            dests = ",".join(lst.destinations)
            lines.append(
                f"# {lst.port}/{lst.protocol} {lst.scope} {lst.source}{aff} {lst.service}"
                f" {dests} -> {eps}{extra}"
            )
        lines += [f"# skipped: {s}" for s in self.skipped]
        return "\n".join(lines) + "\n"


def _addrs(endpoints: Iterable[Endpoint]) -> tuple[tuple[str, int], ...]:
    return tuple((ep.ip, ep.port) for ep in endpoints)


def proxied(sp: ServicePort) -> bool:
    """Whether userspace mode proxies this service port (IPv4 TCP and UDP only)."""
    return sp.protocol is not Protocol.SCTP and bool(sp.cluster_ip) and ":" not in sp.cluster_ip


def listener_keys(ports: Iterable[ServicePort]) -> list[str]:
    """One listener per scope a proxied port uses: its ClusterIP, and its external
    addresses (NodePort, externalIPs, LoadBalancer IPs) when it has any. Each needs a port
    of the proxy port range."""
    keys: list[str] = []
    for sp in ports:
        if not proxied(sp):
            continue
        if sp.has_internal_endpoints:
            keys.append(listener_key(sp, "cluster"))
        if sp.any_endpoints and sp.is_external:
            keys.append(listener_key(sp, "external"))
    return keys


class UserspaceRenderer:
    def __init__(
        self,
        facts: NodeFacts,
        options: RuleOptions,
        *,
        port_range: tuple[int, int] = DEFAULT_PORT_RANGE,
    ) -> None:
        self.facts = facts
        self.options = options
        self.port_range = port_range
        self.localhost_nodeports = localhost_node_ports_enabled(options)
        node_ips = [ip for ip in facts.node_ips if ":" not in ip]
        self.node_ip = node_ips[0] if node_ips else ""

    def plan(
        self,
        snapshot: Snapshot,
        previous_ports: Mapping[str, int] | None = None,
        avoid_ports: Iterable[int] = (),
        bad_ports: Iterable[int] = (),
    ) -> UserspacePlan:
        detector = local_traffic_detector(self.options, snapshot.node.pod_cidrs)
        plan = UserspacePlan(
            # An interface-based detector cannot be checked on an accepted socket: the
            # workers then see no detector (client addresses are kept).
            local_cidrs=(detector.cidr,) if detector.cidr else None,
            masquerade_all=self.options.masquerade_all,
        )
        ports_in_use: list[ServicePort] = []
        for sp in snapshot.sorted_ports():
            if not proxied(sp):
                plan.skipped.append(
                    f"{sp.name} ({sp.protocol}, {sp.cluster_ip or 'no IP'}):"
                    " userspace mode proxies IPv4 TCP and UDP only"
                )
                continue
            ports_in_use.append(sp)
        keys = listener_keys(ports_in_use)
        ports = allocate_ports(keys, previous_ports or {}, self.port_range, avoid_ports, bad_ports)
        # Loopback addresses stay in the list: only the host chain leaves them out, unless
        # localhostNodePorts allows them (see _service).
        np_ips = NodePortAddresses.from_entries(self.options.node_port_addresses).addresses(
            self.facts.node_ips, self.facts.local_addresses, include_loopback=True
        )
        for sp in ports_in_use:
            self._service(plan, sp, ports, detector, np_ips)
        return plan

    # --- one service port ---------------------------------------------------------------------

    def _target(self, port: int) -> str:
        if self.node_ip:
            return f"-j DNAT --to-destination {self.node_ip}:{port}"
        return f"-j REDIRECT --to-ports {port}"

    def _service(
        self,
        plan: UserspacePlan,
        sp: ServicePort,
        ports: Mapping[str, int],
        detector: LocalTrafficDetector,
        np_ips: tuple[str, ...] | None,
    ) -> None:
        name = str(sp.name)
        proto = sp.protocol.lower
        match = f"-p {proto} -m {proto}"
        nat, filt = plan.rules["nat"], plan.rules["filter"]
        cip = f"-d {sp.cluster_ip}/32 --dport {sp.port}"

        def reject(comment: str, dest: str, target: str, *, host: bool = True) -> None:
            chains = (PORTALS_CONTAINER, PORTALS_HOST) if host else (PORTALS_CONTAINER,)
            for chain in chains:
                filt.append(
                    f'-A {chain} -m comment --comment "{comment}" {match} {dest} -j {target}'
                )

        if not sp.any_endpoints:
            gone = f"{name} has no endpoints"
            reject(gone, cip, "REJECT")
            for ip in (*sp.external_ips, *sp.load_balancer_ips):
                reject(gone, f"-d {ip}/32 --dport {sp.port}", "REJECT")
            if sp.node_port:
                reject(gone, f"-m addrtype --dst-type LOCAL --dport {sp.node_port}", "REJECT")
            return

        if sp.has_internal_endpoints:
            key = listener_key(sp, "cluster")
            port = ports[key]
            plan.listeners.append(
                Listener(
                    key=key,
                    service=name,
                    protocol=proto,
                    scope="cluster",
                    port=port,
                    targets=_addrs(sp.internal_endpoints),
                    source="masquerade" if self.options.masquerade_all else "detect",
                    affinity=sp.affinity_timeout,
                    destinations=(f"{sp.cluster_ip}:{sp.port}",),
                )
            )
            for chain in (PORTALS_CONTAINER, PORTALS_HOST):
                nat.append(
                    f'-A {chain} -m comment --comment "{name} cluster IP" {match} {cip}'
                    f" {self._target(port)}"
                )
            self._accept_proxy_port(filt, name, proto, port)
        else:
            reject(f"{name} has no local endpoints", cip, "DROP")

        if not sp.is_external:
            return
        key = listener_key(sp, "external")
        port = ports[key]
        local = sp.external_policy_local
        dests = [f"{ip}:{sp.port}" for ip in (*sp.external_ips, *sp.load_balancer_ips)]
        if sp.node_port:
            dests.append(f"nodePort {sp.node_port}")
        plan.listeners.append(
            Listener(
                key=key,
                service=name,
                protocol=proto,
                scope="external",
                port=port,
                targets=_addrs(sp.external_endpoints),
                fallback=_addrs(sp.cluster_endpoints) if local else (),
                source="local" if local else "masquerade",
                affinity=sp.affinity_timeout,
                destinations=tuple(dests),
            )
        )
        self._accept_proxy_port(filt, name, proto, port)
        target = self._target(port)
        # Without local endpoints (Local policy), only pods and the node itself are served
        # (from the cluster endpoints), like upstream's KUBE-EXT chain; the rest is dropped.
        everyone = sp.has_external_endpoints
        container_src = (
            [""] if everyone else ([f"{detector.if_local} "] if detector.implemented else [])
        )
        no_local = f"{name} has no local endpoints"

        def redirect(chain: str, src: str, comment: str, dest: str) -> None:
            nat.append(f'-A {chain} {src}-m comment --comment "{comment}" {match} {dest} {target}')

        def portal(dest: str, comment: str, sources: list[str]) -> None:
            for src in sources:
                redirect(PORTALS_CONTAINER, src, comment, dest)
            if not everyone:
                reject(no_local, dest, "DROP", host=False)

        for ip in sp.external_ips:
            dest = f"-d {ip}/32 --dport {sp.port}"
            portal(dest, f"{name} external IP", container_src)
            redirect(PORTALS_HOST, "", f"{name} external IP", dest)
        for ip in sp.load_balancer_ips:
            dest = f"-d {ip}/32 --dport {sp.port}"
            ranges = sp.load_balancer_source_ranges
            comment = f"{name} loadbalancer IP"
            if ranges:
                allowed = [f"-s {cidr} " for cidr in ranges]
                # (Local policy without local endpoints and source ranges: only the node.)
                portal(dest, comment, allowed if everyone else [])
                for src in allowed:
                    redirect(PORTALS_HOST, src, comment, dest)
                # Not redirected means not allowed: drop, as KUBE-PROXY-FIREWALL does.
                reject(f"{name} traffic not accepted by loadBalancerSourceRanges", dest, "DROP")
            else:
                portal(dest, comment, container_src)
                nat.append(
                    f'-A {PORTALS_HOST} -m comment --comment "{comment}" {match} {dest} {target}'
                )
        if sp.node_port:
            np = f"-m comment --comment {name} {match} --dport {sp.node_port} {target}"
            if np_ips is None:
                for src in container_src:
                    nat.append(f"-A {NODEPORT_CONTAINER} {src}{np}")
                lo = "" if self.localhost_nodeports else "! -d 127.0.0.0/8 "
                nat.append(f"-A {NODEPORT_HOST} {lo}{np}")
            else:
                for ip in np_ips:
                    for src in container_src:
                        nat.append(f"-A {NODEPORT_CONTAINER} {src}-d {ip}/32 {np}")
                    if ip.startswith("127.") and not self.localhost_nodeports:
                        continue
                    nat.append(f"-A {NODEPORT_HOST} -d {ip}/32 {np}")
            if not everyone:
                reject(
                    no_local,
                    f"-m addrtype --dst-type LOCAL --dport {sp.node_port}",
                    "DROP",
                    host=False,
                )

    @staticmethod
    def _accept_proxy_port(filt: list[str], name: str, proto: str, port: int) -> None:
        match = f"-p {proto} -m {proto} --dport {port}"
        filt.append(
            f'-A {NODEPORT_NON_LOCAL} -m comment --comment "{name}" -m conntrack --ctstate DNAT'
            f" {match} -j ACCEPT"
        )
        filt.append(
            f'-A {NODEPORT_NON_LOCAL} -m comment --comment "{name} proxy port, not through a'
            f' service portal" -m conntrack --ctstate NEW {match} -j DROP'
        )


def mangle_rules() -> list[str]:
    mark = f"{TPROXY_MARK:#x}"
    return [
        f'-A {PORTALS_CONTAINER} -m comment --comment "replies to source-preserving proxy'
        f' connections" -m socket --transparent -j MARK --set-xmark {mark}/{mark}'
    ]


def render_plan(
    snapshot: Snapshot,
    facts: NodeFacts,
    options: RuleOptions,
    *,
    previous_ports: Mapping[str, int] | None = None,
    port_range: tuple[int, int] = DEFAULT_PORT_RANGE,
    avoid_ports: Iterable[int] = (),
    bad_ports: Iterable[int] = (),
) -> UserspacePlan:
    plan = UserspaceRenderer(facts, options, port_range=port_range).plan(
        snapshot, previous_ports, avoid_ports, bad_ports
    )
    plan.rules["mangle"] = mangle_rules()
    return plan


def render_text(
    snapshot: Snapshot,
    facts: NodeFacts,
    options: RuleOptions,
    *,
    previous_ports: Mapping[str, int] | None = None,
    port_range: tuple[int, int] = DEFAULT_PORT_RANGE,
) -> str:
    """What `kproxy render --proxy-mode userspace` prints: the restore input a full sync
    applies (jumps from the built-in chains are added only when missing, not shown), then the
    listener table as comment lines, so the whole output is still valid restore input."""
    plan = render_plan(
        snapshot, facts, options, previous_ports=previous_ports, port_range=port_range
    )
    return plan.text() + plan.listener_table_text()
