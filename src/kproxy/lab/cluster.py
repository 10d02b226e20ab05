"""The lab as a small cluster: several nodes (Lab(nodes=N)), one Kubernetes API stand-in that
every node reaches on its own loopback, a kproxy per node following its Node, and a Service
whose endpoints sit on every node.

It is what a cluster rollout is proven on: the rollout controller talks to the same store
(through a front end in the caller's namespace), traffic crosses every node's rules (from a
pod on the node to the ClusterIP, and from a client to the node's NodePort).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kproxy.lab.kubeapi import KubeApiServer, KubeApiStore
from kproxy.lab.load import LoadHarness, LoadResult
from kproxy.lab.proxy import ProxyProcess, proxy_config
from kproxy.lab.topology import Lab, LabNode
from kproxy.sources.clientsettings import ClientSettings

SERVICE = "web"
NAMESPACE = "default"
NODE_PORT = 30080
ZONE_LABEL = "topology.kubernetes.io/zone"


def node_object(node: LabNode, zone: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": node.name,
            "labels": {"kubernetes.io/hostname": node.name, ZONE_LABEL: zone},
        },
        "spec": {"podCIDR": node.pod_cidr, "podCIDRs": [node.pod_cidr]},
        "status": {
            "addresses": [{"type": "InternalIP", "address": node.ip}],
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


@dataclass
class ClusterLab:
    """Start with start(), end with stop() (or use it as a context manager)."""

    lab: Lab
    workdir: Path
    mode: str = "iptables"
    zones: tuple[str, ...] = ("zone-a", "zone-b")
    services: int = 0  # more Services beside "web" (scale), each with the same endpoints
    store: KubeApiStore = field(default_factory=lambda: KubeApiStore(bookmark_interval=1.0))
    # node name -> a folder searched before PATH by that node's kproxy (a broken tool)
    path_prefixes: dict[str, Path] = field(default_factory=dict)
    # node name -> that node's kproxy's --nftables-layout (absent: upstream's, the default)
    nftables_layouts: dict[str, str] = field(default_factory=dict)
    backend: str = "nft"  # kproxy's --iptables-backend (UML guests: legacy)
    fast_sync: bool = True  # syncs within 100 ms; False: the mode's periods (upstream's)
    start_timeout: float = 60.0  # for every proxy's first sync
    proxies: dict[str, ProxyProcess] = field(default_factory=dict)
    cluster_ip: str = ""
    _servers: list[KubeApiServer] = field(default_factory=list)
    _ours: KubeApiServer | None = None

    # Pods that send traffic (the first pod of each node) and pods that serve it (the rest).
    @property
    def sources(self) -> dict[str, str]:
        """node name -> the namespace of the pod on it that sends traffic."""
        out: dict[str, str] = {}
        for pod, node in self.lab.pod_nodes.items():
            out.setdefault(node.name, self.lab.pod_ns_of(pod))
        return out

    @property
    def endpoints(self) -> list[tuple[str, LabNode]]:
        senders = set(self.sources.values())
        return [
            (self.lab.pod_ips[pod], node)
            for pod, node in self.lab.pod_nodes.items()
            if self.lab.pod_ns_of(pod) not in senders
        ]

    def settings(self) -> ClientSettings:
        """Connection settings for the caller (a rollout controller, the CLI)."""
        assert self._ours is not None
        return ClientSettings(kubeconfig=str(self._ours.kubeconfig(self.workdir / "kubeconfig")))

    def start(self) -> ClusterLab:
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            for i, node in enumerate(self.lab.nodes):
                self.store.apply(node_object(node, self.zones[i % len(self.zones)]))
            self._create_service()
            for i in range(self.services):
                self._create_extra_service(i)
            self._ours = KubeApiServer(self.store).start()
            for node in self.lab.nodes:
                self._start_proxy(node)
            for proxy in self.proxies.values():
                proxy.wait_synced(timeout=self.start_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _create_service(self) -> None:
        service = self.store.create(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": SERVICE, "namespace": NAMESPACE},
                "spec": {
                    "type": "NodePort",
                    "ports": [
                        {"name": "http", "port": 80, "targetPort": 8080, "nodePort": NODE_PORT},
                        {"name": "dns", "port": 53, "targetPort": 8080, "protocol": "UDP"},
                    ],
                },
            }
        )
        self.cluster_ip = service["spec"]["clusterIP"]
        self.store.create(
            {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": f"{SERVICE}-1",
                    "namespace": NAMESPACE,
                    "labels": {"kubernetes.io/service-name": SERVICE},
                },
                "addressType": "IPv4",
                "ports": [
                    {"name": "http", "port": 8080, "protocol": "TCP"},
                    {"name": "dns", "port": 8080, "protocol": "UDP"},
                ],
                "endpoints": [
                    {"addresses": [ip], "nodeName": node.name, "conditions": {"ready": True}}
                    for ip, node in self.endpoints
                ],
            }
        )

    def _create_extra_service(self, i: int) -> None:
        name = f"svc{i:05d}"
        self.store.create(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": name, "namespace": NAMESPACE},
                "spec": {"ports": [{"name": "http", "port": 80, "targetPort": 8080}]},
            }
        )
        self.store.create(
            {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": f"{name}-1",
                    "namespace": NAMESPACE,
                    "labels": {"kubernetes.io/service-name": name},
                },
                "addressType": "IPv4",
                "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
                "endpoints": [
                    {"addresses": [ip], "nodeName": node.name, "conditions": {"ready": True}}
                    for ip, node in self.endpoints
                ],
            }
        )

    def _start_proxy(self, node: LabNode) -> None:
        server = KubeApiServer(self.store, netns=node.ns).start()
        self._servers.append(server)
        home = self.workdir / node.name
        home.mkdir(parents=True, exist_ok=True)
        config = home / "config.yaml"
        kubeconfig = server.kubeconfig(home / "kubeconfig")
        config.write_text(
            proxy_config(
                self.mode,
                node=node.name,
                kubeconfig=kubeconfig,
                sync_period="30s" if self.fast_sync else None,
            )
        )
        args = ["--iptables-backend", self.backend]
        if node.name in self.nftables_layouts:
            args += ["--nftables-layout", self.nftables_layouts[node.name]]
        proxy = ProxyProcess(
            self.lab,
            None,
            config=config,
            args=args,
            workdir=home / "kproxy",
            node=node,
            path_prefix=self.path_prefixes.get(node.name),
        )
        self.proxies[node.name] = proxy.start(wait=False)

    def node_annotations(self, name: str) -> dict[str, str]:
        node = self.store.get("Node", "", name) or {}
        return dict((node.get("metadata") or {}).get("annotations") or {})

    def load(self, **kwargs: Any) -> ClusterLoad:
        """Traffic through every node: ClusterIP from its pod, NodePort from a client."""
        return ClusterLoad(self, **kwargs)

    def stop(self) -> None:
        for proxy in self.proxies.values():
            proxy.stop()
        for server in [*self._servers, *([self._ours] if self._ours else [])]:
            server.stop()

    def __enter__(self) -> ClusterLab:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


class ClusterLoad:
    """One LoadHarness per path: each node's ClusterIP (TCP, UDP and long-lived streams from
    the node's own pod) and each node's NodePort (fresh TCP from a client)."""

    def __init__(self, cluster: ClusterLab, *, fresh_interval: float = 0.02) -> None:
        lab, ip = cluster.lab, cluster.cluster_ip
        self.harnesses: dict[str, LoadHarness] = {}
        for node in lab.nodes:
            source = cluster.sources[node.name]
            self.harnesses[f"{node.name} clusterIP"] = LoadHarness(
                lab,
                tcp=(ip, 80),
                udp=(ip, 53),
                streams=2,
                fresh_interval=fresh_interval,
                fresh_from=source,
                streams_from=source,
            )
            self.harnesses[f"{node.name} nodePort"] = LoadHarness(
                lab,
                tcp=(node.ip, NODE_PORT),
                streams=0,
                fresh_interval=fresh_interval,
                fresh_from=lab.client_ns[0],
            )

    def start(self) -> ClusterLoad:
        for h in self.harnesses.values():
            h.start()
        return self

    def stop(self) -> dict[str, LoadResult]:
        return {name: h.stop() for name, h in self.harnesses.items()}


def failures(results: dict[str, LoadResult]) -> dict[str, str]:
    """The paths that saw a failure, with their summaries (empty: not one failed request)."""
    return {name: r.summary() for name, r in results.items() if r.failures or r.streams_dropped}
