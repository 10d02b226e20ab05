"""Validate Service, EndpointSlice and Node dicts into small records, or reject them.

Every problem becomes an InvalidObject naming the field, so the tracker can log one clear
line and count it; nothing here raises for bad user data. IPv6-only objects are "ignored"
(not invalid): the proxy is single-stack IPv4 until dual stack is built.
"""

from __future__ import annotations

import ipaddress
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from kproxy.model.objects import Protocol

SERVICE_PROXY_NAME_LABEL = "service.kubernetes.io/service-proxy-name"
HEADLESS_LABEL = "service.kubernetes.io/headless"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
TRIGGER_TIME_ANNOTATION = "endpoints.kubernetes.io/last-change-trigger-time"
DEFAULT_AFFINITY_TIMEOUT = 10800


class InvalidObject(Exception):
    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class IgnoredObject(Exception):
    """A valid object this proxy deliberately does not program (headless, IPv6, ...)."""


@dataclass(frozen=True, slots=True)
class ParsedPort:
    name: str
    protocol: Protocol
    port: int
    target_port: int | str
    node_port: int


@dataclass(frozen=True, slots=True)
class ParsedService:
    namespace: str
    name: str
    cluster_ip: str
    ports: tuple[ParsedPort, ...]
    external_ips: tuple[str, ...]
    load_balancer_ips: tuple[str, ...]
    source_ranges: tuple[str, ...]
    health_check_node_port: int
    affinity_timeout: int | None
    external_policy_local: bool
    internal_policy_local: bool
    annotations: tuple[tuple[str, str], ...]
    # spec.selector: () means none, so the EndpointSlices are managed by hand (or by a
    # controller that is not Kubernetes'); preflight and doctor tell the two apart. Not
    # part of equality: the proxy never selects pods, so a selector edit changes no rule.
    selector: tuple[tuple[str, str], ...] = field(default=(), compare=False)


@dataclass(frozen=True, slots=True)
class ParsedEndpoint:
    ip: str
    node_name: str
    zone: str
    ready: bool
    serving: bool
    terminating: bool
    zone_hints: frozenset[str]
    node_hints: frozenset[str]


@dataclass(frozen=True, slots=True)
class ParsedSlice:
    namespace: str
    name: str
    service: str
    # (port name, protocol, port number)
    ports: tuple[tuple[str, Protocol, int], ...]
    endpoints: tuple[ParsedEndpoint, ...]
    trigger_time: float | None = None


@dataclass(frozen=True, slots=True)
class ParsedNode:
    name: str
    labels: tuple[tuple[str, str], ...]
    addresses: tuple[str, ...]
    pod_cidrs: tuple[str, ...] = field(default_factory=tuple)


# --- small field readers -------------------------------------------------------------------


