"""What a preflight (or doctor) run knows: target mode, configuration, objects, the node.

Everything expensive (the dataplane snapshot, local addresses, parsed objects) is computed
once, on first use, and shared by the checks.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kproxy.config import ConfigError, ProxyConfig, load_config
from kproxy.model.objects import Snapshot
from kproxy.model.parse import (
    IgnoredObject,
    InvalidObject,
    ParsedService,
    ParsedSlice,
    parse_endpoint_slice,
    parse_service,
)
from kproxy.ops.preflight.access import NodeAccess
from kproxy.ops.preflight.findings import Finding

if TYPE_CHECKING:
    from kproxy.ops.inspect.destinations import Programmed
    from kproxy.ops.preflight.dataplane import NodeDump
    from kproxy.ops.preflight.live import LiveState

log = logging.getLogger("kproxy.preflight")

KERNEL_MODES = ("iptables", "nftables", "ipvs")
ALL_MODES = ("iptables", "nftables", "ipvs", "userspace")


@dataclass(frozen=True)
class Check:
    """One check: its family (the module), the target modes it applies to, what it reads."""

    family: str
    fn: Callable[[Context], list[Finding]]
    modes: tuple[str, ...] = ALL_MODES
    needs_source: bool = False

    @property
    def name(self) -> str:
        return f"{self.family}.{self.fn.__name__.removeprefix('check_')}"


@dataclass
class ObjectView:
    """The objects of --source through the model's own parser: parsed services and slices,
    and what was skipped (ignored or invalid) with the model's reason."""

    services: dict[str, ParsedService] = field(default_factory=dict)  # "ns/name"
    slices: list[ParsedSlice] = field(default_factory=list)
    ignored: dict[str, str] = field(default_factory=dict)  # "ns/name" -> why
    # Every Service there is, programmed or not ("ns/name"), and the ExternalName ones' names.
    known: set[str] = field(default_factory=set)
    external_names: dict[str, str] = field(default_factory=dict)

    def slices_of(self, service: str) -> list[ParsedSlice]:
        return [s for s in self.slices if f"{s.namespace}/{s.service}" == service]


def object_view(objects: Sequence[dict[str, Any]]) -> ObjectView:
    view = ObjectView()
    for obj in objects:
        kind = obj.get("kind")
        meta = obj.get("metadata") or {}
        key = f"{meta.get('namespace') or 'default'}/{meta.get('name', '')}"
        if kind == "Service":
            view.known.add(key)
            spec = obj.get("spec") or {}
            if spec.get("type") == "ExternalName":
                view.external_names[key] = str(spec.get("externalName", ""))
            try:
                view.services[key] = parse_service(obj)
            except IgnoredObject as why:
                view.ignored[key] = str(why)
            except InvalidObject:
                pass  # the snapshot's rejections report it, with the field
        elif kind == "EndpointSlice":
            with contextlib.suppress(IgnoredObject, InvalidObject):
                view.slices.append(parse_endpoint_slice(obj))
    return view


