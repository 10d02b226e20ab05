"""Live mode switches under load: zero failed requests, zero dropped connections — and the
naive order (remove old, then add new) fails under the same load, so the test can fail."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kproxy.lab.load import LoadHarness
from kproxy.lab.proxy import ProxyProcess, proxy_config
from kproxy.lab.topology import Lab
from kproxy.server.admin import SOCKET_NAME
from tests.support.objects import endpoint, endpoint_slice, node, port, service, write

pytestmark = pytest.mark.kernel
PODS = ("10.244.0.2", "10.244.0.3", "10.244.0.4")


def start(lab: Lab, tmp_path: Path, mode: str, *args: str) -> ProxyProcess:
    src = tmp_path / "objects"
    src.mkdir(parents=True, exist_ok=True)
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
    cfg = tmp_path / f"{mode}.yaml"
    cfg.write_text(proxy_config(mode, sync_period=None))
    return ProxyProcess(
        lab, src, config=cfg, args=["--iptables-backend", "nft", *args], workdir=tmp_path / "kp"
    ).start()


def switch(proxy: ProxyProcess, to: str) -> dict:
    """to: a mode, "previous", or "nftables-compact" / "nftables-upstream" (nftables mode
    in that layout: `--to nftables --nftables-layout L`)."""
    mode, _, layout = to.partition("-")
    if mode == "nftables" and layout:
        to, extra = mode, ["--nftables-layout", layout]
    else:
        extra = []
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kproxy.cli",
            "switch",
            "--to",
            to,
            *extra,
            "--json",
            "--state-dir",
            str(proxy.state_dir),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    return json.loads(out.stdout or "{}") | {"_rc": out.returncode, "_stderr": out.stderr}


def kernel_state(lab: Lab) -> tuple[bool, bool]:
    """(iptables mode present, nftables mode present) in the node."""
    ipt = "KUBE-SERVICES" in lab.exec(lab.node_ns, ["iptables-nft-save", "-t", "nat"]).stdout
    nft = "kube-proxy" in lab.exec(lab.node_ns, ["nft", "list", "tables"]).stdout
    return ipt, nft


def live_modes(lab: Lab) -> set[str]:
    """The dataplanes in the node: modes, and nftables mode's compact layout by its name."""
    nat = lab.exec(lab.node_ns, ["iptables-nft-save", "-t", "nat"]).stdout
    modes = set()
    if "-A PREROUTING" in nat and "-j KUBE-SERVICES" in nat:
        modes.add("iptables")
    if "-j KUBE-PORTALS-CONTAINER" in nat:
        modes.add("userspace")
    tables = lab.exec(lab.node_ns, ["nft", "list", "tables"]).stdout.splitlines()
    if "table ip kube-proxy" in tables:
        modes.add("nftables")
    if "table ip kproxy-compact" in tables:
        modes.add("nftables-compact")
    return modes


def target(report: dict) -> str:
    """The dataplane a switch report went to ("nftables-compact" for that layout)."""
    to = report["to_mode"]
    return f"{to}-compact" if report.get("to_layout") == "compact" else to


# A path through the modes, and nftables mode's compact layout to and from each of them and
# upstream's layout, both ways; ipvs is switched in UML (tests/uml/test_switch_ipvs.py).
PATH = (
    "nftables",
    "userspace",
    "iptables",
    "nftables-compact",
    "nftables-upstream",
    "nftables-compact",
    "userspace",
    "nftables-compact",
    "iptables",
    "previous",
)


