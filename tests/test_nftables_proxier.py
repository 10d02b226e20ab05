"""Unit tests of nftables mode's planner, transaction writer and dataplane (no kernel).

The dataplane runs against tests/support/nft_fakes.FakeBackend, an in-memory table that
rejects what the kernel would reject, so every transaction here is also checked for
validity (dangling jumps, element clashes, deleting referenced chains).
"""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kproxy.dataplane.base import DataplaneUnavailable, SyncError
from kproxy.dataplane.facts import NodeFacts, RuleOptions
from kproxy.dataplane.nftables import names
from kproxy.dataplane.nftables.backend import NftBackend, NftError, element_key, verdict_text
from kproxy.dataplane.nftables.cleanup import is_owned_table, owned_tables
from kproxy.dataplane.nftables.plan import NftablesPlanner, nodeport_addresses
from kproxy.dataplane.nftables.proxier import (
    FAILED_TRANSACTION,
    SKIP_KERNEL_CHECK_ENV,
    NftablesDataplane,
    check_nftables,
)
from kproxy.dataplane.nftables.transaction import TableState, write_sync
from kproxy.model.snapshot import ChangeTracker
from kproxy.sources.base import ObjectEvent, ObjectKey
from tests.support.nft_fakes import FakeBackend, trace_packet
from tests.support.objects import endpoint, endpoint_slice, node, port, service

FACTS = NodeFacts(node_ips=("10.100.0.1",), local_addresses=("127.0.0.1", "10.100.0.1"))
OPTIONS = RuleOptions(cluster_cidrs=("10.244.0.0/16",))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def web(i: int, ips: list[str], **spec: Any) -> list[dict[str, Any]]:
    name = f"web{i}"
    return [
        service(name, f"10.96.0.{10 + i}", [port("http", 80, 8080)], **spec),
        endpoint_slice(name, [endpoint(ip) for ip in ips], [port("http", 8080)]),
    ]


def event(obj: dict[str, Any], delete: bool = False) -> ObjectEvent:
    meta = obj["metadata"]
    ns = "" if obj["kind"] == "Node" else meta.get("namespace", "default")
    return ObjectEvent(ObjectKey(obj["kind"], ns, meta["name"]), None if delete else obj)


class World:
    """A tracker, a dataplane over a FakeBackend, and a fake clock."""

    def __init__(self, services: int = 5, **kwargs: Any) -> None:
        self.tracker = ChangeTracker("node1")
        self.tracker.apply([event(node())])
        for i in range(services):
            self.apply(*web(i, [f"10.244.{i}.1", f"10.244.{i}.2"]))
        self.backend = FakeBackend()
        self.clock = Clock()
        self.dp = NftablesDataplane(
            FACTS, OPTIONS, backend=self.backend, clock=self.clock, keep_last_write=True, **kwargs
        )

    def apply(self, *objs: dict[str, Any], delete: bool = False) -> None:
        self.tracker.apply([event(copy.deepcopy(o), delete) for o in objs])

    def sync(self, full: bool = False):
        return self.dp.sync(self.tracker.snapshot(), full=full)

    @property
    def last(self) -> list[str]:
        assert self.dp.last_write is not None
        return self.dp.last_write.tx.lines


# --------------------------------------------------------------------------- partial syncs


def test_partial_sync_touches_only_the_changed_service() -> None:
    w = World(services=50)
    w.sync(full=True)
    base = names.service_base
    w.apply(*web(7, ["10.244.7.1", "10.244.7.3"]))
    result = w.sync()
    assert not result.full and result.rewritten == 1
    snap = w.tracker.snapshot()
    name = next(n for n in snap.services if n.name == "web7")
    ours = base(name)
    # Every line is about web7 (its chains, or the endpoint chain that went away).
    for line in w.last:
        assert "web7/" in line, line
    assert f"add chain ip kube-proxy service-{ours}" in w.last
    assert any(line.startswith("flush chain") and "10.244.7.2" in line for line in w.last)
    # service-ips still points at the same chain: no element is touched.
    assert not [line for line in w.last if " element " in line]
    # 3 chains of the service (add + flush, 2 rules each), 1 stale endpoint chain flushed
    assert len(w.last) == 3 * 2 + 3 * 2 + 1


def test_no_change_means_an_empty_transaction() -> None:
    w = World()
    w.sync(full=True)
    w.sync()
    assert w.last == []
    assert w.backend.runs[-1].startswith("add table")  # nothing new was run


