"""kproxy list / trace on recorded kernel dumps, render output and hand-made rules (no root).

The recorded dumps (tests/support/inspect_dumps.py) come from a lab node running kproxy with
tests/support/scenario.py's objects; the expectations below are what that scenario
programs, so a reader change that misreads the kernel's own format fails here.
"""

from __future__ import annotations

import json

import pytest

from kproxy.dataplane.facts import NodeFacts, RuleOptions
from kproxy.dataplane.iptables.render import JUMPS, jump_rule, render_full
from kproxy.model.snapshot import snapshot_from_objects
from kproxy.ops.inspect import (
    ModeSelectionError,
    RecordedSource,
    list_services,
    trace,
)
from kproxy.ops.inspect.iptables_rules import parse_rule, parse_save, service_of_comment
from kproxy.ops.inspect.kernel import parse_ip_addr, parse_recent, parse_timer_list
from kproxy.ops.inspect.model import ANY_ADDRESS, DNAT, DROP, REJECT
from tests.support import inspect_dumps as dumps
from tests.support.objects import endpoint, endpoint_slice, port, service
from tests.support.scenario import HTTP, PODS, SLICE, scenario_objects

CLIENT, DENIED, NODE_IP = "10.100.0.2", "10.100.0.3", "10.100.0.1"


def ipt(**extra: object) -> RecordedSource:
    kwargs: dict[str, object] = {
        "iptables": {"nft": dumps.IPTABLES_SAVE},
        "ip_addr": dumps.IP_ADDR,
        "conntrack": dumps.IPTABLES_CONNTRACK,
        "recent": dumps.IPTABLES_RECENT,
        "timer_list": dumps.IPTABLES_TIMER_LIST,
    }
    kwargs.update(extra)
    return RecordedSource(**kwargs)  # type: ignore[arg-type]


def nft(**extra: object) -> RecordedSource:
    kwargs: dict[str, object] = {
        "nft": dumps.NFT_JSON,
        "ip_addr": dumps.IP_ADDR,
        "conntrack": dumps.NFT_CONNTRACK,
    }
    kwargs.update(extra)
    return RecordedSource(**kwargs)  # type: ignore[arg-type]


SOURCES = {"iptables": ipt, "nftables": nft}
both = pytest.mark.parametrize("mode", list(SOURCES))


def snapshot(objects: list[dict[str, object]] | None = None):  # type: ignore[no-untyped-def]
    return snapshot_from_objects(objects or scenario_objects(), "node1")


# --- parsing -----------------------------------------------------------------------------------


def test_rule_parser_reads_generic_module_and_target_options() -> None:
    rule = parse_rule(
        "-A KUBE-SVC-X ! -s 10.244.0.0/16 -d 10.96.0.10/32 -p tcp "
        '-m comment --comment "a b \\"c\\"" -m tcp --dport 80 '
        "-m statistic --mode random --probability 0.50000000000 -j KUBE-SEP-Y"
    )
    assert rule.chain == "KUBE-SVC-X" and rule.target == "KUBE-SEP-Y" and not rule.goto
    src = rule.generic_opt("-s")
    assert src is not None and src.negated and src.value == "10.244.0.0/16"
    assert rule.address("-d") == "10.96.0.10/32" and rule.proto == "tcp" and rule.dport == 80
    assert rule.comment == 'a b "c"'
    stat = rule.match("statistic")
    assert stat is not None and stat.get("--probability").value == "0.50000000000"  # type: ignore[union-attr]
    dnat = parse_rule("-A KUBE-SEP-Y -p tcp -m tcp -j DNAT --to-destination 10.244.0.2:8080")
    assert dnat.target_opt("--to-destination") == "10.244.0.2:8080"
    neg = parse_rule("-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN")
    mark = neg.match("mark")
    assert mark is not None and mark.get("--mark").negated  # type: ignore[union-attr]


def test_save_parser_keeps_counters_and_rule_numbers() -> None:
    tables = parse_save(dumps.IPTABLES_SAVE)
    assert {"filter", "nat"} <= set(tables)
    nat = tables["nat"]
    rules = nat.rules("KUBE-SERVICES")
    assert [r.number for r in rules] == list(range(1, len(rules) + 1))
    web = next(r for r in rules if r.comment == "default/web:http cluster IP")
    assert web.packets == 6 and web.bytes == 360
    assert nat.policy("PREROUTING") == "ACCEPT"


def test_kube_proxy_comments_name_their_service() -> None:
    assert service_of_comment("default/web:http cluster IP") == "default/web:http"
    assert service_of_comment("default/empty:http has no endpoints") == "default/empty:http"
    assert (
        service_of_comment("default/lb:http traffic not accepted by KUBE-FW-X") == "default/lb:http"
    )
    assert service_of_comment("default/web:http -> 10.244.0.2:8080") == "default/web:http"
    assert service_of_comment("kubernetes service portals") is None


