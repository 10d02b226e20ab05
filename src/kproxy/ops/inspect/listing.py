"""`kproxy list`: the programmed services of the live mode, in `ipvsadm -Ln`'s layout.

Order: by default service-port name, then ClusterIP, external IPs, LB IPs, NodePorts
(addresses numerically); `sort=True` orders like `ipvsadm --sort`: protocol, address
(numerically, "*" last), port.

Counters (`stats`): iptables nat rule counters from `iptables-save -c` — the KUBE-SERVICES
/ KUBE-NODEPORTS rule for the virtual server, the KUBE-SEP DNAT rule for each endpoint
(shared by every address of the service). nat only sees the first packet of a connection,
so these count new connections. The nftables layout has no counters ("n/a").
ActiveConn/InActConn come from conntrack in every mode (counts.py). `rate`: two reads
`interval` seconds apart, per-second differences of the counters.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kproxy.model.objects import Snapshot
from kproxy.ops.inspect import drift
from kproxy.ops.inspect.counts import apply_conntrack
from kproxy.ops.inspect.kernel import KernelSource
from kproxy.ops.inspect.model import (
    KIND_ORDER,
    ModeView,
    VirtualServer,
    address_sort_key,
    percent,
)
from kproxy.ops.inspect.readers import select

COUNTER_NOTE = {
    "iptables": (
        "Pkts/Bytes: nat rule counters (iptables-save -c); nat sees only the first packet of "
        "a connection, so Pkts counts new connections. Endpoint counters belong to the "
        "endpoint's KUBE-SEP chain, shared by every address of its service."
    ),
    "nftables": "Pkts/Bytes: n/a, the nftables layout has no counters",
}


@dataclass
class DataplaneListing:
    dataplane: str
    mode: str
    live: bool
    detail: str
    read_from: str
    has_counters: bool
    servers: list[VirtualServer]
    conntrack_ok: bool = True
    notes: list[str] = field(default_factory=list)
    counter_note: str | None = None  # what Pkts/Bytes mean, when the mode says so itself

    @property
    def service_names(self) -> list[str]:
        return sorted({vs.service for vs in self.servers if vs.service})

    def server(self, proto: str, address: str, port: int) -> VirtualServer | None:
        for vs in self.servers:
            if vs.key == (proto, address, port):
                return vs
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "dataplane": self.dataplane,
            "mode": self.mode,
            "live": self.live,
            "detail": self.detail,
            "read_from": self.read_from,
            "has_counters": self.has_counters,
            "conntrack_ok": self.conntrack_ok,
            "services": len(self.service_names),
            "notes": list(self.notes),
            "virtual_servers": [vs.to_json() for vs in self.servers],
        }


@dataclass
class ListingResult:
    dataplanes: list[DataplaneListing]
    notes: list[str] = field(default_factory=list)
    drift: list[str] = field(default_factory=list)
    stats: bool = False
    rate: bool = False
    sort: bool = False
    snapshot_given: bool = False

    @property
    def found(self) -> bool:
        return bool(self.dataplanes)

    @property
    def mid_switch(self) -> bool:
        return sum(1 for d in self.dataplanes if d.live) > 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "mid_switch": self.mid_switch,
            "stats": self.stats,
            "rate": self.rate,
            "sorted": self.sort,
            "notes": list(self.notes),
            "drift": list(self.drift) if self.snapshot_given else None,
            "dataplanes": [d.to_json() for d in self.dataplanes],
        }

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2)

    def text(self) -> str:
        lines: list[str] = []
        if not self.dataplanes:
            lines.append("kproxy list: no kube-proxy dataplane found")
        if self.notes:  # mid-switch and leftovers first: they change how to read the rest
            lines += [f"note: {n}" for n in self.notes]
            lines.append("")
        for dp in self.dataplanes:
            lines += _section(dp, stats=self.stats or self.rate, rate=self.rate)
        if self.snapshot_given:
            lines.append("")
            if self.drift:
                lines.append(f"drift: the kernel and the snapshot disagree ({len(self.drift)}):")
                lines += [f"  - {d}" for d in self.drift]
            else:
                lines.append("drift: none (the kernel programs what the snapshot says)")
        return "\n".join(lines) + "\n"


def _num(value: float | int | None, rate: bool = False) -> str:
    if value is None:
        return "n/a"
    if rate:
        return f"{value:.1f}"
    return str(value)


def _section(dp: DataplaneListing, *, stats: bool, rate: bool) -> list[str]:
    state = "" if dp.live else f" — NOT LIVE ({dp.detail})"
    names = dp.service_names
    lines = [
        f"kproxy list: {dp.mode} mode ({dp.dataplane}), {len(names)} "
        f"service{'s' if len(names) != 1 else ''}, {len(dp.servers)} virtual "
        f"server{'s' if len(dp.servers) != 1 else ''}{state}",
        "Prot LocalAddress:Port Scheduler Flags",
    ]
    head = "  -> RemoteAddress:Port           Forward Weight ActiveConn InActConn Share"
    if stats:
        head += "      Pkts     Bytes"
    if rate:
        head += "    Pkts/s   Bytes/s"
    lines.append(head)
    for vs in dp.servers:
        flags = " ".join(vs.flags)
        line = f"{vs.proto.upper():<4} {vs.addr} {vs.scheduler}{' ' + flags if flags else ''}"
        label = f"{vs.service or '?'} ({vs.kind})"
        counters = ""
        if stats:
            counters = f"  pkts {_num(vs.packets)} bytes {_num(vs.bytes)}"
        if rate:
            counters += f" pkts/s {_num(vs.packet_rate, True)} bytes/s {_num(vs.byte_rate, True)}"
        lines.append(f"{line}  # {label}{counters}")
        for rs in vs.endpoints:
            active = str(rs.active) if dp.conntrack_ok else "?"
            inactive = str(rs.inactive) if dp.conntrack_ok else "?"
            row = (
                f"  -> {rs.addr:<28} {rs.forward:<7} {rs.weight:<6} {active:<10} "
                f"{inactive:<9} {percent(rs.share):>6}"
            )
            if stats:
                row += f" {_num(rs.packets):>9} {_num(rs.bytes):>9}"
            if rate:
                row += f" {_num(rs.packet_rate, True):>9} {_num(rs.byte_rate, True):>9}"
            lines.append(row)
        if vs.verdict:
            lines.append(f"  -> (none: new connections get {vs.verdict}; {vs.verdict_reason})")
        elif not vs.endpoints:
            lines.append("  -> (none)")
        if vs.unlisted_conns:
            lines.append(
                f"     ! {vs.unlisted_conns} conntrack entries to this address went to an "
                "endpoint not listed here"
            )
        lines += [f"     ! {n}" for n in vs.notes]
    if stats:
        if dp.counter_note:
            lines.append(dp.counter_note)
        elif dp.mode == "iptables" and dp.has_counters:
            lines.append(COUNTER_NOTE["iptables"])
        elif dp.has_counters:
            lines.append("Pkts/Bytes: from the counter statements of the rules")
        else:
            lines.append(COUNTER_NOTE.get(dp.mode, "Pkts/Bytes: n/a, no counters in the rules"))
    if not dp.conntrack_ok:
        lines.append("ActiveConn/InActConn: ? (the conntrack table could not be read)")
    lines += [f"note: {n}" for n in dp.notes]
    lines.append("")
    return lines


def _order(servers: list[VirtualServer], sort: bool) -> list[VirtualServer]:
    if sort:
        return sorted(servers, key=lambda v: (v.proto, address_sort_key(v.address), v.port))
    return sorted(
        servers,
        key=lambda v: (v.service, KIND_ORDER.get(v.kind, 9), address_sort_key(v.address), v.port),
    )


def _read(view: ModeView, source: KernelSource) -> DataplaneListing:
    servers = view.services()
    notes: list[str] = list(view.notes)
    # userspace mode counts connections itself (its workers know them; conntrack sees only
    # the redirects to the proxy ports).
    entries = None if getattr(view, "counts_connections", False) else source.conntrack_entries()
    if entries is not None:
        apply_conntrack(servers, entries, view.local_addresses())
    elif not getattr(view, "counts_connections", False):
        notes.append(f"conntrack: {source.errors.get('conntrack', 'unreadable')}")
    return DataplaneListing(
        view.dataplane,
        view.mode,
        view.live,
        view.detail,
        source.command(view.dataplane),
        view.has_counters,
        servers,
        conntrack_ok=entries is not None or getattr(view, "counts_connections", False),
        notes=notes,
        counter_note=getattr(view, "counter_note", None),
    )


def _rates(first: DataplaneListing, second: DataplaneListing, seconds: float) -> None:
    before = {vs.key: vs for vs in first.servers}
    for vs in second.servers:
        old = before.get(vs.key)
        if old is None or seconds <= 0:
            continue
        if vs.packets is not None and old.packets is not None:
            vs.packet_rate = max(0, vs.packets - old.packets) / seconds
            vs.byte_rate = max(0, (vs.bytes or 0) - (old.bytes or 0)) / seconds
        old_eps = {rs.chain: rs for rs in old.endpoints}
        for rs in vs.endpoints:
            prev = old_eps.get(rs.chain)
            if prev is not None and rs.packets is not None and prev.packets is not None:
                rs.packet_rate = max(0, rs.packets - prev.packets) / seconds
                rs.byte_rate = max(0, (rs.bytes or 0) - (prev.bytes or 0)) / seconds


def list_services(
    netns: str | None = None,
    *,
    mode: str | None = None,
    stats: bool = False,
    rate: bool = False,
    sort: bool = False,
    snapshot: Snapshot | None = None,
    source: KernelSource | None = None,
    interval: float = 1.0,
    sleep: Callable[[float], None] = time.sleep,
) -> ListingResult:
    """The programmed services of the live mode(s), read from the kernel (read only).

    mode: "iptables", "iptables-nft", "iptables-legacy" or "nftables" (None: whatever is
    live; both when a switch is half done). snapshot: the desired state, to report drift.
    source: where dumps come from (default: live, in `netns`). Raises
    readers.ModeSelectionError for a mode it cannot read.
    """
    src = source or KernelSource(netns)
    selection = select(src, mode)
    listings = [_read(v, src) for v in selection.views]
    if rate and listings:
        started = time.monotonic()
        sleep(interval)
        elapsed = time.monotonic() - started if source is None or not src.recorded else interval
        src.refresh()
        second = select(src, mode)
        again = {v.dataplane: _read(v, src) for v in second.views}
        for first in listings:
            newer = again.get(first.dataplane)
            if newer is not None:
                _rates(first, newer, elapsed or interval)
        listings = [again.get(d.dataplane, d) for d in listings]
    for d in listings:
        d.servers = _order(d.servers, sort)
    result = ListingResult(
        listings,
        notes=selection.notes,
        stats=stats or rate,
        rate=rate,
        sort=sort,
        snapshot_given=snapshot is not None,
    )
    if snapshot is not None:
        for d in listings:
            prefix = f"{d.dataplane}: " if len(listings) > 1 else ""
            result.drift += [prefix + f for f in drift.compare(d.servers, snapshot)]
    return result
