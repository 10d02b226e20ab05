"""What every command's package shares: how a command ends on a user's mistake (one red
line on stderr and an exit code, never a traceback), and the options declared alike.

Two kinds of usage error, both exit code 2: a value that is wrong on its own (not an IP, a
negative timeout) is click's "Invalid value for '--flag': ..." from a `checked` option,
before the command runs; a mistake only the command can see (a config file's problems, a
missing file) is `fail`'s "kproxy: error: ...".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import typer

from kproxy.text import one_line


class UsageError(Exception):
    """A mistake of the user's (a bad argument, a missing file): one line, exit code 2."""


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print `kproxy: error: message`; the caller raises the returned Exit (2: usage)."""
    typer.secho(f"kproxy: error: {message}", err=True, fg=typer.colors.RED)
    return typer.Exit(code)


def checked(parse: Callable[[Any], object]) -> Callable[[Any], Any]:
    """A typer option callback checking each given value with `parse` (a check from
    kproxy.config, say), whose ValueError becomes click's usage error naming the option."""

    def callback(param: typer.CallbackParam, value: Any) -> Any:
        if value is None:
            # What click holds for an option not given (typer converts it afterwards).
            return () if param.multiple else None
        for item in value if param.multiple else [value]:
            try:
                parse(item)
            except ValueError as err:
                # The checks quote values with repr(); anything else is made one line here.
                why = str(err)
                raise typer.BadParameter(why if why.isprintable() else one_line(why)) from None
        return value

    return callback


def node_name(text: str) -> str:
    """--hostname-override: a Node's name once trimmed and lowercased, as upstream takes it
    (empty: not given)."""
    from kproxy.model.parse import is_dns_subdomain

    name = text.strip().lower()
    if text and not is_dns_subdomain(name):
        raise ValueError(f"{text!r} is not a Node's name (RFC 1123 subdomain, e.g. node-1)")
    return name


HostOpt = Annotated[
    str | None,
    typer.Option(
        "--hostname-override",
        help="The node name (default: this machine's hostname).",
        callback=checked(node_name),
    ),
]


SwitchLayoutOpt = Annotated[
    str | None,
    typer.Option(
        "--nftables-layout",
        help="With --to nftables: the layout to switch to (upstream or compact; default: "
        "the one kproxy was started with). Switching between the layouts of nftables "
        "mode is a switch like any other (each has its own table).",
    ),
]


def check_switch_layout(layout: str | None, to: str) -> str | None:
    """A switch's (or its preflight's) --nftables-layout: a layout, and only with --to
    nftables; UsageError naming the flag otherwise."""
    from kproxy.dataplane.nftables.layouts import LAYOUTS, MODE

    if layout is None:
        return None
    if layout not in LAYOUTS:
        raise UsageError(f"--nftables-layout: {one_line(layout)!r} is not {' or '.join(LAYOUTS)}")
    if to != MODE:
        raise UsageError("--nftables-layout goes with --to nftables")
    return layout
