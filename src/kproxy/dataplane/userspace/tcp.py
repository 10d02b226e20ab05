"""TCP forwarding in a worker: accept, dial with retries, pump both directions.

The pump works on raw file descriptors with the event loop's add_reader/add_writer (no
asyncio transports or streams: fewer Python layers per byte). Two engines share it:

* splice (default where os.splice exists): socket -> pipe -> socket with os.splice, so the
  payload never enters Python; a small pool of pipe pairs is reused between connections.
* copy: recv_into a shared scratch buffer and send; only an unsent remainder is kept.

Backpressure: each direction holds at most one chunk (64 KiB, the pipe's capacity) that the
destination has not taken; while it does, the source is not read, so the kernel's socket
buffers and TCP windows push back on the sender. Nothing is buffered without bound.

Dials follow upstream's userspace proxy: up to four attempts with timeouts 250 ms, 500 ms,
1 s and 2 s, moving on to the next endpoint after each failure. The client's connection is
accepted first, so the client waits (it does not fail) while a dead endpoint is skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

from kproxy.dataplane.userspace.balancer import DIAL_TIMEOUTS, Addr, Balancer

log = logging.getLogger("kproxy.userspace.tcp")

CHUNK = 65536
ACCEPT_BATCH = 64
PIPE_POOL = 256
CAP_LOG_INTERVAL = 10.0  # seconds between two "connection limit reached" lines
IP_TRANSPARENT = getattr(socket, "IP_TRANSPARENT", 19)
IP_BIND_ADDRESS_NO_PORT = getattr(socket, "IP_BIND_ADDRESS_NO_PORT", 24)
LINGER_RST = struct.pack("ii", 1, 0)
HAVE_SPLICE = hasattr(os, "splice")
_SPLICE_FLAGS = (
    (os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK) if HAVE_SPLICE else 0  # type: ignore[attr-defined]
)
_AF_INET = socket.AF_INET
_STREAM = socket.SOCK_STREAM
_STREAM_NB = socket.SOCK_STREAM | socket.SOCK_NONBLOCK
_IPPROTO_TCP = socket.IPPROTO_TCP
_TCP_NODELAY = socket.TCP_NODELAY
_SOL_SOCKET = socket.SOL_SOCKET
_SO_ERROR = socket.SO_ERROR
_SO_LINGER = socket.SO_LINGER
_SOL_IP = socket.SOL_IP


@dataclass
class TcpStats:
    accepted: int = 0
    active: int = 0
    dial_failures: int = 0  # single attempts that failed (then retried)
    unreachable: int = 0  # connections closed because no endpoint answered
    no_endpoints: int = 0
    capped: int = 0  # times the connection cap paused accepting
    transparent_errors: int = 0


class PipePool:
    """Reusable non-blocking pipe pairs for splice (an empty pipe is as good as new)."""

    def __init__(self, size: int = PIPE_POOL) -> None:
        self.size = size
        self.free: list[tuple[int, int]] = []

    def get(self) -> tuple[int, int]:
        if self.free:
            return self.free.pop()
        return os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def put(self, pipe: tuple[int, int]) -> None:
        if len(self.free) < self.size:
            self.free.append(pipe)
        else:
            os.close(pipe[0])
            os.close(pipe[1])

    def close(self) -> None:
        for r, w in self.free:
            os.close(r)
            os.close(w)
        self.free.clear()


class Pump:
    """One direction of a connection: src fd -> dst fd."""

    __slots__ = ("conn", "dsock", "dst", "eof", "loop", "paused", "pending", "pipe", "rest", "src")

    def __init__(
        self, conn: TcpConn, src: int, dsock: socket.socket, pipe: tuple[int, int] | None
    ) -> None:
        self.conn = conn
        self.loop = conn.loop
        self.src = src
        self.dsock = dsock
        self.dst = dsock.fileno()
        self.pipe = pipe
        self.pending = 0  # bytes in the pipe (splice)
        self.rest: memoryview | None = None  # unsent bytes (copy)
        self.eof = False
        self.paused = False

    # splice engine ------------------------------------------------------------------------

    def splice_readable(self) -> None:
        # A pipe is held only while bytes are in flight: idle connections hold none.
        pipes = self.conn.engine.pipes
        pipe = pipes.get()
        try:
            n = os.splice(self.src, pipe[1], CHUNK, flags=_SPLICE_FLAGS)
        except BlockingIOError:
            pipes.put(pipe)
            return
        except OSError as exc:
            pipes.put(pipe)
            if exc.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                self.conn.engine.splice_unsupported(exc)
                self.loop.add_reader(self.src, self.copy_readable)  # replaces this reader
                self.copy_readable()
                return
            self.conn.abort()
            return
        if n == 0:
            pipes.put(pipe)
            self._on_eof()
            return
        self.pipe = pipe
        self.pending = n
        self.splice_flush()

    def splice_flush(self) -> None:
        pipe = self.pipe
        assert pipe is not None
        pending = self.pending
        while pending:
            try:
                pending -= os.splice(pipe[0], self.dst, pending, flags=_SPLICE_FLAGS)
            except BlockingIOError:
                self.pending = pending
                self._pause(self.splice_flush)
                return
            except OSError:
                self.pending = pending
                self.conn.abort()
                return
        self.pending = 0
        self.pipe = None
        self.conn.engine.pipes.put(pipe)
        self._drained(self.splice_readable)

    # copy engine --------------------------------------------------------------------------

    def copy_readable(self) -> None:
        view = self.conn.engine.scratch_view
        try:
            n = os.readv(self.src, [view])
        except BlockingIOError:
            return
        except OSError:
            self.conn.abort()
            return
        if n == 0:
            self._on_eof()
            return
        data = view[:n]
        try:
            sent = os.write(self.dst, data)
        except BlockingIOError:
            sent = 0
        except OSError:
            self.conn.abort()
            return
        if sent < n:
            self.rest = memoryview(bytes(data[sent:]))
            self._pause(self.copy_flush)

    def copy_flush(self) -> None:
        rest = self.rest
        while rest is not None and len(rest):
            try:
                rest = rest[os.write(self.dst, rest) :]
            except BlockingIOError:
                self.rest = rest
                return
            except OSError:
                self.conn.abort()
                return
        self.rest = None
        self._drained(self.copy_readable)

    # shared -------------------------------------------------------------------------------

    def _pause(self, flush: Callable[[], None]) -> None:
        if not self.paused:
            self.paused = True
            self.loop.remove_reader(self.src)
            self.loop.add_writer(self.dst, flush)

    def _drained(self, readable: Callable[[], None]) -> None:
        if self.paused:
            self.paused = False
            self.loop.remove_writer(self.dst)
            if self.eof:
                self._shutdown()
            elif not self.conn.closed:
                self.loop.add_reader(self.src, readable)
        elif self.eof:
            self._shutdown()

    def _on_eof(self) -> None:
        self.eof = True
        self.loop.remove_reader(self.src)
        if not self.paused:
            self._shutdown()

    def _shutdown(self) -> None:
        conn = self.conn
        other = conn.down if conn.up is self else conn.up
        if other is not None and other.eof and other.idle:
            conn.close()  # both directions are done: close() sends the last FIN itself
            return
        with contextlib.suppress(OSError):
            self.dsock.shutdown(socket.SHUT_WR)

    @property
    def idle(self) -> bool:
        return self.pending == 0 and self.rest is None


class TcpConn:
    """A client connection from accept to close."""

    __slots__ = (
        "attempt",
        "bsock",
        "client",
        "closed",
        "csock",
        "down",
        "engine",
        "key",
        "loop",
        "plan",
        "timer",
        "up",
    )

    def __init__(self, engine: TcpEngine, csock: socket.socket, client: Addr, key: str) -> None:
        self.engine = engine
        self.loop = engine.loop
        self.csock = csock
        self.client = client
        self.key = key
        self.bsock: socket.socket | None = None
        self.plan: list[Addr] = []
        self.attempt = 0
        self.timer: asyncio.TimerHandle | None = None
        self.up: Pump | None = None
        self.down: Pump | None = None
        self.closed = False

    # --- dialing ------------------------------------------------------------------------------

    def start(self) -> None:
        engine = self.engine
        self.plan = engine.balancer.plan(self.key, self.client[0], time.monotonic())
        if not self.plan:
            engine.stats.no_endpoints += 1
            self.abort()
            return
        self.dial()

    def dial(self) -> None:
        engine = self.engine
        while self.attempt < len(self.plan):
            ip, port = self.plan[self.attempt]
            timeout = DIAL_TIMEOUTS[self.attempt]
            self.attempt += 1
            bsock = socket.socket(_AF_INET, _STREAM_NB)
            try:
                bsock.setsockopt(_IPPROTO_TCP, _TCP_NODELAY, 1)
                state = engine.balancer.listeners.get(self.key)
                client_ip = self.client[0]
                if state is not None and engine.balancer.keep_source(state.listener, client_ip, ip):
                    engine.bind_transparent(bsock, client_ip)
                err = bsock.connect_ex((ip, port))
            except OSError as exc:
                err = exc.errno or errno.EINVAL
            if err == errno.EINPROGRESS:
                self.bsock = bsock
                self.loop.add_writer(bsock.fileno(), self._on_connect)
                self.timer = self.loop.call_later(timeout, self._on_timeout)
                return
            if err == 0:
                self.bsock = bsock
                self._connected()
                return
            bsock.close()
            engine.stats.dial_failures += 1
        engine.stats.unreachable += 1
        self.abort()

    def _on_timeout(self) -> None:
        self.timer = None
        bsock = self.bsock
        if bsock is None or self.closed:
            return
        self.loop.remove_writer(bsock.fileno())
        bsock.close()
        self.bsock = None
        self.engine.stats.dial_failures += 1
        self.dial()

    def _on_connect(self) -> None:
        bsock = self.bsock
        if bsock is None or self.closed:
            return
        self.loop.remove_writer(bsock.fileno())
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        err = bsock.getsockopt(_SOL_SOCKET, _SO_ERROR)
        if err:
            bsock.close()
            self.bsock = None
            self.engine.stats.dial_failures += 1
            self.dial()
            return
        self._connected()

    def _connected(self) -> None:
        engine = self.engine
        bsock = self.bsock
        assert bsock is not None
        engine.balancer.connected(
            self.key, self.client[0], self.plan[self.attempt - 1], time.monotonic()
        )
        cfd, bfd = self.csock.fileno(), bsock.fileno()
        if engine.splice:
            up = Pump(self, cfd, bsock, None)
            down = Pump(self, bfd, self.csock, None)
            self.up, self.down = up, down
            self.loop.add_reader(bfd, down.splice_readable)
            self.loop.add_reader(cfd, up.splice_readable)
            up.splice_readable()  # the request is usually there already
        else:
            up = Pump(self, cfd, bsock, None)
            down = Pump(self, bfd, self.csock, None)
            self.up, self.down = up, down
            self.loop.add_reader(bfd, down.copy_readable)
            self.loop.add_reader(cfd, up.copy_readable)
            up.copy_readable()

    # --- closing ------------------------------------------------------------------------------

    def abort(self) -> None:
        """Close both sides with a reset (a failed side must not look like a clean EOF)."""
        for sock in (self.csock, self.bsock):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(_SOL_SOCKET, _SO_LINGER, LINGER_RST)
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        loop = self.loop
        engine = self.engine
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        cfd = self.csock.fileno()
        loop.remove_reader(cfd)
        loop.remove_writer(cfd)
        bsock = self.bsock
        if bsock is not None:
            bfd = bsock.fileno()
            loop.remove_reader(bfd)
            loop.remove_writer(bfd)
            bsock.close()
        self.csock.close()
        for pump in (self.up, self.down):
            if pump is not None and pump.pipe is not None:
                # Bytes left in the pipe would leak into the next connection: drop the pipe.
                os.close(pump.pipe[0])
                os.close(pump.pipe[1])
                pump.pipe = None
        # Break the conn <-> pump cycles: reference counting frees everything now, so the
        # cyclic garbage collector (whose pauses add tail latency) has nothing to do.
        self.up = self.down = None
        engine.closed(self)


class TcpEngine:
    """All TCP listeners and connections of a worker."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        balancer: Balancer,
        *,
        splice: bool = HAVE_SPLICE,
        max_connections: int = 8192,
    ) -> None:
        self.loop = loop
        self.balancer = balancer
        self.splice = splice and HAVE_SPLICE
        self.max_connections = max_connections
        self.stats = TcpStats()
        self.pipes = PipePool()
        self.scratch = bytearray(CHUNK)
        self.scratch_view = memoryview(self.scratch)
        self.listeners: dict[str, socket.socket] = {}
        self.conns: set[TcpConn] = set()
        self.paused = False
        self._transparent_ok = True
        self._cap_logged = -CAP_LOG_INTERVAL

    # --- listeners ----------------------------------------------------------------------------

    def add_listener(self, key: str, sock: socket.socket) -> None:
        self.listeners[key] = sock
        if not self.paused:
            self.loop.add_reader(sock.fileno(), self._accept, sock, key)

    def remove_listener(self, key: str) -> None:
        sock = self.listeners.pop(key, None)
        if sock is not None:
            self.loop.remove_reader(sock.fileno())
            sock.close()

    def _accept(self, lsock: socket.socket, key: str) -> None:
        conns = self.conns
        stats = self.stats
        for _ in range(ACCEPT_BATCH):
            if len(conns) >= self.max_connections:
                self._pause()
                return
            try:
                fd, addr = lsock._accept()  # type: ignore[attr-defined]
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                # EMFILE/ENFILE/ENOBUFS: the connection waits in the backlog; try later.
                log.warning("accept on %s failed: %s", key, exc)
                self._pause(retry=0.1)
                return
            # TCP_NODELAY is inherited from the listener (set once in worker.open_listener).
            csock = socket.socket(_AF_INET, _STREAM, 0, fd)
            csock.setblocking(False)
            stats.accepted += 1
            conn = TcpConn(self, csock, addr, key)
            conns.add(conn)
            conn.start()

    def _pause(self, retry: float | None = None) -> None:
        if self.paused:
            return
        self.paused = True
        self.stats.capped += 1
        for sock in self.listeners.values():
            self.loop.remove_reader(sock.fileno())
        if retry is not None:
            self.loop.call_later(retry, self._resume)
            return
        now = time.monotonic()
        if now - self._cap_logged >= CAP_LOG_INTERVAL:
            self._cap_logged = now
            log.warning(
                "connection limit reached: %d concurrent connections in this worker; new "
                "connections wait in the listen backlog until some close (reached %d times "
                "so far; the worker's --max-connections sets the limit)",
                self.max_connections,
                self.stats.capped,
            )

    def _resume(self) -> None:
        if not self.paused:
            return
        self.paused = False
        for key, sock in self.listeners.items():
            self.loop.add_reader(sock.fileno(), self._accept, sock, key)
        log.info("accepting again (%d connections)", len(self.conns))

    def closed(self, conn: TcpConn) -> None:
        self.conns.discard(conn)
        if self.paused and len(self.conns) < self.max_connections * 0.9:
            self._resume()

    def splice_unsupported(self, exc: OSError) -> None:
        """The kernel refuses splice on these sockets: copy from now on."""
        if self.splice:
            self.splice = False
            log.warning("splice is not supported here (%s); forwarding by copying", exc)

    def bind_transparent(self, sock: socket.socket, client_ip: str) -> None:
        """Make `sock` carry the client's address (needs CAP_NET_ADMIN and the policy route)."""
        if not self._transparent_ok:
            return
        try:
            sock.setsockopt(_SOL_IP, IP_TRANSPARENT, 1)
            sock.setsockopt(_SOL_IP, IP_BIND_ADDRESS_NO_PORT, 1)
            sock.bind((client_ip, 0))
        except OSError as exc:
            # The socket stays usable: it connects from the node's address instead.
            self.stats.transparent_errors += 1
            if exc.errno == errno.EPERM:
                self._transparent_ok = False
                log.warning(
                    "cannot keep client addresses (IP_TRANSPARENT: %s); connections to "
                    "endpoints come from the node from now on",
                    exc,
                )

    # --- shutdown -----------------------------------------------------------------------------

    def close_listeners(self) -> None:
        for key in list(self.listeners):
            self.remove_listener(key)

    def abort_all(self) -> None:
        for conn in list(self.conns):
            conn.abort()
        self.pipes.close()
