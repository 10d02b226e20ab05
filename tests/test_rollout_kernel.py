"""Cluster rollouts on the lab as a cluster: four node namespaces, a kproxy on each following
its Node through the lab's API server, the rollout controller in this process, and traffic
through every node's ClusterIP and NodePort for the whole rollout. Real packets."""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kproxy.cluster.annotations import CURRENT_MODE
from kproxy.cluster.rollout import status as st
from kproxy.cluster.rollout.controller import REQUEST_ANNOTATION
from kproxy.dataplane.nftables.layouts import COMPACT, TABLES, UPSTREAM, dataplane_name, target_name
from kproxy.lab.cluster import ClusterLab, failures
from kproxy.lab.topology import Lab
from tests.support.rollout import running

pytestmark = pytest.mark.kernel


# nftables mode in both layouts in one cluster: the Node annotation names the mode, each
# kproxy goes to its own --nftables-layout (a rollout between layouts is not a thing).
LAYOUT_OF = {"node1": UPSTREAM, "node2": COMPACT, "node3": UPSTREAM, "node4": COMPACT}


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[ClusterLab]:
    with (
        Lab(pods=8, clients=1, nodes=4) as lab,
        ClusterLab(lab, tmp_path, nftables_layouts=LAYOUT_OF) as c,
    ):
        yield c


class BrokenNft:
    """An `nft` early in one node's PATH that fails on purpose: every call while `broken`
    exists (preflight sees it), or only transactions (`nft -f`, the syncs) while `failing`
    exists."""

    def __init__(self, folder: Path) -> None:
        real = shutil.which("nft") or shutil.which("nft", path="/usr/sbin:/sbin")
        assert real is not None
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.broken = folder / "broken"
        self.failing = folder / "failing"
        script = folder / "nft"
        script.write_text(
            "#!/bin/sh\n"
            f'[ -e {self.broken} ] && {{ echo "nft: broken on purpose" >&2; exit 1; }}\n'
            f'if [ -e {self.failing} ]; then for a in "$@"; do\n'
            '  [ "$a" = "-f" ] && { echo "nft: transaction refused on purpose" >&2; exit 1; }\n'
            "done; fi\n"
            f'exec {real} "$@"\n'
        )
        script.chmod(0o755)


@pytest.fixture
def faulty(tmp_path: Path) -> Iterator[tuple[ClusterLab, dict[str, BrokenNft]]]:
    """The cluster with a breakable nft on every node."""
    nfts = {f"node{i}": BrokenNft(tmp_path / f"nft-node{i}") for i in range(1, 5)}
    prefixes = {name: nft.folder for name, nft in nfts.items()}
    with (
        Lab(pods=8, clients=1, nodes=4) as lab,
        ClusterLab(lab, tmp_path / "cluster", path_prefixes=prefixes) as c,
    ):
        yield c, nfts


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


def dataplanes(c: ClusterLab) -> dict[str, str]:
    """What each node's kproxy serves, nftables mode by its layout's dataplane name."""
    out = {}
    for name, proxy in c.proxies.items():
        st = proxy.status()
        out[name] = target_name(str(st.get("mode")), st.get("nftables_layout"))
    return out


OWN = {layout: f"table ip {table}" for layout, table in TABLES.items()}


def all_on_nftables(c: ClusterLab) -> None:
    """Every node in nftables mode, in its own layout, its table in the kernel."""
    assert set(modes(c).values()) == {"nftables"}
    assert dataplanes(c) == {n: dataplane_name(layout) for n, layout in LAYOUT_OF.items()}
    for node in c.lab.nodes:
        tables = c.lab.exec(node.ns, ["nft", "list", "tables"]).stdout.splitlines()
        assert [t for t in tables if t in OWN.values()] == [OWN[LAYOUT_OF[node.name]]], tables


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
    all_on_nftables(cluster)
    status = cluster.store.get("ProxyRollout", "", "to-nft")["status"]  # type: ignore[index]
    assert status["nodesDone"] == 4
    assert sorted(n["stage"] for n in status["nodes"]) == [1, 2, 3, 3]
    events = {(e["involvedObject"]["kind"], e["reason"]) for e in cluster.store.objects("Event")}
    assert {("ProxyRollout", "Finished"), ("Node", "NodeSwitched")} <= events
    assert ("Node", "ProxyModeSwitched") in events  # the node's own report


