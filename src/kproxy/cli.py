"""The `kproxy` command: one typer app whose commands their own packages register.

A package's register(app) adds its commands. It is imported only when one of them runs (or
`kproxy --help` lists them all), so `kproxy run` loads neither the ops commands nor the lab.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Annotated

if sys.argv[1:2] == ["run"]:
    # The daemon's resident memory: typer imports rich (7.5 MiB resident) only to colour
    # help and usage errors; without it `kproxy run` prints click's plain ones.
    sys.modules.setdefault("rich", None)  # type: ignore[assignment]

import click
import typer
from typer.core import TyperGroup

from kproxy import __version__
from kproxy.cli_common import fail

# Every command, in `kproxy --help` order, and the module whose register(app) adds it (None:
# defined below).
COMMANDS: dict[str, str | None] = {
    "run": "kproxy.proxy_cli",
    "render": "kproxy.proxy_cli",
    "cleanup": "kproxy.proxy_cli",
    "status": "kproxy.ops.control",
    "switch": "kproxy.ops.control",
    "preflight": "kproxy.ops.preflight.cli",
    "doctor": "kproxy.ops.doctor.cli",
    "list": "kproxy.ops.inspect.cli",
    "trace": "kproxy.ops.inspect.cli",
    "verify": "kproxy.ops.verify",
    "snapshot": None,
    "diff": None,
    "demo": None,
    "version": None,
    "rollout": "kproxy.cluster.rollout.cli",
    "lab": "kproxy.lab.cli",
}


class PackageCommands(TyperGroup):
    """The root group: a package's commands are loaded when one of them is asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        module = COMMANDS.get(cmd_name)
        if cmd_name not in self.commands and module is not None:
            package = typer.Typer()
            importlib.import_module(module).register(package)
            self.commands.update(typer.main.get_group(package).commands)
        return self.commands.get(cmd_name)

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        try:
            return super().resolve_command(ctx, args)
        except click.exceptions.NoSuchCommand as err:
            # click suggests a close name among the loaded commands only.
            raise click.exceptions.NoSuchCommand(
                err.command_name, possibilities=COMMANDS, ctx=ctx
            ) from None


app = typer.Typer(
    cls=PackageCommands,
    help="kproxy: a Kubernetes service proxy compatible with kube-proxy, with safe live "
    "proxy-mode switching.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


# --- snapshot and diff ---------------------------------------------------------------------------


@app.command()
def snapshot(
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write here (default: stdout).")
    ] = None,
) -> None:
    """Record this node's dataplane (iptables of both backends, nftables, IPVS, ipsets,
    kube-ipvs0, conntrack usage) as one JSON document. Read only."""
    from kproxy.ops.snapshot import programmed_in, take
    from kproxy.ops.snapshot_file import write_node_snapshot

    if output is None:
        json.dump(take(), sys.stdout, indent=1)
        sys.stdout.write("\n")
        return
    try:
        output.open("w").close()  # a path that cannot be written is a usage error
    except OSError as err:
        raise fail(f"--output {output}: cannot write it: {err.strerror or err}") from None
    write_node_snapshot(output)
    found = programmed_in(json.loads(output.read_text()))
    summary = ", ".join(f"{name}: {len(keys)} service destinations" for name, keys in found.items())
    typer.echo(f"wrote {output} ({summary or 'no kube-proxy dataplane found'})")


@app.command()
def diff(
    a: Annotated[Path, typer.Argument(help="The earlier snapshot.")],
    b: Annotated[Path, typer.Argument(help="The later snapshot.")],
) -> None:
    """Compare two snapshots, mode-aware: which service destinations one programs and the
    other lacks, in which dataplane. Exit code 1 when B misses something A had."""
    from kproxy.ops.snapshot import FORMAT
    from kproxy.ops.snapshot import diff as compare

    docs = []
    for path in (a, b):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise fail(f"cannot read snapshot {path}: {err}") from None
        if not isinstance(doc, dict):
            raise fail(f"{path} is not a kproxy snapshot (not a JSON object)")
        if doc.get("format") != FORMAT:
            shown = repr(doc.get("format"))[:80]  # repr: printable, one line
            raise fail(f"{path} is not a kproxy snapshot (format {shown})")
        docs.append(doc)
    lines = compare(*docs)
    typer.echo("\n".join(lines))
    raise typer.Exit(1 if any(line.startswith("missing in B") for line in lines) else 0)


# --- demo and version -----------------------------------------------------------------------------


@app.command()
def demo(
    keep: Annotated[bool, typer.Option("--keep", help="Leave the lab running at the end.")] = False,
) -> None:
    """Build the lab, run kproxy on its node, send traffic, edit a service live, tear down."""
    from kproxy.demo import run_demo

    raise typer.Exit(run_demo(keep=keep))


@app.command()
def version() -> None:
    """Print the kproxy version."""
    typer.echo(f"kproxy {__version__}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
