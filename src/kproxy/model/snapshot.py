"""Join Services with their EndpointSlices into the per-node Snapshot, incrementally.

The ChangeTracker is the one place where raw objects become model: every source feeds it
ObjectEvents, every dataplane reads its snapshots. It re-derives only services whose Service
or EndpointSlices changed since the last snapshot, so unchanged ServicePort values keep their
identity and a dataplane can skip their rules cheaply.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kproxy.model.objects import (
    ChangeLog,
    Endpoint,
    Lineage,
    NodeInfo,
    Rejection,
    ServicePort,
    ServicePortName,
    Snapshot,
)
from kproxy.model.parse import (
    IgnoredObject,
    InvalidObject,
    ParsedEndpoint,
    ParsedNode,
    ParsedService,
    ParsedSlice,
    parse_endpoint_slice,
    parse_node,
    parse_service,
)
from kproxy.sources.base import ENDPOINT_SLICE, NODE, SERVICE, ObjectEvent, ObjectKey

log = logging.getLogger("kproxy.model")
T = TypeVar("T")

ZONE_LABEL = "topology.kubernetes.io/zone"
TOPOLOGY_LABELS = (ZONE_LABEL, "kubernetes.io/hostname")


@dataclass
class ChangeCounts:
    """What arrived since the counters were last read (for the changes_* metrics)."""

    service_changes: int = 0
    endpoint_changes: int = 0
    pending_services: set[str] = field(default_factory=set)
    pending_endpoints: set[str] = field(default_factory=set)


class ChangeTracker:
    """Holds the parsed objects of one node's world and builds snapshots from them."""

    def __init__(self, node_name: str) -> None:
        self.node_name = node_name
        self._lock = threading.Lock()
        self._services: dict[str, ParsedService] = {}  # "ns/name"
        self._slices: dict[tuple[str, str], ParsedSlice] = {}  # (ns, slice name)
        self._slices_by_service: dict[str, set[tuple[str, str]]] = {}
        self._rejections: dict[ObjectKey, Rejection] = {}
        # Services deliberately not programmed: "ns/name" -> (why, spec.externalName), so
        # a preflight beside the running proxy sees them without re-reading the objects.
        self._ignored: dict[str, tuple[str, str]] = {}
        self._node: ParsedNode | None = None
        self._dirty: set[str] = set()
        self._all_dirty = True
        self._ports: dict[str, tuple[ServicePort, ...]] = {}
        # The services of the last snapshot (its dict is the snapshot's; never changed).
        self._view: dict[ServicePortName, ServicePort] | None = None
        self._generation = 0
        self._changes = ChangeLog()
        self.counts = ChangeCounts()

    @property
    def generation(self) -> int:
        """Bumped by every change; a sync loop compares it to know whether work is pending."""
        return self._generation

    @property
    def rejected_total(self) -> int:
        return len(self._rejections)

    def rejections(self) -> tuple[Rejection, ...]:
        """The objects skipped as invalid right now: known as soon as they arrive, before
        any sync (an invalid object alone changes nothing to sync)."""
        with self._lock:
            return tuple(sorted(self._rejections.values(), key=str))

    def apply(self, events: Sequence[ObjectEvent]) -> bool:
        """Fold events into the state. Returns True if anything relevant changed."""
        changed = False
        with self._lock:
            for ev in events:
                if ev.key.kind == SERVICE:
                    changed |= self._apply_service(ev)
                elif ev.key.kind == ENDPOINT_SLICE:
                    changed |= self._apply_slice(ev)
                elif ev.key.kind == NODE:
                    changed |= self._apply_node(ev)
            if changed:
                self._generation += 1
        return changed

    def _reject(self, key: ObjectKey, err: InvalidObject) -> None:
        rej = Rejection(key.kind, key.namespace, key.name, err.field, err.reason)
        if self._rejections.get(key) != rej:
            log.warning("skipping invalid %s", rej)
        self._rejections[key] = rej

    def _parse(self, ev: ObjectEvent, parser: Callable[[dict[str, Any]], T]) -> T | None:
        """The parsed object, or None when deleted, ignored or invalid (then recorded)."""
        svc_key = f"{ev.key.namespace}/{ev.key.name}" if ev.key.kind == SERVICE else None
        if svc_key is not None:
            self._ignored.pop(svc_key, None)
        if ev.obj is None:
            self._rejections.pop(ev.key, None)
            return None
        try:
            parsed = parser(ev.obj)
        except IgnoredObject as why:
            self._rejections.pop(ev.key, None)
            log.info("ignoring %s: %s", ev.key, why)
            if svc_key is not None:
                spec = ev.obj.get("spec") or {}
                external = spec.get("externalName") if spec.get("type") == "ExternalName" else ""
                self._ignored[svc_key] = (str(why), str(external or ""))
            return None
        except InvalidObject as err:
            self._reject(ev.key, err)
            return None
        except Exception as err:  # a shape the parser did not foresee: this object alone
            self._reject(ev.key, InvalidObject("", f"cannot be read ({type(err).__name__})"))
            return None
        self._rejections.pop(ev.key, None)
        return parsed

    def _apply_service(self, ev: ObjectEvent) -> bool:
        svc_key = f"{ev.key.namespace}/{ev.key.name}"
        parsed = self._parse(ev, parse_service)
        old = self._services.get(svc_key)
        if old == parsed:
            return False
        if parsed is None:
            self._services.pop(svc_key, None)
        else:
            self._services[svc_key] = parsed
        self._dirty.add(svc_key)
        self.counts.service_changes += 1
        self.counts.pending_services.add(svc_key)
        return True

    def _apply_slice(self, ev: ObjectEvent) -> bool:
        key = (ev.key.namespace, ev.key.name)
        parsed = self._parse(ev, parse_endpoint_slice)
        old = self._slices.get(key)
        if old == parsed:
            return False
        touched: set[str] = set()
        if old is not None:
            svc = f"{old.namespace}/{old.service}"
            self._slices_by_service.get(svc, set()).discard(key)
            touched.add(svc)
        if parsed is None:
            self._slices.pop(key, None)
        else:
            self._slices[key] = parsed
            svc = f"{parsed.namespace}/{parsed.service}"
            self._slices_by_service.setdefault(svc, set()).add(key)
            touched.add(svc)
        self._dirty |= touched
        self.counts.endpoint_changes += 1
        self.counts.pending_endpoints |= touched
        return True

    def _apply_node(self, ev: ObjectEvent) -> bool:
        if ev.key.name != self.node_name:
            return False
        parsed: ParsedNode | None = None
        if ev.obj is None:
            self._rejections.pop(ev.key, None)
        else:
            parsed = self._parse(ev, parse_node)
            if parsed is None:
                return False
        if parsed == self._node:
            return False
        old_topology = _topology(self._node)
        self._node = parsed
        if _topology(parsed) != old_topology:
            self._all_dirty = True  # zone hints depend on the node's zone label
        return True

    def snapshot(self) -> Snapshot:
        """Build the current snapshot; only dirty services are re-derived."""
        with self._lock:
            node = self._node_info()
            all_dirty = self._all_dirty
            dirty = set(self._services) | set(self._ports) if all_dirty else self._dirty
            changed: set[ServicePortName] = set()
            same_names = not all_dirty  # every re-derived service kept its port names
            for svc_key in dirty:
                before = [sp.name for sp in self._ports.get(svc_key, ())]
                changed.update(before)
                svc = self._services.get(svc_key)
                if svc is None:
                    self._ports.pop(svc_key, None)
                    same_names = same_names and not before
                    continue
                slices = [self._slices[k] for k in sorted(self._slices_by_service.get(svc_key, ()))]
                ports = self._ports[svc_key] = build_service_ports(svc, slices, node)
                after = [sp.name for sp in ports]
                changed.update(after)
                same_names = same_names and before == after
            self._dirty = set()
            self._all_dirty = False
            if all_dirty or changed:
                self._changes.record(None if all_dirty else frozenset(changed))
            lineage = Lineage(self._changes, self._changes.seq)
            services: dict[ServicePortName, ServicePort]
            if same_names and self._view is not None:
                # The last snapshot's names in the same order: a copy of its mapping (no
                # rehashing of every name) with the re-derived ports' new values.
                services = self._view.copy()
                for svc_key in dirty:
                    for sp in self._ports.get(svc_key, ()):
                        services[sp.name] = sp
            else:
                services = {}
                for key in sorted(self._ports):
                    for sp in self._ports[key]:
                        services[sp.name] = sp
            self._view = services
            trigger_times: dict[str, float] = {}
            for sl in self._slices.values():
                if sl.trigger_time is not None:
                    svc = f"{sl.namespace}/{sl.service}"
                    trigger_times[svc] = max(trigger_times.get(svc, 0.0), sl.trigger_time)
            rejections = tuple(sorted(self._rejections.values(), key=str))
        return Snapshot(
            node=node,
            services=services,
            rejections=rejections,
            trigger_times=trigger_times,
            lineage=lineage,
        )

    def parsed_objects(
        self,
    ) -> tuple[dict[str, ParsedService], list[ParsedSlice], dict[str, tuple[str, str]], set[str]]:
        """What the objects are now, parsed: the programmed services, the slices, the ignored
        services (why, externalName) and every Service key there is (invalid ones too)."""
        with self._lock:
            known = set(self._services) | set(self._ignored)
            known |= {f"{k.namespace}/{k.name}" for k in self._rejections if k.kind == SERVICE}
            return dict(self._services), list(self._slices.values()), dict(self._ignored), known

    def take_counts(self) -> ChangeCounts:
        with self._lock:
            counts, self.counts = self.counts, ChangeCounts()
        return counts

    def return_counts(self, counts: ChangeCounts) -> None:
        """Put taken counts back (their sync failed, so the changes are still pending)."""
        with self._lock:
            c = self.counts
            c.service_changes += counts.service_changes
            c.endpoint_changes += counts.endpoint_changes
            c.pending_services |= counts.pending_services
            c.pending_endpoints |= counts.pending_endpoints

    def _node_info(self) -> NodeInfo:
        n = self._node
        if n is None:
            return NodeInfo(name=self.node_name)
        return NodeInfo(name=n.name, labels=n.labels, addresses=n.addresses, pod_cidrs=n.pod_cidrs)


