"""Conntrack helpers through the conntrack CLI: list, targeted delete, stale UDP cleanup.

Why this exists: a UDP "connection" to a Service keeps its DNAT binding for as long as
packets keep flowing, so after an endpoint goes away its clients keep sending to the dead
pod (kubernetes #19029 and friends). After each successful sync upstream deletes the UDP
entries whose original destination is a Service IP or NodePort and whose reply source is
not a serving endpoint any more (upstream-kube-proxy.md §5). Never a flush: long-lived
healthy UDP flows must survive (#122740).

Costs measured here (conntrack-tools 1.4.7, 5,000 entries): every ``-D`` with filters dumps
the whole table, about 16 ms per call, however precise the filter. One filter per stale
entry would therefore be O(entries²); instead deletes are grouped the way upstream's filters
are, by (original destination, destination port, reply source), and all filters of a
cleanup go to a single ``conntrack -R -`` process. A grouped delete of 4,780 entries took
47 ms.

`--status UNREPLIED` is never used with ``-D``: in 1.4.7 it appeared to delete ASSURED
entries too (lab G13).
"""

from __future__ import annotations

import logging
import re
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Final

from kproxy.host.commands import Runner, in_netns, run_command

log = logging.getLogger(__name__)

CONNTRACK_MAX: Final = "/proc/sys/net/netfilter/nf_conntrack_max"
_DELETED_RE: Final = re.compile(r"(\d+) flow entries have been deleted")
_TUPLE_KEYS: Final = ("src", "dst", "sport", "dport")


class ConntrackError(Exception):
    """The conntrack tool failed (or a request would have been a flush)."""


@dataclass(frozen=True, slots=True)
class ConntrackEntry:
    """One flow as ``conntrack -L`` prints it; ports are None for port-less protocols."""

    proto: str
    orig_src: str
    orig_dst: str
    orig_sport: int | None
    orig_dport: int | None
    reply_src: str
    reply_dst: str
    reply_sport: int | None
    reply_dport: int | None
    timeout: int = 0
    state: str | None = None
    flags: frozenset[str] = frozenset()
    family: str = "ipv4"
    mark: int | None = None
    zone: int | None = None

    @property
    def assured(self) -> bool:
        return "ASSURED" in self.flags

    @property
    def unreplied(self) -> bool:
        return "UNREPLIED" in self.flags


def _port(value: str | None) -> int | None:
    return int(value) if value is not None and value.isdigit() else None


def parse_entry(line: str) -> ConntrackEntry | None:
    """Parse one line of ``conntrack -L`` (default or ``-o extended``); None if not a flow."""
    tokens = line.split()
    if not tokens or "src=" not in line:
        return None
    family = "ipv4"
    if tokens[0] in ("ipv4", "ipv6"):
        family, tokens = tokens[0], tokens[2:]
    head: list[str] = []
    tuples: list[dict[str, str]] = [{}, {}]
    extras: dict[str, str] = {}
    flags: set[str] = set()
    direction = -1
    for token in tokens:
        if token.startswith("[") and token.endswith("]"):
            flags.add(token[1:-1])
            continue
        key, eq, value = token.partition("=")
        if not eq:
            if direction < 0:
                head.append(token)
            continue
        if key == "src":
            # Each tuple starts with src=; the second one is the reply direction.
            direction += 1
        if key in _TUPLE_KEYS and 0 <= direction <= 1 and key not in tuples[direction]:
            tuples[direction][key] = value
        elif direction >= 0:
            extras.setdefault(key, value)
    if len(head) < 3 or direction < 1:
        return None
    orig, reply = tuples
    try:
        timeout = int(head[2])
    except ValueError:
        timeout = 0
    return ConntrackEntry(
        proto=head[0],
        orig_src=orig.get("src", ""),
        orig_dst=orig.get("dst", ""),
        orig_sport=_port(orig.get("sport")),
        orig_dport=_port(orig.get("dport")),
        reply_src=reply.get("src", ""),
        reply_dst=reply.get("dst", ""),
        reply_sport=_port(reply.get("sport")),
        reply_dport=_port(reply.get("dport")),
        timeout=timeout,
        state=head[3] if len(head) > 3 else None,
        flags=frozenset(flags),
        family=family,
        mark=_port(extras.get("mark")),
        zone=_port(extras.get("zone")),
    )


def parse_entries(text: str) -> list[ConntrackEntry]:
    return [entry for line in text.splitlines() if (entry := parse_entry(line)) is not None]


