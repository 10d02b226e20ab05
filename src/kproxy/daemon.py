"""Assemble a running proxy from a config: source, tracker, dataplane, sync loop."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kproxy.config import ConfigError, ProxyConfig, load_config, rule_options
from kproxy.conntrack import cleanup_stale_udp
from kproxy.dataplane.base import Dataplane
from kproxy.dataplane.nodepolicy import NodePortAddresses, localhost_node_ports_enabled
from kproxy.dataplane.registry import create_dataplane
from kproxy.defaults import DEFAULT_STATE_DIR
from kproxy.leftovers import clean_leftovers
from kproxy.memory import release_free_heap
from kproxy.model.snapshot import ChangeTracker
from kproxy.node_tuning import apply_conntrack_config, apply_oom_score
from kproxy.server.admin import SOCKET_NAME, AdminServer
from kproxy.server.http import HealthState, health_server, metrics_server
from kproxy.server.metrics import ProxyMetrics
from kproxy.server.service_health import ServiceHealthServer
from kproxy.sources.base import Source
from kproxy.sources.files import FileSource
from kproxy.switch import ModeSwitcher
from kproxy.sync import ProxyLoop
from kproxy.sysctl import set_sysctl
from kproxy.text import one_line

if TYPE_CHECKING:  # the agent brings the API client: imported only when it runs
    from kproxy.cluster.agent import ClusterAgent
    from kproxy.ops.preflight.run import PreflightResult
    from kproxy.ops.verify import Collector

log = logging.getLogger("kproxy.daemon")

# The first sync's status is written a moment before first_sync_done is set (the loop
# starts its runner in between): a preflight asked in that moment waits this long for it
# rather than answering "still starting".
PREFLIGHT_START_GRACE = 2.0
# How long a preflight waits for a running sync to end before it reads the kernel instead
# of taking the dataplane's proof of it (both change during a sync).
PROOF_WAIT = 2.0


class Daemon:
    def __init__(
        self,
        config: ProxyConfig,
        *,
        source: Path | Source,
        node_name: str,
        iptables_backend: str = "auto",
        node_ips: tuple[str, ...] = (),
        state_dir: Path | None = None,
        config_path: Path | None = None,
        admin_address: tuple[str, int] | None = None,
        follow_node_from: str | None = None,
        nftables_layout: str = "upstream",
    ) -> None:
        """admin_address: also serve the admin requests on this loopback TCP address.
        follow_node_from: with the API source, follow the mode the Node declares and report
        on the Node (cluster/agent.py); the value is the configured mode, where a removed
        declaration leads back."""
        self.config = config
        self.config_path = config_path
        self.config_watch = ConfigWatch(config_path, self) if config_path else None
        self.follow_node_from = follow_node_from
        self.agent: ClusterAgent | None = None
        self.node_name = node_name
        if isinstance(source, str | Path):
            if not Path(source).exists():
                raise FileNotFoundError(2, "no such file or folder", str(source))
            self.source: Source = FileSource(source)
        else:
            self.source = source  # any other Source, e.g. the API server's (sources/api.py)
        self.tracker = ChangeTracker(node_name)
        options = rule_options(config)
        # Before the node facts are read: tcpBeLiberal changes which rules are written.
        apply_conntrack_config(config)
        apply_oom_score(config.oom_score_adj)

        # nftables mode's layout when a switch names none (the one this kproxy was started
        # with); a switch may name the other (dataplane/nftables/layouts.py).
        self.nftables_layout = nftables_layout

        def make(target: str) -> Dataplane:
            from kproxy.dataplane.nftables.layouts import parse_target

            mode, layout = parse_target(target)
            return create_dataplane(
                mode,
                options=rule_options(self.config.model_copy(update={"mode": mode})),
                node_ips=node_ips,
                iptables_backend_choice=iptables_backend,
                state_dir=state_dir,
                port_range=config.port_range,
                nftables_layout=layout or nftables_layout,
            )[0]

        self.dataplane, facts = create_dataplane(
            config.effective_mode,
            options=options,
            node_ips=node_ips,
            iptables_backend_choice=iptables_backend,
            state_dir=state_dir,
            port_range=config.port_range,
            nftables_layout=nftables_layout,
        )
        self.switcher = ModeSwitcher(make_dataplane=make, state_dir=state_dir)
        self.previous_mode: str | None = None
        self.previous_layout: str | None = None  # nftables mode's, when previous_mode is
        self.last_switch: dict[str, object] | None = None
        self.first_sync_done = threading.Event()
        log.info("node %s: node IPs %s", node_name, ", ".join(facts.node_ips) or "none")
        if localhost_node_ports_enabled(options):
            # NodePorts on 127.0.0.1 need route_localnet (upstream sets it too); KUBE-FIREWALL
            # blocks the martian traffic this would otherwise let in.
            set_sysctl("net/ipv4/conf/all/route_localnet", 1)
        self.metrics = ProxyMetrics(config.effective_mode)
        self.metrics.follow_inputs(
            invalid_objects=lambda: self.tracker.rejected_total,
            failing_files=self._failing_files,
        )
        self.health = HealthState(health_timeout=2 * config.sync_period)
        # Health check NodePorts listen where NodePorts answer (loopback included).
        hc_ips = NodePortAddresses.from_entries(options.node_port_addresses).addresses(
            facts.node_ips, facts.local_addresses, include_loopback=True
        )
        self.service_health = ServiceHealthServer(
            proxy_healthy=lambda: self.health.report()[0], addresses=lambda: hc_ips
        )
        self.state_dir = state_dir
        self.state_dir_error: str | None = None
        self.leftovers_removed: list[str] | None = None
        self.leftover_cleaner = LeftoverCleaner(self)
        self.loop = ProxyLoop(
            self.tracker,
            self.dataplane,
            min_sync_period=config.min_sync_period,
            sync_period=config.sync_period,
            udp_cleaner=self._clean_udp,
            observers=[
                self.metrics,
                self.health,
                self.service_health,
                StatusFile(self),
                self.leftover_cleaner,
            ],
        )
        self.admin = AdminServer(
            (state_dir or DEFAULT_STATE_DIR) / SOCKET_NAME,
            {
                "status": lambda _: {"ok": True, **self.status()},
                "sync": self._sync_request,
                "switch": self._switch_request,
                "preflight": self._preflight_request,
            },
            tcp_address=admin_address,
        )
        hard = config.bind_address_hard_fail
        self.servers = [
            metrics_server(
                config.metrics_bind_address, self.metrics, lambda: self.dataplane.mode, hard
            ),
            health_server(config.healthz_bind_address, self.health, self.metrics, hard),
        ]

    def start(self) -> None:
        log.info("kproxy starting in %s mode on node %s", self.dataplane.mode, self.node_name)
        for server in self.servers:
            server.start()
        # Before the first sync: once the status says synced, `kproxy switch` must find
        # the socket (a switch request waits for the first sync, _switch_request).
        self.admin.start()
        self.loop.start(self.source)
        self.first_sync_done.set()
        if self.config_watch is not None:
            self.config_watch.start()
        if self.follow_node_from is not None:
            self._start_agent(self.follow_node_from)

    def _start_agent(self, configured_mode: str) -> None:
        """After the first sync: the agent reports the serving mode and may switch it."""
        from kproxy.cluster.agent import ClusterAgent
        from kproxy.sources.api import ApiSource

        if not isinstance(self.source, ApiSource):
            raise TypeError("following the Node's declared mode needs the API source")
        self.agent = ClusterAgent(self, self.source, configured_mode=configured_mode)
        self.agent.start()

    def _clean_udp(self, ips: dict[tuple[str, int], set[str]], ports: dict[int, set[str]]) -> int:
        if self.dataplane.moves_udp_flows:
            return 0
        return cleanup_stale_udp(ips, ports)

    @property
    def mode(self) -> str:
        return self.dataplane.mode

    def switch(
        self,
        to: str,
        timeout: float = 60.0,
        before: Path | None = None,
        nftables_layout: str | None = None,
    ) -> dict[str, object]:
        """Switch the running proxy to another mode (see kproxy.switch); returns the report.
        before: the preflight's fresh backup of the node, kept as the "before" record.
        nftables_layout: to nftables mode in this layout (default: the one kproxy was
        started with), or between the layouts."""
        if to == "previous":
            if self.previous_mode is None:
                return {"ok": False, "error": "no previous mode: this kproxy has not switched yet"}
            to, nftables_layout = self.previous_mode, self.previous_layout
        # Imported on use: a daemon in another mode loads no nftables module.
        from kproxy.dataplane.nftables.layouts import switch_layout

        nftables_layout = switch_layout(to, nftables_layout, self.nftables_layout)
        with self.loop.exclusive():
            old = self.dataplane
            snapshot = self.loop.applied_snapshot or self.tracker.snapshot()
            report, now_serving = self.switcher.switch(
                old, snapshot, to, timeout=timeout, before=before, layout=nftables_layout
            )
            if report.ok:
                self.previous_mode = old.mode
                self.previous_layout = old.nftables_layout
                self.dataplane = now_serving
                self.loop.set_dataplane(now_serving)
            if report.leftover_error:
                self.leftover_cleaner.again()
        if not report.ok:
            release_free_heap()  # what the failed attempt built (a success's record does it)
        self.metrics.switched(*report.names, report.ok, report.duration)
        self.last_switch = report.to_dict()
        self.write_status()
        self.loop.runner.run()  # changes that arrived during the switch
        return self.last_switch

    def preflight_report(self, target: str) -> dict[str, object]:
        """This node's preflight of a switch to `target`, for a rollout (cluster/duties.py):
        the same checks as `kproxy preflight --to`, the blocking ones and warnings as lines."""
        from kproxy.ops.preflight.findings import Severity

        result = self.preflight(target, None, backup_at_switch=True)

        def line(f: Any) -> str:
            return f"{f.id}: {f.found}"[:300]

        return {
            "ok": result.safe,
            "blocks": [line(f) for f in result.blocking],
            "warnings": [line(f) for f in result.findings if f.severity is Severity.WARN][:10],
        }

    def preflight(
        self, target: str, layout: str | None, *, backup_at_switch: bool
    ) -> PreflightResult:
        """The preflight of a switch to `target` (nftables mode: in `layout`, None: the one
        a switch would use), from this proxy's own objects, mode and configuration
        (ops/preflight/live.py): nothing re-read from the source, only the serving mode's
        destinations read from the kernel, and not even those while the dataplane proves
        what the kernel holds (Dataplane.proven_dumps)."""
        from kproxy.ops.preflight.live import LiveState, tracker_view
        from kproxy.ops.preflight.run import run_preflight

        with self.loop.between_syncs(wait=PROOF_WAIT) as quiet:
            # The dataplane, its proof and the snapshot it was written from, of one moment.
            dataplane = self.dataplane
            snapshot = self.loop.applied_snapshot or self.tracker.snapshot()
            proven = dataplane.proven_dumps() if quiet else {}
        live = LiveState(
            mode=dataplane.mode,
            flavour=dataplane.iptables_flavour,
            snapshot=snapshot,
            view=tracker_view(*self.tracker.parsed_objects()),
            layout=dataplane.nftables_layout,
            proven=proven,
        )
        return run_preflight(
            target,
            status={"ok": True, **self.status()},
            state_dir=self.state_dir or DEFAULT_STATE_DIR,
            config=self.config,
            config_path=self.config_path,
            node_name=self.node_name,
            live=live,
            backup_at_switch=backup_at_switch,
            target_layout=layout,
        )

    def _preflight_request(self, request: dict[str, object]) -> dict[str, object]:
        """The admin op `preflight`: {"to": MODE, "nftables_layout": LAYOUT (optional, with
        "to": nftables), "backup": "switch" | "write"}; the answer's "result" is the
        PreflightResult's JSON (the CLI prints it)."""
        from kproxy.dataplane.nftables.layouts import LAYOUTS, MODE
        from kproxy.modes import MODES

        to = request.get("to")
        if not isinstance(to, str) or to not in MODES:
            return {"ok": False, "error": f"preflight needs 'to': one of {', '.join(MODES)}"}
        layout = request.get("nftables_layout")
        if layout is not None and (layout not in LAYOUTS or to != MODE):
            return {
                "ok": False,
                "error": f"preflight's 'nftables_layout' must be one of {', '.join(LAYOUTS)}, "
                "with 'to': nftables",
            }
        backup = request.get("backup", "write")
        if backup not in ("switch", "write"):
            return {"ok": False, "error": "preflight's 'backup' is 'switch' or 'write'"}
        if not self.first_sync_done.wait(PREFLIGHT_START_GRACE):
            return {"ok": False, "error": "kproxy is still starting: its first sync is not done"}
        result = self.preflight(
            to, layout if isinstance(layout, str) else None, backup_at_switch=backup == "switch"
        )
        return {"ok": True, "result": result.to_dict()}

    def verify_collector(self) -> Collector:
        """`kproxy verify`'s sampler, fed from this process (no socket, no HTTP)."""
        from prometheus_client import generate_latest

        from kproxy.ops.verify import Collector

        def status() -> dict[str, object]:
            return {"ok": True, **self.status(), "healthy": self.health.report()[0]}

        return Collector(
            self.state_dir or DEFAULT_STATE_DIR,
            metrics_address="127.0.0.1:0",  # never fetched: `fetch` reads the registry
            fetch=lambda _url: generate_latest(self.metrics.registry).decode(),
            admin=status,
            count_services=lambda _mode: (None, "not read during a rollout"),
        )

    def _switch_request(self, request: dict[str, object]) -> dict[str, object]:
        to = request.get("to")
        if not isinstance(to, str):
            return {"ok": False, "error": "switch needs 'to': a mode name or 'previous'"}
        # ValueError: answered "bad request: ..." by the admin endpoint.
        timeout = request.get("timeout", 60.0)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            raise ValueError("'timeout' must be a number of seconds")
        if not 0 < timeout < math.inf:
            raise ValueError(f"'timeout' must be more than 0 s and finite, not {timeout}")
        before = request.get("before")
        if before is not None and not isinstance(before, str):
            raise ValueError("'before' must be the path of a backup file")
        layout = request.get("nftables_layout")
        if layout is not None:
            from kproxy.dataplane.nftables.layouts import LAYOUTS

            if layout not in LAYOUTS or to not in ("nftables", "previous"):
                return {
                    "ok": False,
                    "error": f"'nftables_layout' must be one of {', '.join(LAYOUTS)}, "
                    "with 'to': nftables",
                }
        # The snapshot a switch programs comes from the source's first delivery.
        if not self.first_sync_done.wait(timeout):
            return {
                "ok": False,
                "error": f"kproxy is still starting: its first sync did not finish within"
                f" {timeout:.0f} s; nothing was changed, try again",
            }
        return self.switch(
            to,
            timeout,
            Path(before) if isinstance(before, str) and before else None,
            nftables_layout=layout if isinstance(layout, str) else None,
        )

    def _sync_request(self, _: dict[str, object]) -> dict[str, object]:
        self.loop.request_full_sync()
        return {"ok": True, "queued": "full sync"}

    def _failing_files(self) -> int:
        return len(self.source.current_errors) if isinstance(self.source, FileSource) else 0

    def status(self) -> dict[str, object]:
        st = self.loop.status
        res = st.last_result
        # Bad input as the tracker and the source know it now, not as of the last sync: an
        # invalid object alone, or a file that stopped parsing, queues no sync.
        rejections = self.tracker.rejections()
        return {
            "mode": self.dataplane.mode,
            "nftables_layout": self.dataplane.nftables_layout,  # None in other modes
            # Its --nftables-layout: where a switch to nftables naming none goes, and what a
            # restart comes back in.
            "started_nftables_layout": self.nftables_layout,
            "node": self.node_name,
            "pid": os.getpid(),
            "syncs": st.syncs,
            "full_syncs": st.full_syncs,
            "failures": st.failures,
            "consecutive_failures": st.consecutive_failures,
            # /healthz's verdict, and why the state dir could not be written (if so).
            "healthy": self.health.report()[0],
            "state_dir_error": self.state_dir_error,
            "last_sync": st.last_sync,
            "last_full_sync": st.last_full_sync,
            "last_duration": st.last_duration,
            "last_error": one_line(st.last_error) if st.last_error else None,
            "services": res.services if res else 0,
            "invalid_objects": len(rejections),
            "generation": self.tracker.generation,
            "pending": self.loop.pending,
            "last_result": dataclasses.asdict(st.last_result) if st.last_result else None,
            "conntrack_deleted": st.conntrack_deleted,
            "conntrack_failures": st.conntrack_failures,
            "conntrack_error": one_line(st.conntrack_error) if st.conntrack_error else None,
            "leftovers_removed": self.leftovers_removed,
            "previous_mode": self.previous_mode,
            "previous_nftables_layout": self.previous_layout,
            "last_switch": self.last_switch,
            # The API source's per-resource resourceVersion, lists, watches, current error;
            # the file source's failing files and skipped documents (file, line, error).
            "source": self.source.state() if hasattr(self.source, "state") else None,
            "rejections": [str(r) for r in rejections],
            "invalid": [r.to_dict() for r in rejections],
        }

    def write_status(self) -> None:
        """status.json in the state dir: what `kproxy status` and the lab harness read."""
        if self.state_dir is None:
            return
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            tmp = self.state_dir / "status.json.tmp"
            tmp.write_text(json.dumps(self.status(), indent=2) + "\n")
            tmp.replace(self.state_dir / "status.json")
            self.state_dir_error = None
        except OSError as err:
            if self.state_dir_error is None:
                log.warning("could not write status: %s", err)
            self.state_dir_error = f"could not write status.json: {err}"

    def stop(self) -> None:
        if self.agent is not None:  # first: it may be about to ask for a switch
            self.agent.stop()
        if self.config_watch is not None:
            self.config_watch.stop()
        self.admin.stop()
        self.source.stop()
        self.loop.stop()
        self.switcher.stop_reaping()  # a retired ipvs mode's draining virtual servers
        self.switcher.wait_records(30)  # the last switch's after-record
        for server in self.servers:
            server.stop()
        self.service_health.stop()


