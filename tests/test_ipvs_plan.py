"""ipvs mode's pure planner and renderer: upstream's expectations (pkg/proxy/ipvs/proxier_test.go,
transcribed: which virtual servers and real servers, which ipset entries, which iptables rules
jump where and matching which set, in which order) plus kproxy's annotations."""

from __future__ import annotations

from typing import Any

import pytest

from kproxy.dataplane.facts import NodeFacts, RuleOptions
from kproxy.dataplane.ipvs import names as n
from kproxy.dataplane.ipvs.plan import IpvsPlan, IpvsPlanner, VSKey, node_port_ips, set_net
from kproxy.dataplane.ipvs.render import ipset_restore, plan_ipvsadm, render_text
from kproxy.model.snapshot import snapshot_from_objects
from tests.support.objects import endpoint, endpoint_slice, node, port, service

NODE_IP = "100.101.102.103"
FACTS = NodeFacts(node_ips=(NODE_IP,), local_addresses=(NODE_IP, "127.0.0.1"), random_fully=True)
OPTIONS = RuleOptions(cluster_cidrs=("10.0.0.0/8",))
P80 = [port("p80", 80, 80)]
EP80 = [port("p80", 80)]


def plan_of(
    *objects: dict[str, Any],
    options: RuleOptions = OPTIONS,
    facts: NodeFacts = FACTS,
    addresses: tuple[str, ...] | None = None,
) -> IpvsPlan:
    snap = snapshot_from_objects([node("node1", ip=NODE_IP), *objects], "node1")
    return IpvsPlanner(facts, options).plan(snap, addresses)


def dests(plan: IpvsPlan, proto: str, ip: str, p: int) -> list[tuple[str, int]]:
    return list(plan.virtual_servers[VSKey(proto, ip, p)].destinations)


def chain_rules(plan: IpvsPlan, chain: str) -> list[tuple[str, str, str]]:
    """(target, match set, source) per rule of `chain`, nat rules then filter rules, the way
    upstream's checkIptables reads them."""
    out = []
    for rule in plan.nat_rules + plan.filter_rules:
        words = rule.split()
        if words[1] != chain:
            continue
        target = words[words.index("-j") + 1]
        match_set = words[words.index("--match-set") + 1] if "--match-set" in words else ""
        source = words[words.index("-s") + 1] if "-s" in words[:4] else ""
        out.append((target, match_set, source))
    return out


# --- upstream TestNodePortIPv4 ---------------------------------------------------------------


def test_node_port_with_endpoints_gets_a_virtual_server_per_node_ip() -> None:
    plan = plan_of(
        service("svc1", "10.20.30.41", [port("p80", 80, 80, nodePort=3001)], type="NodePort"),
        endpoint_slice("svc1", [endpoint("10.180.0.1", "")], EP80),
    )
    assert set(plan.virtual_servers) == {
        VSKey("TCP", "10.20.30.41", 80),
        VSKey("TCP", NODE_IP, 3001),
    }
    for key, vs in plan.virtual_servers.items():
        assert vs.scheduler == "rr" and vs.flags == 0 and vs.timeout == 0, key
        assert vs.destinations == (("10.180.0.1", 80),)
    # NodePorts are never bound to kube-ipvs0; ClusterIPs always are.
    assert plan.bind_addresses == {"10.20.30.41"}
    assert plan.sets[n.NODE_PORT_TCP] == {"3001"}
    assert plan.sets[n.IPVS_IPS] == {"10.20.30.41"}


def test_udp_node_port_rules_like_upstream() -> None:
    plan = plan_of(
        service(
            "svc1",
            "10.20.30.41",
            [port("p80", 80, 80, protocol="UDP", nodePort=3001)],
            type="NodePort",
        ),
        endpoint_slice("svc1", [endpoint("10.180.0.1", "")], [port("p80", 80, protocol="UDP")]),
        options=RuleOptions(cluster_cidrs=("10.0.0.0/8",), node_port_addresses=("0.0.0.0/0",)),
    )
    assert dests(plan, "UDP", NODE_IP, 3001) == [("10.180.0.1", 80)]
    assert plan.sets[n.NODE_PORT_UDP] == {"3001"}
    assert chain_rules(plan, "KUBE-NODE-PORT") == [
        ("KUBE-MARK-MASQ", n.NODE_PORT_UDP, ""),
        ("ACCEPT", n.HEALTH_CHECK_NODE_PORT, ""),
    ]
    assert chain_rules(plan, "KUBE-SERVICES") == [
        ("RETURN", "", "127.0.0.0/8"),
        ("KUBE-MARK-MASQ", n.CLUSTER_IP, ""),
        ("KUBE-NODE-PORT", "", ""),
        ("ACCEPT", n.CLUSTER_IP, ""),
    ]


