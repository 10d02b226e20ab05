"""Custody: the generation must move by exactly our own commits, or the proof is gone."""

from __future__ import annotations

import pytest

from kproxy.dataplane.custody import GENERATION_MODULO, Custody


class Counter:
    def __init__(self, value: int | None = 7) -> None:
        self.value = value

    def __call__(self) -> int | None:
        return self.value


def commit(gen: Counter, n: int = 1) -> None:
    assert gen.value is not None
    gen.value = (gen.value + n) % GENERATION_MODULO


def test_our_own_commits_keep_it_and_anyone_elses_end_it() -> None:
    gen = Counter()
    c = Custody(gen)
    assert not c.holds()  # nothing read yet
    c.begin()
    with c.own_commits(lambda: 2):
        commit(gen, 2)
    assert c.holds() and c.at == 9
    commit(gen)  # someone else
    assert not c.holds()
    with c.own_commits(lambda: 1):
        commit(gen)
    assert c.at is None, "custody broken before our write stays broken after it"


def test_a_commit_beside_ours_a_failure_or_no_generation_end_it() -> None:
    gen = Counter()
    c = Custody(gen)
    c.begin()
    with c.own_commits(lambda: 1):
        commit(gen, 2)  # ours and someone else's
    assert c.at is None
    c.begin()
    with pytest.raises(RuntimeError), c.own_commits(lambda: 0):
        raise RuntimeError("restore failed")
    assert c.at is None
    gen.value = None  # the generation cannot be read (legacy backend, no netlink)
    c.begin()
    assert not c.holds()


def test_the_counter_wraps() -> None:
    gen = Counter(GENERATION_MODULO - 1)
    c = Custody(gen)
    c.begin()
    with c.own_commits(lambda: 2):
        commit(gen, 2)
    assert c.holds() and c.at == 1
