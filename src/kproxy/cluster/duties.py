"""What a node's kproxy does for a rollout, besides switching: answer the controller's
preflight requests, and publish its verify while the rollout watches the node.

Both answers travel as annotations on the node's own Node (cluster/annotations.py), written
by the cluster agent with its other status keys. The preflight runs the same checks as
`kproxy preflight --to MODE`; the verify reads this process's own metrics and status, as
`kproxy verify` reads them from outside.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

from kproxy.cluster.annotations import json_annotation

if TYPE_CHECKING:
    from kproxy.ops.verify import Collector, Sample

log = logging.getLogger("kproxy.cluster.duties")

# Between two verify readings published for a rollout.
VERIFY_INTERVAL = 10.0
# The verify checks whose breach means the proxy does not do its job: the verifyFailed
# breaker reads these. Sync time has its own breaker (against the node's baseline: a full
# sync's time depends on the mode), and memory and CPU budgets are not a reason to roll a
# switch back (a switch itself spends CPU in the window that follows it).
CORRECTNESS_CHECKS = ("running", "metrics", "failures", "sync-progress")


class RolloutNode(Protocol):
    """What the duties need of the running proxy (kproxy.daemon.Daemon)."""

    def preflight_report(self, target: str) -> dict[str, Any]: ...

    def verify_collector(self) -> Collector: ...


def parse_request(text: str | None) -> tuple[str, str] | None:
    """(id, mode) of a preflight request annotation; None when absent or malformed."""
    data = json_annotation(text)
    if data is None or not data.get("id") or not data.get("mode"):
        return None
    return str(data["id"]), str(data["mode"])


class RolloutDuties:
    def __init__(self, proxy: RolloutNode, *, verify_interval: float = VERIFY_INTERVAL) -> None:
        self.proxy = proxy
        self.verify_interval = verify_interval
        self.answered: tuple[str, str] | None = None  # (request id, answer JSON)
        self._collector: Collector | None = None
        self._previous: Sample | None = None
        self._next_verify = 0.0
        self.last_p99: float | None = None

    def preflight(self, request: str | None) -> str | None:
        """The answer to a preflight request (JSON), run once per request id."""
        parsed = parse_request(request)
        if parsed is None:
            return self.answered[1] if self.answered else None
        ident, mode = parsed
        if self.answered and self.answered[0] == ident:
            return self.answered[1]
        try:
            report = self.proxy.preflight_report(mode)
        except Exception as err:  # an answer is owed even when the checks break
            log.exception("preflight for %s failed", mode)
            report = {"ok": False, "blocks": [f"preflight could not run: {err}"]}
        answer = {"id": ident, "mode": mode, **report}
        if self.last_p99 is not None:
            answer.setdefault("syncP99", self.last_p99)
        text = json.dumps(answer, sort_keys=True)
        self.answered = (ident, text)
        log.info("preflight for %s (%s): %s", mode, ident, "ok" if report.get("ok") else "blocked")
        return text

    def verify(self, watched: bool, now: float | None = None) -> str | None:
        """A verify reading (JSON) every interval while a rollout watches this node; None
        when no new reading is due."""
        now = time.monotonic() if now is None else now
        if not watched or now < self._next_verify:
            if not watched:
                self._previous = None
            return None
        self._next_verify = now + self.verify_interval
        from kproxy.ops.verify import evaluate

        if self._collector is None:
            self._collector = self.proxy.verify_collector()
        sample = self._collector.sample()
        window = [self._previous, sample] if self._previous is not None else [sample]
        self._previous = sample
        verdict = evaluate(window, single=len(window) == 1)
        checks = {c.name: c for c in verdict.checks}
        broken = [c.name for c in verdict.breaches if c.name in CORRECTNESS_CHECKS]
        p99 = _seconds(checks.get("sync-p99"))
        if p99 is not None:
            self.last_p99 = p99
        failures = checks.get("failures")
        reading = {
            "at": time.time(),
            "ok": not broken,
            "syncP99": p99,
            "failures": _number(failures.value) if failures is not None else 0,
            "healthz": sample.status is not None and bool(sample.status.get("healthy", True)),
            "summary": (f"BREACH {', '.join(broken)}: " if broken else "")
            + verdict.progress()[:280],
        }
        return json.dumps(reading, sort_keys=True)


def _number(text: str) -> float:
    try:
        return float(text.split()[0])
    except (ValueError, IndexError):
        return 0.0


def _seconds(check: Any) -> float | None:
    """The sync-p99 check's value ("0.012 s", "n/a") in seconds."""
    if check is None or check.ok is None:
        return None
    value = check.value.split()
    try:
        number = float(value[0])
    except (ValueError, IndexError):
        return None
    return number / 1000 if len(value) > 1 and value[1] == "ms" else number
