"""Startup in iptables mode removes every other mode's leftovers, and nothing else."""

from __future__ import annotations

from pathlib import Path

import pytest

from kproxy.dataplane.ipvs.hold import HOLD_COMMENT, hold_input
from kproxy.dataplane.ipvs.plan import VSKey
from kproxy.dataplane.userspace.render import HANDOFF_COMMENT, HANDOFF_RULE
from kproxy.lab.proxy import ProxyProcess, proxy_config
from kproxy.lab.topology import Lab
from tests.support.objects import endpoint, endpoint_slice, node, port, service, write

pytestmark = pytest.mark.kernel

LEGACY_KUBE = """\
*nat
:KUBE-SERVICES - [0:0]
:KUBE-SVC-XPGD46QRK7WJZT7O - [0:0]
-A PREROUTING -j KUBE-SERVICES
-A KUBE-SERVICES -d 10.96.0.10/32 -p tcp --dport 80 -j KUBE-SVC-XPGD46QRK7WJZT7O
COMMIT
"""
IPVS_MODE_IN_NFT = """\
*nat
:KUBE-NODE-PORT - [0:0]
:KUBE-LOAD-BALANCER - [0:0]
:FOREIGN-NAT - [0:0]
-A PREROUTING -j KUBE-NODE-PORT
-A OUTPUT -j FOREIGN-NAT
-A KUBE-NODE-PORT -m set --match-set KUBE-NODE-PORT-TCP dst -j RETURN
COMMIT
"""
NFT_TABLES = """\
add table ip kube-proxy
add chain ip kube-proxy services
add table inet foreign
add chain inet foreign input { type filter hook input priority 0 ; }
"""


def web_proxy(lab: Lab, tmp_path: Path, mode: str | None, args: list[str]) -> ProxyProcess:
    """A kproxy (not started) serving one service, "web", in `mode` (None: the default)."""
    src = tmp_path / "objects"
    src.mkdir()
    write(src / "node.yaml", node())
    write(
        src / "web.yaml",
        service("web", "10.96.0.10", [port("http", 80, 8080)]),
        endpoint_slice("web", [endpoint("10.244.0.2")], [port("http", 8080)]),
    )
    cfg = tmp_path / "config.yaml"
    cfg.write_text(proxy_config(mode, sync_period=None))
    return ProxyProcess(lab, src, config=cfg, args=args, workdir=tmp_path / "kp")


def test_startup_removes_other_modes_leftovers(lab: Lab, tmp_path: Path) -> None:
    ns = lab.node_ns

    def sh(*argv: str, input: str | None = None) -> str:
        return lab.exec(ns, list(argv), input=input).stdout

    sh("ipset", "create", "KUBE-NODE-PORT-TCP", "bitmap:port", "range", "0-65535")
    sh("ipset", "create", "KUBE-CLUSTER-IP", "hash:ip,port")
    sh("ipset", "create", "FOREIGN-SET", "hash:ip")
    sh("iptables-legacy-restore", "--noflush", input=LEGACY_KUBE)
    sh("iptables-nft-restore", "--noflush", input=IPVS_MODE_IN_NFT)
    sh("nft", "-f", "-", input=NFT_TABLES)
    # A crash during a switch out of ipvs mode left its datagram hold, in both backends.
    held = hold_input([VSKey("UDP", "10.96.0.53", 53)], "-A")
    foreign_raw = "-A PREROUTING -p udp -m udp --dport 4789 -j CT --notrack"
    for flavour in ("legacy", "nft"):
        sh(f"iptables-{flavour}-restore", "--noflush", input=held)
        sh(f"iptables-{flavour}", "-t", "raw", *foreign_raw.split())
    # ... and userspace mode's UDP hand-off rule (legacy only: one backend is enough here).
    sh("iptables-legacy-restore", "--noflush", input=f"*raw\n-I {HANDOFF_RULE}\nCOMMIT\n")
    # This kernel has no dummy interfaces (UML has; issue "ipvs mode" tests that path): a
    # kube-ipvs0 of another type is not kube-proxy's and must be left alone.
    sh("ip", "link", "add", "kube-ipvs0", "type", "bridge")

    proxy = web_proxy(lab, tmp_path, None, ["--iptables-backend", "nft"])
    proxy.start()
    try:
        import time

        deadline = time.monotonic() + 10
        while proxy.status().get("leftovers_removed") is None and time.monotonic() < deadline:
            time.sleep(0.1)
        removed = proxy.status()["leftovers_removed"]
        assert removed, proxy.log_tail()
        text = "\n".join(removed)
        for gone in (
            "KUBE-NODE-PORT",
            "KUBE-LOAD-BALANCER",
            "KUBE-SVC-XPGD46QRK7WJZT7O",
            "ip kube-proxy",
            "KUBE-NODE-PORT-TCP",
            "KUBE-CLUSTER-IP",
        ):
            assert gone in text, gone
        # Other software's state stays; our own mode's chains stay.
        assert "FOREIGN-NAT" in sh("iptables-nft-save", "-t", "nat")
        assert "KUBE-SERVICES" in sh("iptables-nft-save", "-t", "nat")
        assert "KUBE-" not in sh("iptables-legacy-save")
        assert text.count("datagram hold") == 4, text  # 2 chains x 2 backends
        assert text.count("UDP hand-off") == 1, text
        for flavour in ("legacy", "nft"):
            raw = sh(f"iptables-{flavour}-save", "-t", "raw")
            assert HOLD_COMMENT not in raw and foreign_raw in raw, (flavour, raw)
            assert HANDOFF_COMMENT not in raw, (flavour, raw)
        assert "FOREIGN-SET" in sh("ipset", "list", "-n") and "KUBE-" not in sh(
            "ipset", "list", "-n"
        )
        tables = sh("nft", "list", "tables")
        assert "inet foreign" in tables and "kube-proxy" not in tables
        assert "kube-ipvs0" in sh("ip", "-o", "link") and "kube-ipvs0" not in text
        assert (
            lab.agent(lab.client_ns[0]).request(proto="tcp", dst="10.96.0.10", port=80).pod
            == "pod1"
        )
    finally:
        proxy.stop()


