"""`kproxy preflight --to MODE`: the operators' pre-switch checklist, automated.

Each check family is one module (kernel, conntrack, backup, config_checks, objects,
dataplane, sysctls); run.run_preflight() picks the checks that apply to the target mode
and returns a PreflightResult of Findings (findings.py). Exit codes: 0 safe (only warn /
info findings), 1 blocked, 2 usage error. `kproxy switch` runs the same preflight first
and refuses on a block unless --force.
"""

from kproxy.ops.preflight.access import NodeAccess
from kproxy.ops.preflight.findings import EXIT_BLOCKED, EXIT_SAFE, EXIT_USAGE, Finding, Severity
from kproxy.ops.preflight.run import PreflightResult, run_preflight

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