def test_proc_parsers() -> None:
    assert "10.100.0.1" in parse_ip_addr(dumps.IP_ADDR)
    assert "127.0.0.1" in parse_ip_addr(dumps.IP_ADDR)
    entries = parse_recent(
        "src=10.100.0.2 ttl: 64 last_seen: 4296441332 oldest_pkt: 1 4296441332\n"
    )
    assert entries == {"10.100.0.2": 4296441332}
    jiffies, hz = parse_timer_list(dumps.IPTABLES_TIMER_LIST) or (0, 0)
    assert jiffies > 1 << 32 and hz in (100, 250, 300, 1000)
    assert parse_timer_list("now at 10 nsecs\njiffies: 5\n") is None


# --- list --------------------------------------------------------------------------------------


@both
def test_list_reads_every_virtual_server_of_the_scenario(mode: str) -> None:
    result = list_services(source=SOURCES[mode]())
    assert len(result.dataplanes) == 1 and not result.mid_switch
    dp = result.dataplanes[0]
    assert dp.mode == mode and dp.live
    assert dp.service_names == [
        "default/aff:http",
        "default/dns:dns",
        "default/empty:http",
        "default/lb:http",
        "default/loc:http",
        "default/one:http",
        "default/remote:http",
        "default/web:http",
    ]
    web = dp.server("tcp", "10.96.0.10", 80)
    assert web is not None and web.kind == "ClusterIP"
    assert web.scheduler == ("random" if mode == "iptables" else "numgen")
    assert [rs.addr for rs in web.endpoints] == [f"{ip}:8080" for ip in PODS]
    assert all(rs.forward == "Masq" and rs.weight == 1 for rs in web.endpoints)
    assert [round(rs.share or 0, 3) for rs in web.endpoints] == [0.333] * 3
    aff = dp.server("tcp", "10.96.0.12", 80)
    assert aff is not None and aff.persistent == 60 and "persistent 60" in aff.flags
    empty = dp.server("tcp", "10.96.0.99", 80)
    assert empty is not None and empty.verdict == REJECT and not empty.endpoints
    lb = dp.server("tcp", "10.99.1.10", 80)
    assert lb is not None and lb.kind == "LoadBalancer" and lb.source_ranges
    assert lb.source_ranges[0].startswith(CLIENT)
    dns = dp.server("udp", "10.96.0.53", 53)
    assert dns is not None and len(dns.endpoints) == 2
    assert dp.server("tcp", "10.99.0.10", 80) is not None  # the externalIP
    # NodePorts: match-all in iptables mode; the primary node IP (nodeport-ips) in nftables.
    np_addr = ANY_ADDRESS if mode == "iptables" else NODE_IP
    loc = dp.server("tcp", np_addr, 30082)
    assert loc is not None and loc.kind == "NodePort" and loc.local_only
    assert [rs.addr for rs in loc.endpoints] == ["10.244.0.2:8080"]
    loc_cluster = dp.server("tcp", "10.96.0.13", 80)
    assert loc_cluster is not None and len(loc_cluster.endpoints) == 2
    assert not loc_cluster.local_only


@both
def test_local_policy_without_local_endpoints_drops_external_traffic(mode: str) -> None:
    dp = list_services(source=SOURCES[mode]()).dataplanes[0]
    remote = dp.server("tcp", ANY_ADDRESS if mode == "iptables" else NODE_IP, 30083)
    assert remote is not None and remote.verdict == DROP and remote.local_only
    assert not remote.endpoints
    cluster = dp.server("tcp", "10.96.0.14", 80)
    assert cluster is not None and [rs.addr for rs in cluster.endpoints] == ["10.244.0.4:8080"]
    (o,) = trace(CLIENT, NODE_IP, 30083, source=SOURCES[mode]()).outcomes
    assert o.verdict == DROP and o.service == "default/remote:http"
    if mode == "iptables":
        assert o.reason == (
            "DROP by filter KUBE-EXTERNAL-SERVICES rule 1 "
            "(default/remote:http has no local endpoints)"
        )
    else:
        assert "@no-endpoint-nodeports" in o.reason
    # From the node itself, Local policy short-circuits to the (remote) endpoint.
    assert trace(NODE_IP, NODE_IP, 30083, source=SOURCES[mode]()).destinations() == {
        "10.244.0.4:8080"
    }


@both
def test_list_counts_connections_from_conntrack(mode: str) -> None:
    dp = list_services(source=SOURCES[mode]()).dataplanes[0]
    one = dp.server("tcp", "10.96.0.11", 80)
    assert one is not None
    # The three streams were open when the dump was recorded.
    assert [(rs.addr, rs.active) for rs in one.endpoints] == [("10.244.0.3:8080", 3)]
    web = dp.server("tcp", "10.96.0.10", 80)
    assert web is not None
    assert sum(rs.active for rs in web.endpoints) == 0
    assert sum(rs.inactive for rs in web.endpoints) == 6  # six closed requests (TIME_WAIT)