def test_changed_element_value_is_delete_then_add() -> None:
    w = World(services=3)
    w.sync(full=True)
    w.apply(*web(1, ["10.244.1.1"], internalTrafficPolicy="Local"))
    w.sync()
    lines = w.last
    key = "10.96.0.11 . tcp . 80"
    delete = f"delete element ip kube-proxy service-ips {{ {key} }}"
    assert delete in lines
    add = next(line for line in lines if line.startswith("add element") and key in line)
    assert "goto local-" in add
    assert lines.index(delete) < lines.index(add)


def test_removed_service_deletes_elements_and_flushes_chains_then_deletes_them_later() -> None:
    w = World(services=3)
    w.sync(full=True)
    gone = [o for o in web(2, [])]
    w.apply(*gone, delete=True)
    w.sync()
    flushed = [line.split()[-1] for line in w.last if line.startswith("flush chain")]
    assert len(flushed) == 3 and all("web2/" in c for c in flushed)
    assert "delete element ip kube-proxy cluster-ips { 10.96.0.12 }" in w.last
    assert all(c in w.backend.table.chains for c in flushed)
    # Within a second: not deleted yet.
    w.clock.now += 0.5
    w.sync()
    assert all(c in w.backend.table.chains for c in flushed)
    w.clock.now += 0.6
    result = w.sync()
    assert result.stale_removed == 3
    assert not [c for c in flushed if c in w.backend.table.chains]
    assert w.dp.last_stale_deletion == sorted(flushed)


def test_stale_affinity_sets_are_deleted_at_once() -> None:
    affinity = {
        "sessionAffinity": "ClientIP",
        "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 30}},
    }
    w = World(services=2)
    w.apply(*web(0, ["10.244.0.1", "10.244.0.2"], **affinity))
    w.sync(full=True)
    sets = [s for s in w.backend.table.containers if s.startswith("affinity-")]
    assert len(sets) == 2
    w.apply(*web(0, ["10.244.0.1"], **affinity))
    w.sync()
    left = [s for s in w.backend.table.containers if s.startswith("affinity-")]
    assert len(left) == 1 and "10.244.0.1" in left[0]
    assert any(line.startswith("delete set") and "10.244.0.2" in line for line in w.last)


def test_two_services_claiming_one_key_resolve_deterministically() -> None:
    # Two Services with the same ClusterIP and port (e.g. a delete and a create racing):
    # the later one by ServicePortName owns the element, whatever the order of events.
    def build(order: list[int]) -> str:
        w = World(services=0)
        for i in order:
            objs = web(i, [f"10.244.{i}.1"])
            objs[0]["spec"]["clusterIP"] = "10.96.0.99"
            w.apply(*objs)
        w.sync(full=True)
        return w.backend.table.containers["service-ips"].values["10.96.0.99 . tcp . 80"]

    assert build([1, 2]) == build([2, 1])
    assert "web2" in build([1, 2])


def test_partial_and_full_sync_reach_the_same_state() -> None:
    w = World(services=8)
    w.sync(full=True)
    for step in range(5):
        w.apply(*web(step, [f"10.244.{step}.9"], type="NodePort"))
        w.apply(*web(step + 20, []))
        w.sync()
    partial = w.backend.table.dump()
    fresh = World(services=0)
    fresh.tracker = w.tracker
    fresh.sync(full=True)
    # Stale (flushed, undeleted) chains aside, both tables are equal.
    stale = set(w.dp._state.stale) if w.dp._state else set()
    lines = [
        line
        for line in partial.splitlines()
        if not (line.startswith("add chain") and line.split()[-1] in stale)
    ]
    assert sorted(lines) == sorted(fresh.backend.table.dump().splitlines())


# --------------------------------------------------------------------------- failures


def test_failed_transaction_raises_with_line_keeps_input_and_forces_full(tmp_path: Path) -> None:
    w = World(services=3, state_dir=tmp_path)
    w.sync(full=True)
    before = w.backend.table.dump()
    w.apply(*web(1, ["10.244.1.7"]))
    # A planner bug: a rule that jumps nowhere.
    snap = w.tracker.snapshot()
    real_plan = w.dp.planner.plan

    def bad_plan(snapshot):
        plan = real_plan(snapshot)
        name = next(n for n in plan.blocks if n.name == "web1")
        block = plan.blocks[name]
        chain = block.chains[-1]
        broken = type(chain)(chain.name, (*chain.rules, "jump no-such-chain"))
        plan.blocks[name] = type(block)(
            block.name,
            (*block.chains[:-1], broken),
            block.endpoint_chains,
            block.affinity_sets,
            block.elements,
        )
        return plan

    w.dp.planner.plan = bad_plan  # type: ignore[method-assign]
    with pytest.raises(SyncError) as err:
        w.dp.sync(snap, full=False)
    assert "jump no-such-chain" in str(err.value)
    assert "line " in str(err.value)
    assert w.backend.table.dump() == before  # the kernel kept the previous table
    assert w.dp.sync_failures == 1
    kept = (tmp_path / FAILED_TRANSACTION).read_text()
    assert "jump no-such-chain" in kept and err.value.kept_input == kept
    # The next sync is full and repairs everything.
    w.dp.planner.plan = real_plan  # type: ignore[method-assign]
    result = w.sync()
    assert result.full


