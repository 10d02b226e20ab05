"""Structural errors: what pydantic rejects (types, unknown fields), told in the file's terms.

Fields with structural errors are dropped and validation is retried, so that the semantic
checks still run on everything else and all problems are reported at once.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

from kproxy.config.problems import show_value, suggest
from kproxy.config.schema import FROM_FILE, ProxyConfig


def validate_structure(raw: dict[str, Any], problems: list[str]) -> ProxyConfig | None:
    """Pydantic validation; on errors, also returns a best-effort config for semantic checks."""
    context = {FROM_FILE: True}
    data = raw
    for attempt in range(3):
        try:
            return ProxyConfig.model_validate(data, context=context, by_name=False)
        except ValidationError as err:
            errors = err.errors()
        if attempt == 0:
            problems.extend(_structural_problem(e) for e in errors)
        data = copy.deepcopy(data)
        for e in errors:
            _delete_path(data, e["loc"])
    return None


def _delete_path(data: Any, loc: tuple[Any, ...]) -> None:
    # A bad list item drops the whole list: a list with holes is worse than the default.
    keys: list[str] = []
    for part in loc:
        if not isinstance(part, str):
            break
        keys.append(part)
    node = data
    for key in keys[:-1]:
        node = node.get(key) if isinstance(node, dict) else None
    if isinstance(node, dict) and keys:
        node.pop(keys[-1], None)


_TYPE_MESSAGES = {
    "int_type": "must be an integer",
    "int_from_float": "must be an integer",
    "string_type": "must be a string",
    "bool_type": "must be true or false",
    "float_type": "must be a number",
    "tuple_type": "must be a list",
    "list_type": "must be a list",
    "dict_type": "must be a mapping",
    "model_type": "must be a mapping",
    "model_attributes_type": "must be a mapping",
    "greater_than_equal": "must fit in a 32-bit signed integer",
    "less_than_equal": "must fit in a 32-bit signed integer",
}


def _structural_problem(error: Mapping[str, Any]) -> str:
    loc = tuple(error["loc"])
    path = _format_path(loc)
    if error["type"] == "extra_forbidden":
        hint = suggest(str(loc[-1]), _known_fields(loc[:-1]))
        return f"{path}: unknown field" + (f" (did you mean {hint!r}?)" if hint else "")
    why = _TYPE_MESSAGES.get(error["type"], error["msg"])
    return f"{path}: Invalid value: {show_value(error.get('input'))}: {why}"


def _known_fields(loc: tuple[Any, ...]) -> list[str]:
    model: type[BaseModel] = ProxyConfig
    for part in loc:
        field = next((f for f in model.model_fields.values() if f.alias == part), None)
        if field is None:
            field = model.model_fields.get(str(part))
        annotation = field.annotation if field else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return [f.alias or name for name, f in model.model_fields.items()]


def _format_path(loc: Iterable[Any]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "<root>"
