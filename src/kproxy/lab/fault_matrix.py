"""The fault matrix: one kproxy on a lab node, traffic to a service nobody changes, and
faults injected (kproxy.lab.faults) into the syncs and switches of another service.

The kernel tests (tests/test_faults_kernel.py) assert on what a case observed;
bench/fault_bench.py runs the cases many times and prints a table.

Services: "web" (10.96.0.10:80, pods 1 and 2) carries the load and is never changed;
"moving" (10.96.0.20:80) has its one endpoint flipped between pod 3 and pod 4, so each
flip queues a change whose sync meets the fault. A rig with UDP gives both a UDP port 53
too (load on web's), and keeps one UDP flow of a fixed source port to "moving": after a
flip, only the cleanup of stale conntrack flows moves it to the new pod.

The rig names what serves as a switch target (layouts.target_name): a mode, or nftables
mode in a layout by its dataplane name ("nftables-compact"); "nftables" is upstream's
layout.
"""

from __future__ import annotations

import http.client
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kproxy.dataplane.anchor import CHAIN as ANCHOR_CHAIN
from kproxy.dataplane.anchor import TABLE as ANCHOR_TABLE
from kproxy.dataplane.nftables.layouts import (
    COMPACT,
    DEFAULT_LAYOUT,
    TABLES,
    dataplane_name,
    parse_target,
    target_name,
)
from kproxy.lab.faults import StateDirFault, ToolFaults
from kproxy.lab.load import LoadHarness, LoadResult
from kproxy.lab.proxy import ProxyProcess, proxy_config
from kproxy.lab.topology import Lab
from kproxy.server.admin import SOCKET_NAME, AdminUnavailable, call

WEB = ("10.96.0.10", 80)
MOVING = ("10.96.0.20", 80)
MOVING_PODS = ("pod3", "pod4")
UDP_PORT = 53
STICKY_SPORT = 41999  # the UDP flow to "moving" (the load's own UDP has another port)
CONNTRACK_FAILURES = "kproxy_conntrack_cleanup_failures_total"
HEALTHZ_PORT = 10256
METRICS_PORT = 10249
STATUS_CLI_TIMEOUT = 30.0
# Failure counters per mode, upstream's names (kproxy_sync_failures_total for every mode;
# upstream's ipvs mode counts only its iptables-restore failures).
FAILURE_METRIC = {
    "iptables": "kubeproxy_sync_proxy_rules_iptables_restore_failures_total",
    "nftables": "kubeproxy_sync_proxy_rules_nftables_sync_failures_total",
}


def _objects(moving_pod: str, pod_ips: dict[str, str], udp: bool = False) -> list[dict[str, Any]]:
    ports: list[dict[str, Any]] = [{"name": "http", "port": 80, "targetPort": 8080}]
    slice_ports: list[dict[str, Any]] = [{"name": "http", "port": 8080}]
    if udp:
        ports.append({"name": "dns", "port": UDP_PORT, "targetPort": 8080, "protocol": "UDP"})
        slice_ports.append({"name": "dns", "port": 8080, "protocol": "UDP"})

    def svc(name: str, ip: str, pods: list[str]) -> list[dict[str, Any]]:
        return [
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": name, "namespace": "default"},
                "spec": {"clusterIP": ip, "ports": ports},
            },
            {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": f"{name}-1",
                    "namespace": "default",
                    "labels": {"kubernetes.io/service-name": name},
                },
                "addressType": "IPv4",
                "ports": slice_ports,
                "endpoints": [{"addresses": [pod_ips[p]], "nodeName": "node1"} for p in pods],
            },
        ]

    return [*svc("web", WEB[0], ["pod1", "pod2"]), *svc("moving", MOVING[0], [moving_pod])]


