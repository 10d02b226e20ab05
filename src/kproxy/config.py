"""KubeProxyConfiguration (kubeproxy.config.k8s.io/v1alpha1): loading, defaults, flags, validation.

kproxy reads the same configuration file and the same command-line flags as upstream
kube-proxy, and a file that upstream accepts means the same thing here. Behaviour that was
checked against upstream (pkg/proxy/apis/config/{v1alpha1,validation}, cmd/kube-proxy/app):

* **Defaulting is Go's zero-value defaulting.** Upstream fills a field when it holds its Go
  zero value, so an explicit zero is the same as leaving the field out for: ``bindAddress``,
  ``healthzBindAddress``/``metricsBindAddress`` (also: a bare IP gets the default port),
  ``iptables``/``nftables`` ``syncPeriod`` and ``minSyncPeriod`` (``minSyncPeriod: 0s`` becomes
  ``1s``!), ``ipvs.syncPeriod``, ``configSyncPeriod`` and ``clientConnection``
  ``contentType``/``qps``/``burst``. ``ipvs.minSyncPeriod: 0s`` stays 0, and pointer fields
  (``oomScoreAdj``, ``masqueradeBit``, ``localhostNodePorts``, conntrack ``maxPerCore``,
  ``min``, TCP timeouts) keep an explicit 0. ``null`` means "unset" everywhere.
* **Flags vs. --config** (options.go ``Complete``): when a config file is given, the file
  replaces the flag-parsed configuration wholesale; only ``--hostname-override`` (trimmed
  and lowercased) and logging flags still apply. Every other flag is silently ignored
  upstream; kproxy logs a warning and `apply_flags` returns the ignored names.
* Without a file, flags apply to the defaults. ``--iptables-sync-period`` and
  ``--iptables-min-sync-period`` apply unless the mode is ipvs (so they feed nftables too);
  ``--ipvs-sync-period``/``--ipvs-min-sync-period`` apply only in ipvs mode; both are
  reported as ignored otherwise. ``--masquerade-all`` sets the single internal field, so it
  applies to the iptables and nftables sections alike. A bare IP in
  ``--healthz-bind-address``/``--metrics-bind-address`` gets the default port (or the one
  from the deprecated ``--healthz-port``/``--metrics-port``; port 0 disables the server).
* **Effective per-mode values** (1.31+ internal config): sync periods come from the section
  of the mode (ipvs -> ``ipvs``, nftables -> ``nftables``, else ``iptables``); masqueradeAll
  and masqueradeBit come from ``nftables`` in nftables mode and from ``iptables`` otherwise
  (the v1alpha1 ipvs section has no masquerade fields; upstream's ipvs proxier uses iptables').
* Empty ``healthzBindAddress``/``metricsBindAddress`` mean "server disabled" (upstream's
  servers skip an empty address); a file cannot produce them because "" is defaulted.

Deliberate differences, all in the direction of failing loud: unknown fields are an error
(upstream retries a lenient decode and only logs), duplicate keys are an error, every section
is validated whatever the mode (upstream checks only the active mode's ipvs/nftables
section), and the mode must be one of kproxy's four (upstream: iptables, ipvs, nftables).
Feature-gate names and ``showHiddenMetricsForVersion`` beyond its "X.Y" form are not checked,
because the valid set depends on the Kubernetes release being imitated.
"""

from __future__ import annotations

import copy
import csv
import difflib
import ipaddress
import logging
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
)
from pydantic_core import PydanticCustomError

from kproxy.dataplane import nodepolicy
from kproxy.dataplane.facts import RuleOptions
from kproxy.dataplane.nodepolicy import DETECT_LOCAL_MODES, NODE_PORT_ADDRESSES_PRIMARY

log = logging.getLogger("kproxy.config")

API_VERSION = "kubeproxy.config.k8s.io/v1alpha1"
KIND = "KubeProxyConfiguration"

# kproxy's modes; "" means iptables. Whether a mode is built in is checked elsewhere.
MODES = ("iptables", "nftables", "ipvs", "userspace")
DEFAULT_MODE = "iptables"
IPVS_SCHEDULERS = ("rr", "wrr", "lc", "wlc", "lblc", "lblcr", "sh", "dh", "sed", "nq", "mh")

HEALTHZ_PORT = 10256
METRICS_PORT = 10249
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
# Marks validation input that came from a file: there durations must be strings, like Go's.
_FROM_FILE = "from_file"