def test_list_stats_are_iptables_rule_counters() -> None:
    dp = list_services(source=ipt(), stats=True).dataplanes[0]
    web = dp.server("tcp", "10.96.0.10", 80)
    assert web is not None and web.packets == 6
    assert sum(rs.packets or 0 for rs in web.endpoints) == 6
    assert dp.has_counters


def test_list_stats_say_nftables_has_no_counters() -> None:
    result = list_services(source=nft(), stats=True)
    web = result.dataplanes[0].server("tcp", "10.96.0.10", 80)
    assert web is not None and web.packets is None
    text = result.text()
    assert "n/a" in text and "the nftables layout has no counters" in text


def test_list_text_uses_the_ipvsadm_layout() -> None:
    text = list_services(source=ipt()).text()
    lines = text.splitlines()
    assert lines[0] == "kproxy list: iptables mode (iptables-nft), 8 services, 14 virtual servers"
    assert lines[1] == "Prot LocalAddress:Port Scheduler Flags"
    assert lines[2].startswith(
        "  -> RemoteAddress:Port           Forward Weight ActiveConn InActConn"
    )
    assert "TCP  10.96.0.12:80 random persistent 60  # default/aff:http (ClusterIP)" in lines
    i = lines.index("TCP  10.96.0.11:80 random  # default/one:http (ClusterIP)")
    assert lines[i + 1].split() == ["->", "10.244.0.3:8080", "Masq", "1", "3", "0", "100.0%"]
    assert "TCP  *:30082 random local-only  # default/loc:http (NodePort)" in lines


def test_list_default_order_is_by_service_and_sort_is_by_address() -> None:
    by_name = list_services(source=ipt()).dataplanes[0].servers
    assert [vs.service for vs in by_name] == sorted(vs.service for vs in by_name)
    web = [vs.addr for vs in by_name if vs.service == "default/web:http"]
    assert web == ["10.96.0.10:80", "10.99.0.10:80", "*:30080"]
    by_addr = list_services(source=ipt(), sort=True).dataplanes[0].servers
    tcp = [vs.addr for vs in by_addr if vs.proto == "tcp"]
    assert tcp[:3] == ["10.96.0.10:80", "10.96.0.11:80", "10.96.0.12:80"]
    assert tcp[-4:] == ["*:30080", "*:30081", "*:30082", "*:30083"]
    assert by_addr[-1].proto == "udp"


def test_list_json_is_machine_readable() -> None:
    doc = json.loads(list_services(source=ipt(), stats=True).to_json())
    (dp,) = doc["dataplanes"]
    assert dp["dataplane"] == "iptables-nft" and dp["services"] == 8
    web = next(v for v in dp["virtual_servers"] if v["address"] == "10.96.0.10" and v["port"] == 80)
    assert web["scheduler"] == "random" and web["packets"] == 6
    assert {e["address"] for e in web["endpoints"]} == set(PODS)
    assert doc["drift"] is None  # no snapshot given


class _Growing(RecordedSource):
    """A recorded source whose counters grow by 5 connections between reads."""

    def __init__(self) -> None:
        super().__init__(iptables={"nft": dumps.IPTABLES_SAVE}, ip_addr=dumps.IP_ADDR)
        self.reads = 0

    def refresh(self) -> None:
        self.reads += 1

    def iptables_save(self, flavour: str) -> str | None:
        if self.reads == 0:
            return dumps.IPTABLES_SAVE
        return dumps.IPTABLES_SAVE.replace(
            "[6:360] -A KUBE-SERVICES -d 10.96.0.10/32",
            "[16:960] -A KUBE-SERVICES -d 10.96.0.10/32",
        )


def test_list_rate_is_the_difference_of_two_reads() -> None:
    slept: list[float] = []
    result = list_services(source=_Growing(), rate=True, interval=2.0, sleep=slept.append)
    assert slept == [2.0]
    web = result.dataplanes[0].server("tcp", "10.96.0.10", 80)
    assert web is not None and web.packet_rate == 5.0 and web.byte_rate == 300.0
    assert "Pkts/s" in result.text() and result.stats


# --- mode detection ----------------------------------------------------------------------------


def test_both_dataplanes_hooked_is_reported_as_mid_switch() -> None:
    src = ipt(nft=dumps.NFT_JSON)
    result = list_services(source=src)
    assert [d.dataplane for d in result.dataplanes] == ["iptables-nft", "nftables"]
    assert result.mid_switch and "mid-switch" in result.notes[0]
    only = list_services(source=ipt(nft=dumps.NFT_JSON), mode="nftables")
    assert [d.dataplane for d in only.dataplanes] == ["nftables"]
    traced = trace(CLIENT, "10.96.0.11", 80, source=ipt(nft=dumps.NFT_JSON))
    assert [d.dataplane for d in traced.dataplanes] == ["iptables-nft", "nftables"]
    assert traced.destinations() == {"10.244.0.3:8080"}


