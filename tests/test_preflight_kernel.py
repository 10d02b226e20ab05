"""Preflight against a real lab node: each broken condition is created in the node's
network namespace (sysctls, a filled conntrack table, leftover chains, a deleted rule, a
NodePort collision), and the finding and the exit code are asserted. A healthy lab passes
clean. `kproxy switch` refuses on a block and leaves the dataplane untouched; --force
proceeds and says so."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kproxy.dataplane.base import AVAILABLE_MODES
from kproxy.dataplane.nftables.layouts import LAYOUTS, TABLES, target_name
from kproxy.lab.proxy import ProxyProcess
from kproxy.lab.topology import Lab
from kproxy.ops.preflight import NodeAccess, run_preflight
from kproxy.ops.preflight.findings import Severity
from kproxy.ops.preflight.run import PreflightResult
from tests.support.objects import endpoint, endpoint_slice, port, service
from tests.support.preflight_lab import PODS, cli, config, nat_rules, start

pytestmark = pytest.mark.kernel


def preflight(lab: Lab, to: str, tmp_path: Path, **kw: Any) -> PreflightResult:
    """In-process, every read inside the lab node's namespace."""
    kw.setdefault("config_path", config(tmp_path, to))
    return run_preflight(
        to, access=NodeAccess(netns=lab.node_ns), node_name="node1", state_dir=tmp_path, **kw
    )


def ids(result: PreflightResult, severity: Severity | None = None) -> list[str]:
    return [f.id for f in result.findings if severity is None or f.severity is severity]


def sysctl(lab: Lab, name: str, value: object) -> None:
    lab.exec(lab.node_ns, ["sysctl", "-q", "-w", f"{name}={value}"])


@pytest.fixture
def node_sysctls(lab_module: Lab) -> Iterator[Lab]:
    """The shared lab, with the sysctls tests change put back afterwards."""
    names = (
        "net.ipv4.ip_forward",
        "net.ipv4.conf.all.route_localnet",
        "net.netfilter.nf_conntrack_tcp_timeout_established",
    )
    before = {
        n: lab_module.exec(lab_module.node_ns, ["sysctl", "-n", n]).stdout.strip() for n in names
    }
    yield lab_module
    for n, v in before.items():
        sysctl(lab_module, n, v)


def nft_tables(lab: Lab) -> str:
    return lab.exec(lab.node_ns, ["nft", "list", "tables"]).stdout


# --- a healthy node ----------------------------------------------------------------------------


def kernel_has_ipvs() -> bool:
    """ip_vs loaded, or a module the kernel can load (the host of this repo has neither)."""
    if Path("/proc/net/ip_vs").exists():
        return True
    return (
        Path("/proc/modules").exists()
        and subprocess.run(["modinfo", "ip_vs"], capture_output=True, check=False).returncode == 0
    )


def test_a_healthy_lab_passes_clean_for_every_available_mode(lab: Lab, tmp_path: Path) -> None:
    modes = [m for m in AVAILABLE_MODES if m != "ipvs" or kernel_has_ipvs()]
    proxy = start(lab, tmp_path)
    try:
        for mode in modes:
            out = cli(
                lab,
                "preflight",
                "--to",
                mode,
                "--json",
                "--state-dir",
                str(proxy.state_dir),
                "--config",
                str(config(tmp_path, mode)),
            )
            doc = json.loads(out.stdout)
            problems = [f for f in doc["findings"] if f["severity"] != "info"]
            assert out.returncode == 0 and not problems, (mode, problems)
            assert doc["current_mode"] == "iptables" and doc["current_flavour"] == "nft"
            assert "objects.named_ports" in doc["checks_run"], "the running kproxy's --source"
            backup = next(f for f in doc["findings"] if f["id"] == "backup.ok")
            saved = json.loads(Path(backup["facts"]["path"]).read_text())
            assert "KUBE-SERVICES" in saved["iptables-nft"]["output"]
            assert backup["facts"]["destinations"] == 2
    finally:
        proxy.stop()


# --- node conditions ---------------------------------------------------------------------------


