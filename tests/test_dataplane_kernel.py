"""Real packets through kproxy on a lab node, for every mode (and iptables backend, and
nftables layout) built.

Each test writes Kubernetes objects into a source folder, runs `kproxy run` inside the lab's
node namespace and sends TCP/UDP from client, pod or node namespaces. New modes join by
adding to DATAPLANES; the tests stay the same.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kproxy.lab.agent import ProbeResult
from kproxy.lab.proxy import ProxyProcess, proxy_config
from kproxy.lab.topology import Lab
from tests.support.dataplane_env import (
    LIVE_DEADLINE,
    POD_IPS,
    WEB_PORTS,
    WEB_SLICE_PORTS,
    Env,
    pods_of,
    web,
)
from tests.support.objects import endpoint, endpoint_slice, node, port, service, write

pytestmark = pytest.mark.kernel

# (mode, iptables backend) pairs under test.
DATAPLANES = [
    ("iptables", "nft"),
    ("iptables", "legacy"),
    ("nftables", ""),
    ("nftables", "compact"),  # nftables mode in kproxy's compact layout
    ("userspace", "nft"),
    ("userspace", "legacy"),
]


@pytest.fixture(params=DATAPLANES, ids=[f"{m}-{b}" if b else m for m, b in DATAPLANES])
def env(request: pytest.FixtureRequest, lab: Lab, tmp_path: Path) -> Iterator[Env]:
    mode, backend = request.param
    source = tmp_path / "objects"
    source.mkdir()
    write(source / "node.yaml", node())
    config = tmp_path / "config.yaml"
    config.write_text(proxy_config(mode))
    proxy = ProxyProcess(
        lab,
        source,
        config=config,
        args=variant_args(mode, backend),
        workdir=tmp_path / "kproxy",
    )
    e = Env(lab, source, proxy, mode, backend, config)
    try:
        yield e
    finally:
        proxy.stop()


def variant_args(mode: str, variant: str) -> list[str]:
    """The second of a DATAPLANES pair: the iptables backend, or nftables mode's layout."""
    if not variant:
        return []
    return ["--nftables-layout" if mode == "nftables" else "--iptables-backend", variant]


def nft_table(env: Env) -> str:
    return "kproxy-compact" if env.backend == "compact" else "kube-proxy"


