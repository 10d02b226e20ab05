"""ipvs mode end to end on a real IPVS kernel: `kproxy run --proxy-mode ipvs` on a lab node.

The behaviours every mode has (tests/test_dataplane_kernel.py), through IPVS: one kproxy
process serves the whole module (starting one costs seconds in UML); each test writes its
Services, waits for the sync, sends real packets, and removes them again.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kproxy.lab.agent import ProbeAgent, ProbeResult
from kproxy.lab.proxy import ProxyProcess, proxy_config
from kproxy.lab.topology import Lab
from tests.support.objects import endpoint, endpoint_slice, node, port, service, write

pytestmark = pytest.mark.kernel

POD_IPS = ("10.244.0.2", "10.244.0.3", "10.244.0.4")
WEB_PORTS = [port("http", 80, "http")]
SLICE_PORTS = [port("http", 8080)]
LIVE_DEADLINE = 2.0


@dataclass
class Env:
    lab: Lab
    source: Path
    proxy: ProxyProcess

    def client(self, i: int = 0) -> ProbeAgent:
        return self.lab.agent(self.lab.client_ns[i])

    def apply(self, name: str, *objects: dict[str, object]) -> None:
        before = self.proxy.status().get("generation", 0)
        write(self.source / f"{name}.yaml", *objects)
        self.settled(before)

    def remove(self, name: str) -> None:
        before = self.proxy.status().get("generation", 0)
        (self.source / f"{name}.yaml").unlink()
        self.settled(before)

    def settled(self, generation: int) -> None:
        """Wait until a sync applied a newer generation than `generation` (a sync that was
        already running when the file changed does not count) and nothing is pending."""
        deadline = time.monotonic() + LIVE_DEADLINE + 5
        while time.monotonic() < deadline:
            st = self.proxy.status()
            if st.get("generation", 0) > generation and not st.get("pending", True):
                return
            time.sleep(0.05)
        pytest.fail(f"no sync applied the change:\n{self.proxy.log_tail()}")

    def ipvsadm(self) -> str:
        return self.lab.exec(self.lab.node_ns, ["ipvsadm", "-S", "-n"]).stdout


@pytest.fixture(scope="module")
def env(lab_module: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("ipvs-run")
    source = tmp / "objects"
    source.mkdir()
    write(source / "node.yaml", node())
    config = tmp / "config.yaml"
    config.write_text(proxy_config("ipvs"))
    proxy = ProxyProcess(lab_module, source, config=config, workdir=tmp / "kproxy")
    proxy.start(timeout=60)
    try:
        yield Env(lab_module, source, proxy)
    finally:
        proxy.stop()
        lab_module.exec(lab_module.node_ns, ["ipvsadm", "-C"], check=False)


@pytest.fixture
def web(env: Env) -> Iterator[Callable[..., None]]:
    """web(**spec): the Service web (10.96.0.10:80 -> pods :8080), removed afterwards."""
    used: list[str] = []

    def make(
        *,
        name: str = "web",
        cluster_ip: str = "10.96.0.10",
        pods: tuple[str, ...] = POD_IPS,
        nodes: dict[str, str] | None = None,
        ports: list[dict[str, object]] | None = None,
        slice_ports: list[dict[str, object]] | None = None,
        status: dict[str, object] | None = None,
        **spec: object,
    ) -> None:
        svc = service(name, cluster_ip, ports or WEB_PORTS, **spec)
        if status:
            svc["status"] = status
        eps = [endpoint(ip, (nodes or {}).get(ip, "node1")) for ip in pods]
        env.apply(name, svc, endpoint_slice(name, eps, slice_ports or SLICE_PORTS))
        if name not in used:
            used.append(name)

    yield make
    for name in used:
        if (env.source / f"{name}.yaml").exists():
            env.remove(name)


def pods_of(results: list[ProbeResult]) -> Counter[str]:
    return Counter(r.pod or f"error:{r.error}" for r in results)


def wait_until(check: Callable[[], bool], timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if check():
            return time.monotonic() - start
        time.sleep(0.05)
    pytest.fail(f"condition not reached within {timeout} s")


def test_cluster_ip_round_robin_and_masquerade(env: Env, web: Callable[..., None]) -> None:
    web()
    out = env.ipvsadm()
    assert "-A -t 10.96.0.10:80 -s rr" in out
    for ip in POD_IPS:
        assert f"-a -t 10.96.0.10:80 -r {ip}:8080 -m -w 1" in out
    results = env.client().request_many(proto="tcp", dst="10.96.0.10", port=80, count=12)
    # rr: exactly one in three to each pod; from outside the cluster CIDR: masqueraded.
    assert pods_of(results) == Counter({"pod1": 4, "pod2": 4, "pod3": 4})
    assert {r.peer for r in results} == {env.lab.node_ip}
    addrs = env.lab.exec(env.lab.node_ns, ["ip", "-4", "-o", "addr", "show", "kube-ipvs0"])
    assert "10.96.0.10/32" in addrs.stdout
    link = env.lab.exec(env.lab.node_ns, ["ip", "-o", "link", "show", "kube-ipvs0"]).stdout
    # Never set up, like upstream: the addresses' local routes are all IPVS needs.
    assert "UP" not in link.split("<", 1)[1].split(">", 1)[0].split(","), link


def test_cluster_ip_from_a_pod_keeps_the_pod_source_and_hairpins(
    env: Env, web: Callable[..., None]
) -> None:
    web()
    agent = env.lab.agent(env.lab.pod_ns[0])
    results = agent.request_many(proto="tcp", dst="10.96.0.10", port=80, count=9)
    assert all(r.ok for r in results), pods_of(results)
    for r in results:
        # KUBE-LOOP-BACK: a pod reaching itself is masqueraded; the others see the pod.
        assert r.peer == (env.lab.node_ip if r.pod == "pod1" else POD_IPS[0]), r


def test_node_port_from_client_and_node_but_not_localhost(
    env: Env, web: Callable[..., None]
) -> None:
    web(type="NodePort", ports=[port("http", 80, "http", nodePort=30080)])
    assert f"-A -t {env.lab.node_ip}:30080 -s rr" in env.ipvsadm()
    from_client = env.client().request_many(proto="tcp", dst=env.lab.node_ip, port=30080, count=9)
    assert pods_of(from_client) == Counter({"pod1": 3, "pod2": 3, "pod3": 3})
    node_agent = env.lab.agent(env.lab.node_ns)
    from_node = node_agent.request_many(proto="tcp", dst=env.lab.node_ip, port=30080, count=6)
    assert all(r.ok for r in from_node), pods_of(from_node)
    # Upstream's ipvs mode has no virtual server on loopback addresses.
    local = node_agent.request_many(proto="tcp", dst="127.0.0.1", port=30080, count=2, timeout=0.5)
    assert not any(r.ok for r in local)


def test_external_ip_and_load_balancer_source_ranges(env: Env, web: Callable[..., None]) -> None:
    allowed = env.lab.client_ips[0]
    web(name="ext", cluster_ip="10.96.0.20", externalIPs=["10.99.0.10"])
    web(
        name="lb",
        cluster_ip="10.96.0.21",
        type="LoadBalancer",
        ports=[port("http", 80, "http", nodePort=30081)],
        loadBalancerSourceRanges=[f"{allowed}/32"],
        status={"loadBalancer": {"ingress": [{"ip": "10.99.1.10"}]}},
    )
    ext = env.client(1).request_many(proto="tcp", dst="10.99.0.10", port=80, count=6)
    assert all(r.ok for r in ext), pods_of(ext)
    ok = env.client(0).request_many(proto="tcp", dst="10.99.1.10", port=80, count=6)
    assert all(r.ok for r in ok), pods_of(ok)
    blocked = env.client(1).request_many(
        proto="tcp", dst="10.99.1.10", port=80, count=2, timeout=0.5
    )
    assert not any(r.ok for r in blocked), pods_of(blocked)
    sets = env.lab.exec(env.lab.node_ns, ["ipset", "save"]).stdout
    assert f"add KUBE-LOAD-BALANCER-SOURCE-CIDR 10.99.1.10,tcp:80,{allowed}" in sets
    assert "add KUBE-EXTERNAL-IP 10.99.0.10,tcp:80" in sets


def test_session_affinity_is_persistence(env: Env, web: Callable[..., None]) -> None:
    web(sessionAffinity="ClientIP", sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}})
    assert "-A -t 10.96.0.10:80 -s rr -p 60" in env.ipvsadm()
    for i in (0, 1):
        results = env.client(i).request_many(proto="tcp", dst="10.96.0.10", port=80, count=8)
        assert all(r.ok for r in results)
        assert len(pods_of(results)) == 1, f"client {i} was spread: {pods_of(results)}"


def test_external_traffic_policy_local(env: Env, web: Callable[..., None]) -> None:
    web(
        nodes={POD_IPS[1]: "node2", POD_IPS[2]: "node2"},
        type="NodePort",
        externalTrafficPolicy="Local",
        ports=[port("http", 80, "http", nodePort=30080)],
    )
    results = env.client().request_many(proto="tcp", dst=env.lab.node_ip, port=30080, count=9)
    assert pods_of(results) == Counter({"pod1": 9})
    # Local policy keeps the client's address (KUBE-NODE-PORT-LOCAL-TCP returns before MASQ).
    assert {r.peer for r in results} == {env.lab.client_ips[0]}
    cluster = env.client().request_many(proto="tcp", dst="10.96.0.10", port=80, count=9)
    assert set(pods_of(cluster)) == {"pod1", "pod2", "pod3"}


def test_internal_traffic_policy_local(env: Env, web: Callable[..., None]) -> None:
    web(nodes={POD_IPS[0]: "node2"}, internalTrafficPolicy="Local")
    results = env.lab.agent(env.lab.pod_ns[2]).request_many(
        proto="tcp", dst="10.96.0.10", port=80, count=8
    )
    assert set(pods_of(results)) == {"pod2", "pod3"}


def test_service_without_endpoints_is_refused_at_once(env: Env) -> None:
    env.apply("empty", service("empty", "10.96.0.99", WEB_PORTS))
    try:
        results = env.client().request_many(
            proto="tcp", dst="10.96.0.99", port=80, count=3, timeout=2.0
        )
        assert [r.error for r in results] == ["refused"] * 3
        assert max(r.elapsed for r in results) < 0.5
    finally:
        env.remove("empty")


def test_add_change_delete_are_live(env: Env, web: Callable[..., None]) -> None:
    web()
    client = env.client()
    write(
        env.source / "api.yaml",
        service("api", "10.96.0.30", WEB_PORTS),
        endpoint_slice("api", [endpoint(POD_IPS[0])], SLICE_PORTS),
    )
    took = wait_until(
        lambda: client.request(proto="tcp", dst="10.96.0.30", port=80, timeout=0.3).ok,
        LIVE_DEADLINE,
    )
    assert took < LIVE_DEADLINE
    web(pods=(POD_IPS[2],))

    def only_pod3() -> bool:
        got = client.request_many(proto="tcp", dst="10.96.0.10", port=80, count=6, timeout=0.5)
        return pods_of(got) == Counter({"pod3": 6})

    wait_until(only_pod3, LIVE_DEADLINE)
    (env.source / "api.yaml").unlink()
    wait_until(
        lambda: not client.request(proto="tcp", dst="10.96.0.30", port=80, timeout=0.3).ok,
        LIVE_DEADLINE,
    )
    time.sleep(0.3)
    out = env.ipvsadm()
    assert "10.96.0.30" not in out, out
    addrs = env.lab.exec(env.lab.node_ns, ["ip", "-4", "-o", "addr", "show", "kube-ipvs0"])
    assert "10.96.0.30" not in addrs.stdout


def test_udp_flow_moves_off_a_removed_endpoint(env: Env, web: Callable[..., None]) -> None:
    dns = {
        "name": "dns",
        "cluster_ip": "10.96.0.53",
        "ports": [port("dns", 53, 8080, protocol="UDP")],
        "slice_ports": [port("dns", 8080, protocol="UDP")],
    }
    web(pods=POD_IPS[:2], **dns)
    client = env.client()
    sport = 40053
    first = client.request(proto="udp", dst="10.96.0.53", port=53, timeout=1.0, sport=sport)
    assert first.ok
    again = client.request_many(
        proto="udp", dst="10.96.0.53", port=53, count=3, timeout=1.0, sport=sport
    )
    assert pods_of(again) == Counter({first.pod: 3})
    keep = tuple(ip for ip in POD_IPS[:2] if ip != env.lab.pod_ips[first.pod or ""])
    web(pods=keep, **dns)

    def moved() -> bool:
        r = client.request(proto="udp", dst="10.96.0.53", port=53, timeout=0.3, sport=sport)
        return r.ok and r.pod != first.pod

    wait_until(moved, LIVE_DEADLINE + 1)


def test_kill_9_keeps_traffic_and_restart_fails_no_request(
    env: Env, web: Callable[..., None]
) -> None:
    web()
    client = env.client()
    env.proxy.kill()
    after_kill = client.request_many(proto="tcp", dst="10.96.0.10", port=80, count=6)
    assert all(r.ok for r in after_kill), pods_of(after_kill)
    before = env.ipvsadm()
    env.proxy.start(timeout=60)  # adopts the kernel state: nothing is removed and re-added
    during = client.request_many(proto="tcp", dst="10.96.0.10", port=80, count=6)
    assert all(r.ok for r in during), pods_of(during)
    assert env.ipvsadm() == before


FETCH = (
    "import sys, urllib.request as u; r = u.urlopen(sys.argv[1], timeout=5); "
    "print(r.status); print(r.read().decode())"
)


def test_metrics_and_health_in_ipvs_mode(env: Env, web: Callable[..., None]) -> None:
    import sys

    from prometheus_client.parser import text_string_to_metric_families

    web()

    def fetch(url: str) -> tuple[int, str]:
        out = env.lab.exec(env.lab.node_ns, [sys.executable, "-c", FETCH, url]).stdout
        code, _, body = out.partition("\n")
        return int(code), body

    code, body = fetch("http://127.0.0.1:10249/metrics")
    assert code == 200
    samples = {s.name: s.value for f in text_string_to_metric_families(body) for s in f.samples}
    assert samples["kubeproxy_sync_proxy_rules_duration_seconds_count"] >= 1
    assert samples["kproxy_ipvs_virtual_servers"] >= 1
    assert samples["kproxy_ipvs_real_servers"] >= 3
    assert samples["kproxy_conntrack_max"] > 0
    assert fetch("http://127.0.0.1:10249/proxyMode") == (200, "ipvs\n")
    code, body = fetch(f"http://{env.lab.node_ip}:10256/healthz")
    assert code == 200 and '"healthy": true' in body
