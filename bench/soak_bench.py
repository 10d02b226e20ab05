"""Soak: N services whose endpoints churn, traffic through the node, for a long time.

kproxy runs on a lab node (kproxy.lab.cluster: objects from the lab's API server, with the
mode's default sync periods) with N services, each with a TCP and a UDP port served by a
sliding window of the lab's pods. Half the services are churned: every 1/rate seconds the
next one in turn has its window moved by one pod (one endpoint removed, one added). The
other half never change. A few services of each group carry traffic from the lab's clients:
fresh TCP connections, UDP request/reply from a kept source port, and long-lived TCP
connections pinged for the whole run.

    .venv/bin/python -m bench.soak_bench --mode nftables [--minutes 30] [--services 1000]
        [--churn-per-second 10] [--sample-seconds 10] [--window-seconds 300]
        [--json bench/results/soak-nftables.json] [--uml [--mem 4G]]

Every pod stays up, so no request should fail. Failures to stable services count against the
goal (0), as do failures to churned services that are neither on a connection whose pod
was removed from the service nor within a timeout of a change of that service.

Sampled every --sample-seconds: RSS and open descriptors of kproxy (and its workers in
userspace mode), kproxy_conntrack_entries and the sync histogram
(kubeproxy_sync_proxy_rules_duration_seconds) of its /metrics, the load average. Drift
compares the median of the first --drift-samples samples after --warmup-seconds with the
median of the last ones. The JSON is rewritten after
every sample, so a run cut short still leaves its figures.

--uml runs the same inside a User-Mode Linux guest (ipvs: the host kernel has no ip_vs);
its iptables layer is iptables-legacy. UML makes every syscall a host round trip, so its
figures compare with each other, not with the host's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import machine
from kproxy.lab.cluster import ClusterLab
from kproxy.lab.kubeapi import KubeApiStore
from kproxy.lab.load import LoadHarness, LoadResult
from kproxy.lab.proxy import ProxyProcess
from kproxy.lab.topology import Lab
from kproxy.lab.uml import in_uml
from kproxy.ops.verify import (
    SYNC_FAILURES,
    SYNC_HISTOGRAM,
    Collector,
    bucket_delta,
    histogram_quantile,
)

REPO = Path(__file__).resolve().parents[1]
NAMESPACE = "soak"
MODES = ("iptables", "nftables", "ipvs", "userspace")
PODS = 12  # the cluster lab's first pod sends; the other 11 are the endpoint pool
ENDPOINTS_PER_SERVICE = 3
METRICS_URL = "http://127.0.0.1:10249/metrics"
CONNTRACK = "kproxy_conntrack_entries"
UDP_SPORT_BASE = 41000
MIB = 1024 * 1024

_t0 = time.monotonic()

# userspace mode: UDP sessions closed while a reply was owed (summed over the workers).
UNANSWERED = "udp_expired_unanswered"


def log(msg: str) -> None:
    print(f"[{time.monotonic() - _t0:7.1f}s] {msg}", flush=True)


# --- the cluster ---------------------------------------------------------------------------


def cluster_ip(i: int) -> str:
    return f"10.97.{(i + 1) // 256}.{(i + 1) % 256}"


def window(pool: list[str], i: int, generation: int) -> list[str]:
    """Service i's endpoints at a generation: ENDPOINTS_PER_SERVICE consecutive pods of the
    pool; the next generation drops the first of them and adds the one after the last."""
    return [pool[(i + generation + k) % len(pool)] for k in range(ENDPOINTS_PER_SERVICE)]


def service_obj(i: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": f"svc{i:05d}", "namespace": NAMESPACE},
        "spec": {
            "clusterIP": cluster_ip(i),
            "clusterIPs": [cluster_ip(i)],
            "ports": [
                {"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"},
                {"name": "dns", "port": 53, "targetPort": 8080, "protocol": "UDP"},
            ],
        },
    }


def slice_obj(i: int, ips: list[str], node: str) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"svc{i:05d}-1",
            "namespace": NAMESPACE,
            "labels": {"kubernetes.io/service-name": f"svc{i:05d}"},
        },
        "addressType": "IPv4",
        "ports": [
            {"name": "http", "port": 8080, "protocol": "TCP"},
            {"name": "dns", "port": 8080, "protocol": "UDP"},
        ],
        "endpoints": [
            {"addresses": [ip], "nodeName": node, "conditions": {"ready": True}} for ip in ips
        ],
    }


@dataclass
class Plan:
    services: int
    measured: int  # services with traffic, per group

    @property
    def churned(self) -> range:
        return range(0, self.services // 2)

    @property
    def stable(self) -> range:
        return range(self.services // 2, self.services)

    def measured_of(self, group: range) -> list[int]:
        step = max(1, len(group) // self.measured)
        return list(group[::step][: self.measured])


class Churn:
    """Moves the endpoint window of the churned services in turn, `rate` changes a second,
    and remembers when each measured service lost which pod."""

    def __init__(
        self, store: KubeApiStore, plan: Plan, pool: list[str], node: str, rate: float
    ) -> None:
        self.store, self.plan, self.pool, self.node, self.rate = store, plan, pool, node, rate
        self.generation = dict.fromkeys(plan.churned, 0)
        watched = plan.measured_of(plan.churned)
        # service -> [(monotonic time, removed pod IP)], and the pods put (back) in
        self.removals: dict[int, list[tuple[float, str]]] = {i: [] for i in watched}
        self.additions: dict[int, list[tuple[float, str]]] = {i: [] for i in watched}
        self.changes = 0
        self.behind = 0.0  # the most the schedule ever lagged, seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="churn", daemon=True)

    def was_out(self, service: int, ip: str | None, when: float) -> bool:
        """The pod had been removed from the service at `when` (the window brings every
        pod back later: only the latest change of that pod before `when` counts)."""
        events = [(t, True) for t, gone in self.removals.get(service, []) if gone == ip]
        events += [(t, False) for t, came in self.additions.get(service, []) if came == ip]
        before = [e for e in events if e[0] <= when]
        return bool(before) and max(before)[1]

    def start(self) -> Churn:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        order = list(self.plan.churned)
        due = time.monotonic()
        k = 0
        while not self._stop.is_set():
            i = order[k % len(order)]
            before = window(self.pool, i, self.generation[i])
            self.generation[i] += 1
            after = window(self.pool, i, self.generation[i])
            self.store.apply(slice_obj(i, after, self.node))
            if i in self.removals:
                now = time.monotonic()
                self.removals[i] += [(now, ip) for ip in before if ip not in after]
                self.additions[i] += [(now, ip) for ip in after if ip not in before]
            self.changes += 1
            k += 1
            due += 1.0 / self.rate
            self.behind = max(self.behind, time.monotonic() - due)
            self._stop.wait(max(0.0, due - time.monotonic()))


# --- traffic -------------------------------------------------------------------------------


@dataclass
class Target:
    service: int
    group: str  # "stable" | "churned"
    harness: LoadHarness
    result: LoadResult | None = None


def start_traffic(lab: Lab, plan: Plan, args: argparse.Namespace) -> list[Target]:
    targets = []
    groups = (("stable", plan.stable), ("churned", plan.churned))
    for n, (group, i) in enumerate(
        (g, i) for g, members in groups for i in plan.measured_of(members)
    ):
        harness = LoadHarness(
            lab,
            tcp=(cluster_ip(i), 80),
            udp=(cluster_ip(i), 53),
            streams=args.streams,
            fresh_interval=args.fresh_interval,
            ping_interval=args.ping_interval,
            udp_interval=args.udp_interval,
            udp_sport=UDP_SPORT_BASE + n,
        )
        targets.append(Target(i, group, harness.start()))
    return targets


def classify(
    targets: list[Target], churn: Churn, pod_ips: dict[str, str], grace: float
) -> dict[str, dict[str, Any]]:
    """Requests and failures per group; a churned service's failure is laid at its churn
    when its stream's pod was out of the service at that moment, or when it came within
    `grace` s of a change."""
    out: dict[str, dict[str, Any]] = {}
    for t in targets:
        r = t.result
        assert r is not None
        g = out.setdefault(
            t.group,
            {
                "services": [],
                "fresh_sent": 0,
                "fresh_failed": 0,
                "udp_sent": 0,
                "udp_failed": 0,
                "pings_sent": 0,
                "pings_failed": 0,
                "streams_opened": 0,
                "streams_survived": 0,
                "failed_on_removed_endpoint": 0,
                "failed_within_grace_of_change": 0,
                "failed_other": 0,
                "examples": [],
            },
        )
        g["services"].append(f"svc{t.service:05d}")
        g["fresh_sent"] += r.fresh_sent
        g["fresh_failed"] += len(r.fresh_failed)
        g["udp_sent"] += r.udp_sent
        g["udp_failed"] += len(r.udp_failed)
        g["pings_sent"] += r.pings_sent
        g["pings_failed"] += len(r.pings_failed)
        g["streams_opened"] += r.streams_opened
        g["streams_survived"] += r.streams_opened - r.streams_dropped
        removals = churn.removals.get(t.service, []) if t.group == "churned" else []
        zero = t.harness.started

        def changed_near(at: float, removals: list[tuple[float, str]] = removals) -> bool:
            return any(0.0 <= at - when <= grace for when, _ip in removals)

        failures: list[tuple[str, float, str, str | None]] = [
            ("fresh", at, err, None) for at, err in r.fresh_failed
        ]
        failures += [("udp", at, err, None) for at, err in r.udp_failed]
        failures += [("stream", at, err, pod) for at, pod, err in r.stream_failures]
        for kind, at, err, pod in failures:
            when = zero + at
            ip = pod_ips.get(pod or "")
            if churn.was_out(t.service, ip, when):
                cause = "failed_on_removed_endpoint"
            elif changed_near(when):
                cause = "failed_within_grace_of_change"
            else:
                cause = "failed_other"
            g[cause] += 1
            if len(g["examples"]) < 20:
                g["examples"].append(
                    {
                        "service": f"svc{t.service:05d}",
                        "kind": kind,
                        "at_s": round(when - _t0, 1),
                        "error": err,
                        "pod": pod,
                        "cause": cause,
                    }
                )
    for g in out.values():
        g["goal_failures"] = g["failed_other"]
    if "stable" in out:
        s = out["stable"]
        s["goal_failures"] = s["fresh_failed"] + s["udp_failed"] + s["pings_failed"]
    return out


# --- samples -------------------------------------------------------------------------------


def fd_count(pid: int, reads: int = 3) -> int | None:
    """Open descriptors of pid: the least of a few reads, so that one held for a moment (a
    pipe to iptables-restore, our own admin or metrics connection) is not counted."""
    counts = []
    for k in range(reads):
        try:
            counts.append(len(os.listdir(f"/proc/{pid}/fd")))
        except OSError:
            break
        if k < reads - 1:
            time.sleep(0.02)
    return min(counts) if counts else None


@dataclass
class Sampler:
    proxy: ProxyProcess
    samples: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.collector = Collector(
            self.proxy.state_dir,
            metrics_address=METRICS_URL.split("/")[2],
            fetch=self.proxy.fetch,
            count_services=lambda _mode: (None, "not read by the soak"),
        )

    def take(self) -> dict[str, Any]:
        s = self.collector.sample()
        row: dict[str, Any] = {
            "t": round(s.mono - _t0, 1),
            "loadavg": machine.loadavg(),
            "up": s.status is not None,
        }
        if s.status is not None:
            row["pid"] = s.status.get("pid")
            row["mode"] = s.status.get("mode")
            row["syncs"] = s.status.get("syncs")
        row["rss"] = {p.role: p.rss for p in s.procs}
        row["fds"] = {p.role: fd_count(p.pid) for p in s.procs}
        row["rss_total"] = sum(v or 0 for v in row["rss"].values()) or None
        row["fds_total"] = sum(v or 0 for v in row["fds"].values()) or None
        if s.metrics is not None:
            m = s.metrics
            row["conntrack"] = m.gauge(CONNTRACK)
            row["sync_count"] = m.total(f"{SYNC_HISTOGRAM}_count")
            row["sync_sum"] = m.total(f"{SYNC_HISTOGRAM}_sum")
            row["sync_buckets"] = m.buckets(SYNC_HISTOGRAM)
            row["sync_failures"] = m.total(SYNC_FAILURES)
        else:
            row["metrics_error"] = s.metrics_error
        if row.get("conntrack") is None or row["conntrack"] != row["conntrack"]:  # NaN
            row["conntrack"] = self._conntrack_fallback()
        if row.get("mode") == "userspace":
            row[UNANSWERED] = self._udp_unanswered()
        self.samples.append(row)
        return row

    def _udp_unanswered(self) -> int | None:
        """userspace mode: UDP sessions its workers closed while a reply was still owed
        (from the workers' status files)."""
        total, seen = 0, False
        for path in (self.proxy.state_view / "userspace").glob("worker-*.json"):
            try:
                udp = json.loads(path.read_text()).get("udp") or {}
            except (OSError, ValueError):
                continue
            total += int(udp.get("expired_unanswered") or 0)
            seen = True
        return total if seen else None

    def _conntrack_fallback(self) -> int | None:
        out = self.proxy.lab.exec(
            self.proxy.node.ns, ["cat", "/proc/sys/net/netfilter/nf_conntrack_count"], check=False
        )
        text = out.stdout.strip()
        return int(text) if text.isdigit() else None


def windows(samples: list[dict[str, Any]], seconds: float) -> list[dict[str, Any]]:
    """Sync duration p50/p99 per window, from the histogram's bucket deltas."""
    rows = [s for s in samples if s.get("sync_buckets")]
    out: list[dict[str, Any]] = []
    if len(rows) < 2:
        return out
    start = rows[0]
    for i, s in enumerate(rows[1:], 1):
        last = i == len(rows) - 1
        if s["t"] - start["t"] < seconds and not last:
            continue
        delta = bucket_delta(start["sync_buckets"], s["sync_buckets"])
        count = delta[-1][1] if delta else 0
        total = (s.get("sync_sum") or 0) - (start.get("sync_sum") or 0)
        p50, p99 = histogram_quantile(0.5, delta), histogram_quantile(0.99, delta)
        out.append(
            {
                "from_s": start["t"],
                "to_s": s["t"],
                "syncs": count,
                "mean_s": round(total / count, 4) if count else None,
                "p50_s": None if p50 is None else round(p50, 4),
                "p99_s": None if p99 is None else round(p99, 4),
            }
        )
        start = s
    return out


def drift(first: list[dict[str, Any]], last: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """Median of `key` over the first and the last samples, and the change between them."""
    a = statistics.median(s[key] for s in first)
    b = statistics.median(s[key] for s in last)
    return {
        "start": a,
        "end": b,
        "drift_pct": round(100.0 * (b - a) / a, 2) if a else None,
        "start_t": [first[0]["t"], first[-1]["t"]],
        "end_t": [last[0]["t"], last[-1]["t"]],
        "min": min(s[key] for s in [*first, *last]),
        "max": max(s[key] for s in [*first, *last]),
    }


def summarize(samples: list[dict[str, Any]], warmup: float, span: int) -> dict[str, Any]:
    """Drift compares the median of `span` samples after the warm-up with the median of the
    last `span` (one sample's RSS or descriptor count moves with the sync it catches)."""
    up = [s for s in samples if s["up"] and s.get("rss_total") and s.get("fds_total")]
    if not up:
        return {}
    after = [s for s in up if s["t"] - up[0]["t"] >= warmup] or up[-1:]
    span = max(1, min(span, len(after) // 2))
    first, last = after[:span], after[-span:]
    ct = [s["conntrack"] for s in samples if isinstance(s.get("conntrack"), int | float)]
    return {
        "first_sample": {k: up[0].get(k) for k in ("t", "rss", "fds")},
        "rss": {**drift(first, last, "rss_total"), "run_max": max(s["rss_total"] for s in up)},
        "fds": {**drift(first, last, "fds_total"), "run_max": max(s["fds_total"] for s in up)},
        "rss_by_process": {"start": first[0]["rss"], "end": last[-1]["rss"]},
        "fds_by_process": {"start": first[0]["fds"], "end": last[-1]["fds"]},
        "conntrack": {
            "start": ct[0] if ct else None,
            "max": max(ct) if ct else None,
            "end": ct[-1] if ct else None,
        },
        "pids": sorted({s["pid"] for s in up}),
        "sync_failures": (up[-1].get("sync_failures") or 0) - (first[0].get("sync_failures") or 0),
        "udp_expired_unanswered": next(
            (r[UNANSWERED] for r in reversed(samples) if r.get(UNANSWERED) is not None), None
        ),
    }


# --- the run -------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    backend = args.backend or ("legacy" if in_uml() else "nft")
    plan = Plan(args.services, args.measured)
    report: dict[str, Any] = {
        "bench": "soak",
        "mode": args.mode,
        "uml": in_uml(),
        "backend": backend,
        "services": args.services,
        "service_ports": 2 * args.services,
        "endpoints_per_service": ENDPOINTS_PER_SERVICE,
        "churned_services": len(plan.churned),
        "churn_per_second": args.churn_per_second,
        "minutes": args.minutes,
        "traffic": {
            "measured_services_per_group": args.measured,
            "fresh_interval_s": args.fresh_interval,
            "udp_interval_s": args.udp_interval,
            "streams_per_service": args.streams,
            "ping_interval_s": args.ping_interval,
        },
        "machine": machine.describe(),
    }
    out = args.json

    def save() -> None:
        if out is not None:
            tmp = out.with_suffix(".tmp")
            tmp.write_text(json.dumps(report, indent=1))
            tmp.replace(out)

    with Lab(pods=PODS, clients=2, prefix="kpsoak") as lab, tempfile.TemporaryDirectory() as tmp:
        node = lab.nodes[0].name
        store = KubeApiStore(bookmark_interval=1.0)
        cluster = ClusterLab(
            lab,
            Path(tmp) / "cluster",
            mode=args.mode,
            store=store,
            backend=backend,
            fast_sync=False,
            start_timeout=args.start_timeout,
        )
        pool = [ip for ip, _node in cluster.endpoints]
        pod_ips = dict(lab.pod_ips)
        for i in range(args.services):
            store.apply(service_obj(i))
            store.apply(slice_obj(i, window(pool, i, 0), node))
        started = time.monotonic()
        with cluster:
            proxy = cluster.proxies[node]
            report["first_sync_s"] = round(time.monotonic() - started, 1)
            log(f"{args.mode}: first sync after {report['first_sync_s']} s; traffic starts")
            sampler = Sampler(proxy)
            targets = start_traffic(lab, plan, args)
            churn = Churn(store, plan, pool, node, args.churn_per_second).start()
            t_start = time.monotonic()
            end = t_start + args.minutes * 60
            crashed = ""
            try:
                while True:
                    row = sampler.take()
                    report["samples"] = sampler.samples
                    report["seconds_run"] = round(time.monotonic() - t_start, 1)
                    report["churn_changes"] = churn.changes
                    save()
                    log(progress(row, churn))
                    if proxy.proc is not None and proxy.proc.poll() is not None:
                        crashed = f"kproxy exited with {proxy.proc.returncode}"
                        break
                    if time.monotonic() >= end:
                        break
                    time.sleep(max(0.0, min(args.sample_seconds, end - time.monotonic())))
            finally:
                churn.stop()
                for t in targets:
                    t.result = t.harness.stop()
            seconds = time.monotonic() - t_start
            report["seconds_run"] = round(seconds, 1)
            report["churn"] = {
                "changes": churn.changes,
                "per_second": round(churn.changes / seconds, 2) if seconds else None,
                "most_behind_s": round(churn.behind, 2),
            }
            report["crash"] = crashed or None
            if crashed:
                report["log_tail"] = proxy.log_tail(60).splitlines()
            grace = args.grace
            report["requests"] = classify(targets, churn, pod_ips, grace)
            report["requests_grace_s"] = grace
            report["summary"] = summarize(sampler.samples, args.warmup_seconds, args.drift_samples)
            report["sync_windows"] = windows(sampler.samples, args.window_seconds)
            report["load_end"] = machine.loadavg()
            report["goal"] = goal(report)
            save()
    return report


def progress(row: dict[str, Any], churn: Churn) -> str:
    rss = row.get("rss_total")
    return (
        f"rss {rss / MIB:.1f} MiB, fds {row.get('fds_total')}, conntrack {row.get('conntrack')}, "
        f"syncs {row.get('sync_count')}, churn {churn.changes}, load {row['loadavg']}"
        if rss
        else f"kproxy not answering ({row.get('metrics_error', 'no status')})"
    )


def goal(report: dict[str, Any]) -> dict[str, Any]:
    s = report.get("summary") or {}
    reqs = report.get("requests") or {}
    stable = reqs.get("stable", {})
    checks = {
        "no crash": report.get("crash") is None and len(s.get("pids", [])) == 1,
        "0 failed requests to stable services": stable.get("goal_failures", 1) == 0,
        "every stream to a stable service survived": stable.get("streams_survived")
        == stable.get("streams_opened"),
        "0 unexplained failures to churned services": reqs.get("churned", {}).get(
            "goal_failures", 1
        )
        == 0,
        # A leak grows: a smaller figure at the end (one pipe fewer of 14) is not drift.
        "RSS growth <= 5 %": ((s.get("rss") or {}).get("drift_pct") or 0) <= 5,
        "fd growth <= 5 %": ((s.get("fds") or {}).get("drift_pct") or 0) <= 5,
        "0 failed syncs": s.get("sync_failures", 1) == 0,
    }
    return {"ok": all(checks.values()), "checks": checks}


def table(report: dict[str, Any]) -> str:
    s = report.get("summary") or {}
    lines = [
        f"\nsoak {report['mode']}{' (UML)' if report.get('uml') else ''}: "
        f"{report['services']:,} services, {report.get('seconds_run', 0) / 60:.1f} min, "
        f"churn {report.get('churn', {}).get('per_second')}/s, "
        f"load {report['machine'].get('load average at start')} -> {report.get('load_end')}",
        "",
        "| figure | start | end | drift |",
        "|---|---|---|---|",
    ]
    for key, unit in (("rss", "MiB"), ("fds", "")):
        d = s.get(key) or {}
        a, b = d.get("start"), d.get("end")
        if unit:
            a = None if a is None else f"{a / MIB:.1f} {unit}"
            b = None if b is None else f"{b / MIB:.1f} {unit}"
        lines.append(f"| {key} | {a} | {b} | {d.get('drift_pct')} % |")
    ct = s.get("conntrack") or {}
    lines += [
        "",
        f"conntrack entries: start {ct.get('start')}, max {ct.get('max')}, end {ct.get('end')}",
        *(
            [f"UDP sessions closed owing a reply: {s['udp_expired_unanswered']}"]
            if s.get("udp_expired_unanswered") is not None
            else []
        ),
        "",
        "| group | fresh TCP failed/sent | UDP failed/sent | pings failed/sent "
        "| streams survived | on removed endpoint | near a change | other |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, g in (report.get("requests") or {}).items():
        lines.append(
            f"| {name} | {g['fresh_failed']}/{g['fresh_sent']} | {g['udp_failed']}/"
            f"{g['udp_sent']} | {g['pings_failed']}/{g['pings_sent']} | "
            f"{g['streams_survived']}/{g['streams_opened']} | {g['failed_on_removed_endpoint']}"
            f" | {g['failed_within_grace_of_change']} | {g['failed_other']} |"
        )
    lines += ["", "| window | syncs | mean | p50 | p99 |", "|---|---|---|---|---|"]

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f} ms"

    for w in report.get("sync_windows") or []:
        lines.append(
            f"| {w['from_s']:.0f}-{w['to_s']:.0f} s | {w['syncs']:.0f} | {ms(w['mean_s'])} | "
            f"{ms(w['p50_s'])} | {ms(w['p99_s'])} |"
        )
    g = report.get("goal") or {}
    lines += ["", f"goal: {'met' if g.get('ok') else 'NOT met'}"]
    lines += [f"  {'ok  ' if ok else 'FAIL'} {name}" for name, ok in g.get("checks", {}).items()]
    return "\n".join(lines)


# --- UML -----------------------------------------------------------------------------------


def in_guest(args: argparse.Namespace, argv: list[str]) -> int:
    """This benchmark again inside a UML guest (the JSON path is on the shared filesystem:
    it is rewritten live); the host's load is added to the JSON afterwards."""
    from kproxy.lab.uml import HOST_MEMORY_FAILURE, UmlGuest, host_memory_reason

    inner = [a for a in argv if a != "--uml"]
    guest_argv = [sys.executable, "-m", "bench.soak_bench", *inner]
    budget = args.minutes * 60 + args.start_timeout + 900
    host_load = machine.loadavg()
    with UmlGuest(mem=args.mem, timeout=budget) as guest:
        log(f"UML guest: output in {guest.run_dir}/output.txt while it runs")
        result = guest.run(guest_argv, cwd=REPO, env={"PYTHONPATH": str(REPO / "src")})
    print(result.output, end="")
    if HOST_MEMORY_FAILURE in result.console:
        print(f"\nUML: {host_memory_reason()}")
    if not result.ok:
        print(result.describe_failure())
    if args.json is not None and args.json.exists():
        report = json.loads(args.json.read_text())
        report["host_load"] = {"start": host_load, "end": machine.loadavg()}
        report["uml_wall_s"] = round(result.wall_seconds, 1)
        args.json.write_text(json.dumps(report, indent=1))
    return result.returncode if result.returncode is not None else 1


# --- the command ---------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.soak_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--mode", choices=MODES, required=True)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--services", type=int, default=1000)
    ap.add_argument("--churn-per-second", type=float, default=10.0)
    ap.add_argument("--sample-seconds", type=float, default=10.0)
    ap.add_argument("--window-seconds", type=float, default=300.0, help="sync p50/p99 windows")
    ap.add_argument("--warmup-seconds", type=float, default=60.0, help="before the drift base")
    ap.add_argument(
        "--drift-samples", type=int, default=6, help="samples in each median of the drift"
    )
    ap.add_argument("--json", type=Path, help="write the figures here (rewritten live)")
    ap.add_argument("--measured", type=int, default=4, help="services with traffic, per group")
    ap.add_argument("--streams", type=int, default=3, help="long-lived connections per service")
    ap.add_argument("--fresh-interval", type=float, default=0.2)
    ap.add_argument("--udp-interval", type=float, default=0.2)
    ap.add_argument("--ping-interval", type=float, default=1.0)
    ap.add_argument(
        "--grace", type=float, default=3.0, help="a failure this soon after a change is its"
    )
    ap.add_argument("--start-timeout", type=float, default=900.0, help="for the first sync")
    ap.add_argument(
        "--backend", choices=("nft", "legacy"), help="iptables backend (nft; UML: legacy)"
    )
    ap.add_argument("--uml", action="store_true", help="run inside a UML guest (ipvs)")
    ap.add_argument("--mem", default="4G", help="the UML guest's memory")
    args = ap.parse_args(argv)
    if args.services < 2 * args.measured or args.churn_per_second <= 0:
        ap.error("need --services >= 2 x --measured and a positive --churn-per-second")
    if args.json is not None:
        args.json = args.json.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    if args.uml:
        if args.json is not None:
            raw = [*_without(raw, "--json"), "--json", str(args.json)]
        return in_guest(args, raw)
    report = run(args)
    print(table(report), flush=True)
    return 0 if report["goal"]["ok"] else 1


def _without(argv: list[str], flag: str) -> list[str]:
    """argv minus `flag VALUE` and `flag=VALUE`."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


if __name__ == "__main__":
    sys.exit(main())
