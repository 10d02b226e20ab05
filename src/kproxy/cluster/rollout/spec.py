"""The ProxyRollout object (proxy.kproxy.io/v1alpha1): what a cluster rollout of a mode is asked
to do, validated with errors that name the field.

A rollout moves the selected nodes to one proxy mode in stages. Each stage's node count is
cumulative over the nodes that need the switch ("1" is a one-node canary, "50%" half of them,
"100%" all); the nodes a stage adds form its batch, switched at most `maxParallel` at a time
and then watched for `soak`. Breakers watch the rollout all along; each has a scope (a node,
the current batch, the cluster) and an action.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from kproxy.config import format_duration, parse_duration
from kproxy.modes import MODES

GROUP = "proxy.kproxy.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "ProxyRollout"
PLURAL = "proxyrollouts"

DEFAULT_SOAK = 15 * 60.0
# The target of an undo: every node goes back to the mode it served before the rollout undone.
PREVIOUS = "previous"
WEEKDAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_AMOUNT = re.compile(r"^(?P<number>[0-9]+)(?P<percent>%?)$")
_CLOCK = re.compile(r"^(?P<h>[01][0-9]|2[0-3]):(?P<m>[0-5][0-9])$")


class RolloutSpecError(ValueError):
    """A ProxyRollout that cannot be run; the message names every bad field."""


def _duration(value: Any) -> Any:
    if isinstance(value, str):
        try:
            seconds = parse_duration(value)
        except ValueError as err:
            raise PydanticCustomError("duration", "{reason}", {"reason": str(err)}) from None
        if seconds < 0:
            raise PydanticCustomError("duration", "must not be negative")
        return seconds
    raise PydanticCustomError("duration_type", 'must be a duration string such as "15m"')


Duration = Annotated[
    float,
    BeforeValidator(_duration),
    PlainSerializer(format_duration, return_type=str, when_used="json"),
]


def _amount(value: Any) -> Any:
    text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(text, str) or not (m := _AMOUNT.match(text.strip())):
        raise PydanticCustomError(
            "amount", 'must be a node count or a percentage such as "1", "5%" or "100%"'
        )
    number = int(m["number"])
    if m["percent"] and not 0 < number <= 100:
        raise PydanticCustomError("amount", "a percentage must be between 1% and 100%")
    if not m["percent"] and number < 1:
        raise PydanticCustomError("amount", "a node count must be at least 1")
    return text.strip()


# "3" (nodes) or "25%" (of a whole), kept as written so the object round-trips.
Amount = Annotated[str, BeforeValidator(_amount)]


def resolve(amount: str, whole: int) -> int:
    """How many of `whole` an amount means: a count as given (at most the whole), a percentage
    rounded up, so "5%" of 10 nodes is one node, never none."""
    if amount.endswith("%"):
        return min(whole, math.ceil(whole * int(amount[:-1]) / 100))
    return min(whole, int(amount))


class _Part(BaseModel):
    model_config = ConfigDict(
        extra="forbid", frozen=True, validate_by_name=True, validate_by_alias=True
    )


class Stage(_Part):
    nodes: Amount
    max_parallel: Amount = Field("1", alias="maxParallel")
    soak: Duration | None = None  # None: the rollout's soak


class LabelRequirement(_Part):
    key: str
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _values_fit_the_operator(self) -> LabelRequirement:
        if self.operator in ("In", "NotIn") and not self.values:
            raise ValueError(f"operator {self.operator} needs values")
        if self.operator in ("Exists", "DoesNotExist") and self.values:
            raise ValueError(f"operator {self.operator} takes no values")
        return self


class NodeSelector(_Part):
    match_labels: dict[str, str] = Field(default_factory=dict, alias="matchLabels")
    match_expressions: tuple[LabelRequirement, ...] = Field((), alias="matchExpressions")

    def matches(self, labels: dict[str, str]) -> bool:
        if any(labels.get(k) != v for k, v in self.match_labels.items()):
            return False
        for req in self.match_expressions:
            has = req.key in labels
            if req.operator == "Exists" and not has:
                return False
            if req.operator == "DoesNotExist" and has:
                return False
            if req.operator == "In" and labels.get(req.key) not in req.values:
                return False
            if req.operator == "NotIn" and has and labels[req.key] in req.values:
                return False
        return True

    def describe(self) -> str:
        """kubectl's selector syntax: "zone=a,tier!=x" (empty: every node)."""
        parts = [f"{k}={v}" for k, v in sorted(self.match_labels.items())]
        for req in self.match_expressions:
            if req.operator == "Exists":
                parts.append(req.key)
            elif req.operator == "DoesNotExist":
                parts.append(f"!{req.key}")
            else:
                op = "in" if req.operator == "In" else "notin"
                parts.append(f"{req.key} {op} ({','.join(req.values)})")
        return ",".join(parts)