def node_states(c: ClusterLab, name: str) -> dict[str, str]:
    status = (c.store.get("ProxyRollout", "", name) or {}).get("status") or {}
    return {n["name"]: n["state"] for n in status.get("nodes", [])}


@pytest.mark.parametrize("on_block", ["Skip", "HaltStage"])
def test_a_node_whose_target_cannot_work_is_refused_by_its_preflight(
    faulty: tuple[ClusterLab, dict[str, BrokenNft]], on_block: str
) -> None:
    cluster, nfts = faulty
    nfts["node3"].broken.touch()
    spec = {
        "stages": [{"nodes": "100%", "maxParallel": "4"}],
        "preflight": {"onBlock": on_block},
    }
    with traffic(cluster), running(cluster.settings(), interval=0.2):
        cluster.store.create(rollout("r", **spec))
        if on_block == "Skip":
            assert wait_phase(cluster, "r", st.TERMINAL) == st.SUCCEEDED
        else:
            wait_phase(cluster, "r", (st.PAUSED,))
    states = node_states(cluster, "r")
    assert modes(cluster)["node3"] == "iptables"
    status = cluster.store.get("ProxyRollout", "", "r")["status"]  # type: ignore[index]
    (node3,) = [n for n in status["nodes"] if n["name"] == "node3"]
    assert "nft" in node3["reason"], node3
    if on_block == "Skip":
        assert states["node3"] == st.SKIPPED
        assert {modes(cluster)[n] for n in ("node1", "node2", "node4")} == {"nftables"}
    else:
        assert states["node3"] == st.BLOCKED
        assert "preflight of node3 blocks the switch" in status["pausedReason"]


def test_a_node_that_degrades_after_its_switch_is_rolled_back(
    faulty: tuple[ClusterLab, dict[str, BrokenNft]],
) -> None:
    """node1 switches, then its syncs start failing: its verify breaker trips and sends it
    back to iptables by itself; the other nodes go on (the batch breaker wants 3 failures)."""
    cluster, nfts = faulty
    spec = {
        "soak": "40s",
        "stages": [{"nodes": "100%", "maxParallel": "4"}],
        "breakers": [
            {"signal": "switchFailed"},
            {"signal": "verifyFailed"},
            {"signal": "failedNodes", "threshold": "3"},
        ],
    }
    with traffic(cluster), running(cluster.settings(), interval=0.2):
        cluster.store.create(rollout("r", **spec))
        wait_phase(cluster, "r", (st.SOAKING,))
        nfts["node1"].failing.touch()
        # a change every node must write: node1's transaction fails from now on
        cluster.store.create(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": "extra", "namespace": "default"},
                "spec": {"ports": [{"port": 81, "targetPort": 8080}]},
            }
        )
        deadline = time.monotonic() + 90
        while node_states(cluster, "r").get("node1") != st.ROLLED_BACK:
            if time.monotonic() > deadline:
                status = (cluster.store.get("ProxyRollout", "", "r") or {}).get("status")
                pytest.fail(
                    f"node1 not rolled back: {status}\n{cluster.node_annotations('node1')}\n"
                    + cluster.proxies["node1"].log_tail(60)
                )
            time.sleep(0.2)
        nfts["node1"].failing.unlink()
        assert wait_phase(cluster, "r", st.TERMINAL) == st.FAILED
    assert modes(cluster) == {
        "node1": "iptables",
        "node2": "nftables",
        "node3": "nftables",
        "node4": "nftables",
    }
    status = cluster.store.get("ProxyRollout", "", "r")["status"]  # type: ignore[index]
    tripped = [b for b in status["breakers"] if b.get("tripped")]
    assert [(b["name"], b["node"]) for b in tripped] == [("verifyFailed", "node1")]


