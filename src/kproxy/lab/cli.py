"""`kproxy lab ...`: build, list and tear down network-namespace labs from the shell.

The main CLI mounts `lab_app`; `python -m kproxy.lab.cli` runs it on its own.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Annotated, Any

import typer

# The lab's modules are imported by the commands that use them, not by this command table,
# which `kproxy --help` imports too.
if TYPE_CHECKING:
    from kproxy.lab.topology import Lab

lab_app = typer.Typer(
    name="lab",
    help=(
        "Network-namespace lab: a node namespace (the proxy host), client namespaces on "
        "10.100.0.0/24 and routed pod namespaces on 10.244.0.0/24 running small TCP/UDP "
        "servers. Nothing is created in the host's root namespace."
    ),
    no_args_is_help=True,
    add_completion=False,
)


def register(app: typer.Typer) -> None:
    app.add_typer(lab_app, name="lab", help="Build and tear down the network-namespace lab.")


def _require_support() -> None:
    from kproxy.lab.topology import lab_supported

    ok, reason = lab_supported()
    if not ok:
        typer.echo(f"error: {reason}", err=True)
        raise typer.Exit(1)


def _describe(lab: Lab) -> dict[str, Any]:
    return {**lab.describe(), "running": lab.is_running(), "owner_alive": lab.owner_alive()}


def _print_human(lab: Lab) -> None:
    echo = typer.echo
    for node in lab.nodes:
        echo(
            f"  {'node':<8} {node.ns:<16} {node.ip:<12} {node.name}, pod CIDR "
            f"{node.pod_cidr}, default via {lab.node_gateway} (nothing there)"
        )
    for ns, ip in zip(lab.client_ns, lab.client_ips, strict=True):
        echo(f"  {'client':<8} {ns:<16} {ip:<12} default via {lab.node_ip}")
    for spec, ns in zip(lab.pods, lab.pod_ns, strict=True):
        ports = f"tcp {','.join(map(str, spec.tcp_ports)) or '-'} "
        ports += f"udp {','.join(map(str, spec.udp_ports)) or '-'}"
        where = f" on {lab.pod_nodes[spec.name].name}" if len(lab.nodes) > 1 else ""
        echo(f"  {'pod':<8} {ns:<16} {lab.pod_ips[spec.name]:<12} {spec.name}{where}: {ports}")
    echo(f"  cluster CIDR {lab.cluster_cidr}")


@lab_app.command("up")
def up(
    pods: Annotated[int, typer.Option("--pods", min=1, max=250, help="Number of pods.")] = 3,
    clients: Annotated[
        int, typer.Option("--clients", min=0, max=250, help="Number of client namespaces.")
    ] = 2,
    nodes: Annotated[
        int,
        typer.Option("--nodes", min=1, max=9, help="Node namespaces (pods are spread over them)."),
    ] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")] = False,
) -> None:
    """Build a lab and leave it running; prints its id, namespaces and addresses.

    Pod servers answer "<pod> <peer ip>" on TCP 8080/9090 and UDP 8080. Tear it down with
    `kproxy lab down ID`.
    """
    from kproxy.lab.topology import Lab, LabError

    _require_support()
    try:
        lab = Lab(pods=pods, clients=clients, nodes=nodes).up()
    except (LabError, OSError, ValueError) as exc:
        typer.echo(f"error: lab did not come up: {exc}", err=True)
        raise typer.Exit(1) from exc
    lab.detach()
    if as_json:
        typer.echo(json.dumps({**_describe(lab), "up_seconds": lab.up_seconds}, indent=2))
        return
    typer.echo(f"lab {lab.id} is up ({lab.up_seconds:.2f} s)")
    _print_human(lab)
    first_pod = next(iter(lab.pod_ips.values()))
    if lab.client_ns:
        typer.echo(f"try:       ip netns exec {lab.client_ns[0]} curl -s http://{first_pod}:8080/")
    typer.echo(f"tear down: kproxy lab down {lab.id}")


@lab_app.command("down")
def down(
    lab_ids: Annotated[
        list[str] | None, typer.Argument(help="Lab ids as printed by `up` / `list`.")
    ] = None,
    all_labs: Annotated[
        bool,
        typer.Option(
            "--all",
            help="Every lab whose creating process has exited (CLI labs, leftovers of crashed "
            "test runs).",
        ),
    ] = False,
    force: Annotated[
        bool,
        typer.Option(
            "--force", help="With --all: also labs still owned by a running process (pytest)."
        ),
    ] = False,
) -> None:
    """Stop a lab's processes (by PID) and delete its namespaces."""
    from kproxy.lab.topology import Lab, LabError

    _require_support()
    if not lab_ids and not all_labs:
        typer.echo("error: give lab ids or --all", err=True)
        raise typer.Exit(2)
    targets: list[Lab] = []
    failed = False
    for lab_id in lab_ids or []:
        try:
            targets.append(Lab.load(lab_id))
        except LabError as exc:
            typer.echo(f"error: {exc}", err=True)
            failed = True
    if all_labs:
        for lab in Lab.list_running():
            if lab.owner_alive() and not force:
                typer.echo(f"skipping {lab.id}: its owner process is still running (--force)")
                continue
            if lab.id not in {t.id for t in targets}:
                targets.append(lab)
    for lab in targets:
        started = time.perf_counter()
        try:
            lab.down()
        except (LabError, OSError) as exc:
            typer.echo(f"error: {lab.id}: {exc}", err=True)
            failed = True
            continue
        typer.echo(f"lab {lab.id} is down ({time.perf_counter() - started:.2f} s)")
    if failed:
        raise typer.Exit(1)