def test_a_flavour_without_tables_costs_one_look(tmp_path: Path) -> None:
    """No iptables table of a flavour: the scan reads no save of it (a save of a big
    ruleset costs seconds, and legacy's would create the tables); one table: it does."""
    import subprocess
    import uuid

    from kproxy.dataplane.kernel_dump import KernelDump

    ns = f"kp-lo-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        dump = KernelDump(ns, state_dir=tmp_path)
        assert dump.iptables("nft") is None and dump.iptables("legacy") is None
        names = subprocess.run(
            ["ip", "netns", "exec", ns, "cat", "/proc/net/ip_tables_names"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert names.stdout.split() == []  # the look created no legacy table
        subprocess.run(
            ["ip", "netns", "exec", ns, "iptables-nft", "-t", "nat", "-N", "KUBE-SERVICES"],
            check=True,
        )
        assert dump.iptables("nft") is not None and dump.iptables("legacy") is None
        subprocess.run(
            ["ip", "netns", "exec", ns, "iptables-legacy", "-t", "nat", "-N", "KUBE-SERVICES"],
            check=True,
        )
        assert dump.iptables("legacy") is not None
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


@pytest.mark.parametrize(
    ("layout", "left_over"),
    [("upstream", ["ip kproxy-compact"]), ("compact", ["ip kube-proxy", "ip6 kube-proxy"])],
)
def test_nftables_mode_removes_the_other_layouts_table(
    lab: Lab, tmp_path: Path, layout: str, left_over: list[str]
) -> None:
    """nftables mode in one layout: the other layout's table is a leftover (each has its
    own table), its own table and other software's stay."""
    ns = lab.node_ns

    def sh(*argv: str, input: str | None = None) -> str:
        return lab.exec(ns, list(argv), input=input).stdout

    sh("nft", "-f", "-", input="add table inet foreign\n")
    for table in left_over:
        sh("nft", "add", "table", *table.split())
        sh("nft", "add", "chain", *table.split(), "services")
    proxy = web_proxy(lab, tmp_path, "nftables", ["--nftables-layout", layout])
    proxy.start()
    try:
        import time

        deadline = time.monotonic() + 10
        while proxy.status().get("leftovers_removed") is None and time.monotonic() < deadline:
            time.sleep(0.1)
        removed = proxy.status()["leftovers_removed"]
        assert sorted(r.split(": ")[0].split(" ", 2)[2] for r in removed) == left_over, removed
        tables = set(sh("nft", "list", "tables").splitlines())
        own = "table ip kproxy-compact" if layout == "compact" else "table ip kube-proxy"
        assert tables == {"table inet foreign", own}, tables
        assert proxy.status()["nftables_layout"] == layout
        assert (
            lab.agent(lab.client_ns[0]).request(proto="tcp", dst="10.96.0.10", port=80).pod
            == "pod1"
        )
    finally:
        proxy.stop()