def _write(path: Path, docs: list[dict[str, Any]]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    tmp.replace(path)


@dataclass
class Outcome:
    """What one fault case saw."""

    fault: str
    step: str
    mode: str
    failed_requests: int = 0  # to "web", the service the fault did not concern
    recovered: bool = False
    recover_seconds: float | None = None
    in_status: bool = False  # the fault in `kproxy status` (last_error / last_switch)
    in_metrics: bool = False  # a failure counter went up
    healthz_503: bool | None = None  # None: not waited for (the case had no queued change)
    leftovers: list[str] = field(default_factory=list)  # objects of a mode not serving
    notes: str = ""

    @property
    def ok(self) -> bool:
        return (
            self.failed_requests == 0
            and self.recovered
            and self.in_status
            and self.in_metrics
            and self.healthz_503 is not False
            and not self.leftovers
        )


class FaultRig:
    """kproxy in `mode` (a mode, or "nftables-compact") on the lab's node with every tool
    wrapped, and load on "web"."""

    def __init__(
        self,
        lab: Lab,
        workdir: Path,
        mode: str,
        *,
        backend: str = "nft",
        sync_period: float = 1.0,
        tool_timeout: float = 1.0,
        state_tmpfs: str | None = None,
        udp: bool = False,
    ) -> None:
        if len(lab.pods) < 4:
            raise ValueError("the fault matrix needs a lab of 4 pods")
        self.lab = lab
        self.workdir = workdir
        self.mode = mode
        self.backend = backend
        self.sync_period = sync_period
        self.udp = udp
        self.source = workdir / "objects"
        self.source.mkdir(parents=True, exist_ok=True)
        self.moving_pod = MOVING_PODS[0]
        _write(self.source / "services.yaml", _objects(self.moving_pod, lab.pod_ips, udp))
        _write(
            self.source / "node.yaml",
            [
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {"name": "node1", "labels": {"kubernetes.io/hostname": "node1"}},
                    "spec": {"podCIDR": "10.244.0.0/24", "podCIDRs": ["10.244.0.0/24"]},
                    "status": {"addresses": [{"type": "InternalIP", "address": lab.node_ip}]},
                }
            ],
        )
        config = workdir / "config.yaml"
        configured, layout = parse_target(mode)
        config.write_text(proxy_config(configured, sync_period=f"{sync_period:g}s"))
        self.faults = ToolFaults(workdir / "faults")
        args = ["--iptables-backend", backend, "--tool-timeout", f"{tool_timeout:g}"]
        self.proxy = ProxyProcess(
            lab,
            self.source,
            config=config,
            args=[*args, "--nftables-layout", layout] if layout else args,
            workdir=workdir / "kproxy",
            path_prefix=self.faults.bin,
            env=self.faults.env(),
            state_tmpfs=state_tmpfs,
        )
        self.load: LoadHarness | None = None
        self.last_divergence: str | None = None  # why the last recovery had not converged
        self.status_seconds: list[float] = []  # each `kproxy status` CLI call's wall time
        self._prober = lab.agent(lab.pod_ns[0])

    # -- lifecycle ------------------------------------------------------------------------

    def start(self, timeout: float = 30) -> FaultRig:
        """timeout: for kproxy's first sync (longer in UML)."""
        self.proxy.start(timeout=timeout)
        wait_for(lambda: self.live_modes() == {self.mode}, 20, "the mode serving alone")
        udp = (WEB[0], UDP_PORT) if self.udp else None
        self.load = LoadHarness(self.lab, tcp=WEB, udp=udp, streams=3).start()
        time.sleep(0.3)
        return self

    def failed_so_far(self) -> int:
        return self.load.result.failures if self.load is not None else 0

    def stop(self) -> LoadResult | None:
        result = self.load.stop() if self.load is not None else None
        self.load = None
        self.faults.clear()
        self.proxy.stop()
        return result

    def __enter__(self) -> FaultRig:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    # -- what kproxy says -----------------------------------------------------------------

    def http(self, port: int, path: str) -> tuple[int, str]:
        """(HTTP status, body) of kproxy's server on `port` (status 0: no answer)."""
        try:
            return self.proxy.get(f"http://127.0.0.1:{port}{path}", timeout=5)
        except (OSError, http.client.HTTPException):
            return 0, ""

    def healthz(self) -> int:
        return self.http(HEALTHZ_PORT, "/healthz")[0]

    def metric(self, name: str, **labels: str) -> float:
        """The sum of a metric's samples matching labels (0 when absent)."""
        _, body = self.http(METRICS_PORT, "/metrics")
        total = 0.0
        for line in body.splitlines():
            m = re.match(r"^([a-zA-Z_:]+)(\{[^}]*\})?\s+(\S+)$", line)
            if m is None or m.group(1) != name:
                continue
            found = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            if all(found.get(k) == v for k, v in labels.items()):
                total += float(m.group(3))
        return total

    def failures_metric(self) -> float:
        return self.metric("kproxy_sync_failures_total") + self.metric(
            FAILURE_METRIC.get(parse_target(self.mode)[0], "kproxy_sync_failures_total")
        )

    def status(self) -> dict[str, Any]:
        """`kproxy status --json`, over the admin socket (its wall time kept in
        status_seconds)."""
        started = time.monotonic()
        try:
            proc = self._status_cli()
        except subprocess.TimeoutExpired:
            return {"_error": f"kproxy status took over {STATUS_CLI_TIMEOUT:g} s"}
        finally:
            self.status_seconds.append(round(time.monotonic() - started, 2))
        try:
            return dict(json.loads(proc.stdout))
        except ValueError:
            return {"_error": proc.stderr}

    def _status_cli(self) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "kproxy.cli",
                "status",
                "--json",
                "--state-dir",
                str(self.proxy.state_view),
            ],
            capture_output=True,
            text=True,
            check=False,
            timeout=STATUS_CLI_TIMEOUT,
            env=self.lab.process_env(),
        )

    def switch(self, to: str, timeout: float = 60) -> dict[str, Any]:
        """The switch request `kproxy switch` sends after its preflight (the preflight
        reads the kernel with the same tools and would meet the fault first)."""
        mode, layout = parse_target(to)
        request: dict[str, object] = {"op": "switch", "to": mode, "timeout": timeout}
        if mode == "nftables":  # "nftables" is upstream's layout, whichever kproxy started in
            request["nftables_layout"] = layout or DEFAULT_LAYOUT
        try:
            return call(self.proxy.state_view / SOCKET_NAME, request, timeout=timeout + 60)
        except (AdminUnavailable, OSError) as err:
            return {"ok": False, "error": f"no answer: {err}"}

    # -- the kernel -----------------------------------------------------------------------

    def live_modes(self) -> set[str]:
        """The modes whose rules sit in the packet path of the node, nftables mode's by
        layout (and the switch's anchor, which must not outlive a switch)."""
        ns = self.lab.node_ns
        ipt = f"iptables-{self.backend}-save"
        nat = self.lab.exec(ns, [ipt, "-t", "nat"], check=False).stdout
        tables = self.lab.exec(ns, ["nft", "list", "tables"], check=False).stdout
        modes = set()
        # ipvs mode jumps to a KUBE-SERVICES chain too, but has no per-service chains.
        if re.search(r"^-A (PREROUTING|OUTPUT) .*-j KUBE-SERVICES", nat, re.M) and (
            "-j KUBE-SVC-" in nat
        ):
            modes.add("iptables")
        if self._ipvs_present():
            modes.add("ipvs")
        if "-j KUBE-PORTALS-CONTAINER" in nat:
            modes.add("userspace")
        modes |= set(self._nft_dataplanes(tables))
        if self._anchor_present(tables):
            modes.add("anchor")
        return modes

    @staticmethod
    def _nft_dataplanes(nft_tables: str) -> dict[str, str]:
        """nftables mode's dataplanes whose table `nft list tables` lists -> the table."""
        return {
            dataplane_name(layout): table
            for layout, table in TABLES.items()
            if re.search(rf"^table ip {re.escape(table)}$", nft_tables, re.M)
        }

    def _ipvs_present(self) -> bool:
        ns = self.lab.node_ns
        if "kube-ipvs0" in self.lab.exec(ns, ["ip", "-o", "link"], check=False).stdout:
            return True
        # ipvsadm would load ip_vs into a kernel without it (the host's, outside UML).
        if not Path("/sys/module/ip_vs").exists():
            return False
        vs = self.lab.exec(ns, ["ipvsadm", "-S", "-n"], check=False).stdout
        return any(line.startswith("-A ") for line in vs.splitlines())

    def _anchor_present(self, nft_tables: str) -> bool:
        if ANCHOR_TABLE in nft_tables:
            return True
        # The anchor's fallback when nft cannot take it: a chain of iptables-legacy's
        # mangle table (a full save: `-t mangle` would create the table).
        legacy = self.lab.exec(self.lab.node_ns, ["iptables-legacy-save"], check=False).stdout
        return ANCHOR_CHAIN in legacy

    def leftovers(self) -> list[str]:
        """Objects of modes other than the serving one (chains, tables)."""
        ns = self.lab.node_ns
        serving = self.mode
        out = []
        nat = self.lab.exec(ns, [f"iptables-{self.backend}-save", "-t", "nat"], check=False)
        if serving != "iptables" and re.search(r"^:KUBE-SVC-", nat.stdout, re.M):
            out.append("iptables chains KUBE-SVC-*")
        tables = self.lab.exec(ns, ["nft", "list", "tables"], check=False).stdout
        nft = self._nft_dataplanes(tables)
        out += [f"nftables table ip {nft[plane]}" for plane in sorted(set(nft) - {serving})]
        if serving != "ipvs" and self._ipvs_present():
            out.append("ipvs virtual servers or kube-ipvs0")
        if self._anchor_present(tables):
            out.append("the switch's conntrack anchor")
        return out

    # -- changes --------------------------------------------------------------------------

    def move(self) -> str:
        """Flip "moving" to its other pod (a queued change); returns the new pod."""
        self.moving_pod = MOVING_PODS[1] if self.moving_pod == MOVING_PODS[0] else MOVING_PODS[0]
        _write(self.source / "services.yaml", _objects(self.moving_pod, self.lab.pod_ips, self.udp))
        return self.moving_pod

    def moving_answers_from(self) -> str | None:
        r = self._prober.request(proto="tcp", dst=MOVING[0], port=MOVING[1], timeout=1.0)
        return r.pod if r.ok else None

    def sticky_udp_answers_from(self) -> str | None:
        """Who answers the UDP flow of a fixed source port to "moving" (its conntrack entry
        keeps it on one endpoint until something deletes the entry)."""
        r = self._prober.request(
            proto="udp", dst=MOVING[0], port=UDP_PORT, timeout=1.0, sport=STICKY_SPORT
        )
        return r.pod if r.ok else None

    def converged(self) -> bool:
        """The serving mode alone in the packet path, "moving" served by its current pod
        (with UDP: its flow of a fixed source port too), kproxy's status free of errors
        and /healthz 200."""
        return self.divergence() is None

    def divergence(self) -> str | None:
        """What keeps the rig from having converged (None: nothing)."""
        live = self.live_modes()
        if live != {self.mode}:
            return f"live modes {sorted(live)}"
        answers = [self.moving_answers_from() for _ in range(3)]
        if any(a != self.moving_pod for a in answers):
            return f"moving answered by {answers}, not {self.moving_pod}"
        if self.udp and (udp := self.sticky_udp_answers_from()) != self.moving_pod:
            return f"moving's UDP flow answered by {udp}, not {self.moving_pod}"
        st = self.proxy.status()
        for key in ("last_error", "conntrack_error"):
            if st.get(key) is not None:
                return f"status {key}: {st[key]}"
        if st.get("pending", True):
            return "status: a change pending"
        code = self.healthz()
        return None if code == 200 else f"/healthz {code}"

    # -- the cases ------------------------------------------------------------------------

    def sync_case(self, fault: str, step: str, inject: Callable[[ToolFaults], None]) -> Outcome:
        """A fault at a sync's apply step: a change is queued and its sync fails until the
        fault is cleared."""
        if step.endswith("cleanup"):
            return self._cleanup_case(fault, step, inject)
        out = Outcome(fault, step, self.mode)
        failed0 = self.failed_so_far()
        before = self.proxy.status().get("failures", 0)
        metric0 = self.failures_metric()
        inject(self.faults)
        queued = time.monotonic()
        self.move()
        try:
            wait_for(lambda: self.proxy.status().get("failures", 0) > before, 20, "a failure")
            st = self.status()
            out.in_status = bool(st.get("last_error")) and st.get("consecutive_failures", 0) > 0
            out.in_metrics = self.failures_metric() > metric0
            # upstream: unhealthy once a queued change waits 2 x syncPeriod. kproxy queues it
            # when its source sees the move, a moment after `queued` (longer in UML under
            # load): the 503 must come, within a bound, not at one instant.
            out.healthz_503 = self._healthz_turns_503(queued + 2 * self.sync_period + 10)
            out.notes = str(st.get("last_error"))[:160]
            if not out.healthz_503:
                out.notes += f"; {self.last_divergence}"
        finally:
            self.faults.clear()
        self._finish(out, failed0)
        return out

    def _healthz_turns_503(self, deadline: float) -> bool:
        seen = []
        while True:
            seen.append(self.healthz())
            if seen[-1] == 503:
                return True
            if time.monotonic() > deadline:
                self.last_divergence = f"/healthz answered {seen[-5:]} (0: no answer)"
                return False
            time.sleep(0.2)

    def _cleanup_case(self, fault: str, step: str, inject: Callable[[ToolFaults], None]) -> Outcome:
        """A fault in a cleanup the sync goes on without (upstream: a cleanup failure,
        not a failed sync; /healthz stays 200): the change itself is applied."""
        out = Outcome(fault, step, self.mode)
        failed0 = self.failed_so_far()
        name = "kubeproxy_sync_proxy_rules_nftables_cleanup_failures_total"
        metric0 = self.metric(name)
        syncs0 = self.proxy.status().get("syncs", 0)

        def failed_cleanup() -> bool:
            st = self.proxy.status()
            result = st.get("last_result") or {}
            return st.get("syncs", 0) > syncs0 and bool(result.get("cleanup_failures"))

        inject(self.faults)
        try:
            self.move()  # the old endpoint's chain goes stale: a later sync deletes it
            wait_for(failed_cleanup, 20, "a failed cleanup in status")
            out.in_status = True
            out.in_metrics = self.metric(name) > metric0
            out.healthz_503 = None
            out.notes = f"healthz {self.healthz()} (the sync went on)"
        except TimeoutError as err:
            out.notes = str(err)
        finally:
            self.faults.clear()
        self._finish(out, failed0)
        return out

    def conntrack_case(self, fault: str, inject: Callable[[ToolFaults], None]) -> Outcome:
        """A fault of the conntrack tool in the cleanup of stale UDP flows after a sync that
        removed "moving"'s UDP endpoint: the sync goes on (upstream: a logged error, not a
        failed sync), the flow keeps its old endpoint while the fault lasts, and once it is
        gone a later sync deletes the stale entry by itself."""
        if not self.udp:
            raise ValueError("a conntrack case needs a rig with UDP")
        out = Outcome(fault, "sync: UDP conntrack cleanup", self.mode)
        failed0 = self.failed_so_far()
        old_pod = self.moving_pod
        if self.sticky_udp_answers_from() != old_pod:
            raise RuntimeError(f"the UDP flow to moving is not on {old_pod} before the case")
        metric0 = self.metric(CONNTRACK_FAILURES)
        before = self.proxy.status().get("conntrack_failures", 0)
        inject(self.faults)
        try:
            self.move()
            wait_for(
                lambda: self.proxy.status().get("conntrack_failures", 0) > before,
                20,
                "a failed conntrack cleanup in status",
            )
            st = self.status()
            out.in_status = bool(st.get("conntrack_error")) and st.get("last_error") is None
            out.in_metrics = self.metric(CONNTRACK_FAILURES) > metric0
            out.healthz_503 = None
            during = self.sticky_udp_answers_from()
            out.notes = (
                f"healthz {self.healthz()}; during the fault the UDP flow went to {during} "
                f"(was {old_pod}); {str(st.get('conntrack_error'))[:100]}"
            )
        except TimeoutError as err:
            out.notes = str(err)
        finally:
            self.faults.clear()
        self._finish(out, failed0)
        return out

    def switch_case(
        self, fault: str, step: str, to: str, inject: Callable[[ToolFaults], None]
    ) -> Outcome:
        """A fault at one step of a switch to `to`: the switch fails with the old mode
        serving alone, or completes (a fault after the cut-over); then a change is synced
        by whichever mode serves, and the rig switches back if it had switched."""
        out = Outcome(fault, step, self.mode)
        failed0 = self.failed_so_far()
        metric0 = self.metric("kproxy_mode_switches_total", result="failed")
        inject(self.faults)
        try:
            report = self.switch(to)
        finally:
            self.faults.clear()
        st = self.status()
        if report.get("ok"):
            switched = True
            last = st.get("last_switch") or {}
            details = " ".join(str(s.get("detail")) for s in last.get("steps", []))
            # Visible: leftovers named, or the anchor's fallback when nft refused it.
            out.in_status = bool(last.get("leftover_error")) or "iptables-legacy" in details
            out.in_metrics = True  # a completed switch counts as ok; leftovers in the report
            out.notes = f"switched; leftovers: {report.get('leftover_error')}"[:160]
        else:
            switched = False
            last = st.get("last_switch") or {}
            serving = target_name(str(st.get("mode")), st.get("nftables_layout"))
            out.in_status = bool(last.get("error")) and serving == self.mode
            out.in_metrics = self.metric("kproxy_mode_switches_total", result="failed") > metric0
            out.notes = str(report.get("error"))[:160]
        previous = self.mode
        if switched:
            self.mode = to
        self.move()
        self._finish(out, failed0)
        if switched:
            back = self.switch(previous)
            if back.get("ok"):
                self.mode = previous
            wait_for(self.converged, 30, f"back in {self.mode} after the case")
        return out

    def _finish(self, out: Outcome, failed0: int) -> None:
        """Every case's end, the fault gone: how long kproxy took to converge by itself,
        the requests that failed during the case, and what it left behind."""
        out.recover_seconds, out.recovered = self._recover()
        out.failed_requests = self.failed_so_far() - failed0
        out.leftovers = self.leftovers()

    def _recover(self, timeout: float = 30) -> tuple[float | None, bool]:
        started = time.monotonic()
        deadline = started + timeout
        while time.monotonic() < deadline:
            self.last_divergence = self.divergence()
            if self.last_divergence is None:
                return round(time.monotonic() - started, 2), True
            time.sleep(0.1)
        return None, False

    def kill_case(self, rng: Any, during: str) -> Outcome:
        """kill -9 of kproxy at a random moment of a sync ("sync") or of a switch to the
        other mode ("switch"); then a restart, which must converge on the configured mode
        with nothing of the other left."""
        out = Outcome("kill -9 of kproxy", during, self.mode)
        failed0 = self.failed_so_far()
        other = "nftables" if self.mode == "iptables" else "iptables"
        switcher = None
        if during == "switch":
            switcher = threading.Thread(target=self.switch, args=(other,), daemon=True)
            switcher.start()
            time.sleep(rng.uniform(0.0, 1.5))  # somewhere in the switch's steps
        else:
            self.move()
            time.sleep(rng.uniform(0.0, 0.4))
        self.proxy.kill()
        if switcher is not None:
            switcher.join(timeout=60)
        out.in_status = out.in_metrics = True  # nothing runs to report: the restart is the test
        out.notes = f"at {sorted(self.live_modes())}"
        self.proxy.start(timeout=30)
        self._finish(out, failed0)
        return out

    def state_dir_case(self, fault: str) -> Outcome:
        """The state dir read-only or full while changes sync and a switch is tried."""
        out = Outcome(f"state dir {fault}", "sync + switch", self.mode)
        failed0 = self.failed_so_far()
        sd = StateDirFault(self.proxy)
        (sd.read_only if fault == "read-only" else sd.fill)()
        try:
            self.move()
            wait_for(lambda: self.moving_answers_from() == self.moving_pod, 10, "the change synced")
            other = "nftables" if self.mode == "iptables" else "iptables"
            report = self.switch(other)
            st = self.status()
            out.in_status = bool(st.get("state_dir_error")) or "state" in str(report)
            out.in_metrics = True  # no upstream metric for the state dir; syncs go on
            if report.get("ok"):
                out.notes = "switched (its records not kept)"
                self.mode = other
            else:
                out.notes = str(report.get("error"))[:160]
            out.healthz_503 = None
        finally:
            (sd.writable if fault == "read-only" else sd.free)()
        self.move()
        self._finish(out, failed0)
        out.recovered = out.recovered and not self.status().get("state_dir_error")
        return out


