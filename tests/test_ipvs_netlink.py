"""ipvs mode's kernel-facing pieces without a kernel: the generic-netlink messages (the
layout ipvsadm sends), batching with one ack per datagram, /proc/net/ip_vs and `ipset save`
parsing, the module check's message, and which virtual servers count as kube-proxy's."""

from __future__ import annotations

import errno
import socket
import struct
import time

import pytest

from kproxy.dataplane.base import DataplaneUnavailable
from kproxy.dataplane.iptables.backend import parse_save as parse_iptables_save
from kproxy.dataplane.ipvs import check
from kproxy.dataplane.ipvs import names as n
from kproxy.dataplane.ipvs import netlink as nl
from kproxy.dataplane.ipvs.cleanup import iptables_mode_owns_shared, ownership
from kproxy.dataplane.ipvs.ipset import parse_save, sync_lines
from kproxy.dataplane.ipvs.nlsock import (
    ANSWER_TIMEOUT,
    NLM_F_ACK,
    NLM_F_REQUEST,
    NLMSG_ERROR,
    NLMSG_HDR,
    NetlinkError,
    NetlinkSocket,
    Request,
    nla,
    open_socket,
    parse_attrs,
    u16,
    u32,
)
from kproxy.dataplane.ipvs.plan import VirtualServer, VSKey
from kproxy.host.netlink_wait import answer_timeout, bound_blocking_waits

KEY = VSKey("TCP", "10.96.0.10", 80)


def test_service_message_carries_every_field_explicitly() -> None:
    vs = VirtualServer(KEY, "mh", n.FLAG_PERSISTENT | n.FLAG_SCHED2, 300)
    req = nl.add_service(99, vs)
    assert req.type == 99
    cmd, version, _ = struct.unpack_from("=BBH", req.payload)
    assert (cmd, version) == (nl.CMD_NEW_SERVICE, 1)
    svc = parse_attrs(parse_attrs(req.payload, 4)[nl.ATTR_SERVICE])
    assert u16(svc[nl.SVC_AF]) == socket.AF_INET
    assert u16(svc[nl.SVC_PROTOCOL]) == socket.IPPROTO_TCP
    assert svc[nl.SVC_ADDR] == socket.inet_aton("10.96.0.10")
    assert svc[nl.SVC_PORT] == b"\x00\x50"  # network byte order
    assert svc[nl.SVC_SCHED_NAME] == b"mh\0"
    assert struct.unpack("=II", svc[nl.SVC_FLAGS]) == (0x11, 0xFFFFFFFF)
    assert u32(svc[nl.SVC_TIMEOUT]) == 300
    assert svc[nl.SVC_NETMASK] == b"\xff\xff\xff\xff"


def test_real_server_message_is_masquerading_with_its_weight() -> None:
    req = nl.add_dest(99, KEY, "10.244.0.2", 8080, 1)
    top = parse_attrs(req.payload, 4)
    dest = parse_attrs(top[nl.ATTR_DEST])
    assert dest[nl.DEST_ADDR] == socket.inet_aton("10.244.0.2")
    assert dest[nl.DEST_PORT] == struct.pack("!H", 8080)
    # pyroute2 would default to 3 (direct routing): kproxy always says masq (0).
    assert u32(dest[nl.DEST_FWD_METHOD]) == n.FWD_MASQ
    assert u32(dest[nl.DEST_WEIGHT]) == 1
    assert u32(dest[nl.DEST_U_THRESH]) == 0 and u32(dest[nl.DEST_L_THRESH]) == 0
    # The service is named by its key only.
    assert set(parse_attrs(top[nl.ATTR_SERVICE])) == {
        nl.SVC_AF,
        nl.SVC_PROTOCOL,
        nl.SVC_ADDR,
        nl.SVC_PORT,
    }
    delete = parse_attrs(parse_attrs(nl.delete_dest(99, KEY, "10.244.0.2", 8080).payload, 4)[2])
    assert set(delete) == {nl.DEST_ADDR, nl.DEST_PORT}


def test_attributes_are_padded_to_four_bytes() -> None:
    assert nla(6, b"rr\0") == struct.pack("=HH", 7, 6) + b"rr\0\0"
    assert len(nla(6, b"wlc\0")) == 8


