"""The fault matrix, many times: faults at each step of syncs and switches, kill -9 of
kproxy in the middle of them, with traffic to a service nobody changes.

    .venv/bin/python -m bench.fault_bench [--iterations 5] [--kills 20]
        [--modes iptables,nftables,nftables-compact] [--json FILE]

Each fault case (kproxy.lab.fault_matrix: the sync's tools, the switch's steps, the state
dir, and the conntrack tool in the cleanup of stale UDP flows) runs --iterations times per
mode ("nftables-compact": nftables mode in the compact layout), the kill -9 of
kproxy --kills times per mode (half during syncs, half during switches, at random moments).
Prints one row per fault and step: iterations, failed requests to the untouched service,
how many recovered by themselves, and the time to recover (median / max) from the fault's
removal (for kill -9: from the restart) to the node converged (one mode in the packet path,
the changed service served by its new endpoint, no error in status, /healthz 200).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kproxy.lab.fault_matrix import (
    FaultRig,
    Outcome,
    conntrack_faults,
    switch_faults,
    sync_faults,
)
from kproxy.lab.topology import Lab

OTHER = {"iptables": "nftables", "nftables": "iptables", "nftables-compact": "iptables"}


def run_mode(lab: Lab, workdir: Path, mode: str, iterations: int, kills: int) -> list[Outcome]:
    outcomes: list[Outcome] = []

    def repeat(make: Callable[[FaultRig], Outcome], rig: FaultRig) -> None:
        for _ in range(iterations):
            outcomes.append(make(rig))
            print(f"  {outcomes[-1].fault} @ {outcomes[-1].step}: ok={outcomes[-1].ok}", flush=True)

    rig = FaultRig(lab, workdir / f"{mode}-faults", mode).start()
    try:
        for case in sync_faults(mode):
            repeat(lambda r, c=case: r.sync_case(*c), rig)
        for fault, step, inject in switch_faults(mode, OTHER[mode]):
            repeat(lambda r, f=fault, s=step, i=inject: r.switch_case(f, s, OTHER[mode], i), rig)
    finally:
        rig.stop()
    rig = FaultRig(lab, workdir / f"{mode}-conntrack", mode, udp=True).start()
    try:
        for fault, inject in conntrack_faults():
            repeat(lambda r, f=fault, i=inject: r.conntrack_case(f, i), rig)
    finally:
        rig.stop()
    rig = FaultRig(lab, workdir / f"{mode}-state", mode, state_tmpfs="4m").start()
    try:
        for fault in ("read-only", "full"):
            repeat(lambda r, f=fault: r.state_dir_case(f), rig)
    finally:
        rig.stop()
    rig = FaultRig(lab, workdir / f"{mode}-kill", mode).start()
    rng = random.Random(time.time_ns())
    try:
        for i in range(kills):
            outcomes.append(rig.kill_case(rng, "sync" if i % 2 == 0 else "switch"))
            print(f"  kill -9 @ {outcomes[-1].step}: ok={outcomes[-1].ok}", flush=True)
    finally:
        rig.stop()
    return outcomes


def table(outcomes: list[Outcome]) -> str:
    rows: dict[tuple[str, str, str], list[Outcome]] = {}
    for o in outcomes:
        rows.setdefault((o.mode, o.fault, o.step), []).append(o)
    lines = [
        "| mode | fault | step | iterations | failed requests | recovered | time to recover"
        " (median / max) | all checks |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (mode, fault, step), group in rows.items():
        times = [o.recover_seconds for o in group if o.recover_seconds is not None]
        took = f"{statistics.median(times):.2f} / {max(times):.2f} s" if times else "-"
        recovered = sum(o.recovered for o in group)
        lines.append(
            f"| {mode} | {fault} | {step} | {len(group)} | "
            f"{sum(o.failed_requests for o in group)} | "
            f"{'yes' if recovered == len(group) else f'{recovered} of {len(group)}'} | {took} | "
            f"{sum(o.ok for o in group)} of {len(group)} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=5, help="runs of each fault case")
    parser.add_argument("--kills", type=int, default=20, help="kill -9 of kproxy per mode")
    parser.add_argument("--modes", default="iptables,nftables,nftables-compact")
    parser.add_argument("--json", type=Path, help="also write every outcome here")
    args = parser.parse_args()
    started = time.monotonic()
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="fault-bench-") as tmp, Lab(pods=4) as lab:
        for mode in args.modes.split(","):
            print(f"{mode}:", flush=True)
            outcomes += run_mode(lab, Path(tmp), mode, args.iterations, args.kills)
    print()
    print(table(outcomes))
    bad = [o for o in outcomes if not o.ok]
    print(f"\n{len(outcomes)} cases in {time.monotonic() - started:.0f} s; {len(bad)} not ok")
    for o in bad:
        print(f"  {o}")
    if args.json:
        args.json.write_text(json.dumps([o.__dict__ for o in outcomes], indent=1))


if __name__ == "__main__":
    main()
