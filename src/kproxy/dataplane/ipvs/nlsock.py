"""A small netlink client: batched requests with per-message acks, and dumps.

Why not one request per round trip (pyroute2's IPVS/IPRoute API): a full ipvs sync of 1,000
services with 10 endpoints is 11,000 messages, and every round trip is several syscalls
(in User-Mode Linux each syscall is a host round trip). Netlink lets a sender put many
messages in one datagram; the kernel processes them in order under one lock and acks each
(NLM_F_ACK), continuing after a failed one. So requests go out in batches of up to
BATCH_MESSAGES, and the ack of every message is matched back to it by sequence number.

A socket for another network namespace is opened from a thread that setns()es into it.
Every wait for the kernel is bounded (kproxy.host.netlink_wait): a lost answer fails the
request with ETIMEDOUT instead of blocking the sync for good.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kproxy.host import netlink_fault
from kproxy.host.netlink_wait import answer_timeout, bound_blocking_waits
from kproxy.host.netns import socket_in_netns

NLMSG_HDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
NLA_HDR = struct.Struct("=HH")
NLMSG_ERROR = 2
NLMSG_DONE = 3
NLM_F_REQUEST = 0x1
NLM_F_MULTI = 0x2
NLM_F_ACK = 0x4
NLM_F_DUMP = 0x300
NLM_F_CREATE = 0x400
NLM_F_EXCL = 0x200
NLM_F_REPLACE = 0x100
SOL_NETLINK = 270
NETLINK_CAP_ACK = 10
NETLINK_EXT_ACK = 11
NLA_TYPE_MASK = 0x3FFF

BATCH_MESSAGES = 1024
BATCH_BYTES = 96 * 1024
RECV_BUFFER = 256 * 1024
RCVBUF = 4 * 1024 * 1024
# A datagram is at most BATCH_BYTES; a dump's answer comes in parts, each waited for alike.
ANSWER_TIMEOUT = answer_timeout(BATCH_BYTES)


class NetlinkError(OSError):
    """A request the kernel refused; errno and a description of the request."""


@dataclass(frozen=True, slots=True)
class Request:
    type: int
    flags: int  # besides NLM_F_REQUEST | NLM_F_ACK
    payload: bytes
    what: str = ""  # for error messages: "add TCP 10.96.0.10:80", ...


def pad4(n: int) -> int:
    return (n + 3) & ~3


def nla(kind: int, data: bytes) -> bytes:
    length = NLA_HDR.size + len(data)
    return NLA_HDR.pack(length, kind) + data + b"\0" * (pad4(length) - length)


def nla_u8(kind: int, value: int) -> bytes:
    return nla(kind, struct.pack("=B", value))


def nla_u16(kind: int, value: int) -> bytes:
    return nla(kind, struct.pack("=H", value))


def nla_u32(kind: int, value: int) -> bytes:
    return nla(kind, struct.pack("=I", value))


def nla_be16(kind: int, value: int) -> bytes:
    return nla(kind, struct.pack("!H", value))


def nla_str(kind: int, value: str) -> bytes:
    return nla(kind, value.encode() + b"\0")


def parse_attrs(data: bytes, offset: int = 0, end: int | None = None) -> dict[int, bytes]:
    """Attributes of one level (type -> payload; nested payloads are parsed by the caller)."""
    out: dict[int, bytes] = {}
    end = len(data) if end is None else end
    while offset + NLA_HDR.size <= end:
        length, kind = NLA_HDR.unpack_from(data, offset)
        if length < NLA_HDR.size:
            break
        out[kind & NLA_TYPE_MASK] = data[offset + NLA_HDR.size : offset + length]
        offset += pad4(length)
    return out


def iter_messages(data: bytes) -> Iterator[tuple[int, int, int, bytes]]:
    """The netlink messages of one datagram as (type, flags, seq, payload)."""
    offset = 0
    while offset + NLMSG_HDR.size <= len(data):
        length, msg_type, flags, seq, _pid = NLMSG_HDR.unpack_from(data, offset)
        if length < NLMSG_HDR.size:
            break
        yield msg_type, flags, seq, data[offset + NLMSG_HDR.size : offset + length]
        offset += pad4(length)


def u16(data: bytes) -> int:
    return struct.unpack_from("=H", data)[0]


def u32(data: bytes) -> int:
    return struct.unpack_from("=I", data)[0]


def be16(data: bytes) -> int:
    return struct.unpack_from("!H", data)[0]


def open_socket(proto: int, netns: str | None = None) -> socket.socket:
    """A raw netlink socket of `proto`, in `netns` (a name under /run/netns) if given."""
    sock = socket_in_netns(netns, socket.AF_NETLINK, socket.SOCK_RAW, proto)
    sock.bind((0, 0))
    for opt in (33, socket.SO_RCVBUF):  # SO_RCVBUFFORCE needs CAP_NET_ADMIN; then the plain one
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, RCVBUF)
            break
        except OSError:
            continue
    for opt in (32, socket.SO_SNDBUF):  # SO_SNDBUFFORCE, SO_SNDBUF
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, 1024 * 1024)
            break
        except OSError:
            continue
    # Error acks carry only the failed message's header, not all of it (less to read back).
    with contextlib.suppress(OSError):
        sock.setsockopt(SOL_NETLINK, NETLINK_CAP_ACK, 1)
    bound_blocking_waits(sock, ANSWER_TIMEOUT)
    return sock


class NetlinkSocket:
    def __init__(self, proto: int, netns: str | None = None) -> None:
        self.proto = proto
        self.netns = netns
        self.sock = open_socket(proto, netns)
        self._seq = int.from_bytes(os.urandom(2), "little") << 8
        self._buf = bytearray(RECV_BUFFER)
        self._view = memoryview(self._buf)
        # The kernel refuses a datagram larger than the send buffer (less some slack).
        sndbuf = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) // 2
        self.batch_bytes = max(8192, min(BATCH_BYTES, sndbuf - 4096))

    def close(self) -> None:
        self.sock.close()

    def _next_seq(self) -> int:
        self._seq = (self._seq + 1) & 0x7FFFFFFF or 1
        return self._seq

    @staticmethod
    def _frame(msg_type: int, flags: int, seq: int, payload: bytes) -> bytes:
        return NLMSG_HDR.pack(NLMSG_HDR.size + len(payload), msg_type, flags, seq, 0) + payload

    def _messages(self, data: bytes) -> Iterator[tuple[int, int, int, bytes]]:
        return iter_messages(data)

    def batch(self, requests: Sequence[Request]) -> list[tuple[Request, int]]:
        """Send every request; returns (request, errno) for those the kernel refused.

        Only the last message of each datagram asks for an ack: the kernel handles a
        datagram synchronously in send() and queues an error reply for every failed
        message (acked or not) before that final ack, so once it arrives every failure
        of the datagram has been read."""
        if netlink_fault.CONTROL is not None:
            netlink_fault.inject("ipvs")
        failed: list[tuple[Request, int]] = []
        i = 0
        while i < len(requests):
            pending: dict[int, Request] = {}
            size = 0
            while i < len(requests) and len(pending) < BATCH_MESSAGES and size < self.batch_bytes:
                pending[self._next_seq()] = requests[i]
                size += NLMSG_HDR.size + len(requests[i].payload)
                i += 1
            barrier = next(reversed(pending))
            self._send(
                b"".join(
                    self._frame(
                        req.type,
                        NLM_F_REQUEST | req.flags | (NLM_F_ACK if seq == barrier else 0),
                        seq,
                        req.payload,
                    )
                    for seq, req in pending.items()
                )
            )
            done = False
            while not done:
                for msg_type, _flags, seq, body in self._recv():
                    req = pending.get(seq)
                    if req is None or msg_type != NLMSG_ERROR:
                        continue
                    code = -struct.unpack_from("=i", body)[0]
                    if code:
                        failed.append((req, code))
                    if seq == barrier:
                        done = True
        return failed

    def _send(self, data: bytes) -> None:
        try:
            self.sock.send(data)
        except BlockingIOError as err:
            raise self._timed_out("no room for the request") from err

    def _recv(self) -> Iterator[tuple[int, int, int, bytes]]:
        try:
            n = self.sock.recv_into(self._buf)
        except BlockingIOError as err:
            raise self._timed_out("no answer") from err
        return self._messages(bytes(self._view[:n]))

    def _timed_out(self, what: str) -> NetlinkError:
        # A late answer is told apart by its sequence number: the socket stays usable.
        return NetlinkError(errno.ETIMEDOUT, f"netlink: {what} within {ANSWER_TIMEOUT:.0f} s")

    def request(self, req: Request) -> None:
        """One acked request; NetlinkError when refused."""
        for r, code in self.batch([req]):
            raise NetlinkError(code, f"{r.what or 'netlink request'}: {os.strerror(code)}")

    def dump(self, msg_type: int, payload: bytes) -> list[tuple[int, bytes]]:
        """A dump request; every reply message as (type, payload)."""
        seq = self._next_seq()
        self._send(self._frame(msg_type, NLM_F_REQUEST | NLM_F_DUMP, seq, payload))
        out: list[tuple[int, bytes]] = []
        while True:
            for t, _flags, s, body in self._recv():
                if s != seq:
                    continue
                if t == NLMSG_DONE:
                    return out
                if t == NLMSG_ERROR:
                    code = -struct.unpack_from("=i", body)[0]
                    if code == 0:
                        return out
                    raise NetlinkError(code, f"netlink dump: {os.strerror(code)}")
                out.append((t, body))

    def get(self, msg_type: int, payload: bytes, what: str = "") -> list[tuple[int, bytes]]:
        """A plain (non-dump) request that answers with messages (e.g. a genl family query)."""
        seq = self._next_seq()
        self._send(self._frame(msg_type, NLM_F_REQUEST | NLM_F_ACK, seq, payload))
        out: list[tuple[int, bytes]] = []
        while True:
            for t, _flags, s, body in self._recv():
                if s != seq:
                    continue
                if t == NLMSG_ERROR:
                    code = -struct.unpack_from("=i", body)[0]
                    if code:
                        raise NetlinkError(
                            code, f"{what or 'netlink request'}: {os.strerror(code)}"
                        )
                    return out
                out.append((t, body))


__all__ = [
    "NLM_F_CREATE",
    "NLM_F_EXCL",
    "NLM_F_REPLACE",
    "NetlinkError",
    "NetlinkSocket",
    "Request",
    "errno",
]