@dataclass
class Context:
    target: str
    # nftables mode's layout to switch to (dataplane/nftables/layouts.py; None in other modes)
    target_layout: str | None = None
    access: NodeAccess = field(default_factory=NodeAccess)
    config_path: Path | None = None
    source: Path | None = None
    # The running kproxy's status (admin socket or status.json), when there is one.
    status: dict[str, Any] | None = None
    # The mode serving now: given, from status, or read from the kernel.
    current_mode: str | None = None
    current_flavour: str | None = None
    current_layout: str | None = None  # nftables mode's
    node_name: str = ""
    state_dir: Path | None = None
    backup_path: Path | None = None
    # Given directly (tests, the switch): skips loading.
    config_override: ProxyConfig | None = None
    objects_override: list[dict[str, Any]] | None = None
    # ops.snapshot.take by default; tests give recorded dataplanes.
    snapshot_taker: Callable[[str | None], Mapping[str, Any]] | None = None
    # The running kproxy's own state (live.py): its objects and its mode, no re-reads.
    live: LiveState | None = None
    notes: list[str] = field(default_factory=list)

    # -- configuration --------------------------------------------------------------------

    @cached_property
    def _loaded(self) -> tuple[ProxyConfig | None, ConfigError | None]:
        if self.config_override is not None:
            return self.config_override, None
        if self.config_path is None:
            return None, None
        try:
            return load_config(self.config_path), None
        except ConfigError as err:
            return None, err

    @property
    def config(self) -> ProxyConfig | None:
        """The configuration as given (None: none given, or it does not load)."""
        return self._loaded[0]

    @property
    def config_error(self) -> ConfigError | None:
        return self._loaded[1]

    @cached_property
    def target_config(self) -> ProxyConfig:
        """What the target mode will run with: the given configuration with its mode
        replaced (a live switch keeps every other setting), or upstream's defaults."""
        base = self.config or ProxyConfig()
        return base.model_copy(update={"mode": self.target})

    # -- objects --------------------------------------------------------------------------

    @cached_property
    def objects(self) -> list[dict[str, Any]] | None:
        if self.objects_override is not None:
            return self.objects_override
        if self.source is None:
            return None
        from kproxy.sources.files import load_path

        try:
            loaded, problems = load_path(self.source)
        except FileNotFoundError:
            self.notes.append(f"source {self.source} not found: object checks skipped")
            return None
        for p in problems:
            self.notes.append(f"source: {p}")
        return list(loaded.values())

    @property
    def has_objects(self) -> bool:
        return self.live is not None or self.objects is not None

    @cached_property
    def snapshot(self) -> Snapshot | None:
        if self.live is not None:
            return self.live.snapshot
        if self.objects is None:
            return None
        from kproxy.model.snapshot import snapshot_from_objects

        return snapshot_from_objects(self.objects, self.node_name)

    @cached_property
    def view(self) -> ObjectView | None:
        if self.live is not None:
            return self.live.view
        return object_view(self.objects) if self.objects is not None else None

    # -- the node -------------------------------------------------------------------------

    @cached_property
    def kernel_snapshot(self) -> Mapping[str, Any]:
        """The node's dataplane in ops.snapshot.take()'s shape, each section read once on
        first use (kernelstate.py), shared by the checks."""
        if self.snapshot_taker is not None:
            return self.snapshot_taker(self.access.netns)
        from kproxy.ops.preflight.kernelstate import KernelState

        return KernelState(self.access)

    @cached_property
    def node_dump(self) -> NodeDump:
        """The node's kernel read piece by piece, as a check asks (beside a running
        kproxy, which reads no kernel state section): one for all the checks."""
        from kproxy.ops.preflight.dataplane import NodeDump

        return NodeDump(self)

    @cached_property
    def programmed(self) -> Programmed:
        """Per dataplane, the service destinations the kernel state programs (read by the
        inspect readers, ops.inspect.destinations). Beside a running kproxy only its own
        dataplane is read, and only the entries that hold its destinations."""
        if self.live is not None:
            return self.live.programmed(self.access.netns)
        from kproxy.ops.snapshot import programmed_in

        return programmed_in(self.kernel_snapshot)

    @cached_property
    def addresses(self) -> list[tuple[str, str, str]]:
        """(interface, IPv4 address, scope) of the node's namespace."""
        from kproxy.dataplane.nodefacts import interface_addresses

        try:
            return interface_addresses(self.access.netns, runner=self.access.runner)
        except (RuntimeError, ValueError) as err:
            self.notes.append(f"could not read the node's addresses: {err}")
            return []

    @property
    def local_addresses(self) -> list[str]:
        return list(dict.fromkeys(a for _, a, _ in self.addresses))

    @cached_property
    def node_ips(self) -> list[str]:
        """The node IPs kproxy uses: its --node-ip (from the running one's command line),
        else what it detects, as dataplane.nodefacts does (the Node object's addresses are
        not used for this, there as here)."""
        if self.status and self.status.get("node_ips"):
            return list(self.status["node_ips"])
        from kproxy.dataplane.nodefacts import default_route_interfaces, pick_node_ips

        try:
            devs = default_route_interfaces(self.access.netns, runner=self.access.runner)
        except (RuntimeError, ValueError):
            devs = []
        return list(pick_node_ips(self.addresses, devs))

    @cached_property
    def cluster_cidrs(self) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
        out = []
        for text in self.target_config.cluster_cidrs:
            try:
                out.append(ipaddress.ip_network(text.strip(), strict=False))
            except ValueError:
                continue
        return out

    @cached_property
    def pod_cidrs(self) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
        snap = self.snapshot
        if snap is None:
            return []
        return [ipaddress.ip_network(c, strict=False) for c in snap.node.pod_cidrs]


def load_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
