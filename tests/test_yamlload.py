"""kproxy.sources.yamlload gives exactly what PyYAML's safe loader gives (timestamps as
strings), for generated documents and for the YAML features it hands back to PyYAML."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from kproxy.sources.yamlload import Loader


class Reference(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    pass


Reference.yaml_implicit_resolvers = Loader.yaml_implicit_resolvers


def both(text: str) -> tuple[list[Any], list[Any]]:
    return list(yaml.load_all(text, Loader=Loader)), list(yaml.load_all(text, Loader=Reference))


# Strings that YAML 1.1 reads as something else when plain: they must round-trip the same.
TRICKY = st.sampled_from(
    [
        "yes",
        "No",
        "on",
        "off",
        "~",
        "null",
        "0x1F",
        "0o17",
        "017",
        "1_000",
        "1:30",
        "1e3",
        ".inf",
        "-.NaN",
        "2026-12-01",
        "2026-12-01T10:00:00Z",
        "",
        " x ",
        "=",
        "<<",
        "a: b",
        "- x",
        "#c",
        "10.96.0.10",
        "8080",
        "TCP",
        "üñí",
    ]
)
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(), TRICKY
)
DATA = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(st.one_of(st.text(), TRICKY, st.integers()), inner, max_size=5),
    ),
    max_leaves=30,
)


@settings(max_examples=200, deadline=None)
@given(DATA, st.booleans())
def test_generated_documents_load_the_same(data: Any, flow: bool) -> None:
    text = yaml.safe_dump(data, default_flow_style=flow, allow_unicode=True)
    fast, ref = both(text)
    assert fast == ref


@pytest.mark.parametrize(
    "text",
    [
        # plain scalars YAML 1.1 reads as ints, floats, bools, nulls, and a timestamp
        "a: 0x1F\nb: 0o17\nc: 1_000\nd: 1:30\ne: 1e3\nf: .inf\ng: yes\nh: ~\ni: 2026-12-01\n",
        # anchors and aliases: the same object twice, as PyYAML gives it
        "a: &x {p: 1}\nb: *x\n",
        # merge keys, explicit tags, binary, sets: PyYAML's constructor takes over
        "base: &b {x: 1}\nderived:\n  <<: *b\n  y: 2\n",
        "a: !!str 10\nb: !!int '7'\n",
        "bin: !!binary aGVsbG8=\n",
        "s: !!set {a, b}\n",
        # a recursive alias
        "&a [*a]\n",
        # duplicate keys: the later one wins
        "a: 1\na: 2\n",
        # several documents, one empty
        "a: 1\n---\n---\nb: [1, 2]\n",
    ],
)
def test_features_load_the_same(text: str) -> None:
    fast, ref = both(text)
    if text.startswith("&a"):
        assert fast[0][0] is fast[0] and ref[0][0] is ref[0]
        return
    assert fast == ref
    if text.startswith("a: &x"):
        assert fast[0]["a"] is fast[0]["b"]


def test_unhashable_keys_are_refused_like_pyyaml() -> None:
    text = "? [1, 2]\n: x\n"
    with pytest.raises(yaml.constructor.ConstructorError):
        list(yaml.load_all(text, Loader=Loader))
