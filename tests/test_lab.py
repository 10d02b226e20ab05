"""Kernel tests of the namespace lab itself: wiring, pod servers, probe agent, teardown."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kproxy.lab.agent import ProbeError
from kproxy.lab.topology import NETNS_DIR, Lab, LabError, PodSpec

pytestmark = pytest.mark.kernel


def root_links() -> set[str]:
    """Interface index:name pairs of the namespace pytest runs in (the host's root)."""
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    return {":".join(line.split(":")[:2]) for line in out.splitlines()}


def lab_netns(lab_id: str) -> list[str]:
    return sorted(p.name for p in NETNS_DIR.iterdir() if p.name.startswith(f"{lab_id}-"))


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


@pytest.fixture(scope="module", autouse=True)
def root_snapshot() -> set[str]:
    # Module-scoped and autouse, so taken before lab_module exists.
    return root_links()


# -- lifecycle (own labs) ----------------------------------------------------------------


def test_up_down_leaves_nothing_behind() -> None:
    before = root_links()
    lab = Lab(pods=2, clients=1)
    with lab:
        assert lab_netns(lab.id) == sorted(lab.namespaces)
        assert len(lab.namespaces) == 4
        assert lab.state_file.exists()
        pids = [p["pid"] for p in json.loads(lab.state_file.read_text())["processes"]]
        assert len(pids) == 2 and all(pid_alive(pid) for pid in pids)
        lab.agent(lab.client_ns[0])  # one more tracked process
        assert root_links() == before
    assert lab_netns(lab.id) == []
    assert not lab.state_file.exists() and not lab.log_dir.exists()
    assert not any(pid_alive(pid) for pid in pids)
    assert root_links() == before
    lab.down()  # idempotent
    print(f"lab up {lab.up_seconds:.3f}s down {lab.down_seconds:.3f}s")
    assert lab.up_seconds is not None and lab.up_seconds < 10
    assert lab.down_seconds is not None and lab.down_seconds < 10


def test_exception_inside_with_tears_down() -> None:
    with pytest.raises(RuntimeError, match="boom"), Lab(pods=1, clients=1) as lab:
        pids = [p.pid for p in lab._procs]
        assert lab_netns(lab.id)
        raise RuntimeError("boom")
    assert lab_netns(lab.id) == []
    assert not any(pid_alive(pid) for pid in pids)
    assert not lab.state_file.exists()


def test_failed_up_tears_down_what_it_built() -> None:
    # Two listeners on one port: the pod server dies before "ready", after the namespaces
    # and the other pod's server already exist.
    specs = [PodSpec("good"), PodSpec("bad", tcp_ports=(8080, 8080))]
    lab = Lab(pods=specs, clients=1)
    with pytest.raises(LabError, match="server bad exited"):
        lab.up()
    assert lab_netns(lab.id) == []
    assert not any(pid_alive(p.pid) for p in lab._procs)
    assert not lab.state_file.exists()


def test_load_and_list_running(lab_module: Lab) -> None:
    loaded = Lab.load(lab_module.id)
    assert loaded.namespaces == lab_module.namespaces
    assert loaded.pod_ips == lab_module.pod_ips
    assert loaded.is_running() and loaded.owner_alive()
    assert lab_module.id in {lab.id for lab in Lab.list_running()}
    with pytest.raises(LabError):
        Lab.load("kp000000-does-not-exist")


def test_exec_refuses_foreign_namespaces(lab_module: Lab) -> None:
    with pytest.raises(ValueError, match="not a namespace"):
        lab_module.exec("some-other-ns", ["true"])
    out = lab_module.exec(lab_module.node_ns, ["sysctl", "-n", "net.ipv4.ip_forward"])
    assert out.stdout.strip() == "1"


# -- connectivity (shared lab) -----------------------------------------------------------


def test_clients_reach_every_pod_directly(lab_module: Lab) -> None:
    for ns, client_ip in zip(lab_module.client_ns, lab_module.client_ips, strict=True):
        agent = lab_module.agent(ns)
        for pod, pod_ip in lab_module.pod_ips.items():
            for proto, port in (("tcp", 8080), ("tcp", 9090), ("udp", 8080)):
                res = agent.request(proto, pod_ip, port, timeout=2)
                assert res.ok, (ns, pod, proto, port, res)
                assert (res.pod, res.peer) == (pod, client_ip)


def test_pod_reaches_pod_node_and_client(lab_module: Lab) -> None:
    lab = lab_module
    pod1_ip, pod2_ip = lab.pod_ips["pod1"], lab.pod_ips["pod2"]
    agent = lab.agent(lab.pod_ns_of("pod1"))

    res = agent.request("tcp", pod2_ip, 8080)
    assert (res.ok, res.pod, res.peer) == (True, "pod2", pod1_ip)

    lab.serve(lab.node_ns, "node", tcp_ports=(18080,), udp_ports=(18080,))
    for proto in ("tcp", "udp"):
        res = agent.request(proto, lab.node_ip, 18080)
        assert (res.ok, res.pod, res.peer) == (True, "node", pod1_ip), proto

    lab.serve(lab.client_ns[0], "c1", tcp_ports=(7000,))
    res = agent.request("tcp", lab.client_ips[0], 7000)
    assert (res.ok, res.pod, res.peer) == (True, "c1", pod1_ip)


def test_node_reaches_pods_from_node_ip(lab_module: Lab) -> None:
    agent = lab_module.agent(lab_module.node_ns)
    for pod, ip in lab_module.pod_ips.items():
        res = agent.request("tcp", ip, 9090)
        assert (res.ok, res.pod, res.peer) == (True, pod, lab_module.node_ip)


def test_masquerade_source_is_node_ip(lab: Lab) -> None:
    # Documented lab property that the source-NAT tests rely on: veth-pX has no address, so
    # MASQUERADE picks the node IP on br-ext.
    if shutil.which("iptables-nft") is None:
        pytest.skip("iptables-nft missing")
    lab.exec(
        lab.node_ns,
        ["iptables-nft", "-t", "nat", "-A", "POSTROUTING", "-o", "veth-p1", "-j", "MASQUERADE"],
    )
    res = lab.agent(lab.client_ns[0]).request("tcp", lab.pod_ips["pod1"], 8080)
    assert (res.ok, res.peer) == (True, lab.node_ip)
    res = lab.agent(lab.pod_ns_of("pod2")).request("tcp", lab.pod_ips["pod1"], 8080)
    assert (res.ok, res.peer) == (True, lab.node_ip)


def test_stream_ping(lab_module: Lab) -> None:
    agent = lab_module.agent(lab_module.client_ns[1])
    stream = agent.open_stream(lab_module.pod_ips["pod3"], 9090)
    results = [agent.stream_ping(stream) for _ in range(5)]
    assert all(r.ok and r.pod == "pod3" for r in results), results
    assert len({r.local_port for r in results}) == 1  # one connection, not five
    agent.close_stream(stream)
    with pytest.raises(ProbeError, match="unknown stream"):
        agent.stream_ping(stream)
    with pytest.raises(ProbeError, match="refused"):
        agent.open_stream(lab_module.pod_ips["pod3"], 1)


def test_stream_sees_server_going_away(lab: Lab) -> None:
    agent = lab.agent(lab.client_ns[0])
    server = lab.serve(lab.node_ns, "short", tcp_ports=(18081,))
    stream = agent.open_stream(lab.node_ip, 18081)
    assert agent.stream_ping(stream).ok
    server.kill()
    server.wait()
    res = agent.stream_ping(stream)
    assert not res.ok and res.error in ("closed", "reset")


def test_refused_is_fast_and_silent_address_times_out(lab_module: Lab) -> None:
    agent = lab_module.agent(lab_module.client_ns[0])
    pod1 = lab_module.pod_ips["pod1"]
    for proto in ("tcp", "udp"):
        res = agent.request(proto, pod1, 1, timeout=3)
        assert (res.ok, res.error) == (False, "refused"), proto
        assert res.elapsed < 0.5

    res = agent.request("tcp", lab_module.silent_ip, 8080, timeout=0.3)
    assert (res.ok, res.error) == (False, "timeout")
    assert 0.29 <= res.elapsed < 1.5
    res = agent.request("udp", lab_module.silent_ip, 8080, timeout=0.3)
    assert (res.ok, res.error) == (False, "timeout")


def test_unreachable(lab: Lab) -> None:
    ns = lab.client_ns[1]
    # Give up on ARP after one 100 ms probe instead of three 1 s probes.
    lab.exec(
        ns,
        [
            "sysctl",
            "-q",
            "-w",
            "net.ipv4.neigh.eth0.mcast_solicit=1",
            "net.ipv4.neigh.eth0.retrans_time_ms=100",
        ],
    )
    res = lab.agent(ns).request("tcp", "10.100.0.250", 8080, timeout=3)
    assert (res.ok, res.error) == (False, "unreachable")
    assert res.elapsed < 2


def test_request_many_and_concurrent_callers(lab_module: Lab) -> None:
    agent = lab_module.agent(lab_module.client_ns[0])
    started = time.perf_counter()
    results = agent.request_many("tcp", lab_module.pod_ips["pod2"], 8080, count=300, concurrency=10)
    assert len(results) == 300
    assert all(r.ok and r.pod == "pod2" for r in results)
    assert time.perf_counter() - started < 5

    # The agent handle is shared between threads; answers must reach the right caller.
    def probe(pod: str) -> list[str | None]:
        port = 9090 if pod == "pod1" else 8080
        return [agent.request("tcp", lab_module.pod_ips[pod], port).pod for _ in range(20)]

    with ThreadPoolExecutor(3) as pool:
        answers = dict(zip(lab_module.pod_ips, pool.map(probe, lab_module.pod_ips), strict=True))
    assert answers == {pod: [pod] * 20 for pod in lab_module.pod_ips}


def test_fixed_source_port_is_reusable(lab_module: Lab) -> None:
    agent = lab_module.agent(lab_module.client_ns[0])
    for _ in range(3):
        res = agent.request("tcp", lab_module.pod_ips["pod1"], 8080, sport=40123)
        assert res.ok and res.local_port == 40123
    res = agent.request("udp", lab_module.pod_ips["pod1"], 8080, sport=40124)
    assert res.ok and res.local_port == 40124


def test_http_get_answer(lab_module: Lab) -> None:
    # Pod servers also speak just enough HTTP/1.0 for curl/wrk-based demos and benchmarks.
    pod2 = lab_module.pod_ips["pod2"]
    script = (
        f"import socket; s = socket.create_connection(({pod2!r}, 8080), timeout=2); "
        "s.sendall(b'GET / HTTP/1.0\\r\\nHost: x\\r\\n\\r\\n'); data = b''\n"
        "while chunk := s.recv(4096): data += chunk\n"
        "print(data.decode())"
    )
    out = lab_module.exec(lab_module.client_ns[0], [lab_module.python, "-c", script]).stdout
    assert out.startswith("HTTP/1.0 200 OK")
    assert out.rstrip().endswith(f"pod2 {lab_module.client_ips[0]}")


def test_zz_root_namespace_unchanged(root_snapshot: set[str], lab_module: Lab) -> None:
    # Runs last in this module, with lab_module (and all its veths) still up.
    assert lab_netns(lab_module.id)
    assert root_links() == root_snapshot


def test_a_lab_of_several_nodes_routes_pods_across_nodes() -> None:
    """Four nodes on br-ext's segment, pods spread over them, each node routing the others'
    pod CIDRs: a client, a node and a pod reach pods on every node, over TCP and UDP."""
    before = root_links()
    lab = Lab(pods=4, clients=1, nodes=4)
    with lab:
        assert [n.name for n in lab.nodes] == ["node1", "node2", "node3", "node4"]
        assert lab_netns(lab.id) == sorted(lab.namespaces) and len(lab.namespaces) == 9
        assert {lab.pod_nodes[p].name for p in lab.pod_ips} == {n.name for n in lab.nodes}
        assert lab.pod_ips["pod2"] == "10.244.1.2" and lab.pod_nodes["pod2"].ip == "10.100.0.242"
        for ns in (lab.client_ns[0], lab.nodes[3].ns, lab.pod_ns_of("pod1")):
            agent = lab.agent(ns)
            for pod, ip in lab.pod_ips.items():
                for proto in ("tcp", "udp"):
                    res = agent.request(proto, ip, 8080, timeout=2)
                    assert res.ok and res.pod == pod, (ns, pod, proto, res)
        assert Lab.load(lab.id).nodes == lab.nodes
        assert root_links() == before
    assert lab_netns(lab.id) == []
