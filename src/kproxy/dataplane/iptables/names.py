"""Chain names exactly as upstream kube-proxy derives them (so runbooks and dashboards match)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from functools import lru_cache

from kproxy.model.objects import Endpoint, ServicePortName

SVC_PREFIX = "KUBE-SVC-"
SVL_PREFIX = "KUBE-SVL-"
EXT_PREFIX = "KUBE-EXT-"
FW_PREFIX = "KUBE-FW-"
SEP_PREFIX = "KUBE-SEP-"
SERVICE_CHAIN_PREFIXES = (SVC_PREFIX, SVL_PREFIX, EXT_PREFIX, FW_PREFIX, SEP_PREFIX)


_B32 = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"
# Two base32 digits per 10 bits: the first 16 digits of base32(sha256) are the first 80 bits,
# so a table lookup gives upstream's suffix several times faster than base64.b32encode.
_PAIRS = [_B32[i >> 5] + _B32[i & 31] for i in range(1024)]


def _hash16(text: str) -> str:
    """base32(sha256(text))[:16], as upstream's chain-name hash."""
    n = int.from_bytes(hashlib.sha256(text.encode()).digest()[:10], "big")
    p = _PAIRS
    return (
        p[n >> 70]
        + p[(n >> 60) & 1023]
        + p[(n >> 50) & 1023]
        + p[(n >> 40) & 1023]
        + p[(n >> 30) & 1023]
        + p[(n >> 20) & 1023]
        + p[(n >> 10) & 1023]
        + p[n & 1023]
    )


@lru_cache(maxsize=65536)
def port_proto_hash(name: ServicePortName) -> str:
    """Suffix shared by a service port's SVC/SVL/EXT/FW chains."""
    return _hash16(str(name) + name.protocol.lower)


def endpoint_chain(name: ServicePortName, endpoint_addr: str) -> str:
    return SEP_PREFIX + _hash16(str(name) + name.protocol.lower + endpoint_addr)


def sep_chains(name: ServicePortName, endpoints: Iterable[Endpoint]) -> dict[str, str]:
    """addr -> KUBE-SEP- chain for each endpoint of one service port."""
    base = str(name) + name.protocol.lower
    return {ep.addr: SEP_PREFIX + _hash16(base + ep.addr) for ep in endpoints}


def is_service_chain(chain: str) -> bool:
    return chain.startswith(SERVICE_CHAIN_PREFIXES)
