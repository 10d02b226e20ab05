"""The rollout planner: Node objects and a ProxyRollout spec in, batches and blockers out."""

from __future__ import annotations

from typing import Any

import pytest

from kproxy.cluster.rollout.plan import PreflightAnswer, make_plan
from kproxy.cluster.rollout.spec import RolloutSpecError, parse_spec, resolve
from tests.support.rollout import node


def spec(**fields: Any) -> Any:
    return parse_spec({"targetMode": "nftables", **fields})


def names(plan: Any) -> list[list[str]]:
    return [list(b.nodes) for b in plan.batches]


@pytest.mark.parametrize(
    ("amount", "whole", "count"),
    [("1", 10, 1), ("5%", 10, 1), ("50%", 4, 2), ("50%", 5, 3), ("100%", 7, 7), ("3", 2, 2)],
)
def test_amounts_resolve_up_and_never_past_the_whole(amount: str, whole: int, count: int) -> None:
    assert resolve(amount, whole) == count


def test_stages_are_cumulative_and_the_canary_comes_first() -> None:
    nodes = [node(f"n{i}") for i in range(1, 5)]
    plan = make_plan(
        spec(stages=[{"nodes": "1"}, {"nodes": "50%"}, {"nodes": "100%", "maxParallel": "2"}]),
        nodes,
    )
    assert names(plan) == [["n1"], ["n2"], ["n3", "n4"]]
    assert [b.parallel for b in plan.batches] == [1, 1, 2]
    assert plan.previous == {n: "iptables" for n in ("n1", "n2", "n3", "n4")}
    assert not plan.blockers


def test_nodes_spread_over_zones_in_every_stage() -> None:
    nodes = [node("a1", zone="a"), node("a2", zone="a"), node("b1", zone="b"), node("c1", zone="c")]
    plan = make_plan(spec(stages=[{"nodes": "1"}, {"nodes": "75%"}, {"nodes": "100%"}]), nodes)
    assert names(plan) == [["a1"], ["b1", "c1"], ["a2"]]


def test_selector_nodes_already_in_the_target_and_nodes_without_kproxy() -> None:
    nodes = [
        node("n1", pool="x"),
        node("n2", "nftables", pool="x"),
        node("n3", None, pool="x"),
        node("n4", pool="y"),
    ]
    plan = make_plan(spec(nodeSelector={"matchLabels": {"pool": "x"}}), nodes)
    assert plan.already == ["n2"]
    assert names(plan) == [["n1"], []]
    assert len(plan.blockers) == 1 and plan.blockers[0].startswith("n3: no kproxy reports")
    assert "n4" not in plan.zones


def test_a_preflight_block_skips_the_node_or_blocks_the_plan() -> None:
    nodes = [node("n1"), node("n2")]
    answers = {"n2": PreflightAnswer(False, ("mode.nft-missing: nft is not installed",))}
    skipping = make_plan(spec(), nodes, preflight=answers)
    assert names(skipping) == [["n1"], []]
    assert [s.node for s in skipping.skipped] == ["n2"]
    assert "nft is not installed" in skipping.skipped[0].reason
    halting = make_plan(spec(preflight={"onBlock": "HaltStage"}), nodes, preflight=answers)
    assert names(halting) == [["n1"], ["n2"]]
    assert any("n2: preflight blocks" in b for b in halting.blockers)


def test_estimate_counts_waves_and_soaks_of_non_empty_batches() -> None:
    nodes = [node(f"n{i}") for i in range(1, 6)]
    plan = make_plan(
        spec(soak="10m", stages=[{"nodes": "1"}, {"nodes": "100%", "maxParallel": "50%"}]),
        nodes,
        switch_estimate=30,
    )
    # canary: 1 wave + soak; then 4 nodes 2 at a time: 2 waves + soak
    assert plan.estimated_seconds == 30 + 600 + 2 * 30 + 600


def test_fingerprint_follows_what_the_plan_was_made_from() -> None:
    base = make_plan(spec(), [node("n1"), node("n2")]).fingerprint
    assert make_plan(spec(), [node("n2"), node("n1")]).fingerprint == base
    assert make_plan(spec(), [node("n1"), node("n2", "nftables")]).fingerprint != base
    assert make_plan(spec(), [node("n1"), node("n2"), node("n3")]).fingerprint != base
    assert make_plan(spec(soak="1m"), [node("n1"), node("n2")]).fingerprint != base


