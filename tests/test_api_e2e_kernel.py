"""kproxy run against an API server, end to end in the lab, with real packets.

Objects are written over the Kubernetes REST API (create, replace, delete, merge patch), so
the same test drives either the in-memory API server (kproxy.lab.kubeapi, on the loopback of
the lab's node namespace, where `kproxy run --kubeconfig` reaches it) or, when KUBECONFIG is
set, a real cluster:

  KUBECONFIG=~/.kube/config KPROXY_E2E_NODE=<a node whose annotations the test may set> \
      pytest tests/test_api_e2e_kernel.py

With a real cluster the API server must be reachable from the lab's node namespace (routed
out of it); the test skips, saying so, when it is not. It creates a namespace of its own and
deletes it afterwards. An outage is a front end stopped (local) or the API server's address
rejected inside the node namespace (real cluster, which nobody can stop for a test).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import pytest

from kproxy.cluster.annotations import CURRENT_MODE, MODE_ANNOTATION, OBSERVED, SWITCH_STATE
from kproxy.dataplane.nftables.layouts import LAYOUTS, TABLES, UPSTREAM, dataplane_name
from kproxy.lab.kubeapi import KubeApiServer, KubeApiStore
from kproxy.lab.proxy import ProxyProcess, proxy_config
from kproxy.lab.topology import Lab
from kproxy.sources.kubeclient import ApiError, ClientSettings, connect, json_request

pytestmark = pytest.mark.kernel

PODS = ("10.244.0.2", "10.244.0.3", "10.244.0.4")
LIVE = 5.0  # seconds for an API change to reach the dataplane (watch + min sync period)


class Rest:
    """Blocking REST calls through kproxy's own client code (a fresh connection per call)."""

    def __init__(self, kubeconfig: Path) -> None:
        self.settings = ClientSettings(kubeconfig=str(kubeconfig))

    def __call__(
        self, method: str, path: str, body: object = None, content_type: str = "application/json"
    ) -> dict[str, Any]:
        async def go() -> dict[str, Any]:
            conn = await connect(self.settings)
            try:
                return await json_request(conn, method, path, body=body, content_type=content_type)
            finally:
                await conn.close()

        return asyncio.run(go())

    def server(self) -> str:
        async def go() -> str:
            conn = await connect(self.settings)
            await conn.close()
            return conn.host

        return asyncio.run(go())


class Cluster(Protocol):
    node: str
    namespace: str
    rest: Rest
    kubeconfig_for_kproxy: Path

    def outage(self) -> contextlib.AbstractContextManager[None]: ...


class LocalCluster:
    """The in-memory server: one front end in the node namespace (kproxy's), one in ours."""

    def __init__(self, lab: Lab, tmp_path: Path) -> None:
        self.node = "node1"
        self.namespace = "default"
        self.store = KubeApiStore(bookmark_interval=1.0)
        self.store.apply(
            {
                "kind": "Node",
                "metadata": {
                    "name": self.node,
                    "labels": {"kubernetes.io/hostname": self.node},
                },
                "spec": {"podCIDR": "10.244.0.0/24", "podCIDRs": ["10.244.0.0/24"]},
                "status": {"addresses": [{"type": "InternalIP", "address": lab.node_ip}]},
            }
        )
        self.for_kproxy = KubeApiServer(self.store, netns=lab.node_ns).start()
        self.for_test = KubeApiServer(self.store).start()
        self.kubeconfig_for_kproxy = self.for_kproxy.kubeconfig(tmp_path / "kproxy.kubeconfig")
        self.rest = Rest(self.for_test.kubeconfig(tmp_path / "test.kubeconfig"))

    @contextlib.contextmanager
    def outage(self) -> Iterator[None]:
        self.for_kproxy.stop()
        try:
            yield
        finally:
            self.for_kproxy.start()

    def close(self) -> None:
        self.for_kproxy.stop()
        self.for_test.stop()


class RealCluster:
    """A real cluster from KUBECONFIG; objects go to a namespace of the test's own."""

    def __init__(self, lab: Lab, kubeconfig: Path, node: str) -> None:
        self.lab = lab
        self.node = node
        self.namespace = f"kproxy-e2e-{secrets.token_hex(3)}"
        self.rest = Rest(kubeconfig)
        self.kubeconfig_for_kproxy = kubeconfig
        self.url = urlsplit(self.rest.server())
        if not self._reachable():
            pytest.skip(f"{self.url.netloc} is not reachable from the lab's node namespace")
        self.rest(
            "POST",
            "/api/v1/namespaces",
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": self.namespace}},
        )

    def _reachable(self) -> bool:
        host, port = self.url.hostname or "", self.url.port or 443
        probe = f"import socket; socket.create_connection(({host!r}, {port}), timeout=3)"
        return (
            self.lab.exec(self.lab.node_ns, ["python3", "-c", probe], check=False).returncode == 0
        )

    @contextlib.contextmanager
    def outage(self) -> Iterator[None]:
        host, port = self.url.hostname or "", str(self.url.port or 443)
        rule = ["OUTPUT", "-d", host, "-p", "tcp", "--dport", port, "-j", "REJECT"]
        rule += ["--reject-with", "tcp-reset"]
        self.lab.exec(self.lab.node_ns, ["iptables", "-I", *rule])
        try:
            yield
        finally:
            self.lab.exec(self.lab.node_ns, ["iptables", "-D", *rule])

    def close(self) -> None:
        with contextlib.suppress(ApiError, OSError):
            self.rest("DELETE", f"/api/v1/namespaces/{self.namespace}")
        with contextlib.suppress(ApiError, OSError):
            set_mode_annotation(self, None)


