"""Throw-away network namespaces (kpb-<random>) and the kernel-quiet wait between loads.

Every load the bench measures runs inside a namespace created here; the host's own
namespace is never touched. Namespaces are deleted in `finally`, and an atexit hook plus
SIGTERM handling remove any that are still listed if the run is interrupted.
"""

from __future__ import annotations

import atexit
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

PREFIX = "kpb-"
_created: set[str] = set()


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def create() -> str:
    name = PREFIX + secrets.token_hex(4)
    _ip("netns", "add", name)
    _created.add(name)
    try:
        _ip("-n", name, "link", "set", "lo", "up")
    except subprocess.CalledProcessError:
        delete(name)
        raise
    return name


def delete(name: str) -> None:
    """Delete a namespace this module created (its tables are freed by the kernel later).
    Names it did not create (or already deleted) are left alone."""
    if name not in _created:
        return
    subprocess.run(["ip", "netns", "del", name], capture_output=True, text=True, check=False)
    _created.discard(name)


@contextmanager
def fresh() -> Iterator[str]:
    name = create()
    try:
        yield name
    finally:
        delete(name)


def cleanup_all() -> None:
    for name in sorted(_created):
        delete(name)


def _on_term(signum: int, frame: FrameType | None) -> None:
    cleanup_all()
    raise SystemExit(128 + signum)


atexit.register(cleanup_all)
signal.signal(signal.SIGTERM, _on_term)


def exec_argv(ns: str, argv: list[str]) -> list[str]:
    return ["ip", "netns", "exec", ns, *argv]


# --- wait for the kernel to finish freeing deleted namespaces (lab §2.2 noise note) ---------


def _cpu_times() -> tuple[int, int]:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields), idle


def wait_quiet(
    *, busy_below: float = 0.08, window: float = 0.5, max_wait: float = 20.0, min_wait: float = 0.3
) -> float:
    """Sleep until the machine's CPUs are mostly idle for one window (the kernel frees a
    deleted namespace's big tables in a worker, which slows the next load). Returns the
    seconds waited."""
    start = time.monotonic()
    time.sleep(min_wait)
    while time.monotonic() - start < max_wait:
        total0, idle0 = _cpu_times()
        time.sleep(window)
        total1, idle1 = _cpu_times()
        span = total1 - total0
        if span <= 0 or 1 - (idle1 - idle0) / span < busy_below:
            break
    return time.monotonic() - start
