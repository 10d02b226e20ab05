"""`kproxy doctor [--service NS/NAME]`: explain a misbehaving node or service.

run.run_doctor() checks the node (the preflight checks of the mode serving now), then
walks each service object -> endpoints -> kernel rules -> conntrack (layers.py) and names
the layer where it breaks, with the field knowledge of knowledge.py: symptom, cause,
commands. Exit codes: 0 nothing broken, 1 something broken, 2 usage error.
"""

from kproxy.ops.doctor.run import DoctorResult, ServiceReport, run_doctor

__all__ = ["DoctorResult", "ServiceReport", "run_doctor"]
