"""Node policy shared by every mode: which traffic is local, and where NodePorts answer.

Two decisions upstream keeps once for all its proxiers, kept once here too:

* the local-traffic detector (detectLocalMode ClusterCIDR, NodeCIDR, BridgeInterface or
  InterfaceNamePrefix): what "from this node's pods" means, spelled for iptables and for
  nftables side by side;
* nodePortAddresses: "primary" or CIDRs -> the node addresses NodePorts answer on, or
  every local address.

Pure functions of the options and the node's facts; IPv4 only, like the dataplanes.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from kproxy.dataplane.facts import RuleOptions

# --------------------------------------------------------------------------- local traffic

DETECT_LOCAL_MODES: Final = ("ClusterCIDR", "NodeCIDR", "BridgeInterface", "InterfaceNamePrefix")
DEFAULT_DETECT_LOCAL_MODE: Final = "ClusterCIDR"


def effective_detect_local_mode(mode: str) -> str:
    """The detect-local mode in force: blank means ClusterCIDR."""
    return mode or DEFAULT_DETECT_LOCAL_MODE


@dataclass(frozen=True, slots=True)
class LocalTrafficDetector:
    """Matches for traffic from this node's pods (upstream's LocalTrafficDetector).

    The spellings are plain strings, ready to drop into a rule. The no-op detector (nothing
    to detect with) has them all empty: callers check `implemented` first."""

    if_local: str = ""  # iptables
    if_not_local: str = ""
    if_local_nft: str = ""
    if_not_local_nft: str = ""
    # The source CIDR when detecting by CIDR: the only detector a socket can be checked
    # against (userspace mode), as an interface is not known after accept().
    cidr: str = ""

    @property
    def implemented(self) -> bool:
        return bool(self.if_local)


NO_LOCAL_DETECTOR: Final = LocalTrafficDetector()


def detect_local_by_cidr(cidr: str) -> LocalTrafficDetector:
    return LocalTrafficDetector(
        if_local=f"-s {cidr}",
        if_not_local=f"! -s {cidr}",
        if_local_nft=f"ip saddr {cidr}",
        if_not_local_nft=f"ip saddr != {cidr}",
        cidr=cidr,
    )


def detect_local_by_bridge_interface(interface: str) -> LocalTrafficDetector:
    # iifname, not iif: the bridge may not exist yet when the rules are loaded.
    return LocalTrafficDetector(
        if_local=f"-i {interface}",
        if_not_local=f"! -i {interface}",
        if_local_nft=f"iifname {interface}",
        if_not_local_nft=f"iifname != {interface}",
    )


def detect_local_by_interface_name_prefix(prefix: str) -> LocalTrafficDetector:
    return LocalTrafficDetector(
        if_local=f"-i {prefix}+",
        if_not_local=f"! -i {prefix}+",
        if_local_nft=f'iifname "{prefix}*"',
        if_not_local_nft=f'iifname != "{prefix}*"',
    )


def _first_ipv4(cidrs: Iterable[str]) -> str:
    return next((c for c in cidrs if ":" not in c), "")


def local_traffic_detector(options: RuleOptions, pod_cidrs: Iterable[str]) -> LocalTrafficDetector:
    """The detector for the configured mode; the no-op one when the mode lacks its input
    (no IPv4 clusterCIDR, no IPv4 podCIDR on the Node yet, no interface name).

    pod_cidrs: the Node's spec.podCIDRs, read only in NodeCIDR mode."""
    mode = effective_detect_local_mode(options.detect_local_mode)
    cidr = ""
    if mode == "ClusterCIDR":
        cidr = _first_ipv4(options.cluster_cidrs)
    elif mode == "NodeCIDR":
        cidr = _first_ipv4(pod_cidrs)
    elif mode == "BridgeInterface" and options.bridge_interface:
        return detect_local_by_bridge_interface(options.bridge_interface)
    elif mode == "InterfaceNamePrefix" and options.interface_name_prefix:
        return detect_local_by_interface_name_prefix(options.interface_name_prefix)
    return detect_local_by_cidr(cidr) if cidr else NO_LOCAL_DETECTOR


