"""YAML documents as plain data, faster than PyYAML's own constructor and with its result.

PyYAML's C loader parses and composes in C but builds the Python objects in Python, one
method call per node through a generic dispatch: at 10,000 services that was most of the
daemon's start (the file source read 20,000 objects in ~15 s on this machine). The builder
here walks the composed node tree directly for the tags a Kubernetes object uses (maps,
sequences, strings, ints, floats, booleans, null), with PyYAML's own scalar conversions;
any other tag or a merge key sends the document to PyYAML's constructor.
Timestamps stay strings, as Kubernetes' own YAML decoding keeps them.

Whatever the text, loading ends in data or a yaml.YAMLError naming the line: nesting is
bounded (MAX_DEPTH), and so is what aliases expand to (MAX_ALIAS_NODES: a few lines of
nested aliases, "billion laughs", would otherwise stand for billions of nodes once anything
walks the data); a recursive alias is refused, as Kubernetes' YAML decoder refuses it. Depth
is checked before PyYAML's C composer sees the text, because that recursion in C ends the
process, not in an exception, some ten thousand levels down.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import yaml
from yaml.error import Mark
from yaml.events import MappingEndEvent, MappingStartEvent, SequenceEndEvent, SequenceStartEvent
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

_BaseLoader: type = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

_TAG = "tag:yaml.org,2002:"
_STR, _INT, _FLOAT, _BOOL, _NULL = (_TAG + t for t in ("str", "int", "float", "bool", "null"))
_MAP, _SEQ, _MERGE = _TAG + "map", _TAG + "seq", _TAG + "merge"


# Far deeper than any Kubernetes object (a Service nests about 6 levels, a CRD's schema a few
# dozen) and far from where recursion, in PyYAML's C composer or in Python, gives out.
MAX_DEPTH = 200
# Nodes that aliases may add to a file beyond those written out in it. Objects use aliases,
# if at all, to repeat a few labels or ports; each file gets its own allowance.
MAX_ALIAS_NODES = 1_000_000


class LimitExceeded(yaml.MarkedYAMLError):
    """The text is valid YAML but beyond what kproxy reads (depth, alias expansion)."""

    def __init__(self, problem: str, mark: Mark | None) -> None:
        super().__init__(problem=problem, problem_mark=mark)


class _Unusual(Exception):
    """The document needs PyYAML's full constructor."""


# Tags of plain scalars by their text. The safe loader has no path resolvers, so a plain
# scalar's tag depends on its text alone; the same names, protocols and ports repeat over
# every object. Cleared when it grows past _RESOLVED_MAX (IPs and names are unbounded).
_resolved: dict[str, str] = {}
_RESOLVED_MAX = 65536


class Loader(_BaseLoader):  # type: ignore[misc,valid-type]
    """Safe loader: plain data only, timestamps kept as strings."""

    def resolve(self, kind: type, value: Any, implicit: tuple[bool, bool]) -> str:
        if kind is not ScalarNode or not implicit[0] or self.yaml_path_resolvers:
            return str(super().resolve(kind, value, implicit))
        tag = _resolved.get(value)
        if tag is None:
            tag = str(super().resolve(kind, value, implicit))
            if len(_resolved) >= _RESOLVED_MAX:
                _resolved.clear()
            _resolved[value] = tag
        return tag

    _alias_nodes = 0  # nodes added by aliases so far in this stream

    def construct_document(self, node: Node) -> Any:
        spent = self._alias_nodes
        self._sizes: dict[int, int] = {}
        try:
            return self._build(node, {}, set(), 1)
        except _Unusual:
            pass
        self._alias_nodes = spent
        _measure(node, self)  # the limits, checked without building anything
        return super().construct_document(node)

    def _spend(self, nodes: int, mark: Mark | None) -> None:
        self._alias_nodes += nodes
        if self._alias_nodes > MAX_ALIAS_NODES:
            raise LimitExceeded(
                f"aliases expand to more than {MAX_ALIAS_NODES} nodes (a limit of kproxy)", mark
            )

    def _build(self, node: Node, memo: dict[int, Any], active: set[int], depth: int) -> Any:
        cls = type(node)
        if cls is ScalarNode:
            tag = node.tag
            if tag == _STR:
                return node.value
            if tag == _INT:
                return self.construct_yaml_int(node)
            if tag == _NULL:
                return None
            if tag == _BOOL:
                return self.construct_yaml_bool(node)
            if tag == _FLOAT:
                return self.construct_yaml_float(node)
            raise _Unusual(tag)
        key = id(node)
        if key in memo:
            self._spend(_size(node, self._sizes), node.start_mark)
            return memo[key]  # an alias: the same object, as PyYAML gives it
        if key in active:
            raise _recursive(node)
        if depth > MAX_DEPTH:
            raise _too_deep(node)
        active.add(key)
        out: Any
        if cls is MappingNode and node.tag == _MAP:
            out = {}
            for key_node, value_node in node.value:
                if key_node.tag == _MERGE:
                    raise _Unusual("merge key")
                k = self._build(key_node, memo, active, depth + 1)
                try:
                    hash(k)
                except TypeError:
                    raise _Unusual("unhashable key") from None
                out[k] = self._build(value_node, memo, active, depth + 1)
        elif cls is SequenceNode and node.tag == _SEQ:
            out = [self._build(child, memo, active, depth + 1) for child in node.value]
        else:
            raise _Unusual(node.tag)
        active.discard(key)
        memo[key] = out
        return out


