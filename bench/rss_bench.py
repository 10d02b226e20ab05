"""Memory of the real `kproxy run` at N services: VmRSS / VmHWM after its first sync.

kproxy runs as production runs it (`python -m kproxy.cli run --source DIR --config ...`),
inside a fresh bench namespace via `ip netns exec`, reading one YAML file per service. We
wait for status.json in its state dir to report syncs >= 1, then read /proc/<pid>/status;
then wait for the start-up leftover scan to finish (status.json's leftovers_removed: it
reads whole rule dumps beside the running mode), STEADY_WAIT seconds more, and read again
(steady state) together with the CPU the idle process uses over those seconds.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench import netns, workload
from bench.fixes import BUG1_MESSAGE

FIRST_SYNC_TIMEOUT = 600.0
STEADY_WAIT = 5.0
_FIRST_FULL_RE = re.compile(r"kproxy\.sync: full sync: .* ([\d.]+) s$", re.MULTILINE)


@dataclass
class RssFigures:
    backend: str
    size: int
    rss_mb: float = 0.0  # VmRSS right after the first sync
    hwm_mb: float = 0.0  # VmHWM (peak RSS) right after the first sync
    steady_rss_mb: float = 0.0  # VmRSS STEADY_WAIT seconds after the leftover scan
    leftovers_s: float = 0.0  # first sync -> the leftover scan reported done
    first_sync_s: float = 0.0  # process start -> status.json reports the first sync
    sync_duration_s: float = 0.0  # the first (full) sync itself, as kproxy logs it
    idle_cpu_pct: float = 0.0  # CPU of the idle process (polling), % of one core
    workaround: str = ""
    problem: str = ""

    def to_json(self) -> dict[str, object]:
        return dict(self.__dict__)


def _proc_status(pid: int) -> dict[str, float]:
    out: dict[str, float] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) / 1024  # kB -> MiB
    return out


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _status(path: Path) -> dict[str, object]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def prepare_files(workdir: Path, size: int) -> tuple[Path, Path]:
    source = workdir / f"objects-{size}"
    if not source.exists():
        workload.write_source(source, size)
    config = workdir / "kproxy-config.yaml"
    config.write_text(workload.CONFIG_YAML)
    return source, config


NFTABLES_MODE = "nftables"


def _mode_args(flavour: str) -> list[str]:
    """kproxy run's arguments for a measured flavour: an iptables backend (iptables mode)
    or "nftables" (nftables mode)."""
    if flavour == NFTABLES_MODE:
        return ["--proxy-mode", NFTABLES_MODE]
    return ["--iptables-backend", flavour]


def measure(flavour: str, size: int, workdir: Path, log: Callable[[str], None]) -> RssFigures:
    """RSS of `kproxy run` at `size` services; flavour: "nft" or "legacy" (iptables mode on
    that backend) or "nftables" (nftables mode)."""
    source, config = prepare_files(workdir, size)
    fig = RssFigures(flavour, size)
    try:
        _run_once(fig, source, config, workdir, precreate=False, log=log)
    except _Bug1:
        # A fresh node never gets its first sync on nft (bench/fixes.py bug 1). To still
        # see the memory, give the namespace the chain the first piece needs.
        fig.workaround = "bug 1: KUBE-MARK-MASQ pre-created in the namespace"
        log(f"    rss {flavour} {size}: first sync hit bug 1; retrying with the chain pre-created")
        netns.wait_quiet(min_wait=2.0, busy_below=0.2)
        _run_once(fig, source, config, workdir, precreate=True, log=log)
    return fig


class _Bug1(Exception):
    pass


def _run_once(
    fig: RssFigures,
    source: Path,
    config: Path,
    workdir: Path,
    *,
    precreate: bool,
    log: Callable[[str], None],
) -> None:
    state = workdir / f"state-{fig.backend}-{fig.size}-{int(precreate)}"
    logfile = workdir / f"kproxy-{fig.backend}-{fig.size}-{int(precreate)}.log"
    with netns.fresh() as ns:
        if precreate:
            subprocess.run(
                netns.exec_argv(
                    ns, [f"iptables-{fig.backend}", "-t", "nat", "-N", "KUBE-MARK-MASQ"]
                ),
                check=True,
            )
        argv = netns.exec_argv(
            ns,
            [
                sys.executable,
                "-m",
                "kproxy.cli",
                "run",
                "--source",
                str(source),
                "--config",
                str(config),
                "--state-dir",
                str(state),
                "--node-ip",
                workload.NODE_IP,
                *_mode_args(fig.backend),
            ],
        )
        with logfile.open("w") as out:
            t0 = time.monotonic()
            proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            _wait_first_sync(proc, state / "status.json", logfile)
            fig.first_sync_s = time.monotonic() - t0
            mem = _proc_status(proc.pid)
            fig.rss_mb, fig.hwm_mb = mem["VmRSS"], mem["VmHWM"]
            found = _FIRST_FULL_RE.search(logfile.read_text(errors="replace"))
            fig.sync_duration_s = float(found.group(1)) if found else 0.0
            fig.leftovers_s = _wait_leftovers(proc, state / "status.json")
            cpu0 = _cpu_seconds(proc.pid)
            time.sleep(STEADY_WAIT)
            fig.idle_cpu_pct = 100 * (_cpu_seconds(proc.pid) - cpu0) / STEADY_WAIT
            fig.steady_rss_mb = _proc_status(proc.pid)["VmRSS"]
            log(
                f"    rss {fig.backend} {fig.size}: RSS {fig.rss_mb:.0f} MiB, peak "
                f"{fig.hwm_mb:.0f} MiB, first sync after {fig.first_sync_s:.1f} s"
            )
        finally:
            _stop(proc)


def _wait_first_sync(
    proc: subprocess.Popen[bytes], status: Path, logfile: Path
) -> dict[str, object]:
    deadline = time.monotonic() + FIRST_SYNC_TIMEOUT
    while time.monotonic() < deadline:
        st = _status(status)
        syncs = st.get("syncs", 0)
        if st.get("pid") == proc.pid and isinstance(syncs, int) and syncs >= 1:
            return st
        if proc.poll() is not None:
            raise RuntimeError(f"kproxy exited with {proc.returncode}; see {logfile}")
        if BUG1_MESSAGE in logfile.read_text(errors="replace"):
            raise _Bug1()
        time.sleep(0.1)
    raise TimeoutError(f"kproxy did not report a sync within {FIRST_SYNC_TIMEOUT:.0f} s")


def _wait_leftovers(proc: subprocess.Popen[bytes], status: Path) -> float:
    started = time.monotonic()
    deadline = started + FIRST_SYNC_TIMEOUT
    while time.monotonic() < deadline and proc.poll() is None:
        if _status(status).get("leftovers_removed") is not None:
            return time.monotonic() - started
        time.sleep(0.2)
    raise TimeoutError("kproxy did not report its leftover scan as done")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop the kproxy this module started (its pid only)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
