"""Node policy (kproxy.dataplane.nodepolicy): the local-traffic detector in both spellings and
the nodePortAddresses decision, as pure functions (no root, no kernel)."""

from __future__ import annotations

import pytest

from kproxy.dataplane.facts import NodeFacts, RuleOptions
from kproxy.dataplane.iptables.render import render_full
from kproxy.dataplane.nodepolicy import (
    DEFAULT_DETECT_LOCAL_MODE,
    DETECT_LOCAL_MODES,
    NO_LOCAL_DETECTOR,
    NODE_PORT_ADDRESSES_PRIMARY,
    LocalTrafficDetector,
    NodePortAddresses,
    effective_detect_local_mode,
    effective_node_port_addresses,
    local_traffic_detector,
    localhost_node_ports_enabled,
)
from kproxy.model.snapshot import snapshot_from_objects
from tests.support.objects import node

# --- local-traffic detector --------------------------------------------------------------------


def spellings(d: LocalTrafficDetector) -> tuple[str, str, str, str]:
    return d.if_local, d.if_not_local, d.if_local_nft, d.if_not_local_nft


def test_blank_mode_is_cluster_cidr() -> None:
    assert effective_detect_local_mode("") == DEFAULT_DETECT_LOCAL_MODE == "ClusterCIDR"
    assert effective_detect_local_mode("NodeCIDR") == "NodeCIDR"
    assert DETECT_LOCAL_MODES == (
        "ClusterCIDR",
        "NodeCIDR",
        "BridgeInterface",
        "InterfaceNamePrefix",
    )


def test_cluster_cidr_detector_matches_the_first_ipv4_cluster_cidr() -> None:
    options = RuleOptions(cluster_cidrs=("fd00:10::/64", "10.244.0.0/16", "10.245.0.0/16"))
    d = local_traffic_detector(options, ("10.9.9.0/24",))
    assert d.implemented and d.cidr == "10.244.0.0/16"
    assert spellings(d) == (
        "-s 10.244.0.0/16",
        "! -s 10.244.0.0/16",
        "ip saddr 10.244.0.0/16",
        "ip saddr != 10.244.0.0/16",
    )
    # A blank mode is ClusterCIDR.
    assert (
        local_traffic_detector(
            RuleOptions(detect_local_mode="", cluster_cidrs=("10.0.0.0/8",)), ()
        ).cidr
        == "10.0.0.0/8"
    )


def test_node_cidr_detector_reads_the_nodes_first_ipv4_pod_cidr() -> None:
    options = RuleOptions(detect_local_mode="NodeCIDR", cluster_cidrs=("10.244.0.0/16",))
    d = local_traffic_detector(options, ("fd00:10:1::/64", "10.244.1.0/24"))
    assert spellings(d) == (
        "-s 10.244.1.0/24",
        "! -s 10.244.1.0/24",
        "ip saddr 10.244.1.0/24",
        "ip saddr != 10.244.1.0/24",
    )
    assert d.cidr == "10.244.1.0/24"
    # No podCIDR on the Node yet (or only IPv6): nothing to detect with.
    assert local_traffic_detector(options, ()) == NO_LOCAL_DETECTOR
    assert local_traffic_detector(options, ("fd00:10:1::/64",)) == NO_LOCAL_DETECTOR


def test_bridge_interface_detector() -> None:
    options = RuleOptions(detect_local_mode="BridgeInterface", bridge_interface="cbr0")
    d = local_traffic_detector(options, ("10.244.1.0/24",))
    assert d.implemented
    assert spellings(d) == ("-i cbr0", "! -i cbr0", "iifname cbr0", "iifname != cbr0")
    assert d.cidr == ""  # cannot be checked on a socket


def test_interface_name_prefix_detector() -> None:
    options = RuleOptions(detect_local_mode="InterfaceNamePrefix", interface_name_prefix="veth")
    d = local_traffic_detector(options, ())
    assert d.implemented
    assert spellings(d) == ("-i veth+", "! -i veth+", 'iifname "veth*"', 'iifname != "veth*"')
    assert d.cidr == ""


