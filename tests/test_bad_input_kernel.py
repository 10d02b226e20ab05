"""A running kproxy with hostile files in its source folder, on a lab node, real packets.

Files that cannot become objects (nested aliases that would expand to a billion nodes, nesting
that crashed PyYAML's C composer, binary garbage, a recursive alias) sit next to valid ones:
kproxy starts with them present, keeps serving, applies a valid change made in the same poll
as a new hostile file, and `kproxy status --json` names each bad file with its line and each
invalid object with its field, before any further sync.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kproxy.lab.proxy import ProxyProcess, proxy_config
from kproxy.lab.topology import Lab
from tests.support.dataplane_env import POD_IPS, WEB_PORTS, WEB_SLICE_PORTS
from tests.support.objects import endpoint, endpoint_slice, node, service, write

pytestmark = pytest.mark.kernel

LAUGHS = "kind: Service\nmetadata: {name: lol}\nspec:\n  a0: &a0 [x,x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"  a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 9)
)
HOSTILE_AT_START = {
    "laughs.yaml": LAUGHS.encode(),
    "deep.yaml": b"kind: Service\nmetadata: {name: deep}\nspec: " + b"[" * 200_000 + b"]" * 200_000,
    "garbage.yaml": bytes(range(256)) * 16,
}


def wait_for(check: Callable[[], Any], timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    pytest.fail(f"condition not reached within {timeout} s")


@pytest.fixture
def proxy(lab: Lab, tmp_path: Path) -> Iterator[ProxyProcess]:
    source = tmp_path / "objects"
    source.mkdir()
    write(source / "node.yaml", node())
    pods = [endpoint(ip) for ip in POD_IPS]
    write(
        source / "web.yaml",
        service("web", "10.96.0.10", WEB_PORTS),
        endpoint_slice("web", pods, WEB_SLICE_PORTS),
    )
    for name, data in HOSTILE_AT_START.items():
        (source / name).write_bytes(data)
    config = tmp_path / "config.yaml"
    config.write_text(proxy_config("iptables"))
    p = ProxyProcess(lab, source, config=config, workdir=tmp_path / "kproxy")
    try:
        yield p
    finally:
        p.stop()


def status(p: ProxyProcess) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "kproxy.cli", "status", "--json", "--state-dir", str(p.state_dir)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def served(lab: Lab, ip: str) -> bool:
    results = lab.agent(lab.client_ns[0]).request_many(
        proto="tcp", dst=ip, port=80, count=6, timeout=1.0
    )
    return all(r.ok for r in results)


def test_hostile_files_are_reported_and_never_stop_the_proxy(lab: Lab, proxy: ProxyProcess) -> None:
    source = proxy.source
    assert source is not None
    proxy.start()  # starts with the hostile files already there (it used to not start)
    assert served(lab, "10.96.0.10")
    failing = {Path(f["file"]).name: f for f in status(proxy)["source"]["failing_files"]}
    assert set(failing) == set(HOSTILE_AT_START)
    assert failing["laughs.yaml"]["line"] and "nodes" in failing["laughs.yaml"]["error"]
    assert failing["deep.yaml"]["line"] == 3 and "levels deep" in failing["deep.yaml"]["error"]

    # In one poll: a new hostile file, and a valid change in another file.
    (source / "recursive.yaml").write_text("kind: Service\nmetadata: {name: r}\nspec: &a {x: *a}\n")
    write(
        source / "api.yaml",
        service("api", "10.96.0.20", WEB_PORTS),
        endpoint_slice("api", [endpoint(POD_IPS[0])], WEB_SLICE_PORTS),
    )
    wait_for(lambda: served(lab, "10.96.0.20"))
    assert served(lab, "10.96.0.10")
    failing = {Path(f["file"]).name for f in status(proxy)["source"]["failing_files"]}
    assert failing == {*HOSTILE_AT_START, "recursive.yaml"}

    # An invalid object alone queues no sync; the status knows it at once all the same.
    syncs = status(proxy)["syncs"]
    write(
        source / "bad-object.yaml",
        service("bad", "10.96.0.300", WEB_PORTS),
    )
    invalid = wait_for(lambda: status(proxy)["invalid"], timeout=5.0)
    assert invalid == [
        {
            "kind": "Service",
            "namespace": "default",
            "name": "bad",
            "field": "spec.clusterIP",
            "error": invalid[0]["error"],
        }
    ]
    assert status(proxy)["syncs"] == syncs

    # Fixed and removed files leave the report.
    (source / "laughs.yaml").unlink()
    (source / "bad-object.yaml").unlink()
    wait_for(lambda: "laughs.yaml" not in str(status(proxy)["source"]["failing_files"]))
    wait_for(lambda: status(proxy)["invalid"] == [])
    assert served(lab, "10.96.0.10") and served(lab, "10.96.0.20")