def test_service_dump_reply_is_parsed_without_the_hashed_flag() -> None:
    attrs = (
        nla(nl.SVC_AF, struct.pack("=H", socket.AF_INET))
        + nla(nl.SVC_PROTOCOL, struct.pack("=H", 17))
        + nla(nl.SVC_ADDR, socket.inet_aton("10.96.0.53") + b"\0" * 12)  # the kernel sends 16
        + nla(nl.SVC_PORT, struct.pack("!H", 53))
        + nla(nl.SVC_FWMARK, struct.pack("=I", 0))
        + nla(nl.SVC_SCHED_NAME, b"sh\0")
        + nla(nl.SVC_FLAGS, struct.pack("=II", n.FLAG_HASHED | n.FLAG_PERSISTENT, 0xFFFF))
        + nla(nl.SVC_TIMEOUT, struct.pack("=I", 180))
        + nla(nl.SVC_NETMASK, b"\xff" * 4)
    )
    body = struct.pack("=BBH", nl.CMD_NEW_SERVICE, 1, 0) + nla(nl.ATTR_SERVICE, attrs)
    svc = nl.parse_service(body)
    assert svc == nl.KernelService(VSKey("UDP", "10.96.0.53", 53), "sh", n.FLAG_PERSISTENT, 180)
    fwmark = attrs.replace(
        nla(nl.SVC_FWMARK, struct.pack("=I", 0)), nla(nl.SVC_FWMARK, struct.pack("=I", 7))
    )
    body = struct.pack("=BBH", nl.CMD_NEW_SERVICE, 1, 0) + nla(nl.ATTR_SERVICE, fwmark)
    assert nl.parse_service(body) is None  # fwmark services are never kproxy's


PROC = """IP Virtual Server version 1.2.1 (size=4096)
Prot LocalAddress:Port Scheduler Flags
  -> RemoteAddress:Port Forward Weight ActiveConn InActConn
TCP  0A60000A:0050 rr 
  -> 0AF40004:1F90      Masq    1      0          0         
  -> 0AF40002:1F90      Masq    0      2          5         
UDP  0A600035:0035 rr persistent 10800 FFFFFFFF
  -> 0AF40003:1F90      Route   3      0          1         
FWM  00000007 wlc 
  -> 0AF40003:1F90      Masq    1      0          0         
TCP  [fd00::1]:0050 rr 
"""  # noqa: W291 (the kernel's trailing spaces)


def test_proc_ip_vs_gives_weights_and_connections() -> None:
    got = nl.parse_proc_ip_vs(PROC)
    assert set(got) == {KEY, VSKey("UDP", "10.96.0.53", 53)}
    assert got[KEY] == [
        nl.KernelDest("10.244.0.4", 8080, 1, 0, 0, 0),
        nl.KernelDest("10.244.0.2", 8080, 0, 0, 2, 5),
    ]
    (udp,) = got[VSKey("UDP", "10.96.0.53", 53)]
    assert udp.fwd_method == 3 and udp.weight == 3 and udp.connections == 1


class FakeKernelSocket:
    """Answers like the kernel: an error message for each refused request, and an ack for
    the one message that asked for it."""

    def __init__(self, refuse: set[int]) -> None:
        self.refuse = refuse  # indexes of requests (in send order) to refuse
        self.datagrams: list[bytes] = []
        self.replies: list[bytes] = []
        self.count = 0

    def send(self, data: bytes) -> int:
        self.datagrams.append(data)
        offset = 0
        while offset < len(data):
            length, _t, flags, seq, _pid = NLMSG_HDR.unpack_from(data, offset)
            code = -2 if self.count in self.refuse else 0
            if code or flags & NLM_F_ACK:
                body = struct.pack("=i", code) + data[offset : offset + NLMSG_HDR.size]
                self.replies.append(
                    NLMSG_HDR.pack(NLMSG_HDR.size + len(body), NLMSG_ERROR, 0, seq, 0) + body
                )
            self.count += 1
            offset += (length + 3) & ~3
        return len(data)

    def recv_into(self, buf: bytearray) -> int:
        reply = self.replies.pop(0)
        buf[: len(reply)] = reply
        return len(reply)