def test_failed_stale_chain_deletion_forces_a_full_sync() -> None:
    w = World(services=2)
    w.sync(full=True)
    w.apply(*web(1, []), delete=True)
    w.sync()
    w.clock.now += 2
    w.backend.fail_next = "Error: Device or resource busy"
    result = w.sync()
    assert result.full
    assert w.dp.cleanup_failures == 1 and w.dp.sync_failures == 0


def test_drifted_when_the_table_is_deleted() -> None:
    w = World(services=1)
    assert not w.dp.drifted()  # nothing programmed yet
    w.sync(full=True)
    assert not w.dp.drifted()
    w.backend.table.apply("delete table ip kube-proxy\n")
    assert w.dp.drifted()
    assert w.sync(full=True).full
    assert not w.dp.drifted()


def test_detach_removes_the_base_chains_and_the_next_sync_attaches_again() -> None:
    w = World(services=3)
    w.sync(full=True)
    chains = set(w.backend.table.chains)
    w.dp.detach()
    left = set(w.backend.table.chains)
    base = {
        "filter-prerouting-pre-dnat",
        "filter-output-pre-dnat",
        "filter-input",
        "filter-forward",
        "filter-output",
        "nat-prerouting",
        "nat-output",
        "nat-postrouting",
    }
    assert left == chains - base
    assert w.sync().full  # re-attached
    assert set(w.backend.table.chains) == chains
    t = trace_packet(w.backend.table, "10.100.0.9", "tcp", "10.96.0.11", 80, frozenset())
    assert t.outputs == ["10.244.1.1:8080", "10.244.1.2:8080"]
    w.backend.table.apply("delete table ip kube-proxy\n")
    w.dp.detach()  # nothing to detach: no error


def test_full_sync_after_restart_adopts_elements() -> None:
    w = World(services=4)
    w.sync(full=True)
    restarted = NftablesDataplane(
        FACTS, OPTIONS, backend=w.backend, clock=w.clock, keep_last_write=True
    )
    restarted.sync(w.tracker.snapshot(), full=False)
    assert restarted.last_write is not None
    lines = restarted.last_write.tx.lines
    # Same elements and endpoint chains in the kernel: none rewritten.
    assert not [line for line in lines if " element " in line and "nodeport-ips" not in line]
    assert not [line for line in lines if "chain ip kube-proxy endpoint-" in line]


def test_restart_rewrites_an_endpoint_chain_left_empty() -> None:
    """A proxy killed after flushing a stale endpoint chain and before deleting it leaves
    the chain empty; if its endpoint is back when the next proxy starts, reusing the chain
    would send the service's traffic nowhere."""
    w = World(services=4)
    w.sync(full=True)
    chain = next(c for c in w.backend.table.chains if c.startswith("endpoint-"))
    w.backend.table.apply(f"flush chain ip kube-proxy {chain}\n")
    restarted = NftablesDataplane(
        FACTS, OPTIONS, backend=w.backend, clock=w.clock, keep_last_write=True
    )
    restarted.sync(w.tracker.snapshot(), full=False)
    assert w.backend.table.chains[chain].rules
    assert restarted.last_write is not None
    lines = restarted.last_write.tx.lines
    rewritten = [ln for ln in lines if "chain ip kube-proxy endpoint-" in ln]
    assert rewritten and all(chain in ln for ln in rewritten), rewritten


# --------------------------------------------------------------------------- planning


def test_plan_is_cached_per_service_port() -> None:
    w = World(services=3)
    planner = NftablesPlanner(FACTS, OPTIONS)
    snap = w.tracker.snapshot()
    first = planner.plan(snap)
    second = planner.plan(snap)
    assert all(first.blocks[n] is second.blocks[n] for n in first.blocks)