@dataclass(frozen=True, slots=True, order=True)
class DeleteFilter:
    """A ``conntrack -D`` selection. At least one address or port is required: a filter
    of only a protocol would delete every flow of it, which this module never does."""

    proto: str
    orig_src: str | None = None
    orig_dst: str | None = None
    orig_sport: int | None = None
    orig_dport: int | None = None
    reply_src: str | None = None
    reply_dst: str | None = None
    state: str | None = None

    def args(self, family: str = "ipv4") -> list[str]:
        selective = [
            f.name
            for f in fields(self)
            if f.name not in ("proto", "state") and getattr(self, f.name) is not None
        ]
        if not selective:
            raise ConntrackError(f"refusing an unselective conntrack delete ({self})")
        if (self.orig_sport is not None or self.orig_dport is not None or self.state) and (
            self.proto not in ("tcp", "udp", "sctp", "dccp", "udplite")
        ):
            raise ConntrackError(f"ports and states need a port protocol, not {self.proto!r}")
        argv = ["-D", "-f", family, "-p", self.proto]
        for flag, value in (
            ("--orig-src", self.orig_src),
            ("--orig-dst", self.orig_dst),
            ("--orig-port-src", self.orig_sport),
            ("--orig-port-dst", self.orig_dport),
            ("--reply-src", self.reply_src),
            ("--reply-dst", self.reply_dst),
            ("--state", self.state),
        ):
            if value is not None:
                argv += [flag, str(value)]
        return argv


def stale_udp_filters(
    entries: Iterable[ConntrackEntry],
    service_ips: Mapping[tuple[str, int], set[str]],
    node_ports: Mapping[int, set[str]],
) -> list[DeleteFilter]:
    """The deletes upstream's reconciler would do for these entries (pure; sorted, unique).

    service_ips: (service IP, port) of every UDP ClusterIP / LoadBalancer / external IP ->
    serving endpoint IPs. node_ports: UDP NodePort -> serving endpoint IPs. An entry is
    stale when its original destination matches and its reply source (the endpoint the
    flow was DNATed to) is not serving. Upstream keys service IPs by address only; keying
    by (address, port) keeps a flow to another port of the same IP out of the decision.
    """
    found: set[DeleteFilter] = set()
    for entry in entries:
        if entry.proto != "udp" or entry.orig_dport is None:
            continue
        serving = service_ips.get((entry.orig_dst, entry.orig_dport))
        if serving is not None and entry.reply_src not in serving:
            found.add(
                DeleteFilter(
                    "udp",
                    orig_dst=entry.orig_dst,
                    orig_dport=entry.orig_dport,
                    reply_src=entry.reply_src,
                )
            )
        serving = node_ports.get(entry.orig_dport)
        if serving is not None and entry.reply_src not in serving:
            found.add(DeleteFilter("udp", orig_dport=entry.orig_dport, reply_src=entry.reply_src))
    return sorted(
        found,
        key=lambda f: tuple(
            "" if v is None else str(v) for v in (f.orig_dst, f.orig_dport, f.reply_src)
        ),
    )


def _count_printed(stdout: str) -> int:
    # conntrack prints every entry it deleted on stdout.
    return len(parse_entries(stdout))


