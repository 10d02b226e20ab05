"""Cluster rollout figures on the lab as a cluster (four nodes, a kproxy on each following its
Node through the lab's API server, the controller in this process), at N services:

* the wall time of a full rollout iptables -> nftables (stages 1 / 50% / 100%, the last two
  nodes at once, soak --soak), and the node switch times inside it;
* a breaker trip: node1, switched to nftables, starts failing its syncs (its `nft` refuses
  transactions); the time from the fault to the verifyFailed trip (detection: the node's
  verify readings come every 10 s) and from the trip to node1 serving iptables again
  (goal: <= 30 s at 1,000 services);
* beside them, the bare kernel tools on the same ruleset in a scratch namespace: the
  iptables-nft-restore of node1's iptables rules and the nft load of its nftables rules,
  the floor under any switch between the two.

Traffic runs through every node's ClusterIP and NodePort all along; failed requests are
counted.

    .venv/bin/python -m bench.rollout_bench [--services 1000] [--soak 5s] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from kproxy.cluster.annotations import CURRENT_MODE, OBSERVED, SWITCH_STATE
from kproxy.cluster.rollout import status as st
from kproxy.cluster.rollout.controller import running_in_thread
from kproxy.config import parse_duration
from kproxy.lab.cluster import ClusterLab, failures
from kproxy.lab.topology import Lab

ROLLOUT = {
    "apiVersion": "proxy.kproxy.io/v1alpha1",
    "kind": "ProxyRollout",
    "spec": {
        "targetMode": "nftables",
        "stages": [{"nodes": "1"}, {"nodes": "50%"}, {"nodes": "100%", "maxParallel": "2"}],
    },
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def status(cluster: ClusterLab, name: str) -> dict[str, Any]:
    return (cluster.store.get("ProxyRollout", "", name) or {}).get("status") or {}


def wait(check: Any, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise TimeoutError(what)
        time.sleep(0.05)
    return time.monotonic()


def switch_seconds(cluster: ClusterLab) -> dict[str, float]:
    """Each node's last switch duration, from its kproxy's status."""
    out = {}
    for name, proxy in cluster.proxies.items():
        last = proxy.status().get("last_switch") or {}
        if last.get("duration") is not None:
            out[name] = float(last["duration"])
    return out


def full_rollout(cluster: ClusterLab, soak: str) -> dict[str, Any]:
    body = {**ROLLOUT, "metadata": {"name": "full"}}
    body["spec"] = {**ROLLOUT["spec"], "soak": soak}
    load = cluster.load().start()
    started = time.monotonic()
    cluster.store.create(body)
    ended = wait(lambda: status(cluster, "full").get("phase") in st.TERMINAL, 900, "full rollout")
    results = load.stop()
    return {
        "phase": status(cluster, "full").get("phase"),
        "wall_seconds": round(ended - started, 2),
        "soak_seconds_in_it": 3 * parse_duration(soak),
        "node_switch_seconds": switch_seconds(cluster),
        "requests": sum(r.fresh_sent + r.pings_sent + r.udp_sent for r in results.values()),
        "failed": failures(results),
    }


def trip_and_back(cluster: ClusterLab, workdir: Path) -> dict[str, Any]:
    """Roll node1 alone to nftables, break its syncs, time detection and the way back."""
    real = shutil.which("nft") or "/usr/sbin/nft"
    folder = workdir / "nft-node1"
    flag = folder / "failing"
    body = {**ROLLOUT, "metadata": {"name": "trip"}}
    body["spec"] = {
        "targetMode": "nftables",
        "soak": "1h",
        "stages": [{"nodes": "100%"}],
        "nodeSelector": {"matchLabels": {"kubernetes.io/hostname": "node1"}},
        "breakers": [{"signal": "switchFailed"}, {"signal": "verifyFailed"}],
    }
    cluster.store.create(body)
    wait(lambda: status(cluster, "trip").get("phase") == st.SOAKING, 600, "node1 switched")
    # node1's kproxy was started with this folder first in its PATH (see main)
    (folder / "nft").write_text(
        "#!/bin/sh\n"
        f'if [ -e {flag} ]; then for a in "$@"; do [ "$a" = "-f" ] && exit 1; done; fi\n'
        f'exec {real} "$@"\n'
    )
    load = cluster.load().start()
    flag.touch()
    fault = time.monotonic()
    cluster.store.create(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": f"trigger-{uuid.uuid4().hex[:6]}", "namespace": "default"},
            "spec": {"ports": [{"port": 81, "targetPort": 8080}]},
        }
    )

    def tripped() -> bool:
        return any(b.get("tripped") for b in status(cluster, "trip").get("breakers", []))

    trip = wait(tripped, 120, "breaker trip")

    def back() -> bool:
        ann = cluster.node_annotations("node1")
        return (
            ann.get(CURRENT_MODE) == "iptables"
            and ann.get(OBSERVED) == "iptables"
            and ann.get(SWITCH_STATE) != "switching"
        )

    serving = wait(back, 300, "node1 back on iptables")
    flag.unlink()
    results = load.stop()
    return {
        "fault_to_trip_seconds": round(trip - fault, 2),
        "trip_to_previous_seconds": round(serving - trip, 2),
        "node1_switch_back_seconds": switch_seconds(cluster).get("node1"),
        "failed": failures(results),
    }


def node1_rules(cluster: ClusterLab) -> tuple[str, str]:
    """node1's iptables rules (iptables-nft-save) and kube-proxy nft table, as they are now."""
    node1 = cluster.lab.nodes[0].ns
    ipt = cluster.lab.exec(node1, ["iptables-nft-save"]).stdout
    nft = cluster.lab.exec(node1, ["nft", "list", "table", "ip", "kube-proxy"], check=False)
    return ipt, nft.stdout


