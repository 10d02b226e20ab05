"""The daemon's heap: giving what a full sync freed back to the kernel, and keeping the
cyclic garbage collector off the long-lived state.

A full sync at 10,000 services builds ~33 MB of restore text and rule strings and drops them
when it is done. glibc keeps freed memory in the process unless it sits at the top of the
heap, so without this the daemon's RSS stays at its full-sync peak (about 30 MB more at
10,000 services; bench/membreak.py measures it).

glibc also gives every thread that allocates its own arena, and what a thread frees there
stays mapped even through malloc_trim (measured: the leftover scan, run in its own thread
at start, kept 30 MB at 10,000 services). The daemon's threads allocate little and seldom,
so it uses a single arena (as MALLOC_ARENA_MAX=1 does).

Python's cyclic collector runs whenever enough container objects were allocated, and its
oldest generation holds everything the daemon keeps (the tracker's objects, the planner's
blocks, the kernel mirror: millions of objects at 10,000 services). A full sync allocates
hundreds of thousands of tuples, and each collection then walks that whole heap, though
nearly everything a sync leaves behind is freed by reference counting. So a sync runs with
the collector paused, and what a full sync leaves alive is frozen (gc.freeze) out of later
collections: those walk only what changed since.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

log = logging.getLogger("kproxy.memory")


@cache
def _libc() -> Any | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        return libc if hasattr(libc, "malloc_trim") else None
    except (OSError, AttributeError):
        return None  # not glibc (musl has no malloc_trim): nothing to do


_M_ARENA_MAX = -8  # mallopt parameter number, from glibc's malloc.h


def use_single_arena() -> bool:
    """Make every thread allocate from the main arena (call before starting threads)."""
    libc = _libc()
    return bool(libc is not None and libc.mallopt(_M_ARENA_MAX, 1))


def release_free_heap() -> float:
    """malloc_trim(0): return free heap pages to the kernel. Seconds it took (0 without glibc)."""
    libc = _libc()
    if libc is None:
        return 0.0
    started = time.monotonic()
    libc.malloc_trim(0)
    took = time.monotonic() - started
    log.debug("returned free heap to the kernel in %.3f s", took)
    return took


@contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic garbage collection inside (a sync); the collector's state is restored."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def settle_after_full_sync() -> float:
    """After a full sync: collect the cycles among young objects (the sync's, made while
    the collector was paused), freeze the survivors, the daemon's long-lived state, out of
    later collections, and give free heap back. Seconds it took."""
    started = time.monotonic()
    gc.collect(1)
    gc.freeze()
    release_free_heap()
    took = time.monotonic() - started
    log.debug("settled the heap after a full sync in %.3f s", took)
    return took