def test_unhooked_chains_are_leftovers_not_live() -> None:
    unhooked = "\n".join(
        line
        for line in dumps.IPTABLES_SAVE.splitlines()
        if "-A PREROUTING" not in line
        and '-A OUTPUT -m comment --comment "kubernetes service portals"' not in line
    )
    result = list_services(source=RecordedSource(iptables={"nft": unhooked}))
    (dp,) = result.dataplanes
    assert not dp.live and "not hooked" in dp.detail
    assert "NOT LIVE" in result.text()


def test_nothing_found_and_unknown_modes() -> None:
    empty = list_services(
        source=RecordedSource(iptables={"nft": "*nat\n:PREROUTING ACCEPT [0:0]\nCOMMIT\n"})
    )
    assert not empty.found and "no kube-proxy dataplane" in empty.text()
    # ipvs has a reader now (ops/inspect/ipvs.py); a recording without IPVS state has none.
    assert not list_services(source=ipt(), mode="ipvs").found
    with pytest.raises(ModeSelectionError, match="unknown mode"):
        trace(CLIENT, "10.96.0.10", 80, source=ipt(), mode="bogus")


def test_ipvs_mode_iptables_rules_are_not_iptables_mode() -> None:
    save = (
        "*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n:KUBE-NODE-PORT - [0:0]\n"
        '-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES\n'
        "-A KUBE-SERVICES -m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT\nCOMMIT\n"
    )
    (dp,) = list_services(source=RecordedSource(iptables={"nft": save})).dataplanes
    assert not dp.live and "ipvs mode's iptables chains" in dp.detail
    userspace = (
        "*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-PORTALS-CONTAINER - [0:0]\n"
        "-A PREROUTING -j KUBE-PORTALS-CONTAINER\nCOMMIT\n"
    )
    # The userspace reader takes these chains; iptables mode's reader says they are not its.
    (dp,) = list_services(source=RecordedSource(iptables={"nft": userspace})).dataplanes
    assert dp.dataplane == "userspace-nft" and dp.live
    only = list_services(source=RecordedSource(iptables={"nft": userspace}), mode="iptables")
    (dp,) = only.dataplanes
    assert not dp.live and "userspace mode's iptables chains" in dp.detail


# --- trace: iptables ---------------------------------------------------------------------------


def test_iptables_trace_shows_the_probability_ladder_with_rule_numbers() -> None:
    result = trace(CLIENT, "10.96.0.10", 80, source=ipt())
    (dp,) = result.dataplanes
    assert len(dp.outcomes) == 3
    assert result.destinations() == {f"{ip}:8080" for ip in PODS}
    assert all(o.masquerade for o in dp.outcomes)
    assert [round(o.probability or 0, 3) for o in dp.outcomes] == [0.333] * 3
    first = dp.outcomes[0].steps
    assert (first[0].table, first[0].chain, first[0].rule) == ("nat", "PREROUTING", 1)
    services = parse_save(dumps.IPTABLES_SAVE)["nat"].rules("KUBE-SERVICES")
    web_rule = next(r for r in services if r.comment == "default/web:http cluster IP")
    hit = next(s for s in first if s.chain == "KUBE-SERVICES")
    assert hit.rule == web_rule.number and hit.text == web_rule.text
    text = result.text()
    assert "3 possible outcomes" in text and "taken (probability 0.3333)" in text
    assert "DNAT to one of 10.244.0.2:8080 (33.3%), 10.244.0.3:8080 (33.3%)" in text
    assert "KUBE-POSTROUTING rule 3" in text and "MASQUERADE" in text


def test_iptables_trace_of_a_service_without_endpoints_is_reject() -> None:
    result = trace(CLIENT, "10.96.0.99", 80, source=ipt())
    (o,) = result.outcomes
    assert o.verdict == REJECT and o.service == "default/empty:http"
    assert o.reason == "REJECT by filter KUBE-SERVICES rule 1 (default/empty:http has no endpoints)"


def test_iptables_trace_of_a_source_outside_the_ranges_is_drop() -> None:
    (o,) = trace(DENIED, "10.99.1.10", 80, source=ipt()).outcomes
    assert o.verdict == DROP and "KUBE-PROXY-FIREWALL" in o.reason
    assert any("will be dropped by KUBE-PROXY-FIREWALL" in s.text for s in o.steps)
    allowed = trace(CLIENT, "10.99.1.10", 80, source=ipt())
    assert allowed.verdicts() == {DNAT} and len(allowed.destinations()) == 3


