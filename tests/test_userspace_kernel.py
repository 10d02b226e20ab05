"""userspace mode with real packets: what only this mode has (the core kernel tests run it
through test_dataplane_kernel.DATAPLANES, which lists userspace).

`kproxy run` is started through tests/support/userspace.py's two-line bootstrap, and its
`env` fixture is the core tests' Env in userspace mode. Every test also checks that no
worker survives it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from kproxy.dataplane.userspace.control import WORKER_MODULE, proc_cmdline
from kproxy.lab.agent import ProbeResult
from kproxy.lab.proxy import proxy_config
from kproxy.lab.topology import Lab
from tests.support.dataplane_env import (
    POD_IPS,
    WEB_PORTS,
    WEB_SLICE_PORTS,
    Env,
    pods_of,
    web,
)
from tests.support.objects import endpoint, endpoint_slice, node, port, service, write
from tests.support.userspace import UserspaceProxy

pytestmark = pytest.mark.kernel
# The redirect rules go through iptables-nft (the default backend on this machine); the
# legacy backend passes the same tests (KPROXY_TEST_IPTABLES_BACKEND=legacy).
BACKEND = os.environ.get("KPROXY_TEST_IPTABLES_BACKEND", "nft")


def worker_pids(state_dir: Path | None = None) -> list[int]:
    """PIDs of userspace workers (of one state dir, or of any) running on this machine."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        argv = proc_cmdline(int(entry.name))
        if WORKER_MODULE not in argv:
            continue
        if state_dir is None or str(state_dir) in argv:
            out.append(int(entry.name))
    return out


