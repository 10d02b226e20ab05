"""KubeProxyConfiguration loading, defaults, validation, flags and effective values."""

from __future__ import annotations

import json
import logging
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from kproxy.config import (
    API_VERSION,
    KIND,
    ConfigError,
    ProxyConfig,
    apply_flags,
    format_duration,
    format_duration_ns,
    load_config,
    parse_config,
    parse_duration,
    parse_duration_ns,
    rule_options,
)
from kproxy.config.addresses import is_interface_name, parse_host_port, parse_ip, parse_port
from kproxy.config.durations import check_seconds, parse_positive_duration
from kproxy.dataplane.facts import RuleOptions

HEADER = f"apiVersion: {API_VERSION}\nkind: {KIND}\n"


def parse(body: str) -> ProxyConfig:
    return parse_config(HEADER + textwrap.dedent(body))


def problems(body: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse(body)
    return info.value.problems


def one_problem(body: str) -> str:
    found = problems(body)
    assert len(found) == 1, found
    return found[0]


# --------------------------------------------------------------------------- defaults

# kube-proxy's own defaults (pkg/proxy/apis/config/scheme/testdata roundtrip/default, with
# the 1.29+ nftables section and conntrack fields), as written by --write-config-to before
# the startup-time resolution of mode/detectLocalMode.
UPSTREAM_DEFAULTS = {
    "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
    "kind": "KubeProxyConfiguration",
    "bindAddress": "0.0.0.0",
    "bindAddressHardFail": False,
    "clientConnection": {
        "acceptContentTypes": "",
        "burst": 10,
        "contentType": "application/vnd.kubernetes.protobuf",
        "kubeconfig": "",
        "qps": 5,
    },
    "clusterCIDR": "",
    "configSyncPeriod": "15m0s",
    "conntrack": {
        "maxPerCore": 32768,
        "min": 131072,
        "tcpBeLiberal": False,
        "tcpCloseWaitTimeout": "1h0m0s",
        "tcpEstablishedTimeout": "24h0m0s",
        "udpStreamTimeout": "0s",
        "udpTimeout": "0s",
    },
    "detectLocal": {"bridgeInterface": "", "interfaceNamePrefix": ""},
    "detectLocalMode": "",
    "enableProfiling": False,
    "healthzBindAddress": "0.0.0.0:10256",
    "hostnameOverride": "",
    "iptables": {
        "localhostNodePorts": True,
        "masqueradeAll": False,
        "masqueradeBit": 14,
        "minSyncPeriod": "1s",
        "syncPeriod": "30s",
    },
    "ipvs": {
        "excludeCIDRs": None,
        "minSyncPeriod": "0s",
        "scheduler": "",
        "strictARP": False,
        "syncPeriod": "30s",
        "tcpFinTimeout": "0s",
        "tcpTimeout": "0s",
        "udpTimeout": "0s",
    },
    "metricsBindAddress": "127.0.0.1:10249",
    "mode": "",
    "nftables": {
        "masqueradeAll": False,
        "masqueradeBit": 14,
        "minSyncPeriod": "1s",
        "syncPeriod": "30s",
    },
    "nodePortAddresses": None,
    "oomScoreAdj": -999,
    "portRange": "",
    "showHiddenMetricsForVersion": "",
}


def test_defaults_equal_upstream() -> None:
    assert yaml.safe_load(ProxyConfig().to_yaml(effective=False)) == UPSTREAM_DEFAULTS


def test_minimal_file_gives_defaults_and_none_gives_defaults() -> None:
    assert parse("") == ProxyConfig()
    assert load_config(None) == ProxyConfig()
    assert load_config(None).source is None
    assert parse("").source == "<config>"


def test_default_effective_values() -> None:
    c = ProxyConfig()
    assert c.effective_mode == "iptables"
    assert c.effective_detect_local_mode == "ClusterCIDR"
    assert (c.sync_period, c.min_sync_period) == (30.0, 1.0)
    assert (c.masquerade_all, c.masquerade_bit) == (False, 14)
    assert c.config_sync_period == 900.0
    assert c.conntrack.tcp_established_timeout == 86400.0


def test_effective_to_yaml_resolves_blanks() -> None:
    written = yaml.safe_load(ProxyConfig().to_yaml())
    assert written["mode"] == "iptables"
    assert written["detectLocalMode"] == "ClusterCIDR"
    nft = yaml.safe_load(parse("mode: nftables\n").to_yaml())
    assert nft["nodePortAddresses"] == ["primary"]


def test_nulls_mean_unset() -> None:
    c = parse(
        """
        oomScoreAdj: null
        nodePortAddresses: null
        iptables:
          masqueradeBit: null
          syncPeriod: null
        conntrack: null
        """
    )
    assert c == ProxyConfig()


@pytest.mark.parametrize(
    ("body", "attr", "expected"),
    [
        # Go zero values are "unset" for non-pointer fields, so they get the default.
        ("iptables: {syncPeriod: 0s}", ("iptables", "sync_period"), 30.0),
        ("iptables: {minSyncPeriod: 0s}", ("iptables", "min_sync_period"), 1.0),
        ("nftables: {minSyncPeriod: '0'}", ("nftables", "min_sync_period"), 1.0),
        ("ipvs: {syncPeriod: 0s}", ("ipvs", "sync_period"), 30.0),
        ("configSyncPeriod: 0s", ("config_sync_period",), 900.0),
        ("clientConnection: {qps: 0, burst: 0}", ("client_connection", "burst"), 10),
        (
            "clientConnection: {contentType: ''}",
            ("client_connection", "content_type"),
            "application/vnd.kubernetes.protobuf",
        ),
        ("bindAddress: ''", ("bind_address",), "0.0.0.0"),
        ("healthzBindAddress: ''", ("healthz_bind_address",), "0.0.0.0:10256"),
        # ...while pointer fields and ipvs.minSyncPeriod keep an explicit zero.
        ("ipvs: {minSyncPeriod: 0s}", ("ipvs", "min_sync_period"), 0.0),
        ("oomScoreAdj: 0", ("oom_score_adj",), 0),
        ("iptables: {masqueradeBit: 0}", ("iptables", "masquerade_bit"), 0),
        ("conntrack: {maxPerCore: 0}", ("conntrack", "max_per_core"), 0),
        ("conntrack: {tcpEstablishedTimeout: 0s}", ("conntrack", "tcp_established_timeout"), 0.0),
        ("iptables: {localhostNodePorts: false}", ("iptables", "localhost_node_ports"), False),
        # A bare IP gets the default port; IPv6 bind addresses move the defaults to [::].
        ("healthzBindAddress: 10.1.2.3", ("healthz_bind_address",), "10.1.2.3:10256"),
        ("metricsBindAddress: '::1'", ("metrics_bind_address",), "[::1]:10249"),
        ("bindAddress: 'fd00::1'", ("healthz_bind_address",), "[::]:10256"),
        ("bindAddress: 'fd00::1'", ("metrics_bind_address",), "[::1]:10249"),
    ],
)
def test_go_defaulting(body: str, attr: tuple[str, ...], expected: object) -> None:
    value: object = parse(body + "\n")
    for name in attr:
        value = getattr(value, name)
    assert value == expected


# --------------------------------------------------------------------------- validation

# (good body, bad body, expected path) for every rule; the good one must load, the bad one
# must fail with exactly one problem naming the path.
RULES = [
    ("iptables: {masqueradeBit: 31}", "iptables: {masqueradeBit: 32}", "iptables.masqueradeBit"),
    ("iptables: {masqueradeBit: 0}", "iptables: {masqueradeBit: -1}", "iptables.masqueradeBit"),
    ("nftables: {masqueradeBit: 5}", "nftables: {masqueradeBit: 40}", "nftables.masqueradeBit"),
    ("iptables: {syncPeriod: 1s}", "iptables: {syncPeriod: -1s}", "iptables.syncPeriod"),
    ("ipvs: {syncPeriod: 5s}", "ipvs: {syncPeriod: -5s}", "ipvs.syncPeriod"),
    ("nftables: {syncPeriod: 2m}", "nftables: {syncPeriod: -2m}", "nftables.syncPeriod"),
    ("iptables: {minSyncPeriod: 30s}", "iptables: {minSyncPeriod: 31s}", "iptables.minSyncPeriod"),
    ("ipvs: {minSyncPeriod: 0s}", "ipvs: {minSyncPeriod: -1s}", "ipvs.minSyncPeriod"),
    ("nftables: {minSyncPeriod: 10s}", "nftables: {minSyncPeriod: 1m}", "nftables.minSyncPeriod"),
    ("configSyncPeriod: 1s", "configSyncPeriod: -1s", "configSyncPeriod"),
    ("oomScoreAdj: -1000", "oomScoreAdj: -1001", "oomScoreAdj"),
    ("oomScoreAdj: 1000", "oomScoreAdj: 1001", "oomScoreAdj"),
    ("conntrack: {maxPerCore: 0}", "conntrack: {maxPerCore: -1}", "conntrack.maxPerCore"),
    ("conntrack: {min: 0}", "conntrack: {min: -1}", "conntrack.min"),
    ("conntrack: {tcpEstablishedTimeout: 1h}", "conntrack: {tcpEstablishedTimeout: -1h}",
     "conntrack.tcpEstablishedTimeout"),
    ("conntrack: {tcpCloseWaitTimeout: 0s}", "conntrack: {tcpCloseWaitTimeout: -1s}",
     "conntrack.tcpCloseWaitTimeout"),
    ("conntrack: {udpTimeout: 30s}", "conntrack: {udpTimeout: -30s}", "conntrack.udpTimeout"),
    ("conntrack: {udpStreamTimeout: 5m}", "conntrack: {udpStreamTimeout: -5m}",
     "conntrack.udpStreamTimeout"),
    ("ipvs: {tcpTimeout: 900s}", "ipvs: {tcpTimeout: -1s}", "ipvs.tcpTimeout"),
    ("ipvs: {tcpFinTimeout: 120s}", "ipvs: {tcpFinTimeout: -1s}", "ipvs.tcpFinTimeout"),
    ("ipvs: {udpTimeout: 300s}", "ipvs: {udpTimeout: -1s}", "ipvs.udpTimeout"),
    ("ipvs: {scheduler: mh}", "ipvs: {scheduler: random}", "ipvs.scheduler"),
    ("ipvs: {excludeCIDRs: [10.0.0.0/8, 'fd00::/8']}",
     "ipvs: {excludeCIDRs: [10.0.0.0/8, 10.0.0.1]}", "ipvs.excludeCIDRs[1]"),
    ("clusterCIDR: 10.244.0.0/16", "clusterCIDR: 10.244.0.0", "clusterCIDR"),
    ("clusterCIDR: 'fd00:10::/64'", "clusterCIDR: 10.244.0.0/33", "clusterCIDR"),
    ("clusterCIDR: '10.244.0.0/16,fd00:10::/64'", "clusterCIDR: '10.244.0.0/16,10.245.0.0/16'",
     "clusterCIDR"),
    ("clusterCIDR: '10.244.0.0/16,fd00:10::/64'",
     "clusterCIDR: '10.244.0.0/16,fd00:10::/64,10.1.0.0/16'", "clusterCIDR"),
    ("nodePortAddresses: [10.0.0.0/8, '::1/128']", "nodePortAddresses: [10.0.0.0/8, 10.0.0.1]",
     "nodePortAddresses[1]"),
    ("nodePortAddresses: [primary]", "nodePortAddresses: [10.0.0.0/8, primary]",
     "nodePortAddresses[1]"),
    ("bindAddress: 'fd00::1'", "bindAddress: 10.0.0.1:80", "bindAddress"),
    ("healthzBindAddress: '[::]:10256'", "healthzBindAddress: 0.0.0.0:0", "healthzBindAddress"),
    ("healthzBindAddress: 127.0.0.1:1", "healthzBindAddress: localhost:10256",
     "healthzBindAddress"),
    ("metricsBindAddress: 0.0.0.0:65535", "metricsBindAddress: 0.0.0.0:65536",
     "metricsBindAddress"),
    ("metricsBindAddress: '[::1]:10249'", "metricsBindAddress: 'nonsense'", "metricsBindAddress"),
    ("detectLocalMode: NodeCIDR", "detectLocalMode: NodeCidr", "detectLocalMode"),
    ("detectLocalMode: BridgeInterface\ndetectLocal: {bridgeInterface: cbr0}",
     "detectLocalMode: BridgeInterface", "detectLocal.bridgeInterface"),
    ("detectLocalMode: InterfaceNamePrefix\ndetectLocal: {interfaceNamePrefix: veth}",
     "detectLocalMode: InterfaceNamePrefix\ndetectLocal: {bridgeInterface: cbr0}",
     "detectLocal.interfaceNamePrefix"),
    ("portRange: 30000-32767", "portRange: 300-20", "portRange"),
    ("showHiddenMetricsForVersion: '1.32'", "showHiddenMetricsForVersion: v1.32",
     "showHiddenMetricsForVersion"),
    ("clientConnection: {burst: 1}", "clientConnection: {burst: -1}", "clientConnection.burst"),
]  # fmt: skip


@pytest.mark.parametrize(("good", "bad", "path"), RULES)
def test_validation_rule(good: str, bad: str, path: str) -> None:
    parse(good + "\n")
    message = one_problem(bad + "\n")
    assert message.startswith(f"{path}: "), message


def test_invalid_value_message_names_path_and_value() -> None:
    assert one_problem("iptables: {masqueradeBit: 40}\n") == (
        "iptables.masqueradeBit: Invalid value: 40: must be within the range [0, 31]"
    )
    assert one_problem("iptables: {syncPeriod: -1s}\n") == (
        "iptables.syncPeriod: Invalid value: '-1s': must be greater than 0"
    )


@pytest.mark.parametrize(
    ("mode", "hint"),
    [("ipvs ", "ipvs"), ("IPVS", "ipvs"), ("iptabels", "iptables"), ("userpsace", "userspace"),
     ("NFTables", "nftables"), ("kernelspace", None), ("ebpf", None)],
)  # fmt: skip
def test_mode_typos_are_rejected_never_fallen_back(mode: str, hint: str | None) -> None:
    message = one_problem(f"mode: {mode!r}\n".replace("'", '"'))
    assert message.startswith(f"mode: Invalid value: {mode!r}: ")
    for valid in ("iptables", "nftables", "ipvs", "userspace"):
        assert repr(valid) in message
    if hint:
        assert message.endswith(f"did you mean {hint!r}?")
    else:
        assert "did you mean" not in message


@pytest.mark.parametrize("mode", ["", "iptables", "nftables", "ipvs", "userspace"])
def test_valid_modes(mode: str) -> None:
    c = parse(f"mode: '{mode}'\n")
    assert c.mode == mode
    assert c.effective_mode == (mode or "iptables")


def test_unknown_nested_field_names_full_path_and_suggests() -> None:
    assert one_problem("iptables:\n  masqueradeBitt: 3\n") == (
        "iptables.masqueradeBitt: unknown field (did you mean 'masqueradeBit'?)"
    )
    assert one_problem("conntrack: {maxPerCPU: 3}\n").startswith(
        "conntrack.maxPerCPU: unknown field"
    )
    assert one_problem("clusterCidr: 10.0.0.0/8\n") == (
        "clusterCidr: unknown field (did you mean 'clusterCIDR'?)"
    )
    # Python attribute names are not file names.
    assert one_problem("hostname_override: x\n").startswith("hostname_override: unknown field")


@pytest.mark.parametrize(
    ("body", "path", "why"),
    [
        ("iptables: {masqueradeBit: '14'}", "iptables.masqueradeBit", "must be an integer"),
        ("iptables: {masqueradeAll: 'yes please'}", "iptables.masqueradeAll", "true or false"),
        ("iptables: {syncPeriod: 30}", "iptables.syncPeriod", "duration string"),
        ("iptables: {syncPeriod: 30x}", "iptables.syncPeriod", "unknown unit"),
        ("iptables: {syncPeriod: '1h 30m'}", "iptables.syncPeriod", "unknown unit"),
        ("iptables: 5", "iptables", "must be a mapping"),
        ("nodePortAddresses: 10.0.0.0/8", "nodePortAddresses", "must be a list"),
        ("nodePortAddresses: [10.0.0.0/8, 5]", "nodePortAddresses[1]", "must be a string"),
        ("conntrack: {min: 4294967296}", "conntrack.min", "32-bit"),
        ("featureGates: {Foo: maybe}", "featureGates.Foo", "true or false"),
    ],
)
def test_type_errors(body: str, path: str, why: str) -> None:
    message = one_problem(body + "\n")
    assert message.startswith(f"{path}: "), message
    assert why in message


def test_all_problems_reported_together_with_file_name(tmp_path: Path) -> None:
    path = tmp_path / "kube-proxy.yaml"
    path.write_text(
        HEADER
        + textwrap.dedent(
            """
            mode: iptabels
            iptables:
              masqueradeBitt: 3
              masqueradeBit: 40
            ipvs: {scheduler: rrr}
            conntrack: {min: -1}
            oomScoreAdj: 5000
            """
        )
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    lines = str(info.value).splitlines()
    assert lines[0].startswith(str(path))
    assert "6 problems" in lines[0]
    body = "\n".join(lines[1:])
    for fragment in ("mode:", "iptables.masqueradeBitt: unknown field", "iptables.masqueradeBit:",
                     "ipvs.scheduler:", "conntrack.min:", "oomScoreAdj:"):  # fmt: skip
        assert fragment in body
    assert len(info.value.problems) == len(lines) - 1 == 6


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="iptables.masqueradeBit"):
        parse("iptables: {masqueradeBit: 99}\n")


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("kind: KubeProxyConfiguration\n", "apiVersion: Required value"),
        (f"apiVersion: {API_VERSION}\n", "kind: Required value"),
        (f"apiVersion: kubeproxy.config.k8s.io/v1beta1\nkind: {KIND}\n",
         "apiVersion: Invalid value: 'kubeproxy.config.k8s.io/v1beta1'"),
        (f"apiVersion: {API_VERSION}\nkind: KubeletConfiguration\nfoo: 1\n",
         "kind: Invalid value: 'KubeletConfiguration'"),
    ],
)  # fmt: skip
def test_wrong_type_meta(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    # Only the type problem: other fields (foo) are not checked against a foreign schema.
    assert len(info.value.problems) == 1
    assert fragment in info.value.problems[0]


def test_yaml_syntax_error_reports_line() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(HEADER + "iptables:\n  syncPeriod: [30s\nmode: ipvs\n", source="bad.yaml")
    assert str(info.value).startswith("bad.yaml:")
    assert "line " in info.value.problems[0]


def test_duplicate_key_is_an_error_with_line() -> None:
    message = one_problem("mode: ipvs\nmode: iptables\n")
    assert "duplicate key 'mode'" in message
    assert message.startswith("line 4,")


@pytest.mark.parametrize("text", ["", "# only a comment\n", "- a\n- b\n", "just a string\n"])
def test_not_an_object(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_config(text)


def test_json_is_accepted() -> None:
    text = (
        '{"apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",'
        ' "mode": "nftables", "nftables": {"syncPeriod": "1m"}, "clusterCIDR": "10.0.0.0/8"}'
    )
    c = parse_config(text)
    assert c.effective_mode == "nftables"
    assert c.sync_period == 60.0


def test_unreadable_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(missing)
    assert str(info.value).startswith(str(missing))
    assert "cannot read" in info.value.problems[0]


def test_empty_bind_addresses_mean_disabled_when_given_by_flag() -> None:
    c, _ = apply_flags(ProxyConfig(), {"metrics-bind-address": "", "healthz-bind-address": ""})
    assert c.metrics_bind_address == "" and c.healthz_bind_address == ""


# --------------------------------------------------------------------------- effective values


@pytest.mark.parametrize(
    ("mode", "sync", "min_sync", "masq_all", "masq_bit"),
    [
        ("", 11.0, 1.5, True, 3),
        ("iptables", 11.0, 1.5, True, 3),
        ("userspace", 11.0, 1.5, True, 3),
        ("ipvs", 22.0, 0.5, True, 3),  # ipvs has no masquerade fields: iptables' apply
        ("nftables", 33.0, 2.5, False, 7),
    ],
)
def test_effective_values_follow_mode(
    mode: str, sync: float, min_sync: float, masq_all: bool, masq_bit: int
) -> None:
    c = parse(
        f"""
        mode: '{mode}'
        iptables: {{syncPeriod: 11s, minSyncPeriod: 1.5s, masqueradeAll: true, masqueradeBit: 3}}
        ipvs: {{syncPeriod: 22s, minSyncPeriod: 500ms}}
        nftables: {{syncPeriod: 33s, minSyncPeriod: 2500ms, masqueradeAll: false, masqueradeBit: 7}}
        """
    )
    assert (c.sync_period, c.min_sync_period) == (sync, min_sync)
    assert (c.masquerade_all, c.masquerade_bit) == (masq_all, masq_bit)


def test_rule_options() -> None:
    c = parse(
        """
        mode: iptables
        clusterCIDR: '10.244.0.0/16,fd00:10:244::/56'
        iptables: {masqueradeAll: true, masqueradeBit: 5, localhostNodePorts: false}
        nodePortAddresses: [192.168.0.0/16]
        detectLocal: {bridgeInterface: cbr0, interfaceNamePrefix: veth}
        """
    )
    assert rule_options(c) == RuleOptions(
        masquerade_all=True,
        masquerade_bit=5,
        detect_local_mode="ClusterCIDR",
        cluster_cidrs=("10.244.0.0/16",),
        bridge_interface="cbr0",
        interface_name_prefix="veth",
        localhost_nodeports=False,
        node_port_addresses=("192.168.0.0/16",),
    )
    assert rule_options(ProxyConfig()) == RuleOptions()
    nft = rule_options(parse("mode: nftables\ndetectLocalMode: NodeCIDR\n"))
    assert nft.node_port_addresses == ("primary",)
    assert nft.detect_local_mode == "NodeCIDR"


# --------------------------------------------------------------------------- flags


def test_flags_apply_to_defaults() -> None:
    c, ignored = apply_flags(
        ProxyConfig(),
        {
            "proxy-mode": "nftables",
            "hostname-override": "  Node-1.Example  ",
            "cluster-cidr": "10.244.0.0/16,fd00::/64",
            "masquerade-all": "true",
            "iptables-sync-period": "1m",
            "iptables-min-sync-period": "0",
            "iptables-masquerade-bit": "0x0f",
            "iptables-localhost-nodeports": "false",
            "nodeport-addresses": "10.0.0.0/8,192.168.0.0/16",
            "metrics-bind-address": "0.0.0.0",
            "healthz-bind-address": "[::]:12345",
            "detect-local-mode": "InterfaceNamePrefix",
            "pod-interface-name-prefix": "veth",
            "pod-bridge-interface": "cbr0",
            "bind-address": "10.0.0.5",
            "oom-score-adj": "-500",
            "config-sync-period": "5m",
            "conntrack-max-per-core": "0",
            "conntrack-min": "1000",
            "conntrack-tcp-timeout-established": "2h",
            "conntrack-tcp-timeout-close-wait": "30m",
            "conntrack-tcp-be-liberal": "t",
            "conntrack-udp-timeout": "30s",
            "conntrack-udp-timeout-stream": "2m",
            "ipvs-scheduler": "wrr",
            "ipvs-exclude-cidrs": "10.1.0.0/16",
            "ipvs-strict-arp": "true",
            "ipvs-tcp-timeout": "1s",
            "ipvs-tcpfin-timeout": "2s",
            "ipvs-udp-timeout": "3s",
            "feature-gates": "Foo=true, Bar=false",
            "kube-api-qps": "20",
            "kube-api-burst": "40",
        },
    )
    assert ignored == []
    assert c.source is None
    assert c.effective_mode == "nftables"
    assert c.hostname_override == "node-1.example"
    assert c.cluster_cidrs == ("10.244.0.0/16", "fd00::/64")
    # --iptables-* sync flags and --masquerade-all feed nftables too.
    assert (c.sync_period, c.min_sync_period, c.masquerade_all) == (60.0, 0.0, True)
    assert (c.iptables.sync_period, c.iptables.min_sync_period) == (60.0, 0.0)
    assert c.iptables.masquerade_bit == 15 and c.nftables.masquerade_bit == 14
    assert c.iptables.localhost_node_ports is False
    assert c.node_port_addresses == ("10.0.0.0/8", "192.168.0.0/16")
    assert c.metrics_bind_address == "0.0.0.0:10249"
    assert c.healthz_bind_address == "[::]:12345"
    assert c.detect_local_mode == "InterfaceNamePrefix"
    assert c.detect_local.interface_name_prefix == "veth"
    assert c.detect_local.bridge_interface == "cbr0"
    assert c.bind_address == "10.0.0.5"
    assert c.oom_score_adj == -500
    assert c.config_sync_period == 300.0
    ct = c.conntrack
    assert (ct.max_per_core, ct.min, ct.tcp_be_liberal) == (0, 1000, True)
    assert (ct.tcp_established_timeout, ct.tcp_close_wait_timeout) == (7200.0, 1800.0)
    assert (ct.udp_timeout, ct.udp_stream_timeout) == (30.0, 120.0)
    ipvs = c.ipvs
    assert (ipvs.scheduler, ipvs.exclude_cidrs, ipvs.strict_arp) == ("wrr", ("10.1.0.0/16",), True)
    assert (ipvs.tcp_timeout, ipvs.tcp_fin_timeout, ipvs.udp_timeout) == (1.0, 2.0, 3.0)
    assert c.feature_gates == {"Foo": True, "Bar": False}
    assert (c.client_connection.qps, c.client_connection.burst) == (20.0, 40)
    assert rule_options(c).masquerade_bit == 14  # nftables' own bit


def test_ipvs_sync_flags_apply_only_in_ipvs_mode(caplog: pytest.LogCaptureFixture) -> None:
    flags = {"ipvs-sync-period": "10s", "ipvs-min-sync-period": "2s", "iptables-sync-period": "5s"}
    ipvs, ignored = apply_flags(ProxyConfig(), {"proxy-mode": "ipvs", **flags})
    assert ignored == ["iptables-sync-period"]
    assert (ipvs.sync_period, ipvs.min_sync_period) == (10.0, 2.0)
    assert ipvs.iptables.sync_period == 30.0
    with caplog.at_level(logging.WARNING, logger="kproxy.config"):
        ipt, ignored = apply_flags(ProxyConfig(), flags)
    assert sorted(ignored) == ["ipvs-min-sync-period", "ipvs-sync-period"]
    assert "--ipvs-sync-period" in caplog.text
    assert (ipt.sync_period, ipt.ipvs.sync_period) == (5.0, 30.0)


def test_flags_ignored_when_config_file_given_except_hostname(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from_file = parse("mode: ipvs\nhostnameOverride: from-file\n")
    with caplog.at_level(logging.WARNING, logger="kproxy.config"):
        c, ignored = apply_flags(
            from_file,
            {"proxy-mode": "iptables", "masquerade-all": "true", "hostname-override": "From-Flag"},
        )
    assert sorted(ignored) == ["masquerade-all", "proxy-mode"]
    assert c.mode == "ipvs" and c.masquerade_all is False
    assert c.hostname_override == "from-flag"
    assert c.source == "<config>"
    assert "--proxy-mode" in caplog.text and "--masquerade-all" in caplog.text
    # An empty --hostname-override means "not given": the file's value stays.
    c2, _ = apply_flags(from_file, {"hostname-override": ""})
    assert c2.hostname_override == "from-file"


def test_deprecated_port_flags() -> None:
    c, _ = apply_flags(ProxyConfig(), {"metrics-port": "0"})
    assert c.metrics_bind_address == ""
    c, _ = apply_flags(ProxyConfig(), {"healthz-bind-address": "10.0.0.1", "healthz-port": "9999"})
    assert c.healthz_bind_address == "10.0.0.1:9999"
    # Like upstream, the port only fills in an address that has none.
    c, _ = apply_flags(ProxyConfig(), {"healthz-port": "9999"})
    assert c.healthz_bind_address == "0.0.0.0:10256"


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        ({"proxy-mod": "ipvs"}, "--proxy-mod: unknown flag (did you mean --proxy-mode?)"),
        ({"config": "/etc/kube-proxy.yaml"}, "--config: unknown flag"),
        ({"iptables-masquerade-bit": "abc"}, "--iptables-masquerade-bit: Invalid value: 'abc'"),
        ({"masquerade-all": "yes"}, "--masquerade-all: Invalid value: 'yes'"),
        ({"iptables-sync-period": "30"}, "missing unit"),
        ({"feature-gates": "Foo"}, "--feature-gates: Invalid value"),
        ({"oom-score-adj": "99999999999"}, "32-bit"),
        ({"hostname-override": "   "}, "empty hostname-override is invalid"),
        # Values that parse but fail validation are reported the same way.
        ({"proxy-mode": "ipvs "}, "mode: Invalid value: 'ipvs '"),
        ({"iptables-masquerade-bit": "32"}, "iptables.masqueradeBit: Invalid value: 32"),
        ({"iptables-sync-period": "0s"}, "iptables.syncPeriod: Invalid value: '0s'"),
        ({"iptables-min-sync-period": "1m"}, "iptables.minSyncPeriod"),
        ({"cluster-cidr": "10.0.0.0"}, "clusterCIDR"),
        ({"bind-address": ""}, "bindAddress"),
        ({"detect-local-mode": "BridgeInterface"}, "detectLocal.bridgeInterface"),
    ],
)
def test_bad_flags(flags: dict[str, str], fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        apply_flags(ProxyConfig(), flags)
    assert str(info.value).startswith("command-line flags:")
    assert any(fragment in p for p in info.value.problems), info.value.problems


def test_all_flag_errors_reported_together() -> None:
    with pytest.raises(ConfigError) as info:
        apply_flags(ProxyConfig(), {"nope": "1", "conntrack-min": "x", "ipvs-strict-arp": "2"})
    assert len(info.value.problems) == 3


def test_apply_flags_does_not_mutate_input() -> None:
    base = ProxyConfig()
    apply_flags(base, {"proxy-mode": "ipvs", "masquerade-all": "true"})
    assert base == ProxyConfig()


# --------------------------------------------------------------------------- durations


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30s", 30.0), ("1m0s", 60.0), ("1h", 3600.0), ("500ms", 0.5), ("0s", 0.0), ("0", 0.0),
        ("24h0m0s", 86400.0), ("1m30s", 90.0), ("1.5h", 5400.0), ("300ms", 0.3), ("-1.5s", -1.5),
        ("+5s", 5.0), (".5s", 0.5), ("5.s", 5.0), ("1h1m1s1ms1us1ns", 3661.001001001),
        ("2\u00b5s", 2e-6), ("2\u03bcs", 2e-6), ("100ns", 1e-7), ("-0", 0.0),
    ],
)  # fmt: skip
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds, abs=1e-12)