def test_local_traffic_detectors() -> None:
    snap = World(services=1).tracker.snapshot()
    for opts, text in [
        (RuleOptions(detect_local_mode="NodeCIDR"), "ip saddr != 10.244.0.0/24"),
        (
            RuleOptions(detect_local_mode="BridgeInterface", bridge_interface="cbr0"),
            "iifname != cbr0",
        ),
        (
            RuleOptions(detect_local_mode="InterfaceNamePrefix", interface_name_prefix="veth"),
            'iifname != "veth*"',
        ),
    ]:
        plan = NftablesPlanner(FACTS, opts).plan(snap)
        rules = [r for b in plan.blocks.values() for c in b.chains for r in c.rules]
        assert any(f"ip daddr 10.96.0.10 {text} jump mark-for-masquerade" == r for r in rules)
    plan = NftablesPlanner(FACTS, RuleOptions(masquerade_all=True)).plan(snap)
    rules = [r for b in plan.blocks.values() for c in b.chains for r in c.rules]
    assert "ip daddr 10.96.0.10 jump mark-for-masquerade" in rules


def test_nodeport_addresses() -> None:
    facts = NodeFacts(
        node_ips=("10.0.0.5",), local_addresses=("127.0.0.1", "10.0.0.5", "10.1.0.5", "192.168.7.1")
    )
    assert nodeport_addresses(RuleOptions(), facts) == ("10.0.0.5",)
    assert nodeport_addresses(RuleOptions(node_port_addresses=("10.0.0.0/8",)), facts) == (
        "10.0.0.5",
        "10.1.0.5",
    )
    assert nodeport_addresses(RuleOptions(node_port_addresses=("0.0.0.0/0",)), facts) is None
    assert nodeport_addresses(RuleOptions(node_port_addresses=("fd00::/8",)), facts) is None
    assert nodeport_addresses(
        RuleOptions(node_port_addresses=("primary", "192.168.0.0/16")), facts
    ) == ("10.0.0.5", "192.168.7.1")
    assert nodeport_addresses(RuleOptions(node_port_addresses=("127.0.0.0/8",)), facts) == ()


def test_internal_traffic_policy_local_without_local_endpoints_drops() -> None:
    w = World(services=0)
    objs = web(0, ["10.244.0.1"], internalTrafficPolicy="Local")
    objs[1]["endpoints"][0]["nodeName"] = "node2"
    w.apply(*objs)
    w.sync(full=True)
    values = w.backend.table.containers["no-endpoint-services"].values
    assert values == {"10.96.0.10 . tcp . 80": "drop"}
    t = trace_packet(w.backend.table, "10.244.5.5", "tcp", "10.96.0.10", 80, frozenset())
    assert t.outputs == ["DROP"]


def test_write_sync_is_pure() -> None:
    snap = World(services=2).tracker.snapshot()
    plan = NftablesPlanner(FACTS, OPTIONS).plan(snap)
    state = TableState()
    a = write_sync(plan, state, full=True).tx.text()
    b = write_sync(plan, state, full=True).tx.text()
    assert a == b and state.blocks == {} and state.chains == set()


# --------------------------------------------------------------------------- backend bits


def test_nft_error_names_the_line() -> None:
    data = "add table ip t\nadd chain ip t c\nadd rule ip t c jump nope\n"
    err = NftError(
        "nft rejected the transaction",
        stderr="/dev/stdin:3:24-27: Error: Could not process rule: No such file or directory\n"
        "add rule ip t c jump nope\n                       ^^^^\n",
        input_data=data,
    )
    assert err.line_number == 3 and err.line_text == "add rule ip t c jump nope"
    assert "line 3 ('add rule ip t c jump nope')" in str(err)
    assert "=>      3: add rule ip t c jump nope" in err.context()
    assert err.not_found


def test_json_values_back_to_text() -> None:
    assert element_key({"concat": ["10.96.0.10", "tcp", 80]}) == "10.96.0.10 . tcp . 80"
    assert element_key({"elem": {"val": {"concat": ["tcp", 3001]}, "comment": "x"}}) == (
        "tcp . 3001"
    )
    assert verdict_text({"goto": {"target": "service-X"}}) == "goto service-X"
    assert verdict_text({"drop": None}) == "drop"


def _runner(version: str = "nftables v1.0.6 (Lester Gooch #5)", check_rc: int = 0):
    calls: list[list[str]] = []

    def run(argv, input_data):
        calls.append(list(argv))
        if "--version" in argv:
            return subprocess.CompletedProcess(argv, 0 if version else 127, version, "")
        return subprocess.CompletedProcess(argv, check_rc, "", "Error: nope" if check_rc else "")

    return run, calls


