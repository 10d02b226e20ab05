"""ipvs mode inside User-Mode Linux: full sync and one-service update at N services, against
`ipvsadm-restore` of the same virtual servers and against iptables mode in the same guest.

    python -m bench.ipvs_bench [--sizes 1000,10000] [--no-ipvsadm-above N]

boots one UML guest (the host kernel has no ip_vs) and runs this module with --inside
there; the guest writes its figures as JSON into the run dir, the host prints them. Each
load runs in a fresh network namespace of the guest, deleted afterwards. The workload is
bench/workload.py's: N ClusterIP services with 10 endpoints each (dataplane-lab.md §2.1),
and a one-service update replaces the 10 endpoints of one service.

Measured per size:
* kproxy ipvs: the initial full sync (empty node), a full resync of the programmed node
  (the periodic one: kernel read and diff), a one-service partial sync, with the phases;
* ipvsadm-restore: the same virtual and real servers from `ipvsadm -S -n` text (one netlink
  request per line), and the one-service change as 10 -d + 10 -a lines;
* kproxy iptables (iptables-legacy, the only backend UML has): initial full sync and a
  one-service partial sync, with the same snapshots.
UML makes every syscall a host round trip, so absolute figures are far above a real
kernel's; the ratios between the three compare like with like.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(n: int, *, ipvsadm: bool) -> dict[str, Any]:
    """One size, inside the guest (each part builds its own objects, freed when it ends)."""
    from bench import workload

    out: dict[str, Any] = {"services": n, "real_servers": n * workload.ENDPOINTS_PER_SERVICE}
    out.update(_ipvs_part(n))
    print(f"  ipvs: {out['ipvs_initial']:.2f} s initial", flush=True)
    if ipvsadm:
        out.update(_ipvsadm_part(n))
        print(f"  ipvsadm-restore: {out['ipvsadm_restore']:.2f} s", flush=True)
    out.update(_iptables_part(n))
    return out


def _setup() -> tuple[Any, Any]:
    from bench import workload
    from kproxy.dataplane.facts import RuleOptions

    return workload.facts(), RuleOptions(cluster_cidrs=(workload.CLUSTER_CIDR,))


def _ipvs_part(n: int) -> dict[str, Any]:
    from bench import netns, workload
    from kproxy.dataplane.iptables.backend import IptablesBackend
    from kproxy.dataplane.ipvs.proxier import IpvsDataplane

    facts, options = _setup()
    tracker = workload.tracker(n)
    snap = tracker.snapshot()
    changed = workload.change_one(tracker, n // 2, 1)
    out: dict[str, Any] = {}
    ns = netns.create()
    try:
        dp = IpvsDataplane(IptablesBackend("legacy", netns=ns), facts, options, netns=ns)
        dp.prepare()
        out["ipvs_initial"] = _timed(lambda: dp.sync(snap, full=True))
        out["ipvs_initial_phases"] = dict(dp.last_timings)
        dp.sync(snap, full=False)  # the one after a full sync also rewrites iptables
        out["ipvs_resync"] = _timed(lambda: dp.sync(snap, full=True))
        out["ipvs_resync_phases"] = dict(dp.last_timings)
        dp.sync(snap, full=False)
        out["ipvs_partial"] = _timed(lambda: dp.sync(changed, full=False))
        out["ipvs_partial_phases"] = dict(dp.last_timings)
        kernel = subprocess.run(
            ["ip", "netns", "exec", ns, "ipvsadm", "-S", "-n"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        out["ipvs_kernel_lines"] = len(kernel.splitlines())
        dp.close()
    finally:
        netns.delete(ns)
    return out


def _ipvsadm_part(n: int) -> dict[str, Any]:
    from bench import netns, workload
    from kproxy.dataplane.ipvs.plan import IpvsPlanner, VSKey
    from kproxy.dataplane.ipvs.render import RenderedDest, dest_line, plan_ipvsadm

    facts, options = _setup()
    out: dict[str, Any] = {}
    # The state before the change, as `ipvsadm -S -n` prints it (what -R reads).
    initial = plan_ipvsadm(IpvsPlanner(facts, options).plan(workload.tracker(n).snapshot(), ()))
    out["ipvsadm_lines"] = len(initial.splitlines())
    vip = workload._ip(workload._SERVICE_BASE + n // 2)
    key = VSKey("TCP", vip, 80)
    adds = [dest_line(key, RenderedDest(ip, 8080)) for ip in workload.endpoint_ips(n // 2, 1)]
    dels = [f"-d -t {vip}:80 -r {ip}:8080" for ip in workload.endpoint_ips(n // 2)]
    change = "\n".join(adds + dels) + "\n"
    ns = netns.create()
    try:
        out["ipvsadm_restore"] = _timed(lambda: _ipvsadm_restore(ns, initial))
        out["ipvsadm_change"] = _timed(lambda: _ipvsadm_restore(ns, change))
    finally:
        netns.delete(ns)
    return out


def _iptables_part(n: int) -> dict[str, Any]:
    from bench import netns, workload
    from kproxy.dataplane.iptables.backend import IptablesBackend
    from kproxy.dataplane.iptables.proxier import IptablesDataplane

    facts, options = _setup()
    out: dict[str, Any] = {}
    ns = netns.create()
    try:
        ipt = IptablesDataplane(IptablesBackend("legacy", netns=ns), facts, options)
        tracker = workload.tracker(n)
        s0 = tracker.snapshot()
        out["iptables_initial"] = _timed(lambda: ipt.sync(s0, full=True))
        s1 = workload.change_one(tracker, n // 2, 1)
        out["iptables_partial"] = _timed(lambda: ipt.sync(s1, full=False))
    finally:
        netns.delete(ns)
    return out


def _ipvsadm_restore(ns: str, text: str) -> None:
    subprocess.run(
        ["ip", "netns", "exec", ns, "ipvsadm", "-R"],
        input=text,
        capture_output=True,
        text=True,
        check=True,
    )


def inside(sizes: list[int], out_path: Path, ipvsadm_max: int) -> int:
    results = []
    for n in sizes:
        print(f"measuring {n} services ...", flush=True)
        res = measure(n, ipvsadm=n <= ipvsadm_max)
        print(json.dumps(res), flush=True)
        results.append(res)
        out_path.write_text(json.dumps(results, indent=1))
    return 0


def _fmt(v: Any) -> str:
    return f"{v:.2f} s" if isinstance(v, float) else "-"


def report(results: list[dict[str, Any]]) -> str:
    lines = [
        "| services (x10 real servers) | kproxy ipvs full sync | ipvsadm-restore, same set "
        "| iptables-legacy full sync | ipvs resync (full, no change) | ipvs one-service update "
        "| ipvsadm, same change | iptables one-service update |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['services']:,} | {_fmt(r.get('ipvs_initial'))}"
            f" | {_fmt(r.get('ipvsadm_restore'))} | {_fmt(r.get('iptables_initial'))}"
            f" | {_fmt(r.get('ipvs_resync'))}"
            f" | {_fmt(r.get('ipvs_partial'))} | {_fmt(r.get('ipvsadm_change'))}"
            f" | {_fmt(r.get('iptables_partial'))} |"
        )
    lines.append("")
    for r in results:
        parts = ", ".join(
            f"{k} {v:.2f}" for k, v in r.get("ipvs_initial_phases", {}).items() if v >= 0.01
        )
        resync = ", ".join(
            f"{k} {v:.2f}" for k, v in r.get("ipvs_resync_phases", {}).items() if v >= 0.01
        )
        lines.append(f"{r['services']:,}: initial phases (s): {parts}; resync: {resync}")
        if r.get("ipvsadm_restore"):
            lines.append(
                f"{r['services']:,}: ipvsadm-restore / kproxy full sync = "
                f"{r['ipvsadm_restore'] / r['ipvs_initial']:.1f}x; kproxy ipvs / iptables full"
                f" sync = {r['ipvs_initial'] / r['iptables_initial']:.1f}x"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000")
    parser.add_argument("--no-ipvsadm-above", type=int, default=10000, dest="ipvsadm_max")
    parser.add_argument("--inside", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--mem", default="4G")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if args.inside is not None:
        return inside(sizes, args.inside, args.ipvsadm_max)

    from kproxy.lab.uml import UmlGuest

    with UmlGuest(mem=args.mem, timeout=args.timeout) as guest:
        assert guest.run_dir is not None
        out = guest.run_dir / "ipvs-bench.json"
        argv = [
            sys.executable,
            "-m",
            "bench.ipvs_bench",
            "--sizes",
            args.sizes,
            "--no-ipvsadm-above",
            str(args.ipvsadm_max),
            "--inside",
            str(out),
        ]
        result = guest.run(argv, cwd=REPO, env={"PYTHONPATH": f"{REPO / 'src'}:{REPO}"})
        text = out.read_text() if out.exists() else "[]"
    print(result.output[-4000:] if result.returncode else "", end="")
    results = json.loads(text)
    print(report(results))
    results_dir = REPO / "bench" / "results"
    results_dir.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    (results_dir / f"ipvs-{stamp}.json").write_text(json.dumps(results, indent=1))
    return 0 if result.returncode == 0 and results else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    sys.exit(main())
