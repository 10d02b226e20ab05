"""The real `kproxy` command given bad values: a usage error naming the flag and the value,
exit code 2, never a traceback, and nothing started; outside text kept on one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kproxy.server.admin import SOCKET_NAME, AdminServer

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "demo"
FACTS = ["--node-ip", "10.100.0.1", "--local-address", "10.100.0.1", "--random-fully"]
FACTS += ["--no-tcp-be-liberal"]


def kproxy(
    *args: str, netns: bool = False, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    # `run` goes into a network namespace of its own (gone when it exits): should a bad value
    # ever be accepted again, the proxy it starts programs that namespace, not the host's.
    prefix = ["unshare", "--net"] if netns else []
    return subprocess.run(
        [*prefix, sys.executable, "-m", "kproxy.cli", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "200"},
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--node-ip", "999.1.1.1"], "Invalid value for '--node-ip': '999.1.1.1' is not an IP"),
        (["--node-ip", ""], "Invalid value for '--node-ip': '' is not an IP address"),
        (["--v=abc"], "--v: 'abc' is not a log level"),
        (["--healthz-port=70000"], "--healthz-port: Invalid value: '70000': must be a port"),
        (["--kube-api-qps=nan"], "--kube-api-qps: Invalid value: 'nan': must be a finite"),
        (["--iptables-masquerade-bit", "40"], "--iptables-masquerade-bit: iptables.masqueradeBit"),
        (["--hostname-override", "bad\nname"], "'--hostname-override': 'bad\\nname' is not a Node"),
        (
            ["--detect-local-mode", "BridgeInterface", "--pod-bridge-interface", "br\n-A X"],
            "--pod-bridge-interface: detectLocal.bridgeInterface: Invalid value: 'br\\n-A X'",
        ),
        (["--admin-address", "0.0.0.0:1"], "--admin-address: 0.0.0.0 is not a loopback"),
    ],
    ids=[
        "node-ip", "empty-node-ip", "klog-v", "healthz-port", "qps-nan", "masquerade-bit",
        "hostname-newline", "bridge-newline", "admin-address",
    ],
)  # fmt: skip
def test_run_refuses_bad_flags_before_starting(
    args: list[str], message: str, tmp_path: Path
) -> None:
    proc = kproxy("run", "--source", str(EXAMPLES), "--state-dir", str(tmp_path), *args, netns=True)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / SOCKET_NAME).exists()  # it never started


def test_run_names_a_state_dir_it_cannot_create(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    proc = kproxy(
        "run", "--source", str(EXAMPLES), "--state-dir", str(tmp_path / "file" / "x"), netns=True
    )
    assert proc.returncode == 2
    assert f"--state-dir {tmp_path / 'file' / 'x'}: cannot create it" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["render", "--source", str(EXAMPLES), "--proxy-mode", "nftables", "--node-ip", "1.2.3"],
            "Invalid value for '--node-ip': '1.2.3' is not an IP address",
        ),
        (
            ["render", "--source", str(EXAMPLES), "--local-address", "fe80::1%eth0"],
            "'fe80::1%eth0': an IP address here has no zone",
        ),
        (["switch", "--to", "iptables", "--timeout", "nan"], "Invalid value for '--timeout'"),
        (["switch", "--to", "ebpf"], "Invalid value for '--to': 'ebpf' is not a proxy mode"),
        (["preflight", "--to", "iptables", "--from", "foo"], "--from 'foo' is not a proxy mode"),
        (
            ["preflight", "--to", "nftables", "--nftables-layout", "compat"],
            "--nftables-layout: 'compat' is not upstream or compact",
        ),
        (
            ["preflight", "--to", "ipvs", "--nftables-layout", "compact"],
            "--nftables-layout goes with --to nftables",
        ),
        (["trace", "--from", "10.0.0.300", "--to", "10.96.0.1:80"], "'--from': '10.0.0.300'"),
        (["trace", "--from", "10.0.0.3", "--to", "10.96.0.1:99999"], "--to: '99999' is not a port"),
        (["verify", "--for", "5x"], "Invalid value for '--for': unknown unit 'x'"),
        (["verify", "--max-failures", "-1"], "Invalid value for '--max-failures'"),
        (["verify", "--metrics-address", "nope"], "'nope' is not HOST:PORT"),
        (["snapshot", "-o", "/proc/no/such"], "--output /proc/no/such: cannot write it"),
        (["rollout", "run", "--metrics-address", "127.0.0.1:99999"], "'99999' is not a port"),
        (["rollout", "run", "--interval", "-1"], "Invalid value for '--interval'"),
        (["rollout", "pause", "../x"], "'../x' is not an object name"),
        (["rollout", "start", "--to", "nftables", "--name", "A_B"], "'A_B' is not an object"),
    ],
    ids=[
        "render-node-ip", "render-zone", "switch-timeout", "switch-to", "preflight-from",
        "preflight-layout", "preflight-layout-mode",
        "trace-from", "trace-port", "verify-for", "verify-failures", "verify-metrics",
        "snapshot-output", "rollout-metrics", "rollout-interval", "rollout-name-path",
        "rollout-name",
    ],
)  # fmt: skip
def test_commands_refuse_bad_values_naming_the_flag(args: list[str], message: str) -> None:
    proc = kproxy(*args)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    # Rich wraps a long message in its box: compare without the box's line breaks.
    said = " ".join(line.strip(" │") for line in proc.stderr.splitlines())
    assert message in said, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_diff_refuses_json_that_is_no_snapshot(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text("[1, 2]")
    proc = kproxy("diff", str(tmp_path / "a.json"), str(tmp_path / "a.json"))
    assert proc.returncode == 2 and "is not a kproxy snapshot (not a JSON object)" in proc.stderr
    assert "Traceback" not in proc.stderr


FORGED = "2026-01-01 00:00:00,000 E kproxy: FORGED"


def forged_objects(folder: Path) -> Path:
    """Services whose names, namespace and port name carry a line break or a quote, and one
    valid Service whose endpoints' slice and label carry them too."""
    docs: list[dict[str, Any]] = [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"clusterIP": ip, "ports": [{"name": port, "port": 80}]},
        }
        for name, ns, port, ip in [
            (f"web\n{FORGED}", "x", "http", "10.96.0.30"),
            ('web" -j ACCEPT', "x", "http", "10.96.0.31"),
            ("web", f"x\n{FORGED}", "http", "10.96.0.32"),
            ("web2", "x", 'h" FORGED', "10.96.0.33"),
            ("ok", "x", "http", "10.96.0.34"),
        ]
    ]
    docs.append(
        {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": f"ok-1\n{FORGED}",
                "namespace": "x",
                "labels": {"kubernetes.io/service-name": "ok"},
            },
            "addressType": "IPv4",
            "endpoints": [{"addresses": ["10.244.0.9"]}],
            "ports": [{"name": "http", "port": 8080}],
        }
    )
    path = folder / "forged.json"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
    return path


