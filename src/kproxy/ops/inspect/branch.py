"""One path of a trace walk (shared by the iptables and the nftables walker): its probability,
the conditions it assumed, the steps taken, and what happened to the packet on the way."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kproxy.ops.inspect.model import Step


@dataclass
class Branch:
    prob: float | None
    conditions: list[str] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    mark: int = 0
    dnat: tuple[str, int | None] | None = None
    service: str | None = None
    masquerade: bool = False

    def fork(self) -> Branch:
        return replace(
            self,
            conditions=list(self.conditions),
            steps=list(self.steps),
            notes=list(self.notes),
        )

    def scale(self, p: float | None) -> None:
        self.prob = None if self.prob is None or p is None else self.prob * p
