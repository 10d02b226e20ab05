"""Live switch duration (command start to old state gone) per mode pair, under load.

kproxy runs on a lab node with N services (each with the lab's 10 pods as endpoints, plus
one more the load goes to); `kproxy switch` is timed from the command line while fresh and
long-lived connections run; failures are counted. A pair member is a mode or nftables
mode's dataplane name (`nftables-compact`: mode nftables in the compact layout, given to the
proxy and to `kproxy switch` as --nftables-layout; the config's mode stays `nftables`).

Beside each switch, the bare tool for its program step (iptables and nftables targets): what
kproxy's full sync of the same objects sends to the kernel (recorded in a scratch namespace),
fed to the bare tool in a fresh namespace after the lab is gone: the restore inputs to
`iptables-<backend>-restore --noflush` one after the other, the transaction to `nft -f`.

    .venv/bin/python -m bench.switch_bench [--sizes 1000,10000] [--pairs iptables:nftables,...]
        [--port-range 32768-43767] [--backend nft|legacy] [--no-bare] [--uml [--mem 4G]]

--port-range sets the config's portRange (userspace mode's proxy ports): the default
20000-29999 holds 10,000 listeners, fewer than 10,000 services need (preflight refuses).
--uml runs the same inside a User-Mode Linux guest (the pairs with ipvs: the host kernel
has no ip_vs); the iptables layer there is iptables-legacy unless --backend says
otherwise. UML makes every syscall a host round trip: compare pairs within one run.
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

from bench import machine, netns
from bench.nft_incremental import nft_times
from bench.sync_bench import TimedBackend, bare_restore
from kproxy.config import load_config, rule_options
from kproxy.dataplane.facts import NodeFacts, RuleOptions
from kproxy.dataplane.iptables.proxier import IptablesDataplane
from kproxy.dataplane.nftables.layouts import DEFAULT_LAYOUT, MODE, parse_target, target_name
from kproxy.dataplane.nftables.proxier import NftablesDataplane
from kproxy.lab.load import LoadHarness
from kproxy.lab.proxy import ProxyProcess
from kproxy.lab.topology import Lab
from kproxy.lab.uml import in_uml
from kproxy.model.objects import Snapshot
from kproxy.model.snapshot import ChangeTracker
from kproxy.sources.base import ObjectEvent, ObjectKey

REPO = Path(__file__).resolve().parents[1]

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
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "objects.yaml").write_text(
        yaml.dump_all(objects(n, pods), Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper))
    )


def objects(n: int, pods: list[str]) -> list[dict[str, object]]:
    docs: list[dict[str, object]] = []
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
    return docs


def _layout_args(target: str) -> list[str]:
    """`kproxy switch`'s layout option for a target: nftables mode always names its layout
    (a plain `nftables` is upstream's, whatever layout the proxy was started with)."""
    mode, layout = parse_target(target)
    return ["--nftables-layout", layout or DEFAULT_LAYOUT] if mode == MODE else []


def _start_layout(first: str, second: str) -> list[str]:
    """The proxy's --nftables-layout: the first member's (it starts in it) when that is
    nftables mode, else the second's (the layout a switch to nftables defaults to)."""
    for member in (first, second):
        mode, layout = parse_target(member)
        if mode == MODE:
            return ["--nftables-layout", layout] if layout else []
    return []


def run_pair(
    n: int, first: str, second: str, port_range: str = "", backend: str = "nft", bare: bool = True
) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    with Lab(pods=10, clients=2) as lab, tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_objects(work / "objects", n, list(lab.pod_ips.values()))
        cfg = work / "config.yaml"
        cfg.write_text(CONFIG.format(mode=parse_target(first)[0], port_range=port_range))
        proxy = ProxyProcess(
            lab,
            work / "objects",
            config=cfg,
            args=["--iptables-backend", backend, *_start_layout(first, second)],
            workdir=work / "kp",
        )
        proxy.start(timeout=900)
        load = LoadHarness(lab, tcp=("10.95.255.250", 80)).start()
        starts: list[float] = []
        try:
            for to in (second, first):
                t0 = time.monotonic()
                starts.append(t0 - load.started)  # on the clock of the load's failures
                out = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "kproxy.cli",
                        "switch",
                        "--to",
                        parse_target(to)[0],
                        *_layout_args(to),
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
                        "from": target_name(
                            str(report.get("from_mode")), report.get("from_layout")
                        ),
                        "to": target_name(str(report.get("to_mode")), report.get("to_layout")),
                        "target": to,
                        "ok": report.get("ok"),
                        "seconds": round(wall, 2),
                        "load": machine.loadavg(),
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
                        "error": report.get("error")
                        or (None if report else f"rc {out.returncode}: {out.stderr[-800:]}"),
                    }
                )
                if not report.get("ok"):
                    rows[-1]["daemon"] = daemon_state(proxy)
                print(json.dumps(rows[-1]), flush=True)
                if not report.get("ok"):
                    break  # still in the first mode: there is no way back to time
                time.sleep(2)
        finally:
            result = load.stop()
            proxy.stop()
        failed = [t for t, _ in (*result.fresh_failed, *result.pings_failed, *result.udp_failed)]
        for i, r in enumerate(rows):
            r["failed_requests"] = result.failures
            r["requests"] = result.fresh_sent + result.pings_sent
            # this switch's share: from its start to the next one's (or the end of the load)
            until = starts[i + 1] if i + 1 < len(starts) else float("inf")
            r["failed_during"] = sum(1 for t in failed if starts[i] <= t < until)
        pods = list(lab.pod_ips.values())
        node_ip = lab.node_ip
        options = rule_options(load_config(cfg))
    if bare:
        snapshot = _snapshot(objects(n, pods))
        for r in rows:
            netns.wait_quiet(min_wait=2.0, busy_below=0.2)
            tool, seconds = bare_program(str(r["target"]), snapshot, node_ip, options, backend)
            r["bare_tool"], r["bare_program"] = tool, seconds
            r["bare_load"] = machine.loadavg()
            print(json.dumps({"bare": r["target"], "tool": tool, "seconds": seconds}), flush=True)
    return rows


