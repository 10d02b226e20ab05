"""Prometheus metrics with upstream kube-proxy's names, types, labels and buckets.

Dashboards and alerts written for kube-proxy must work unchanged, so the
names below are upstream's, in subsystem `kubeproxy`; kproxy's own additions are prefixed
`kproxy_`. One registry per process, so tests can build several without collisions.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kproxy.dataplane.base import SyncResult
from kproxy.model.objects import Snapshot
from kproxy.model.snapshot import ChangeCounts

IP_FAMILY = "IPv4"
CONNTRACK_COUNT = "/proc/sys/net/netfilter/nf_conntrack_count"
CONNTRACK_MAX = "/proc/sys/net/netfilter/nf_conntrack_max"


def _proc_int(path: str) -> float:
    """A /proc number, or NaN when the kernel has no such file (conntrack not loaded)."""
    try:
        with open(path) as f:
            return float(int(f.read().strip()))
    except (OSError, ValueError):
        return float("nan")


SYNC_BUCKETS = tuple(0.001 * 2**k for k in range(15))  # 1 ms .. 16.384 s
PROGRAMMING_BUCKETS = (
    0.25,
    0.5,
    *range(1, 60),
    *range(60, 120, 5),
    *range(120, 301, 30),
)


class ProxyMetrics:
    """Observes the sync loop (it implements sync.SyncObserver) and the health servers."""

    def __init__(self, mode: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.mode = mode
        r = self.registry
        fam = ["ip_family"]

        def hist(name: str, doc: str, buckets: tuple[float, ...] = SYNC_BUCKETS) -> Histogram:
            return Histogram(f"kubeproxy_{name}", doc, fam, buckets=buckets, registry=r)

        self.sync_duration = hist(
            "sync_proxy_rules_duration_seconds", "SyncProxyRules latency in seconds"
        )
        self.full_sync_duration = hist(
            "sync_full_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for full resyncs",
        )
        self.partial_sync_duration = hist(
            "sync_partial_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for partial resyncs",
        )
        self.programming_duration = hist(
            "network_programming_duration_seconds",
            "In Cluster Network Programming Latency in seconds",
            PROGRAMMING_BUCKETS,
        )
        self.last_sync = Gauge(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced",
            fam,
            registry=r,
        )
        self.last_queued = Gauge(
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "The last time a sync of proxy rules was queued",
            fam,
            registry=r,
        )
        self.rules_total = Gauge(
            "kubeproxy_sync_proxy_rules_iptables_total",
            "Total number of iptables rules owned by kube-proxy",
            ["table", "ip_family"],
            registry=r,
        )
        self.rules_last = Gauge(
            "kubeproxy_sync_proxy_rules_iptables_last",
            "Number of iptables rules written by kube-proxy in last sync",
            ["table", "ip_family"],
            registry=r,
        )
        self.no_local_endpoints = Gauge(
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            "Number of services with a Local traffic policy and no endpoints",
            ["traffic_policy", "ip_family"],
            registry=r,
        )
        self.endpoint_changes_pending = Gauge(
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            "Pending proxy rules Endpoint changes",
            registry=r,
        )
        self.service_changes_pending = Gauge(
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            "Pending proxy rules Service changes",
            registry=r,
        )
        # prometheus-client appends "_total" to counter names.
        self.endpoint_changes = Counter(
            "kubeproxy_sync_proxy_rules_endpoint_changes",
            "Cumulative proxy rules Endpoint changes",
            registry=r,
        )
        self.service_changes = Counter(
            "kubeproxy_sync_proxy_rules_service_changes",
            "Cumulative proxy rules Service changes",
            registry=r,
        )
        self.restore_failures = Counter(
            "kubeproxy_sync_proxy_rules_iptables_restore_failures",
            "Cumulative proxy iptables restore failures",
            fam,
            registry=r,
        )
        self.partial_restore_failures = Counter(
            "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures",
            "Cumulative proxy iptables partial restore failures",
            fam,
            registry=r,
        )
        self.nft_sync_failures = Counter(
            "kubeproxy_sync_proxy_rules_nftables_sync_failures",
            "Cumulative proxy nftables sync failures",
            fam,
            registry=r,
        )
        self.nft_cleanup_failures = Counter(
            "kubeproxy_sync_proxy_rules_nftables_cleanup_failures",
            "Cumulative proxy nftables cleanup failures",
            fam,
            registry=r,
        )
        self.conntrack_deleted = Counter(
            "kubeproxy_conntrack_reconciler_deleted_entries",
            "Cumulative conntrack flows deleted by conntrack reconciler",
            fam,
            registry=r,
        )
        self.healthz = Counter(
            "kubeproxy_proxy_healthz", "Cumulative proxy healthz HTTP status", ["code"], registry=r
        )
        self.livez = Counter(
            "kubeproxy_proxy_livez", "Cumulative proxy livez HTTP status", ["code"], registry=r
        )
        # kproxy's own
        self.current_mode = Gauge(
            "kproxy_proxy_mode",
            "The proxy mode in use (1 for the current one)",
            ["mode"],
            registry=r,
        )
        self.invalid_objects = Gauge(
            "kproxy_invalid_objects",
            "Objects skipped as invalid (kind, namespace/name and field are logged)",
            registry=r,
        )
        self.source_failing_files = Gauge(
            "kproxy_source_failing_files",
            "Source files that cannot be read or parsed now (they keep their last good "
            "objects; file, line and error are in `kproxy status`)",
            registry=r,
        )
        self.sync_failures = Counter(
            "kproxy_sync_failures", "Cumulative failed syncs of any mode", ["mode"], registry=r
        )
        # Upstream only logs a failed conntrack cleanup.
        self.conntrack_cleanup_failures = Counter(
            "kproxy_conntrack_cleanup_failures",
            "Cumulative failed cleanups of stale UDP conntrack flows (retried at the next sync)",
            registry=r,
        )
        self.switches = Counter(
            "kproxy_mode_switches",
            "Proxy mode switches",
            ["from_mode", "to_mode", "result"],
            registry=r,
        )
        self.switch_duration = Histogram(
            "kproxy_mode_switch_duration_seconds",
            "Duration of proxy mode switches, command start to old state gone",
            buckets=SYNC_BUCKETS,
            registry=r,
        )
        # Read at scrape time from this network namespace (count is per namespace).
        self.conntrack_entries = Gauge(
            "kproxy_conntrack_entries", "Connection tracking entries now", registry=r
        )
        self.conntrack_entries.set_function(lambda: _proc_int(CONNTRACK_COUNT))
        self.conntrack_max = Gauge(
            "kproxy_conntrack_max", "nf_conntrack_max (the table's limit)", registry=r
        )
        self.conntrack_max.set_function(lambda: _proc_int(CONNTRACK_MAX))
        self.ipvs_virtual_servers = Gauge(
            "kproxy_ipvs_virtual_servers",
            "IPVS virtual servers programmed by the last sync (ipvs mode)",
            registry=r,
        )
        self.ipvs_real_servers = Gauge(
            "kproxy_ipvs_real_servers",
            "IPVS real servers programmed by the last sync (ipvs mode)",
            registry=r,
        )
        self.current_mode.labels(mode=mode).set(1)
        # Children exist from the start, so a fresh kproxy already exposes every series
        # (dashboards and absent() alerts see zeros, not gaps).
        for metric in (
            self.sync_duration,
            self.full_sync_duration,
            self.partial_sync_duration,
            self.programming_duration,
            self.last_sync,
            self.last_queued,
            self.restore_failures,
            self.partial_restore_failures,
            self.nft_sync_failures,
            self.nft_cleanup_failures,
            self.conntrack_deleted,
        ):
            metric.labels(ip_family=IP_FAMILY)
        for table in ("filter", "nat"):
            self.rules_total.labels(table=table, ip_family=IP_FAMILY)
            self.rules_last.labels(table=table, ip_family=IP_FAMILY)
        for policy in ("internal", "external"):
            self.no_local_endpoints.labels(traffic_policy=policy, ip_family=IP_FAMILY)
        self._trigger_seen: dict[str, float] = {}

    def follow_inputs(
        self, invalid_objects: Callable[[], int], failing_files: Callable[[], int]
    ) -> None:
        """Read the bad-input gauges at scrape time, so they move as soon as the input does
        (an invalid object alone queues no sync)."""
        self.invalid_objects.set_function(lambda: float(invalid_objects()))
        self.source_failing_files.set_function(lambda: float(failing_files()))

    def switched(self, from_mode: str, to_mode: str, ok: bool, seconds: float) -> None:
        self.switches.labels(
            from_mode=from_mode, to_mode=to_mode, result="ok" if ok else "failed"
        ).inc()
        if ok:
            self.switch_duration.observe(seconds)
            self.current_mode.labels(mode=from_mode).set(0)
            self.current_mode.labels(mode=to_mode).set(1)
            self.mode = to_mode

    # --- sync.SyncObserver --------------------------------------------------------------------

    def queued(self, when: float, pending_services: int, pending_endpoints: int) -> None:
        self.last_queued.labels(ip_family=IP_FAMILY).set(when)
        self.service_changes_pending.set(pending_services)
        self.endpoint_changes_pending.set(pending_endpoints)

    def synced(
        self, snapshot: Snapshot, result: SyncResult, seconds: float, counts: ChangeCounts
    ) -> None:
        fam = IP_FAMILY
        self.sync_duration.labels(ip_family=fam).observe(seconds)
        (self.full_sync_duration if result.full else self.partial_sync_duration).labels(
            ip_family=fam
        ).observe(seconds)
        now = time.time()
        self.last_sync.labels(ip_family=fam).set(now)
        for table, n in result.rules_total.items():
            self.rules_total.labels(table=table, ip_family=fam).set(n)
        for table, n in result.rules_written.items():
            self.rules_last.labels(table=table, ip_family=fam).set(n)
        if result.cleanup_failures:
            self.nft_cleanup_failures.labels(ip_family=fam).inc(result.cleanup_failures)
        self.ipvs_virtual_servers.set(result.objects.get("ipvs_virtual_servers", 0))
        self.ipvs_real_servers.set(result.objects.get("ipvs_real_servers", 0))
        internal = external = 0
        for sp in snapshot.services.values():
            if sp.any_endpoints and sp.internal_policy_local and not sp.local_endpoints:
                internal += 1
            if (
                sp.any_endpoints
                and sp.external_policy_local
                and sp.is_external
                and not sp.local_endpoints
            ):
                external += 1
        self.no_local_endpoints.labels(traffic_policy="internal", ip_family=fam).set(internal)
        self.no_local_endpoints.labels(traffic_policy="external", ip_family=fam).set(external)
        self.service_changes.inc(counts.service_changes)
        self.endpoint_changes.inc(counts.endpoint_changes)
        self.service_changes_pending.set(0)
        self.endpoint_changes_pending.set(0)
        self.invalid_objects.set(len(snapshot.rejections))
        # Network programming latency: from the newest change trigger of each service to now,
        # once per trigger (upstream's last-change-trigger-time annotation).
        for svc, trigger in snapshot.trigger_times.items():
            if trigger > self._trigger_seen.get(svc, 0.0):
                self._trigger_seen[svc] = trigger
                self.programming_duration.labels(ip_family=fam).observe(max(0.0, now - trigger))

    def failed(self, full: bool) -> None:
        self.sync_failures.labels(mode=self.mode).inc()
        if self.mode == "iptables":
            self.restore_failures.labels(ip_family=IP_FAMILY).inc()
            if not full:
                self.partial_restore_failures.labels(ip_family=IP_FAMILY).inc()
        elif self.mode == "nftables":
            self.nft_sync_failures.labels(ip_family=IP_FAMILY).inc()

    def conntrack_cleaned(self, deleted: int, error: str | None = None) -> None:
        self.conntrack_deleted.labels(ip_family=IP_FAMILY).inc(deleted)
        if error is not None:
            self.conntrack_cleanup_failures.inc()
