"""kproxy.conntrack: parsing and planning with a fake runner, then real flows through DNAT
rules in throwaway namespaces (client -- veth -- node -- veth -- pod A; endpoint B absent)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest

from kproxy.conntrack import (
    Conntrack,
    ConntrackEntry,
    ConntrackError,
    DeleteFilter,
    cleanup_stale_udp,
    delete_unreplied_syn,
    parse_entries,
    parse_entry,
    stale_udp_filters,
)
from kproxy.dataplane.iptables.backend import IptablesBackend
from kproxy.host.commands import run_command

kernel = pytest.mark.kernel
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces")

# --------------------------------------------------------------------------------- parsing

DEFAULT = (
    "udp      17 29 src=10.100.0.2 dst=10.96.0.10 sport=40001 dport=53 [UNREPLIED] "
    "src=10.244.0.2 dst=10.100.0.2 sport=5353 dport=40001 mark=0 use=1"
)
EXTENDED_TCP = (
    "ipv4     2 tcp      6 431999 ESTABLISHED src=10.100.0.2 dst=10.96.0.11 "
    "sport=48602 dport=80 packets=3 bytes=164 src=10.244.0.2 dst=10.100.0.2 "
    "sport=8080 dport=48602 packets=2 bytes=112 [ASSURED] mark=0 zone=3 use=1"
)
ICMP = (
    "icmp     1 29 src=10.100.0.2 dst=10.96.0.10 type=8 code=0 id=7 src=10.244.0.2 "
    "dst=10.100.0.2 type=0 code=0 id=7 mark=0 use=1"
)


def test_parse_default_line() -> None:
    entry = parse_entry(DEFAULT)
    assert entry == ConntrackEntry(
        proto="udp",
        orig_src="10.100.0.2",
        orig_dst="10.96.0.10",
        orig_sport=40001,
        orig_dport=53,
        reply_src="10.244.0.2",
        reply_dst="10.100.0.2",
        reply_sport=5353,
        reply_dport=40001,
        timeout=29,
        state=None,
        flags=frozenset({"UNREPLIED"}),
        family="ipv4",
        mark=0,
        zone=None,
    )
    assert entry.unreplied and not entry.assured


def test_parse_extended_with_accounting_and_state() -> None:
    entry = parse_entry(EXTENDED_TCP)
    assert entry is not None
    assert (entry.proto, entry.state, entry.timeout) == ("tcp", "ESTABLISHED", 431999)
    assert (entry.orig_dport, entry.reply_src, entry.reply_sport) == (80, "10.244.0.2", 8080)
    assert entry.assured and not entry.unreplied
    assert (entry.zone, entry.mark) == (3, 0)


def test_parse_portless_and_junk() -> None:
    entry = parse_entry(ICMP)
    assert entry is not None and entry.orig_dport is None and entry.reply_src == "10.244.0.2"
    text = "\n".join([DEFAULT, "conntrack v1.4.7 (conntrack-tools): 1 flow entries", "", ICMP])
    assert len(parse_entries(text)) == 2
    assert parse_entry("udp 17 29 src=1.2.3.4") is None


def entry(
    dst: str, dport: int, reply_src: str, proto: str = "udp", sport: int = 40000
) -> ConntrackEntry:
    return ConntrackEntry(
        proto, "10.100.0.2", dst, sport, dport, reply_src, "10.100.0.2", 5353, sport
    )


def test_stale_udp_filters_like_upstream() -> None:
    entries = [
        entry("10.96.0.10", 53, "10.244.0.2", sport=1),  # endpoint gone -> stale
        entry("10.96.0.10", 53, "10.244.0.2", sport=2),  # same group, one filter
        entry("10.96.0.10", 53, "10.244.0.3"),  # still serving
        entry("10.96.0.10", 5300, "10.244.0.2"),  # another port: not ours to judge
        entry("10.96.0.20", 53, "10.244.0.2"),  # unknown service IP
        entry("10.96.0.10", 53, "10.244.0.2", proto="tcp"),  # never TCP
        entry("10.100.0.1", 30053, "10.244.0.9"),  # NodePort, endpoint gone
        entry("10.100.0.1", 30054, "10.244.0.3"),  # NodePort still served
    ]
    filters = stale_udp_filters(
        entries,
        {("10.96.0.10", 53): {"10.244.0.3"}},
        {30053: {"10.244.0.3"}, 30054: {"10.244.0.3"}},
    )
    assert filters == [
        DeleteFilter("udp", orig_dport=30053, reply_src="10.244.0.9"),
        DeleteFilter("udp", orig_dst="10.96.0.10", orig_dport=53, reply_src="10.244.0.2"),
    ]
    # a service without serving endpoints: every flow to it is stale
    assert len(stale_udp_filters(entries, {("10.96.0.10", 53): set()}, {})) == 2


def test_delete_filter_args_and_refusals() -> None:
    flt = DeleteFilter("udp", orig_dst="10.96.0.10", orig_dport=53, reply_src="10.244.0.2")
    assert flt.args() == [
        "-D",
        "-f",
        "ipv4",
        "-p",
        "udp",
        "--orig-dst",
        "10.96.0.10",
        "--orig-port-dst",
        "53",
        "--reply-src",
        "10.244.0.2",
    ]
    with pytest.raises(ConntrackError, match="unselective"):
        DeleteFilter("udp").args()
    with pytest.raises(ConntrackError, match="unselective"):
        DeleteFilter("tcp", state="SYN_SENT").args()
    with pytest.raises(ConntrackError, match="port protocol"):
        DeleteFilter("icmp", orig_dst="10.0.0.1", orig_dport=1).args()


class FakeRunner:
    def __init__(self, answers: dict[str, tuple[int, str, str]]) -> None:
        self.answers = answers
        self.calls: list[tuple[list[str], str | None]] = []

    def __call__(
        self, argv: Sequence[str], input_data: str | None
    ) -> subprocess.CompletedProcess[str]:
        argv = list(argv)
        self.calls.append((argv, input_data))
        for word, (rc, out, err) in self.answers.items():
            if word in argv:
                return subprocess.CompletedProcess(argv, rc, out, err)
        return subprocess.CompletedProcess(argv, 0, "", "")


def test_delete_many_is_one_batch_in_the_namespace() -> None:
    fake = FakeRunner({"-R": (0, DEFAULT + "\n" + DEFAULT + "\n", "")})
    filters = [
        DeleteFilter("udp", orig_dst="10.96.0.10", orig_dport=53, reply_src="10.244.0.2"),
        DeleteFilter("udp", orig_dport=30053, reply_src="10.244.0.9"),
    ]
    assert Conntrack("ns1", runner=fake).delete_many(filters) == 2
    [(argv, batch)] = fake.calls
    assert argv == ["ip", "netns", "exec", "ns1", "conntrack", "-R", "-"]
    assert batch == (
        "-D -f ipv4 -p udp --orig-dst 10.96.0.10 --orig-port-dst 53 --reply-src "
        "10.244.0.2\n-D -f ipv4 -p udp --orig-port-dst 30053 --reply-src 10.244.0.9\n"
    )


def test_delete_many_falls_back_to_single_deletes() -> None:
    fake = FakeRunner(
        {
            "-R": (2, "", "conntrack: invalid option -- 'R'"),
            "10.244.0.9": (0, DEFAULT + "\n", "1 flow entries have been deleted.\n"),
            "10.244.0.2": (1, "", "0 flow entries have been deleted.\n"),
        }
    )
    filters = [
        DeleteFilter("udp", orig_dst="10.96.0.10", reply_src="10.244.0.2"),
        DeleteFilter("udp", orig_dport=30053, reply_src="10.244.0.9"),
    ]
    assert Conntrack(runner=fake).delete_many(filters) == 1
    assert len(fake.calls) == 3
    assert Conntrack(runner=fake).delete_many([]) == 0


def test_delete_errors_are_raised() -> None:
    fake = FakeRunner({"-D": (1, "", "Operation not permitted\n")})
    with pytest.raises(ConntrackError, match="Operation not permitted"):
        Conntrack(runner=fake).delete(orig_dst="10.96.0.10")
    fake = FakeRunner({"-C": (0, "17\n", ""), "cat": (0, "262144\n", "")})
    assert Conntrack(runner=fake).count() == 17
    assert Conntrack(runner=fake).max() == 262144


def test_cleanup_without_services_does_nothing() -> None:
    fake = FakeRunner({})
    assert cleanup_stale_udp({}, {}, conntrack=Conntrack(runner=fake)) == 0
    assert fake.calls == []


# ---------------------------------------------------------------------------- kernel tests

VIP, VIP2, NODE_IP = "10.96.0.10", "10.96.0.20", "10.100.0.1"
POD_A, POD_B = "10.244.0.2", "10.244.0.3"  # B has no namespace: its flows stay unreplied
RULES = f"""\
*nat
:KPX-TEST - [0:0]
-A PREROUTING -j KPX-TEST
-A KPX-TEST -d {VIP}/32 -p udp -m udp --dport 53 -j DNAT --to-destination {POD_A}:5353
-A KPX-TEST -d {VIP}/32 -p udp -m udp --dport 5300 -j DNAT --to-destination {POD_A}:5353
-A KPX-TEST -d {VIP2}/32 -p udp -m udp --dport 53 -j DNAT --to-destination {POD_A}:5353
-A KPX-TEST -d {NODE_IP}/32 -p udp -m udp --dport 30053 -j DNAT --to-destination {POD_B}:5353
-A KPX-TEST -d 10.96.0.11/32 -p tcp -m tcp --dport 80 -j DNAT --to-destination {POD_A}:8080
-A KPX-TEST -d 10.96.0.11/32 -p tcp -m tcp --dport 81 -j DNAT --to-destination {POD_B}:8080
COMMIT
"""
# Pod A: UDP echo on 5353 and a TCP listener on 8080 that holds connections open.
SERVER = """
import select, socket, sys
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(("0.0.0.0", 5353))
t = socket.socket(); t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
t.bind(("0.0.0.0", 8080)); t.listen(16)
held = []
print("ready", flush=True)
while True:
    for s in select.select([u, t], [], [])[0]:
        if s is u:
            data, peer = u.recvfrom(2048); u.sendto(data, peer)
        else:
            held.append(t.accept()[0])
