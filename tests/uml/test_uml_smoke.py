"""Smoke tests of the UML guest: IPVS, the lab and a hand-made ipvs-mode service work here.

They prove the harness (tests/test_uml.py) and show the ipvs dataplane what the guest
supports: pyroute2 IPVS in masq mode behind a dummy kube-ipvs0, an ipset-driven
iptables-legacy masquerade (dataplane-lab.md §1.4), rr and sh scheduling.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kproxy.dataplane.iptables.backend import detect_backend
from kproxy.lab.topology import Lab
from kproxy.lab.uml import NFTABLES_GUEST_MODULES
from tests.support.uml import Guest

pytestmark = pytest.mark.kernel

VIP = "10.96.0.10"
VIP_PORT = 80
POD_PORT = 8080
REQUESTS = 12

# Runs in the node namespace: pyroute2 talks IPVS generic netlink of that namespace.
IPVS_SCRIPT = """
import json, socket, sys
from pyroute2 import IPVS, IPVSDest, IPVSService
args = json.loads(sys.argv[1])
ipvs = IPVS()
svc = IPVSService(addr=args["vip"], port=args["port"], protocol=socket.IPPROTO_TCP,
                  sched_name=args["sched"])
if args["op"] == "add":
    ipvs.service("add", service=svc)
    for pod in args["pods"]:
        # G12: pyroute2 defaults to direct routing (3); kube-proxy uses masq (0).
        ipvs.dest("add", service=svc,
                  dest=IPVSDest(addr=pod, port=args["pod_port"], fwd_method=0, weight=1))
elif args["op"] == "set":
    ipvs.service("set", service=svc)
elif args["op"] == "del":
    ipvs.service("del", service=svc)
ipvs.close()
"""


def _ipvs(lab: Lab, op: str, sched: str) -> None:
    args = {
        "op": op,
        "vip": VIP,
        "port": VIP_PORT,
        "sched": sched,
        "pods": list(lab.pod_ips.values()),
        "pod_port": POD_PORT,
    }
    lab.exec(lab.node_ns, [lab.python, "-c", IPVS_SCRIPT, json.dumps(args)])


def _masquerade_rules(cluster_cidr: str) -> str:
    # The small iptables layer of upstream's ipvs mode: mark non-pod traffic to a
    # ClusterIP (found through the ipset) and masquerade it on the way out.
    return f"""*nat
