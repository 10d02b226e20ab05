"""userspace mode's open-file budget: listeners first, connections in what is left, the
worker's own reserve always free (a worker out of descriptors could not report back: a
switch to userspace at 10,000 services in UML timed out that way). No namespace: the
worker test's sockets are on 127.0.0.1."""

from __future__ import annotations

import asyncio
import resource
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kproxy.dataplane.userspace import fdlimit, worker
from kproxy.dataplane.userspace.render import Listener
from kproxy.dataplane.userspace.tcp import TcpEngine
from kproxy.dataplane.userspace.udp import UdpEngine

LIMITS = """\
Limit                     Soft Limit           Hard Limit           Units
Max processes             95000                95000                processes
Max open files            {soft:<20} {hard:<20} files
"""


def status_text(caps: int) -> str:
    return f"Name:\tkproxy\nCapInh:\t0000000000000000\nCapEff:\t{caps:016x}\n"


def test_the_budget_puts_listeners_first_and_keeps_the_reserve() -> None:
    limit = 4096
    room = fdlimit.listener_room(limit)
    assert room == limit - fdlimit.RESERVE - fdlimit.MIN_CONNECTIONS * fdlimit.FDS_PER_CONNECTION
    assert fdlimit.connection_room(limit, room) == fdlimit.MIN_CONNECTIONS
    assert fdlimit.connection_room(limit, 0) == (limit - fdlimit.RESERVE) // 2
    assert fdlimit.connection_room(100, 500) == 0
    assert fdlimit.needed(10_000, 8192) == 10_000 + 2 * 8192 + fdlimit.RESERVE


def test_process_limits_are_read_like_proc_shows_them() -> None:
    all_caps = (1 << 41) - 1
    no_resource = all_caps & ~(1 << fdlimit.CAP_SYS_RESOURCE)  # this sandbox's root
    lim = fdlimit.parse_process_limit(
        LIMITS.format(soft=1024, hard=4096), status_text(all_caps), "1048576\n"
    )
    assert lim == fdlimit.ProcessLimit(1024, 4096, True, 1048576)
    assert lim.reachable == 1048576
    lim = fdlimit.parse_process_limit(
        LIMITS.format(soft=20000, hard=20000), status_text(no_resource), "1048576"
    )
    assert lim is not None and not lim.can_raise_hard and lim.reachable == 20000
    lim = fdlimit.parse_process_limit(
        LIMITS.format(soft="unlimited", hard="unlimited"), status_text(0), None
    )
    assert lim is not None and lim.hard is None and lim.reachable == 1 << 20
    assert fdlimit.parse_process_limit("Max processes 1 1 processes\n", "", None) is None


def test_lift_raises_the_soft_limit_and_never_lowers_it() -> None:
    # In a child: this process's limits stay as they are.
    code = (
        "import resource; from kproxy.dataplane.userspace import fdlimit\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))\n"
        "print(fdlimit.lift(500), fdlimit.lift(100), fdlimit.lift(hard if hard > 0 else 1024))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    expected_hard = hard if hard != resource.RLIM_INFINITY else 1024
    assert [int(x) for x in out] == [500, 500, expected_hard]


def loopback_listener(protocol: str, _port: int) -> socket.socket:
    kind = socket.SOCK_STREAM if protocol == "tcp" else socket.SOCK_DGRAM
    sock = socket.socket(socket.AF_INET, kind)
    sock.bind(("127.0.0.1", 0))
    if protocol == "tcp":
        sock.listen(8)
    sock.setblocking(False)
    return sock


def test_a_worker_at_its_limit_refuses_the_listeners_past_it_and_still_reports(
    tmp_path: Path, loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    limit = fdlimit.RESERVE + fdlimit.MIN_CONNECTIONS * fdlimit.FDS_PER_CONNECTION + 3
    monkeypatch.setattr(fdlimit, "lift", lambda want: limit)
    monkeypatch.setattr(worker, "open_listener", loopback_listener)
    w = worker.Worker(tmp_path, 0, max_connections=1000)
    w.dir.mkdir(parents=True)
    w.tcp = TcpEngine(loop, w.balancer, max_connections=1000)
    w.udp = UdpEngine(loop, w.balancer, max_sessions=1000)
    listeners = [
        Listener(
            f"default/s{i}:http/tcp/cluster",
            f"default/s{i}:http",
            "tcp",
            "cluster",
            20000 + i,
            (("10.244.0.2", 8080),),
        ).to_json()
        for i in range(5)
    ]
    try:
        w.apply({"generation": 7, "workers": 1, "listeners": listeners})
        assert len(w.listening) == 3
        assert w.generation == 7  # applied and written: the controller hears of it
        refused = sorted(w.errors)
        assert refused == [listeners[3]["key"], listeners[4]["key"]]
        assert set(w.error_kinds.values()) == {"fd-limit"}
        assert "open-file limit" in w.errors[refused[0]]
        status = w.status()
        assert status["fd_limit"] == limit and status["error_kinds"] == w.error_kinds
        # Connections get what the listeners leave.
        assert w.tcp.max_connections == fdlimit.MIN_CONNECTIONS
        assert w.udp.max_sessions == fdlimit.MIN_CONNECTIONS
    finally:
        w.tcp.close_listeners()
        w.udp.close_all()
