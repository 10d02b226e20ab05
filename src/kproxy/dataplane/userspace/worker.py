"""The forwarding process of userspace mode: `python -m kproxy.dataplane.userspace.worker`.

One worker per core, each with its own SO_REUSEPORT listener on every proxy port, so the
kernel spreads connections over them. A worker applies the listener table it finds in its
state folder (control.py), reports what it applied, and forwards (tcp.py, udp.py). It runs
in its own session and never depends on the controller being alive.

It exits on SIGTERM (closing its listeners, then giving open connections a short grace
period), when the table tells it to, when the state folder disappears, or when the named
network namespace it was started in is deleted (so a lab teardown cannot leave it behind).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import errno
import gc
import logging
import os
import signal
import socket
import struct
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kproxy.dataplane.userspace import fdlimit
from kproxy.dataplane.userspace.balancer import Balancer
from kproxy.dataplane.userspace.control import (
    REPORT_SIGNAL,
    SUBDIR,
    TABLE_FILE,
    proc_starttime,
    read_json,
    write_json_atomic,
)
from kproxy.dataplane.userspace.render import Listener
from kproxy.dataplane.userspace.tcp import HAVE_SPLICE, TcpEngine
from kproxy.dataplane.userspace.udp import UdpEngine, handoff_peers
from kproxy.host.netns import NETNS_DIR
from kproxy.text import log_to_stderr

log = logging.getLogger("kproxy.userspace.worker")

TABLE_POLL = 0.1
HOUSEKEEPING = 2.0
EXIT_CHECK = 0.25
DRAIN_GRACE = 2.0
BACKLOG = 4096
SO_ATTACH_REUSEPORT_CBPF = 51
SO_DETACH_REUSEPORT_BPF = 52


# --- ClientIP affinity across workers ---------------------------------------------------------


def _client_ip_program(workers: int) -> tuple[bytes, ctypes.Array[ctypes.c_char]]:
    """Classic BPF for SO_ATTACH_REUSEPORT_CBPF: socket index = source IPv4 % workers.

    Every connection of one client then lands in the same worker, whose affinity table is
    therefore exact (a worker restart reshuffles the mapping once)."""
    skf_net_off = -0x100000
    insns = [
        (0x20, 0, 0, (skf_net_off + 12) & 0xFFFFFFFF),  # ld [net + 12]: source address
        (0x94, 0, 0, workers),  # a %= workers
        (0x16, 0, 0, 0),  # ret a
    ]
    code = b"".join(struct.pack("HBBI", *i) for i in insns)
    buf = ctypes.create_string_buffer(code, len(code))
    return struct.pack("HL", len(insns), ctypes.addressof(buf)), buf


def attach_client_ip_steering(sock: socket.socket, workers: int) -> None:
    prog, _keep = _client_ip_program(max(1, workers))
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_REUSEPORT_CBPF, prog)


def detach_steering(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, SO_DETACH_REUSEPORT_BPF, 0)


def open_listener(protocol: str, port: int) -> socket.socket:
    kind = socket.SOCK_STREAM if protocol == "tcp" else socket.SOCK_DGRAM
    sock = socket.socket(socket.AF_INET, kind)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("0.0.0.0", port))
        if protocol == "tcp":
            # Accepted sockets inherit it: no setsockopt per connection.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.listen(BACKLOG)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def connection_counts(tcp: TcpEngine, udp: UdpEngine) -> dict[str, dict[str, list[int]]]:
    """Open connections per listener key and endpoint "ip:port": [active, inactive].

    As ipvsadm counts them: a TCP connection with both directions open is active; one still
    dialling its endpoint or half closed is inactive, and so is every UDP session."""
    out: dict[str, dict[str, list[int]]] = {}
    for conn in tcp.conns:
        if conn.bsock is None or not conn.attempt or conn.closed:
            continue
        ip, port = conn.plan[conn.attempt - 1]
        up, down = conn.up, conn.down
        active = up is not None and down is not None and not (up.eof or down.eof)
        slot = out.setdefault(conn.key, {}).setdefault(f"{ip}:{port}", [0, 0])
        slot[0 if active else 1] += 1
    for session in udp.sessions.values():
        ip, port = session.endpoint
        out.setdefault(session.key, {}).setdefault(f"{ip}:{port}", [0, 0])[1] += 1
    return out


def own_netns_name() -> str | None:
    """The /run/netns name of the namespace this process runs in, if it has one."""
    try:
        ino = os.stat("/proc/self/ns/net").st_ino
        for entry in NETNS_DIR.iterdir():
            with contextlib.suppress(OSError):
                if entry.stat().st_ino == ino:
                    return entry.name
    except OSError:
        pass
    return None


class Worker:
    def __init__(
        self,
        state_dir: Path,
        index: int,
        *,
        splice: bool = HAVE_SPLICE,
        max_connections: int = fdlimit.DEFAULT_MAX_CONNECTIONS,
        udp_idle_timeout: float = 0.25,
    ) -> None:
        self.state_dir = state_dir
        self.dir = state_dir / SUBDIR
        self.index = index
        self.splice = splice
        self.max_connections = max_connections
        self.udp_idle_timeout = udp_idle_timeout
        self.pid = os.getpid()
        self.starttime = proc_starttime(self.pid) or 0
        self.generation = -1
        self.errors: dict[str, str] = {}
        # Why each listener in errors failed: "in-use" (the controller moves it to another
        # port), "fd-limit" or "other" (a failed sync that says why).
        self.error_kinds: dict[str, str] = {}
        self.fd_limit = 0
        self.listening: dict[str, tuple[str, int, bool]] = {}  # key -> (proto, port, steered)
        self.workers = 1
        self._table_sig: tuple[int, int, int] | None = None
        self._stop: asyncio.Event | None = None
        self.exit_reason = ""
        self.drain = True
        self.netns = own_netns_name()
        self.netns_ino = os.stat("/proc/self/ns/net").st_ino
        self.balancer = Balancer()
        self.tcp: TcpEngine | None = None
        self.udp: UdpEngine | None = None
        self.uvloop = False

    @property
    def status_path(self) -> Path:
        return self.dir / f"worker-{self.index}.json"

    @property
    def report_path(self) -> Path:
        return self.dir / f"report-{self.index}.json"

    # --- main loop ---------------------------------------------------------------------------

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self.uvloop = type(loop).__module__.startswith("uvloop")
        self._stop = asyncio.Event()
        self.tcp = TcpEngine(
            loop, self.balancer, splice=self.splice, max_connections=self.max_connections
        )
        self.udp = UdpEngine(
            loop,
            self.balancer,
            idle_timeout=self.udp_idle_timeout,
            max_sessions=self.max_connections,
        )
        loop.add_signal_handler(signal.SIGHUP, self.reload, True)
        loop.add_signal_handler(REPORT_SIGNAL, self.write_report)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop, f"signal {sig.name}")
        self.reload(True)
        self.write_status()
        log.info(
            "worker %d up (pid %d, %s, %s engine, netns %s)",
            self.index,
            self.pid,
            "uvloop" if self.uvloop else "asyncio",
            "splice" if self.tcp.splice else "copy",
            self.netns or "-",
        )
        last_house = last_check = time.monotonic()
        sweep = max(0.02, min(TABLE_POLL, self.udp_idle_timeout / 2))
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), sweep)
            if self._stop.is_set():
                break
            now = time.monotonic()
            self.udp.sweep(now)
            self.reload()
            if now - last_check >= EXIT_CHECK:
                last_check = now
                self.check_exit()
            if now - last_house >= HOUSEKEEPING:
                last_house = now
                self.balancer.prune(now)
                # File I/O off the event loop: a slow disk must not stall forwarding.
                status = self.status()
                await loop.run_in_executor(None, self._write, status)
        await self.shutdown()

    def stop(self, reason: str, *, drain: bool = True) -> None:
        if self._stop is not None and not self._stop.is_set():
            self.exit_reason = reason
            self.drain = drain
            log.info("worker %d stopping: %s", self.index, reason)
            self._stop.set()

    def check_exit(self) -> None:
        """Nobody can reach or manage this worker any more: exit without draining."""
        if not self.dir.is_dir():
            self.stop(f"state folder {self.dir} is gone", drain=False)
            return
        if self.netns is not None:
            try:
                gone = (NETNS_DIR / self.netns).stat().st_ino != self.netns_ino
            except OSError:
                gone = True
            if gone:
                self.stop(f"network namespace {self.netns} was deleted", drain=False)

    async def shutdown(self) -> None:
        assert self.tcp is not None and self.udp is not None
        self.tcp.close_listeners()
        # What reached a UDP listener before the mode left is still answered (udp.py).
        self.udp.drain_listeners()
        deadline = time.monotonic() + (DRAIN_GRACE if self.drain else 0.0)
        while time.monotonic() < deadline and (
            self.tcp.conns or self.udp.awaiting(time.monotonic())
        ):
            await asyncio.sleep(0.02)
        self.udp.close_all()
        self.tcp.abort_all()
        for path in (self.status_path, self.report_path):
            with contextlib.suppress(OSError):
                status = read_json(path)
                if isinstance(status, dict) and status.get("pid") == self.pid:
                    path.unlink()
        log.info("worker %d exited: %s", self.index, self.exit_reason)

    # --- the table ---------------------------------------------------------------------------

    def reload(self, force: bool = False) -> None:
        path = self.dir / TABLE_FILE
        try:
            st = path.stat()
        except OSError:
            return
        sig = (st.st_ino, st.st_mtime_ns, st.st_size)
        if sig == self._table_sig and not force:
            return
        table = read_json(path)
        if not isinstance(table, dict):
            return  # half-written by hand? the controller always renames a complete file
        self._table_sig = sig
        self.apply(table)

    def apply(self, table: dict[str, Any]) -> None:
        assert self.tcp is not None and self.udp is not None
        generation = int(table.get("generation", 0))
        self.workers = int(table.get("workers", 1))
        if table.get("stop") or self.index >= self.workers:
            self.stop("the table says this worker is not needed")
            return
        listeners = [Listener.from_json(item) for item in table.get("listeners", ())]
        self.udp.handoff = bool(table.get("udp_handoff"))
        self.udp.handoff_peers = handoff_peers(table.get("udp_handoff_peers"))
        self.balancer.configure(
            listeners,
            local_cidrs=table.get("local_cidrs"),
            masquerade_all=bool(table.get("masquerade_all")),
            node_addresses=table.get("node_addresses", ()),
        )
        wanted = {lst.key: lst for lst in listeners}
        # Close what is gone (or moved) first, so a port handed to another key is free.
        for key, (proto, port, _steered) in list(self.listening.items()):
            lst = wanted.get(key)
            if lst is None or lst.protocol != proto or lst.port != port:
                self._close(key, proto)
        errors: dict[str, str] = {}
        kinds: dict[str, str] = {}
        self.fd_limit = limit = fdlimit.lift(fdlimit.needed(len(wanted), self.max_connections))
        room = fdlimit.listener_room(limit)
        for key, lst in wanted.items():
            steer = lst.affinity is not None and self.workers > 1
            current = self.listening.get(key)
            if current is not None:
                if current[2] != steer:
                    self._steer(key, lst, steer)
                continue
            if len(self.listening) >= room:
                errors[key] = (
                    f"cannot listen on {lst.protocol} port {lst.port}: no file descriptor "
                    f"left (open-file limit {limit}, room for {room} listeners; raise the "
                    "proxy's LimitNOFILE / ulimit -n)"
                )
                kinds[key] = "fd-limit"
                continue
            try:
                sock = open_listener(lst.protocol, lst.port)
                if steer:
                    attach_client_ip_steering(sock, self.workers)
            except OSError as exc:
                errors[key] = f"cannot listen on {lst.protocol} port {lst.port}: {exc}"
                kinds[key] = _error_kind(exc)
                continue
            if lst.protocol == "tcp":
                self.tcp.add_listener(key, sock)
            else:
                self.udp.add_listener(key, sock)
            self.listening[key] = (lst.protocol, lst.port, steer)
        self.udp.retarget()
        # Connections get what the listeners leave (never more than asked for).
        cap = max(1, min(self.max_connections, fdlimit.connection_room(limit, len(self.listening))))
        self.tcp.max_connections = self.udp.max_sessions = cap
        self.errors = errors
        self.error_kinds = kinds
        for msg in errors.values():
            log.error("%s", msg)
        self.generation = generation
        self.write_status()

    def _sock(self, key: str, proto: str) -> socket.socket | None:
        assert self.tcp is not None and self.udp is not None
        if proto == "tcp":
            return self.tcp.listeners.get(key)
        lst = self.udp.listeners.get(key)
        return lst.sock if lst is not None else None

    def _steer(self, key: str, lst: Listener, steer: bool) -> None:
        sock = self._sock(key, lst.protocol)
        if sock is None:
            return
        if steer:
            with contextlib.suppress(OSError):
                attach_client_ip_steering(sock, self.workers)
        else:
            detach_steering(sock)
        self.listening[key] = (lst.protocol, lst.port, steer)

    def _close(self, key: str, proto: str) -> None:
        assert self.tcp is not None and self.udp is not None
        if proto == "tcp":
            self.tcp.remove_listener(key)  # open connections keep draining
        else:
            self.udp.remove_listener(key)
        self.listening.pop(key, None)

    # --- status ------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        assert self.tcp is not None and self.udp is not None
        t, u = self.tcp.stats, self.udp.stats
        return {
            "index": self.index,
            "pid": self.pid,
            "starttime": self.starttime,
            "generation": self.generation,
            "listeners": len(self.listening),
            "errors": self.errors,
            "error_kinds": self.error_kinds,
            "fd_limit": self.fd_limit,
            "loop": "uvloop" if self.uvloop else "asyncio",
            "engine": "splice" if self.tcp.splice else "copy",
            "netns": self.netns,
            "tcp": {
                "active": len(self.tcp.conns),
                "accepted": t.accepted,
                "dial_failures": t.dial_failures,
                "unreachable": t.unreachable,
                "no_endpoints": t.no_endpoints,
                "capped": t.capped,
                "paused": self.tcp.paused,
                "transparent_errors": t.transparent_errors,
            },
            "udp": {
                "sessions": len(self.udp.sessions),
                "sessions_total": u.sessions_total,
                "datagrams": u.datagrams,
                "replies": u.replies,
                "dropped": u.dropped,
                "expired_unanswered": u.expired_unanswered,
            },
            "updated": time.time(),
            "reports": 1,  # answers REPORT_SIGNAL (see control.py)
        }

    def report(self) -> dict[str, Any]:
        """What `kproxy list` / `kproxy trace` ask for: open connections per listener and
        endpoint, and the ClientIP affinity entries (service -> client -> endpoint, age)."""
        assert self.tcp is not None and self.udp is not None
        now = time.monotonic()
        affinity = {
            service: {
                client: [entry.endpoint[0], entry.endpoint[1], round(now - entry.last_used, 3)]
                for client, entry in table.items()
            }
            for service, table in self.balancer.affinity.items()
            if table
        }
        return {
            "index": self.index,
            "pid": self.pid,
            "starttime": self.starttime,
            "generation": self.generation,
            "time": time.time(),
            "conns": connection_counts(self.tcp, self.udp),
            "affinity": affinity,
        }

    def write_report(self) -> None:
        try:
            write_json_atomic(self.report_path, self.report())
        except OSError as exc:
            log.warning("cannot write report: %s", exc)

    def write_status(self) -> None:
        self._write(self.status())

    def _write(self, status: dict[str, Any]) -> None:
        try:
            write_json_atomic(self.status_path, status)
        except OSError as exc:
            log.warning("cannot write status: %s", exc)


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop  # type: ignore[import-not-found]
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()  # type: ignore[no-any-return]


def _error_kind(exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return "in-use"
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        return "fd-limit"
    return "other"


def raise_fd_limit(max_connections: int) -> int:
    """Lift the open-file limit for the connections asked for (the listeners are added
    per table, Worker.apply); returns how many connections fit."""
    soft = fdlimit.lift(fdlimit.needed(0, max_connections))
    return max(1, min(max_connections, fdlimit.connection_room(soft, 0)))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="kproxy userspace-mode worker")
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--index", type=int, required=True)
    # The environment defaults exist for benchmarks and debugging (no controller flag).
    engine = os.environ.get("KPROXY_USERSPACE_ENGINE") or ("splice" if HAVE_SPLICE else "copy")
    parser.add_argument("--engine", choices=("splice", "copy"), default=engine)
    parser.add_argument("--max-connections", type=int, default=fdlimit.DEFAULT_MAX_CONNECTIONS)
    parser.add_argument("--udp-idle-timeout", type=float, default=0.25)
    parser.add_argument(
        "--nice",
        type=int,
        default=int(os.environ.get("KPROXY_USERSPACE_NICE", "0")),
        help="scheduling niceness (negative: woken ahead of ordinary work)",
    )
    parser.add_argument(
        "--no-uvloop",
        action="store_true",
        default=os.environ.get("KPROXY_USERSPACE_LOOP") == "asyncio",
    )
    args = parser.parse_args(argv)
    log_to_stderr(logging.INFO, f"%(asctime)s %(levelname).1s worker-{args.index}: %(message)s")
    if args.nice:
        # Every forwarded byte waits for this process to be scheduled (the in-kernel paths run
        # in softirq context). Off by default: -5 and -20 made no measurable difference to
        # the tail latency in the lab (bench/results/userspace.md).
        try:
            os.setpriority(os.PRIO_PROCESS, 0, args.nice)
        except OSError as exc:
            log.warning("cannot set niceness %d: %s", args.nice, exc)
    max_connections = raise_fd_limit(args.max_connections)
    if max_connections < args.max_connections:
        log.warning(
            "the fd limit allows only %d connections (asked for %d)",
            max_connections,
            args.max_connections,
        )
    worker = Worker(
        args.state_dir,
        args.index,
        splice=args.engine == "splice",
        max_connections=max_connections,
        udp_idle_timeout=args.udp_idle_timeout,
    )
    # Everything allocated so far lives as long as the process: keep it out of every
    # future garbage collection.
    gc.freeze()
    loop = asyncio.new_event_loop() if args.no_uvloop else _new_loop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(worker.run())
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
