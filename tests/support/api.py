"""For tests against the lab's API server: fast client timings, a batch sink, a Node with
annotations, and a daemon that switches modes without a kernel."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kproxy.sources.api import Timing
from kproxy.sources.base import ObjectEvent

FAST = Timing(
    backoff_initial=0.02,
    backoff_max=0.2,
    watch_timeout=30,
    read_grace=5.0,
    list_timeout=5.0,
    connect_timeout=2.0,
)


class Sink:
    """Collects batches; wait() blocks until a condition on all events seen holds."""

    def __init__(self) -> None:
        self.batches: list[list[ObjectEvent]] = []
        self._cond = threading.Condition()

    def __call__(self, batch: Sequence[ObjectEvent]) -> None:
        with self._cond:
            self.batches.append(list(batch))
            self._cond.notify_all()

    @property
    def events(self) -> list[ObjectEvent]:
        with self._cond:
            return [e for b in self.batches for e in b]

    def since(self, n: int) -> list[ObjectEvent]:
        return self.events[n:]

    def wait(self, pred: Callable[[list[ObjectEvent]], bool], timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not pred([e for b in self.batches for e in b]):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"condition not met; events: {self._describe()}")
                self._cond.wait(left)

    def _describe(self) -> list[str]:
        return [f"{e.key}{' (deleted)' if e.obj is None else ''}" for b in self.batches for e in b]


def node(name: str = "n1", **annotations: str) -> dict[str, Any]:
    return {
        "kind": "Node",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "labels": {"topology.kubernetes.io/zone": "z1", "kubernetes.io/hostname": name},
            "annotations": dict(annotations),
        },
        "spec": {"podCIDR": "10.244.0.0/24", "podCIDRs": ["10.244.0.0/24"]},
        "status": {"addresses": [{"type": "InternalIP", "address": "10.100.0.1"}]},
    }


class FakeDataplane:
    def __init__(self, mode: str) -> None:
        self.mode = mode


class FakeDaemon:
    """Daemon.switch's contract without a kernel: a report dict, last_switch, the mode."""

    def __init__(self, mode: str = "iptables", fail_with: str = "") -> None:
        self.dataplane = FakeDataplane(mode)
        self.last_switch: dict[str, object] | None = None
        self.fail_with = fail_with
        self.switches: list[str] = []

    @property
    def mode(self) -> str:
        return self.dataplane.mode

    def switch(self, to: str, timeout: float = 60.0) -> dict[str, object]:
        self.switches.append(to)
        report: dict[str, object] = {
            "from_mode": self.dataplane.mode,
            "to_mode": to,
            "ok": not self.fail_with,
            "error": self.fail_with or None,
            "duration": 0.25,
        }
        if not self.fail_with:
            self.dataplane.mode = to
        self.last_switch = report
        return report


def wait_until(pred: Callable[[], bool], timeout: float = 5.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what or "condition not met"
        time.sleep(0.02)
