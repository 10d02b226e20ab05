"""userspace mode's pure plan: listener table, proxy ports and redirect rules (no root)."""

from __future__ import annotations

from typing import Any

import pytest

from kproxy.dataplane.facts import NodeFacts, RuleOptions
from kproxy.dataplane.userspace.render import (
    DEFAULT_PORT_RANGE,
    allocate_ports,
    parse_port_range,
    render_plan,
    render_text,
)
from kproxy.model.snapshot import snapshot_from_objects
from tests.support.objects import endpoint, endpoint_slice, node, port, service

FACTS = NodeFacts(node_ips=("10.100.0.1",), local_addresses=("10.100.0.1", "127.0.0.1"))
OPTIONS = RuleOptions(cluster_cidrs=("10.244.0.0/16",))
PODS = ("10.244.0.2", "10.244.0.3")
HTTP = [port("http", 80, 8080)]
SLICE_PORTS = [port("http", 8080)]


def snap(*objects: dict[str, Any]):
    return snapshot_from_objects([node(), *objects], "node1")


def web(
    name: str = "web", ip: str = "10.96.0.10", pods=PODS, nodes=None, slice_ports=None, **spec: Any
):
    nodes = nodes or {}
    return (
        service(name, ip, spec.pop("ports", HTTP), **spec),
        endpoint_slice(
            name, [endpoint(p, nodes.get(p, "node1")) for p in pods], slice_ports or SLICE_PORTS
        ),
    )


def plan_of(*objects: dict[str, Any], options: RuleOptions = OPTIONS, **kw: Any):
    return render_plan(snap(*objects), FACTS, options, **kw)


def test_cluster_ip_gets_a_listener_and_a_dnat_to_the_node_in_both_portal_chains() -> None:
    plan = plan_of(*web())
    [lst] = plan.listeners
    assert lst.key == "default/web:http/tcp/cluster"
    assert lst.targets == (("10.244.0.2", 8080), ("10.244.0.3", 8080))
    assert lst.source == "detect"
    p = lst.port
    assert DEFAULT_PORT_RANGE[0] <= p <= DEFAULT_PORT_RANGE[1]
    assert plan.rules["nat"] == [
        '-A KUBE-PORTALS-CONTAINER -m comment --comment "default/web:http cluster IP"'
        f" -p tcp -m tcp -d 10.96.0.10/32 --dport 80 -j DNAT --to-destination 10.100.0.1:{p}",
        f'-A KUBE-PORTALS-HOST -m comment --comment "default/web:http cluster IP" -p tcp -m tcp'
        f" -d 10.96.0.10/32 --dport 80 -j DNAT --to-destination 10.100.0.1:{p}",
    ]
    # Only redirected traffic may reach a proxy port.
    assert any(
        "--ctstate DNAT" in r and f"--dport {p} -j ACCEPT" in r for r in plan.rules["filter"]
    )
    assert any("--ctstate NEW" in r and f"--dport {p} -j DROP" in r for r in plan.rules["filter"])
    assert plan.local_cidrs == ("10.244.0.0/16",)


def test_without_a_node_ip_the_rules_redirect() -> None:
    plan = render_plan(snap(*web()), NodeFacts(), OPTIONS)
    assert all(
        r.endswith(f"REDIRECT --to-ports {plan.listeners[0].port}") for r in plan.rules["nat"]
    )


