"""Preflight's kernel-module and ipvs checks on a kernel that has ip_vs (inside UML).

The guest loads ip_vs and its schedulers at boot; here modules are unloaded (rmmod, only
inside the guest), refused by modprobe.d (block_module), and listed or not in a
modules-load.d file of a private root, and the findings and exit codes follow.
"""

from __future__ import annotations

import platform
import shlex
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kproxy.config import parse_config
from kproxy.lab.topology import Lab
from kproxy.leftovers import clean_leftovers
from kproxy.ops.preflight import NodeAccess, run_preflight
from kproxy.ops.preflight.findings import Severity
from kproxy.ops.preflight.kernel import module_tree
from kproxy.ops.preflight.run import PreflightResult
from tests.support.uml import Guest

pytestmark = pytest.mark.kernel

HEAD = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"


@pytest.fixture
def lab(lab_module: Lab) -> Lab:
    """The module's lab: the checks only read its node, and a test that changes it puts it
    back (building a lab costs seconds in UML)."""
    return lab_module


def preflight(
    lab: Lab,
    scheduler: str = "",
    *,
    access: NodeAccess | None = None,
    families: tuple[str, ...] = ("kernel", "sysctls"),
    flavour: str | None = None,
) -> PreflightResult:
    cfg = parse_config(
        HEAD + "clusterCIDR: 10.244.0.0/16\n" + f"ipvs: {{scheduler: '{scheduler}'}}\n"
    )
    return run_preflight(
        "ipvs",
        access=access or NodeAccess(netns=lab.node_ns),
        config=cfg,
        node_name="node1",
        families=families,
        current_flavour=flavour,
    )


def ids(result: PreflightResult, severity: Severity | None = None) -> list[str]:
    return [f.id for f in result.findings if severity is None or f.severity is severity]


def subjects(result: PreflightResult, id: str) -> list[str]:
    return [f.subject for f in result.findings if f.id == id]


def test_the_guest_kernel_supports_ipvs_mode(lab: Lab, guest: Guest) -> None:
    guest.require("ip_vs", "ip_vs_rr", "nf_conntrack")
    result = preflight(lab)
    assert result.current_flavour is None  # nothing runs: the backend is detected (legacy)
    assert not result.blocking, [f.to_dict() for f in result.blocking]
    assert "kernel.modules-dir-missing" not in ids(result), "modprobe's --dirname is honoured"
    assert "ip_vs" not in subjects(result, "kernel.module-loadable"), "ip_vs is loaded"
    # The vs.* sysctls exist in the node's namespace now that ip_vs is loaded.
    assert "sysctl.ipvs-unreadable" not in ids(result)


def test_an_unloaded_scheduler_is_loadable_not_missing(lab: Lab, guest: Guest) -> None:
    guest.require("ip_vs_wrr")
    subprocess.run(["rmmod", "ip_vs_wrr"], check=True)
    try:
        result = preflight(lab, "wrr")
        assert "ip_vs_wrr" in subjects(result, "kernel.module-loadable")
        assert "ip_vs_wrr" not in subjects(result, "kernel.module-missing")
        assert result.exit_code == 0
    finally:
        subprocess.run(["modprobe", "ip_vs_wrr"], check=True)


def test_a_scheduler_modprobe_refuses_blocks(
    lab: Lab, guest: Guest, block_module: Callable[..., None]
) -> None:
    guest.require("ip_vs_sh")
    block_module("ip_vs_sh")
    result = preflight(lab, "sh")
    (missing,) = [f for f in result.blocking if f.id == "kernel.module-missing"]
    assert missing.subject == "ip_vs_sh" and "install /bin/false" in missing.found
    assert result.exit_code == 1
    assert preflight(lab, "rr").exit_code == 0, "the default scheduler is still there"


def _private_root(tmp_path: Path, modules_load: str | None) -> NodeAccess:
    """The real /proc, /sys and module tree, with our own /etc/modules-load.d (the guest's
    /etc is the host's, which a test must not write)."""
    root = tmp_path / "root"
    (root / "lib/modules").mkdir(parents=True)
    for name in ("proc", "sys"):
        (root / name).symlink_to(f"/{name}")
    release = platform.release()
    tree = module_tree(NodeAccess()).path(f"/lib/modules/{release}")
    (root / "lib/modules" / release).symlink_to(tree)
    if modules_load is not None:
        (root / "etc/modules-load.d").mkdir(parents=True)
        (root / "etc/modules-load.d/ipvs.conf").write_text(modules_load)
    return NodeAccess(root=root)


