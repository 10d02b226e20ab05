"""`kproxy preflight --to MODE`: the operators' pre-switch checklist, automated.

Each check family is one module (kernel, conntrack, backup, config_checks, objects,
dataplane, sysctls); run.run_preflight() picks the checks that apply to the target mode
and returns a PreflightResult of Findings (findings.py). Exit codes: 0 safe (only warn /
info findings), 1 blocked, 2 usage error. `kproxy switch` runs the same preflight first
and refuses on a block unless --force.
"""

from typing import Any

_HOMES = {
    "NodeAccess": "access",
    "EXIT_BLOCKED": "findings",
    "EXIT_SAFE": "findings",
    "EXIT_USAGE": "findings",
    "Finding": "findings",
    "Severity": "findings",
    "PreflightResult": "run",
    "run_preflight": "run",
}
__all__ = [
    "EXIT_BLOCKED",
    "EXIT_SAFE",
    "EXIT_USAGE",
    "Finding",
    "NodeAccess",
    "PreflightResult",
    "Severity",
    "run_preflight",
]


def __getattr__(name: str) -> Any:
    # Lazily: `kproxy run` imports the preflight command line (typer needs its signature)
    # and must not pay for every check family in its resident memory.
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