def test_service_without_endpoints_is_rejected_and_has_no_listener() -> None:
    plan = plan_of(
        service("empty", "10.96.0.99", [port("http", 80, 8080, nodePort=30099)], type="NodePort")
    )
    assert plan.listeners == []
    assert plan.rules["nat"] == []
    reject = [r for r in plan.rules["filter"] if r.endswith("-j REJECT")]
    assert reject == [
        '-A KUBE-PORTALS-CONTAINER -m comment --comment "default/empty:http has no endpoints"'
        " -p tcp -m tcp -d 10.96.0.99/32 --dport 80 -j REJECT",
        '-A KUBE-PORTALS-HOST -m comment --comment "default/empty:http has no endpoints"'
        " -p tcp -m tcp -d 10.96.0.99/32 --dport 80 -j REJECT",
        '-A KUBE-PORTALS-CONTAINER -m comment --comment "default/empty:http has no endpoints"'
        " -p tcp -m tcp -m addrtype --dst-type LOCAL --dport 30099 -j REJECT",
        '-A KUBE-PORTALS-HOST -m comment --comment "default/empty:http has no endpoints"'
        " -p tcp -m tcp -m addrtype --dst-type LOCAL --dport 30099 -j REJECT",
    ]


def test_internal_policy_local_without_local_endpoints_drops() -> None:
    plan = plan_of(*web(nodes={ip: "node2" for ip in PODS}, internalTrafficPolicy="Local"))
    assert plan.listeners == []
    assert [r.split(" -j ")[-1] for r in plan.rules["filter"]] == ["DROP", "DROP"]
    assert "has no local endpoints" in plan.rules["filter"][0]


def test_node_port_with_local_policy_uses_local_endpoints_and_pods_fall_back() -> None:
    plan = plan_of(
        *web(
            nodes={PODS[1]: "node2"},
            type="NodePort",
            externalTrafficPolicy="Local",
            ports=[port("http", 80, 8080, nodePort=30080)],
        )
    )
    cluster, external = sorted(plan.listeners, key=lambda x: x.scope)
    assert cluster.targets == (("10.244.0.2", 8080), ("10.244.0.3", 8080))
    assert external.scope == "external" and external.source == "local"
    assert external.targets == (("10.244.0.2", 8080),)
    assert external.fallback == cluster.targets
    p = external.port
    assert (
        f"-A KUBE-NODEPORT-CONTAINER -m comment --comment default/web:http -p tcp -m tcp"
        f" --dport 30080 -j DNAT --to-destination 10.100.0.1:{p}" in plan.rules["nat"]
    )
    assert (
        f"-A KUBE-NODEPORT-HOST -m comment --comment default/web:http -p tcp -m tcp"
        f" --dport 30080 -j DNAT --to-destination 10.100.0.1:{p}" in plan.rules["nat"]
    )


def test_local_policy_without_local_endpoints_serves_pods_only() -> None:
    plan = plan_of(
        *web(
            nodes={ip: "node2" for ip in PODS},
            type="NodePort",
            externalTrafficPolicy="Local",
            externalIPs=["10.99.0.10"],
            ports=[port("http", 80, 8080, nodePort=30080)],
        )
    )
    container = [r for r in plan.rules["nat"] if r.startswith("-A KUBE-PORTALS-CONTAINER")]
    ext = [r for r in container if "10.99.0.10" in r]
    assert ext and all(" -s 10.244.0.0/16 " in r for r in ext)
    nodeports = [r for r in plan.rules["nat"] if r.startswith("-A KUBE-NODEPORT-CONTAINER")]
    assert nodeports and all(
        r.startswith("-A KUBE-NODEPORT-CONTAINER -s 10.244.0.0/16 ") for r in nodeports
    )
    drops = [r for r in plan.rules["filter"] if "has no local endpoints" in r]
    assert len(drops) == 2 and all(r.endswith("-j DROP") for r in drops)


def test_load_balancer_source_ranges_redirect_only_allowed_sources() -> None:
    svc, eps = web(
        type="LoadBalancer",
        loadBalancerSourceRanges=["10.100.0.2/32"],
        ports=[port("http", 80, 8080, nodePort=30081)],
    )
    svc["status"] = {"loadBalancer": {"ingress": [{"ip": "10.99.1.10"}]}}
    plan = plan_of(svc, eps)
    lb = [r for r in plan.rules["nat"] if "10.99.1.10" in r]
    assert len(lb) == 2 and all(" -s 10.100.0.2/32 " in r for r in lb)
    drop = [r for r in plan.rules["filter"] if "loadBalancerSourceRanges" in r]
    assert len(drop) == 2 and all("-d 10.99.1.10/32 --dport 80 -j DROP" in r for r in drop)


