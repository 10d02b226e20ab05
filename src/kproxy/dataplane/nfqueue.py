"""Hold packets in an NFQUEUE for a moment, then let every one of them go on, in order.

A queue is bound on a netfilter netlink socket (in the dataplane's network namespace);
iptables rules with `-j NFQUEUE --queue-num N --queue-bypass` send packets to it. While the
hold lasts, every queued packet waits in the kernel (only its id reaches us: the queue
copies metadata, not payloads); release() accepts them all with one batch verdict, and every
packet queued after that is accepted as it arrives. The packets re-enter the hook where
they were queued, so a packet held in raw PREROUTING meets conntrack and nat only once
released.

Fail-safe by construction: the queue is fail-open (a full queue accepts instead of
dropping), the rules are meant to carry --queue-bypass (no listener: packets pass), a hold
releases itself after `max_hold` seconds, and close() accepts whatever is still queued
before it unbinds (the kernel drops what is queued on a queue that goes away).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
import time

from kproxy.dataplane.ipvs.nlsock import (
    NLM_F_ACK,
    NLM_F_REQUEST,
    NLMSG_ERROR,
    NLMSG_HDR,
    NetlinkError,
    iter_messages,
    nla,
    open_socket,
    parse_attrs,
)

log = logging.getLogger(__name__)

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
MSG_PACKET = NFNL_SUBSYS_QUEUE << 8 | 0
MSG_VERDICT = NFNL_SUBSYS_QUEUE << 8 | 1
MSG_CONFIG = NFNL_SUBSYS_QUEUE << 8 | 2
MSG_VERDICT_BATCH = NFNL_SUBSYS_QUEUE << 8 | 3
CFG_CMD = 1
CFG_PARAMS = 2
CFG_QUEUE_MAXLEN = 3
CFG_MASK = 4
CFG_FLAGS = 5
CMD_BIND = 1
CMD_UNBIND = 2
COPY_META = 1
FLAG_FAIL_OPEN = 1
PACKET_HDR = 1
VERDICT_HDR = 2
NF_ACCEPT = 1
NFGENMSG = struct.Struct("!BBH")  # family, version, queue number (network order)
PACKET_HDR_STRUCT = struct.Struct("!IHB")  # packet id, hw protocol, hook
QUEUE_MAXLEN = 16384
# Nothing queued for this long after close() starts: every packet has been seen.
QUIET = 0.05


class PacketHold:
    """One bound queue. Use: hold = PacketHold(n, netns).start(); add the rules;
    ...; hold.release(); remove the rules; hold.close(). OSError (NetlinkError) from
    start() when the queue cannot be bound (no nfnetlink_queue, or another process has it)."""

    def __init__(self, queue: int, netns: str | None = None, *, max_hold: float = 3.0) -> None:
        self.queue = queue
        self.netns = netns
        self.max_hold = max_hold
        self.held = 0  # packets that waited for release()
        self.passed = 0  # packets accepted as they came, after release()
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._released = False
        self._closing = threading.Event()
        self._last_id: int | None = None
        self._thread: threading.Thread | None = None
        self._seq = 0
        self._started = 0.0

    # --- life cycle --------------------------------------------------------------------------

    def start(self) -> PacketHold:
        sock = open_socket(NETLINK_NETFILTER, self.netns)
        self._sock = sock
        try:
            self._config(nla(CFG_CMD, struct.pack("!BxH", CMD_BIND, socket.AF_INET)))
            self._config(
                nla(CFG_PARAMS, struct.pack("!IB", 0, COPY_META))
                + nla(CFG_QUEUE_MAXLEN, struct.pack("!I", QUEUE_MAXLEN))
                + nla(CFG_MASK, struct.pack("!I", FLAG_FAIL_OPEN))
                + nla(CFG_FLAGS, struct.pack("!I", FLAG_FAIL_OPEN))
            )
        except OSError:
            sock.close()
            self._sock = None
            raise
        sock.settimeout(QUIET)
        self._started = time.monotonic()
        self._thread = threading.Thread(
            target=self._read, name=f"nfqueue-{self.queue}", daemon=True
        )
        self._thread.start()
        return self

    def release(self) -> None:
        """Accept every held packet (one batch verdict), and every later one as it comes."""
        with self._lock:
            if self._released:
                return
            self._released = True
            if self._last_id is not None:
                self._verdict(MSG_VERDICT_BATCH, self._last_id)

    def close(self) -> None:
        """Release, accept what is still on its way, unbind."""
        self.release()
        self._closing.set()
        if self._thread is not None:
            self._thread.join(self.max_hold + 1.0)
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.send(
                    self._frame(
                        MSG_CONFIG, 0, nla(CFG_CMD, struct.pack("!BxH", CMD_UNBIND, socket.AF_INET))
                    )
                )
            self._sock.close()
            self._sock = None

    def __enter__(self) -> PacketHold:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the reader --------------------------------------------------------------------------

    def _read(self) -> None:
        assert self._sock is not None
        buf = bytearray(256 * 1024)
        while True:
            if not self._released and time.monotonic() - self._started > self.max_hold:
                log.warning("packets held for %.1f s: released", self.max_hold)
                self.release()
            try:
                n = self._sock.recv_into(buf)
            except TimeoutError:
                if self._closing.is_set():
                    return
                continue
            except OSError as err:  # ENOBUFS: the fail-open queue accepted what did not fit
                if self._closing.is_set():
                    return
                log.debug("nfqueue %d: %s", self.queue, err)
                continue
            for packet_id in packet_ids(bytes(buf[:n])):
                with self._lock:
                    if self._released:
                        self.passed += 1
                        self._verdict(MSG_VERDICT, packet_id)
                    else:
                        self.held += 1
                        self._last_id = packet_id

    # --- messages ----------------------------------------------------------------------------

    def _frame(self, msg_type: int, flags: int, attrs: bytes) -> bytes:
        self._seq += 1
        body = NFGENMSG.pack(socket.AF_UNSPEC, 0, self.queue) + attrs
        return (
            NLMSG_HDR.pack(
                NLMSG_HDR.size + len(body), msg_type, NLM_F_REQUEST | flags, self._seq, 0
            )
            + body
        )

    def _config(self, attrs: bytes) -> None:
        """One acknowledged config message (before the reader runs: nothing else arrives)."""
        assert self._sock is not None
        self._sock.send(self._frame(MSG_CONFIG, NLM_F_ACK, attrs))
        seq = self._seq
        while True:
            data = self._sock.recv(8192)
            for msg_type, _flags, msg_seq, body in iter_messages(data):
                if msg_type == NLMSG_ERROR and msg_seq == seq:
                    code = -struct.unpack_from("=i", body)[0]
                    if code:
                        raise NetlinkError(
                            code, f"nfqueue {self.queue} config: {os.strerror(code)}"
                        )
                    return

    def _verdict(self, msg_type: int, packet_id: int) -> None:
        assert self._sock is not None
        try:
            self._sock.send(
                self._frame(msg_type, 0, nla(VERDICT_HDR, struct.pack("!II", NF_ACCEPT, packet_id)))
            )
        except OSError as err:
            log.warning("nfqueue %d: verdict for packet %d failed: %s", self.queue, packet_id, err)


def packet_ids(data: bytes) -> list[int]:
    """The ids of the queued packets announced in one datagram."""
    ids = []
    for msg_type, _flags, _seq, body in iter_messages(data):
        if msg_type != MSG_PACKET:
            continue
        hdr = parse_attrs(body, NFGENMSG.size).get(PACKET_HDR)
        if hdr is not None and len(hdr) >= PACKET_HDR_STRUCT.size:
            ids.append(PACKET_HDR_STRUCT.unpack_from(hdr)[0])
    return ids
