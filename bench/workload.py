"""The benchmark cluster: N ClusterIP services with 10 endpoints each, as objects and files.

Same shape as dataplane-lab.md §2.1: one TCP port per service, 10 ready endpoints on other
nodes, so every service owns one KUBE-SVC chain and 10 KUBE-SEP chains (32 rules in the
kernel per service). A "change" replaces the 10 endpoints of one service with 10 new ones:
10 new SEP chains, 10 stale ones, KUBE-SERVICES unchanged.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kproxy.config import load_config, rule_options
from kproxy.dataplane.facts import NodeFacts, RuleOptions
from kproxy.model.objects import Snapshot
from kproxy.model.snapshot import ChangeTracker
from kproxy.sources.base import ENDPOINT_SLICE, NODE, SERVICE, ObjectEvent, ObjectKey

NODE_NAME = "node1"
NODE_IP = "10.100.0.1"
NAMESPACE = "bench"
ENDPOINTS_PER_SERVICE = 10
CLUSTER_CIDR = "10.128.0.0/9"
_SERVICE_BASE = int(ipaddress.IPv4Address("10.96.0.10"))
_POD_BASE = int(ipaddress.IPv4Address("10.128.1.0"))
# Replacement endpoints of a changed service come from here, so they never collide.
_CHANGED_BASE = int(ipaddress.IPv4Address("10.250.0.0"))


def config_yaml(mode: str = "iptables") -> str:
    """The bench's KubeProxyConfiguration in a proxy mode. The mode goes in the file: with a
    config file, `kproxy run` ignores --proxy-mode (as upstream ignores its flags)."""
    return f"""\
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: {mode}
hostnameOverride: {NODE_NAME}
clusterCIDR: {CLUSTER_CIDR}
{mode}: {{minSyncPeriod: 1s, syncPeriod: 30s}}
conntrack: {{maxPerCore: 0}}
"""


CONFIG_YAML = config_yaml()


def _ip(n: int) -> str:
    return str(ipaddress.IPv4Address(n))


def service_name(i: int) -> str:
    return f"svc-{i:05d}"


def service_obj(i: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": SERVICE,
        "metadata": {"name": service_name(i), "namespace": NAMESPACE},
        "spec": {
            "type": "ClusterIP",
            "clusterIP": _ip(_SERVICE_BASE + i),
            "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}],
        },
    }


def endpoint_ips(i: int, generation: int = 0) -> list[str]:
    """The 10 endpoint IPs of service i; generation > 0 gives a disjoint replacement set."""
    if generation == 0:
        base = _POD_BASE + i * ENDPOINTS_PER_SERVICE
    else:
        base = _CHANGED_BASE + (generation * 100_000 + i) * ENDPOINTS_PER_SERVICE
    return [_ip(base + k) for k in range(ENDPOINTS_PER_SERVICE)]


def slice_obj(i: int, generation: int = 0) -> dict[str, Any]:
    eps = [
        {"addresses": [ip], "nodeName": f"node-{k + 2}", "conditions": {"ready": True}}
        for k, ip in enumerate(endpoint_ips(i, generation))
    ]
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": ENDPOINT_SLICE,
        "metadata": {
            "name": f"{service_name(i)}-1",
            "namespace": NAMESPACE,
            "labels": {"kubernetes.io/service-name": service_name(i)},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": eps,
    }


def node_obj() -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": NODE,
        "metadata": {"name": NODE_NAME, "labels": {"kubernetes.io/hostname": NODE_NAME}},
        "spec": {"podCIDR": "10.128.0.0/24", "podCIDRs": ["10.128.0.0/24"]},
        "status": {"addresses": [{"type": "InternalIP", "address": NODE_IP}]},
    }


def objects(n: int) -> Iterator[dict[str, Any]]:
    yield node_obj()
    for i in range(n):
        yield service_obj(i)
        yield slice_obj(i)


def event(obj: dict[str, Any]) -> ObjectEvent:
    meta = obj["metadata"]
    ns = "" if obj["kind"] == NODE else meta.get("namespace", "default")
    return ObjectEvent(ObjectKey(obj["kind"], ns, meta["name"]), obj)


def tracker(n: int) -> ChangeTracker:
    """A tracker holding the whole cluster, as a daemon's is after its initial batch."""
    t = ChangeTracker(NODE_NAME)
    t.apply([event(o) for o in objects(n)])
    return t


def change_one(t: ChangeTracker, i: int, generation: int) -> Snapshot:
    """Replace the endpoints of service i (one EndpointSlice event) and take the snapshot."""
    t.apply([event(slice_obj(i, generation))])
    return t.snapshot()


def facts() -> NodeFacts:
    """What detect_node_facts finds in a bench namespace (given, so every run is equal)."""
    return NodeFacts(node_ips=(NODE_IP,), local_addresses=("127.0.0.1",), random_fully=True)


def options(config_path: Path) -> RuleOptions:
    """The rule options `kproxy run --config CONFIG_YAML` uses."""
    return rule_options(load_config(config_path))


# --- files for `kproxy run` ------------------------------------------------------------------

_FILE = """\
apiVersion: v1
kind: Service
metadata:
  name: {name}
  namespace: {ns}
spec:
  type: ClusterIP
  clusterIP: {cip}
  ports:
  - name: http
    port: 80
    protocol: TCP
    targetPort: 8080
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {name}-1
  namespace: {ns}
  labels:
    kubernetes.io/service-name: {name}
addressType: IPv4
ports:
- name: http
  port: 8080
  protocol: TCP
endpoints:
{endpoints}"""

_ENDPOINT = """\
- addresses: [{ip}]
  nodeName: node-{node}
  conditions: {{ready: true}}
"""

_NODE_FILE = f"""\
apiVersion: v1
kind: Node
metadata:
  name: {NODE_NAME}
  labels: {{kubernetes.io/hostname: {NODE_NAME}}}
spec:
  podCIDR: 10.128.0.0/24
  podCIDRs: [10.128.0.0/24]
status:
  addresses: [{{type: InternalIP, address: {NODE_IP}}}]
"""


def write_source(folder: Path, n: int) -> None:
    """One YAML file per service (Service + EndpointSlice), plus the Node, as `kproxy run`
    reads them (same objects as `objects(n)`)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "node.yaml").write_text(_NODE_FILE)
    for i in range(n):
        eps = "".join(_ENDPOINT.format(ip=ip, node=k + 2) for k, ip in enumerate(endpoint_ips(i)))
        text = _FILE.format(
            name=service_name(i), ns=NAMESPACE, cip=_ip(_SERVICE_BASE + i), endpoints=eps
        )
        (folder / f"{service_name(i)}.yaml").write_text(text)
