"""The compact nftables layout's planner and writer (no kernel): objects in, table out.

The golden file is upstream's overall test case (tests/golden/nftables/overall.yaml, the
objects upstream's own expected output is for) rendered in the compact layout; it was
read rule by rule against upstream's layout for the same objects (plan.py): same filter
side, NAT decisions moved from per-service chains into map elements and shared chains.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from kproxy.dataplane.facts import NodeFacts, RuleOptions
from kproxy.dataplane.nftables import names
from kproxy.dataplane.nftables.compact import CompactPlanner
from kproxy.dataplane.nftables.render import render_full
from kproxy.dataplane.nftables.steps import split
from kproxy.dataplane.nftables.transaction import TableState, write_sync
from kproxy.model.snapshot import ChangeTracker, snapshot_from_objects
from kproxy.sources.base import ObjectEvent, ObjectKey
from tests.support.nft_golden import GOLDEN, facts, fixture, golden_yaml, options, snapshot
from tests.support.objects import endpoint, endpoint_slice, node, port, service

FACTS = NodeFacts(node_ips=("10.100.0.1",), local_addresses=("127.0.0.1", "10.100.0.1"))
OPTIONS = RuleOptions(cluster_cidrs=("10.244.0.0/16",))
TCP_ENDPOINTS = names.endpoint_map(names.SERVICE_ENDPOINTS_MAP, "tcp")


def web(i: int, ips: list[str], **spec: Any) -> list[dict[str, Any]]:
    name = f"web{i}"
    return [
        service(name, f"10.96.{i // 200}.{10 + i % 200}", [port("http", 80, 8080)], **spec),
        endpoint_slice(name, [endpoint(ip) for ip in ips], [port("http", 8080)]),
    ]


def event(obj: dict[str, Any], delete: bool = False) -> ObjectEvent:
    meta = obj["metadata"]
    ns = "" if obj["kind"] == "Node" else meta.get("namespace", "default")
    return ObjectEvent(ObjectKey(obj["kind"], ns, meta["name"]), None if delete else obj)


def plan_of(objects: list[dict[str, Any]]):
    snap = snapshot_from_objects([node(), *objects], "node1")
    return CompactPlanner(FACTS, OPTIONS).plan(snap)


def elements(plan, container: str) -> dict[str, str]:
    return {k: e.value for k, e in plan.elements()[container].items()}


def test_upstreams_overall_case_renders_to_the_golden_table() -> None:
    case = golden_yaml("overall.yaml")
    text = render_full(
        snapshot(case["objects"]),
        facts(),
        options(),
        service_cidrs=fixture()["service_cidrs"],
        layout="compact",
    )
    assert text == (GOLDEN / "compact_overall.nft").read_text()
    assert "table ip kproxy-compact" in text and " kube-proxy " not in text


def test_chains_do_not_grow_with_services_or_endpoints() -> None:
    def chains(services: int, endpoints: int) -> set[str]:
        objs = []
        for i in range(services):
            objs += web(i, [f"10.244.{e}.{1 + i % 250}" for e in range(endpoints)])
        plan = plan_of(objs)
        assert all(not b.chains for b in plan.blocks.values())
        return plan.service_chains() | set(plan.shared)

    assert chains(10, 3) == chains(1000, 3) == {"dnat/internal/3"}
    assert chains(1000, 10) == {"dnat/internal/10"}


@pytest.mark.parametrize("count", [1, 2, 3, 7, 10, 64, 100])
def test_every_endpoint_gets_exactly_one_slot_of_its_own_count(count: int) -> None:
    ips = [f"10.244.{i // 250}.{1 + i % 250}" for i in range(count)]
    plan = plan_of(web(0, ips))
    slots = {k: v for k, v in elements(plan, TCP_ENDPOINTS).items() if "10.96.0.10" in k}
    assert sorted(int(k.rsplit(" . ", 1)[1]) for k in slots) == list(range(count))
    assert Counter(v.split(" . ")[0] for v in slots.values()) == Counter(ips)
    chain = f"dnat/internal/{count}"
    assert elements(plan, names.SERVICE_IPS_MAP)["10.96.0.10 . tcp . 80"] == f"goto {chain}"
    assert plan.shared[chain].rules[-3:] == tuple(
        f"meta l4proto {proto} dnat to ip daddr . meta l4proto . th dport . numgen random"
        f" mod {count} map @service-endpoints-{proto}"
        for proto in ("tcp", "udp", "sctp")
    )


def test_local_policy_puts_local_endpoints_after_the_cluster_ones() -> None:
    lb = service(
        "lb",
        "10.96.0.50",
        [port("http", 80, 8080, nodePort=30050)],
        type="LoadBalancer",
        externalTrafficPolicy="Local",
    )
    lb["status"] = {"loadBalancer": {"ingress": [{"ip": "10.99.0.5"}]}}
    eps = [endpoint("10.244.1.1", "node2"), endpoint("10.244.0.5"), endpoint("10.244.2.1", "n3")]
    plan = plan_of([lb, endpoint_slice("lb", eps, [port("http", 8080)])])
    dnat = elements(plan, TCP_ENDPOINTS)
    ext = "10.99.0.5 . tcp . 80"
    assert [dnat[f"{ext} . {i}"] for i in range(4)] == [
        "10.244.0.5 . 8080",
        "10.244.1.1 . 8080",
        "10.244.2.1 . 8080",
        "10.244.0.5 . 8080",  # the local one, at slot N + 0
    ]
    assert elements(plan, names.SERVICE_IPS_MAP)[ext] == "goto dnat/external-local/3/1"
    assert elements(plan, names.SERVICE_NODEPORTS_MAP)["tcp . 30050"] == (
        "goto dnat/nodeport-local/3/1"
    )
    rules = plan.shared["dnat/external-local/3/1"].rules
    assert rules[0].startswith("ip saddr 10.244.0.0/16 meta l4proto tcp dnat to ")
    assert "mod 3 map @service-endpoints-tcp" in rules[0]
    assert "fib saddr type local jump mark-for-masquerade" in rules[3]
    assert rules[-1].endswith("numgen random mod 1 offset 3 map @service-endpoints-sctp")
    # ClusterIP traffic (Cluster policy) spreads over all three.
    assert elements(plan, names.SERVICE_IPS_MAP)["10.96.0.50 . tcp . 80"] == (
        "goto dnat/internal/3"
    )


def test_affinity_keeps_upstreams_per_service_chains() -> None:
    aff = {
        "sessionAffinity": "ClientIP",
        "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 60}},
    }
    plan = plan_of(web(0, ["10.244.0.1", "10.244.0.2"], **aff) + web(1, ["10.244.0.3"]))
    blocks = {b.name.name: b for b in plan.blocks.values()}
    assert {s.timeout for s in blocks["web0"].affinity_sets} == {60}
    assert len(blocks["web0"].endpoint_chains) == 2
    target = elements(plan, names.SERVICE_IPS_MAP)["10.96.0.10 . tcp . 80"]
    assert target.startswith("goto service-") and "web0" in target
    assert not blocks["web1"].chains and blocks["web1"].shared == ("dnat/internal/1",)


def test_hairpin_and_masquerade_checks_are_in_the_setup() -> None:
    plan = plan_of(web(0, ["10.244.0.1"]))
    rules = [r for c, r in plan.setup.masquerade_rules if c == names.MASQUERADING_CHAIN]
    assert rules[0] == (
        "ct status dnat ip saddr . ip daddr @hairpin-endpoints jump mark-for-masquerade"
    )
    assert elements(plan, names.HAIRPIN_SET) == {"10.244.0.1 . 10.244.0.1": ""}
    assert plan.shared["dnat/internal/1"].rules[0] == (
        "ip saddr != 10.244.0.0/16 jump mark-for-masquerade"
    )
    masq_all = CompactPlanner(FACTS, RuleOptions(masquerade_all=True)).plan(
        snapshot_from_objects([node(), *web(0, ["10.244.0.1"])], "node1")
    )
    assert masq_all.shared["dnat/internal/1"].rules[0] == "jump mark-for-masquerade"


def test_a_one_service_change_is_elements_only_over_netlink() -> None:
    t = ChangeTracker("node1")
    t.apply([event(node())])
    for i in range(50):
        t.apply([event(o) for o in web(i, [f"10.244.{i}.1", "10.244.255.1"])])
    planner = CompactPlanner(FACTS, OPTIONS)
    first = write_sync(planner.plan(t.snapshot()), TableState(), full=True)
    state = first.commit(TableState())
    # Endpoints sort by "ip:port" text: 10.244.255.1 takes slot 0, the new one slot 1.
    t.apply([event(o) for o in web(7, ["10.244.7.9", "10.244.255.1"])])
    write = write_sync(planner.plan(t.snapshot()), state, full=False)
    assert {op.kind for op in write.tx.ops} == {"element"}
    steps = split(write.tx)
    assert [s.kind for s in steps] == ["netlink"]
    assert write.tx.text() == (
        "delete element ip kproxy-compact hairpin-endpoints { 10.244.7.1 . 10.244.7.1 }\n"
        "delete element ip kproxy-compact service-endpoints-tcp { 10.96.0.17 . tcp . 80 . 1 }\n"
        "add element ip kproxy-compact hairpin-endpoints { 10.244.7.9 . 10.244.7.9 }\n"
        "add element ip kproxy-compact service-endpoints-tcp"
        " { 10.96.0.17 . tcp . 80 . 1 : 10.244.7.9 . 8080 }\n"
    )


def test_a_shared_chain_goes_stale_with_its_last_user() -> None:
    t = ChangeTracker("node1")
    t.apply([event(node())])
    t.apply([event(o) for o in web(0, ["10.244.0.1"]) + web(1, ["10.244.0.2", "10.244.0.3"])])
    planner = CompactPlanner(FACTS, OPTIONS)
    state = write_sync(planner.plan(t.snapshot()), TableState(), full=True).commit(TableState())
    assert {"dnat/internal/1", "dnat/internal/2"} <= state.chains
    t.apply([event(o) for o in web(1, ["10.244.0.2"])])  # 2 -> 1 endpoint
    write = write_sync(planner.plan(t.snapshot()), state, full=False, now=5.0)
    assert write.stale_flushed == ["dnat/internal/2"]
    assert "flush chain ip kproxy-compact dnat/internal/2" in write.tx.text()
    state = write.commit(state)
    t.apply([event(o) for o in web(1, ["10.244.0.2", "10.244.0.4"])])  # and back
    write = write_sync(planner.plan(t.snapshot()), state, full=False, now=5.5)
    assert "add rule ip kproxy-compact dnat/internal/2 meta l4proto tcp dnat to" in write.tx.text()
    assert write.commit(state).stale == {}


@pytest.mark.parametrize("proto", ["UDP", "SCTP"])
def test_each_protocols_endpoints_go_to_its_own_map(proto: str) -> None:
    spec = [port("p", 53, 8053, protocol=proto, nodePort=30053)]
    svc = service("dns", "10.96.0.53", spec, type="NodePort")
    slice_ = endpoint_slice("dns", [endpoint("10.244.0.1")], [port("p", 8053, protocol=proto)])
    plan = plan_of([svc, slice_])
    p = proto.lower()
    maps = {c: elements(plan, c) for c in names.ENDPOINT_MAPS}
    assert {c for c, els in maps.items() if els} == {
        f"service-endpoints-{p}",
        f"nodeport-endpoints-{p}",
    }
    assert maps[f"service-endpoints-{p}"] == {f"10.96.0.53 . {p} . 53 . 0": "10.244.0.1 . 8053"}
    assert maps[f"nodeport-endpoints-{p}"] == {f"{p} . 30053 . 0": "10.244.0.1 . 8053"}
    # Every shared chain has this protocol's pick, on its map.
    for chain in plan.shared.values():
        assert any(r.startswith(f"meta l4proto {p} dnat") for r in chain.rules), chain