def _mapping(value: Any, path: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidObject(path, f"must be an object, got {type(value).__name__}")
    return value


def _list(value: Any, path: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidObject(path, f"must be a list, got {type(value).__name__}")
    return value


def _str(value: Any, path: str, *, required: bool = False) -> str:
    if value is None or value == "":
        if required:
            raise InvalidObject(path, "required field is missing")
        return ""
    if not isinstance(value, str):
        raise InvalidObject(path, f"must be a string, got {value!r}")
    return value


def _port(value: Any, path: str, *, required: bool = True, allow_zero: bool = False) -> int:
    if value is None:
        if required:
            raise InvalidObject(path, "required field is missing")
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidObject(path, f"must be an integer port, got {value!r}")
    low = 0 if allow_zero else 1
    if not low <= value <= 65535:
        raise InvalidObject(path, f"Invalid value: {value}: must be between {low} and 65535")
    return value


def _protocol(value: Any, path: str) -> Protocol:
    if value is None or value == "":
        return Protocol.TCP
    try:
        return Protocol(value)
    except ValueError:
        raise InvalidObject(
            path, f'Unsupported value: {value!r}: supported values: "TCP", "UDP", "SCTP"'
        ) from None


_IPV4 = re.compile(r"([0-9]{1,3})\.([0-9]{1,3})\.([0-9]{1,3})\.([0-9]{1,3})")


def _ip(value: Any, path: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.ip_address(_ip_text(value, path))


def _canonical_ip(text: str) -> str | None:
    """Canonical form of an IP, or None. Like upstream's ParseIPSloppy, IPv4 octets with
    leading zeros are accepted and read as decimal ("010.001.2.3" is 10.1.2.3).

    Not cached: a node holds one string per endpoint IP already, and a cache of 100,000
    endpoint addresses cost more memory (about 200 bytes each) than re-checking them costs
    time. A text that is already canonical is returned as it is, so no copy is kept."""
    m = _IPV4.fullmatch(text)
    if m is not None:
        octets = [int(g) for g in m.groups()]
        if all(o <= 255 for o in octets):
            canonical = ".".join(map(str, octets))
            return text if canonical == text else canonical
        return None
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        return None


def _ip_text(value: Any, path: str) -> str:
    """The canonical text of an IP address field (InvalidObject if it is not one)."""
    if not isinstance(value, str):
        raise InvalidObject(path, f"must be an IP address string, got {value!r}")
    ip = _canonical_ip(value.strip())
    if ip is None:
        raise InvalidObject(path, f"Invalid value: {value!r}: must be a valid IP address")
    return ip


_DIGITS = re.compile(r"[0-9]{1,3}")


def _canonical_cidr(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    """A CIDR, sloppy like upstream's ParseCIDRSloppy (leading zeros allowed)."""
    addr, sep, prefix = text.partition("/")
    ip = _canonical_ip(addr)
    if ip is None or not sep or not _DIGITS.fullmatch(prefix):
        return None
    try:
        return ipaddress.ip_network(f"{ip}/{int(prefix)}", strict=False)
    except ValueError:
        return None


def _is_v4(ip: str) -> bool:
    return ":" not in ip


def _ipv4_list(values: Any, path: str) -> tuple[str, ...]:
    out: list[str] = []
    for i, v in enumerate(_list(values, path)):
        ip = _ip_text(v, f"{path}[{i}]")
        if _is_v4(ip):
            out.append(ip)
    return tuple(out)


def _labels(meta: dict[str, Any], key: str, path: str) -> dict[str, str]:
    raw = _mapping(meta.get(key), f"{path}.{key}")
    return {str(k): str(v) for k, v in raw.items()}


# --- Service ----------------------------------------------------------------------------------

# The API server enforces these; a file source must too, because names end up inside
# iptables comments and nft chain names, where a stray quote would break a whole restore.
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_PORT_NAME = _DNS_LABEL  # Service port names are DNS labels (container port names: IANA)
_SVC_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,13}[a-z0-9])?")  # IANA_SVC_NAME, ASCII only
_PORT_NUMBER = re.compile(r"[0-9]{1,5}")


def is_dns_label(value: str) -> bool:
    """A namespace's, a Service's or a port's name: RFC 1123 label, lowercase."""
    return _DNS_LABEL.fullmatch(value) is not None


def is_dns_subdomain(value: str) -> bool:
    """A Node's or a custom resource's name: dot-separated RFC 1123 labels, lowercase, at
    most 253 characters."""
    return len(value) <= 253 and all(is_dns_label(part) for part in value.split("."))


def _dns_label(value: str, path: str) -> str:
    if not _DNS_LABEL.fullmatch(value):
        raise InvalidObject(
            path,
            f"Invalid value: {value!r}: must be a DNS label (at most 63 lowercase letters, digits"
            " and '-', starting and ending with a letter or digit)",
        )
    return value


def parse_service(obj: dict[str, Any]) -> ParsedService:
    meta = _mapping(obj.get("metadata"), "metadata")
    name = _dns_label(_str(meta.get("name"), "metadata.name", required=True), "metadata.name")
    namespace = _dns_label(
        _str(meta.get("namespace"), "metadata.namespace") or "default", "metadata.namespace"
    )
    labels = _labels(meta, "labels", "metadata")
    annotations = _labels(meta, "annotations", "metadata")
    spec = _mapping(obj.get("spec"), "spec")
    status = _mapping(obj.get("status"), "status")

    svc_type = _str(spec.get("type"), "spec.type") or "ClusterIP"
    if svc_type not in ("ClusterIP", "NodePort", "LoadBalancer", "ExternalName"):
        raise InvalidObject("spec.type", f"Unsupported value: {svc_type!r}")
    if svc_type == "ExternalName":
        raise IgnoredObject("type ExternalName")
    if SERVICE_PROXY_NAME_LABEL in labels:
        raise IgnoredObject(f"label {SERVICE_PROXY_NAME_LABEL}={labels[SERVICE_PROXY_NAME_LABEL]}")
    if HEADLESS_LABEL in labels:
        raise IgnoredObject(f"label {HEADLESS_LABEL}")

    cluster_ip = _cluster_ipv4(spec)

    ports: list[ParsedPort] = []
    seen: set[tuple[str, Protocol]] = set()
    # Like the API server: two ports of one Service never share a (port, protocol) or
    # (nodePort, protocol), or they would fight over one frontend.
    numbers: set[tuple[int, Protocol]] = set()
    node_ports: set[tuple[int, Protocol]] = set()
    raw_ports = _list(spec.get("ports"), "spec.ports")
    for i, raw in enumerate(raw_ports):
        path = f"spec.ports[{i}]"
        p = _mapping(raw, path)
        pname = _str(p.get("name"), f"{path}.name")
        if pname and not _PORT_NAME.fullmatch(pname):
            raise InvalidObject(
                f"{path}.name",
                f"Invalid value: {pname!r}: must be a DNS label (lowercase letters, digits, '-')",
            )
        if len(raw_ports) > 1 and not pname:
            raise InvalidObject(f"{path}.name", "required when a Service has several ports")
        proto = _protocol(p.get("protocol"), f"{path}.protocol")
        number = _port(p.get("port"), f"{path}.port")
        target = p.get("targetPort")
        if target is None or target == 0:
            target = number
        elif isinstance(target, str):
            if _PORT_NUMBER.fullmatch(target):
                target = _port(int(target), f"{path}.targetPort")
            elif not _SVC_NAME.fullmatch(target) or not any(c.isalpha() for c in target):
                raise InvalidObject(
                    f"{path}.targetPort",
                    f"Invalid value: {target!r}: must be a port number or a port name (at most"
                    " 15 lowercase letters, digits and '-', with at least one letter)",
                )
        else:
            target = _port(target, f"{path}.targetPort")
        node_port = 0
        if svc_type in ("NodePort", "LoadBalancer"):
            node_port = _port(p.get("nodePort"), f"{path}.nodePort", required=False)
        if (pname, proto) in seen:
            raise InvalidObject(f"{path}.name", f"Duplicate value: {pname!r} ({proto})")
        seen.add((pname, proto))
        if (number, proto) in numbers:
            raise InvalidObject(path, f"Duplicate value: port {number} ({proto})")
        numbers.add((number, proto))
        if node_port and (node_port, proto) in node_ports:
            raise InvalidObject(f"{path}.nodePort", f"Duplicate value: {node_port} ({proto})")
        node_ports.add((node_port, proto))
        ports.append(ParsedPort(pname, proto, number, target, node_port))

    external_ips = _ipv4_list(spec.get("externalIPs"), "spec.externalIPs")
    lb_ips: list[str] = []
    if svc_type == "LoadBalancer":
        lb = _mapping(status.get("loadBalancer"), "status.loadBalancer")
        for i, ing in enumerate(_list(lb.get("ingress"), "status.loadBalancer.ingress")):
            ing = _mapping(ing, f"status.loadBalancer.ingress[{i}]")
            if not ing.get("ip"):
                continue  # hostname-only ingress: nothing to program
            # ipMode Proxy: the load balancer delivers to the node itself, not to the VIP.
            if ing.get("ipMode") == "Proxy":
                continue
            ip = _ip_text(ing["ip"], f"status.loadBalancer.ingress[{i}].ip")
            if _is_v4(ip):
                lb_ips.append(ip)
    source_ranges = _source_ranges(spec) if svc_type == "LoadBalancer" else ()

    affinity_timeout: int | None = None
    affinity = _str(spec.get("sessionAffinity"), "spec.sessionAffinity") or "None"
    if affinity == "ClientIP":
        cfg = _mapping(spec.get("sessionAffinityConfig"), "spec.sessionAffinityConfig")
        client = _mapping(cfg.get("clientIP"), "spec.sessionAffinityConfig.clientIP")
        timeout = client.get("timeoutSeconds", DEFAULT_AFFINITY_TIMEOUT)
        if timeout is None:
            timeout = DEFAULT_AFFINITY_TIMEOUT
        if isinstance(timeout, bool) or not isinstance(timeout, int) or not 0 < timeout <= 86400:
            raise InvalidObject(
                "spec.sessionAffinityConfig.clientIP.timeoutSeconds",
                f"Invalid value: {timeout!r}: must be greater than 0 and less than 86400",
            )
        affinity_timeout = timeout
    elif affinity != "None":
        raise InvalidObject("spec.sessionAffinity", f"Unsupported value: {affinity!r}")

    externally_accessible = svc_type in ("NodePort", "LoadBalancer") or bool(external_ips)
    etp = _str(spec.get("externalTrafficPolicy"), "spec.externalTrafficPolicy") or "Cluster"
    itp = _str(spec.get("internalTrafficPolicy"), "spec.internalTrafficPolicy") or "Cluster"
    for path, value in (("spec.externalTrafficPolicy", etp), ("spec.internalTrafficPolicy", itp)):
        if value not in ("Cluster", "Local"):
            raise InvalidObject(
                path, f'Unsupported value: {value!r}: supported values: "Cluster", "Local"'
            )
    etp_local = etp == "Local" and externally_accessible
    hcnp = 0
    if svc_type == "LoadBalancer" and etp_local:
        hcnp = _port(spec.get("healthCheckNodePort"), "spec.healthCheckNodePort", required=False)

    return ParsedService(
        namespace=namespace,
        name=name,
        cluster_ip=cluster_ip,
        ports=tuple(ports),
        external_ips=external_ips,
        load_balancer_ips=tuple(lb_ips),
        source_ranges=source_ranges,
        health_check_node_port=hcnp,
        affinity_timeout=affinity_timeout,
        external_policy_local=etp_local,
        internal_policy_local=itp == "Local",
        annotations=tuple(sorted(annotations.items())),
        selector=_selector(spec.get("selector")),
    )


def _selector(value: Any) -> tuple[tuple[str, str], ...]:
    # Read for diagnostics only (the proxy never selects pods), so a malformed one is no
    # reason to reject the Service.
    if not isinstance(value, dict):
        return ()
    return tuple(sorted((str(k), str(v)) for k, v in value.items()))


def _cluster_ipv4(spec: dict[str, Any]) -> str:
    primary = _str(spec.get("clusterIP"), "spec.clusterIP")
    if primary == "None":
        raise IgnoredObject("headless (clusterIP None)")
    candidates = [primary] if primary else []
    for i, ip in enumerate(_list(spec.get("clusterIPs"), "spec.clusterIPs")):
        if ip == "None":
            raise IgnoredObject("headless (clusterIP None)")
        candidates.append(_str(ip, f"spec.clusterIPs[{i}]"))
    if not candidates:
        raise IgnoredObject("no clusterIP allocated (headless or not yet allocated)")
    for i, ip in enumerate(candidates):
        path = "spec.clusterIP" if i == 0 and primary else f"spec.clusterIPs[{i - bool(primary)}]"
        text = _ip_text(ip, path)
        if _is_v4(text):
            return text
    raise IgnoredObject("IPv6-only service (dual stack is not built yet)")


def _source_ranges(spec: dict[str, Any]) -> tuple[str, ...]:
    out: list[str] = []
    for i, cidr in enumerate(
        _list(spec.get("loadBalancerSourceRanges"), "spec.loadBalancerSourceRanges")
    ):
        path = f"spec.loadBalancerSourceRanges[{i}]"
        net = _canonical_cidr(_str(cidr, path).strip())
        if net is None:
            raise InvalidObject(path, f"Invalid value: {cidr!r}: must be a valid CIDR")
        if net.version == 4:
            out.append(str(net))
    return tuple(out)


# --- EndpointSlice ---------------------------------------------------------------------------


def parse_endpoint_slice(obj: dict[str, Any]) -> ParsedSlice:
    meta = _mapping(obj.get("metadata"), "metadata")
    name = _str(meta.get("name"), "metadata.name", required=True)
    namespace = _str(meta.get("namespace"), "metadata.namespace") or "default"
    labels = _labels(meta, "labels", "metadata")
    annotations = _labels(meta, "annotations", "metadata")
    service = labels.get(SERVICE_NAME_LABEL, "")
    if not service:
        raise InvalidObject(f"metadata.labels[{SERVICE_NAME_LABEL}]", "required label is missing")
    address_type = _str(obj.get("addressType"), "addressType", required=True)
    if address_type == "IPv6":
        raise IgnoredObject("addressType IPv6 (dual stack is not built yet)")
    if address_type == "FQDN":
        raise IgnoredObject("addressType FQDN")
    if address_type != "IPv4":
        raise InvalidObject("addressType", f"Unsupported value: {address_type!r}")

    ports: list[tuple[str, Protocol, int]] = []
    for i, raw in enumerate(_list(obj.get("ports"), "ports")):
        p = _mapping(raw, f"ports[{i}]")
        if p.get("port") is None:
            continue  # a slice port without a number carries no traffic
        ports.append(
            (
                _str(p.get("name"), f"ports[{i}].name"),
                _protocol(p.get("protocol"), f"ports[{i}].protocol"),
                _port(p.get("port"), f"ports[{i}].port"),
            )
        )

    endpoints = tuple(
        _plain_endpoint(raw) or _checked_endpoint(raw, f"endpoints[{i}]")
        for i, raw in enumerate(_list(obj.get("endpoints"), "endpoints"))
    )
    return ParsedSlice(
        namespace=namespace,
        name=name,
        service=service,
        ports=tuple(ports),
        endpoints=endpoints,
        trigger_time=_trigger_time(annotations.get(TRIGGER_TIME_ANNOTATION)),
    )


# A dotted quad already in canonical form (no leading zeros, each octet at most 255).
_CANONICAL_IPV4 = re.compile(
    r"(?:(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
)


def _plain_endpoint(raw: Any) -> ParsedEndpoint | None:
    """The endpoint in its common shape (canonical IPv4, string names, boolean conditions,
    no hints) without building a field path per check; None sends anything else to
    _checked_endpoint, which gives the same result or names the bad field. A cluster's
    endpoints are most of what a node parses."""
    if type(raw) is not dict or "hints" in raw:
        return None
    addrs = raw.get("addresses")
    if type(addrs) is not list or not addrs:
        return None
    ip = addrs[0]
    if type(ip) is not str or _CANONICAL_IPV4.fullmatch(ip) is None:
        return None
    node = raw.get("nodeName", "")
    zone = raw.get("zone", "")
    if type(node) is not str or type(zone) is not str:
        return None
    cond = raw.get("conditions", _NO_CONDITIONS)
    if type(cond) is not dict:
        return None
    ready, serving, terminating = (
        cond.get("ready", True),
        cond.get("serving", True),
        cond.get("terminating", False),
    )
    if type(ready) is not bool or type(serving) is not bool or type(terminating) is not bool:
        return None
    return ParsedEndpoint(
        ip=ip,
        node_name=sys.intern(node),
        zone=sys.intern(zone),
        ready=ready,
        serving=serving,
        terminating=terminating,
        zone_hints=_NO_HINTS,
        node_hints=_NO_HINTS,
    )


def _checked_endpoint(raw: Any, path: str) -> ParsedEndpoint:
    ep = _mapping(raw, path)
    addrs = _list(ep.get("addresses"), f"{path}.addresses")
    if not addrs:
        raise InvalidObject(f"{path}.addresses", "required field is missing")
    # Upstream uses only the first address of an endpoint.
    ip = _ip_text(addrs[0], f"{path}.addresses[0]")
    if not _is_v4(ip):
        raise InvalidObject(f"{path}.addresses[0]", f"Invalid value: {addrs[0]!r}: not IPv4")
    cond = _mapping(ep.get("conditions"), f"{path}.conditions")
    hints = _mapping(ep.get("hints"), f"{path}.hints")
    return ParsedEndpoint(
        ip=ip,
        # A handful of node and zone names repeat over every endpoint of a cluster.
        node_name=sys.intern(_str(ep.get("nodeName"), f"{path}.nodeName")),
        zone=sys.intern(_str(ep.get("zone"), f"{path}.zone")),
        ready=_condition(cond, "ready", True, path),
        serving=_condition(cond, "serving", True, path),
        terminating=_condition(cond, "terminating", False, path),
        zone_hints=_hint_names(hints, "forZones", path),
        node_hints=_hint_names(hints, "forNodes", path),
    )


def _condition(cond: dict[str, Any], key: str, default: bool, path: str) -> bool:
    value = cond.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidObject(f"{path}.conditions.{key}", f"must be true or false, got {value!r}")
    return value


_NO_HINTS: frozenset[str] = frozenset()
_NO_CONDITIONS: dict[str, Any] = {}


def _hint_names(hints: dict[str, Any], key: str, path: str) -> frozenset[str]:
    if not hints.get(key):
        return _NO_HINTS
    names = []
    for i, h in enumerate(_list(hints.get(key), f"{path}.hints.{key}")):
        names.append(
            _str(
                _mapping(h, f"{path}.hints.{key}[{i}]").get("name"), f"{path}.hints.{key}[{i}].name"
            )
        )
    return frozenset(n for n in names if n)


def _trigger_time(value: str | None) -> float | None:
    if not value:
        return None
    from datetime import datetime

    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


# --- Node ------------------------------------------------------------------------------------


def parse_node(obj: dict[str, Any]) -> ParsedNode:
    meta = _mapping(obj.get("metadata"), "metadata")
    name = _str(meta.get("name"), "metadata.name", required=True)
    labels = _labels(meta, "labels", "metadata")
    spec = _mapping(obj.get("spec"), "spec")
    status = _mapping(obj.get("status"), "status")
    addresses: list[str] = []
    for i, a in enumerate(_list(status.get("addresses"), "status.addresses")):
        a = _mapping(a, f"status.addresses[{i}]")
        if a.get("type") in ("InternalIP", "ExternalIP") and a.get("address"):
            ip = _ip(a["address"], f"status.addresses[{i}].address")
            if ip.version == 4:
                addresses.append(str(ip))
    cidrs = [c for c in _list(spec.get("podCIDRs"), "spec.podCIDRs") if isinstance(c, str)]
    if not cidrs and isinstance(spec.get("podCIDR"), str):
        cidrs = [spec["podCIDR"]]
    v4 = []
    for c in cidrs:
        try:
            net = ipaddress.ip_network(c, strict=False)
        except ValueError:
            raise InvalidObject(
                "spec.podCIDRs", f"Invalid value: {c!r}: must be a valid CIDR"
            ) from None
        if net.version == 4:
            v4.append(str(net))
    return ParsedNode(
        name=name,
        labels=tuple(sorted(labels.items())),
        addresses=tuple(addresses),
        pod_cidrs=tuple(v4),
    )