@pytest.mark.parametrize(
    "options",
    [
        RuleOptions(),  # ClusterCIDR without a clusterCIDR
        RuleOptions(cluster_cidrs=("fd00:10::/64",)),  # no IPv4 one
        RuleOptions(detect_local_mode="BridgeInterface"),
        RuleOptions(detect_local_mode="InterfaceNamePrefix"),
        RuleOptions(detect_local_mode="NoSuchMode", cluster_cidrs=("10.0.0.0/8",)),
    ],
)
def test_no_op_detector_when_the_mode_lacks_its_input(options: RuleOptions) -> None:
    d = local_traffic_detector(options, ("10.244.1.0/24",))
    assert d == NO_LOCAL_DETECTOR
    assert not d.implemented
    assert spellings(d) == ("", "", "", "") and d.cidr == ""


# --- nodePortAddresses ---------------------------------------------------------------------------

NODE_IPS = ("192.168.0.2",)
LOCAL = ("127.0.0.1", "192.168.0.2", "192.168.1.2", "192.168.99.11", "2001:db8::1")


def pick(entries: tuple[str, ...], *, include_loopback: bool = True) -> tuple[str, ...] | None:
    return NodePortAddresses.from_entries(entries).addresses(
        NODE_IPS, LOCAL, include_loopback=include_loopback
    )


def test_nftables_reads_an_empty_list_as_primary_and_the_other_modes_do_not() -> None:
    assert effective_node_port_addresses((), "nftables") == (NODE_PORT_ADDRESSES_PRIMARY,)
    for mode in ("iptables", "ipvs", "userspace", ""):
        assert effective_node_port_addresses((), mode) == ()
    assert effective_node_port_addresses(["10.0.0.0/8"], "nftables") == ("10.0.0.0/8",)


def test_no_entries_match_every_local_address() -> None:
    npa = NodePortAddresses.from_entries(())
    assert npa.match_all and npa.contains_ipv4_loopback
    assert pick(()) is None


def test_primary_is_the_nodes_ipv4_node_ips() -> None:
    npa = NodePortAddresses.from_entries(["primary"])
    assert npa.primary and not npa.match_all and not npa.contains_ipv4_loopback
    assert pick(("primary",)) == ("192.168.0.2",)
    got = npa.addresses(("2001:db8::1", "10.0.0.5", "10.0.0.5"), LOCAL, include_loopback=True)
    assert got == ("10.0.0.5",)  # IPv4 only, once; not checked against the local addresses


def test_cidrs_select_the_local_addresses_inside_them_in_their_order() -> None:
    entries = ("192.168.1.0/24", "192.168.0.0/24", "2001:db8::/64")
    npa = NodePortAddresses.from_entries(entries)
    assert not npa.match_all and not npa.contains_ipv4_loopback
    assert [str(n) for n in npa.cidrs] == ["192.168.1.0/24", "192.168.0.0/24"]  # IPv6 left out
    assert pick(entries) == ("192.168.0.2", "192.168.1.2")
    assert pick(("10.0.0.0/8",)) == ()  # matches nothing: no NodePort address at all
    assert pick(("192.168.0.2/24",)) == ("192.168.0.2",)  # host bits are tolerated


def test_zero_cidr_matches_every_local_address() -> None:
    for entries in (("0.0.0.0/0",), ("192.168.0.0/24", "0.0.0.0/0"), ("primary", "0.0.0.0/0")):
        npa = NodePortAddresses.from_entries(entries)
        assert npa.match_all and npa.contains_ipv4_loopback, entries
        assert pick(entries) is None


def test_only_ipv6_cidrs_match_every_ipv4_local_address() -> None:
    npa = NodePortAddresses.from_entries(("2001:db8::/64", "fd00::/8"))
    assert npa.cidrs == () and npa.match_all and npa.contains_ipv4_loopback
    assert pick(("fd00::/8",)) is None