def test_node_port_without_endpoints_has_virtual_servers_without_real_servers() -> None:
    plan = plan_of(
        service("svc1", "10.20.30.41", [port("p80", 80, 80, nodePort=3001)], type="NodePort")
    )
    assert dests(plan, "TCP", "10.20.30.41", 80) == []
    assert dests(plan, "TCP", NODE_IP, 3001) == []


def test_sctp_node_port_on_several_node_ips_uses_the_hash_set() -> None:
    ips = ("100.101.102.103", "100.101.102.104", "100.101.102.105")
    plan = plan_of(
        service(
            "svc1",
            "10.20.30.41",
            [port("p80", 80, 80, protocol="SCTP", nodePort=3001)],
            type="NodePort",
        ),
        endpoint_slice("svc1", [endpoint("10.180.0.1", "")], [port("p80", 80, protocol="SCTP")]),
        addresses=ips,
    )
    for ip in ips:
        assert dests(plan, "SCTP", ip, 3001) == [("10.180.0.1", 80)]
    assert plan.sets[n.NODE_PORT_SCTP] == {f"{ip},sctp:3001" for ip in ips}
    assert not plan.sets[n.NODE_PORT_TCP]


def test_sctp_node_port_with_local_policy() -> None:
    plan = plan_of(
        service(
            "svc1",
            "10.20.30.41",
            [port("p80", 80, 80, protocol="SCTP", nodePort=3001)],
            type="NodePort",
            externalTrafficPolicy="Local",
        ),
        endpoint_slice(
            "svc1",
            [endpoint("10.180.0.1", "node1"), endpoint("10.180.1.1", "otherHost")],
            [port("p80", 80, protocol="SCTP")],
        ),
    )
    # The ClusterIP keeps every endpoint; the NodePort only the local one.
    assert dests(plan, "SCTP", "10.20.30.41", 80) == [("10.180.0.1", 80), ("10.180.1.1", 80)]
    assert dests(plan, "SCTP", NODE_IP, 3001) == [("10.180.0.1", 80)]
    assert plan.sets[n.NODE_PORT_SCTP] == {f"{NODE_IP},sctp:3001"}
    assert plan.sets[n.NODE_PORT_LOCAL_SCTP] == {f"{NODE_IP},sctp:3001"}
    assert chain_rules(plan, "KUBE-NODE-PORT") == [
        ("RETURN", n.NODE_PORT_LOCAL_SCTP, ""),
        ("KUBE-MARK-MASQ", n.NODE_PORT_SCTP, ""),
        ("ACCEPT", n.HEALTH_CHECK_NODE_PORT, ""),
    ]
    # hash:ip,port sets are matched on both directions of the pair.
    sctp = [r for r in plan.nat_rules if n.NODE_PORT_SCTP + " " in r]
    assert sctp[0].startswith("-A KUBE-NODE-PORT -p sctp -m comment") and " dst,dst " in sctp[0]


# --- upstream TestOnlyLocalNodePorts, TestOnlyLocalExternalIPs, TestHealthCheckNodePort -------


