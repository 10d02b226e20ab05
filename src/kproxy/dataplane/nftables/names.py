"""Object names of nftables mode exactly as upstream kube-proxy derives them.

Per-service and per-endpoint objects are named `<prefix><HASH>-<readable name>` where HASH is
the first 8 characters of base32(sha256(readable name)); the readable name uses "/" as a
separator, which none of upstream's fixed chain names contain (that is how service chains
are recognised).
"""

from __future__ import annotations

import base64
import hashlib
from functools import lru_cache

from kproxy.model.objects import ServicePortName

TABLE = "kube-proxy"
TABLE_COMMENT = "rules for kube-proxy"

# nft's limit for object names is 256; upstream keeps 16 for the prefix.
NAME_LENGTH_MAX = 256
PREFIX_LENGTH_MAX = 16
BASE_LENGTH_MAX = NAME_LENGTH_MAX - PREFIX_LENGTH_MAX

SERVICE_PREFIX = "service-"
LOCAL_PREFIX = "local-"
EXTERNAL_PREFIX = "external-"
FIREWALL_PREFIX = "firewall-"
ENDPOINT_PREFIX = "endpoint-"
AFFINITY_PREFIX = "affinity-"
# The prefixes of per-service and per-endpoint chains (service_port_of decodes their names).
CHAIN_PREFIXES = (SERVICE_PREFIX, LOCAL_PREFIX, EXTERNAL_PREFIX, FIREWALL_PREFIX, ENDPOINT_PREFIX)

# Fixed chains, sets and maps.
FILTER_PREROUTING_PRE_DNAT = "filter-prerouting-pre-dnat"
FILTER_OUTPUT_PRE_DNAT = "filter-output-pre-dnat"
FILTER_INPUT = "filter-input"
FILTER_FORWARD = "filter-forward"
FILTER_OUTPUT = "filter-output"
NAT_PREROUTING = "nat-prerouting"
NAT_OUTPUT = "nat-output"
NAT_POSTROUTING = "nat-postrouting"

SERVICES_CHAIN = "services"
SERVICE_IPS_MAP = "service-ips"
SERVICE_NODEPORTS_MAP = "service-nodeports"
NODEPORT_IPS_SET = "nodeport-ips"
CLUSTER_IPS_SET = "cluster-ips"
SERVICE_ENDPOINTS_CHECK_CHAIN = "service-endpoints-check"
NODEPORT_ENDPOINTS_CHECK_CHAIN = "nodeport-endpoints-check"
NO_ENDPOINT_SERVICES_MAP = "no-endpoint-services"
NO_ENDPOINT_NODEPORTS_MAP = "no-endpoint-nodeports"
REJECT_CHAIN = "reject-chain"
CLUSTER_IPS_CHECK_CHAIN = "cluster-ips-check"
FIREWALL_IPS_MAP = "firewall-ips"
FIREWALL_CHECK_CHAIN = "firewall-check"
MARK_MASQ_CHAIN = "mark-for-masquerade"
MASQUERADING_CHAIN = "masquerading"

# kproxy's compact layout (compact.py): its own table, so that both layouts can be in the
# kernel at once during a switch between them; "kproxy-" marks it as kproxy's for cleanup.
COMPACT_TABLE = "kproxy-compact"
COMPACT_TABLE_COMMENT = "rules for kproxy (compact nftables layout)"
# The endpoint maps, one per transport protocol ("service-endpoints-udp"): a map's data
# names its protocol's port, and nft makes the DNAT match that protocol only.
SERVICE_ENDPOINTS_MAP = "service-endpoints"
NODEPORT_ENDPOINTS_MAP = "nodeport-endpoints"
ENDPOINT_MAP_PROTOCOLS = ("tcp", "udp", "sctp")
HAIRPIN_SET = "hairpin-endpoints"
# Its dispatch chains, shared by every service port with the same endpoint counts:
# "dnat/internal/3", "dnat/external-local/3/1". The "/" makes them service chains to the
# writer (created when first used, flushed and deleted when no longer used).
SHARED_PREFIX = "dnat/"


def endpoint_map(base: str, proto: str) -> str:
    """The endpoint map of a protocol: endpoint_map(SERVICE_ENDPOINTS_MAP, "udp")."""
    return f"{base}-{proto}"


ENDPOINT_MAPS = tuple(
    endpoint_map(base, proto)
    for base in (SERVICE_ENDPOINTS_MAP, NODEPORT_ENDPOINTS_MAP)
    for proto in ENDPOINT_MAP_PROTOCOLS
)


def hash_and_truncate(name: str) -> str:
    """HASH-name, cut to BASE_LENGTH_MAX with a trailing "..." (upstream's hashAndTruncate)."""
    # The 8 characters used are the base32 of the digest's first 5 bytes; encoding only
    # those spares the pure-Python encoder most of its work (one call per endpoint).
    digest = base64.b32encode(hashlib.sha256(name.encode()).digest()[:5]).decode()
    out = f"{digest}-{name}"
    if len(out) > BASE_LENGTH_MAX:
        out = out[: BASE_LENGTH_MAX - 3] + "..."
    return out


@lru_cache(maxsize=65536)
def service_base(name: ServicePortName) -> str:
    """ "ULMVA6XW-ns1/svc1/tcp/p80": the base of a service port's chains."""
    return hash_and_truncate(f"{name.namespace}/{name.name}/{name.protocol.lower}/{name.port}")


def endpoint_base(name: ServicePortName, ip: str, port: int) -> str:
    """ "5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80": the base of an endpoint's chain and set.

    IPv6 colons are not allowed in nft names and become dots, as upstream does."""
    host = ip.replace(":", ".")
    return hash_and_truncate(
        f"{name.namespace}/{name.name}/{name.protocol.lower}/{name.port}__{host}/{port}"
    )


def service_port_of(chain: str) -> str:
    """The service port a chain of service_base / endpoint_base belongs to, as kube-proxy's
    comments name it: 'service-SUSTUHLJ-default/web/tcp/http' -> 'default/web:http' ("" for
    other chains; a truncated name as it stands)."""
    for prefix in CHAIN_PREFIXES:
        if chain.startswith(prefix):
            rest = chain[len(prefix) :]
            break
    else:
        return ""
    _hash, _, name = rest.partition("-")
    name = name.split("__", 1)[0]  # an endpoint chain's "__IP/PORT"
    parts = name.split("/")
    if len(parts) != 4:
        return name
    ns, svc, _proto, port = parts
    return f"{ns}/{svc}:{port}" if port else f"{ns}/{svc}"


def is_service_chain(chain: str) -> bool:
    return "/" in chain


def is_shared_chain(chain: str) -> bool:
    return chain.startswith(SHARED_PREFIX)


def is_affinity_set(name: str) -> bool:
    return name.startswith(AFFINITY_PREFIX)