class ConfigError(ValueError):
    """A configuration that cannot be used; str() is the message for humans.

    The first line names the source (file name, or "command-line flags"), then one line per
    problem. `problems` holds the problem lines alone.
    """

    def __init__(self, source: str, problems: Iterable[str]) -> None:
        self.source = source
        self.problems = list(problems)
        count = len(self.problems)
        head = f"{source}: invalid configuration ({count} problem{'s' if count != 1 else ''}):"
        super().__init__("\n".join([head, *(f"  {p}" for p in self.problems)]))


# --------------------------------------------------------------------------- durations
# Go's time.ParseDuration / time.Duration.String, on integer nanoseconds.

_UNIT_NS = {
    "ns": 1,
    "us": 1_000,
    "\u00b5s": 1_000,  # micro sign, what Go prints
    "\u03bcs": 1_000,  # Greek mu, also accepted by Go
    "ms": 1_000_000,
    "s": 1_000_000_000,
    "m": 60_000_000_000,
    "h": 3_600_000_000_000,
}
_DIGITS = re.compile(r"[0-9]*")
_UNIT = re.compile(r"[^0-9.]*")
_NS_PER_S = 1_000_000_000


def parse_duration_ns(text: str) -> int:
    """Parse a Go duration ("1h30m", "1.5s", "-300ms", "0") into integer nanoseconds."""
    s = text
    negative = False
    if s[:1] in ("+", "-"):
        negative = s[0] == "-"
        s = s[1:]
    if s == "0":
        return 0
    if not s:
        raise ValueError(f"invalid duration {text!r}")
    total = 0
    pos = 0
    while pos < len(s):
        whole = _DIGITS.match(s, pos)
        assert whole is not None  # [0-9]* always matches
        int_part = whole.group()
        pos = whole.end()
        frac_part = ""
        if s.startswith(".", pos):
            frac = _DIGITS.match(s, pos + 1)
            assert frac is not None
            frac_part = frac.group()
            pos = frac.end()
        if not int_part and not frac_part:
            raise ValueError(f"invalid duration {text!r}")
        unit_match = _UNIT.match(s, pos)
        assert unit_match is not None
        unit = unit_match.group()
        pos = unit_match.end()
        if not unit:
            raise ValueError(f"missing unit in duration {text!r} (use ns, us, ms, s, m or h)")
        if unit not in _UNIT_NS:
            raise ValueError(f"unknown unit {unit!r} in duration {text!r}")
        scale = _UNIT_NS[unit]
        total += int(int_part or "0") * scale
        if frac_part:
            total += int(frac_part) * scale // 10 ** len(frac_part)
        if total > 2**63 - (0 if negative else 1):
            raise ValueError(f"invalid duration {text!r}: out of range")
    return -total if negative else total


def parse_duration(text: str) -> float:
    """Parse a Go duration string into float seconds."""
    return parse_duration_ns(text) / _NS_PER_S


def _decimal(value: int, unit: int) -> str:
    whole, frac = divmod(value, unit)
    if not frac:
        return str(whole)
    width = len(str(unit)) - 1
    return f"{whole}.{str(frac).rjust(width, '0').rstrip('0')}"


def format_duration_ns(ns: int) -> str:
    """Format nanoseconds exactly like Go's time.Duration.String ("1m0s", "24h0m0s", "1.5ms")."""
    if ns == 0:
        return "0s"
    sign = "-" if ns < 0 else ""
    u = abs(ns)
    if u < 1_000:
        return f"{sign}{u}ns"
    if u < 1_000_000:
        return f"{sign}{_decimal(u, 1_000)}\u00b5s"
    if u < _NS_PER_S:
        return f"{sign}{_decimal(u, 1_000_000)}ms"
    hours, rest = divmod(u, _UNIT_NS["h"])
    minutes, rest = divmod(rest, _UNIT_NS["m"])
    text = f"{_decimal(rest, _NS_PER_S)}s"
    if hours:
        text = f"{hours}h{minutes}m{text}"
    elif minutes:
        text = f"{minutes}m{text}"
    return sign + text


def format_duration(seconds: float) -> str:
    """Format float seconds as a Go duration string."""
    return format_duration_ns(round(seconds * _NS_PER_S))


