"""The proxy modes of this build, one spec each: the one place that knows which modes exist
and where each one's pieces are.

A spec names functions of its mode's package without importing it: `kproxy run` imports
only the mode it runs (and the others' cleanup modules once it looks for their leftovers).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kproxy.dataplane.base import AVAILABLE_MODES, Dataplane, check_mode_available
from kproxy.dataplane.facts import NodeFacts, RuleOptions

if TYPE_CHECKING:
    from kproxy.dataplane.base import OwnedObject
    from kproxy.dataplane.kernel_dump import KernelDump
    from kproxy.model.objects import Snapshot

log = logging.getLogger("kproxy.dataplane")


@dataclass(frozen=True)
class CreateArgs:
    """What every mode's factory is given (each takes what it needs)."""

    options: RuleOptions
    node_ips: tuple[str, ...] = ()
    iptables_backend_choice: str = "auto"
    state_dir: Path | None = None
    port_range: str = ""
    # nftables mode's layout (kproxy's own setting, dataplane/nftables/layouts.py).
    nftables_layout: str = "upstream"


@dataclass(frozen=True)
class RenderArgs:
    """What `kproxy render` gives every mode's renderer."""

    snapshot: Snapshot
    facts: NodeFacts
    options: RuleOptions
    state_dir: Path
    port_range: str = ""
    nftables_layout: str = "upstream"


Leftovers = Callable[["KernelDump"], list["OwnedObject"]]


@dataclass(frozen=True)
class ModeSpec:
    name: str
    # The dataplane in the current network namespace, and the node facts it uses.
    create: Callable[[CreateArgs], tuple[Dataplane, NodeFacts]]
    # What a full sync onto a fresh node programs, as text.
    render: Callable[[RenderArgs], str]
    # The iptables chains (table, name) this mode writes: while it runs, the leftover cleanup
    # of its own iptables backend keeps them (every other kube-proxy chain goes).
    keeps_chain: Callable[[str, str], bool] | None
    # What of this mode, besides its chains, a kernel dump holds (nothing is changed) ...
    owned: Leftovers
    # ... and the same removed, in an order that works; returns what went.
    remove: Leftovers
    # Its reader of what the kernel programs (list, trace, the switch's verification): a
    # module of kproxy.ops.inspect with load() and destinations(), each taking the iptables
    # flavour first where the mode lives in an iptables backend (one reader per flavour).
    reader: str = ""
    per_iptables_flavour: bool = False
    # Raw-table rules this mode adds only during a switch (in any mode a leftover of a crash):
    # (where, rules) -> the ones that are this mode's.
    switch_rules: Callable[[str, list[str]], list[OwnedObject]] | None = None
    # nftables mode: one dataplane per layout (dataplane/nftables/layouts.py), its reader's
    # load() and destinations() given layout=; while it runs in one layout, the others'
    # state is left over: (dump, running layout, remove=) -> that state (removed if remove).
    per_nftables_layout: bool = False
    other_layouts: Callable[..., list[OwnedObject]] | None = None


@dataclass(frozen=True)
class DataplaneName:
    """One dataplane of a mode, as kproxy reports it: "iptables-nft" (a mode in an iptables
    backend, per flavour), "nftables-compact" (nftables mode per layout), "ipvs"."""

    name: str
    mode: str
    flavour: str | None = None
    layout: str | None = None


def dataplanes() -> list[DataplaneName]:
    """Every dataplane of this build's modes, in the specs' order."""
    from kproxy.dataplane.kernel_dump import IPTABLES_FLAVOURS

    out: list[DataplaneName] = []
    for spec in SPECS.values():
        if spec.per_iptables_flavour:
            out += [DataplaneName(f"{spec.name}-{f}", spec.name, f) for f in IPTABLES_FLAVOURS]
        elif spec.per_nftables_layout:
            from kproxy.dataplane.nftables import layouts

            out += [
                DataplaneName(layouts.dataplane_name(lay), spec.name, layout=lay)
                for lay in layouts.LAYOUTS
            ]
        else:
            out.append(DataplaneName(spec.name, spec.name))
    return out