def _children(node: Node) -> Iterator[Node]:
    if type(node) is MappingNode:
        for k, v in node.value:
            yield k
            yield v
    elif type(node) is SequenceNode:
        yield from node.value


def _size(root: Node, sizes: dict[int, int]) -> int:
    """The nodes under root, aliases expanded; memoized in sizes. Only for a node already
    built (so no alias under it leads back up), and without recursion."""
    stack = [(root, False)]
    while stack:
        node, done = stack.pop()
        if done:
            sizes[id(node)] = sum(1 + sizes.get(id(c), 0) for c in _children(node))
        elif id(node) not in sizes:
            stack.append((node, True))
            stack.extend((c, False) for c in _children(node) if type(c) is not ScalarNode)
    return sizes[id(root)]


def _recursive(node: Node) -> LimitExceeded:
    return LimitExceeded("a recursive alias (an anchor used inside itself)", node.start_mark)


def _too_deep(node: Node) -> LimitExceeded:
    return LimitExceeded(
        f"nested more than {MAX_DEPTH} levels deep (a limit of kproxy)", node.start_mark
    )


def _measure(root: Node, loader: Loader) -> None:
    """The limits of Loader._build, for a document PyYAML's constructor builds: depth,
    recursive aliases and alias expansion, walked without recursion."""
    sizes: dict[int, int] = {}
    on_path = {id(root)}
    path: list[list[Any]] = [[root, _children(root), 0]]
    while path:
        top = path[-1]
        for child in top[1]:
            if type(child) is ScalarNode:
                top[2] += 1
                continue
            cid = id(child)
            known = sizes.get(cid)
            if known is not None:  # an alias
                top[2] += known + 1
                loader._spend(known, child.start_mark)
                continue
            if cid in on_path:
                raise _recursive(child)
            if len(path) >= MAX_DEPTH:
                raise _too_deep(child)
            on_path.add(cid)
            path.append([child, _children(child), 0])
            break
        else:
            path.pop()
            on_path.discard(id(top[0]))
            sizes[id(top[0])] = top[2]
            if path:
                path[-1][2] += top[2] + 1


Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != _TAG + "timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


# Beyond this depth the text is checked on the parser's events before PyYAML's C composer
# sees it; up to it the composer is safe (well within any thread's stack), and MAX_DEPTH is
# then enforced exactly while building.
_COMPOSER_SAFE_DEPTH = 1000
# A line whose first characters are all spaces, tabs or block indicators ("- ", "? ", ": ",
# "---"): a block collection can start that far right only on such a line. Line breaks are
# YAML 1.1's.
_DEEP_LINE = re.compile(
    r"(?:^|[\n\r\x85\u2028\u2029])[-?: \t]{" + str(_COMPOSER_SAFE_DEPTH // 4) + "}"
)


def _may_nest_deep(text: str) -> bool:
    """False when the text cannot nest _COMPOSER_SAFE_DEPTH levels, cheaply: block
    collections nest at increasing columns (a sequence may share its parent mapping's
    column, so two per column), and each flow collection needs a bracket ('[]' and '{}'
    nest nothing: at most one level more)."""
    flow = text.count("[") + text.count("{") - text.count("[]") - text.count("{}")
    return flow + 1 > _COMPOSER_SAFE_DEPTH // 2 or _DEEP_LINE.search(text) is not None


def _check_depth(text: str) -> None:
    """LimitExceeded if the text nests deeper than MAX_DEPTH, found on the parser's events
    (no recursion); only for text that might nest too deep for the composer."""
    if not _may_nest_deep(text):
        return
    parser = _BaseLoader(text)
    try:
        depth = 0
        while (event := parser.get_event()) is not None:
            cls = type(event)
            if cls is MappingStartEvent or cls is SequenceStartEvent:
                depth += 1
                if depth > MAX_DEPTH:
                    raise LimitExceeded(
                        f"nested more than {MAX_DEPTH} levels deep (a limit of kproxy)",
                        event.start_mark,
                    )
            elif cls is MappingEndEvent or cls is SequenceEndEvent:
                depth -= 1
    finally:
        parser.dispose()


def load_documents(text: str) -> list[tuple[int, Any]]:
    """Every document of the text with the line it starts on; yaml.YAMLError (with the
    line) for text that is not YAML or is beyond the limits above."""
    _check_depth(text)
    loader = Loader(text)
    try:
        out = []
        while loader.check_node():
            node = loader.get_node()
            out.append((node.start_mark.line + 1, loader.construct_document(node)))
        return out
    finally:
        loader.dispose()


def load_all(text: str) -> list[Any]:
    """Every document of the text (see load_documents)."""
    return [doc for _, doc in load_documents(text)]


def check_depth(data: Any, where: str = "") -> None:
    """ValueError if data (as JSON gives it) nests deeper than MAX_DEPTH; iterative."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            value = list(value.values())
        elif not isinstance(value, list):
            continue
        if depth > MAX_DEPTH:
            raise ValueError(f"nested more than {MAX_DEPTH} levels deep (a limit of kproxy)")
        stack.extend((v, depth + 1) for v in value)
