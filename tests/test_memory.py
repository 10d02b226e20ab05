"""kproxy.memory: handing freed heap back (glibc only; elsewhere both calls do nothing), and
the cyclic collector paused during syncs and kept off what a full sync leaves."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from kproxy.memory import (
    _libc,
    collector_paused,
    release_free_heap,
    settle_after_full_sync,
    use_single_arena,
)


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """Give the test process its collector back as it was."""
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    if enabled:
        gc.enable()


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_release_free_heap_returns_freed_small_allocations() -> None:
    if _libc() is None:
        assert release_free_heap() == 0.0
        return
    # 200,000 blocks of 1 KiB (above pymalloc's limit, so in glibc's heap), one in 64 kept:
    # the ~200 MB freed between the kept ones stays in the process until it is trimmed.
    blocks = [b"x" * 1024 + i.to_bytes(4, "little") for i in range(200_000)]
    keep = blocks[::64]
    del blocks
    before = _rss_kb()
    release_free_heap()
    after = _rss_kb()
    assert before - after > 100_000, (before, after)
    assert len(keep) == 3125


def test_use_single_arena_is_accepted_by_glibc() -> None:
    assert use_single_arena() == (_libc() is not None)


def test_collector_paused_restores_the_collector_even_on_errors(unfrozen: None) -> None:
    gc.enable()
    with pytest.raises(RuntimeError), collector_paused():
        assert not gc.isenabled()
        raise RuntimeError("a failed sync")
    assert gc.isenabled()
    gc.disable()
    with collector_paused():
        pass
    assert not gc.isenabled()  # paused by someone else: left so


def test_settle_collects_young_cycles_and_freezes_the_survivors(unfrozen: None) -> None:
    class Node:
        other: object = None

    with collector_paused():
        kept = [Node() for _ in range(1000)]
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle: only the collector frees it
        cycle = weakref.ref(a)
        del a, b
        assert cycle() is not None  # the paused collector has not freed it
        before = gc.get_freeze_count()
        settle_after_full_sync()
    assert cycle() is None
    assert gc.get_freeze_count() >= before + len(kept)