# --------------------------------------------------------------------------- NodePort addresses

NODE_PORT_ADDRESSES_PRIMARY: Final = "primary"
_IPV4_LOOPBACK: Final = ipaddress.IPv4Network("127.0.0.0/8")


def effective_node_port_addresses(entries: Sequence[str], mode: str) -> tuple[str, ...]:
    """The nodePortAddresses a mode works with: nftables mode reads an empty list as
    "primary" (upstream, 1.29+); the other modes as every local address."""
    if not entries and mode == "nftables":
        return (NODE_PORT_ADDRESSES_PRIMARY,)
    return tuple(entries)


def _is_ipv4(address: str) -> bool:
    return ipaddress.ip_address(address).version == 4


@dataclass(frozen=True, slots=True)
class NodePortAddresses:
    """nodePortAddresses, read for IPv4 (upstream's NodePortAddresses).

    "primary" stands for the node's primary IPs; CIDRs select the node's addresses inside
    them. No IPv4 entry at all, or an IPv4 CIDR of prefix length 0, matches every local
    address: the dataplane then matches "any local address" instead of listing them."""

    primary: bool = False
    cidrs: tuple[ipaddress.IPv4Network, ...] = ()

    @classmethod
    def from_entries(cls, entries: Iterable[str]) -> NodePortAddresses:
        """Entries are "primary" or CIDRs (validated by the configuration; a bad one raises
        ValueError). IPv6 CIDRs are left out: they belong to the other family."""
        primary = False
        cidrs: list[ipaddress.IPv4Network] = []
        for entry in entries:
            if entry == NODE_PORT_ADDRESSES_PRIMARY:
                primary = True
                continue
            net = ipaddress.ip_network(entry, strict=False)
            if isinstance(net, ipaddress.IPv4Network):
                cidrs.append(net)
        return cls(primary, tuple(cidrs))

    @property
    def match_all(self) -> bool:
        if not self.primary and not self.cidrs:
            return True
        return any(net.prefixlen == 0 for net in self.cidrs)

    @property
    def contains_ipv4_loopback(self) -> bool:
        """Whether loopback addresses are among those selected (localhost NodePorts stay
        off otherwise). "primary" alone never is: a node IP is not a loopback address."""
        return self.match_all or any(net.overlaps(_IPV4_LOOPBACK) for net in self.cidrs)

    def addresses(
        self, node_ips: Iterable[str], local_addresses: Iterable[str], *, include_loopback: bool
    ) -> tuple[str, ...] | None:
        """The IPv4 addresses NodePorts answer on, without duplicates; None means every
        local address (match_all).

        "primary" contributes the node's IPv4 node_ips, first; the CIDRs select from
        local_addresses, in their order. include_loopback=False drops loopback addresses
        (nftables and ipvs never serve NodePorts on them; iptables only when
        localhostNodePorts allows)."""
        if self.match_all:
            return None
        picked: list[str] = []
        if self.primary:
            picked += [ip for ip in node_ips if _is_ipv4(ip)]
        if self.cidrs:
            for address in local_addresses:
                ip = ipaddress.ip_address(address)
                if ip.version == 4 and any(ip in net for net in self.cidrs):
                    picked.append(address)
        if not include_loopback:
            picked = [a for a in picked if not ipaddress.ip_address(a).is_loopback]
        return tuple(dict.fromkeys(picked))


def localhost_node_ports_enabled(options: RuleOptions) -> bool:
    """localhostNodePorts (iptables and userspace modes), forced off when nodePortAddresses
    leaves out 127.0.0.0/8, as upstream does."""
    if not options.localhost_nodeports:
        return False
    return NodePortAddresses.from_entries(options.node_port_addresses).contains_ipv4_loopback