def _duration_input(value: Any, info: ValidationInfo) -> Any:
    if isinstance(value, str):
        try:
            return parse_duration(value)
        except ValueError as err:
            raise PydanticCustomError("duration", "{reason}", {"reason": str(err)}) from None
    if (info.context or {}).get(_FROM_FILE) or isinstance(value, bool):
        # metav1.Duration only unmarshals from a string; a bare 30 is an error upstream too.
        raise PydanticCustomError(
            "duration_type", 'must be a duration string such as "30s" or "1m30s"'
        )
    return value


Duration = Annotated[
    float,
    BeforeValidator(_duration_input),
    PlainSerializer(format_duration, return_type=str, when_used="json"),
]
Int32 = Annotated[int, Field(ge=_INT32_MIN, le=_INT32_MAX)]
# Lists come from YAML as lists; lax mode lets them become tuples while items stay strict.
StrTuple = Annotated[tuple[str, ...], Field(strict=False)]


# --------------------------------------------------------------------------- models


class _Section(BaseModel):
    model_config = ConfigDict(
        strict=True,
        extra="forbid",
        frozen=True,
        validate_by_name=True,
        validate_by_alias=True,
    )


class ClientConnectionConfig(_Section):
    kubeconfig: str = ""
    accept_content_types: str = Field("", alias="acceptContentTypes")
    content_type: str = Field("application/vnd.kubernetes.protobuf", alias="contentType")
    qps: float = 5.0
    burst: Int32 = 10


class IPTablesConfig(_Section):
    masquerade_all: bool = Field(False, alias="masqueradeAll")
    masquerade_bit: Int32 = Field(14, alias="masqueradeBit")
    localhost_node_ports: bool = Field(True, alias="localhostNodePorts")
    sync_period: Duration = Field(30.0, alias="syncPeriod")
    min_sync_period: Duration = Field(1.0, alias="minSyncPeriod")


class IPVSConfig(_Section):
    sync_period: Duration = Field(30.0, alias="syncPeriod")
    min_sync_period: Duration = Field(0.0, alias="minSyncPeriod")
    scheduler: str = ""
    exclude_cidrs: StrTuple = Field((), alias="excludeCIDRs")
    strict_arp: bool = Field(False, alias="strictARP")
    tcp_timeout: Duration = Field(0.0, alias="tcpTimeout")
    tcp_fin_timeout: Duration = Field(0.0, alias="tcpFinTimeout")
    udp_timeout: Duration = Field(0.0, alias="udpTimeout")


class NFTablesConfig(_Section):
    masquerade_all: bool = Field(False, alias="masqueradeAll")
    masquerade_bit: Int32 = Field(14, alias="masqueradeBit")
    sync_period: Duration = Field(30.0, alias="syncPeriod")
    min_sync_period: Duration = Field(1.0, alias="minSyncPeriod")


class ConntrackConfig(_Section):
    max_per_core: Int32 = Field(32768, alias="maxPerCore")
    min: Int32 = 131072
    tcp_established_timeout: Duration = Field(86400.0, alias="tcpEstablishedTimeout")
    tcp_close_wait_timeout: Duration = Field(3600.0, alias="tcpCloseWaitTimeout")
    tcp_be_liberal: bool = Field(False, alias="tcpBeLiberal")
    udp_timeout: Duration = Field(0.0, alias="udpTimeout")
    udp_stream_timeout: Duration = Field(0.0, alias="udpStreamTimeout")


class DetectLocalConfig(_Section):
    bridge_interface: str = Field("", alias="bridgeInterface")
    interface_name_prefix: str = Field("", alias="interfaceNamePrefix")