def test_a_batch_where_enough_nodes_fail_is_rolled_back_and_pauses(
    faulty: tuple[ClusterLab, dict[str, BrokenNft]],
) -> None:
    """Stage 2's three nodes switch together; two cannot write nftables rules (their switch
    fails and their kproxy keeps iptables): the batch breaker sends the third back too and
    the rollout pauses, the canary staying on nftables."""
    cluster, nfts = faulty
    for name in ("node2", "node3"):
        nfts[name].failing.touch()
    spec = {
        "soak": "1s",
        "stages": [{"nodes": "1"}, {"nodes": "100%", "maxParallel": "3"}],
        "breakers": [{"signal": "switchFailed"}, {"signal": "failedNodes", "threshold": "2"}],
    }
    with traffic(cluster), running(cluster.settings(), interval=0.2):
        cluster.store.create(rollout("r", **spec))
        wait_phase(cluster, "r", (st.PAUSED,))
    assert modes(cluster) == {
        "node1": "nftables",
        "node2": "iptables",
        "node3": "iptables",
        "node4": "iptables",
    }
    states = node_states(cluster, "r")
    assert states["node1"] == st.DONE
    assert {states[n] for n in ("node2", "node3", "node4")} == {st.ROLLED_BACK}
    status = cluster.store.get("ProxyRollout", "", "r")["status"]  # type: ignore[index]
    assert "failedNodes" in status["pausedReason"]


def test_abort_rollback_all_and_undo_bring_every_node_back(cluster: ClusterLab) -> None:
    stages = [{"nodes": "1"}, {"nodes": "100%", "maxParallel": "3"}]
    with traffic(cluster), running(cluster.settings(), interval=0.2):
        cluster.store.create(rollout("first", soak="1h", stages=[{"nodes": "100%"}]))
        wait_phase(cluster, "first", (st.SOAKING,))
        request = {"metadata": {"annotations": {REQUEST_ANNOTATION: "1 abort:all"}}}
        cluster.store.patch("ProxyRollout", "", "first", request)
        assert wait_phase(cluster, "first", st.TERMINAL) == st.FAILED
        assert set(modes(cluster).values()) == {"iptables"}
        cluster.store.create(rollout("second", soak="1s", stages=stages))
        assert wait_phase(cluster, "second", st.TERMINAL) == st.SUCCEEDED
        all_on_nftables(cluster)
        undo = rollout("second-undo", soak="1s", stages=stages)
        undo["spec"].update(targetMode="previous", undoOf="second")
        cluster.store.create(undo)
        assert wait_phase(cluster, "second-undo", st.TERMINAL) == st.SUCCEEDED
    assert set(modes(cluster).values()) == {"iptables"}


def switches_per_node(c: ClusterLab) -> dict[str, int]:
    """Each node's own reports of a done switch (its kproxy's Events)."""
    out = dict.fromkeys(c.proxies, 0)
    for e in c.store.objects("Event"):
        if e["reason"] == "ProxyModeSwitched" and e.get("reportingComponent") == "kproxy":
            out[e["involvedObject"]["name"]] += 1
    return out


def test_a_controller_killed_mid_batch_is_resumed_by_the_next_one(cluster: ClusterLab) -> None:
    """`kproxy rollout run` as a process, killed with SIGKILL while stage 2 switches; a new
    one takes the Lease over once it expires and finishes without switching a node twice."""
    settings = cluster.settings()

    def controller() -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-m", "kproxy.cli", "rollout", "run"]
        argv += ["--kubeconfig", settings.kubeconfig, "--lease-namespace", "default"]
        argv += ["--interval", "0.2", "--lease-duration", "3"]
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    stages = [{"nodes": "1"}, {"nodes": "100%", "maxParallel": "1"}]
    first = controller()
    try:
        with traffic(cluster):
            cluster.store.create(rollout("r", soak="1s", stages=stages))
            deadline = time.monotonic() + 120
            while sum(s == st.SWITCHED for s in node_states(cluster, "r").values()) < 2:
                assert time.monotonic() < deadline, node_states(cluster, "r")
                time.sleep(0.1)
            first.send_signal(signal.SIGKILL)
            first.wait(10)
            stopped_at = node_states(cluster, "r")
            second = controller()
            try:
                assert wait_phase(cluster, "r", st.TERMINAL) == st.SUCCEEDED
            finally:
                second.terminate()
                second.wait(10)
    finally:
        if first.poll() is None:
            first.kill()
    assert st.DONE in stopped_at.values() or st.SWITCHED in stopped_at.values()
    all_on_nftables(cluster)
    assert switches_per_node(cluster) == dict.fromkeys(cluster.proxies, 1)
    lease = cluster.store.get("Lease", "default", "kproxy-rollout-controller")
    assert lease is not None and lease["spec"]["leaseTransitions"] >= 1
