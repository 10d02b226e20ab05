"""`kproxy preflight` and the preflight gate of `kproxy switch`.

Inputs not given on the command line come from the running kproxy of --state-dir: its mode
and node from the admin socket, its --config and --source from its command line
(ops/inputs.py). Without a running kproxy the current mode is read from the kernel.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kproxy.cli_common import HostOpt, SwitchLayoutOpt, UsageError, check_switch_layout, fail
from kproxy.defaults import DEFAULT_STATE_DIR
from kproxy.ops.inputs import OpsInputs, ops_inputs, with_running_proxy
from kproxy.ops.preflight.findings import EXIT_USAGE
from kproxy.text import one_line

if TYPE_CHECKING:
    from kproxy.ops.preflight.run import PreflightResult

log = logging.getLogger("kproxy.preflight")


# A preflight inside the running kproxy reads no whole table; this is a safety net only.
LIVE_TIMEOUT = 300.0


def register(app: typer.Typer) -> None:
    app.command("preflight")(preflight_command)


def check_mode_name(to: str, flag: str = "--to") -> str:
    """The mode given as `flag`, or UsageError with kproxy.config's own message (and its
    suggestion)."""
    from kproxy.config import MODES, ProxyConfig, validate_config

    if to in MODES:
        return to
    problems = [p for p in validate_config(ProxyConfig(mode=to)) if p.startswith("mode:")]
    hint = next((p.split("; ", 1)[1] for p in problems if "; did you mean" in p), "")
    raise UsageError(
        f"{flag} {to!r} is not a proxy mode (choose from {', '.join(MODES)})"
        + (f"; {hint}" if hint else "")
    )


def preflight_command(
    to: Annotated[str, typer.Option("--to", help="The mode to switch to.")],
    config_path: Annotated[
        Path | None,
        typer.Option(
            "--config",
            help="The KubeProxyConfiguration the proxy runs with (default: the running "
            "kproxy's); checked with its mode set to --to.",
        ),
    ] = None,
    source: Annotated[
        Path | None,
        typer.Option(
            "--source",
            help="Services, EndpointSlices and Nodes (default: the running kproxy's); "
            "without it the object and consistency checks are skipped.",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable report.")] = False,
    state_dir: Annotated[
        Path, typer.Option("--state-dir", help="The running kproxy's state dir; backups go here.")
    ] = DEFAULT_STATE_DIR,
    current: Annotated[
        str | None,
        typer.Option("--from", help="The mode serving now (default: asked, or from the kernel)."),
    ] = None,
    netns: Annotated[
        str | None,
        typer.Option("--netns", help="Check the node in this named network namespace (a lab)."),
    ] = None,
    backup: Annotated[
        Path | None,
        typer.Option("--backup", help="Write the verified backup here (default: in --state-dir)."),
    ] = None,
    hostname: HostOpt = None,
    no_daemon: Annotated[
        bool,
        typer.Option(
            "--no-daemon",
            help="Read the objects and the kernel here even when a kproxy runs (by default "
            "the running kproxy runs the checks with the objects and mode it already has).",
        ),
    ] = False,
    nftables_layout: SwitchLayoutOpt = None,
) -> None:
    """Check whether a switch to --to is safe on this node; explain what is not and how to fix it.

    Kernel support for the target mode (modules loaded, built in or loadable, persisted;
    kernel and nft versions; iptables backends), conntrack headroom, a verified backup of
    the current dataplane, the configuration, the objects, the dataplane's consistency and
    other modes' leftovers, and the sysctls the mode depends on. Read only: the only thing
    written is the backup file. With a running kproxy (and no --config, --source, --from,
    --netns or --backup of your own) the checks run inside it, from the objects and mode it
    already holds; the report says which way it went ("path"). Each finding has an id, a
    severity (block, warn, info), what was found, why it matters and the commands that fix it.

    Exit codes: 0 safe (nothing blocks; warnings and info do not), 1 blocked (at least one
    finding of severity block), 2 usage error (unknown mode or layout, missing file).
    """

    try:
        target = check_mode_name(to)
        check_switch_layout(nftables_layout, target)
        if current is not None:
            check_mode_name(current, "--from")
        inputs = with_running_proxy(
            ops_inputs(
                state_dir=state_dir,
                config_path=config_path,
                source=source,
                netns=netns,
                hostname=hostname,
            )
        )
    except UsageError as err:
        raise fail(str(err), EXIT_USAGE) from None
    own = (config_path, source, current, netns, backup, hostname)
    ask = not no_daemon and all(v is None for v in own)
    result = running_or_read(
        inputs,
        target,
        ask=ask,
        backup="write",
        current_mode=current,
        backup_path=backup,
        layout=nftables_layout,
    )
    if as_json:
        typer.echo(result.to_json())
    else:
        result.print_text()
    raise typer.Exit(result.exit_code)


def running_or_read(
    inputs: OpsInputs,
    target: str,
    *,
    ask: bool,
    backup: str,
    current_mode: str | None = None,
    backup_path: Path | None = None,
    layout: str | None = None,
) -> PreflightResult:
    """The preflight of a switch to `target` (nftables mode: in `layout`; None: the one the
    switch would use): the running kproxy's own when `ask` and one answers, else read here
    from `inputs`; the notes of both ways first."""
    from kproxy.ops.preflight.run import run_preflight

    result = None
    if ask:
        result, note = ask_running(inputs, target, backup=backup, layout=layout)
        inputs = replace(inputs, notes=(*inputs.notes, note)) if note else inputs
    if result is None:
        result = run_preflight(
            target,
            access=inputs.access(),
            config_path=inputs.config_path,
            source=inputs.source,
            state_dir=inputs.state_dir,
            status=inputs.status,
            current_mode=current_mode,
            node_name=inputs.node_name,
            backup_path=backup_path,
            target_layout=layout,
        )
    result.notes = [*inputs.notes, *result.notes]
    return result


def ask_running(
    inputs: OpsInputs, target: str, *, backup: str, layout: str | None = None
) -> tuple[PreflightResult | None, str | None]:
    """The running kproxy's own preflight of a switch to `target` (the admin op
    `preflight`), and a note when one answers but could not run it (then the caller reads
    everything itself). (None, None): no kproxy runs."""
    from kproxy.ops.preflight.run import PreflightResult
    from kproxy.server.admin import AdminUnavailable, call

    if inputs.status is None:
        return None, None
    request = {"op": "preflight", "to": target, "backup": backup}
    if layout is not None:
        request["nftables_layout"] = layout
    try:
        answer = call(inputs.admin_target, request, timeout=LIVE_TIMEOUT)
    except (AdminUnavailable, OSError, ValueError) as err:
        return None, f"the running kproxy did not run the preflight ({err}): read here instead"
    doc = answer.get("result")
    if not answer.get("ok") or not isinstance(doc, dict):
        why = one_line(str(answer.get("error") or "no result"))
        return None, f"the running kproxy did not run the preflight ({why}): read here instead"
    try:
        result = PreflightResult.from_dict(doc)
    except (KeyError, TypeError, ValueError) as err:
        return None, f"the running kproxy's preflight answer is unreadable ({err}): read here"
    # It checked its own namespace, which only the caller can name (found from its pid).
    result.netns = inputs.netns
    return result, None


# --- the switch's gate -----------------------------------------------------------------------


@dataclass
class SwitchGate:
    """Preflight before `kproxy switch`: refuse on a block unless forced."""

    target: str
    result: Any  # PreflightResult
    forced: bool

    @property
    def described(self) -> str:
        """The target for messages, with nftables mode's layout (the preflight's)."""
        return str(self.result.target_described)

    @property
    def refused(self) -> bool:
        return not self.result.safe and not self.forced

    def summary(self) -> dict[str, Any]:
        return {
            "safe": self.result.safe,
            "forced": self.forced and not self.result.safe,
            "blocking": [f.id for f in self.result.blocking],
            "counts": self.result.to_dict()["counts"],
        }

    def refusal(self) -> dict[str, Any]:
        blocking = "; ".join(f"{f.id}: {f.found}" for f in self.result.blocking)
        return {
            "ok": False,
            "refused": True,
            "from_mode": self.result.current_mode,
            "from_layout": self.result.current_layout,
            "to_mode": self.target,
            "to_layout": self.result.target_layout,
            "error": f"{self.described} mode cannot run here: preflight blocked the switch "
            f"(--force overrides): {blocking}",
            "preflight": self.result.to_dict(),
        }

    def backup_path(self) -> str | None:
        """The verified backup this preflight wrote (the switch keeps it as its "before")."""
        for f in self.result.findings:
            if f.id == "backup.ok" and isinstance(f.facts.get("path"), str):
                return str(f.facts["path"])
        return None

    def annotate(self, report: dict[str, Any]) -> dict[str, Any]:
        """Record the preflight (and a --force) in the switch report."""
        report["preflight"] = self.result.to_dict()
        report["forced"] = self.forced and not self.result.safe
        return report


def switch_gate(
    to: str, inputs: OpsInputs, *, force: bool, layout: str | None = None
) -> SwitchGate | None:
    """Run preflight for `kproxy switch --to` (--nftables-layout: `layout`). None when
    there is nothing to check here: no kproxy answers (the switch call reports that), or
    --to previous without a previous mode (the proxy answers that). Raises UsageError for
    bad arguments."""
    own_inputs = inputs.config_path or inputs.source or inputs.netns
    inputs = with_running_proxy(inputs)
    status = inputs.status
    if status is None:
        return None
    if to == "previous":
        target, layout = status.get("previous_mode"), status.get("previous_nftables_layout")
    else:
        target = to
    if not target:
        return None
    target = check_mode_name(target)
    # The switch records the dataplane itself when it starts: no backup here.
    result = running_or_read(inputs, target, ask=not own_inputs, backup="switch", layout=layout)
    gate = SwitchGate(target, result, force)
    if not result.safe and force:
        ids = ", ".join(f.id for f in result.blocking)
        log.warning("switch to %s FORCED past blocking preflight findings: %s", gate.described, ids)
        typer.secho(
            f"kproxy: warning: --force: switching to {gate.described} despite blocking preflight "
            f"findings: {ids}",
            err=True,
            fg=typer.colors.YELLOW,
        )
        _record_forced(inputs.state_dir, gate)
    return gate


def _record_forced(state_dir: Path, gate: SwitchGate) -> None:
    """A forced switch leaves a file next to the switch snapshots, for whoever looks later."""
    from kproxy.dataplane.nftables.layouts import target_name

    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%S")
        name = target_name(gate.target, gate.result.target_layout)
        path = state_dir / f"switch-{stamp}-forced-{name}-preflight.json"
        path.write_text(gate.result.to_json() + "\n")
    except OSError as err:
        log.warning("could not record the forced switch: %s", err)


def print_gate(gate: SwitchGate) -> None:
    """Text mode: what preflight found (blocks and warnings), before the switch output."""
    from kproxy.ops.preflight.findings import Severity, render_text

    shown = [f for f in gate.result.findings if f.severity is not Severity.INFO]
    if not shown and gate.result.safe:
        typer.echo(f"preflight: nothing blocks a switch to {gate.described}")
        return
    verdict = gate.result.verdict()
    if gate.forced and not gate.result.safe:
        verdict = f"FORCED: switching to {gate.described} despite the blocking findings"
    render_text(shown, header=gate.result.header(), verdict=verdict)