def test_batch_asks_one_ack_per_datagram_and_maps_errors_back() -> None:
    sock = NetlinkSocket.__new__(NetlinkSocket)
    fake = FakeKernelSocket(refuse={3, 700})
    sock.sock = fake  # type: ignore[assignment]
    sock._seq = 100
    sock._buf = bytearray(65536)
    sock._view = memoryview(sock._buf)
    sock.batch_bytes = 96 * 1024
    reqs = [Request(5, 0, b"\0" * 60, f"r{i}") for i in range(1500)]
    failed = sock.batch(reqs)
    assert [(r.what, code) for r, code in failed] == [("r3", 2), ("r700", 2)]
    assert len(fake.datagrams) == 2  # 1024 messages per datagram
    flags = []
    for data in fake.datagrams:
        offset = 0
        while offset < len(data):
            length, _t, f, _s, _p = NLMSG_HDR.unpack_from(data, offset)
            flags.append(f)
            offset += (length + 3) & ~3
    acked = [i for i, f in enumerate(flags) if f & NLM_F_ACK]
    assert acked == [1023, 1499] and all(f & NLM_F_REQUEST for f in flags)


def _socket_on(sock: socket.socket) -> NetlinkSocket:
    out = NetlinkSocket.__new__(NetlinkSocket)
    out.sock = sock
    out._seq = 100
    out._buf = bytearray(65536)
    out._view = memoryview(out._buf)
    out.batch_bytes = 96 * 1024
    return out


def test_a_batch_the_kernel_never_answers_fails_within_the_bound() -> None:
    """A lost answer fails the batch (ETIMEDOUT, a failed sync retried later) instead of
    holding the sync, and the loop's lock, for good."""
    kernel, ours = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    with kernel, ours:
        bound_blocking_waits(ours, 0.3)
        started = time.monotonic()
        with pytest.raises(NetlinkError) as caught:
            _socket_on(ours).batch([Request(5, 0, b"\0" * 8, "add TCP 10.96.0.10:80")])
        took = time.monotonic() - started
        assert caught.value.errno == errno.ETIMEDOUT
        assert "no answer within" in str(caught.value) and "netlink" in str(caught.value)
        assert 0.25 < took < 5, took
        assert kernel.recv(4096), "the batch was not sent"
        # A dump meets the same bound.
        with pytest.raises(NetlinkError, match="no answer"):
            _socket_on(ours).dump(5, b"")


def test_ipvs_netlink_sockets_bound_their_waits() -> None:
    with open_socket(16) as sock:  # NETLINK_GENERIC, as IpvsNetlink opens it
        for opt in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
            sec, usec = struct.unpack("@ll", sock.getsockopt(socket.SOL_SOCKET, opt, 16))
            assert sec + usec / 1e6 == pytest.approx(ANSWER_TIMEOUT, abs=0.01)
    assert answer_timeout(96 * 1024) == ANSWER_TIMEOUT


# --- ipset ----------------------------------------------------------------------------------


def test_ipset_sync_lines_create_delete_then_add() -> None:
    desired = {n.CLUSTER_IP: {"10.96.0.10,tcp:80"}, n.IPVS_IPS: {"10.96.0.10"}}
    current = {n.CLUSTER_IP: {"10.96.0.11,tcp:80"}}
    lines = sync_lines(desired, current, create=True)
    assert lines == [
        n.SET_INFO[n.CLUSTER_IP].create_line(),
        n.SET_INFO[n.IPVS_IPS].create_line(),
        "del KUBE-CLUSTER-IP 10.96.0.11,tcp:80",
        "add KUBE-CLUSTER-IP 10.96.0.10,tcp:80",
        "add KUBE-IPVS-IPS 10.96.0.10",
    ]
    assert sync_lines(desired, desired, create=False) == []


