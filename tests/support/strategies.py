"""Hypothesis strategies for the objects kproxy reads: valid sets of Services, EndpointSlices
and a Node, and invalid (or deliberately ignored) objects to add to them.

A valid set is collision-free the way an API server's allocators make it: every Service has
its own ClusterIP, externalIPs, LoadBalancer IPs and NodePorts, so each frontend belongs to
exactly one service port and the dataplane's answer for it is well defined. Sizes are small
(a few services, ports and endpoints) so that an example renders in milliseconds.

The objects are plain dicts built with tests/support/model_objects.py (fields left out are
absent). Strings a parser does not check (slice and node names, zones, hints) sometimes hold
spaces, quotes or newlines: they must never reach a rule.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from kproxy.dataplane.facts import NodeFacts, RuleOptions
from kproxy.dataplane.nodepolicy import DETECT_LOCAL_MODES
from kproxy.model.objects import Snapshot
from kproxy.model.snapshot import ChangeTracker, object_key
from kproxy.sources.base import ObjectEvent, ObjectKey
from tests.support.model_objects import endpoint, eport, eslice, node, service, sport

NODE = "node-a"
OTHER_NODES = ("node-b", "node-c")
ZONES = ("z1", "z2")
NAMESPACES = ("ns", "other")
NODE_IP = "10.100.0.1"
POD_CIDR = "10.244.0.0/16"
ZONE_LABEL = "topology.kubernetes.io/zone"
# Text that is fine where nothing checks it, and fatal in a rule comment or chain name.
ODD_TEXT = ("a b", 'q"uote', "new\nline", "semi;colon", "ünï", "")

INVALID = "invalid"  # rejected: reported as a Rejection naming the object
IGNORED = "ignored"  # valid but deliberately not programmed (IPv6-only, ExternalName, ...)


@dataclass(frozen=True)
class BadObject:
    """An object that must change nothing, and what the model is expected to make of it."""

    obj: dict[str, Any]
    outcome: str  # INVALID or IGNORED
    why: str

    def __repr__(self) -> str:
        meta = self.obj.get("metadata") or {}
        return f"BadObject({self.obj.get('kind')} {meta.get('name')!r}: {self.why})"


# --- valid objects ---------------------------------------------------------------------------


def _service_ips(i: int) -> tuple[str, list[str], list[str]]:
    """Service i's own ClusterIP and pools of externalIPs and LoadBalancer IPs."""
    return (
        f"10.96.0.{i + 1}",
        [f"203.0.113.{4 * i + k + 1}" for k in range(2)],
        [f"198.51.100.{4 * i + k + 1}" for k in range(2)],
    )


@st.composite
def service_ports(draw: st.DrawFn, i: int, node_ports: bool) -> list[dict[str, Any]]:
    """1-3 ports with distinct (name, protocol) and (port, protocol)."""
    count = draw(st.integers(1, 3))
    out: list[dict[str, Any]] = []
    used: set[tuple[int, str]] = set()
    for j in range(count):
        proto = draw(st.sampled_from(["TCP", "UDP", "SCTP"]))
        number = draw(st.sampled_from([80, 443, 53, 8080]) | st.integers(1, 65535))
        if (number, proto) in used:
            continue
        used.add((number, proto))
        name = f"p{j}" if count > 1 else draw(st.sampled_from(["", "http"]))
        target = draw(
            st.sampled_from([None, 0, "web", "8443"]) | st.integers(1, 65535),
        )
        node_port = 30000 + 8 * i + j if node_ports and draw(st.integers(0, 4)) else None
        # TCP is also what a port without a protocol means.
        protocol = draw(st.sampled_from(["TCP", None])) if proto == "TCP" else proto
        out.append(
            sport(name or None, number, protocol=protocol, target=target, node_port=node_port)
        )
    return out


def _slice_port_number(p: dict[str, Any]) -> int:
    target = p.get("targetPort")
    if isinstance(target, int) and target:
        return target
    if isinstance(target, str) and target.isdigit():
        return int(target)
    return 9000 + p["port"] % 1000  # a named target port resolves to some container port


@st.composite
def endpoints(draw: st.DrawFn, pool: list[str]) -> list[dict[str, Any]]:
    """0-3 endpoints; addresses from a small per-service pool, so slices share some."""
    out = []
    for ip in draw(st.lists(st.sampled_from(pool), max_size=3, unique=True)):
        out.append(
            endpoint(
                ip,
                node=draw(st.sampled_from([NODE, *OTHER_NODES, None])),
                zone=draw(st.sampled_from([*ZONES, None]) | st.sampled_from(ODD_TEXT)),
                ready=draw(st.sampled_from([None, True, False])),
                serving=draw(st.sampled_from([None, True, False])),
                terminating=draw(st.sampled_from([None, False, True])),
                zones=draw(st.sampled_from([None, ["z1"], ["z2"], ["z1", "z2"]])),
                nodes=draw(st.sampled_from([None, None, [NODE], ["node-b"]])),
            )
        )
    return out


