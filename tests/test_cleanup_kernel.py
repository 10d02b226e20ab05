"""`kproxy cleanup` removes kube-proxy's iptables state, in both backends, and nothing else."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest

from kproxy.dataplane.nftables.layouts import LAYOUTS, OWN_TABLES, TABLES

pytestmark = pytest.mark.kernel

UPSTREAM_STATE = """\
*filter
:KUBE-SERVICES - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-FIREWALL - [0:0]
:KUBE-KUBELET-CANARY - [0:0]
:KUBE-IPVS-FILTER - [0:0]
:CALI-INPUT - [0:0]
:KUBE-ROUTER-INPUT - [0:0]
-A INPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A INPUT -j KUBE-FIREWALL
-A INPUT -j KUBE-IPVS-FILTER
-A INPUT -j CALI-INPUT
-A FORWARD -j KUBE-FORWARD
-A CALI-INPUT -j KUBE-SERVICES
-A KUBE-FIREWALL -d 127.0.0.0/8 ! -s 127.0.0.0/8 -j DROP
-A KUBE-SERVICES -d 10.96.0.99/32 -p tcp -j REJECT
COMMIT
*nat
:KUBE-SERVICES - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-MARK-MASQ - [0:0]
:KUBE-SVC-XPGD46QRK7WJZT7O - [0:0]
:KUBE-SEP-SXIVWICOYRO3J4NJ - [0:0]
:KUBE-PORTALS-CONTAINER - [0:0]
:OTHER-NAT - [0:0]
-A PREROUTING -j KUBE-SERVICES
-A PREROUTING -j KUBE-PORTALS-CONTAINER
-A POSTROUTING -j KUBE-POSTROUTING
-A OUTPUT -j OTHER-NAT
-A KUBE-SERVICES -d 10.96.0.10/32 -p tcp --dport 80 -j KUBE-SVC-XPGD46QRK7WJZT7O
-A KUBE-SVC-XPGD46QRK7WJZT7O -j KUBE-SEP-SXIVWICOYRO3J4NJ
-A KUBE-SEP-SXIVWICOYRO3J4NJ -p tcp -j DNAT --to-destination 10.180.0.1:80
-A OTHER-NAT -d 192.0.2.1/32 -j RETURN
COMMIT
"""
OURS = {
    "KUBE-SERVICES",
    "KUBE-FORWARD",
    "KUBE-IPVS-FILTER",
    "KUBE-POSTROUTING",
    "KUBE-MARK-MASQ",
    "KUBE-SVC-XPGD46QRK7WJZT7O",
    "KUBE-SEP-SXIVWICOYRO3J4NJ",
    "KUBE-PORTALS-CONTAINER",
}
THEIRS = {"KUBE-FIREWALL", "KUBE-KUBELET-CANARY", "CALI-INPUT", "KUBE-ROUTER-INPUT", "OTHER-NAT"}


@pytest.fixture
def netns() -> Iterator[str]:
    name = f"kpc-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=False)


def run_in(ns: str, *argv: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", "netns", "exec", ns, *argv], input=input, capture_output=True, text=True, check=False
    )


def chains(ns: str, flavour: str) -> set[str]:
    out = run_in(ns, f"iptables-{flavour}-save").stdout
    return {line[1:].split()[0] for line in out.splitlines() if line.startswith(":")}


@pytest.mark.parametrize("flavour", ["nft", "legacy"])
def test_cleanup_removes_only_kube_proxy_state(netns: str, flavour: str) -> None:
    loaded = run_in(netns, f"iptables-{flavour}-restore", "--noflush", input=UPSTREAM_STATE)
    assert loaded.returncode == 0, loaded.stderr
    kproxy = [sys.executable, "-m", "kproxy.cli", "cleanup"]

    dry = run_in(netns, *kproxy, "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    listed = json.loads(dry.stdout)["removed"]
    listed_chains = {o["name"] for o in listed if o["kind"] == "iptables-chain"}
    assert listed_chains == OURS
    assert all(o["reason"] for o in listed)
    jumps = [o for o in listed if o["kind"] == "iptables-rule"]
    # Foreign rules that jump into our chains go too (CALI-INPUT -> KUBE-SERVICES); others stay.
    assert any("CALI-INPUT" in o["name"] for o in jumps)
    assert not any("KUBE-FIREWALL" in o["name"] or "OTHER-NAT" in o["name"] for o in jumps)
    assert chains(netns, flavour) >= OURS, "a dry run changes nothing"

    done = run_in(netns, *kproxy, "--json")
    assert done.returncode == 0, done.stderr
    # Everything listed is reported removed (nft: the netlink way stops at CALI-INPUT's
    # jump and the save-based way removes the rest; the report holds both parts).
    removed = json.loads(done.stdout)["removed"]
    assert {(o["kind"], o["name"]) for o in removed} == {(o["kind"], o["name"]) for o in listed}
    left = chains(netns, flavour)
    assert not (OURS & left)
    assert left >= THEIRS
    rules = run_in(netns, f"iptables-{flavour}-save").stdout
    assert "-A INPUT -j KUBE-FIREWALL" in rules and "-A INPUT -j CALI-INPUT" in rules
    assert "-A OTHER-NAT -d 192.0.2.1/32 -j RETURN" in rules

    again = run_in(netns, *kproxy)
    assert "nothing to remove" in again.stdout


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cleanup_removes_kube_proxy_nftables_tables_only(netns: str, layout: str) -> None:
    """A node of nftables mode in either layout: its tables and the anchor go, a foreign
    table stays."""
    own = [f"{family} {name}" for family, name in OWN_TABLES[layout]]
    script = (
        "".join(f"add table {table}\n" for table in own)
        + f"add chain {own[0]} services\n"
        + "add table inet firewalld\nadd table ip kproxy-anchor\n"
    )
    assert run_in(netns, "nft", "-f", "-", input=script).returncode == 0
    kproxy = [sys.executable, "-m", "kproxy.cli", "cleanup"]
    dry = json.loads(run_in(netns, *kproxy, "--dry-run", "--json").stdout)["removed"]
    assert {o["name"] for o in dry if o["kind"] == "nft-table"} == {*own, "ip kproxy-anchor"}
    assert run_in(netns, *kproxy).returncode == 0
    tables = run_in(netns, "nft", "list", "tables").stdout.splitlines()
    assert tables == ["table inet firewalld"]


def test_nft_cleanup_over_netlink_alone_removes_what_the_save_lists(netns: str) -> None:
    """Without a foreign jump into our chains the iptables-nft cleanup needs no save."""
    from kproxy.dataplane.iptables.backend import IptablesBackend
    from kproxy.dataplane.iptables.cleanup import owned_state, remove_over_netlink

    state = UPSTREAM_STATE.replace("-A CALI-INPUT -j KUBE-SERVICES\n", "")
    loaded = run_in(netns, "iptables-nft-restore", "--noflush", input=state)
    assert loaded.returncode == 0, loaded.stderr
    backend = IptablesBackend("nft", netns=netns)
    listed = owned_state(backend)
    removed, complete = remove_over_netlink(backend)
    assert complete
    assert sorted(removed, key=str) == sorted(listed, key=str)
    left = chains(netns, "nft")
    assert not (OURS & left) and left >= THEIRS
    rules = run_in(netns, "iptables-nft-save").stdout
    assert "-A INPUT -j KUBE-FIREWALL" in rules and "-A OUTPUT -j OTHER-NAT" in rules
    assert "KUBE-SERVICES" not in rules
    assert remove_over_netlink(backend) == ([], True)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_nft_cleanup_skips_the_chain_dump_without_iptables_nft_tables(
    netns: str, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    """An nftables-mode node (either layout): its own table's chains are the whole chain
    dump (3.5 s at 10,000 services), and iptables-nft has no table to clean."""
    from kproxy.dataplane.iptables.backend import IptablesBackend
    from kproxy.dataplane.iptables.cleanup import remove_over_netlink
    from kproxy.dataplane.nftables.netlink import NftNetlink

    dumps: list[str] = []
    real = NftNetlink.chains_by_table

    def counted(self: NftNetlink) -> dict[str, list[str]]:
        dumps.append("chains")
        return real(self)

    monkeypatch.setattr(NftNetlink, "chains_by_table", counted)
    chain = "chain services {\n type nat hook prerouting priority 0\n }"
    nft = f"table ip {TABLES[layout]} {{\n {chain}\n}}\n"
    assert run_in(netns, "nft", "-f", "-", input=nft).returncode == 0
    backend = IptablesBackend("nft", netns=netns)
    assert remove_over_netlink(backend) == ([], True) and dumps == []
    loaded = run_in(netns, "iptables-nft-restore", "--noflush", input=UPSTREAM_STATE)
    assert loaded.returncode == 0, loaded.stderr
    removed, _complete = remove_over_netlink(backend)
    assert dumps == ["chains"] and removed


def test_cleanup_removes_upstreams_ipv6_ipsets_under_their_truncated_names(netns: str) -> None:
    """Upstream cuts the IPv6 set names at the kernel's 31 characters (KUBE-6-LOAD-BALANCER-
    SOURCE-CID): a cleanup that lengthens them misses those sets."""
    from kproxy.dataplane.ipvs import names

    truncated = [name for name in names.IPV6_SET_NAMES if len(name) == 31]
    assert "KUBE-6-LOAD-BALANCER-SOURCE-CID" in truncated
    created = "".join(
        f"create {s} hash:ip family inet6\n" for s in (*names.IPV6_SET_NAMES, "FOREIGN-6-SET")
    )
    assert run_in(netns, "ipset", "restore", input=created).returncode == 0
    kproxy = [sys.executable, "-m", "kproxy.cli", "cleanup"]

    dry = json.loads(run_in(netns, *kproxy, "--dry-run", "--json").stdout)["removed"]
    assert {o["name"] for o in dry if o["kind"] == "ipset"} == set(names.IPV6_SET_NAMES)
    done = run_in(netns, *kproxy)
    assert done.returncode == 0, done.stderr
    assert run_in(netns, "ipset", "list", "-n").stdout.split() == ["FOREIGN-6-SET"]


IPVS_MODE_STATE = """\
*filter
:KUBE-SERVICES - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-IPVS-FILTER - [0:0]
-A INPUT -j KUBE-SERVICES
-A INPUT -j KUBE-IPVS-FILTER
-A FORWARD -j KUBE-FORWARD
COMMIT
*nat
:KUBE-SERVICES - [0:0]
:KUBE-NODE-PORT - [0:0]
:KUBE-SVC-XPGD46QRK7WJZT7O - [0:0]
:KUBE-NODEPORTS - [0:0]
-A PREROUTING -j KUBE-SERVICES
-A KUBE-SERVICES -j KUBE-NODE-PORT
-A OUTPUT -j KUBE-NODEPORTS
COMMIT
"""


@pytest.mark.parametrize("flavour", ["nft", "legacy"])
def test_leftovers_of_a_node_running_ipvs_keep_its_chains_by_table(
    netns: str, flavour: str
) -> None:
    """ipvs mode writes some of iptables mode's chain names, in its own tables only: filter
    KUBE-SERVICES is an iptables-mode leftover beside ipvs mode's nat KUBE-SERVICES."""
    from kproxy.leftovers import clean_leftovers

    loaded = run_in(netns, f"iptables-{flavour}-restore", "--noflush", input=IPVS_MODE_STATE)
    assert loaded.returncode == 0, loaded.stderr
    removed = clean_leftovers("ipvs", iptables_flavour=flavour, netns=netns)
    chains_gone = {
        (o.where.rsplit(" ", 1)[1], o.name) for o in removed if o.kind == "iptables-chain"
    }
    assert chains_gone == {
        ("filter", "KUBE-SERVICES"),
        ("nat", "KUBE-SVC-XPGD46QRK7WJZT7O"),
        ("nat", "KUBE-NODEPORTS"),
    }
    saved = run_in(netns, f"iptables-{flavour}-save").stdout
    assert "-A INPUT -j KUBE-IPVS-FILTER" in saved and "-A FORWARD -j KUBE-FORWARD" in saved
    assert "-A KUBE-SERVICES -j KUBE-NODE-PORT" in saved and "KUBE-NODEPORTS" not in saved
    assert "-A INPUT -j KUBE-SERVICES" not in saved and "KUBE-SVC-" not in saved
