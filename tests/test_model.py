"""The object model: Service / EndpointSlice / Node dicts -> the per-node Snapshot.

Checked against upstream kube-proxy (pkg/proxy: servicechangetracker.go, service.go,
endpointslicecache.go, topology.go, and the iptables proxier's use of CategorizeEndpoints).
Incremental ChangeTracker behaviour, rejections and fuzzing live in test_model_tracker.py.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kproxy.model.objects import (
    Endpoint,
    NodeInfo,
    Protocol,
    Rejection,
    ServicePort,
    ServicePortName,
    Snapshot,
)
from kproxy.model.parse import (
    DEFAULT_AFFINITY_TIMEOUT,
    IgnoredObject,
    parse_endpoint_slice,
    parse_service,
)
from kproxy.model.snapshot import categorize, snapshot_from_objects
from tests.support.model_objects import (
    NODE,
    ZONE_LABEL,
    addrs,
    endpoint,
    eport,
    eslice,
    node,
    one,
    service,
    spn,
    sport,
)


def snap(*objs: dict[str, Any], node_name: str = NODE) -> Snapshot:
    return snapshot_from_objects(list(objs), node_name)


# --- objects.py basics -----------------------------------------------------------------------


class TestServicePortName:
    def test_named_port(self) -> None:
        assert str(ServicePortName("ns1", "svc1", "p80")) == "ns1/svc1:p80"

    def test_unnamed_port_has_no_colon(self) -> None:
        assert str(ServicePortName("default", "foo")) == "default/foo"
        assert str(ServicePortName("default", "foo", "", Protocol.UDP)) == "default/foo"

    def test_service_property(self) -> None:
        assert ServicePortName("ns1", "svc1", "p80").service == "ns1/svc1"

    def test_protocol_is_part_of_identity_not_of_string(self) -> None:
        tcp = ServicePortName("ns", "dns", "dns", Protocol.TCP)
        udp = ServicePortName("ns", "dns", "dns", Protocol.UDP)
        assert tcp != udp
        assert str(tcp) == str(udp) == "ns/dns:dns"
        assert len({tcp, udp}) == 2

    def test_sorting_is_by_namespace_name_port(self) -> None:
        names = [
            ServicePortName("b", "a", "x"),
            ServicePortName("a", "z", "y"),
            ServicePortName("a", "z", "b"),
            ServicePortName("a", "b", ""),
        ]
        assert [str(n) for n in sorted(names)] == ["a/b", "a/z:b", "a/z:y", "b/a:x"]


class TestEndpointAddr:
    def test_ipv4(self) -> None:
        assert Endpoint("10.180.0.1", 80).addr == "10.180.0.1:80"

    def test_ipv6_gets_brackets_like_join_host_port(self) -> None:
        assert Endpoint("fd00::1", 8080).addr == "[fd00::1]:8080"

    def test_addr_follows_replace(self) -> None:
        ep = Endpoint("10.0.0.1", 80)
        assert dataclasses.replace(ep, port=81).addr == "10.0.0.1:81"
        assert dataclasses.replace(ep, ip="10.0.0.2").addr == "10.0.0.2:80"

    def test_addr_is_not_part_of_equality(self) -> None:
        assert Endpoint("10.0.0.1", 80) == Endpoint("10.0.0.1", 80)
        assert Endpoint("10.0.0.1", 80) != Endpoint("10.0.0.1", 81)

    def test_defaults_match_upstream_nil_conditions(self) -> None:
        ep = Endpoint("10.0.0.1", 80)
        assert (ep.ready, ep.serving, ep.terminating, ep.is_local) == (True, True, False, False)


class TestSmallRecords:
    def test_rejection_str_names_kind_namespace_name_and_field(self) -> None:
        rej = Rejection("Service", "ns", "web", "spec.ports[0].port", "bad")
        assert str(rej) == "Service ns/web: spec.ports[0].port: bad"

    def test_rejection_str_cluster_scoped(self) -> None:
        assert str(Rejection("Node", "", "n1", "status.addresses[0]", "x")) == (
            "Node n1: status.addresses[0]: x"
        )

    def test_node_zone(self) -> None:
        assert NodeInfo("n", labels=((ZONE_LABEL, "z1"), ("a", "b"))).zone == "z1"
        assert NodeInfo("n").zone == ""

    def test_annotation_lookup(self) -> None:
        sp = ServicePort(spn(), "10.0.0.1", 80, Protocol.TCP, annotations=(("a", "1"), ("b", "2")))
        assert sp.annotation("b") == "2"
        assert sp.annotation("c") == ""
        assert sp.annotation("c", "dflt") == "dflt"

    def test_sorted_ports(self) -> None:
        s = snap(
            service("b", cluster_ip="10.96.0.2"),
            service("a", cluster_ip="10.96.0.1", ports=[sport("z", 1), sport("m", 2)]),
        )
        assert [str(p.name) for p in s.sorted_ports()] == ["ns/a:m", "ns/a:z", "ns/b:http"]

    def test_snapshot_is_hashable(self) -> None:
        s = snap(service())
        assert hash(s) == hash(s)
        assert len({s, snap(service())}) == 2


# --- Services --------------------------------------------------------------------------------


class TestServiceParsing:
    def test_cluster_ip_with_several_ports_and_protocols(self) -> None:
        s = snap(
            service(
                ports=[
                    sport("http", 80, target=8080),
                    sport("dns", 53, protocol="UDP", target=5353),
                    sport("sctp", 9999, protocol="SCTP"),
                ]
            )
        )
        assert set(s.services) == {
            spn(port="http"),
            spn(port="dns", proto=Protocol.UDP),
            spn(port="sctp", proto=Protocol.SCTP),
        }
        dns = s.services[spn(port="dns", proto=Protocol.UDP)]
        assert (dns.cluster_ip, dns.port, dns.protocol, dns.target_port) == (
            "10.96.0.10",
            53,
            Protocol.UDP,
            5353,
        )
        sctp = s.services[spn(port="sctp", proto=Protocol.SCTP)]
        assert sctp.target_port == 9999  # unset targetPort defaults to the port
        assert sctp.node_port == 0 and not sctp.is_external

    def test_protocol_defaults_to_tcp(self) -> None:
        s = snap(service(ports=[sport("", 80, protocol=None)]))
        assert set(s.services) == {spn(port="")}

    def test_same_name_different_protocol_are_two_ports(self) -> None:
        s = snap(service(ports=[sport("dns", 53, protocol="UDP"), sport("dns", 53)]))
        assert set(s.services) == {spn(port="dns"), spn(port="dns", proto=Protocol.UDP)}

    def test_string_digit_target_port_is_a_number(self) -> None:
        parsed = parse_service(service(ports=[sport("", 80, target="8080")]))
        assert parsed.ports[0].target_port == 8080

    def test_named_target_port_kept_as_name(self) -> None:
        parsed = parse_service(service(ports=[sport("", 80, target="web")]))
        assert parsed.ports[0].target_port == "web"

    def test_long_port_name_is_valid(self) -> None:
        name = "grpc-web-metrics-port"  # 21 characters, a valid DNS-1123 label
        s = snap(service(ports=[sport(name, 80), sport("x" * 63, 81)]))
        assert set(s.services) == {spn(port=name), spn(port="x" * 63)}
        assert s.rejections == ()

    def test_port_name_longer_than_a_dns_label_is_invalid(self) -> None:
        s = snap(service(ports=[sport("x" * 64, 80)]))
        assert s.services == {}
        assert [r.field for r in s.rejections] == ["spec.ports[0].name"]

    def test_sloppy_ipv4_like_upstream(self) -> None:
        # ParseIPSloppy reads leading-zero octets as decimal.
        obj = service(
            cluster_ip="010.096.000.010",
            svc_type="LoadBalancer",
            spec={"externalIPs": ["203.0.113.005"], "loadBalancerSourceRanges": ["010.0.0.0/08"]},
            status={"loadBalancer": {"ingress": [{"ip": "198.51.100.001"}]}},
        )
        s = snap(obj, eslice("svc-1", endpoints=[endpoint("10.001.0.01")]))
        sp = one(s)
        assert sp.cluster_ip == "10.96.0.10"
        assert sp.external_ips == ("203.0.113.5",)
        assert sp.load_balancer_ips == ("198.51.100.1",)
        assert sp.load_balancer_source_ranges == ("10.0.0.0/8",)
        assert addrs(sp.endpoints) == ["10.1.0.1:8080"]

    @pytest.mark.parametrize(
        "mutate",
        [
            lambda o: o["spec"].update(clusterIP="\u0661\u0660.96.0.10"),
            lambda o: o["spec"].update(externalIPs=["203.0.113.\u0665"]),
            lambda o: o["spec"].update(
                type="LoadBalancer", loadBalancerSourceRanges=["10.0.0.0/\u0668"]
            ),
        ],
        ids=["clusterIP", "externalIP", "sourceRange"],
    )
    def test_non_ascii_digits_are_not_an_ip(self, mutate: Any) -> None:
        obj = service()
        mutate(obj)
        s = snap(obj)
        assert s.services == {}
        assert len(s.rejections) == 1

    def test_namespace_defaults_to_default(self) -> None:
        obj = service()
        del obj["metadata"]["namespace"]
        s = snap(obj)
        assert set(s.services) == {spn(ns="default")}

    def test_cluster_ip_is_normalised(self) -> None:
        assert one(snap(service(cluster_ip=" 10.96.0.10 "))).cluster_ip == "10.96.0.10"

    def test_annotations_are_carried(self) -> None:
        sp = one(snap(service(annotations={"x/y": "1"})))
        assert sp.annotation("x/y") == "1"

    @pytest.mark.parametrize(
        ("mutate", "why"),
        [
            (lambda o: o["spec"].update(clusterIP="None"), "headless"),
            (lambda o: o["spec"].update(clusterIP="", clusterIPs=["None"]), "headless"),
            (lambda o: o["spec"].pop("clusterIP"), "no clusterIP"),
            (lambda o: o["spec"].update(type="ExternalName", externalName="x.y"), "ExternalName"),
            (
                lambda o: o["metadata"].update(
                    labels={"service.kubernetes.io/service-proxy-name": "other"}
                ),
                "service-proxy-name",
            ),
            (
                lambda o: o["metadata"].update(labels={"service.kubernetes.io/headless": ""}),
                "headless",
            ),
            (lambda o: o["spec"].update(clusterIP="fd00::10"), "IPv6"),
            (
                lambda o: o["spec"].update(clusterIP="fd00::10", clusterIPs=["fd00::10"]),
                "IPv6",
            ),
        ],
    )
    def test_skipped_services(self, mutate: Any, why: str) -> None:
        obj = service()
        mutate(obj)
        with pytest.raises(IgnoredObject, match=why):
            parse_service(obj)
        s = snap(obj, service("other", cluster_ip="10.96.0.99"))
        assert set(s.services) == {spn("other")}
        assert s.rejections == ()  # skipped on purpose, not invalid

    def test_ipv6_service_ignored_with_a_log_line(self, caplog: pytest.LogCaptureFixture) -> None:
        with caplog.at_level(logging.INFO, logger="kproxy.model"):
            s = snap(service(name="v6", cluster_ip="fd00::10"))
        assert s.services == {}
        lines = [r.getMessage() for r in caplog.records if "ns/v6" in r.getMessage()]
        assert len(lines) == 1 and "IPv6" in lines[0]

    def test_dual_stack_ipv6_primary_uses_the_ipv4_cluster_ip(self) -> None:
        obj = service(cluster_ip="fd00::10", spec={"clusterIPs": ["fd00::10", "10.96.0.20"]})
        assert one(snap(obj)).cluster_ip == "10.96.0.20"

    def test_node_port(self) -> None:
        sp = one(snap(service(svc_type="NodePort", ports=[sport("http", 80, node_port=30080)])))
        assert sp.node_port == 30080 and sp.is_external

    def test_node_port_ignored_on_cluster_ip_type(self) -> None:
        sp = one(snap(service(ports=[sport("http", 80, node_port=30080)])))
        assert sp.node_port == 0 and not sp.is_external

    def test_external_ips_ipv4_only(self) -> None:
        obj = service(spec={"externalIPs": ["203.0.113.5", "2001:db8::5", "203.0.113.6"]})
        sp = one(snap(obj))
        assert sp.external_ips == ("203.0.113.5", "203.0.113.6")
        assert sp.is_external

    def test_load_balancer(self) -> None:
        obj = service(
            svc_type="LoadBalancer",
            ports=[sport("http", 80, node_port=30080)],
            spec={"loadBalancerSourceRanges": ["192.168.0.0/16", " 10.1.2.3/8 ", "2001:db8::/32"]},
            status={
                "loadBalancer": {
                    "ingress": [
                        {"ip": "198.51.100.1"},
                        {"ip": "198.51.100.2", "ipMode": "Proxy"},
                        {"ip": "198.51.100.3", "ipMode": "VIP"},
                        {"hostname": "lb.example.com"},
                        {"ip": "2001:db8::1"},
                    ]
                }
            },
        )
        sp = one(snap(obj))
        assert sp.load_balancer_ips == ("198.51.100.1", "198.51.100.3")
        # CIDRs are masked like Go's ParseCIDR; the other family is dropped.
        assert sp.load_balancer_source_ranges == ("192.168.0.0/16", "10.0.0.0/8")
        assert sp.node_port == 30080
        assert sp.health_check_node_port == 0  # only for externalTrafficPolicy Local

    def test_load_balancer_without_node_ports(self) -> None:
        obj = service(
            svc_type="LoadBalancer",
            spec={"allocateLoadBalancerNodePorts": False},
            status={"loadBalancer": {"ingress": [{"ip": "198.51.100.1"}]}},
        )
        sp = one(snap(obj))
        assert sp.node_port == 0 and sp.load_balancer_ips == ("198.51.100.1",) and sp.is_external

    def test_health_check_node_port_for_local_load_balancer(self) -> None:
        obj = service(
            svc_type="LoadBalancer",
            ports=[sport("http", 80, node_port=30080)],
            spec={"externalTrafficPolicy": "Local", "healthCheckNodePort": 32000},
        )
        sp = one(snap(obj))
        assert sp.health_check_node_port == 32000 and sp.external_policy_local

    def test_health_check_node_port_not_for_node_port_type(self) -> None:
        obj = service(
            svc_type="NodePort",
            ports=[sport("http", 80, node_port=30080)],
            spec={"externalTrafficPolicy": "Local", "healthCheckNodePort": 32000},
        )
        sp = one(snap(obj))
        assert sp.health_check_node_port == 0 and sp.external_policy_local

    def test_source_ranges_only_for_load_balancers(self) -> None:
        obj = service(svc_type="NodePort", spec={"loadBalancerSourceRanges": ["10.0.0.0/8"]})
        assert one(snap(obj)).load_balancer_source_ranges == ()

    def test_session_affinity_client_ip_default_timeout(self) -> None:
        sp = one(snap(service(spec={"sessionAffinity": "ClientIP"})))
        assert sp.affinity_timeout == DEFAULT_AFFINITY_TIMEOUT == 10800

    @pytest.mark.parametrize("timeout", [1, 60, 86400])
    def test_session_affinity_client_ip_timeout(self, timeout: int) -> None:
        cfg = {"clientIP": {"timeoutSeconds": timeout}}
        obj = service(spec={"sessionAffinity": "ClientIP", "sessionAffinityConfig": cfg})
        assert one(snap(obj)).affinity_timeout == timeout

    def test_session_affinity_none(self) -> None:
        assert one(snap(service(spec={"sessionAffinity": "None"}))).affinity_timeout is None
        assert one(snap(service())).affinity_timeout is None

    def test_timeout_ignored_without_client_ip_affinity(self) -> None:
        cfg = {"clientIP": {"timeoutSeconds": 60}}
        assert one(snap(service(spec={"sessionAffinityConfig": cfg}))).affinity_timeout is None

    @pytest.mark.parametrize(
        ("svc_type", "extra", "expect"),
        [
            ("NodePort", {}, True),
            ("LoadBalancer", {}, True),
            ("ClusterIP", {}, False),  # not externally accessible: ETP does not apply
            # Upstream's ExternallyAccessible counts ClusterIP services with externalIPs.
            ("ClusterIP", {"externalIPs": ["203.0.113.5"]}, True),
        ],
    )
    def test_external_traffic_policy_local(
        self, svc_type: str, extra: dict[str, Any], expect: bool
    ) -> None:
        obj = service(
            svc_type=svc_type,
            ports=[sport("http", 80, node_port=30080 if svc_type != "ClusterIP" else None)],
            spec={"externalTrafficPolicy": "Local", **extra},
        )
        assert one(snap(obj)).external_policy_local is expect

    def test_internal_traffic_policy_local(self) -> None:
        sp = one(snap(service(spec={"internalTrafficPolicy": "Local"})))
        assert sp.internal_policy_local and not sp.external_policy_local
        cluster = one(snap(service(spec={"internalTrafficPolicy": "Cluster"})))
        assert not cluster.internal_policy_local


# --- EndpointSlices --------------------------------------------------------------------------


class TestEndpointSlices:
    def test_named_target_port_resolved_through_slice_port_name(self) -> None:
        s = snap(
            service(ports=[sport("http", 80, target="web"), sport("metrics", 9090, target="m")]),
            eslice(
                "svc-1",
                ports=[eport("http", 8080), eport("metrics", 9100)],
                endpoints=[endpoint("10.1.0.1"), endpoint("10.1.0.2")],
            ),
        )
        assert addrs(one(s).endpoints) == ["10.1.0.1:8080", "10.1.0.2:8080"]
        assert addrs(s.services[spn(port="metrics")].endpoints) == [
            "10.1.0.1:9100",
            "10.1.0.2:9100",
        ]

    def test_slice_port_number_wins_over_numeric_target_port(self) -> None:
        # kube-proxy never reads targetPort: the slice's port (matched by name) is used.
        s = snap(
            service(ports=[sport("http", 80, target=1234)]),
            eslice("svc-1", ports=[eport("http", 8080)], endpoints=[endpoint("10.1.0.1")]),
        )
        assert addrs(one(s).endpoints) == ["10.1.0.1:8080"]

    def test_unnamed_port(self) -> None:
        s = snap(
            service(ports=[sport(None, 80, target=8080)]),
            eslice("svc-1", ports=[eport("", 8080)], endpoints=[endpoint("10.1.0.1")]),
        )
        assert addrs(s.services[spn(port="")].endpoints) == ["10.1.0.1:8080"]

    def test_slice_port_must_match_name_and_protocol(self) -> None:
        s = snap(
            service(ports=[sport("dns", 53, protocol="UDP"), sport("dns-tcp", 53)]),
            eslice(
                "svc-1",
                ports=[eport("dns", 5353, "UDP"), eport("dns-tcp", 5354, "TCP"), eport("x", 1)],
                endpoints=[endpoint("10.1.0.1")],
            ),
            eslice(
                "svc-2",
                ports=[eport("dns", 6000, "TCP"), eport("other", 7000)],
                endpoints=[endpoint("10.1.0.9")],
            ),
        )
        assert addrs(s.services[spn(port="dns", proto=Protocol.UDP)].endpoints) == ["10.1.0.1:5353"]
        assert addrs(s.services[spn(port="dns-tcp")].endpoints) == ["10.1.0.1:5354"]

    def test_slice_port_without_number_carries_nothing(self) -> None:
        s = snap(
            service(),
            eslice("svc-1", ports=[eport("http", None)], endpoints=[endpoint("10.1.0.1")]),
        )
        assert one(s).endpoints == () and s.rejections == ()

    def test_slice_for_unknown_service_is_harmless(self) -> None:
        s = snap(service(), eslice("x-1", "nope", endpoints=[endpoint("10.1.0.1")]))
        assert one(s).endpoints == () and s.rejections == ()

    def test_slice_in_other_namespace_does_not_match(self) -> None:
        s = snap(service(), eslice("svc-1", ns="other", endpoints=[endpoint("10.1.0.1")]))
        assert one(s).endpoints == ()

    def test_conditions_default_like_upstream(self) -> None:
        s = snap(service(), eslice("svc-1", endpoints=[endpoint("10.1.0.1")]))
        (ep,) = one(s).endpoints
        assert (ep.ready, ep.serving, ep.terminating) == (True, True, False)

    def test_explicit_conditions(self) -> None:
        s = snap(
            service(),
            eslice(
                "svc-1",
                endpoints=[
                    endpoint("10.1.0.1", ready=False, serving=True, terminating=True),
                    endpoint("10.1.0.2", ready=False, serving=False, terminating=False),
                ],
            ),
        )
        a, b = one(s).endpoints
        assert (a.ready, a.serving, a.terminating) == (False, True, True)
        assert (b.ready, b.serving, b.terminating) == (False, False, False)

    def test_node_name_sets_is_local(self) -> None:
        s = snap(
            service(),
            eslice(
                "svc-1",
                endpoints=[
                    endpoint("10.1.0.1", node=NODE, zone="z1"),
                    endpoint("10.1.0.2", node="node-b"),
                    endpoint("10.1.0.3"),
                ],
            ),
        )
        a, b, c = one(s).endpoints
        assert (a.is_local, b.is_local, c.is_local) == (True, False, False)
        assert (a.node_name, a.zone, b.node_name, c.node_name) == (NODE, "z1", "node-b", "")

    def test_nothing_is_local_without_a_node_name(self) -> None:
        obj = eslice("svc-1", endpoints=[endpoint("10.1.0.1", node="")])
        s = snap(service(), obj, node_name="")
        assert not one(s).endpoints[0].is_local

    def test_only_first_address_is_used(self) -> None:
        ep = endpoint("10.1.0.1")
        ep["addresses"].append("10.1.0.2")
        s = snap(service(), eslice("svc-1", endpoints=[ep]))
        assert addrs(one(s).endpoints) == ["10.1.0.1:8080"]

    def test_several_slices_merged_and_sorted_by_ip_port_string(self) -> None:
        s = snap(
            service(),
            eslice("svc-b", endpoints=[endpoint("10.1.0.10"), endpoint("10.1.0.2")]),
            eslice("svc-a", endpoints=[endpoint("10.1.0.9"), endpoint("10.1.0.100")]),
        )
        # byEndpoint: lexicographic on "ip:port", not numeric.
        assert addrs(one(s).endpoints) == [
            "10.1.0.100:8080",
            "10.1.0.10:8080",
            "10.1.0.2:8080",
            "10.1.0.9:8080",
        ]

    def test_same_ip_different_slice_ports_are_different_endpoints(self) -> None:
        s = snap(
            service(),
            eslice("svc-a", ports=[eport("http", 8080)], endpoints=[endpoint("10.1.0.1")]),
            eslice("svc-b", ports=[eport("http", 8081)], endpoints=[endpoint("10.1.0.1")]),
        )
        assert addrs(one(s).endpoints) == ["10.1.0.1:8080", "10.1.0.1:8081"]

    @pytest.mark.parametrize("terminating_slice", ["svc-a", "svc-b"])
    def test_duplicate_endpoint_non_terminating_copy_wins(self, terminating_slice: str) -> None:
        # Upstream addEndpoints: a later copy replaces an earlier one unless it is terminating,
        # so the non-terminating copy wins whatever the slice order.
        other = "svc-b" if terminating_slice == "svc-a" else "svc-a"
        s = snap(
            service(),
            eslice(
                terminating_slice,
                endpoints=[endpoint("10.1.0.1", ready=False, serving=True, terminating=True)],
            ),
            eslice(other, endpoints=[endpoint("10.1.0.1", node=NODE)]),
        )
        (ep,) = one(s).endpoints
        assert ep.ready and not ep.terminating and ep.is_local

    def test_duplicate_identical_endpoints_collapse(self) -> None:
        s = snap(
            service(),
            eslice("svc-a", endpoints=[endpoint("10.1.0.1"), endpoint("10.1.0.1")]),
            eslice("svc-b", endpoints=[endpoint("10.1.0.1")]),
        )
        assert addrs(one(s).endpoints) == ["10.1.0.1:8080"]

    def test_ipv6_slice_ignored_with_a_log_line(self, caplog: pytest.LogCaptureFixture) -> None:
        with caplog.at_level(logging.INFO, logger="kproxy.model"):
            s = snap(
                service(),
                eslice("svc-v6", address_type="IPv6", endpoints=[endpoint("fd00::1")]),
                eslice("svc-v4", endpoints=[endpoint("10.1.0.1")]),
            )
        assert addrs(one(s).endpoints) == ["10.1.0.1:8080"]
        assert s.rejections == ()
        lines = [r.getMessage() for r in caplog.records if "svc-v6" in r.getMessage()]
        assert len(lines) == 1 and "IPv6" in lines[0]

    def test_fqdn_slice_ignored(self) -> None:
        obj = eslice("svc-f", address_type="FQDN", endpoints=[endpoint("example.com")])
        with pytest.raises(IgnoredObject):
            parse_endpoint_slice(obj)
        s = snap(service(), obj)
        assert one(s).endpoints == () and s.rejections == ()

    def test_endpoint_address_normalised(self) -> None:
        s = snap(service(), eslice("svc-1", endpoints=[endpoint(" 10.1.0.1")]))
        assert addrs(one(s).endpoints) == ["10.1.0.1:8080"]

    def test_trigger_times_newest_per_service(self) -> None:
        key = "endpoints.kubernetes.io/last-change-trigger-time"
        s = snap(
            service(),
            eslice("svc-a", endpoints=[], annotations={key: "2024-01-01T00:00:00Z"}),
            eslice("svc-b", endpoints=[], annotations={key: "2024-01-01T00:00:10Z"}),
            eslice("svc-c", endpoints=[], annotations={key: "not a time"}),
            eslice("x-1", "x", endpoints=[], annotations={key: "2024-01-01T00:00:05+00:00"}),
        )
        assert s.trigger_times == {"ns/svc": 1704067210.0, "ns/x": 1704067205.0}
        assert s.rejections == ()


# --- topology ----------------------------------------------------------------------------------


def _zone_objects(node_zone: str | None, *eps: dict[str, Any]) -> Snapshot:
    return snap(node(zone=node_zone), service(), eslice("svc-1", endpoints=list(eps)))


class TestTopologyHints:
    def test_hints_filter_cluster_endpoints_to_the_node_zone(self) -> None:
        s = _zone_objects(
            "z1",
            endpoint("10.1.0.1", zones=["z1"]),
            endpoint("10.1.0.2", zones=["z2"]),
            endpoint("10.1.0.3", zones=["z1", "z3"]),
        )
        sp = one(s)
        assert addrs(sp.cluster_endpoints) == ["10.1.0.1:8080", "10.1.0.3:8080"]
        assert addrs(sp.reachable_endpoints) == ["10.1.0.1:8080", "10.1.0.3:8080"]
        assert len(sp.endpoints) == 3 and sp.any_endpoints

    def test_ignored_if_a_ready_endpoint_lacks_hints(self) -> None:
        s = _zone_objects("z1", endpoint("10.1.0.1", zones=["z1"]), endpoint("10.1.0.2"))
        assert len(one(s).cluster_endpoints) == 2

    def test_unready_endpoint_without_hints_does_not_disable_them(self) -> None:
        s = _zone_objects(
            "z1",
            endpoint("10.1.0.1", zones=["z1"]),
            endpoint("10.1.0.2", zones=["z2"]),
            endpoint("10.1.0.3", ready=False, serving=False),
        )
        assert addrs(one(s).cluster_endpoints) == ["10.1.0.1:8080"]

    def test_ignored_if_no_endpoint_is_hinted_for_this_zone(self) -> None:
        s = _zone_objects(
            "z9", endpoint("10.1.0.1", zones=["z1"]), endpoint("10.1.0.2", zones=["z2"])
        )
        assert len(one(s).cluster_endpoints) == 2

    def test_ignored_if_node_has_no_zone_label(self) -> None:
        s = _zone_objects(
            None, endpoint("10.1.0.1", zones=["z1"]), endpoint("10.1.0.2", zones=["z2"])
        )
        assert len(one(s).cluster_endpoints) == 2

    def test_ignored_without_node_object(self) -> None:
        s = snap(
            service(),
            eslice(
                "svc-1",
                endpoints=[endpoint("10.1.0.1", zones=["z1"]), endpoint("10.1.0.2", zones=["z2"])],
            ),
        )
        assert len(one(s).cluster_endpoints) == 2

    def test_local_endpoints_ignore_hints(self) -> None:
        s = snap(
            node(zone="z1"),
            service(spec={"internalTrafficPolicy": "Local"}),
            eslice(
                "svc-1",
                endpoints=[
                    endpoint("10.1.0.1", node=NODE, zones=["z2"]),
                    endpoint("10.1.0.2", zones=["z1"]),
                ],
            ),
        )
        assert addrs(one(s).local_endpoints) == ["10.1.0.1:8080"]

    def test_serving_terminating_fallback_ignores_topology(self) -> None:
        s = _zone_objects(
            "z1",
            endpoint("10.1.0.1", ready=False, terminating=True, zones=["z2"]),
            endpoint("10.1.0.2", ready=False, terminating=True, zones=["z1"]),
        )
        assert len(one(s).cluster_endpoints) == 2

    def test_reachable_includes_local_endpoint_filtered_by_topology(self) -> None:
        # ETP Local: the local endpoint is hinted elsewhere, so it is not a Cluster endpoint,
        # but Local traffic still reaches it: allReachable is the union.
        s = snap(
            node(zone="z1"),
            service(
                svc_type="NodePort",
                ports=[sport("http", 80, node_port=30080)],
                spec={"externalTrafficPolicy": "Local"},
            ),
            eslice(
                "svc-1",
                endpoints=[
                    endpoint("10.1.0.1", node=NODE, zones=["z2"]),
                    endpoint("10.1.0.2", zones=["z1"]),
                ],
            ),
        )
        sp = one(s)
        assert addrs(sp.cluster_endpoints) == ["10.1.0.2:8080"]
        assert addrs(sp.local_endpoints) == ["10.1.0.1:8080"]
        assert addrs(sp.reachable_endpoints) == ["10.1.0.1:8080", "10.1.0.2:8080"]

    def test_prefer_same_node_hints(self) -> None:
        s = snap(
            node(zone="z1"),
            service(),
            eslice(
                "svc-1",
                endpoints=[
                    endpoint("10.1.0.1", node=NODE, zones=["z1"], nodes=[NODE]),
                    endpoint("10.1.0.2", node="node-b", zones=["z1"], nodes=["node-b"]),
                    endpoint("10.1.0.3", node="node-c", zones=["z2"], nodes=["node-c"]),
                ],
            ),
        )
        # Every ready endpoint has a node hint and one is for this node: PreferSameNode.
        assert addrs(one(s).cluster_endpoints) == ["10.1.0.1:8080"]

    def test_node_hints_without_one_for_this_node_fall_back_to_zone(self) -> None:
        # Holds with and without PreferSameNode support.
        s = snap(
            node(zone="z1"),
            service(),
            eslice(
                "svc-1",
                endpoints=[
                    endpoint("10.1.0.2", zones=["z1"], nodes=["node-b"]),
                    endpoint("10.1.0.3", zones=["z2"], nodes=["node-c"]),
                ],
            ),
        )
        assert addrs(one(s).cluster_endpoints) == ["10.1.0.2:8080"]


# --- ServicePort helpers and categorisation ---------------------------------------------------


def port_with(**kw: Any) -> ServicePort:
    return ServicePort(name=spn(), cluster_ip="10.96.0.10", port=80, protocol=Protocol.TCP, **kw)


def ep(ip: str, **kw: Any) -> Endpoint:
    return Endpoint(ip=ip, port=8080, **kw)


LOCAL_READY = ep("10.1.0.1", is_local=True, node_name=NODE)
REMOTE_READY = ep("10.1.0.2", node_name="node-b")
LOCAL_ST = ep("10.1.0.3", is_local=True, node_name=NODE, ready=False, terminating=True)
REMOTE_ST = ep("10.1.0.4", ready=False, terminating=True)
REMOTE_DEAD = ep("10.1.0.5", ready=False, serving=False, terminating=True)
LOCAL_UNREADY = ep("10.1.0.6", is_local=True, ready=False, serving=False)
# Not ready, serving, but not terminating: upstream uses it for neither policy.
REMOTE_SERVING_ONLY = ep("10.1.0.7", ready=False, serving=True, terminating=False)


def categorized(*eps: Endpoint, **kw: Any) -> ServicePort:
    return categorize(
        port_with(endpoints=tuple(sorted(eps, key=lambda e: e.addr)), **kw), NodeInfo(NODE)
    )


class TestUsesEndpoints:
    # (ITP Local, ETP Local, node port) -> (UsesClusterEndpoints, UsesLocalEndpoints)
    @pytest.mark.parametrize(
        ("itp", "etp", "node_port", "cluster", "local"),
        [
            (False, False, 0, True, False),
            (True, False, 0, False, True),
            (True, False, 30080, True, True),  # external traffic needs cluster endpoints
            (False, True, 30080, True, True),
            (True, True, 30080, True, True),
            (False, True, 0, True, False),  # ETP Local but nothing external (no LB IP yet)
        ],
    )
    def test_table(self, itp: bool, etp: bool, node_port: int, cluster: bool, local: bool) -> None:
        sp = port_with(internal_policy_local=itp, external_policy_local=etp, node_port=node_port)
        assert (sp.uses_cluster_endpoints, sp.uses_local_endpoints) == (cluster, local)

    @pytest.mark.parametrize(
        "kw",
        [
            {"node_port": 30080},
            {"external_ips": ("203.0.113.5",)},
            {"load_balancer_ips": ("198.51.100.1",)},
        ],
    )
    def test_every_external_destination_counts(self, kw: dict[str, Any]) -> None:
        sp = port_with(internal_policy_local=True, external_policy_local=True, **kw)
        assert sp.is_external and sp.uses_cluster_endpoints and sp.uses_local_endpoints


class TestCategorize:
    def test_cluster_policy_uses_ready_endpoints(self) -> None:
        sp = categorized(LOCAL_READY, REMOTE_READY, REMOTE_ST, REMOTE_DEAD, REMOTE_SERVING_ONLY)
        assert sp.cluster_endpoints == (LOCAL_READY, REMOTE_READY)
        assert sp.local_endpoints == ()
        assert sp.reachable_endpoints == sp.cluster_endpoints
        assert sp.any_endpoints and sp.has_internal_endpoints and sp.has_external_endpoints
        assert sp.internal_endpoints == sp.external_endpoints == sp.cluster_endpoints

    def test_cluster_falls_back_to_serving_terminating(self) -> None:
        sp = categorized(REMOTE_ST, LOCAL_ST, REMOTE_DEAD, LOCAL_UNREADY)
        assert sp.cluster_endpoints == (LOCAL_ST, REMOTE_ST)
        assert sp.any_endpoints and sp.has_internal_endpoints

    def test_no_usable_endpoints(self) -> None:
        sp = categorized(REMOTE_DEAD, LOCAL_UNREADY, REMOTE_SERVING_ONLY)
        assert sp.cluster_endpoints == sp.local_endpoints == sp.reachable_endpoints == ()
        assert not sp.any_endpoints
        assert not sp.has_internal_endpoints and not sp.has_external_endpoints

    def test_no_endpoints_at_all(self) -> None:
        sp = categorized()
        assert not sp.any_endpoints and not sp.has_internal_endpoints

    def test_internal_local_uses_local_ready(self) -> None:
        sp = categorized(LOCAL_READY, REMOTE_READY, LOCAL_ST, internal_policy_local=True)
        assert sp.local_endpoints == (LOCAL_READY,)  # ready wins over serving-terminating
        assert sp.cluster_endpoints == ()  # not computed: Cluster policy never used
        assert sp.reachable_endpoints == (LOCAL_READY,)
        assert sp.internal_endpoints == (LOCAL_READY,)
        assert sp.has_internal_endpoints

    def test_internal_local_falls_back_to_local_serving_terminating(self) -> None:
        sp = categorized(REMOTE_READY, LOCAL_ST, LOCAL_UNREADY, internal_policy_local=True)
        assert sp.local_endpoints == (LOCAL_ST,)
        assert sp.has_internal_endpoints

    def test_internal_local_without_local_endpoints_has_none(self) -> None:
        # iptables: "has no local endpoints" -> DROP, even though endpoints exist elsewhere.
        sp = categorized(REMOTE_READY, REMOTE_ST, internal_policy_local=True)
        assert sp.local_endpoints == () and sp.reachable_endpoints == ()
        assert sp.any_endpoints  # hasAnyEndpoints counts remote ones too
        assert not sp.has_internal_endpoints

    def test_external_local_has_both_lists(self) -> None:
        sp = categorized(LOCAL_READY, REMOTE_READY, external_policy_local=True, node_port=30080)
        assert sp.cluster_endpoints == (LOCAL_READY, REMOTE_READY)
        assert sp.local_endpoints == (LOCAL_READY,)
        assert sp.reachable_endpoints == (LOCAL_READY, REMOTE_READY)
        assert sp.internal_endpoints == sp.cluster_endpoints
        assert sp.external_endpoints == (LOCAL_READY,)
        assert sp.has_internal_endpoints and sp.has_external_endpoints

    def test_external_local_falls_back_independently(self) -> None:
        # Cluster policy has ready endpoints; Local policy falls back to the local
        # serving-terminating one: the union is reachable.
        sp = categorized(REMOTE_READY, LOCAL_ST, external_policy_local=True, node_port=30080)
        assert sp.cluster_endpoints == (REMOTE_READY,)
        assert sp.local_endpoints == (LOCAL_ST,)
        assert sp.reachable_endpoints == (REMOTE_READY, LOCAL_ST)
        assert sp.has_external_endpoints and sp.has_internal_endpoints

    def test_external_local_without_local_endpoints(self) -> None:
        sp = categorized(REMOTE_READY, external_policy_local=True, node_port=30080)
        assert sp.has_internal_endpoints and not sp.has_external_endpoints
        assert sp.external_endpoints == ()

    def test_both_policies_local_with_external(self) -> None:
        sp = categorized(
            REMOTE_READY,
            internal_policy_local=True,
            external_policy_local=True,
            node_port=30080,
        )
        # Cluster endpoints are still computed (external traffic from pods short-circuits).
        assert sp.cluster_endpoints == (REMOTE_READY,)
        assert not sp.has_internal_endpoints and not sp.has_external_endpoints


# Reference model written from upstream's description (topology.go CategorizeEndpoints and
# the iptables proxier's hasEndpoints / hasInternalEndpoints / hasExternalEndpoints).


def _st(e: Endpoint) -> bool:
    return e.serving and e.terminating


def reference_categorize(
    eps: list[Endpoint], *, uses_cluster: bool, uses_local: bool, zone: str
) -> tuple[set[str], set[str], set[str], bool]:
    cluster: set[str] = set()
    local: set[str] = set()
    if uses_cluster:
        ready = [e for e in eps if e.ready]
        topology = (
            bool(ready)
            and all(e.zone_hints for e in ready)
            and any(zone in e.zone_hints for e in ready)
        )
        cluster = {e.addr for e in ready if not topology or zone in e.zone_hints}
        if not cluster:
            cluster = {e.addr for e in eps if _st(e)}
    if uses_local:
        local = {e.addr for e in eps if e.is_local and e.ready}
        if not local:
            local = {e.addr for e in eps if e.is_local and _st(e)}
    any_eps = any(e.ready or _st(e) for e in eps)
    return cluster, local, cluster | local, any_eps


@st.composite
def endpoint_sets(draw: st.DrawFn) -> list[Endpoint]:
    n = draw(st.integers(0, 8))
    ips = draw(st.lists(st.integers(1, 40), min_size=n, max_size=n, unique=True))
    out = []
    for i in ips:
        out.append(
            Endpoint(
                ip=f"10.1.{i // 10}.{i}",
                port=draw(st.sampled_from([80, 8080])),
                ready=draw(st.booleans()),
                serving=draw(st.booleans()),
                terminating=draw(st.booleans()),
                is_local=draw(st.booleans()),
                zone_hints=frozenset(draw(st.sets(st.sampled_from(["z1", "z2", "z3"])))),
            )
        )
    return sorted(out, key=lambda e: e.addr)


@settings(max_examples=400, deadline=None)
@given(
    eps=endpoint_sets(),
    itp=st.booleans(),
    etp=st.booleans(),
    external=st.sampled_from(["", "node_port", "external_ips", "load_balancer_ips"]),
    zone=st.sampled_from(["", "z1", "z2"]),
)
def test_categorize_matches_upstream_model(
    eps: list[Endpoint], itp: bool, etp: bool, external: str, zone: str
) -> None:
    kw: dict[str, Any] = {}
    if external == "node_port":
        kw["node_port"] = 30080
    elif external:
        kw[external] = ("203.0.113.5",)
    sp = port_with(endpoints=tuple(eps), internal_policy_local=itp, external_policy_local=etp, **kw)
    labels = ((ZONE_LABEL, zone),) if zone else ()
    got = categorize(sp, NodeInfo(NODE, labels=labels))
    cluster, local, reachable, any_eps = reference_categorize(
        eps, uses_cluster=sp.uses_cluster_endpoints, uses_local=sp.uses_local_endpoints, zone=zone
    )
    assert set(addrs(got.cluster_endpoints)) == cluster
    assert set(addrs(got.local_endpoints)) == local
    assert set(addrs(got.reachable_endpoints)) == reachable
    assert got.any_endpoints is any_eps
    # Lists keep upstream's byEndpoint order and have no duplicates.
    for lst in (got.cluster_endpoints, got.local_endpoints, got.reachable_endpoints):
        assert addrs(lst) == sorted(set(addrs(lst)))
    # iptables proxier: hasInternalEndpoints / hasExternalEndpoints.
    assert got.has_internal_endpoints is (bool(local) if itp else any_eps)
    assert got.has_external_endpoints is (bool(local) if etp else any_eps)
    # Every reachable endpoint is a usable one; local ones are local.
    assert all(e.ready or _st(e) for e in got.reachable_endpoints)
    assert all(e.is_local for e in got.local_endpoints)
    # Categorising is idempotent and leaves the service fields alone.
    assert categorize(got, NodeInfo(NODE, labels=labels)) == got
    assert got.endpoints == sp.endpoints and got.name == sp.name
