"""kproxy verify's evaluation, from canned metrics (exposed by kproxy's own ProxyMetrics, so
the names are the ones a running proxy serves) and canned /proc values (no root)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from typer.testing import CliRunner

from kproxy.cli import app
from kproxy.dataplane.base import SyncResult
from kproxy.model.objects import Snapshot
from kproxy.model.snapshot import ChangeCounts, snapshot_from_objects
from kproxy.ops.verify import (
    MIB,
    Collector,
    Metrics,
    ProcSample,
    Sample,
    Thresholds,
    bucket_delta,
    evaluate,
    histogram_quantile,
    max_observation_bound,
    metrics_url,
    metrics_url_of,
    parse_metrics,
    parse_proc_stat,
    parse_proc_status,
    parse_size,
    run,
)
from kproxy.server.metrics import IP_FAMILY, ProxyMetrics
from tests.support.objects import node

T0 = 1_800_000_000.0  # wall clock of the first sample
EMPTY: Snapshot = snapshot_from_objects([node()], "node1")


class Proxy:
    """A ProxyMetrics driven like the sync loop drives it, with a settable clock."""

    def __init__(self) -> None:
        self.m = ProxyMetrics("iptables")

    def sync(self, seconds: float, at: float) -> None:
        self.m.synced(EMPTY, SyncResult(full=False, services=3), seconds, ChangeCounts())
        self.m.last_sync.labels(ip_family=IP_FAMILY).set(at)

    def queue(self, at: float) -> None:
        self.m.queued(at, 1, 0)

    def fail(self) -> None:
        self.m.failed(full=False)

    def scrape(self) -> Metrics:
        return parse_metrics(generate_latest(self.m.registry).decode())


def status(**kw: Any) -> dict[str, Any]:
    return {"ok": True, "pid": 4242, "mode": "iptables", "services": 3, "syncs": 5, **kw}


def sample(
    at: float,
    metrics: Metrics | None,
    *,
    rss: int = 80 * MIB,
    ticks: int = 1000,
    services: int | None = 3,
    stable: bool = True,
    st: dict[str, Any] | None = None,
) -> Sample:
    return Sample(
        time=T0 + at,
        mono=at,
        status=st if st is not None else status(),
        metrics=metrics,
        metrics_error="" if metrics is not None else "http://127.0.0.1:10249/metrics: refused",
        procs=[ProcSample(4242, "proxy", rss, ticks, 77)],
        dataplane_services=services,
        stable=stable,
    )


def healthy_window() -> list[Sample]:
    p = Proxy()
    for _ in range(20):
        p.sync(0.05, T0 - 5)
    first = p.scrape()
    p.queue(T0 + 10)
    p.sync(0.3, T0 + 10.2)
    return [sample(0, first), sample(30, p.scrape(), ticks=1000 + 150)]


def by_name(verdict: Any) -> dict[str, Any]:
    return {c.name: c for c in verdict.checks}


# --- parsers -------------------------------------------------------------------------------------


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    buckets = [(0.001, 0.0), (0.002, 50.0), (0.004, 99.0), (0.008, 100.0), (float("inf"), 100.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.002)
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.004)
    assert histogram_quantile(0.995, buckets) == pytest.approx(0.006)
    # Beyond the last finite bucket: its bound (Prometheus' answer too).
    assert histogram_quantile(0.99, [(1.0, 1.0), (2.0, 1.0), (float("inf"), 10.0)]) == 2.0
    assert histogram_quantile(0.99, [(1.0, 0.0), (float("inf"), 0.0)]) is None
    assert histogram_quantile(0.99, []) is None
    # The window: what arrived between two scrapes; a reset (restart) keeps the later one.
    assert bucket_delta([(1.0, 4.0), (2.0, 5.0)], [(1.0, 6.0), (2.0, 9.0)]) == [
        (1.0, 2.0),
        (2.0, 4.0),
    ]
    assert bucket_delta([(1.0, 4.0)], [(1.0, 1.0)]) == [(1.0, 1.0)]


def test_the_largest_observation_is_bounded_by_the_sum() -> None:
    # 99 syncs of 1 ms and one of 1.1 s: p99 interpolates deep into the 1.024-2.048 bucket.
    buckets = [(0.001, 99.0), (1.024, 99.0), (2.048, 100.0), (float("inf"), 100.0)]
    assert histogram_quantile(0.999, buckets) == pytest.approx(1.024 + 1.024 * 0.9)
    total = 99 * 0.001 + 1.1
    assert max_observation_bound(buckets, total) == pytest.approx(1.1 + 0.099)
    assert max_observation_bound([(1.0, 0.0), (float("inf"), 0.0)], 0.0) is None


def test_metrics_parse_upstream_names_from_a_real_registry() -> None:
    p = Proxy()
    p.sync(0.1, T0)
    p.sync(3.0, T0 + 1)
    p.fail()
    m = p.scrape()
    buckets = m.buckets("kubeproxy_sync_proxy_rules_duration_seconds")
    assert buckets[-1] == (float("inf"), 2.0)
    assert m.total("kubeproxy_sync_proxy_rules_duration_seconds_count") == 2
    assert m.gauge("kubeproxy_sync_proxy_rules_last_timestamp_seconds") == T0 + 1
    assert m.total("kubeproxy_sync_proxy_rules_iptables_restore_failures_total") == 1
    assert m.total("kproxy_sync_failures_total") == 1
    assert m.total("no_such_metric") is None


def test_proc_parsers() -> None:
    status_text = "Name:\tkproxy\nVmPeak:\t  200000 kB\nVmRSS:\t   81920 kB\nThreads:\t4\n"
    assert parse_proc_status(status_text) == 80 * MIB
    assert parse_proc_status("Name:\tkthreadd\n") is None
    # A process name with spaces and parentheses: fields count from the last ")".
    fields = ["S", "1", "2"] + ["0"] * 8 + ["123", "45"] + ["0"] * 6 + ["999", "0"]
    stat = "4242 (py (thon) x) " + " ".join(fields)
    assert parse_proc_stat(stat) == (168, 999)


def test_sizes() -> None:
    assert parse_size("512Mi") == 512 * MIB
    assert parse_size("512MiB") == 512 * MIB
    assert parse_size("1Gi") == 1024 * MIB
    assert parse_size("800M") == 800_000_000
    assert parse_size("4096") == 4096
    with pytest.raises(ValueError, match="invalid size"):
        parse_size("lots")


def test_metrics_address_from_the_bind_address_and_the_proxys_command_line(
    tmp_path: Path,
) -> None:
    assert metrics_url("127.0.0.1:10249") == "http://127.0.0.1:10249/metrics"
    assert metrics_url("0.0.0.0:10249") == "http://127.0.0.1:10249/metrics"
    assert metrics_url("[::]:9000") == "http://[::1]:9000/metrics"
    proc = tmp_path / "proc"
    work = tmp_path / "work"
    (proc / "42").mkdir(parents=True)
    work.mkdir()
    (work / "cfg.yaml").write_text(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
        "metricsBindAddress: 127.0.0.1:19999\n"
    )
    os.symlink(work, proc / "42" / "cwd")
    argv = ["python", "-m", "kproxy.cli", "run", "--config", "cfg.yaml", "--source", "x"]
    (proc / "42" / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    assert metrics_url_of(42, proc) == "http://127.0.0.1:19999/metrics"
    argv.append("--metrics-bind-address=0.0.0.0:18888")  # the flag wins, as in kube-proxy
    (proc / "42" / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    assert metrics_url_of(42, proc) == "http://127.0.0.1:18888/metrics"


# --- the verdict ---------------------------------------------------------------------------------


def test_a_healthy_window_passes_every_check() -> None:
    verdict = evaluate(healthy_window(), Thresholds(), clk_tck=100)
    checks = by_name(verdict)
    assert verdict.ok, verdict.text()
    assert list(checks) == [
        "running",
        "sync-p99",
        "services",
        "rss",
        "cpu",
        "failures",
        "sync-progress",
    ]
    # One sync in the window, 0.3 s: interpolation in the 0.256-0.512 bucket would say 0.509,
    # the histogram's sum says at most 0.3.
    assert checks["sync-p99"].value == "0.300 s"
    assert "over 1 syncs in the window (bounded by the histogram's sum" in checks["sync-p99"].detail
    assert checks["cpu"].value == "0.050 core"  # 150 ticks / 100 Hz / 30 s
    assert checks["rss"].value == "80 MiB"
    assert checks["services"].value == "3 service ports"
    assert "verdict: healthy" in verdict.text()
    data = json.loads(verdict.to_json())
    assert data["ok"] and data["breaches"] == [] and data["samples"] == 2


def test_each_breach_is_named() -> None:
    p = Proxy()
    p.sync(0.05, T0 - 5)
    first = p.scrape()
    for _ in range(5):
        p.sync(3.0, T0 + 5)  # slow syncs
    p.fail()  # one failed restore in the window
    samples = [
        sample(0, first),
        sample(10, p.scrape(), rss=600 * MIB, ticks=1000 + 500, services=2),
    ]
    verdict = evaluate(samples, Thresholds(), clk_tck=100)
    assert [c.name for c in verdict.breaches] == ["sync-p99", "services", "rss", "cpu", "failures"]
    checks = by_name(verdict)
    assert checks["services"].value == "2 in the dataplane, 3 in the snapshot"
    assert checks["cpu"].value == "0.500 core"
    assert checks["failures"].value == "1" and "in the window" in checks["failures"].detail
    assert "verdict: 5 breaches: sync-p99, services, rss, cpu, failures" in verdict.text()
    # Thresholds are the user's: looser ones pass the same samples.
    loose = Thresholds(sync_p99=5.0, rss=1024 * MIB, cpu=1.0, failures=1)
    assert [c.name for c in evaluate(samples, loose).breaches] == ["services"]


def test_a_service_count_read_while_syncing_is_not_compared() -> None:
    samples = healthy_window()
    samples[1].dataplane_services, samples[1].stable = 1, False
    assert evaluate(samples).ok
    samples[0].stable = False
    check = by_name(evaluate(samples))["services"]
    assert check.ok is None and "syncing" in check.detail


def test_sync_progress_breach_needs_two_stalled_samples_without_a_sync() -> None:
    p = Proxy()
    p.sync(0.05, T0 - 300)  # last successful sync 5 minutes before the first sample
    p.queue(T0 - 200)  # and a change waiting since
    stuck = p.scrape()
    one = evaluate([sample(0, stuck)])
    assert by_name(one)["sync-progress"].ok  # one sample alone cannot tell
    two = evaluate([sample(0, stuck), sample(5, stuck)])
    check = by_name(two)["sync-progress"]
    assert check.ok is False and check.value == "no sync for 305 s", check.detail
    # A sync between the samples: progress.
    p.sync(0.05, T0 + 3)
    assert by_name(evaluate([sample(0, stuck), sample(5, p.scrape())]))["sync-progress"].ok
    # Idle (nothing queued after the last sync): an old last sync is fine.
    idle = Proxy()
    idle.queue(T0 - 400)
    idle.sync(0.05, T0 - 300)
    quiet = idle.scrape()
    assert by_name(evaluate([sample(0, quiet), sample(5, quiet)]))["sync-progress"].ok
    # The rate is a threshold too: 2 syncs/minute means 30 s of waiting is too long.
    p2 = Proxy()
    p2.sync(0.05, T0 - 40)
    p2.queue(T0 - 35)
    m = p2.scrape()
    assert evaluate([sample(0, m), sample(5, m)]).ok
    strict = evaluate([sample(0, m), sample(5, m)], Thresholds(syncs_per_minute=2))
    assert [c.name for c in strict.breaches] == ["sync-progress"]


def test_not_running_restarted_and_unreachable_metrics() -> None:
    gone = Sample(T0, 0.0, status_error="no kproxy admin socket at /x/admin.sock")
    verdict = evaluate([gone])
    assert [c.name for c in verdict.breaches] == ["running"]
    assert "no kproxy admin socket" in verdict.breaches[0].detail
    samples = healthy_window()
    samples[1].status = status(pid=4343)
    assert "running" in [c.name for c in evaluate(samples).breaches]
    samples = healthy_window()
    samples[1].metrics = None
    samples[1].metrics_error = "http://127.0.0.1:10249/metrics: connection refused"
    verdict = evaluate(samples)
    assert [c.name for c in verdict.breaches] == ["metrics"]
    assert "refused" in verdict.breaches[0].detail


def test_failures_since_start_for_a_single_look() -> None:
    p = Proxy()
    p.sync(0.05, T0)
    p.fail()
    m = p.scrape()
    samples = [sample(0, m), sample(1, m)]
    assert by_name(evaluate(samples))["failures"].ok  # none in the window
    single = by_name(evaluate(samples, single=True))["failures"]
    assert single.ok is False and "since the proxy started" in single.detail


# --- collecting ----------------------------------------------------------------------------------


def fake_proc(tmp_path: Path, rss_kb: int, ticks: int) -> Path:
    proc = tmp_path / "proc"
    d = proc / "4242"
    d.mkdir(parents=True, exist_ok=True)
    fields = ["S", "1", "2"] + ["0"] * 8 + [str(ticks), "0"] + ["0"] * 6 + ["77", "0"]
    (d / "stat").write_text("4242 (python3) " + " ".join(fields))
    (d / "status").write_text(f"Name:\tpython3\nVmRSS:\t{rss_kb} kB\n")
    return proc


def test_collector_reads_status_metrics_proc_and_the_dataplane(tmp_path: Path) -> None:
    p = Proxy()
    p.sync(0.05, T0)
    statuses = iter([status(), status(), status(syncs=5), status(syncs=6, pending=True)])
    collector = Collector(
        tmp_path,
        metrics_address="127.0.0.1:10249",
        fetch=lambda url: generate_latest(p.m.registry).decode(),
        admin=lambda: next(statuses),
        count_services=lambda mode: (3, "") if mode == "iptables" else (None, "?"),
        proc=fake_proc(tmp_path, 81920, 500),
    )
    first = collector.sample()
    assert first.stable and first.dataplane_services == 3
    assert first.procs[0].rss == 80 * MIB and first.procs[0].cpu_ticks == 500
    assert first.metrics is not None and first.metrics.total(
        "kubeproxy_sync_proxy_rules_duration_seconds_count"
    )
    second = collector.sample()  # a sync completed while the dataplane was read
    assert not second.stable


def test_run_samples_for_the_duration_and_reports_progress(tmp_path: Path) -> None:
    p = Proxy()
    p.sync(0.05, T0)
    now = [0.0]
    lines: list[str] = []

    def sleep(seconds: float) -> None:
        now[0] += seconds

    collector = Collector(
        tmp_path,
        metrics_address="127.0.0.1:10249",
        fetch=lambda url: generate_latest(p.m.registry).decode(),
        admin=lambda: status(),
        count_services=lambda mode: (3, ""),
        proc=fake_proc(tmp_path, 1024, 10),
    )
    import kproxy.ops.verify as verify

    real = verify.time.monotonic
    verify.time.monotonic = lambda: now[0]  # type: ignore[assignment]
    try:
        verdict = run(
            collector, Thresholds(), duration=12, interval=5, progress=lines.append, sleep=sleep
        )
    finally:
        verify.time.monotonic = real  # type: ignore[assignment]
    assert verdict.samples == 4  # 0, 5, 10, 12 s
    assert len(lines) == 3 and lines[0].startswith("[     5 s / 12 s] running pid 4242")
    assert verdict.ok, verdict.text()


def test_cli_rejects_bad_arguments_and_reports_a_missing_proxy(tmp_path: Path) -> None:
    runner = CliRunner()
    bad = runner.invoke(app, ["verify", "--max-rss", "huge", "--state-dir", str(tmp_path)])
    assert bad.exit_code == 2 and "invalid size" in bad.output
    bad = runner.invoke(app, ["verify", "--for", "-1s", "--state-dir", str(tmp_path)])
    assert bad.exit_code == 2
    gone = runner.invoke(app, ["verify", "--json", "--state-dir", str(tmp_path)])
    assert gone.exit_code == 1
    data = json.loads(gone.output)
    assert data["breaches"] == ["running"]
