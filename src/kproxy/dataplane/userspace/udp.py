"""UDP forwarding in a worker: one backend socket per client address, with an idle timeout.

A datagram from a new client address opens a session: a connected UDP socket to an endpoint
(from the client's own address when the source is kept). Replies are sent back from the
listener socket with the local address the client's datagram was delivered to (IP_PKTINFO),
which is the address the kernel NATed it to, so conntrack maps the reply back to the service
address. A session ends after `idle_timeout` without traffic (upstream: 250 ms), when its
endpoint leaves the table (UDP has nothing to drain), or when the endpoint answers with an
ICMP error (the next datagram then picks the next endpoint).

Backpressure: UDP has none to give; a datagram that cannot be sent at once is dropped (and
counted), so no queue builds up. Sessions are capped per worker.

Hand-off (the mode is leaving, proxier.py): a client keeping its address stays one conntrack
entry, which the controller deletes so its next datagram takes the next mode's path. A reply
relayed after that would leave untranslated and be lost, so from the hand-off on replies go
from the service address itself (a transparent socket bound to the listener's destination,
marked so the raw table leaves them untracked): they need no conntrack entry. On shutdown
the datagrams still queued on a listener are forwarded and the replies they wait for relayed
(within the idle timeout) before the sessions close.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import struct
import time
from dataclasses import dataclass

from kproxy.dataplane.userspace.balancer import Addr, Balancer
from kproxy.dataplane.userspace.render import HANDOFF_MARK
from kproxy.dataplane.userspace.tcp import IP_TRANSPARENT

log = logging.getLogger("kproxy.userspace.udp")

MAX_DATAGRAM = 65535
BATCH = 64
IP_PKTINFO = getattr(socket, "IP_PKTINFO", 8)
_PKTINFO = struct.Struct("=I4s4s")
_ANC_SPACE = socket.CMSG_SPACE(_PKTINFO.size)


@dataclass
class UdpStats:
    datagrams: int = 0
    replies: int = 0
    dropped: int = 0
    sessions: int = 0
    sessions_total: int = 0
    no_endpoints: int = 0
    # Sessions that went idle while their last datagram still had no reply: the client
    # waited in vain (endpoint silent, or the reply came after the idle timeout).
    expired_unanswered: int = 0


class UdpSession:
    __slots__ = (
        "answered",
        "bsock",
        "client",
        "endpoint",
        "key",
        "last",
        "listener",
        "pktinfo",
        "sent",
    )

    def __init__(
        self,
        listener: UdpListener,
        key: str,
        client: Addr,
        endpoint: Addr,
        bsock: socket.socket,
        pktinfo: bytes,
    ) -> None:
        self.listener = listener
        self.key = key
        self.client = client
        self.endpoint = endpoint
        self.bsock = bsock
        self.pktinfo = pktinfo
        self.last = time.monotonic()
        self.sent = 0.0  # when the last datagram went to the endpoint
        self.answered = 0.0  # when the last reply went to the client

    def on_reply(self) -> None:
        engine = self.listener.engine
        lsock = self.listener.sock
        anc = [(socket.SOL_IP, IP_PKTINFO, self.pktinfo)]
        handoff = engine.handoff_socket(self.key)
        for _ in range(BATCH):
            try:
                data = self.bsock.recv(MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                # ICMP error for an earlier datagram (endpoint gone): start over elsewhere.
                engine.close_session(self)
                return
            self.last = self.answered = time.monotonic()
            try:
                if handoff is not None:
                    ip, port = self.client
                    handoff.sendto(data, (ip, engine.handoff_peers.get(self.client, port)))
                else:
                    lsock.sendmsg([data], anc, 0, self.client)
                engine.stats.replies += 1
            except OSError:
                engine.stats.dropped += 1


def handoff_peers(raw: object) -> dict[Addr, int]:
    """The table's "udp_handoff_peers" ({"ip:seen port": client port}) as a lookup; what
    does not parse is skipped (the reply then goes where the worker saw the client)."""
    out: dict[Addr, int] = {}
    if not isinstance(raw, dict):
        return out
    for peer, port in raw.items():
        ip, _, seen = str(peer).rpartition(":")
        if ip and seen.isdigit() and isinstance(port, int) and 0 < port < 65536:
            out[(ip, int(seen))] = port
    return out


class UdpListener:
    def __init__(self, engine: UdpEngine, key: str, sock: socket.socket) -> None:
        self.engine = engine
        self.key = key
        self.sock = sock
        sock.setsockopt(socket.SOL_IP, IP_PKTINFO, 1)

    def on_datagram(self) -> None:
        engine = self.engine
        sessions = engine.sessions
        stats = engine.stats
        for _ in range(BATCH):
            try:
                data, anc, _flags, client = self.sock.recvmsg(MAX_DATAGRAM, _ANC_SPACE)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                continue
            stats.datagrams += 1
            skey = (self.key, client)
            session = sessions.get(skey)
            if session is None:
                session = engine.open_session(self, client, anc)
                if session is None:
                    stats.dropped += 1
                    continue
            session.last = session.sent = time.monotonic()
            try:
                session.bsock.send(data)
            except (BlockingIOError, InterruptedError):
                stats.dropped += 1
            except OSError:
                stats.dropped += 1
                engine.close_session(session)


def _local_addr(anc: list[tuple[int, int, bytes]]) -> bytes:
    """in_pktinfo to send a reply with: the header destination the datagram arrived with."""
    for level, kind, data in anc:
        if level == socket.SOL_IP and kind == IP_PKTINFO and len(data) >= _PKTINFO.size:
            _ifindex, _spec_dst, addr = _PKTINFO.unpack_from(data)
            return _PKTINFO.pack(0, addr, b"\0\0\0\0")
    return _PKTINFO.pack(0, b"\0\0\0\0", b"\0\0\0\0")


class UdpEngine:
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        balancer: Balancer,
        *,
        idle_timeout: float = 0.25,
        max_sessions: int = 20000,
    ) -> None:
        self.loop = loop
        self.balancer = balancer
        self.idle_timeout = idle_timeout
        self.max_sessions = max_sessions
        self.stats = UdpStats()
        self.listeners: dict[str, UdpListener] = {}
        self.sessions: dict[tuple[str, Addr], UdpSession] = {}
        self._capped_logged = False
        self.handoff = False  # set by the table while the controller hands the flows over
        # Clients whose source port conntrack remapped for the redirect (a clash): the port
        # this worker sees -> the client's own, which a hand-off reply (untracked) must use.
        self.handoff_peers: dict[Addr, int] = {}
        self._handoff_socks: dict[str, socket.socket | None] = {}

    def add_listener(self, key: str, sock: socket.socket) -> None:
        lst = UdpListener(self, key, sock)
        self.listeners[key] = lst
        self.loop.add_reader(sock.fileno(), lst.on_datagram)

    def remove_listener(self, key: str) -> None:
        lst = self.listeners.pop(key, None)
        if lst is None:
            return
        for session in [s for s in self.sessions.values() if s.key == key]:
            self.close_session(session)
        self.loop.remove_reader(lst.sock.fileno())
        lst.sock.close()

    def open_session(
        self, lst: UdpListener, client: Addr, anc: list[tuple[int, int, bytes]]
    ) -> UdpSession | None:
        if len(self.sessions) >= self.max_sessions:
            if not self._capped_logged:
                self._capped_logged = True
                log.warning(
                    "UDP session limit reached: %d client addresses in this worker; datagrams "
                    "of new clients are dropped until sessions expire",
                    self.max_sessions,
                )
            return None
        plan = self.balancer.plan(lst.key, client[0], time.monotonic())
        if not plan:
            self.stats.no_endpoints += 1
            return None
        endpoint = plan[0]
        state = self.balancer.listeners.get(lst.key)
        bsock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
        try:
            if state is not None and self.balancer.keep_source(
                state.listener, client[0], endpoint[0]
            ):
                try:
                    bsock.setsockopt(socket.SOL_IP, IP_TRANSPARENT, 1)
                    bsock.bind((client[0], 0))
                except OSError:
                    pass  # from the node's address instead
            bsock.connect(endpoint)
        except OSError as exc:
            bsock.close()
            if exc.errno != errno.EINPROGRESS:
                self.stats.dropped += 1
                return None
        session = UdpSession(lst, lst.key, client, endpoint, bsock, _local_addr(anc))
        self.sessions[(lst.key, client)] = session
        self.balancer.connected(lst.key, client[0], endpoint, time.monotonic())
        self.loop.add_reader(bsock.fileno(), session.on_reply)
        self.stats.sessions_total += 1
        self.stats.sessions = len(self.sessions)
        return session

    def close_session(self, session: UdpSession) -> None:
        if self.sessions.get((session.key, session.client)) is session:
            del self.sessions[(session.key, session.client)]
        with contextlib.suppress(ValueError, OSError):
            self.loop.remove_reader(session.bsock.fileno())
        session.bsock.close()
        self.stats.sessions = len(self.sessions)
        if self._capped_logged and len(self.sessions) < self.max_sessions * 0.9:
            self._capped_logged = False

    def sweep(self, now: float) -> None:
        """Close idle sessions."""
        limit = now - self.idle_timeout
        for session in [s for s in self.sessions.values() if s.last < limit]:
            if session.sent > session.answered:
                # After a stall this timer can run before the reply's reader: relay what
                # has already arrived before judging the session idle.
                session.on_reply()
                if self.sessions.get((session.key, session.client)) is not session:
                    continue  # closed by an ICMP error
                if session.answered >= session.sent:
                    continue  # answered just now: not idle
                self.stats.expired_unanswered += 1
            self.close_session(session)

    def retarget(self) -> None:
        """After a table change: end sessions whose endpoint may no longer be used."""
        for session in list(self.sessions.values()):
            state = self.balancer.listeners.get(session.key)
            if state is None:
                self.close_session(session)
                continue
            _which, eps = self.balancer.candidates_for(state.listener, session.client[0])
            if session.endpoint not in eps:
                self.close_session(session)

    def handoff_socket(self, key: str) -> socket.socket | None:
        """During a hand-off: the socket replies of listener `key` go from (bound to its one
        destination, transparent, marked); None otherwise, or when the listener has several
        destinations (external ones): those replies keep the listener's path."""
        if not self.handoff:
            return None
        if key in self._handoff_socks:
            return self._handoff_socks[key]
        sock = None
        state = self.balancer.listeners.get(key)
        dests = state.listener.destinations if state is not None else ()
        ip, sep, port = dests[0].rpartition(":") if len(dests) == 1 else ("", "", "")
        if sep and port.isdigit():
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
            try:
                sock.setsockopt(socket.SOL_IP, IP_TRANSPARENT, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, HANDOFF_MARK)
                sock.bind((ip, int(port)))
            except OSError as exc:
                log.warning(
                    "cannot send the hand-off replies of %s from %s: %s", key, dests[0], exc
                )
                sock.close()
                sock = None
        self._handoff_socks[key] = sock
        return sock

    def drain_listeners(self) -> None:
        """Forward what is queued on the listeners, then close them; sessions stay open."""
        for key, lst in list(self.listeners.items()):
            lst.on_datagram()
            with contextlib.suppress(ValueError, OSError):
                self.loop.remove_reader(lst.sock.fileno())
            lst.sock.close()
            del self.listeners[key]

    def awaiting(self, now: float) -> bool:
        """A session forwarded a datagram whose reply has not come yet (within the idle
        timeout: a later reply would find no session anyway)."""
        return any(
            s.sent > s.answered and now - s.sent < self.idle_timeout for s in self.sessions.values()
        )

    def close_all(self) -> None:
        for session in list(self.sessions.values()):
            self.close_session(session)
        for key in list(self.listeners):
            self.remove_listener(key)
        for sock in self._handoff_socks.values():
            if sock is not None:
                sock.close()
        self._handoff_socks.clear()
