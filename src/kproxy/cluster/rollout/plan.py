"""Plan a rollout: which nodes switch in which batch, in which order, and what stands in the way.

Pure: Node objects, the spec and the nodes' preflight answers in, a Plan out. `kproxy rollout
plan` prints it, `start` stores its node order in the rollout's status (the controller never
re-plans a running rollout), and its fingerprint tells `start` whether the plan an operator
was shown still holds.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

from kproxy.cluster.annotations import CURRENT_MODE, annotations_of
from kproxy.cluster.rollout.spec import RolloutSpec, resolve

ZONE_LABELS = ("topology.kubernetes.io/zone", "failure-domain.beta.kubernetes.io/zone")
# What one node's switch is assumed to take when nothing better is known.
DEFAULT_SWITCH_ESTIMATE = 60.0


@dataclass(frozen=True)
class NodeInfo:
    """What the planner and the controller read off a Node object."""

    name: str
    labels: dict[str, str]
    zone: str
    ready: bool
    mode: str | None  # the mode its kproxy reports serving; None: no kproxy reports here
    annotations: dict[str, str]

    @classmethod
    def of(cls, node: dict[str, Any]) -> NodeInfo:
        meta = node.get("metadata") or {}
        labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
        annotations = annotations_of(node)
        zone = next((labels[k] for k in ZONE_LABELS if labels.get(k)), "")
        return cls(
            name=str(meta.get("name", "")),
            labels=labels,
            zone=zone,
            ready=is_ready(node),
            mode=annotations.get(CURRENT_MODE) or None,
            annotations=annotations,
        )


def is_ready(node: dict[str, Any]) -> bool:
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(
        isinstance(c, dict) and c.get("type") == "Ready" and c.get("status") == "True"
        for c in conditions
    )


@dataclass(frozen=True)
class PreflightAnswer:
    """A node's own preflight of the switch to the target mode."""

    ok: bool
    blocks: tuple[str, ...] = ()  # the blocking findings, one line each
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class Batch:
    stage: int  # 1-based
    amount: str  # the stage's cumulative amount as written ("1", "50%")
    nodes: tuple[str, ...]
    parallel: int
    soak: float

    @property
    def waves(self) -> int:
        return math.ceil(len(self.nodes) / self.parallel) if self.nodes else 0


@dataclass(frozen=True)
class Skipped:
    node: str
    reason: str


@dataclass
class Plan:
    target: str
    selector: str
    batches: list[Batch]
    already: list[str]  # selected nodes already serving the target mode
    skipped: list[Skipped]
    blockers: list[str]
    warnings: list[str]
    previous: dict[str, str]  # node -> the mode it serves now (where it goes back)
    zones: dict[str, str]
    estimated_seconds: float
    fingerprint: str
    preflight: dict[str, PreflightAnswer] = field(default_factory=dict)
    targets: dict[str, str] = field(default_factory=dict)  # where a node's target differs

    @property
    def node_count(self) -> int:
        return sum(len(b.nodes) for b in self.batches)

    def to_json(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "selector": self.selector,
            "fingerprint": self.fingerprint,
            "estimatedSeconds": round(self.estimated_seconds),
            "batches": [
                {
                    "stage": b.stage,
                    "amount": b.amount,
                    "parallel": b.parallel,
                    "soakSeconds": b.soak,
                    "nodes": [
                        {
                            "name": n,
                            "zone": self.zones.get(n, ""),
                            "from": self.previous[n],
                            "to": self.targets.get(n, self.target),
                        }
                        for n in b.nodes
                    ],
                }
                for b in self.batches
            ],
            "already": self.already,
            "skipped": [{"node": s.node, "reason": s.reason} for s in self.skipped],
            "blockers": self.blockers,
            "warnings": self.warnings,
            "preflight": {
                n: {"ok": a.ok, "blocks": list(a.blocks), "warnings": list(a.warnings)}
                for n, a in sorted(self.preflight.items())
            },
        }


def spread_by_zone(nodes: list[NodeInfo]) -> list[NodeInfo]:
    """Nodes in an order that takes one from each zone in turn (zones and nodes by name), so
    every stage, the canary's included, spreads over the zones as evenly as it can."""
    zones: dict[str, list[NodeInfo]] = {}
    for n in sorted(nodes, key=lambda n: n.name):
        zones.setdefault(n.zone, []).append(n)
    queues = [zones[z] for z in sorted(zones)]
    out: list[NodeInfo] = []
    for i in range(max((len(q) for q in queues), default=0)):
        out.extend(q[i] for q in queues if i < len(q))
    return out


