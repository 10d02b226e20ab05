"""The ChangeTracker: incremental snapshots, rejections of bad objects, and fuzzing.

Builders come from tests/support/model_objects.py. Bad objects must be skipped with one log
line naming kind, namespace/name and field, be counted, and never disturb other services.
"""

from __future__ import annotations

import copy
import logging
import string
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kproxy.model import snapshot as snapshot_mod
from kproxy.model.objects import ChangeLog, Lineage, Protocol, ServicePort, Snapshot
from kproxy.model.parse import (
    IgnoredObject,
    InvalidObject,
    parse_endpoint_slice,
    parse_node,
    parse_service,
)
from kproxy.model.snapshot import ChangeTracker, snapshot_from_objects
from kproxy.sources.base import ENDPOINT_SLICE, NODE, SERVICE, ObjectEvent, ObjectKey
from tests.support.model_objects import (
    NODE as NODE_NAME,
)
from tests.support.model_objects import (
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

LOGGER = "kproxy.model"


def key_of(obj: dict[str, Any]) -> ObjectKey:
    kind = obj["kind"]
    meta = obj["metadata"]
    ns = "" if kind == NODE else meta.get("namespace") or "default"
    return ObjectKey(kind, ns, meta["name"])


def put(tracker: ChangeTracker, *objs: dict[str, Any]) -> bool:
    return tracker.apply([ObjectEvent(key_of(o), copy.deepcopy(o)) for o in objs])


def delete(tracker: ChangeTracker, kind: str, name: str, ns: str = "ns") -> bool:
    return tracker.apply([ObjectEvent(ObjectKey(kind, "" if kind == NODE else ns, name), None)])


def two_services() -> list[dict[str, Any]]:
    return [
        service("a", cluster_ip="10.96.0.1"),
        eslice("a-1", "a", endpoints=[endpoint("10.1.0.1")]),
        service("b", cluster_ip="10.96.0.2"),
        eslice("b-1", "b", endpoints=[endpoint("10.2.0.1")]),
    ]


@pytest.fixture
def tracker() -> ChangeTracker:
    return ChangeTracker(NODE_NAME)


@pytest.fixture
def rebuilt(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names ("ns/name") of the services build_service_ports is called for."""
    calls: list[str] = []
    real = snapshot_mod.build_service_ports

    def spy(svc: Any, slices: Any, node_info: Any) -> tuple[ServicePort, ...]:
        calls.append(f"{svc.namespace}/{svc.name}")
        return real(svc, slices, node_info)

    monkeypatch.setattr(snapshot_mod, "build_service_ports", spy)
    return calls


# --- incremental behaviour -----------------------------------------------------------------


class TestIncremental:
    def test_first_snapshot_builds_everything(
        self, tracker: ChangeTracker, rebuilt: list[str]
    ) -> None:
        put(tracker, *two_services())
        s = tracker.snapshot()
        assert sorted(rebuilt) == ["ns/a", "ns/b"]
        assert addrs(one(s, spn("a")).endpoints) == ["10.1.0.1:8080"]
        assert addrs(one(s, spn("b")).endpoints) == ["10.2.0.1:8080"]

    def test_no_change_keeps_identity_and_builds_nothing(
        self, tracker: ChangeTracker, rebuilt: list[str]
    ) -> None:
        put(tracker, *two_services())
        s1 = tracker.snapshot()
        rebuilt.clear()
        s2 = tracker.snapshot()
        assert rebuilt == []
        assert s2 is not s1
        for name, sp in s1.services.items():
            assert s2.services[name] is sp

    def test_slice_change_rederives_only_its_service(
        self, tracker: ChangeTracker, rebuilt: list[str]
    ) -> None:
        put(tracker, *two_services())
        s1 = tracker.snapshot()
        rebuilt.clear()
        assert put(tracker, eslice("b-1", "b", endpoints=[endpoint("10.2.0.9")]))
        s2 = tracker.snapshot()
        assert rebuilt == ["ns/b"]
        assert s2.services[spn("a")] is s1.services[spn("a")]
        assert addrs(one(s2, spn("b")).endpoints) == ["10.2.0.9:8080"]

    def test_service_change_rederives_only_that_service(
        self, tracker: ChangeTracker, rebuilt: list[str]
    ) -> None:
        put(tracker, *two_services())
        s1 = tracker.snapshot()
        rebuilt.clear()
        put(tracker, service("a", cluster_ip="10.96.0.1", spec={"sessionAffinity": "ClientIP"}))
        s2 = tracker.snapshot()
        assert rebuilt == ["ns/a"]
        assert s2.services[spn("b")] is s1.services[spn("b")]
        assert one(s2, spn("a")).affinity_timeout == 10800
        assert addrs(one(s2, spn("a")).endpoints) == ["10.1.0.1:8080"]

    def test_reapplying_identical_objects_is_not_a_change(self, tracker: ChangeTracker) -> None:
        objs = two_services()
        assert put(tracker, *objs)
        gen = tracker.generation
        s1 = tracker.snapshot()
        assert not put(tracker, *objs)
        assert tracker.generation == gen
        assert tracker.snapshot().services[spn("a")] is s1.services[spn("a")]

    def test_cosmetic_change_is_not_a_change(self, tracker: ChangeTracker) -> None:
        # Fields kproxy does not read (resourceVersion, selector, ...) change nothing.
        put(tracker, *two_services())
        gen = tracker.generation
        obj = service("a", cluster_ip="10.96.0.1", spec={"selector": {"app": "a"}})
        obj["metadata"]["resourceVersion"] = "42"
        assert not put(tracker, obj)
        assert tracker.generation == gen

    def test_delete_slice(self, tracker: ChangeTracker) -> None:
        put(tracker, *two_services(), eslice("a-2", "a", endpoints=[endpoint("10.1.0.2")]))
        assert len(one(tracker.snapshot(), spn("a")).endpoints) == 2
        assert delete(tracker, ENDPOINT_SLICE, "a-1")
        assert addrs(one(tracker.snapshot(), spn("a")).endpoints) == ["10.1.0.2:8080"]
        assert delete(tracker, ENDPOINT_SLICE, "a-2")
        sp = one(tracker.snapshot(), spn("a"))
        assert sp.endpoints == () and not sp.any_endpoints

    def test_delete_unknown_object_is_not_a_change(self, tracker: ChangeTracker) -> None:
        gen = tracker.generation
        assert not delete(tracker, ENDPOINT_SLICE, "nope")
        assert not delete(tracker, SERVICE, "nope")
        assert tracker.generation == gen

    def test_delete_service_and_recreate_picks_up_its_slices(self, tracker: ChangeTracker) -> None:
        put(tracker, *two_services())
        tracker.snapshot()
        assert delete(tracker, SERVICE, "a")
        s = tracker.snapshot()
        assert set(s.services) == {spn("b")}
        put(tracker, service("a", cluster_ip="10.96.0.1"))
        assert addrs(one(tracker.snapshot(), spn("a")).endpoints) == ["10.1.0.1:8080"]

    def test_slice_before_service(self, tracker: ChangeTracker) -> None:
        put(tracker, eslice("a-1", "a", endpoints=[endpoint("10.1.0.1")]))
        assert tracker.snapshot().services == {}
        put(tracker, service("a", cluster_ip="10.96.0.1"))
        assert addrs(one(tracker.snapshot(), spn("a")).endpoints) == ["10.1.0.1:8080"]

    def test_slice_moving_between_services(
        self, tracker: ChangeTracker, rebuilt: list[str]
    ) -> None:
        put(tracker, *two_services())
        tracker.snapshot()
        rebuilt.clear()
        assert put(tracker, eslice("a-1", "b", endpoints=[endpoint("10.1.0.1")]))
        s = tracker.snapshot()
        assert sorted(rebuilt) == ["ns/a", "ns/b"]
        assert one(s, spn("a")).endpoints == ()
        assert addrs(one(s, spn("b")).endpoints) == ["10.1.0.1:8080", "10.2.0.1:8080"]
        counts = tracker.take_counts()
        assert counts.pending_endpoints == {"ns/a", "ns/b"}

    def test_service_removing_a_port(self, tracker: ChangeTracker) -> None:
        put(tracker, service(ports=[sport("http", 80), sport("https", 443)]))
        assert set(tracker.snapshot().services) == {spn(), spn(port="https")}
        put(tracker, service(ports=[sport("https", 443)]))
        assert set(tracker.snapshot().services) == {spn(port="https")}

    def test_service_becoming_headless_is_removed(self, tracker: ChangeTracker) -> None:
        put(tracker, *two_services())
        tracker.snapshot()
        assert put(tracker, service("a", cluster_ip="None"))
        s = tracker.snapshot()
        assert set(s.services) == {spn("b")}
        assert s.rejections == () and tracker.rejected_total == 0

    def test_generation_bumps_once_per_changing_batch(self, tracker: ChangeTracker) -> None:
        assert tracker.generation == 0
        put(tracker, *two_services())
        assert tracker.generation == 1
        put(tracker, service("a", cluster_ip="10.96.0.1"), service("c", cluster_ip="10.96.0.3"))
        assert tracker.generation == 2
        tracker.snapshot()
        assert tracker.generation == 2  # taking a snapshot is not a change

    def test_other_nodes_are_ignored(self, tracker: ChangeTracker) -> None:
        put(tracker, node(zone="z1"))
        gen = tracker.generation
        assert not put(tracker, node("node-b", zone="z2"))
        assert tracker.generation == gen
        assert tracker.snapshot().node.zone == "z1"

    def test_node_address_change_keeps_services(
        self, tracker: ChangeTracker, rebuilt: list[str]
    ) -> None:
        put(tracker, node(), *two_services())
        s1 = tracker.snapshot()
        rebuilt.clear()
        gen = tracker.generation
        assert put(tracker, node(addresses=("192.168.0.11",)))
        assert tracker.generation == gen + 1
        s2 = tracker.snapshot()
        assert rebuilt == []
        assert s2.node.addresses == ("192.168.0.11",)
        assert s2.services[spn("a")] is s1.services[spn("a")]

    def test_node_zone_change_rederives_all(
        self, tracker: ChangeTracker, rebuilt: list[str]
    ) -> None:
        hinted = eslice(
            "a-1",
            "a",
            endpoints=[endpoint("10.1.0.1", zones=["z1"]), endpoint("10.1.0.2", zones=["z2"])],
        )
        put(tracker, node(zone="z1"), *two_services(), hinted)
        s1 = tracker.snapshot()
        assert addrs(one(s1, spn("a")).cluster_endpoints) == ["10.1.0.1:8080"]
        rebuilt.clear()
        assert put(tracker, node(zone="z2"))
        s2 = tracker.snapshot()
        assert sorted(rebuilt) == ["ns/a", "ns/b"]
        assert addrs(one(s2, spn("a")).cluster_endpoints) == ["10.1.0.2:8080"]
        assert s2.services[spn("b")] == s1.services[spn("b")]  # same value, rebuilt
        assert s2.node.zone == "z2"

    def test_node_arriving_after_services_applies_topology(self, tracker: ChangeTracker) -> None:
        hinted = eslice(
            "a-1",
            "a",
            endpoints=[endpoint("10.1.0.1", zones=["z1"]), endpoint("10.1.0.2", zones=["z2"])],
        )
        put(tracker, service("a", cluster_ip="10.96.0.1"), hinted)
        assert len(one(tracker.snapshot(), spn("a")).cluster_endpoints) == 2
        put(tracker, node(zone="z2"))
        assert addrs(one(tracker.snapshot(), spn("a")).cluster_endpoints) == ["10.1.0.2:8080"]

    def test_node_deleted(self, tracker: ChangeTracker) -> None:
        put(tracker, node(zone="z1"))
        assert tracker.snapshot().node.addresses == ("192.168.0.10",)
        assert delete(tracker, NODE, NODE_NAME)
        info = tracker.snapshot().node
        assert (info.name, info.addresses, info.zone) == (NODE_NAME, (), "")

    def test_node_info(self, tracker: ChangeTracker) -> None:
        assert tracker.snapshot().node.name == NODE_NAME  # before any Node object
        put(tracker, node(zone="z1", addresses=("192.168.0.10", "2001:db8::10")))
        info = tracker.snapshot().node
        assert info.addresses == ("192.168.0.10",)
        assert info.pod_cidrs == ("10.244.1.0/24",)
        assert ("kubernetes.io/hostname", NODE_NAME) in info.labels

    def test_take_counts(self, tracker: ChangeTracker) -> None:
        put(tracker, *two_services())
        counts = tracker.take_counts()
        assert (counts.service_changes, counts.endpoint_changes) == (2, 2)
        assert counts.pending_services == {"ns/a", "ns/b"}
        assert counts.pending_endpoints == {"ns/a", "ns/b"}
        again = tracker.take_counts()
        assert (again.service_changes, again.endpoint_changes) == (0, 0)
        assert again.pending_services == set() == again.pending_endpoints
        put(tracker, *two_services())  # nothing new
        assert tracker.take_counts().service_changes == 0
        put(tracker, eslice("a-1", "a", endpoints=[]))
        delete(tracker, SERVICE, "b")
        counts = tracker.take_counts()
        assert (counts.service_changes, counts.endpoint_changes) == (1, 1)
        assert counts.pending_services == {"ns/b"} and counts.pending_endpoints == {"ns/a"}


# --- what changed between snapshots (Lineage) -------------------------------------------------


class TestLineage:
    def test_names_the_ports_of_changed_and_deleted_services(self, tracker: ChangeTracker) -> None:
        put(tracker, *two_services())
        s1 = tracker.snapshot()
        assert s1.lineage is not None
        assert s1.lineage.changed_since(None) is None
        put(tracker, eslice("b-1", "b", endpoints=[endpoint("10.2.0.9")]))
        s2 = tracker.snapshot()
        assert s2.lineage is not None
        assert s2.lineage.changed_since(s1.lineage) == {spn("b")}
        delete(tracker, SERVICE, "a")
        s3 = tracker.snapshot()
        assert s3.lineage is not None
        assert s3.lineage.changed_since(s2.lineage) == {spn("a")}
        assert s3.lineage.changed_since(s1.lineage) == {spn("a"), spn("b")}
        assert s1.lineage.changed_since(s3.lineage) is None  # backwards: unknown

    def test_a_snapshot_without_changes_changes_nothing(self, tracker: ChangeTracker) -> None:
        put(tracker, *two_services())
        s1, s2 = tracker.snapshot(), tracker.snapshot()
        assert s1.lineage is not None and s2.lineage is not None
        assert s2.lineage.changed_since(s1.lineage) == frozenset()

    def test_unknown_across_trackers_topology_and_trimmed_history(
        self, tracker: ChangeTracker
    ) -> None:
        put(tracker, *two_services())
        s1 = tracker.snapshot()
        other = ChangeTracker(NODE_NAME)
        put(other, *two_services())
        s_other = other.snapshot()
        assert s_other.lineage is not None and s1.lineage is not None
        assert s_other.lineage.changed_since(s1.lineage) is None
        put(tracker, node(NODE_NAME, zone="z9"))
        s2 = tracker.snapshot()
        assert s2.lineage is not None
        assert s2.lineage.changed_since(s1.lineage) is None  # every port was re-derived
        log = s2.lineage.log
        for i in range(300):  # more steps than the log keeps
            put(tracker, eslice("b-1", "b", endpoints=[endpoint(f"10.2.1.{i % 250}")]))
            tracker.snapshot()
        last = tracker.snapshot().lineage
        assert last is not None and last.log is log
        assert last.changed_since(s2.lineage) is None
        assert last.changed_since(Lineage(log, last.seq - 1)) == {spn("b")}

    def test_the_log_forgets_steps_beyond_its_name_budget(self) -> None:
        log = ChangeLog(keep=10, keep_names=3)
        names = [spn(c) for c in "abcd"]
        start = log.record(None)
        one = log.record(frozenset(names[:2]))
        two = log.record(frozenset(names[2:]))  # 4 names: the first step is forgotten
        assert log.between(one, two) == frozenset(names[2:])
        assert log.between(start, two) is None
        assert log.between(two, two) == frozenset()

    def test_services_keep_the_order_of_a_snapshot_built_from_scratch(
        self, tracker: ChangeTracker
    ) -> None:
        objs = [*two_services(), service("c", cluster_ip="10.96.0.3")]
        put(tracker, *objs)
        tracker.snapshot()
        changes = [
            eslice("b-1", "b", endpoints=[endpoint("10.2.0.9")]),  # same port names
            service("aa", cluster_ip="10.96.0.4"),  # a new name between others
            service("b", cluster_ip="10.96.0.2", ports=[sport("p2", 81), sport("p1", 80)]),
        ]
        for obj in changes:
            put(tracker, obj)
            objs = [o for o in objs if key_of(o) != key_of(obj)] + [obj]
            got = tracker.snapshot()
            want = snapshot_from_objects(objs, NODE_NAME)
            assert list(got.services.items()) == list(want.services.items())
        delete(tracker, SERVICE, "aa")
        objs = [o for o in objs if o["metadata"]["name"] != "aa"]
        got = tracker.snapshot()
        assert list(got.services.items()) == list(
            snapshot_from_objects(objs, NODE_NAME).services.items()
        )


# --- snapshot_from_objects ---------------------------------------------------------------------


class TestSnapshotFromObjects:
    def test_mixed_objects(self) -> None:
        s = snapshot_from_objects(
            [
                node(zone="z1"),
                node("node-b", zone="z2"),
                {"kind": "ConfigMap", "metadata": {"name": "cm", "namespace": "ns"}},
                {"kind": "Pod", "metadata": {"name": "p"}},
                *two_services(),
            ],
            NODE_NAME,
        )
        assert s.node.name == NODE_NAME and s.node.zone == "z1"
        assert set(s.services) == {spn("a"), spn("b")}
        assert s.rejections == ()

    def test_empty(self) -> None:
        s = snapshot_from_objects([], "n1")
        assert s.services == {} and s.rejections == () and s.node.name == "n1"

    def test_rejections_are_reported(self) -> None:
        bad = service("bad", ports=[sport("http", 70000)])
        s = snapshot_from_objects([bad, *two_services()], NODE_NAME)
        assert set(s.services) == {spn("a"), spn("b")}
        assert [str(r) for r in s.rejections] == [
            "Service ns/bad: spec.ports[0].port: Invalid value: 70000: must be between 1 and 65535"
        ]


# --- rejections --------------------------------------------------------------------------------

Mutator = Callable[[dict[str, Any]], None]


def _set(path: str, value: Any) -> Mutator:
    """Set a dotted path (list indices as numbers) in an object."""

    def mutate(obj: dict[str, Any]) -> None:
        parts = path.split(".")
        cur: Any = obj
        for p in parts[:-1]:
            cur = cur[int(p)] if p.isdigit() else cur[p]
        last = parts[-1]
        if value is _DELETE:
            del cur[int(last) if last.isdigit() else last]
        elif last.isdigit():
            cur[int(last)] = value
        else:
            cur[last] = value

    return mutate


_DELETE = object()


def _bad_service() -> dict[str, Any]:
    return service(
        "bad",
        cluster_ip="10.96.0.50",
        svc_type="LoadBalancer",
        ports=[sport("http", 80, node_port=30080)],
        status={"loadBalancer": {"ingress": [{"ip": "198.51.100.1"}]}},
    )


SERVICE_CASES: list[tuple[str, Mutator, str]] = [
    ("port 0", _set("spec.ports.0.port", 0), "spec.ports[0].port"),
    ("port too big", _set("spec.ports.0.port", 65536), "spec.ports[0].port"),
    ("port as string", _set("spec.ports.0.port", "80"), "spec.ports[0].port"),
    ("port missing", _set("spec.ports.0.port", _DELETE), "spec.ports[0].port"),
    ("port bool", _set("spec.ports.0.port", True), "spec.ports[0].port"),
    ("protocol unknown", _set("spec.ports.0.protocol", "ICMP"), "spec.ports[0].protocol"),
    ("protocol lowercase", _set("spec.ports.0.protocol", "tcp"), "spec.ports[0].protocol"),
    ("targetPort too big", _set("spec.ports.0.targetPort", 70000), "spec.ports[0].targetPort"),
    ("targetPort digits", _set("spec.ports.0.targetPort", "0"), "spec.ports[0].targetPort"),
    ("targetPort list", _set("spec.ports.0.targetPort", [1]), "spec.ports[0].targetPort"),
    ("nodePort too big", _set("spec.ports.0.nodePort", 65536), "spec.ports[0].nodePort"),
    ("nodePort string", _set("spec.ports.0.nodePort", "x"), "spec.ports[0].nodePort"),
    ("ports not a list", _set("spec.ports", {"port": 80}), "spec.ports"),
    ("port entry not a map", _set("spec.ports.0", 80), "spec.ports[0]"),
    (
        "second port without name",
        _set("spec.ports", [{"name": "a", "port": 1}, {"port": 2}]),
        "spec.ports[1].name",
    ),
    (
        "duplicate port name",
        _set("spec.ports", [{"name": "a", "port": 1}, {"name": "a", "port": 2}]),
        "spec.ports[1].name",
    ),
    ("clusterIP invalid", _set("spec.clusterIP", "10.96.0.300"), "spec.clusterIP"),
    ("clusterIP number", _set("spec.clusterIP", 17), "spec.clusterIP"),
    ("clusterIPs invalid", _set("spec.clusterIPs", ["10.96.0.50", 5]), "spec.clusterIPs[1]"),
    ("externalIP invalid", _set("spec.externalIPs", ["nope"]), "spec.externalIPs[0]"),
    ("externalIPs not list", _set("spec.externalIPs", "1.2.3.4"), "spec.externalIPs"),
    ("type unknown", _set("spec.type", "Bogus"), "spec.type"),
    ("type not a string", _set("spec.type", 3), "spec.type"),
    ("spec not a map", _set("spec", []), "spec"),
    ("metadata not a map", _set("metadata", "x"), "metadata"),
    ("name missing", _set("metadata.name", _DELETE), "metadata.name"),
    ("name not a DNS label", _set("metadata.name", "Bad_Name"), "metadata.name"),
    ("namespace not a DNS label", _set("metadata.namespace", "NS"), "metadata.namespace"),
    ("port name uppercase", _set("spec.ports.0.name", "HTTP"), "spec.ports[0].name"),
    ("port name with a quote", _set("spec.ports.0.name", 'a"b'), "spec.ports[0].name"),
    ("name not a string", _set("metadata.name", 12), "metadata.name"),
    ("labels not a map", _set("metadata.labels", ["a"]), "metadata.labels"),
    ("affinity unknown", _set("spec.sessionAffinity", "Cookie"), "spec.sessionAffinity"),
    (
        "affinity timeout 0",
        _set(
            "spec",
            {
                "clusterIP": "10.96.0.50",
                "ports": [{"port": 80}],
                "sessionAffinity": "ClientIP",
                "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 0}},
            },
        ),
        "spec.sessionAffinityConfig.clientIP.timeoutSeconds",
    ),
    (
        "affinity timeout too big",
        _set(
            "spec",
            {
                "clusterIP": "10.96.0.50",
                "ports": [{"port": 80}],
                "sessionAffinity": "ClientIP",
                "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 86401}},
            },
        ),
        "spec.sessionAffinityConfig.clientIP.timeoutSeconds",
    ),
    ("ETP unknown", _set("spec.externalTrafficPolicy", "Nearby"), "spec.externalTrafficPolicy"),
    ("ITP unknown", _set("spec.internalTrafficPolicy", "local"), "spec.internalTrafficPolicy"),
    (
        "LB ingress IP invalid",
        _set("status.loadBalancer.ingress.0.ip", "198.51.100"),
        "status.loadBalancer.ingress[0].ip",
    ),
    ("LB ingress not list", _set("status.loadBalancer.ingress", {}), "status.loadBalancer.ingress"),
    (
        "source range invalid",
        _set("spec.loadBalancerSourceRanges", ["10.0.0.0/33"]),
        "spec.loadBalancerSourceRanges[0]",
    ),
    (
        "source range not a string",
        _set("spec.loadBalancerSourceRanges", [10]),
        "spec.loadBalancerSourceRanges[0]",
    ),
    (
        "healthCheckNodePort invalid",
        _set(
            "spec",
            {
                "type": "LoadBalancer",
                "clusterIP": "10.96.0.50",
                "ports": [{"port": 80, "nodePort": 30080}],
                "externalTrafficPolicy": "Local",
                "healthCheckNodePort": 0.5,
            },
        ),
        "spec.healthCheckNodePort",
    ),
]


def _bad_slice() -> dict[str, Any]:
    return eslice(
        "a-bad",
        "a",
        ports=[eport("http", 8080)],
        endpoints=[endpoint("10.1.0.50", node=NODE_NAME, zones=["z1"])],
    )


SLICE_CASES: list[tuple[str, Mutator, str]] = [
    (
        "no service-name label",
        _set("metadata.labels", {}),
        "metadata.labels[kubernetes.io/service-name]",
    ),
    ("addressType missing", _set("addressType", _DELETE), "addressType"),
    ("addressType unknown", _set("addressType", "IPv5"), "addressType"),
    ("endpoint IP invalid", _set("endpoints.0.addresses.0", "10.1.0.500"), "endpoints[0]"),
    ("endpoint IP not a string", _set("endpoints.0.addresses.0", 1), "endpoints[0]"),
    ("endpoint IPv6 in IPv4 slice", _set("endpoints.0.addresses.0", "fd00::1"), "endpoints[0]"),
    ("endpoint no addresses", _set("endpoints.0.addresses", []), "endpoints[0].addresses"),
    ("endpoints not a list", _set("endpoints", {}), "endpoints"),
    ("port 0", _set("ports.0.port", 0), "ports[0].port"),
    ("port too big", _set("ports.0.port", 65536), "ports[0].port"),
    ("port protocol unknown", _set("ports.0.protocol", "GRE"), "ports[0].protocol"),
    ("port name not a string", _set("ports.0.name", 5), "ports[0].name"),
    ("ready not a bool", _set("endpoints.0.conditions", {"ready": "yes"}), "endpoints[0]"),
    ("terminating not a bool", _set("endpoints.0.conditions", {"terminating": 1}), "endpoints[0]"),
    ("hints not a list", _set("endpoints.0.hints.forZones", "z1"), "endpoints[0].hints"),
    ("hint entry not a map", _set("endpoints.0.hints.forZones", ["z1"]), "endpoints[0].hints"),
    ("nodeName not a string", _set("endpoints.0.nodeName", ["x"]), "endpoints[0].nodeName"),
]

NODE_CASES: list[tuple[str, Mutator, str]] = [
    ("address invalid", _set("status.addresses.0.address", "1.2.3"), "status.addresses[0]"),
    ("addresses not a list", _set("status.addresses", "1.2.3.4"), "status.addresses"),
    ("podCIDR invalid", _set("spec.podCIDRs", ["10.244.0.0/99"]), "spec.podCIDRs"),
    ("labels not a map", _set("metadata.labels", "zone"), "metadata.labels"),
]


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


class TestRejections:
    @pytest.mark.parametrize(
        ("mutate", "field"), [c[1:] for c in SERVICE_CASES], ids=[c[0] for c in SERVICE_CASES]
    )
    def test_bad_service(
        self,
        tracker: ChangeTracker,
        caplog: pytest.LogCaptureFixture,
        mutate: Mutator,
        field: str,
    ) -> None:
        bad = _bad_service()
        mutate(bad)
        with pytest.raises(InvalidObject) as err:
            parse_service(copy.deepcopy(bad))
        assert err.value.field.startswith(field)
        with caplog.at_level(logging.INFO, logger=LOGGER):
            put(tracker, *two_services())
            tracker.apply([ObjectEvent(ObjectKey(SERVICE, "ns", "bad"), bad)])
            s = tracker.snapshot()
        assert set(s.services) == {spn("a"), spn("b")}
        assert addrs(one(s, spn("a")).endpoints) == ["10.1.0.1:8080"]
        assert tracker.rejected_total == 1
        (rej,) = s.rejections
        assert (rej.kind, rej.namespace, rej.name) == (SERVICE, "ns", "bad")
        assert rej.field.startswith(field)
        (line,) = _warnings(caplog)
        assert "Service ns/bad" in line and field in line

    @pytest.mark.parametrize(
        ("mutate", "field"), [c[1:] for c in SLICE_CASES], ids=[c[0] for c in SLICE_CASES]
    )
    def test_bad_slice(
        self,
        tracker: ChangeTracker,
        caplog: pytest.LogCaptureFixture,
        mutate: Mutator,
        field: str,
    ) -> None:
        bad = _bad_slice()
        mutate(bad)
        with pytest.raises(InvalidObject) as err:
            parse_endpoint_slice(copy.deepcopy(bad))
        assert err.value.field.startswith(field)
        with caplog.at_level(logging.INFO, logger=LOGGER):
            put(tracker, *two_services())
            tracker.apply([ObjectEvent(ObjectKey(ENDPOINT_SLICE, "ns", "a-bad"), bad)])
            s = tracker.snapshot()
        # The service's other slice is still used; other services are untouched.
        assert addrs(one(s, spn("a")).endpoints) == ["10.1.0.1:8080"]
        assert addrs(one(s, spn("b")).endpoints) == ["10.2.0.1:8080"]
        assert tracker.rejected_total == 1
        (rej,) = s.rejections
        assert (rej.kind, rej.namespace, rej.name) == (ENDPOINT_SLICE, "ns", "a-bad")
        assert rej.field.startswith(field)
        (line,) = _warnings(caplog)
        assert "EndpointSlice ns/a-bad" in line and field in line

    @pytest.mark.parametrize(
        ("mutate", "field"), [c[1:] for c in NODE_CASES], ids=[c[0] for c in NODE_CASES]
    )
    def test_bad_node(
        self,
        tracker: ChangeTracker,
        caplog: pytest.LogCaptureFixture,
        mutate: Mutator,
        field: str,
    ) -> None:
        bad = node(zone="z2")
        mutate(bad)
        with pytest.raises(InvalidObject):
            parse_node(copy.deepcopy(bad))
        put(tracker, node(zone="z1"), *two_services())
        with caplog.at_level(logging.INFO, logger=LOGGER):
            tracker.apply([ObjectEvent(ObjectKey(NODE, "", NODE_NAME), bad)])
            s = tracker.snapshot()
        assert s.node.zone == "z1"  # the last good Node is kept
        assert set(s.services) == {spn("a"), spn("b")}
        (rej,) = s.rejections
        assert (rej.kind, rej.name) == (NODE, NODE_NAME) and rej.field.startswith(field)
        (line,) = _warnings(caplog)
        assert f"Node {NODE_NAME}" in line and field in line

    def test_rejection_logged_once_and_counted_once(
        self, tracker: ChangeTracker, caplog: pytest.LogCaptureFixture
    ) -> None:
        bad = service("bad", ports=[sport("http", 0)])
        with caplog.at_level(logging.INFO, logger=LOGGER):
            for _ in range(3):
                put(tracker, bad)
        assert tracker.rejected_total == 1
        assert len(_warnings(caplog)) == 1
        # A different problem in the same object is a new line, still one rejection.
        with caplog.at_level(logging.INFO, logger=LOGGER):
            put(tracker, service("bad", ports=[sport("http", 80, protocol="XTP")]))
        assert tracker.rejected_total == 1
        assert len(_warnings(caplog)) == 2
        assert "spec.ports[0].protocol" in _warnings(caplog)[1]

    def test_several_bad_objects_counted(self, tracker: ChangeTracker) -> None:
        put(
            tracker,
            service("bad1", ports=[sport("http", 0)]),
            service("bad2", ns="other", ports=[sport("http", 0)]),
            eslice("x-1", "x", endpoints=[endpoint("nope")]),
            *two_services(),
        )
        s = tracker.snapshot()
        assert tracker.rejected_total == 3 == len(s.rejections)
        assert {(r.kind, r.namespace, r.name) for r in s.rejections} == {
            (SERVICE, "ns", "bad1"),
            (SERVICE, "other", "bad2"),
            (ENDPOINT_SLICE, "ns", "x-1"),
        }

    def test_fixing_the_object_clears_the_rejection(self, tracker: ChangeTracker) -> None:
        put(tracker, service("bad", ports=[sport("http", 0)]))
        assert tracker.rejected_total == 1
        put(tracker, service("bad", ports=[sport("http", 80)]))
        assert tracker.rejected_total == 0
        s = tracker.snapshot()
        assert s.rejections == () and spn("bad") in s.services

    def test_deleting_the_object_clears_the_rejection(self, tracker: ChangeTracker) -> None:
        put(tracker, service("bad", ports=[sport("http", 0)]))
        put(tracker, eslice("bad-1", "bad", endpoints=[endpoint("x")]))
        assert tracker.rejected_total == 2
        delete(tracker, SERVICE, "bad")
        delete(tracker, ENDPOINT_SLICE, "bad-1")
        assert tracker.rejected_total == 0
        assert tracker.snapshot().rejections == ()

    def test_object_becoming_ignored_clears_the_rejection(self, tracker: ChangeTracker) -> None:
        put(tracker, service("bad", ports=[sport("http", 0)]))
        put(tracker, service("bad", svc_type="ExternalName"))
        assert tracker.rejected_total == 0

    def test_deleting_a_rejected_node_clears_the_rejection(self, tracker: ChangeTracker) -> None:
        bad = node()
        bad["status"]["addresses"][0]["address"] = "1.2.3"
        put(tracker, bad)
        assert tracker.rejected_total == 1
        delete(tracker, NODE, NODE_NAME)
        assert tracker.rejected_total == 0

    def test_service_turning_invalid_is_dropped_alone(self, tracker: ChangeTracker) -> None:
        put(tracker, *two_services())
        s1 = tracker.snapshot()
        assert put(tracker, service("a", cluster_ip="10.96.0.1", ports=[sport("http", 99999)]))
        s2 = tracker.snapshot()
        assert set(s2.services) == {spn("b")}
        assert s2.services[spn("b")] is s1.services[spn("b")]
        assert tracker.rejected_total == 1
        put(tracker, service("a", cluster_ip="10.96.0.1"))
        assert addrs(one(tracker.snapshot(), spn("a")).endpoints) == ["10.1.0.1:8080"]

    def test_slice_turning_invalid_drops_its_endpoints(self, tracker: ChangeTracker) -> None:
        put(tracker, *two_services())
        tracker.snapshot()
        assert put(tracker, eslice("a-1", "a", endpoints=[endpoint("10.1.0.1/32")]))
        assert one(tracker.snapshot(), spn("a")).endpoints == ()
        assert tracker.rejected_total == 1

    @pytest.mark.parametrize(
        "target", ["\u00b2", "1\u00b2", "9" * 5000], ids=["superscript", "mixed", "5000-digits"]
    )
    def test_odd_digit_target_port_is_rejected_not_raised(
        self, tracker: ChangeTracker, target: str
    ) -> None:
        put(tracker, *two_services())
        put(tracker, service("bad", ports=[sport("http", 80, target=target)]))
        s = tracker.snapshot()
        assert set(s.services) == {spn("a"), spn("b")}
        (rej,) = s.rejections
        assert rej.field == "spec.ports[0].targetPort"

    def test_non_ascii_digit_target_port_is_not_a_number(self) -> None:
        # "\u0668\u0660" is Arabic-Indic "80": not a port number, not a valid port name either.
        try:
            parsed = parse_service(service(ports=[sport("http", 80, target="\u0668\u0660")]))
        except InvalidObject as err:
            assert err.field == "spec.ports[0].targetPort"
        else:
            assert parsed.ports[0].target_port != 80


# --- fuzzing -----------------------------------------------------------------------------------

INTERESTING: list[Any] = [
    None,
    "",
    "None",
    "0",
    "-1",
    "65536",
    "80",
    "http",
    "TCP",
    "UDP",
    "SCTP",
    "ICMP",
    "Local",
    "Cluster",
    "ClientIP",
    "IPv4",
    "IPv6",
    "FQDN",
    "Proxy",
    "VIP",
    "LoadBalancer",
    "NodePort",
    "ExternalName",
    "10.0.0.1",
    "10.0.0.256",
    "::1",
    "fd00::1",
    "10.0.0.0/8",
    "10.0.0.0/33",
    "2024-01-01T00:00:00Z",
    "0001-01-01T00:00:00",
    0,
    1,
    -1,
    80,
    65535,
    65536,
    86400,
    86401,
    2**63,
    True,
    False,
    0.5,
    float("nan"),
    [],
    {},
]

json_leaves = (
    st.sampled_from(INTERESTING)
    | st.integers(-(2**33), 2**33)
    | st.text(string.printable, max_size=12)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.booleans()
    | st.none()
)
json_values = st.recursive(
    json_leaves,
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.sampled_from(["name", "port", "ip", "x", ""]), inner, max_size=3),
    max_leaves=6,
)


def _rich_service() -> dict[str, Any]:
    return service(
        "fz",
        ns="fz",
        cluster_ip="10.96.1.1",
        svc_type="LoadBalancer",
        labels={"app": "fz"},
        annotations={"a": "b"},
        ports=[sport("http", 80, target="web", node_port=30080), sport("dns", 53, protocol="UDP")],
        spec={
            "clusterIPs": ["10.96.1.1"],
            "externalIPs": ["203.0.113.7"],
            "loadBalancerSourceRanges": ["10.0.0.0/8"],
            "sessionAffinity": "ClientIP",
            "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 100}},
            "externalTrafficPolicy": "Local",
            "internalTrafficPolicy": "Cluster",
            "healthCheckNodePort": 32000,
        },
        status={"loadBalancer": {"ingress": [{"ip": "198.51.100.7", "ipMode": "VIP"}]}},
    )


def _rich_slice() -> dict[str, Any]:
    return eslice(
        "fz-1",
        "fz",
        ns="fz",
        ports=[eport("http", 8080), eport("dns", 5353, "UDP")],
        endpoints=[
            endpoint("10.3.0.1", node=NODE_NAME, zone="z1", zones=["z1"], nodes=[NODE_NAME]),
            endpoint("10.3.0.2", ready=False, serving=True, terminating=True),
        ],
        annotations={"endpoints.kubernetes.io/last-change-trigger-time": "2024-01-01T00:00:00Z"},
    )


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*prefix, i))
    return out


@st.composite
def mutated(draw: st.DrawFn, base: dict[str, Any]) -> dict[str, Any]:
    obj = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(obj) if p[0] not in ("kind", "apiVersion")]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent: Any = obj
        for p in path[:-1]:
            parent = parent[p]
        if isinstance(parent, dict) and draw(st.booleans()):
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(json_values)
    return obj


def _outcome(parse: Callable[[dict[str, Any]], Any], obj: dict[str, Any]) -> str:
    try:
        parse(copy.deepcopy(obj))
    except InvalidObject:
        return "invalid"
    except IgnoredObject:
        return "ignored"
    return "ok"


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(mutated(_rich_service()))
def test_fuzz_parse_service_only_raises_model_errors(obj: dict[str, Any]) -> None:
    _outcome(parse_service, obj)


@FUZZ
@given(mutated(_rich_slice()))
def test_fuzz_parse_slice_only_raises_model_errors(obj: dict[str, Any]) -> None:
    _outcome(parse_endpoint_slice, obj)


@FUZZ
@given(mutated(node(zone="z1")))
def test_fuzz_parse_node_only_raises_model_errors(obj: dict[str, Any]) -> None:
    _outcome(parse_node, obj)


@FUZZ
@given(
    svc=mutated(_rich_service()),
    sl=mutated(_rich_slice()),
    nd=mutated(node(zone="z1")),
)
def test_fuzz_tracker_survives_and_counts(
    svc: dict[str, Any], sl: dict[str, Any], nd: dict[str, Any]
) -> None:
    tracker = ChangeTracker(NODE_NAME)
    put(tracker, *two_services())
    before = tracker.snapshot()
    events = [
        ObjectEvent(ObjectKey(SERVICE, "fz", "fz"), svc),
        ObjectEvent(ObjectKey(ENDPOINT_SLICE, "fz", "fz-1"), sl),
        ObjectEvent(ObjectKey(NODE, "", NODE_NAME), nd),
    ]
    tracker.apply(events)
    s: Snapshot = tracker.snapshot()
    expected = sum(
        _outcome(parse, obj) == "invalid"
        for parse, obj in ((parse_service, svc), (parse_endpoint_slice, sl), (parse_node, nd))
    )
    assert tracker.rejected_total == expected == len(s.rejections)
    for rej in s.rejections:
        assert rej.field and rej.reason
        assert str(rej).startswith(f"{rej.kind} ")
    # The untouched services are unaffected (topology can only change with the Node).
    for name in (spn("a"), spn("b")):
        assert s.services[name].endpoints == before.services[name].endpoints
        assert s.services[name].cluster_ip == before.services[name].cluster_ip
    for name, sp in s.services.items():
        assert sp.name == name
        assert 1 <= sp.port <= 65535 and 0 <= sp.node_port <= 65535
        assert sp.protocol in Protocol
        assert all(e.ready or (e.serving and e.terminating) for e in sp.reachable_endpoints)
    # Putting the original objects back restores a clean state.
    put(tracker, _rich_service(), _rich_slice(), node(zone="z1"))
    s2 = tracker.snapshot()
    assert tracker.rejected_total == 0 and s2.rejections == ()
    assert addrs(one(s2, spn("fz", ns="fz")).endpoints) == ["10.3.0.1:8080", "10.3.0.2:8080"]
    assert s2.services[spn("fz", port="dns", ns="fz", proto=Protocol.UDP)].port == 53


# --- incremental == from scratch ---------------------------------------------------------------

_SVC_NAMES = ["a", "b", "c"]
_SLICE_NAMES = ["s1", "s2", "s3"]


def _svc_variant(name: str, v: int) -> dict[str, Any]:
    ip = f"10.96.0.{_SVC_NAMES.index(name) + 1}"
    if v == 0:
        return service(name, cluster_ip=ip)
    if v == 1:
        return service(name, cluster_ip=ip, ports=[sport("http", 80), sport("https", 443)])
    if v == 2:
        return service(
            name,
            cluster_ip=ip,
            svc_type="NodePort",
            ports=[sport("http", 80, node_port=30000 + v)],
            spec={"externalTrafficPolicy": "Local"},
        )
    if v == 3:
        return service(name, cluster_ip=ip, spec={"internalTrafficPolicy": "Local"})
    return service(name, cluster_ip=ip, ports=[sport("http", 0)])  # invalid


@st.composite
def _slice_variant(draw: st.DrawFn, name: str) -> dict[str, Any]:
    target = draw(st.sampled_from(_SVC_NAMES))
    eps = []
    for i in draw(st.lists(st.integers(1, 5), max_size=4, unique=True)):
        eps.append(
            endpoint(
                f"10.1.0.{i}",
                node=draw(st.sampled_from([NODE_NAME, "node-b", None])),
                ready=draw(st.sampled_from([None, True, False])),
                terminating=draw(st.sampled_from([None, True])),
                zones=draw(st.sampled_from([None, ["z1"], ["z2"]])),
            )
        )
    if draw(st.integers(0, 9)) == 0:
        eps.append(endpoint("bogus"))  # invalid slice
    ports = draw(
        st.sampled_from([[eport("http", 8080)], [eport("http", 8080), eport("https", 8443)]])
    )
    return eslice(name, target, endpoints=eps, ports=ports)


@st.composite
def _ops(draw: st.DrawFn) -> list[tuple[ObjectKey, dict[str, Any] | None, bool]]:
    out = []
    for _ in range(draw(st.integers(1, 25))):
        kind = draw(st.sampled_from([SERVICE, ENDPOINT_SLICE, NODE]))
        gone = draw(st.integers(0, 5)) == 0
        obj: dict[str, Any] | None
        if kind == SERVICE:
            name = draw(st.sampled_from(_SVC_NAMES))
            obj = None if gone else _svc_variant(name, draw(st.integers(0, 4)))
            key = ObjectKey(SERVICE, "ns", name)
        elif kind == ENDPOINT_SLICE:
            name = draw(st.sampled_from(_SLICE_NAMES))
            obj = None if gone else draw(_slice_variant(name))
            key = ObjectKey(ENDPOINT_SLICE, "ns", name)
        else:
            obj = None if gone else node(zone=draw(st.sampled_from([None, "z1", "z2"])))
            key = ObjectKey(NODE, "", NODE_NAME)
        out.append((key, obj, draw(st.booleans())))
    return out


@settings(max_examples=300, deadline=None)
@given(_ops())
def test_incremental_snapshots_equal_a_fresh_build(
    ops: list[tuple[ObjectKey, dict[str, Any] | None, bool]],
) -> None:
    tracker = ChangeTracker(NODE_NAME)
    world: dict[ObjectKey, dict[str, Any]] = {}
    prev: Snapshot | None = None
    dirty = False
    for key, obj, take in ops:
        gen = tracker.generation
        changed = tracker.apply([ObjectEvent(key, copy.deepcopy(obj))])
        assert tracker.generation == gen + int(changed)
        dirty |= changed
        if obj is None:
            world.pop(key, None)
        else:
            world[key] = obj
        if take:
            s = tracker.snapshot()
            fresh = snapshot_from_objects(list(world.values()), NODE_NAME)
            assert s.services == fresh.services
            assert s.node == fresh.node
            assert s.rejections == fresh.rejections
            if prev is not None and not dirty:
                assert s.services.keys() == prev.services.keys()
                assert all(s.services[k] is v for k, v in prev.services.items())
            prev, dirty = s, False
    final = tracker.snapshot()
    fresh = snapshot_from_objects(list(world.values()), NODE_NAME)
    assert final.services == fresh.services
    assert final.rejections == fresh.rejections
    # A second snapshot without changes reuses every ServicePort object.
    again = tracker.snapshot()
    assert all(again.services[k] is v for k, v in final.services.items())
