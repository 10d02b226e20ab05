"""Semantic checks: upstream's validation of a KubeProxyConfiguration (plus kproxy's modes).

Every section is checked whatever the mode: a bad value must not wait for a switch to bite.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from kproxy.config.addresses import is_interface_name, parse_cidr, split_host_port
from kproxy.config.durations import format_duration
from kproxy.config.problems import show_value, suggest
from kproxy.config.schema import (
    IPVS_SCHEDULERS,
    ProxyConfig,
)
from kproxy.dataplane.nodepolicy import DETECT_LOCAL_MODES, NODE_PORT_ADDRESSES_PRIMARY
from kproxy.model.parse import is_dns_subdomain
from kproxy.modes import MODES


def validate_config(config: ProxyConfig) -> list[str]:
    """Upstream's validation (plus kproxy's mode set); returns one message per problem."""
    v = _Problems()
    _validate_top_level(v, config)
    _validate_local_detection(v, config)
    _validate_sections(v, config)
    return v.messages


def _validate_top_level(v: _Problems, config: ProxyConfig) -> None:
    _check_choice(v, "mode", config.mode, MODES, "blank means iptables")
    host = config.hostname_override.strip().lower()
    v.check(
        not host or is_dns_subdomain(host),
        "hostnameOverride",
        config.hostname_override,
        "must be a Node's name (lowercase RFC 1123 subdomain, e.g. node-1.example)",
    )
    _check_ip(v, "bindAddress", config.bind_address)
    _check_node_port_addresses(v, config.node_port_addresses)
    for path, value in (
        ("healthzBindAddress", config.healthz_bind_address),
        ("metricsBindAddress", config.metrics_bind_address),
    ):
        if value:  # empty: that server is disabled
            _check_host_port(v, path, value)
    v.check(
        config.client_connection.burst >= 0,
        "clientConnection.burst",
        config.client_connection.burst,
        "must be greater than or equal to 0",
    )
    v.check(
        -1000 <= config.oom_score_adj <= 1000,
        "oomScoreAdj",
        config.oom_score_adj,
        "must be within the range [-1000, 1000]",
    )
    _check_positive(v, "configSyncPeriod", config.config_sync_period)
    v.check(
        _valid_port_range(config.port_range),
        "portRange",
        config.port_range,
        "must be a valid port range (e.g. 300-2000)",
    )
    v.check(
        not config.show_hidden_metrics_for_version
        or re.fullmatch(r"\d+\.\d+", config.show_hidden_metrics_for_version) is not None,
        "showHiddenMetricsForVersion",
        config.show_hidden_metrics_for_version,
        "must be a version in the form <major>.<minor>, e.g. '1.33'",
    )


def _validate_local_detection(v: _Problems, config: ProxyConfig) -> None:
    _check_choice(
        v,
        "detectLocalMode",
        config.detect_local_mode,
        DETECT_LOCAL_MODES,
        "blank means ClusterCIDR",
    )
    if config.detect_local_mode == "BridgeInterface" and not config.detect_local.bridge_interface:
        v.required(
            "detectLocal.bridgeInterface",
            "must not be empty when detectLocalMode is BridgeInterface",
        )
    if (
        config.detect_local_mode == "InterfaceNamePrefix"
        and not config.detect_local.interface_name_prefix
    ):
        v.required(
            "detectLocal.interfaceNamePrefix",
            "must not be empty when detectLocalMode is InterfaceNamePrefix",
        )
    # Whatever the mode (the names reach iptables and nft rules once the mode is chosen).
    for path, name in (
        ("detectLocal.bridgeInterface", config.detect_local.bridge_interface),
        ("detectLocal.interfaceNamePrefix", config.detect_local.interface_name_prefix),
    ):
        v.check(
            not name or is_interface_name(name),
            path,
            name,
            "must be an interface name: 1-15 printable ASCII characters without whitespace,"
            " '/', ':', quotes or backslashes",
        )
    _check_cluster_cidr(v, config.cluster_cidr)


def _validate_sections(v: _Problems, config: ProxyConfig) -> None:
    # Every section, whatever the mode: a bad value must not wait for a mode switch to bite.
    for name, section in (("iptables", config.iptables), ("nftables", config.nftables)):
        v.check(
            0 <= section.masquerade_bit <= 31,
            f"{name}.masqueradeBit",
            section.masquerade_bit,
            "must be within the range [0, 31]",
        )
        _check_sync_periods(v, name, section.sync_period, section.min_sync_period)

    ipvs = config.ipvs
    _check_sync_periods(v, "ipvs", ipvs.sync_period, ipvs.min_sync_period)
    _check_choice(v, "ipvs.scheduler", ipvs.scheduler, IPVS_SCHEDULERS, "blank means rr")
    for i, cidr in enumerate(ipvs.exclude_cidrs):
        v.check(
            parse_cidr(cidr) is not None, f"ipvs.excludeCIDRs[{i}]", cidr, "must be a valid CIDR"
        )
    for key, value in (
        ("tcpTimeout", ipvs.tcp_timeout),
        ("tcpFinTimeout", ipvs.tcp_fin_timeout),
        ("udpTimeout", ipvs.udp_timeout),
    ):
        _check_non_negative(v, f"ipvs.{key}", value)

    ct = config.conntrack
    v.check(
        ct.max_per_core >= 0,
        "conntrack.maxPerCore",
        ct.max_per_core,
        "must be greater than or equal to 0",
    )
    v.check(ct.min >= 0, "conntrack.min", ct.min, "must be greater than or equal to 0")
    for key, value in (
        ("tcpEstablishedTimeout", ct.tcp_established_timeout),
        ("tcpCloseWaitTimeout", ct.tcp_close_wait_timeout),
        ("udpTimeout", ct.udp_timeout),
        ("udpStreamTimeout", ct.udp_stream_timeout),
    ):
        _check_non_negative(v, f"conntrack.{key}", value)


class _Problems:
    def __init__(self) -> None:
        self.messages: list[str] = []

    def invalid(self, path: str, value: Any, why: str) -> None:
        self.messages.append(f"{path}: Invalid value: {show_value(value)}: {why}")

    def required(self, path: str, why: str) -> None:
        self.messages.append(f"{path}: Required value: {why}")

    def check(self, ok: bool, path: str, value: Any, why: str) -> None:
        if not ok:
            self.invalid(path, value, why)


def _check_choice(
    v: _Problems, path: str, value: str, choices: tuple[str, ...], blank: str
) -> None:
    if value == "" or value in choices:
        return
    listed = ", ".join(repr(c) for c in choices)
    why = f"must be one of {listed} or blank ({blank})"
    hint = suggest(value, choices)
    v.invalid(path, value, why + (f"; did you mean {hint!r}?" if hint else ""))


def _check_positive(v: _Problems, path: str, seconds: float) -> None:
    v.check(seconds > 0, path, format_duration(seconds), "must be greater than 0")


def _check_non_negative(v: _Problems, path: str, seconds: float) -> None:
    v.check(seconds >= 0, path, format_duration(seconds), "must be greater than or equal to 0")


def _check_sync_periods(v: _Problems, section: str, sync: float, min_sync: float) -> None:
    _check_positive(v, f"{section}.syncPeriod", sync)
    _check_non_negative(v, f"{section}.minSyncPeriod", min_sync)
    # Only compare two values that are each valid, so one mistake gives one message.
    if min_sync >= 0 and sync > 0 and min_sync > sync:
        v.invalid(
            f"{section}.minSyncPeriod",
            format_duration(min_sync),
            f"must be less than or equal to {section}.syncPeriod ({format_duration(sync)})",
        )


def _check_ip(v: _Problems, path: str, value: str) -> None:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        v.invalid(path, value, "not a valid textual representation of an IP address")


def _check_host_port(v: _Problems, path: str, value: str) -> None:
    parts = split_host_port(value)
    if parts is None:
        v.invalid(path, value, "must be IP:port")
        return
    host, port = parts
    try:
        ipaddress.ip_address(host)
    except ValueError:
        v.invalid(path, value, f"must be IP:port with a valid IP (got {host!r})")
    if not (port.isdigit() and 1 <= int(port) <= 65535):
        v.invalid(
            path, value, f"must be IP:port with a port in the range [1, 65535] (got {port!r})"
        )


def _check_cluster_cidr(v: _Problems, value: str) -> None:
    if not value:
        return
    parts = value.split(",")
    if len(parts) > 2:
        v.invalid(
            "clusterCIDR",
            value,
            "must be a single CIDR or a dual-stack pair of CIDRs "
            "(e.g. 10.100.0.0/16,fde4:8dba:82e1::/48)",
        )
        return
    networks = [parse_cidr(p) for p in parts]
    bad = [p for p, n in zip(parts, networks, strict=True) if n is None]
    if bad:
        v.invalid(
            "clusterCIDR",
            value,
            f"must be a valid CIDR block (e.g. 10.100.0.0/16 or "
            f"fde4:8dba:82e1::/48); not valid: {', '.join(repr(b) for b in bad)}",
        )
    elif len(networks) == 2 and {n.version for n in networks if n} != {4, 6}:
        v.invalid(
            "clusterCIDR",
            value,
            "a pair of CIDRs must be one IPv4 and one IPv6 "
            "(e.g. 10.100.0.0/16,fde4:8dba:82e1::/48)",
        )


def _check_node_port_addresses(v: _Problems, values: tuple[str, ...]) -> None:
    for i, value in enumerate(values):
        path = f"nodePortAddresses[{i}]"
        if value == NODE_PORT_ADDRESSES_PRIMARY:
            v.check(len(values) == 1, path, value, "can't use both 'primary' and CIDRs")
        else:
            v.check(
                parse_cidr(value) is not None,
                path,
                value,
                "must be a valid CIDR (or the single entry 'primary')",
            )


def _valid_port_range(value: str) -> bool:
    # utilnet.ParsePortRange: "", "N", "N-M" or "N+size" within [0, 65535].
    text = value.strip()
    if not text:
        return True
    m = re.fullmatch(r"(\d+)(?:([-+])(\d+))?", text)
    if not m:
        return False
    base = int(m.group(1))
    if m.group(2) is None:
        return base <= 65535
    other = int(m.group(3))
    high = other if m.group(2) == "-" else base + other
    return base <= high <= 65535
