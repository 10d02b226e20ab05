"""kube-proxy's command-line flags: their names, their parsing, and how they meet a
configuration (only --hostname-override applies over a config file; see the package's
docstring)."""

from __future__ import annotations

import csv
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kproxy.config.addresses import append_port_if_needed
from kproxy.config.durations import parse_duration
from kproxy.config.problems import ConfigError, suggest
from kproxy.config.schema import (
    DEFAULT_MODE,
    HEALTHZ_PORT,
    INT32_MAX,
    INT32_MIN,
    METRICS_PORT,
    ProxyConfig,
)
from kproxy.config.validation import validate_config

log = logging.getLogger("kproxy.config")


@dataclass(frozen=True, slots=True)
class _Flag:
    parse: Callable[[str], Any]
    # Where the value goes: (section or "", field) pairs; several for flags feeding two sections.
    targets: tuple[tuple[str, str], ...]


_BOOL_WORDS = {
    "1": True, "t": True, "T": True, "true": True, "TRUE": True, "True": True,
    "0": False, "f": False, "F": False, "false": False, "FALSE": False, "False": False,
}  # fmt: skip


def _parse_bool(text: str) -> bool:
    # strconv.ParseBool. A bare "--masquerade-all" should be passed as "true".
    if text not in _BOOL_WORDS:
        raise ValueError("must be a boolean (true or false)")
    return _BOOL_WORDS[text]


def _parse_int32(text: str) -> int:
    try:
        value = int(text, 0)
    except ValueError:
        raise ValueError("must be an integer") from None
    if not INT32_MIN <= value <= INT32_MAX:
        raise ValueError("must fit in a 32-bit signed integer")
    return value


def _parse_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError("must be a number") from None
    if not math.isfinite(value):
        raise ValueError("must be a finite number")
    return value


def _parse_port(text: str) -> int:
    value = _parse_int32(text)
    if not 0 <= value <= 65535:
        raise ValueError("must be a port (0-65535; 0 disables the server)")
    return value


def _parse_string_list(text: str) -> tuple[str, ...]:
    # pflag's StringSlice reads one CSV record; empty means an empty list.
    return tuple(next(csv.reader([text]))) if text else ()


def _parse_feature_gates(text: str) -> dict[str, bool]:
    gates: dict[str, bool] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"missing '=' in {item!r}; expected Name=true|false,...")
        gates[key.strip()] = _parse_bool(value.strip())
    return gates


def _str(text: str) -> str:
    return text


