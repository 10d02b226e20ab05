"""`kproxy list` and `kproxy trace`: what the kernel programs, and where a connection goes."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kproxy.cli_common import HostOpt, UsageError, checked, fail
from kproxy.config.addresses import parse_host_port, parse_ip
from kproxy.ops.inputs import OpsInputs, ops_inputs

if TYPE_CHECKING:
    from kproxy.model.objects import Snapshot


def register(app: typer.Typer) -> None:
    app.command("list")(list_command)
    app.command("trace")(trace_command)


InspectModeOpt = Annotated[
    str | None,
    typer.Option(
        "--mode",
        help="Which dataplane to read when two are live (mid-switch): iptables, "
        "iptables-nft, iptables-legacy, nftables, userspace, userspace-nft or userspace-legacy.",
    ),
]
DriftSourceOpt = Annotated[
    Path | None,
    typer.Option("--source", help="Objects to compare the kernel with (reports drift)."),
]


def drift_snapshot(inputs: OpsInputs) -> Snapshot | None:
    """The objects of --source as the node sees them, for the readers to report drift."""
    if inputs.source is None:
        return None
    from kproxy.model.snapshot import snapshot_from_objects
    from kproxy.sources.files import load_path

    try:
        objects, _ = load_path(inputs.source)
    except FileNotFoundError:
        raise UsageError(f"source not found: {inputs.source}") from None
    return snapshot_from_objects(objects.values(), inputs.node_name)


def list_command(
    stats: Annotated[
        bool, typer.Option("--stats", help="Packet/byte counters per endpoint.")
    ] = False,
    rate: Annotated[
        bool, typer.Option("--rate", help="Per-second rates (two reads 1 s apart).")
    ] = False,
    sort: Annotated[
        bool, typer.Option("--sort", help="Sort by protocol, address and port.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    mode: InspectModeOpt = None,
    source: DriftSourceOpt = None,
    hostname: HostOpt = None,
) -> None:
    """The services the kernel programs now, in the `ipvsadm -Ln` layout: each virtual
    address with its scheduler and flags, each endpoint with ActiveConn / InActConn from
    conntrack (from the workers in userspace mode). Read from the kernel, so it shows what
    is really there."""
    from kproxy.ops.inspect import ModeSelectionError, list_services

    try:
        inputs = ops_inputs(source=source, hostname=hostname)
        result = list_services(
            inputs.netns,
            mode=mode,
            stats=stats,
            rate=rate,
            sort=sort,
            snapshot=drift_snapshot(inputs),
        )
    except (ModeSelectionError, UsageError) as err:
        raise fail(str(err)) from None
    typer.echo(result.to_json() if as_json else result.text())


def trace_command(
    src: Annotated[
        str,
        typer.Option("--from", help="Source IP of the new connection.", callback=checked(parse_ip)),
    ],
    to: Annotated[str, typer.Option("--to", help="Destination IP:PORT.")],
    proto: Annotated[str, typer.Option("--proto", help="tcp or udp.")] = "tcp",
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    mode: InspectModeOpt = None,
    from_node: Annotated[
        bool | None,
        typer.Option(
            "--from-node/--not-from-node", help="Default: decided from the node's addresses."
        ),
    ] = None,
    source: DriftSourceOpt = None,
    hostname: HostOpt = None,
) -> None:
    """Where a new connection goes and why: the chain and rule path (iptables), the
    map and chain path (nftables), the redirect rules to a worker's listener and its choice
    of endpoint (userspace), computed from what the kernel and the workers hold."""
    from kproxy.ops.inspect import ModeSelectionError, trace

    try:
        ip, port = parse_host_port(to)
    except ValueError as err:
        raise fail(f"--to: {err}") from None
    try:
        inputs = ops_inputs(source=source, hostname=hostname)
        result = trace(
            src,
            ip,
            port,
            proto,
            netns=inputs.netns,
            mode=mode,
            from_node=from_node,
            snapshot=drift_snapshot(inputs),
        )
    except (ModeSelectionError, ValueError, UsageError) as err:
        raise fail(str(err)) from None
    typer.echo(result.to_json() if as_json else result.text())
