"""Metrics and health: upstream names and semantics, unit level (the lab test scrapes HTTP)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kproxy.dataplane.base import SyncResult
from kproxy.model.snapshot import ChangeCounts, snapshot_from_objects
from kproxy.server.http import HealthState, health_server, metrics_server
from kproxy.server.metrics import ProxyMetrics
from tests.support.objects import endpoint, endpoint_slice, port, service

# Upstream kube-proxy's metric families (reference §6) that every dashboard relies on.
UPSTREAM_FAMILIES = {
    "kubeproxy_sync_proxy_rules_duration_seconds": "histogram",
    "kubeproxy_sync_full_proxy_rules_duration_seconds": "histogram",
    "kubeproxy_sync_partial_proxy_rules_duration_seconds": "histogram",
    "kubeproxy_network_programming_duration_seconds": "histogram",
    "kubeproxy_sync_proxy_rules_last_timestamp_seconds": "gauge",
    "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds": "gauge",
    "kubeproxy_sync_proxy_rules_iptables_total": "gauge",
    "kubeproxy_sync_proxy_rules_iptables_last": "gauge",
    "kubeproxy_sync_proxy_rules_no_local_endpoints_total": "gauge",
    "kubeproxy_sync_proxy_rules_endpoint_changes_pending": "gauge",
    "kubeproxy_sync_proxy_rules_service_changes_pending": "gauge",
    "kubeproxy_sync_proxy_rules_endpoint_changes": "counter",
    "kubeproxy_sync_proxy_rules_service_changes": "counter",
    "kubeproxy_sync_proxy_rules_iptables_restore_failures": "counter",
    "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures": "counter",
    "kubeproxy_proxy_healthz": "counter",
    "kubeproxy_proxy_livez": "counter",
}


def families(metrics: ProxyMetrics) -> dict[str, object]:
    text = generate_latest(metrics.registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_upstream_names_types_and_buckets() -> None:
    fams = families(ProxyMetrics("iptables"))
    for name, kind in UPSTREAM_FAMILIES.items():
        assert name in fams, name
        assert fams[name].type == kind, name
    fresh = generate_latest(ProxyMetrics("iptables").registry).decode()
    top_bucket = 'kubeproxy_sync_proxy_rules_duration_seconds_bucket{ip_family="IPv4",le="16.384"}'
    assert f"{top_bucket} 0.0" in fresh
    m = ProxyMetrics("iptables")
    m.synced(snapshot_from_objects([], "n"), SyncResult(full=True), 0.003, ChangeCounts())
    text = generate_latest(m.registry).decode()
    assert (
        'kubeproxy_sync_proxy_rules_duration_seconds_bucket{ip_family="IPv4",le="0.004"} 1.0'
        in text
    )
    assert (
        'kubeproxy_sync_proxy_rules_duration_seconds_bucket{ip_family="IPv4",le="0.002"} 0.0'
        in text
    )
    assert 'le="16.384"' in text
    assert (
        'kubeproxy_network_programming_duration_seconds_bucket{ip_family="IPv4",le="300.0"}' in text
    )


def test_sync_observations() -> None:
    m = ProxyMetrics("iptables")
    objs = [
        service(
            "web",
            "10.96.0.10",
            [port("http", 80, 8080, nodePort=30080)],
            type="NodePort",
            externalTrafficPolicy="Local",
        ),
        endpoint_slice("web", [endpoint("10.244.0.2", node="other")], [port("http", 8080)]),
    ]
    objs[1]["metadata"]["annotations"] = {
        "endpoints.kubernetes.io/last-change-trigger-time": "2020-01-01T00:00:00Z"
    }
    snap = snapshot_from_objects(objs, "node1")
    m.queued(123.0, 1, 1)
    m.synced(
        snap,
        SyncResult(full=False, rules_total={"nat": 10, "filter": 3}, rules_written={"nat": 4}),
        0.01,
        ChangeCounts(2, 3),
    )
    f = families(m)
    values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in f.values()
        for s in fam.samples
    }
    assert (
        values[
            (
                "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
                (("ip_family", "IPv4"), ("traffic_policy", "external")),
            )
        ]
        == 1
    )
    assert (
        values[
            ("kubeproxy_sync_proxy_rules_iptables_total", (("ip_family", "IPv4"), ("table", "nat")))
        ]
        == 10
    )
    assert values[("kubeproxy_sync_proxy_rules_service_changes_total", ())] == 2
    assert values[("kubeproxy_sync_proxy_rules_endpoint_changes_total", ())] == 3
    assert (
        values[
            ("kubeproxy_sync_partial_proxy_rules_duration_seconds_count", (("ip_family", "IPv4"),))
        ]
        == 1
    )
    # The trigger time is long ago: one observation, in the top bucket range.
    assert (
        values[("kubeproxy_network_programming_duration_seconds_count", (("ip_family", "IPv4"),))]
        == 1
    )
    m.failed(full=False)
    f = families(m)
    values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in f.values()
        for s in fam.samples
    }
    assert (
        values[
            (
                "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures_total",
                (("ip_family", "IPv4"),),
            )
        ]
        == 1
    )


def test_health_goes_503_when_a_queued_change_waits_too_long() -> None:
    now = [1000.0]
    state = HealthState(health_timeout=60, clock=lambda: now[0])
    assert state.report()[0], "nothing queued: healthy"
    state.queued(1000.0, 1, 0)
    now[0] = 1059.0
    assert state.report()[0]
    now[0] = 1061.0
    healthy, last, _ = state.report()
    assert not healthy
    state.synced(None, None, 0.0, None)  # type: ignore[arg-type]
    assert state.report()[0]


def test_servers_over_http() -> None:
    m = ProxyMetrics("iptables")
    state = HealthState(health_timeout=60)
    import socket

    # Port 0 means "disabled" (as upstream), so pick free ports first.

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        mport = s.getsockname()[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        hport = s.getsockname()[1]
    ms = metrics_server(f"127.0.0.1:{mport}", m, lambda: "iptables", True)
    hs = health_server(f"127.0.0.1:{hport}", state, m, True)
    ms.start()
    hs.start()
    try:
        base = f"http://127.0.0.1:{mport}"
        assert urllib.request.urlopen(f"{base}/proxyMode").read() == b"iptables"
        assert urllib.request.urlopen(f"{base}/healthz").read() == b"ok"
        text = urllib.request.urlopen(f"{base}/metrics").read().decode()
        assert "kubeproxy_sync_proxy_rules_duration_seconds_bucket" in text
        resp = urllib.request.urlopen(f"http://127.0.0.1:{hport}/healthz")
        assert resp.status == 200 and resp.headers["Content-Type"] == "application/json"
        assert resp.headers["X-Content-Type-Options"] == "nosniff"
        body = json.loads(resp.read())
        assert body["healthy"] is True and body["nodeEligible"] is True
        assert set(body) >= {"lastUpdated", "currentTime", "status"}
        live = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{hport}/livez").read())
        assert "nodeEligible" not in live
        text = urllib.request.urlopen(f"{base}/metrics").read().decode()
        assert 'kubeproxy_proxy_healthz_total{code="200"} 1.0' in text
        assert 'kubeproxy_proxy_livez_total{code="200"} 1.0' in text
    finally:
        ms.stop()
        hs.stop()


def test_conntrack_and_ipvs_object_gauges(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from kproxy.server import metrics as metrics_module

    count, limit = tmp_path / "count", tmp_path / "max"
    count.write_text("1234\n")
    limit.write_text("262144\n")
    monkeypatch.setattr(metrics_module, "CONNTRACK_COUNT", str(count))
    monkeypatch.setattr(metrics_module, "CONNTRACK_MAX", str(limit))
    m = ProxyMetrics("ipvs")
    m.synced(
        snapshot_from_objects([], "node1"),
        SyncResult(full=True, objects={"ipvs_virtual_servers": 7, "ipvs_real_servers": 21}),
        0.01,
        ChangeCounts(0, 0),
    )
    values = {s.name: s.value for fam in families(m).values() for s in fam.samples}
    assert values["kproxy_conntrack_entries"] == 1234
    assert values["kproxy_conntrack_max"] == 262144
    assert values["kproxy_ipvs_virtual_servers"] == 7
    assert values["kproxy_ipvs_real_servers"] == 21
    count.unlink()  # conntrack not loaded: NaN, not a crash
    values = {s.name: s.value for fam in families(m).values() for s in fam.samples}
    assert values["kproxy_conntrack_entries"] != values["kproxy_conntrack_entries"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _raw_http(port: int, data: bytes) -> bytes:
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    return answer


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"garbage\r\n\r\n", b"400"),
        (b"\xff\xfe\x00\x01 / HTTP/1.0\r\n\r\n", b"501"),
        (b"GET /" + b"a" * 70_000 + b" HTTP/1.0\r\n\r\n", b"414"),
        (b"GET /healthz HTTP/1.0\r\nX: " + b"a" * 70_000 + b"\r\n\r\n", b"431"),
        (b"GET /healthz HTTP/1.0\r\n" + b"X: a\r\n" * 101 + b"\r\n", b"431"),
        (b"GET /\x1b[2J\xc3\xa9 HTTP/1.0\r\n\r\n", b"404"),
    ],
    ids=["garbage", "binary", "huge-line", "huge-header", "many-headers", "escapes"],
)
def test_bad_http_requests_are_answered_and_logged_in_one_line(
    request_bytes: bytes, status: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    port = _free_port()
    server = health_server(f"127.0.0.1:{port}", HealthState(60), ProxyMetrics("iptables"), True)
    server.start()
    try:
        with caplog.at_level("DEBUG", logger="kproxy.server"):
            answer = _raw_http(port, request_bytes)
            # A request line without a version is answered the HTTP/0.9 way: no status line.
            shown = answer.startswith(b"HTTP/1.0 " + status) or b"code: " + status in answer
            assert shown, answer[:300]
            # The server goes on serving.
            assert json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/livez").read())
    finally:
        server.stop()
    for record in caplog.records:
        message = record.getMessage()
        assert "\n" not in message and "\x1b" not in message and "\r" not in message, message


def test_a_silent_http_client_is_dropped_after_the_timeout_and_blocks_no_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import socket
    import time

    from kproxy.server.http import RequestHandler

    monkeypatch.setattr(RequestHandler, "timeout", 1.0)
    port = _free_port()
    server = metrics_server(f"127.0.0.1:{port}", ProxyMetrics("iptables"), lambda: "x", True)
    server.start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as silent:
            silent.sendall(b"GET /heal")  # and nothing more
            start = time.monotonic()
            assert urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz").read() == b"ok"
            assert time.monotonic() - start < 1.0
            assert silent.recv(100) == b""  # closed by the server after its timeout
            assert time.monotonic() - start < 5.0
    finally:
        server.stop()