class ProxyConfig(_Section):
    """One KubeProxyConfiguration after upstream defaulting. Frozen; use model_copy to vary.

    Python names are snake_case; the file's camelCase names are the aliases. `source` says
    where the configuration came from (a file name, or None for defaults plus flags); it is
    provenance, not content, so it takes no part in equality.
    """

    api_version: str = Field(API_VERSION, alias="apiVersion")
    kind: str = KIND
    feature_gates: dict[str, bool] = Field(default_factory=dict, alias="featureGates")
    client_connection: ClientConnectionConfig = Field(
        default_factory=ClientConnectionConfig, alias="clientConnection"
    )
    # Kept as given (component-base LoggingConfiguration); the CLI maps it onto logging.
    logging: dict[str, Any] = Field(default_factory=dict)
    hostname_override: str = Field("", alias="hostnameOverride")
    bind_address: str = Field("0.0.0.0", alias="bindAddress")
    healthz_bind_address: str = Field(f"0.0.0.0:{HEALTHZ_PORT}", alias="healthzBindAddress")
    metrics_bind_address: str = Field(f"127.0.0.1:{METRICS_PORT}", alias="metricsBindAddress")
    bind_address_hard_fail: bool = Field(False, alias="bindAddressHardFail")
    enable_profiling: bool = Field(False, alias="enableProfiling")
    show_hidden_metrics_for_version: str = Field("", alias="showHiddenMetricsForVersion")
    mode: str = ""
    iptables: IPTablesConfig = Field(default_factory=IPTablesConfig)
    ipvs: IPVSConfig = Field(default_factory=IPVSConfig)
    nftables: NFTablesConfig = Field(default_factory=NFTablesConfig)
    # Windows-only settings: accepted so shared files load, otherwise ignored.
    winkernel: dict[str, Any] = Field(default_factory=dict)
    windows_run_as_service: bool = Field(False, alias="windowsRunAsService")
    detect_local_mode: str = Field("", alias="detectLocalMode")
    detect_local: DetectLocalConfig = Field(default_factory=DetectLocalConfig, alias="detectLocal")
    cluster_cidr: str = Field("", alias="clusterCIDR")
    node_port_addresses: StrTuple = Field((), alias="nodePortAddresses")
    oom_score_adj: Int32 = Field(-999, alias="oomScoreAdj")
    conntrack: ConntrackConfig = Field(default_factory=ConntrackConfig)
    config_sync_period: Duration = Field(900.0, alias="configSyncPeriod")
    port_range: str = Field("", alias="portRange")

    _source: str | None = PrivateAttr(default=None)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ProxyConfig):
            return NotImplemented
        return self.model_dump() == other.model_dump()

    __hash__ = None  # type: ignore[assignment]  # dict fields make it unhashable anyway

    @property
    def source(self) -> str | None:
        return self._source

    @property
    def effective_mode(self) -> str:
        return self.mode or DEFAULT_MODE

    @property
    def sync_period(self) -> float:
        return self._sync_section.sync_period

    @property
    def min_sync_period(self) -> float:
        return self._sync_section.min_sync_period

    @property
    def masquerade_all(self) -> bool:
        return self._masquerade_section.masquerade_all

    @property
    def masquerade_bit(self) -> int:
        return self._masquerade_section.masquerade_bit

    @property
    def effective_detect_local_mode(self) -> str:
        return nodepolicy.effective_detect_local_mode(self.detect_local_mode)

    @property
    def cluster_cidrs(self) -> tuple[str, ...]:
        return tuple(self.cluster_cidr.split(",")) if self.cluster_cidr else ()

    @property
    def effective_node_port_addresses(self) -> tuple[str, ...]:
        return nodepolicy.effective_node_port_addresses(
            self.node_port_addresses, self.effective_mode
        )

    @property
    def _sync_section(self) -> IPTablesConfig | IPVSConfig | NFTablesConfig:
        mode = self.effective_mode
        if mode == "ipvs":
            return self.ipvs
        return self.nftables if mode == "nftables" else self.iptables

    @property
    def _masquerade_section(self) -> IPTablesConfig | NFTablesConfig:
        return self.nftables if self.effective_mode == "nftables" else self.iptables

    def to_dict(self, effective: bool = True) -> dict[str, Any]:
        """The configuration as the file would spell it (camelCase keys, Go durations).

        With `effective`, blanks that upstream resolves at startup are written resolved
        (mode, detectLocalMode, nftables' nodePortAddresses), like upstream's
        --write-config-to, so the file says what actually runs.
        """
        data = self.model_dump(mode="json", by_alias=True)
        if effective:
            data["mode"] = self.effective_mode
            data["detectLocalMode"] = self.effective_detect_local_mode
            data["nodePortAddresses"] = list(self.effective_node_port_addresses)
        # Go writes nil slices as null and drops omitempty fields.
        data["nodePortAddresses"] = data["nodePortAddresses"] or None
        data["ipvs"]["excludeCIDRs"] = data["ipvs"]["excludeCIDRs"] or None
        for key in ("featureGates", "logging", "winkernel", "windowsRunAsService"):
            if not data[key]:
                del data[key]
        qps = data["clientConnection"]["qps"]
        if float(qps).is_integer():
            data["clientConnection"]["qps"] = int(qps)
        return data

    def to_yaml(self, effective: bool = True) -> str:
        """YAML for --write-config-to; parse_config() reads it back to an equal config."""
        return yaml.safe_dump(self.to_dict(effective), sort_keys=True, allow_unicode=True)