def test_iptables_trace_reads_the_affinity_state_from_xt_recent() -> None:
    result = trace(CLIENT, "10.96.0.12", 80, source=ipt())
    (o,) = result.outcomes
    assert o.dnat == dumps.IPTABLES_AFFINITY_ENDPOINT and o.probability == 1.0
    assert any("last seen" in n for s in o.steps for n in s.notes)
    # Another client has no entry: the ladder decides.
    other = trace(DENIED, "10.96.0.12", 80, source=ipt())
    assert len(other.outcomes) == 2 and len(other.destinations()) == 2
    # The entry is old once --seconds 60 have passed.
    jiffies, hz = parse_timer_list(dumps.IPTABLES_TIMER_LIST) or (0, 1)
    later = dumps.IPTABLES_TIMER_LIST.replace(
        f"jiffies: {jiffies}", f"jiffies: {jiffies + 61 * hz}"
    )
    expired = trace(CLIENT, "10.96.0.12", 80, source=ipt(timer_list=later))
    assert len(expired.destinations()) == 2
    assert all(any("(expired, > 60 s)" in n for n in o.notes) for o in expired.outcomes)


def test_iptables_trace_without_recent_lists_forks_on_the_condition() -> None:
    result = trace(CLIENT, "10.96.0.12", 80, source=ipt(recent=None))
    conditioned = [o for o in result.outcomes if any("has affinity to" in c for c in o.conditions)]
    assert len(conditioned) == 2 and len(result.outcomes) == 4
    assert "if 10.100.0.2 has affinity to 10.244.0.2:8080" in result.text()
    assert "otherwise: DNAT to one of" in result.text()


def test_iptables_trace_external_local_policy_keeps_the_source() -> None:
    from_client = trace(CLIENT, NODE_IP, 30082, source=ipt())
    (o,) = from_client.outcomes
    assert o.dnat == "10.244.0.2:8080" and o.masquerade is False
    # From the node itself the Local policy short-circuits to every endpoint, masqueraded.
    from_node = trace(NODE_IP, NODE_IP, 30082, source=ipt())
    assert from_node.packet.from_node and from_node.outcomes[0].steps[0].chain == "OUTPUT"
    assert from_node.destinations() == {"10.244.0.2:8080", "10.244.0.3:8080"}
    assert all(o.masquerade for o in from_node.outcomes)


def test_iptables_trace_of_other_destinations_is_not_dnated() -> None:
    (o,) = trace(CLIENT, "8.8.8.8", 53, "udp", source=ipt()).outcomes
    assert o.verdict == "ACCEPT" and o.dnat is None and "not DNATed" in o.reason
    assert o.masquerade is False


def test_iptables_trace_says_which_matches_it_cannot_evaluate() -> None:
    save = dumps.IPTABLES_SAVE.replace(
        '[10:600] -A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
        "[0:0] -A PREROUTING -m physdev --physdev-is-in -j ACCEPT\n"
        '[10:600] -A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
    )
    assert save != dumps.IPTABLES_SAVE
    (o,) = trace(CLIENT, "10.96.0.11", 80, source=ipt(iptables={"nft": save})).outcomes
    (step,) = [s for s in o.steps if s.chain == "PREROUTING"]
    assert step.notes == ("cannot evaluate -m physdev --physdev-is-in; assuming it may match",)
    assert o.verdict == "ACCEPT" and o.dnat is None  # assumed to match: the ACCEPT wins


def test_trace_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="protocol"):
        trace(CLIENT, "10.96.0.10", 80, "icmp", source=ipt())
    with pytest.raises(ValueError, match="port"):
        trace(CLIENT, "10.96.0.10", 70000, source=ipt())


# --- trace: nftables ---------------------------------------------------------------------------


def test_nftables_trace_walks_the_maps_and_the_numgen_vmap() -> None:
    result = trace(CLIENT, "10.96.0.10", 80, source=nft())
    outcomes = result.outcomes
    assert len(outcomes) == 3 and result.destinations() == {f"{ip}:8080" for ip in PODS}
    assert [round(o.probability or 0, 3) for o in outcomes] == [0.333] * 3
    assert all(o.masquerade for o in outcomes)
    actions = [s.action for s in outcomes[0].steps]
    assert any(
        a.startswith("@service-ips: element 10.96.0.10 . tcp . 80 : goto service-") for a in actions
    )
    assert any(a.startswith("numgen = 0 (probability 1/3): goto endpoint-") for a in actions)
    chains = [s.chain for s in outcomes[0].steps]
    assert chains[:2] == ["filter-prerouting-pre-dnat", "firewall-check"]
    assert "nat-postrouting" in chains and "masquerading" in chains


def test_nftables_trace_reject_drop_and_local_policy() -> None:
    (rej,) = trace(CLIENT, "10.96.0.99", 80, source=nft()).outcomes
    assert rej.verdict == REJECT and rej.service == "default/empty:http"
    assert "service-endpoints-check" in rej.reason and "@no-endpoint-services" in rej.reason
    (drop,) = trace(DENIED, "10.99.1.10", 80, source=nft()).outcomes
    assert drop.verdict == DROP and "outside its loadBalancerSourceRanges" in drop.reason
    (loc,) = trace(CLIENT, NODE_IP, 30082, source=nft()).outcomes
    assert loc.dnat == "10.244.0.2:8080" and loc.masquerade is False


