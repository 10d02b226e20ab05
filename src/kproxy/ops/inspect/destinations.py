"""Service destinations: what every mode must program for the objects, and what each
dataplane programs, read by its reader (readers.py) from a live kernel or a recorded one
(a `kproxy snapshot` document, ops.snapshot.recorded_source).

The switch verifies the new mode with these, preflight the mode serving now, doctor and
`kproxy diff` compare with them: the same entries `kproxy list` shows, so a switch that
passes its check leaves nothing `kproxy list` would show missing.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from kproxy.model.objects import Snapshot
from kproxy.ops.inspect.kernel import KernelSource
from kproxy.ops.inspect.model import Destination
from kproxy.ops.inspect.readers import READERS

# Per dataplane ("iptables-nft", "nftables", …), its destinations -> their service port.
Programmed = dict[str, dict[Destination, str]]


def expected_destinations(snapshot: Snapshot) -> set[Destination]:
    """What any mode must program for this snapshot: ClusterIPs with internal endpoints,
    externalIPs and LoadBalancer IPs with endpoints."""
    out: set[Destination] = set()
    for sp in snapshot.services.values():
        proto = sp.protocol.lower
        if sp.has_internal_endpoints:
            out.add(Destination(sp.cluster_ip, proto, sp.port))
        if sp.any_endpoints:
            out.update(
                Destination(ip, proto, sp.port) for ip in (*sp.external_ips, *sp.load_balancer_ips)
            )
    return out


def missing_destinations(
    snapshot: Snapshot, programmed: Mapping[Destination, str] | Collection[Destination]
) -> tuple[list[Destination], int]:
    """The snapshot's expected destinations a dataplane lacks (sorted), and how many it
    expects."""
    expected = expected_destinations(snapshot)
    return sorted(expected - set(programmed)), len(expected)


def programmed(source: KernelSource, dataplanes: Collection[str] | None = None) -> Programmed:
    """Per dataplane (those named, or all), the service destinations it programs; a
    dataplane that programs none is left out."""
    out: Programmed = {}
    for reader in READERS:
        if dataplanes is not None and reader.dataplane not in dataplanes:
            continue
        found = reader.destinations(source)
        if found:
            out[reader.dataplane] = found
    return out


def plane_destinations(dataplane: str, netns: str | None = None) -> dict[Destination, str]:
    """The service destinations one dataplane has in the kernel now."""
    return programmed(KernelSource(netns), [dataplane]).get(dataplane, {})
