"""`kproxy demo` / `make demo`: the whole story in under a minute, on real packets.

A lab (node, three pods, two clients) is built from network namespaces; kproxy runs on the
node in iptables mode from examples/demo; traffic goes through a ClusterIP, a NodePort, an
externalIP and a UDP service; a service is edited live; kproxy switches to nftables mode
under traffic; it is killed and traffic keeps flowing; everything is torn down.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections import Counter
from importlib import resources
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kproxy.lab.agent import ProbeResult
from kproxy.lab.proxy import ProxyProcess
from kproxy.lab.topology import Lab, lab_supported

console = Console(highlight=False)


def examples_dir() -> Path:
    """examples/demo of the source tree (the demo runs from a checkout)."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        candidate = parent / "examples" / "demo"
        if candidate.is_dir():
            return candidate
    return Path(str(resources.files("kproxy"))) / "examples" / "demo"


def _spread(results: list[ProbeResult]) -> str:
    counts = Counter(r.pod if r.ok else f"failed ({r.error})" for r in results)
    return ", ".join(f"{name} x{n}" for name, n in sorted(counts.items()))


def run_demo(*, keep: bool = False) -> int:
    ok, why = lab_supported()
    if not ok:
        console.print(f"[red]the demo needs root and iproute2: {why}[/red]")
        return 2
    started = time.monotonic()
    examples = examples_dir()
    work = Path(tempfile.mkdtemp(prefix="kproxy-demo-"))
    source = work / "objects"
    source.mkdir()
    for f in examples.glob("*.yaml"):
        if f.name != "kproxy-config.yaml":
            shutil.copy(f, source / f.name)
    lab = Lab(pods=3, clients=2)
    proxy: ProxyProcess | None = None
    try:
        console.rule("[bold]1. The lab: network namespaces on this machine")
        lab.up()
        console.print(
            f"node [bold]{lab.node_ns}[/bold] ({lab.node_ip}), pods "
            + ", ".join(f"{n}={ip}" for n, ip in lab.pod_ips.items())
            + f", clients {', '.join(lab.client_ips)}  [dim](built in {lab.up_seconds:.2f} s)[/dim]"
        )

        console.rule("[bold]2. kproxy runs on the node, in iptables mode")
        console.print(
            f"objects: {', '.join(sorted(p.name for p in source.iterdir()))} (from {examples})"
        )
        proxy = ProxyProcess(lab, source, config=examples / "kproxy-config.yaml", workdir=work)
        t0 = time.monotonic()
        proxy.start()
        st = proxy.status()
        console.print(
            f"first sync done {time.monotonic() - t0:.2f} s after start:"
            f" {st.get('services')} service ports programmed"
        )

        console.rule("[bold]3. Traffic from client 10.100.0.2 (12 fresh connections each)")
        client = lab.agent(lab.client_ns[0])
        table = Table("what", "destination", "answered by")
        checks = [
            ("ClusterIP", "tcp", "10.96.0.10", 80),
            ("NodePort", "tcp", lab.node_ip, 30080),
            ("externalIP", "tcp", "10.99.0.10", 80),
            ("UDP ClusterIP", "udp", "10.96.0.53", 53),
            ("no endpoints", "tcp", "10.96.0.99", 80),
        ]
        failures = 0
        for what, proto, ip, port in checks:
            results = client.request_many(proto=proto, dst=ip, port=port, count=12, timeout=1.0)
            expect_ok = what != "no endpoints"
            failures += sum(1 for r in results if r.ok != expect_ok)
            table.add_row(what, f"{proto} {ip}:{port}", _spread(results))
        console.print(table)
        console.print(
            "[dim]'no endpoints' is REJECTed by the node: the client gets"
            " 'connection refused' at once.[/dim]"
        )

        console.rule("[bold]4. Live edit: pod3 leaves the 'web' service")
        web = source / "web.yaml"
        web.write_text(
            web.read_text().replace(
                "  - {addresses: [10.244.0.4], nodeName: node1, conditions: {ready: true}}\n", ""
            )
        )
        t0 = time.monotonic()
        results: list[ProbeResult] = []
        while time.monotonic() - t0 < 10:
            results = client.request_many(
                proto="tcp", dst="10.96.0.10", port=80, count=12, timeout=1.0
            )
            if all(r.ok and r.pod != "pod3" for r in results):
                break
        took = time.monotonic() - t0
        console.print(
            f"edited {web.name}; {took:.2f} s later the ClusterIP answers from: {_spread(results)}"
        )
        if any(r.pod == "pod3" or not r.ok for r in results):
            failures += 1

        console.rule("[bold]5. The rules kproxy wrote (upstream kube-proxy's layout)")
        saved = lab.exec(lab.node_ns, ["iptables-save", "-t", "nat"]).stdout
        for line in saved.splitlines():
            if "demo/web:http" in line and (
                "KUBE-SERVICES" in line or "KUBE-SVC" in line.split()[1]
            ):
                console.print(f"  {line}", soft_wrap=True)

        console.rule("[bold]6. Live switch to nftables mode while traffic flows")
        from kproxy.lab.load import LoadHarness
        from kproxy.server.admin import SOCKET_NAME, call

        load = LoadHarness(lab, tcp=("10.96.0.10", 80), udp=("10.96.0.53", 53), streams=3).start()
        time.sleep(0.3)
        report = call(
            proxy.state_dir / SOCKET_NAME, {"op": "switch", "to": "nftables", "timeout": 60}
        )
        time.sleep(0.3)
        result = load.stop()
        for st in report.get("steps", []):
            detail = (
                st["detail"] if not st["name"].startswith("snapshot") else "kept in the state dir"
            )
            console.print(f"  {st['name']:<15} {st['seconds']:7.3f} s  [dim]{detail}[/dim]")
        if not report.get("ok") or result.failures:
            failures += 1
        console.print(
            f"switched iptables -> nftables in {report.get('duration', 0):.2f} s: "
            + result.summary()
        )
        nft = lab.exec(
            lab.node_ns, ["nft", "list", "map", "ip", "kube-proxy", "service-ips"]
        ).stdout
        console.print(
            "  [dim]nft service-ips map: "
            + " ".join(line.strip() for line in nft.splitlines() if "goto" in line)[:300]
            + "[/dim]"
        )

        console.rule("[bold]7. kill -9 kproxy: the rules stay, traffic keeps flowing")
        proxy.kill()
        results = client.request_many(proto="tcp", dst="10.96.0.10", port=80, count=6, timeout=1.0)
        failures += sum(1 for r in results if not r.ok)
        console.print(f"kproxy is dead; the ClusterIP still answers: {_spread(results)}")
    finally:
        if proxy is not None:
            proxy.stop()
        if keep:
            console.print(f"lab {lab.id} left running; remove it with: kproxy lab down {lab.id}")
            lab.detach()
        else:
            lab.down()
        shutil.rmtree(work, ignore_errors=True)
    verdict = (
        "[green]all checks passed[/green]"
        if failures == 0
        else f"[red]{failures} checks failed[/red]"
    )
    console.rule(f"done in {time.monotonic() - started:.1f} s: {verdict}; lab torn down")
    return 0 if failures == 0 else 1