@pytest.mark.parametrize(
    "text", ["", "30", "s", ".s", "1.5", "1 s", "1h 30m", "1d", "1e3s", "--1s", "1s-1s", "+", "5S"]
)
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


def test_parse_duration_range() -> None:
    assert parse_duration_ns("2562047h47m16.854775807s") == 2**63 - 1
    assert parse_duration_ns("-2562047h47m16.854775808s") == -(2**63)
    with pytest.raises(ValueError, match="range"):
        parse_duration_ns("2562048h")


@pytest.mark.parametrize(
    ("ns", "text"),
    [
        (0, "0s"), (30 * 10**9, "30s"), (60 * 10**9, "1m0s"), (86400 * 10**9, "24h0m0s"),
        (3600 * 10**9, "1h0m0s"), (900 * 10**9, "15m0s"), (500 * 10**6, "500ms"),
        (1_500_000_000, "1.5s"), (1_000, "1\u00b5s"), (1_500, "1.5\u00b5s"), (7, "7ns"),
        (-90 * 10**9, "-1m30s"), (5_400 * 10**9, "1h30m0s"), (1_000_000_001, "1.000000001s"),
    ],
)  # fmt: skip
def test_format_duration_like_go(ns: int, text: str) -> None:
    assert format_duration_ns(ns) == text


