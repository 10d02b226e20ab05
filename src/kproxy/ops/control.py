"""`kproxy status` and `kproxy switch`: the running proxy, asked over its admin endpoint (the
state dir's unix socket, or --admin-address with its token)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer

from kproxy.cli_common import (
    SwitchLayoutOpt,
    UsageError,
    check_switch_layout,
    checked,
    fail,
)
from kproxy.config.durations import check_seconds
from kproxy.defaults import DEFAULT_STATE_DIR
from kproxy.modes import MODES
from kproxy.ops.inputs import ops_inputs
from kproxy.text import one_line


def register(app: typer.Typer) -> None:
    app.command("status")(status_command)
    app.command("switch")(switch_command)


StateDirOpt = Annotated[
    Path, typer.Option("--state-dir", help="The state dir of the kproxy to ask (as given to run).")
]
AdminAddressOpt = Annotated[
    str | None,
    typer.Option(
        "--admin-address",
        help="Ask over the proxy's loopback TCP admin endpoint (IP:PORT, as given to run) "
        "instead of the state dir's unix socket.",
    ),
]
TokenFileOpt = Annotated[
    Path | None,
    typer.Option(
        "--admin-token-file",
        help="The token for --admin-address (default: admin.token in --state-dir).",
    ),
]


def _age(ts: float | None) -> str:
    if not ts:
        return "never"
    return f"{time.time() - ts:.1f} s ago"


def status_command(
    state_dir: StateDirOpt = DEFAULT_STATE_DIR,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    admin_address: AdminAddressOpt = None,
    token_file: TokenFileOpt = None,
) -> None:
    """Mode, health, syncs and the last error of the running kproxy (over its admin socket)."""
    from kproxy.server.admin import AdminUnavailable, call

    try:
        inputs = ops_inputs(state_dir=state_dir, admin_address=admin_address, token_file=token_file)
    except UsageError as err:
        raise fail(str(err)) from None
    try:
        st = call(inputs.admin_target, {"op": "status"}, timeout=10)
        running = True
        if st.get("ok") is False:  # it answered, and refused (a wrong token, say)
            raise fail(f"kproxy refused the request: {st.get('error')}", code=1)
    except AdminUnavailable as err:
        saved = inputs.state_dir / "status.json"
        if not saved.exists():
            raise fail(str(err), code=1) from None
        st = json.loads(saved.read_text())
        running = False
        typer.secho(
            f"kproxy: {err}; showing the last saved status", err=True, fg=typer.colors.YELLOW
        )
    st["running"] = running
    if as_json:
        typer.echo(json.dumps(st, indent=2))
        raise typer.Exit(0 if running else 1)
    res = st.get("last_result") or {}
    lines = [
        f"mode:            {st.get('mode')}"
        + (f" ({st['nftables_layout']} layout)" if st.get("nftables_layout") else "")
        + f"  (node {st.get('node')}, pid {st.get('pid')}, "
        f"{'running' if running else 'NOT running'})",
        f"last sync:       {_age(st.get('last_sync'))}, took {st.get('last_duration') or 0:.3f} s "
        f"({'full' if res.get('full') else 'partial'}); "
        f"last full sync {_age(st.get('last_full_sync'))}",
        f"syncs:           {st.get('syncs')} ({st.get('full_syncs')} full), "
        f"failures {st.get('failures')} ({st.get('consecutive_failures', 0)} in a row now)",
        "health:          "
        + (
            "healthy"
            if st.get("healthy", True)
            else "UNHEALTHY: a change has waited longer than 2 x syncPeriod (/healthz: 503)"
        ),
        f"service ports:   {st.get('services')}; rules owned {res.get('rules_total', {})}",
        f"pending changes: {'yes' if st.get('pending') else 'no'}",
        f"invalid objects: {st.get('invalid_objects')}",
    ]
    # Rejections and errors quote object names and file contents: one line each.
    lines += [f"  - {one_line(r)}" for r in st.get("rejections", [])[:20]]
    lines += _source_problem_lines(st.get("source"))
    if st.get("last_error"):
        lines.append(f"last error:      {one_line(st['last_error'])}")
    if st.get("state_dir_error"):
        lines.append(f"state dir:       {one_line(st['state_dir_error'])}")
    if st.get("conntrack_error"):
        lines.append(
            f"conntrack:       stale UDP flows not cleaned ({st.get('conntrack_failures')} "
            f"failures; retried at the next sync): {one_line(st['conntrack_error'])}"
        )
    typer.echo("\n".join(lines))
    raise typer.Exit(0 if running else 1)


def _source_problem_lines(source: object) -> list[str]:
    """The file source's failing files and skipped documents, one line each."""
    if not isinstance(source, dict) or "failing_files" not in source:
        return []

    def where(p: dict[str, object]) -> str:
        file = one_line(p.get("file"))
        return f"{file}:{p['line']}" if p.get("line") else file

    failing = source.get("failing_files") or []
    skipped = source.get("skipped_documents") or []
    lines = [f"failing files:   {len(failing)} (each keeps its last good objects)"]
    lines += [f"  - {where(p)}: {one_line(p.get('error'))}" for p in failing[:20]]
    if skipped:
        lines.append(f"skipped documents: {len(skipped)}")
        lines += [f"  - {where(p)}: {one_line(p.get('error'))}" for p in skipped[:20]]
    return lines


