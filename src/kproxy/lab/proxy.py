"""Run kproxy itself on a lab node, as the demo, the kernel tests and the benchmarks do."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kproxy.host.netns import socket_in_netns
from kproxy.lab.topology import Lab, LabNode


def proxy_config(
    mode: str | None,
    *,
    node: str = "node1",
    sync_period: str | None = "30s",
    kubeconfig: str | Path | None = None,
) -> str:
    """The KubeProxyConfiguration a lab node's kproxy runs with: the lab's cluster CIDR, no
    conntrack sizing (the host's sysctls are not the lab's to change) and, unless
    `sync_period` is None, syncs within 100 ms of a change (tests want a change in the rules
    within a fraction of a second, not upstream's 1 s). `mode` None: the default mode."""
    lines = [
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1",
        "kind: KubeProxyConfiguration",
        *([f"mode: {mode}"] if mode is not None else []),
        f"hostnameOverride: {node}",
        "clusterCIDR: 10.244.0.0/16",
        *([f"clientConnection: {{kubeconfig: {kubeconfig}}}"] if kubeconfig else []),
        *(
            f"{section}: {{minSyncPeriod: 100ms, syncPeriod: {sync_period}}}"
            for section in ("iptables", "nftables", "ipvs")
            if sync_period is not None
        ),
        "conntrack: {maxPerCore: 0}",
    ]
    return "\n".join(lines) + "\n"


class ProxyProcess:
    """`kproxy run` inside a lab node's namespace (the first node unless `node` is given),
    with its own state dir and log file."""

    def __init__(
        self,
        lab: Lab,
        source: Path | None,
        *,
        config: Path | None = None,
        args: Sequence[str] = (),
        workdir: Path,
        node: LabNode | None = None,
        path_prefix: Path | None = None,
        env: dict[str, str] | None = None,
        state_tmpfs: str | None = None,
    ) -> None:
        """path_prefix: a folder searched before PATH (tools replaced for a fault test).
        env: more environment variables. state_tmpfs: the state dir is a tmpfs of this size
        (e.g. "4m") in a mount namespace of the process's own, gone when it exits (a fault
        test makes it read-only or full: kproxy.lab.faults.StateDirFault)."""
        self.lab = lab
        self.path_prefix = path_prefix
        self.extra_env = dict(env or {})
        self.state_tmpfs = state_tmpfs
        self.node = node or lab.nodes[0]
        self.source = source
        self.config = config
        self.args = list(args)
        self.workdir = workdir
        self.state_dir = workdir / "state"
        self.log_path = workdir / "kproxy.log"
        self.proc: subprocess.Popen[Any] | None = None

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "kproxy.cli", "run"]
        if self.source is not None:  # None: objects from an API server (--kubeconfig in args)
            argv += ["--source", str(self.source)]
        if self.config is not None:
            argv += ["--config", str(self.config)]
        argv += ["--state-dir", str(self.state_dir), "--node-ip", self.node.ip, *self.args]
        if self.state_tmpfs is not None:
            # A private mount namespace: the tmpfs is never seen by (or left in) the host's.
            mount = 'mount -t tmpfs -o size="$1" kproxy-state "$2" && shift 2 && exec "$@"'
            argv = [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                mount,
                "sh",
                self.state_tmpfs,
                str(self.state_dir),
                *argv,
            ]
        return argv

    def start(self, *, wait: bool = True, timeout: float = 20.0) -> ProxyProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.state_tmpfs is not None:
            self.state_dir.mkdir(exist_ok=True)  # the mount point
        previous = self.status().get("syncs", 0) if self.status_path.exists() else 0
        log = self.log_path.open("a")
        env = self.lab.process_env() | self.extra_env
        if self.path_prefix is not None:
            env["PATH"] = f"{self.path_prefix}:{env.get('PATH', '')}"
        self.proc = self.lab.spawn(
            self.node.ns, self.argv(), stdout=log, stderr=subprocess.STDOUT, env=env
        )
        log.close()
        if wait:
            self.wait_synced(
                after=previous if self.status().get("pid") == self.proc.pid else 0, timeout=timeout
            )
        return self

    @property
    def state_view(self) -> Path:
        """The state dir as this process sees it (through its own mount namespace when the
        state dir is a private tmpfs)."""
        if self.state_tmpfs is not None and self.proc is not None:
            return Path(f"/proc/{self.proc.pid}/root") / self.state_dir.relative_to("/")
        return self.state_dir

    @property
    def status_path(self) -> Path:
        return self.state_view / "status.json"

    def status(self) -> dict[str, Any]:
        try:
            return json.loads(self.status_path.read_text())
        except (OSError, ValueError):
            return {}

    def wait_synced(self, *, after: int = 0, timeout: float = 20.0) -> dict[str, Any]:
        """Wait until this process has completed more than `after` syncs."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.status()
            if (
                self.proc is not None
                and st.get("pid") == self.proc.pid
                and st.get("syncs", 0) > after
            ):
                return st
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"kproxy exited with {self.proc.returncode}:\n{self.log_tail()}")
            time.sleep(0.05)
        raise TimeoutError(f"kproxy did not sync within {timeout} s:\n{self.log_tail()}")

    def get(self, url: str, timeout: float = 5.0) -> tuple[int, str]:
        """GET an http:// URL from inside the proxy's node namespace (its /metrics, its
        /healthz), where the bench or test process cannot connect by itself: (HTTP status,
        body). From this process: no interpreter started per request (in UML each start
        costs the guest's one CPU seconds)."""
        parts = urlsplit(url)
        if parts.scheme != "http" or parts.hostname is None:
            raise ValueError(f"not an http URL: {url!r}")
        conn = _NetnsHTTPConnection(self.node.ns, parts.hostname, parts.port or 80, timeout)
        try:
            conn.request("GET", parts.path or "/")
            resp = conn.getresponse()
            body = resp.read().decode(errors="replace")
        finally:
            conn.close()
        return resp.status, body

    def fetch(self, url: str, timeout: float = 5.0) -> str:
        """The body of get(url); OSError unless the answer is 200."""
        status, body = self.get(url, timeout)
        if status != 200:
            raise OSError(f"GET {url}: HTTP {status}")
        return body

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """kill -9, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


class _NetnsHTTPConnection(http.client.HTTPConnection):
    """An HTTP connection whose socket is made inside a network namespace."""

    def __init__(self, netns: str, host: str, port: int, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self.netns = netns

    def connect(self) -> None:
        sock = socket_in_netns(self.netns, socket.AF_INET, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect((self.host, self.port))
        except OSError:
            sock.close()
            raise
        self.sock = sock