:KUBE-SERVICES - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-MARK-MASQ - [0:0]
-A PREROUTING -j KUBE-SERVICES
-A OUTPUT -j KUBE-SERVICES
-A POSTROUTING -j KUBE-POSTROUTING
-A KUBE-SERVICES ! -s {cluster_cidr} -m set --match-set KUBE-CLUSTER-IP dst,dst -j KUBE-MARK-MASQ
-A KUBE-SERVICES -m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT
-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000
-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN
-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000
-A KUBE-POSTROUTING -j MASQUERADE --random-fully
COMMIT
"""


@pytest.fixture(scope="module")
def ipvs_lab(lab_module: Lab, guest: Guest) -> Iterator[Lab]:
    """A ClusterIP VIP:80 -> the 3 pods' :8080, programmed by hand like upstream's ipvs mode."""
    lab = lab_module
    node = lab.node_ns
    lab.exec(node, ["ip", "link", "add", "kube-ipvs0", "type", "dummy"])
    lab.exec(node, ["ip", "addr", "add", f"{VIP}/32", "dev", "kube-ipvs0"])
    # vs.conntrack=1: without it the MASQUERADE rule never sees IPVS-NATed packets (G16).
    lab.exec(node, ["sysctl", "-q", "-w", "net.ipv4.vs.conntrack=1"])
    lab.exec(node, ["ipset", "create", "KUBE-CLUSTER-IP", "hash:ip,port"])
    lab.exec(node, ["ipset", "add", "KUBE-CLUSTER-IP", f"{VIP},tcp:{VIP_PORT}"])
    lab.exec(node, [guest.iptables_restore], input=_masquerade_rules(lab.cluster_cidr))
    _ipvs(lab, "add", "rr")
    yield lab
    # The lab is shared by the module: leave its node as it was.
    _ipvs(lab, "del", "rr")
    lab.exec(node, [guest.iptables, "-t", "nat", "-F"])
    lab.exec(node, [guest.iptables, "-t", "nat", "-X"])
    lab.exec(node, ["ipset", "destroy", "KUBE-CLUSTER-IP"])
    lab.exec(node, ["ip", "link", "del", "kube-ipvs0"])


def _spread(lab: Lab, client: int = 0) -> Counter[str]:
    agent = lab.agent(lab.client_ns[client])
    results = agent.request_many("tcp", VIP, VIP_PORT, REQUESTS, timeout=2.0)
    failed = [r.error for r in results if not r.ok]
    assert not failed, f"requests to {VIP}:{VIP_PORT} failed: {failed}"
    # MASQUERADE applied: the pods see the node's address, not the client's.
    peers = {r.peer for r in results}
    assert peers == {lab.node_ip}, f"pods saw peers {peers}, expected only {lab.node_ip}"
    return Counter(str(r.pod) for r in results)


def test_guest_is_uml_with_private_run_and_tmp(guest: Guest) -> None:
    mounts = {
        fields[1]: fields[2]
        for fields in (line.split() for line in Path("/proc/mounts").read_text().splitlines())
    }
    assert mounts.get("/") == "hostfs"
    assert mounts.get("/run") == "tmpfs", "guest /run must be private (G11)"
    assert mounts.get("/tmp") == "tmpfs"
    assert guest.run_dir is not None and os.access(guest.run_dir, os.W_OK)


def test_ip_vs_and_guest_modules_loaded(guest: Guest) -> None:
    assert Path("/proc/net/ip_vs").exists(), "ip_vs is not loaded"
    # nftables' are checked below: Debian's UML kernels have no nf_tables for ip.
    missing = [
        m
        for m, state in guest.modules.items()
        if state == "missing" and m not in NFTABLES_GUEST_MODULES
    ]
    assert not missing, f"modules that did not load: {missing}"
    guest.require("ip_vs", "ip_vs_rr", "ip_vs_sh", "xt_set", "ip_set_hash_ipport")


def test_nftables_modules_loaded(guest: Guest) -> None:
    # Fails naming them in kproxy's own kernel; skipped in Debian's, which lack them.
    guest.require_nftables()


def test_lab_comes_up_and_pods_answer(lab_module: Lab) -> None:
    agent = lab_module.agent(lab_module.client_ns[0])
    for pod, ip in lab_module.pod_ips.items():
        result = agent.request("tcp", ip, POD_PORT, timeout=2.0)
        assert result.ok and result.pod == pod, f"{pod} at {ip}: {result}"


def test_ipvs_masq_service_listed(ipvs_lab: Lab) -> None:
    out = ipvs_lab.exec(ipvs_lab.node_ns, ["ipvsadm", "-S", "-n"]).stdout
    assert f"-A -t {VIP}:{VIP_PORT} -s rr" in out
    for ip in ipvs_lab.pod_ips.values():
        # -m: masquerading (NAT), not the direct routing pyroute2 defaults to.
        assert f"-a -t {VIP}:{VIP_PORT} -r {ip}:{POD_PORT} -m -w 1" in out


def test_ipvs_rr_spreads_evenly(ipvs_lab: Lab) -> None:
    counts = _spread(ipvs_lab)
    per_pod = REQUESTS // len(ipvs_lab.pods)
    assert counts == dict.fromkeys(ipvs_lab.pod_ips, per_pod), counts


def test_ipvs_sh_sticks_to_one_pod(ipvs_lab: Lab) -> None:
    _ipvs(ipvs_lab, "set", "sh")
    try:
        for client in range(len(ipvs_lab.client_ns)):
            first, second = _spread(ipvs_lab, client), _spread(ipvs_lab, client)
            assert len(first) == 1, f"client {client}: sh spread over {dict(first)}"
            assert first.keys() == second.keys(), f"client {client}: {first} then {second}"
    finally:
        _ipvs(ipvs_lab, "set", "rr")


def test_lab_node_detects_legacy_iptables(lab_module: Lab) -> None:
    # The lab node carries kubelet's hint in the legacy mangle table (tests/uml/conftest.py),
    # whether or not the guest kernel has nf_tables for ip (G9: Debian's do not).
    assert detect_backend(lab_module.node_ns) == "legacy"


def test_blocked_module_cannot_be_loaded(
    lab_module: Lab, block_module: Callable[..., None]
) -> None:
    block_module("ip_vs_mh")
    assert not Path("/sys/module/ip_vs_mh").exists()
    assert lab_module.exec(lab_module.node_ns, ["modprobe", "ip_vs_mh"], check=False).returncode
    # The kernel's own autoload (a service asking for the mh scheduler) is refused too.
    add = ["ipvsadm", "-A", "-t", "10.96.0.99:80", "-s", "mh"]
    proc = lab_module.exec(lab_module.node_ns, add, check=False)
    assert proc.returncode != 0 and "not found" in proc.stderr, proc.stderr