# A private root is read from the guest's own namespace, which has no backend hint (it
# would detect iptables-nft, whose nat chains Debian's UML kernels cannot build): say
# legacy, as the lab's node is.
KERNEL_ONLY: dict[str, Any] = {"families": ("kernel",), "flavour": "legacy"}


def test_modules_must_be_persisted_for_the_next_boot(
    lab: Lab, guest: Guest, tmp_path: Path
) -> None:
    guest.require("ip_vs", "ip_vs_rr", "nf_conntrack")
    bare = preflight(lab, access=_private_root(tmp_path / "a", None), **KERNEL_ONLY)
    (f,) = [f for f in bare.findings if f.id == "kernel.module-not-persisted"]
    assert set(f.facts["modules"]) == {"ip_vs", "ip_vs_rr", "nf_conntrack"}
    assert f.severity is Severity.WARN and bare.exit_code == 0
    listed = _private_root(tmp_path / "b", "# kube-proxy ipvs\nip_vs\nip_vs_rr\nnf_conntrack\n")
    assert "kernel.module-not-persisted" not in ids(
        preflight(lab, access=listed, families=("kernel",))
    )
    # The fix, applied to the private root, is the same file.
    fixed = _private_root(tmp_path / "c", None)
    cmd = f.fix[0].replace("/etc/modules-load.d", str(fixed.root / "etc/modules-load.d"))
    (fixed.root / "etc/modules-load.d").mkdir(parents=True)
    subprocess.run(["sh", "-c", cmd], check=True)
    assert "kernel.module-not-persisted" not in ids(
        preflight(lab, access=fixed, families=("kernel",))
    )


def test_ipvs_sysctls_of_the_node(lab: Lab, guest: Guest) -> None:
    guest.require("ip_vs")
    was = lab.exec(lab.node_ns, ["sysctl", "-n", "net.ipv4.vs.conntrack"]).stdout.strip()
    lab.exec(lab.node_ns, ["sysctl", "-q", "-w", "net.ipv4.vs.conntrack=0"])
    try:
        result = preflight(lab, families=("sysctls",))
    finally:
        lab.exec(lab.node_ns, ["sysctl", "-q", "-w", f"net.ipv4.vs.conntrack={was}"])
    (planned,) = [f for f in result.findings if f.id == "sysctl.ipvs-planned"]
    assert "vs.conntrack=1 (now 0)" in planned.found
    assert "sysctl.ipvs-conn-reuse" not in ids(result), "6.1 has the conn_reuse fix"


def test_kube_ipvs0_and_ipsets_left_behind(lab: Lab, guest: Guest, tmp_path: Path) -> None:
    guest.require("dummy", "ip_set")
    for argv in (
        ["ip", "link", "add", "kube-ipvs0", "type", "dummy"],
        ["ip", "addr", "add", "10.96.0.10/32", "dev", "kube-ipvs0"],
        ["ipset", "create", "KUBE-CLUSTER-IP", "hash:ip,port"],
    ):
        lab.exec(lab.node_ns, argv)
    try:
        result = run_preflight(
            "iptables",
            access=NodeAccess(netns=lab.node_ns),
            node_name="node1",
            families=("dataplane",),
            state_dir=tmp_path,
        )
        (left,) = [f for f in result.findings if f.id == "dataplane.leftovers"]
        assert (
            "ip link delete kube-ipvs0" in left.fix and "ipset destroy KUBE-CLUSTER-IP" in left.fix
        )
        for cmd in left.fix:
            for part in cmd.split(" && "):
                lab.exec(lab.node_ns, shlex.split(part))
        again = run_preflight(
            "iptables",
            access=NodeAccess(netns=lab.node_ns),
            node_name="node1",
            families=("dataplane",),
            state_dir=tmp_path,
        )
        assert "dataplane.leftovers" not in ids(again)
    finally:
        clean_leftovers(None, netns=lab.node_ns)  # what `kproxy cleanup` removes