def test_nftables_trace_reads_the_affinity_set_elements() -> None:
    (o,) = trace(CLIENT, "10.96.0.12", 80, source=nft()).outcomes
    assert o.dnat == dumps.NFT_AFFINITY_ENDPOINT and o.probability == 1.0
    assert len(trace(DENIED, "10.96.0.12", 80, source=nft()).destinations()) == 2


def test_nftables_trace_text_and_json() -> None:
    result = trace(CLIENT, "10.96.0.11", 80, source=nft())
    text = result.text()
    assert text.startswith("kproxy trace: tcp 10.100.0.2 -> 10.96.0.11:80, a new connection")
    assert "kube-proxy services rule 1 (handle" in text
    assert "verdict (nftables): DNAT to 10.244.0.3:8080 [default/one:http], masqueraded" in text
    doc = json.loads(result.to_json())
    (dp,) = doc["dataplanes"]
    assert dp["outcomes"][0]["dnat"] == "10.244.0.3:8080" and dp["outcomes"][0]["steps"]


# --- the compact nftables layout (recorded from the same scenario) -----------------------------


def compact(**extra: object) -> RecordedSource:
    kwargs: dict[str, object] = {
        "dumps": {"nftables-compact": dumps.NFT_COMPACT_JSON},
        "ip_addr": dumps.IP_ADDR,
        "conntrack": dumps.NFT_COMPACT_CONNTRACK,
    }
    kwargs.update(extra)
    return RecordedSource(**kwargs)  # type: ignore[arg-type]


def test_compact_list_reads_endpoints_from_the_slot_maps() -> None:
    (dp,) = list_services(source=compact()).dataplanes
    assert (dp.dataplane, dp.mode, dp.live) == ("nftables-compact", "nftables", True)
    assert "table ip kproxy-compact" in dp.detail
    web = dp.server("tcp", "10.96.0.10", 80)
    assert web is not None and web.kind == "ClusterIP" and web.scheduler == "numgen"
    # the shared chain names no service: the map element's comment does
    assert web.chain == "dnat/internal/3" and web.service == "default/web:http"
    assert dp.service_names == list_services(source=nft()).dataplanes[0].service_names
    assert [rs.addr for rs in web.endpoints] == [f"{ip}:8080" for ip in PODS]
    assert [rs.chain for rs in web.endpoints] == [
        f"dnat/internal/3 @service-endpoints-tcp[{i}]" for i in range(3)
    ]
    assert [round(rs.share or 0, 3) for rs in web.endpoints] == [0.333] * 3
    assert sum(rs.inactive for rs in web.endpoints) == 6  # conntrack, as in upstream's layout
    # ClientIP affinity keeps upstream's per-service chains (named)
    aff = dp.server("tcp", "10.96.0.12", 80)
    assert aff is not None and aff.persistent == 60 and aff.service == "default/aff:http"
    lb = dp.server("tcp", "10.99.1.10", 80)
    assert lb is not None and lb.kind == "LoadBalancer" and lb.source_ranges == (CLIENT,)
    empty = dp.server("tcp", "10.96.0.99", 80)
    assert empty is not None and empty.verdict == REJECT and empty.service == "default/empty:http"
    # Local policy: outside traffic picks the local slots (after the cluster ones)
    loc = dp.server("tcp", NODE_IP, 30082)
    assert loc is not None and loc.kind == "NodePort" and loc.local_only
    assert [(rs.addr, rs.chain) for rs in loc.endpoints] == [
        ("10.244.0.2:8080", "dnat/nodeport-local/2/1 @nodeport-endpoints-tcp[2]")
    ]
    remote = dp.server("tcp", NODE_IP, 30083)
    assert remote is not None and remote.verdict == DROP and not remote.endpoints
    # UDP: the same shared chain, its UDP rule and map
    dns = dp.server("udp", "10.96.0.53", 53)
    assert dns is not None and dns.chain == "dnat/internal/2" and not dns.notes
    assert [(rs.addr, rs.chain) for rs in dns.endpoints] == [
        (f"{ip}:8080", f"dnat/internal/2 @service-endpoints-udp[{i}]")
        for i, ip in enumerate(PODS[:2])
    ]


def test_compact_destinations_are_the_upstream_layouts() -> None:
    from kproxy.ops.inspect.destinations import missing_destinations, programmed

    got = programmed(compact())
    assert list(got) == ["nftables-compact"]
    assert got["nftables-compact"] == programmed(nft())["nftables"]  # names included
    assert missing_destinations(snapshot(), got["nftables-compact"])[0] == []