def test_ip_forward_off_blocks(node_sysctls: Lab, tmp_path: Path) -> None:
    lab = node_sysctls
    sysctl(lab, "net.ipv4.ip_forward", 0)
    result = preflight(lab, "nftables", tmp_path)
    assert "sysctl.ip-forward-off" in ids(result, Severity.BLOCK) and result.exit_code == 1
    out = cli(lab, "preflight", "--to", "nftables", "--state-dir", str(tmp_path))
    assert out.returncode == 1 and "BLOCK  sysctl.ip-forward-off" in out.stdout
    assert "fix: sysctl -w net.ipv4.ip_forward=1" in out.stdout
    sysctl(lab, "net.ipv4.ip_forward", 1)
    assert "sysctl.ip-forward-off" not in ids(preflight(lab, "nftables", tmp_path))


def test_a_short_established_timeout_warns(node_sysctls: Lab, tmp_path: Path) -> None:
    lab = node_sysctls
    sysctl(lab, "net.netfilter.nf_conntrack_tcp_timeout_established", 300)
    result = preflight(lab, "nftables", tmp_path, families=["conntrack"])
    assert "conntrack.tcp-timeout-short" in ids(result, Severity.WARN) and result.exit_code == 0


def test_route_localnet_left_on_for_nftables_mode(node_sysctls: Lab, tmp_path: Path) -> None:
    lab = node_sysctls
    sysctl(lab, "net.ipv4.conf.all.route_localnet", 1)
    result = preflight(lab, "nftables", tmp_path, families=["sysctls"])
    assert "sysctl.route-localnet-exposed" in ids(result, Severity.WARN)
    sysctl(lab, "net.ipv4.conf.all.route_localnet", 0)
    assert "sysctl.route-localnet-off" in ids(
        preflight(lab, "iptables", tmp_path, families=["sysctls"])
    )


def test_conntrack_table_70_percent_full_warns(lab_module: Lab, tmp_path: Path) -> None:
    lab = lab_module
    maximum = int(lab.exec(lab.node_ns, ["cat", "/proc/sys/net/netfilter/nf_conntrack_max"]).stdout)
    wanted = int(maximum * 0.7) + 10
    lines = (
        f"-I -p udp -s 10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255} -d 192.0.2.1 "
        "--sport 1000 --dport 53 -t 300\n"
        for i in range(wanted)
    )
    batch = tmp_path / "fill.txt"
    batch.write_text("".join(lines))
    try:
        lab.exec(lab.node_ns, ["conntrack", "-R", str(batch)], timeout=120)
        result = preflight(lab, "nftables", tmp_path, families=["conntrack"])
        f = next(f for f in result.findings if f.id == "conntrack.headroom")
        assert f.severity is Severity.WARN and f.facts["ratio"] >= 0.7
        assert result.exit_code == 0
    finally:
        lab.exec(lab.node_ns, ["conntrack", "-F"], check=False)
    assert "conntrack.headroom" not in ids(
        preflight(lab, "nftables", tmp_path, families=["conntrack"])
    )