@given(st.integers(min_value=-(2**63), max_value=2**63 - 1))
def test_duration_ns_round_trip(ns: int) -> None:
    assert parse_duration_ns(format_duration_ns(ns)) == ns


@given(st.integers(min_value=-(10**15), max_value=10**15))
def test_duration_seconds_round_trip(ns: int) -> None:
    seconds = ns / 1e9
    assert parse_duration(format_duration(seconds)) == seconds


@given(
    st.lists(
        st.tuples(st.integers(0, 10**4), st.sampled_from(["h", "m", "s", "ms", "us", "ns"])),
        min_size=1,
        max_size=6,
    )
)
def test_duration_components_add_up(parts: list[tuple[int, str]]) -> None:
    unit_ns = {"h": 3600 * 10**9, "m": 60 * 10**9, "s": 10**9, "ms": 10**6, "us": 10**3, "ns": 1}
    text = "".join(f"{n}{u}" for n, u in parts)
    assert parse_duration_ns(text) == sum(n * unit_ns[u] for n, u in parts)


# --------------------------------------------------------------------------- round trip

REALISTIC = """\
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
bindAddress: 0.0.0.0
clientConnection:
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
  acceptContentTypes: ""
  contentType: application/vnd.kubernetes.protobuf
  qps: 20.5
  burst: 40
clusterCIDR: 10.244.0.0/16,fd00:10:244::/56
configSyncPeriod: 10m
conntrack:
  maxPerCore: 65536
  min: 262144
  tcpEstablishedTimeout: 12h
  tcpCloseWaitTimeout: 30m
  tcpBeLiberal: true
  udpTimeout: 30s
  udpStreamTimeout: 2m
detectLocalMode: ClusterCIDR
detectLocal:
  bridgeInterface: ""
  interfaceNamePrefix: ""
enableProfiling: true
featureGates:
  SomeGate: true
healthzBindAddress: 0.0.0.0:10256
hostnameOverride: worker-3
iptables:
  masqueradeAll: false
  masqueradeBit: 14
  localhostNodePorts: false
  syncPeriod: 45s
  minSyncPeriod: 2s
ipvs:
  scheduler: wrr
  excludeCIDRs: [10.96.0.0/24]
  strictARP: true
  syncPeriod: 1m30s
  minSyncPeriod: 0s
  tcpTimeout: 15m
  tcpFinTimeout: 2m
  udpTimeout: 5m
logging:
  format: json
  verbosity: 4
metricsBindAddress: 0.0.0.0:10249
mode: ipvs
nftables:
  masqueradeAll: true
  masqueradeBit: 15
  syncPeriod: 30s
  minSyncPeriod: 500ms
nodePortAddresses: [192.168.0.0/16, "fd00::/8"]
oomScoreAdj: -998
portRange: ""
showHiddenMetricsForVersion: "1.32"
winkernel:
  networkName: ""
"""