def _topology(node: ParsedNode | None) -> tuple[tuple[str, str], ...]:
    if node is None:
        return ()
    return tuple((k, v) for k, v in node.labels if k in TOPOLOGY_LABELS)


def build_service_ports(
    svc: ParsedService, slices: Sequence[ParsedSlice], node: NodeInfo
) -> tuple[ServicePort, ...]:
    """All ServicePorts of one Service, with endpoints resolved by slice port name."""
    out = []
    for port in svc.ports:
        name = ServicePortName(svc.namespace, svc.name, port.name, port.protocol)
        eps = _endpoints_for(port.name, port.protocol, slices, node.name)
        sp = ServicePort(
            name=name,
            cluster_ip=svc.cluster_ip,
            port=port.port,
            protocol=port.protocol,
            target_port=port.target_port,
            node_port=port.node_port,
            external_ips=svc.external_ips,
            load_balancer_ips=svc.load_balancer_ips,
            load_balancer_source_ranges=svc.source_ranges,
            health_check_node_port=svc.health_check_node_port,
            affinity_timeout=svc.affinity_timeout,
            external_policy_local=svc.external_policy_local,
            internal_policy_local=svc.internal_policy_local,
            annotations=svc.annotations,
            endpoints=eps,
        )
        out.append(categorize(sp, node))
    return tuple(out)


