"""What every proxy mode implements, and the registry of modes this build provides.

The sync loop, the live switch and the inspectors talk to a mode only through this
interface: sync a snapshot (full or partial), say what it owns, clean it up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kproxy.model.objects import Snapshot
from kproxy.modes import MODES

# The modes this build provides: all of kproxy's (a build without one drops it here).
AVAILABLE_MODES: tuple[str, ...] = MODES


class DataplaneUnavailable(Exception):
    """The mode cannot run on this node or in this build; the message says why and what to do."""


class SyncError(Exception):
    """Applying a plan failed; the kernel still holds the last good state."""

    def __init__(self, message: str, *, kept_input: str | None = None) -> None:
        super().__init__(message)
        self.kept_input = kept_input


@dataclass
class SyncResult:
    full: bool
    services: int = 0
    rewritten: int = 0
    stale_removed: int = 0
    # Rules written per table in this sync and owned in total (for the rule-count metrics).
    rules_written: dict[str, int] = field(default_factory=dict)
    rules_total: dict[str, int] = field(default_factory=dict)
    pieces: int = 1
    # Other kernel objects the mode programs, by kind (ipvs: "ipvs_virtual_servers",
    # "ipvs_real_servers"), for the metrics.
    objects: dict[str, int] = field(default_factory=dict)
    # A full sync that found the kernel provably as last written, so it wrote only changes.
    kernel_unchanged: bool = False


@dataclass(frozen=True)
class OwnedObject:
    """One piece of kernel state a cleanup would remove, and why it is considered ours."""

    kind: str  # "iptables-chain", "iptables-rule", "nft-table", ...
    where: str  # e.g. "iptables-nft nat"
    name: str
    reason: str

    def __str__(self) -> str:
        return f"{self.kind} {self.where} {self.name}: {self.reason}"


class Dataplane(Protocol):
    mode: str

    def sync(self, snapshot: Snapshot, *, full: bool) -> SyncResult: ...

    def drifted(self) -> bool:
        """Did someone else remove our state (e.g. a firewall reload)? Then a full sync is due."""

    def detach(self) -> None:
        """Take this mode out of the packet path in one atomic step (its entry points: jumps,
        base chains). Its other state stays until cleanup(); established connections keep
        their conntrack translation. A later sync(full=True) attaches it again."""

    def owned(self) -> list[OwnedObject]:
        """Kernel state of this mode that exists now (kproxy's or upstream kube-proxy's)."""

    def cleanup(self, *, dry_run: bool = False) -> list[OwnedObject]:
        """Remove this mode's state (only ours); returns what was (or would be) removed."""


def check_mode_available(mode: str) -> None:
    if mode not in AVAILABLE_MODES:
        raise DataplaneUnavailable(
            f"proxy mode {mode!r} is not available in this build (available: "
            f"{', '.join(AVAILABLE_MODES)}); kproxy never falls back to another mode"
        )
