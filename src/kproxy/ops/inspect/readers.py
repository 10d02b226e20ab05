"""Which dataplanes a node has, and the reader for each: one interface, one entry per mode.

A reader turns a KernelSource into a ModeView (model.py) or None when its dataplane is
absent. A view is *live* when it is hooked into the packet path (kube-proxy's jump rules /
base chains are there), *present* when only its leftovers are. A reader also reads its
dataplane's service destinations alone (destinations.py: the switch's verification, diff,
preflight), from the same entries its view lists, and no more of the kernel than they need.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from kproxy.dataplane.registry import SPECS, dataplanes
from kproxy.modes import MODES
from kproxy.ops.inspect.kernel import KernelSource
from kproxy.ops.inspect.model import Destination, ModeView


@dataclass(frozen=True)
class Reader:
    dataplane: str  # "iptables-nft"
    mode: str  # "iptables"
    load: Callable[[KernelSource], ModeView | None]
    # the service destinations it programs -> their service port ("" when unnamed)
    destinations: Callable[[KernelSource], dict[Destination, str]]


def _from_registry() -> list[Reader]:
    """One reader per dataplane (dataplane/registry.py): a mode in an iptables backend has
    one per flavour (given first), nftables mode one per layout (given as layout=)."""
    out: list[Reader] = []
    for plane in dataplanes():
        module = importlib.import_module(SPECS[plane.mode].reader)
        load, dests = module.load, module.destinations
        if plane.flavour is not None:
            load, dests = partial(load, plane.flavour), partial(dests, plane.flavour)
        elif plane.layout is not None:
            load, dests = partial(load, layout=plane.layout), partial(dests, layout=plane.layout)
        out.append(Reader(plane.name, plane.mode, load, dests))
    return out


READERS: list[Reader] = _from_registry()


def register(reader: Reader) -> None:
    """Add (or replace) the reader of one dataplane."""
    READERS[:] = [r for r in READERS if r.dataplane != reader.dataplane]
    READERS.append(reader)


class ModeSelectionError(ValueError):
    """--mode names no dataplane this build can read."""


@dataclass
class Selection:
    views: list[ModeView]  # what to report on
    found: list[ModeView]  # every dataplane with kube-proxy state
    notes: list[str] = field(default_factory=list)

    @property
    def mid_switch(self) -> bool:
        return sum(1 for v in self.found if v.live) > 1


def _wanted(reader: Reader, mode: str | None) -> bool:
    return mode is None or mode in (reader.mode, reader.dataplane)


def select(source: KernelSource, mode: str | None = None) -> Selection:
    """The live dataplanes (or those --mode names), read from the kernel."""
    if mode is not None:
        names = {r.dataplane for r in READERS} | {r.mode for r in READERS}
        if mode not in names:
            if mode in MODES:
                raise ModeSelectionError(f"{mode} mode cannot be inspected by this build yet")
            choices = ", ".join(sorted(names))
            raise ModeSelectionError(f"unknown mode {mode!r} (choose from {choices})")
    found: list[ModeView] = []
    for reader in READERS:
        if not _wanted(reader, mode):
            continue
        view = reader.load(source)
        if view is not None:
            found.append(view)
    # A view that reads another reader's dump (userspace mode's chains in an iptables
    # backend) explains that reader's "not iptables mode" view: drop the latter.
    covered = {c for v in found for c in getattr(v, "covers", ())}
    found = [v for v in found if v.live or v.dataplane not in covered]
    live = [v for v in found if v.live]
    notes: list[str] = []
    views = live or found
    for v in found:
        if not v.live:
            notes.append(f"{v.dataplane} has kube-proxy state but is not live: {v.detail}")
    if len(live) > 1:
        names = " and ".join(v.dataplane for v in live)
        notes.insert(
            0,
            f"mid-switch: {names} are both hooked into the packet path"
            + ("" if mode else "; pick one with --mode"),
        )
    if not found:
        what = f"{mode} dataplane" if mode else "kube-proxy dataplane (iptables, nftables, …)"
        notes.append(f"no {what} found in this network namespace")
    return Selection(views, found, notes)