def _endpoints_for(
    port_name: str, protocol: Any, slices: Sequence[ParsedSlice], node_name: str
) -> tuple[Endpoint, ...]:
    by_addr: dict[str, Endpoint] = {}
    for sl in slices:
        for pname, proto, number in sl.ports:
            if pname != port_name or proto != protocol:
                continue
            for pe in sl.endpoints:
                ep = _endpoint(pe, number, node_name)
                prev = by_addr.get(ep.addr)
                # A duplicate (same ip:port in two slices, e.g. during a slice migration):
                # keep the more usable copy so a stale terminating copy never hides a ready one.
                if prev is None or _usability(ep) > _usability(prev):
                    by_addr[ep.addr] = ep
    return tuple(by_addr[k] for k in sorted(by_addr))


def _usability(ep: Endpoint) -> tuple[bool, bool, bool]:
    return (ep.ready, not ep.terminating, ep.serving)


def _endpoint(pe: ParsedEndpoint, port: int, node_name: str) -> Endpoint:
    return Endpoint(
        ip=pe.ip,
        port=port,
        node_name=pe.node_name,
        zone=pe.zone,
        ready=pe.ready,
        serving=pe.serving,
        terminating=pe.terminating,
        is_local=bool(node_name) and pe.node_name == node_name,
        zone_hints=pe.zone_hints,
        node_hints=pe.node_hints,
    )


