"""The machine a bench run measured: cores, memory, kernel, tool versions, python, load."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time


def _first_line(argv: list[str]) -> str:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"unavailable ({err})"
    text = (proc.stdout or proc.stderr).strip()
    return text.splitlines()[0] if text else f"unavailable (exit {proc.returncode})"


def _mem_total_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    return 0.0


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def commit() -> str:
    """The kproxy tree measured: HEAD, plus a note when src/ has uncommitted changes."""
    head = _first_line(["git", "rev-parse", "--short", "HEAD"])
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "src"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return head + (" + uncommitted changes in src/" if dirty else "")


def describe() -> dict[str, str]:
    return {
        "kproxy commit": commit(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpus": f"{os.cpu_count()} ({_cpu_model()})",
        "memory": f"{_mem_total_gib():.1f} GiB",
        "kernel": platform.release(),
        "iptables-nft": _first_line(["iptables-nft", "--version"]),
        "iptables-legacy": _first_line(["iptables-legacy", "--version"]),
        "python": sys.version.split()[0],
        "load average at start": loadavg(),
    }
