"""A lab node running `kproxy run` in one mode, and the web service the kernel tests probe."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from kproxy.lab.agent import ProbeResult
from kproxy.lab.proxy import ProxyProcess
from kproxy.lab.topology import Lab
from tests.support.objects import endpoint, endpoint_slice, port, service, write

LIVE_DEADLINE = 2.0  # the bound for a source edit to reach the dataplane
POD_IPS = ("10.244.0.2", "10.244.0.3", "10.244.0.4")
WEB_PORTS = [port("http", 80, "http")]
WEB_SLICE_PORTS = [port("http", 8080)]


@dataclass
class Env:
    lab: Lab
    source: Path
    proxy: ProxyProcess
    mode: str
    backend: str
    config: Path

    @property
    def plane(self) -> str:
        """The dataplane's name in snapshots: iptables-nft, iptables-legacy or nftables."""
        return f"{self.mode}-{self.backend}" if self.backend else self.mode

    def client(self, i: int = 0):
        return self.lab.agent(self.lab.client_ns[i])

    def sync(self) -> None:
        """Wait for the next completed sync (after a source edit)."""
        before = self.proxy.status().get("syncs", 0)
        self.proxy.wait_synced(after=before, timeout=LIVE_DEADLINE + 3)


def web(
    env: Env,
    *,
    pods: tuple[str, ...] = POD_IPS,
    nodes: dict[str, str] | None = None,
    ports: list[dict[str, object]] | None = None,
    **spec: object,
) -> None:
    nodes = nodes or {}
    write(
        env.source / "web.yaml",
        service("web", "10.96.0.10", ports or WEB_PORTS, **spec),
        endpoint_slice(
            "web", [endpoint(ip, nodes.get(ip, "node1")) for ip in pods], WEB_SLICE_PORTS
        ),
    )


def pods_of(results: list[ProbeResult]) -> Counter[str]:
    return Counter(r.pod or f"error:{r.error}" for r in results)
