"""The shared vocabulary of `kproxy list` and `kproxy trace`, whatever the mode.

Every mode is read by a small reader (iptables_reader, nftables_reader, later ipvs and
userspace) that turns what the kernel holds into a `ModeView`: the programmed virtual
servers in ipvsadm's terms (virtual address:port, scheduler, flags, real servers) and a
packet-path walk for one new connection. listing.py and trace.py only ever talk to that
interface, so a new mode is one more reader registered in readers.py.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any, Protocol

ANY_ADDRESS = "*"  # a NodePort that answers on every local address (match-all)

# Kinds of virtual server, in the order a service's addresses are listed.
CLUSTER_IP = "ClusterIP"
EXTERNAL_IP = "ExternalIP"
LOAD_BALANCER = "LoadBalancer"
EXTERNAL = "External"  # nftables: an externalIP or LB IP (its maps do not tell which)
NODE_PORT = "NodePort"
KIND_ORDER = {CLUSTER_IP: 0, EXTERNAL_IP: 1, EXTERNAL: 1, LOAD_BALANCER: 2, NODE_PORT: 3}


@dataclass(frozen=True, order=True)
class Destination:
    """A service destination a dataplane programs: a ClusterIP, externalIP or LoadBalancer
    IP with its protocol and port (in ipvs mode any virtual server: IPVS does not say
    which are NodePorts)."""

    ip: str
    proto: str
    port: int

    def __str__(self) -> str:
        return f"{self.proto} {self.ip}:{self.port}"


@dataclass
class RealServer:
    """One endpoint a virtual server DNATs to (ipvsadm's "-> RemoteAddress:Port" line)."""

    address: str
    port: int
    chain: str = ""  # KUBE-SEP-… / endpoint-… that does the DNAT
    forward: str = "Masq"
    weight: int = 1
    # Probability that a new connection without affinity state lands here (1/n for n
    # endpoints when the kernel's ladder is intact). None: not computable.
    share: float | None = None
    active: int = 0  # ESTABLISHED conntrack entries (ActiveConn)
    inactive: int = 0  # other states (InActConn), e.g. TIME_WAIT, SYN_SENT, UDP
    packets: int | None = None  # rule counters (None: the layout has none)
    bytes: int | None = None
    packet_rate: float | None = None
    byte_rate: float | None = None

    @property
    def addr(self) -> str:
        return (
            f"[{self.address}]:{self.port}"
            if ":" in self.address
            else f"{self.address}:{self.port}"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "address": self.address,
            "port": self.port,
            "chain": self.chain,
            "forward": self.forward,
            "weight": self.weight,
            "share": self.share,
            "active_conns": self.active,
            "inactive_conns": self.inactive,
            "packets": self.packets,
            "bytes": self.bytes,
            "packet_rate": self.packet_rate,
            "byte_rate": self.byte_rate,
        }


@dataclass
class VirtualServer:
    """One programmed service destination: protocol, address ("*" for every local
    address), port, and where new connections to it go."""

    proto: str  # tcp | udp | sctp
    address: str
    port: int
    service: str = ""  # "ns/name:port" as in kube-proxy's comments (or from chain names)
    kind: str = CLUSTER_IP
    scheduler: str = "random"  # iptables: statistic random; nftables: numgen; none: no dispatch
    chain: str = ""  # entry chain (KUBE-SVC-…, KUBE-EXT-…, service-…, external-…)
    persistent: int | None = None  # ClientIP affinity timeout in seconds
    local_only: bool = False  # Local traffic policy: only this node's endpoints
    source_ranges: tuple[str, ...] = ()  # loadBalancerSourceRanges, as programmed
    # "REJECT" / "DROP" when the kernel refuses new connections (no (local) endpoints).
    verdict: str | None = None
    verdict_reason: str = ""
    endpoints: list[RealServer] = field(default_factory=list)
    packets: int | None = None
    bytes: int | None = None
    packet_rate: float | None = None
    byte_rate: float | None = None
    # conntrack entries to this address whose reply source is none of the endpoints.
    unlisted_conns: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.proto, self.address, self.port)

    @property
    def addr(self) -> str:
        if ":" in self.address:
            return f"[{self.address}]:{self.port}"
        return f"{self.address}:{self.port}"

    @property
    def flags(self) -> list[str]:
        out: list[str] = []
        if self.persistent is not None:
            out.append(f"persistent {self.persistent}")
        if self.local_only:
            out.append("local-only")
        if self.source_ranges:
            out.append("source-ranges " + ",".join(self.source_ranges))
        if self.verdict:
            out.append(self.verdict.lower())
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "proto": self.proto,
            "address": self.address,
            "port": self.port,
            "service": self.service,
            "kind": self.kind,
            "scheduler": self.scheduler,
            "flags": self.flags,
            "chain": self.chain,
            "persistent": self.persistent,
            "local_only": self.local_only,
            "source_ranges": list(self.source_ranges),
            "verdict": self.verdict,
            "verdict_reason": self.verdict_reason,
            "packets": self.packets,
            "bytes": self.bytes,
            "packet_rate": self.packet_rate,
            "byte_rate": self.byte_rate,
            "unlisted_conns": self.unlisted_conns,
            "notes": list(self.notes),
            "endpoints": [rs.to_json() for rs in self.endpoints],
        }


