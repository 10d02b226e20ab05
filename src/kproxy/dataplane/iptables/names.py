"""Chain names exactly as upstream kube-proxy derives them (so runbooks and dashboards match)."""

from __future__ import annotations

import base64
import hashlib
from functools import lru_cache

from kproxy.model.objects import Endpoint, ServicePortName

SVC_PREFIX = "KUBE-SVC-"
SVL_PREFIX = "KUBE-SVL-"
EXT_PREFIX = "KUBE-EXT-"
FW_PREFIX = "KUBE-FW-"
SEP_PREFIX = "KUBE-SEP-"
SERVICE_CHAIN_PREFIXES = (SVC_PREFIX, SVL_PREFIX, EXT_PREFIX, FW_PREFIX, SEP_PREFIX)


def _hash16(text: str) -> str:
    return base64.b32encode(hashlib.sha256(text.encode()).digest())[:16].decode()


@lru_cache(maxsize=65536)
def port_proto_hash(name: ServicePortName) -> str:
    """Suffix shared by a service port's SVC/SVL/EXT/FW chains."""
    return _hash16(str(name) + name.protocol.lower)


@lru_cache(maxsize=1 << 20)
def endpoint_chain(name: ServicePortName, endpoint_addr: str) -> str:
    return SEP_PREFIX + _hash16(str(name) + name.protocol.lower + endpoint_addr)


def sep_chain(name: ServicePortName, ep: Endpoint) -> str:
    return endpoint_chain(name, ep.addr)


def is_service_chain(chain: str) -> bool:
    return chain.startswith(SERVICE_CHAIN_PREFIXES)
