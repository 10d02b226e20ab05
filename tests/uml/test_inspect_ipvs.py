"""`kproxy list` and `kproxy trace` in ipvs mode, against a real IPVS kernel (UML).

list: the virtual servers kproxy programmed, with their schedulers, real servers, IPVS's
own ActiveConn/InActConn (an open connection counts) and --stats counters; trace: the
iptables layer in front (ipset matches, masquerade mark), the virtual server and scheduler,
and the real servers it can pick, checked against where real connections went. The CLI
runs twice (`list --json`, `list --stats`); the other reads call what it prints, in this
process, in the node's namespace (each CLI start costs seconds in UML).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from kproxy.dataplane.ipvs import names as n
from kproxy.lab.proxy import ProxyProcess, proxy_config
from kproxy.lab.topology import Lab
from kproxy.leftovers import clean_leftovers
from kproxy.ops import inspect as inspection
from tests.support.objects import endpoint, endpoint_slice, node, port, service, write

pytestmark = pytest.mark.kernel

PODS = ("10.244.0.2", "10.244.0.3", "10.244.0.4")
Key = tuple[str, str, int]  # (proto, address, port) of a virtual server
POD_NAMES = {f"pod{i + 1}": ip for i, ip in enumerate(PODS)}


@dataclass
class Env:
    lab: Lab
    proxy: ProxyProcess

    def trace(self, src: str, to: str) -> dict[str, Any]:
        """What `kproxy trace --from src --to IP:PORT --json` prints (in this process)."""
        ip, _, port = to.rpartition(":")
        data: dict[str, Any] = json.loads(
            inspection.trace(src, ip, int(port), "tcp", netns=self.lab.node_ns).to_json()
        )
        return data

    def kproxy(self, *argv: str) -> dict[str, Any]:
        proc = self.lab.exec(
            self.lab.node_ns, [sys.executable, "-m", "kproxy.cli", *argv, "--json"], check=False
        )
        assert proc.returncode == 0, (argv, proc.stdout[-2000:], proc.stderr[-2000:])
        data: dict[str, Any] = json.loads(proc.stdout)
        return data

    def listing(self, *, stats: bool = False, cli: bool = False) -> dict[Key, dict[str, Any]]:
        """`kproxy list --json [--stats]` by virtual server: what the CLI prints (cli=True:
        run it), or the same function's JSON in this process (each CLI run costs seconds
        of start-up in UML; the CLI itself runs in two of the tests)."""
        if cli:
            out = self.kproxy("list", *(["--stats"] if stats else []))
        else:
            out = json.loads(inspection.list_services(self.lab.node_ns, stats=stats).to_json())
        planes = out["dataplanes"]
        assert [d["dataplane"] for d in planes] == ["ipvs"], out
        assert planes[0]["live"], planes[0]
        return {(v["proto"], v["address"], v["port"]): v for v in planes[0]["virtual_servers"]}


@pytest.fixture(scope="module")
def env(lab_module: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("inspect-ipvs")
    src = tmp / "objects"
    src.mkdir()
    write(src / "node.yaml", node())
    write(
        src / "web.yaml",
        service("web", "10.96.0.10", [port("http", 80, 8080)]),
        endpoint_slice("web", [endpoint(ip) for ip in PODS], [port("http", 8080)]),
    )
    db = service("db", "10.96.0.20", [port("http", 80, 8080)])
    db["metadata"]["annotations"] = {n.SCHEDULER_ANNOTATION: "sh"}
    write(
        src / "db.yaml",
        db,
        endpoint_slice("db", [endpoint(ip) for ip in PODS[:2]], [port("http", 8080)]),
    )
    write(
        src / "dns.yaml",
        service("dns", "10.96.0.53", [port("dns", 53, 8080, protocol="UDP")]),
        endpoint_slice("dns", [endpoint(ip) for ip in PODS], [port("dns", 8080, protocol="UDP")]),
    )
    cfg = tmp / "config.yaml"
    cfg.write_text(proxy_config("ipvs"))
    proxy = ProxyProcess(
        lab_module, src, config=cfg, args=["--iptables-backend", "legacy"], workdir=tmp / "kp"
    )
    proxy.start(timeout=60)
    try:
        yield Env(lab_module, proxy)
    finally:
        proxy.stop()
        clean_leftovers(None, netns=lab_module.node_ns)  # what `kproxy cleanup` removes
        lab_module.exec(lab_module.node_ns, ["ipvsadm", "-C"], check=False)


def endpoints(vs: dict[str, Any]) -> set[str]:
    return {f"{e['address']}:{e['port']}" for e in vs["endpoints"]}


def test_list_shows_the_virtual_servers_with_schedulers_and_real_servers(env: Env) -> None:
    servers = env.listing(cli=True)
    web = servers[("tcp", "10.96.0.10", 80)]
    assert web["scheduler"] == "rr" and web["kind"] == "ClusterIP"
    assert endpoints(web) == {f"{ip}:8080" for ip in PODS}
    assert {e["forward"] for e in web["endpoints"]} == {"Masq"}
    assert {e["weight"] for e in web["endpoints"]} == {1}
    db = servers[("tcp", "10.96.0.20", 80)]
    assert db["scheduler"] == "sh" and endpoints(db) == {f"{ip}:8080" for ip in PODS[:2]}
    dns = servers[("udp", "10.96.0.53", 53)]
    assert dns["scheduler"] == "rr" and endpoints(dns) == {f"{ip}:8080" for ip in PODS}
    # What ipvsadm itself says about the same kernel.
    raw = env.lab.exec(env.lab.node_ns, ["ipvsadm", "-S", "-n"]).stdout
    assert "-A -t 10.96.0.20:80 -s sh" in raw and "-A -t 10.96.0.10:80 -s rr" in raw


def test_active_conn_counts_an_open_connection_and_stats_count_traffic(env: Env) -> None:
    agent = env.lab.agent(env.lab.client_ns[0])
    before = env.listing(stats=True)[("tcp", "10.96.0.10", 80)]
    stream = agent.open_stream(dst="10.96.0.10", port=80, timeout=2.0)
    assert agent.stream_ping(stream, timeout=2.0).ok
    results = agent.request_many("tcp", "10.96.0.10", 80, 6, timeout=2.0)
    assert all(r.ok for r in results), [r.error for r in results]
    # IPVS's counters are summed from per-CPU ones every 2 s (its rate estimator): read
    # until they show the 7 connections, at most 6 s.
    deadline = time.monotonic() + 6
    while True:
        web = env.listing(stats=True)[("tcp", "10.96.0.10", 80)]
        counted = web["ipvs_stats"]["conns"] - before["ipvs_stats"]["conns"]
        if counted >= 7 or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert sum(e["active_conns"] for e in web["endpoints"]) == 1, web["endpoints"]
    assert sum(e["inactive_conns"] for e in web["endpoints"]) >= 6, web["endpoints"]
    conns = web["ipvs_stats"]["conns"] - before["ipvs_stats"]["conns"]
    assert conns == 7, (before["ipvs_stats"], web["ipvs_stats"])
    assert web["packets"] > before["packets"] and web["bytes"] > before["bytes"]
    per_dest = sum(e["ipvs_stats"]["conns"] for e in web["endpoints"])
    assert per_dest == web["ipvs_stats"]["conns"]
    text = env.lab.exec(
        env.lab.node_ns, [sys.executable, "-m", "kproxy.cli", "list", "--stats"]
    ).stdout
    assert "TCP  10.96.0.10:80 rr" in text and "ActiveConn InActConn" in text, text


def test_trace_predicts_where_real_connections_go(env: Env) -> None:
    client = env.lab.client_ns[0]
    src = "10.100.0.2"
    out = env.trace(src, "10.96.0.10:80")
    (plane,) = out["dataplanes"]
    assert plane["dataplane"] == "ipvs"
    outcomes = plane["outcomes"]
    predicted = {o["dnat"] for o in outcomes if o["verdict"] == "DNAT"}
    assert predicted == {f"{ip}:8080" for ip in PODS}, outcomes
    assert all(abs(o["probability"] - 1 / 3) < 1e-6 for o in outcomes)
    # From outside the cluster CIDR: KUBE-SERVICES marks for masquerade (ipset match).
    assert all(o["masquerade"] for o in outcomes), outcomes
    steps = outcomes[0]["steps"]
    assert any("KUBE-CLUSTER-IP" in s["text"] for s in steps), steps
    assert any(s["table"] == "ipvs" and "scheduler rr" in s["action"] for s in steps), steps
    agent = env.lab.agent(client)
    results = agent.request_many("tcp", "10.96.0.10", 80, 9, timeout=2.0)
    assert all(r.ok for r in results), [r.error for r in results]
    went = {f"{POD_NAMES[str(r.pod)]}:8080" for r in results}
    assert went == predicted
    # Masqueraded, as predicted: the pods see the node, not the client.
    assert {r.peer for r in results} != {src}

    # sh: one real server per client, and it is one of the two predicted.
    db = env.trace(src, "10.96.0.20:80")["dataplanes"][0]
    db_predicted = {o["dnat"] for o in db["outcomes"]}
    assert db_predicted == {f"{ip}:8080" for ip in PODS[:2]}
    hits = {
        f"{POD_NAMES[str(r.pod)]}:8080"
        for r in agent.request_many("tcp", "10.96.0.20", 80, 4, timeout=2.0)
    }
    assert len(hits) == 1 and hits <= db_predicted

    # No virtual server: the trace says so and a real connection is not answered by a pod.
    none = env.trace(src, "10.96.0.99:80")["dataplanes"][0]
    assert [o["verdict"] for o in none["outcomes"]] != ["DNAT"]


def test_verify_counts_the_ipvs_service_ports(env: Env) -> None:
    from kproxy.ops.verify import dataplane_service_count

    count, error = dataplane_service_count("ipvs", env.lab.node_ns)
    assert (count, error) == (3, "")
    assert env.proxy.status().get("services") == 3
