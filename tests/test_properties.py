"""Properties of the model and of every mode's planner over generated objects (no root).

The objects come from tests/support/strategies.py: valid, collision-free sets of Services,
EndpointSlices and this node's Node, and invalid or ignored objects added to them. The same
properties against a real kernel are in test_properties_kernel.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kproxy.dataplane.facts import NodeFacts, RuleOptions
from kproxy.dataplane.iptables.proxier import IptablesDataplane
from kproxy.dataplane.ipvs.proxier import IpvsDataplane
from kproxy.dataplane.nftables.layouts import DEFAULT_LAYOUT, LAYOUTS, make_planner
from kproxy.dataplane.nftables.proxier import NftablesDataplane
from kproxy.dataplane.registry import SPECS, RenderArgs
from kproxy.model.objects import Snapshot
from kproxy.model.snapshot import snapshot_from_objects
from tests.support.iptables_fakes import FakeXtables
from tests.support.ipvs_fakes import FakeDummy, FakeIpset, FakeIpvs, IpvsKernel
from tests.support.model_objects import service, sport
from tests.support.nft_fakes import FakeBackend as NftFakeBackend
from tests.support.nft_fakes import sort_dump
from tests.support.strategies import (
    IGNORED,
    INVALID,
    NODE,
    BadObject,
    World,
    any_world_histories,
    bad_objects,
    node_facts,
    rule_options,
    tracked_snapshots,
    valid_worlds,
)

# About 0.1 s of CPU per example (every mode's render, or a few syncs into fakes).
PROPERTY = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SYNCS = settings(PROPERTY, max_examples=60)
# A full sync, then up to three partial ones.
HISTORIES = any_world_histories(max_length=4)
# No saved userspace proxy ports: a render from nothing.
NO_STATE = Path("/nonexistent/kproxy-properties")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def snap(objects: list[dict[str, Any]]) -> Snapshot:
    return snapshot_from_objects(objects, NODE)


def renders(snapshot: Snapshot, facts: NodeFacts, options: RuleOptions) -> dict[str, str]:
    """Every mode's `kproxy render` output for the snapshot."""
    out = {}
    for name, spec in SPECS.items():
        for layout in LAYOUTS if name == "nftables" else (DEFAULT_LAYOUT,):
            args = RenderArgs(snapshot, facts, options, NO_STATE, nftables_layout=layout)
            out[f"{name} {layout}"] = spec.render(args)
    return out


def key_of(obj: dict[str, Any]) -> tuple[str, str, str]:
    meta = obj["metadata"]
    ns = "" if obj["kind"] == "Node" else (meta.get("namespace") or "default")
    return obj["kind"], ns, meta["name"]


@st.composite
def worlds_with_bad(draw: st.DrawFn) -> tuple[list[dict[str, Any]], list[BadObject]]:
    valid = draw(valid_worlds(collide=draw(st.booleans())))
    has_node = any(o["kind"] == "Node" for o in valid)
    return valid, draw(bad_objects(valid, with_node=not has_node))


# --- the model -------------------------------------------------------------------------------


@PROPERTY
@given(worlds_with_bad())
def test_every_object_parses_and_only_invalid_ones_are_reported(
    world: tuple[list[dict[str, Any]], list[BadObject]],
) -> None:
    valid, bad = world
    snapshot = snap(valid + [b.obj for b in bad])
    reported = {(r.kind, r.namespace, r.name): r for r in snapshot.rejections}
    expected = {key_of(b.obj) for b in bad if b.outcome == INVALID}
    assert set(reported) == expected, bad
    for rej in reported.values():
        assert rej.field and rej.reason
        assert str(rej).startswith(f"{rej.kind} ")
    for b in bad:
        if b.outcome == IGNORED:
            assert key_of(b.obj) not in reported


@PROPERTY
@given(worlds_with_bad(), node_facts(), rule_options())
def test_bad_objects_change_nothing_else(
    world: tuple[list[dict[str, Any]], list[BadObject]],
    facts: NodeFacts,
    options: RuleOptions,
) -> None:
    valid, bad = world
    clean = snap(valid)
    dirty = snap(valid + [b.obj for b in bad])
    assert dirty.services == clean.services
    assert dirty.node == clean.node
    assert renders(dirty, facts, options) == renders(clean, facts, options)


@PROPERTY
@given(st.data(), worlds_with_bad(), node_facts(), rule_options())
def test_snapshot_and_renders_do_not_depend_on_object_order(
    data: st.DataObject,
    world: tuple[list[dict[str, Any]], list[BadObject]],
    facts: NodeFacts,
    options: RuleOptions,
) -> None:
    valid, bad = world
    objects = valid + [b.obj for b in bad]
    shuffled = data.draw(st.permutations(objects))
    first, second = snap(objects), snap(shuffled)
    assert second.services == first.services
    assert second.node == first.node
    assert second.rejections == first.rejections
    assert list(second.services) == list(first.services)
    assert renders(second, facts, options) == renders(first, facts, options)


# --- regressions found while writing the strategies ---------------------------------------------


