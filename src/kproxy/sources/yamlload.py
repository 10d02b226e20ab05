"""YAML documents as plain data, faster than PyYAML's own constructor and with its result.

PyYAML's C loader parses and composes in C but builds the Python objects in Python, one
method call per node through a generic dispatch: at 10,000 services that was most of the
daemon's start (the file source read 20,000 objects in ~15 s on this machine). The builder
here walks the composed node tree directly for the tags a Kubernetes object uses (maps,
sequences, strings, ints, floats, booleans, null), with PyYAML's own scalar conversions;
any other tag, a merge key or a recursive alias sends the document to PyYAML's constructor.
Timestamps stay strings, as Kubernetes' own YAML decoding keeps them.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

_BaseLoader: type = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

_TAG = "tag:yaml.org,2002:"
_STR, _INT, _FLOAT, _BOOL, _NULL = (_TAG + t for t in ("str", "int", "float", "bool", "null"))
_MAP, _SEQ, _MERGE = _TAG + "map", _TAG + "seq", _TAG + "merge"


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

    def construct_document(self, node: Node) -> Any:
        try:
            return self._build(node, {}, set())
        except (_Unusual, RecursionError):
            return super().construct_document(node)

    def _build(self, node: Node, memo: dict[int, Any], active: set[int]) -> Any:
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
            return memo[key]  # an alias: the same object, as PyYAML gives it
        if key in active:
            raise _Unusual("recursive alias")
        active.add(key)
        out: Any
        if cls is MappingNode and node.tag == _MAP:
            out = {}
            for key_node, value_node in node.value:
                if key_node.tag == _MERGE:
                    raise _Unusual("merge key")
                k = self._build(key_node, memo, active)
                try:
                    hash(k)
                except TypeError:
                    raise _Unusual("unhashable key") from None
                out[k] = self._build(value_node, memo, active)
        elif cls is SequenceNode and node.tag == _SEQ:
            out = [self._build(child, memo, active) for child in node.value]
        else:
            raise _Unusual(node.tag)
        active.discard(key)
        memo[key] = out
        return out


Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != _TAG + "timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def load_all(text: str) -> list[Any]:
    return list(yaml.load_all(text, Loader=Loader))