def wait_for(check: Callable[[], bool], timeout: float, what: str) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if check():
            return time.monotonic() - started
        time.sleep(0.1)
    raise TimeoutError(f"{what}: not within {timeout} s")


# --- the cases ----------------------------------------------------------------------------


def restore_tool(mode: str, backend: str = "nft") -> tuple[str, str]:
    """(tool, argument match) of a sync's apply step in `mode` (a layout's dataplane name
    for nftables mode)."""
    if parse_target(mode)[0] == "iptables":
        return f"iptables-{backend}-restore", ""
    return "nft", "-f"


# (fault, step, how to inject it)
Case = tuple[str, str, Callable[[ToolFaults], None]]


def sync_faults(mode: str, backend: str = "nft") -> list[Case]:
    """(fault, step, inject) for a sync's apply step of `mode`."""
    if parse_target(mode)[1] == COMPACT:
        # A change of endpoints is map elements alone in the compact layout, applied in one
        # netlink batch (nftables/steps.py): no nft call, and no stale chain to clean up.
        return [
            ("netlink batch fails", "sync: apply", lambda f: f.netlink("nftables", "fail")),
            ("netlink batch hangs", "sync: apply", lambda f: f.netlink("nftables", "hang", 2)),
        ]
    tool, match = restore_tool(mode, backend)
    cases: list[Case] = [
        (f"{tool} fails", "sync: apply", lambda f: f.set(tool, "fail", match=match, code=2)),
        (f"{tool} hangs", "sync: apply", lambda f: f.set(tool, "hang", match=match)),
        (f"{tool} killed", "sync: apply", lambda f: f.set(tool, "kill", match=match)),
        (
            f"{tool} killed after its commit",
            "sync: apply",
            lambda f: f.set(tool, "kill-after", match=match),
        ),
    ]
    if parse_target(mode)[0] == "nftables":
        # Netlink carries the deletes of stale chains, a cleanup the sync goes on without.
        cleanup = "sync: stale-chain cleanup"
        cases += [
            ("netlink batch fails", cleanup, lambda f: f.netlink("nftables", "fail")),
            ("netlink batch hangs", cleanup, lambda f: f.netlink("nftables", "hang", 2)),
        ]
    return cases


