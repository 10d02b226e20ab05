"""Builders for the object-model tests: Kubernetes dicts where every field left out is absent
(the model's defaults and rejections are what those tests check), and ways to look into the
resulting Snapshot."""

from __future__ import annotations

from typing import Any

from kproxy.model.objects import Endpoint, Protocol, ServicePort, ServicePortName, Snapshot

NODE = "node-a"
ZONE_LABEL = "topology.kubernetes.io/zone"


def service(
    name: str = "svc",
    ns: str = "ns",
    *,
    ports: list[dict[str, Any]] | None = None,
    cluster_ip: str | None = "10.96.0.10",
    svc_type: str | None = None,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    status: dict[str, Any] | None = None,
    spec: dict[str, Any] | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "ports": ports if ports is not None else [sport("http", 80, target=8080)],
    }
    if cluster_ip is not None:
        body["clusterIP"] = cluster_ip
    if svc_type is not None:
        body["type"] = svc_type
    body.update(spec or {})
    meta: dict[str, Any] = {"name": name, "namespace": ns}
    if labels:
        meta["labels"] = labels
    if annotations:
        meta["annotations"] = annotations
    obj: dict[str, Any] = {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": body}
    if status is not None:
        obj["status"] = status
    return obj


def sport(
    name: str | None,
    port: int,
    *,
    protocol: str | None = "TCP",
    target: int | str | None = None,
    node_port: int | None = None,
) -> dict[str, Any]:
    out: dict[str, Any] = {"port": port}
    if name is not None:
        out["name"] = name
    if protocol is not None:
        out["protocol"] = protocol
    if target is not None:
        out["targetPort"] = target
    if node_port is not None:
        out["nodePort"] = node_port
    return out


def endpoint(
    ip: str,
    *,
    node: str | None = None,
    zone: str | None = None,
    ready: bool | None = None,
    serving: bool | None = None,
    terminating: bool | None = None,
    zones: list[str] | None = None,
    nodes: list[str] | None = None,
) -> dict[str, Any]:
    ep: dict[str, Any] = {"addresses": [ip]}
    if node is not None:
        ep["nodeName"] = node
    if zone is not None:
        ep["zone"] = zone
    cond = {
        k: v
        for k, v in (("ready", ready), ("serving", serving), ("terminating", terminating))
        if v is not None
    }
    if cond:
        ep["conditions"] = cond
    hints: dict[str, Any] = {}
    if zones is not None:
        hints["forZones"] = [{"name": z} for z in zones]
    if nodes is not None:
        hints["forNodes"] = [{"name": n} for n in nodes]
    if hints:
        ep["hints"] = hints
    return ep


def eslice(
    name: str,
    svc: str = "svc",
    ns: str = "ns",
    *,
    endpoints: list[dict[str, Any]],
    ports: list[dict[str, Any]] | None = None,
    address_type: str = "IPv4",
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": ns,
        "labels": {"kubernetes.io/service-name": svc},
    }
    if annotations:
        meta["annotations"] = annotations
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": meta,
        "addressType": address_type,
        "ports": ports if ports is not None else [eport("http", 8080)],
        "endpoints": endpoints,
    }


def eport(name: str | None, port: int | None, protocol: str | None = "TCP") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if name is not None:
        out["name"] = name
    if port is not None:
        out["port"] = port
    if protocol is not None:
        out["protocol"] = protocol
    return out


def node(
    name: str = NODE,
    *,
    zone: str | None = None,
    addresses: tuple[str, ...] = ("192.168.0.10",),
    pod_cidrs: tuple[str, ...] = ("10.244.1.0/24",),
) -> dict[str, Any]:
    labels = {"kubernetes.io/hostname": name}
    if zone is not None:
        labels[ZONE_LABEL] = zone
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels},
        "spec": {"podCIDRs": list(pod_cidrs)},
        "status": {"addresses": [{"type": "InternalIP", "address": a} for a in addresses]},
    }


def spn(
    name: str = "svc", port: str = "http", ns: str = "ns", proto: Protocol = Protocol.TCP
) -> ServicePortName:
    return ServicePortName(ns, name, port, proto)


def addrs(eps: tuple[Endpoint, ...]) -> list[str]:
    return [e.addr for e in eps]


def one(s: Snapshot, name: ServicePortName | None = None) -> ServicePort:
    return s.services[name or spn()]