def equal_shares(servers: list[RealServer]) -> None:
    for rs in servers:
        rs.share = 1.0 / len(servers)


@dataclass(frozen=True)
class Packet:
    """The first packet of a new connection."""

    src: str
    dst: str
    dport: int
    proto: str = "tcp"
    # True: sent by the node itself (nat OUTPUT); False: arrives from outside (PREROUTING).
    from_node: bool = False
    sport: int | None = None

    def __str__(self) -> str:
        return f"{self.proto} {self.src} -> {self.dst}:{self.dport}"

    def to_json(self) -> dict[str, Any]:
        return {
            "src": self.src,
            "dst": self.dst,
            "dport": self.dport,
            "proto": self.proto,
            "from_node": self.from_node,
        }


@dataclass(frozen=True)
class Step:
    """One rule the packet matched (or a fork it took) on its way."""

    table: str  # iptables table, or the nftables table
    chain: str
    rule: int | None  # 1-based position in the chain (iptables -L --line-numbers)
    text: str  # the rule as the kernel listing shows it
    action: str  # what it did: "jump KUBE-SVC-…", "DNAT to 10.244.0.2:8080", "mark 0x4000", …
    handle: int | None = None  # nftables rule handle
    notes: tuple[str, ...] = ()

    def where(self) -> str:
        num = f" rule {self.rule}" if self.rule is not None else ""
        handle = f" (handle {self.handle})" if self.handle is not None else ""
        return f"{self.table} {self.chain}{num}{handle}"

    def to_json(self) -> dict[str, Any]:
        return {
            "table": self.table,
            "chain": self.chain,
            "rule": self.rule,
            "handle": self.handle,
            "text": self.text,
            "action": self.action,
            "notes": list(self.notes),
        }


# Final verdicts of a trace outcome.
DNAT = "DNAT"
ACCEPT = "ACCEPT"  # passed without DNAT
DROP = "DROP"
REJECT = "REJECT"


@dataclass
class Outcome:
    """One way a new connection can go; a trace has one per branch of the random choice
    (and per affinity condition the reader cannot decide)."""

    probability: float | None
    conditions: tuple[str, ...]
    steps: list[Step]
    verdict: str
    dnat: str | None = None  # "10.244.0.2:8080"
    service: str | None = None
    masquerade: bool | None = None  # None: not decided (dropped, or delivered locally)
    reason: str = ""
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        if self.verdict == DNAT:
            text = f"DNAT to {self.dnat}"
            if self.service:
                text += f" ({self.service})"
            if self.masquerade:
                text += ", masqueraded (source becomes the node's address)"
            elif self.masquerade is False:
                text += ", source address kept"
            return text
        return self.reason or self.verdict

    def to_json(self) -> dict[str, Any]:
        return {
            "probability": self.probability,
            "conditions": list(self.conditions),
            "verdict": self.verdict,
            "dnat": self.dnat,
            "service": self.service,
            "masquerade": self.masquerade,
            "reason": self.reason,
            "summary": self.summary(),
            "notes": list(self.notes),
            "steps": [s.to_json() for s in self.steps],
        }


@dataclass
class Walk:
    """A trace in one dataplane: every outcome, plus notes about the walk as a whole."""

    outcomes: list[Outcome]
    notes: list[str] = field(default_factory=list)


class ModeView(Protocol):
    """What one mode's reader offers: its programmed services and a packet walk."""

    dataplane: str  # "iptables-nft", "iptables-legacy", "nftables", later "ipvs", "userspace"
    mode: str  # "iptables", "nftables", …
    live: bool  # hooked into the packet path (not just leftovers)
    detail: str  # why live / not live, for the header
    has_counters: bool
    notes: list[str]

    def services(self) -> list[VirtualServer]: ...

    def trace(self, packet: Packet) -> Walk: ...

    def local_addresses(self) -> list[str] | None: ...


# --- small helpers shared by the readers ---------------------------------------------------


def in_network(addr: str, cidr: str) -> bool | None:
    """addr in cidr; None when either does not parse."""
    try:
        return ipaddress.ip_address(addr) in ipaddress.ip_network(cidr, strict=False)
    except ValueError:
        return None


def strip_host_prefix(addr: str) -> str:
    """'10.96.0.10/32' -> '10.96.0.10' (other prefixes are kept)."""
    if addr.endswith("/32"):
        return addr[:-3]
    if addr.endswith("/128"):
        return addr[:-4]
    return addr


def split_hostport(text: str) -> tuple[str, int | None]:
    """'10.244.0.2:8080' -> ('10.244.0.2', 8080); '[fd00::1]:80' -> ('fd00::1', 80)."""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
    else:
        host, port = text, ""
    port = port.split("-", 1)[0]
    return host, int(port) if port.isdigit() else None


def address_sort_key(address: str) -> tuple[int, int, str]:
    if address == ANY_ADDRESS:
        return (2, 0, address)
    try:
        ip = ipaddress.ip_address(address.split("/", 1)[0])
    except ValueError:
        return (3, 0, address)
    return (ip.version - 4, int(ip), address)


def percent(p: float | None) -> str:
    if p is None:
        return "?"
    value = p * 100
    return f"{value:.1f}%" if value >= 0.05 or value == 0 else f"{value:.2g}%"
