"""One step of the rollout controller, pure: the object and the Nodes in, what to write out.

The controller (controller.py) reads the ProxyRollout and the Nodes, calls `reconcile`, and
writes back the new status, the node annotations and the Events it returns. Everything the
step needs is in its arguments, so a controller that crashed and restarted takes the same
decision from the same objects: no node is switched twice, none is forgotten.

Per node: Pending -> Preflight (the node checks the switch on itself and answers) -> Switching
(its declared mode is the target; its kproxy switches live) -> Switched -> Done once its
batch soaked. A tripped node breaker sends the node back (RollingBack -> RolledBack) or marks
it Failed; a batch breaker sends the whole batch back and pauses; a cluster breaker pauses.
A switch under way is never interrupted: rollbacks and pauses act once it is over.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

from kproxy.cluster.annotations import (
    LAST_ERROR,
    LAST_ROLLOUT,
    MODE_ANNOTATION,
    OBSERVED,
    PREFLIGHT_REQUEST,
    PREFLIGHT_RESULT,
    PREVIOUS_MODE,
    ROLLOUT,
    SWITCH_STATE,
    SWITCH_TARGET,
    VERIFY,
    json_annotation,
)
from kproxy.cluster.rollout import status as st
from kproxy.cluster.rollout.plan import NodeInfo, Plan
from kproxy.cluster.rollout.spec import WEEKDAYS, Breaker, MaintenanceWindow, RolloutSpec, resolve
from kproxy.text import one_line


@dataclass(frozen=True)
class VerifyReport:
    """A node's verify of its running proxy, as its kproxy publishes it during a rollout."""

    at: float
    ok: bool
    sync_p99: float | None
    failures: float
    healthz: bool
    summary: str

    def short(self) -> str:
        """For the status table: "ok, p99 0.042 s, 0 failures"."""
        p99 = "n/a" if self.sync_p99 is None else f"{self.sync_p99:.3f} s"
        head = "ok" if self.ok else self.summary.split(":", 1)[0]
        return f"{head}, p99 {p99}, {self.failures:.0f} failures"

    @classmethod
    def parse(cls, text: str | None) -> VerifyReport | None:
        data = json_annotation(text)
        if data is None:
            return None
        p99 = data.get("syncP99")
        return cls(
            at=float(data.get("at") or 0),
            ok=bool(data.get("ok")),
            sync_p99=float(p99) if isinstance(p99, int | float) else None,
            failures=float(data.get("failures") or 0),
            healthz=data.get("healthz") is not False,
            summary=str(data.get("summary", ""))[:300],
        )


@dataclass(frozen=True)
class NodeReport:
    """What a node's kproxy says on its Node."""

    info: NodeInfo
    declared: str | None
    observed: str
    switch_state: str
    switch_target: str
    last_error: str
    preflight: dict[str, Any] | None
    verify: VerifyReport | None

    @classmethod
    def of(cls, node: dict[str, Any]) -> NodeReport:
        info = NodeInfo.of(node)
        ann = info.annotations
        # Free text anyone who may annotate the Node can write; it reaches the rollout's
        # status and Events, so one line each.
        return cls(
            info=info,
            declared=ann.get(MODE_ANNOTATION),
            observed=one_line(ann.get(OBSERVED, ""), limit=63),
            switch_state=one_line(ann.get(SWITCH_STATE, ""), limit=63),
            switch_target=one_line(ann.get(SWITCH_TARGET, ""), limit=63),
            last_error=one_line(ann.get(LAST_ERROR, ""), limit=1000),
            preflight=json_annotation(ann.get(PREFLIGHT_RESULT)),
            verify=VerifyReport.parse(ann.get(VERIFY)),
        )


@dataclass(frozen=True)
class Request:
    """An operator's request, from the rollout's annotation: "ID VERB[:ARG]"."""

    id: str
    verb: str  # pause, resume, abort
    arg: str = ""

    @classmethod
    def parse(cls, text: str | None) -> Request | None:
        if not text or " " not in text:
            return None
        ident, _, what = text.partition(" ")
        verb, _, arg = what.strip().partition(":")
        return cls(ident, verb, arg)

    def __str__(self) -> str:
        return f"{self.id} {self.verb}" + (f":{self.arg}" if self.arg else "")


