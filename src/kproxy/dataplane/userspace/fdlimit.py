"""The file descriptors a userspace worker needs, and its open-file limit lifted to match.

Every worker listens on every proxy port (SO_REUSEPORT), so it holds one socket per
listener, two per forwarded TCP connection and one per UDP session, plus a reserve for
its splice pipes, table and status files. At 10,000 services the listeners alone need 10,000:
more than a process gets by default (1,024 soft; a UML guest's init hands on a hard limit
of 4,096). A worker out of descriptors cannot even write the status that tells the
controller it applied the table, so the budget is planned up front: listeners first (a
service without one is down), connections in what is left, a reserve for the worker's own
files always kept free.

The preflight (ops/preflight/config_checks.py) reads the same numbers from the running
proxy's /proc entries before a switch to userspace mode.
"""

from __future__ import annotations

import contextlib
import resource
from dataclasses import dataclass
from pathlib import Path

# Connections a worker forwards at most, unless told otherwise (`--max-connections`).
DEFAULT_MAX_CONNECTIONS = 8192
# The worker's own descriptors: the splice engine's pipes (a pair per connection with bytes
# in flight, up to tcp.PIPE_POOL = 256 pairs kept for reuse), table reads, status and report
# writes, the event loop's, logging's and the executor's.
RESERVE = 1024
# Two sockets per forwarded TCP connection (client and endpoint).
FDS_PER_CONNECTION = 2
# Listeners never take the last of the room: a worker keeps at least this many
# connections' worth of descriptors, or it would listen on everything and forward nothing.
MIN_CONNECTIONS = 64

CAP_SYS_RESOURCE = 24
NR_OPEN = Path("/proc/sys/fs/nr_open")


def needed(listeners: int, connections: int) -> int:
    """Descriptors for this many listeners and connections, the reserve included."""
    return listeners + connections * FDS_PER_CONNECTION + RESERVE


def listener_room(limit: int) -> int:
    """How many listeners fit under an open-file limit (connections keep their minimum)."""
    return max(0, limit - RESERVE - MIN_CONNECTIONS * FDS_PER_CONNECTION)


def connection_room(limit: int, listeners: int) -> int:
    """How many connections fit beside `listeners` under an open-file limit."""
    return max(0, (limit - RESERVE - listeners) // FDS_PER_CONNECTION)


def _nr_open() -> int:
    """The kernel's ceiling for any process's open-file limit."""
    try:
        return int(NR_OPEN.read_text())
    except (OSError, ValueError):
        return 1 << 20


def lift(want: int) -> int:
    """Raise this process's soft open-file limit to `want`, and the hard one as well where
    the process may (CAP_SYS_RESOURCE, up to fs.nr_open); never lowers either. Returns the
    soft limit in force afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if want <= soft:
        return soft
    unlimited = hard == resource.RLIM_INFINITY
    if not unlimited and want > hard:
        with contextlib.suppress(ValueError, OSError):  # not privileged: keep the hard one
            target = min(want, _nr_open())
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, max(target, hard)))
            return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (want if unlimited else min(want, hard), hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


@dataclass(frozen=True)
class ProcessLimit:
    """A process's open-file limits as /proc shows them, and what it could raise them to."""

    soft: int | None  # None: unlimited
    hard: int | None
    can_raise_hard: bool  # CAP_SYS_RESOURCE in its effective set
    nr_open: int

    @property
    def reachable(self) -> int:
        """The highest soft limit this process (or a child it starts) can give itself."""
        if self.can_raise_hard or self.hard is None:
            return self.nr_open
        return self.hard


def _limit_value(text: str) -> int | None:
    return None if text == "unlimited" else int(text)


def parse_process_limit(limits: str, status: str, nr_open: str | None) -> ProcessLimit | None:
    """From the text of /proc/PID/limits and /proc/PID/status (None when unreadable)."""
    soft = hard = None
    found = False
    for line in limits.splitlines():
        if line.startswith("Max open files"):
            fields = line[len("Max open files") :].split()
            try:
                soft, hard = _limit_value(fields[0]), _limit_value(fields[1])
            except (IndexError, ValueError):
                return None
            found = True
    if not found:
        return None
    effective = 0
    for line in status.splitlines():
        if line.startswith("CapEff:"):
            with contextlib.suppress(ValueError):
                effective = int(line.split()[1], 16)
    try:
        ceiling = int(nr_open or "")
    except ValueError:
        ceiling = 1 << 20
    return ProcessLimit(
        soft=soft,
        hard=hard,
        can_raise_hard=bool(effective >> CAP_SYS_RESOURCE & 1),
        nr_open=ceiling,
    )