@pytest.mark.parametrize("mode", ["iptables", "nftables", "ipvs", "userspace"])
def test_forged_names_reach_no_rule_comment_and_no_line_of_their_own(
    mode: str, tmp_path: Path
) -> None:
    forged_objects(tmp_path)
    proc = kproxy("render", "--source", str(tmp_path), "--proxy-mode", mode, "-v", *FACTS)
    assert proc.returncode == 0, proc.stderr
    # The model refused every forged name: no rule mentions one (only the valid Service).
    assert "FORGED" not in proc.stdout and '-j ACCEPT"' not in proc.stdout
    assert "10.96.0.34" in proc.stdout
    # Warnings and log lines quote the names on their own line, escaped.
    assert "FORGED" in proc.stderr
    assert not any(line.startswith(FORGED) for line in proc.stderr.splitlines())


def test_status_text_keeps_each_rejection_and_error_on_its_line(tmp_path: Path) -> None:
    status = {
        "ok": True,
        "mode": "iptables",
        "rejections": [f"Service x/web\n{FORGED}: metadata.name: bad"],
        "last_error": f"restore failed\n{FORGED}",
    }
    srv = AdminServer(tmp_path / SOCKET_NAME, {"status": lambda _: status})
    srv.start()
    try:
        proc = kproxy("status", "--state-dir", str(tmp_path))
    finally:
        srv.stop()
    assert proc.returncode == 0, proc.stderr
    assert not any(line.startswith(FORGED) for line in proc.stdout.splitlines()), proc.stdout
    assert f"  - Service x/web\\n{FORGED}: metadata.name: bad" in proc.stdout
    assert f"last error:      restore failed\\n{FORGED}" in proc.stdout
