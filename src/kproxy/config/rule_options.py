"""The configuration as the dataplanes see it: RuleOptions for the active mode."""

from __future__ import annotations

from kproxy.config.addresses import parse_cidr
from kproxy.config.schema import ProxyConfig
from kproxy.dataplane.facts import RuleOptions


def rule_options(config: ProxyConfig) -> RuleOptions:
    """The parts of the configuration that shape rules, for the active mode."""
    v4_cidrs = tuple(
        c for c in config.cluster_cidrs if (n := parse_cidr(c)) is not None and n.version == 4
    )
    return RuleOptions(
        masquerade_all=config.masquerade_all,
        masquerade_bit=config.masquerade_bit,
        detect_local_mode=config.effective_detect_local_mode,
        cluster_cidrs=v4_cidrs,
        bridge_interface=config.detect_local.bridge_interface,
        interface_name_prefix=config.detect_local.interface_name_prefix,
        localhost_nodeports=config.iptables.localhost_node_ports,
        node_port_addresses=config.effective_node_port_addresses,
        ipvs_scheduler=config.ipvs.scheduler,
        ipvs_exclude_cidrs=tuple(config.ipvs.exclude_cidrs),
        ipvs_strict_arp=config.ipvs.strict_arp,
        ipvs_tcp_timeout=config.ipvs.tcp_timeout,
        ipvs_tcp_fin_timeout=config.ipvs.tcp_fin_timeout,
        ipvs_udp_timeout=config.ipvs.udp_timeout,
    )
