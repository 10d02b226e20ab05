"""One finding of a preflight or doctor check, and how a list of them is shown.

A finding says what was found, why it matters and the exact commands that fix it, with a
severity: `block` (the switch is not safe / this breaks traffic), `warn` (works, but
something will bite later) or `info` (worth knowing, nothing to do). Only blocks make the
exit code non-zero. The same dataclass serves preflight and doctor, so automation parses
one JSON shape.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # rich is imported where text is rendered (`kproxy run` has none)
    from rich.console import Console

EXIT_SAFE = 0
EXIT_BLOCKED = 1
EXIT_USAGE = 2


class Severity(StrEnum):
    BLOCK = "block"
    WARN = "warn"
    INFO = "info"

    @property
    def rank(self) -> int:
        return _RANK[self]


_RANK = {Severity.BLOCK: 0, Severity.WARN: 1, Severity.INFO: 2}
_STYLE = {Severity.BLOCK: "bold red", Severity.WARN: "yellow", Severity.INFO: "cyan"}


@dataclass(frozen=True)
class Finding:
    """id: stable dotted name (`kernel.module-missing`), for scripts and tests.
    found: what is there (one sentence). why: what it breaks. fix: shell commands, in order.
    subject: the object the finding is about (a module, a sysctl, a service) when several
    findings share an id. facts: the raw values behind the sentence, for automation."""

    id: str
    severity: Severity
    found: str
    why: str = ""
    fix: tuple[str, ...] = ()
    subject: str = ""
    facts: dict[str, Any] = field(default_factory=dict)
    # doctor only: the layer of the packet path the finding belongs to
    layer: str = ""

    @property
    def blocks(self) -> bool:
        return self.severity is Severity.BLOCK

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Finding:
        """A finding as to_dict() wrote it."""
        return cls(
            doc["id"],
            Severity(doc["severity"]),
            doc.get("found", ""),
            doc.get("why", ""),
            tuple(doc.get("fix", ())),
            doc.get("subject", ""),
            dict(doc.get("facts", {})),
            doc.get("layer", ""),
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "severity": self.severity.value,
            "subject": self.subject,
            "found": self.found,
            "why": self.why,
            "fix": list(self.fix),
            "facts": self.facts,
        }
        if self.layer:
            out["layer"] = self.layer
        return out


def block(id: str, found: str, why: str = "", fix: Iterable[str] = (), **kw: Any) -> Finding:
    return Finding(id, Severity.BLOCK, found, why, tuple(fix), **kw)


def warn(id: str, found: str, why: str = "", fix: Iterable[str] = (), **kw: Any) -> Finding:
    return Finding(id, Severity.WARN, found, why, tuple(fix), **kw)


def info(id: str, found: str, why: str = "", fix: Iterable[str] = (), **kw: Any) -> Finding:
    return Finding(id, Severity.INFO, found, why, tuple(fix), **kw)


def ordered(findings: Iterable[Finding]) -> list[Finding]:
    """Blocks first, then warnings, then info; stable within a severity (check order)."""
    return sorted(findings, key=lambda f: f.severity.rank)


def counts(findings: Sequence[Finding]) -> dict[str, int]:
    return {s.value: sum(1 for f in findings if f.severity is s) for s in Severity}


def exit_code(findings: Sequence[Finding]) -> int:
    return EXIT_BLOCKED if any(f.blocks for f in findings) else EXIT_SAFE


def findings_json(findings: Sequence[Finding]) -> list[dict[str, Any]]:
    return [f.to_dict() for f in ordered(findings)]


def dumps(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2, sort_keys=False, default=str)


def render_text(
    findings: Sequence[Finding],
    *,
    header: str,
    verdict: str,
    console: Console | None = None,
    labels: dict[Severity, str] | None = None,
    show_info: bool = True,
    why_label: str = "why",
) -> None:
    """Human output: a header, one block per finding (what, why, fix), a verdict line.

    rich only colours when writing to a terminal; piped output is plain text. Texts are
    escaped, so a value like "[KUBE-SVC]" is never taken for markup."""
    from rich.console import Console
    from rich.markup import escape

    out = console or Console(highlight=False, soft_wrap=True, emoji=False)
    names = labels or {Severity.BLOCK: "BLOCK", Severity.WARN: "WARN", Severity.INFO: "INFO"}
    out.print(escape(header), style="bold")
    shown = [f for f in ordered(findings) if show_info or f.severity is not Severity.INFO]
    if not shown:
        out.print("  no findings")
    for f in shown:
        style = _STYLE[f.severity]
        where = f" [{f.layer}]" if f.layer else ""
        out.print(
            f"[{style}]{names[f.severity]:<6}[/{style}] {escape(f.id)}{escape(where)}: "
            f"{escape(f.found)}"
        )
        symptom = f.facts.get("symptom")
        if symptom:
            out.print(f"       symptom: {escape(str(symptom))}")
        if f.why:
            out.print(f"       {why_label}: {escape(f.why)}")
        seen = f.facts.get("seen")
        if seen:
            out.print(f"       seen in the field: {escape(', '.join(map(str, seen)))}")
        for i, cmd in enumerate(f.fix):
            lead = "       fix: " if i == 0 else "            "
            out.print(f"{lead}{escape(cmd)}")
    hidden = len(findings) - len(shown)
    if hidden:
        out.print(f"  ({hidden} info findings not shown; --verbose shows them)")
    c = counts(findings)
    style = "bold red" if c["block"] else "bold green"
    out.print(
        f"[{style}]{escape(verdict)}[/{style}] ({c['block']} blocking, {c['warn']} warnings, "
        f"{c['info']} info)"
    )