def test_compact_trace_walks_the_shared_chain_and_the_slot_map() -> None:
    result = trace(CLIENT, "10.96.0.10", 80, source=compact())
    assert [d.dataplane for d in result.dataplanes] == ["nftables-compact"]
    outcomes = result.outcomes
    assert result.destinations() == {f"{ip}:8080" for ip in PODS}
    assert [round(o.probability or 0, 3) for o in outcomes] == [0.333] * 3
    assert all(o.masquerade for o in outcomes)
    steps = outcomes[1].steps
    actions = [s.action for s in steps]
    assert (
        "@service-ips: element 10.96.0.10 . tcp . 80 (default/web:http) : goto dnat/internal/3"
        in actions
    )
    (pick,) = [s for s in steps if s.chain == "dnat/internal/3" and "numgen" in s.action]
    assert pick.text.startswith("dnat to ip daddr . meta l4proto . tcp dport . numgen random mod 3")
    assert pick.action == (
        "numgen = 1 (probability 1/3): @service-endpoints-tcp element 10.96.0.10 . tcp . 80 . 1"
        " : DNAT to 10.244.0.3:8080"
    )
    # UDP passes the TCP rule (nft matches its protocol first) and takes the UDP one.
    udp = trace(CLIENT, "10.96.0.53", 53, proto="udp", source=compact()).outcomes
    assert {o.dnat for o in udp} == {f"{ip}:8080" for ip in PODS[:2]}
    assert [round(o.probability or 0, 3) for o in udp] == [0.5] * 2
    (pick,) = [s for s in udp[0].steps if s.chain == "dnat/internal/2" and "numgen" in s.action]
    assert "@service-endpoints-udp element 10.96.0.53 . udp . 53 . 0" in pick.action
    assert not pick.notes
    assert "only table ip kproxy-compact is evaluated" in result.text()
    (loc,) = trace(CLIENT, NODE_IP, 30082, source=compact()).outcomes
    assert loc.dnat == "10.244.0.2:8080" and loc.masquerade is False
    (rej,) = trace(CLIENT, "10.96.0.99", 80, source=compact()).outcomes
    assert rej.verdict == REJECT and rej.service == "default/empty:http"
    assert {o.service for o in outcomes} == {"default/web:http"}
    (o,) = trace(CLIENT, "10.96.0.12", 80, source=compact()).outcomes
    assert o.dnat == dumps.NFT_COMPACT_AFFINITY_ENDPOINT


def test_a_switch_between_the_layouts_is_mid_switch() -> None:
    both_layouts = compact(nft=dumps.NFT_JSON)
    result = list_services(source=both_layouts)
    assert [d.dataplane for d in result.dataplanes] == ["nftables", "nftables-compact"]
    assert result.mid_switch
    only = list_services(source=compact(nft=dumps.NFT_JSON), mode="nftables-compact")
    assert [d.dataplane for d in only.dataplanes] == ["nftables-compact"]


# --- drift -------------------------------------------------------------------------------------


@both
def test_no_drift_when_the_kernel_programs_the_snapshot(mode: str) -> None:
    result = list_services(source=SOURCES[mode](), snapshot=snapshot())
    assert result.drift == [], result.drift
    assert "drift: none" in result.text()
    traced = trace(CLIENT, "10.96.0.10", 80, source=SOURCES[mode](), snapshot=snapshot())
    assert traced.drift == []


@both
def test_drift_names_what_the_kernel_and_the_snapshot_disagree_on(mode: str) -> None:
    objects = [
        o
        for o in scenario_objects()
        if o["metadata"]["name"] not in ("one", "web-1")  # type: ignore[index]
    ]
    objects += [
        endpoint_slice("web", [endpoint("10.244.0.9"), endpoint(PODS[0])], SLICE),
        service("api", "10.96.0.30", HTTP),
        endpoint_slice("api", [endpoint(PODS[0])], SLICE),
    ]
    found = list_services(source=SOURCES[mode](), snapshot=snapshot(objects)).drift
    assert "service default/api:http is in the snapshot but not in the kernel" in found
    assert (
        "the kernel DNATs 10.96.0.10:80 to 10.244.0.3:8080, which is not an endpoint of "
        "default/web:http"
    ) in found
    assert (
        "default/web:http endpoint 10.244.0.9:8080 is in the snapshot but the kernel does not "
        "DNAT 10.96.0.10:80 to it"
    ) in found
    assert any(
        f.startswith("the kernel programs tcp 10.96.0.11:80 for default/one:http") for f in found
    )
    traced = trace(CLIENT, "10.96.0.10", 80, source=SOURCES[mode](), snapshot=snapshot(objects))
    assert (
        "the kernel DNATs 10.96.0.10:80 to 10.244.0.4:8080, which is not an endpoint of "
        "default/web:http"
    ) in traced.drift
    assert "drift: the kernel and the snapshot disagree" in traced.text()