def test_switch_through_every_mode_under_load_fails_nothing(lab: Lab, tmp_path: Path) -> None:
    import time

    proxy = start(lab, tmp_path, "iptables")
    # Synced means switchable: the admin socket exists before the first sync is reported
    # (it came after, and a switch sent at once found no socket).
    assert (proxy.state_dir / SOCKET_NAME).exists()
    load = LoadHarness(lab, tcp=("10.96.0.10", 80), udp=("10.96.0.53", 53)).start()
    reports = []
    try:
        time.sleep(0.5)
        for to in PATH:
            report = switch(proxy, to)
            assert report["ok"], report
            reports.append(report)
            assert live_modes(lab) == {target(report)}, (target(report), live_modes(lab))
            status = proxy.status()
            assert (status["mode"], status["nftables_layout"]) == (
                report["to_mode"],
                report["to_layout"],
            )
            time.sleep(0.5)
    finally:
        result = load.stop()
        proxy.stop()
    # "previous" goes back to nftables mode in the layout it had
    went = [to.removesuffix("-upstream") for to in PATH[:-1]]
    assert [target(r) for r in reports] == [*went, "nftables-compact"]
    assert result.fresh_sent > 100 and result.pings_sent > 50 and result.udp_sent > 20, (
        result.summary()
    )
    assert result.failures == 0 and result.streams_dropped == 0, result.summary()
    steps = [s["name"] for s in reports[0]["steps"]]
    assert steps == [
        "check",
        "snapshot",
        "anchor",
        "program",
        "verify",
        "cut-over",
        "remove",
        "snapshot-after",
    ]
    assert any("KUBE-SERVICES" in r for r in reports[0]["removed"])
    assert "anchor" not in lab.exec(lab.node_ns, ["nft", "list", "tables"]).stdout


def test_the_naive_order_fails_under_the_same_load(lab: Lab, tmp_path: Path) -> None:
    proxy = start(lab, tmp_path, "iptables")
    load = LoadHarness(lab, tcp=("10.96.0.10", 80), udp=("10.96.0.53", 53)).start()
    try:
        import time

        time.sleep(0.5)
        # remove old, then add new: what a restart into another mode does without kproxy
        proxy.kill()
        lab.exec(lab.node_ns, [sys.executable, "-m", "kproxy.cli", "cleanup"])
        time.sleep(0.3)  # the time a new proxy takes to come up and program its rules
        nft = start(lab, tmp_path / "nft", "nftables")
        time.sleep(0.5)
    finally:
        result = load.stop()
        proxy.stop()
    nft.stop()
    assert result.failures > 0, f"the naive order should fail: {result.summary()}"


def test_a_switch_that_cannot_run_leaves_the_old_mode_untouched(lab: Lab, tmp_path: Path) -> None:
    proxy = start(lab, tmp_path, "iptables")
    before = lab.exec(lab.node_ns, ["iptables-nft-save", "-t", "nat"]).stdout.count("-A KUBE-")
    report = switch(proxy, "ipvs")
    assert report["_rc"] == 1 and not report["ok"]
    assert "ipvs mode cannot run here" in report["error"] and "not available" in report["error"]
    assert (
        lab.exec(lab.node_ns, ["iptables-nft-save", "-t", "nat"]).stdout.count("-A KUBE-") == before
    )
    assert lab.agent(lab.client_ns[0]).request(proto="tcp", dst="10.96.0.10", port=80).ok
    assert switch(proxy, "previous")["error"].startswith("no previous mode")
    proxy.stop()


def test_status_and_switch_over_the_loopback_tcp_admin_endpoint(lab: Lab, tmp_path: Path) -> None:
    # Loopback is the node namespace's own: the commands run there, as a sidecar would.
    address = "127.0.0.1:10259"
    proxy = start(lab, tmp_path, "iptables", "--admin-address", address)
    token = proxy.state_dir / "admin.token"

    def cli(*argv: str) -> subprocess.CompletedProcess[str]:
        base = [sys.executable, "-m", "kproxy.cli", *argv, "--json"]
        base += ["--state-dir", str(proxy.state_dir), "--admin-address", address]
        return lab.exec(lab.node_ns, base, check=False, timeout=120)

    try:
        assert oct(token.stat().st_mode & 0o777) == "0o600"
        st = cli("status")
        assert st.returncode == 0 and json.loads(st.stdout)["mode"] == "iptables", st.stderr
        wrong = tmp_path / "wrong.token"
        wrong.write_text("0" * 64)
        refused = cli("status", "--admin-token-file", str(wrong))
        assert refused.returncode == 1 and "unauthorized" in refused.stderr
        out = cli("switch", "--to", "nftables")
        report = json.loads(out.stdout or "{}")
        assert out.returncode == 0 and report["ok"], (report, out.stderr)
        assert live_modes(lab) == {"nftables"}
        assert lab.agent(lab.client_ns[0]).request(proto="tcp", dst="10.96.0.10", port=80).ok
    finally:
        proxy.stop()
    assert not token.exists()


