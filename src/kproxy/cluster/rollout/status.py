"""A ProxyRollout's status: everything the controller knows, so a restarted controller goes
on from the object and the Nodes alone.

The status holds the plan's node order (each node's stage and the mode it goes back to), each
node's progress, the breakers' last readings and the conditions. It is written only by the
controller; operators' requests (pause, resume, abort) arrive as an annotation on the object.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

# Rollout phases.
PLANNED = "Planned"
PROGRESSING = "Progressing"
SOAKING = "Soaking"
PAUSED = "Paused"
ROLLING_BACK = "RollingBack"
SUCCEEDED = "Succeeded"
FAILED = "Failed"
TERMINAL = (SUCCEEDED, FAILED)

# Node states.
PENDING = "Pending"  # waits for its turn
PREFLIGHT = "Preflight"  # asked to check the switch on itself
SWITCHING = "Switching"  # its declared mode is the target; the switch runs
SWITCHED = "Switched"  # serves the target; its batch soaks
DONE = "Done"  # its batch soaked without a trip
SKIPPED = "Skipped"  # its preflight blocked the switch (onBlock: Skip)
BLOCKED = "Blocked"  # its preflight blocked the switch (onBlock: HaltStage); retried on resume
ROLLING_BACK_NODE = "RollingBack"  # its declared mode is its previous mode again
ROLLED_BACK = "RolledBack"  # serves its previous mode again after a trip or an abort
FAILED_NODE = "Failed"  # tripped and left as it is (MarkFailed), or its rollback failed
IN_FLIGHT = (PREFLIGHT, SWITCHING, ROLLING_BACK_NODE)
SETTLED = (SWITCHED, DONE, SKIPPED, ROLLED_BACK, FAILED_NODE)
TRIPPED_STATES = (ROLLING_BACK_NODE, ROLLED_BACK, FAILED_NODE)


def stamp(now: float) -> str:
    """RFC 3339 in UTC, to the second, as Kubernetes writes times."""
    return datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_stamp(text: str) -> float | None:
    if not text:
        return None
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()
    except ValueError:
        return None


class _Part(BaseModel):
    model_config = ConfigDict(extra="ignore", validate_by_name=True, validate_by_alias=True)

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True, exclude_defaults=True)


class NodeProgress(_Part):
    name: str
    stage: int  # 1-based
    previous_mode: str = Field(alias="previousMode")
    target_mode: str = Field("", alias="targetMode")  # "": the spec's (an undo's differ)
    state: str  # always written: a status without it would read as nothing at all
    since: str = ""  # when the node entered its state
    attempt: int = 0  # numbers the node's preflight requests
    reason: str = ""  # why it is Skipped / Blocked / rolled back or failed
    last_error: str = Field("", alias="lastError")  # the node's own report of its last switch
    baseline_p99: float | None = Field(None, alias="baselineP99")  # before its switch
    verify: str = ""  # the node's last verify summary


class BreakerReading(_Part):
    name: str
    scope: str
    value: float | None = None
    threshold: str = ""
    tripped: bool = False
    tripped_at: str = Field("", alias="trippedAt")
    node: str = ""  # node-scope readings: the node that tripped
    message: str = ""


class Condition(_Part):
    type: str
    status: str  # "True" / "False"
    reason: str = ""
    message: str = ""
    last_transition_time: str = Field("", alias="lastTransitionTime")


class RolloutStatus(_Part):
    phase: str = PLANNED
    stage: int = 0  # the stage under way, 1-based; 0 before the first
    nodes_done: int = Field(0, alias="nodesDone")
    nodes_total: int = Field(0, alias="nodesTotal")
    plan_fingerprint: str = Field("", alias="planFingerprint")
    stage_soak_since: str = Field("", alias="stageSoakSince")
    paused_reason: str = Field("", alias="pausedReason")
    handled_request: str = Field("", alias="handledRequest")
    resumed_at: str = Field("", alias="resumedAt")  # trips before it are acknowledged
    abort: str = ""  # none, batch or all once aborted
    message: str = ""
    nodes: list[NodeProgress] = Field(default_factory=list)
    breakers: list[BreakerReading] = Field(default_factory=list)
    conditions: list[Condition] = Field(default_factory=list)

    @classmethod
    def of(cls, obj: dict[str, Any]) -> RolloutStatus | None:
        """The status of a ProxyRollout object; None before the controller planned it."""
        raw = obj.get("status")
        if not isinstance(raw, dict) or (not raw.get("nodes") and not raw.get("phase")):
            return None
        return cls.model_validate(raw)

    def node(self, name: str) -> NodeProgress:
        return next(n for n in self.nodes if n.name == name)

    def stage_nodes(self, stage: int) -> list[NodeProgress]:
        return [n for n in self.nodes if n.stage == stage]

    def set_condition(
        self, type_: str, ok: bool, reason: str, message: str, now: float | None = None
    ) -> None:
        status = "True" if ok else "False"
        for c in self.conditions:
            if c.type == type_:
                if c.status != status:
                    c.last_transition_time = stamp(now or time.time())
                c.status, c.reason, c.message = status, reason, message
                return
        self.conditions.append(
            Condition(
                type=type_,
                status=status,
                reason=reason,
                message=message,
                lastTransitionTime=stamp(now or time.time()),
            )
        )
