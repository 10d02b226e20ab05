"""How long kproxy waits for the kernel's answer to a netlink request (nf_tables, IPVS).

The kernel handles a request inside send() and queues its answer before send() returns, so
a long wait means the answer will not come (it was dropped, or the request was never
handled). Without a bound the sync waiting for it would hold the loop's lock for good: no
later sync, no mode switch, and no failure in status or metrics to say why. Past the bound
the request fails as a tool past the tool timeout does: the sync counts as failed, the last
good rules stay, and it is retried after syncPeriod.

Upstream sets socket timeouts on its IPVS netlink socket for the same reason, but retries a
receive that timed out, so there a lost answer still blocks its sync.
"""

from __future__ import annotations

import socket
import struct
from typing import Final

# A small request's answer; a batch of megabytes gets more (the kernel's work grows with it).
BASE_SECONDS: Final = 10.0
BYTES_PER_SECOND: Final = 1_000_000


def answer_timeout(nbytes: int = 0) -> float:
    """Seconds to wait for the answer to a request of `nbytes`."""
    return BASE_SECONDS + nbytes / BYTES_PER_SECOND


def bound_blocking_waits(sock: socket.socket, seconds: float) -> None:
    """A blocking `sock` whose send and receive fail (BlockingIOError, EAGAIN) after
    `seconds` instead of waiting for ever. Kernel socket timeouts rather than
    sock.settimeout(): no poll() before every call (each a host round trip in UML)."""
    whole = int(seconds)
    value = struct.pack("@ll", whole, int((seconds - whole) * 1_000_000))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
