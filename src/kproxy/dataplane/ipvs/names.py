"""Names and constants of upstream kube-proxy's ipvs mode (pkg/proxy/ipvs), and kproxy's own.

Set names, types and comments, chain names and jump comments are upstream's, so a node
programmed by kproxy looks like one programmed by kube-proxy (and either cleans the other).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

DUMMY_DEVICE: Final = "kube-ipvs0"
DEFAULT_SCHEDULER: Final = "rr"
# Every scheduler upstream accepts (config validation uses the same list).
SCHEDULERS: Final = ("rr", "wrr", "lc", "wlc", "lblc", "lblcr", "sh", "dh", "sed", "nq", "mh")

# Virtual server flags (linux/ip_vs.h).
FLAG_PERSISTENT: Final = 0x1
FLAG_HASHED: Final = 0x2  # set by the kernel on every service; never ours to compare
FLAG_ONEPACKET: Final = 0x4
FLAG_SCHED1: Final = 0x8  # sh-fallback / mh-fallback
FLAG_SCHED2: Final = 0x10  # sh-port / mh-port: upstream sets it for mh ("FlagSourceHash")
FLAG_SCHED3: Final = 0x20
SCHED_FLAG_NAMES: Final = {
    "sh": {FLAG_SCHED1: "sh-fallback", FLAG_SCHED2: "sh-port"},
    "mh": {FLAG_SCHED1: "mh-fallback", FLAG_SCHED2: "mh-port"},
}
FWD_MASQ: Final = 0  # IP_VS_CONN_F_MASQ: NAT, what `ipvsadm -m` and kube-proxy use
FWD_NAMES: Final = {0: "Masq", 1: "Local", 2: "Tunnel", 3: "Route", 4: "Bypass"}

# kproxy's per-Service annotations (upstream has none).
SCHEDULER_ANNOTATION: Final = "ipvs.kproxy.io/scheduler"
PERSISTENCE_ANNOTATION: Final = "ipvs.kproxy.io/persistence-timeout"
MAX_PERSISTENCE_TIMEOUT: Final = 86400  # the API's cap for sessionAffinity timeouts

# Graceful termination: a drained real server is deleted once idle; upstream checks every
# minute, kproxy on every sync (at least every syncPeriod).
GRACEFUL_PROTOCOLS: Final = frozenset({"TCP"})  # UDP and SCTP real servers go at once

# Upstream's probe virtual server for the usability check (TEST-NET-2, RFC 5737).
PROBE_ADDRESS: Final = "198.51.100.0"
PROBE_PORT: Final = 20000


@dataclass(frozen=True, slots=True)
class SetInfo:
    name: str
    type: str
    comment: str

    @property
    def is_bitmap(self) -> bool:
        return self.type == "bitmap:port"

    def create_line(self) -> str:
        """`ipset restore` input that creates the set (upstream's parameters)."""
        if self.is_bitmap:
            return f"create {self.name} bitmap:port range 0-65535"
        return f"create {self.name} {self.type} family inet hashsize 1024 maxelem 65536"


LOOP_BACK: Final = "KUBE-LOOP-BACK"
CLUSTER_IP: Final = "KUBE-CLUSTER-IP"
EXTERNAL_IP: Final = "KUBE-EXTERNAL-IP"
EXTERNAL_IP_LOCAL: Final = "KUBE-EXTERNAL-IP-LOCAL"
LOAD_BALANCER: Final = "KUBE-LOAD-BALANCER"
LOAD_BALANCER_FW: Final = "KUBE-LOAD-BALANCER-FW"
LOAD_BALANCER_LOCAL: Final = "KUBE-LOAD-BALANCER-LOCAL"
LOAD_BALANCER_SOURCE_IP: Final = "KUBE-LOAD-BALANCER-SOURCE-IP"
LOAD_BALANCER_SOURCE_CIDR: Final = "KUBE-LOAD-BALANCER-SOURCE-CIDR"
NODE_PORT_TCP: Final = "KUBE-NODE-PORT-TCP"
NODE_PORT_LOCAL_TCP: Final = "KUBE-NODE-PORT-LOCAL-TCP"
NODE_PORT_UDP: Final = "KUBE-NODE-PORT-UDP"
NODE_PORT_LOCAL_UDP: Final = "KUBE-NODE-PORT-LOCAL-UDP"
NODE_PORT_SCTP: Final = "KUBE-NODE-PORT-SCTP-HASH"
NODE_PORT_LOCAL_SCTP: Final = "KUBE-NODE-PORT-LOCAL-SCTP-HASH"
HEALTH_CHECK_NODE_PORT: Final = "KUBE-HEALTH-CHECK-NODE-PORT"
IPVS_IPS: Final = "KUBE-IPVS-IPS"

# In upstream's order (ipsetInfo).
SETS: Final = (
    SetInfo(
        LOOP_BACK,
        "hash:ip,port,ip",
        "Kubernetes endpoints dst ip:port, source ip for solving hairpin purpose",
    ),
    SetInfo(
        CLUSTER_IP, "hash:ip,port", "Kubernetes service cluster ip + port for masquerade purpose"
    ),
    SetInfo(
        EXTERNAL_IP,
        "hash:ip,port",
        "Kubernetes service external ip + port for masquerade and filter purpose",
    ),
    SetInfo(
        EXTERNAL_IP_LOCAL,
        "hash:ip,port",
        "Kubernetes service external ip + port with externalTrafficPolicy=local",
    ),
    SetInfo(LOAD_BALANCER, "hash:ip,port", "Kubernetes service lb portal"),
    SetInfo(
        LOAD_BALANCER_FW,
        "hash:ip,port",
        "Kubernetes service load balancer ip + port for load balancer with sourceRange",
    ),
    SetInfo(
        LOAD_BALANCER_LOCAL,
        "hash:ip,port",
        "Kubernetes service load balancer ip + port with externalTrafficPolicy=local",
    ),
    SetInfo(
        LOAD_BALANCER_SOURCE_IP,
        "hash:ip,port,ip",
        "Kubernetes service load balancer ip + port + source IP for packet filter purpose",
    ),
    SetInfo(
        LOAD_BALANCER_SOURCE_CIDR,
        "hash:ip,port,net",
        "Kubernetes service load balancer ip + port + source cidr for packet filter purpose",
    ),
    SetInfo(NODE_PORT_TCP, "bitmap:port", "Kubernetes nodeport TCP port for masquerade purpose"),
    SetInfo(
        NODE_PORT_LOCAL_TCP,
        "bitmap:port",
        "Kubernetes nodeport TCP port with externalTrafficPolicy=local",
    ),
    SetInfo(NODE_PORT_UDP, "bitmap:port", "Kubernetes nodeport UDP port for masquerade purpose"),
    SetInfo(
        NODE_PORT_LOCAL_UDP,
        "bitmap:port",
        "Kubernetes nodeport UDP port with externalTrafficPolicy=local",
    ),
    SetInfo(
        NODE_PORT_SCTP,
        "hash:ip,port",
        "Kubernetes nodeport SCTP port for masquerade purpose with type 'hash ip:port'",
    ),
    SetInfo(
        NODE_PORT_LOCAL_SCTP,
        "hash:ip,port",
        "Kubernetes nodeport SCTP port with externalTrafficPolicy=local with type 'hash ip:port'",
    ),
    SetInfo(HEALTH_CHECK_NODE_PORT, "bitmap:port", "Kubernetes health check node port"),
    SetInfo(IPVS_IPS, "hash:ip", "Addresses on the ipvs interface"),
)
SET_INFO: Final = {s.name: s for s in SETS}
SET_NAMES: Final = tuple(s.name for s in SETS)
# IPv6 copies upstream creates in dual-stack clusters (KUBE-6-..., at most 31 characters).
IPV6_SET_NAMES: Final = tuple(("KUBE-6-" + n[len("KUBE-") :])[:31] for n in SET_NAMES)
# Every ipset name of ipvs mode: what a cleanup may destroy, and nothing else.
OWNED_SET_NAMES: Final = frozenset(SET_NAMES) | frozenset(IPV6_SET_NAMES)

NODE_PORT_SETS: Final = {"TCP": NODE_PORT_TCP, "UDP": NODE_PORT_UDP, "SCTP": NODE_PORT_SCTP}
NODE_PORT_LOCAL_SETS: Final = {
    "TCP": NODE_PORT_LOCAL_TCP,
    "UDP": NODE_PORT_LOCAL_UDP,
    "SCTP": NODE_PORT_LOCAL_SCTP,
}

# iptables chains (upstream's iptablesChains, in order).
NAT_CHAINS: Final = (
    "KUBE-SERVICES",
    "KUBE-POSTROUTING",
    "KUBE-NODE-PORT",
    "KUBE-LOAD-BALANCER",
    "KUBE-MARK-MASQ",
)
FILTER_CHAINS: Final = (
    "KUBE-FORWARD",
    "KUBE-NODE-PORT",
    "KUBE-PROXY-FIREWALL",
    "KUBE-SOURCE-RANGES-FIREWALL",
    "KUBE-IPVS-FILTER",
    "KUBE-IPVS-OUT-FILTER",
)
IPVS_CHAINS: Final = frozenset(NAT_CHAINS) | frozenset(FILTER_CHAINS)
# Chains iptables mode writes under the same names: whichever mode restored last owns them.
SHARED_CHAINS: Final = frozenset(
    {"KUBE-SERVICES", "KUBE-POSTROUTING", "KUBE-MARK-MASQ", "KUBE-FORWARD", "KUBE-PROXY-FIREWALL"}
)
IPVS_ONLY_CHAINS: Final = IPVS_CHAINS - SHARED_CHAINS

# Jumps from built-in chains (upstream's iptablesJumpChain, in order; each is prepended).
JUMPS: Final = (
    ("nat", "OUTPUT", "KUBE-SERVICES", "kubernetes service portals"),
    ("nat", "PREROUTING", "KUBE-SERVICES", "kubernetes service portals"),
    ("nat", "POSTROUTING", "KUBE-POSTROUTING", "kubernetes postrouting rules"),
    ("filter", "FORWARD", "KUBE-FORWARD", "kubernetes forwarding rules"),
    ("filter", "INPUT", "KUBE-NODE-PORT", "kubernetes health check rules"),
    ("filter", "INPUT", "KUBE-PROXY-FIREWALL", "kube-proxy firewall rules"),
    ("filter", "FORWARD", "KUBE-PROXY-FIREWALL", "kube-proxy firewall rules"),
    ("filter", "INPUT", "KUBE-IPVS-FILTER", "kubernetes ipvs access filter"),
    ("filter", "OUTPUT", "KUBE-IPVS-OUT-FILTER", "kubernetes ipvs access filter"),
)


def jump_rule(chain: str, target: str, comment: str) -> str:
    """A jump as iptables-save prints it, without the leading '-A '."""
    return f'{chain} -m comment --comment "{comment}" -j {target}'