@dataclass(frozen=True)
class NodePatch:
    node: str
    annotations: dict[str, str | None]  # None removes the annotation (merge patch)


@dataclass(frozen=True)
class Event:
    kind: str  # "ProxyRollout" or "Node"
    name: str
    reason: str
    message: str
    warning: bool = False


@dataclass
class Step:
    status: st.RolloutStatus
    patches: list[NodePatch] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)


def initial_status(plan: Plan, now: float) -> st.RolloutStatus:
    """The status a rollout starts from: the plan's node order, frozen."""
    nodes = [
        st.NodeProgress(
            name=n,
            stage=b.stage,
            previousMode=plan.previous[n],
            targetMode=plan.targets.get(n, ""),
            state=st.PENDING,
        )
        for b in plan.batches
        for n in b.nodes
    ]
    for s in plan.skipped:
        nodes.append(
            st.NodeProgress(
                name=s.node,
                stage=0,
                previousMode="",
                state=st.SKIPPED,
                reason=s.reason,
                since=st.stamp(now),
            )
        )
    status = st.RolloutStatus(planFingerprint=plan.fingerprint, nodes=nodes)
    status.nodes_total = len(nodes)
    return status


def in_window(windows: tuple[MaintenanceWindow, ...], now: float) -> bool:
    """May new nodes start switching now? Always, when no window is set."""
    if not windows:
        return True
    for w in windows:
        local = datetime.fromtimestamp(now, ZoneInfo(w.time_zone))
        minute = local.hour * 60 + local.minute
        start = int(w.start[:2]) * 60 + int(w.start[3:])
        end = int(w.end[:2]) * 60 + int(w.end[3:])
        today = WEEKDAYS[local.weekday()]
        yesterday = WEEKDAYS[(local.weekday() - 1) % 7]
        if start <= end:
            if today in w.days and start <= minute < end:
                return True
        elif (today in w.days and minute >= start) or (yesterday in w.days and minute < end):
            return True  # a window past midnight belongs to the day it starts
    return False


def reconcile(
    name: str,
    spec: RolloutSpec,
    status: st.RolloutStatus,
    nodes: list[dict[str, Any]],
    now: float,
    *,
    request: Request | None = None,
    api_errors: int = 0,
) -> Step:
    """The next status of rollout `name`, and what to write to get there."""
    step = _Reconciler(name, spec, status.model_copy(deep=True), nodes, now, api_errors)
    step.run(request)
    return step.out