def test_primary_and_cidrs_together_add_up() -> None:
    # The configuration rejects the mix; the decision still has one answer: both, deduplicated.
    assert pick(("primary", "192.168.0.0/16")) == ("192.168.0.2", "192.168.1.2", "192.168.99.11")


def test_loopback_addresses_are_kept_or_dropped_on_request() -> None:
    entries = ("127.0.0.0/8", "192.168.0.0/24")
    assert NodePortAddresses.from_entries(entries).contains_ipv4_loopback
    assert pick(entries) == ("127.0.0.1", "192.168.0.2")
    assert pick(entries, include_loopback=False) == ("192.168.0.2",)
    assert pick(("127.0.0.0/8",), include_loopback=False) == ()


@pytest.mark.parametrize(
    ("entries", "loopback"),
    [
        (("127.0.0.1/32",), True),
        (("127.0.0.2/32",), True),  # inside 127.0.0.0/8, though not 127.0.0.1
        (("120.0.0.0/5",), True),  # a supernet of 127.0.0.0/8
        (("128.0.0.0/8",), False),
        (("192.168.0.0/24",), False),
        (("primary",), False),
    ],
)
def test_contains_ipv4_loopback(entries: tuple[str, ...], loopback: bool) -> None:
    assert NodePortAddresses.from_entries(entries).contains_ipv4_loopback is loopback


def test_a_bad_entry_raises() -> None:
    with pytest.raises(ValueError):
        NodePortAddresses.from_entries(["not-a-cidr"])


@pytest.mark.parametrize(
    ("localhost_nodeports", "entries", "enabled"),
    [
        (True, (), True),
        (False, (), False),
        (True, ("primary",), False),
        (True, ("192.168.0.0/24",), False),
        (True, ("192.168.0.0/24", "127.0.0.1/32"), True),
        (False, ("192.168.0.0/24", "127.0.0.1/32"), False),
        (True, ("0.0.0.0/0",), True),
        (True, ("2001:db8::/64",), True),  # no IPv4 entry: every address, loopback included
    ],
)
def test_localhost_node_ports(
    localhost_nodeports: bool, entries: tuple[str, ...], enabled: bool
) -> None:
    options = RuleOptions(localhost_nodeports=localhost_nodeports, node_port_addresses=entries)
    assert localhost_node_ports_enabled(options) is enabled


# --- the modes read the one decision -------------------------------------------------------------


def nodeport_jumps(options: RuleOptions) -> list[str]:
    """The destinations of iptables mode's KUBE-SERVICES -> KUBE-NODEPORTS jumps."""
    snap = snapshot_from_objects([node()], "node1")
    text = render_full(snap, NodeFacts(node_ips=NODE_IPS, local_addresses=LOCAL), options)
    comment = '"kubernetes service nodeports; NOTE: this must be the last rule in this chain" '
    return [
        line.split(comment)[1].removesuffix(" -j KUBE-NODEPORTS")
        for line in text.splitlines()
        if line.startswith("-A KUBE-SERVICES ") and line.endswith(" -j KUBE-NODEPORTS")
    ]


def test_iptables_serves_a_zero_cidr_on_every_local_address_like_upstream() -> None:
    assert nodeport_jumps(RuleOptions(node_port_addresses=("0.0.0.0/0",))) == [
        "-m addrtype --dst-type LOCAL"
    ]
    assert nodeport_jumps(RuleOptions(node_port_addresses=("192.168.0.0/16",))) == [
        "-d 192.168.0.2",
        "-d 192.168.1.2",
        "-d 192.168.99.11",
    ]
    localhost_off = RuleOptions(localhost_nodeports=False, node_port_addresses=("0.0.0.0/0",))
    assert nodeport_jumps(localhost_off) == ["-m addrtype --dst-type LOCAL ! -d 127.0.0.0/8"]