def test_realistic_config_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(REALISTIC)
    c = load_config(path)
    assert c.source == str(path)
    assert c.effective_mode == "ipvs"
    assert (c.sync_period, c.min_sync_period) == (90.0, 0.0)
    assert c.ipvs.exclude_cidrs == ("10.96.0.0/24",)
    assert c.conntrack.tcp_established_timeout == 43200.0
    assert c.logging == {"format": "json", "verbosity": 4}
    assert c.feature_gates == {"SomeGate": True}
    assert c.client_connection.qps == 20.5

    written = c.to_yaml()
    again = parse_config(written, source="written")
    assert again == c
    assert again.to_yaml() == written
    dumped = yaml.safe_load(written)
    assert dumped["ipvs"]["syncPeriod"] == "1m30s"
    assert dumped["conntrack"]["tcpEstablishedTimeout"] == "12h0m0s"
    assert dumped["nftables"]["minSyncPeriod"] == "500ms"
    assert dumped["configSyncPeriod"] == "10m0s"

    # Re-parsing the original source text gives the same configuration too.
    assert parse_config(REALISTIC) == c


def test_model_copy_and_equality_ignore_source() -> None:
    a = parse("mode: ipvs\n")
    b = ProxyConfig(mode="ipvs")
    assert a == b and a.source != b.source
    assert a.model_copy(update={"mode": "iptables"}) != a


