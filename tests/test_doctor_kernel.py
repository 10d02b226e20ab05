"""kproxy doctor on a real lab node: services broken at each layer for real (no pods, a
port nothing listens on, a named port nobody declares, a rule deleted behind the proxy's
back, a silent endpoint, a stale UDP flow), each named at the right layer; the fix
commands it prints make the finding go away."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kproxy.lab.topology import Lab
from tests.support.objects import endpoint, endpoint_slice, port, service
from tests.support.preflight_lab import cli, nat_rules, start

pytestmark = pytest.mark.kernel


def doctor(lab: Lab, state_dir: Path, *args: str) -> tuple[int, dict[str, Any]]:
    out = cli(lab, "doctor", "--json", "--state-dir", str(state_dir), *args)
    return out.returncode, json.loads(out.stdout)


def by_service(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s["service"]: s for s in doc["services"]}


def test_a_healthy_node_and_services_are_broken_at_the_right_layer(
    lab: Lab, tmp_path: Path
) -> None:
    broken = [
        service("lonely", "10.96.2.1", [port("http", 80, 8080)], selector={"app": "gone"}),
        service("named", "10.96.2.2", [port("http", 80, "web"), port("m", 9090, "metrics")]),
        endpoint_slice("named", [endpoint("10.244.0.2")], [port("http", 8080)]),
        service("closed", "10.96.2.3", [port("http", 80, 7777)]),
        endpoint_slice("closed", [endpoint("10.244.0.3")], [port("http", 7777)]),
    ]
    proxy = start(lab, tmp_path, *broken)
    try:
        rc, doc = doctor(lab, proxy.state_dir, "--service", "default/web")
        assert rc == 0 and doc["services"][0]["layers"] == dict.fromkeys(
            ("object", "endpoints", "kernel", "conntrack"), "ok"
        )
        api = next(
            r for r in nat_rules(lab) if r.startswith("-A KUBE-SERVICES") and "10.96.0.20" in r
        )
        lab.exec(lab.node_ns, ["iptables-nft", "-t", "nat", "-D", *shlex.split(api[3:])])
        rc, doc = doctor(lab, proxy.state_dir)
        layers = {name: s["broken_layer"] for name, s in by_service(doc).items()}
        assert rc == 1 and layers == {
            "default/web": None,
            "default/api": "kernel",
            "default/lonely": "endpoints",
            "default/named": "endpoints",
            "default/closed": "endpoints",
        }, layers
        ids = {s["service"]: [f["id"] for f in s["findings"]] for s in doc["services"]}
        assert ids["default/api"] == ["kernel.missing", "kernel.probe-failed"]
        assert ids["default/lonely"] == ["endpoints.none"]
        assert ids["default/named"] == ["endpoints.named-port"]
        closed = by_service(doc)["default/closed"]["findings"][0]
        assert closed["id"] == "endpoints.unreachable" and "(refused)" in closed["found"]
        # The text report, as an operator reads it.
        text = cli(lab, "doctor", "--state-dir", str(proxy.state_dir), "--service", "default/api")
        assert "default/api: broken at the kernel layer" in text.stdout
        assert "symptom: this service fails on this node only" in text.stdout
    finally:
        proxy.stop()


def test_a_hung_pod_leaves_unreplied_flows(lab: Lab, tmp_path: Path) -> None:
    """pod1 drops its TCP 9090 on the floor (a hung process, a pod firewall): clients' SYNs
    are DNATed and forwarded, and their conntrack entries stay UNREPLIED."""
    pod = lab.pod_ips["pod1"]
    silent = [
        service("silent", "10.96.3.1", [port("http", 80, 9090)]),
        endpoint_slice("silent", [endpoint(pod)], [port("http", 9090)]),
    ]
    proxy = start(lab, tmp_path, *silent)
    drop = ["-p", "tcp", "--dport", "9090", "-j", "DROP"]
    lab.exec(lab.pod_ns_of("pod1"), ["iptables-nft", "-A", "INPUT", *drop])
    try:
        assert not lab.agent(lab.client_ns[0]).request("tcp", "10.96.3.1", 80, timeout=0.5).ok
        rc, doc = doctor(lab, proxy.state_dir, "--service", "default/silent")
        (svc,) = doc["services"]
        assert rc == 1 and svc["broken_layer"] == "endpoints"
        found = {f["id"]: f for f in svc["findings"]}
        assert f"{pod}:9090 (timeout)" in found["endpoints.unreachable"]["found"]
        unreplied = found["conntrack.unreplied"]
        assert unreplied["facts"]["unreplied"] >= 1 and "10.100.0.2" in unreplied["found"]
    finally:
        lab.exec(lab.pod_ns_of("pod1"), ["iptables-nft", "-D", "INPUT", *drop], check=False)
        proxy.stop()


def test_a_stale_udp_flow_and_its_fix(lab: Lab, tmp_path: Path) -> None:
    """A UDP flow still translated to an address that is no endpoint any more, as the
    kernel keeps it when nobody cleans up (#19029). The printed fix removes it."""
    dns = [
        service("dns", "10.96.0.53", [port("dns", 53, 8080, protocol="UDP")]),
        endpoint_slice("dns", [endpoint("10.244.0.2")], [port("dns", 8080, protocol="UDP")]),
    ]
    proxy = start(lab, tmp_path, *dns)
    try:
        lab.exec(
            lab.node_ns,
            ["conntrack", "-I", "-p", "udp", "-s", "10.100.0.2", "-d", "10.96.0.53",
             "--sport", "40000", "--dport", "53", "-r", "10.244.0.9", "-q", "10.100.0.2",
             "--reply-port-src", "8080", "--reply-port-dst", "40000", "-t", "120"],
        )  # fmt: skip
        rc, doc = doctor(lab, proxy.state_dir, "--service", "default/dns", "--no-probe")
        (svc,) = doc["services"]
        assert rc == 1 and svc["broken_layer"] == "conntrack"
        (stale,) = [f for f in svc["findings"] if f["id"] == "conntrack.stale-udp"]
        assert stale["facts"]["stale"] == ["10.244.0.9"] and "#19029" in stale["facts"]["seen"]
        for cmd in stale["fix"]:
            if cmd.startswith("conntrack -D"):
                lab.exec(lab.node_ns, shlex.split(cmd), check=False)
        rc, doc = doctor(lab, proxy.state_dir, "--service", "default/dns", "--no-probe")
        assert rc == 0 and doc["services"][0]["broken_layer"] is None
    finally:
        proxy.stop()


def test_doctor_from_another_namespace_reads_the_proxys(lab: Lab, tmp_path: Path) -> None:
    proxy = start(lab, tmp_path)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "kproxy.cli", "doctor", "--json",
             "--state-dir", str(proxy.state_dir)],
            capture_output=True, text=True, check=False, timeout=120,
        )  # fmt: skip
        doc = json.loads(out.stdout)
        assert out.returncode == 0, doc
        assert doc["netns"] == lab.node_ns and doc["mode"] == "iptables"
        assert sorted(by_service(doc)) == ["default/api", "default/web"]
    finally:
        proxy.stop()
