"""Read and write /proc/sys values of the current network namespace, with clear logs."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("kproxy.sysctl")
PROC_SYS = Path("/proc/sys")


def get_sysctl(name: str) -> str | None:
    try:
        return (PROC_SYS / name).read_text().strip()
    except OSError:
        return None


def set_sysctl(name: str, value: int | str) -> bool:
    """Set name (slash form, e.g. net/ipv4/ip_forward) if it differs; False when it failed."""
    current = get_sysctl(name)
    if current == str(value):
        return True
    try:
        (PROC_SYS / name).write_text(f"{value}\n")
    except OSError as err:
        log.warning("could not set sysctl %s=%s (now %s): %s", name, value, current, err)
        return False
    log.info("set sysctl %s=%s (was %s)", name, value, current)
    return True
