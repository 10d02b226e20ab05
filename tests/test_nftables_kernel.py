"""nftables mode against the real kernel and nft 1.0.6, in throwaway network namespaces.

Tests that take the `layout` fixture run in both layouts (upstream's and compact); the
others check what only upstream's layout has (its golden output, its per-service chains).

Every test runs nft only inside a namespace it created (`ip netns exec kpnft-<random> nft
...`), removed in a finalizer even when the test fails; the host's own namespace is never
touched. The packet test uses the lab (kproxy.lab.topology), which does the same.
"""

from __future__ import annotations

import copy
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kproxy.dataplane.base import SyncError
from kproxy.dataplane.facts import NodeFacts, RuleOptions
from kproxy.dataplane.nftables import names
from kproxy.dataplane.nftables.backend import NftBackend, NftError
from kproxy.dataplane.nftables.layouts import LAYOUTS, TABLES
from kproxy.dataplane.nftables.plan import CONTAINERS
from kproxy.dataplane.nftables.proxier import FAILED_TRANSACTION, NftablesDataplane
from kproxy.dataplane.nftables.render import render_full
from kproxy.lab.topology import Lab
from kproxy.model.snapshot import ChangeTracker, snapshot_from_objects
from kproxy.ops.inspect.nftables_reader import parse_table, shared_picks
from kproxy.sources.base import ObjectEvent, ObjectKey
from tests.support.nft_fakes import FakeTable
from tests.support.nft_golden import facts, fixture, flow_cases, golden_yaml, options, snapshot
from tests.support.objects import endpoint, endpoint_slice, node, port, service

pytestmark = pytest.mark.kernel

FACTS = NodeFacts(node_ips=("10.100.0.1",), local_addresses=("127.0.0.1", "10.100.0.1"))
OPTIONS = RuleOptions(cluster_cidrs=("10.244.0.0/16",))


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def netns() -> Iterator[str]:
    name = f"kpnft-{secrets.token_hex(4)}"
    _ip("netns", "add", name)
    try:
        _ip("-n", name, "link", "set", "lo", "up")
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


