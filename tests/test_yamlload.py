"""kproxy.sources.yamlload gives exactly what PyYAML's safe loader gives (timestamps as
strings), for generated documents and for the YAML features it hands back to PyYAML."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from kproxy.sources.yamlload import (
    MAX_ALIAS_NODES,
    MAX_DEPTH,
    LimitExceeded,
    Loader,
    _may_nest_deep,
    check_depth,
    load_all,
)


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
        # duplicate keys: the later one wins
        "a: 1\na: 2\n",
        # several documents, one empty
        "a: 1\n---\n---\nb: [1, 2]\n",
    ],
)
def test_features_load_the_same(text: str) -> None:
    fast, ref = both(text)
    assert fast == ref
    if text.startswith("a: &x"):
        assert fast[0]["a"] is fast[0]["b"]


def test_unhashable_keys_are_refused_like_pyyaml() -> None:
    text = "? [1, 2]\n: x\n"
    with pytest.raises(yaml.constructor.ConstructorError):
        list(yaml.load_all(text, Loader=Loader))


# --- limits: whatever the text, data or a YAMLError naming the line, never a crash ------------


def laughs(levels: int, width: int = 10, merge: bool = False) -> str:
    """Nested aliases: each level lists the previous one `width` times ("billion laughs")."""
    lines = ["kind: Service", "metadata: {name: l}", "spec:"]
    lines.append(f"  a0: &a0 [{', '.join('x' * width)}]")
    for i in range(1, levels):
        refs = ", ".join([f"*a{i - 1}"] * width)
        lines.append(f"  a{i}: &a{i} [{refs}]")
    if merge:  # a merge key sends the document to PyYAML's constructor: limited there too
        lines += ["  base: &b {x: 1}", "  derived: {<<: *b}"]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("merge", [False, True])
def test_alias_expansion_is_bounded_by_nodes_not_only_depth(merge: bool) -> None:
    # 10**9 nodes once expanded, in 9 short lines: refused quickly, naming a line.
    with pytest.raises(LimitExceeded, match=f"more than {MAX_ALIAS_NODES} nodes") as err:
        load_all(laughs(9, merge=merge))
    assert err.value.problem_mark is not None and 4 <= err.value.problem_mark.line + 1 <= 9
    # A few levels stay well within: aliases are fine in moderation, as in Kubernetes.
    (doc,) = load_all(laughs(3, merge=merge))
    assert doc["spec"]["a2"][0] is doc["spec"]["a1"]


@pytest.mark.parametrize("merge", [False, True])
def test_recursive_alias_is_refused_as_kubernetes_refuses_it(merge: bool) -> None:
    text = "kind: Service\nmetadata: {name: r}\nspec: &a\n  x: *a\n"
    if merge:
        text += "  y: {<<: {z: 1}}\n"
    with pytest.raises(LimitExceeded, match="recursive alias"):
        load_all(text)
    with pytest.raises(LimitExceeded, match="recursive alias"):
        load_all("&a [*a]\n")


def deep_flow(n: int) -> str:
    return "a: " + "[" * n + "]" * n + "\n"


def deep_block(n: int) -> str:
    return "a:\n" + "".join("  " * i + "- x\n" + "  " * i + "-\n" for i in range(n))


def deep_compact(n: int) -> str:
    return "- " * n + "x\n"


@pytest.mark.parametrize("make", [deep_flow, deep_block, deep_compact])
def test_nesting_is_bounded(make: Any) -> None:
    assert load_all(make(MAX_DEPTH - 1))  # the limit is not off by one
    with pytest.raises(LimitExceeded, match=f"more than {MAX_DEPTH} levels") as err:
        load_all(make(MAX_DEPTH + 1))
    assert err.value.problem_mark is not None


@pytest.mark.parametrize("make", [deep_flow, deep_compact])
def test_nesting_that_would_crash_the_c_composer_is_refused_before_it(make: Any) -> None:
    # PyYAML's C composer recurses in C: around 30,000 levels it ended the process with a
    # segmentation fault. In a subprocess, so that a regression fails this test, not the run.
    code = (
        "import sys\n"
        "from kproxy.sources.yamlload import LimitExceeded, load_all\n"
        "try:\n"
        "    load_all(sys.stdin.read())\n"
        "except LimitExceeded as e:\n"
        "    print('refused', e.problem_mark.line + 1)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], input=make(300_000), capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("refused 1")


@pytest.mark.parametrize("brk", ["\n", "\r", "\x85", "\u2028", "\u2029"])
def test_the_cheap_depth_bound_sees_every_kind_of_line_break(brk: str) -> None:
    # YAML 1.1 also breaks lines at CR, NEL, LS and PS: a deep line after any of them must
    # be checked on the parser's events before the composer sees it.
    assert _may_nest_deep("a: 1" + brk + deep_compact(300))
    assert not _may_nest_deep("a: 1" + brk + deep_compact(20))


def test_check_depth_of_json_data() -> None:
    ok: Any = []
    for _ in range(MAX_DEPTH - 1):
        ok = [ok]
    check_depth(ok)
    with pytest.raises(ValueError, match=f"more than {MAX_DEPTH} levels"):
        check_depth({"a": [ok, ok]})
