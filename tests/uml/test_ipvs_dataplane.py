"""IpvsDataplane driven directly on a lab node inside UML: schedulers, weights, graceful
termination, excludeCIDRs, cleanup that spares other IPVS users, the missing-module error,
incremental syncs, sysctls and timeouts, and the renderer against what the kernel holds."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kproxy.dataplane.base import DataplaneUnavailable
from kproxy.dataplane.facts import NodeFacts, RuleOptions
from kproxy.dataplane.iptables.backend import IptablesBackend
from kproxy.dataplane.ipvs import names as n
from kproxy.dataplane.ipvs.check import check_ipvs_support
from kproxy.dataplane.ipvs.proxier import IpvsDataplane
from kproxy.dataplane.ipvs.render import plan_ipvsadm
from kproxy.lab.agent import ProbeResult
from kproxy.lab.topology import Lab
from kproxy.leftovers import clean_leftovers
from kproxy.model.objects import Snapshot
from kproxy.model.snapshot import snapshot_from_objects
from tests.support.objects import endpoint, endpoint_slice, node, port, service, write

pytestmark = pytest.mark.kernel

POD_IPS = ("10.244.0.2", "10.244.0.3", "10.244.0.4")
WEB = [port("http", 80, "http")]
SLICE = [port("http", 8080)]
VIP = "10.96.0.10"

# A long-lived TCP connection from a client: prints the pod that answers each "ping" line
# on stdin; "rst" closes it with a reset (IPVS then forgets it after 10 s, not 2 minutes).
HOLD = r"""
import socket, struct, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)
def ping():
    s.sendall(b"ping\n"); print(s.recv(200).decode().split()[0], flush=True)
ping()
for line in sys.stdin:
    if line.strip() == "ping":
        ping()
    elif line.strip() == "rst":
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
        print("closed", flush=True)
        break