def test_two_ports_of_a_service_never_share_a_port_or_node_port() -> None:
    """The API server rejects them (each pair would fight over one frontend, and the modes
    chose different winners: iptables the first port, nftables the last name)."""
    same_port = service("web", ports=[sport("a", 80), sport("b", 80)])
    same_node_port = service(
        "lb",
        svc_type="NodePort",
        ports=[sport("a", 80, node_port=30080), sport("b", 81, node_port=30080)],
    )
    other_protocol = service(
        "dns", ports=[sport("tcp", 53), sport("udp", 53, protocol="UDP")], cluster_ip="10.96.0.11"
    )
    s = snap([same_port, same_node_port, other_protocol])
    assert [str(r) for r in s.rejections] == [
        "Service ns/lb: spec.ports[1].nodePort: Duplicate value: 30080 (TCP)",
        "Service ns/web: spec.ports[1]: Duplicate value: port 80 (TCP)",
    ]
    assert sorted(str(n) for n in s.services) == ["ns/dns:tcp", "ns/dns:udp"]


# --- planners: partial syncs end where full ones do --------------------------------------------


@SYNCS
@given(HISTORIES, node_facts(), rule_options(), st.sampled_from(["nft", "legacy"]))
def test_iptables_partial_syncs_end_like_a_full_one(
    history: list[World], facts: NodeFacts, options: RuleOptions, flavour: str
) -> None:
    first, *rest = [snap(w) for w in history]
    partial, full = FakeXtables(), FakeXtables()
    plane = IptablesDataplane(partial.backend(flavour), facts, options)
    plane.sync(first, full=True)
    for s in rest:
        plane.sync(s, full=False)
    IptablesDataplane(full.backend(flavour), facts, options).sync(rest[-1], full=True)
    assert partial.save() == full.save()


def nft_plane(facts: NodeFacts, options: RuleOptions, clock: Clock) -> NftablesDataplane:
    return NftablesDataplane(facts, options, backend=NftFakeBackend(), clock=clock)


def nft_dump(plane: NftablesDataplane) -> list[str]:
    backend = plane.backend
    assert isinstance(backend, NftFakeBackend)
    return sort_dump(backend.table.dump())


@SYNCS
@given(HISTORIES, node_facts(), rule_options())
def test_nftables_partial_syncs_end_like_a_full_one(
    history: list[World], facts: NodeFacts, options: RuleOptions
) -> None:
    """The upstream layout (the fake table is `ip kube-proxy`; the compact layout's partial
    syncs are checked in a kernel by test_properties_kernel.py)."""
    first, *middle, after = [snap(w) for w in history]
    clock = Clock()
    partial, full, fresh = (nft_plane(facts, options, clock) for _ in range(3))
    for plane in (partial, full):
        plane.sync(first, full=True)
        for s in middle:
            plane.sync(s, full=False)
    partial.sync(after, full=False)
    full.sync(after, full=True)
    fresh.sync(after, full=True)
    assert nft_dump(partial) == nft_dump(full)
    # Once stale chains are due for deletion, nothing of `before` is left.
    clock.now += 3600
    partial.sync(after, full=False)
    assert nft_dump(partial) == nft_dump(fresh)


@SYNCS
@given(HISTORIES, node_facts(), rule_options())
def test_nftables_partial_syncs_of_one_tracker_end_like_a_full_one(
    history: list[World], facts: NodeFacts, options: RuleOptions
) -> None:
    """Snapshots of one tracker say what changed, and the planner visits only that: the
    partial syncs still end where a fresh full sync does (upstream layout, fake table)."""
    *before, after = tracked_snapshots(history, NODE)
    clock = Clock()
    partial, fresh = nft_plane(facts, options, clock), nft_plane(facts, options, clock)
    partial.sync(before[0], full=True)
    for s in [*before[1:], after]:
        partial.sync(s, full=False)
    fresh.sync(after, full=True)
    clock.now += 3600
    partial.sync(after, full=False)
    assert nft_dump(partial) == nft_dump(fresh)


@SYNCS
@given(HISTORIES, node_facts(), rule_options(), st.sampled_from(sorted(LAYOUTS)))
def test_nftables_plans_of_one_tracker_equal_a_fresh_plan(
    history: list[World], facts: NodeFacts, options: RuleOptions, layout: str
) -> None:
    """Either layout: planning a tracker's snapshots one after the other (each visiting only
    the ports that changed) gives the plan a fresh planner makes of the last one."""
    snapshots = tracked_snapshots(history, NODE)
    planner = make_planner(layout, facts, options)
    for s in snapshots:
        plan = planner.plan(s)
    fresh = make_planner(layout, facts, options).plan(snapshots[-1])
    assert plan.blocks == fresh.blocks
    assert plan.shared == fresh.shared
    assert plan.rules_total == fresh.rules_total


def ipvs_world(facts: NodeFacts, options: RuleOptions) -> tuple[IpvsDataplane, IpvsKernel]:
    kernel = IpvsKernel(FakeIpvs(), FakeDummy(), FakeIpset(), FakeXtables())
    plane = IpvsDataplane(
        kernel.iptables.backend("legacy"),
        facts,
        options,
        ipvs=kernel.ipvs,  # type: ignore[arg-type]
        ipset=kernel.ipset,  # type: ignore[arg-type]
        dummy=kernel.dummy,  # type: ignore[arg-type]
        clock=Clock(),
    )
    return plane, kernel


@SYNCS
@given(HISTORIES, node_facts(), rule_options())
def test_ipvs_partial_syncs_end_like_a_full_one(
    history: list[World], facts: NodeFacts, options: RuleOptions
) -> None:
    first, *middle, after = [snap(w) for w in history]
    (partial, partial_kernel), (full, full_kernel) = (ipvs_world(facts, options) for _ in range(2))
    for plane in (partial, full):
        plane.sync(first, full=True)
        for s in middle:
            plane.sync(s, full=False)
    partial.sync(after, full=False)
    full.sync(after, full=True)
    assert partial_kernel.state() == full_kernel.state()
