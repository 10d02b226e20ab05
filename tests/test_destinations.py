"""Service destinations (ops.inspect.destinations): what the switch's check, preflight and
`kproxy diff` read, on the recorded dumps of tests/support/inspect_dumps.py. They come from
the same entries `kproxy list` shows, so both agree by construction; these tests hold them
to it."""

from __future__ import annotations

import json
import shlex

import pytest

from kproxy.dataplane.ipvs import render
from kproxy.dataplane.ipvs.plan import VSKey
from kproxy.dataplane.nftables.names import endpoint_base, service_base, service_port_of
from kproxy.model.objects import Protocol, ServicePortName
from kproxy.ops.inspect import RecordedSource, list_services
from kproxy.ops.inspect.destinations import programmed
from kproxy.ops.inspect.iptables_rules import parse_chains, parse_save, split_words
from kproxy.ops.inspect.ipvs import parse_ipvsadm_save
from kproxy.ops.inspect.model import NODE_PORT, Destination
from kproxy.ops.inspect.nftables_reader import SERVICE_IPS, parse_set, parse_table
from kproxy.ops.snapshot import FORMAT, diff, recorded_source
from tests.support import inspect_dumps as dumps

# What tests/support/scenario.py programs: ClusterIPs, an externalIP and an LB IP.
SCENARIO = {
    "tcp 10.96.0.10:80": "default/web:http",
    "tcp 10.96.0.11:80": "default/one:http",
    "tcp 10.96.0.12:80": "default/aff:http",
    "tcp 10.96.0.13:80": "default/loc:http",
    "tcp 10.96.0.14:80": "default/remote:http",
    "tcp 10.96.0.21:80": "default/lb:http",
    "udp 10.96.0.53:53": "default/dns:dns",
    "tcp 10.99.0.10:80": "default/web:http",
    "tcp 10.99.1.10:80": "default/lb:http",
}


def section(output: str, ok: bool = True) -> dict[str, object]:
    return {"command": "x", "ok": ok, "output": output, "error": ""}


def document(**sections: str) -> dict[str, object]:
    """A kproxy-snapshot/v1 document with these sections' outputs (the others empty)."""
    doc: dict[str, object] = {"format": "kproxy-snapshot/v1", "taken_at": 0.0, "netns": None}
    for name in ("iptables-nft", "iptables-legacy", "nftables", "ipset", "ipvs", "kube-ipvs0"):
        doc[name] = section(sections.get(name.replace("-", "_"), ""))
    doc["conntrack"] = {"count": 3, "max": 262144}
    return doc


def listed(source: RecordedSource) -> dict[str, dict[str, str]]:
    """What `kproxy list` shows as dispatched service destinations, per dataplane."""
    return {
        dp.dataplane: {
            str(Destination(vs.address, vs.proto, vs.port)): vs.service
            for vs in dp.servers
            if vs.kind != NODE_PORT and vs.verdict is None
        }
        for dp in list_services(source=source).dataplanes
    }


def named(found: dict[Destination, str]) -> dict[str, str]:
    return {str(k): v for k, v in found.items()}


@pytest.mark.parametrize(
    ("dataplane", "doc"),
    [
        # iptables-save -c: every rule starts with its counters ("[0:0] -A KUBE-SERVICES …"),
        # which the regular expressions the switch used to check with never matched (they
        # found no destination here while `kproxy list` showed nine).
        ("iptables-nft", document(iptables_nft=dumps.IPTABLES_SAVE)),
        ("nftables", document(nftables=dumps.NFT_JSON)),
    ],
)
def test_a_recorded_document_programs_what_list_shows(dataplane: str, doc: dict) -> None:
    found = programmed(recorded_source(doc))
    assert list(found) == [dataplane]
    assert named(found[dataplane]) == SCENARIO
    assert listed(recorded_source(doc)) == {dataplane: SCENARIO}


def test_nft_map_elements_with_comments_are_destinations() -> None:
    """nft -j writes an element with a comment as {"elem": {"val": …, "comment": …}}."""
    service_ips = {
        "family": "ip",
        "table": "kube-proxy",
        "name": SERVICE_IPS,
        "map": "verdict",
        "elem": [
            [
                {"elem": {"val": {"concat": ["10.96.0.10", "tcp", 80]}, "comment": "web"}},
                {"goto": {"target": "service-ULMVA6XW-default/web/tcp/http"}},
            ]
        ],
    }
    text = json.dumps({"nftables": [{"metainfo": {}}, {"map": service_ips}]})
    found = programmed(RecordedSource(nft=text))
    assert named(found["nftables"]) == {"tcp 10.96.0.10:80": "default/web:http"}


def test_one_map_is_decoded_alone_and_as_the_whole_table_has_it() -> None:
    whole = parse_table(dumps.NFT_JSON)
    assert whole is not None
    alone = parse_set(dumps.NFT_JSON, SERVICE_IPS)
    assert alone == whole.sets[SERVICE_IPS] and len(alone.elements) == 9
    assert parse_set(dumps.NFT_JSON, "no-such-map") is None
    assert parse_set(dumps.NFT_JSON, SERVICE_IPS, family="ip6") is None
    # `nft -j list map` prints no table object: the map alone is enough.
    items = json.loads(dumps.NFT_JSON)["nftables"]
    only = [i for i in items if i.get("map", {}).get("name") == SERVICE_IPS]
    assert parse_set(json.dumps({"nftables": only}), SERVICE_IPS) == alone


