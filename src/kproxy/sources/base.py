"""The one small interface every object source implements.

A source turns its world (files, an API server) into ObjectEvents: "this object now looks
like this" or "this object is gone". It never parses objects into the model; the change
tracker does that, so every source gets the same validation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

# Kinds a source forwards; everything else it reads is ignored.
SERVICE = "Service"
ENDPOINT_SLICE = "EndpointSlice"
NODE = "Node"
KINDS = (SERVICE, ENDPOINT_SLICE, NODE)


@dataclass(frozen=True, slots=True)
class ObjectKey:
    kind: str
    namespace: str
    name: str

    def __str__(self) -> str:
        return (
            f"{self.kind} {self.namespace}/{self.name}"
            if self.namespace
            else f"{self.kind} {self.name}"
        )


@dataclass(frozen=True, slots=True)
class ObjectEvent:
    """obj is the full object (a plain dict) after the change, or None when it was deleted."""

    key: ObjectKey
    obj: dict[str, Any] | None


EventSink = Callable[[Sequence[ObjectEvent]], None]


class Source(Protocol):
    def start(self, sink: EventSink) -> None:
        """Deliver the initial objects (one batch, or several for a large source, all before
        returning), then keep delivering changes until stop()."""

    def stop(self) -> None: ...

    @property
    def synced(self) -> bool:
        """True once the initial batch has been delivered."""
