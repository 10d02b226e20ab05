"""Full syncs in the kernel: the nft backend loading a large sync in pieces into a fresh and a
live node, and trusting a kernel only it changed; the legacy backend repairing drift after a
resync."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator

import pytest

from kproxy.dataplane.facts import NodeFacts, RuleOptions
from kproxy.dataplane.iptables.backend import IptablesBackend
from kproxy.dataplane.iptables.proxier import SPLIT_THRESHOLD, IptablesDataplane
from kproxy.model.snapshot import snapshot_from_objects
from tests.support.objects import endpoint, endpoint_slice, port, service

pytestmark = pytest.mark.kernel


@pytest.fixture
def netns() -> Iterator[str]:
    name = f"kpp-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=False)


def objects(n: int, first_ep: int = 2) -> list[dict]:
    out = []
    for i in range(n):
        out.append(service(f"s{i}", f"10.96.{i // 250}.{i % 250 + 1}", [port("http", 80, 8080)]))
        out.append(
            endpoint_slice(
                f"s{i}",
                [endpoint(f"10.244.{i // 250}.{first_ep + j}") for j in range(2)],
                [port("http", 8080)],
            )
        )
    return out


def test_pieces_load_into_a_fresh_node_then_resync_and_change(netns: str) -> None:
    n = SPLIT_THRESHOLD + 100
    backend = IptablesBackend("nft", netns=netns)
    plane = IptablesDataplane(
        backend, NodeFacts(node_ips=("10.100.0.1",)), RuleOptions(cluster_cidrs=("10.244.0.0/16",))
    )
    result = plane.sync(snapshot_from_objects(objects(n), "node1"), full=True)
    assert result.pieces > 2
    nat = backend.save("nat")
    assert nat.count("-A KUBE-SERVICES ") == n + 1
    assert "-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000" in nat
    # A full resync over the live table, with every endpoint changed: stale chains go. Some
    # other software's commit first, so the resync cannot trust the kernel and loads pieces.
    subprocess.run(["ip", "netns", "exec", netns, "nft", "add", "table", "ip", "other"], check=True)
    result = plane.sync(snapshot_from_objects(objects(n, first_ep=100), "node1"), full=True)
    assert not result.kernel_unchanged and result.pieces > 2
    assert result.stale_removed == 2 * n
    assert backend.save("nat").count(":KUBE-SEP-") == 2 * n


def test_nft_resync_trusts_a_kernel_only_kproxy_changed(netns: str) -> None:
    """A full sync writes only what changed while every nf_tables commit in the namespace
    since its last full read was kproxy's own; anyone else's commit ends that, and the next
    full sync reads the tables and repairs what was done behind its back."""
    backend = IptablesBackend("nft", netns=netns)
    plane = IptablesDataplane(backend, NodeFacts(node_ips=("10.100.0.1",)), RuleOptions())
    snap = snapshot_from_objects(objects(20), "node1")
    assert not plane.sync(snap, full=True).kernel_unchanged  # the first one reads the tables
    again = plane.sync(snap, full=True)
    assert again.full and again.kernel_unchanged and again.pieces == 0
    # A partial sync of our own keeps the custody; the full sync after it writes nothing.
    changed = snapshot_from_objects(objects(20, first_ep=50), "node1")
    assert plane.sync(changed, full=False).rewritten == 20
    assert plane.sync(changed, full=True).kernel_unchanged

    ipt = ["ip", "netns", "exec", netns, "iptables-nft", "-t", "nat"]
    jump = ["-m", "comment", "--comment", "kubernetes service portals", "-j", "KUBE-SERVICES"]
    subprocess.run([*ipt, "-D", "PREROUTING", *jump], check=True)
    assert plane.drifted() is False  # the canary chain is still there
    repaired = plane.sync(changed, full=True)
    assert not repaired.kernel_unchanged and repaired.pieces == 1
    nat = backend.save("nat")
    assert '-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES' in nat
    assert nat.count("-A KUBE-SERVICES ") == 21
    # The repair's own restore re-established custody.
    assert plane.sync(changed, full=True).kernel_unchanged
    # A commit that touches nothing of ours still ends it (the generation cannot tell).
    subprocess.run(["ip", "netns", "exec", netns, "nft", "add", "table", "ip", "other"], check=True)
    assert not plane.sync(changed, full=True).kernel_unchanged


def test_legacy_resync_repairs_what_was_changed_behind_its_back(netns: str) -> None:
    """The legacy resync reads the tables while its restore runs; what drifted (a deleted
    jump, a leftover chain of kube-proxy's shape) is repaired right after, in the kernel."""
    backend = IptablesBackend("legacy", netns=netns)
    plane = IptablesDataplane(backend, NodeFacts(node_ips=("10.100.0.1",)), RuleOptions())
    snap = snapshot_from_objects(objects(20), "node1")
    plane.sync(snap, full=True)
    ipt = ["ip", "netns", "exec", netns, "iptables-legacy", "-t", "nat"]
    jump = ["-m", "comment", "--comment", "kubernetes service portals", "-j", "KUBE-SERVICES"]
    subprocess.run([*ipt, "-D", "PREROUTING", *jump], check=True)
    subprocess.run([*ipt, "-N", "KUBE-SEP-AAAAAAAAAAAAAAAA"], check=True)
    result = plane.sync(snap, full=True)
    assert result.pieces == 2 and result.stale_removed == 1
    nat = backend.save("nat")
    assert '-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES' in nat
    assert "KUBE-SEP-AAAAAAAAAAAAAAAA" not in nat
    assert nat.count("-A KUBE-SERVICES ") == 21
    # Nothing drifted since: the next resync is one restore.
    assert plane.sync(snap, full=True).pieces == 1
