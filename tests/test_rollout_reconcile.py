"""The rollout controller's step against simulated nodes: each node's kproxy is a few lines that
answer preflight requests and follow the declared mode, as cluster/agent.py does. The kernel
tests prove the same flows with real kproxies and packets; these cover every branch fast."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from kproxy.cluster.annotations import (
    CURRENT_MODE,
    LAST_ROLLOUT,
    MODE_ANNOTATION,
    PREFLIGHT_REQUEST,
    PREVIOUS_MODE,
    ROLLOUT,
)
from kproxy.cluster.rollout import status as st
from kproxy.cluster.rollout.plan import make_plan
from kproxy.cluster.rollout.reconcile import Request, Step, in_window, initial_status, reconcile
from kproxy.cluster.rollout.spec import parse_spec
from tests.support.rollout import SimNode, node

T0 = 1_800_000_000.0


@dataclass
class Cluster:
    spec: Any
    nodes: dict[str, SimNode]
    now: float = T0
    status: st.RolloutStatus | None = None
    events: list[str] = field(default_factory=list)
    request: Request | None = None

    def objs(self) -> list[dict[str, Any]]:
        return [n.obj for n in self.nodes.values()]

    def step(self, seconds: float = 1.0) -> Step:
        if self.status is None:
            self.status = initial_status(make_plan(self.spec, self.objs()), self.now)
        out = reconcile("r1", self.spec, self.status, self.objs(), self.now, request=self.request)
        for p in out.patches:  # node patches first, as the controller writes them
            ann = self.nodes[p.node].ann
            for k, v in p.annotations.items():
                if v is None:
                    ann.pop(k, None)
                else:
                    ann[k] = v
        self.status = out.status
        self.events += [f"{e.kind}/{e.name} {e.reason}" for e in out.events]
        for n in self.nodes.values():
            n.act(self.now)
        self.now += seconds
        return out

    def run(self, until: str | tuple[str, ...], steps: int = 200, seconds: float = 1.0) -> None:
        phases = (until,) if isinstance(until, str) else until
        for _ in range(steps):
            self.step(seconds)
            assert self.status is not None
            if self.status.phase in phases:
                return
        raise AssertionError(f"still {self.status.phase if self.status else None}")

    def state(self, name: str) -> str:
        assert self.status is not None
        return self.status.node(name).state

    def mode(self, name: str) -> str:
        return self.nodes[name].ann[CURRENT_MODE]


def cluster(count: int = 4, **spec_fields: Any) -> Cluster:
    fields = {
        "targetMode": "nftables",
        "soak": "10s",
        "stages": [{"nodes": "1"}, {"nodes": "50%"}, {"nodes": "100%", "maxParallel": "2"}],
        **spec_fields,
    }
    nodes = {f"n{i}": SimNode(node(f"n{i}")) for i in range(1, count + 1)}
    return Cluster(parse_spec(fields), nodes)


def test_a_full_rollout_moves_every_node_once_stage_by_stage() -> None:
    c = cluster()
    c.run(st.SUCCEEDED)
    assert all(c.mode(n) == "nftables" for n in c.nodes)
    assert all(n.switches == ["nftables"] for n in c.nodes.values())
    assert c.status is not None and c.status.nodes_done == 4
    assert [c.status.node(n).stage for n in ("n1", "n2", "n3", "n4")] == [1, 2, 3, 3]
    for n in c.nodes.values():
        assert n.ann[LAST_ROLLOUT].startswith("r1/")
        assert ROLLOUT not in n.ann and PREFLIGHT_REQUEST not in n.ann
        assert n.ann[PREVIOUS_MODE] == "iptables"
    assert "ProxyRollout/r1 Finished" in c.events
    assert "Node/n1 NodeSwitched" in c.events


def test_a_stage_waits_for_its_soak_and_its_parallelism() -> None:
    c = cluster(soak="1m")
    c.run(st.SOAKING)
    assert c.state("n1") == st.SWITCHED and c.state("n2") == st.PENDING
    for _ in range(30):
        c.step()
    assert c.state("n2") == st.PENDING  # still soaking stage 1
    c.run(st.PROGRESSING, seconds=5)
    c.step()
    c.run(st.SOAKING)
    c.run(st.PROGRESSING, seconds=5)
    c.step()
    # stage 3: two nodes at once
    assert c.state("n3") in st.IN_FLIGHT and c.state("n4") in st.IN_FLIGHT


def test_a_failed_switch_trips_the_node_breaker_and_sends_it_back() -> None:
    c = cluster(count=4, stages=[{"nodes": "100%", "maxParallel": "4"}])
    c.nodes["n2"].fail_to = "nftables"
    c.run(st.TERMINAL)
    assert c.state("n2") == st.ROLLED_BACK and c.mode("n2") == "iptables"
    assert c.nodes["n2"].ann[MODE_ANNOTATION] == "iptables"
    assert c.status is not None and c.status.phase == st.FAILED
    assert "n2" in c.status.message
    tripped = [b for b in c.status.breakers if b.tripped]
    assert [(b.name, b.node) for b in tripped] == [("switchFailed", "n2")]
    assert "Node/n2 BreakerTripped" in c.events


def test_a_nodes_error_text_reaches_the_status_and_events_on_one_line() -> None:
    c = cluster(count=2, stages=[{"nodes": "100%", "maxParallel": "2"}])
    c.nodes["n2"].fail_to = "nftables"
    c.nodes["n2"].fail_error = "boom\nPhase: Succeeded\x1b[2J"
    messages: list[str] = []
    for _ in range(200):
        out = c.step()
        messages += [e.message for e in out.events]
        if c.status is not None and c.status.phase in (*st.TERMINAL, st.PAUSED):
            break
    assert c.status is not None and c.status.phase in (st.FAILED, st.PAUSED)
    texts = [c.status.message, c.status.node("n2").last_error, c.status.node("n2").reason]
    texts += [b.message for b in c.status.breakers] + messages
    assert any("boom\\nPhase: Succeeded\\x1b[2J" in t for t in texts), texts
    assert all(t.isprintable() for t in texts), texts


def test_a_node_that_degrades_after_its_switch_is_rolled_back_during_soak() -> None:
    c = cluster(
        count=2,
        soak="1m",
        stages=[{"nodes": "1"}, {"nodes": "100%"}],
        breakers=[{"signal": "syncP99Seconds", "threshold": "0.1", "relativeToBaseline": 3}],
    )
    c.run(st.SOAKING)
    c.nodes["n1"].p99 = 0.12  # above 0.1 s but below 3x its 0.05 s baseline: fine
    c.step()
    c.step()
    assert c.state("n1") == st.SWITCHED
    c.nodes["n1"].p99 = 0.4
    c.step()
    c.step()
    assert c.state("n1") in (st.ROLLING_BACK_NODE, st.ROLLED_BACK)
    c.step()
    assert c.state("n1") == st.ROLLED_BACK and c.mode("n1") == "iptables"
    reading = next(b for b in c.status.breakers if b.node == "n1")  # type: ignore[union-attr]
    assert reading.tripped and reading.value == pytest.approx(0.4)
    assert reading.threshold == "0.1"


def test_a_batch_where_enough_nodes_fail_is_rolled_back_and_the_rollout_pauses() -> None:
    c = cluster(
        count=4,
        stages=[{"nodes": "1"}, {"nodes": "100%", "maxParallel": "3"}],
        breakers=[{"signal": "switchFailed"}, {"signal": "failedNodes", "threshold": "2"}],
    )
    c.nodes["n2"].fail_to = c.nodes["n3"].fail_to = "nftables"
    c.run(st.PAUSED)
    assert c.state("n1") == st.DONE and c.mode("n1") == "nftables"  # stage 1 stays
    assert {c.state(n) for n in ("n2", "n3", "n4")} == {st.ROLLED_BACK}
    assert all(c.mode(n) == "iptables" for n in ("n2", "n3", "n4"))
    assert c.status is not None and "failedNodes" in c.status.paused_reason
    for _ in range(20):  # no auto-resume after a trip
        c.step()
    assert c.status.phase == st.PAUSED
    assert c.nodes["n4"].switches == ["nftables", "iptables"]


def test_a_preflight_block_skips_the_node_or_halts_the_stage() -> None:
    c = cluster(count=3, stages=[{"nodes": "100%", "maxParallel": "3"}])
    c.nodes["n2"].block = "mode.nft-missing: nft is not installed"
    c.run(st.TERMINAL)
    assert c.state("n2") == st.SKIPPED and "nft is not installed" in c.status.node("n2").reason  # type: ignore[union-attr]
    assert c.nodes["n2"].switches == []
    assert c.status is not None and c.status.phase == st.SUCCEEDED

    halting = cluster(count=3, stages=[{"nodes": "100%"}], preflight={"onBlock": "HaltStage"})
    halting.nodes["n1"].block = "mode.nft-missing: nft is not installed"
    halting.run(st.PAUSED)
    assert halting.state("n1") == st.BLOCKED
    assert halting.state("n2") == st.PENDING and halting.nodes["n2"].switches == []
    halting.nodes["n1"].block = ""
    halting.request = Request("req-1", "resume")
    halting.run(st.SUCCEEDED)
    assert halting.mode("n1") == "nftables"


def test_no_preflight_answer_in_time_counts_as_a_block() -> None:
    c = cluster(count=1, stages=[{"nodes": "100%"}], preflight={"timeout": "5s"})
    c.nodes["n1"].answers = False
    c.run(st.TERMINAL)
    assert c.state("n1") == st.SKIPPED and "no preflight answer" in c.status.node("n1").reason  # type: ignore[union-attr]


def test_a_restarted_controller_switches_no_node_twice() -> None:
    c = cluster(count=4, stages=[{"nodes": "100%", "maxParallel": "2"}])
    for _ in range(3):
        c.step()
    # The controller dies after writing node patches but before its status: the next one
    # starts from the status it last wrote.
    saved = c.status.model_copy(deep=True)  # type: ignore[union-attr]
    c.step()
    c.status = st.RolloutStatus.model_validate(saved.to_json())
    c.run(st.SUCCEEDED)
    assert all(n.switches == ["nftables"] for n in c.nodes.values())


def test_pause_holds_new_switches_and_resume_goes_on() -> None:
    c = cluster(count=3, stages=[{"nodes": "100%"}])
    c.step()
    c.request = Request("a", "pause")
    c.run(st.PAUSED)
    for _ in range(10):
        c.step()
    started = [n for n in c.nodes.values() if n.switches]
    assert len(started) <= 1  # the switch under way finished; nothing new began
    c.request = Request("b", "resume")
    c.run(st.SUCCEEDED)


def test_resume_is_refused_while_a_cluster_breaker_still_trips() -> None:
    c = cluster(count=4, stages=[{"nodes": "100%"}])
    c.step()
    for name in ("n3", "n4"):
        c.nodes[name].obj["status"]["conditions"][0]["status"] = "False"
    c.run(st.PAUSED)
    assert "notReadyNodes" in c.status.paused_reason  # type: ignore[union-attr]
    c.request = Request("r", "resume")
    c.step()
    assert c.status.phase == st.PAUSED and "resume refused" in c.status.message  # type: ignore[union-attr]
    for name in ("n3", "n4"):
        c.nodes[name].obj["status"]["conditions"][0]["status"] = "True"
    c.request = Request("r2", "resume")
    c.run(st.SUCCEEDED)


@pytest.mark.parametrize(("scope", "back"), [("all", 4), ("batch", 3), ("none", 0)])
def test_abort_rolls_back_what_it_is_asked_to(scope: str, back: int) -> None:
    c = cluster(
        count=4,
        soak="1h",
        stages=[{"nodes": "1", "soak": "0s"}, {"nodes": "100%", "maxParallel": "3"}],
    )
    c.run(st.SOAKING)  # stage 1 soaks for no time: stage 2 switched, soaking its hour
    assert c.status is not None and c.status.stage == 2
    c.request = Request("x", "abort", scope)
    c.run(st.FAILED)
    moved_back = [n for n, s in c.nodes.items() if s.switches[-1:] == ["iptables"]]
    assert len(moved_back) == back
    assert c.status.message == f"aborted (rollback: {scope})"


def test_maintenance_windows_gate_new_switches() -> None:
    spec = parse_spec(
        {
            "targetMode": "nftables",
            "maintenanceWindows": [
                {"days": ["Sat"], "start": "22:00", "end": "02:00", "timeZone": "UTC"}
            ],
        }
    )
    sat_23 = 1_798_326_000.0  # 2026-12-26 (a Saturday) 23:00 UTC
    assert in_window(spec.maintenance_windows, sat_23)
    assert in_window(spec.maintenance_windows, sat_23 + 2 * 3600)  # Sunday 01:00
    assert not in_window(spec.maintenance_windows, sat_23 + 4 * 3600)  # Sunday 03:00
    assert not in_window(spec.maintenance_windows, sat_23 - 86400)  # Friday 23:00
    c = Cluster(spec, {"n1": SimNode(node("n1"))}, now=sat_23 - 86400)
    for _ in range(5):
        c.step()
    assert c.state("n1") == st.PENDING and c.nodes["n1"].switches == []
    c.now = sat_23
    c.run(st.SOAKING)


def test_an_undo_sends_every_moved_node_back_to_its_own_previous_mode() -> None:
    from kproxy.cluster.rollout.plan import make_undo_plan

    c = cluster(count=3, stages=[{"nodes": "100%", "maxParallel": "3"}])
    c.nodes["n3"].ann[CURRENT_MODE] = "ipvs"  # the nodes came from two modes
    c.run(st.SUCCEEDED)
    undone = c.status
    assert undone is not None
    spec = parse_spec({"targetMode": "previous", "undoOf": "r1", "soak": "0s"})
    plan = make_undo_plan(spec, undone, c.objs())
    assert plan.targets == {"n1": "iptables", "n2": "iptables", "n3": "ipvs"}
    assert not plan.blockers
    undo = Cluster(spec, c.nodes, now=c.now, status=initial_status(plan, c.now))
    undo.run(st.SUCCEEDED)
    assert [undo.mode(n) for n in ("n1", "n2", "n3")] == ["iptables", "iptables", "ipvs"]
    assert undo.status is not None
    assert undo.status.message == "every node serves its previous mode again"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"targetMode": "previous"}, "targetMode: previous and undoOf go together"),
        ({"targetMode": "ipvs", "undoOf": "r1"}, "targetMode: previous and undoOf go together"),
    ],
)
def test_previous_is_only_an_undos_target(fields: dict[str, Any], message: str) -> None:
    from kproxy.cluster.rollout.spec import RolloutSpecError

    with pytest.raises(RolloutSpecError, match=message):
        parse_spec(fields)


def test_the_controllers_metrics_follow_the_status() -> None:
    from prometheus_client import generate_latest

    from kproxy.cluster.rollout.metrics import RolloutMetrics

    c = cluster(count=4, stages=[{"nodes": "100%", "maxParallel": "4"}])
    c.nodes["n2"].fail_to = "nftables"
    c.run(st.TERMINAL)
    metrics = RolloutMetrics()
    metrics.observe("r1", c.status)
    text = generate_latest(metrics.registry).decode()
    assert 'kproxy_rollout_phase{phase="Failed",rollout="r1"} 1.0' in text
    assert 'kproxy_rollout_phase{phase="Succeeded",rollout="r1"} 0.0' in text
    assert 'kproxy_rollout_nodes{rollout="r1",state="Done"} 3.0' in text
    assert 'kproxy_rollout_nodes{rollout="r1",state="RolledBack"} 1.0' in text
    assert (
        'kproxy_rollout_breaker_tripped{breaker="switchFailed",rollout="r1",scope="Node"} 1.0'
        in text
    )


def test_the_canary_is_held_against_the_nodes_not_switched_yet() -> None:
    """relativeToPeers: the canary trips above 3x the median p99 of the nodes waiting their
    turn (which publish readings from the start), not above a fixed number."""
    c = cluster(
        count=4,
        soak="1m",
        stages=[{"nodes": "1"}, {"nodes": "100%"}],
        breakers=[{"signal": "syncP99Seconds", "threshold": "0.01", "relativeToPeers": 3}],
    )
    for name in ("n2", "n3", "n4"):
        c.nodes[name].p99 = 0.2  # a busy fleet: 0.2 s is normal here
    c.run(st.SOAKING)
    assert ROLLOUT in c.nodes["n4"].ann  # the peers publish readings
    c.nodes["n1"].p99 = 0.5  # above the 0.01 s floor, below 3 x 0.2 s: fine
    c.step()
    c.step()
    assert c.state("n1") == st.SWITCHED
    c.nodes["n1"].p99 = 0.7
    c.step()
    c.step()
    assert c.state("n1") in (st.ROLLING_BACK_NODE, st.ROLLED_BACK)
    reading = next(b for b in c.status.breakers if b.node == "n1")  # type: ignore[union-attr]
    assert reading.tripped and "0.7 > 0.6" in reading.message
