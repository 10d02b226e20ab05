"""Objects made inside another network namespace without moving any thread of ours there.

setns(2) with CLONE_NEWNET moves only the calling thread, so a short-lived thread enters the
namespace, makes the object (a socket stays bound to the namespace it was created in for its
whole life) and ends. pyroute2 forks a helper for this instead: a fork of the whole process,
whose interpreter exit runs the parent's atexit handlers.
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Final, TypeVar

NETNS_DIR: Final = Path("/run/netns")
CLONE_NEWNET: Final = 0x40000000

T = TypeVar("T")


def netns_path(netns: str) -> Path:
    """A namespace given by name (under /run/netns) or by the path of its file."""
    return Path(netns) if netns.startswith("/") else NETNS_DIR / netns


def enter_netns(netns: str) -> None:
    """Move the calling thread into `netns`. Only for threads made for that purpose."""
    libc = ctypes.CDLL(None, use_errno=True)
    path = netns_path(netns)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"setns into {path}: {os.strerror(code)}")
    finally:
        os.close(fd)


def made_in_netns(netns: str | None, make: Callable[[], T]) -> T:
    """`make()` called from a thread inside `netns` (None: called here, in ours)."""
    if netns is None:
        return make()
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            enter_netns(netns)
            result.append(make())
        except BaseException as err:  # handed to the caller below
            failure.append(err)

    thread = threading.Thread(target=run, name=f"kproxy-netns-{netns}")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


def socket_in_netns(netns: str | None, family: int, kind: int, proto: int = 0) -> socket.socket:
    """A socket created in `netns` (None: the caller's namespace)."""
    return made_in_netns(netns, lambda: socket.socket(family, kind, proto))