def test_no_selected_node_is_a_blocker() -> None:
    plan = make_plan(spec(nodeSelector={"matchLabels": {"pool": "none"}}), [node("n1")])
    assert plan.blockers == ["no node matches the selector (pool=none)"]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"targetMode": "ipvss"}, "spec.targetMode: 'ipvss' is not a proxy mode"),
        ({"stages": [{"nodes": "1"}]}, "spec.stages: the last stage must cover every"),
        ({"stages": [{"nodes": "0"}, {"nodes": "100%"}]}, "spec.stages.0.nodes: a node count"),
        ({"stages": [{"nodes": "150%"}]}, "spec.stages.0.nodes: a percentage must be"),
        ({"soak": "15 minutes"}, "spec.soak: unknown unit"),
        ({"soak": 900}, 'spec.soak: must be a duration string such as "15m"'),
        ({"breakers": [{"signal": "cpu"}]}, "spec.breakers.0.signal: unknown signal 'cpu'"),
        (
            {"breakers": [{"signal": "notReadyNodes", "action": "RollbackNode"}]},
            "spec.breakers.0: action 'RollbackNode' cannot follow a cluster-scope signal",
        ),
        (
            {"maintenanceWindows": [{"start": "25:00", "end": "04:00"}]},
            "spec.maintenanceWindows.0.start: '25:00' is not a time of day",
        ),
        (
            {"maintenanceWindows": [{"start": "22:00", "end": "04:00", "timeZone": "Mars/Base"}]},
            "spec.maintenanceWindows.0.timeZone: unknown time zone 'Mars/Base'",
        ),
        ({"stages": [{"nodes": "1", "maxparallel": "2"}, {"nodes": "100%"}]}, "maxparallel"),
    ],
)
def test_spec_errors_name_the_field(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(RolloutSpecError) as err:
        parse_spec({"targetMode": "nftables", **fields})
    assert message in str(err.value)


def test_spec_round_trips_through_its_json_form() -> None:
    written = {
        "targetMode": "ipvs",
        "nodeSelector": {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["x"]}]},
        "stages": [{"nodes": "1", "soak": "5m"}, {"nodes": "100%", "maxParallel": "25%"}],
        "soak": "30m",
        "breakers": [{"signal": "syncP99Seconds", "threshold": "2", "relativeToBaseline": 3.0}],
        "maintenanceWindows": [
            {"days": ["Sat", "Sun"], "start": "22:00", "end": "04:00", "timeZone": "Europe/Berlin"}
        ],
    }
    parsed = parse_spec(written)
    assert parse_spec(parsed.to_json()) == parsed
    assert parsed.to_json()["stages"][0]["soak"] == "5m0s"
    assert parsed.node_selector.describe() == "pool in (x)"


def test_the_crd_schema_names_the_fields_and_choices_of_the_spec_model() -> None:
    """deploy/rollout/crd.yaml is kubectl's first check; the model is the one that counts:
    the two must name the same fields and the same choices."""
    from pathlib import Path

    import yaml

    from kproxy.cluster.rollout import spec as model
    from kproxy.modes import MODES

    crd = yaml.safe_load(
        (Path(__file__).resolve().parent.parent / "deploy/rollout/crd.yaml").read_text()
    )
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]

    def fields(cls: type) -> set[str]:
        return {f.alias or name for name, f in cls.model_fields.items()}

    props = schema["properties"]
    assert set(props) == fields(model.RolloutSpec)
    assert set(props["stages"]["items"]["properties"]) == fields(model.Stage)
    assert set(props["breakers"]["items"]["properties"]) == fields(model.Breaker)
    assert set(props["preflight"]["properties"]) == fields(model.Preflight)
    assert set(props["nodeSelector"]["properties"]) == fields(model.NodeSelector)
    window = props["maintenanceWindows"]["items"]["properties"]
    assert set(window) == fields(model.MaintenanceWindow)
    assert tuple(props["targetMode"]["enum"]) == (*MODES, model.PREVIOUS)
    assert tuple(props["breakers"]["items"]["properties"]["signal"]["enum"]) == tuple(model.SIGNALS)
    actions = {a for scoped in model.ACTIONS.values() for a in scoped}
    assert set(props["breakers"]["items"]["properties"]["action"]["enum"]) == actions
    assert tuple(window["days"]["items"]["enum"]) == model.WEEKDAYS
    assert crd["spec"]["group"] == model.GROUP and crd["spec"]["names"]["kind"] == model.KIND