def test_pods_on_a_bridge_without_bridge_nf_call_iptables(lab_module: Lab, tmp_path: Path) -> None:
    lab = lab_module
    name = "net.bridge.bridge-nf-call-iptables"
    before = lab.exec(lab.node_ns, ["sysctl", "-n", name]).stdout.strip()
    lab.exec(lab.node_ns, ["ip", "link", "add", "cni0", "type", "bridge"])
    try:
        lab.exec(lab.node_ns, ["ip", "addr", "add", "10.244.1.1/24", "dev", "cni0"])
        sysctl(lab, name, 0)
        result = preflight(lab, "iptables", tmp_path, families=["sysctls"])
        f = next(f for f in result.findings if f.id == "sysctl.bridge-nf-call-iptables-off")
        assert f.facts["bridges"] == ["cni0"] and result.exit_code == 0
        sysctl(lab, name, 1)
        assert "sysctl.bridge-nf-call-iptables-off" not in ids(
            preflight(lab, "iptables", tmp_path, families=["sysctls"])
        )
    finally:
        lab.exec(lab.node_ns, ["ip", "link", "delete", "cni0"], check=False)
        sysctl(lab, name, before)
    # br-ext only holds clients: not a pod bridge, so nothing to say
    assert not [
        i
        for i in ids(preflight(lab, "iptables", tmp_path, families=["sysctls"]))
        if i.startswith(("sysctl.br", "sysctl.bridge"))
    ]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_leftovers_of_other_modes_and_chains_in_both_backends(
    lab_module: Lab, tmp_path: Path, layout: str
) -> None:
    """A node serving iptables mode from iptables-legacy, with leftovers: nftables mode's
    table (in either layout), an ipvs ipset, kube-proxy chains in iptables-nft. (This
    kernel has no dummy interfaces, so no kube-ipvs0 here.)"""
    lab = lab_module
    table = TABLES[layout]
    setup = [
        ["iptables-legacy", "-t", "nat", "-N", "KUBE-SERVICES"],
        ["iptables-legacy", "-t", "nat", "-A", "PREROUTING", "-j", "KUBE-SERVICES"],
        ["nft", "add", "table", "ip", table],
        ["ipset", "create", "KUBE-CLUSTER-IP", "hash:ip,port"],
        ["iptables-nft", "-t", "nat", "-N", "KUBE-SERVICES"],
        ["iptables-nft", "-t", "nat", "-N", "KUBE-SVC-AAAAAAAAAAAAAAAA"],
        ["iptables-nft", "-t", "nat", "-A", "KUBE-SERVICES", "-j", "KUBE-SVC-AAAAAAAAAAAAAAAA"],
    ]
    for argv in setup:
        lab.exec(lab.node_ns, argv)
    try:
        result = preflight(lab, "userspace", tmp_path, families=["kernel", "dataplane"])
        assert result.current_mode == "iptables" and result.current_flavour == "legacy"
        left = next(f for f in result.findings if f.id == "dataplane.leftovers")
        assert left.severity is Severity.WARN and result.exit_code == 0
        assert f"nft delete table ip {table}" in left.fix
        assert "ipset destroy KUBE-CLUSTER-IP" in left.fix
        assert "iptables.both-backends" in ids(result, Severity.WARN)
        nft_target = preflight(lab, "nftables", tmp_path, families=["dataplane"])
        assert "dataplane.target-state-present" in ids(nft_target, Severity.INFO)
        # The fix commands are exact: run them in order, and the findings are gone.
        for cmd in left.fix:
            for part in cmd.split(" && "):
                lab.exec(lab.node_ns, shlex.split(part))
        again = preflight(lab, "userspace", tmp_path, families=["kernel", "dataplane"])
        assert not {"dataplane.leftovers", "iptables.both-backends"} & set(ids(again))
    finally:
        lab.exec(lab.node_ns, [sys.executable, "-m", "kproxy.cli", "cleanup"], check=False)


# --- the running proxy -------------------------------------------------------------------------


def test_a_rule_deleted_behind_the_proxys_back(lab: Lab, tmp_path: Path) -> None:
    proxy = start(lab, tmp_path)
    try:
        api = next(
            line
            for line in nat_rules(lab)
            if line.startswith("-A KUBE-SERVICES") and "10.96.0.20" in line
        )
        lab.exec(lab.node_ns, ["iptables-nft", "-t", "nat", "-D", *shlex.split(api[3:])])
        result = preflight(lab, "nftables", tmp_path, source=proxy.source, current_mode="iptables")
        f = next(f for f in result.findings if f.id == "dataplane.missing-services")
        assert f.facts["missing"] == ["tcp 10.96.0.20:443"] and f.severity is Severity.WARN
        assert "default/api:https" in f.found
    finally:
        proxy.stop()


def switch(lab: Lab, proxy: ProxyProcess, to: str, *extra: str) -> tuple[int, dict[str, Any]]:
    out = subprocess.run(
        [sys.executable, "-m", "kproxy.cli", "switch", "--to", to, "--json",
         "--state-dir", str(proxy.state_dir), *extra],
        capture_output=True,
        text=True,
        check=False,
        timeout=180,
    )  # fmt: skip
    return out.returncode, json.loads(out.stdout or "{}")


