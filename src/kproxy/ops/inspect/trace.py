"""`kproxy trace`: where a new connection goes and why, from the rules in the kernel.

The walk runs over what the kernel returns now (iptables-save, nft -j list), never over a
snapshot, so it shows drift; when a snapshot of the desired state is given, the result also
says where the kernel's answer differs from it. Whether the connection comes from the node
itself (nat OUTPUT) or from outside (PREROUTING) is `from_node`, or decided by whether the
source is one of the node's local addresses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kproxy.model.objects import Snapshot
from kproxy.ops.inspect import drift
from kproxy.ops.inspect.kernel import KernelSource
from kproxy.ops.inspect.model import DNAT, Outcome, Packet, Step, Walk, percent
from kproxy.ops.inspect.readers import select

PROTOCOLS = ("tcp", "udp", "sctp")


@dataclass
class DataplaneTrace:
    dataplane: str
    mode: str
    live: bool
    detail: str
    read_from: str
    walk: Walk

    @property
    def outcomes(self) -> list[Outcome]:
        return self.walk.outcomes

    def to_json(self) -> dict[str, Any]:
        return {
            "dataplane": self.dataplane,
            "mode": self.mode,
            "live": self.live,
            "detail": self.detail,
            "read_from": self.read_from,
            "verdict": verdict_line(self.outcomes),
            "notes": list(self.walk.notes),
            "outcomes": [o.to_json() for o in self.outcomes],
        }


@dataclass
class TraceResult:
    packet: Packet
    dataplanes: list[DataplaneTrace]
    from_node_reason: str = ""
    notes: list[str] = field(default_factory=list)
    drift: list[str] = field(default_factory=list)
    snapshot_given: bool = False

    @property
    def found(self) -> bool:
        return bool(self.dataplanes)

    @property
    def outcomes(self) -> list[Outcome]:
        """The outcomes of every traced dataplane (usually just one)."""
        return [o for d in self.dataplanes for o in d.outcomes]

    def destinations(self) -> set[str]:
        """Every ip:port the kernel may DNAT this connection to."""
        return {o.dnat for o in self.outcomes if o.verdict == DNAT and o.dnat}

    def verdicts(self) -> set[str]:
        return {o.verdict for o in self.outcomes}

    def as_dict(self) -> dict[str, Any]:
        return {
            "packet": self.packet.to_json(),
            "from_node_reason": self.from_node_reason,
            "notes": list(self.notes),
            "drift": list(self.drift) if self.snapshot_given else None,
            "dataplanes": [d.to_json() for d in self.dataplanes],
        }

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2)

    def text(self) -> str:
        pkt = self.packet
        origin = "from the node itself" if pkt.from_node else "arriving from outside the node"
        lines = [f"kproxy trace: {pkt}, a new connection {origin} ({self.from_node_reason})"]
        if not self.dataplanes:
            lines.append("no kube-proxy dataplane found: nothing to trace")
        for dp in self.dataplanes:
            lines += _dataplane_text(dp)
        if self.notes:
            lines += [f"note: {n}" for n in self.notes]
        if self.snapshot_given:
            if self.drift:
                lines.append(f"drift: the kernel and the snapshot disagree ({len(self.drift)}):")
                lines += [f"  - {d}" for d in self.drift]
            else:
                lines.append("drift: none (the kernel's answer matches the snapshot)")
        return "\n".join(lines) + "\n"


def _rule_text(step: Step) -> str:
    prefix = f"-A {step.chain} "
    return step.text[len(prefix) :] if step.text.startswith(prefix) else step.text


def _step_lines(step: Step, indent: str) -> list[str]:
    if step.rule is None:
        out = [f"{indent}{step.table} {step.chain}: {step.action}"]
    else:
        out = [f"{indent}{step.where()}: {_rule_text(step)}", f"{indent}    => {step.action}"]
    out += [f"{indent}    ! {n}" for n in step.notes]
    return out


def _common_prefix(outcomes: list[Outcome]) -> int:
    if len(outcomes) < 2:
        return len(outcomes[0].steps) if outcomes else 0
    n = 0
    for steps in zip(*(o.steps for o in outcomes), strict=False):
        if all(s == steps[0] for s in steps):
            n += 1
        else:
            break
    return n


def _common_suffix(outcomes: list[Outcome], prefix: int) -> int:
    if len(outcomes) < 2:
        return 0
    limit = min(len(o.steps) for o in outcomes) - prefix
    n = 0
    while n < limit and all(o.steps[-1 - n] == outcomes[0].steps[-1 - n] for o in outcomes):
        n += 1
    return n


def _label(o: Outcome) -> str:
    parts = []
    if o.conditions:
        parts.append("if " + " and ".join(o.conditions))
    if o.probability is not None and (o.probability < 0.9995 or not o.conditions):
        parts.append(("then " if o.conditions else "") + percent(o.probability))
    return ", ".join(parts) or "?"


def _group_text(members: list[Outcome]) -> str:
    """One condition group: DNATs merged per service (with each destination's share)."""
    parts: list[str] = []
    dnat: dict[tuple[str | None, bool | None], dict[str, float | None]] = {}
    for o in members:
        if o.verdict == DNAT and o.dnat:
            dests = dnat.setdefault((o.service, o.masquerade), {})
            prev = dests.get(o.dnat, 0.0)
            dests[o.dnat] = None if prev is None or o.probability is None else prev + o.probability
    for (service, masq), dests in dnat.items():
        if len(dests) == 1:
            text = f"DNAT to {next(iter(dests))}"
        else:
            text = "DNAT to one of " + ", ".join(f"{d} ({percent(p)})" for d, p in dests.items())
        if service:
            text += f" [{service}]"
        if masq:
            text += ", masqueraded"
        elif masq is False:
            text += ", source kept"
        parts.append(text)
    others: dict[str, float | None] = {}
    for o in members:
        if o.verdict != DNAT:
            prev = others.get(o.summary(), 0.0)
            others[o.summary()] = (
                None if prev is None or o.probability is None else prev + o.probability
            )
    total = len(dnat) + len(others)
    for summary, p in others.items():
        parts.append(summary if total == 1 else f"{summary} ({percent(p)})")
    return "; ".join(parts)


def verdict_line(outcomes: list[Outcome]) -> str:
    """Where the connection goes: per affinity condition (if any), each destination with its
    share of new connections."""
    if not outcomes:
        return "nothing evaluated"
    groups: dict[tuple[str, ...], list[Outcome]] = {}
    for o in outcomes:
        groups.setdefault(o.conditions, []).append(o)
    if len(groups) == 1 and not next(iter(groups)):
        return _group_text(outcomes)
    out = []
    for conditions, members in groups.items():
        positive = [c for c in conditions if " no affinity" not in c]
        head = "if " + " and ".join(positive) if positive else "otherwise"
        out.append(f"{head}: {_group_text(members)}")
    return " | ".join(out)


def _dataplane_text(dp: DataplaneTrace) -> list[str]:
    state = "" if dp.live else f" — NOT LIVE ({dp.detail})"
    lines = [f"{dp.mode} mode ({dp.dataplane}), rules read from {dp.read_from}{state}"]
    outcomes = dp.outcomes
    prefix = _common_prefix(outcomes)
    suffix = _common_suffix(outcomes, prefix)
    if outcomes:
        for step in outcomes[0].steps[:prefix]:
            lines += _step_lines(step, "  ")
    if len(outcomes) == 1:
        o = outcomes[0]
        for step in o.steps[prefix:]:
            lines += _step_lines(step, "  ")
        if o.conditions:
            lines.append(f"  (if {' and '.join(o.conditions)})")
        lines += [f"  ! {n}" for n in o.notes]
    elif outcomes:
        lines.append(f"  {len(outcomes)} possible outcomes:")
        for i, o in enumerate(outcomes, 1):
            lines.append(f"  [{i}] {_label(o)}: {o.summary()}")
            for step in o.steps[prefix : len(o.steps) - suffix]:
                lines += _step_lines(step, "      ")
            lines += [f"      ! {n}" for n in o.notes]
        if suffix:
            lines.append("  then, in every outcome:")
            for step in outcomes[0].steps[len(outcomes[0].steps) - suffix :]:
                lines += _step_lines(step, "  ")
    lines.append(f"verdict ({dp.dataplane}): {verdict_line(outcomes)}")
    lines += [f"note: {n}" for n in dp.walk.notes]
    lines.append("")
    return lines


def trace(
    src: str,
    dst: str,
    port: int,
    proto: str = "tcp",
    *,
    netns: str | None = None,
    mode: str | None = None,
    from_node: bool | None = None,
    snapshot: Snapshot | None = None,
    source: KernelSource | None = None,
) -> TraceResult:
    """Trace a new connection src -> dst:port through the live mode's kernel rules.

    from_node None: the connection comes from the node when src is one of its local
    addresses. mode as for list_services. Raises ValueError for a bad protocol/port and
    readers.ModeSelectionError for a mode it cannot read.
    """
    proto = proto.lower()
    if proto not in PROTOCOLS:
        raise ValueError(f"unknown protocol {proto!r} (choose from {', '.join(PROTOCOLS)})")
    if not 0 < int(port) < 65536:
        raise ValueError(f"port {port} is out of range")
    src_ = source or KernelSource(netns)
    selection = select(src_, mode)
    local = src_.local_addresses()
    if from_node is None:
        if local is None:
            from_node, reason = False, "the node's addresses are unknown; assuming from outside"
        elif src in local or src.startswith("127."):
            from_node, reason = True, f"{src} is an address of the node"
        else:
            from_node, reason = False, f"{src} is not an address of the node"
    else:
        reason = "as requested"
    packet = Packet(src, dst, int(port), proto, bool(from_node))
    traces = [
        DataplaneTrace(
            v.dataplane, v.mode, v.live, v.detail, src_.command(v.dataplane), v.trace(packet)
        )
        for v in selection.views
    ]
    result = TraceResult(
        packet, traces, reason, notes=selection.notes, snapshot_given=snapshot is not None
    )
    if snapshot is not None:
        for d in traces:
            prefix = f"{d.dataplane}: " if len(traces) > 1 else ""
            result.drift += [
                prefix + f for f in drift.compare_trace(d.outcomes, packet, snapshot, local)
            ]
    return result