# --- values checked alike in the file, the flags and the other commands' options ----------------


@pytest.mark.parametrize(
    ("flags", "problem"),
    [
        ({"iptables-masquerade-bit": "32"}, "--iptables-masquerade-bit: iptables.masqueradeBit:"),
        ({"cluster-cidr": "10.0.0.0"}, "--cluster-cidr: clusterCIDR: Invalid value"),
        ({"nodeport-addresses": "10.0.0.1"}, "--nodeport-addresses: nodePortAddresses[0]:"),
        ({"masquerade-all": "true", "iptables-sync-period": "-1s"}, "--iptables-sync-period: "),
        ({"healthz-port": "65536"}, "--healthz-port: Invalid value: '65536': must be a port"),
        ({"kube-api-qps": "inf"}, "--kube-api-qps: Invalid value: 'inf': must be a finite"),
        ({"hostname-override": "Node_1"}, "--hostname-override: hostnameOverride: Invalid"),
    ],
)
def test_a_problem_a_flag_made_names_the_flag(flags: dict[str, str], problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        apply_flags(ProxyConfig(), flags)
    assert any(p.startswith(problem) for p in info.value.problems), info.value.problems


@pytest.mark.parametrize(
    "name", ["br\n-A KUBE-X", 'cbr0"', "veth'", "a b", "a/b", "a:b", "x" * 16, ".", "é", "a\\b"]
)
def test_interface_names_that_no_rule_can_carry_are_refused(name: str) -> None:
    for key in ("bridgeInterface", "interfaceNamePrefix"):
        found = one_problem(f"detectLocal:\n  {key}: {json.dumps(name)}\n")
        assert found.startswith(f"detectLocal.{key}: Invalid value: {name!r}"), found


def test_interface_names_and_prefixes_in_use_are_accepted() -> None:
    for name in ("cbr0", "cni0", "veth", "lxc", "eth0.100", "x" * 15, "br-a1b2c3d4e5f6"):
        assert is_interface_name(name), name
    cfg = parse("detectLocalMode: InterfaceNamePrefix\ndetectLocal: {interfaceNamePrefix: veth}\n")
    assert cfg.detect_local.interface_name_prefix == "veth"


def test_hostname_override_must_be_a_node_name() -> None:
    assert parse("hostnameOverride: Node-1.Example\n").hostname_override == "Node-1.Example"
    found = one_problem('hostnameOverride: "node\\n1"\n')
    assert found.startswith("hostnameOverride: Invalid value: 'node\\n1'"), found


@pytest.mark.parametrize(
    ("check", "good", "bad", "why"),
    [
        (parse_ip, ["10.0.0.1", "::1", "fd00::1"], ["999.1.1.1", "", "[::1]"], "not an IP"),
        (parse_ip, [], ["fe80::1%eth0"], "no zone"),
        (parse_port, ["1", "65535"], ["0", "65536", "-1", "http", "٣"], "not a port"),
        (parse_host_port, ["127.0.0.1:1", "[::1]:80"], ["::1:80", "x:80", "1.2.3.4"], "IP"),
        (parse_positive_duration, ["1s", "1.5m"], ["0s", "-1s"], "must be more than 0"),
        (check_seconds, [0.1, 60], [0, -1, float("nan"), float("inf")], "not a number of"),
    ],
)
def test_value_checks(check: Any, good: list[Any], bad: list[Any], why: str) -> None:
    for value in good:
        check(value)
    for value in bad:
        with pytest.raises(ValueError, match=why):
            check(value)


@given(st.text(max_size=20))
def test_the_value_checks_raise_only_value_error(text: str) -> None:
    for check in (parse_ip, parse_port, parse_host_port, parse_positive_duration):
        try:
            check(text)
        except ValueError as err:
            assert str(err).isprintable()
