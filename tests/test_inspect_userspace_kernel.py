"""kproxy list / trace in userspace mode against a real lab node: the answers are checked
against where real connections went (which pod answered, with which source address) and
against what the workers really hold open.

One lab and one `kproxy run --proxy-mode userspace` per iptables backend (the scenario of
tests/support/scenario.py), shared by the tests of that backend.
"""

from __future__ import annotations

import json
import sys
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
from tests.support.objects import write
from tests.support.scenario import scenario_objects

pytestmark = pytest.mark.kernel

BACKENDS = ["nft", "legacy"]


@dataclass
class Node:
    lab: Lab
    proxy: ProxyProcess
    backend: str

    @property
    def plane(self) -> str:
        return f"userspace-{self.backend}"

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


@pytest.fixture(scope="module", params=BACKENDS, ids=[f"userspace-{b}" for b in BACKENDS])
def node(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Node]:
    if not LAB_SUPPORTED:
        pytest.skip(f"lab unavailable: {LAB_SKIP_REASON}")
    backend = request.param
    work: Path = tmp_path_factory.mktemp(f"inspect-userspace-{backend}")
    with Lab(pods=3) as lab:
        source = work / "objects"
        source.mkdir()
        for i, obj in enumerate(scenario_objects(lab.client_ips[0])):
            write(source / f"{i:02d}.yaml", obj)
        config = work / "config.yaml"
        config.write_text(proxy_config("userspace"))
        proxy = ProxyProcess(
            lab,
            source,
            config=config,
            args=["--iptables-backend", backend],
            workdir=work / "kproxy",
        )
        proxy.start()
        try:
            yield Node(lab, proxy, backend)
        finally:
            proxy.stop()


def test_list_reads_the_workers_and_matches_the_snapshot(node: Node) -> None:
    objects = scenario_objects(node.lab.client_ips[0])
    result = node.list(snapshot=snapshot_from_objects(objects, "node1"))
    (dp,) = result.dataplanes
    assert dp.dataplane == node.plane and dp.live and not result.mid_switch, result.text()
    assert not result.notes, result.notes  # iptables mode's reader does not chime in
    assert len(dp.service_names) == 8
    assert result.drift == [], result.text()
    web = dp.server("tcp", "10.96.0.10", 80)
    assert web is not None and web.scheduler == "rr"
    assert {rs.addr for rs in web.endpoints} == {f"{ip}:8080" for ip in node.lab.pod_ips.values()}
    assert all(rs.forward == "Proxy" for rs in web.endpoints)
    assert any("userspace workers" in n for n in dp.notes), dp.notes


def test_cli_list_json_and_trace_text(node: Node) -> None:
    cli = [sys.executable, "-m", "kproxy.cli"]
    listing = json.loads(node.lab.exec(node.lab.node_ns, [*cli, "list", "--json"]).stdout)
    (dp,) = listing["dataplanes"]
    assert dp["mode"] == "userspace" and dp["services"] == 8
    traced = node.lab.exec(
        node.lab.node_ns,
        [*cli, "trace", "--from", node.lab.client_ips[0], "--to", "10.96.0.11:80"],
    ).stdout
    assert "KUBE-PORTALS-CONTAINER rule" in traced and "userspace listener tcp/" in traced
    assert "10.244.0.3:8080" in traced


def test_one_endpoint_trace_says_where_and_from_which_address(node: Node) -> None:
    client_ip, node_ip = node.lab.client_ips[0], node.lab.node_ip
    result = node.trace(client_ip, "10.96.0.11", 80)
    (o,) = result.outcomes
    assert o.verdict == DNAT and o.dnat == "10.244.0.3:8080"
    real = node.client().request(proto="tcp", dst="10.96.0.11", port=80)
    assert real.ok and node.pod_addr(real.pod) == o.dnat
    # The worker connects from the node for a client outside the cluster CIDR.
    assert o.masquerade and real.peer == node_ip
    from_node = node.trace(node_ip, "10.96.0.11", 80)
    assert from_node.packet.from_node
    assert any(s.chain == "KUBE-PORTALS-HOST" for s in from_node.outcomes[0].steps)
    real = node.lab.agent(node.lab.node_ns).request(proto="tcp", dst="10.96.0.11", port=80)
    assert real.ok and node.pod_addr(real.pod) in from_node.destinations()


