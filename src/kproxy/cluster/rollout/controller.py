"""The rollout controller: reads ProxyRollouts and Nodes, takes one reconcile step per rollout,
writes back through the API only. `kproxy rollout run` runs it in the foreground; the
Deployment in deploy/rollout/ runs the same loop in the cluster. A Lease keeps one instance
active; any instance can die at any point and the next one goes on from the API's objects.

Write order per step: node annotations first, then the rollout's status, then Events. A crash
between the first two repeats the step's node writes, which are idempotent (the same values);
the other order could record a switch that was never declared.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from kproxy.cluster.events import event_body, node_ref
from kproxy.cluster.lease import LeaderLease
from kproxy.cluster.rollout import status as st
from kproxy.cluster.rollout.metrics import RolloutMetrics
from kproxy.cluster.rollout.plan import Plan, make_plan, make_undo_plan
from kproxy.cluster.rollout.reconcile import Event, Request, initial_status, reconcile
from kproxy.cluster.rollout.spec import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    RolloutSpecError,
    parse_spec,
)
from kproxy.sources.clientsettings import ClientSettings
from kproxy.sources.kubeclient import ApiError, Connection, connect, json_request
from kproxy.sources.reflector import TRANSIENT, describe_error

log = logging.getLogger("kproxy.rollout")

ROLLOUTS = f"/apis/{GROUP}/{VERSION}/{PLURAL}"
NODES = "/api/v1/nodes"
# An operator's request to a rollout: "ID VERB[:ARG]" (kproxy rollout pause/resume/abort).
REQUEST_ANNOTATION = "proxy.kproxy.io/request"
COMPONENT = "kproxy-rollout"
LEASE_NAME = "kproxy-rollout-controller"


def default_identity() -> str:
    return f"{socket.gethostname()}_{os.getpid()}"


class RolloutController:
    def __init__(
        self,
        settings: ClientSettings,
        *,
        identity: str | None = None,
        lease_namespace: str = "kube-system",
        lease_duration: float = 15.0,
        interval: float = 2.0,
        only: str | None = None,
        metrics: RolloutMetrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.identity = identity or default_identity()
        self.lease = LeaderLease(
            lease_namespace, LEASE_NAME, self.identity, duration=lease_duration
        )
        self.interval = interval
        self.only = only  # reconcile this rollout only (None: every rollout)
        self.metrics = metrics or RolloutMetrics()
        self.clock = clock
        self.api_errors = 0  # consecutive failed steps: the apiErrors breaker's reading
        self._failing = ""

    async def run(self, stop: asyncio.Event) -> None:
        conn = await connect(self.settings)
        try:
            while not stop.is_set():
                await self.step(conn)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.interval)
            await self.lease.release(conn)
        finally:
            await conn.close()

    async def step(self, conn: Connection) -> None:
        """One pass: hold the Lease, then one reconcile step of every unfinished rollout."""
        try:
            if await self.lease.hold(conn, self.clock()):
                await self.reconcile_all(conn)
            self.api_errors = 0
            if self._failing:
                log.info("the API server answers again")
                self._failing = ""
        except (*TRANSIENT, TimeoutError, ApiError) as err:
            self.api_errors += 1
            self.metrics.api_errors.inc()
            text = describe_error(err) if not isinstance(err, ApiError) else str(err)
            if text != self._failing:
                log.warning("rollout controller: %s (retrying)", text)
                self._failing = text

    async def reconcile_all(self, conn: Connection) -> None:
        rollouts = (await json_request(conn, "GET", ROLLOUTS)).get("items") or []
        nodes = (await json_request(conn, "GET", NODES)).get("items") or []
        for obj in rollouts:
            name = (obj.get("metadata") or {}).get("name", "")
            if self.only is not None and name != self.only:
                continue
            if (obj.get("status") or {}).get("phase") in st.TERMINAL:
                self.metrics.observe(name, st.RolloutStatus.of(obj))
                continue
            await self.reconcile_one(conn, obj, nodes, rollouts)

    async def reconcile_one(
        self,
        conn: Connection,
        obj: dict[str, Any],
        nodes: list[dict[str, Any]],
        rollouts: list[dict[str, Any]],
    ) -> None:
        meta = obj.get("metadata") or {}
        name = str(meta.get("name", ""))
        now = self.clock()
        try:
            spec = parse_spec(obj.get("spec"))
        except RolloutSpecError as err:
            await self.refuse(conn, obj, "InvalidSpec", str(err))
            return
        status = st.RolloutStatus.of(obj)
        if status is None:
            plan = self.plan(spec, nodes, rollouts)
            if plan.blockers:
                await self.refuse(conn, obj, "PlanBlocked", "; ".join(plan.blockers))
                return
            status = initial_status(plan, now)
            log.info("rollout %s planned: %d nodes", name, status.nodes_total)
        request = Request.parse((meta.get("annotations") or {}).get(REQUEST_ANNOTATION))
        step = reconcile(
            name, spec, status, nodes, now, request=request, api_errors=self.api_errors
        )
        for patch in step.patches:
            await json_request(
                conn,
                "PATCH",
                f"{NODES}/{patch.node}",
                body={"metadata": {"annotations": patch.annotations}},
                content_type="application/merge-patch+json",
            )
        new = step.status.to_json()
        if new != obj.get("status"):
            await self.write_status(conn, obj, new)
        for event in step.events:
            await self.post_event(conn, obj, event)
        self.metrics.observe(name, step.status)

    @staticmethod
    def plan(spec: Any, nodes: list[dict[str, Any]], rollouts: list[dict[str, Any]]) -> Plan:
        """A new rollout's plan; an undo's comes from the status of the rollout it undoes."""
        if not spec.undo_of:
            return make_plan(spec, nodes)
        undone = next((o for o in rollouts if o["metadata"]["name"] == spec.undo_of), None)
        status = st.RolloutStatus.of(undone) if undone is not None else None
        if status is None or status.phase not in st.TERMINAL:
            why = (
                f"rollout {spec.undo_of} does not exist"
                if undone is None
                else f"rollout {spec.undo_of} has not finished: abort it first"
            )
            return replace(make_undo_plan(spec, st.RolloutStatus(), nodes), blockers=[why])
        return make_undo_plan(spec, status, nodes)

    async def write_status(self, conn: Connection, obj: dict[str, Any], status: dict) -> None:
        name = obj["metadata"]["name"]
        body = {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {"name": name, "resourceVersion": obj["metadata"]["resourceVersion"]},
            "spec": obj.get("spec"),
            "status": status,
        }
        try:
            await json_request(conn, "PUT", f"{ROLLOUTS}/{name}/status", body=body)
        except ApiError as err:
            if err.code != 409:
                raise
            # Changed since it was read (an operator's request): the next step reads it again;
            # its node writes were idempotent.
            log.info("rollout %s changed while it was reconciled; again at the next step", name)

    async def refuse(self, conn: Connection, obj: dict[str, Any], reason: str, why: str) -> None:
        """A rollout that cannot start: Failed, with the reason in a condition and an Event."""
        status = st.RolloutStatus(phase=st.FAILED, message=why)
        status.set_condition("Ready", False, reason, why, self.clock())
        log.error("rollout %s: %s", obj["metadata"]["name"], why)
        await self.write_status(conn, obj, status.to_json())
        await self.post_event(conn, obj, Event(KIND, obj["metadata"]["name"], reason, why, True))

    async def post_event(self, conn: Connection, obj: dict[str, Any], event: Event) -> None:
        meta = obj["metadata"]
        involved = (
            node_ref(event.name)
            if event.kind == "Node"
            else {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "name": meta["name"],
                "uid": meta.get("uid", ""),
            }
        )
        body = event_body(
            involved,
            "Warning" if event.warning else "Normal",
            event.reason,
            event.message,
            component=COMPONENT,
            instance=self.identity,
        )
        try:
            await json_request(conn, "POST", "/api/v1/namespaces/default/events", body=body)
        except ApiError as err:  # an Event is worth less than the step: never fail it
            log.warning("event %s not posted: %s", json.dumps(event.reason), err)


@contextlib.contextmanager
def running_in_thread(
    settings: ClientSettings, *, kill: bool = False, **kwargs: Any
) -> Iterator[RolloutController]:
    """The controller on an event loop of its own thread, for the lab, tests and benchmarks:
    stopped at the end (its Lease released), or with kill=True abandoned mid-step as a killed
    process would be (its Lease left to expire)."""
    controller = RolloutController(settings, **kwargs)
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    task: list[asyncio.Task[None]] = []

    async def go() -> None:
        task.append(asyncio.current_task())  # type: ignore[arg-type]
        with contextlib.suppress(asyncio.CancelledError):
            await controller.run(stop)

    thread = threading.Thread(
        target=lambda: loop.run_until_complete(go()), name="rollout-controller", daemon=True
    )
    thread.start()
    try:
        yield controller
    finally:
        if kill:
            loop.call_soon_threadsafe(task[0].cancel)
        else:
            loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        loop.close()