def test_drift_for_refused_services() -> None:
    # The snapshot gives default/empty an endpoint the kernel does not know about yet.
    objects = [*scenario_objects(), endpoint_slice("empty", [endpoint(PODS[0])], SLICE)]
    found = list_services(source=ipt(), snapshot=snapshot(objects)).drift
    assert any(f.startswith("the kernel REJECTs new connections to 10.96.0.99:80") for f in found)
    traced = trace(CLIENT, "10.96.0.99", 80, source=ipt(), snapshot=snapshot(objects))
    assert traced.drift and "the kernel does not DNAT this connection" in traced.drift[0]


# --- rules rendered by kproxy itself (restore-input order, exact probabilities) ----------------


def _as_save(restore: str) -> str:
    """kproxy's restore input plus the built-in chains and jump rules: a save-like dump."""
    out: list[str] = []
    builtin = {
        "filter": ("INPUT", "FORWARD", "OUTPUT"),
        "nat": ("PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"),
    }
    for line in restore.splitlines():
        out.append(line)
        if line.startswith("*"):
            table = line[1:]
            out += [f":{c} ACCEPT [0:0]" for c in builtin[table]]
            out += [f"-A {jump_rule(c, e, m, t)}" for tb, c, e, m, t in JUMPS if tb == table]
    return "\n".join(out) + "\n"


def test_rendered_rules_of_a_four_endpoint_service() -> None:
    pods = [f"10.244.1.{i}" for i in range(1, 5)]
    objects = [
        service(
            "big",
            "10.96.1.1",
            [port("http", 80, "http", nodePort=30090)],
            externalTrafficPolicy="Local",
            type="NodePort",
        ),
        endpoint_slice("big", [endpoint(ip) for ip in pods], SLICE),
    ]
    snap = snapshot_from_objects(objects, "node1")
    facts = NodeFacts(node_ips=(NODE_IP,), local_addresses=(NODE_IP, "127.0.0.1"))
    options = RuleOptions(cluster_cidrs=("10.244.0.0/16",))
    save = _as_save(render_full(snap, facts, options))
    src = RecordedSource(iptables={"legacy": save}, local_addresses=[NODE_IP, "127.0.0.1"])
    (dp,) = list_services(source=src).dataplanes
    big = dp.server("tcp", "10.96.1.1", 80)
    assert big is not None and [rs.share for rs in big.endpoints] == pytest.approx([0.25] * 4)
    nodeport = next(vs for vs in dp.servers if vs.kind == "NodePort")
    assert nodeport.address == ANY_ADDRESS and nodeport.local_only and len(nodeport.endpoints) == 4
    assert list_services(source=src, snapshot=snap).drift == []
    result = trace(CLIENT, "10.96.1.1", 80, source=src)
    assert [o.probability for o in result.outcomes] == pytest.approx([0.25] * 4)
    # localhost NodePorts (iptables mode's default) go through nat OUTPUT.
    local = trace("127.0.0.1", "127.0.0.1", nodeport.port, source=src)
    assert local.packet.from_node and local.destinations() == {f"{ip}:8080" for ip in pods}


def test_rendered_rules_without_comments_in_large_cluster_mode() -> None:
    pods = [f"10.245.{i // 250}.{i % 250 + 1}" for i in range(1001)]
    objects = [
        service("huge", "10.96.2.1", HTTP),
        endpoint_slice("huge", [endpoint(ip) for ip in pods], SLICE),
    ]
    snap = snapshot_from_objects(objects, "node1")
    save = _as_save(render_full(snap, NodeFacts(node_ips=(NODE_IP,)), RuleOptions()))
    src = RecordedSource(iptables={"nft": save}, local_addresses=[NODE_IP])
    (dp,) = list_services(source=src).dataplanes
    (huge,) = dp.servers
    assert huge.service == "default/huge:http" and len(huge.endpoints) == 1001
    assert sum(rs.share or 0 for rs in huge.endpoints) == pytest.approx(1.0)
    assert list_services(source=src, snapshot=snap).drift == []


def test_a_missing_chain_is_reported_not_fatal() -> None:
    # Drift of the worst kind: KUBE-SERVICES jumps to a chain that is gone.
    save = "\n".join(
        line
        for line in dumps.IPTABLES_SAVE.splitlines()
        if "KUBE-SVC-4MCPEXSLZTSPBPTK" not in line
        or line.startswith("[1:60] -A KUBE-SERVICES")
        or "-A KUBE-SERVICES" in line
    )
    src = RecordedSource(iptables={"nft": save}, local_addresses=[NODE_IP])
    one = list_services(source=src).dataplanes[0].server("tcp", "10.96.0.11", 80)
    assert one is not None and not one.endpoints
    assert one.notes == ["KUBE-SVC-4MCPEXSLZTSPBPTK does not exist in nat (the jump to it fails)"]
    (o,) = trace(CLIENT, "10.96.0.11", 80, source=src).outcomes
    assert o.verdict == "ACCEPT" and o.dnat is None
    assert any("cannot evaluate target KUBE-SVC-4MCPEXSLZTSPBPTK" in n for n in o.notes)
