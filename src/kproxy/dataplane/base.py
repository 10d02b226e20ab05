"""What every proxy mode implements, and which modes this build provides.

The sync loop, the live switch and the inspectors talk to a mode only through the
Dataplane class: sync a snapshot (full or partial), say what it owns, clean it up. Its
optional capabilities have defaults here, so callers never ask whether a mode has them.
"""

from __future__ import annotations

import threading
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
    # Cleanup transactions (stale chain deletions) that failed in this sync, which went on
    # as a full one: upstream counts them apart from failed syncs.
    cleanup_failures: int = 0


@dataclass(frozen=True)
class OwnedObject:
    """One piece of kernel state a cleanup would remove, and why it is considered ours."""

    kind: str  # "iptables-chain", "iptables-rule", "nft-table", ...
    where: str  # e.g. "iptables-nft nat"
    name: str
    reason: str

    def __str__(self) -> str:
        return f"{self.kind} {self.where} {self.name}: {self.reason}"


class Draining(Protocol):
    """What a retired mode keeps until it is idle (ipvs/drain.Draining)."""

    @property
    def done(self) -> bool: ...
    def summary(self) -> str: ...
    def run(self, stop: threading.Event) -> None: ...


class Dataplane:
    """A proxy mode's dataplane. Each mode subclasses it; the methods that raise are the
    ones every mode implements, the others are defaults a mode overrides when it can."""

    mode: str
    # Whether the mode itself moves UDP flows off removed endpoints (userspace's workers do:
    # the conntrack entries there are redirects of live flows, which the sync loop's stale
    # UDP cleanup must not delete).
    moves_udp_flows: bool = False

    def sync(self, snapshot: Snapshot, *, full: bool) -> SyncResult:
        raise NotImplementedError

    def drifted(self) -> bool:
        """Did someone else remove our state (e.g. a firewall reload)? Then a full sync is due."""
        raise NotImplementedError

    def detach(self) -> None:
        """Take this mode out of the packet path in one atomic step (its entry points: jumps,
        base chains). Its other state stays until cleanup(); established connections keep
        their conntrack translation. A later sync(full=True) attaches it again."""
        raise NotImplementedError

    def owned(self) -> list[OwnedObject]:
        """Kernel state of this mode that exists now (kproxy's or upstream kube-proxy's)."""
        raise NotImplementedError

    def cleanup(self, *, dry_run: bool = False) -> list[OwnedObject]:
        """Remove this mode's state (only ours); returns what was (or would be) removed."""
        raise NotImplementedError

    def retire(self) -> tuple[list[OwnedObject], Draining | None]:
        """cleanup() for a live switch away from this mode: what was removed, and what
        stays until its connections end (None: nothing; only ipvs mode keeps some)."""
        return self.cleanup(), None

    def close(self) -> None:
        """Let go of what this dataplane holds in this process (sockets, locks)."""

    def distrust_kernel(self) -> None:
        """Make the next full sync read and rewrite everything (an operator asked for it);
        a mode that always does is fine with this default."""

    def proven_dumps(self) -> dict[str, str]:
        """What the kernel provably holds of this mode's service destinations now, as dumps
        under the keys a kernel source reads them by (ops.inspect.kernel: "iptables-nft",
        …): what its last sync wrote, while nothing but its own syncs changed the kernel
        since a full read. Empty when that cannot be proven (the caller reads the kernel).
        Only while no sync runs (ProxyLoop.between_syncs): a sync changes both."""
        return {}

    @property
    def iptables_flavour(self) -> str | None:
        """The iptables backend this mode writes with ("nft", "legacy"), if it writes any."""
        return None

    @property
    def nftables_layout(self) -> str | None:
        """nftables mode's layout (dataplane/nftables/layouts.py); None in other modes."""
        return None


def check_mode_available(mode: str) -> None:
    if mode not in AVAILABLE_MODES:
        raise DataplaneUnavailable(
            f"proxy mode {mode!r} is not available in this build (available: "
            f"{', '.join(AVAILABLE_MODES)}); kproxy never falls back to another mode"
        )