"""
UDP_CLIENT = """
import socket, sys
dst, port, wait = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
for sport in range(int(sys.argv[4]), int(sys.argv[5]) + 1):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("0.0.0.0", sport))
    s.sendto(b"ping", (dst, port))
    if wait:
        s.settimeout(3); s.recvfrom(100)
    s.close()
"""
TCP_HOLD = """
import socket, sys
s = socket.create_connection(("10.96.0.11", 80), timeout=3); s.sendall(b"hi")
print("connected", s.getsockname()[1], flush=True)
sys.stdin.read()
"""
SYN_ONLY = """
import socket
s = socket.socket(); s.setblocking(False)
try:
    s.connect(("10.96.0.11", 81))
except BlockingIOError:
    pass
"""


def sh(*argv: str) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, f"{argv}: {proc.stderr}"
    return proc.stdout


@dataclass
class Topo:
    client: str
    node: str
    pod: str

    def py(self, ns: str, script: str, *args: str) -> None:
        sh("ip", "netns", "exec", ns, sys.executable, "-c", script, *args)

    def udp(
        self, dst: str, port: int, first: int, last: int | None = None, wait: bool = False
    ) -> None:
        self.py(
            self.client,
            UDP_CLIENT,
            dst,
            str(port),
            "1" if wait else "0",
            str(first),
            str(last if last is not None else first),
        )

    def flows(self, proto: str | None = "udp") -> list[ConntrackEntry]:
        return Conntrack(self.node).list_entries(proto)


@pytest.fixture
def topo() -> Iterator[Topo]:
    tag = uuid.uuid4().hex[:8]
    names = [f"kpxc-{tag}", f"kpxn-{tag}", f"kpxp-{tag}"]
    created: list[str] = []
    server: subprocess.Popen[str] | None = None
    try:
        for name in names:
            sh("ip", "netns", "add", name)
            created.append(name)
            sh("ip", "-n", name, "link", "set", "lo", "up")
        c, n, p = names
        # Each veth is created inside the node namespace with its peer moved straight into
        # the other namespace, so nothing ever appears in the root namespace.
        sh(
            "ip",
            "-n",
            n,
            "link",
            "add",
            "veth-c",
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            c,
        )
        sh(
            "ip",
            "-n",
            n,
            "link",
            "add",
            "veth-p",
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            p,
        )
        for ns, dev, addr in (
            (n, "veth-c", f"{NODE_IP}/24"),
            (c, "eth0", "10.100.0.2/24"),
            (n, "veth-p", "10.244.0.1/24"),
            (p, "eth0", f"{POD_A}/24"),
        ):
            sh("ip", "-n", ns, "addr", "add", addr, "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
        sh("ip", "-n", c, "route", "add", "default", "via", NODE_IP)
        sh("ip", "-n", p, "route", "add", "default", "via", "10.244.0.1")
        sh("ip", "netns", "exec", n, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        IptablesBackend("nft", netns=n).restore(RULES)
        server = subprocess.Popen(
            ["ip", "netns", "exec", p, sys.executable, "-c", SERVER],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        yield Topo(c, n, p)
    finally:
        if server is not None:
            server.kill()
            server.wait()
        for name in created:
            subprocess.run(["ip", "netns", "del", name], check=False)


def keys(entries: list[ConntrackEntry]) -> set[tuple[str, int | None, int | None, str]]:
    return {(e.orig_dst, e.orig_dport, e.orig_sport, e.reply_src) for e in entries}


@kernel
@needs_root
def test_list_count_max(topo: Topo) -> None:
    topo.udp(VIP, 53, 40001, wait=True)
    [flow] = [e for e in topo.flows() if e.orig_dst == VIP]
    assert (flow.orig_src, flow.orig_sport, flow.orig_dport) == ("10.100.0.2", 40001, 53)
    assert (flow.reply_src, flow.reply_sport, flow.reply_dst) == (POD_A, 5353, "10.100.0.2")
    assert not flow.unreplied and flow.family == "ipv4" and flow.timeout > 0
    ct = Conntrack(topo.node)
    assert ct.count() == len(topo.flows(None)) >= 1
    assert ct.max() > 0


@kernel
@needs_root
def test_cleanup_deletes_flows_of_gone_endpoint_only(topo: Topo) -> None:
    topo.udp(VIP, 53, 40001, 40002, wait=True)
    topo.udp(VIP, 5300, 40003, wait=True)
    topo.udp(VIP2, 53, 40004, wait=True)
    topo.udp(NODE_IP, 30053, 40005)
    hold = subprocess.Popen(
        ["ip", "netns", "exec", topo.client, sys.executable, "-c", TCP_HOLD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert hold.stdout is not None and hold.stdout.readline().startswith("connected")
        before = topo.flows(None)
        assert {(VIP, 53, 40001, POD_A), (VIP, 53, 40002, POD_A)} <= keys(before)
        # A no longer serves VIP:53 (B does now)
        deleted = cleanup_stale_udp({(VIP, 53): {POD_B}}, {}, topo.node)
        assert deleted == 2
        after = topo.flows(None)
        assert not any(e.orig_dst == VIP and e.orig_dport == 53 for e in after)
        untouched = keys(before) - {(VIP, 53, 40001, POD_A), (VIP, 53, 40002, POD_A)}
        assert keys(after) == untouched
        assert any(e.proto == "tcp" and e.assured for e in after)
    finally:
        hold.kill()
        hold.wait()


@kernel
@needs_root
def test_cleanup_keeps_flows_of_serving_endpoint(topo: Topo) -> None:
    topo.udp(VIP, 53, 40001, wait=True)
    before = keys(topo.flows())
    assert cleanup_stale_udp({(VIP, 53): {POD_A, POD_B}}, {30053: {POD_B}}, topo.node) == 0
    assert keys(topo.flows()) == before


@kernel
@needs_root
def test_cleanup_nodeport(topo: Topo) -> None:
    topo.udp(NODE_IP, 30053, 40005)
    topo.udp(VIP, 53, 40001, wait=True)
    [nodeport] = [e for e in topo.flows() if e.orig_dport == 30053]
    assert (nodeport.orig_dst, nodeport.reply_src, nodeport.unreplied) == (NODE_IP, POD_B, True)
    assert cleanup_stale_udp({}, {30053: {POD_B}}, topo.node) == 0
    assert cleanup_stale_udp({}, {30053: {POD_A}}, topo.node) == 1
    assert keys(topo.flows()) == {(VIP, 53, 40001, POD_A)}


@kernel
@needs_root
def test_cleanup_many_flows_is_one_dump_and_one_batch(topo: Topo) -> None:
    topo.udp(VIP, 53, 41000, 41199)
    topo.udp(VIP2, 53, 41300, 41309)
    calls: list[list[str]] = []

    def counting(argv: Sequence[str], input_data: str | None) -> subprocess.CompletedProcess[str]:
        calls.append(list(argv))
        return run_command(argv, input_data)

    ct = Conntrack(topo.node, runner=counting)
    assert cleanup_stale_udp({(VIP, 53): set()}, {}, conntrack=ct) == 200
    assert [argv[5] for argv in calls] == ["-L", "-R"]
    assert {e.orig_dst for e in topo.flows()} == {VIP2}


@kernel
@needs_root
def test_delete_unreplied_syn_keeps_established(topo: Topo) -> None:
    hold = subprocess.Popen(
        ["ip", "netns", "exec", topo.client, sys.executable, "-c", TCP_HOLD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert hold.stdout is not None and hold.stdout.readline().startswith("connected")
        topo.py(topo.client, SYN_ONLY)
        topo.udp(VIP, 53, 40001)
        tcp = topo.flows("tcp")
        assert {e.state for e in tcp} == {"ESTABLISHED", "SYN_SENT"}
        assert delete_unreplied_syn("10.96.0.11", topo.node) == 1
        [left] = topo.flows("tcp")
        assert (left.state, left.assured, left.orig_dport) == ("ESTABLISHED", True, 80)
        assert len(topo.flows("udp")) == 1
        assert delete_unreplied_syn("10.96.0.11", topo.node) == 0
    finally:
        hold.kill()
        hold.wait()


@kernel
@needs_root
def test_targeted_delete_and_no_flush(topo: Topo) -> None:
    topo.udp(VIP, 53, 40001, 40003, wait=True)
    topo.udp(VIP2, 53, 40004, wait=True)
    ct = Conntrack(topo.node)
    with pytest.raises(ConntrackError):
        ct.delete("udp")
    assert len(topo.flows()) == 4
    assert ct.delete(orig_dst=VIP, orig_dport=53, orig_sport=40002) == 1
    assert ct.delete(orig_dst=VIP, reply_src=POD_B) == 0
    assert ct.delete(orig_dst=VIP, reply_src=POD_A) == 2
    assert keys(topo.flows()) == {(VIP2, 53, 40004, POD_A)}