class _Reconciler:
    def __init__(
        self,
        name: str,
        spec: RolloutSpec,
        status: st.RolloutStatus,
        nodes: list[dict[str, Any]],
        now: float,
        api_errors: int,
    ) -> None:
        self.name = name
        self.spec = spec
        self.status = status
        self.reports = {r.info.name: r for r in map(NodeReport.of, nodes)}
        self.now = now
        self.api_errors = api_errors
        self.out = Step(status)
        self.readings = {(b.name, b.node): b for b in status.breakers}

    # --- outputs --------------------------------------------------------------------------------

    def patch(self, node: str, annotations: dict[str, str | None]) -> None:
        self.out.patches.append(NodePatch(node, annotations))

    def event(self, reason: str, message: str, *, node: str = "", warning: bool = False) -> None:
        self.out.events.append(Event("ProxyRollout", self.name, reason, message, warning))
        if node:
            self.out.events.append(Event("Node", node, reason, message, warning))

    def enter(self, n: st.NodeProgress, state: str, reason: str = "") -> None:
        n.state, n.since = state, st.stamp(self.now)
        if reason:
            n.reason = reason

    def age(self, n: st.NodeProgress) -> float:
        since = st.parse_stamp(n.since)
        return 0.0 if since is None else self.now - since

    # --- the step -------------------------------------------------------------------------------

    def run(self, request: Request | None) -> None:
        if self.status.phase in st.TERMINAL:
            if request is not None and str(request) != self.status.handled_request:
                self.status.handled_request = str(request)
                self.status.message = f"{request.verb}: the rollout has already finished"
            return
        for n in self.status.nodes:
            self.follow(n)
        if request is not None and str(request) != self.status.handled_request:
            self.handle(request)
        if self.status.phase in (st.PLANNED, st.PROGRESSING, st.SOAKING):
            self.check_breakers()
        self.advance()
        done = sum(1 for n in self.status.nodes if n.state in (st.SWITCHED, st.DONE))
        self.status.nodes_done = done
        self.status.breakers = sorted(self.readings.values(), key=lambda b: (b.scope, b.name))

    # --- following each node's own reports ------------------------------------------------------

    def follow(self, n: st.NodeProgress) -> None:
        report = self.reports.get(n.name)
        if n.state in (st.PENDING, st.PREFLIGHT, st.SWITCHING, st.BLOCKED) and report is None:
            self.enter(n, st.SKIPPED, "the Node no longer exists")
            self.event("NodeGone", f"{n.name}: the Node no longer exists; skipped")
            return
        if report is None:
            return
        if n.state == st.PREFLIGHT:
            self.follow_preflight(n, report)
        elif n.state == st.SWITCHING:
            self.follow_switch(n, report)
        elif n.state == st.ROLLING_BACK_NODE:
            self.follow_rollback(n, report)
        verify = report.verify
        switched_at = st.parse_stamp(n.since) or 0.0
        if verify is not None and n.state == st.SWITCHED and verify.at >= switched_at:
            n.verify = verify.short()

    def follow_preflight(self, n: st.NodeProgress, report: NodeReport) -> None:
        answer = report.preflight
        if answer is None or answer.get("id") != self.request_id(n):
            if self.age(n) > self.spec.preflight.timeout:
                self.preflight_blocked(
                    n,
                    f"no preflight answer within {self.spec.preflight.timeout:.0f} s "
                    "(is kproxy running there, following the API?)",
                )
            return
        baseline = answer.get("syncP99")
        if isinstance(baseline, int | float):
            n.baseline_p99 = float(baseline)
        if not answer.get("ok"):
            blocks = [str(b) for b in answer.get("blocks") or []]
            self.preflight_blocked(n, "; ".join(blocks) or "preflight blocks the switch")
            return
        self.patch(
            n.name,
            {MODE_ANNOTATION: self.target_of(n), PREFLIGHT_REQUEST: None},
        )
        self.enter(n, st.SWITCHING)
        self.event(
            "NodeSwitching",
            f"{n.name}: switching {n.previous_mode} -> {self.target_of(n)} (stage {n.stage})",
            node=n.name,
        )

    def preflight_blocked(self, n: st.NodeProgress, why: str) -> None:
        self.patch(n.name, {PREFLIGHT_REQUEST: None, ROLLOUT: None})
        if self.spec.preflight.on_block == "Skip":
            self.enter(n, st.SKIPPED, f"preflight: {why}")
            self.event("NodeSkipped", f"{n.name}: preflight: {why}", node=n.name, warning=True)
            return
        self.enter(n, st.BLOCKED, f"preflight: {why}")
        self.pause(f"preflight of {n.name} blocks the switch: {why}")
        self.event("NodeBlocked", f"{n.name}: preflight: {why}", node=n.name, warning=True)

    def follow_switch(self, n: st.NodeProgress, report: NodeReport) -> None:
        target = self.target_of(n)
        acted = report.observed == target and report.switch_target == target
        if acted and report.switch_state == "succeeded" and report.info.mode == target:
            n.last_error = ""
            self.enter(n, st.SWITCHED)
            self.event("NodeSwitched", f"{n.name}: serves {target}", node=n.name)
            if self.rollback_covers(n):  # its batch was sent back while it switched
                self.roll_back(n, self.status.paused_reason or "the batch is rolled back")
        elif acted and report.switch_state == "failed":
            n.last_error = report.last_error[:300]
            self.trip_node(n, self.breaker("switchFailed"), 1.0, report.last_error or "failed")
        elif self.age(n) > self.spec.switch_timeout:
            self.trip_node(
                n,
                self.breaker("switchFailed"),
                1.0,
                f"no switch report within {self.spec.switch_timeout:.0f} s",
            )

    def follow_rollback(self, n: st.NodeProgress, report: NodeReport) -> None:
        back = n.previous_mode
        if report.switch_state == "switching":
            return
        if report.observed == back and report.info.mode == back:
            self.enter(n, st.ROLLED_BACK)
            self.event("NodeRolledBack", f"{n.name}: serves {back} again", node=n.name)
        elif report.observed == back and report.switch_state == "failed":
            n.last_error = report.last_error[:300]
            self.enter(n, st.FAILED_NODE, f"rollback to {back} failed: {report.last_error}")
            self.pause(f"rollback of {n.name} to {back} failed: {report.last_error}")
            self.event("NodeRollbackFailed", n.reason, node=n.name, warning=True)
        elif self.age(n) > self.spec.switch_timeout:
            self.enter(
                n, st.FAILED_NODE, f"no rollback report within {self.spec.switch_timeout:.0f} s"
            )
            self.pause(f"{n.name}: {n.reason}")
            self.event("NodeRollbackFailed", f"{n.name}: {n.reason}", node=n.name, warning=True)

    # --- breakers -------------------------------------------------------------------------------

    def breaker(self, signal: str) -> Breaker | None:
        return next((b for b in self.spec.breakers if b.signal == signal), None)

    def reading(self, b: Breaker, node: str = "") -> st.BreakerReading:
        key = (b.label, node)
        if key not in self.readings:
            self.readings[key] = st.BreakerReading(
                name=b.label, scope=b.scope, node=node, threshold=b.threshold
            )
        return self.readings[key]

    def record(
        self, b: Breaker, value: float, tripped: bool, node: str = "", why: str = ""
    ) -> bool:
        """Keep the reading; True when this reading trips the breaker anew."""
        r = self.reading(b, node)
        r.value = value
        if tripped and not r.tripped:
            r.tripped, r.tripped_at, r.message = True, st.stamp(self.now), why
            return True
        return False

    def trip_node(self, n: st.NodeProgress, b: Breaker | None, value: float, why: str) -> None:
        """A node-scope trip: the node goes back to its previous mode, or is marked failed."""
        label = b.label if b is not None else "switchFailed"
        if b is not None:
            self.record(b, value, True, n.name, why)
        if b is not None and b.effective_action == "MarkFailed":
            self.enter(n, st.FAILED_NODE, f"{label}: {why}")
            self.event("BreakerTripped", f"{n.name}: {label}: {why}", node=n.name, warning=True)
            return
        self.roll_back(n, f"{label}: {why}")
        self.event(
            "BreakerTripped",
            f"{n.name}: {label}: {why}; back to {n.previous_mode}",
            node=n.name,
            warning=True,
        )

    def roll_back(self, n: st.NodeProgress, why: str) -> None:
        self.patch(n.name, {MODE_ANNOTATION: n.previous_mode, PREFLIGHT_REQUEST: None})
        self.enter(n, st.ROLLING_BACK_NODE, why)

    def check_breakers(self) -> None:
        # Node-scope readings: the worst node's value per breaker (a reading per node would
        # grow the status with the cluster), and one reading per node that tripped.
        worst: dict[str, tuple[float, str]] = {}
        for n in self.status.nodes:
            if n.state == st.SWITCHED:
                self.check_node(n, worst)
        for b in self.spec.breakers:
            if b.scope == "Node" and b.label in worst:
                value, node = worst[b.label]
                r = self.reading(b)
                r.value, r.message = value, f"highest on {node}"
        self.check_batch()
        self.check_cluster()

    def check_node(self, n: st.NodeProgress, worst: dict[str, tuple[float, str]]) -> None:
        report = self.reports.get(n.name)
        verify = report.verify if report is not None else None
        switched_at = st.parse_stamp(n.since) or 0.0
        if verify is None or verify.at < switched_at:
            return  # nothing measured since the switch yet
        for b in self.spec.breakers:
            if b.scope != "Node" or b.signal == "switchFailed":
                continue
            value, limit = self.node_value(b, verify, n)
            if value is None:
                continue
            if value >= worst.get(b.label, (-1.0, ""))[0]:
                worst[b.label] = (value, n.name)
            if value > limit:
                self.trip_node(n, b, value, f"{b.signal} {value:g} > {limit:g}: {verify.summary}")
                return

    def node_value(
        self, b: Breaker, verify: VerifyReport, n: st.NodeProgress
    ) -> tuple[float | None, float]:
        limit = float(b.threshold)
        if b.signal == "verifyFailed":
            return (0.0 if verify.ok else 1.0), 0.0
        if b.signal == "healthzFailing":
            return (0.0 if verify.healthz else 1.0), 0.0
        if b.signal == "syncFailures":
            return verify.failures, limit
        # syncP99Seconds: against the node's own baseline or its peers' when asked, never
        # below threshold
        if b.relative_to_baseline is not None and n.baseline_p99:
            limit = max(limit, b.relative_to_baseline * n.baseline_p99)
        peers = self.peer_p99()
        if b.relative_to_peers is not None and peers is not None:
            limit = max(limit, b.relative_to_peers * peers)
        return verify.sync_p99, limit

    def peer_p99(self) -> float | None:
        """The median sync p99 the nodes not switched yet report (None: no reading)."""
        values = sorted(
            r.verify.sync_p99
            for n in self.status.nodes
            if n.state == st.PENDING
            and (r := self.reports.get(n.name)) is not None
            and r.verify is not None
            and r.verify.sync_p99 is not None
        )
        return values[len(values) // 2] if values else None

    def check_batch(self) -> None:
        b = self.breaker("failedNodes")
        if b is None or self.status.stage < 1:
            return
        batch = [n for n in self.status.stage_nodes(self.status.stage) if n.state != st.SKIPPED]
        since = st.parse_stamp(self.status.resumed_at) or 0.0
        failed = [
            n
            for n in batch
            if n.state in st.TRIPPED_STATES
            and not n.reason.startswith("abort")
            and (st.parse_stamp(n.since) or 0.0) >= since
        ]
        limit = resolve(b.threshold, len(batch)) if batch else 0
        tripped = limit > 0 and len(failed) >= limit
        why = f"{len(failed)} of {len(batch)} nodes of stage {self.status.stage} failed"
        if not self.record(b, float(len(failed)), tripped, why=why):
            return
        self.event("BreakerTripped", f"{b.label}: {why}", warning=True)
        if b.effective_action == "RollbackBatch":
            for n in batch:
                if n.state in (st.SWITCHING, st.SWITCHED, st.DONE, st.PREFLIGHT):
                    if n.state == st.PREFLIGHT:
                        self.patch(n.name, {PREFLIGHT_REQUEST: None})
                        self.enter(n, st.PENDING)
                    elif n.state != st.SWITCHING:
                        self.roll_back(n, f"{b.label}: the batch is rolled back")
            self.status.phase = st.ROLLING_BACK
            self.status.paused_reason = f"{b.label}: {why}; the batch is rolled back"
        else:
            self.pause(f"{b.label}: {why}")

    def check_cluster(self) -> None:
        for b in self.spec.breakers:
            if b.scope != "Cluster":
                continue
            if b.signal == "notReadyNodes":
                members = [
                    self.reports[n.name] for n in self.status.nodes if n.name in self.reports
                ]
                value = float(sum(1 for r in members if not r.info.ready))
                limit = float(resolve(b.threshold, len(members))) if members else 0.0
                why = f"{value:.0f} of {len(members)} nodes NotReady"
                tripped = limit > 0 and value >= limit
            else:  # apiErrors
                value, limit = float(self.api_errors), float(b.threshold)
                why = f"{self.api_errors} API requests in a row failed"
                tripped = value >= limit > 0
            if self.record(b, value, tripped, why=why):
                self.pause(f"{b.label}: {why}")
                self.event("BreakerTripped", f"{b.label}: {why}", warning=True)

    # --- operators' requests --------------------------------------------------------------------

    def handle(self, request: Request) -> None:
        self.status.handled_request = str(request)
        if request.verb == "pause":
            self.pause("paused by the operator")
            self.status.message = "paused"
        elif request.verb == "resume":
            self.resume()
        elif request.verb == "abort":
            self.abort(request.arg or "none")
        else:
            self.status.message = f"unknown request {request.verb!r}: use pause, resume or abort"

    def pause(self, why: str) -> None:
        if self.status.phase != st.ROLLING_BACK:
            self.status.phase = st.PAUSED
        self.status.paused_reason = why
        self.status.set_condition("Paused", True, "Paused", why, self.now)
        self.event("Paused", why, warning=True)

    def resume(self) -> None:
        if self.status.phase != st.PAUSED:
            self.status.message = f"resume: the rollout is {self.status.phase}, not Paused"
            return
        still = self.still_tripped()
        if still:
            self.status.message = "resume refused: " + "; ".join(still)
            self.event("ResumeRefused", self.status.message, warning=True)
            return
        for r in self.readings.values():
            r.tripped, r.tripped_at = False, ""
        for n in self.status.nodes:
            if n.state == st.BLOCKED:
                self.enter(n, st.PENDING, "")
        self.status.phase = st.PROGRESSING
        self.status.paused_reason = ""
        self.status.resumed_at = st.stamp(self.now)
        self.status.message = "resumed"
        self.status.set_condition("Paused", False, "Resumed", "resumed by the operator", self.now)
        self.event("Resumed", "resumed by the operator; breakers re-checked")

    def still_tripped(self) -> list[str]:
        """Cluster breakers read afresh: a resume into a distressed cluster is refused."""
        out = []
        fresh = _Reconciler(
            self.name, self.spec, self.status.model_copy(deep=True), [], self.now, self.api_errors
        )
        fresh.reports = self.reports
        fresh.readings = {}
        fresh.check_cluster()
        for r in fresh.readings.values():
            if r.tripped:
                out.append(f"{r.name} still trips ({r.message})")
        return out

    def abort(self, scope: str) -> None:
        if scope not in ("none", "batch", "all"):
            self.status.message = f"abort: --rollback {scope!r} is not none, batch or all"
            return
        self.status.abort = scope
        for n in self.status.nodes:
            if n.state == st.PREFLIGHT:
                self.patch(n.name, {PREFLIGHT_REQUEST: None})
                self.enter(n, st.PENDING)
        if scope != "none":
            chosen = [
                n for n in self.status.nodes if scope == "all" or n.stage == self.status.stage
            ]
            for n in chosen:
                if n.state in (st.SWITCHED, st.DONE):
                    self.roll_back(n, f"abort --rollback {scope}")
        self.status.phase = st.ROLLING_BACK
        self.status.message = f"aborted (rollback: {scope})"
        self.event("Aborted", f"aborted by the operator; rollback: {scope}", warning=True)

    # --- moving on ------------------------------------------------------------------------------

    def advance(self) -> None:
        s = self.status
        if s.phase == st.ROLLING_BACK:
            self.finish_rollback()
            return
        if s.phase == st.PAUSED:
            return
        if s.stage == 0:
            s.stage = 1
            s.phase = st.PROGRESSING
            self.event("Started", f"rolling out {self.spec.target_mode}: {s.nodes_total} nodes")
            if any(b.relative_to_peers is not None for b in self.spec.breakers):
                # the nodes waiting their turn are the peers: they publish readings too
                for n in s.nodes:
                    if n.state == st.PENDING:
                        self.patch(n.name, {ROLLOUT: f"{self.name}/{n.stage}"})
        while s.stage <= len(self.spec.stages):
            members = s.stage_nodes(s.stage)
            if any(n.state not in st.SETTLED for n in members):
                s.phase = st.PROGRESSING
                self.start_nodes(members)
                return
            if not self.soaked(members):
                return
            for n in members:
                if n.state == st.SWITCHED:
                    n.state = st.DONE
            s.stage += 1
            s.stage_soak_since = ""
            if s.stage <= len(self.spec.stages):
                self.event("StageStarted", f"stage {s.stage} of {len(self.spec.stages)}")
        self.finish()

    def soaked(self, members: list[st.NodeProgress]) -> bool:
        s = self.status
        if not any(n.state == st.SWITCHED for n in members):
            return True
        if not s.stage_soak_since:
            s.stage_soak_since = st.stamp(self.now)
            self.event("Soaking", f"stage {s.stage} switched; soaking")
        s.phase = st.SOAKING
        soak = self.spec.soak_of(self.spec.stages[s.stage - 1])
        since = st.parse_stamp(s.stage_soak_since) or self.now
        return self.now - since >= soak

    def start_nodes(self, members: list[st.NodeProgress]) -> None:
        stage = self.spec.stages[self.status.stage - 1]
        batch = [n for n in members if n.state != st.SKIPPED]
        parallel = max(1, resolve(stage.max_parallel, len(batch) or 1))
        busy = sum(1 for n in members if n.state in st.IN_FLIGHT)
        if busy >= parallel:
            return
        if not in_window(self.spec.maintenance_windows, self.now):
            self.status.set_condition(
                "InMaintenanceWindow", False, "OutsideWindow", "waiting for a window", self.now
            )
            return
        self.status.set_condition("InMaintenanceWindow", True, "InsideWindow", "", self.now)
        for n in members:
            if busy >= parallel:
                break
            report = self.reports.get(n.name)
            if n.state != st.PENDING or report is None or not report.info.ready:
                continue
            n.attempt += 1
            request = {"id": self.request_id(n), "mode": self.target_of(n)}
            self.patch(
                n.name,
                {
                    # declaring what the node runs first re-arms a declaration left failed
                    MODE_ANNOTATION: n.previous_mode,
                    ROLLOUT: f"{self.name}/{n.stage}",
                    PREVIOUS_MODE: n.previous_mode,
                    PREFLIGHT_REQUEST: json.dumps(request, sort_keys=True),
                },
            )
            self.enter(n, st.PREFLIGHT)
            busy += 1

    def target_of(self, n: st.NodeProgress) -> str:
        return n.target_mode or self.spec.target_mode

    def request_id(self, n: st.NodeProgress) -> str:
        return f"{self.name}.{n.name}.{n.attempt}"

    def rollback_covers(self, n: st.NodeProgress) -> bool:
        """Does the rollback under way (a batch's, or an abort's) include this node?"""
        s = self.status
        if s.phase != st.ROLLING_BACK or s.abort == "none":
            return False
        return s.abort == "all" or n.stage == s.stage

    def finish_rollback(self) -> None:
        s = self.status
        if any(
            n.state == st.ROLLING_BACK_NODE or (n.state == st.SWITCHING and self.rollback_covers(n))
            for n in s.nodes
        ):
            return
        if s.abort:
            self.finish(aborted=True)
            return
        s.phase = st.PAUSED
        s.set_condition("Paused", True, "RolledBack", s.paused_reason, self.now)
        self.event("Paused", f"batch rolled back: {s.paused_reason}", warning=True)

    def finish(self, aborted: bool = False) -> None:
        s = self.status
        failed = [n.name for n in s.nodes if n.state in st.TRIPPED_STATES]
        if aborted:
            s.phase, s.message = st.FAILED, f"aborted (rollback: {s.abort})"
        elif failed:
            s.phase = st.FAILED
            s.message = f"{len(failed)} node(s) did not move: {', '.join(failed)}"
        else:
            s.phase = st.SUCCEEDED
            where = "its previous mode again" if self.spec.undo_of else self.spec.target_mode
            skipped = [n.name for n in s.nodes if n.state == st.SKIPPED]
            moved = sum(1 for n in s.nodes if n.state == st.DONE)
            s.message = (
                f"every node serves {where}"
                if not skipped
                else f"{moved} node(s) serve {where}; skipped: {', '.join(skipped)}"
            )
        s.stage = min(s.stage, len(self.spec.stages))
        for n in s.nodes:
            if n.state == st.PENDING:
                self.patch(n.name, {ROLLOUT: None})
            elif n.stage and n.state != st.SKIPPED:
                self.patch(
                    n.name,
                    {
                        ROLLOUT: None,
                        PREFLIGHT_REQUEST: None,
                        LAST_ROLLOUT: f"{self.name}/{n.stage}",
                    },
                )
        self.event("Finished" if s.phase == st.SUCCEEDED else "Failed", s.message, warning=aborted)