class Conntrack:
    """The conntrack table of one namespace (None: the caller's own) and family."""

    def __init__(
        self, netns: str | None = None, *, family: str = "ipv4", runner: Runner | None = None
    ) -> None:
        if family not in ("ipv4", "ipv6"):
            raise ValueError(f"unknown family {family!r}")
        self.netns = netns
        self.family = family
        self._runner: Runner = runner or run_command

    def __repr__(self) -> str:
        return f"Conntrack(netns={self.netns!r}, family={self.family!r})"

    def _run(
        self, args: Sequence[str], input_data: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        return self._runner(in_netns(["conntrack", *args], self.netns), input_data)

    def list_entries(self, proto: str | None = "udp") -> list[ConntrackEntry]:
        """All flows of `proto` (None: every protocol) in one dump."""
        args = ["-L", "-f", self.family, "-o", "extended"]
        if proto is not None:
            args += ["-p", proto]
        proc = self._run(args)
        if proc.returncode != 0:
            raise ConntrackError(
                f"conntrack -L failed with exit code {proc.returncode}: {proc.stderr.strip()}"
            )
        return parse_entries(proc.stdout)

    def delete(
        self,
        proto: str = "udp",
        *,
        orig_src: str | None = None,
        orig_dst: str | None = None,
        orig_sport: int | None = None,
        orig_dport: int | None = None,
        reply_src: str | None = None,
        reply_dst: str | None = None,
        state: str | None = None,
    ) -> int:
        """Delete the flows matching every given field; returns how many went."""
        flt = DeleteFilter(
            proto,
            orig_src=orig_src,
            orig_dst=orig_dst,
            orig_sport=orig_sport,
            orig_dport=orig_dport,
            reply_src=reply_src,
            reply_dst=reply_dst,
            state=state,
        )
        return self._delete_one(flt)

    def _delete_one(self, flt: DeleteFilter) -> int:
        proc = self._run(flt.args(self.family))
        summary = _DELETED_RE.search(proc.stderr)
        # Exit 1 with "0 flow entries have been deleted" just means nothing matched.
        if proc.returncode != 0 and not (summary and summary.group(1) == "0"):
            raise ConntrackError(
                f"conntrack {' '.join(flt.args(self.family))} failed with "
                f"exit code {proc.returncode}: {proc.stderr.strip()}"
            )
        return int(summary.group(1)) if summary else _count_printed(proc.stdout)

    def delete_many(self, filters: Sequence[DeleteFilter]) -> int:
        """Apply all deletes in one ``conntrack -R -`` batch; returns the total deleted.

        Should the batch fail (a conntrack without -R, a rejected line), the filters are
        re-run one by one; a flow deleted by the batch cannot be counted twice.
        """
        if not filters:
            return 0
        batch = "".join(" ".join(flt.args(self.family)) + "\n" for flt in filters)
        proc = self._run(["-R", "-"], batch)
        deleted = _count_printed(proc.stdout)
        if proc.returncode == 0:
            return deleted
        log.warning(
            "conntrack -R failed (exit %d: %s); deleting one filter at a time",
            proc.returncode,
            proc.stderr.strip(),
        )
        return deleted + sum(self._delete_one(flt) for flt in filters)

    def count(self) -> int:
        """Number of flows in the table."""
        proc = self._run(["-C"])
        try:
            return int(proc.stdout.strip())
        except ValueError:
            raise ConntrackError(
                f"conntrack -C failed with exit code {proc.returncode}: "
                f"{proc.stderr.strip() or proc.stdout.strip()}"
            ) from None

    def max(self) -> int:
        """nf_conntrack_max as this namespace sees it (global on older kernels)."""
        proc = self._runner(in_netns(["cat", CONNTRACK_MAX], self.netns), None)
        try:
            return int(proc.stdout.strip())
        except ValueError:
            raise ConntrackError(f"cannot read {CONNTRACK_MAX}: {proc.stderr.strip()}") from None


def cleanup_stale_udp(
    service_ips: Mapping[tuple[str, int], set[str]],
    node_ports: Mapping[int, set[str]],
    netns: str | None = None,
    *,
    conntrack: Conntrack | None = None,
) -> int:
    """Delete UDP flows to Service IPs / NodePorts that no serving endpoint answers.

    One dump, then one batch of grouped deletes; returns the number of flows deleted.
    """
    if not service_ips and not node_ports:
        return 0
    ct = conntrack or Conntrack(netns)
    filters = stale_udp_filters(ct.list_entries("udp"), service_ips, node_ports)
    if not filters:
        return 0
    deleted = ct.delete_many(filters)
    log.info("deleted %d stale UDP conntrack entries (%d filters)", deleted, len(filters))
    return deleted


def delete_unreplied_syn_to(
    dst_ips: set[str], netns: str | None = None, *, conntrack: Conntrack | None = None
) -> int:
    """delete_unreplied_syn for many VIPs with one listing and one batch (a failed mode
    switch clears every service IP at once)."""
    ct = conntrack or Conntrack(netns)
    stale = {
        (e.orig_src, e.orig_sport, e.orig_dst, e.orig_dport)
        for e in ct.list_entries("tcp")
        if e.state == "SYN_SENT" and e.orig_dst in dst_ips
    }
    filters = [
        DeleteFilter("tcp", orig_src=s, orig_sport=sp, orig_dst=d, orig_dport=dp, state="SYN_SENT")
        for s, sp, d, dp in sorted(stale, key=str)
    ]
    return ct.delete_many(filters) if filters else 0


def delete_unreplied_syn(
    dst_ip: str, netns: str | None = None, *, conntrack: Conntrack | None = None
) -> int:
    """Delete TCP SYN_SENT flows to `dst_ip` (the null-binding entries of a rule gap, G13).

    Selected by state, never by --status UNREPLIED, so established flows are safe.
    """
    ct = conntrack or Conntrack(netns)
    return ct.delete("tcp", orig_dst=dst_ip, state="SYN_SENT")
