"""Detect NodeFacts on a live node (or inside a network namespace).

Plans take NodeFacts as input so renders stay reproducible; this module is the one place
that asks the kernel and the tools for them. Everything runs through subprocess commands
that are prefixed with ``ip netns exec NS`` (or ``ip -n NS``) when a namespace is given,
so the caller's own namespace is only read when netns is None.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from kproxy.dataplane.facts import NodeFacts
from kproxy.dataplane.iptables.backend import IptablesBackend, detect_backend
from kproxy.host.commands import Runner, in_netns, run_command

log = logging.getLogger(__name__)

TCP_BE_LIBERAL: Final = "/proc/sys/net/netfilter/nf_conntrack_tcp_be_liberal"
# nfacct list prints one object per line: "{ pkts = 000..., bytes = 000... } = NAME;"
_NFACCT_RE: Final = re.compile(r"}\s*=\s*([^;\s]+)\s*;")


def _ip(netns: str | None, *args: str) -> list[str]:
    # `ip -n NS` enters the namespace for this one call without a mount namespace dance.
    return ["ip", *(["-n", netns] if netns else []), *args]


def _json(runner: Runner, argv: list[str]) -> list[dict[str, Any]]:
    proc = runner(argv, None)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(argv)} failed with exit code {proc.returncode}: {proc.stderr.strip()}"
        )
    data = json.loads(proc.stdout or "[]")
    return data if isinstance(data, list) else []


def interface_addresses(
    netns: str | None = None, *, runner: Runner | None = None
) -> list[tuple[str, str, str]]:
    """(interface, IPv4 address, scope) for every address, in interface-index order."""
    run = runner or run_command
    out: list[tuple[str, str, str]] = []
    for link in _json(run, _ip(netns, "-j", "-4", "addr", "show")):
        for info in link.get("addr_info", []):
            if info.get("family") == "inet" and info.get("local"):
                out.append((link.get("ifname", ""), info["local"], info.get("scope", "")))
    return out


def default_route_interfaces(
    netns: str | None = None, *, runner: Runner | None = None
) -> list[str]:
    """Interfaces holding an IPv4 default route of the main table, in route order."""
    run = runner or run_command
    return [
        route["dev"]
        for route in _json(run, _ip(netns, "-j", "-4", "route", "show", "default"))
        if route.get("dev")
    ]


def pick_node_ips(
    addresses: Sequence[tuple[str, str, str]], default_devs: Sequence[str]
) -> tuple[str, ...]:
    """First global non-loopback address on the default-route interface, else first non-loopback."""

    def usable(address: str) -> bool:
        return not ipaddress.ip_address(address).is_loopback

    for dev in default_devs:
        for ifname, address, scope in addresses:
            if ifname == dev and scope == "global" and usable(address):
                return (address,)
    for _, address, _ in addresses:
        if usable(address):
            return (address,)
    return ()


def nfacct_counters(netns: str | None = None, *, runner: Runner | None = None) -> frozenset[str]:
    """Names of the nfacct objects that exist; empty when the nfacct tool is missing."""
    if shutil.which("nfacct") is None:
        return frozenset()
    run = runner or run_command
    proc = run(in_netns(["nfacct", "list"], netns), None)
    if proc.returncode != 0:
        log.warning("nfacct list failed (exit %d): %s", proc.returncode, proc.stderr.strip())
        return frozenset()
    return parse_nfacct_list(proc.stdout)


def parse_nfacct_list(text: str) -> frozenset[str]:
    return frozenset(_NFACCT_RE.findall(text))


def read_proc(path: str, netns: str | None = None, *, runner: Runner | None = None) -> str | None:
    """Contents of a /proc file as the namespace sees it; None when it does not exist."""
    if netns is None and runner is None:
        try:
            return Path(path).read_text()
        except FileNotFoundError:
            return None
    run = runner or run_command
    proc = run(in_netns(["cat", path], netns), None)
    return proc.stdout if proc.returncode == 0 else None


def tcp_be_liberal(netns: str | None = None, *, runner: Runner | None = None) -> bool:
    text = read_proc(TCP_BE_LIBERAL, netns, runner=runner)
    try:
        return text is not None and int(text.strip()) != 0
    except ValueError:
        return False


def detect_node_facts(
    netns: str | None = None,
    backend: IptablesBackend | None = None,
    node_ips: Sequence[str] = (),
    *,
    runner: Runner | None = None,
) -> NodeFacts:
    """NodeFacts of the node (or of `netns`).

    node_ips: as given, else the first global-scope non-loopback IPv4 address of the
    interface holding the default route, else the first non-loopback address.
    random_fully comes from `backend` (default: the backend detect_backend picks there).
    """
    run = runner or run_command
    addresses = interface_addresses(netns, runner=run)
    local = tuple(dict.fromkeys(address for _, address, _ in addresses))
    ips = tuple(node_ips) or pick_node_ips(addresses, default_route_interfaces(netns, runner=run))
    if backend is None:
        backend = IptablesBackend(detect_backend(netns, runner=run), netns=netns, runner=run)
    return NodeFacts(
        node_ips=ips,
        local_addresses=local,
        random_fully=backend.supports_random_fully(),
        nfacct_counters=nfacct_counters(netns, runner=run),
        tcp_be_liberal=tcp_be_liberal(netns, runner=runner),
    )
