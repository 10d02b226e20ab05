"""Builders for the Kubernetes objects tests feed kproxy (plain dicts, as YAML gives them)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml


def service(
    name: str,
    cluster_ip: str,
    ports: Sequence[dict[str, Any]],
    *,
    namespace: str = "default",
    type: str = "ClusterIP",
    **spec: Any,
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"type": type, "clusterIP": cluster_ip, "ports": list(ports), **spec},
    }


def port(
    name: str, port: int, target: int | str | None = None, *, protocol: str = "TCP", **extra: Any
) -> dict[str, Any]:
    out: dict[str, Any] = {"name": name, "port": port, "protocol": protocol, **extra}
    if target is not None:
        out["targetPort"] = target
    return out


def endpoint(ip: str, node: str = "node1", **conditions: bool) -> dict[str, Any]:
    ep: dict[str, Any] = {"addresses": [ip], "nodeName": node}
    if conditions:
        ep["conditions"] = conditions
    return ep


def endpoint_slice(
    service_name: str,
    endpoints: Iterable[dict[str, Any]],
    ports: Sequence[dict[str, Any]],
    *,
    name: str | None = None,
    namespace: str = "default",
) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name or f"{service_name}-1",
            "namespace": namespace,
            "labels": {"kubernetes.io/service-name": service_name},
        },
        "addressType": "IPv4",
        "ports": list(ports),
        "endpoints": list(endpoints),
    }


def node(
    name: str = "node1", *, pod_cidr: str = "10.244.0.0/24", ip: str = "10.100.0.1", **labels: str
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **labels}},
        "spec": {"podCIDR": pod_cidr, "podCIDRs": [pod_cidr]},
        "status": {"addresses": [{"type": "InternalIP", "address": ip}]},
    }


def write(path: Path, *objects: dict[str, Any]) -> Path:
    """Write objects as one multi-document YAML file atomically (as editors do)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(yaml.safe_dump_all(objects, sort_keys=False))
    tmp.replace(path)
    return path
