"""Rule-compatibility tests of nftables mode against upstream kube-proxy's nftables proxier.

Expected data lives in tests/golden/nftables/, transcribed from kubernetes/kubernetes
pkg/proxy/nftables/proxier_test.go at 030880a5dc5449403c6d1f0aa146a7dc21d6c6dc (the layout
of proxier.go at 531be812: filter-*-pre-dnat base chains at priority -110, cluster-ips-check,
service-/nodeport-endpoints-check):

* base_rules.nft: upstream's baseRules, the fixed part of the table;
* overall.yaml: TestOverallNFTablesRules, a full dump;
* sync_repeated.yaml: TestSyncProxyRulesRepeated, a dump and an operation count per sync;
* flows.yaml: tests upstream asserts by tracing packets (TestClusterIPGeneral,
  TestLoadBalancer, TestNoEndpointsReject, TestExternalTrafficPolicy*, TestNodePorts ipv4).

kproxy's transactions are applied to an in-memory table (tests/support/nft_fakes.py)
that behaves like the kernel, and its state is compared with upstream's expected dump the
way upstream compares (sortNFTablesTransaction): only the order in which services were
written is ignored. Upstream's fixture writes the mark as 0x4000; kproxy writes Go's %#08x,
0x00004000, as upstream itself does outside unit tests.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest

from kproxy.dataplane.facts import RuleOptions
from kproxy.dataplane.nftables import names
from kproxy.dataplane.nftables.proxier import NftablesDataplane
from kproxy.dataplane.nftables.render import render_full
from kproxy.model.snapshot import ChangeTracker
from kproxy.sources.base import ObjectEvent, ObjectKey
from tests.support.nft_fakes import (
    FakeBackend,
    FakeTable,
    assert_dump_equal,
    load_dump,
    trace_packet,
)
from tests.support.nft_golden import (
    GOLDEN,
    facts,
    fixture,
    flow_cases,
    golden_yaml,
    options,
    snapshot,
)

COMMIT = "kubernetes/kubernetes@030880a5dc5449403c6d1f0aa146a7dc21d6c6dc"


def with_mark(text: str, opts: RuleOptions) -> str:
    return re.sub(r"\b0x4000\b", opts.masquerade_mark, text)


def base_rules(opts: RuleOptions, nodeport_ips: tuple[str, ...] = ("192.168.0.2",)) -> str:
    text = (GOLDEN / "base_rules.nft").read_text()
    text = text.replace(
        "add element ip kube-proxy nodeport-ips { 192.168.0.2 }\n",
        "".join(f"add element ip kube-proxy nodeport-ips {{ {ip} }}\n" for ip in nodeport_ips),
    )
    return with_mark(text, opts)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# Every compat test runs twice: kproxy's transaction applied as one `nft -f` text
# ("text"), and applied the way the fast path does (steps.split, in small pieces, "steps").
APPLY = pytest.mark.parametrize("fast", [False, True], ids=["text", "steps"])


def dataplane(
    opts: RuleOptions | None = None, table: FakeTable | None = None, *, fast: bool = False
) -> tuple[NftablesDataplane, FakeBackend, Clock]:
    backend = FakeBackend(table, fast=fast, chunk_ops=40)
    clock = Clock()
    dp = NftablesDataplane(
        facts(),
        opts or options(),
        backend=backend,
        service_cidrs=fixture()["service_cidrs"],
        clock=clock,
        keep_last_write=True,
    )
    return dp, backend, clock


# --------------------------------------------------------------------------- chain names


def test_chain_names_match_upstream() -> None:
    """Names spelled out in upstream's tests (hash of "ns/svc/proto/port[__ip/port]")."""
    from kproxy.model.objects import Protocol, ServicePortName

    spn = ServicePortName("ns1", "svc1", "p80", Protocol.TCP)
    assert names.service_base(spn) == "ULMVA6XW-ns1/svc1/tcp/p80"
    assert names.endpoint_base(spn, "10.180.0.1", 80) == "5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80"
    assert names.endpoint_base(spn, "10.0.1.1", 80) == "5TPGNJF2-ns1/svc1/tcp/p80__10.0.1.1/80"
    spn2 = ServicePortName("ns2", "svc2", "p8080", Protocol.TCP)
    assert names.service_base(spn2) == "MHHHYRWA-ns2/svc2/tcp/p8080"
    # IPv6 colons become dots; over-long names are cut with "..." at 240 characters.
    assert names.endpoint_base(spn, "fd00::1", 80).endswith("__fd00..1/80")
    long = names.hash_and_truncate("x" * 300)
    assert len(long) == names.BASE_LENGTH_MAX and long.endswith("...")
    assert names.is_service_chain("service-ULMVA6XW-ns1/svc1/tcp/p80")
    assert not names.is_service_chain("filter-prerouting-pre-dnat")


