"""The cluster-declared proxy mode: follow the Node's annotation, report progress on the Node.

A rollout controller (or a person with kubectl) sets `proxy.kproxy.io/mode` on a Node; the
kproxy on that node switches live (Daemon.switch: make before break, verified, rolled back
on failure) and writes what happened back onto its Node as annotations, plus a Kubernetes
Event per switch, so progress can be watched from the API alone:

  proxy.kproxy.io/current-mode   the mode serving now
  proxy.kproxy.io/mode-observed  the declared value this kproxy has acted on ("" = none)
  proxy.kproxy.io/switch-state   idle, switching, succeeded or failed (the last switch)
  proxy.kproxy.io/switch-target  the mode the last switch went to
  proxy.kproxy.io/last-error     why the last switch failed (absent when it did not)

During a rollout (cluster/rollout/) the agent also answers the controller's preflight
requests and publishes verify readings while the Node carries the rollout's annotation
(cluster/duties.py):

  proxy.kproxy.io/preflight-result  the answer to proxy.kproxy.io/preflight-request
  proxy.kproxy.io/verify            the latest verify reading

The annotation is edge-triggered: kproxy acts when its value changes (removing it leads back
to the configured mode); a failed switch is not retried until the value changes again, so a
mode that cannot work never causes repeated disruption. Switches made another way (the config
file, `kproxy switch`) are reported the same way.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol

import aiohttp

from kproxy.cluster.annotations import (
    CURRENT_MODE,
    LAST_ERROR,
    MODE_ANNOTATION,
    OBSERVED,
    PREFLIGHT_REQUEST,
    PREFLIGHT_RESULT,
    ROLLOUT,
    SWITCH_STATE,
    SWITCH_TARGET,
    VERIFY,
    annotations_of,
    declared_mode,
)
from kproxy.cluster.duties import RolloutDuties, RolloutNode
from kproxy.cluster.events import EVENT_NAMESPACE, event_body, node_ref
from kproxy.modes import MODES
from kproxy.sources.api import ApiSource
from kproxy.sources.kubeclient import ApiError, json_request
from kproxy.sources.reflector import TRANSIENT, Backoff, describe_error
from kproxy.text import one_line

log = logging.getLogger("kproxy.cluster.agent")

COMPONENT = "kproxy"
MODE_LIMIT = 63  # characters of a declared mode echoed back (a mode name is far shorter)

_TIMEOUT = aiohttp.ClientTimeout(total=10, sock_connect=5)


_NOTHING_HANDLED = object()


class SwitchingProxy(RolloutNode, Protocol):
    """What the agent needs of the running proxy (kproxy.daemon.Daemon)."""

    last_switch: dict[str, object] | None

    @property
    def mode(self) -> str: ...

    def switch(self, to: str, timeout: float = ...) -> dict[str, object]: ...


class ClusterAgent:
    """See the module docstring. start() after the daemon serves; stop() before it stops."""

    def __init__(
        self,
        daemon: SwitchingProxy,
        source: ApiSource,
        *,
        configured_mode: str,
        interval: float = 1.0,
        switch_timeout: float = 60.0,
    ) -> None:
        self.daemon = daemon
        self.source = source
        self.node_name = source.node_name
        self.configured_mode = configured_mode
        self.interval = interval
        self.switch_timeout = switch_timeout
        self.state = "idle"
        self.target = ""
        self.error = ""
        self.duties = RolloutDuties(daemon)
        self.rollout_status: dict[str, str | None] = {}  # the duties' annotations
        self.observed = ""  # the declared value last acted on
        # Not None: None means "annotation absent", and a daemon that started in a declared
        # mode must still act when the annotation is gone before the agent's first step (it
        # can be removed between the first sync and the agent's start).
        self._handled: str | None | object = _NOTHING_HANDLED
        self._seen_switch: object = daemon.last_switch
        self._node: dict[str, Any] | None = source.node
        self._reported: dict[str, str | None] = {}
        self._events: list[dict[str, Any]] = []
        self._backoff = Backoff(1.0, 30.0)
        self._retry_at = 0.0
        self._failing = ""
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        source.node_listeners.append(self._on_node)

    def start(self) -> None:
        if self._node is None:
            self._node = self.source.node
        self._thread = threading.Thread(target=self._run, name="cluster-agent", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(self.switch_timeout + 15)
        if self._on_node in self.source.node_listeners:
            self.source.node_listeners.remove(self._on_node)

    def _on_node(self, node: dict[str, Any] | None) -> None:
        self._node = node
        self._wake.set()

    # --- the loop ------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except Exception:
                log.exception("cluster agent step failed")
            self._wake.wait(self.interval)
            self._wake.clear()

    def step(self) -> None:
        """Act on a changed declaration, notice other switches, push status and events."""
        node = self._node
        want = declared_mode(node)
        if node is not None and want != self._handled:
            self._handled = want
            self._declared(want)
        self._notice_other_switches()
        self._rollout_duties(node)
        self._flush()

    def _declared(self, want: str | None) -> None:
        self.observed = want or ""
        target = want or self.configured_mode
        current = self.daemon.mode
        if target not in MODES:
            self._failed(
                target,
                f"{MODE_ANNOTATION}: {target!r} is not a proxy mode ({', '.join(MODES)})",
            )
            return
        if target == current:
            return
        why = f"{MODE_ANNOTATION}={want}" if want else f"{MODE_ANNOTATION} removed"
        log.info("Node %s: %s; switching live from %s to %s", self.node_name, why, current, target)
        self.state, self.target, self.error = "switching", target, ""
        self._event("Normal", "ProxyModeSwitching", f"Switching from {current} to {target} ({why})")
        self._flush()
        try:
            report = self.daemon.switch(target, timeout=self.switch_timeout)
        except Exception as err:  # never leave "switching" on the Node for good
            log.exception("switch to %s raised", target)
            report = {"ok": False, "from_mode": current, "to_mode": target, "error": str(err)}
        self._seen_switch = self.daemon.last_switch
        self._finished(report)

    def _finished(self, report: dict[str, object]) -> None:
        from_mode, to_mode = str(report.get("from_mode", "")), str(report.get("to_mode", ""))
        if report.get("ok"):
            self.state, self.target, self.error = "succeeded", to_mode, ""
            seconds = report.get("duration")
            took = f" in {seconds:.2f} s" if isinstance(seconds, int | float) else ""
            self._event(
                "Normal", "ProxyModeSwitched", f"Switched from {from_mode} to {to_mode}{took}"
            )
        else:
            self._failed(to_mode, str(report.get("error") or "unknown error"), from_mode)

    def _failed(self, target: str, error: str, from_mode: str = "") -> None:
        self.state, self.target, self.error = "failed", target, error
        current = from_mode or self.daemon.mode
        log.error(
            "Node %s: switch to %s failed, %s keeps serving: %s",
            self.node_name,
            target,
            current,
            error,
        )
        self._event(
            "Warning",
            "ProxyModeSwitchFailed",
            f"Switch from {current} to {target} failed; {current} keeps serving: {error}",
        )

    def _rollout_duties(self, node: dict[str, Any] | None) -> None:
        """Answer a rollout's preflight request; publish verify readings while watched."""
        ann = annotations_of(node)
        answer = self.duties.preflight(ann.get(PREFLIGHT_REQUEST))
        if answer is not None:
            self.rollout_status[PREFLIGHT_RESULT] = answer
        watched = ROLLOUT in ann
        reading = self.duties.verify(watched)
        if reading is not None:
            self.rollout_status[VERIFY] = reading
        elif not watched:
            self.rollout_status[VERIFY] = None

    def _notice_other_switches(self) -> None:
        last = self.daemon.last_switch
        if last is not None and last is not self._seen_switch:
            self._seen_switch = last
            self._finished(last)

    # --- talking to the API server -------------------------------------------------------------

    def status(self) -> dict[str, str | None]:
        # observed and target echo the declared-mode annotation: any text, made one line.
        return {
            CURRENT_MODE: self.daemon.mode,
            OBSERVED: one_line(self.observed, limit=MODE_LIMIT),
            SWITCH_STATE: self.state,
            SWITCH_TARGET: one_line(self.target, limit=MODE_LIMIT) or None,
            LAST_ERROR: one_line(self.error, limit=1000) or None,  # None removes it (merge patch)
            **self.rollout_status,
        }

    def _event(self, type_: str, reason: str, message: str) -> None:
        self._events.append(
            event_body(
                node_ref(self.node_name),
                type_,
                reason,
                message,
                component=COMPONENT,
                instance=self.node_name,
            )
        )

    def _flush(self) -> None:
        """Send the status annotations that changed and the queued events; on failure keep
        them for the next step, retrying with backoff (logged once per failure)."""
        if time.monotonic() < self._retry_at:
            return
        want = self.status()
        current = annotations_of(self._node)
        patch = {k: v for k, v in want.items() if self._reported.get(k, "\0") != v}
        # A key that is absent on the Node needs no removal.
        patch = {k: v for k, v in patch.items() if v is not None or k in current}
        try:
            if patch:
                body = {"metadata": {"annotations": patch}}
                self.source.call(self._patch(body), timeout=15)
            self._reported.update(want)
            while self._events:
                try:
                    self.source.call(self._post(self._events[0]), timeout=15)
                except ApiError as err:
                    if not 400 <= err.code < 500 or err.code == 429:
                        raise
                    # Refused for good (e.g. RBAC): retrying would not help.
                    log.warning("Node %s: event refused: %s", self.node_name, err)
                self._events.pop(0)
        except (*TRANSIENT, TimeoutError) as err:
            text = describe_error(err)
            if text != self._failing:
                log.warning("Node %s: could not report status: %s; retrying", self.node_name, text)
                self._failing = text
            self._retry_at = time.monotonic() + self._backoff.next()
            if len(self._events) > 50:
                del self._events[:-50]  # an old event is worth less than memory
            return
        if self._failing:
            log.info("Node %s: status reported again", self.node_name)
        self._failing = ""
        self._backoff.reset()

    async def _patch(self, body: dict[str, Any]) -> None:
        await json_request(
            self.source.connection,
            "PATCH",
            f"/api/v1/nodes/{self.node_name}",
            body=body,
            content_type="application/merge-patch+json",
            timeout=_TIMEOUT,
        )

    async def _post(self, event: dict[str, Any]) -> None:
        await json_request(
            self.source.connection,
            "POST",
            f"/api/v1/namespaces/{EVENT_NAMESPACE}/events",
            body=event,
            timeout=_TIMEOUT,
        )