"""


def snapshot(*objects: dict[str, Any]) -> Snapshot:
    return snapshot_from_objects([node(), *objects], "node1")


def web(
    name: str = "web",
    ip: str = VIP,
    pods: tuple[str, ...] = POD_IPS,
    *,
    annotations: dict[str, str] | None = None,
    ports: list[dict[str, Any]] | None = None,
    slice_ports: list[dict[str, Any]] | None = None,
    **spec: Any,
) -> list[dict[str, Any]]:
    svc = service(name, ip, ports or WEB, **spec)
    if annotations:
        svc["metadata"]["annotations"] = annotations
    return [svc, endpoint_slice(name, [endpoint(p) for p in pods], slice_ports or SLICE)]


class Node:
    def __init__(self, lab: Lab) -> None:
        self.lab = lab
        self.made: list[IpvsDataplane] = []

    def dataplane(self, **options: Any) -> IpvsDataplane:
        opts = RuleOptions(cluster_cidrs=("10.244.0.0/16",), **options)
        facts = NodeFacts(
            node_ips=(self.lab.node_ip,), local_addresses=(self.lab.node_ip,), random_fully=True
        )
        backend = IptablesBackend("legacy", netns=self.lab.node_ns)
        dp = IpvsDataplane(backend, facts, opts, netns=self.lab.node_ns)
        dp.prepare()
        self.made.append(dp)
        return dp

    def run(self, *argv: str, check: bool = True) -> str:
        return self.lab.exec(self.lab.node_ns, list(argv), check=check).stdout

    def ipvsadm(self) -> list[str]:
        return self.run("ipvsadm", "-S", "-n").splitlines()

    def spread(self, dst: str, count: int, client: int = 0, dport: int = 80) -> Counter[str]:
        agent = self.lab.agent(self.lab.client_ns[client])
        results: list[ProbeResult] = agent.request_many("tcp", dst, dport, count, timeout=2.0)
        assert all(r.ok for r in results), [r.error for r in results]
        return Counter(str(r.pod) for r in results)


@pytest.fixture
def box(lab_module: Lab) -> Iterator[Node]:
    """The lab node, left without IPVS state, kube-ipvs0, ipsets or ipvs chains afterwards."""
    node_ = Node(lab_module)
    yield node_
    if node_.made:
        node_.made[-1].cleanup()  # every dataplane of a test programs the same node
    for dp in node_.made:
        dp.close()
    node_.run("ipvsadm", "-C")


# --- schedulers and weights ---------------------------------------------------------------


def test_rr_spreads_evenly(box: Node) -> None:
    dp = box.dataplane()
    dp.sync(snapshot(*web()), full=True)
    assert box.spread(VIP, 12) == Counter({"pod1": 4, "pod2": 4, "pod3": 4})


def test_sh_annotation_sticks_each_client_to_one_pod(box: Node) -> None:
    dp = box.dataplane()
    dp.sync(snapshot(*web(annotations={n.SCHEDULER_ANNOTATION: "sh"})), full=True)
    assert f"-A -t {VIP}:80 -s sh" in box.ipvsadm()
    for client in (0, 1):
        first, second = box.spread(VIP, 6, client), box.spread(VIP, 6, client)
        assert len(first) == 1 and first == second, (client, first, second)


def test_wrr_honours_weights_until_a_restart_resets_them(box: Node) -> None:
    """Upstream programs weight 1 and leaves a changed weight alone until its next start."""
    dp = box.dataplane(ipvs_scheduler="wrr")
    snap = snapshot(*web())
    dp.sync(snap, full=True)
    assert box.spread(VIP, 9) == Counter({"pod1": 3, "pod2": 3, "pod3": 3})
    box.run("ipvsadm", "-e", "-t", f"{VIP}:80", "-r", f"{POD_IPS[0]}:8080", "-m", "-w", "3")
    dp.sync(snap, full=False)
    dp.sync(snap, full=True)
    assert f"-a -t {VIP}:80 -r {POD_IPS[0]}:8080 -m -w 3" in box.ipvsadm()
    assert box.spread(VIP, 10) == Counter({"pod1": 6, "pod2": 2, "pod3": 2})
    restarted = box.dataplane(ipvs_scheduler="wrr")
    restarted.sync(snap, full=True)
    assert f"-a -t {VIP}:80 -r {POD_IPS[0]}:8080 -m -w 1" in box.ipvsadm()


def test_render_matches_what_the_kernel_holds(box: Node) -> None:
    dp = box.dataplane()
    snap = snapshot(
        *web(
            annotations={n.SCHEDULER_ANNOTATION: "mh", n.PERSISTENCE_ANNOTATION: "120"},
            type="NodePort",
            ports=[port("http", 80, "http", nodePort=30080)],
        ),
        *web(
            "dns",
            "10.96.0.53",
            ports=[port("dns", 53, 8080, protocol="UDP")],
            slice_ports=[port("dns", 8080, protocol="UDP")],
            sessionAffinity="ClientIP",
        ),
    )
    dp.sync(snap, full=True)
    assert dp.last_plan is not None
    assert sorted(box.ipvsadm()) == sorted(plan_ipvsadm(dp.last_plan).splitlines())
    assert f"-A -t {VIP}:80 -s mh -p 120 -b mh-port" in box.ipvsadm()
    assert "-A -u 10.96.0.53:53 -s rr -p 10800" in box.ipvsadm()
    saved = box.run("ipset", "save")
    for name, entries in dp.last_plan.sets.items():
        got = {line.split()[2] for line in saved.splitlines() if line.startswith(f"add {name} ")}
        assert got == entries, name


# --- graceful termination -----------------------------------------------------------------


def test_removed_endpoint_drains_then_goes(box: Node) -> None:
    dp = box.dataplane()
    dp.sync(snapshot(*web()), full=True)
    lab = box.lab
    hold = lab.spawn(
        lab.client_ns[0],
        [lab.python, "-c", HOLD, VIP, "80"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert hold.stdin is not None and hold.stdout is not None
    try:
        pod = hold.stdout.readline().strip()
        assert pod in lab.pod_ips, pod
        drained = lab.pod_ips[pod]
        rest = tuple(ip for ip in POD_IPS if ip != drained)
        snap = snapshot(*web(pods=rest))
        dp.sync(snap, full=False)
        # Weight 0: no new connections, but the open one is served to the end.
        assert f"-a -t {VIP}:80 -r {drained}:8080 -m -w 0" in box.ipvsadm()
        assert any(dest == (drained, 8080) for _, dest in dp.draining)
        assert pod not in box.spread(VIP, 8)
        hold.stdin.write("ping\n")
        hold.stdin.flush()
        assert hold.stdout.readline().strip() == pod
        dp.sync(snap, full=True)  # a full sync keeps draining too
        assert f"-a -t {VIP}:80 -r {drained}:8080 -m -w 0" in box.ipvsadm()
        hold.stdin.write("rst\n")
        hold.stdin.flush()
        assert hold.stdout.readline().strip() == "closed"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            dp.sync(snap, full=False)
            if not any(drained in line for line in box.ipvsadm()):
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"{drained} still a real server after its connection ended")
        assert not dp.draining
    finally:
        hold.kill()
        hold.wait()


def test_udp_real_server_is_removed_at_once(box: Node) -> None:
    dp = box.dataplane()
    udp = {
        "ports": [port("dns", 53, 8080, protocol="UDP")],
        "slice_ports": [port("dns", 8080, protocol="UDP")],
    }
    dp.sync(snapshot(*web("dns", "10.96.0.53", **udp)), full=True)
    agent = box.lab.agent(box.lab.client_ns[0])
    first = agent.request("udp", "10.96.0.53", 53, timeout=1.0, sport=40153)
    assert first.ok
    gone = box.lab.pod_ips[first.pod or ""]
    rest = tuple(ip for ip in POD_IPS if ip != gone)
    dp.sync(snapshot(*web("dns", "10.96.0.53", rest, **udp)), full=False)
    assert not any(gone in line for line in box.ipvsadm())
    assert not dp.draining


# --- excludeCIDRs and ownership -----------------------------------------------------------------


def test_excluded_cidr_and_foreign_virtual_servers_survive_sync_and_cleanup(box: Node) -> None:
    dp = box.dataplane(ipvs_exclude_cidrs=("10.111.0.0/16",))
    dp.sync(snapshot(*web()), full=True)
    # Another IPVS user's services: one in an excluded CIDR, one on the node's address
    # (a keepalived-style VIP, not a NodePort); and a stale kube-proxy one (its address is
    # on kube-ipvs0, as upstream left it).
    box.run("ipvsadm", "-A", "-t", "10.111.0.5:80", "-s", "wlc")
    box.run("ipvsadm", "-A", "-t", f"{box.lab.node_ip}:8443", "-s", "rr")
    box.run("ip", "addr", "add", "10.96.5.5/32", "dev", n.DUMMY_DEVICE)
    box.run("ipvsadm", "-A", "-t", "10.96.5.5:80", "-s", "rr")
    dp.sync(snapshot(*web()), full=True)
    lines = box.ipvsadm()
    assert "-A -t 10.111.0.5:80 -s wlc" in lines
    assert f"-A -t {box.lab.node_ip}:8443 -s rr" in lines
    assert not any("10.96.5.5" in line for line in lines), "stale kube-proxy VS kept"
    assert f"-A -t {VIP}:80 -s rr" in lines

    removed = dp.cleanup()
    kinds = Counter(o.kind for o in removed)
    assert kinds["ipvs-virtual-server"] == 1 and kinds["interface"] == 1
    assert kinds["ipset"] == len(n.SET_NAMES) and kinds["iptables-chain"] == 11
    lines = box.ipvsadm()
    assert sorted(lines) == [f"-A -t {box.lab.node_ip}:8443 -s rr", "-A -t 10.111.0.5:80 -s wlc"]
    left = [
        line
        for line in box.run("iptables-legacy-save").splitlines()
        if "KUBE-" in line and "KUBE-IPTABLES-HINT" not in line  # kubelet's, not ours
    ]
    assert left == []
    assert not any(s.startswith("KUBE-") for s in box.run("ipset", "list", "-n").split())
    # What `kproxy cleanup` runs (every mode, no configuration) spares them too.
    dp.sync(snapshot(*web()), full=True)
    gone = clean_leftovers(None, netns=box.lab.node_ns)
    assert [str(o).split(":")[0] for o in gone if o.kind == "ipvs-virtual-server"] == [
        "ipvs-virtual-server ipvs TCP 10.96.0.10"
    ]
    assert sorted(box.ipvsadm()) == [
        f"-A -t {box.lab.node_ip}:8443 -s rr",
        "-A -t 10.111.0.5:80 -s wlc",
    ]


# --- the missing-module error -------------------------------------------------------------------


def test_missing_scheduler_module_is_a_clear_startup_error(
    box: Node, block_module: Callable[..., None], tmp_path: Path
) -> None:
    block_module("ip_vs_nq")
    with pytest.raises(DataplaneUnavailable) as caught:
        check_ipvs_support("nq", netns=box.lab.node_ns)
    message = str(caught.value)
    assert "ip_vs_nq (the nq IPVS scheduler)" in message
    assert "`modprobe ip_vs_nq`" in message
    assert "echo ip_vs_nq >> /etc/modules-load.d/kproxy-ipvs.conf" in message
    assert "never falls back" in message
    # The same as a startup error of `kproxy run`: one line, exit code 2, no traceback.
    source = tmp_path / "objects"
    source.mkdir()
    write(source / "node.yaml", node())
    proc = box.lab.exec(
        box.lab.node_ns,
        [
            sys.executable,
            "-m",
            "kproxy.cli",
            "run",
            "--source",
            str(source),
            "--proxy-mode",
            "ipvs",
            "--ipvs-scheduler",
            "nq",
            "--state-dir",
            str(tmp_path / "state"),
        ],
        check=False,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "kproxy: error: ipvs mode needs the kernel module ip_vs_nq" in proc.stderr
    assert box.ipvsadm() == []  # nothing was programmed


# --- incremental syncs, sysctls, timeouts ---------------------------------------------------------


def test_partial_sync_sends_only_the_change(box: Node) -> None:
    dp = box.dataplane()
    objects: list[dict[str, Any]] = []
    for i in range(100):
        objects += web(f"svc{i}", f"10.96.1.{i + 1}", pods=POD_IPS[: 1 + i % 3])
    dp.sync(snapshot(*objects), full=True)
    dp.sync(snapshot(*objects), full=False)  # the one that re-checks the iptables layer
    assert len(box.ipvsadm()) == 100 + sum(1 + i % 3 for i in range(100))
    sent: list[list[str]] = []
    real = dp.ipvs.apply

    def counting(requests: Any) -> Any:
        sent.append([r.what for r in requests])
        return real(requests)

    dp.ipvs.apply = counting  # type: ignore[method-assign]
    dp.sync(snapshot(*objects), full=False)
    assert sent == []  # nothing changed: nothing sent, no ipset or iptables process either
    assert dp.last_timings["ipset"] < 0.05 and dp.last_timings["iptables"] < 0.05
    objects[2 * 7 + 1] = endpoint_slice("svc7", [endpoint(POD_IPS[2])], SLICE)
    dp.sync(snapshot(*objects), full=False)
    assert len(sent) == 1 and sorted(sent[0]) == [
        "add real server 10.244.0.4:8080 to TCP 10.96.1.8:80",
        "delete real server 10.244.0.2:8080 of TCP 10.96.1.8:80",
        "delete real server 10.244.0.3:8080 of TCP 10.96.1.8:80",
    ], sent
    assert f"-a -t 10.96.1.8:80 -r {POD_IPS[2]}:8080 -m -w 1" in box.ipvsadm()


def test_sysctls_strict_arp_and_timeouts(box: Node) -> None:
    dp = box.dataplane(
        ipvs_strict_arp=True, ipvs_tcp_timeout=900, ipvs_tcp_fin_timeout=60, ipvs_udp_timeout=200
    )
    dp.sync(snapshot(*web()), full=True)
    for key, value in (
        ("net.ipv4.vs.conntrack", "1"),
        ("net.ipv4.vs.expire_nodest_conn", "1"),
        ("net.ipv4.vs.expire_quiescent_template", "1"),
        ("net.ipv4.ip_forward", "1"),
        ("net.ipv4.conf.all.arp_ignore", "1"),
        ("net.ipv4.conf.all.arp_announce", "2"),
    ):
        assert box.run("sysctl", "-n", key).strip() == value, key
    assert dp.ipvs.timeouts() == (900, 60, 200)
    assert "900 60 200" in box.run("ipvsadm", "-L", "--timeout")
