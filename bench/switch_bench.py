"""Live switch duration (command start to old state gone) per mode pair, under load.

kproxy runs on a lab node with N services (each with the lab's 10 pods as endpoints, plus
one more the load goes to); `kproxy switch` is timed from the command line while fresh and
long-lived connections run; failures are counted.

    .venv/bin/python -m bench.switch_bench [--sizes 1000,10000] [--pairs iptables:nftables,...]
        [--port-range 32768-43767]

--port-range sets the config's portRange (userspace mode's proxy ports): the default
20000-29999 holds 10,000 listeners, fewer than 10,000 services need (preflight refuses).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from kproxy.lab.load import LoadHarness
from kproxy.lab.proxy import ProxyProcess
from kproxy.lab.topology import Lab

CONFIG = """\
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: {mode}
hostnameOverride: node1
clusterCIDR: 10.244.0.0/16
conntrack: {{maxPerCore: 0}}
portRange: "{port_range}"
"""


def write_objects(folder: Path, n: int, pods: list[str]) -> None:
    docs = []
    for i in range(n):
        name = f"svc{i:05d}"
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": name, "namespace": "bench"},
                "spec": {
                    "clusterIP": f"10.{96 + i // 65536}.{(i // 256) % 256}.{i % 256}",
                    "ports": [{"name": "http", "port": 80, "targetPort": 8080}],
                },
            }
        )
        eps = pods  # every service is served by the lab's pods (the switch self-probes them)
        docs.append(
            {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": f"{name}-1",
                    "namespace": "bench",
                    "labels": {"kubernetes.io/service-name": name},
                },
                "addressType": "IPv4",
                "ports": [{"name": "http", "port": 8080}],
                "endpoints": [{"addresses": [ip]} for ip in eps],
            }
        )
    docs.append(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "real", "namespace": "zzz"},
            "spec": {
                "clusterIP": "10.95.255.250",
                "ports": [{"name": "http", "port": 80, "targetPort": 8080}],
            },
        }
    )
    docs.append(
        {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": "real-1",
                "namespace": "zzz",
                "labels": {"kubernetes.io/service-name": "real"},
            },
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080}],
            "endpoints": [{"addresses": [ip]} for ip in pods],
        }
    )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "objects.yaml").write_text(
        yaml.dump_all(docs, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper))
    )


def run_pair(n: int, first: str, second: str, port_range: str = "") -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    with Lab(pods=10, clients=2) as lab, tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_objects(work / "objects", n, list(lab.pod_ips.values()))
        cfg = work / "config.yaml"
        cfg.write_text(CONFIG.format(mode=first, port_range=port_range))
        proxy = ProxyProcess(
            lab,
            work / "objects",
            config=cfg,
            args=["--iptables-backend", "nft"],
            workdir=work / "kp",
        )
        proxy.start(timeout=900)
        load = LoadHarness(lab, tcp=("10.95.255.250", 80)).start()
        try:
            for to in (second, first):
                t0 = time.monotonic()
                out = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "kproxy.cli",
                        "switch",
                        "--to",
                        to,
                        "--timeout",
                        "900",
                        "--json",
                        "--state-dir",
                        str(proxy.state_dir),
                    ],
                    capture_output=True,
                    text=True,
                    check=False,
                    timeout=1000,
                )
                wall = time.monotonic() - t0
                report = json.loads(out.stdout or "{}")
                steps = {s["name"]: s["seconds"] for s in report.get("steps", [])}
                rows.append(
                    {
                        "services": n,
                        "from": report.get("from_mode"),
                        "to": report.get("to_mode"),
                        "ok": report.get("ok"),
                        "seconds": round(wall, 2),
                        "preflight": report.get("preflight", {}).get("seconds"),
                        "preflight_checks": sorted(
                            report.get("preflight", {}).get("check_seconds", {}).items(),
                            key=lambda kv: -kv[1],
                        )[:6],
                        "steps": steps,
                        "program": steps.get("program"),
                        "verify": steps.get("verify"),
                        "cut_over": steps.get("cut-over"),
                        "remove": steps.get("remove"),
                        "error": report.get("error"),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
                time.sleep(2)
        finally:
            result = load.stop()
            proxy.stop()
        for r in rows:
            r["failed_requests"] = result.failures
            r["requests"] = result.fresh_sent + result.pings_sent
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sizes", default="1000")
    ap.add_argument("--pairs", default="iptables:nftables,iptables:userspace,nftables:userspace")
    ap.add_argument("--port-range", default="", help="the config's portRange (default: none)")
    args = ap.parse_args()
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        for pair in args.pairs.split(","):
            first, second = pair.split(":")
            rows += run_pair(n, first, second, args.port_range)
    print("\n| services | switch | ok | total s | program | verify | cut-over | remove | failed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['services']:,} | {r['from']} → {r['to']} | {r['ok']} | {r['seconds']} |"
            f" {r['program']} | {r['verify']} | {r['cut_over']} | {r['remove']} |"
            f" {r['failed_requests']} / {r['requests']} |"
        )


if __name__ == "__main__":
    main()