def test_affinity_udp_and_sctp() -> None:
    plan = plan_of(
        *web(
            sessionAffinity="ClientIP", sessionAffinityConfig={"clientIP": {"timeoutSeconds": 30}}
        ),
        *web(
            "dns",
            "10.96.0.53",
            ports=[port("dns", 53, 8080, protocol="UDP")],
            slice_ports=[port("dns", 8080, protocol="UDP")],
        ),
        *web(
            "sctp",
            "10.96.0.60",
            ports=[port("s", 80, 8080, protocol="SCTP")],
            slice_ports=[port("s", 8080, protocol="SCTP")],
        ),
    )
    by_key = {lst.key: lst for lst in plan.listeners}
    assert by_key["default/web:http/tcp/cluster"].affinity == 30
    assert by_key["default/dns:dns/udp/cluster"].protocol == "udp"
    assert not any("sctp" in k for k in by_key)
    assert any("userspace mode proxies IPv4 TCP and UDP only" in s for s in plan.skipped)


def test_render_is_deterministic_and_ports_stick_to_their_listener() -> None:
    objs = [*web(), *web("api", "10.96.0.30"), *web("dns", "10.96.0.53")]
    first = plan_of(*objs)
    assert render_text(snap(*objs), FACTS, OPTIONS) == render_text(
        snap(*reversed(objs)), FACTS, OPTIONS
    )
    # Deleting one service moves nobody else; a new one gets a free port.
    previous = first.ports
    later = plan_of(
        *web(),
        *web("dns", "10.96.0.53"),
        *web("new", "10.96.0.70"),
        previous_ports=previous,
        avoid_ports=set(previous.values()),
    )
    for key, p in later.ports.items():
        if key in previous:
            assert previous[key] == p
        else:
            assert p not in previous.values()


def test_render_text_is_restore_input_with_the_listener_table_as_comments() -> None:
    text = render_text(snap(*web()), FACTS, OPTIONS)
    lines = text.splitlines()
    assert lines[0] == "*filter"
    assert ":KUBE-PORTALS-CONTAINER - [0:0]" in lines
    assert ":KUBE-PROXY-CANARY - [0:0]" in lines
    assert any("-m socket --transparent -j MARK --set-xmark 0x2000/0x2000" in ln for ln in lines)
    table = [ln for ln in lines if ln.startswith("# ")]
    assert table[0].startswith("# kproxy userspace listeners")
    assert "default/web:http 10.96.0.10:80 -> 10.244.0.2:8080 10.244.0.3:8080" in table[1]
    assert all(ln.startswith(("*", ":", "-A", "COMMIT", "#")) for ln in lines)


def test_allocate_ports() -> None:
    keys = [f"k{i}" for i in range(10)]
    a = allocate_ports(keys, {}, (100, 119))
    assert sorted(a) == keys and len(set(a.values())) == 10
    assert all(100 <= p <= 119 for p in a.values())
    assert allocate_ports(keys, {}, (100, 119)) == a  # deterministic
    b = allocate_ports(keys, a, (100, 119), bad=[a["k3"]])
    assert b["k3"] != a["k3"] and {k: v for k, v in b.items() if k != "k3"} == {
        k: v for k, v in a.items() if k != "k3"
    }
    c = allocate_ports(["new"], a, (100, 119), avoid=a.values())
    assert c["new"] not in a.values()
    with pytest.raises(ValueError, match="do not fit"):
        allocate_ports(keys, {}, (100, 105))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", DEFAULT_PORT_RANGE),
        ("3000-3100", (3000, 3100)),
        ("3000+10", (3000, 3010)),
        ("4000", (4000, 4000)),
    ],
)
def test_parse_port_range(text: str, expected: tuple[int, int]) -> None:
    assert parse_port_range(text) == expected


def test_parse_port_range_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        parse_port_range("70000-70010")