def test_only_local_node_ports() -> None:
    plan = plan_of(
        service(
            "svc1",
            "10.20.30.41",
            [port("p80", 80, 80, nodePort=3001)],
            type="NodePort",
            externalTrafficPolicy="Local",
        ),
        endpoint_slice(
            "svc1", [endpoint("10.180.0.1"), endpoint("10.180.1.1", "other-node")], EP80
        ),
        options=RuleOptions(
            cluster_cidrs=("10.0.0.0/8",), node_port_addresses=("100.101.102.0/24",)
        ),
        addresses=(NODE_IP, "2001:db8::"),
    )
    assert len(plan.virtual_servers) == 2
    assert dests(plan, "TCP", NODE_IP, 3001) == [("10.180.0.1", 80)]
    assert plan.sets[n.NODE_PORT_TCP] == {"3001"} == plan.sets[n.NODE_PORT_LOCAL_TCP]
    assert chain_rules(plan, "KUBE-SERVICES") == [
        ("RETURN", "", "127.0.0.0/8"),
        ("KUBE-MARK-MASQ", n.CLUSTER_IP, ""),
        ("KUBE-NODE-PORT", "", ""),
        ("ACCEPT", n.CLUSTER_IP, ""),
    ]
    assert chain_rules(plan, "KUBE-NODE-PORT") == [
        ("RETURN", n.NODE_PORT_LOCAL_TCP, ""),
        ("KUBE-MARK-MASQ", n.NODE_PORT_TCP, ""),
        ("ACCEPT", n.HEALTH_CHECK_NODE_PORT, ""),
    ]


def test_only_local_external_ips() -> None:
    plan = plan_of(
        service(
            "svc1",
            "10.20.30.41",
            P80,
            type="NodePort",
            externalIPs=["50.60.70.81", "127.0.0.1"],
            externalTrafficPolicy="Local",
        ),
        endpoint_slice(
            "svc1", [endpoint("10.180.0.1"), endpoint("10.180.1.1", "other-node")], EP80
        ),
    )
    assert dests(plan, "TCP", "50.60.70.81", 80) == [("10.180.0.1", 80)]
    assert plan.sets[n.EXTERNAL_IP_LOCAL] == {"50.60.70.81,tcp:80", "127.0.0.1,tcp:80"}
    assert not plan.sets[n.EXTERNAL_IP]
    # An external IP that is already a node address is not bound to kube-ipvs0 again.
    assert plan.virtual_servers[VSKey("TCP", "127.0.0.1", 80)].bind is False
    assert plan.virtual_servers[VSKey("TCP", "50.60.70.81", 80)].bind is True
    local_rules = [r for r in plan.nat_rules if n.EXTERNAL_IP_LOCAL + " " in r]
    assert [r.split(" -j ")[1] for r in local_rules] == ["ACCEPT", "ACCEPT"]


def test_external_ips_are_masqueraded_and_accepted() -> None:
    plan = plan_of(
        service("svc1", "10.20.30.41", P80, externalIPs=["50.60.70.81"]),
        endpoint_slice("svc1", [endpoint("10.180.0.1", "")], EP80),
    )
    ext = [r for r in plan.nat_rules if f"--match-set {n.EXTERNAL_IP} " in r]
    why = "Kubernetes service external ip + port for masquerade and filter purpose"
    comment = f'-m comment --comment "{why}"'
    head = f"-A KUBE-SERVICES {comment} -m set --match-set KUBE-EXTERNAL-IP dst,dst"
    assert ext == [
        f"{head} -j KUBE-MARK-MASQ",
        f"{head} -m physdev ! --physdev-is-in -m addrtype ! --src-type LOCAL -j ACCEPT",
        f"{head} -m addrtype --dst-type LOCAL -j ACCEPT",
    ]


def test_health_check_node_ports_are_accepted() -> None:
    objects = []
    for name, hc in (("valid-svc1", 30000), ("valid-svc2", 30001)):
        objects.append(
            service(
                name,
                "10.20.30.41" if name.endswith("1") else "10.20.30.42",
                [port("p80", 80, 80, nodePort=hc - 27000)],
                type="LoadBalancer",
                externalTrafficPolicy="Local",
                healthCheckNodePort=hc,
            )
        )
    plan = plan_of(*objects)
    assert plan.sets[n.HEALTH_CHECK_NODE_PORT] == {"30000", "30001"}
    assert ("ACCEPT", n.HEALTH_CHECK_NODE_PORT, "") in chain_rules(plan, "KUBE-NODE-PORT")


# --- upstream TestLoadBalancer, TestLoadBalancerSourceRanges, TestAcceptIPVSTraffic -------------