_FLAGS: dict[str, _Flag] = {
    "proxy-mode": _Flag(_str, (("", "mode"),)),
    "hostname-override": _Flag(_str, (("", "hostname_override"),)),
    "cluster-cidr": _Flag(_str, (("", "cluster_cidr"),)),
    "bind-address": _Flag(_str, (("", "bind_address"),)),
    "healthz-bind-address": _Flag(_str, (("", "healthz_bind_address"),)),
    "metrics-bind-address": _Flag(_str, (("", "metrics_bind_address"),)),
    "healthz-port": _Flag(_parse_port, ()),
    "metrics-port": _Flag(_parse_port, ()),
    "bind-address-hard-fail": _Flag(_parse_bool, (("", "bind_address_hard_fail"),)),
    "profiling": _Flag(_parse_bool, (("", "enable_profiling"),)),
    "show-hidden-metrics-for-version": _Flag(_str, (("", "show_hidden_metrics_for_version"),)),
    "feature-gates": _Flag(_parse_feature_gates, (("", "feature_gates"),)),
    "kubeconfig": _Flag(_str, (("client_connection", "kubeconfig"),)),
    "kube-api-content-type": _Flag(_str, (("client_connection", "content_type"),)),
    "kube-api-qps": _Flag(_parse_float, (("client_connection", "qps"),)),
    "kube-api-burst": _Flag(_parse_int32, (("client_connection", "burst"),)),
    "config-sync-period": _Flag(parse_duration, (("", "config_sync_period"),)),
    "nodeport-addresses": _Flag(_parse_string_list, (("", "node_port_addresses"),)),
    "oom-score-adj": _Flag(_parse_int32, (("", "oom_score_adj"),)),
    "detect-local-mode": _Flag(_str, (("", "detect_local_mode"),)),
    "pod-bridge-interface": _Flag(_str, (("detect_local", "bridge_interface"),)),
    "pod-interface-name-prefix": _Flag(_str, (("detect_local", "interface_name_prefix"),)),
    "masquerade-all": _Flag(
        _parse_bool, (("iptables", "masquerade_all"), ("nftables", "masquerade_all"))
    ),
    "iptables-masquerade-bit": _Flag(_parse_int32, (("iptables", "masquerade_bit"),)),
    "iptables-localhost-nodeports": _Flag(_parse_bool, (("iptables", "localhost_node_ports"),)),
    "iptables-sync-period": _Flag(
        parse_duration, (("iptables", "sync_period"), ("nftables", "sync_period"))
    ),
    "iptables-min-sync-period": _Flag(
        parse_duration, (("iptables", "min_sync_period"), ("nftables", "min_sync_period"))
    ),
    "ipvs-sync-period": _Flag(parse_duration, (("ipvs", "sync_period"),)),
    "ipvs-min-sync-period": _Flag(parse_duration, (("ipvs", "min_sync_period"),)),
    "ipvs-scheduler": _Flag(_str, (("ipvs", "scheduler"),)),
    "ipvs-exclude-cidrs": _Flag(_parse_string_list, (("ipvs", "exclude_cidrs"),)),
    "ipvs-strict-arp": _Flag(_parse_bool, (("ipvs", "strict_arp"),)),
    "ipvs-tcp-timeout": _Flag(parse_duration, (("ipvs", "tcp_timeout"),)),
    "ipvs-tcpfin-timeout": _Flag(parse_duration, (("ipvs", "tcp_fin_timeout"),)),
    "ipvs-udp-timeout": _Flag(parse_duration, (("ipvs", "udp_timeout"),)),
    "conntrack-max-per-core": _Flag(_parse_int32, (("conntrack", "max_per_core"),)),
    "conntrack-min": _Flag(_parse_int32, (("conntrack", "min"),)),
    "conntrack-tcp-timeout-established": _Flag(
        parse_duration, (("conntrack", "tcp_established_timeout"),)
    ),
    "conntrack-tcp-timeout-close-wait": _Flag(
        parse_duration, (("conntrack", "tcp_close_wait_timeout"),)
    ),
    "conntrack-tcp-be-liberal": _Flag(_parse_bool, (("conntrack", "tcp_be_liberal"),)),
    "conntrack-udp-timeout": _Flag(parse_duration, (("conntrack", "udp_timeout"),)),
    "conntrack-udp-timeout-stream": _Flag(parse_duration, (("conntrack", "udp_stream_timeout"),)),
}
# Flags that still apply when a config file is given.
_FLAGS_OVER_CONFIG = frozenset({"hostname-override"})
_IPTABLES_SYNC_FLAGS = frozenset({"iptables-sync-period", "iptables-min-sync-period"})
_IPVS_SYNC_FLAGS = frozenset({"ipvs-sync-period", "ipvs-min-sync-period"})
FLAG_NAMES: tuple[str, ...] = tuple(sorted(_FLAGS))

_FLAG_SOURCE = "command-line flags"


