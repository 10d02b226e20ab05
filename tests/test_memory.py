"""kproxy.memory: handing freed heap back (glibc only; elsewhere both calls do nothing)."""

from __future__ import annotations

from kproxy.memory import _libc, release_free_heap, use_single_arena


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
