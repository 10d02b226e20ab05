"""How a configuration's problems are told: ConfigError and the pieces of its messages."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any


class ConfigError(ValueError):
    """A configuration that cannot be used; str() is the message for humans.

    The first line names the source (file name, or "command-line flags"), then one line per
    problem. `problems` holds the problem lines alone.
    """

    def __init__(self, source: str, problems: Iterable[str]) -> None:
        self.source = source
        self.problems = list(problems)
        count = len(self.problems)
        head = f"{source}: invalid configuration ({count} problem{'s' if count != 1 else ''}):"
        super().__init__("\n".join([head, *(f"  {p}" for p in self.problems)]))


def show_value(value: Any) -> str:
    """A value in an error message: strings quoted with repr so stray spaces are visible."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, str | list | tuple | dict):
        return repr(value if not isinstance(value, tuple) else list(value))
    return str(value)


def suggest(value: str, choices: Iterable[str]) -> str | None:
    options = [c for c in choices if c]
    folded = {c.lower(): c for c in options}
    key = value.strip().lower()
    if key in folded:
        return folded[key]
    # 0.75 keeps real typos ("iptabels") and drops look-alikes ("kernelspace" -> userspace).
    close = difflib.get_close_matches(key, list(folded), n=1, cutoff=0.75)
    return folded[close[0]] if close else None