# --------------------------------------------------------------------------- loading


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

    raw = _apply_go_defaults(raw)
    problems: list[str] = []
    config = _validate_structure(raw, problems)
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
            problems.append(f"{key}: Invalid value: {_show(got)}: must be {want!r}")
    if problems:
        raise ConfigError(source, problems)


_SECTIONS = ("clientConnection", "iptables", "ipvs", "nftables", "conntrack", "detectLocal")


def _drop_nulls(data: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if v is not None}


def _apply_go_defaults(raw: dict[str, Any]) -> dict[str, Any]:
    """Upstream's SetDefaults_KubeProxyConfiguration on the raw mapping (see module doc)."""
    out = _drop_nulls(copy.deepcopy(raw))
    for name in _SECTIONS:
        if isinstance(out.get(name), dict):
            out[name] = _drop_nulls(out[name])

    if out.get("bindAddress") == "":
        out["bindAddress"] = "0.0.0.0"
    bind = out.get("bindAddress", "0.0.0.0")
    healthz_host, metrics_host = (
        ("0.0.0.0", "127.0.0.1") if _is_ipv4ish(bind) else ("[::]", "[::1]")
    )
    for key, host, port in (
        ("healthzBindAddress", healthz_host, HEALTHZ_PORT),
        ("metricsBindAddress", metrics_host, METRICS_PORT),
    ):
        value = out.get(key, "")
        if value == "":
            out[key] = f"{host}:{port}"
        elif isinstance(value, str):
            out[key] = _append_port_if_needed(value, port)

    zero_durations = (
        (out, "configSyncPeriod", "15m0s"),
        (out.get("iptables"), "syncPeriod", "30s"),
        (out.get("iptables"), "minSyncPeriod", "1s"),
        (out.get("ipvs"), "syncPeriod", "30s"),
        (out.get("nftables"), "syncPeriod", "30s"),
        (out.get("nftables"), "minSyncPeriod", "1s"),
    )
    for section, key, default in zero_durations:
        if isinstance(section, dict) and _is_zero_duration(section.get(key)):
            section[key] = default

    client = out.get("clientConnection")
    if isinstance(client, dict):
        if client.get("contentType") == "":
            client["contentType"] = "application/vnd.kubernetes.protobuf"
        for key, default in (("qps", 5.0), ("burst", 10)):
            value = client.get(key)
            if not isinstance(value, bool) and isinstance(value, int | float) and value == 0:
                client[key] = default
    return out