def test_cluster_ip_trace_is_round_robin_over_the_endpoints_the_requests_reach(node: Node) -> None:
    result = node.trace(node.lab.client_ips[0], "10.96.0.10", 80)
    assert [round(o.probability or 0, 2) for o in result.outcomes] == [0.33] * 3
    assert "round robin over 3 backends" in result.text()
    results = node.client().request_many(proto="tcp", dst="10.96.0.10", port=80, count=30)
    assert {node.pod_addr(p) for p in pods_of(results)} == result.destinations()


def test_no_endpoints_trace_says_reject_and_the_request_is_refused(node: Node) -> None:
    (o,) = node.trace(node.lab.client_ips[0], "10.96.0.99", 80).outcomes
    assert o.verdict == REJECT and o.service == "default/empty:http", o.reason
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
    assert len(node.trace(node.lab.client_ips[1], "10.96.0.12", 80).destinations()) == 2


def test_local_policy_trace_names_only_the_local_endpoint_and_keeps_the_source(
    node: Node,
) -> None:
    client_ip = node.lab.client_ips[0]
    (o,) = node.trace(client_ip, node.lab.node_ip, 30082).outcomes
    assert o.dnat == "10.244.0.2:8080" and o.masquerade is False
    results = node.client().request_many(proto="tcp", dst=node.lab.node_ip, port=30082, count=10)
    assert {node.pod_addr(p) for p in pods_of(results)} == {o.dnat}
    assert {r.peer for r in results} == {client_ip}  # the worker kept it, as the trace says


def test_local_policy_without_local_endpoints_trace_says_drop(node: Node) -> None:
    (o,) = node.trace(node.lab.client_ips[0], node.lab.node_ip, 30083).outcomes
    assert o.verdict == DROP, o.reason
    real = node.client().request(proto="tcp", dst=node.lab.node_ip, port=30083, timeout=0.5)
    assert real.error == "timeout"


def test_list_counts_the_connections_the_workers_hold(node: Node) -> None:
    client = node.client()
    streams = [client.open_stream("10.96.0.11", 80) for _ in range(3)]
    try:
        assert all(client.stream_ping(s).pod == "pod2" for s in streams)
        dp = node.list(stats=True).dataplanes[0]
        one = dp.server("tcp", "10.96.0.11", 80)
        assert one is not None
        assert [(rs.addr, rs.active, rs.inactive) for rs in one.endpoints] == [
            ("10.244.0.3:8080", 3, 0)
        ]
        # nat counters of the redirect rules count new connections: at least these 3.
        assert (one.packets or 0) >= 3
    finally:
        for s in streams:
            client.close_stream(s)
    dp = node.list().dataplanes[0]
    one = dp.server("tcp", "10.96.0.11", 80)
    assert one is not None and one.endpoints[0].active == 0


def test_a_stopped_worker_listener_shows_in_list_and_trace(node: Node) -> None:
    """Kill every worker (the kernel rules stay): list and trace say nothing listens, and a
    real connection is indeed refused; the controller's next sync brings them back."""
    import os
    import signal
    import time

    from kproxy.ops.inspect.userspace import read_worker_state

    state = read_worker_state(node.lab.node_ns, report=False)
    assert state is not None and len(state.statuses) >= 1
    for st in state.statuses.values():
        os.kill(int(st["pid"]), signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and read_worker_state(node.lab.node_ns, report=False):
        time.sleep(0.05)
    (o,) = node.trace(node.lab.client_ips[0], "10.96.0.11", 80).outcomes
    assert o.verdict == REJECT and "no userspace worker runs" in o.reason, o.reason
    dp = node.list().dataplanes[0]
    one = dp.server("tcp", "10.96.0.11", 80)
    assert one is not None and any("no worker runs" in n for n in one.notes), one.notes
    real = node.client().request(proto="tcp", dst="10.96.0.11", port=80, timeout=1.0)
    assert not real.ok
    # The next sync starts new workers (asked for now instead of waiting for syncPeriod).
    from kproxy.server.admin import SOCKET_NAME, call

    before = node.proxy.status().get("syncs", 0)
    assert call(node.proxy.state_dir / SOCKET_NAME, {"op": "sync"}, timeout=10)["ok"]
    node.proxy.wait_synced(after=before, timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        result = node.trace(node.lab.client_ips[0], "10.96.0.11", 80)
        if result.verdicts() == {DNAT}:
            break
        time.sleep(0.5)
    assert result.destinations() == {"10.244.0.3:8080"}, result.text()
    assert node.client().request(proto="tcp", dst="10.96.0.11", port=80).ok
