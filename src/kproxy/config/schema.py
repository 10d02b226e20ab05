"""The KubeProxyConfiguration schema: its names, its field types and the pydantic models.

The models hold upstream's defaults and the per-mode effective values (see the package's
docstring); checking values beyond their types is validation.py's.
"""

from __future__ import annotations

from typing import Annotated, Any

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    PrivateAttr,
    ValidationInfo,
)
from pydantic_core import PydanticCustomError

from kproxy.config.durations import format_duration, parse_duration
from kproxy.dataplane import nodepolicy

API_VERSION = "kubeproxy.config.k8s.io/v1alpha1"
KIND = "KubeProxyConfiguration"

# kproxy's modes are kproxy/modes.py's MODES; "" means iptables.
DEFAULT_MODE = "iptables"
IPVS_SCHEDULERS = ("rr", "wrr", "lc", "wlc", "lblc", "lblcr", "sh", "dh", "sed", "nq", "mh")

HEALTHZ_PORT = 10256
METRICS_PORT = 10249
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
# Marks validation input that came from a file: there durations must be strings, like Go's.
FROM_FILE = "from_file"


def _duration_input(value: Any, info: ValidationInfo) -> Any:
    if isinstance(value, str):
        try:
            return parse_duration(value)
        except ValueError as err:
            raise PydanticCustomError("duration", "{reason}", {"reason": str(err)}) from None
    if (info.context or {}).get(FROM_FILE) or isinstance(value, bool):
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
Int32 = Annotated[int, Field(ge=INT32_MIN, le=INT32_MAX)]
# Lists come from YAML as lists; lax mode lets them become tuples while items stay strict.
StrTuple = Annotated[tuple[str, ...], Field(strict=False)]


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
