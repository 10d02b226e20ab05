"""Build the dataplane of a mode: the one place that knows which modes exist in this build."""

from __future__ import annotations

import logging
from pathlib import Path

from kproxy.dataplane.base import AVAILABLE_MODES, Dataplane, check_mode_available
from kproxy.dataplane.facts import NodeFacts, RuleOptions
from kproxy.dataplane.iptables.backend import IptablesBackend, detect_backend

log = logging.getLogger("kproxy.dataplane")


def iptables_backend(choice: str, netns: str | None = None) -> IptablesBackend:
    """auto (detect like upstream), nft or legacy."""
    if choice not in ("auto", "nft", "legacy"):
        raise ValueError(f"--iptables-backend: invalid value {choice!r}: use auto, nft or legacy")
    return IptablesBackend(detect_backend(netns) if choice == "auto" else choice, netns=netns)


def create_dataplane(
    mode: str,
    *,
    options: RuleOptions,
    node_ips: tuple[str, ...] = (),
    iptables_backend_choice: str = "auto",
    state_dir: Path | None = None,
    port_range: str = "",
) -> tuple[Dataplane, NodeFacts]:
    """The dataplane for `mode` in the current network namespace, and the facts it uses."""
    check_mode_available(mode)
    from kproxy.dataplane.nodefacts import detect_node_facts

    if mode == "iptables":
        from kproxy.dataplane.iptables.proxier import IptablesDataplane

        backend = iptables_backend(iptables_backend_choice)
        facts = detect_node_facts(backend=backend, node_ips=node_ips)
        log.info("iptables backend %s, random-fully %s", backend.flavour, facts.random_fully)
        return IptablesDataplane(backend, facts, options, state_dir=state_dir), facts
    if mode == "nftables":
        from kproxy.dataplane.nftables.proxier import NftablesDataplane

        NftablesDataplane.check()
        # No iptables backend detection: nftables mode writes no iptables rule, and the
        # detection's iptables-nft-save reads the whole ip family, this mode's own table
        # included (1.6 s at 10,000 services, on every restart).
        facts = detect_node_facts(backend=IptablesBackend("nft"), node_ips=node_ips)
        return NftablesDataplane(facts, options, state_dir=state_dir), facts
    if mode == "userspace":
        from kproxy.dataplane.userspace.proxier import create_userspace_dataplane

        return create_userspace_dataplane(
            options=options,
            node_ips=node_ips,
            iptables_backend_choice=iptables_backend_choice,
            state_dir=state_dir,
            port_range=port_range,
        )
    if mode == "ipvs":
        from kproxy.dataplane.ipvs.proxier import create_ipvs_dataplane

        return create_ipvs_dataplane(
            options=options,
            node_ips=node_ips,
            iptables_backend_choice=iptables_backend_choice,
            state_dir=state_dir,
        )
    raise AssertionError(f"mode {mode!r} is listed as available ({AVAILABLE_MODES}) but not built")