@st.composite
def endpoint_slices(
    draw: st.DrawFn, i: int, name: str, ns: str, ports: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """0-3 slices of one service; some omit a port, one may be empty."""
    pool = [f"10.244.{i}.{k + 2}" for k in range(4)]
    out = []
    for k in range(draw(st.integers(0, 3))):
        slice_ports = [
            eport(p.get("name"), _slice_port_number(p), p.get("protocol"))
            for p in ports
            if draw(st.integers(0, 5))
        ]
        slice_name = f"{name}-{k}" if draw(st.integers(0, 5)) else f"{name} {k}\n"
        out.append(eslice(slice_name, name, ns, endpoints=draw(endpoints(pool)), ports=slice_ports))
    return out


@st.composite
def service_with_slices(draw: st.DrawFn, i: int, collide: bool = False) -> list[dict[str, Any]]:
    """Service number i (any type, valid) and its EndpointSlices. collide: its addresses
    and ports are those of service 0 or 1, so frontends may be shared."""
    name, ns = f"s{i}", draw(st.sampled_from(NAMESPACES))
    kind = draw(
        st.sampled_from(["ClusterIP", "ClusterIP", "NodePort", "LoadBalancer", "ExternalName"])
        | st.just("headless")
    )
    own = draw(st.integers(0, 1)) if collide else i
    cluster_ip, external_pool, lb_pool = _service_ips(own)
    ports = draw(service_ports(own, node_ports=kind in ("NodePort", "LoadBalancer")))
    spec: dict[str, Any] = {}
    status: dict[str, Any] | None = None
    svc_type: str | None = kind
    if kind == "headless":
        svc_type, cluster_ip = None, "None"
    elif kind == "ExternalName":
        spec["externalName"] = "example.com"
    if kind != "ExternalName" and draw(st.booleans()):
        spec["clusterIPs"] = [cluster_ip]
    if kind in ("ClusterIP", "NodePort", "LoadBalancer"):
        ext = draw(st.lists(st.sampled_from(external_pool), max_size=2, unique=True))
        if ext:
            spec["externalIPs"] = ext
        if draw(st.booleans()):
            spec["sessionAffinity"] = "ClientIP"
            timeout = draw(st.sampled_from([None, 1, 10800, 86400]))
            if timeout is not None:
                spec["sessionAffinityConfig"] = {"clientIP": {"timeoutSeconds": timeout}}
        for policy in ("externalTrafficPolicy", "internalTrafficPolicy"):
            value = draw(st.sampled_from([None, "Cluster", "Local"]))
            if value is not None:
                spec[policy] = value
    if kind == "LoadBalancer":
        ingress = []
        for ip in draw(st.lists(st.sampled_from(lb_pool), max_size=2, unique=True)):
            entry: dict[str, Any] = {"ip": ip}
            mode = draw(st.sampled_from([None, "VIP", "Proxy"]))
            if mode is not None:
                entry["ipMode"] = mode
            ingress.append(entry)
        if draw(st.integers(0, 3)) == 0:
            ingress.append({"hostname": "lb.example.com"})
        status = {"loadBalancer": {"ingress": ingress}}
        if draw(st.booleans()):
            spec["loadBalancerSourceRanges"] = draw(
                st.lists(
                    st.sampled_from(["10.0.0.0/8", "192.0.2.0/24", "10.100.0.0/24", " 1.2.3.4/32"]),
                    min_size=1,
                    max_size=2,
                    unique=True,
                )
            )
        if spec.get("externalTrafficPolicy") == "Local":
            spec["healthCheckNodePort"] = 32000 + own
    annotations = draw(
        st.sampled_from(
            [None, {"a": "b"}, {"ipvs.kubernetes.io/scheduler": draw(st.sampled_from(ODD_TEXT))}]
        )
    )
    svc = service(
        name,
        ns,
        ports=ports,
        cluster_ip=cluster_ip,
        svc_type=svc_type,
        annotations=annotations,
        status=status,
        spec=spec,
    )
    return [svc, *draw(endpoint_slices(i, name, ns, ports))]


@st.composite
def this_node(draw: st.DrawFn) -> dict[str, Any]:
    return node(
        NODE,
        zone=draw(st.sampled_from([None, *ZONES])),
        addresses=(NODE_IP,),
        pod_cidrs=("10.244.0.0/24",),
    )


@st.composite
def valid_worlds(
    draw: st.DrawFn, max_services: int = 4, *, collide: bool = False
) -> list[dict[str, Any]]:
    """A valid set of objects: this node (usually) and 0-max services, collision-free
    unless `collide` (then services share ClusterIPs, externalIPs, LB IPs and NodePorts,
    which an API server forbids only for ClusterIPs and NodePorts)."""
    out = [draw(this_node())] if draw(st.integers(0, 4)) else []
    for i in range(draw(st.integers(0, max_services))):
        out += draw(service_with_slices(i, collide))
    return out


# --- invalid and ignored objects ---------------------------------------------------------------

# (where, value, outcome): one field of a valid object replaced; where is a path of keys.
_SERVICE_DAMAGE: list[tuple[tuple[Any, ...], Any, str]] = [
    (("metadata", "name"), "Upper", INVALID),
    (("metadata", "name"), "new\nline", INVALID),
    (("metadata", "name"), "x" * 64, INVALID),
    (("metadata", "name"), 'q"uote', INVALID),
    (("metadata", "namespace"), "bad ns", INVALID),
    (("metadata", "labels"), ["not", "a", "map"], INVALID),
    (("spec",), ["not", "a", "map"], INVALID),
    (("spec", "type"), "Weird", INVALID),
    (("spec", "clusterIP"), "10.96.0.300", INVALID),
    (("spec", "clusterIP"), "not-an-ip", INVALID),
    (("spec", "clusterIP"), 1234, INVALID),
    (("spec", "clusterIP"), "fd00::10", IGNORED),
    (("spec", "clusterIP"), "None", IGNORED),
    (("spec", "type"), "ExternalName", IGNORED),
    (("metadata", "labels"), {"service.kubernetes.io/headless": ""}, IGNORED),
    (("metadata", "labels"), {"service.kubernetes.io/service-proxy-name": "other"}, IGNORED),
    (("spec", "ports"), [sport(None, 80), sport(None, 81)], INVALID),
    (("spec", "ports"), [sport("a", 80), sport("a", 81)], INVALID),
    (("spec", "ports"), [sport("a", 80), sport("b", 80)], INVALID),
    (("spec", "ports"), {"port": 80}, INVALID),
    (("spec", "ports", 0, "port"), 0, INVALID),
    (("spec", "ports", 0, "port"), 65536, INVALID),
    (("spec", "ports", 0, "port"), "80", INVALID),
    (("spec", "ports", 0, "port"), True, INVALID),
    (("spec", "ports", 0, "port"), None, INVALID),
    (("spec", "ports", 0, "protocol"), "ICMP", INVALID),
    (("spec", "ports", 0, "name"), "HTTP", INVALID),
    (("spec", "ports", 0, "name"), "a\nb", INVALID),
    (("spec", "ports", 0, "targetPort"), "Bad_Name", INVALID),
    (("spec", "ports", 0, "targetPort"), 70000, INVALID),
    (("spec", "ports", 0, "targetPort"), "99999", INVALID),
    (("spec", "ports", 0, "targetPort"), 1.5, INVALID),
    (("spec", "externalIPs"), ["1.2.3"], INVALID),
    (("spec", "externalIPs"), "203.0.113.1", INVALID),
    (("spec", "sessionAffinity"), "Sticky", INVALID),
    (("spec", "sessionAffinityConfig"), {"clientIP": {"timeoutSeconds": 0}}, INVALID),
    (("spec", "sessionAffinityConfig"), {"clientIP": {"timeoutSeconds": 86401}}, INVALID),
    (("spec", "sessionAffinityConfig"), {"clientIP": {"timeoutSeconds": "10"}}, INVALID),
    (("spec", "externalTrafficPolicy"), "Nope", INVALID),
    (("spec", "internalTrafficPolicy"), "local", INVALID),
]
# The same, only for a service of type LoadBalancer.
_LB_DAMAGE: list[tuple[tuple[Any, ...], Any, str]] = [
    (
        ("spec", "ports"),
        [sport("a", 80, node_port=30999), sport("b", 81, node_port=30999)],
        INVALID,
    ),
    (("spec", "ports", 0, "nodePort"), 70000, INVALID),
    (("spec", "ports", 0, "nodePort"), -1, INVALID),
    (("spec", "loadBalancerSourceRanges"), ["10.0.0.0/33"], INVALID),
    (("spec", "loadBalancerSourceRanges"), ["10.0.0.0"], INVALID),
    (("spec", "loadBalancerSourceRanges"), "10.0.0.0/8", INVALID),
    (("status", "loadBalancer", "ingress"), [{"ip": "198.51.100.300"}], INVALID),
    (("status", "loadBalancer", "ingress"), "198.51.100.9", INVALID),
    (("spec", "healthCheckNodePort"), 70000, INVALID),
]
_SLICE_DAMAGE: list[tuple[tuple[Any, ...], Any, str]] = [
    (("addressType",), "IPv5", INVALID),
    (("addressType",), None, INVALID),
    (("addressType",), "IPv6", IGNORED),
    (("addressType",), "FQDN", IGNORED),
    (("metadata", "labels"), {}, INVALID),
    (("metadata", "annotations"), "text", INVALID),
    (("ports",), {"port": 80}, INVALID),
    (("ports", 0, "port"), 0, INVALID),
    (("ports", 0, "port"), 65536, INVALID),
    (("ports", 0, "protocol"), "GRE", INVALID),
    (("endpoints",), {"addresses": []}, INVALID),
    (("endpoints", 0, "addresses"), [], INVALID),
    (("endpoints", 0, "addresses"), ["10.244.9"], INVALID),
    (("endpoints", 0, "addresses"), ["fd00::1"], INVALID),
    (("endpoints", 0, "addresses"), ["10.244.9.9\nx"], INVALID),
    (("endpoints", 0, "conditions", "ready"), "yes", INVALID),
    (("endpoints", 0, "nodeName"), 7, INVALID),
    (("endpoints", 0, "hints"), {"forZones": "z1"}, INVALID),
]
_NODE_DAMAGE: list[tuple[tuple[Any, ...], Any, str]] = [
    (("metadata", "labels"), ["a"], INVALID),
    (("status", "addresses"), [{"type": "InternalIP", "address": "10.100.0.300"}], INVALID),
    (("status", "addresses"), "10.100.0.1", INVALID),
    (("spec", "podCIDRs"), ["10.244.0.0/40"], INVALID),
    (("spec",), "text", INVALID),
]


def _damaged(obj: dict[str, Any], where: tuple[Any, ...], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    parent: Any = out
    for key in where[:-1]:
        parent = parent.setdefault(key, {}) if isinstance(parent, dict) else parent[key]
    if value is None and isinstance(parent, dict):
        parent.pop(where[-1], None)
    else:
        parent[where[-1]] = value
    return out


@st.composite
def bad_services(draw: st.DrawFn, k: int) -> BadObject:
    """An invalid (or ignored) Service named bad-k, or a damaged name."""
    kind = draw(st.sampled_from(["ClusterIP", "LoadBalancer"]))
    base = service(
        f"bad-{k}",
        "ns",
        cluster_ip=f"10.97.0.{k + 1}",
        svc_type=kind,
        ports=[sport("http", 80, node_port=31000 + k), sport("dns", 53, protocol="UDP")],
        status={"loadBalancer": {"ingress": [{"ip": f"198.51.101.{k + 1}"}]}},
        spec={
            "sessionAffinity": "ClientIP",
            "externalTrafficPolicy": "Local" if kind == "LoadBalancer" else "Cluster",
        },
    )
    damage = _SERVICE_DAMAGE + (_LB_DAMAGE if kind == "LoadBalancer" else [])
    where, value, outcome = draw(st.sampled_from(damage))
    return BadObject(
        _damaged(base, where, value), outcome, f"{'.'.join(map(str, where))}={value!r}"
    )


@st.composite
def bad_slices(draw: st.DrawFn, k: int, service_names: list[str]) -> BadObject:
    """An invalid (or ignored) EndpointSlice bad-k, labelled for one of the services."""
    svc = draw(st.sampled_from(service_names or ["s0"]))
    ns = draw(st.sampled_from(NAMESPACES))
    base = eslice(
        f"bad-{k}",
        svc,
        ns,
        ports=[eport("http", 8080), eport("p0", 8080), eport(None, 8080)],
        endpoints=[endpoint(f"10.245.{k}.1", node=NODE), endpoint(f"10.245.{k}.2")],
    )
    where, value, outcome = draw(st.sampled_from(_SLICE_DAMAGE))
    return BadObject(
        _damaged(base, where, value), outcome, f"{'.'.join(map(str, where))}={value!r}"
    )


@st.composite
def bad_nodes(draw: st.DrawFn) -> BadObject:
    """An invalid Node object of this node."""
    where, value, outcome = draw(st.sampled_from(_NODE_DAMAGE))
    base = node(NODE, zone="z1", addresses=("10.100.0.9",), pod_cidrs=("10.250.0.0/24",))
    return BadObject(
        _damaged(base, where, value), outcome, f"{'.'.join(map(str, where))}={value!r}"
    )


def service_names(objects: list[dict[str, Any]]) -> list[str]:
    return sorted({o["metadata"]["name"] for o in objects if o["kind"] == "Service"})


@st.composite
def bad_objects(
    draw: st.DrawFn, valid: list[dict[str, Any]], *, with_node: bool
) -> list[BadObject]:
    """1-3 bad objects whose keys collide with nothing in `valid`; with_node: the node's own
    object may be one of them (only when `valid` has no Node, or it would be an update)."""
    names = service_names(valid)
    out: list[BadObject] = []
    for k in range(draw(st.integers(1, 3))):
        which = draw(
            st.sampled_from(["service", "slice", "node"] if with_node else ["service", "slice"])
        )
        if which == "node" and not any(b.obj["kind"] == "Node" for b in out):
            out.append(draw(bad_nodes()))
        elif which == "slice":
            out.append(draw(bad_slices(k, names)))
        else:
            out.append(draw(bad_services(k)))
    return out


# --- how the node is set up ------------------------------------------------------------------


@st.composite
def rule_options(draw: st.DrawFn) -> RuleOptions:
    detect = draw(st.sampled_from(DETECT_LOCAL_MODES))
    return RuleOptions(
        masquerade_all=draw(st.booleans()),
        detect_local_mode=detect,
        cluster_cidrs=(POD_CIDR,),
        bridge_interface="cbr0" if detect == "BridgeInterface" else "",
        interface_name_prefix="veth" if detect == "InterfaceNamePrefix" else "",
        localhost_nodeports=draw(st.booleans()),
        node_port_addresses=draw(st.sampled_from([(), ("primary",), ("10.100.0.0/24",)])),
    )


@st.composite
def node_facts(draw: st.DrawFn) -> NodeFacts:
    return NodeFacts(
        node_ips=(NODE_IP,),
        local_addresses=("127.0.0.1", NODE_IP),
        random_fully=draw(st.booleans()),
        tcp_be_liberal=draw(st.booleans()),
    )


def _service_of(obj: dict[str, Any]) -> str:
    meta = obj["metadata"]
    if obj["kind"] == "Service":
        return str(meta["name"])
    return str((meta.get("labels") or {}).get("kubernetes.io/service-name", ""))


World = list[dict[str, Any]]


def tracked_snapshots(history: list[World], node_name: str) -> list[Snapshot]:
    """The snapshots of one ChangeTracker fed each world in turn (the objects that changed,
    appeared or went as events), so that each snapshot knows what changed since the last."""
    tracker = ChangeTracker(node_name)
    held: dict[ObjectKey, dict[str, Any]] = {}
    out = []
    for world in history:
        now = {object_key(o): o for o in world}
        events = [ObjectEvent(k, None) for k in held if k not in now]
        events += [ObjectEvent(k, o) for k, o in now.items() if held.get(k) != o]
        tracker.apply(events)
        held = now
        out.append(tracker.snapshot())
    return out


@st.composite
def world_histories(
    draw: st.DrawFn, max_length: int = 2, max_services: int = 4, *, collide: bool = False
) -> list[World]:
    """2-max_length valid worlds one after the other: from one to the next each service (with
    its slices) is kept, changed, added or gone, and the Node kept or changed, so a partial
    sync has some of everything. collide: as valid_worlds."""
    history = [draw(valid_worlds(max_services, collide=collide))]
    for _ in range(draw(st.integers(2, max_length)) - 1):
        before, other = history[-1], draw(valid_worlds(max_services, collide=collide))
        after: World = []
        nodes = (
            [o for o in before if o["kind"] == "Node"],
            [o for o in other if o["kind"] == "Node"],
        )
        after += nodes[draw(st.integers(0, 1))]
        for i in range(max_services):
            name = f"s{i}"
            source = draw(st.sampled_from([before, before, other, []]))
            after += [o for o in source if o["kind"] != "Node" and _service_of(o) == name]
        history.append(after)
    return history


def any_world_histories(max_length: int = 2) -> st.SearchStrategy[list[World]]:
    """World histories, a quarter of them with shared frontends."""
    plain = world_histories(max_length)
    return st.one_of(plain, plain, plain, world_histories(max_length, collide=True))
