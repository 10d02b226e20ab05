"""Faults in ipvs mode's sync, inside UML (the only kernel with IPVS), with traffic flowing.

kproxy.lab.fault_matrix's rig in ipvs mode: load on "web", which nobody changes, while
"moving" flips to another pod and the sync meets a fault: `ipset restore` (the flip changes
the hairpin set) fails, hangs past the tool timeout and is killed; kproxy's IPVS netlink
batch fails and gets no answer. Each time: no failed request to "web", the failure in
`kproxy status` and kproxy_sync_failures_total{mode="ipvs"} (upstream's ipvs mode counts
only its iptables-restore failures), /healthz 503 once the change has waited 2 x
syncPeriod, and, the fault gone, kproxy converges by itself with "moving" served by its new
pod.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kproxy.lab.fault_matrix import FaultRig, ipvs_sync_faults
from kproxy.lab.topology import Lab
from tests.support.uml import Guest

pytestmark = pytest.mark.kernel


@pytest.fixture
def lab4() -> Iterator[Lab]:
    """A lab of 4 pods (the fault matrix's two services), torn down even on failure."""
    with Lab(pods=4) as lab:
        yield lab


# kproxy's --tool-timeout: in a UML guest an unhindered `ipset save` can take over the
# rig's usual 1 s; the hang still runs past it.
TOOL_TIMEOUT = 5.0
# What each case's failure says (its sync's last_error, cut to 160 characters).
EXPECTED_ERROR = {
    "ipset restore fails": "ipset restore failed",
    "ipset restore hangs": "killed (tool timeout)",
    "ipset restore killed": "killed by SIGKILL",
    "ipvs netlink batch fails": "netlink failed",
    "ipvs netlink batch hangs": "netlink batch unanswered",
}


def test_ipset_and_ipvs_netlink_faults_keep_the_untouched_service(
    guest: Guest, lab4: Lab, tmp_path: Path
) -> None:
    guest.require("ip_vs")
    rig = FaultRig(lab4, tmp_path, "ipvs", backend="legacy", tool_timeout=TOOL_TIMEOUT)
    try:
        rig.start(timeout=60)
        outcomes = []
        for case in ipvs_sync_faults():
            hits = rig.faults.hits("ipset")
            outcome = rig.sync_case(*case)
            outcomes.append(outcome)
            if case[0].startswith("ipset"):
                assert rig.faults.hits("ipset") > hits, f"{case[0]}: never met its fault"
        assert [o.fault for o in outcomes] == list(EXPECTED_ERROR)
        # Every case's problems at once, with kproxy's log: one run shows them all.
        problems = [
            f"{o.fault}: {why}"
            for o in outcomes
            for why, bad in (
                (
                    f"its error is not {EXPECTED_ERROR[o.fault]!r}",
                    EXPECTED_ERROR[o.fault] not in o.notes,
                ),
                ("no /healthz 503", not o.healthz_503),
                ("not ok", not o.ok),
            )
            if bad
        ]
        assert not problems, (
            "\n".join([*problems, *map(str, outcomes), f"last divergence: {rig.last_divergence}"])
            + "\n"
            + rig.proxy.log_tail(60)
        )
        result = rig.stop()
        assert result is not None and result.fresh_sent > 50, result
        assert result.failures == 0 and result.streams_dropped == 0, result.summary()
    finally:
        print(f"kproxy status CLI wall times (s): {rig.status_seconds}")
        rig.stop()
