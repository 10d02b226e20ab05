"""userspace mode's UDP engine on loopback: draining the listeners when the mode leaves, and
the sockets hand-off replies go from. No namespace: every socket is on 127.0.0.1."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time

import pytest

from kproxy.dataplane.userspace.balancer import Balancer
from kproxy.dataplane.userspace.render import HANDOFF_MARK, Listener
from kproxy.dataplane.userspace.udp import UdpEngine

KEY = "default/dns:udp/cluster"
# SO_MARK and IP_TRANSPARENT need CAP_NET_ADMIN; CI runs as root.
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs CAP_NET_ADMIN")


def udp_socket(port: int = 0) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
    sock.bind(("127.0.0.1", port))
    return sock


def engine_for(
    loop: asyncio.AbstractEventLoop, endpoint: tuple[str, int], destinations: tuple[str, ...]
) -> UdpEngine:
    balancer = Balancer(seed=1)
    listener = Listener(
        key=KEY,
        service="default/dns:udp",
        protocol="udp",
        scope="cluster",
        port=0,
        targets=(endpoint,),
        destinations=destinations,
    )
    balancer.configure([listener], local_cidrs=None, node_addresses=["127.0.0.1"])
    return UdpEngine(loop, balancer)


def test_drain_forwards_what_is_queued_then_closes_the_listeners_and_keeps_sessions(
    loop: asyncio.AbstractEventLoop,
) -> None:
    endpoint, listen, client = udp_socket(), udp_socket(), udp_socket()
    engine = engine_for(loop, endpoint.getsockname(), ("10.96.0.10:53",))
    try:
        engine.add_listener(KEY, listen)
        # Queued on the listener, never read by the (not running) loop.
        client.sendto(b"query-1", listen.getsockname())
        client.sendto(b"query-2", listen.getsockname())
        engine.drain_listeners()
        assert engine.listeners == {} and listen.fileno() == -1, "the listener is closed"
        endpoint.settimeout(2)
        got = [endpoint.recvfrom(100)[0] for _ in range(2)]
        assert got == [b"query-1", b"query-2"], "both queued datagrams were forwarded"
        assert engine.stats.datagrams == 2 and engine.stats.sessions == 1
        # The session stays for the reply it waits for.
        assert engine.awaiting(time.monotonic())
        assert list(engine.sessions) == [(KEY, client.getsockname())]
    finally:
        engine.close_all()
        for s in (endpoint, listen, client):
            s.close()


@needs_root
def test_handoff_socket_is_bound_to_the_one_destination_marked_and_kept(
    loop: asyncio.AbstractEventLoop,
) -> None:
    endpoint = udp_socket()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        free_port = probe.getsockname()[1]
    engine = engine_for(loop, endpoint.getsockname(), (f"127.0.0.1:{free_port}",))
    try:
        assert engine.handoff_socket(KEY) is None, "no hand-off in progress: no socket"
        engine.handoff = True
        sock = engine.handoff_socket(KEY)
        assert sock is not None
        assert sock.getsockname() == ("127.0.0.1", free_port)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_MARK) == HANDOFF_MARK
        assert engine.handoff_socket(KEY) is sock, "one socket per listener"
        engine.close_all()
        assert sock.fileno() == -1, "closed with the engine"
    finally:
        engine.close_all()
        endpoint.close()


@needs_root
def test_handoff_replies_keep_the_listener_path_for_several_or_unusable_destinations(
    loop: asyncio.AbstractEventLoop, caplog: pytest.LogCaptureFixture
) -> None:
    endpoint = udp_socket()
    several = engine_for(loop, endpoint.getsockname(), ("10.96.0.10:53", "192.0.2.7:53"))
    broken = engine_for(loop, endpoint.getsockname(), ("256.0.0.1:53",))
    try:
        several.handoff = broken.handoff = True
        assert several.handoff_socket(KEY) is None
        with caplog.at_level(logging.WARNING, logger="kproxy.userspace.udp"):
            assert broken.handoff_socket(KEY) is None
        assert "cannot send the hand-off replies of default/dns:udp/cluster" in caplog.text
        assert broken.handoff_socket(KEY) is None and caplog.text.count("cannot send") == 1
    finally:
        several.close_all()
        broken.close_all()
        endpoint.close()


def test_handoff_peers_parse_only_well_formed_entries() -> None:
    from kproxy.dataplane.userspace.udp import handoff_peers

    raw = {"10.100.0.2:45328": 41053, "bad": 1, "10.0.0.1:x": 2, "10.0.0.1:5": 70000}
    assert handoff_peers(raw) == {("10.100.0.2", 45328): 41053}
    assert handoff_peers(None) == {} and handoff_peers(["x"]) == {}


@needs_root
def test_a_handoff_reply_goes_to_the_port_the_client_sent_from(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """conntrack remapped the client's port for the redirect (seen: 41053 -> 45328): an
    untracked hand-off reply to the port the worker saw would never reach the client."""
    endpoint, listen, seen, own = udp_socket(), udp_socket(), udp_socket(), udp_socket()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        service_port = probe.getsockname()[1]
    engine = engine_for(loop, endpoint.getsockname(), (f"127.0.0.1:{service_port}",))
    try:
        engine.add_listener(KEY, listen)
        seen.sendto(b"query", listen.getsockname())  # the worker sees this port
        engine.drain_listeners()
        endpoint.settimeout(2)
        _data, backend = endpoint.recvfrom(100)
        engine.handoff = True
        engine.handoff_peers = {seen.getsockname(): own.getsockname()[1]}
        endpoint.sendto(b"answer", backend)
        (session,) = engine.sessions.values()
        deadline = time.monotonic() + 2
        while engine.stats.replies == 0 and time.monotonic() < deadline:
            session.on_reply()
        own.settimeout(2)
        data, sender = own.recvfrom(100)
        assert data == b"answer" and sender == ("127.0.0.1", service_port)
        seen.setblocking(False)
        with pytest.raises(BlockingIOError):
            seen.recv(100)
    finally:
        engine.close_all()
        for s in (endpoint, listen, seen, own):
            s.close()


def test_sweep_relays_a_reply_that_arrived_during_a_stall_and_counts_the_unanswered(
    loop: asyncio.AbstractEventLoop,
) -> None:
    endpoint, listen, client = udp_socket(), udp_socket(), udp_socket()
    engine = engine_for(loop, endpoint.getsockname(), ("10.96.0.10:53",))
    try:
        engine.add_listener(KEY, listen)
        client.sendto(b"query", listen.getsockname())
        engine.listeners[KEY].on_datagram()
        endpoint.settimeout(2)
        data, backend = endpoint.recvfrom(100)
        endpoint.sendto(b"answer", backend)
        time.sleep(0.05)  # the reply waits in the session's socket; the loop never ran
        # The loop wakes after a stall longer than the idle timeout: the sweep runs first.
        engine.sweep(time.monotonic() + 2 * engine.idle_timeout)
        client.settimeout(2)
        assert client.recvfrom(100)[0] == b"answer", "the queued reply reached the client"
        assert engine.stats.expired_unanswered == 0

        # An endpoint that never answers: the session expires owing a reply, and is counted.
        engine.sweep(time.monotonic() + 2 * engine.idle_timeout)
        assert engine.sessions == {}, "the answered session expired normally"
        client.sendto(b"query-2", listen.getsockname())
        engine.listeners[KEY].on_datagram()
        assert endpoint.recvfrom(100)[0] == b"query-2"
        engine.sweep(time.monotonic() + 2 * engine.idle_timeout)
        assert engine.sessions == {} and engine.stats.expired_unanswered == 1
    finally:
        engine.close_all()
        for s in (endpoint, listen, client):
            s.close()
