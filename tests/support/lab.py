"""Whether the lab (real network namespaces, root) can run here, asked once per session."""

from __future__ import annotations

from kproxy.lab.topology import lab_supported

LAB_SUPPORTED, LAB_SKIP_REASON = lab_supported()