def lb(name: str = "svc1", **spec: Any) -> dict[str, Any]:
    svc = service(
        name, "10.20.30.41", [port("p80", 80, 80, nodePort=3001)], type="LoadBalancer", **spec
    )
    svc["status"] = {"loadBalancer": {"ingress": [{"ip": "1.2.3.4"}]}}
    return svc


def test_load_balancer() -> None:
    plan = plan_of(lb(), endpoint_slice("svc1", [endpoint("10.180.0.1", "")], EP80))
    assert dests(plan, "TCP", "1.2.3.4", 80) == [("10.180.0.1", 80)]
    assert plan.sets[n.LOAD_BALANCER] == {"1.2.3.4,tcp:80"}
    assert chain_rules(plan, "KUBE-SERVICES") == [
        ("RETURN", "", "127.0.0.0/8"),
        ("KUBE-LOAD-BALANCER", n.LOAD_BALANCER, ""),
        ("KUBE-MARK-MASQ", n.CLUSTER_IP, ""),
        ("KUBE-NODE-PORT", "", ""),
        ("ACCEPT", n.CLUSTER_IP, ""),
        ("ACCEPT", n.LOAD_BALANCER, ""),
    ]
    assert chain_rules(plan, "KUBE-LOAD-BALANCER") == [("KUBE-MARK-MASQ", "", "")]


def test_load_balancer_source_ranges() -> None:
    plan = plan_of(
        lb(loadBalancerSourceRanges=["10.0.0.0/8"]),
        endpoint_slice("svc1", [endpoint("10.180.0.1", "")], EP80),
    )
    assert plan.sets[n.LOAD_BALANCER_FW] == {"1.2.3.4,tcp:80"}
    assert plan.sets[n.LOAD_BALANCER_SOURCE_CIDR] == {"1.2.3.4,tcp:80,10.0.0.0/8"}
    assert chain_rules(plan, "KUBE-PROXY-FIREWALL") == [
        ("KUBE-SOURCE-RANGES-FIREWALL", n.LOAD_BALANCER_FW, "")
    ]
    assert chain_rules(plan, "KUBE-SOURCE-RANGES-FIREWALL") == [
        ("RETURN", n.LOAD_BALANCER_SOURCE_CIDR, ""),
        ("DROP", "", ""),
    ]
    # The node (100.101.102.103) is outside 10.0.0.0/8: it may not reach the LB IP either.
    assert (
        "-A KUBE-IPVS-OUT-FILTER -s 1.2.3.4 -m ipvs --vaddr 1.2.3.4 --vproto tcp --vport 80 -j DROP"
        in plan.filter_rules
    )
    assert not plan.sets[n.LOAD_BALANCER_SOURCE_IP]


def test_load_balancer_source_range_with_the_node_allows_the_node() -> None:
    plan = plan_of(
        lb(loadBalancerSourceRanges=["100.101.0.0/16", "203.0.113.7/32"]),
        endpoint_slice("svc1", [endpoint("10.180.0.1", "")], EP80),
    )
    assert plan.sets[n.LOAD_BALANCER_SOURCE_CIDR] == {
        "1.2.3.4,tcp:80,100.101.0.0/16",
        # ipset prints a /32 net without its prefix; kproxy plans it that way (no churn).
        "1.2.3.4,tcp:80,203.0.113.7",
    }
    assert plan.sets[n.LOAD_BALANCER_SOURCE_IP] == {"1.2.3.4,tcp:80,1.2.3.4"}
    assert not any("KUBE-IPVS-OUT-FILTER" in r for r in plan.filter_rules)


def test_accept_ipvs_traffic_for_cluster_ips_and_lb_ips() -> None:
    plan = plan_of(
        service("svc1", "10.20.30.40", P80),
        endpoint_slice("svc1", [endpoint("10.180.0.1", "")], EP80),
        lb("svc2"),
        endpoint_slice("svc2", [endpoint("10.180.0.2", "")], EP80),
    )
    accepts = [r for r in plan.nat_rules if r.endswith("-j ACCEPT")]
    assert accepts == [
        "-A KUBE-SERVICES -m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT",
        "-A KUBE-SERVICES -m set --match-set KUBE-LOAD-BALANCER dst,dst -j ACCEPT",
    ]


