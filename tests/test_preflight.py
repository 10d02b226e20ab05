"""Preflight checks against fake nodes: a file tree for /proc, /sys, /lib/modules and /etc,
canned command output, recorded dataplanes. Each check: the broken condition, the finding
id, the exit code. (The lab and UML versions are in test_preflight_kernel.py and
tests/uml/test_preflight_*.py.)"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from kproxy.config import ProxyConfig, parse_config
from kproxy.ops.preflight import run_preflight
from kproxy.ops.preflight.findings import Finding, Severity, exit_code, render_text
from kproxy.ops.preflight.run import PreflightResult, detect_current
from tests.support.objects import endpoint, endpoint_slice, node, port, service
from tests.support.preflight_fakes import ADDRS, RELEASE, FakeNode, recorded

UML_MODULES = Path("/usr/lib/uml/modules/6.1.176")
PODS = ("10.244.0.2", "10.244.0.3")


# --- canned rules, objects and runs (the fake node is tests/support/preflight_fakes.py) -------

IPT_SAVE = """\
*nat
:PREROUTING ACCEPT [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-SVC-AAAA - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A KUBE-SERVICES -d 10.96.0.10/32 -p tcp -m comment --comment "default/web:http cluster IP" -m tcp --dport 80 -j KUBE-SVC-AAAA
{extra}COMMIT
"""  # noqa: E501


def ipt_save(extra: str = "") -> str:
    return IPT_SAVE.format(extra=extra)


def web_objects(**svc: Any) -> list[dict[str, Any]]:
    return [
        node(),
        service("web", "10.96.0.10", [port("http", 80, 8080)], selector={"app": "web"}, **svc),
        endpoint_slice("web", [endpoint(ip) for ip in PODS], [port("http", 8080)]),
    ]


def run(
    fake: FakeNode,
    target: str,
    *,
    families: Sequence[str] | None = None,
    snap: Callable[[str | None], dict[str, Any]] | None = None,
    config: ProxyConfig | None = None,
    objects: list[dict[str, Any]] | None = None,
    **kw: Any,
) -> PreflightResult:
    return run_preflight(
        target,
        access=fake.access(kw.pop("cpus", 2)),
        families=families,
        snapshot_taker=snap or recorded(),
        config=config,
        objects=objects,
        node_name="node1",
        **kw,
    )


def ids(result: PreflightResult, severity: Severity | None = None) -> list[str]:
    return [f.id for f in result.findings if severity is None or f.severity is severity]


def one(result: PreflightResult, id: str) -> Finding:
    hits = [f for f in result.findings if f.id == id]
    assert len(hits) == 1, (id, [f.to_dict() for f in result.findings])
    return hits[0]


@pytest.fixture
def fake(tmp_path: Path) -> FakeNode:
    return FakeNode(tmp_path / "root")


HEAD = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"


def cfg(text: str = "") -> ProxyConfig:
    return parse_config(HEAD + "clusterCIDR: 10.244.0.0/16\n" + text)


# --- findings ----------------------------------------------------------------------------------


def test_only_blocks_make_the_exit_code_non_zero() -> None:
    w = Finding("a.b", Severity.WARN, "found")
    i = Finding("c.d", Severity.INFO, "found")
    b = Finding("e.f", Severity.BLOCK, "found", "why", ("cmd",))
    assert exit_code([w, i]) == 0
    assert exit_code([w, b, i]) == 1
    assert b.to_dict() == {
        "id": "e.f",
        "severity": "block",
        "subject": "",
        "found": "found",
        "why": "why",
        "fix": ["cmd"],
        "facts": {},
    }


def test_text_rendering_shows_what_why_fix_and_never_takes_values_for_markup() -> None:
    from rich.console import Console

    console = Console(record=True, width=200, color_system=None)
    f = Finding("x.y", Severity.BLOCK, "chain [KUBE-SVC-X] gone", "it matters", ("iptables -L",))
    render_text([f], header="head", verdict="BLOCKED", console=console)
    text = console.export_text()
    assert "BLOCK  x.y: chain [KUBE-SVC-X] gone" in text
    assert "why: it matters" in text and "fix: iptables -L" in text
    assert "BLOCKED (1 blocking, 0 warnings, 0 info)" in text


# --- kernel modules ----------------------------------------------------------------------------

IPVS_MODS = (
    "ip_vs",
    "ip_vs_rr",
    "nf_conntrack",
    "nf_nat",
    "ip_set",
    "ip_set_hash_ip",
    "ip_set_hash_ipport",
    "ip_set_hash_ipportip",
    "ip_set_hash_ipportnet",
    "ip_set_bitmap_port",
    "xt_set",
    "dummy",
    "nf_tables",
    "nft_compat",
    "nft_chain_nat",
    "xt_conntrack",
    "xt_comment",
    "xt_addrtype",
    "xt_mark",
    "xt_MASQUERADE",
)


def test_ipvs_modules_loadable_but_not_persisted_warn(fake: FakeNode) -> None:
    fake.modules(loaded=["nf_conntrack"], available=IPVS_MODS)
    result = run(fake, "ipvs", families=["kernel"])
    assert result.exit_code == 0, [f.to_dict() for f in result.blocking]
    persisted = one(result, "kernel.module-not-persisted")
    assert persisted.severity is Severity.WARN
    assert set(persisted.facts["modules"]) == {"ip_vs", "ip_vs_rr", "nf_conntrack"}
    assert any("modules-load.d" in c for c in persisted.fix)
    loadable = [f.subject for f in result.findings if f.id == "kernel.module-loadable"]
    assert "ip_vs" in loadable and "nf_conntrack" not in loadable


def test_modules_listed_in_modules_load_d_are_persisted(fake: FakeNode) -> None:
    fake.modules(loaded=["nf_conntrack"], available=IPVS_MODS)
    fake.file("/etc/modules-load.d/ipvs.conf", "# ipvs\nip_vs\nip_vs_rr ; sched\n")
    fake.file("/usr/lib/modules-load.d/ct.conf", "nf-conntrack\n")
    result = run(fake, "ipvs", families=["kernel"])
    assert "kernel.module-not-persisted" not in ids(result)


def test_a_missing_scheduler_module_blocks(fake: FakeNode) -> None:
    fake.modules(available=IPVS_MODS)  # no ip_vs_sh
    result = run(fake, "ipvs", families=["kernel"], config=cfg("ipvs: {scheduler: sh}\n"))
    assert result.exit_code == 1
    missing = one(result, "kernel.module-missing")
    assert missing.subject == "ip_vs_sh" and missing.severity is Severity.BLOCK
    assert any("ipvs.scheduler" in c for c in missing.fix)


def test_schedulers_services_ask_for_are_checked_too(fake: FakeNode) -> None:
    fake.modules(available=IPVS_MODS)
    objs = web_objects()
    objs[1]["metadata"]["annotations"] = {"ipvs.kproxy.io/scheduler": "mh"}
    result = run(fake, "ipvs", families=["kernel"], objects=objs)
    assert [f.subject for f in result.blocking] == ["ip_vs_mh"]


def test_leaving_ipvs_without_nfqueue_warns_that_a_udp_reply_may_be_lost(fake: FakeNode) -> None:
    """The datagram hold of a switch out of ipvs mode (ipvs/hold.py) needs nfnetlink_queue
    and xt_NFQUEUE; without them the switch goes on, so it is a warning, never a block."""
    queue = {"nfnetlink_queue", "xt_NFQUEUE"}

    def about_queue(result: PreflightResult) -> list[Finding]:
        return [f for f in result.findings if f.subject in queue]

    fake.modules(available=IPVS_MODS)
    hold = about_queue(run(fake, "iptables", families=["kernel"], current_mode="ipvs"))
    assert {f.subject for f in hold} == queue, [f.to_dict() for f in hold]
    assert all(f.id == "kernel.module-missing" and f.severity is Severity.WARN for f in hold)
    assert all("a reply on its way back" in f.why for f in hold)
    assert not about_queue(run(fake, "iptables", families=["kernel"], current_mode="nftables"))
    fake.modules(available=(*IPVS_MODS, *queue))
    assert not about_queue(run(fake, "iptables", families=["kernel"], current_mode="ipvs"))


def test_a_module_modprobe_d_disables_blocks(fake: FakeNode) -> None:
    """`install ip_vs_rr /bin/false` (hardening guides do this): the file is there, modprobe
    would not load it. The output is what kmod 30 prints for that line."""
    fake.modules(available=IPVS_MODS)
    fake.command(
        ["modprobe", "-n", "-v", "ip_vs_rr"], 0, "insmod /x/ip_vs.ko \ninstall /bin/false \n"
    )
    fake.command(
        ["modprobe", "-n", "-v", "xt_set"], 1, "", "modprobe: FATAL: Module xt_set not found"
    )
    result = run(fake, "ipvs", families=["kernel"])
    refused = {f.subject: f for f in result.blocking if f.id == "kernel.module-missing"}
    assert set(refused) == {"ip_vs_rr", "xt_set"} and result.exit_code == 1
    assert "install /bin/false" in refused["ip_vs_rr"].found
    assert refused["ip_vs_rr"].fix[0].startswith("grep -rn 'ip_vs_rr' /etc/modprobe.d")


def test_built_in_modules_need_nothing(fake: FakeNode) -> None:
    fake.modules(builtin=IPVS_MODS)
    result = run(fake, "ipvs", families=["kernel"])
    assert result.exit_code == 0
    assert not {"kernel.module-missing", "kernel.module-not-persisted"} & set(ids(result))


def test_upgraded_not_rebooted_blocks_when_a_module_must_still_be_loaded(fake: FakeNode) -> None:
    fake.modules(loaded=["nf_conntrack"], modules_dir=False)
    fake.file("/lib/modules/6.2.0-new/modules.dep", "kernel/x/ip_vs.ko:\n")
    result = run(fake, "ipvs", families=["kernel"])
    f = one(result, "kernel.modules-dir-missing")
    assert f.severity is Severity.BLOCK and result.exit_code == 1
    assert f.facts["installed"] == ["6.2.0-new"] and "ip_vs" in f.facts["needed"]
    assert any("reboot" in c for c in f.fix)


def test_upgraded_not_rebooted_only_warns_when_everything_is_loaded(fake: FakeNode) -> None:
    mods = (
        "nf_conntrack",
        "nf_nat",
        "nf_tables",
        "nft_ct",
        "nft_nat",
        "nft_chain_nat",
        "nft_masq",
        "nft_numgen",
        "nft_fib_ipv4",
        "nft_reject_ipv4",
    )
    fake.modules(loaded=mods, modules_dir=False)
    result = run(fake, "nftables", families=["kernel"])
    assert one(result, "kernel.modules-dir-missing").severity is Severity.WARN
    assert result.exit_code == 0


def test_kernel_without_module_support_reads_the_kernel_config(fake: FakeNode) -> None:
    fake.modules(loaded=None, modules_dir=False)
    config = "CONFIG_NF_CONNTRACK=y\nCONFIG_NF_NAT=y\n# CONFIG_IP_VS is not set\n"
    fake.file("/proc/config.gz", config)
    result = run(fake, "ipvs", families=["kernel"])
    assert "kernel.no-module-support" in ids(result, Severity.INFO)
    missing = {f.subject: f for f in result.findings if f.id == "kernel.module-missing"}
    assert "ip_vs" in missing and "nf_conntrack" not in missing
    assert "built without CONFIG_IP_VS" in missing["ip_vs"].found
    assert result.exit_code == 1


@pytest.mark.skipif(not UML_MODULES.exists(), reason="user-mode-linux's module tree not installed")
def test_the_uml_kernels_real_module_tree(fake: FakeNode) -> None:
    """Debian's UML 6.1 modules: everything ipvs needs is a loadable module, and the
    nftables ip family is not built at all (dataplane-lab G9)."""
    uml = FakeNode(fake.root, release="6.1.176")
    (uml.root / "lib/modules").mkdir(parents=True)
    (uml.root / "lib/modules/6.1.176").symlink_to(UML_MODULES)
    uml.file("/proc/modules", "")
    ipvs = run(uml, "ipvs", families=["kernel"], current_flavour="legacy")
    assert not ipvs.blocking, [f.to_dict() for f in ipvs.blocking]
    assert "ip_vs" in [f.subject for f in ipvs.findings if f.id == "kernel.module-loadable"]
    # ... but not with iptables-nft, whose nat chains that kernel cannot build
    with_nft = run(uml, "ipvs", families=["kernel"], current_flavour="nft")
    assert [f.subject for f in with_nft.blocking] == ["nft_chain_nat"]
    nft = run(uml, "nftables", families=["kernel"])
    assert "nft_fib_ipv4" in [f.subject for f in nft.blocking if f.id == "kernel.module-missing"]


def test_nftables_needs_kernel_5_13_and_nft_1_0_1(tmp_path: Path) -> None:
    old = FakeNode(tmp_path / "old", release="5.10.0-28-amd64").modules(builtin=["nf_tables"])
    old.command(["nft", "--version"], 0, "nftables v0.9.8 (E.D.S.)\n")
    result = run(old, "nftables", families=["kernel"])
    assert {"kernel.too-old", "nft.too-old"} <= set(ids(result, Severity.BLOCK))
    none = FakeNode(tmp_path / "none").modules()
    none.command(["nft", "--version"], 127, "", "nft is not installed")
    assert "nft.missing" in ids(run(none, "nftables", families=["kernel"]), Severity.BLOCK)
    refused = FakeNode(tmp_path / "refused").modules()
    probe = ["nft", "--check", "add", "table", "ip", "kproxy-probe"]
    refused.command(probe, 1, "", "Operation not supported")
    assert "nft.kernel-refused" in ids(run(refused, "nftables", families=["kernel"]))


def test_kube_proxy_chains_in_both_iptables_backends_warn(fake: FakeNode) -> None:
    fake.modules(builtin=IPVS_MODS)
    legacy = "*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-FIREWALL - [0:0]\nCOMMIT\n"
    result = run(
        fake, "nftables", families=["kernel"], snap=recorded(nft=ipt_save(), legacy=legacy)
    )
    f = one(result, "iptables.both-backends")
    assert f.severity is Severity.WARN and f.facts["legacy"] == ["KUBE-SERVICES"]
    only = run(fake, "nftables", families=["kernel"], snap=recorded(nft=ipt_save()))
    assert "iptables.both-backends" not in ids(only)


# --- conntrack ---------------------------------------------------------------------------------


def test_conntrack_at_70_percent_warns_and_does_not_block(fake: FakeNode) -> None:
    fake.sysctls({"net/netfilter/nf_conntrack_count": 700, "net/netfilter/nf_conntrack_max": 1000})
    result = run(fake, "nftables", families=["conntrack"])
    f = one(result, "conntrack.headroom")
    assert f.severity is Severity.WARN and f.facts["ratio"] == 0.7 and result.exit_code == 0
    fake.sysctls({"net/netfilter/nf_conntrack_count": 690})
    assert "conntrack.headroom" not in ids(run(fake, "nftables", families=["conntrack"]))


def test_what_maxpercore_and_min_will_set(fake: FakeNode) -> None:
    fake.sysctls({"net/netfilter/nf_conntrack_max": 65536})
    result = run(fake, "iptables", families=["conntrack"], cpus=8)
    f = one(result, "conntrack.max-planned")
    assert f.facts["desired"] == 262144 and "262144" in f.found
    zero = run(fake, "iptables", families=["conntrack"], config=cfg("conntrack: {maxPerCore: 0}\n"))
    assert "conntrack.max-untouched" in ids(zero)


def test_a_short_established_timeout_warns(fake: FakeNode) -> None:
    fake.sysctls({"net/netfilter/nf_conntrack_tcp_timeout_established": 600})
    f = one(run(fake, "nftables", families=["conntrack"]), "conntrack.tcp-timeout-short")
    assert f.severity is Severity.WARN and f.facts["current"] == 600
    assert f.fix == ("sysctl -w net.netfilter.nf_conntrack_tcp_timeout_established=86400",)


# --- configuration -----------------------------------------------------------------------------


def test_a_mode_typo_in_the_config_file_blocks_with_a_suggestion(
    fake: FakeNode, tmp_path: Path
) -> None:
    path = tmp_path / "kp.yaml"
    path.write_text(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
        "mode: nftabels\n"
    )
    result = run(fake, "nftables", families=["config"], config_path=path)
    f = one(result, "config.mode-invalid")
    assert "did you mean 'nftables'" in f.found and result.exit_code == 1


def test_a_file_saying_another_mode_warns(fake: FakeNode, tmp_path: Path) -> None:
    path = tmp_path / "kp.yaml"
    path.write_text(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
        "mode: iptables\nclusterCIDR: 10.244.0.0/16\n"
    )
    result = run(fake, "nftables", families=["config"], config_path=path)
    f = one(result, "config.mode-differs")
    assert f.severity is Severity.WARN and str(path) in f.fix[0] and result.exit_code == 0


def test_exclude_cidrs_swallowing_the_pod_network(fake: FakeNode) -> None:
    config = cfg("ipvs: {excludeCIDRs: [10.0.0.0/8]}\n")
    ipvs = run(fake, "ipvs", families=["config"], config=config, objects=web_objects())
    f = one(ipvs, "config.exclude-cidrs-overlap")
    assert f.severity is Severity.BLOCK
    assert "clusterCIDR 10.244.0.0/16" in f.found and "10.96.0.10" in f.found
    nft = run(fake, "nftables", families=["config"], config=config)
    assert one(nft, "config.exclude-cidrs-overlap").severity is Severity.WARN
    fine = cfg("ipvs: {excludeCIDRs: [192.168.50.0/24]}\n")
    assert "config.exclude-cidrs-overlap" not in ids(
        run(fake, "ipvs", families=["config"], config=fine)
    )


def test_masquerade_all_lives_in_per_mode_sections(fake: FakeNode) -> None:
    config = cfg("iptables: {masqueradeAll: true}\n")
    result = run(fake, "nftables", families=["config"], config=config, current_mode="iptables")
    f = one(result, "config.masquerade-all-changes")
    assert f.facts == {"current": True, "target": False}
    assert f.fix == ("yq -i '.nftables.masqueradeAll = true' <config file>",)
    on = run(fake, "iptables", families=["config"], config=config, current_mode="nftables")
    assert "config.masquerade-all" in ids(on, Severity.WARN)


def test_min_sync_period_zero_with_a_high_change_rate(fake: FakeNode) -> None:
    busy = {"mode": "iptables", "generation": 5000, "uptime": 100.0}
    result = run(fake, "ipvs", families=["config"], status=busy)
    f = one(result, "config.min-sync-zero")
    assert f.severity is Severity.WARN and f.facts["rate"] == 50.0
    quiet = run(fake, "ipvs", families=["config"], status={**busy, "generation": 10})
    assert one(quiet, "config.min-sync-zero").severity is Severity.INFO
    assert "config.min-sync-zero" not in ids(run(fake, "nftables", families=["config"]))


def test_strict_arp_off_under_load_balancer_ips(fake: FakeNode) -> None:
    lb = web_objects(type="LoadBalancer", status={})
    lb[1]["status"] = {"loadBalancer": {"ingress": [{"ip": "192.0.2.10"}]}}
    f = one(run(fake, "ipvs", families=["config"], objects=lb), "config.strict-arp-off")
    assert f.severity is Severity.WARN and f.facts["load_balancer_ips"] == ["192.0.2.10"]
    strict = cfg("ipvs: {strictARP: true}\n")
    assert "config.strict-arp-off" not in ids(run(fake, "ipvs", families=["config"], config=strict))


def test_node_port_addresses_matching_no_local_address(fake: FakeNode) -> None:
    config = cfg("nodePortAddresses: [192.0.2.0/24]\n")
    objs = web_objects(type="NodePort")
    objs[1]["spec"]["ports"][0]["nodePort"] = 30080
    result = run(fake, "nftables", families=["config"], config=config, objects=objs)
    f = one(result, "config.nodeport-addresses-match-nothing")
    assert f.severity is Severity.BLOCK and f.facts["node_ports"] == [30080]
    no_np = run(fake, "nftables", families=["config"], config=config, objects=web_objects())
    assert one(no_np, "config.nodeport-addresses-match-nothing").severity is Severity.WARN
    ok = cfg("nodePortAddresses: [10.100.0.0/24]\n")
    assert "config.nodeport-addresses-match-nothing" not in ids(
        run(fake, "nftables", families=["config"], config=ok, objects=objs)
    )
    # nftables never serves NodePorts on loopback, iptables does
    lo = cfg("nodePortAddresses: [127.0.0.0/8]\n")
    assert "config.nodeport-addresses-match-nothing" in ids(
        run(fake, "nftables", families=["config"], config=lo)
    )
    assert "config.nodeport-addresses-match-nothing" not in ids(
        run(fake, "iptables", families=["config"], config=lo)
    )


def test_node_port_addresses_without_an_ipv4_entry_match_every_address(fake: FakeNode) -> None:
    # The IPv4 dataplanes then serve NodePorts on every local address (upstream: 0.0.0.0/0).
    v6_only = cfg("nodePortAddresses: [fd00::/64]\n")
    for mode in ("iptables", "nftables", "ipvs"):
        assert "config.nodeport-addresses-match-nothing" not in ids(
            run(fake, mode, families=["config"], config=v6_only)
        )


def test_missing_cluster_cidr_warns(fake: FakeNode) -> None:
    bare = parse_config(HEAD)
    f = one(
        run(fake, "iptables", families=["config"], config=bare, objects=web_objects()),
        "config.cluster-cidr-missing",
    )
    assert "10.244.0.0/24" in f.found and '.clusterCIDR = "10.244.0.0/16"' in f.fix[0]
    assert "config.cluster-cidr-missing" not in ids(
        run(fake, "iptables", families=["config"], config=cfg())
    )


def test_a_userspace_port_range_too_small_for_the_listeners_blocks(fake: FakeNode) -> None:
    # web is a NodePort service: a ClusterIP listener and an external one, 2 ports each.
    objs = web_objects(type="NodePort")
    objs[1]["spec"]["ports"][0]["nodePort"] = 30080
    api_ports = [port("a", 80, 8080, nodePort=30081), port("b", 81, 8081, nodePort=30082)]
    objs += [
        service("api", "10.96.0.11", api_ports, type="NodePort"),
        endpoint_slice("api", [endpoint(PODS[0])], [port("a", 8080), port("b", 8081)]),
    ]
    small = cfg('portRange: "20000-20004"\n')  # 5 ports for 6 listeners
    result = run(fake, "userspace", families=["config"], config=small, objects=objs)
    f = one(result, "config.port-range-too-small")
    assert f.severity is Severity.BLOCK and f.facts == {"needed": 6, "range": [20000, 20004]}
    assert '.portRange = "20000-20005"' in f.fix[0]
    enough = cfg('portRange: "20000-20005"\n')
    assert "config.port-range-too-small" not in ids(
        run(fake, "userspace", families=["config"], config=enough, objects=objs)
    )
    # Other modes have no proxy ports.
    assert "config.port-range-too-small" not in ids(
        run(fake, "iptables", families=["config"], config=small, objects=objs)
    )


def test_an_open_file_limit_below_the_listeners_blocks_a_switch_to_userspace(
    fake: FakeNode,
) -> None:
    # Every worker holds a socket per listener; the running proxy's limits decide.
    objs = web_objects(type="NodePort")
    objs[1]["spec"]["ports"][0]["nodePort"] = 30080  # 2 listeners
    from kproxy.dataplane.userspace import fdlimit

    no_resource = ((1 << 41) - 1) & ~(1 << fdlimit.CAP_SYS_RESOURCE)

    def proc(pid: int, soft: int, hard: int, caps: int) -> dict[str, Any]:
        fake.file(
            f"/proc/{pid}/limits",
            f"Limit   Soft Limit   Hard Limit   Units\nMax open files {soft} {hard} files\n",
        )
        fake.file(f"/proc/{pid}/status", f"Name:\tkproxy\nCapEff:\t{caps:016x}\n")
        return {"pid": pid, "mode": "iptables"}

    fake.file("/proc/sys/fs/nr_open", "1048576\n")
    tight = proc(41, 1100, 1100, no_resource)  # room for no listener beside the reserve
    f = one(
        run(fake, "userspace", families=["config"], objects=objs, status=tight),
        "config.open-file-limit",
    )
    assert f.severity is Severity.BLOCK and "pid 41" in f.found and "CAP_SYS_RESOURCE" in f.found
    assert f.facts["listeners"] == 2 and "LimitNOFILE=" in f.fix[0]
    # Room for the listeners but not for the default connections: a warning.
    some = proc(42, 4096, 4096, no_resource)
    f = one(
        run(fake, "userspace", families=["config"], objects=objs, status=some),
        "config.open-file-limit",
    )
    assert f.severity is Severity.WARN
    assert f.facts["connections"] == (4096 - fdlimit.RESERVE - 2) // 2
    # Root with CAP_SYS_RESOURCE lifts the hard limit itself (a UML guest's 4096).
    able = proc(43, 1024, 4096, (1 << 41) - 1)
    assert "config.open-file-limit" not in ids(
        run(fake, "userspace", families=["config"], objects=objs, status=able)
    )
    assert "config.open-file-limit" not in ids(
        run(fake, "iptables", families=["config"], objects=objs, status=tight)
    )


def test_an_unavailable_target_mode_blocks(fake: FakeNode) -> None:
    from kproxy.dataplane.base import AVAILABLE_MODES

    result = run(fake, "ipvs", families=["config"])
    assert ("mode.unavailable" in ids(result, Severity.BLOCK)) == ("ipvs" not in AVAILABLE_MODES)


# --- objects -----------------------------------------------------------------------------------


def test_port_zero_is_reported_with_the_field(fake: FakeNode) -> None:
    objs = [*web_objects(), service("zero", "10.96.0.11", [port("p", 0, 8080)])]
    f = one(run(fake, "nftables", families=["objects"], objects=objs), "objects.port-zero")
    assert f.subject == "default/zero" and "spec.ports[0].port" in f.found


def test_selector_without_endpoints_and_not_ready_endpoints(fake: FakeNode) -> None:
    objs = [
        *web_objects(),
        service("lonely", "10.96.0.12", [port("http", 80)], selector={"app": "gone"}),
        service("sick", "10.96.0.13", [port("http", 80)], selector={"app": "sick"}),
        endpoint_slice("sick", [endpoint("10.244.0.9", ready=False)], [port("http", 80)]),
        service("manual", "10.96.0.14", [port("http", 80)]),
    ]
    result = run(fake, "nftables", families=["objects"], objects=objs)
    assert one(result, "objects.no-endpoints").subject == "default/lonely"
    assert one(result, "objects.no-ready-endpoints").subject == "default/sick"
    assert "default/manual" in one(result, "objects.no-selector-no-endpoints").found
    assert result.exit_code == 0


def test_a_named_target_port_that_resolves_to_nothing(fake: FakeNode) -> None:
    objs = [
        node(),
        service(
            "web",
            "10.96.0.10",
            [port("http", 80, "http"), port("metrics", 9090, "metrics")],
            selector={"app": "web"},
        ),
        endpoint_slice("web", [endpoint(ip) for ip in PODS], [port("http", 8080)]),
    ]
    f = one(
        run(fake, "nftables", families=["objects"], objects=objs), "objects.named-port-unresolved"
    )
    assert f.subject == "default/web:metrics" and "'metrics'" in f.found


def test_node_ports_out_of_range_and_colliding(fake: FakeNode) -> None:
    objs = [
        node(),
        service("a", "10.96.0.20", [port("p", 80, 8080, nodePort=30080)], type="NodePort"),
        service("b", "10.96.0.21", [port("p", 80, 8080, nodePort=30080)], type="NodePort"),
        service("c", "10.96.0.22", [port("p", 80, 8080, nodePort=22)], type="NodePort"),
    ]
    moved = run(fake, "nftables", families=["objects"], objects=objs, current_mode="iptables")
    clash = one(moved, "objects.nodeport-collision")
    assert clash.severity is Severity.BLOCK and clash.subject == "tcp/30080"
    assert (
        clash.facts["served_now"] == "default/a:p" and clash.facts["served_after"] == "default/b:p"
    )
    assert clash.fix == ("kubectl -n default edit service a",)
    assert one(moved, "objects.nodeport-out-of-range").facts == {"node_port": 22}
    assert moved.exit_code == 1
    # the same winner before and after, or nothing serving now: a warning
    same = run(fake, "userspace", families=["objects"], objects=objs, current_mode="iptables")
    assert one(same, "objects.nodeport-collision").severity is Severity.WARN and same.exit_code == 0
    fresh = run(fake, "nftables", families=["objects"], objects=objs)
    assert one(fresh, "objects.nodeport-collision").severity is Severity.WARN


def test_two_services_on_one_address_and_port(fake: FakeNode) -> None:
    objs = [*web_objects(), service("twin", "10.96.0.10", [port("http", 80, 8080)])]
    result = run(fake, "iptables", families=["objects"], objects=objs, current_mode="nftables")
    f = one(result, "objects.destination-collision")
    assert f.subject == "tcp 10.96.0.10:80" and f.severity is Severity.BLOCK
    assert f.facts["served_after"] == "default/twin:http"


def test_slices_of_a_service_without_cluster_ip(fake: FakeNode) -> None:
    pending = service("pending", "", [port("http", 80)])
    objs = [
        *web_objects(),
        pending,
        endpoint_slice("pending", [endpoint("10.244.0.5")], [port("http", 80)]),
        endpoint_slice("ghost", [endpoint("10.244.0.6")], [port("http", 80)]),
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "alias", "namespace": "default"},
            "spec": {"type": "ExternalName", "externalName": "pending.default.svc.cluster.local"},
        },
    ]
    result = run(fake, "nftables", families=["objects"], objects=objs)
    refs = [f.subject for f in result.findings if f.id == "objects.no-cluster-ip-referenced"]
    assert refs == ["default/pending", "default/alias"]
    assert "default/ghost" in one(result, "objects.orphan-slices").found


# --- dataplane consistency and backup ----------------------------------------------------------


def test_a_service_missing_from_the_kernel_and_one_too_many(fake: FakeNode) -> None:
    extra = (
        "-A KUBE-SERVICES -d 10.96.9.9/32 -p tcp -m comment"
        ' --comment "old/gone:http cluster IP" -m tcp --dport 80 -j KUBE-SVC-BBBB\n'
    )
    objs = [
        *web_objects(),
        service("api", "10.96.0.30", [port("https", 443, 8443)]),
        endpoint_slice("api", [endpoint(PODS[0])], [port("https", 8443)]),
    ]
    result = run(
        fake,
        "nftables",
        families=["dataplane"],
        objects=objs,
        snap=recorded(nft=ipt_save(extra)),
        current_mode="iptables",
    )
    missing = one(result, "dataplane.missing-services")
    assert missing.facts["missing"] == ["tcp 10.96.0.30:443"]
    assert missing.facts["dataplane"] == ["iptables-nft"]
    assert one(result, "dataplane.extra-services").facts["extra"] == ["tcp 10.96.9.9:80"]


def test_the_backup_is_written_read_back_and_restorable(fake: FakeNode, tmp_path: Path) -> None:
    result = run(
        fake,
        "nftables",
        families=["backup"],
        snap=recorded(nft=ipt_save()),
        state_dir=tmp_path / "state",
        objects=web_objects(),
    )
    f = one(result, "backup.ok")
    path = Path(f.facts["path"])
    assert path.parent == tmp_path / "state" and f.facts["destinations"] == 1
    assert json.loads(path.read_text())["iptables-nft"]["output"] == ipt_save()
    assert f.fix == (f"jq -r '.\"iptables-nft\".output' {path} | iptables-nft-restore",)
    assert result.current_mode == "iptables" and result.current_flavour == "nft"


def test_a_backup_without_the_modes_state_blocks(fake: FakeNode, tmp_path: Path) -> None:
    result = run(
        fake,
        "nftables",
        families=["backup"],
        snap=recorded(nft="*nat\nCOMMIT\n"),
        state_dir=tmp_path,
        current_mode="iptables",
    )
    assert one(result, "backup.no-kube-state").severity is Severity.BLOCK
    assert result.exit_code == 1


def test_an_empty_backup_of_a_node_with_services_blocks(fake: FakeNode, tmp_path: Path) -> None:
    empty = "*nat\n:KUBE-SERVICES - [0:0]\n-A PREROUTING -j KUBE-SERVICES\nCOMMIT\n"
    result = run(
        fake,
        "nftables",
        families=["backup"],
        snap=recorded(nft=empty),
        state_dir=tmp_path,
        objects=web_objects(),
    )
    assert one(result, "backup.empty").facts == {"expected": 1}


def test_an_unreadable_dataplane_blocks_the_backup(fake: FakeNode, tmp_path: Path) -> None:
    def broken(_: str | None) -> dict[str, Any]:
        snap = recorded(nft=ipt_save())(None)
        snap["iptables-nft"] = {
            "command": "iptables-nft-save",
            "ok": False,
            "output": "",
            "error": "Permission denied",
        }
        return snap

    result = run(
        fake,
        "nftables",
        families=["backup"],
        snap=broken,
        state_dir=tmp_path,
        current_mode="iptables",
        current_flavour="nft",
    )
    f = one(result, "backup.failed")
    assert "Permission denied" in f.found and result.exit_code == 1


def test_the_current_mode_is_read_from_the_kernel() -> None:
    assert detect_current(recorded(nft=ipt_save())(None))[:2] == ("iptables", "nft")
    portals = (
        "*nat\n:KUBE-PORTALS-CONTAINER - [0:0]\n-A PREROUTING -j KUBE-PORTALS-CONTAINER\nCOMMIT\n"
    )
    assert detect_current(recorded(legacy=portals)(None))[:2] == ("userspace", "legacy")
    nft = json.dumps({"nftables": [{"table": {"family": "ip", "name": "kube-proxy", "handle": 1}}]})
    assert detect_current(recorded(nftables=nft)(None))[:2] == ("nftables", None)
    mode, _, notes = detect_current(recorded(nft=ipt_save(), nftables=nft)(None))
    assert mode == "iptables" and "more than one proxy mode" in notes[0]
    assert detect_current(recorded()(None))[0] is None


def nft_table(name: str) -> str:
    """`nft -j list table ip NAME` of an empty table (nftables mode's, in a layout)."""
    return json.dumps({"nftables": [{"table": {"family": "ip", "name": name, "handle": 1}}]})


UPSTREAM_TABLE, COMPACT_TABLE = nft_table("kube-proxy"), nft_table("kproxy-compact")


def test_the_current_nftables_layout_is_its_table_in_the_kernel(fake: FakeNode) -> None:
    upstream = run(fake, "iptables", families=[], snap=recorded(nftables=UPSTREAM_TABLE))
    compact = run(fake, "iptables", families=[], snap=recorded(compact=COMPACT_TABLE))
    assert (upstream.current_mode, upstream.current_layout) == ("nftables", "upstream")
    assert (compact.current_mode, compact.current_layout) == ("nftables", "compact")
    assert compact.header().startswith("kproxy preflight: nftables (compact layout) -> iptables")
    both = run(
        fake,
        "iptables",
        families=[],
        snap=recorded(nftables=UPSTREAM_TABLE, compact=COMPACT_TABLE),
    )
    assert both.current_layout == "upstream"
    assert any("more than one nftables layout" in n for n in both.notes), both.notes
    # The running kproxy's status says which layout serves, whatever the kernel holds.
    status = {"mode": "nftables", "nftables_layout": "compact"}
    told = run(fake, "iptables", families=[], snap=recorded(nftables=UPSTREAM_TABLE), status=status)
    assert told.current_layout == "compact"
    # Other modes have no layout, on either side.
    assert (
        run(fake, "ipvs", families=[], snap=recorded(nft=ipt_save())).to_dict()["current_layout"]
        is None
    )


def test_a_switch_between_nftables_layouts_is_a_layout_change_not_the_same_mode(
    fake: FakeNode,
) -> None:
    result = run(
        fake,
        "nftables",
        families=["config"],
        snap=recorded(nftables=UPSTREAM_TABLE),
        target_layout="compact",
    )
    assert "mode.same" not in ids(result)
    f = one(result, "mode.layout-change")
    assert f.severity is Severity.INFO and result.safe
    assert "upstream layout (table ip kube-proxy)" in f.found
    assert "compact layout (table ip kproxy-compact)" in f.found
    assert "make-before-break" in f.found
    # No kproxy runs here: the restart's layout is whatever its flag will say.
    assert "--nftables-layout" in f.why and "upstream when absent" in f.why
    assert f.fix == (
        "kproxy run --nftables-layout compact ...  # where kproxy is started (its unit)",
    )
    assert result.verdict() == "SAFE: nothing blocks a switch to nftables (compact layout)"
    doc = result.to_dict()
    assert (doc["target_layout"], doc["current_layout"]) == ("compact", "upstream")
    # The same layout is the same mode: the switch refuses it.
    same = run(
        fake,
        "nftables",
        families=["config"],
        snap=recorded(compact=COMPACT_TABLE),
        target_layout="compact",
    )
    assert "mode.layout-change" not in ids(same)
    assert "nftables (compact layout) mode" in one(same, "mode.same").found


def test_a_switch_naming_no_layout_goes_to_the_one_kproxy_was_started_with(
    fake: FakeNode,
) -> None:
    """As Daemon.switch picks it: the running kproxy's --nftables-layout (its status)."""
    switched = {"mode": "nftables", "nftables_layout": "compact"}
    back = run(
        fake,
        "nftables",
        families=["config"],
        status={**switched, "started_nftables_layout": "upstream"},
    )
    assert back.target_layout == "upstream"
    f = one(back, "mode.layout-change")
    assert f.facts["current_layout"] == "compact" and f.facts["target_layout"] == "upstream"
    assert "started with --nftables-layout upstream: a restart stays" in f.why and not f.fix
    started_compact = {**switched, "started_nftables_layout": "compact"}
    stays = run(fake, "nftables", families=["config"], status=started_compact)
    assert stays.target_layout == "compact" and "mode.same" in ids(stays)
    # To the other layout while started with this one: the restart comes back here.
    away = run(
        fake,
        "nftables",
        families=["config"],
        status={
            "mode": "nftables",
            "nftables_layout": "upstream",
            "started_nftables_layout": "upstream",
        },
        target_layout="compact",
    )
    why = one(away, "mode.layout-change").why
    assert "restart comes back in the upstream layout and removes the compact table" in why
    # Without a kproxy (nothing started): the default layout.
    assert run(fake, "nftables", families=[]).target_layout == "upstream"
    assert run(fake, "ipvs", families=[], target_layout="compact").target_layout is None


@pytest.mark.parametrize(
    ("layout", "section"), [("upstream", "nftables"), ("compact", "nftables-compact")]
)
def test_the_backup_restores_only_the_nftables_layout_that_exists(
    fake: FakeNode, tmp_path: Path, layout: str, section: str
) -> None:
    tables = {"nftables": UPSTREAM_TABLE} if layout == "upstream" else {"compact": COMPACT_TABLE}
    result = run(
        fake,
        "iptables",
        families=["backup"],
        snap=recorded(**tables),
        state_dir=tmp_path / "state",
        objects=[node()],
    )
    f = one(result, "backup.ok")
    path = f.facts["path"]
    assert path.endswith(
        f"-{'nftables' if layout == 'upstream' else 'nftables-compact'}-to-iptables.json"
    )
    restore = f"jq -r '.\"{section}\".output' {path} > /tmp/{section}.json"
    assert f.fix == (f"{restore} && nft -j -f /tmp/{section}.json",)


# --- sysctls -----------------------------------------------------------------------------------


def test_ip_forward_off_blocks_kernel_modes_and_warns_userspace(fake: FakeNode) -> None:
    fake.sysctls({"net/ipv4/ip_forward": 0})
    nft = run(fake, "nftables", families=["sysctls"])
    assert one(nft, "sysctl.ip-forward-off").severity is Severity.BLOCK and nft.exit_code == 1
    us = run(fake, "userspace", families=["sysctls"])
    assert one(us, "sysctl.ip-forward-off").severity is Severity.WARN and us.exit_code == 0


def test_route_localnet_left_on_without_the_guard_rule(fake: FakeNode) -> None:
    fake.sysctls({"net/ipv4/conf/all/route_localnet": 1})
    result = run(fake, "nftables", families=["sysctls"])
    assert one(result, "sysctl.route-localnet-exposed").severity is Severity.WARN
    guard = ipt_save(
        '-A KUBE-FIREWALL -m comment --comment "block incoming localnet connections"'
        " -d 127.0.0.0/8 ! -s 127.0.0.0/8 -j DROP\n"
    )
    assert "sysctl.route-localnet-exposed" not in ids(
        run(fake, "nftables", families=["sysctls"], snap=recorded(nft=guard))
    )
    fake.sysctls({"net/ipv4/conf/all/route_localnet": 0})
    assert "sysctl.route-localnet-off" in ids(run(fake, "iptables", families=["sysctls"]))


def test_pods_on_a_bridge_need_bridge_nf_call_iptables(fake: FakeNode) -> None:
    bridged = [
        *ADDRS,
        {
            "ifname": "cni0",
            "addr_info": [{"family": "inet", "local": "10.244.0.1", "scope": "global"}],
        },
    ]
    fake.command(["ip", "-j", "-4", "addr", "show"], 0, json.dumps(bridged))
    fake.command(["ip", "-j", "-d", "link", "show", "type", "bridge"], 0, '[{"ifname": "cni0"}]')
    f = one(
        run(fake, "iptables", families=["sysctls"], config=cfg()), "sysctl.br-netfilter-missing"
    )
    assert f.facts["bridges"] == ["cni0"]
    fake.sysctls({"net/bridge/bridge-nf-call-iptables": 0})
    assert "sysctl.bridge-nf-call-iptables-off" in ids(
        run(fake, "iptables", families=["sysctls"], config=cfg())
    )
    fake.sysctls({"net/bridge/bridge-nf-call-iptables": 1})
    assert not ids(run(fake, "nftables", families=["sysctls"], config=cfg()), Severity.WARN)


def test_ipvs_sysctls_on_an_old_kernel(tmp_path: Path) -> None:
    old = FakeNode(tmp_path, release="5.4.0-150-generic")
    old.sysctls(
        {
            "net/ipv4/vs/conntrack": 0,
            "net/ipv4/vs/conn_reuse_mode": 1,
            "net/ipv4/vs/expire_nodest_conn": 0,
            "net/ipv4/vs/expire_quiescent_template": 1,
            "net/ipv4/conf/all/arp_ignore": 0,
            "net/ipv4/conf/all/arp_announce": 0,
        }
    )
    result = run(old, "ipvs", families=["sysctls"], config=cfg("ipvs: {strictARP: true}\n"))
    assert "sysctl.ipvs-conn-reuse" in ids(result, Severity.WARN)
    planned = one(result, "sysctl.ipvs-planned")
    assert "vs.conntrack=1 (now 0)" in planned.found and "expire_quiescent" not in planned.found
    assert "arp_announce=2 (now 0)" in one(result, "sysctl.strict-arp-planned").found


# --- the run as a whole ------------------------------------------------------------------------


def test_object_checks_are_skipped_without_a_source(fake: FakeNode) -> None:
    result = run(fake, "nftables", families=["objects", "dataplane"])
    assert "objects.rejections" in result.skipped and "dataplane.consistency" in result.skipped
    assert "dataplane.leftovers" not in result.skipped


def test_a_crashing_check_is_a_warning_not_a_crash(
    fake: FakeNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kproxy.ops.preflight import conntrack

    def boom(_ctx: object) -> list[Finding]:
        raise RuntimeError("kaboom")

    from kproxy.ops.preflight import run as run_module

    monkeypatch.setitem(run_module.FAMILIES, "conntrack", (conntrack.Check("conntrack", boom),))
    result = run(fake, "nftables", families=["conntrack"])
    f = one(result, "preflight.check-failed")
    assert "kaboom" in f.found and f.severity is Severity.WARN


def test_json_report_shape(fake: FakeNode) -> None:
    fake.sysctls({"net/ipv4/ip_forward": 0})
    doc = json.loads(run(fake, "nftables", families=["sysctls"]).to_json())
    assert doc["safe"] is False and doc["exit_code"] == 1 and doc["target"] == "nftables"
    assert doc["counts"]["block"] == 1
    assert set(doc["findings"][0]) >= {"id", "severity", "found", "why", "fix"}


def test_the_kernel_state_reads_a_section_only_when_a_check_needs_it(fake: FakeNode) -> None:
    from kproxy.ops.preflight.kernelstate import KernelState
    from kproxy.ops.snapshot import programmed_in

    table = {"nftables": [{"table": {"family": "ip", "name": "kube-proxy", "handle": 1}}]}
    fake.command(["nft", "-j", "list", "table", "ip", "kube-proxy"], 0, json.dumps(table))
    fake.command(
        ["nft", "-j", "list", "table", "ip6", "kube-proxy"],
        1,
        "",
        "Error: No such file or directory",
    )
    fake.command(["iptables-nft-save"], 0, ipt_save())
    state = KernelState(fake.access())
    assert state["iptables-nft"]["output"] == ipt_save()
    assert [a for a in fake.ran if a[0] != "iptables-nft-save"] == []
    nft = state["nftables"]
    assert nft["ok"] and json.loads(nft["output"]) == table, "a missing ip6 table is no error"
    assert ["nft", "-j", "list", "ruleset"] not in fake.ran
    doc = json.loads(json.dumps(state.document()))
    assert doc["format"] == "kproxy-snapshot/v1" and doc["conntrack"] == {
        "count": 10,
        "max": 262144,
    }
    assert set(programmed_in(doc)) == {"iptables-nft"}


# --- the remaining findings, one condition each ------------------------------------------------


def test_module_state_that_cannot_be_read_warns(fake: FakeNode) -> None:
    fake.file("/proc/modules", "")  # modular kernel, no module tree, no config, no modinfo
    fake.command(["modinfo", "-F", "filename", "ip_vs"], 127, "", "modinfo is not installed")
    (fake.root / "lib/modules" / RELEASE).mkdir(parents=True)
    result = run(fake, "ipvs", families=["kernel"])
    assert "ip_vs" in [f.subject for f in result.findings if f.id == "kernel.module-unknown"]


def test_an_nft_that_cannot_read_the_kube_proxy_table_blocks(fake: FakeNode) -> None:
    fake.modules(builtin=["nf_tables"])
    fake.command(["nft", "-j", "list", "table", "ip", "kube-proxy"], 1, "", "Error: parse error")
    result = run(fake, "nftables", families=["kernel"])
    assert "nft.cannot-list" in ids(result, Severity.BLOCK)


def test_missing_iptables_and_ipset_tools_block(fake: FakeNode) -> None:
    fake.modules(builtin=IPVS_MODS)
    fake.command(["iptables-nft-restore", "--version"], 127, "", "not installed")
    fake.command(["ipset", "version"], 127, "", "not installed")
    result = run(fake, "ipvs", families=["kernel"], current_flavour="nft")
    assert {"iptables.missing", "ipset.missing"} <= set(ids(result, Severity.BLOCK))


def test_conntrack_facts_that_are_only_information(fake: FakeNode) -> None:
    fake.sysctls({"net/netfilter/nf_conntrack_tcp_timeout_established": 432000})
    assert "conntrack.tcp-timeout-planned" in ids(run(fake, "iptables", families=["conntrack"]))
    (fake.root / "proc/sys/net/netfilter/nf_conntrack_count").unlink()
    result = run(fake, "iptables", families=["conntrack"])
    assert "conntrack.unreadable" in ids(result, Severity.INFO) and result.exit_code == 0


def test_other_configuration_findings(fake: FakeNode, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(HEAD + "iptables: {masqueradeBit: 40}\n")
    invalid = one(run(fake, "iptables", families=["config"], config_path=bad), "config.invalid")
    assert "masqueradeBit" in invalid.found and invalid.severity is Severity.BLOCK
    periods = cfg("nftables: {syncPeriod: 10s}\n")
    changes = run(fake, "nftables", families=["config"], config=periods, current_mode="iptables")
    assert "syncPeriod 30s -> 10s" in one(changes, "config.sync-periods-change").found
    node_cidr = cfg("detectLocalMode: NodeCIDR\n")
    objs = [o for o in web_objects() if o["kind"] != "Node"]
    result = run(fake, "iptables", families=["config"], config=node_cidr, objects=objs)
    assert "config.node-cidr-missing" in ids(result, Severity.WARN)


def test_an_invalid_object_other_than_port_zero(fake: FakeNode) -> None:
    objs = [*web_objects(), service("bad", "10.96.0.99", [port("p", 80)], type="Weird")]
    f = one(run(fake, "iptables", families=["objects"], objects=objs), "objects.invalid")
    assert "spec.type" in f.found and f.subject == "default/bad"


def test_a_backup_that_cannot_be_kept(fake: FakeNode, tmp_path: Path) -> None:
    snap = recorded(nft=ipt_save())
    kept = run(fake, "nftables", families=["backup"], snap=snap, objects=web_objects())
    assert "backup.not-kept" in ids(kept, Severity.INFO)  # no state dir, no --backup
    blocked = tmp_path / "file"
    blocked.write_text("")
    failed = run(fake, "nftables", families=["backup"], snap=snap, backup_path=blocked / "x.json")
    assert "backup.write-failed" in ids(failed, Severity.BLOCK) and failed.exit_code == 1