def wait_no_workers(state_dir: Path, timeout: float = 8.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = worker_pids(state_dir)
        if not left:
            return []
        time.sleep(0.1)
    return worker_pids(state_dir)


@pytest.fixture
def env(lab: Lab, tmp_path: Path) -> Iterator[Env]:
    """The core tests' Env, running userspace mode (iptables-nft for the redirect rules)."""
    source = tmp_path / "objects"
    source.mkdir()
    write(source / "node.yaml", node())
    config = tmp_path / "config.yaml"
    config.write_text(proxy_config("userspace"))
    proxy = UserspaceProxy(
        lab,
        source,
        config=config,
        args=["--iptables-backend", BACKEND],
        workdir=tmp_path / "kproxy",
    )
    e = Env(lab, source, proxy, "userspace", BACKEND, config)
    try:
        yield e
    finally:
        proxy.stop()
    # The workers outlive the controller on purpose; the lab's namespace deletion (after this
    # fixture) is what ends them. Checked by the autouse fixture below.


@pytest.fixture(autouse=True)
def no_worker_left_behind(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[None]:
    """After the lab is gone, no worker of this test may still run (they exit on their own)."""
    yield
    state = tmp_path / "kproxy" / "state"
    left = wait_no_workers(state)
    for pid in left:  # do not leak them into later tests, but fail this one
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"userspace workers {left} outlived the lab"


# --- what only userspace mode has ---------------------------------------------------------------


def live_workers(env: Env) -> dict[int, int]:
    """worker index -> PID, from the workers' own status files."""
    from kproxy.dataplane.userspace.control import WorkerSet

    ws = WorkerSet(env.proxy.state_dir, count=0)
    return {i: w.pid for i, w in ws.workers().items()}


def test_controller_kill_9_under_load_loses_nothing(env: Env) -> None:
    web(env)
    env.proxy.start()
    workers = live_workers(env)
    assert len(workers) == os.cpu_count()
    client = env.client()
    streams = [client.open_stream("10.96.0.10", 80) for _ in range(4)]
    failures: list[ProbeResult] = []
    sent = 0
    stop = threading.Event()

    def load() -> None:
        nonlocal sent
        while not stop.is_set():
            for r in env.client(1).request_many(
                proto="tcp", dst="10.96.0.10", port=80, count=10, concurrency=5, timeout=1.0
            ):
                sent += 1
                if not r.ok:
                    failures.append(r)

    t = threading.Thread(target=load)
    t.start()
    try:
        time.sleep(0.3)
        # SIGKILL to the controller's whole process group (a crash, or a careless kill).
        assert env.proxy.proc is not None
        os.killpg(os.getpgid(env.proxy.proc.pid), signal.SIGKILL)
        env.proxy.proc.wait(timeout=10)
        time.sleep(0.5)
        # Established connections survive the controller...
        pings = [client.stream_ping(s) for s in streams]
        assert all(p.ok for p in pings), pings
        env.proxy.start()  # ...and a new controller adopts the same workers.
        time.sleep(0.5)
        pings = [client.stream_ping(s) for s in streams]
        assert all(p.ok for p in pings), pings
    finally:
        stop.set()
        t.join()
    assert sent > 50
    assert failures == [], f"{len(failures)} of {sent} requests failed: {failures[:3]}"
    assert live_workers(env) == workers, "the restarted controller started a second set"
    assert sorted(worker_pids(env.proxy.state_dir)) == sorted(workers.values())


def test_dead_endpoint_is_skipped_by_the_retry(env: Env) -> None:
    # 10.244.0.200 is routed to pod1's veth, where nobody answers: a SYN into the void, so
    # the first dial attempt to it times out (250 ms) and the connection moves on.
    env.lab.exec(env.lab.node_ns, ["ip", "route", "add", "10.244.0.200/32", "dev", "veth-p1"])
    write(
        env.source / "web.yaml",
        service("web", "10.96.0.10", WEB_PORTS),
        endpoint_slice(
            "web",
            [endpoint(ip) for ip in ("10.244.0.200", POD_IPS[1])],
            WEB_SLICE_PORTS,
        ),
    )
    env.proxy.start()
    results = env.client().request_many(
        proto="tcp", dst="10.96.0.10", port=80, count=8, timeout=2.0
    )
    assert pods_of(results) == Counter({"pod2": 8})
    slow = [r.elapsed for r in results if r.elapsed > 0.2]
    # Round robin sends every second connection to the dead endpoint first.
    assert len(slow) >= 3, [round(r.elapsed, 3) for r in results]
    assert max(slow) < 0.6, "the retry waited longer than the first dial timeout"


def test_removed_endpoint_gets_no_new_connections_while_established_ones_drain(
    env: Env,
) -> None:
    web(env)
    env.proxy.start()
    client = env.client()
    stream = client.open_stream("10.96.0.10", 80)
    first = client.stream_ping(stream)
    assert first.ok
    keep = tuple(ip for ip in POD_IPS if ip != env.lab.pod_ips[first.pod or ""])
    web(env, pods=keep)
    env.sync()
    fresh = client.request_many(proto="tcp", dst="10.96.0.10", port=80, count=12, timeout=1.0)
    assert all(r.ok for r in fresh)
    assert first.pod not in pods_of(fresh)
    again = client.stream_ping(stream)
    assert again.ok and again.pod == first.pod, again


# --- the dataplane driven directly (no controller process) ---------------------------------------


def _dataplane(lab: Lab, state: Path, **kw: object):
    from kproxy.dataplane.facts import NodeFacts, RuleOptions
    from kproxy.dataplane.iptables.backend import IptablesBackend
    from kproxy.dataplane.userspace.proxier import UserspaceDataplane

    facts = NodeFacts(node_ips=(lab.node_ip,), local_addresses=(lab.node_ip, "127.0.0.1"))
    options = RuleOptions(cluster_cidrs=(lab.cluster_cidr,))
    backend = IptablesBackend(BACKEND, netns=lab.node_ns)
    return UserspaceDataplane(backend, facts, options, state_dir=state, **kw)  # type: ignore[arg-type]


def _snapshot(*objects: dict[str, object]):
    from kproxy.model.snapshot import snapshot_from_objects

    return snapshot_from_objects([node(), *objects], "node1")


WEB = (
    service("web", "10.96.0.10", WEB_PORTS),
    endpoint_slice("web", [endpoint(POD_IPS[0])], WEB_SLICE_PORTS),
)


def test_connection_cap_holds_new_connections_until_one_closes(lab: Lab, tmp_path: Path) -> None:
    state = tmp_path / "kproxy" / "state"
    dp = _dataplane(lab, state, workers=1, max_connections=2)
    try:
        dp.sync(_snapshot(*WEB), full=True)
        client = lab.agent(lab.client_ns[0])
        held = [client.open_stream("10.96.0.10", 80) for _ in range(2)]
        assert all(client.stream_ping(s).ok for s in held)
        # The kernel completes the third handshake (backlog) but the worker does not take it.
        waiting = client.open_stream("10.96.0.10", 80)
        assert not client.stream_ping(waiting, timeout=0.5).ok
        client.close_stream(held[0])
        assert client.stream_ping(waiting, timeout=2.0).ok
        log = (state / "userspace" / "worker-0.log").read_text()
        assert "connection limit reached: 2 concurrent connections" in log
    finally:
        dp.cleanup()


def test_cleanup_removes_rules_routes_and_workers(lab: Lab, tmp_path: Path) -> None:
    state = tmp_path / "kproxy" / "state"
    dp = _dataplane(lab, state, workers=2)
    dp.sync(_snapshot(*WEB), full=True)
    client = lab.agent(lab.client_ns[0])
    assert client.request(proto="tcp", dst="10.96.0.10", port=80).ok
    kinds = {o.kind for o in dp.owned()}
    assert kinds == {"iptables-chain", "iptables-rule", "process", "ip-rule", "ip-route"}
    assert len(worker_pids(state)) == 2
    removed = dp.cleanup()
    assert {o.kind for o in removed} == kinds
    assert worker_pids(state) == []
    saved = lab.exec(lab.node_ns, [f"iptables-{BACKEND}-save"]).stdout
    assert "KUBE-PORTALS" not in saved and "KUBE-NODEPORT" not in saved
    assert "2900" not in lab.exec(lab.node_ns, ["ip", "rule"]).stdout
    assert dp.owned() == []
    assert not client.request(proto="tcp", dst="10.96.0.10", port=80, timeout=0.3).ok


def test_new_listener_is_up_before_its_rule_and_old_one_stays_until_its_rule_is_gone(
    lab: Lab, tmp_path: Path
) -> None:
    """Make-before-break: no connection may hit a redirect without a listener behind it."""
    state = tmp_path / "kproxy" / "state"
    dp = _dataplane(lab, state, workers=2)
    client = lab.agent(lab.client_ns[0])
    api = (
        service("api", "10.96.0.30", WEB_PORTS),
        endpoint_slice("api", [endpoint(POD_IPS[1])], WEB_SLICE_PORTS),
    )
    failures: list[ProbeResult] = []
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            for r in client.request_many(
                proto="tcp", dst="10.96.0.10", port=80, count=10, concurrency=5, timeout=1.0
            ):
                if not r.ok:
                    failures.append(r)

    try:
        dp.sync(_snapshot(*WEB), full=True)
        t = threading.Thread(target=load)
        t.start()
        try:
            for _ in range(3):  # add and remove a service next to the loaded one
                dp.sync(_snapshot(*WEB, *api), full=False)
                assert client.request(proto="tcp", dst="10.96.0.30", port=80).ok
                dp.sync(_snapshot(*WEB), full=False)
        finally:
            stop.set()
            t.join()
        assert failures == []
        # The retired listener is closed once its rule is gone.
        listeners = {lst["key"] for lst in dp.workers.read_table()["listeners"]}
        assert listeners == {"default/web:http/tcp/cluster"}
    finally:
        dp.cleanup()


ECHO_SERVER = """\
import socket, threading
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 7000))
s.listen(64)
print("ready", flush=True)
def echo(c):
    while True:
        data = c.recv(65536)
        if not data:
            break
        c.sendall(data)
    c.close()
while True:
    c, _ = s.accept()
    threading.Thread(target=echo, args=(c,), daemon=True).start()
"""
BULK_CLIENT = """\
import hashlib, os, socket, sys, threading
payload = os.urandom(8 << 20)
s = socket.create_connection(("10.96.0.70", 7000), timeout=10)
def send():
    s.sendall(payload)
    s.shutdown(socket.SHUT_WR)  # the half-close must travel through the proxy
threading.Thread(target=send).start()
got = bytearray()
while chunk := s.recv(1 << 16):
    got += chunk
print(len(got), hashlib.sha256(got).hexdigest() == hashlib.sha256(payload).hexdigest())
"""


@pytest.mark.parametrize("engine", ["splice", "copy"])
def test_bulk_echo_with_backpressure_and_half_close(lab: Lab, tmp_path: Path, engine: str) -> None:
    server = lab.spawn(
        lab.pod_ns[0], [sys.executable, "-c", ECHO_SERVER], stdout=subprocess.PIPE, text=True
    )
    assert server.stdout is not None and server.stdout.readline().strip() == "ready"
    state = tmp_path / "kproxy" / "state"
    dp = _dataplane(lab, state, workers=1, engine=engine)
    try:
        dp.sync(
            _snapshot(
                service("echo", "10.96.0.70", [port("echo", 7000, 7000)]),
                endpoint_slice("echo", [endpoint(POD_IPS[0])], [port("echo", 7000)]),
            ),
            full=True,
        )
        out = lab.exec(lab.client_ns[0], [sys.executable, "-c", BULK_CLIENT], timeout=60)
        assert out.stdout.split() == [str(8 << 20), "True"], out.stderr
        status = json.loads((state / "userspace" / "worker-0.json").read_text())
        assert status["engine"] == engine
    finally:
        dp.cleanup()


def test_detach_takes_new_connections_off_and_keeps_established_ones(
    lab: Lab, tmp_path: Path
) -> None:
    state = tmp_path / "kproxy" / "state"
    dp = _dataplane(lab, state, workers=1)
    client = lab.agent(lab.client_ns[0])
    try:
        dp.sync(_snapshot(*WEB), full=True)
        stream = client.open_stream("10.96.0.10", 80)
        assert client.stream_ping(stream).ok
        dp.detach()
        saved = lab.exec(lab.node_ns, [f"iptables-{BACKEND}-save"]).stdout
        assert "-j KUBE-PORTALS" not in saved and "-j KUBE-NODEPORT" not in saved
        assert ":KUBE-PORTALS-CONTAINER" in saved  # chains stay until cleanup
        assert not client.request(proto="tcp", dst="10.96.0.10", port=80, timeout=0.3).ok
        assert client.stream_ping(stream).ok
        dp.sync(_snapshot(*WEB), full=False)  # re-attaches (a detach forces a full sync)
        assert client.request(proto="tcp", dst="10.96.0.10", port=80).ok
    finally:
        dp.cleanup()


def test_udp_session_sticks_while_busy_and_ends_after_the_idle_timeout(
    lab: Lab, tmp_path: Path
) -> None:
    state = tmp_path / "kproxy" / "state"
    dp = _dataplane(lab, state, workers=2, udp_idle_timeout=0.25)
    client = lab.agent(lab.client_ns[0])
    dns = [port("dns", 53, 8080, protocol="UDP")]
    try:
        dp.sync(
            _snapshot(
                service("dns", "10.96.0.53", dns),
                endpoint_slice(
                    "dns",
                    [endpoint(ip) for ip in POD_IPS[:2]],
                    [port("dns", 8080, protocol="UDP")],
                ),
            ),
            full=True,
        )
        busy = client.request_many(
            proto="udp", dst="10.96.0.53", port=53, count=6, timeout=1.0, sport=40054
        )
        assert len(pods_of(busy)) == 1 and all(r.ok for r in busy), pods_of(busy)
        # The pod sees the node (ClusterIP traffic from outside the cluster CIDR).
        assert {r.peer for r in busy} == {lab.node_ip}
        time.sleep(0.6)  # idle: the session (and its backend socket) is gone
        later = client.request(proto="udp", dst="10.96.0.53", port=53, sport=40054)
        assert later.ok and later.pod != busy[0].pod  # a new session: the next endpoint
    finally:
        dp.cleanup()