def test_changing_mode_in_the_config_file_switches_live(lab: Lab, tmp_path: Path) -> None:
    import time

    proxy = start(lab, tmp_path, "iptables")
    pid = proxy.proc.pid if proxy.proc else None
    try:
        assert proxy.config is not None
        proxy.config.write_text(proxy_config("nftables", sync_period=None))
        deadline = time.monotonic() + 15
        while proxy.status().get("mode") != "nftables" and time.monotonic() < deadline:
            time.sleep(0.1)
        st = proxy.status()
        assert st["mode"] == "nftables" and st["pid"] == pid, "same process, new mode"
        assert st["last_switch"]["ok"]
        assert kernel_state(lab) == (False, True)
        assert lab.agent(lab.client_ns[0]).request(proto="tcp", dst="10.96.0.10", port=80).ok
        # A config that does not validate changes nothing.
        proxy.config.write_text(proxy_config("nftabels", sync_period=None))
        time.sleep(2.0)
        assert proxy.status()["mode"] == "nftables"
        assert "config change ignored" in proxy.log_tail(50)
    finally:
        proxy.stop()


# Killed right after each step's "done" line, so during the next one: "check" -> during the
# snapshot, ..., "cut-over" -> while the old mode's state is being removed.
@pytest.mark.parametrize("after", ["check", "snapshot", "anchor", "program", "verify", "cut-over"])
def test_kill_9_during_a_switch_leaves_a_serving_node_and_restart_converges(
    lab: Lab, tmp_path: Path, after: str
) -> None:
    import threading
    import time

    from kproxy.server.admin import AdminUnavailable, call

    proxy = start(lab, tmp_path, "iptables")
    client = lab.agent(lab.client_ns[0])
    answers: list[object] = []

    def send() -> None:
        # The switch itself, as `kproxy switch` sends it once its preflight passed.
        request = {"op": "switch", "to": "nftables", "timeout": 60}
        try:
            answers.append(call(proxy.state_dir / SOCKET_NAME, request, 60))
        except (AdminUnavailable, OSError) as err:  # the daemon died mid-answer
            answers.append(err)

    logged = proxy.log_path.stat().st_size
    sender = threading.Thread(target=send)
    sender.start()
    marker = f"switch iptables -> nftables: {after} done"
    deadline = time.monotonic() + 30
    with proxy.log_path.open() as log:
        log.seek(logged)
        seen = ""
        while marker not in seen and time.monotonic() < deadline:
            seen += log.read()
            time.sleep(0.002)
    proxy.kill()
    sender.join(timeout=30)
    assert marker in seen, seen[-2000:]
    tail = proxy.log_tail(60)
    assert "switched iptables -> nftables" not in tail, f"the kill after {after} came too late"
    try:
        results = client.request_many(proto="tcp", dst="10.96.0.10", port=80, count=20, timeout=1.0)
        assert all(r.ok for r in results), (
            f"killed after {after}: node not serving: {[r.error for r in results]}"
        )
        proxy.start()  # configured mode: iptables
        deadline = time.monotonic() + 10
        while proxy.status().get("leftovers_removed") is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proxy.status()["mode"] == "iptables"
        assert kernel_state(lab) == (True, False), "the next start converges and cleans the rest"
        assert "kproxy-anchor" not in lab.exec(lab.node_ns, ["nft", "list", "tables"]).stdout
        assert all(
            r.ok for r in client.request_many(proto="tcp", dst="10.96.0.10", port=80, count=10)
        )
    finally:
        proxy.stop()