# Which signal a breaker reads, at which scope it may be used, and the action it takes when
# none is given. Node signals come from what each node's kproxy reports on its Node.
SIGNALS: dict[str, tuple[str, str]] = {
    "switchFailed": ("Node", "RollbackNode"),  # the node's switch failed or was rolled back
    "verifyFailed": ("Node", "RollbackNode"),  # the node's verify after its switch failed
    "syncP99Seconds": ("Node", "RollbackNode"),
    "syncFailures": ("Node", "RollbackNode"),  # failed syncs since the switch
    "healthzFailing": ("Node", "RollbackNode"),
    "failedNodes": ("Batch", "RollbackBatch"),  # nodes of the current batch that failed
    "notReadyNodes": ("Cluster", "Pause"),  # selected nodes NotReady
    "apiErrors": ("Cluster", "Pause"),  # consecutive failed API requests of the controller
}
ACTIONS = {
    "Node": ("RollbackNode", "MarkFailed"),
    "Batch": ("RollbackBatch", "Pause"),
    "Cluster": ("Pause",),
}


class Breaker(_Part):
    name: str = ""
    signal: str
    # An absolute limit ("2" failures, "25%" of a batch, 0.5 s of p99) ...
    threshold: str = "1"
    # ... or, for numeric node signals, a factor over the node's own value before its switch
    # (sync times differ by mode, so "3x its baseline" travels better than seconds).
    relative_to_baseline: float | None = Field(None, alias="relativeToBaseline", gt=0)
    # ... or a factor over the median of the nodes not switched yet (the canary against the
    # rest of the fleet, in the same hour and under the same load).
    relative_to_peers: float | None = Field(None, alias="relativeToPeers", gt=0)
    action: str = ""  # empty: the signal's default action

    @field_validator("signal")
    @classmethod
    def _known_signal(cls, value: str) -> str:
        if value not in SIGNALS:
            raise ValueError(f"unknown signal {value!r} (choose from {', '.join(SIGNALS)})")
        return value

    @model_validator(mode="after")
    def _action_fits_the_scope(self) -> Breaker:
        scope, default = SIGNALS[self.signal]
        action = self.action or default
        if action not in ACTIONS[scope]:
            raise ValueError(
                f"action {action!r} cannot follow a {scope.lower()}-scope signal "
                f"({self.signal}): choose from {', '.join(ACTIONS[scope])}"
            )
        if self.signal in ("failedNodes", "notReadyNodes"):
            _amount(self.threshold)
        else:
            try:
                limit = float(self.threshold)
            except ValueError:
                raise ValueError(f"threshold {self.threshold!r} is not a number") from None
            if limit < 0:
                raise ValueError("threshold must not be negative")
        relative = (self.relative_to_baseline, self.relative_to_peers)
        if any(r is not None for r in relative) and self.signal != "syncP99Seconds":
            raise ValueError("relativeToBaseline and relativeToPeers apply to syncP99Seconds only")
        return self

    @property
    def scope(self) -> str:
        return SIGNALS[self.signal][0]

    @property
    def effective_action(self) -> str:
        return self.action or SIGNALS[self.signal][1]

    @property
    def label(self) -> str:
        return self.name or self.signal