def test_chain_names_decode_to_the_service_port_they_encode() -> None:
    name = ServicePortName("kube-system", "dns", "dns-tcp", Protocol.TCP)
    assert service_port_of(f"service-{service_base(name)}") == "kube-system/dns:dns-tcp"
    assert service_port_of(f"external-{service_base(name)}") == "kube-system/dns:dns-tcp"
    ep = f"endpoint-{endpoint_base(name, '10.244.0.2', 53)}"
    assert service_port_of(ep) == "kube-system/dns:dns-tcp"
    unnamed = ServicePortName("default", "web", "", Protocol.TCP)
    assert service_port_of(f"local-{service_base(unnamed)}") == "default/web"
    assert service_port_of("services") == "" and service_port_of("reject-chain") == ""


IPVS_SAVE = render.ipvsadm_save(
    {
        VSKey("TCP", "10.96.0.10", 80): ("rr", 0, 0),
        VSKey("UDP", "10.96.0.53", 53): ("rr", 1, 10800),
        VSKey("TCP", "10.100.0.1", 30080): ("rr", 0, 0),
    },
    {
        VSKey("TCP", "10.96.0.10", 80): [
            render.RenderedDest("10.244.0.2", 8080),
            render.RenderedDest("10.244.0.3", 8080, weight=0),
        ]
    },
)


def test_ipvsadm_save_reads_back_what_render_writes() -> None:
    services = {str(s.key): s for s in parse_ipvsadm_save(IPVS_SAVE)}
    assert list(services) == ["TCP 10.96.0.10:80", "UDP 10.96.0.53:53", "TCP 10.100.0.1:30080"]
    web, dns = services["TCP 10.96.0.10:80"], services["UDP 10.96.0.53:53"]
    assert [(d.ip, d.port, d.weight, d.forward) for d in web.dests] == [
        ("10.244.0.2", 8080, 1, "Masq"),
        ("10.244.0.3", 8080, 0, "Masq"),
    ]
    assert (dns.scheduler, dns.flags, dns.timeout, dns.dests) == ("rr", 1, 10800, [])


def test_a_recorded_ipvs_document_is_listed_and_its_virtual_servers_programmed() -> None:
    dummy = '[{"ifname": "kube-ipvs0", "addr_info": [{"local": "10.96.0.10"}]}]'
    doc = document(ipvs=IPVS_SAVE, kube_ipvs0=dummy)
    # IPVS names no service and (without the ipsets) tells no NodePort apart: every
    # virtual server, unnamed, as before.
    assert named(programmed(recorded_source(doc))["ipvs"]) == {
        "tcp 10.96.0.10:80": "",
        "udp 10.96.0.53:53": "",
        "tcp 10.100.0.1:30080": "",
    }
    (dp,) = list_services(source=recorded_source(doc)).dataplanes
    assert dp.dataplane == "ipvs" and dp.live
    assert {vs.key for vs in dp.servers} == {
        ("tcp", "10.96.0.10", 80),
        ("udp", "10.96.0.53", 53),
        ("tcp", "10.100.0.1", 30080),
    }


def test_diff_of_two_v1_documents_across_a_switch() -> None:
    before = json.loads(json.dumps(document(iptables_nft=dumps.IPTABLES_SAVE)))
    after = json.loads(json.dumps(document(nftables=dumps.NFT_JSON)))
    assert before["format"] == after["format"] == FORMAT
    assert diff(before, after) == [
        "A programs 9 service destinations (iptables-nft); B programs 9 (nftables)",
        "conntrack entries: 3 -> 3 (max 262144)",
    ]
    lines = diff(after, document())
    assert lines[0] == "A programs 9 service destinations (nftables); B programs 0 (no dataplane)"
    assert "missing in B: tcp 10.99.0.10:80 (default/web:http), present in A's nftables" in lines
    assert sum(line.startswith("missing in B: ") for line in lines) == 9
    extra = diff(document(), before)
    assert "extra in B: udp 10.96.0.53:53 (default/dns:dns) in B's iptables-nft, absent from A" in (
        extra
    )


def test_a_document_is_read_section_by_section_as_the_readers_ask() -> None:
    asked: list[str] = []

    class Sections(dict):  # type: ignore[type-arg]
        def get(self, key: str, default: object = None) -> object:
            asked.append(key)
            return super().get(key, default)

    doc = Sections(document(nftables=dumps.NFT_JSON))
    found = programmed(recorded_source(doc), ["nftables"])
    assert list(found) == ["nftables"] and asked == ["nftables"]


@pytest.mark.parametrize("save", [dumps.IPTABLES_SAVE, dumps.IPTABLES_SAVE.replace("[0:0] ", "")])
def test_some_chains_found_alone_are_the_chains_of_the_whole_save(save: str) -> None:
    whole = parse_save(save)
    for table in ("nat", "filter"):
        names = whole[table].chain_names
        alone = parse_chains(save, table, [*names, "NO-SUCH-CHAIN"])
        assert alone.policies == whole[table].policies
        assert {c: alone.raw.get(c, []) for c in names} == whole[table].raw
        assert "NO-SUCH-CHAIN" not in alone.raw
    assert not parse_chains(save, "mangle", ["PREROUTING"]).raw


def test_a_rule_with_one_quoted_argument_splits_as_shlex_does() -> None:
    lines = [ln.split("] ", 1)[-1] for ln in dumps.IPTABLES_SAVE.splitlines() if "-A " in ln]
    quoted = [ln for ln in lines if ln.count('"') == 2]
    assert quoted
    for line in [*quoted, '-A X -m comment --comment "" -j Y', '-A X -m comment --comment "a b"']:
        assert split_words(line) == shlex.split(line), line
