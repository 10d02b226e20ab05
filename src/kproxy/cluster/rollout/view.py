"""Text views of a rollout plan and a rollout's status, kubectl-style columns. Pure."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kproxy.cluster.rollout import status as st
from kproxy.cluster.rollout.plan import Plan
from kproxy.config import format_duration


def columns(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns separated by two spaces, as kubectl prints them."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in [list(headers), *rows]
    ]
    return "\n".join(lines)


def short_duration(seconds: float) -> str:
    """ "1h5m", "15m", "40s": a duration to read, not to parse back."""
    text = format_duration(round(seconds))
    for unit in ("m0s", "h0m"):
        if text.endswith(unit):
            text = text[: -len(unit) + 1]
    return text


def plan_text(plan: Plan) -> str:
    out = [
        f"Rollout plan: {plan.node_count} node(s) to {plan.target} "
        f"(selector: {plan.selector}), plan {plan.fingerprint}",
        f"Estimated duration: {short_duration(plan.estimated_seconds)}",
        "",
    ]
    rows = []
    for b in plan.batches:
        nodes = ", ".join(
            f"{n} ({self_zone}{plan.previous[n]})"
            for n in b.nodes
            for self_zone in [f"{plan.zones[n]}, " if plan.zones.get(n) else ""]
        )
        rows.append([str(b.stage), b.amount, str(b.parallel), short_duration(b.soak), nodes or "-"])
    out.append(columns(["STAGE", "NODES", "PARALLEL", "SOAK", "SWITCHES"], rows))
    if plan.already:
        out += ["", f"Already {plan.target}: {', '.join(plan.already)}"]
    if plan.preflight:
        out += ["", "Preflight on each node:"]
        for node, answer in sorted(plan.preflight.items()):
            if answer.ok:
                extra = f" ({len(answer.warnings)} warning(s))" if answer.warnings else ""
                out.append(f"  {node}: ok{extra}")
            else:
                out.append(f"  {node}: BLOCKED: {'; '.join(answer.blocks)}")
            out += [f"    warning: {w}" for w in answer.warnings]
    if plan.skipped:
        out += ["", "Skipped:"] + [f"  {s.node}: {s.reason}" for s in plan.skipped]
    if plan.warnings:
        out += ["", "Warnings:"] + [f"  {w}" for w in plan.warnings]
    if plan.blockers:
        out += ["", "Blockers (the rollout cannot start):"] + [f"  {b}" for b in plan.blockers]
    return "\n".join(out)


def status_text(obj: dict[str, Any]) -> str:
    name = obj["metadata"]["name"]
    spec = obj.get("spec") or {}
    status = st.RolloutStatus.of(obj)
    target = spec.get("targetMode", "?")
    if status is None:
        return f"ProxyRollout {name}: to {target}, not planned yet (is the controller running?)"
    stages = len(spec.get("stages") or []) or 2
    head = (
        f"ProxyRollout {name}: {status.phase}, stage {status.stage} of {stages}, "
        f"{status.nodes_done}/{status.nodes_total} nodes done, to {target}"
    )
    out = [head]
    if status.paused_reason and status.phase in (st.PAUSED, st.ROLLING_BACK):
        out.append(f"Paused: {status.paused_reason}")
    if status.message:
        out.append(f"Message: {status.message}")
    rows = [
        [
            n.name,
            str(n.stage or "-"),
            n.previous_mode or "-",
            target,
            n.state,
            n.verify or "-",
            (n.last_error or n.reason or "-")[:80],
        ]
        for n in status.nodes
    ]
    out += ["", columns(["NODE", "STAGE", "FROM", "TO", "STATE", "VERIFY", "LAST ERROR"], rows)]
    if status.breakers:
        brows = [
            [
                b.name + (f" ({b.node})" if b.node else ""),
                b.scope,
                "-" if b.value is None else f"{b.value:g}",
                b.threshold,
                f"yes, {b.tripped_at}" if b.tripped else "no",
            ]
            for b in status.breakers
        ]
        out += ["", columns(["BREAKER", "SCOPE", "VALUE", "THRESHOLD", "TRIPPED"], brows)]
    return "\n".join(out)