def test_ipset_save_is_parsed_for_our_sets() -> None:
    text = (
        "create KUBE-CLUSTER-IP hash:ip,port family inet hashsize 1024 maxelem 65536"
        " bucketsize 12\n"
        "add KUBE-CLUSTER-IP 10.96.0.10,tcp:80\n"
        "create KUBE-NODE-PORT-TCP bitmap:port range 0-65535\n"
        "create other hash:ip family inet\nadd other 1.2.3.4\n"
    )
    assert parse_save(text, n.SET_NAMES) == {
        n.CLUSTER_IP: {"10.96.0.10,tcp:80"},
        n.NODE_PORT_TCP: set(),
    }


# --- the module check ------------------------------------------------------------------------


def test_missing_modules_are_loaded_when_possible() -> None:
    loaded = {"ip_vs", "nf_conntrack"}
    tried: list[str] = []

    def loader(mod: str) -> bool:
        tried.append(mod)
        if mod == "ip_vs_sh":
            loaded.add(mod)
            return True
        return False

    assert check.missing_modules("sh", present=loaded.__contains__, loader=loader) == []
    assert tried == ["ip_vs_sh"]
    assert check.missing_modules("mh", present=loaded.__contains__, loader=loader) == ["ip_vs_mh"]
    assert check.required_modules() == ["ip_vs", "ip_vs_rr", "nf_conntrack"]


def test_missing_module_message_says_how_to_load_and_persist(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(check, "missing_modules", lambda *a, **k: ["ip_vs", "ip_vs_wrr"])
    with pytest.raises(DataplaneUnavailable) as caught:
        check.check_modules("wrr")
    msg = str(caught.value)
    assert "ip_vs (the IPVS load balancer), ip_vs_wrr (the wrr IPVS scheduler)" in msg
    assert "`modprobe ip_vs && modprobe ip_vs_wrr`" in msg
    assert "echo ip_vs >> /etc/modules-load.d/kproxy-ipvs.conf" in msg
    assert "echo ip_vs_wrr >> /etc/modules-load.d/kproxy-ipvs.conf" in msg
    assert "never falls back" in msg


# --- ownership ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "reason"),
    [
        (VSKey("TCP", "10.96.0.10", 80), "bound on kube-ipvs0"),
        (VSKey("UDP", "10.96.0.53", 53), "in ipset KUBE-CLUSTER-IP"),
        (VSKey("TCP", "192.0.2.7", 443), "in ipset KUBE-LOAD-BALANCER"),
        (VSKey("TCP", "10.100.0.1", 30080), "port 30080 is in ipset KUBE-NODE-PORT-TCP"),
        (VSKey("SCTP", "10.100.0.1", 30090), "KUBE-NODE-PORT-SCTP-HASH"),
        (VSKey("TCP", "198.51.100.0", 20000), "scheduler probe"),
        (VSKey("TCP", "10.100.0.1", 8443), None),  # a keepalived VIP on the node
        (VSKey("TCP", "10.100.0.9", 30080), None),  # the NodePort port, not a node address
        (VSKey("UDP", "10.100.0.1", 30080), None),  # NodePort is TCP only
    ],
)
def test_ownership_of_virtual_servers(key: VSKey, reason: str | None) -> None:
    sets = {
        n.CLUSTER_IP: {"10.96.0.53,udp:53"},
        n.LOAD_BALANCER: {"192.0.2.7,tcp:443"},
        n.NODE_PORT_TCP: {"30080"},
        n.NODE_PORT_SCTP: {"10.100.0.1,sctp:30090"},
    }
    got = ownership(key, bound={"10.96.0.10"}, sets=sets, node_addresses={"10.100.0.1"})
    if reason is None:
        assert got is None
    else:
        assert got is not None and reason in got


def test_shared_chain_ownership_follows_kube_services() -> None:
    ipvs = parse_iptables_save(
        "*nat\n:KUBE-SERVICES - [0:0]\n"
        "-A KUBE-SERVICES -m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT\nCOMMIT\n"
    )
    iptables = parse_iptables_save(
        "*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-SVC-X - [0:0]\n"
        "-A KUBE-SERVICES -d 10.96.0.10/32 -p tcp -m tcp --dport 80 -j KUBE-SVC-X\nCOMMIT\n"
    )
    assert not iptables_mode_owns_shared(ipvs)
    assert iptables_mode_owns_shared(iptables)
    assert not iptables_mode_owns_shared({})