DEFAULT_BREAKERS = (
    Breaker(signal="switchFailed"),
    Breaker(signal="verifyFailed"),
    Breaker(signal="healthzFailing"),
    Breaker(signal="failedNodes", threshold="50%"),
    Breaker(signal="notReadyNodes", threshold="10%"),
    Breaker(signal="apiErrors", threshold="5"),
)


class MaintenanceWindow(_Part):
    days: tuple[str, ...] = WEEKDAYS
    start: str
    end: str  # before start: the window runs past midnight
    time_zone: str = Field("UTC", alias="timeZone")

    @field_validator("days")
    @classmethod
    def _weekdays(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        bad = [d for d in value if d not in WEEKDAYS]
        if bad:
            raise ValueError(f"unknown day {bad[0]!r} (use {', '.join(WEEKDAYS)})")
        return value

    @field_validator("start", "end")
    @classmethod
    def _clock(cls, value: str) -> str:
        if not _CLOCK.match(value):
            raise ValueError(f"{value!r} is not a time of day such as 22:00")
        return value

    @field_validator("time_zone")
    @classmethod
    def _zone(cls, value: str) -> str:
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown time zone {value!r}") from None
        return value


class Preflight(_Part):
    # A node whose preflight blocks the switch: skip it, or halt the stage (the rollout pauses).
    on_block: Literal["Skip", "HaltStage"] = Field("Skip", alias="onBlock")
    timeout: Duration = 120.0


class RolloutSpec(_Part):
    target_mode: str = Field(alias="targetMode")
    node_selector: NodeSelector = Field(default_factory=NodeSelector, alias="nodeSelector")
    stages: tuple[Stage, ...] = (Stage(nodes="1"), Stage(nodes="100%"))
    soak: Duration = DEFAULT_SOAK
    breakers: tuple[Breaker, ...] = DEFAULT_BREAKERS
    preflight: Preflight = Field(default_factory=Preflight)
    maintenance_windows: tuple[MaintenanceWindow, ...] = Field((), alias="maintenanceWindows")
    # How long one node's switch may take before it counts as failed.
    switch_timeout: Duration = Field(300.0, alias="switchTimeout")
    # The rollout this one undoes: the nodes it moved go back to their previous modes
    # (targetMode: previous).
    undo_of: str = Field("", alias="undoOf")

    @field_validator("target_mode")
    @classmethod
    def _mode(cls, value: str) -> str:
        if value not in (*MODES, PREVIOUS):
            raise ValueError(f"{value!r} is not a proxy mode (choose from {', '.join(MODES)})")
        return value

    @model_validator(mode="after")
    def _previous_only_for_an_undo(self) -> RolloutSpec:
        if (self.target_mode == PREVIOUS) != bool(self.undo_of):
            raise ValueError("targetMode: previous and undoOf go together (an undo of a rollout)")
        return self

    @field_validator("stages")
    @classmethod
    def _stages_grow_to_all(cls, value: tuple[Stage, ...]) -> tuple[Stage, ...]:
        if not value:
            raise ValueError("at least one stage is needed")
        if value[-1].nodes != "100%":
            raise ValueError('the last stage must cover every selected node: nodes: "100%"')
        percents = [int(s.nodes[:-1]) for s in value if s.nodes.endswith("%")]
        if percents != sorted(percents):
            raise ValueError("stage percentages must not decrease")
        return value

    def soak_of(self, stage: Stage) -> float:
        return self.soak if stage.soak is None else stage.soak

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True, exclude_defaults=True)


def parse_spec(spec: Any, *, where: str = "spec") -> RolloutSpec:
    """A ProxyRollout's spec from its JSON form; RolloutSpecError names each bad field."""
    if not isinstance(spec, dict):
        raise RolloutSpecError(f"{where}: must be a mapping, not {type(spec).__name__}")
    try:
        return RolloutSpec.model_validate(spec)
    except ValidationError as err:
        problems = []
        for e in err.errors():
            path = ".".join([where, *(str(p) for p in e["loc"])])
            problems.append(f"{path}: {e['msg'].removeprefix('Value error, ')}")
        raise RolloutSpecError("\n".join(problems)) from None