# --------------------------------------------------------------------------- full dumps


@APPLY
def test_overall_nftables_rules(fast: bool) -> None:
    """TestOverallNFTablesRules: the table after one full sync is upstream's dump."""
    case = golden_yaml("overall.yaml")
    opts = options()
    dp, backend, _ = dataplane(opts, fast=fast)
    result = dp.sync(snapshot(case["objects"]), full=True)
    expected = base_rules(opts) + with_mark(case["expected"], opts)
    assert_dump_equal(expected, backend.table.dump())
    assert result.full and result.services == 6


def test_render_full_is_what_a_full_sync_applies() -> None:
    """`kproxy render` output is one command per line and yields upstream's state."""
    case = golden_yaml("overall.yaml")
    opts = options()
    text = render_full(
        snapshot(case["objects"]), facts(), opts, service_cidrs=fixture()["service_cidrs"]
    )
    assert all(
        re.match(r"^(add|flush|delete) (table|chain|rule|set|map|element) ", line)
        for line in text.splitlines()
    )
    table = FakeTable()
    table.apply(text)
    assert_dump_equal(base_rules(opts) + with_mark(case["expected"], opts), table.dump())
    # The first full sync of a process re-creates every base chain (add + delete first).
    assert text.splitlines()[1:3] == [
        "add chain ip kube-proxy filter-prerouting-pre-dnat",
        "delete chain ip kube-proxy filter-prerouting-pre-dnat",
    ]


def test_render_is_deterministic_and_sorted() -> None:
    case = golden_yaml("overall.yaml")
    opts = options()
    sc = fixture()["service_cidrs"]
    first = render_full(snapshot(case["objects"]), facts(), opts, service_cidrs=sc)
    assert render_full(snapshot(case["objects"][::-1]), facts(), opts, service_cidrs=sc) == first
    order = [
        m.group(1)
        for m in re.finditer(r"^add chain ip kube-proxy service-\w+-(\S+)/tcp", first, re.MULTILINE)
    ]
    assert order == sorted(order) and len(order) == 5


def test_nodeport_addresses_default_to_primary_and_never_localhost() -> None:
    """nftables mode: nodePortAddresses unset means the node's primary IP; loopback never
    serves NodePorts; 0.0.0.0/0 (or no IPv4 CIDR) means every local address."""
    case = golden_yaml("overall.yaml")
    primary = render_full(snapshot(case["objects"]), facts(), options(node_port_addresses=[]))
    assert "add element ip kube-proxy nodeport-ips { 192.168.0.2 }" in primary
    lo = render_full(
        snapshot(case["objects"]), facts(), options(node_port_addresses=["127.0.0.0/8"])
    )
    assert (
        "nodeport-ips {"
        not in lo.split("flush set ip kube-proxy nodeport-ips", 1)[1].split("add map", 1)[0]
    )
    everything = render_full(
        snapshot(case["objects"]), facts(), options(node_port_addresses=["0.0.0.0/0"])
    )
    assert "delete set ip kube-proxy nodeport-ips" in everything
    assert (
        "add rule ip kube-proxy services fib daddr type local ip daddr != 127.0.0.0/8 "
        "meta l4proto . th dport vmap @service-nodeports"
    ) in everything
    assert (
        "add rule ip kube-proxy nodeport-endpoints-check ip daddr != 127.0.0.0/8 "
        "meta l4proto . th dport vmap @no-endpoint-nodeports"
    ) in everything


