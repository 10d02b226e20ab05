"""The nftables fakes themselves: FakeTable is as strict as the kernel, sort_dump as upstream's."""

from __future__ import annotations

import pytest

from tests.support.nft_fakes import WHERE, FakeNftError, FakeTable, sort_dump


def test_fake_table_is_atomic_and_strict() -> None:
    t = FakeTable()
    t.apply(f"add table {WHERE}\nadd chain {WHERE} a\nadd chain {WHERE} b\n")
    t.apply(f"add rule {WHERE} a jump b\n")
    with pytest.raises(FakeNftError) as err:
        t.apply(f"add chain {WHERE} c\nadd rule {WHERE} c goto missing\n")
    assert err.value.line_number == 2
    assert "c" not in t.chains  # nothing of the failed transaction stayed
    with pytest.raises(FakeNftError, match="busy"):
        t.apply(f"delete chain {WHERE} b\n")
    t.apply(f"flush chain {WHERE} a\ndelete chain {WHERE} b\n")
    assert list(t.chains) == ["a"]


def test_fake_table_element_clash_needs_delete_first() -> None:
    t = FakeTable()
    t.apply(f"add table {WHERE}\nadd map {WHERE} m {{ type ipv4_addr : verdict ; }}\n")
    t.apply(f"add element {WHERE} m {{ 1.2.3.4 : drop }}\n")
    t.apply(f"add element {WHERE} m {{ 1.2.3.4 : drop }}\n")  # same value: fine
    with pytest.raises(FakeNftError, match="File exists"):
        t.apply(f"add element {WHERE} m {{ 1.2.3.4 : accept }}\n")
    t.apply(
        f"delete element {WHERE} m {{ 1.2.3.4 }}\nadd element {WHERE} m {{ 1.2.3.4 : accept }}\n"
    )
    assert t.containers["m"].values == {"1.2.3.4": "accept"}


def test_sort_dump_ignores_object_order_but_not_rule_order() -> None:
    a = f"add chain {WHERE} x\nadd rule {WHERE} x drop\nadd rule {WHERE} x accept\n"
    b = f"add rule {WHERE} x drop\nadd rule {WHERE} x accept\nadd chain {WHERE} x\n"
    assert sort_dump(a) == sort_dump(b)
    c = f"add chain {WHERE} x\nadd rule {WHERE} x accept\nadd rule {WHERE} x drop\n"
    assert sort_dump(a) != sort_dump(c)