@pytest.fixture(params=LAYOUTS)
def layout(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def nft(ns: str, *args: str, input: str | None = None) -> str:
    proc = subprocess.run(
        ["ip", "netns", "exec", ns, "nft", *args],
        input=input,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def web(i: int, ips: list[str]) -> list[dict[str, Any]]:
    name = f"web{i}"
    return [
        service(name, f"10.96.{i // 200}.{10 + i % 200}", [port("http", 80, 8080)]),
        endpoint_slice(name, [endpoint(ip) for ip in ips], [port("http", 8080)]),
    ]


def event(obj: dict[str, Any], delete: bool = False) -> ObjectEvent:
    meta = obj["metadata"]
    ns = "" if obj["kind"] == "Node" else meta.get("namespace", "default")
    return ObjectEvent(ObjectKey(obj["kind"], ns, meta["name"]), None if delete else obj)


def tracker(n: int) -> ChangeTracker:
    t = ChangeTracker("node1")
    t.apply([event(node())])
    for i in range(n):
        t.apply([event(o) for o in web(i, [f"10.244.{i % 250}.{1 + i // 250}", "10.244.255.1"])])
    return t


def kernel_elements(ns: str, kind: str, name: str, table: str = names.TABLE) -> dict[str, str]:
    return {k: v for k, v, _ in NftBackend(netns=ns).elements(kind, "ip", table, name)}


def assert_kernel_holds_the_plan(ns: str, dp: NftablesDataplane) -> None:
    """Every service container of the table holds exactly the last plan's elements."""
    assert dp.last_plan is not None
    for container, want in dp.last_plan.elements().items():
        have = kernel_elements(ns, CONTAINERS[container][0], container, dp.table)
        assert have == {k: e.value for k, e in want.items()}, container


# --------------------------------------------------------------------------- full syncs


def test_check_passes_here(netns: str) -> None:
    NftablesDataplane.check(netns)


def test_full_sync_loads_upstreams_overall_case_and_the_kernel_agrees_with_the_model(
    netns: str,
) -> None:
    case = golden_yaml("overall.yaml")
    opts = options()
    snap = snapshot(case["objects"])
    dp = NftablesDataplane(facts(), opts, netns=netns, service_cidrs=fixture()["service_cidrs"])
    result = dp.sync(snap, full=True)
    assert result.full and result.services == 6
    listing = NftBackend(netns=netns).list_json("table", "ip", names.TABLE)
    kinds = {next(iter(o)) for o in listing}
    assert {"table", "chain", "rule", "set", "map"} <= kinds
    maps = {o["map"]["name"] for o in listing if "map" in o}
    assert maps == {
        "service-ips",
        "service-nodeports",
        "no-endpoint-services",
        "no-endpoint-nodeports",
        "firewall-ips",
    }
    # The model (upstream's expected state, see the compat tests) equals what the kernel holds.
    model = FakeTable()
    model.apply(render_full(snap, facts(), opts, service_cidrs=fixture()["service_cidrs"]))
    for name, container in model.containers.items():
        if name.startswith("affinity-"):
            continue
        assert kernel_elements(netns, container.kind, name) == container.values, name
    chains = set(NftBackend(netns=netns).chains("ip", names.TABLE))
    assert chains == set(model.chains)
    svc5 = "service-HVFWP5L3-ns5/svc5/tcp/p80"
    out = nft(netns, "list", "chain", "ip", names.TABLE, svc5)
    assert "ip saddr @affinity-GTK6MW7G-ns5/svc5/tcp/p80__10.180.0.3/80 goto" in out
    assert "numgen random mod 1 vmap" in out
    base = nft(netns, "list", "chain", "ip", names.TABLE, "nat-output")
    assert "type nat hook output priority -100" in base  # G1: numeric on nft 1.0.6


def test_netlink_element_listing_matches_nfts(netns: str, layout: str) -> None:
    """The element reader a full sync diffs against (one netlink dump per container) sees
    what `nft -j list` shows: keys, verdicts, endpoint data, comments."""
    case = golden_yaml("overall.yaml")
    dp = NftablesDataplane(
        facts(), options(), netns=netns, service_cidrs=fixture()["service_cidrs"], layout=layout
    )
    dp.sync(snapshot(case["objects"]), full=True)
    backend = NftBackend(netns=netns)
    seen = 0
    for container in dp.planner.setup.service_containers:
        kind = CONTAINERS[container][0]
        listed = sorted(backend.nft_elements(kind, "ip", dp.table, container))
        assert sorted(backend.elements(kind, "ip", dp.table, container)) == listed, container
        seen += len(listed)
    assert seen > 20
    # Chain and set names come from netlink dumps too.
    listing = backend.list_json("table", "ip", dp.table)
    assert sorted(backend.chains("ip", dp.table)) == sorted(
        o["chain"]["name"] for o in listing if "chain" in o
    )
    sets = sorted(backend.sets("ip", dp.table))
    assert sets == sorted(o["set"]["name"] for o in listing if "set" in o) and sets


def test_full_sync_onto_an_empty_table_equals_the_diffing_path(netns: str, layout: str) -> None:
    """A full sync onto a missing table writes every element without diffing; one onto a
    table someone scribbled in diffs against the kernel. Both end in the state of the
    upstream-form text loaded by one bare `nft -f`."""
    case = golden_yaml("overall.yaml")
    snap = snapshot(case["objects"])
    cidrs = fixture()["service_cidrs"]
    text = render_full(snap, facts(), options(), service_cidrs=cidrs, layout=layout)
    table = TABLES[layout]
    nft(netns, "-f", "-", input=text)
    want = kernel_state(netns, table)
    nft(netns, "delete", "table", "ip", table)

    fresh = NftablesDataplane(
        facts(), options(), netns=netns, service_cidrs=cidrs, layout=layout, keep_last_write=True
    )
    fresh.sync(snap, full=True)
    assert fresh.last_write is not None
    assert not [op for op in fresh.last_write.tx.ops if op.verb == "delete" and op.element]
    assert kernel_state(netns, table) == want
    assert_kernel_holds_the_plan(netns, fresh)

    # Someone else's edits: an element gone, one changed, two extra.
    nft(netns, "delete", "element", "ip", table, "cluster-ips", "{ 172.30.0.41 }")
    nft(netns, "delete", "element", "ip", table, "service-ips", "{ 172.30.0.42 . tcp . 80 }")
    nft(netns, "add", "element", "ip", table, "service-ips", "{ 172.30.0.42 . tcp . 80 : drop }")
    nft(
        netns,
        "add",
        "element",
        "ip",
        table,
        "no-endpoint-services",
        '{ 10.9.9.9 . tcp . 9 comment "x" : drop }',
    )
    nft(netns, "add", "element", "ip", table, "cluster-ips", "{ 10.9.9.8 }")
    restarted = NftablesDataplane(
        facts(), options(), netns=netns, service_cidrs=cidrs, layout=layout, keep_last_write=True
    )
    restarted.sync(snap, full=True)
    assert restarted.last_write is not None
    changed = [line for line in restarted.last_write.tx.lines if " element " in line]
    assert any("delete element" in line and "10.9.9.8" in line for line in changed)
    assert any("delete element" in line and "172.30.0.42 . tcp" in line for line in changed)
    assert kernel_state(netns, table) == want
    assert_kernel_holds_the_plan(netns, restarted)


def test_every_golden_case_renders_to_a_valid_nft_script(netns: str) -> None:
    cases = [golden_yaml("overall.yaml"), *flow_cases()]
    for case in cases:
        text = render_full(
            snapshot(case["objects"]),
            facts(),
            options(),
            service_cidrs=fixture()["service_cidrs"],
        )
        nft(netns, "-f", "-", input=text)
        nft(netns, "-f", "-", input=text)  # and again over itself: a full resync
        nft(netns, "delete", "table", "ip", names.TABLE)


# --------------------------------------------------------------------------- partial syncs


def test_one_service_change_is_a_small_transaction(netns: str) -> None:
    t = tracker(300)
    dp = NftablesDataplane(FACTS, OPTIONS, netns=netns, clock=Clock(), keep_last_write=True)
    full = dp.sync(t.snapshot(), full=True)
    assert dp.last_write is not None
    full_ops = len(dp.last_write.tx)
    t.apply([event(o) for o in web(42, ["10.244.42.9", "10.244.255.1"])])
    result = dp.sync(t.snapshot(), full=False)
    assert not result.full and result.rewritten == 1
    ops = len(dp.last_write.tx)
    assert ops == 3 * 2 + 3 * 2 + 1, dp.last_write.tx.text()
    assert full_ops > 50 * ops
    assert full.rules_total == result.rules_total
    # The kernel now DNATs web42 to the new endpoint.
    chain = next(
        c
        for c in NftBackend(netns=netns).chains("ip", names.TABLE)
        if "web42/" in c and c.startswith("service-")
    )
    assert "10.244.42.9" in nft(netns, "list", "chain", "ip", names.TABLE, chain)


def test_stale_chains_are_deleted_on_a_later_sync(netns: str) -> None:
    t = tracker(5)
    clock = Clock()
    dp = NftablesDataplane(FACTS, OPTIONS, netns=netns, clock=clock)
    dp.sync(t.snapshot(), full=True)
    t.apply([event(o, delete=True) for o in web(3, [])])
    dp.sync(t.snapshot(), full=False)
    backend = NftBackend(netns=netns)
    stale = [c for c in backend.chains("ip", names.TABLE) if "web3/" in c]
    assert len(stale) == 3
    for chain in stale:  # flushed at once, still there
        assert "jump" not in nft(netns, "list", "chain", "ip", names.TABLE, chain)
    assert "10.96.0.13" not in kernel_elements(netns, "set", "cluster-ips")
    clock.now += 1.5
    result = dp.sync(t.snapshot(), full=False)
    assert result.stale_removed == 3
    assert not [c for c in backend.chains("ip", names.TABLE) if "web3/" in c]


def test_full_sync_trusts_a_kernel_only_kproxy_changed(netns: str, layout: str) -> None:
    """Every commit in the namespace since the last full read was ours (the nf_tables
    generation says so): a full sync writes only what changed. Anyone else's commit ends
    that, and the next full sync reads the table and repairs what was done to it."""
    t = tracker(30)
    dp = NftablesDataplane(
        FACTS, OPTIONS, netns=netns, clock=Clock(), keep_last_write=True, layout=layout
    )
    assert not dp.sync(t.snapshot(), full=True).kernel_unchanged
    again = dp.sync(t.snapshot(), full=True)
    assert again.full and again.kernel_unchanged
    assert dp.last_write is not None and len(dp.last_write.tx) == 0
    t.apply([event(o) for o in web(7, ["10.244.7.9"])])
    assert dp.sync(t.snapshot(), full=False).rewritten == 1  # our own commits keep custody
    assert dp.sync(t.snapshot(), full=True).kernel_unchanged

    nft(netns, "delete", "element", "ip", dp.table, "cluster-ips", "{ 10.96.0.13 }")
    repaired = dp.sync(t.snapshot(), full=True)
    assert not repaired.kernel_unchanged
    assert "10.96.0.13" in kernel_elements(netns, "set", "cluster-ips", dp.table)
    assert_kernel_holds_the_plan(netns, dp)
    assert dp.sync(t.snapshot(), full=True).kernel_unchanged, "the repair re-established it"


def test_broken_transaction_keeps_the_previous_table(netns: str, tmp_path: Path) -> None:
    t = tracker(5)
    dp = NftablesDataplane(FACTS, OPTIONS, netns=netns, state_dir=tmp_path, clock=Clock())
    dp.sync(t.snapshot(), full=True)
    before = nft(netns, "list", "table", "ip", names.TABLE)

    t.apply([event(o) for o in web(2, ["10.244.2.77"])])
    snap = t.snapshot()
    real_plan = dp.planner.plan

    def bad_plan(snapshot):
        plan = real_plan(snapshot)
        name = next(n for n in plan.blocks if n.name == "web2")
        block = plan.blocks[name]
        chain = block.chains[0]
        broken = type(chain)(chain.name, (*chain.rules, "ip daddr 10.1.2.3 jump nowhere"))
        plan.blocks[name] = type(block)(
            block.name,
            (broken, *block.chains[1:]),
            block.endpoint_chains,
            block.affinity_sets,
            block.elements,
        )
        return plan

    dp.planner.plan = bad_plan  # type: ignore[method-assign]
    with pytest.raises(SyncError) as err:
        dp.sync(snap, full=False)
    message = str(err.value)
    assert "line " in message and "jump nowhere" in message
    assert "No such file or directory" in message
    assert nft(netns, "list", "table", "ip", names.TABLE) == before
    assert "jump nowhere" in (tmp_path / FAILED_TRANSACTION).read_text()
    dp.planner.plan = real_plan  # type: ignore[method-assign]
    assert dp.sync(snap, full=False).full  # the next sync is full and succeeds
    assert "10.244.2.77" in nft(netns, "list", "table", "ip", names.TABLE)


def test_rejected_netlink_step_names_the_element(netns: str, tmp_path: Path, layout: str) -> None:
    """An element change the kernel refuses (here: the mirror believes in an element someone
    else deleted) fails the sync with the element named, and the next sync is full."""
    t = tracker(5)
    dp = NftablesDataplane(
        FACTS, OPTIONS, netns=netns, state_dir=tmp_path, clock=Clock(), layout=layout
    )
    dp.sync(t.snapshot(), full=True)
    key = "10.96.0.12 . tcp . 80"
    nft(netns, "delete", "element", "ip", dp.table, "service-ips", "{", key, "}")
    t.apply([event(o) for o in web(2, [])])  # web2 loses its endpoints: delete + add
    with pytest.raises(SyncError) as err:
        dp.sync(t.snapshot(), full=False)
    assert f"delete element ip {dp.table} service-ips {{ {key} }}" in str(err.value)
    assert "No such file or directory" in str(err.value)
    assert key in (tmp_path / FAILED_TRANSACTION).read_text()
    assert dp.sync(t.snapshot(), full=False).full
    assert key in kernel_elements(netns, "map", "no-endpoint-services", dp.table)
    assert_kernel_holds_the_plan(netns, dp)


def test_restart_adopts_the_table(netns: str, layout: str) -> None:
    t = tracker(30)
    NftablesDataplane(FACTS, OPTIONS, netns=netns, layout=layout).sync(t.snapshot(), full=True)
    again = NftablesDataplane(FACTS, OPTIONS, netns=netns, keep_last_write=True, layout=layout)
    again.sync(t.snapshot(), full=False)
    assert again.last_write is not None
    lines = again.last_write.tx.lines
    assert not [line for line in lines if f"chain ip {again.table} endpoint-" in line]
    assert not [line for line in lines if " element " in line and "nodeport-ips" not in line]


def test_detach_unhooks_in_one_step_and_a_full_sync_reattaches(netns: str, layout: str) -> None:
    dp = NftablesDataplane(FACTS, OPTIONS, netns=netns, layout=layout)
    dp.sync(tracker(3).snapshot(), full=True)
    dp.detach()
    listing = NftBackend(netns=netns).list_json("chains", "ip")
    assert listing and not [c for c in listing if "hook" in c["chain"]]
    assert [c for c in listing if names.is_service_chain(c["chain"]["name"])]
    assert dp.sync(tracker(3).snapshot(), full=False).full
    hooked = {
        c["chain"]["name"]
        for c in NftBackend(netns=netns).list_json("chains", "ip")
        if "hook" in c["chain"]
    }
    assert len(hooked) == 8


def test_table_lookup_and_detach_go_over_netlink(netns: str) -> None:
    backend = NftBackend(netns=netns)
    assert not backend.table_exists("ip", "kube-proxy")
    nft(netns, "-f", "-", input="add table ip kube-proxy\nadd table ip6 other\n")
    assert backend.table_exists("ip", "kube-proxy")
    assert not backend.table_exists("ip", "other")  # another family's table
    assert backend.table_exists("ip6", "other")  # the nft fallback for another family
    # A batch naming one missing chain changes nothing: the detach then falls back to nft.
    nft(netns, "-f", "-", input="add chain ip kube-proxy a { counter ; }\n")
    with pytest.raises(NftError):
        backend.delete_chains("ip", "kube-proxy", ["a", "missing"])
    assert "a" in backend.chains("ip", "kube-proxy")
    backend.delete_chains("ip", "kube-proxy", ["a"])  # rules and all
    assert "a" not in backend.chains("ip", "kube-proxy")


def test_netlink_table_listing_matches_nft(netns: str) -> None:
    nft(
        netns,
        "-f",
        "-",
        input="add table ip a\nadd table ip6 b\nadd table inet c\nadd table bridge d\n"
        "add table arp e\nadd table netdev f\n",
    )
    backend = NftBackend(netns=netns)
    by_netlink = sorted(map(str, backend.tables()))
    by_nft = sorted(
        f"{t['table']['family']} {t['table']['name']}"
        for t in backend.list_json("tables")
        if "table" in t
    )
    assert by_netlink == by_nft == ["arp e", "bridge d", "inet c", "ip a", "ip6 b", "netdev f"]


def test_drifted_and_cleanup_touch_only_our_tables(netns: str, layout: str) -> None:
    """A dataplane's own tables are its layout's: the other layout's table (the other side
    of a switch between them) stays."""
    other = next(t for lay, t in TABLES.items() if lay != layout)
    nft(netns, "add", "table", "ip", other)
    nft(
        netns,
        "-f",
        "-",
        input=(
            "add table inet filter\n"
            "add chain inet filter input { type filter hook input priority 0 ; }\n"
            "add rule inet filter input tcp dport 22 accept\n"
            "add table ip6 kube-proxy\n"
            "add table ip nat\n"
            "add table ip kproxy-anchor\n"
        ),
    )
    dp = NftablesDataplane(FACTS, OPTIONS, netns=netns, layout=layout)
    dp.sync(tracker(3).snapshot(), full=True)
    owned = sorted(o.name for o in dp.owned())
    own = {"upstream": ["ip kube-proxy", "ip6 kube-proxy"], "compact": ["ip kproxy-compact"]}
    assert owned == own[layout]
    assert sorted(o.name for o in dp.cleanup(dry_run=True)) == owned
    assert NftBackend(netns=netns).table_exists("ip", dp.table)
    assert not dp.drifted()
    dp.cleanup()
    tables = {str(t) for t in NftBackend(netns=netns).tables()}
    others = {"ip kproxy-compact"} if layout == "upstream" else {"ip kube-proxy", "ip6 kube-proxy"}
    assert tables == {"inet filter", "ip nat", "ip kproxy-anchor", *others}
    assert "tcp dport 22 accept" in nft(netns, "list", "table", "inet", "filter")
    assert dp.owned() == []
    dp.sync(tracker(3).snapshot(), full=True)
    nft(netns, "delete", "table", "ip", dp.table)
    assert dp.drifted()


def kernel_state(ns: str, table: str = names.TABLE) -> dict[str, Any]:
    """The table as comparable data: rules per chain and elements per set (no handles)."""
    import json

    state: dict[str, Any] = {"chains": {}, "sets": {}}
    for obj in NftBackend(netns=ns).list_json("table", "ip", table):
        if "chain" in obj:
            c = obj["chain"]
            state["chains"][c["name"]] = [c.get("type"), c.get("hook"), c.get("prio")]
            state["chains"].setdefault(c["name"] + "#rules", [])
        elif "rule" in obj:
            r = obj["rule"]
            rule = json.dumps([r["expr"], r.get("comment")], sort_keys=True)
            # nft 1.0.6 prints the same transport-header load in a numgen DNAT map key as
            # `tcp dport` or `th dport` depending on what it listed before (same bytecode).
            rule = rule.replace(
                '{"field": "dport", "protocol": "tcp"}', '{"field": "dport", "protocol": "th"}'
            )
            state["chains"].setdefault(r["chain"] + "#rules", []).append(rule)
        elif "set" in obj or "map" in obj:
            kind = "set" if "set" in obj else "map"
            body = obj[kind]
            elems = sorted(json.dumps(e, sort_keys=True) for e in body.get("elem", []))
            flags = body.get("flags", [])
            state["sets"][body["name"]] = [kind, body["type"], flags, body.get("comment"), elems]
    return state


def test_fast_apply_reaches_the_state_of_one_upstream_form_transaction(
    netns: str, layout: str
) -> None:
    """A series of partial syncs through the fast path (cache-free nft steps plus netlink
    deletes and element changes) ends in the same kernel state as one full sync written in
    upstream's form to a fresh table."""
    t = tracker(40)
    clock = Clock()
    dp = NftablesDataplane(FACTS, OPTIONS, netns=netns, clock=clock, fast=True, layout=layout)
    dp.backend.chunk_ops = 200  # type: ignore[attr-defined]  (several pieces on full syncs)
    dp.sync(t.snapshot(), full=True)
    affinity = {
        "sessionAffinity": "ClientIP",
        "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 99}},
    }
    lb = service(
        "lb",
        "10.96.9.9",
        [port("http", 80, 8080, nodePort=30099)],
        type="LoadBalancer",
        loadBalancerSourceRanges=["10.100.0.0/24"],
    )
    lb["status"] = {"loadBalancer": {"ingress": [{"ip": "10.99.0.9"}]}}
    changes = [
        web(3, ["10.244.3.7", "10.244.3.8"]),  # endpoints replaced
        web(4, []),  # emptied: service-ips -> no-endpoint-services
        [
            service("web5", "10.96.0.15", [port("http", 80, 8080)], internalTrafficPolicy="Local"),
            web(5, ["10.244.5.1"])[1],
        ],  # the service-ips value changes (goto local-...)
        [
            service("web6", "10.96.0.16", [port("http", 80, 8080)], **affinity),
            web(6, ["10.244.6.1", "10.244.6.2"])[1],
        ],  # affinity sets appear
        [lb, endpoint_slice("lb", [endpoint("10.244.9.1")], [port("http", 8080)])],
    ]
    for objs in changes:
        t.apply([event(o) for o in objs])
        dp.sync(t.snapshot(), full=False)
        clock.now += 0.4
    t.apply([event(o, delete=True) for o in web(7, [])])  # a service deleted
    t.apply([event(o) for o in web(6, ["10.244.6.1"])])  # its affinity sets go away
    dp.sync(t.snapshot(), full=False)
    assert any(s.startswith("netlink") for s in dp.backend.last_steps)  # type: ignore[attr-defined]
    t.apply([event(o) for o in web(4, ["10.244.4.4"])])  # refilled
    dp.sync(t.snapshot(), full=False)
    clock.now += 5
    dp.sync(t.snapshot(), full=False)  # deletes the stale chains
    fast_state = kernel_state(netns, dp.table)
    assert_kernel_holds_the_plan(netns, dp)

    nft(netns, "delete", "table", "ip", dp.table)
    text = NftablesDataplane(FACTS, OPTIONS, netns=netns, fast=False, layout=layout)
    text.sync(t.snapshot(), full=True)
    assert kernel_state(netns, dp.table) == fast_state


# --------------------------------------------------------------------------- real packets


def test_cluster_ip_and_node_port_carry_real_packets(lab: Lab, layout: str) -> None:
    pod_ips = sorted(lab.pod_ips.values())
    objects = [
        node(ip=lab.node_ip),
        service(
            "web",
            "10.96.0.10",
            [port("http", 80, 8080, nodePort=30080)],
            type="NodePort",
        ),
        endpoint_slice("web", [endpoint(ip) for ip in pod_ips], [port("http", 8080)]),
        service("empty", "10.96.0.11", [port("http", 80, 8080)]),
    ]
    snap = snapshot_from_objects(copy.deepcopy(objects), "node1")
    facts = NodeFacts(node_ips=(lab.node_ip,), local_addresses=("127.0.0.1", lab.node_ip))
    dp = NftablesDataplane(
        facts, RuleOptions(cluster_cidrs=(lab.cluster_cidr,)), netns=lab.node_ns, layout=layout
    )
    try:
        dp.sync(snap, full=True)
        client = lab.agent(lab.client_ns[0])
        results = client.request_many(proto="tcp", dst="10.96.0.10", port=80, count=40)
        assert {r.pod for r in results if r.ok} == set(lab.pod_ips), results
        assert all(r.ok for r in results)
        # From outside the cluster CIDR: masqueraded to the node.
        assert {r.peer for r in results} == {lab.node_ip}
        via_nodeport = client.request_many(proto="tcp", dst=lab.node_ip, port=30080, count=15)
        assert all(r.ok for r in via_nodeport), via_nodeport
        # No endpoints: rejected at once (connection refused), not a timeout.
        empty = client.request_many(proto="tcp", dst="10.96.0.11", port=80, count=1, timeout=2)
        assert not empty[0].ok and empty[0].elapsed < 1.0, empty
    finally:
        dp.cleanup()


def test_hairpin_local_policy_and_udp_carry_real_packets(lab: Lab, layout: str) -> None:
    """A pod reaching itself through its service is masqueraded (hairpin); externalIP traffic
    with externalTrafficPolicy Local goes to local endpoints only, keeping the client's
    address; UDP is balanced like TCP; a one-service change over the fast path lands."""
    pods = sorted(lab.pod_ips.items())
    (pod1, ip1), (_, ip2) = pods[0], pods[1]
    ext = service(
        "ext",
        "10.96.0.20",
        [port("http", 80, 8080)],
        externalIPs=["10.99.0.20"],
        externalTrafficPolicy="Local",
    )
    objects = [
        node(ip=lab.node_ip),
        service(
            "web",
            "10.96.0.10",
            [port("http", 80, 8080), port("dns", 53, 8080, protocol="UDP")],
        ),
        endpoint_slice(
            "web",
            [endpoint(ip) for _, ip in pods],
            [port("http", 8080), port("dns", 8080, protocol="UDP")],
        ),
        ext,
        endpoint_slice("ext", [endpoint(ip1), endpoint(ip2, "node2")], [port("http", 8080)]),
    ]
    t = ChangeTracker("node1")
    t.apply([event(o) for o in copy.deepcopy(objects)])
    facts = NodeFacts(node_ips=(lab.node_ip,), local_addresses=("127.0.0.1", lab.node_ip))
    dp = NftablesDataplane(
        facts, RuleOptions(cluster_cidrs=(lab.cluster_cidr,)), netns=lab.node_ns, layout=layout
    )
    try:
        dp.sync(t.snapshot(), full=True)
        own = lab.agent(lab.pod_ns_of(pod1))
        hairpin = [
            r
            for r in own.request_many(proto="tcp", dst="10.96.0.10", port=80, count=30)
            if r.pod == pod1
        ]
        assert hairpin and all(r.ok and r.peer == lab.node_ip for r in hairpin), hairpin
        client = lab.agent(lab.client_ns[0])
        local = client.request_many(proto="tcp", dst="10.99.0.20", port=80, count=15)
        assert all(r.ok and r.pod == pod1 for r in local), local
        assert {r.peer for r in local} == {lab.client_ips[0]}  # not masqueraded
        udp = client.request_many(proto="udp", dst="10.96.0.10", port=53, count=40)
        assert all(r.ok for r in udp) and {r.pod for r in udp} == set(lab.pod_ips), udp
        # One service change on the fast path: the local endpoint is now the other pod
        # (same endpoint counts, so in the compact layout: map elements over netlink only).
        swapped = [endpoint(ip2), endpoint(ip1, "node2")]
        t.apply([event(endpoint_slice("ext", swapped, [port("http", 8080)]))])
        dp.sync(t.snapshot(), full=False)
        moved = client.request_many(proto="tcp", dst="10.99.0.20", port=80, count=10)
        assert all(r.ok and r.pod != pod1 for r in moved), moved
        if layout == "compact":
            assert [s.split(":")[0] for s in dp.backend.last_steps] == ["netlink"]  # type: ignore[attr-defined]
    finally:
        dp.cleanup()


def test_udp_only_services_carry_real_packets(lab: Lab, layout: str) -> None:
    """UDP-only services (ClusterIP and NodePort) are DNATed, also after later syncs write
    new chains and elements for them; in the compact layout each DNAT rule takes the
    protocol of its map and nothing else (nft makes the rule match it)."""
    pod_ips = sorted(lab.pod_ips.values())
    udp = [port("dns", 53, 8080, protocol="UDP", nodePort=30053)]
    udp_slice = [port("dns", 8080, protocol="UDP")]

    def dns(name: str, cluster_ip: str, ips: list[str], **spec: Any) -> list[dict[str, Any]]:
        return [
            service(name, cluster_ip, copy.deepcopy(udp), **spec),
            endpoint_slice(name, [endpoint(ip) for ip in ips], copy.deepcopy(udp_slice)),
        ]

    t = ChangeTracker("node1")
    t.apply([event(node(ip=lab.node_ip))])
    t.apply([event(o) for o in dns("dns", "10.96.0.53", pod_ips, type="NodePort")])
    facts = NodeFacts(node_ips=(lab.node_ip,), local_addresses=("127.0.0.1", lab.node_ip))
    dp = NftablesDataplane(
        facts, RuleOptions(cluster_cidrs=(lab.cluster_cidr,)), netns=lab.node_ns, layout=layout
    )
    client = lab.agent(lab.client_ns[0])
    try:
        dp.sync(t.snapshot(), full=True)
        results = client.request_many(proto="udp", dst="10.96.0.53", port=53, count=30)
        assert all(r.ok for r in results) and {r.pod for r in results} == set(lab.pod_ips)
        nodeport = client.request_many(proto="udp", dst=lab.node_ip, port=30053, count=10)
        assert all(r.ok for r in nodeport), nodeport
        # Later transactions: a second UDP service and new endpoint counts (new shared
        # chains in the compact layout, written after the maps they name).
        t.apply([event(o) for o in dns("dns2", "10.96.0.54", pod_ips[:1])])
        t.apply([event(o) for o in dns("dns", "10.96.0.53", pod_ips[1:], type="NodePort")])
        dp.sync(t.snapshot(), full=False)
        second = client.request_many(proto="udp", dst="10.96.0.54", port=53, count=5)
        assert all(r.ok and lab.pod_ips[r.pod or ""] == pod_ips[0] for r in second), second
        first = client.request_many(proto="udp", dst="10.96.0.53", port=53, count=20)
        assert all(r.ok for r in first), first
        assert {lab.pod_ips[r.pod or ""] for r in first} == set(pod_ips[1:])
        assert all(r.ok for r in client.request_many("udp", lab.node_ip, 30053, count=5))
        if layout == "compact":
            listing = nft(lab.node_ns, "-j", "list", "table", "ip", dp.table)
            table = parse_table(listing, name=dp.table)
            assert table is not None
            picks = [p for c in table.chains.values() for p in shared_picks(c)]
            assert picks and all(p.container.endswith(f"-{p.proto}") for p in picks)
            assert {p.proto for p in picks} == {"tcp", "udp", "sctp"}
            assert_kernel_holds_the_plan(lab.node_ns, dp)
    finally:
        dp.cleanup()
