"""kproxy list / trace for userspace mode, from recorded dumps (no root).

The iptables side is what the userspace renderer writes (plus the jumps from the built-in
chains, in the order a sync inserts them), read back as iptables-save -c text; the workers'
side is a WorkerState as read_worker_state() builds it from /proc and the state dir.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from kproxy.dataplane.facts import NodeFacts, RuleOptions
from kproxy.dataplane.userspace.render import JUMPS, UserspacePlan, jump_rule, render_plan
from kproxy.dataplane.userspace.worker import connection_counts
from kproxy.model.snapshot import snapshot_from_objects
from kproxy.ops.inspect import list_services, trace
from kproxy.ops.inspect.model import DNAT, DROP, REJECT
from kproxy.ops.inspect.userspace import (
    RecordedUserspaceSource,
    WorkerState,
    parse_proc_net,
)
from tests.support.objects import endpoint, endpoint_slice, node, port, service

NODE_IP = "10.100.0.1"
CLIENT = "10.100.0.2"
POD_CLIENT = "10.244.0.9"
PODS = ("10.244.0.2", "10.244.0.3", "10.244.0.4")
FACTS = NodeFacts(node_ips=(NODE_IP,), local_addresses=(NODE_IP, "127.0.0.1"))
OPTIONS = RuleOptions(cluster_cidrs=("10.244.0.0/16",))
HTTP = [port("http", 80, "http")]
SLICE = [port("http", 8080)]


def objects() -> list[dict[str, Any]]:
    lb = service(
        "lb",
        "10.96.0.21",
        HTTP,
        type="LoadBalancer",
        loadBalancerSourceRanges=[f"{CLIENT}/32"],
    )
    lb["status"] = {"loadBalancer": {"ingress": [{"ip": "10.99.1.10"}]}}
    return [
        node(),
        service(
            "web",
            "10.96.0.10",
            [port("http", 80, "http", nodePort=30080)],
            type="NodePort",
            externalIPs=["10.99.0.10"],
        ),
        endpoint_slice("web", [endpoint(ip) for ip in PODS], SLICE),
        service("empty", "10.96.0.99", HTTP),
        service(
            "aff",
            "10.96.0.12",
            HTTP,
            sessionAffinity="ClientIP",
            sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}},
        ),
        endpoint_slice("aff", [endpoint(ip) for ip in PODS[:2]], SLICE),
        lb,
        endpoint_slice("lb", [endpoint(ip) for ip in PODS], SLICE),
        service(
            "loc",
            "10.96.0.13",
            [port("http", 80, "http", nodePort=30082)],
            type="NodePort",
            externalTrafficPolicy="Local",
        ),
        endpoint_slice("loc", [endpoint(PODS[0]), endpoint(PODS[1], "node2")], SLICE),
    ]


def plan() -> UserspacePlan:
    return render_plan(snapshot_from_objects(objects(), "node1"), FACTS, OPTIONS)


def save_text(p: UserspacePlan, *, counters: bool = True, hooked: bool = True) -> str:
    """The plan as iptables-save -c would print it after a full sync."""
    jumps: dict[tuple[str, str], list[str]] = {}
    for table, chain, extra, comment, target, verb in JUMPS if hooked else ():
        rule = "-A " + jump_rule(chain, extra, comment, target)
        rules = jumps.setdefault((table, chain), [])
        # -I puts a jump first, -A last.
        rules.insert(0, rule) if verb == "-I" else rules.append(rule)
    builtin = {
        "filter": ("INPUT", "FORWARD", "OUTPUT"),
        "nat": ("PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"),
        "mangle": ("PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"),
    }
    out: list[str] = []
    body = p.text().splitlines()
    table = ""
    for line in body:
        if line.startswith("*"):
            table = line[1:]
            out.append(line)
            out += [f":{c} ACCEPT [0:0]" for c in builtin[table]]
            for (t, _chain), rules in jumps.items():
                if t == table:
                    out += [("[0:0] " if counters else "") + r for r in rules]
            continue
        if line.startswith("-A "):
            # One new connection per redirect rule: a counter that can be checked.
            count = "[1:60] " if " DNAT " in line else "[0:0] "
            out.append((count if counters else "") + line)
            continue
        out.append(line)
    return "\n".join(out) + "\n"


def workers(p: UserspacePlan, **overrides: Any) -> WorkerState:
    table = {
        **p.worker_table(),
        "node_addresses": [NODE_IP, "127.0.0.1"],
        "generation": 4,
        "workers": 2,
    }
    listening = {(lst.protocol, lst.port): {0, 1} for lst in p.listeners}
    statuses = {i: {"index": i, "pid": 100 + i, "generation": 4, "errors": {}} for i in (0, 1)}
    reports: dict[int, dict[str, Any]] = {
        0: {"conns": {"default/web:http/tcp/cluster": {f"{PODS[0]}:8080": [2, 1]}}},
        1: {
            "conns": {"default/web:http/tcp/cluster": {f"{PODS[0]}:8080": [1, 0]}},
            "affinity": {"default/aff:http": {CLIENT: [PODS[1], 8080, 5.0]}},
        },
    }
    state = WorkerState(None, table=table, statuses=statuses, reports=reports, listening=listening)
    for name, value in overrides.items():
        setattr(state, name, value)
    return state


def source(p: UserspacePlan | None = None, **kw: Any) -> RecordedUserspaceSource:
    p = p or plan()
    state = kw.pop("state", None) or workers(p)
    return RecordedUserspaceSource(
        iptables={"nft": save_text(p, **kw)},
        local_addresses=[NODE_IP, "127.0.0.1"],
        workers=state,
    )


def port_of(p: UserspacePlan, key: str) -> int:
    return next(lst.port for lst in p.listeners if lst.key == key)


# --- list ----------------------------------------------------------------------------------------


def test_list_reads_the_redirects_and_the_workers_in_ipvsadm_layout() -> None:
    result = list_services(source=source(), stats=True)
    (dp,) = result.dataplanes  # the iptables reader's "not iptables mode" view is covered
    assert (dp.dataplane, dp.mode, dp.live) == ("userspace-nft", "userspace", True)
    assert not result.notes, result.notes
    assert dp.service_names == [
        "default/aff:http",
        "default/empty:http",
        "default/lb:http",
        "default/loc:http",
        "default/web:http",
    ]
    web = dp.server("tcp", "10.96.0.10", 80)
    assert web is not None and web.scheduler == "rr" and web.kind == "ClusterIP"
    assert [(rs.addr, rs.forward, rs.weight) for rs in web.endpoints] == [
        (f"{ip}:8080", "Proxy", 1) for ip in PODS
    ]
    # ActiveConn/InActConn summed over the workers' reports, not from conntrack.
    assert [(rs.active, rs.inactive) for rs in web.endpoints] == [(3, 1), (0, 0), (0, 0)]
    # nat counters of the container and the host rule of this address.
    assert web.packets == 2 and web.bytes == 120
    node_port = dp.server("tcp", "*", 30080)
    assert node_port is not None and node_port.kind == "NodePort" and len(node_port.endpoints) == 3
    aff = dp.server("tcp", "10.96.0.12", 80)
    assert aff is not None and aff.persistent == 60 and "persistent 60" in aff.flags
    empty = dp.server("tcp", "10.96.0.99", 80)
    assert empty is not None and empty.verdict == "REJECT" and not empty.endpoints
    lb = dp.server("tcp", "10.99.1.10", 80)
    assert lb is not None and lb.source_ranges == (f"{CLIENT}/32",)
    local = dp.server("tcp", "*", 30082)
    assert local is not None and local.local_only
    assert [rs.addr for rs in local.endpoints] == [f"{PODS[0]}:8080"]
    text = result.text()
    assert "TCP  10.96.0.10:80 rr  # default/web:http (ClusterIP)" in text
    assert f"  -> {PODS[0]}:8080" in text and "Proxy" in text
    assert "2 userspace workers (pids 100, 101)" in text
    assert "nat rule counters of the redirect rules" in text
    data = json.loads(result.to_json())
    assert data["dataplanes"][0]["virtual_servers"][0]["endpoints"][0]["forward"] == "Proxy"


def test_list_says_what_the_workers_do_not_do() -> None:
    p = plan()
    web_port = port_of(p, "default/web:http/tcp/cluster")
    state = workers(p)
    del state.listening[("tcp", web_port)]
    state.statuses[1]["errors"] = {
        "default/web:http/tcp/cluster": f"cannot listen on tcp port {web_port}: in use"
    }
    state.reports[1]["conns"]["default/web:http/tcp/cluster"]["10.244.0.77:8080"] = [0, 2]
    (dp,) = list_services(source=source(p, state=state)).dataplanes
    web = dp.server("tcp", "10.96.0.10", 80)
    assert web is not None
    notes = " | ".join(web.notes)
    assert f"no worker listens on tcp port {web_port}" in notes
    assert f"worker 1: cannot listen on tcp port {web_port}" in notes
    assert "2 open connections to endpoints not listed here (10.244.0.77:8080)" in notes


def test_list_without_workers_and_without_hooks() -> None:
    p = plan()
    src = RecordedUserspaceSource(
        iptables={"nft": save_text(p, hooked=False)}, local_addresses=[NODE_IP]
    )
    (dp,) = list_services(source=src).dataplanes
    assert not dp.live and "not hooked" in dp.detail
    assert any("no userspace worker runs here" in n for n in dp.notes)
    web = dp.server("tcp", "10.96.0.10", 80)
    assert web is not None and not web.endpoints
    assert any("no worker runs" in n for n in web.notes)


def test_mode_selection_names_userspace() -> None:
    (dp,) = list_services(source=source(), mode="userspace").dataplanes
    assert dp.dataplane == "userspace-nft"
    assert list_services(source=source(), mode="userspace-legacy").dataplanes == []
    (ipt,) = list_services(source=source(), mode="iptables").dataplanes
    assert not ipt.live and "userspace mode's iptables chains" in ipt.detail


# --- trace ---------------------------------------------------------------------------------------


def test_trace_walks_the_rules_to_the_listener_and_round_robin() -> None:
    p = plan()
    web_port = port_of(p, "default/web:http/tcp/cluster")
    result = trace(CLIENT, "10.96.0.10", 80, source=source(p))
    (dp,) = result.dataplanes
    assert dp.dataplane == "userspace-nft"
    assert result.verdicts() == {DNAT}
    assert result.destinations() == {f"{ip}:8080" for ip in PODS}
    assert [round(o.probability or 0, 3) for o in dp.outcomes] == [0.333] * 3
    # The client is outside the cluster CIDR: the worker connects from the node.
    assert all(o.masquerade for o in dp.outcomes)
    steps = dp.outcomes[0].steps
    where = [(s.table, s.chain, s.rule) for s in steps]
    assert where[:2] == [("nat", "PREROUTING", 1), ("nat", "KUBE-PORTALS-CONTAINER", where[1][2])]
    assert steps[1].action == f"DNAT to {NODE_IP}:{web_port}"
    listener = next(s for s in steps if s.table == "userspace" and s.chain.startswith("listener"))
    assert listener.chain == f"listener tcp/{web_port}" and "pids 100, 101" in listener.action
    balancer = next(s for s in steps if s.chain == "balancer")
    assert balancer.action == "round robin over 3 backends"
    text = result.text()
    assert f"nat KUBE-PORTALS-CONTAINER rule {where[1][2]}:" in text
    assert "userspace balancer: round robin over 3 backends" in text


def test_trace_from_a_pod_keeps_its_address_and_from_the_node_uses_the_host_chain() -> None:
    result = trace(POD_CLIENT, "10.96.0.10", 80, source=source())
    assert all(o.masquerade is False for o in result.outcomes)
    from_node = trace(NODE_IP, "10.96.0.10", 80, source=source())
    assert from_node.packet.from_node
    assert any(s.chain == "KUBE-PORTALS-HOST" for s in from_node.outcomes[0].steps)
    assert from_node.destinations() == {f"{ip}:8080" for ip in PODS}


def test_trace_follows_the_workers_affinity_entry() -> None:
    (o,) = trace(CLIENT, "10.96.0.12", 80, source=source()).outcomes
    assert o.dnat == f"{PODS[1]}:8080"
    assert any("ClientIP affinity: 10.100.0.2 used" in s.action for s in o.steps)
    # Another client has no entry: either endpoint.
    other = trace("10.100.0.3", "10.96.0.12", 80, source=source())
    assert other.destinations() == {f"{ip}:8080" for ip in PODS[:2]}
    # An entry as old as the timeout does not count.
    p = plan()
    state = workers(p)
    state.reports[1]["affinity"]["default/aff:http"][CLIENT][2] = 61.0
    assert len(trace(CLIENT, "10.96.0.12", 80, source=source(p, state=state)).outcomes) == 2


def test_trace_refusals_no_endpoints_source_ranges_and_a_port_nobody_listens_on() -> None:
    (o,) = trace(CLIENT, "10.96.0.99", 80, source=source()).outcomes
    assert o.verdict == REJECT and "has no endpoints" in o.reason
    (o,) = trace("10.100.0.3", "10.99.1.10", 80, source=source()).outcomes
    assert o.verdict == DROP and "loadBalancerSourceRanges" in o.reason
    p = plan()
    state = workers(p)
    web_port = port_of(p, "default/web:http/tcp/cluster")
    del state.listening[("tcp", web_port)]
    (o,) = trace(CLIENT, "10.96.0.10", 80, source=source(p, state=state)).outcomes
    assert o.verdict == REJECT and f"no worker listens on tcp port {web_port}" in o.reason


def test_trace_local_policy_keeps_the_source_and_uses_only_the_local_endpoint() -> None:
    (o,) = trace(CLIENT, NODE_IP, 30082, source=source()).outcomes
    assert o.dnat == f"{PODS[0]}:8080" and o.masquerade is False
    # From the node itself: every endpoint (the cluster fallback), from the node's address.
    from_node = trace(NODE_IP, NODE_IP, 30082, source=source())
    assert from_node.destinations() == {f"{ip}:8080" for ip in PODS[:2]}
    assert all(o.masquerade for o in from_node.outcomes)


def test_trace_drift_against_the_snapshot() -> None:
    snap = snapshot_from_objects(objects(), "node1")
    assert trace(CLIENT, "10.96.0.10", 80, source=source(), snapshot=snap).drift == []
    p = plan()
    state = workers(p)
    table = state.table or {}
    for item in table["listeners"]:
        if item["key"] == "default/web:http/tcp/cluster":
            item["targets"] = item["targets"][:1]
    drift = trace(CLIENT, "10.96.0.10", 80, source=source(p, state=state), snapshot=snap).drift
    assert any(f"endpoint {PODS[1]}:8080 is in the snapshot" in d for d in drift), drift


# --- the workers' side ---------------------------------------------------------------------------

PROC_NET_TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:671C 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4242 1
   1: 0100640A:671C 0200640A:A1B2 01 00000000:00000000 00:00000000 00000000     0        0 4343 1
"""
PROC_NET_UDP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
  12: 00000000:6D92 00000000:0000 07 00000000:00000000 00:00000000 00000000     0        0 5151 2