def ipvs_sync_faults() -> list[Case]:
    """(fault, step, inject) in ipvs mode's sync: its ipset restore (a flip changes the
    hairpin set of endpoints) fails, hangs past the tool timeout or is killed; its IPVS
    netlink batch (a flip changes destinations) fails or gets no answer (the injected hang
    then fails the batch as kproxy.host.netlink_wait's bound does)."""
    return [
        ("ipset restore fails", "sync: ipset", lambda f: f.set("ipset", "fail", match="restore")),
        ("ipset restore hangs", "sync: ipset", lambda f: f.set("ipset", "hang", match="restore")),
        ("ipset restore killed", "sync: ipset", lambda f: f.set("ipset", "kill", match="restore")),
        ("ipvs netlink batch fails", "sync: ipvs", lambda f: f.netlink("ipvs", "fail")),
        ("ipvs netlink batch hangs", "sync: ipvs", lambda f: f.netlink("ipvs", "hang", 3)),
    ]


def conntrack_faults() -> list[tuple[str, Callable[[ToolFaults], None]]]:
    """(fault, inject) of the conntrack tool, at every call (the listing comes first)."""
    return [
        ("conntrack fails", lambda f: f.set("conntrack", "fail", code=1)),
        ("conntrack hangs", lambda f: f.set("conntrack", "hang")),
        ("conntrack killed", lambda f: f.set("conntrack", "kill")),
    ]


