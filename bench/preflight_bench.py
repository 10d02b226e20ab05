"""Preflight of a switch beside a running kproxy, and the bare tools on the same node.

kproxy runs on a lab node with N services (bench.switch_bench's objects) in the first mode;
the preflight `kproxy switch --to SECOND` runs (asked of the running kproxy, the backup left
to the switch) is timed, then `kproxy preflight --to SECOND --json` from the command line
(asking the running kproxy, and with --no-daemon the path that reads everything itself),
with the per-check times each reports. Beside it, in the node's namespace: `nft list
table` in text and JSON, `nft list tables`, and the service map alone.

    .venv/bin/python -m bench.preflight_bench [--sizes 1000,3000] [--pairs nftables:iptables]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.switch_bench import CONFIG, write_objects
from kproxy.lab.proxy import ProxyProcess
from kproxy.lab.topology import Lab

TOOLS = {
    "nft list tables": ["nft", "list", "tables"],
    "nft list table (text)": ["nft", "list", "table", "ip", "kube-proxy"],
    "nft -j list table": ["nft", "-j", "list", "table", "ip", "kube-proxy"],
    "nft -j list map service-ips": ["nft", "-j", "list", "map", "ip", "kube-proxy", "service-ips"],
    "iptables-nft-save": ["iptables-nft-save"],
}


def timed(argv: list[str]) -> tuple[float, subprocess.CompletedProcess[str]]:
    t0 = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=1800)
    return time.monotonic() - t0, proc


def preflight(state_dir: Path, to: str, *extra: str) -> dict[str, object]:
    argv = [sys.executable, "-m", "kproxy.cli", "preflight", "--to", to, "--json"]
    wall, proc = timed([*argv, "--state-dir", str(state_dir), *extra])
    report = json.loads(proc.stdout or "{}")
    checks = sorted(report.get("check_seconds", {}).items(), key=lambda kv: -kv[1])
    return {
        "wall": round(wall, 2),
        "seconds": report.get("seconds"),
        "path": report.get("path"),
        "exit": proc.returncode,
        "findings": sorted(f["id"] for f in report.get("findings", [])),
        "top_checks": [(k, round(v, 2)) for k, v in checks[:5]],
        "error": None if report else proc.stderr[-600:],
    }


def switch_preflight(state_dir: Path, to: str) -> dict[str, object]:
    """The preflight `kproxy switch` runs (the backup left to the switch), asked directly."""
    from kproxy.ops.inputs import OpsInputs, running_status
    from kproxy.ops.preflight.cli import ask_running

    t0 = time.monotonic()
    inputs = OpsInputs(state_dir)
    inputs = OpsInputs(state_dir, status=running_status(inputs))
    result, note = ask_running(inputs, to, backup="switch")
    wall = time.monotonic() - t0
    if result is None:
        return {"wall": round(wall, 2), "error": note}
    checks = sorted(result.check_seconds.items(), key=lambda kv: -kv[1])
    return {
        "wall": round(wall, 2),
        "seconds": round(result.seconds, 3),
        "path": result.path,
        "findings": sorted(f.id for f in result.findings),
        "checks": [(k, round(v, 2)) for k, v in checks if v >= 0.05],
        "load": [round(x, 2) for x in os.getloadavg()],
    }


def run(n: int, first: str, second: str, switch_only: bool = False) -> dict[str, object]:
    with Lab(pods=2, clients=1) as lab, tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_objects(work / "objects", n, list(lab.pod_ips.values()))
        cfg = work / "config.yaml"
        cfg.write_text(CONFIG.format(mode=first, port_range="32768-43767"))
        proxy = ProxyProcess(lab, work / "objects", config=cfg, workdir=work / "kp")
        proxy.start(timeout=1800)
        try:
            row: dict[str, object] = {"services": n, "from": first, "to": second}
            row["switch"] = switch_preflight(proxy.state_dir, second)
            # again: the first one pays the daemon's import of the check modules
            row["switch_again"] = switch_preflight(proxy.state_dir, second)
            if switch_only:
                print(json.dumps(row), flush=True)
                return row
            row["live"] = preflight(proxy.state_dir, second)
            row["full"] = preflight(proxy.state_dir, second, "--no-daemon")
            tools = {}
            for name, argv in TOOLS.items():
                seconds, proc = timed(["ip", "netns", "exec", lab.node_ns, *argv])
                tools[name] = (round(seconds, 2), len(proc.stdout))
            row["tools"] = tools
        finally:
            proxy.stop()
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sizes", default="1000")
    ap.add_argument("--pairs", default="nftables:iptables,iptables:nftables")
    ap.add_argument("--switch-only", action="store_true", help="only the switch's preflight")
    args = ap.parse_args()
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        for pair in args.pairs.split(","):
            first, second = pair.split(":")
            rows.append(run(n, first, second, args.switch_only))
    if args.switch_only:
        return 0
    print(
        "\n| services | switch | switch's preflight s | preflight live s | preflight full s"
        " | same findings |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        gate, live, full = r["switch"], r["live"], r["full"]
        assert isinstance(gate, dict) and isinstance(live, dict) and isinstance(full, dict)
        print(
            f"| {r['services']:,} | {r['from']} → {r['to']}"
            f" | {gate['wall']} ({gate.get('seconds')})"
            f" | {live['wall']} ({live['seconds']})"
            f" | {full['wall']} ({full['seconds']}) | {live['findings'] == full['findings']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
