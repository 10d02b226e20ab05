"""A live switch into ipvs mode on a real IPVS kernel, under load.

iptables mode and ipvs mode share one iptables backend here (legacy, the only one UML
has) and both name chains KUBE-SERVICES, KUBE-POSTROUTING, KUBE-MARK-MASQ, KUBE-FORWARD
and KUBE-PROXY-FIREWALL: each side's detach and cleanup must leave the other's alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kproxy.lab.load import LoadHarness
from kproxy.lab.proxy import ProxyProcess
from kproxy.lab.topology import Lab
from tests.objects import endpoint, endpoint_slice, node, port, service, write

pytestmark = pytest.mark.kernel

CONFIG = """\
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
hostnameOverride: node1
clusterCIDR: 10.244.0.0/16
conntrack: {maxPerCore: 0}
"""
PODS = ("10.244.0.2", "10.244.0.3", "10.244.0.4")


def switch(proxy: ProxyProcess, to: str) -> dict[str, Any]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kproxy.cli",
            "switch",
            "--to",
            to,
            "--json",
            "--state-dir",
            str(proxy.state_dir),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=240,
    )
    return json.loads(out.stdout or "{}") | {"_rc": out.returncode, "_stderr": out.stderr[-2000:]}


def hairpin_ok(lab: Lab) -> bool:
    """pod1 reaching itself through its service is masqueraded: needs the iptables layer."""
    results = lab.agent(lab.pod_ns[0]).request_many("tcp", "10.96.0.10", 80, 6, timeout=1.0)
    return all(r.ok for r in results) and all(
        r.peer == lab.node_ip for r in results if r.pod == "pod1"
    )


def test_iptables_to_ipvs_under_load_fails_nothing(lab: Lab, tmp_path: Path) -> None:
    src = tmp_path / "objects"
    src.mkdir()
    write(src / "node.yaml", node())
    write(
        src / "web.yaml",
        service("web", "10.96.0.10", [port("http", 80, 8080)]),
        endpoint_slice("web", [endpoint(ip) for ip in PODS], [port("http", 8080)]),
    )
    write(
        src / "dns.yaml",
        service("dns", "10.96.0.53", [port("dns", 53, 8080, protocol="UDP")]),
        endpoint_slice("dns", [endpoint(ip) for ip in PODS], [port("dns", 8080, protocol="UDP")]),
    )
    cfg = tmp_path / "config.yaml"
    cfg.write_text(CONFIG)
    proxy = ProxyProcess(lab, src, config=cfg, workdir=tmp_path / "kp").start(timeout=60)
    load = LoadHarness(lab, tcp=("10.96.0.10", 80), udp=("10.96.0.53", 53)).start()
    node_ns = lab.node_ns
    try:
        time.sleep(0.5)
        into = switch(proxy, "ipvs")
        assert into.get("ok"), into
        assert any("KUBE-SVC-" in r for r in into["removed"])  # iptables mode's state went

        def layer_back() -> bool:
            # iptables mode's cleanup deleted the chains both modes name alike; the daemon's
            # first sync after the switch writes ipvs mode's layer again.
            nat = lab.exec(node_ns, ["iptables-legacy-save", "-t", "nat"]).stdout
            return (
                '-A PREROUTING -m comment --comment "kubernetes service portals"' in nat
                and "--match-set KUBE-CLUSTER-IP" in nat
            )

        deadline = time.monotonic() + 10
        while not layer_back():
            assert time.monotonic() < deadline, "ipvs mode's iptables layer did not come back"
            time.sleep(0.2)
        nat = lab.exec(node_ns, ["iptables-legacy-save", "-t", "nat"]).stdout
        assert "KUBE-SVC-" not in nat and "KUBE-NODEPORTS" not in nat, nat
        assert "-A -t 10.96.0.10:80 -s rr" in lab.exec(node_ns, ["ipvsadm", "-S", "-n"]).stdout
        assert hairpin_ok(lab)
    finally:
        result = load.stop()
        proxy.stop()
    assert result.fresh_sent > 50 and result.pings_sent > 20, result.summary()
    assert result.failures == 0 and result.streams_dropped == 0, result.summary()
