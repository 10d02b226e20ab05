"""Cluster rollouts on the lab as a cluster: four node namespaces, a kproxy on each following
its Node through the lab's API server, the rollout controller in this process, and traffic
through every node's ClusterIP and NodePort for the whole rollout. Real packets."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kproxy.cluster.annotations import CURRENT_MODE
from kproxy.cluster.rollout import status as st
from kproxy.lab.cluster import ClusterLab, failures
from kproxy.lab.topology import Lab
from tests.test_rollout_controller import running

pytestmark = pytest.mark.kernel


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[ClusterLab]:
    with Lab(pods=8, clients=1, nodes=4) as lab, ClusterLab(lab, tmp_path) as c:
        yield c


def rollout(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "proxy.kproxy.io/v1alpha1",
        "kind": "ProxyRollout",
        "metadata": {"name": name},
        "spec": {"targetMode": "nftables", "soak": "2s", **spec},
    }


def phase(c: ClusterLab, name: str) -> str:
    obj = c.store.get("ProxyRollout", "", name) or {}
    return str((obj.get("status") or {}).get("phase", ""))


def wait_phase(c: ClusterLab, name: str, phases: tuple[str, ...], timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = phase(c, name)
        if now in phases:
            return now
        time.sleep(0.2)
    status = (c.store.get("ProxyRollout", "", name) or {}).get("status")
    logs = {n: p.log_tail(15) for n, p in c.proxies.items()}
    raise AssertionError(f"rollout {name} still {phase(c, name)}: {status}\n{logs}")


def modes(c: ClusterLab) -> dict[str, str]:
    return {n: c.node_annotations(n).get(CURRENT_MODE, "") for n in c.proxies}


@contextlib.contextmanager
def traffic(c: ClusterLab) -> Iterator[None]:
    """Traffic on every path for the block; asserts not one request failed."""
    load = c.load().start()
    try:
        yield
    finally:
        results = load.stop()
    assert all(r.fresh_sent > 10 for r in results.values()), results
    assert failures(results) == {}


def test_every_node_serves_its_clusterip_and_nodeport(cluster: ClusterLab) -> None:
    lab = cluster.lab
    for node in lab.nodes:
        pod_agent = lab.agent(cluster.sources[node.name])
        for proto, port in (("tcp", 80), ("udp", 53)):
            res = pod_agent.request(proto, cluster.cluster_ip, port, timeout=2)
            assert res.ok, (node.name, proto, res)
        res = lab.agent(lab.client_ns[0]).request("tcp", node.ip, 30080, timeout=2)
        assert res.ok, (node.name, "nodePort", res)
    assert set(modes(cluster).values()) == {"iptables"}


def test_a_full_rollout_moves_every_node_with_no_failed_request(cluster: ClusterLab) -> None:
    stages = [{"nodes": "1"}, {"nodes": "50%"}, {"nodes": "100%", "maxParallel": "2"}]
    with traffic(cluster), running(cluster.settings(), interval=0.2):
        cluster.store.create(rollout("to-nft", stages=stages))
        assert wait_phase(cluster, "to-nft", st.TERMINAL) == st.SUCCEEDED
    assert set(modes(cluster).values()) == {"nftables"}
    status = cluster.store.get("ProxyRollout", "", "to-nft")["status"]  # type: ignore[index]
    assert status["nodesDone"] == 4
    assert sorted(n["stage"] for n in status["nodes"]) == [1, 2, 3, 3]
    events = {(e["involvedObject"]["kind"], e["reason"]) for e in cluster.store.objects("Event")}
    assert {("ProxyRollout", "Finished"), ("Node", "NodeSwitched")} <= events
    assert ("Node", "ProxyModeSwitched") in events  # the node's own report