def categorize(sp: ServicePort, node: NodeInfo) -> ServicePort:
    """Upstream's CategorizeEndpoints: which endpoints Cluster and Local policy may use."""
    from dataclasses import replace

    endpoints = sp.endpoints
    cluster: tuple[Endpoint, ...] = ()
    local: tuple[Endpoint, ...] = ()
    any_eps = False
    if sp.uses_cluster_endpoints:
        mode = _topology_mode(endpoints, node.name, node.zone)
        if mode == "node":
            cluster = tuple(e for e in endpoints if e.ready and node.name in e.node_hints)
        elif mode == "zone":
            cluster = tuple(e for e in endpoints if e.ready and node.zone in e.zone_hints)
        else:
            cluster = tuple(e for e in endpoints if e.ready)
        if not cluster:
            cluster = tuple(e for e in endpoints if e.serving and e.terminating)
        any_eps = bool(cluster)
    if sp.uses_local_endpoints:
        local_ready = any(e.is_local for e in endpoints if e.ready)
        local_st = any(e.is_local for e in endpoints if not e.ready and e.serving and e.terminating)
        any_eps = any_eps or any(e.ready or (e.serving and e.terminating) for e in endpoints)
        if local_ready:
            local = tuple(e for e in endpoints if e.is_local and e.ready)
        elif local_st:
            local = tuple(e for e in endpoints if e.is_local and e.serving and e.terminating)
    if not sp.uses_local_endpoints:
        reachable = cluster
    elif not sp.uses_cluster_endpoints:
        reachable = local
    else:
        merged = {e.addr: e for e in cluster}
        for e in local:
            merged.setdefault(e.addr, e)
        reachable = tuple(merged[k] for k in sorted(merged))
    return replace(
        sp,
        cluster_endpoints=cluster,
        local_endpoints=local,
        reachable_endpoints=reachable,
        any_endpoints=any_eps,
    )


def _topology_mode(endpoints: Iterable[Endpoint], node_name: str, zone: str) -> str:
    """Upstream's hint handling: "node" (PreferSameNode: every ready endpoint has node hints
    and one is for this node), else "zone" (every ready endpoint has zone hints and one is
    for this node's zone), else "" (hints are not used)."""
    all_node_hints = all_zone_hints = True
    for_node = for_zone = False
    ready = False
    for e in endpoints:
        if not e.ready:
            continue
        ready = True
        if not e.node_hints:
            all_node_hints = False
        elif node_name in e.node_hints:
            for_node = True
        if not e.zone_hints:
            all_zone_hints = False
        elif zone and zone in e.zone_hints:
            for_zone = True
    if not ready:
        return ""
    if all_node_hints and for_node and node_name:
        return "node"
    if all_zone_hints and for_zone:
        return "zone"
    return ""


def snapshot_from_objects(objects: Iterable[dict[str, Any]], node_name: str) -> Snapshot:
    """One-shot helper (render, tests): build a snapshot from plain object dicts."""
    return tracker_of(objects, node_name).snapshot()


def tracker_of(objects: Iterable[dict[str, Any]], node_name: str) -> ChangeTracker:
    """A ChangeTracker fed plain object dicts once."""
    tracker = ChangeTracker(node_name)
    tracker.apply([ObjectEvent(object_key(obj), obj) for obj in objects])
    return tracker


def object_key(obj: dict[str, Any]) -> ObjectKey:
    """The key a plain object dict is tracked under (namespace "default" when unset)."""
    kind = obj.get("kind", "")
    meta = obj.get("metadata") or {}
    ns = "" if kind == NODE else (meta.get("namespace") or "default")
    return ObjectKey(kind, ns, str(meta.get("name", "")))