def dataplane_name(dp: Dataplane) -> str:
    """A running dataplane's name among dataplanes()."""
    flavour, layout = dp.iptables_flavour, dp.nftables_layout
    spec = SPECS.get(dp.mode)
    if spec is not None and spec.per_iptables_flavour and flavour:
        return f"{dp.mode}-{flavour}"
    if spec is not None and spec.per_nftables_layout and layout:
        from kproxy.dataplane.nftables.layouts import dataplane_name as nft_name

        return nft_name(layout)
    return dp.mode


def _lazy(target: str, **bound: Any) -> Callable[..., Any]:
    """module:function, imported at its first call."""
    module, _, name = target.partition(":")

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args, **bound, **kwargs)

    call.__qualname__ = call.__name__ = target
    return call


def _none(_dump: KernelDump) -> list[OwnedObject]:
    return []


# --- factories and renderers ------------------------------------------------------------------


def _create_iptables(a: CreateArgs) -> tuple[Dataplane, NodeFacts]:
    from kproxy.dataplane.iptables.backend import chosen_backend
    from kproxy.dataplane.iptables.proxier import IptablesDataplane
    from kproxy.dataplane.nodefacts import detect_node_facts

    backend = chosen_backend(a.iptables_backend_choice)
    facts = detect_node_facts(backend=backend, node_ips=a.node_ips)
    log.info("iptables backend %s, random-fully %s", backend.flavour, facts.random_fully)
    return IptablesDataplane(backend, facts, a.options, state_dir=a.state_dir), facts


def _create_nftables(a: CreateArgs) -> tuple[Dataplane, NodeFacts]:
    from kproxy.dataplane.iptables.backend import IptablesBackend
    from kproxy.dataplane.nftables.proxier import NftablesDataplane
    from kproxy.dataplane.nodefacts import detect_node_facts

    NftablesDataplane.check()
    # No iptables backend detection: nftables mode writes no iptables rule, and the
    # detection's iptables-nft-save reads the whole ip family, this mode's own table
    # included (1.6 s at 10,000 services, on every restart).
    facts = detect_node_facts(backend=IptablesBackend("nft"), node_ips=a.node_ips)
    dataplane = NftablesDataplane(facts, a.options, state_dir=a.state_dir, layout=a.nftables_layout)
    return dataplane, facts


def _create_ipvs(a: CreateArgs) -> tuple[Dataplane, NodeFacts]:
    from kproxy.dataplane.ipvs.proxier import create_ipvs_dataplane

    return create_ipvs_dataplane(
        options=a.options,
        node_ips=a.node_ips,
        iptables_backend_choice=a.iptables_backend_choice,
        state_dir=a.state_dir,
    )


def _create_userspace(a: CreateArgs) -> tuple[Dataplane, NodeFacts]:
    from kproxy.dataplane.userspace.proxier import create_userspace_dataplane

    return create_userspace_dataplane(
        options=a.options,
        node_ips=a.node_ips,
        iptables_backend_choice=a.iptables_backend_choice,
        state_dir=a.state_dir,
        port_range=a.port_range,
    )


def _render_iptables(a: RenderArgs) -> str:
    from kproxy.dataplane.iptables.render import render_full

    return render_full(a.snapshot, a.facts, a.options)


def _render_nftables(a: RenderArgs) -> str:
    from kproxy.dataplane.nftables.render import render_full

    return render_full(a.snapshot, a.facts, a.options, layout=a.nftables_layout)


def _render_ipvs(a: RenderArgs) -> str:
    from kproxy.dataplane.ipvs.render import render_text

    return render_text(a.snapshot, a.facts, a.options)


def _render_userspace(a: RenderArgs) -> str:
    from kproxy.dataplane.userspace.proxier import saved_ports
    from kproxy.dataplane.userspace.render import parse_port_range, render_text

    return render_text(
        a.snapshot,
        a.facts,
        a.options,
        previous_ports=saved_ports(a.state_dir),
        port_range=parse_port_range(a.port_range),
    )