@pytest.fixture
def cluster(lab: Lab, tmp_path: Path) -> Iterator[LocalCluster | RealCluster]:
    kubeconfig = os.environ.get("KUBECONFIG", "")
    c: LocalCluster | RealCluster
    if kubeconfig:
        node = os.environ.get("KPROXY_E2E_NODE", "")
        if not node:
            pytest.skip("KUBECONFIG is set: name a Node the test may annotate in KPROXY_E2E_NODE")
        c = RealCluster(lab, Path(kubeconfig.split(os.pathsep)[0]), node)
    else:
        c = LocalCluster(lab, tmp_path)
    try:
        yield c
    finally:
        c.close()


# --- objects --------------------------------------------------------------------------------------


def create_service(c: Cluster, name: str) -> str:
    """A selector-less Service (its EndpointSlices are ours); returns its ClusterIP."""
    svc = c.rest(
        "POST",
        f"/api/v1/namespaces/{c.namespace}/services",
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name, "namespace": c.namespace},
            "spec": {"ports": [{"name": "http", "port": 80, "targetPort": 8080}]},
        },
    )
    return str(svc["spec"]["clusterIP"])


def slice_body(c: Cluster, service: str, pods: tuple[str, ...]) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{service}-1",
            "namespace": c.namespace,
            "labels": {
                "kubernetes.io/service-name": service,
                "endpointslice.kubernetes.io/managed-by": "kproxy-e2e",
            },
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": [
            {"addresses": [ip], "nodeName": c.node, "conditions": {"ready": True}} for ip in pods
        ],
    }


def set_slice(c: Cluster, service: str, pods: tuple[str, ...], *, create: bool = False) -> None:
    path = f"/apis/discovery.k8s.io/v1/namespaces/{c.namespace}/endpointslices"
    if create:
        c.rest("POST", path, slice_body(c, service, pods))
    else:
        c.rest("PUT", f"{path}/{service}-1", slice_body(c, service, pods))


def delete_service(c: Cluster, name: str) -> None:
    c.rest("DELETE", f"/apis/discovery.k8s.io/v1/namespaces/{c.namespace}/endpointslices/{name}-1")
    c.rest("DELETE", f"/api/v1/namespaces/{c.namespace}/services/{name}")


def set_mode_annotation(c: Cluster, mode: str | None) -> None:
    c.rest(
        "PATCH",
        f"/api/v1/nodes/{c.node}",
        {"metadata": {"annotations": {MODE_ANNOTATION: mode}}},
        content_type="application/merge-patch+json",
    )


def node_annotations(c: Cluster) -> dict[str, str]:
    node = c.rest("GET", f"/api/v1/nodes/{c.node}")
    return dict(node["metadata"].get("annotations") or {})


def node_events(c: Cluster) -> list[dict[str, Any]]:
    selector = f"involvedObject.name={c.node}"
    events = c.rest("GET", f"/api/v1/namespaces/default/events?fieldSelector={selector}")
    return [e for e in events["items"] if e.get("reportingComponent") == "kproxy"]


# --- helpers ------------------------------------------------------------------------------------


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if check():
            return time.monotonic() - start
        time.sleep(0.05)
    pytest.fail(f"{what}: not within {timeout} s")


def answers(lab: Lab, ip: str) -> bool:
    return lab.agent(lab.client_ns[0]).request(proto="tcp", dst=ip, port=80, timeout=0.3).ok


def pods_answering(lab: Lab, ip: str, count: int = 30) -> set[str]:
    # 30 requests over 3 endpoints miss one with a probability of 3 * (2/3)^30, about 2e-5.
    results = lab.agent(lab.client_ns[0]).request_many(
        proto="tcp", dst=ip, port=80, count=count, timeout=0.5
    )
    return {r.pod or f"error:{r.error}" for r in results}


def start_kproxy(
    lab: Lab, c: Cluster, tmp_path: Path, mode: str = "iptables", layout: str = UPSTREAM
) -> ProxyProcess:
    """kproxy following the Node; nftables mode (configured or annotated) in `layout`."""
    cfg = tmp_path / "config.yaml"
    cfg.write_text(proxy_config(mode, node=c.node, kubeconfig=c.kubeconfig_for_kproxy))
    args = ["--iptables-backend", "nft", "--nftables-layout", layout]
    return ProxyProcess(lab, None, config=cfg, args=args, workdir=tmp_path / "kproxy").start(
        timeout=30
    )


