"""Reading a KubeProxyConfiguration: the file, strict YAML, then defaulting and validation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kproxy.config.defaulting import apply_go_defaults
from kproxy.config.problems import ConfigError, show_value
from kproxy.config.schema import API_VERSION, KIND, ProxyConfig
from kproxy.config.structure import validate_structure
from kproxy.config.validation import validate_config


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (upstream's strict decoding does too)."""


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        try:
            first = seen.get(key)
        except TypeError:
            continue  # unhashable key: construct_mapping reports it
        if first is not None:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"duplicate key {key!r} (first at line {first + 1})",
                key_node.start_mark,
            )
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_config(path: str | Path | None) -> ProxyConfig:
    """Load a configuration file; None gives upstream's defaults (for flags to apply to)."""
    if path is None:
        return ProxyConfig()
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(str(path), [f"cannot read file: {err.strerror or err}"]) from err
    except UnicodeDecodeError as err:
        raise ConfigError(str(path), [f"not UTF-8 text: {err}"]) from err
    return parse_config(text, source=str(path))


def parse_config(text: str, source: str = "<config>") -> ProxyConfig:
    """Parse, default and validate a KubeProxyConfiguration given as YAML or JSON text."""
    try:
        raw = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass
    except yaml.MarkedYAMLError as err:
        raise ConfigError(source, [_yaml_problem(err)]) from err
    except yaml.YAMLError as err:
        raise ConfigError(source, [f"not valid YAML: {err}"]) from err
    if raw is None:
        raise ConfigError(source, [f"empty document: expected a {KIND}"])
    if not isinstance(raw, dict):
        raise ConfigError(source, [f"<root>: must be a mapping (a {KIND} object)"])
    _check_type_meta(raw, source)

    raw = apply_go_defaults(raw)
    problems: list[str] = []
    config = validate_structure(raw, problems)
    if config is not None:
        problems.extend(validate_config(config))
    if problems:
        raise ConfigError(source, problems)
    assert config is not None
    config._source = source
    return config


def _yaml_problem(err: yaml.MarkedYAMLError) -> str:
    mark = err.problem_mark or err.context_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    what = err.problem or "invalid YAML"
    if err.context:
        what = f"{err.context}: {what}"
    return f"{where}{what}"


def _check_type_meta(raw: dict[str, Any], source: str) -> None:
    # A wrong apiVersion/kind means the rest follows another schema: report only this.
    problems = []
    for key, want in (("apiVersion", API_VERSION), ("kind", KIND)):
        got = raw.get(key)
        if got is None:
            problems.append(f"{key}: Required value: must be {want!r}")
        elif got != want:
            problems.append(f"{key}: Invalid value: {show_value(got)}: must be {want!r}")
    if problems:
        raise ConfigError(source, problems)