# --- ClusterIP, masquerade, hairpin, internal policy -------------------------------------------


def test_cluster_ip_masquerade_follows_the_local_detector() -> None:
    objects = (
        service("svc1", "10.20.30.41", P80),
        endpoint_slice("svc1", [endpoint("10.180.0.1", "")], EP80),
    )
    comment = '-m comment --comment "Kubernetes service cluster ip + port for masquerade purpose"'
    head = f"-A KUBE-SERVICES {comment} -m set --match-set KUBE-CLUSTER-IP"
    cidr = [r for r in plan_of(*objects).nat_rules if r.startswith(head)]
    assert cidr == [f"{head} dst,dst ! -s 10.0.0.0/8 -j KUBE-MARK-MASQ"]
    everything = plan_of(*objects, options=RuleOptions(masquerade_all=True)).nat_rules
    assert f"{head} dst,dst -j KUBE-MARK-MASQ" in everything
    # No detector: masquerade node traffic whose source is a VIP (src,dst).
    none = plan_of(*objects, options=RuleOptions()).nat_rules
    assert f"{head} src,dst -j KUBE-MARK-MASQ" in none


def test_local_endpoints_are_in_the_loop_back_set() -> None:
    plan = plan_of(
        service("svc1", "10.20.30.41", P80),
        endpoint_slice("svc1", [endpoint("10.180.0.1"), endpoint("10.180.0.2", "node2")], EP80),
    )
    assert plan.sets[n.LOOP_BACK] == {"10.180.0.1,tcp:80,10.180.0.1"}
    assert plan.nat_rules[1] == (
        '-A KUBE-POSTROUTING -m comment --comment "Kubernetes endpoints dst ip:port, source ip'
        ' for solving hairpin purpose" -m set --match-set KUBE-LOOP-BACK dst,dst,src -j MASQUERADE'
    )


def test_internal_policy_local_falls_back_to_nothing_without_local_endpoints() -> None:
    # ClusterIP-only service with internalTrafficPolicy Local: only local endpoints; none
    # local means no real servers (the cluster endpoints are not used for internal traffic).
    plan = plan_of(
        service("svc1", "10.20.30.41", P80, internalTrafficPolicy="Local"),
        endpoint_slice("svc1", [endpoint("10.180.0.2", "node2")], EP80),
    )
    assert dests(plan, "TCP", "10.20.30.41", 80) == []
    local = plan_of(
        service("svc1", "10.20.30.41", P80, internalTrafficPolicy="Local"),
        endpoint_slice("svc1", [endpoint("10.180.0.1"), endpoint("10.180.0.2", "node2")], EP80),
    )
    assert dests(local, "TCP", "10.20.30.41", 80) == [("10.180.0.1", 80)]


def test_external_policy_local_without_local_endpoints_uses_all_endpoints() -> None:
    # upstream PR #97081: pods on this node can still reach the service.
    plan = plan_of(
        service(
            "svc1",
            "10.20.30.41",
            [port("p80", 80, 80, nodePort=3001)],
            type="NodePort",
            externalTrafficPolicy="Local",
        ),
        endpoint_slice("svc1", [endpoint("10.180.1.1", "other-node")], EP80),
    )
    assert dests(plan, "TCP", NODE_IP, 3001) == [("10.180.1.1", 80)]


# --- scheduler, affinity, annotations -----------------------------------------------------------


def test_scheduler_from_config_and_mh_flag() -> None:
    objects = (service("svc1", "10.20.30.41", P80),)
    wrr = plan_of(*objects, options=RuleOptions(ipvs_scheduler="wrr"))
    assert wrr.virtual_servers[VSKey("TCP", "10.20.30.41", 80)].attributes == ("wrr", 0, 0)
    mh = plan_of(*objects, options=RuleOptions(ipvs_scheduler="mh"))
    assert mh.virtual_servers[VSKey("TCP", "10.20.30.41", 80)].attributes == ("mh", 0x10, 0)
    assert "-A -t 10.20.30.41:80 -s mh -b mh-port" in plan_ipvsadm(mh)


