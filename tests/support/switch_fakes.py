"""Fake dataplanes for ModeSwitcher, a snapshot to switch with and the kernel state that
programs it (no kernel)."""

from __future__ import annotations

import json

from kproxy.dataplane.base import Dataplane, SyncResult
from kproxy.model.objects import Snapshot
from kproxy.model.snapshot import snapshot_from_objects
from tests.support.objects import endpoint, endpoint_slice, port, service


class Plane(Dataplane):
    def __init__(self, mode: str, calls: list[str]) -> None:
        self.mode = mode
        self.calls = calls

    def sync(self, snapshot: Snapshot, *, full: bool) -> SyncResult:
        self.calls.append(f"{self.mode}.sync")
        return SyncResult(full=full, services=len(snapshot.services))

    def detach(self) -> None:
        self.calls.append(f"{self.mode}.detach")

    def cleanup(self, *, dry_run: bool = False) -> list:
        self.calls.append(f"{self.mode}.cleanup")
        return []

    def drifted(self) -> bool:
        return False

    def owned(self) -> list:
        return []


SNAP = snapshot_from_objects(
    [
        service("web", "10.96.0.10", [port("http", 80, 8080)], externalIPs=["10.99.0.10"]),
        endpoint_slice("web", [endpoint("10.244.0.2")], [port("http", 8080)]),
        service("empty", "10.96.0.11", [port("http", 80, 8080)]),
    ],
    "node1",
)


def kernel_with(*ips: str) -> dict:
    """A snapshot whose nftables service-ips map holds these ClusterIP/externalIP keys."""
    elems = [
        [{"concat": [ip, "tcp", 80]}, {"goto": {"target": "service-X-default/web/tcp/http"}}]
        for ip in ips
    ]
    service_ips = {"family": "ip", "table": "kube-proxy", "name": "service-ips", "elem": elems}
    table = {"nftables": [{"map": service_ips}]}
    return {"format": "kproxy-snapshot/v1", "nftables": {"output": json.dumps(table)}}


PROGRAMMED = kernel_with("10.96.0.10", "10.99.0.10")