def stage_batches(spec: RolloutSpec, ordered: list[NodeInfo]) -> list[Batch]:
    """The nodes, in order, cut into the stages' batches (each stage's amount cumulative)."""
    batches: list[Batch] = []
    done = 0
    for number, stage in enumerate(spec.stages, start=1):
        upto = max(done, resolve(stage.nodes, len(ordered)))
        members = tuple(n.name for n in ordered[done:upto])
        parallel = max(1, resolve(stage.max_parallel, len(members) or 1))
        batches.append(Batch(number, stage.nodes, members, parallel, spec.soak_of(stage)))
        done = upto
    return batches


def estimate_seconds(batches: list[Batch], switch_estimate: float) -> float:
    return sum(b.waves * switch_estimate + (b.soak if b.nodes else 0) for b in batches)


def fingerprint(spec: RolloutSpec, nodes: list[NodeInfo]) -> str:
    """Changes when anything the plan was made from changes: the spec, which nodes exist,
    their modes, readiness and zones (not their resourceVersion: status writes move it)."""
    facts = {
        "spec": spec.to_json(),
        "nodes": sorted([n.name, n.mode, n.ready, n.zone, n.labels] for n in nodes),
    }
    digest = hashlib.sha256(json.dumps(facts, sort_keys=True).encode())
    return digest.hexdigest()[:16]


def make_plan(
    spec: RolloutSpec,
    nodes: list[dict[str, Any]],
    *,
    preflight: dict[str, PreflightAnswer] | None = None,
    switch_estimate: float = DEFAULT_SWITCH_ESTIMATE,
) -> Plan:
    infos = [NodeInfo.of(n) for n in nodes]
    selected = [n for n in infos if spec.node_selector.matches(n.labels)]
    answers = preflight or {}
    blockers: list[str] = []
    warnings: list[str] = []
    skipped: list[Skipped] = []
    already: list[str] = []
    todo: list[NodeInfo] = []
    selector = spec.node_selector.describe() or "every node"
    if not selected:
        blockers.append(f"no node matches the selector ({selector})")
    for n in selected:
        if n.mode is None:
            blockers.append(
                f"{n.name}: no kproxy reports on this node ({CURRENT_MODE} is not set): "
                "deploy kproxy there or leave the node out with the selector"
            )
        elif n.mode == spec.target_mode:
            already.append(n.name)
        else:
            if not n.ready:
                warnings.append(f"{n.name}: NotReady now; the rollout waits for it in its turn")
            answer = answers.get(n.name)
            if answer is not None and not answer.ok:
                why = "; ".join(answer.blocks) or "preflight blocks the switch"
                if spec.preflight.on_block == "Skip":
                    skipped.append(Skipped(n.name, f"preflight: {why}"))
                    continue
                blockers.append(f"{n.name}: preflight blocks the switch (onBlock HaltStage): {why}")
            todo.append(n)
    batches = stage_batches(spec, spread_by_zone(todo))
    estimate = estimate_seconds(batches, switch_estimate)
    return Plan(
        target=spec.target_mode,
        selector=selector,
        batches=batches,
        already=sorted(already),
        skipped=skipped,
        blockers=blockers,
        warnings=warnings,
        previous={n.name: n.mode or "" for n in todo},
        zones={n.name: n.zone for n in selected},
        estimated_seconds=estimate,
        fingerprint=fingerprint(spec, infos),
        preflight=dict(answers),
    )


def make_undo_plan(
    spec: RolloutSpec,
    undone: Any,
    nodes: list[dict[str, Any]],
    *,
    switch_estimate: float = DEFAULT_SWITCH_ESTIMATE,
) -> Plan:
    """The plan of an undo: every node the undone rollout moved (`undone`, its status) goes
    back to the mode it served before, in the undo's own stages."""
    from kproxy.cluster.rollout import status as st

    moved = {n.name: n for n in undone.nodes if n.state in (st.SWITCHED, st.DONE)}
    infos = {i.name: i for i in map(NodeInfo.of, nodes)}
    blockers = [f"{name}: the Node no longer exists" for name in moved if name not in infos]
    todo = [infos[name] for name in moved if name in infos]
    if not moved:
        blockers.append("the rollout undone moved no node")
    batches = stage_batches(spec, spread_by_zone(todo))
    estimate = estimate_seconds(batches, switch_estimate)
    return Plan(
        target=spec.target_mode,
        selector=f"the nodes {spec.undo_of} moved",
        batches=batches,
        already=[],
        skipped=[],
        blockers=blockers,
        warnings=[f"{n.name}: NotReady now" for n in todo if not n.ready],
        previous={n.name: n.mode or "" for n in todo},
        zones={n.name: n.zone for n in todo},
        estimated_seconds=estimate,
        fingerprint=fingerprint(spec, list(infos.values())),
        targets={name: moved[name].previous_mode for name in moved if name in infos},
    )