class ConfigWatch:
    """Polls the config file; a changed `mode` switches live (no restart). Other changes
    are reported as needing a restart; a file that no longer validates changes nothing."""

    def __init__(self, path: Path, daemon: Daemon, interval: float = 1.0) -> None:
        self.path = path
        self.daemon = daemon
        self.interval = interval
        self._stop = threading.Event()
        self._seen = self._stamp()

    def _stamp(self) -> tuple[int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def start(self) -> None:
        threading.Thread(target=self._run, name="config-watch", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            stamp = self._stamp()
            if stamp == self._seen or stamp is None:
                continue
            self._seen = stamp
            self.changed()

    def changed(self) -> None:
        d = self.daemon
        try:
            new = load_config(self.path)
        except (ConfigError, OSError) as err:
            log.error("config change ignored, the running configuration stays: %s", err)
            return
        others = sorted(
            k
            for k, v in new.to_dict(effective=False).items()
            if k != "mode" and d.config.to_dict(effective=False).get(k) != v
        )
        if others:
            log.warning("config change of %s needs a restart to take effect", ", ".join(others))
        if new.effective_mode != d.dataplane.mode:
            log.info("config file now says mode %s: switching live", new.effective_mode)
            d.config = d.config.model_copy(update={"mode": new.mode})
            report = d.switch(new.effective_mode)
            if not report.get("ok"):
                log.error(
                    "config-driven switch to %s failed: %s", new.effective_mode, report.get("error")
                )


class LeftoverCleaner:
    """Once the mode is serving (first successful sync), remove other modes' leftovers."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.started = False

    def queued(self, when: float, pending_services: int, pending_endpoints: int) -> None:
        pass

    def synced(self, *_: object) -> None:
        if self.started:
            return
        self.started = True
        threading.Thread(target=self._clean, name="leftovers", daemon=True).start()

    def again(self) -> None:
        """Clean once more after the next successful sync (a switch left leftovers)."""
        self.started = False

    def _clean(self) -> None:
        d = self.daemon
        removed = clean_leftovers(
            d.dataplane.mode,
            iptables_flavour=d.dataplane.iptables_flavour,
            state_dir=d.state_dir,
            nftables_layout=d.dataplane.nftables_layout,
        )
        release_free_heap()  # the scan read whole rule dumps
        d.leftovers_removed = [str(o) for o in removed]
        log.info("removed %d leftovers of other proxy modes", len(removed))
        d.write_status()

    def failed(self, full: bool) -> None:
        pass

    def conntrack_cleaned(self, deleted: int, error: str | None = None) -> None:
        pass


class StatusFile:
    """Rewrites the status file after every sync (a sync.SyncObserver)."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    def queued(self, when: float, pending_services: int, pending_endpoints: int) -> None:
        pass

    def synced(self, *_: object) -> None:
        self.daemon.write_status()

    def failed(self, full: bool) -> None:
        self.daemon.write_status()

    def conntrack_cleaned(self, deleted: int, error: str | None = None) -> None:
        pass