@lab_app.command("list")
def list_labs(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")] = False,
) -> None:
    """List labs recorded in /run/kproxy-lab (running or stale)."""
    from kproxy.lab.topology import Lab

    labs = Lab.list_running()
    if as_json:
        typer.echo(json.dumps([_describe(lab) for lab in labs], indent=2))
        return
    if not labs:
        typer.echo("no labs")
        return
    for lab in labs:
        status = "running" if lab.is_running() else "stale (namespaces gone)"
        owner = "owner running" if lab.owner_alive() else "owner exited"
        typer.echo(
            f"{lab.id}: {status}, {owner}, {len(lab.pods)} pods, {len(lab.client_ns)} clients"
        )
        _print_human(lab)


@lab_app.command("uml", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def uml_run(
    ctx: typer.Context,
    timeout: Annotated[
        float, typer.Option("--timeout", help="Wall-clock budget, boot to poweroff (s).")
    ] = 600.0,
    mem: Annotated[str, typer.Option("--mem", help="Guest memory (UML mem=).")] = "1G",
) -> None:
    """Run a command inside a User-Mode Linux guest (a kernel with ip_vs): `kproxy lab uml -- CMD`.

    The guest's root is the host filesystem with private /run and /tmp; the command runs as
    guest root in the current directory, and its exit code is this command's.
    """
    argv = list(ctx.args[1:] if ctx.args[:1] == ["--"] else ctx.args)
    if not argv:
        typer.echo("error: give a command, e.g. kproxy lab uml -- ipvsadm -Ln", err=True)
        raise typer.Exit(2)
    from kproxy.lab.uml import UmlError, run_in_uml

    try:
        result = run_in_uml(argv, timeout=timeout, mem=mem)
    except (UmlError, OSError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    typer.echo(result.output, nl=False)
    if result.returncode is None:
        typer.echo(result.describe_failure(), err=True)
        raise typer.Exit(1)
    raise typer.Exit(result.returncode)


if __name__ == "__main__":
    lab_app()


@lab_app.command("uml-kernel")
def uml_kernel_build(
    if_needed: Annotated[
        bool,
        typer.Option(
            "--if-needed",
            help="Build only when no kernel was built here from the current recipe and UML "
            "is installed (what `make test` runs).",
        ),
    ] = False,
    jobs: Annotated[int | None, typer.Option("--jobs", help="make -j (default: CPUs).")] = None,
) -> None:
    """Build the UML guest kernel the ipvs tests run in (see README).

    Debian's UML kernels have no nf_tables for ip (nftables mode beside IPVS), the newer
    ones no legacy iptables, and bookworm's cannot boot on CPUs with AMX. This fetches the
    newest linux-source of Debian unstable, configures it for the lab and every mode and
    installs it under /var/cache/kproxy/uml-kernel (KPROXY_UML_KERNEL_DIR), where the UML
    harness finds it. Takes several minutes on 2 cores, once per machine.
    """
    from kproxy.lab import uml_kernel
    from kproxy.lab.uml import uml_supported

    if if_needed:
        built = uml_kernel.kernel()
        if built is not None and uml_kernel.up_to_date():
            typer.echo(f"UML kernel: {built} (built earlier)")
            return
        if built is not None:
            typer.echo(f"UML kernel: {built} was built from another recipe; rebuilding")
        else:
            installed, why = uml_supported()
            if not installed:
                typer.echo(f"UML kernel: not built ({why})")
                return
            typer.echo("UML kernel: none built here yet; building it (once per machine)")
    started = time.perf_counter()
    try:
        path = uml_kernel.build(lambda line: typer.echo(f"  {line}"), jobs=jobs)
    except (uml_kernel.KernelBuildError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    typer.echo(f"UML kernel built in {time.perf_counter() - started:.0f} s: {path}")