def apply_flags(config: ProxyConfig, flags: Mapping[str, str]) -> tuple[ProxyConfig, list[str]]:
    """Apply kube-proxy flags (names without dashes, string values) the way upstream does.

    If `config` came from a file (config.source is set), only --hostname-override applies and
    every other flag given is ignored; otherwise all flags apply to `config`. Returns the new
    (validated) config and the names of the ignored flags, which are also logged as a
    warning. The CLI's own flags (--config, --write-config-to, --cleanup, --init-only,
    --master, logging) are not handled here and count as unknown. Raises ConfigError for an
    unknown flag, an unparsable value, or an invalid resulting configuration.
    """
    problems: list[str] = []
    values: dict[str, Any] = {}
    for name, text in flags.items():
        flag = _FLAGS.get(name)
        if flag is None:
            hint = suggest(name, _FLAGS)
            problems.append(
                f"--{name}: unknown flag" + (f" (did you mean --{hint}?)" if hint else "")
            )
            continue
        try:
            values[name] = flag.parse(text)
        except ValueError as err:
            problems.append(f"--{name}: Invalid value: {text!r}: {err}")
    if "hostname-override" in values:
        host = values["hostname-override"].strip().lower()
        if values["hostname-override"] and not host:
            problems.append(
                "--hostname-override: Invalid value: empty hostname-override is invalid"
            )
        if not values["hostname-override"]:
            del values["hostname-override"]  # upstream: an empty flag means "not set"
        else:
            values["hostname-override"] = host
    if problems:
        raise ConfigError(_FLAG_SOURCE, problems)

    from_file = config.source is not None
    ignored: list[str] = []
    if from_file:
        ignored = [name for name in values if name not in _FLAGS_OVER_CONFIG]
        reason = f"a config file ({config.source}) is given"
    else:
        mode = values.get("proxy-mode", config.mode)
        unused = _IPVS_SYNC_FLAGS if mode != "ipvs" else _IPTABLES_SYNC_FLAGS
        ignored = [name for name in values if name in unused]
        reason = f"they have no effect in proxy mode {mode or DEFAULT_MODE!r}"
    for name in ignored:
        del values[name]
    if ignored:
        log.warning(
            "ignoring command-line flags because %s: %s",
            reason,
            ", ".join(f"--{n}" for n in ignored),
        )

    new = _with_flag_values(config, values)
    if not from_file:
        new = _apply_deprecated_ports(new, values)
    problems = validate_config(new)
    if problems:
        raise ConfigError(_FLAG_SOURCE, [_with_flag(p, values) for p in problems])
    return new, ignored


def _config_paths(name: str) -> tuple[str, ...]:
    """Where a flag's value shows in the configuration's problems ("iptables.masqueradeBit")."""
    fields = ProxyConfig.model_fields
    paths = []
    for section, field in _FLAGS[name].targets:
        if section:
            model = fields[section].annotation
            inner = model.model_fields[field]  # type: ignore[union-attr]
            paths.append(f"{fields[section].alias or section}.{inner.alias or field}")
        else:
            paths.append(fields[field].alias or field)
    return tuple(paths)


def _with_flag(problem: str, given: Mapping[str, Any]) -> str:
    """A problem of the configuration the flags made, led by the flag whose value it is."""
    path = problem.split(":", 1)[0].split("[", 1)[0]
    for name in given:
        if path in _config_paths(name):
            return f"--{name}: {problem}"
    return problem


def _with_flag_values(config: ProxyConfig, values: Mapping[str, Any]) -> ProxyConfig:
    top: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {}
    for name, value in values.items():
        for section, field in _FLAGS[name].targets:
            if section:
                sections.setdefault(section, {})[field] = value
            else:
                top[field] = value
    for section, fields in sections.items():
        top[section] = getattr(config, section).model_copy(update=fields)
    return config.model_copy(update=top)


def _apply_deprecated_ports(config: ProxyConfig, values: Mapping[str, Any]) -> ProxyConfig:
    # options.go addressFromDeprecatedFlags: port 0 disables, otherwise a bare IP gets it.
    update: dict[str, str] = {}
    for field, flag, default in (
        ("healthz_bind_address", "healthz-port", HEALTHZ_PORT),
        ("metrics_bind_address", "metrics-port", METRICS_PORT),
    ):
        port = values.get(flag, default)
        addr = getattr(config, field)
        update[field] = "" if port == 0 else append_port_if_needed(addr, port)
    return config.model_copy(update=update)