def test_switch_refuses_on_a_block_and_force_proceeds(lab: Lab, tmp_path: Path) -> None:
    """Run from the host namespace, as the switch tests do: preflight reads the proxy's
    namespace (found from its pid), not the caller's."""
    proxy = start(lab, tmp_path)
    try:
        sysctl(lab, "net.ipv4.ip_forward", 0)
        before = nat_rules(lab)
        rc, report = switch(lab, proxy, "nftables")
        assert rc == 1 and report["refused"] and not report["ok"]
        assert "sysctl.ip-forward-off" in report["error"]
        assert report["preflight"]["netns"] == lab.node_ns
        assert nat_rules(lab) == before and "kube-proxy" not in nft_tables(lab)
        assert proxy.status()["mode"] == "iptables"
        text = subprocess.run(
            [sys.executable, "-m", "kproxy.cli", "switch", "--to", "nftables",
             "--state-dir", str(proxy.state_dir)],
            capture_output=True, text=True, check=False, timeout=180,
        )  # fmt: skip
        assert text.returncode == 1 and "BLOCK  sysctl.ip-forward-off" in text.stdout
        assert "--force overrides" in text.stderr

        # Forced: the switch runs, and fails its own verification for the reason preflight
        # gave (pods answer through the node's proxy ARP, which needs forwarding), so it
        # rolls back and iptables keeps serving.
        rc, report = switch(lab, proxy, "nftables", "--force")
        assert report["forced"] and report["preflight"]["safe"] is False, report
        assert rc == 1 and not report["ok"] and "self-probe failed" in report["error"]
        assert [s["name"] for s in report["steps"]][-1] == "roll-back"
        assert nat_rules(lab) == before and proxy.status()["mode"] == "iptables"
        assert list(proxy.state_dir.glob("switch-*-forced-nftables-preflight.json"))
        sysctl(lab, "net.ipv4.ip_forward", 1)
        rc, report = switch(lab, proxy, "nftables")
        assert rc == 0 and report["ok"] and report["forced"] is False
    finally:
        proxy.stop()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_colliding_services_move_with_the_mode_as_preflight_predicts(
    lab: Lab, tmp_path: Path, layout: str
) -> None:
    """Two services on one NodePort, two on one ClusterIP:port. iptables serves the first
    of each (in service-port order), nftables (either layout) the last: preflight blocks
    the switch, and a forced one really moves the traffic."""
    to = ("--nftables-layout", layout)
    twins = [
        service("one", "10.96.1.1", [port("http", 80, 8080, nodePort=30080)], type="NodePort"),
        service("two", "10.96.1.2", [port("http", 80, 8080, nodePort=30080)], type="NodePort"),
        service("four", "10.96.1.3", [port("http", 80, 8080)]),
        service("three", "10.96.1.3", [port("http", 80, 8080)]),
    ]
    pods = {"one": PODS[0], "two": PODS[1], "four": PODS[2], "three": PODS[0]}
    slices = [endpoint_slice(n, [endpoint(ip)], [port("http", 8080)]) for n, ip in pods.items()]
    proxy = start(lab, tmp_path, *twins, *slices)
    client = lab.agent(lab.client_ns[0])

    def served() -> tuple[set[str | None], set[str | None]]:
        nodeport = {client.request(proto="tcp", dst=lab.node_ip, port=30080).pod for _ in range(4)}
        cluster = {client.request(proto="tcp", dst="10.96.1.3", port=80).pod for _ in range(4)}
        return nodeport, cluster

    try:
        assert served() == ({"pod1"}, {"pod3"})  # default/one, default/four
        rc, report = switch(lab, proxy, "nftables", *to)
        assert rc == 1 and report["refused"]
        blocked = {f["id"]: f for f in report["preflight"]["findings"] if f["severity"] == "block"}
        assert blocked["objects.nodeport-collision"]["facts"]["served_after"] == "default/two:http"
        assert blocked["objects.destination-collision"]["facts"]["served_after"] == (
            "default/three:http"
        )
        rc, report = switch(lab, proxy, "nftables", *to, "--force")
        assert rc == 0 and report["ok"] and report["forced"], report
        assert report["to_layout"] == layout
        # The record of the forced switch names the layout it went to.
        forced = f"switch-*-forced-{target_name('nftables', layout)}-preflight.json"
        assert list(proxy.state_dir.glob(forced))
        assert served() == ({"pod2"}, {"pod1"})  # default/two, default/three
    finally:
        proxy.stop()
