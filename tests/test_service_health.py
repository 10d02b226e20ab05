"""The health-check NodePort server on loopback: listeners follow the snapshot, answers
follow local ready endpoints and proxy health, as upstream's service health server."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from kproxy.dataplane.base import SyncResult
from kproxy.model.snapshot import ChangeCounts, ChangeTracker
from kproxy.server.service_health import (
    ServiceHealthServer,
    local_ready_endpoints,
    wanted_health_checks,
)
from kproxy.sources.base import ObjectEvent, ObjectKey
from tests.support.objects import endpoint, endpoint_slice, port, service


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def lb_local(name: str, hc: int, endpoints: list[dict]) -> list[dict]:
    return [
        service(
            name,
            "10.96.0.10",
            [port("http", 80, 8080, nodePort=30080), port("https", 443, 8443, nodePort=30443)],
            type="LoadBalancer",
            externalTrafficPolicy="Local",
            healthCheckNodePort=hc,
        ),
        endpoint_slice(name, endpoints, [port("http", 8080), port("https", 8443)]),
    ]


def snapshot_of(*objects: dict):
    t = ChangeTracker("node1")
    t.apply(
        [
            ObjectEvent(
                ObjectKey(
                    o["kind"], o["metadata"].get("namespace", "default"), o["metadata"]["name"]
                ),
                o,
            )
            for o in objects
        ]
    )
    return t.snapshot()


def get(port_: int) -> tuple[int, dict, dict[str, str]]:
    try:
        r = urllib.request.urlopen(f"http://127.0.0.1:{port_}/anything", timeout=3)
    except urllib.error.HTTPError as err:
        r = err
    return r.status, json.loads(r.read()), dict(r.headers)


@pytest.fixture
def server() -> Iterator[tuple[ServiceHealthServer, list[bool]]]:
    healthy = [True]
    srv = ServiceHealthServer(lambda: healthy[0], addresses=lambda: ["127.0.0.1"])
    yield srv, healthy
    srv.stop()


def synced(srv: ServiceHealthServer, snap) -> None:
    srv.synced(snap, SyncResult(full=True), 0.0, ChangeCounts())


def test_counts_distinct_local_ready_ips_over_all_ports() -> None:
    snap = snapshot_of(
        *lb_local(
            "web",
            31000,
            [
                endpoint("10.244.0.2"),  # local, ready: counted once for both ports
                endpoint("10.244.0.3", ready=False, serving=True, terminating=True),
                endpoint("10.244.0.4", "node2"),
            ],
        )
    )
    assert wanted_health_checks(snap) == {("default", "web"): 31000}
    assert local_ready_endpoints(snap) == {("default", "web"): 1}


def test_no_health_check_port_without_lb_and_local_policy() -> None:
    snap = snapshot_of(
        service(
            "np",
            "10.96.0.11",
            [port("http", 80, 8080, nodePort=30081)],
            type="NodePort",
            externalTrafficPolicy="Local",
            healthCheckNodePort=31001,
        ),
        service(
            "lb",
            "10.96.0.12",
            [port("http", 80, 8080, nodePort=30082)],
            type="LoadBalancer",
            healthCheckNodePort=31002,
        ),
    )
    assert wanted_health_checks(snap) == {}


def test_answers_follow_endpoints_and_proxy_health(
    server: tuple[ServiceHealthServer, list[bool]],
) -> None:
    srv, healthy = server
    hc = free_port()
    synced(srv, snapshot_of(*lb_local("web", hc, [endpoint("10.244.0.2"), endpoint("10.244.0.3")])))
    code, body, headers = get(hc)
    assert code == 200
    assert body == {
        "service": {"namespace": "default", "name": "web"},
        "localEndpoints": 2,
        "serviceProxyHealthy": True,
    }
    assert headers["Content-Type"] == "application/json"
    assert headers["X-Content-Type-Options"] == "nosniff"
    healthy[0] = False  # the proxy is behind on its changes: LBs must stop sending here
    code, body, _ = get(hc)
    assert code == 503 and body["serviceProxyHealthy"] is False and body["localEndpoints"] == 2
    healthy[0] = True
    synced(srv, snapshot_of(*lb_local("web", hc, [endpoint("10.244.0.2", "node2")])))
    code, body, _ = get(hc)
    assert code == 503 and body["localEndpoints"] == 0


def test_listener_moves_with_the_port_and_closes_with_the_service(
    server: tuple[ServiceHealthServer, list[bool]],
) -> None:
    srv, _ = server
    first, second = free_port(), free_port()
    synced(srv, snapshot_of(*lb_local("web", first, [endpoint("10.244.0.2")])))
    assert get(first)[0] == 200
    synced(srv, snapshot_of(*lb_local("web", second, [endpoint("10.244.0.2")])))
    assert get(second)[0] == 200
    with pytest.raises(urllib.error.URLError):
        get(first)
    synced(srv, snapshot_of())
    assert srv.ports() == {}
    with pytest.raises(urllib.error.URLError):
        get(second)


def test_a_port_in_use_is_reported_and_retried(
    server: tuple[ServiceHealthServer, list[bool]],
) -> None:
    srv, _ = server
    hc = free_port()
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", hc))
    squatter.listen()
    snap = snapshot_of(*lb_local("web", hc, [endpoint("10.244.0.2")]))
    try:
        synced(srv, snap)
        assert srv.ports() == {}
        assert "cannot open health check port" in srv.open_errors[("default", "web")]
    finally:
        squatter.close()
    synced(srv, snap)  # the next sync tries again
    assert srv.ports() == {("default", "web"): hc} and srv.open_errors == {}
    assert get(hc)[0] == 200
