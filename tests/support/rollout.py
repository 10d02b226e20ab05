"""Rollout controller helpers: Nodes as the planner reads them, simulated node agents (alone or
on the lab's API server), ProxyRollout objects, and the controller running in a thread."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

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
)
from kproxy.cluster.rollout.controller import running_in_thread
from kproxy.lab.kubeapi import KubeApiStore
from kproxy.sources.clientsettings import ClientSettings


def node(
    name: str, mode: str | None = "iptables", *, zone: str = "", ready: bool = True, **labels: str
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": dict(labels)}
    if zone:
        meta["labels"]["topology.kubernetes.io/zone"] = zone
    if mode is not None:
        meta["annotations"] = {CURRENT_MODE: mode}
    status = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    return {"apiVersion": "v1", "kind": "Node", "metadata": meta, "status": status}


@dataclass
class SimNode:
    """A node's kproxy, reduced to what it says on its Node."""

    obj: dict[str, Any]
    block: str = ""  # its preflight blocks with this finding
    fail_to: str = ""  # a switch to this mode fails
    fail_error: str = "verify: 10.96.0.1:443 missing"  # ... and says so on its Node
    answers: bool = True  # answers preflight requests at all
    verify_ok: bool = True
    p99: float = 0.05
    switches: list[str] = field(default_factory=list)

    @property
    def ann(self) -> dict[str, str]:
        return self.obj["metadata"].setdefault("annotations", {})

    def act(self, now: float) -> None:
        ann = self.ann
        request = json.loads(ann[PREFLIGHT_REQUEST]) if PREFLIGHT_REQUEST in ann else None
        if request and self.answers:
            answer = {"id": request["id"], "ok": not self.block, "syncP99": self.p99}
            if self.block:
                answer["blocks"] = [self.block]
            ann[PREFLIGHT_RESULT] = json.dumps(answer)
        declared = ann.get(MODE_ANNOTATION)
        if declared is not None and declared != ann.get(OBSERVED):
            ann[OBSERVED] = declared
            if declared != ann[CURRENT_MODE]:
                self.switches.append(declared)
                ann[SWITCH_TARGET] = declared
                if declared == self.fail_to:
                    ann[SWITCH_STATE], ann[LAST_ERROR] = "failed", self.fail_error
                else:
                    ann[CURRENT_MODE], ann[SWITCH_STATE] = declared, "succeeded"
                    ann.pop(LAST_ERROR, None)
        if ROLLOUT in ann:
            ann[VERIFY] = json.dumps(
                {"at": now, "ok": self.verify_ok, "syncP99": self.p99, "summary": "verify"}
            )


class Agents:
    """Each node's kproxy, simulated on the store: answers preflights, follows its mode."""

    def __init__(self, store: KubeApiStore, names: list[str]) -> None:
        self.store = store
        self.sims = {n: SimNode(node(n)) for n in names}
        for sim in self.sims.values():
            store.apply(sim.obj)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            for name, sim in self.sims.items():
                obj = self.store.get("Node", "", name)
                if obj is None:
                    continue
                before = dict(obj["metadata"].get("annotations") or {})
                sim.obj = obj
                sim.act(time.time())
                after = sim.ann
                patch: dict[str, Any] = {k: v for k, v in after.items() if before.get(k) != v}
                patch.update({k: None for k in before if k not in after})
                if patch:
                    self.store.patch("Node", "", name, {"metadata": {"annotations": patch}})

    def __enter__(self) -> Agents:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(5)


def rollout(name: str = "to-nft", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "proxy.kproxy.io/v1alpha1",
        "kind": "ProxyRollout",
        "metadata": {"name": name},
        "spec": {
            "targetMode": "nftables",
            "soak": "0s",
            "stages": [{"nodes": "1"}, {"nodes": "50%"}, {"nodes": "100%", "maxParallel": "2"}],
            **spec,
        },
    }


def phase(store: KubeApiStore, name: str = "to-nft") -> str:
    obj = store.get("ProxyRollout", "", name)
    return ((obj or {}).get("status") or {}).get("phase", "")


def running(settings: ClientSettings, **kwargs: Any) -> Any:
    """The controller in a thread, stepping fast, its Lease in "default"."""
    kwargs.setdefault("lease_namespace", "default")
    kwargs.setdefault("interval", 0.05)
    return running_in_thread(settings, **kwargs)


def wait_for(check: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.02)