def wait_until(check: Callable[[], bool], timeout: float) -> float:
    """Poll check() until it holds; returns the seconds it took (fails the test on timeout)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if check():
            return time.monotonic() - start
        time.sleep(0.05)
    pytest.fail(f"condition not reached within {timeout} s")


# --- ClusterIP, NodePort, externalIP, LoadBalancer ---------------------------------------------


def test_cluster_ip_spreads_over_all_endpoints(env: Env) -> None:
    web(env)
    env.proxy.start()
    results = env.client().request_many(
        proto="tcp", dst="10.96.0.10", port=80, count=60, timeout=1.0
    )
    counts = pods_of(results)
    assert set(counts) == {"pod1", "pod2", "pod3"}, counts
    # From outside the cluster CIDR, traffic is masqueraded to the node (upstream's rule).
    assert {r.peer for r in results} == {env.lab.node_ip}


def test_cluster_ip_from_a_pod_keeps_the_pod_source_and_hairpins(env: Env) -> None:
    web(env)
    env.proxy.start()
    agent = env.lab.agent(env.lab.pod_ns[0])
    results = agent.request_many(proto="tcp", dst="10.96.0.10", port=80, count=30, timeout=1.0)
    assert all(r.ok for r in results), pods_of(results)
    for r in results:
        # A pod reaching itself through the service is hairpin-masqueraded; others see the pod.
        assert r.peer == (env.lab.node_ip if r.pod == "pod1" else POD_IPS[0]), r


def test_node_port_from_client_and_from_node(env: Env) -> None:
    web(env, type="NodePort", ports=[port("http", 80, "http", nodePort=30080)])
    env.proxy.start()
    from_client = env.client().request_many(
        proto="tcp", dst=env.lab.node_ip, port=30080, count=30, timeout=1.0
    )
    assert set(pods_of(from_client)) == {"pod1", "pod2", "pod3"}
    node_agent = env.lab.agent(env.lab.node_ns)
    from_node = node_agent.request_many(
        proto="tcp", dst=env.lab.node_ip, port=30080, count=10, timeout=1.0
    )
    assert all(r.ok for r in from_node), pods_of(from_node)
    localhost = node_agent.request_many(
        proto="tcp", dst="127.0.0.1", port=30080, count=5, timeout=0.5
    )
    if env.mode != "nftables":
        # localhostNodePorts (default true): NodePorts answer on 127.0.0.1 of the node too.
        assert all(r.ok for r in localhost), pods_of(localhost)
    else:
        # nftables mode never serves NodePorts on localhost (upstream, by design).
        assert not any(r.ok for r in localhost), pods_of(localhost)


def test_external_ip_and_load_balancer_source_ranges(env: Env) -> None:
    allowed, denied = env.lab.client_ips[0], env.lab.client_ips[1]
    write(
        env.source / "ext.yaml",
        service("ext", "10.96.0.20", WEB_PORTS, externalIPs=["10.99.0.10"]),
        endpoint_slice("ext", [endpoint(ip) for ip in POD_IPS], WEB_SLICE_PORTS),
    )
    lb = service(
        "lb",
        "10.96.0.21",
        [port("http", 80, "http", nodePort=30081)],
        type="LoadBalancer",
        loadBalancerSourceRanges=[f"{allowed}/32"],
    )
    lb["status"] = {"loadBalancer": {"ingress": [{"ip": "10.99.1.10"}]}}
    write(
        env.source / "lb.yaml",
        lb,
        endpoint_slice("lb", [endpoint(ip) for ip in POD_IPS], WEB_SLICE_PORTS),
    )
    env.proxy.start()
    ext = env.client(1).request_many(proto="tcp", dst="10.99.0.10", port=80, count=15, timeout=1.0)
    assert all(r.ok for r in ext), pods_of(ext)
    ok = env.client(0).request_many(proto="tcp", dst="10.99.1.10", port=80, count=15, timeout=1.0)
    assert all(r.ok for r in ok), pods_of(ok)
    blocked = env.client(1).request_many(
        proto="tcp", dst="10.99.1.10", port=80, count=3, timeout=0.5
    )
    assert not any(r.ok for r in blocked), (
        f"{denied} is outside the source range but got {pods_of(blocked)}"
    )


def test_session_affinity_sticks(env: Env) -> None:
    web(env, sessionAffinity="ClientIP", sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}})
    env.proxy.start()
    for i in (0, 1):
        results = env.client(i).request_many(
            proto="tcp", dst="10.96.0.10", port=80, count=20, timeout=1.0
        )
        assert all(r.ok for r in results)
        assert len(pods_of(results)) == 1, f"client {i} was spread: {pods_of(results)}"


def test_external_traffic_policy_local_reaches_only_local_endpoints(env: Env) -> None:
    remote = {POD_IPS[1]: "node2", POD_IPS[2]: "node2"}
    web(
        env,
        nodes=remote,
        type="NodePort",
        externalTrafficPolicy="Local",
        ports=[port("http", 80, "http", nodePort=30080)],
    )
    env.proxy.start()
    results = env.client().request_many(
        proto="tcp", dst=env.lab.node_ip, port=30080, count=30, timeout=1.0
    )
    assert pods_of(results) == Counter({"pod1": 30})
    # Local policy keeps the client's source address (no masquerade).
    assert {r.peer for r in results} == {env.lab.client_ips[0]}
    # The ClusterIP still uses every endpoint (internal policy is Cluster).
    cluster = env.client().request_many(
        proto="tcp", dst="10.96.0.10", port=80, count=30, timeout=1.0
    )
    assert set(pods_of(cluster)) == {"pod1", "pod2", "pod3"}


def test_internal_traffic_policy_local(env: Env) -> None:
    web(env, nodes={POD_IPS[0]: "node2"}, internalTrafficPolicy="Local")
    env.proxy.start()
    results = env.lab.agent(env.lab.pod_ns[2]).request_many(
        proto="tcp", dst="10.96.0.10", port=80, count=30, timeout=1.0
    )
    assert set(pods_of(results)) == {"pod2", "pod3"}


def test_service_without_endpoints_is_refused_at_once(env: Env) -> None:
    write(env.source / "empty.yaml", service("empty", "10.96.0.99", WEB_PORTS))
    env.proxy.start()
    results = env.client().request_many(
        proto="tcp", dst="10.96.0.99", port=80, count=5, timeout=2.0
    )
    assert [r.error for r in results] == ["refused"] * 5
    assert max(r.elapsed for r in results) < 0.5


# --- live changes --------------------------------------------------------------------------------


def test_add_change_delete_are_live_within_two_seconds(env: Env) -> None:
    web(env)
    env.proxy.start()
    client = env.client()

    write(
        env.source / "api.yaml",
        service("api", "10.96.0.30", WEB_PORTS),
        endpoint_slice("api", [endpoint(POD_IPS[0])], WEB_SLICE_PORTS),
    )
    took = wait_until(
        lambda: client.request(proto="tcp", dst="10.96.0.30", port=80, timeout=0.3).ok,
        LIVE_DEADLINE,
    )
    assert took < LIVE_DEADLINE

    web(env, pods=(POD_IPS[2],))

    def only_pod3() -> bool:
        return pods_of(
            client.request_many(proto="tcp", dst="10.96.0.10", port=80, count=12, timeout=0.5)
        ) == Counter({"pod3": 12})

    wait_until(only_pod3, LIVE_DEADLINE)

    (env.source / "api.yaml").unlink()
    wait_until(
        lambda: not client.request(proto="tcp", dst="10.96.0.30", port=80, timeout=0.3).ok,
        LIVE_DEADLINE,
    )


def test_udp_flow_moves_off_a_removed_endpoint(env: Env) -> None:
    write(
        env.source / "dns.yaml",
        service("dns", "10.96.0.53", [port("dns", 53, 8080, protocol="UDP")]),
        endpoint_slice(
            "dns", [endpoint(ip) for ip in POD_IPS[:2]], [port("dns", 8080, protocol="UDP")]
        ),
    )
    env.proxy.start()
    client = env.client()
    sport = 40053
    first = client.request(proto="udp", dst="10.96.0.53", port=53, timeout=1.0, sport=sport)
    assert first.ok
    # The same client port keeps its conntrack entry, so it sticks to one pod...
    again = client.request_many(
        proto="udp", dst="10.96.0.53", port=53, count=5, timeout=1.0, sport=sport
    )
    assert pods_of(again) == Counter({first.pod: 5})
    # ...until that pod's endpoint goes away: kproxy deletes the stale entry.
    keep = [ip for ip in POD_IPS[:2] if ip != env.lab.pod_ips[first.pod or ""]]
    write(
        env.source / "dns.yaml",
        service("dns", "10.96.0.53", [port("dns", 53, 8080, protocol="UDP")]),
        endpoint_slice("dns", [endpoint(ip) for ip in keep], [port("dns", 8080, protocol="UDP")]),
    )

    def moved() -> bool:
        r = client.request(proto="udp", dst="10.96.0.53", port=53, timeout=0.3, sport=sport)
        return r.ok and r.pod != first.pod

    wait_until(moved, LIVE_DEADLINE + 1)


def test_broken_source_file_changes_nothing(env: Env) -> None:
    web(env)
    env.proxy.start()
    before = rules(env)
    (env.source / "web.yaml").write_text(
        "apiVersion: v1\nkind: Service\nmetadata: {name: web\n  spec: [\n"
    )
    time.sleep(1.5)  # several polls and sync opportunities
    assert rules(env) == before
    results = env.client().request_many(
        proto="tcp", dst="10.96.0.10", port=80, count=20, timeout=1.0
    )
    assert all(r.ok for r in results)
    assert "invalid YAML" in env.proxy.log_tail(200)


# --- the dataplane outlives the process -----------------------------------------------------


def test_kill_9_keeps_traffic_and_restart_fails_no_request(env: Env) -> None:
    web(env)
    env.proxy.start()
    client = env.client()
    env.proxy.kill()
    after_kill = client.request_many(proto="tcp", dst="10.96.0.10", port=80, count=20, timeout=1.0)
    assert all(r.ok for r in after_kill), pods_of(after_kill)

    failures: list[ProbeResult] = []
    sent = 0
    stop = threading.Event()

    def load() -> None:
        nonlocal sent
        while not stop.is_set():
            for r in client.request_many(
                proto="tcp", dst="10.96.0.10", port=80, count=5, timeout=1.0
            ):
                sent += 1
                if not r.ok:
                    failures.append(r)

    t = threading.Thread(target=load)
    t.start()
    try:
        time.sleep(0.3)
        env.proxy.start()  # adopts the rules in place: no flush, no gap
        time.sleep(0.5)
    finally:
        stop.set()
        t.join()
    assert sent > 20
    assert failures == [], f"{len(failures)} of {sent} requests failed across the restart"


def test_rules_flushed_by_someone_else_come_back(env: Env) -> None:
    env.config.write_text(proxy_config(env.mode, sync_period="1s"))
    web(env)
    env.proxy.start()
    client = env.client()
    # A firewall reload: the whole nat table is flushed and its chains deleted.
    if env.mode != "nftables":
        env.lab.exec(env.lab.node_ns, [f"iptables-{env.backend}", "-t", "nat", "-F"])
        env.lab.exec(env.lab.node_ns, [f"iptables-{env.backend}", "-t", "nat", "-X"])
    else:
        env.lab.exec(env.lab.node_ns, ["nft", "delete", "table", "ip", nft_table(env)])
    assert not client.request(proto="tcp", dst="10.96.0.10", port=80, timeout=0.3).ok
    # Drift is seen (canary chain / table gone): the next periodic sync is full and restores.
    wait_until(lambda: client.request(proto="tcp", dst="10.96.0.10", port=80, timeout=0.3).ok, 5.0)


# --- observability ------------------------------------------------------------------------------

FETCH = """
import sys, urllib.error as e, urllib.request as u
try:
    r = u.urlopen(sys.argv[1], timeout=3)