# --- switch --------------------------------------------------------------------------------------


def _mode_or_previous(to: str) -> str:
    if to != "previous" and to not in MODES:
        raise ValueError(f"{to!r} is not a proxy mode ({', '.join(MODES)}) nor 'previous'")
    return to


def switch_command(
    to: Annotated[
        str,
        typer.Option(
            "--to",
            help="The mode to switch to, or 'previous' to roll back.",
            callback=checked(_mode_or_previous),
        ),
    ],
    timeout: Annotated[
        float,
        typer.Option(
            "--timeout",
            help="Give up (and keep the old mode) after S s.",
            callback=checked(check_seconds),
        ),
    ] = 60.0,
    state_dir: StateDirOpt = DEFAULT_STATE_DIR,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable report.")] = False,
    force: Annotated[
        bool,
        typer.Option("--force", help="Switch even if preflight blocks (logged, in the report)."),
    ] = False,
    config_path: Annotated[
        Path | None, typer.Option("--config", help="For preflight (default: the running one's).")
    ] = None,
    source: Annotated[
        Path | None, typer.Option("--source", help="For preflight (default: the running one's).")
    ] = None,
    admin_address: AdminAddressOpt = None,
    token_file: TokenFileOpt = None,
    nftables_layout: SwitchLayoutOpt = None,
) -> None:
    """Switch the running kproxy to another proxy mode, live and make-before-break.

    First `kproxy preflight --to MODE` runs; a blocking finding refuses the switch (exit
    code 1, nothing changed) unless --force. The new mode is programmed beside the old one
    and verified (every service in the kernel, a self-probe of a sample of services); only
    then is the old mode taken out of the packet path in one step and its state removed. If
    anything fails before that, the old mode keeps serving untouched and the report says
    why. Exit code 0 on success.
    """
    from kproxy.dataplane.nftables.layouts import target_name
    from kproxy.ops.preflight.cli import print_gate, switch_gate
    from kproxy.server.admin import AdminUnavailable, call

    try:
        check_switch_layout(nftables_layout, to)
        inputs = ops_inputs(
            state_dir=state_dir,
            config_path=config_path,
            source=source,
            admin_address=admin_address,
            token_file=token_file,
        )
        gate = switch_gate(to, inputs, force=force, layout=nftables_layout)
    except UsageError as err:
        raise fail(str(err)) from None
    if gate is not None and not as_json:
        print_gate(gate)
    if gate is not None and gate.refused:
        refusal = gate.refusal()
        if as_json:
            typer.echo(json.dumps(refusal, indent=2))
            raise typer.Exit(1)
        raise fail(refusal["error"], code=1)
    try:
        request: dict[str, object] = {"op": "switch", "to": to, "timeout": timeout, "force": force}
        if nftables_layout is not None:
            request["nftables_layout"] = nftables_layout
        before = gate.backup_path() if gate is not None else None
        if before is not None:
            request["before"] = before
        report = call(inputs.admin_target, request, timeout=timeout + 30)
    except AdminUnavailable as err:
        raise fail(str(err), code=1) from None
    if gate is not None:
        report = gate.annotate(report)
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        raise typer.Exit(0 if report.get("ok") else 1)
    if "steps" not in report:
        raise fail(str(report.get("error")), code=1)
    for st in report["steps"]:
        typer.echo(f"  {st['name']:<15} {st['seconds']:8.3f} s  {st['detail']}")
    was = target_name(str(report["from_mode"]), report.get("from_layout"))
    target = target_name(str(report["to_mode"]), report.get("to_layout"))
    if report.get("ok"):
        typer.secho(
            f"switched {was} -> {target} in {report['duration']:.2f} s; "
            f"{report.get('removed_total', 0)} objects of {was} removed"
            + (" (FORCED past blocking preflight findings)" if report.get("forced") else ""),
            fg=typer.colors.GREEN,
        )
        if report.get("removed_file"):
            typer.echo(f"  the removed objects, one a line: {report['removed_file']}")
        raise typer.Exit(0)
    typer.secho(
        f"switch {was} -> {target} FAILED, {was} is still serving: {report.get('error')}",
        fg=typer.colors.RED,
        err=True,
    )
    raise typer.Exit(1)
