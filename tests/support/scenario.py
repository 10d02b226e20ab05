"""The objects behind the recorded inspect dumps, and the recorder (test support, no tests).

`scenario_objects()` is one of each kind of service port kube-proxy programs: ClusterIP
with 3 endpoints (+ NodePort + externalIP), 1 endpoint, no endpoints, ClientIP affinity,
LoadBalancer with loadBalancerSourceRanges, externalTrafficPolicy Local (with and without a
local endpoint), UDP.

Regenerate tests/support/inspect_dumps.py (root, from the repository root):

    .venv/bin/python -m tests.support.scenario
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kproxy.lab.proxy import proxy_config
from tests.support.objects import endpoint, endpoint_slice, node, port, service, write

PODS = ("10.244.0.2", "10.244.0.3", "10.244.0.4")
ALLOWED_CLIENT = "10.100.0.2"  # the lab's first client; the second (10.100.0.3) is denied
HTTP = [port("http", 80, "http")]
SLICE = [port("http", 8080)]


def scenario_objects(allowed: str = ALLOWED_CLIENT) -> list[dict[str, Any]]:
    lb = service(
        "lb",
        "10.96.0.21",
        [port("http", 80, "http", nodePort=30081)],
        type="LoadBalancer",
        loadBalancerSourceRanges=[f"{allowed}/32"],
    )
    lb["status"] = {"loadBalancer": {"ingress": [{"ip": "10.99.1.10"}]}}
    return [
        node(),
        service(
            "web",
            "10.96.0.10",
            [port("http", 80, "http", nodePort=30080)],
            type="NodePort",
            externalIPs=["10.99.0.10"],
        ),
        endpoint_slice("web", [endpoint(ip) for ip in PODS], SLICE),
        service("one", "10.96.0.11", HTTP),
        endpoint_slice("one", [endpoint(PODS[1])], SLICE),
        service("empty", "10.96.0.99", HTTP),
        service(
            "aff",
            "10.96.0.12",
            HTTP,
            sessionAffinity="ClientIP",
            sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}},
        ),
        endpoint_slice("aff", [endpoint(ip) for ip in PODS[:2]], SLICE),
        lb,
        endpoint_slice("lb", [endpoint(ip) for ip in PODS], SLICE),
        service(
            "loc",
            "10.96.0.13",
            [port("http", 80, "http", nodePort=30082)],
            type="NodePort",
            externalTrafficPolicy="Local",
        ),
        endpoint_slice("loc", [endpoint(PODS[0]), endpoint(PODS[1], "node2")], SLICE),
        # Local policy and no endpoint on this node: external traffic is dropped.
        service(
            "remote",
            "10.96.0.14",
            [port("http", 80, "http", nodePort=30083)],
            type="NodePort",
            externalTrafficPolicy="Local",
        ),
        endpoint_slice("remote", [endpoint(PODS[2], "node2")], SLICE),
        service("dns", "10.96.0.53", [port("dns", 53, 8080, protocol="UDP")]),
        endpoint_slice(
            "dns", [endpoint(ip) for ip in PODS[:2]], [port("dns", 8080, protocol="UDP")]
        ),
    ]


# --- the recorder --------------------------------------------------------------------------------

DUMPS = Path(__file__).with_name("inspect_dumps.py")
HEADER = '''"""Kernel dumps recorded in the lab for the inspect unit tests (test data, no tests).

Recorded by tests/support/scenario.py: `kproxy run` on a lab node with its objects,
then six requests to default/web, one to default/aff (an affinity entry), three open
streams to default/one, all from the first client; each mode in a fresh lab.
"""

# ruff: noqa: E501
'''


def _literal(text: str) -> str:
    if '"""' not in text and not text.endswith(('"', "\\")):
        return 'r"""' + text + '"""'
    return repr(text)