def switch_faults(old: str, to: str, backend: str = "nft") -> list[Case]:
    """(fault, step, inject) at each switch step that runs a tool, for old -> to (modes,
    or nftables mode in a layout by its dataplane name)."""
    ipt = f"iptables-{backend}-restore"
    to_mode, to_layout = parse_target(to)
    table = TABLES[to_layout or DEFAULT_LAYOUT]
    cases: list[Case] = [
        (
            "nft -f fails",
            "switch: anchor",
            lambda f: f.set("nft", "fail", match="-f", input_match="ct-anchor"),
        ),
    ]
    if to_mode == "nftables":
        cases += [
            (
                "nft -f fails",
                "switch: program",
                lambda f: f.set("nft", "fail", match="-f", input_match=table),
            ),
            (
                "nft -f hangs",
                "switch: program",
                lambda f: f.set("nft", "hang", match="-f", input_match=table),
            ),
            ("nft list fails", "switch: verify", lambda f: f.set("nft", "fail", match="list")),
        ]
    else:
        cases += [
            ("iptables-restore fails", "switch: program", lambda f: f.set(ipt, "fail")),
            ("iptables-restore killed", "switch: program", lambda f: f.set(ipt, "kill")),
        ]
    if old == "iptables":
        cases += [
            (
                "iptables-restore fails",
                "switch: cut-over",
                lambda f: f.set(ipt, "fail", input_match="-D PREROUTING"),
            ),
            (
                "netlink batch and iptables-restore fail",
                "switch: remove",
                lambda f: (
                    f.netlink("any", "fail"),
                    f.set(ipt, "fail", input_match="-X KUBE-"),
                ),
            ),
        ]
    else:
        # The detach is a netlink batch, with nft as its fallback: both fail, and so does
        # the full sync that would confirm the old mode (nft again), so the new mode stays
        # beside it until the old one syncs and the leftover cleanup removes it.
        cases += [
            (
                "netlink batch and nft -f fail",
                "switch: cut-over",
                lambda f: (f.netlink("nftables", "fail"), f.set("nft", "fail", match="-f")),
            ),
        ]
    return cases
