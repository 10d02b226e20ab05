"""`kproxy doctor`. Inputs not given come from the running kproxy of --state-dir, as for
preflight (ops/inputs.py): its status, namespace, --config and --source."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kproxy.cli_common import HostOpt, UsageError, fail
from kproxy.defaults import DEFAULT_STATE_DIR
from kproxy.ops.inputs import ops_inputs, with_running_proxy
from kproxy.ops.preflight.findings import EXIT_USAGE


def register(app: typer.Typer) -> None:
    app.command("doctor")(doctor_command)


def doctor_command(
    service: Annotated[
        str | None,
        typer.Option("--service", help="NAMESPACE/NAME of one service (default: all of them)."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable report.")] = False,
    source: Annotated[
        Path | None,
        typer.Option(
            "--source", help="Services, EndpointSlices, Nodes (default: the running kproxy's)."
        ),
    ] = None,
    config_path: Annotated[
        Path | None,
        typer.Option("--config", help="The configuration (default: the running kproxy's)."),
    ] = None,
    state_dir: Annotated[
        Path, typer.Option("--state-dir", help="The running kproxy's state dir.")
    ] = DEFAULT_STATE_DIR,
    netns: Annotated[
        str | None,
        typer.Option("--netns", help="Diagnose the node in this named network namespace."),
    ] = None,
    probe: Annotated[
        bool,
        typer.Option(
            "--probe/--no-probe", help="TCP-connect to endpoints and ClusterIPs from the node."
        ),
    ] = True,
    all_services: Annotated[
        bool, typer.Option("--all", help="Show healthy services too (text output).")
    ] = False,
    hostname: HostOpt = None,
) -> None:
    """Explain a misbehaving node or service: where the packet path breaks, and why.

    The node first (kernel support of the mode in use, sysctls, conntrack headroom, other
    modes' leftovers, the running proxy's last error), then each service walked layer by
    layer: object (is the Service valid and proxied?) -> endpoints (ready, resolved, do they
    answer?) -> rules in the kernel (read back and compared with the objects; does the
    ClusterIP answer from the node?) -> conntrack (unreplied or stale flows). A service is
    broken at its first failing layer; each finding gives the symptom users see, the cause,
    and the commands that show and fix it. Read only, apart from TCP connects (--no-probe).

    Exit codes: 0 nothing broken (warnings and info do not count), 1 something is broken,
    2 usage error.
    """
    from kproxy.ops.doctor.run import run_doctor

    try:
        if service is not None and service.count("/") != 1:
            raise UsageError(f"--service {service!r}: give NAMESPACE/NAME, e.g. default/web")
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
    result = run_doctor(
        service,
        access=inputs.access(),
        config_path=inputs.config_path,
        source=inputs.source,
        state_dir=inputs.state_dir,
        status=inputs.status,
        node_name=inputs.node_name,
        probe=probe,
    )
    result.notes = [*inputs.notes, *result.notes]
    if as_json:
        typer.echo(result.to_json())
    else:
        result.print_text(all_services=all_services or service is not None)
    raise typer.Exit(result.exit_code)
