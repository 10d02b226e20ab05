"""kproxy verify against a running proxy on a lab node: healthy gives exit code 0; a real
breach (an RSS limit below the real RSS, a service's rules deleted behind the proxy's back)
gives exit code 1 naming it."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kproxy.lab.proxy import ProxyProcess, proxy_config
from kproxy.lab.topology import Lab
from tests.support.dataplane_env import POD_IPS
from tests.support.objects import endpoint, endpoint_slice, node, port, service, write

pytestmark = pytest.mark.kernel

MODES = [("iptables", "nft"), ("userspace", "nft")]
CHECKS = ["running", "sync-p99", "services", "rss", "cpu", "failures", "sync-progress"]


@pytest.fixture(params=MODES, ids=[f"{m}-{b}" for m, b in MODES])
def proxy(request: pytest.FixtureRequest, lab: Lab, tmp_path: Path) -> Iterator[ProxyProcess]:
    mode, backend = request.param
    source = tmp_path / "objects"
    source.mkdir()
    write(source / "node.yaml", node())
    write(
        source / "web.yaml",
        service("web", "10.96.0.10", [port("http", 80, "http")]),
        endpoint_slice("web", [endpoint(ip) for ip in POD_IPS], [port("http", 8080)]),
    )
    write(
        source / "api.yaml",
        service("api", "10.96.0.11", [port("http", 80, "http")]),
        endpoint_slice("api", [endpoint(POD_IPS[0])], [port("http", 8080)]),
    )
    config = tmp_path / "config.yaml"
    config.write_text(proxy_config(mode))
    p = ProxyProcess(
        lab, source, config=config, args=["--iptables-backend", backend], workdir=tmp_path / "kp"
    )
    p.start()
    try:
        yield p
    finally:
        p.stop()


def verify(p: ProxyProcess, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "kproxy.cli", "verify", "--state-dir", str(p.state_dir), *args]
    return p.lab.exec(p.lab.node_ns, argv, check=False)


def test_verify_healthy_then_real_breaches(proxy: ProxyProcess) -> None:
    lab = proxy.lab
    # Healthy, watched for a few seconds, with traffic through the proxy meanwhile.
    assert lab.agent(lab.client_ns[0]).request(proto="tcp", dst="10.96.0.10", port=80).ok
    out = verify(proxy, "--for", "4s", "--interval", "2s", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    verdict = json.loads(out.stdout)
    assert [c["name"] for c in verdict["checks"]] == CHECKS
    assert all(c["ok"] for c in verdict["checks"]), verdict
    assert verdict["samples"] >= 3
    services = next(c for c in verdict["checks"] if c["name"] == "services")
    assert services["value"] == "2 service ports"
    assert out.stderr.count(" s / 4 s] running pid") >= 2  # progress lines
    # An RSS limit below what the proxy really uses.
    out = verify(proxy, "--max-rss", "1Mi")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "BREACH rss" in out.stdout and "verdict: 1 breach: rss" in out.stdout
    # Someone deletes web's ClusterIP rules: the dataplane has one service fewer than the
    # proxy's snapshot (it restores them only at its next full sync).
    tool = "iptables-nft"
    save = lab.exec(lab.node_ns, [f"{tool}-save", "-t", "nat"]).stdout
    doomed = [
        line for line in save.splitlines() if line.startswith("-A ") and "default/web:http" in line
    ]
    assert doomed, save
    for line in doomed:
        words = shlex.split(line)
        lab.exec(lab.node_ns, [tool, "-t", "nat", "-D", *words[1:]])
    out = verify(proxy, "--json")
    assert out.returncode == 1, out.stdout + out.stderr
    verdict = json.loads(out.stdout)
    assert verdict["breaches"] == ["services"], verdict
    services = next(c for c in verdict["checks"] if c["name"] == "services")
    assert services["value"] == "1 in the dataplane, 2 in the snapshot"