def _snapshot(docs: list[dict[str, object]]) -> Snapshot:
    tracker = ChangeTracker("node1")
    events = []
    for doc in docs:
        meta = doc["metadata"]
        assert isinstance(meta, dict)
        key = ObjectKey(str(doc["kind"]), meta["namespace"], meta["name"])
        events.append(ObjectEvent(key, doc))
    tracker.apply(events)
    return tracker.snapshot()


def bare_program(
    target: str, snapshot: Snapshot, node_ip: str, options: RuleOptions, backend: str
) -> tuple[str, float | None]:
    """(tool, seconds) of the bare tool loading what a switch to `target` programs: kproxy's
    full sync of the snapshot in a scratch namespace, its kernel input recorded, then fed to
    the bare tool in a fresh namespace. None for modes without one tool (userspace, ipvs)."""
    mode, layout = parse_target(target)
    facts = NodeFacts(node_ips=(node_ip,), local_addresses=(node_ip,))
    with netns.fresh() as scratch:
        if mode == "iptables":
            recorder = TimedBackend(backend, scratch)
            IptablesDataplane(recorder, facts, options).sync(snapshot, full=True)
            inputs = recorder.inputs
        elif mode == MODE:
            plane = NftablesDataplane(
                facts, options, netns=scratch, keep_last_write=True, layout=layout or DEFAULT_LAYOUT
            )
            plane.sync(snapshot, full=True)
            assert plane.last_write is not None
            text = plane.last_write.tx.text()
        else:
            return "-", None
    netns.wait_quiet(min_wait=2.0, busy_below=0.2)
    with netns.fresh() as ns:
        if mode == "iptables":
            seconds = bare_restore(ns, backend, inputs)
            return f"iptables-{backend}-restore ({len(inputs)} inputs)", round(seconds, 2)
        return "nft -f", round(nft_times(ns, text, repeats=1)[0], 2)


