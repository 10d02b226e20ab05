"""Faults at every step of a sync and of a mode switch, with traffic flowing.

Each external tool (iptables-restore, nft, conntrack) fails, hangs past the tool timeout, is killed,
or is killed after its commit; kproxy's netlink batches fail or hang; the state dir turns
read-only or full; kproxy itself is killed -9 in the middle of syncs and switches. Every
time: the service nobody changes keeps answering (0 failed requests), the fault shows in
`kproxy status`, the metrics and /healthz (503 once a change has waited 2 x syncPeriod,
as upstream), and kproxy recovers by itself once the fault is gone, with nothing of a mode
that does not serve left behind. The cases and what they observe: kproxy.lab.fault_matrix
(bench/fault_bench.py runs them many times).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from kproxy.lab.fault_matrix import (
    FaultRig,
    Outcome,
    conntrack_faults,
    switch_faults,
    sync_faults,
    wait_for,
)
from kproxy.lab.topology import Lab
from tests.support.lab import LAB_SKIP_REASON, LAB_SUPPORTED

pytestmark = pytest.mark.kernel


@pytest.fixture
def lab4() -> Iterator[Lab]:
    """A lab of 4 pods (the fault matrix's two services), torn down even on failure."""
    if not LAB_SUPPORTED:
        pytest.skip(f"lab unavailable: {LAB_SKIP_REASON}")
    with Lab(pods=4) as lab:
        yield lab


def check(outcomes: list[Outcome], rig: FaultRig) -> None:
    bad = [o for o in outcomes if not o.ok]
    assert not bad, "\n".join(map(str, bad)) + "\n" + rig.proxy.log_tail(30)
    result = rig.stop()
    assert result is not None and result.fresh_sent > 100, result
    assert not rig.udp or result.udp_sent > 50, result
    assert result.failures == 0 and result.streams_dropped == 0, result.summary()


# nftables-compact: nftables mode in the compact layout (layouts.target_name)
@pytest.mark.parametrize("mode", ["iptables", "nftables", "nftables-compact"])
def test_sync_faults_keep_the_last_good_rules_and_recover(
    lab4: Lab, tmp_path: Path, mode: str
) -> None:
    rig = FaultRig(lab4, tmp_path, mode).start()
    try:
        outcomes = [rig.sync_case(*case) for case in sync_faults(mode)]
        # The tools' wrappers count the faults they meet; a netlink fault of the apply step
        # (the compact layout's) shows in the failed sync's error.
        netlink = [o for o in outcomes if o.step == "sync: apply" and "netlink" in o.fault]
        assert all("(injected fault)" in o.notes for o in netlink), netlink
        assert rig.faults.hits() >= len(outcomes) - len(netlink), "a fault was never reached"
        # A failed apply is a failed sync (healthz 503 after 2 x syncPeriod); a failed
        # cleanup is not (the sync went on, as upstream's).
        assert all(o.healthz_503 for o in outcomes if o.step == "sync: apply")
        check(outcomes, rig)
    finally:
        rig.stop()


def test_conntrack_faults_leave_the_sync_going_and_clean_up_later(
    lab4: Lab, tmp_path: Path
) -> None:
    """UDP load on "web"; "moving" loses its UDP endpoint while the conntrack tool fails,
    hangs past the tool timeout or is killed: the rules follow, the stale flow stays on
    the old endpoint until the fault is gone, and then is moved without another change."""
    rig = FaultRig(lab4, tmp_path, "iptables", udp=True).start()
    try:
        outcomes = [rig.conntrack_case(fault, inject) for fault, inject in conntrack_faults()]
        assert rig.faults.hits("conntrack") >= len(outcomes), "a fault was never reached"
        for o in outcomes:
            # Not a failed sync: /healthz stays 200, and the stale flow was not deleted.
            assert o.notes.startswith("healthz 200; during the fault the UDP flow went to pod"), o
            old = o.notes.split("(was ", 1)[1].split(")", 1)[0]
            assert f"went to {old} " in o.notes, o
        # The fault gone, the next removal of a UDP endpoint cleans its flows at once.
        rig.move()
        wait_for(rig.converged, 30, "the next removal's flow moved")
        check(outcomes, rig)
    finally:
        rig.stop()


@pytest.mark.parametrize(("old", "to"), [("iptables", "nftables"), ("nftables", "iptables")])
def test_switch_faults_leave_one_mode_serving(lab4: Lab, tmp_path: Path, old: str, to: str) -> None:
    rig = FaultRig(lab4, tmp_path, old).start()
    try:
        outcomes = [
            rig.switch_case(fault, step, to, inject)
            for fault, step, inject in switch_faults(old, to)
        ]
        steps = {o.step for o in outcomes}
        assert {"switch: anchor", "switch: program", "switch: cut-over"} <= steps
        # Before the cut-over, and at it, a fault fails the switch and the old mode serves.
        failed = [o for o in outcomes if not o.notes.startswith("switched")]
        assert {o.step for o in failed} >= {"switch: program", "switch: cut-over"}, outcomes
        check(outcomes, rig)
    finally:
        rig.stop()


def test_state_dir_read_only_or_full(lab4: Lab, tmp_path: Path) -> None:
    rig = FaultRig(lab4, tmp_path, "iptables", state_tmpfs="4m").start()
    try:
        outcomes = [rig.state_dir_case(fault) for fault in ("read-only", "full")]
        # Syncs go on; a switch refuses to start without its "before" record.
        assert all("before the switch" in o.notes for o in outcomes), outcomes
        check(outcomes, rig)
    finally:
        rig.stop()


@pytest.mark.parametrize("mode", ["iptables", "nftables"])
def test_kill_9_during_syncs_and_switches(lab4: Lab, tmp_path: Path, mode: str) -> None:
    """nftables: a kill between the flush of a stale endpoint chain and its deletion once
    left the chain empty, and the restarted proxy reused it for a service that wanted that
    endpoint back (the service answered nothing until the next full rewrite)."""
    rng = random.Random(0x6B70)
    rig = FaultRig(lab4, tmp_path, mode).start()
    try:
        outcomes = [rig.kill_case(rng, during) for during in ["sync", "switch"] * 2]
        check(outcomes, rig)
    finally:
        rig.stop()
