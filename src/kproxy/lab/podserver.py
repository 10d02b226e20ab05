"""A tiny pod workload: answers "<pod name> <peer ip>" over TCP and UDP.

Run inside a pod namespace:
    ip netns exec NS python -m kproxy.lab.podserver --name pod1 --tcp 8080,9090 --udp 8080

The reply names both the pod that answered and the source address the pod saw, so tests can
check load balancing and source NAT (masquerade vs. preserved client IP) from one line.

TCP: a first line starting with "GET " gets an HTTP/1.0 response (for curl/wrk-style
clients) and the connection closes; anything else makes the connection long-lived and every
received line is answered. UDP: every datagram is answered.

Prints "ready" on stdout once every listener is bound, which is what the lab waits for.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import socket
import sys
from collections.abc import Sequence
from typing import cast

# Clients such as wrk open many connections at once; asyncio's default backlog (100) would
# make SYNs queue up and distort benchmark latencies.
BACKLOG = 4096
# Bounds how long an HTTP client may dribble headers before we answer anyway.
HEADER_TIMEOUT = 2.0


def reply_line(name: str, peer: str) -> bytes:
    return f"{name} {peer}\n".encode()


def http_response(body: bytes) -> bytes:
    head = (
        "HTTP/1.0 200 OK\r\n"
        "Content-Type: text/plain\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body


def _peer_ip(peername: object) -> str:
    if isinstance(peername, tuple) and peername:
        return str(peername[0])
    return "?"


class PodServer:
    def __init__(self, name: str, tcp_ports: Sequence[int], udp_ports: Sequence[int]) -> None:
        self.name = name
        self.tcp_ports = tuple(tcp_ports)
        self.udp_ports = tuple(udp_ports)

    async def _handle_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        reply = reply_line(self.name, _peer_ip(writer.get_extra_info("peername")))
        try:
            line = await reader.readline()
            if line.startswith(b"GET "):
                await self._drain_headers(reader)
                writer.write(http_response(reply))
                await writer.drain()
                return
            while line:
                writer.write(reply)
                await writer.drain()
                line = await reader.readline()
        except (ConnectionError, asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    @staticmethod
    async def _drain_headers(reader: asyncio.StreamReader) -> None:
        # Closing with unread request bytes makes the kernel send RST instead of FIN, and an
        # RST can destroy the response in the client's receive queue.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(HEADER_TIMEOUT):
                while True:
                    header = await reader.readline()
                    if header in (b"", b"\r\n", b"\n"):
                        return

    async def start(self) -> list[asyncio.AbstractServer | asyncio.DatagramTransport]:
        loop = asyncio.get_running_loop()
        handles: list[asyncio.AbstractServer | asyncio.DatagramTransport] = []
        for port in self.tcp_ports:
            server = await asyncio.start_server(
                self._handle_tcp, "0.0.0.0", port, backlog=BACKLOG, reuse_address=True
            )
            handles.append(server)
        for port in self.udp_ports:
            transport, _ = await loop.create_datagram_endpoint(
                lambda: _UdpEcho(self.name), local_addr=("0.0.0.0", port), family=socket.AF_INET
            )
            handles.append(transport)
        return handles


class _UdpEcho(asyncio.DatagramProtocol):
    def __init__(self, name: str) -> None:
        self.name = name
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # The selector transport is not a DatagramTransport subclass on every Python version.
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | object, int]) -> None:
        if self.transport is not None:
            self.transport.sendto(reply_line(self.name, _peer_ip(addr)), addr)

    def error_received(self, exc: Exception) -> None:
        # An ICMP error for an earlier reply must not stop the server.
        pass


def parse_ports(text: str) -> tuple[int, ...]:
    ports = tuple(int(p) for p in text.split(",") if p.strip())
    for port in ports:
        if not 0 < port < 65536:
            raise argparse.ArgumentTypeError(f"invalid port {port}")
    return ports


async def _serve(server: PodServer) -> None:
    handles = await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print("ready", flush=True)
    await stop.wait()
    for handle in handles:
        handle.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="kproxy lab pod server")
    parser.add_argument("--name", required=True, help="pod name put in every reply")
    parser.add_argument("--tcp", type=parse_ports, default=(8080, 9090), help="e.g. 8080,9090")
    parser.add_argument("--udp", type=parse_ports, default=(8080,), help="e.g. 8080")
    args = parser.parse_args(argv)
    asyncio.run(_serve(PodServer(args.name, args.tcp, args.udp)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
