"""Proof that nothing but kproxy changed the kernel's nf_tables ruleset since a full read.

The kernel moves a network namespace's nf_tables generation by one for every committed
batch, anyone's (NftNetlink.generation). A dataplane starts custody when a full sync reads
the kernel, and wraps each of its own writes in own_commits(): custody survives a write only
if the generation moved by exactly the write's own commits. While custody holds the kernel
provably holds what the dataplane last wrote, so a periodic full sync need only write what
changed. Anything else (another program's commit, a failed write, a gap in the chain)
ends it until the next full read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

GENERATION_MODULO = 1 << 32  # the kernel's counter is 32 bits wide


class Custody:
    def __init__(self, read_generation: Callable[[], int | None]) -> None:
        self._read = read_generation
        self.at: int | None = None  # the generation at which the kernel was as we believe

    def begin(self) -> None:
        """A full read of the kernel starts now (what it sees is what we will believe)."""
        self.at = self._read()

    def end(self) -> None:
        self.at = None

    def holds(self) -> bool:
        return self.at is not None and self._read() == self.at

    @contextmanager
    def own_commits(self, count: Callable[[], int]) -> Iterator[None]:
        """Around one of our writes; count() (called after it) is how many batches it
        committed. Custody holds afterwards only if the generation moved by exactly that."""
        before = self._read() if self.at is not None else None
        if before is None or before != self.at:
            self.at = None  # someone else committed since our last step
            yield
            return
        try:
            yield
        except BaseException:
            self.at = None
            raise
        after = self._read()
        ok = after is not None and (after - before) % GENERATION_MODULO == count()
        self.at = after if ok else None