def test_client_ip_affinity_is_persistence_with_its_timeout() -> None:
    plan = plan_of(
        service(
            "svc1",
            "10.20.30.41",
            P80,
            sessionAffinity="ClientIP",
            sessionAffinityConfig={"clientIP": {"timeoutSeconds": 300}},
        )
    )
    vs = plan.virtual_servers[VSKey("TCP", "10.20.30.41", 80)]
    assert vs.attributes == ("rr", n.FLAG_PERSISTENT, 300)
    assert "-A -t 10.20.30.41:80 -s rr -p 300" in plan_ipvsadm(plan)


def annotated(**annotations: str) -> dict[str, Any]:
    svc = service("svc1", "10.20.30.41", P80)
    svc["metadata"]["annotations"] = annotations
    return svc


def test_scheduler_annotation_overrides_the_config() -> None:
    plan = plan_of(annotated(**{n.SCHEDULER_ANNOTATION: "sh"}), options=RuleOptions())
    assert plan.virtual_servers[VSKey("TCP", "10.20.30.41", 80)].scheduler == "sh"
    assert not plan.problems


def test_invalid_annotations_are_reported_and_ignored() -> None:
    plan = plan_of(
        annotated(**{n.SCHEDULER_ANNOTATION: "fastest", n.PERSISTENCE_ANNOTATION: "1h"}),
        options=RuleOptions(ipvs_scheduler="lc"),
    )
    assert plan.virtual_servers[VSKey("TCP", "10.20.30.41", 80)].attributes == ("lc", 0, 0)
    assert len(plan.problems) == 2
    assert (
        "service default/svc1: annotation ipvs.kproxy.io/scheduler='fastest'" in (plan.problems[1])
    )
    assert "ipvs.kproxy.io/persistence-timeout='1h' must be a whole number" in plan.problems[0]


@pytest.mark.parametrize("value", ["0", "86401", "-5", "٣"])
def test_persistence_annotation_range(value: str) -> None:
    plan = plan_of(annotated(**{n.PERSISTENCE_ANNOTATION: value}))
    assert plan.virtual_servers[VSKey("TCP", "10.20.30.41", 80)].flags == 0
    assert plan.problems


def test_persistence_annotation_sets_and_overrides_the_timeout() -> None:
    plain = plan_of(annotated(**{n.PERSISTENCE_ANNOTATION: "120"}))
    assert plain.virtual_servers[VSKey("TCP", "10.20.30.41", 80)].attributes == (
        "rr",
        n.FLAG_PERSISTENT,
        120,
    )
    svc = annotated(**{n.PERSISTENCE_ANNOTATION: "45"})
    svc["spec"]["sessionAffinity"] = "ClientIP"
    assert plan_of(svc).virtual_servers[VSKey("TCP", "10.20.30.41", 80)].timeout == 45


# --- node addresses, duplicates, caching ---------------------------------------------------------


def test_node_port_ips_follow_node_port_addresses() -> None:
    addrs = ("10.100.0.1", "192.168.5.5", "127.0.0.1", "fe80::1")
    assert node_port_ips(RuleOptions(), FACTS, addrs) == ("10.100.0.1", "192.168.5.5")
    picked = node_port_ips(RuleOptions(node_port_addresses=("192.168.0.0/16",)), FACTS, addrs)
    assert picked == ("192.168.5.5",)
    primary = node_port_ips(RuleOptions(node_port_addresses=("primary",)), FACTS, addrs)
    assert primary == (NODE_IP,)
    only_v6 = node_port_ips(RuleOptions(node_port_addresses=("2001:db8::/64",)), FACTS, addrs)
    assert only_v6 == ("10.100.0.1", "192.168.5.5")


def test_a_virtual_server_claimed_twice_goes_to_the_first_service() -> None:
    plan = plan_of(
        service("a", "10.20.30.41", P80, externalIPs=["50.60.70.81"]),
        service("b", "10.20.30.42", P80, externalIPs=["50.60.70.81"]),
    )
    key = VSKey("TCP", "50.60.70.81", 80)
    assert str(plan.owners[key]) == "default/a:p80"
    assert any("already programmed for default/a:p80" in p for p in plan.problems)