def _is_zero_duration(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        return parse_duration_ns(value) == 0
    except ValueError:
        return False


def _is_ipv4ish(value: Any) -> bool:
    # Go's ParseIP(x).To4() != nil: IPv4 or IPv4-mapped IPv6; anything else counts as IPv6.
    try:
        ip = ipaddress.ip_address(value)
    except ValueError:
        return False
    return ip.version == 4 or ip.ipv4_mapped is not None


def _append_port_if_needed(addr: str, port: int) -> str:
    """proxyutil.AppendPortIfNeeded: a bare IP gets the port, anything else is kept."""
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return addr
    return f"[{addr}]:{port}" if ip.version == 6 else f"{addr}:{port}"


# --------------------------------------------------------------------------- structural errors


def _validate_structure(raw: dict[str, Any], problems: list[str]) -> ProxyConfig | None:
    """Pydantic validation; on errors, also returns a best-effort config for semantic checks.

    Fields with structural errors are dropped and validation is retried so that the
    semantic checks still run on everything else and all problems are reported at once.
    """
    context = {_FROM_FILE: True}
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
        hint = _suggest(str(loc[-1]), _known_fields(loc[:-1]))
        return f"{path}: unknown field" + (f" (did you mean {hint!r}?)" if hint else "")
    why = _TYPE_MESSAGES.get(error["type"], error["msg"])
    return f"{path}: Invalid value: {_show(error.get('input'))}: {why}"


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


def _show(value: Any) -> str:
    """A value in an error message: strings quoted with repr so stray spaces are visible."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, str | list | tuple | dict):
        return repr(value if not isinstance(value, tuple) else list(value))
    return str(value)


def _suggest(value: str, choices: Iterable[str]) -> str | None:
    options = [c for c in choices if c]
    folded = {c.lower(): c for c in options}
    key = value.strip().lower()
    if key in folded:
        return folded[key]
    # 0.75 keeps real typos ("iptabels") and drops look-alikes ("kernelspace" -> userspace).
    close = difflib.get_close_matches(key, list(folded), n=1, cutoff=0.75)
    return folded[close[0]] if close else None


# --------------------------------------------------------------------------- semantic checks


def validate_config(config: ProxyConfig) -> list[str]:
    """Upstream's validation (plus kproxy's mode set); returns one message per problem."""
    v = _Problems()
    _validate_top_level(v, config)
    _validate_local_detection(v, config)
    _validate_sections(v, config)
    return v.messages


def _validate_top_level(v: _Problems, config: ProxyConfig) -> None:
    _check_choice(v, "mode", config.mode, MODES, "blank means iptables")
    _check_ip(v, "bindAddress", config.bind_address)
    _check_node_port_addresses(v, config.node_port_addresses)
    for path, value in (
        ("healthzBindAddress", config.healthz_bind_address),
        ("metricsBindAddress", config.metrics_bind_address),
    ):
        if value:  # empty: that server is disabled
            _check_host_port(v, path, value)
    v.check(
        config.client_connection.burst >= 0,
        "clientConnection.burst",
        config.client_connection.burst,
        "must be greater than or equal to 0",
    )
    v.check(
        -1000 <= config.oom_score_adj <= 1000,
        "oomScoreAdj",
        config.oom_score_adj,
        "must be within the range [-1000, 1000]",
    )
    _check_positive(v, "configSyncPeriod", config.config_sync_period)
    v.check(
        _valid_port_range(config.port_range),
        "portRange",
        config.port_range,
        "must be a valid port range (e.g. 300-2000)",
    )
    v.check(
        not config.show_hidden_metrics_for_version
        or re.fullmatch(r"\d+\.\d+", config.show_hidden_metrics_for_version) is not None,
        "showHiddenMetricsForVersion",
        config.show_hidden_metrics_for_version,
        "must be a version in the form <major>.<minor>, e.g. '1.33'",
    )


def _validate_local_detection(v: _Problems, config: ProxyConfig) -> None:
    _check_choice(
        v,
        "detectLocalMode",
        config.detect_local_mode,
        DETECT_LOCAL_MODES,
        "blank means ClusterCIDR",
    )
    if config.detect_local_mode == "BridgeInterface" and not config.detect_local.bridge_interface:
        v.required(
            "detectLocal.bridgeInterface",
            "must not be empty when detectLocalMode is BridgeInterface",
        )
    if (
        config.detect_local_mode == "InterfaceNamePrefix"
        and not config.detect_local.interface_name_prefix
    ):
        v.required(
            "detectLocal.interfaceNamePrefix",
            "must not be empty when detectLocalMode is InterfaceNamePrefix",
        )
    _check_cluster_cidr(v, config.cluster_cidr)


def _validate_sections(v: _Problems, config: ProxyConfig) -> None:
    # Every section, whatever the mode: a bad value must not wait for a mode switch to bite.
    for name, section in (("iptables", config.iptables), ("nftables", config.nftables)):
        v.check(
            0 <= section.masquerade_bit <= 31,
            f"{name}.masqueradeBit",
            section.masquerade_bit,
            "must be within the range [0, 31]",
        )
        _check_sync_periods(v, name, section.sync_period, section.min_sync_period)

    ipvs = config.ipvs
    _check_sync_periods(v, "ipvs", ipvs.sync_period, ipvs.min_sync_period)
    _check_choice(v, "ipvs.scheduler", ipvs.scheduler, IPVS_SCHEDULERS, "blank means rr")
    for i, cidr in enumerate(ipvs.exclude_cidrs):
        v.check(
            _parse_cidr(cidr) is not None, f"ipvs.excludeCIDRs[{i}]", cidr, "must be a valid CIDR"
        )
    for key, value in (
        ("tcpTimeout", ipvs.tcp_timeout),
        ("tcpFinTimeout", ipvs.tcp_fin_timeout),
        ("udpTimeout", ipvs.udp_timeout),
    ):
        _check_non_negative(v, f"ipvs.{key}", value)

    ct = config.conntrack
    v.check(
        ct.max_per_core >= 0,
        "conntrack.maxPerCore",
        ct.max_per_core,
        "must be greater than or equal to 0",
    )
    v.check(ct.min >= 0, "conntrack.min", ct.min, "must be greater than or equal to 0")
    for key, value in (
        ("tcpEstablishedTimeout", ct.tcp_established_timeout),
        ("tcpCloseWaitTimeout", ct.tcp_close_wait_timeout),
        ("udpTimeout", ct.udp_timeout),
        ("udpStreamTimeout", ct.udp_stream_timeout),
    ):
        _check_non_negative(v, f"conntrack.{key}", value)


class _Problems:
    def __init__(self) -> None:
        self.messages: list[str] = []

    def invalid(self, path: str, value: Any, why: str) -> None:
        self.messages.append(f"{path}: Invalid value: {_show(value)}: {why}")

    def required(self, path: str, why: str) -> None:
        self.messages.append(f"{path}: Required value: {why}")

    def check(self, ok: bool, path: str, value: Any, why: str) -> None:
        if not ok:
            self.invalid(path, value, why)


def _check_choice(
    v: _Problems, path: str, value: str, choices: tuple[str, ...], blank: str
) -> None:
    if value == "" or value in choices:
        return
    listed = ", ".join(repr(c) for c in choices)
    why = f"must be one of {listed} or blank ({blank})"
    hint = _suggest(value, choices)
    v.invalid(path, value, why + (f"; did you mean {hint!r}?" if hint else ""))


def _check_positive(v: _Problems, path: str, seconds: float) -> None:
    v.check(seconds > 0, path, format_duration(seconds), "must be greater than 0")


def _check_non_negative(v: _Problems, path: str, seconds: float) -> None:
    v.check(seconds >= 0, path, format_duration(seconds), "must be greater than or equal to 0")


def _check_sync_periods(v: _Problems, section: str, sync: float, min_sync: float) -> None:
    _check_positive(v, f"{section}.syncPeriod", sync)
    _check_non_negative(v, f"{section}.minSyncPeriod", min_sync)
    # Only compare two values that are each valid, so one mistake gives one message.
    if min_sync >= 0 and sync > 0 and min_sync > sync:
        v.invalid(
            f"{section}.minSyncPeriod",
            format_duration(min_sync),
            f"must be less than or equal to {section}.syncPeriod ({format_duration(sync)})",
        )


def _check_ip(v: _Problems, path: str, value: str) -> None:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        v.invalid(path, value, "not a valid textual representation of an IP address")


def _split_host_port(value: str) -> tuple[str, str] | None:
    """Go's net.SplitHostPort for the cases that matter here; None when malformed."""
    if value.startswith("["):
        end = value.find("]")
        if end < 0 or value[end + 1 : end + 2] != ":":
            return None
        return value[1:end], value[end + 2 :]
    host, sep, port = value.rpartition(":")
    if not sep or ":" in host:
        return None
    return host, port