def daemon_state(proxy: ProxyProcess, lines: int = 60) -> dict[str, object]:
    """What a failed switch left: is the daemon alive, its log's end, its workers' logs' ends
    (a failure at 10,000 services is too slow to reproduce for a second look)."""
    proc = proxy.proc
    state: dict[str, object] = {
        "alive": proc is not None and proc.poll() is None,
        "returncode": None if proc is None else proc.returncode,
        "log_tail": proxy.log_tail(lines).splitlines(),
    }
    for log in sorted(proxy.state_dir.glob("**/worker-*.log")):
        state[str(log.relative_to(proxy.state_dir))] = log.read_text().splitlines()[-10:]
    if not state["alive"]:  # killed? the kernel's log says whether it was the OOM killer
        dmesg = subprocess.run(["dmesg"], capture_output=True, text=True, check=False)
        state["dmesg_tail"] = dmesg.stdout.splitlines()[-15:]
    return state


def in_guest(args: argparse.Namespace) -> int:
    """This benchmark again inside a UML guest; its output is printed as it comes back."""
    from kproxy.lab.uml import HOST_MEMORY_FAILURE, UmlGuest, host_memory_reason

    argv = [sys.executable, "-m", "bench.switch_bench", "--sizes", args.sizes]
    argv += ["--pairs", args.pairs, "--backend", args.backend or "legacy"]
    if args.no_bare:
        argv.append("--no-bare")
    if args.port_range:
        argv += ["--port-range", args.port_range]
    with UmlGuest(mem=args.mem, timeout=args.timeout) as guest:
        result = guest.run(argv, cwd=REPO, env={"PYTHONPATH": f"{REPO / 'src'}:{REPO}"})
    print(result.output, end="")
    if HOST_MEMORY_FAILURE in result.console:
        print(f"\nUML: {host_memory_reason()}")
    return result.returncode


def _ratio(ours: object, bare: object) -> str:
    if not isinstance(ours, int | float) or not isinstance(bare, int | float) or not bare:
        return "-"
    return f"{ours / bare:.2f}x"


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sizes", default="1000")
    ap.add_argument("--pairs", default="iptables:nftables,iptables:userspace,nftables:userspace")
    ap.add_argument("--port-range", default="", help="the config's portRange (default: none)")
    ap.add_argument(
        "--backend", choices=("nft", "legacy"), help="iptables backend (nft; UML: legacy)"
    )
    ap.add_argument(
        "--no-bare", action="store_true", help="skip the bare tool for the program step"
    )
    ap.add_argument("--uml", action="store_true", help="run inside a UML guest (ipvs pairs)")
    ap.add_argument("--mem", default="4G", help="the UML guest's memory")
    ap.add_argument("--timeout", type=float, default=7200.0, help="the UML guest's wall budget")
    args = ap.parse_args()
    if args.uml:
        return in_guest(args)
    backend = args.backend or ("legacy" if in_uml() else "nft")
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        for pair in args.pairs.split(","):
            first, second = pair.split(":")
            rows += run_pair(n, first, second, args.port_range, backend, not args.no_bare)
    print(
        "\n| services | switch | ok | total s | preflight | program | verify | cut-over | remove"
        " | failed (this switch; whole run) | bare tool (program step) | bare s | total / bare"
        " | program / bare | load |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        bare = r.get("bare_program")
        print(
            f"| {r['services']:,} | {r['from']} → {r['to']} | {r['ok']} | {r['seconds']} |"
            f" {r['preflight']} | {r['program']} | {r['verify']} | {r['cut_over']} |"
            f" {r['remove']} | {r['failed_during']}; {r['failed_requests']} / {r['requests']} |"
            f" {r.get('bare_tool', '-')} | {bare if bare is not None else '-'} |"
            f" {_ratio(r['seconds'], bare)} | {_ratio(r['program'], bare)} | {r['load']} |"
        )
    return 0 if rows and all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