# --- the specs --------------------------------------------------------------------------------


def _leftovers(module: str) -> tuple[Leftovers, Leftovers]:
    """owned and remove of a cleanup module's leftovers(dump, *, remove)."""
    return _lazy(f"{module}:leftovers", remove=False), _lazy(f"{module}:leftovers", remove=True)


_IPVS_OWNED, _IPVS_REMOVE = _leftovers("kproxy.dataplane.ipvs.cleanup")
_NFT_OWNED, _NFT_REMOVE = _leftovers("kproxy.dataplane.nftables.cleanup")
_USERSPACE_OWNED, _USERSPACE_REMOVE = _leftovers("kproxy.dataplane.userspace.cleanup")

# In the order leftovers go (after the iptables chains of every mode): ipvs's ipsets
# after the chains that reference them.
_SPECS = (
    ModeSpec(
        "iptables",
        create=_create_iptables,
        render=_render_iptables,
        keeps_chain=_lazy("kproxy.dataplane.iptables.cleanup:keeps_chain"),
        owned=_none,  # nothing but chains
        remove=_none,
        reader="kproxy.ops.inspect.iptables_reader",
        per_iptables_flavour=True,
    ),
    ModeSpec(
        "nftables",
        create=_create_nftables,
        render=_render_nftables,
        keeps_chain=None,
        owned=_NFT_OWNED,
        remove=_NFT_REMOVE,
        reader="kproxy.ops.inspect.nftables_reader",
        per_nftables_layout=True,
        other_layouts=_lazy("kproxy.dataplane.nftables.cleanup:other_layouts"),
    ),
    ModeSpec(
        "ipvs",
        create=_create_ipvs,
        render=_render_ipvs,
        keeps_chain=_lazy("kproxy.dataplane.ipvs.cleanup:is_ipvs_chain"),
        owned=_IPVS_OWNED,
        remove=_IPVS_REMOVE,
        reader="kproxy.ops.inspect.ipvs",
        switch_rules=_lazy("kproxy.dataplane.ipvs.hold:hold_objects"),
    ),
    ModeSpec(
        "userspace",
        create=_create_userspace,
        render=_render_userspace,
        keeps_chain=_lazy("kproxy.dataplane.userspace.cleanup:keeps_chain"),
        owned=_USERSPACE_OWNED,
        remove=_USERSPACE_REMOVE,
        reader="kproxy.ops.inspect.userspace",
        per_iptables_flavour=True,
        switch_rules=_lazy("kproxy.dataplane.userspace.render:handoff_objects"),
    ),
)
SPECS: Mapping[str, ModeSpec] = {s.name: s for s in _SPECS if s.name in AVAILABLE_MODES}


def mode_spec(mode: str) -> ModeSpec:
    """The spec of an available mode (DataplaneUnavailable otherwise)."""
    check_mode_available(mode)
    try:
        return SPECS[mode]
    except KeyError:
        raise AssertionError(
            f"mode {mode!r} is listed as available ({AVAILABLE_MODES}) but not built"
        ) from None


def create_dataplane(
    mode: str,
    *,
    options: RuleOptions,
    node_ips: tuple[str, ...] = (),
    iptables_backend_choice: str = "auto",
    state_dir: Path | None = None,
    port_range: str = "",
    nftables_layout: str = "upstream",
) -> tuple[Dataplane, NodeFacts]:
    """The dataplane for `mode` in the current network namespace, and the facts it uses."""
    spec = mode_spec(mode)
    return spec.create(
        CreateArgs(
            options, node_ips, iptables_backend_choice, state_dir, port_range, nftables_layout
        )
    )


__all__ = [
    "SPECS",
    "CreateArgs",
    "DataplaneName",
    "ModeSpec",
    "RenderArgs",
    "create_dataplane",
    "dataplane_name",
    "dataplanes",
    "mode_spec",
]
