"""A lab node running kproxy (iptables-nft) with two services, web and api, as the preflight and
doctor kernel tests set it up, and the commands they run on it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from kproxy.lab.proxy import ProxyProcess, proxy_config
from kproxy.lab.topology import Lab
from tests.support.objects import endpoint, endpoint_slice, node, port, service, write

PODS = ("10.244.0.2", "10.244.0.3", "10.244.0.4")


def objects(folder: Path, *extra: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    write(folder / "node.yaml", node())
    write(
        folder / "web.yaml",
        service("web", "10.96.0.10", [port("http", 80, 8080)], selector={"app": "web"}),
        endpoint_slice("web", [endpoint(ip) for ip in PODS], [port("http", 8080)]),
    )
    write(
        folder / "api.yaml",
        service("api", "10.96.0.20", [port("https", 443, 9090)], selector={"app": "api"}),
        endpoint_slice("api", [endpoint(ip) for ip in PODS], [port("https", 9090)]),
    )
    if extra:
        write(folder / "extra.yaml", *extra)
    return folder


def config(tmp_path: Path, mode: str, extra: str = "") -> Path:
    path = tmp_path / f"config-{mode}.yaml"
    path.write_text(proxy_config(mode, sync_period=None) + extra)
    return path


def start(lab: Lab, tmp_path: Path, *extra: dict[str, Any]) -> ProxyProcess:
    src = objects(tmp_path / "objects", *extra)
    return ProxyProcess(
        lab,
        src,
        config=config(tmp_path, "iptables"),
        args=["--iptables-backend", "nft"],
        workdir=tmp_path / "kp",
    ).start()


def cli(lab: Lab, *args: str) -> subprocess.CompletedProcess[str]:
    """`kproxy ...` run inside the node namespace, as an operator on the node would."""
    return lab.exec(
        lab.node_ns, [sys.executable, "-m", "kproxy.cli", *args], check=False, timeout=120
    )


def nat_rules(lab: Lab) -> list[str]:
    """The nat rules without iptables-save's timestamp comments."""
    text = lab.exec(lab.node_ns, ["iptables-nft-save", "-t", "nat"]).stdout
    return [line for line in text.splitlines() if not line.startswith("#")]
