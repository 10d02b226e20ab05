"""kproxy.dataplane.nfqueue: message parsing (no root) and, in a namespace, packets that
wait until release() and then all arrive, in order (real kernel queue)."""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import pytest

from kproxy.dataplane.ipvs.nlsock import NLMSG_HDR, nla
from kproxy.dataplane.nfqueue import (
    MSG_PACKET,
    MSG_VERDICT,
    NFGENMSG,
    PACKET_HDR,
    PacketHold,
    packet_ids,
)


def packet_message(packet_id: int, queue: int = 7) -> bytes:
    body = NFGENMSG.pack(socket.AF_INET, 0, queue) + nla(
        PACKET_HDR, struct.pack("!IHB", packet_id, 0x0800, 0)
    )
    return NLMSG_HDR.pack(NLMSG_HDR.size + len(body), MSG_PACKET, 0, 0, 0) + body


def test_packet_ids_are_read_from_every_packet_message_of_a_datagram() -> None:
    other = NFGENMSG.pack(0, 0, 7) + nla(PACKET_HDR, struct.pack("!IHB", 99, 0, 0))
    not_a_packet = NLMSG_HDR.pack(NLMSG_HDR.size + len(other), MSG_VERDICT, 0, 0, 0) + other
    data = packet_message(3) + not_a_packet + packet_message(4)
    assert packet_ids(data) == [3, 4]
    assert packet_ids(b"") == []
    assert packet_ids(packet_message(5)[:-4]) == []  # a truncated header is skipped


# --- in a namespace --------------------------------------------------------------------------

QUEUE = 2901
PORT = 9999
RECEIVER = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("127.0.0.1", int(sys.argv[2])))
s.settimeout(float(sys.argv[1]))
print("ready", flush=True)
while True:
    try:
        data = s.recv(100)
    except TimeoutError:
        break
    print(f"{time.monotonic():.6f} {data.decode()}", flush=True)
"""


@pytest.fixture
def netns() -> Iterator[str]:
    name = f"kpq-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=False)


def in_ns(ns: str, *argv: str) -> None:
    subprocess.run(["ip", "netns", "exec", ns, *argv], check=True, capture_output=True)


def queue_rule(ns: str, verb: str) -> None:
    in_ns(
        ns,
        "iptables-legacy", "-t", "raw", verb, "OUTPUT", "-p", "udp", "--dport", str(PORT),
        "-j", "NFQUEUE", "--queue-num", str(QUEUE), "--queue-bypass",
    )  # fmt: skip


def send(ns: str, count: int, start: int = 0) -> None:
    code = (
        "import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        f"for i in range({start}, {start + count}):\n"
        f"    s.sendto(str(i).encode(), ('127.0.0.1', {PORT}))"
    )
    in_ns(ns, sys.executable, "-c", code)


def receiver(ns: str, quiet: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-c", RECEIVER, str(quiet), str(PORT)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def received(proc: subprocess.Popen[str]) -> list[tuple[float, str]]:
    out, _ = proc.communicate(timeout=30)
    return [(float(t), d) for t, d in (line.split() for line in out.splitlines())]


@pytest.mark.kernel
def test_held_packets_wait_for_release_then_all_arrive_in_order(netns: str) -> None:
    proc = receiver(netns, quiet=1.5)
    try:
        hold = PacketHold(QUEUE, netns).start()
        queue_rule(netns, "-I")
        send(netns, 20)
        time.sleep(0.3)
        assert hold.held == 20
        released = time.monotonic()
        hold.release()
        send(netns, 5, start=20)  # after release: accepted as they come, still in order
        queue_rule(netns, "-D")
        send(netns, 5, start=25)  # no rule any more: straight through
        hold.close()
    finally:
        got = received(proc)
    assert [d for _t, d in got] == [str(i) for i in range(30)]
    # Nothing of the first 20 arrived before release() (the clocks are the same monotonic).
    assert min(t for t, _d in got) >= released
    assert hold.passed == 5


@pytest.mark.kernel
def test_close_without_release_and_the_hold_cap_lose_nothing(netns: str) -> None:
    proc = receiver(netns, quiet=2.0)
    try:
        hold = PacketHold(QUEUE, netns, max_hold=0.5).start()
        queue_rule(netns, "-I")
        send(netns, 10)
        time.sleep(1.0)  # past max_hold: released by the reader itself
        send(netns, 3, start=10)
        hold.close()  # the rule is still there: packets must not be dropped with the queue
        send(netns, 3, start=13)  # nothing bound any more: --queue-bypass lets them pass
        queue_rule(netns, "-D")
    finally:
        got = received(proc)
    assert [d for _t, d in got] == [str(i) for i in range(16)]
    assert hold.held == 10 and hold.passed == 3


@pytest.mark.kernel
def test_a_queue_taken_by_another_socket_cannot_be_bound(netns: str) -> None:
    with PacketHold(QUEUE, netns), pytest.raises(OSError):
        PacketHold(QUEUE, netns).start()