def test_unchanged_service_ports_reuse_their_block() -> None:
    snap = snapshot_from_objects(
        [node("node1"), service("svc1", "10.20.30.41", P80), service("svc2", "10.20.30.42", P80)],
        "node1",
    )
    planner = IpvsPlanner(FACTS, OPTIONS)
    first = planner.plan(snap)
    second = planner.plan(snap)
    for name, block in first.blocks.items():
        assert second.blocks[name] is block
    moved = planner.plan(snap, ("10.9.9.9",))  # new node addresses: NodePort IPs may change
    assert all(moved.blocks[k] is not b for k, b in first.blocks.items())


def test_set_net_normalises_like_ipset() -> None:
    assert set_net("10.0.0.5/8") == "10.0.0.0/8"
    assert set_net("10.1.2.3/32") == "10.1.2.3"


# --- render ---------------------------------------------------------------------------------------


def test_render_text_has_all_four_sections() -> None:
    snap = snapshot_from_objects(
        [
            node("node1"),
            service("web", "10.96.0.10", [port("http", 80, 8080, nodePort=30080)], type="NodePort"),
            endpoint_slice(
                "web", [endpoint("10.244.0.2"), endpoint("10.244.0.3")], [port("http", 8080)]
            ),
        ],
        "node1",
    )
    text = render_text(
        snap,
        NodeFacts(node_ips=("10.100.0.1",), local_addresses=("10.100.0.1",)),
        RuleOptions(cluster_cidrs=("10.244.0.0/16",)),
    )
    assert "-A -t 10.96.0.10:80 -s rr\n-a -t 10.96.0.10:80 -r 10.244.0.2:8080 -m -w 1\n" in text
    assert "-A -t 10.100.0.1:30080 -s rr\n" in text
    assert "# 10.96.0.10/32" in text
    assert (
        "create KUBE-NODE-PORT-TCP bitmap:port range 0-65535\nadd KUBE-NODE-PORT-TCP 30080" in text
    )
    assert "create KUBE-CLUSTER-IP hash:ip,port family inet hashsize 1024 maxelem 65536" in text
    assert "*nat\n:KUBE-SERVICES - [0:0]\n" in text and text.rstrip().endswith("COMMIT")
    assert (
        "-A KUBE-IPVS-FILTER -m conntrack --ctstate NEW"
        " -m set --match-set KUBE-IPVS-IPS dst -j REJECT" in text
    )
    assert "-A KUBE-POSTROUTING -j MASQUERADE --random-fully" not in text  # the comment comes first
    assert (
        '-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT"'
        " -j MASQUERADE --random-fully" in text
    )


def test_ipset_restore_lists_every_set_in_upstream_order() -> None:
    text = ipset_restore({s: set() for s in n.SET_NAMES} | {n.NODE_PORT_TCP: {"30080", "3001"}})
    creates = [line.split()[1] for line in text.splitlines() if line.startswith("create")]
    assert creates == list(n.SET_NAMES)
    adds = [line for line in text.splitlines() if line.startswith("add")]
    assert adds == ["add KUBE-NODE-PORT-TCP 3001", "add KUBE-NODE-PORT-TCP 30080"]


def test_iptables_text_declares_upstream_chains_nat_then_filter() -> None:
    text = plan_of(service("svc1", "10.20.30.41", P80)).iptables_text()
    lines = text.splitlines()
    assert lines[:6] == [
        "*nat",
        ":KUBE-SERVICES - [0:0]",
        ":KUBE-POSTROUTING - [0:0]",
        ":KUBE-NODE-PORT - [0:0]",
        ":KUBE-LOAD-BALANCER - [0:0]",
        ":KUBE-MARK-MASQ - [0:0]",
    ]
    f = lines.index("*filter")
    assert lines[f + 1 : f + 7] == [f":{c} - [0:0]" for c in n.FILTER_CHAINS]
    assert lines.count("COMMIT") == 2
    assert "-A KUBE-MARK-MASQ -j MARK --or-mark 0x00004000" in lines
    assert "-A KUBE-POSTROUTING -m mark ! --mark 0x00004000/0x00004000 -j RETURN" in lines
