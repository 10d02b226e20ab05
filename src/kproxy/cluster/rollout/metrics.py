"""The rollout controller's Prometheus metrics, `kproxy_rollout_*`, from each rollout's status."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from kproxy.cluster.rollout import status as st

PHASES = (st.PLANNED, st.PROGRESSING, st.SOAKING, st.PAUSED, st.ROLLING_BACK, *st.TERMINAL)
NODE_STATES = (
    st.PENDING,
    *st.IN_FLIGHT,
    st.SWITCHED,
    st.DONE,
    st.SKIPPED,
    st.BLOCKED,
    st.ROLLED_BACK,
    st.FAILED_NODE,
)


class RolloutMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        self.phase = Gauge(
            "kproxy_rollout_phase",
            "1 for the rollout's current phase",
            ["rollout", "phase"],
            registry=r,
        )
        self.stage = Gauge("kproxy_rollout_stage", "The stage under way", ["rollout"], registry=r)
        self.nodes = Gauge(
            "kproxy_rollout_nodes",
            "Nodes of the rollout by state",
            ["rollout", "state"],
            registry=r,
        )
        self.breaker_value = Gauge(
            "kproxy_rollout_breaker_value",
            "A breaker's last reading (node scope: the worst node's)",
            ["rollout", "breaker", "scope"],
            registry=r,
        )
        self.breaker_tripped = Gauge(
            "kproxy_rollout_breaker_tripped",
            "Trips in force, by breaker",
            ["rollout", "breaker", "scope"],
            registry=r,
        )
        self.api_errors = Counter(
            "kproxy_rollout_api_errors", "Controller steps that failed on the API", registry=r
        )

    def observe(self, name: str, status: st.RolloutStatus | None) -> None:
        if status is None:
            return
        for phase in PHASES:
            self.phase.labels(name, phase).set(1 if status.phase == phase else 0)
        self.stage.labels(name).set(status.stage)
        for state in NODE_STATES:
            count = sum(1 for n in status.nodes if n.state == state)
            self.nodes.labels(name, state).set(count)
        tripped: dict[tuple[str, str], int] = {}
        for b in status.breakers:
            key = (b.name, b.scope)
            tripped[key] = tripped.get(key, 0) + (1 if b.tripped else 0)
            if not b.node and b.value is not None:
                self.breaker_value.labels(name, b.name, b.scope).set(b.value)
        for (breaker, scope), count in tripped.items():
            self.breaker_tripped.labels(name, breaker, scope).set(count)
