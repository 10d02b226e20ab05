"""Preflight beside (inside) a running kproxy: its own objects and mode, read no second time.

The running proxy already holds the parsed Services and EndpointSlices (its ChangeTracker)
and the snapshot it programmed, and knows which mode and iptables backend serve. A
preflight it runs itself (the admin op `preflight`, a rollout's duty) uses those; what it
still reads of the kernel is only the entries that hold the serving mode's destinations
(the readers' per-plane read: the nft service map, the iptables nat table), never a whole
table's JSON dump, and not even those while the dataplane proves that the kernel holds
what it last wrote (Dataplane.proven_dumps: the readers read its dumps instead). The
backup of a switch's preflight is the switch's own "before" record, taken by the proxy
when the switch starts (switch.py), so it is not read here twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kproxy.model.objects import Snapshot
from kproxy.model.parse import ParsedService, ParsedSlice
from kproxy.ops.preflight.context import ObjectView

if TYPE_CHECKING:
    from kproxy.ops.inspect.destinations import Programmed
    from kproxy.ops.inspect.model import Destination

# What a result says about where its facts came from (PreflightResult.path).
PATH_LIVE = "running-kproxy"
PATH_READ = "read"


def tracker_view(
    services: dict[str, ParsedService],
    slices: list[ParsedSlice],
    ignored: dict[str, tuple[str, str]],
    known: set[str],
) -> ObjectView:
    """The ObjectView of a ChangeTracker's parsed objects (model.snapshot.parsed_objects)."""
    return ObjectView(
        services=services,
        slices=slices,
        ignored={key: why for key, (why, _) in ignored.items()},
        known=known,
        external_names={key: name for key, (_, name) in ignored.items() if name},
    )


@dataclass
class LiveState:
    """What the running proxy knows, handed to run_preflight(live=...)."""

    mode: str
    flavour: str | None
    snapshot: Snapshot
    view: ObjectView
    # dataplane name -> its service destinations in the kernel now (netns given)
    plane_reader: Callable[[str, str | None], dict[Destination, str]] | None = None
    layout: str | None = None  # nftables mode's (None in other modes)
    # The serving dataplane's proof of what the kernel holds (Dataplane.proven_dumps):
    # when given, its planes are read from these dumps instead of the kernel.
    proven: dict[str, str] = field(default_factory=dict)

    @property
    def planes(self) -> list[str]:
        from kproxy.ops.preflight.backup import planes_of

        return planes_of(self.mode, self.flavour, {}, layout=self.layout)

    def programmed(self, netns: str | None) -> Programmed:
        """The serving mode's destinations alone, read by its reader (no other plane),
        from the dataplane's proof when it gave one."""
        read: Callable[[str, str | None], dict[Destination, str]]
        if self.proven:
            from kproxy.ops.inspect.destinations import programmed
            from kproxy.ops.inspect.kernel import RecordedSource

            source = RecordedSource(dumps=self.proven)

            def read(plane: str, _netns: str | None) -> dict[Destination, str]:
                return programmed(source, [plane]).get(plane, {})

        elif self.plane_reader is None:
            from kproxy.ops.inspect.destinations import plane_destinations

            read = plane_destinations
        else:
            read = self.plane_reader
        out: Programmed = {}
        for plane in self.planes:
            found = read(plane, netns)
            if found:
                out[plane] = found
        return out