def bare_tools(ipt: str, nft: str) -> dict[str, float]:
    """node1's rules of each mode loaded by the bare tools into a scratch namespace: the
    floor under a switch between the two."""
    ns = f"kpb-roll-{uuid.uuid4().hex[:6]}"
    out: dict[str, float] = {}
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        for name, argv, data in (
            ("iptables_nft_restore_seconds", ["iptables-nft-restore"], ipt),
            ("nft_load_seconds", ["nft", "-f", "-"], nft),
        ):
            if not data.strip():
                continue
            t0 = time.monotonic()
            subprocess.run(["ip", "netns", "exec", ns, *argv], input=data, text=True, check=True)
            out[name] = round(time.monotonic() - t0, 3)
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.rollout_bench", description=__doc__)
    ap.add_argument("--services", type=int, default=1000)
    ap.add_argument("--soak", default="5s")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="kproxy-rollout-bench-"))
    (workdir / "nft-node1").mkdir()
    (workdir / "nft-node1" / "nft").write_text(f'#!/bin/sh\nexec {shutil.which("nft")} "$@"\n')
    (workdir / "nft-node1" / "nft").chmod(0o755)
    figures: dict[str, Any] = {"services": args.services, "nodes": 4}
    with (
        Lab(pods=8, clients=1, nodes=4, prefix="kpbro") as lab,
        ClusterLab(
            lab,
            workdir / "cluster",
            services=args.services,
            path_prefixes={"node1": workdir / "nft-node1"},
        ) as cluster,
        running_in_thread(cluster.settings(), lease_namespace="default", interval=0.2),
    ):
        log(f"cluster up: 4 nodes, {args.services + 1} services")
        figures["full_rollout"] = full_rollout(cluster, args.soak)
        log(f"full rollout: {figures['full_rollout']}")
        _, nft_rules = node1_rules(cluster)
        # node1 back to iptables first (an undo of the full rollout would do it too)
        cluster.store.patch(
            "Node", "", "node1", {"metadata": {"annotations": {"proxy.kproxy.io/mode": None}}}
        )
        wait(
            lambda: cluster.node_annotations("node1").get(CURRENT_MODE) == "iptables",
            300,
            "node1 back to its configured iptables",
        )
        figures["trip"] = trip_and_back(cluster, workdir)
        log(f"trip: {figures['trip']}")
        ipt_rules, _ = node1_rules(cluster)
        figures["bare_tools"] = bare_tools(ipt_rules, nft_rules)
        log(f"bare tools: {figures['bare_tools']}")
    text = json.dumps(figures, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
