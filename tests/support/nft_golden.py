"""Upstream kube-proxy's nftables test data (tests/golden/nftables/): its fixture's node facts,
rule options and objects, as the compat and kernel tests of nftables mode feed them to kproxy."""

from __future__ import annotations

import copy
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from kproxy.dataplane.facts import NodeFacts, RuleOptions
from kproxy.model.objects import Snapshot
from kproxy.model.snapshot import snapshot_from_objects

GOLDEN = Path(__file__).parent.parent / "golden" / "nftables"


@cache
def golden_yaml(name: str) -> Any:
    return yaml.safe_load((GOLDEN / name).read_text())


def fixture() -> dict[str, Any]:
    return golden_yaml("fixture.yaml")


def facts() -> NodeFacts:
    f = fixture()["facts"]
    return NodeFacts(node_ips=tuple(f["node_ips"]), local_addresses=tuple(f["local_addresses"]))


def options(**overrides: Any) -> RuleOptions:
    o = {**fixture()["options"], **overrides}
    return RuleOptions(
        masquerade_all=bool(o["masquerade_all"]),
        masquerade_bit=int(o["masquerade_bit"]),
        detect_local_mode=o["detect_local_mode"],
        cluster_cidrs=tuple(o["cluster_cidrs"]),
        node_port_addresses=tuple(o["node_port_addresses"]),
    )


def snapshot(objects: list[dict[str, Any]]) -> Snapshot:
    return snapshot_from_objects(copy.deepcopy(objects), fixture()["node_name"])


def flow_cases() -> list[dict[str, Any]]:
    return golden_yaml("flows.yaml")["cases"]
