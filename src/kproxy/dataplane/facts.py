"""Inputs a dataplane plan needs besides the snapshot: node facts and rule options.

NodeFacts are what a live sync detects on the node (addresses, iptables features); a render
takes them as options so that its output is reproducible on any machine. RuleOptions are
the parts of the configuration that shape rules. Both are frozen so plans stay pure.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kproxy.dataplane.nodepolicy import DEFAULT_DETECT_LOCAL_MODE


@dataclass(frozen=True, slots=True)
class NodeFacts:
    # The node's primary IPs (used for nodePortAddresses "primary" and firewall rules).
    node_ips: tuple[str, ...] = ()
    # Every address on the node's interfaces (for matching nodePortAddresses CIDRs).
    local_addresses: tuple[str, ...] = ()
    # Does the iptables binary support MASQUERADE --random-fully?
    random_fully: bool = True
    # nfacct counters that exist (upstream only references counters it could create).
    nfacct_counters: frozenset[str] = field(default_factory=frozenset)
    # sysctl net/netfilter/nf_conntrack_tcp_be_liberal != 0: upstream then skips the INVALID drop.
    tcp_be_liberal: bool = False


@dataclass(frozen=True, slots=True)
class RuleOptions:
    masquerade_all: bool = False
    masquerade_bit: int = 14
    # Local-traffic detector: one of nodepolicy.DETECT_LOCAL_MODES.
    detect_local_mode: str = DEFAULT_DETECT_LOCAL_MODE
    cluster_cidrs: tuple[str, ...] = ()
    bridge_interface: str = ""
    interface_name_prefix: str = ""
    localhost_nodeports: bool = True
    # CIDRs (or the single word "primary"), read by nodepolicy.NodePortAddresses.
    node_port_addresses: tuple[str, ...] = ()
    # ipvs mode only (the ipvs section of the configuration); other modes ignore them.
    ipvs_scheduler: str = ""
    ipvs_exclude_cidrs: tuple[str, ...] = ()
    ipvs_strict_arp: bool = False
    ipvs_tcp_timeout: float = 0.0
    ipvs_tcp_fin_timeout: float = 0.0
    ipvs_udp_timeout: float = 0.0

    @property
    def masquerade_mark(self) -> str:
        """The mark as upstream writes it into restore input: Go's %#08x of 1 << bit."""
        return f"{1 << self.masquerade_bit:#010x}"
