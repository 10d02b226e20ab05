"""nf_tables element messages: what set_elements encodes decodes back to the same elements,
for every shape a sync writes (sets, data maps, verdict maps, comments, deletes)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kproxy.dataplane.nftables.netlink import decode_elements, set_elements

DNAT_KEY = "ipv4_addr . inet_proto . inet_service . numgen"
DNAT_DATA = "ipv4_addr . inet_service"

octet = st.integers(0, 255)
ipv4 = st.tuples(octet, octet, octet, octet).map(lambda t: ".".join(map(str, t)))
ports = st.integers(1, 65535)
comments = st.none() | st.text("abcdefghijklmnopqrstuvwxyz0123456789/-:", max_size=40)


@st.composite
def dnat_elements(draw: st.DrawFn) -> list[tuple[str, str, str | None]]:
    count = draw(st.integers(1, 30))
    out = {}
    for _ in range(count):
        key = f"{draw(ipv4)} . {draw(st.sampled_from(['tcp', 'udp', 'sctp']))} . {draw(ports)}"
        key += f" . {draw(st.integers(0, 63))}"
        out[key] = (key, f"{draw(ipv4)} . {draw(ports)}", draw(comments))
    return list(out.values())


@settings(max_examples=40)
@given(dnat_elements())
def test_data_map_elements_decode_to_what_was_encoded(elements: list) -> None:
    op = set_elements(
        "kproxy-compact",
        "service-endpoints-tcp",
        DNAT_KEY,
        elements,
        delete=False,
        data_type=DNAT_DATA,
    )
    assert list(decode_elements(op.payload, DNAT_KEY, DNAT_DATA)) == elements


@settings(max_examples=40)
@given(dnat_elements())
def test_deletes_carry_only_the_keys(elements: list) -> None:
    op = set_elements(
        "kproxy-compact",
        "service-endpoints-tcp",
        DNAT_KEY,
        elements,
        delete=True,
        data_type=DNAT_DATA,
    )
    assert list(decode_elements(op.payload, DNAT_KEY, DNAT_DATA)) == [
        (key, "", None) for key, _, _ in elements
    ]


@settings(max_examples=40)
@given(st.lists(st.tuples(ipv4, ipv4), min_size=1, max_size=20, unique=True))
def test_set_elements_decode_to_their_keys(pairs: list[tuple[str, str]]) -> None:
    elements = [(f"{a} . {b}", "", None) for a, b in pairs]
    op = set_elements("t", "hairpin", "ipv4_addr . ipv4_addr", elements, delete=False)
    assert list(decode_elements(op.payload, "ipv4_addr . ipv4_addr", None)) == elements


def test_verdict_map_elements_keep_their_chain_and_comment() -> None:
    key_type = "ipv4_addr . inet_proto . inet_service"
    elements = [
        ("10.96.0.10 . tcp . 80", "goto shared/internal/3", "default/web:http"),
        ("10.96.0.11 . udp . 53", "goto shared/internal/1", None),
        ("10.96.0.12 . sctp . 9", "drop", None),
    ]
    op = set_elements("t", "service-ips", key_type, elements, delete=False)
    assert list(decode_elements(op.payload, key_type, None)) == elements