# --------------------------------------------------------------------------- packet flows


@APPLY
@pytest.mark.parametrize("case", flow_cases(), ids=lambda c: c["name"])
def test_packet_flows(case: dict[str, Any], fast: bool) -> None:
    """Upstream's runPacketFlowTests on kproxy's table."""
    overrides = {}
    if "node_port_addresses" in case:
        overrides["node_port_addresses"] = case["node_port_addresses"]
    dp, backend, _ = dataplane(options(**overrides), fast=fast)
    dp.sync(snapshot(case["objects"]), full=True)
    node_ips = frozenset(fixture()["tracer_node_ips"])
    failures = []
    for flow in case["flows"]:
        t = trace_packet(
            backend.table,
            flow["source"],
            flow.get("protocol", "tcp"),
            flow["destination"],
            flow["port"],
            node_ips,
        )
        output = ", ".join(t.outputs)
        if output != flow["output"] or t.masq != flow.get("masq", False):
            failures.append(
                f"{flow['name']}: got {output!r} masq={t.masq}, expected {flow['output']!r} "
                f"masq={flow.get('masq', False)}\n    " + "\n    ".join(t.matches)
            )
    assert not failures, "\n".join(failures)


# --------------------------------------------------------------------------- repeated syncs


def _event(obj: dict[str, Any], *, delete: bool = False) -> ObjectEvent:
    meta = obj["metadata"]
    key = ObjectKey(obj["kind"], meta.get("namespace", "default"), meta["name"])
    return ObjectEvent(key, None if delete else copy.deepcopy(obj))


@APPLY
def test_sync_proxy_rules_repeated(fast: bool) -> None:
    """TestSyncProxyRulesRepeated: partial syncs write only what changed (upstream's
    operation counts), stale chains are flushed at once and deleted once aged."""
    case = golden_yaml("sync_repeated.yaml")
    objects, fragments = case["objects"], case["fragments"]
    opts = options()
    dp, backend, clock = dataplane(opts, fast=fast)
    tracker = ChangeTracker(fixture()["node_name"])

    def age() -> None:
        clock.now += 2.0

    for i, step in enumerate(case["steps"]):
        where = f"step {i + 1} ({step['name']})"
        if step.get("age_before"):
            age()
        events = [_event(objects[n]) for n in step.get("apply", [])]
        events += [_event(objects[n], delete=True) for n in step.get("delete", [])]
        tracker.apply(events)
        if step.get("age"):
            age()
        result = dp.sync(tracker.snapshot(), full=i == 0)
        if "then_age_and_apply" in step:
            age()
            tracker.apply([_event(objects[n]) for n in step["then_age_and_apply"]])
            result = dp.sync(tracker.snapshot(), full=False)
        assert result.full == (i == 0), where
        expected = base_rules(opts) + with_mark(step["expected"], opts)
        expected += "".join(fragments[f] for f in step["fragments"])
        try:
            assert_dump_equal(expected, backend.table.dump())
        except AssertionError as err:
            raise AssertionError(f"{where}: {err}") from None
        if "operations" in step:
            assert dp.last_write is not None
            got = len(dp.last_write.tx)
            assert got == step["operations"], (
                f"{where}: {got} operations, upstream {step['operations']}:\n"
                + dp.last_write.tx.text()
            )
        if "stale_chains" in step:
            assert dp._state is not None
            assert sorted(dp._state.stale) == sorted(step["stale_chains"]), where