except e.HTTPError as err:
    r = err
except OSError:
    print(0)
    sys.exit()
print(r.status)
print(r.headers.get("X-Content-Type-Options", ""), r.headers.get("Content-Type", ""))
print(r.read().decode())
"""


def fetch_with_headers(env: Env, url: str, ns: str | None = None) -> tuple[int, str, str]:
    """(HTTP status or 0 when nothing answers, selected headers, body)."""
    argv = [sys.executable, "-c", FETCH, url]
    out = env.lab.exec(ns or env.lab.node_ns, argv, check=False).stdout
    code, _, rest = out.partition("\n")
    headers, _, body = rest.partition("\n")
    return int(code or 0), headers, body


def fetch(env: Env, url: str) -> tuple[int, str]:
    code, _, body = fetch_with_headers(env, url)
    return code, body


def test_health_check_node_port_follows_local_endpoints(env: Env) -> None:
    import json

    hc = 32000
    url = f"http://{env.lab.node_ip}:{hc}/"
    web(
        env,
        nodes={POD_IPS[1]: "node2", POD_IPS[2]: "node2"},  # one endpoint on this node
        type="LoadBalancer",
        externalTrafficPolicy="Local",
        healthCheckNodePort=hc,
        ports=[port("http", 80, "http", nodePort=30080)],
    )
    env.proxy.start()
    client = env.lab.client_ns[0]  # what the cloud load balancer's probe looks like
    code, headers, body = fetch_with_headers(env, url, client)
    assert code == 200, body
    assert headers == "nosniff application/json"
    assert json.loads(body) == {
        "service": {"namespace": "default", "name": "web"},
        "localEndpoints": 1,
        "serviceProxyHealthy": True,
    }
    web(
        env,
        nodes={ip: "node2" for ip in POD_IPS},
        type="LoadBalancer",
        externalTrafficPolicy="Local",
        healthCheckNodePort=hc,
        ports=[port("http", 80, "http", nodePort=30080)],
    )
    env.sync()
    code, _, body = fetch_with_headers(env, url, client)
    assert code == 503 and json.loads(body)["localEndpoints"] == 0
    (env.source / "web.yaml").unlink()
    wait_until(lambda: fetch_with_headers(env, url, client)[0] == 0, LIVE_DEADLINE + 3)


def test_metrics_and_health_servers_answer_like_upstream(env: Env) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    web(env)
    env.proxy.start()
    code, body = fetch(env, "http://127.0.0.1:10249/metrics")
    assert code == 200
    fams = {f.name: f for f in text_string_to_metric_families(body)}
    syncs = [
        s
        for s in fams["kubeproxy_sync_proxy_rules_duration_seconds"].samples
        if s.name.endswith("_count")
    ]
    assert syncs and syncs[0].value >= 1
    if env.mode == "iptables":
        nat_rules = [
            s
            for s in fams["kubeproxy_sync_proxy_rules_iptables_total"].samples
            if s.labels["table"] == "nat"
        ]
        assert nat_rules[0].value > 10
    else:
        assert "kubeproxy_sync_proxy_rules_nftables_sync_failures" in fams
    assert fetch(env, "http://127.0.0.1:10249/proxyMode") == (200, env.mode + "\n")
    code, body = fetch(env, f"http://{env.lab.node_ip}:10256/healthz")
    assert code == 200 and '"healthy": true' in body


def test_status_over_the_admin_socket(env: Env) -> None:
    import json as _json
    import subprocess

    web(env)
    write(env.source / "bad.yaml", service("bad", "10.96.0.300", WEB_PORTS))
    env.proxy.start()
    argv = [sys.executable, "-m", "kproxy.cli", "status", "--state-dir", str(env.proxy.state_dir)]
    out = subprocess.run([*argv, "--json"], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    st = _json.loads(out.stdout)
    assert st["running"] and st["mode"] == env.mode and st["syncs"] >= 1
    assert st["invalid_objects"] == 1 and "spec.clusterIP" in st["rejections"][0]
    human = subprocess.run(argv, capture_output=True, text=True, check=False).stdout
    assert f"mode:            {env.mode}" in human and "Service default/bad" in human
    env.proxy.kill()
    gone = subprocess.run(argv, capture_output=True, text=True, check=False)
    assert gone.returncode == 1 and "NOT running" in gone.stdout


def test_snapshot_and_diff_see_what_the_kernel_programs(env: Env, tmp_path: Path) -> None:
    import subprocess

    web(
        env,
        type="NodePort",
        externalIPs=["10.99.0.10"],
        ports=[port("http", 80, "http", nodePort=30080)],
    )
    env.proxy.start()
    cli = [sys.executable, "-m", "kproxy.cli"]
    before, after = tmp_path / "a.json", tmp_path / "b.json"
    env.lab.exec(env.lab.node_ns, [*cli, "snapshot", "-o", str(before)])
    web(env)  # the externalIP goes away
    env.sync()
    env.lab.exec(env.lab.node_ns, [*cli, "snapshot", "-o", str(after)])
    out = subprocess.run(
        [*cli, "diff", str(before), str(after)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert "missing in B: tcp 10.99.0.10:80 (default/web:http)" in out.stdout
    assert f"present in A's {env.plane}" in out.stdout
    same = subprocess.run(
        [*cli, "diff", str(after), str(after)], capture_output=True, text=True, check=False
    )
    assert same.returncode == 0 and "missing" not in same.stdout


def rules(env: Env) -> list[str]:
    """Our rules in the node, without counters (for before/after comparisons)."""
    if env.mode == "nftables":
        out = env.lab.exec(env.lab.node_ns, ["nft", "list", "table", "ip", nft_table(env)]).stdout
        return [line.strip() for line in out.splitlines() if "counter" not in line]
    tool = f"iptables-{env.backend}-save"
    out = env.lab.exec(env.lab.node_ns, [tool]).stdout
    return [line for line in out.splitlines() if "KUBE-" in line and not line.startswith("#")]


def test_list_and_trace_commands_read_the_kernel(env: Env) -> None:
    web(env, pods=(POD_IPS[0],))
    env.proxy.start()
    cli = [sys.executable, "-m", "kproxy.cli"]
    listing = env.lab.exec(env.lab.node_ns, [*cli, "list", "--json"]).stdout
    assert "10.96.0.10" in listing and "10.244.0.2" in listing
    traced = env.lab.exec(
        env.lab.node_ns, [*cli, "trace", "--from", env.lab.client_ips[0], "--to", "10.96.0.10:80"]
    ).stdout
    assert "10.244.0.2:8080" in traced
    answered = env.client().request(proto="tcp", dst="10.96.0.10", port=80)
    assert answered.pod == "pod1"
