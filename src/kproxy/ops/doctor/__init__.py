"""`kproxy doctor [--service NS/NAME]`: explain a misbehaving node or service.

run.run_doctor() checks the node (the preflight checks of the mode serving now), then
walks each service object -> endpoints -> kernel rules -> conntrack (layers.py) and names
the layer where it breaks, with the field knowledge of knowledge.py: symptom, cause,
commands. Exit codes: 0 nothing broken, 1 something broken, 2 usage error.
"""

from typing import Any

__all__ = ["DoctorResult", "ServiceReport", "run_doctor"]


def __getattr__(name: str) -> Any:
    # Lazily: `kproxy run` imports the doctor's command line (typer needs its signature)
    # and must not pay for the doctor's readers in its resident memory.
    if name in __all__:
        from kproxy.ops.doctor import run

        return getattr(run, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