def _check_host_port(v: _Problems, path: str, value: str) -> None:
    parts = _split_host_port(value)
    if parts is None:
        v.invalid(path, value, "must be IP:port")
        return
    host, port = parts
    try:
        ipaddress.ip_address(host)
    except ValueError:
        v.invalid(path, value, f"must be IP:port with a valid IP (got {host!r})")
    if not (port.isdigit() and 1 <= int(port) <= 65535):
        v.invalid(
            path, value, f"must be IP:port with a port in the range [1, 65535] (got {port!r})"
        )


_CIDR = re.compile(r"[^/\s]+/[0-9]{1,3}")


def _parse_cidr(value: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    # Go's ParseCIDR: "addr/len" only (no bare address, no netmask form); host bits allowed.
    if not _CIDR.fullmatch(value):
        return None
    try:
        return ipaddress.ip_network(value, strict=False)
    except ValueError:
        return None


def _check_cluster_cidr(v: _Problems, value: str) -> None:
    if not value:
        return
    parts = value.split(",")
    if len(parts) > 2:
        v.invalid(
            "clusterCIDR",
            value,
            "must be a single CIDR or a dual-stack pair of CIDRs "
            "(e.g. 10.100.0.0/16,fde4:8dba:82e1::/48)",
        )
        return
    networks = [_parse_cidr(p) for p in parts]
    bad = [p for p, n in zip(parts, networks, strict=True) if n is None]
    if bad:
        v.invalid(
            "clusterCIDR",
            value,
            f"must be a valid CIDR block (e.g. 10.100.0.0/16 or "
            f"fde4:8dba:82e1::/48); not valid: {', '.join(repr(b) for b in bad)}",
        )
    elif len(networks) == 2 and {n.version for n in networks if n} != {4, 6}:
        v.invalid(
            "clusterCIDR",
            value,
            "a pair of CIDRs must be one IPv4 and one IPv6 "
            "(e.g. 10.100.0.0/16,fde4:8dba:82e1::/48)",
        )


def _check_node_port_addresses(v: _Problems, values: tuple[str, ...]) -> None:
    for i, value in enumerate(values):
        path = f"nodePortAddresses[{i}]"
        if value == NODE_PORT_ADDRESSES_PRIMARY:
            v.check(len(values) == 1, path, value, "can't use both 'primary' and CIDRs")
        else:
            v.check(
                _parse_cidr(value) is not None,
                path,
                value,
                "must be a valid CIDR (or the single entry 'primary')",
            )


def _valid_port_range(value: str) -> bool:
    # utilnet.ParsePortRange: "", "N", "N-M" or "N+size" within [0, 65535].
    text = value.strip()
    if not text:
        return True
    m = re.fullmatch(r"(\d+)(?:([-+])(\d+))?", text)
    if not m:
        return False
    base = int(m.group(1))
    if m.group(2) is None:
        return base <= 65535
    other = int(m.group(3))
    high = other if m.group(2) == "-" else base + other
    return base <= high <= 65535


# --------------------------------------------------------------------------- flags


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
    if not _INT32_MIN <= value <= _INT32_MAX:
        raise ValueError("must fit in a 32-bit signed integer")
    return value


def _parse_float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError("must be a number") from None


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
    "healthz-port": _Flag(_parse_int32, ()),
    "metrics-port": _Flag(_parse_int32, ()),
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
            hint = _suggest(name, _FLAGS)
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
        raise ConfigError(_FLAG_SOURCE, problems)
    return new, ignored


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
        update[field] = "" if port == 0 else _append_port_if_needed(addr, port)
    return config.model_copy(update=update)


# --------------------------------------------------------------------------- rule options


def rule_options(config: ProxyConfig) -> RuleOptions:
    """The parts of the configuration that shape rules, for the active mode."""
    v4_cidrs = tuple(
        c for c in config.cluster_cidrs if (n := _parse_cidr(c)) is not None and n.version == 4
    )
    return RuleOptions(
        masquerade_all=config.masquerade_all,
        masquerade_bit=config.masquerade_bit,
        detect_local_mode=config.effective_detect_local_mode,
        cluster_cidrs=v4_cidrs,
        bridge_interface=config.detect_local.bridge_interface,
        interface_name_prefix=config.detect_local.interface_name_prefix,
        localhost_nodeports=config.iptables.localhost_node_ports,
        node_port_addresses=config.effective_node_port_addresses,
        ipvs_scheduler=config.ipvs.scheduler,
        ipvs_exclude_cidrs=tuple(config.ipvs.exclude_cidrs),
        ipvs_strict_arp=config.ipvs.strict_arp,
        ipvs_tcp_timeout=config.ipvs.tcp_timeout,
        ipvs_tcp_fin_timeout=config.ipvs.tcp_fin_timeout,
        ipvs_udp_timeout=config.ipvs.udp_timeout,
    )


__all__ = [
    "API_VERSION",
    "DETECT_LOCAL_MODES",
    "FLAG_NAMES",
    "IPVS_SCHEDULERS",
    "KIND",
    "MODES",
    "ClientConnectionConfig",
    "ConfigError",
    "ConntrackConfig",
    "DetectLocalConfig",
    "IPTablesConfig",
    "IPVSConfig",
    "NFTablesConfig",
    "ProxyConfig",
    "apply_flags",
    "format_duration",
    "format_duration_ns",
    "load_config",
    "parse_config",
    "parse_duration",
    "parse_duration_ns",
    "rule_options",
    "validate_config",
]
