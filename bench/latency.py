"""NEW-connection latency through iptables and nftables mode at 100 and 10,000 services.

Modes: iptables-nft, iptables-legacy, nftables (upstream's layout), nftables-compact.

The number the seeds argue about: iptables walks KUBE-SERVICES rule by rule for the first
packet of a connection, nftables looks the service up in a map. The measured service sits
last in KUBE-SERVICES (its name sorts last); the others have 10 unreachable endpoints each.
Each setup: >= 2,000 sequential fresh connections from a client namespace, connect() only
(SYN to SYN-ACK through the node), timed in the client; p50 and p99 in microseconds.

    .venv/bin/python -m bench.latency [--sizes 100,10000] [--connections 2000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from bench.machine import loadavg
from kproxy.dataplane.facts import NodeFacts, RuleOptions
from kproxy.dataplane.iptables.backend import IptablesBackend
from kproxy.dataplane.iptables.proxier import IptablesDataplane
from kproxy.dataplane.nftables.layouts import DATAPLANES
from kproxy.dataplane.nftables.proxier import NftablesDataplane
from kproxy.lab.topology import Lab
from kproxy.model.snapshot import ChangeTracker
from kproxy.sources.base import ObjectEvent, ObjectKey

TARGET = ("10.95.255.250", 80)
CLIENT = r"""
import socket, sys, time
ip, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
out = []
fails = 0
for _ in range(n):
    s = socket.socket()
    s.settimeout(2)
    t = time.perf_counter_ns()
    try:
        s.connect((ip, port))
        out.append((time.perf_counter_ns() - t) / 1000)
    except OSError:
        fails += 1
    s.close()
print(" ".join(f"{x:.1f}" for x in out))
print(fails)
"""


def events(n: int, pod_ips: list[str]) -> list[ObjectEvent]:
    evs = []
    for i in range(n):
        name = f"svc{i:05d}"
        ip = f"10.{96 + i // 65536}.{(i // 256) % 256}.{i % 256}"
        evs.append(_service("bench", name, ip))
        eps = [
            f"10.{200 + (i * 10 + j) // 65536}.{((i * 10 + j) // 256) % 256}.{(i * 10 + j) % 256}"
            for j in range(10)
        ]
        evs.append(_slice("bench", name, eps))
    evs.append(_service("zzz", "zzz-real", TARGET[0]))
    evs.append(_slice("zzz", "zzz-real", pod_ips))
    return evs


def _service(ns: str, name: str, ip: str) -> ObjectEvent:
    obj = {
        "kind": "Service",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"clusterIP": ip, "ports": [{"name": "http", "port": 80, "targetPort": 8080}]},
    }
    return ObjectEvent(ObjectKey("Service", ns, name), obj)


def _slice(ns: str, name: str, ips: list[str]) -> ObjectEvent:
    obj = {
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{name}-1",
            "namespace": ns,
            "labels": {"kubernetes.io/service-name": name},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080}],
        "endpoints": [{"addresses": [ip]} for ip in ips],
    }
    return ObjectEvent(ObjectKey("EndpointSlice", ns, f"{name}-1"), obj)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def measure(mode: str, n: int, connections: int, repeats: int) -> dict[str, object]:
    with Lab(pods=3, clients=1) as lab:
        facts = NodeFacts(node_ips=(lab.node_ip,), local_addresses=(lab.node_ip,))
        options = RuleOptions(cluster_cidrs=(lab.cluster_cidr,))
        tracker = ChangeTracker("node1")
        tracker.apply(events(n, list(lab.pod_ips.values())))
        snapshot = tracker.snapshot()
        if mode in DATAPLANES:
            plane = NftablesDataplane(facts, options, netns=lab.node_ns, layout=DATAPLANES[mode])
        else:
            plane = IptablesDataplane(
                IptablesBackend(mode.split("-", 1)[1], netns=lab.node_ns), facts, options
            )
        t0 = time.monotonic()
        plane.sync(snapshot, full=True)
        programmed = time.monotonic() - t0
        time.sleep(2)  # let the kernel settle after a big load (dataplane-lab §2.2 noise)
        runs = []
        failures = 0
        for _ in range(repeats):
            out = lab.exec(
                lab.client_ns[0],
                [sys.executable, "-c", CLIENT, TARGET[0], str(TARGET[1]), str(connections)],
                timeout=600,
            ).stdout.split("\n")
            lat = [float(x) for x in out[0].split()]
            failures += int(out[1])
            runs.append((percentile(lat, 0.5), percentile(lat, 0.99)))
        return {
            "mode": mode,
            "services": n,
            "program_seconds": round(programmed, 2),
            "p50_us": round(statistics.median(r[0] for r in runs), 1),
            "p99_us": round(statistics.median(r[1] for r in runs), 1),
            "connections": connections * repeats,
            "failures": failures,
            "load": loadavg(),  # at the end of the measurement
        }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sizes", default="100,10000")
    ap.add_argument("--modes", default="iptables-nft,iptables-legacy,nftables,nftables-compact")
    ap.add_argument("--connections", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        for mode in args.modes.split(","):
            row = measure(mode, n, args.connections, args.repeats)
            rows.append(row)
            print(json.dumps(row), flush=True)
    header = "| services | mode | p50 µs | p99 µs | connections | failed | programmed | load |"
    print(f"\n{header}")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['services']:,} | {r['mode']} | {r['p50_us']} | {r['p99_us']} |"
            f" {r['connections']:,} | {r['failures']} | {r['program_seconds']} s | {r['load']} |"
        )
    sizes = sorted({int(str(r["services"])) for r in rows})
    if len(sizes) > 1:  # the goal's figure: p50 at the largest size against the smallest
        for mode in args.modes.split(","):
            p50 = {r["services"]: r["p50_us"] for r in rows if r["mode"] == mode}
            small, large = float(p50[sizes[0]]), float(p50[sizes[-1]])
            print(
                f"{mode}: p50 at {sizes[-1]:,} is {100 * (large / small - 1):+.1f} % of"
                f" {sizes[0]:,}"
            )


if __name__ == "__main__":
    main()