def live_modes(lab: Lab) -> set[str]:
    """The dataplanes in the node: modes, nftables mode in a layout by its dataplane name."""
    nat = lab.exec(lab.node_ns, ["iptables-nft-save", "-t", "nat"]).stdout
    modes = set()
    if "-A PREROUTING" in nat and "-j KUBE-SERVICES" in nat:
        modes.add("iptables")
    tables = lab.exec(lab.node_ns, ["nft", "list", "tables"]).stdout.splitlines()
    modes |= {dataplane_name(lay) for lay, t in TABLES.items() if f"table ip {t}" in tables}
    return modes


def nat_rules(lab: Lab) -> list[str]:
    out = lab.exec(lab.node_ns, ["iptables-nft-save", "-t", "nat"]).stdout
    return sorted(line for line in out.splitlines() if line.startswith("-A KUBE-"))


# --- the tests ------------------------------------------------------------------------------------


def test_api_objects_are_proxied_and_an_outage_changes_nothing(
    lab: Lab, cluster: LocalCluster | RealCluster, tmp_path: Path
) -> None:
    web = create_service(cluster, "web")
    set_slice(cluster, "web", PODS, create=True)
    proxy = start_kproxy(lab, cluster, tmp_path)
    try:
        assert pods_answering(lab, web) == {"pod1", "pod2", "pod3"}

        # Created through the API: reachable; deleted: gone.
        api = create_service(cluster, "api")
        set_slice(cluster, "api", PODS[:1], create=True)
        wait_until(lambda: answers(lab, api), LIVE, "a new service answering")
        set_slice(cluster, "web", PODS[2:])
        wait_until(lambda: pods_answering(lab, web) == {"pod3"}, LIVE, "web only on pod3")
        delete_service(cluster, "api")
        wait_until(lambda: not answers(lab, api), LIVE, "a deleted service refusing")

        # The API server goes away: the dataplane stays exactly as it was.
        rules = nat_rules(lab)
        syncs = proxy.status().get("syncs", 0)
        with cluster.outage():
            set_slice(cluster, "web", PODS[:2])  # not seen by kproxy until the end
            time.sleep(3.0)  # several list/watch retries
            assert proxy.proc is not None and proxy.proc.poll() is None
            assert pods_answering(lab, web) == {"pod3"}
            assert nat_rules(lab) == rules
            log = proxy.log_path.read_text()
            assert "retrying with backoff (the dataplane keeps its current state)" in log
        assert proxy.status().get("syncs", 0) >= syncs

        # Back: the change made meanwhile arrives (resumed watch or relist).
        wait_until(
            lambda: pods_answering(lab, web) == {"pod1", "pod2"}, LIVE + 30, "the change after"
        )
        status = proxy.status()
        assert status["last_error"] is None and not status["invalid_objects"]
    finally:
        proxy.stop()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_node_annotation_switches_the_mode_and_reports_back(
    lab: Lab, cluster: LocalCluster | RealCluster, tmp_path: Path, layout: str
) -> None:
    """The annotation names the mode alone: nftables mode comes in the layout kproxy was
    started with."""
    web = create_service(cluster, "web")
    set_slice(cluster, "web", PODS, create=True)
    proxy = start_kproxy(lab, cluster, tmp_path, mode="iptables", layout=layout)
    try:
        assert answers(lab, web)
        wait_until(
            lambda: node_annotations(cluster).get(CURRENT_MODE) == "iptables",
            LIVE,
            "current mode reported",
        )

        set_mode_annotation(cluster, "nftables")
        wait_until(
            lambda: node_annotations(cluster).get(SWITCH_STATE) == "succeeded",
            60,
            "the declared switch",
        )
        ann = node_annotations(cluster)
        assert ann[CURRENT_MODE] == "nftables" and ann[OBSERVED] == "nftables"
        assert live_modes(lab) == {dataplane_name(layout)}
        status = proxy.status()
        assert (status["mode"], status["nftables_layout"]) == ("nftables", layout)
        assert pods_answering(lab, web) == {"pod1", "pod2", "pod3"}
        reasons = [e["reason"] for e in node_events(cluster)]
        assert "ProxyModeSwitching" in reasons and "ProxyModeSwitched" in reasons

        # A restart comes up in the declared mode directly (no switch needed).
        proxy.stop()
        proxy = start_kproxy(lab, cluster, tmp_path, mode="iptables", layout=layout)
        status = proxy.status()
        assert (status["mode"], status["nftables_layout"]) == ("nftables", layout)
        assert status["last_switch"] is None
        assert live_modes(lab) == {dataplane_name(layout)}

        # Removing the annotation leads back to the configured mode.
        set_mode_annotation(cluster, None)
        wait_until(
            lambda: node_annotations(cluster).get(CURRENT_MODE) == "iptables",
            60,
            "back to the configured mode",
        )
        assert live_modes(lab) == {"iptables"}
        assert answers(lab, web)
    finally:
        proxy.stop()
