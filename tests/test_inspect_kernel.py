"""kproxy list / trace against a real lab node: the answers are checked against where real
packets actually went.

One lab and one `kproxy run` per dataplane (the scenario of tests/support/scenario.py),
shared by the tests of that dataplane; list_services / trace read the node namespace
(read only) exactly as `kproxy list` / `kproxy trace` would there.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kproxy.lab.proxy import ProxyProcess, proxy_config
from kproxy.lab.topology import Lab
from kproxy.model.snapshot import snapshot_from_objects
from kproxy.ops.inspect import ListingResult, TraceResult, list_services, trace
from kproxy.ops.inspect.model import DNAT, DROP, REJECT
from tests.support.dataplane_env import pods_of
from tests.support.lab import LAB_SKIP_REASON, LAB_SUPPORTED
from tests.support.objects import endpoint, endpoint_slice, service, write
from tests.support.scenario import HTTP, PODS, SLICE, scenario_objects

pytestmark = pytest.mark.kernel

# The modes this inspector reads (ipvs and userspace readers come later).
# (mode, iptables backend or nftables layout)
DATAPLANES = [
    ("iptables", "nft"),
    ("iptables", "legacy"),
    ("nftables", ""),
    ("nftables", "compact"),
]


@dataclass
class Node:
    lab: Lab
    proxy: ProxyProcess
    mode: str
    backend: str

    @property
    def plane(self) -> str:
        return f"{self.mode}-{self.backend}" if self.backend else self.mode

    def list(self, **kwargs: object) -> ListingResult:
        return list_services(self.lab.node_ns, **kwargs)  # type: ignore[arg-type]

    def trace(self, src: str, dst: str, port: int, proto: str = "tcp", **kw: object) -> TraceResult:
        result = trace(src, dst, port, proto, netns=self.lab.node_ns, **kw)  # type: ignore[arg-type]
        assert [d.dataplane for d in result.dataplanes] == [self.plane], result.text()
        return result

    def client(self, i: int = 0):  # type: ignore[no-untyped-def]
        return self.lab.agent(self.lab.client_ns[i])

    def pod_addr(self, pod: str | None) -> str:
        return f"{self.lab.pod_ips[pod or '']}:8080"


@pytest.fixture(
    scope="module", params=DATAPLANES, ids=[f"{m}-{b}" if b else m for m, b in DATAPLANES]
)
def node(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Node]:
    if not LAB_SUPPORTED:
        pytest.skip(f"lab unavailable: {LAB_SKIP_REASON}")
    mode, backend = request.param
    work: Path = tmp_path_factory.mktemp(f"inspect-{mode}-{backend or 'nft'}")
    with Lab(pods=3) as lab:
        source = work / "objects"
        source.mkdir()
        for i, obj in enumerate(scenario_objects(lab.client_ips[0])):
            write(source / f"{i:02d}.yaml", obj)
        config = work / "config.yaml"
        config.write_text(proxy_config(mode))
        proxy = ProxyProcess(
            lab,
            source,
            config=config,
            args=(
                [f"--{'nftables-layout' if mode == 'nftables' else 'iptables-backend'}", backend]
                if backend
                else []
            ),
            workdir=work / "kproxy",
        )
        proxy.start()
        try:
            yield Node(lab, proxy, mode, backend)
        finally:
            proxy.stop()


def test_list_detects_the_live_mode_and_matches_the_snapshot(node: Node) -> None:
    objects = scenario_objects(node.lab.client_ips[0])
    result = node.list(snapshot=snapshot_from_objects(objects, "node1"))
    (dp,) = result.dataplanes
    assert dp.dataplane == node.plane and dp.live and not result.mid_switch
    assert len(dp.service_names) == 8
    assert result.drift == [], result.text()
    # A service the kernel does not have yet is drift.
    extra = [*objects, service("api", "10.96.0.30", HTTP)]
    extra.append(endpoint_slice("api", [endpoint(PODS[0])], SLICE))
    drift = node.list(snapshot=snapshot_from_objects(extra, "node1")).drift
    assert drift == ["service default/api:http is in the snapshot but not in the kernel"]


def test_one_endpoint_trace_says_where_the_request_answers_from(node: Node) -> None:
    client_ip, node_ip = node.lab.client_ips[0], node.lab.node_ip
    result = node.trace(client_ip, "10.96.0.11", 80)
    assert result.verdicts() == {DNAT} and result.destinations() == {"10.244.0.3:8080"}
    (o,) = result.outcomes
    real = node.client().request(proto="tcp", dst="10.96.0.11", port=80)
    assert real.ok and node.pod_addr(real.pod) == o.dnat
    # masqueraded (the client is outside the cluster CIDR): the pod sees the node.
    assert o.masquerade and real.peer == node_ip
    # From the node itself: nat OUTPUT, same endpoint.
    from_node = node.trace(node_ip, "10.96.0.11", 80)
    assert from_node.packet.from_node and from_node.destinations() == {"10.244.0.3:8080"}
    real = node.lab.agent(node.lab.node_ns).request(proto="tcp", dst="10.96.0.11", port=80)
    assert real.ok and node.pod_addr(real.pod) == "10.244.0.3:8080"


def test_cluster_ip_trace_lists_every_endpoint_the_requests_reach(node: Node) -> None:
    result = node.trace(node.lab.client_ips[0], "10.96.0.10", 80)
    assert [round(o.probability or 0, 2) for o in result.outcomes] == [0.33] * 3
    results = node.client().request_many(proto="tcp", dst="10.96.0.10", port=80, count=30)
    assert {node.pod_addr(p) for p in pods_of(results)} == result.destinations()


def test_no_endpoints_trace_says_reject_and_the_request_is_refused(node: Node) -> None:
    result = node.trace(node.lab.client_ips[0], "10.96.0.99", 80)
    (o,) = result.outcomes
    assert o.verdict == REJECT and o.service == "default/empty:http", result.text()
    real = node.client().request(proto="tcp", dst="10.96.0.99", port=80, timeout=2.0)
    assert real.error == "refused"


def test_source_outside_the_ranges_trace_says_drop_and_the_request_times_out(node: Node) -> None:
    denied, allowed = node.lab.client_ips[1], node.lab.client_ips[0]
    (o,) = node.trace(denied, "10.99.1.10", 80).outcomes
    assert o.verdict == DROP, o.reason
    real = node.client(1).request(proto="tcp", dst="10.99.1.10", port=80, timeout=0.5)
    assert real.error == "timeout"
    ok = node.trace(allowed, "10.99.1.10", 80)
    real = node.client(0).request(proto="tcp", dst="10.99.1.10", port=80)
    assert real.ok and node.pod_addr(real.pod) in ok.destinations()


def test_affinity_trace_knows_where_this_client_sticks(node: Node) -> None:
    client_ip = node.lab.client_ips[0]
    before = node.trace(client_ip, "10.96.0.12", 80)
    assert len(before.destinations()) == 2  # no affinity entry yet: either endpoint
    first = node.client().request(proto="tcp", dst="10.96.0.12", port=80)
    assert first.ok
    after = node.trace(client_ip, "10.96.0.12", 80)
    assert after.destinations() == {node.pod_addr(first.pod)}, after.text()
    again = node.client().request_many(proto="tcp", dst="10.96.0.12", port=80, count=5)
    assert {node.pod_addr(p) for p in pods_of(again)} == after.destinations()
    # The other client has no entry: still either endpoint.
    assert len(node.trace(node.lab.client_ips[1], "10.96.0.12", 80).destinations()) == 2


def test_local_policy_trace_names_only_the_local_endpoint(node: Node) -> None:
    client_ip = node.lab.client_ips[0]
    (o,) = node.trace(client_ip, node.lab.node_ip, 30082).outcomes
    assert o.dnat == "10.244.0.2:8080" and o.masquerade is False
    results = node.client().request_many(proto="tcp", dst=node.lab.node_ip, port=30082, count=10)
    assert {node.pod_addr(p) for p in pods_of(results)} == {o.dnat}
    assert {r.peer for r in results} == {client_ip}  # source kept, as the trace says


def test_list_counts_long_lived_connections(node: Node) -> None:
    client = node.client()
    streams = [client.open_stream("10.96.0.11", 80) for _ in range(3)]
    try:
        assert all(client.stream_ping(s).pod == "pod2" for s in streams)
        dp = node.list(stats=True).dataplanes[0]
        one = dp.server("tcp", "10.96.0.11", 80)
        assert one is not None
        assert [(rs.addr, rs.active) for rs in one.endpoints] == [("10.244.0.3:8080", 3)]
        if node.mode == "iptables":
            # nat counters count connections: at least the 3 streams went through the rule.
            assert (one.packets or 0) >= 3 and (one.endpoints[0].packets or 0) >= 3
        else:
            assert one.packets is None
    finally:
        for s in streams:
            client.close_stream(s)


def test_local_policy_without_local_endpoints_trace_says_drop(node: Node) -> None:
    (o,) = node.trace(node.lab.client_ips[0], node.lab.node_ip, 30083).outcomes
    assert o.verdict == DROP, o.reason
    real = node.client().request(proto="tcp", dst=node.lab.node_ip, port=30083, timeout=0.5)
    assert real.error == "timeout"
    # The ClusterIP still reaches the endpoint on the other node (internal policy Cluster).
    (o,) = node.trace(node.lab.client_ips[0], "10.96.0.14", 80).outcomes
    real = node.client().request(proto="tcp", dst="10.96.0.14", port=80)
    assert real.ok and node.pod_addr(real.pod) == o.dnat == "10.244.0.4:8080"