def test_check_accepts_this_kind_of_node_and_runs_in_the_namespace() -> None:
    run, calls = _runner()
    check_nftables("ns1", runner=run, kernel_release="6.18.44-fc", environ={})
    assert all(c[:4] == ["ip", "netns", "exec", "ns1"] for c in calls)
    assert calls[-1][4:] == ["nft", "--check", "add", "table", "ip", "kproxy-probe"]


@pytest.mark.parametrize(
    ("version", "kernel", "env", "message"),
    [
        ("nftables v0.9.8 (E.D.S.)", "6.1.0", {}, "upgrade the 'nftables' package"),
        ("", "6.1.0", {}, "install or repair the 'nftables' package"),
        ("nftables v1.0.6", "5.10.0-21-amd64", {}, "kernel 5.13 or later"),
    ],
)
def test_check_refuses_with_a_clear_message(
    version: str, kernel: str, env: dict[str, str], message: str
) -> None:
    run, _ = _runner(version)
    with pytest.raises(DataplaneUnavailable, match=message):
        check_nftables(None, runner=run, kernel_release=kernel, environ=env)


def test_check_kernel_version_can_be_skipped_like_upstream() -> None:
    run, _ = _runner()
    check_nftables(None, runner=run, kernel_release="5.4.0", environ={SKIP_KERNEL_CHECK_ENV: "1"})
    run, _ = _runner(check_rc=1)
    with pytest.raises(DataplaneUnavailable, match="nf_tables"):
        check_nftables(None, runner=run, kernel_release="6.1", environ={})


def test_backend_prefixes_every_command_with_the_namespace() -> None:
    calls: list[tuple[list[str], str | None]] = []

    def run(argv, input_data):
        calls.append((list(argv), input_data))
        return subprocess.CompletedProcess(argv, 0, '{"nftables": []}', "")

    b = NftBackend(netns="kp-x", runner=run)
    b.run("add table ip kube-proxy\n")
    b.tables()
    assert calls[0] == (
        ["ip", "netns", "exec", "kp-x", "nft", "-f", "-"],
        "add table ip kube-proxy\n",
    )
    assert calls[1][0] == ["ip", "netns", "exec", "kp-x", "nft", "-j", "list", "tables"]


def test_owned_tables_are_only_ours() -> None:
    from kproxy.dataplane.nftables.backend import TableRef

    assert is_owned_table(TableRef("ip", "kube-proxy"))
    assert is_owned_table(TableRef("ip6", "kube-proxy"))
    assert is_owned_table(TableRef("inet", "kproxy-lab"))
    assert not is_owned_table(TableRef("ip", "kproxy-anchor"))  # the switch's, not ours
    assert not is_owned_table(TableRef("inet", "kube-proxy"))
    assert not is_owned_table(TableRef("inet", "filter"))
    assert not is_owned_table(TableRef("ip", "nat"))

    class Tables:
        def tables(self) -> list[TableRef]:
            return [TableRef("inet", "filter"), TableRef("ip", "kube-proxy")]

        def delete_table(self, family: str, name: str) -> bool:
            raise AssertionError("dry run")

    assert [o.name for o in owned_tables(Tables())] == ["ip kube-proxy"]


def test_planner_reports_what_changed_since_its_last_plan() -> None:
    w = World(services=4)
    planner = NftablesPlanner(FACTS, OPTIONS)
    first = planner.plan(w.tracker.snapshot())
    assert len(first.rebuilt) == 4 and first.base is None
    w.apply(*web(1, ["10.244.1.9"]))
    w.apply(*web(2, []), delete=True)
    w.apply(*web(9, ["10.244.9.1"]))
    second = planner.plan(w.tracker.snapshot())
    assert {n.name for n in second.rebuilt} == {"web1", "web9"}
    assert {n.name for n in second.removed} == {"web2"}
    assert second.base is first.blocks
    assert sorted(n.name for n in second.blocks) == ["web0", "web1", "web3", "web9"]
    unchanged = next(n for n in second.blocks if n.name == "web0")
    assert second.blocks[unchanged] is first.blocks[unchanged]
    # Equal values in new objects (a snapshot built from scratch) are not rebuilt.
    from kproxy.model.snapshot import snapshot_from_objects

    objs = [node()] + [o for i in (0, 1, 3, 9) for o in web(i, [])]
    fresh = snapshot_from_objects(objs, "node1")
    third = planner.plan(fresh)
    assert {n.name for n in third.rebuilt} == {"web0", "web1", "web3", "web9"}
    fourth = planner.plan(snapshot_from_objects(copy.deepcopy(objs), "node1"))
    assert fourth.rebuilt == set() and fourth.removed == set()
    assert fourth.rules_total == third.rules_total