@APPLY
def test_sync_proxy_rules_startup(fast: bool) -> None:
    """TestSyncProxyRulesStartup: after a restart, the first (full) sync keeps existing map
    elements and endpoint chains and writes only the setup plus what differs: svc3's
    cluster-ips and no-endpoint-services elements (2), both service chains (2 x (add +
    flush + 2 rules) = 8), and svc1's new endpoint chain (4)."""
    opts = options()
    dp, backend, _ = dataplane(opts, fast=fast)
    dp.sync(snapshot([]), full=True)
    assert dp.last_write is not None
    setup_ops = len(dp.last_write.tx)

    state = base_rules(opts) + (
        "add chain ip kube-proxy service-ULMVA6XW-ns1/svc1/tcp/p80\n"
        "add chain ip kube-proxy endpoint-5TPGNJF2-ns1/svc1/tcp/p80__10.0.1.1/80\n"
        "add chain ip kube-proxy service-MHHHYRWA-ns2/svc2/tcp/p8080\n"
        "add chain ip kube-proxy endpoint-7RVP4LUQ-ns2/svc2/tcp/p8080__10.0.2.1/8080\n"
        "add rule ip kube-proxy service-ULMVA6XW-ns1/svc1/tcp/p80 ip daddr 172.30.0.41 ip saddr != 10.0.0.0/8 jump mark-for-masquerade\n"  # noqa: E501
        "add rule ip kube-proxy service-ULMVA6XW-ns1/svc1/tcp/p80 numgen random mod 1 vmap { 0 : goto endpoint-5TPGNJF2-ns1/svc1/tcp/p80__10.0.1.1/80 }\n"  # noqa: E501
        "add rule ip kube-proxy endpoint-5TPGNJF2-ns1/svc1/tcp/p80__10.0.1.1/80 ip saddr 10.0.1.1 jump mark-for-masquerade\n"  # noqa: E501
        "add rule ip kube-proxy endpoint-5TPGNJF2-ns1/svc1/tcp/p80__10.0.1.1/80 meta l4proto tcp dnat to 10.0.1.1:80\n"  # noqa: E501
        "add rule ip kube-proxy service-MHHHYRWA-ns2/svc2/tcp/p8080 ip daddr 172.30.0.42 ip saddr != 10.0.0.0/8 jump mark-for-masquerade\n"  # noqa: E501
        "add rule ip kube-proxy service-MHHHYRWA-ns2/svc2/tcp/p8080 numgen random mod 1 vmap { 0 : goto endpoint-7RVP4LUQ-ns2/svc2/tcp/p8080__10.0.2.1/8080 }\n"  # noqa: E501
        "add rule ip kube-proxy endpoint-7RVP4LUQ-ns2/svc2/tcp/p8080__10.0.2.1/8080 ip saddr 10.0.2.1 jump mark-for-masquerade\n"  # noqa: E501
        "add rule ip kube-proxy endpoint-7RVP4LUQ-ns2/svc2/tcp/p8080__10.0.2.1/8080 meta l4proto tcp dnat to 10.0.2.1:8080\n"  # noqa: E501
        "add element ip kube-proxy cluster-ips { 172.30.0.41 }\n"
        "add element ip kube-proxy cluster-ips { 172.30.0.42 }\n"
        "add element ip kube-proxy service-ips { 172.30.0.41 . tcp . 80 : goto service-ULMVA6XW-ns1/svc1/tcp/p80 }\n"  # noqa: E501
        "add element ip kube-proxy service-ips { 172.30.0.42 . tcp . 8080 : goto service-MHHHYRWA-ns2/svc2/tcp/p8080 }\n"  # noqa: E501
    )
    table = FakeTable()
    load_dump(table, state)
    dp, backend, _ = dataplane(opts, table, fast=fast)
    svc = golden_yaml("sync_repeated.yaml")["objects"]
    eps1 = copy.deepcopy(svc["eps1"])
    eps1["endpoints"].append({"addresses": ["10.0.1.2"]})
    dp.sync(snapshot([svc["svc1"], svc["svc2"], svc["svc3"], eps1, svc["eps2"]]), full=False)
    assert dp.last_write is not None
    assert len(dp.last_write.tx) == setup_ops + 14, dp.last_write.tx.text()
    expected = base_rules(opts) + with_mark(
        "add element ip kube-proxy cluster-ips { 172.30.0.41 }\n"
        "add element ip kube-proxy cluster-ips { 172.30.0.42 }\n"
        "add element ip kube-proxy cluster-ips { 172.30.0.43 }\n"
        "add element ip kube-proxy service-ips { 172.30.0.41 . tcp . 80 : goto service-ULMVA6XW-ns1/svc1/tcp/p80 }\n"  # noqa: E501
        "add element ip kube-proxy service-ips { 172.30.0.42 . tcp . 8080 : goto service-MHHHYRWA-ns2/svc2/tcp/p8080 }\n"  # noqa: E501
        'add element ip kube-proxy no-endpoint-services { 172.30.0.43 . tcp . 80 comment "ns3/svc3:p80" : goto reject-chain }\n'  # noqa: E501
        "add chain ip kube-proxy service-ULMVA6XW-ns1/svc1/tcp/p80\n"
        "add rule ip kube-proxy service-ULMVA6XW-ns1/svc1/tcp/p80 ip daddr 172.30.0.41 ip saddr != 10.0.0.0/8 jump mark-for-masquerade\n"  # noqa: E501
        "add rule ip kube-proxy service-ULMVA6XW-ns1/svc1/tcp/p80 numgen random mod 2 vmap { 0 : goto endpoint-5TPGNJF2-ns1/svc1/tcp/p80__10.0.1.1/80 , 1 : goto endpoint-ZCZBVNAZ-ns1/svc1/tcp/p80__10.0.1.2/80 }\n"  # noqa: E501
        "add chain ip kube-proxy endpoint-5TPGNJF2-ns1/svc1/tcp/p80__10.0.1.1/80\n"
        "add rule ip kube-proxy endpoint-5TPGNJF2-ns1/svc1/tcp/p80__10.0.1.1/80 ip saddr 10.0.1.1 jump mark-for-masquerade\n"  # noqa: E501
        "add rule ip kube-proxy endpoint-5TPGNJF2-ns1/svc1/tcp/p80__10.0.1.1/80 meta l4proto tcp dnat to 10.0.1.1:80\n"  # noqa: E501
        "add chain ip kube-proxy endpoint-ZCZBVNAZ-ns1/svc1/tcp/p80__10.0.1.2/80\n"
        "add rule ip kube-proxy endpoint-ZCZBVNAZ-ns1/svc1/tcp/p80__10.0.1.2/80 ip saddr 10.0.1.2 jump mark-for-masquerade\n"  # noqa: E501
        "add rule ip kube-proxy endpoint-ZCZBVNAZ-ns1/svc1/tcp/p80__10.0.1.2/80 meta l4proto tcp dnat to 10.0.1.2:80\n"  # noqa: E501
        "add chain ip kube-proxy service-MHHHYRWA-ns2/svc2/tcp/p8080\n"
        "add rule ip kube-proxy service-MHHHYRWA-ns2/svc2/tcp/p8080 ip daddr 172.30.0.42 ip saddr != 10.0.0.0/8 jump mark-for-masquerade\n"  # noqa: E501
        "add rule ip kube-proxy service-MHHHYRWA-ns2/svc2/tcp/p8080 numgen random mod 1 vmap { 0 : goto endpoint-7RVP4LUQ-ns2/svc2/tcp/p8080__10.0.2.1/8080 }\n"  # noqa: E501
        "add chain ip kube-proxy endpoint-7RVP4LUQ-ns2/svc2/tcp/p8080__10.0.2.1/8080\n"
        "add rule ip kube-proxy endpoint-7RVP4LUQ-ns2/svc2/tcp/p8080__10.0.2.1/8080 ip saddr 10.0.2.1 jump mark-for-masquerade\n"  # noqa: E501
        "add rule ip kube-proxy endpoint-7RVP4LUQ-ns2/svc2/tcp/p8080__10.0.2.1/8080 meta l4proto tcp dnat to 10.0.2.1:8080\n",  # noqa: E501
        opts,
    )
    assert_dump_equal(expected, backend.table.dump())