"""


def test_proc_net_parser_finds_listening_sockets() -> None:
    assert parse_proc_net(PROC_NET_TCP, "tcp") == {4242: (0x671C, "LISTEN"), 4343: (0x671C, "01")}
    assert parse_proc_net(PROC_NET_UDP, "udp") == {5151: (0x6D92, "UNCONN")}


def test_worker_connection_counts_as_ipvsadm_counts_them() -> None:
    def pump(eof: bool = False) -> SimpleNamespace:
        return SimpleNamespace(eof=eof)

    ep = ("10.244.0.2", 8080)
    other = ("10.244.0.3", 8080)

    def conn(up: Any, down: Any, *, attempt: int = 1, plan: Any = (ep,)) -> SimpleNamespace:
        return SimpleNamespace(
            key="k",
            bsock=object(),
            attempt=attempt,
            plan=list(plan),
            closed=False,
            up=up,
            down=down,
        )

    tcp = SimpleNamespace(
        conns=[
            conn(pump(), pump()),  # established
            conn(pump(), pump(True)),  # half closed
            conn(None, None),  # still dialling
            conn(pump(), pump(), attempt=2, plan=(ep, other)),  # the retry reached the second
            SimpleNamespace(
                key="k", bsock=None, attempt=0, plan=[], closed=False, up=None, down=None
            ),
        ]
    )
    udp = SimpleNamespace(
        sessions={("u", ("10.100.0.2", 5353)): SimpleNamespace(key="u", endpoint=ep)}
    )
    assert connection_counts(tcp, udp) == {  # type: ignore[arg-type]
        "k": {"10.244.0.2:8080": [1, 2], "10.244.0.3:8080": [1, 0]},
        "u": {"10.244.0.2:8080": [0, 1]},
    }


def test_redirect_rules_without_a_node_ip_lead_to_the_same_listener() -> None:
    # Without a node IP the renderer REDIRECTs (to the incoming interface's address).
    facts = NodeFacts(node_ips=(), local_addresses=(NODE_IP, "127.0.0.1"))
    p = render_plan(snapshot_from_objects(objects(), "node1"), facts, OPTIONS)
    save = save_text(p)
    assert "-j REDIRECT --to-ports" in save and "--to-destination" not in save
    result = trace(CLIENT, "10.96.0.10", 80, source=source(p))
    assert result.destinations() == {f"{ip}:8080" for ip in PODS}
    (dp,) = list_services(source=source(p)).dataplanes
    web = dp.server("tcp", "10.96.0.10", 80)
    assert web is not None and len(web.endpoints) == 3
