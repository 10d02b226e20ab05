"""What every command's package shares: how a command ends on a user's mistake (one red
line on stderr and an exit code, never a traceback), and the options declared alike."""

from __future__ import annotations

from typing import Annotated

import typer


class UsageError(Exception):
    """A mistake of the user's (a bad argument, a missing file): one line, exit code 2."""


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print `kproxy: error: message`; the caller raises the returned Exit (2: usage)."""
    typer.secho(f"kproxy: error: {message}", err=True, fg=typer.colors.RED)
    return typer.Exit(code)


HostOpt = Annotated[
    str | None,
    typer.Option("--hostname-override", help="The node name (default: this machine's hostname)."),
]