def _record(mode: str, backend: str, workdir: Path, layout: str = "upstream") -> dict[str, Any]:
    from kproxy.lab.proxy import ProxyProcess
    from kproxy.lab.topology import Lab

    out: dict[str, Any] = {}
    with Lab(pods=3) as lab:
        src = workdir / f"objects-{mode}"
        src.mkdir(parents=True)
        for i, obj in enumerate(scenario_objects(lab.client_ips[0])):
            write(src / f"{i:02d}.yaml", obj)
        cfg = workdir / f"config-{mode}.yaml"
        cfg.write_text(proxy_config(mode))
        args = ["--iptables-backend", backend] if backend else []
        args += ["--nftables-layout", layout]
        proxy = ProxyProcess(
            lab, src, config=cfg, args=args, workdir=workdir / f"kproxy-{mode}-{layout}"
        )
        proxy.start()

        def ex(argv: list[str]) -> str:
            return lab.exec(lab.node_ns, argv, check=False).stdout

        try:
            client = lab.agent(lab.client_ns[0])
            client.request_many(proto="tcp", dst="10.96.0.10", port=80, count=6)
            aff = client.request(proto="tcp", dst="10.96.0.12", port=80)
            out["affinity"] = f"{lab.pod_ips[aff.pod or '']}:8080"
            streams = [client.open_stream("10.96.0.11", 80) for _ in range(3)]
            time.sleep(0.2)
            if mode == "iptables":
                out["save"] = ex([f"iptables-{backend}-save", "-c"])
                out["recent"] = {
                    name: ex(["cat", f"/proc/net/xt_recent/{name}"])
                    for name in ex(["ls", "/proc/net/xt_recent"]).split()
                }
                timer = ex(["cat", "/proc/timer_list"]).splitlines()
                keep = [ln for ln in timer if ln.startswith(("now at", "jiffies:"))][:2]
                out["timer"] = "\n".join(keep) + "\n"
            else:
                table = "kube-proxy" if layout == "upstream" else f"kproxy-{layout}"
                items = json.loads(ex(["nft", "-j", "list", "table", "ip", table]))
                lines = ",\n".join(json.dumps(i) for i in items["nftables"])
                out["nft"] = '{"nftables": [\n' + lines + "\n]}\n"
            out["conntrack"] = ex(["conntrack", "-L", "-o", "extended"])
            out["ip_addr"] = json.dumps(json.loads(ex(["ip", "-j", "addr"])), indent=1) + "\n"
            for s in streams:
                client.close_stream(s)
        finally:
            proxy.stop()
    return out


def compact_parts(compact: dict[str, Any]) -> list[str]:
    return [
        f"NFT_COMPACT_AFFINITY_ENDPOINT = {compact['affinity']!r}\n",
        f"NFT_COMPACT_JSON = {_literal(compact['nft'])}\n",
        f"NFT_COMPACT_CONNTRACK = {_literal(compact['conntrack'])}\n",
    ]


def main() -> int:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        ipt = _record("iptables", "nft", Path(tmp))
        nft = _record("nftables", "", Path(tmp))
        compact = _record("nftables", "", Path(tmp), layout="compact")
    parts = [
        HEADER,
        f"IPTABLES_AFFINITY_ENDPOINT = {ipt['affinity']!r}\n",
        f"IPTABLES_SAVE = {_literal(ipt['save'])}\n",
        f"IPTABLES_RECENT = {ipt['recent']!r}\n",
        f"IPTABLES_TIMER_LIST = {_literal(ipt['timer'])}\n",
        f"IPTABLES_CONNTRACK = {_literal(ipt['conntrack'])}\n",
        f"IP_ADDR = {_literal(ipt['ip_addr'])}\n",
        f"NFT_AFFINITY_ENDPOINT = {nft['affinity']!r}\n",
        f"NFT_JSON = {_literal(nft['nft'])}\n",
        f"NFT_CONNTRACK = {_literal(nft['conntrack'])}\n",
        *compact_parts(compact),
    ]
    DUMPS.write_text("\n".join(parts))
    # Keep the generated module in the repository's format (ruff is a test dependency).
    subprocess.run([sys.executable, "-m", "ruff", "format", str(DUMPS)], check=False)
    print(f"wrote {DUMPS} ({DUMPS.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
