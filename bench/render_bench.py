"""Parse + snapshot and render times, in-process, no kernel.

* parse + snapshot: snapshot_from_objects over the plain object dicts (what a source has
  delivered): every Service and EndpointSlice parsed, joined and categorised;
* render (cold): IptablesRenderer(...).plan(snapshot).text() from a fresh renderer, with
  the chain-name cache (names.port_proto_hash) cleared too, so nothing is reused;
* render (warm): the same renderer again on the same snapshot (every block cached), what a
  resync pays for its plan.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

from bench import workload
from bench.contention import Meter
from bench.stats import Stat
from kproxy.dataplane.facts import RuleOptions
from kproxy.dataplane.iptables import names
from kproxy.dataplane.iptables.render import IptablesRenderer
from kproxy.model.snapshot import snapshot_from_objects


@dataclass
class RenderFigures:
    size: int
    parse: Stat = field(default_factory=Stat)
    cold: Stat = field(default_factory=Stat)
    warm: Stat = field(default_factory=Stat)
    foreign: Stat = field(default_factory=Stat)  # other load during the cold renders
    lines: int = 0
    bytes: int = 0

    def to_json(self) -> dict[str, object]:
        return {
            "size": self.size,
            "parse": self.parse.to_json(),
            "cold": self.cold.to_json(),
            "warm": self.warm.to_json(),
            "foreign": self.foreign.to_json(),
            "lines": self.lines,
            "bytes": self.bytes,
        }


def measure(size: int, options: RuleOptions, repeats: int) -> RenderFigures:
    fig = RenderFigures(size)
    objs = list(workload.objects(size))
    facts = workload.facts()
    snapshot = None
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        snapshot = snapshot_from_objects(objs, workload.NODE_NAME)
        fig.parse.add(time.perf_counter() - t0)
    assert snapshot is not None
    if len(snapshot.services) != size:
        raise RuntimeError(f"snapshot has {len(snapshot.services)} service ports, not {size}")
    renderer = None
    text = ""
    for _ in range(repeats):
        names.port_proto_hash.cache_clear()
        gc.collect()
        with Meter() as meter:
            t0 = time.perf_counter()
            renderer = IptablesRenderer(facts, options)
            text = renderer.plan(snapshot).text()
            fig.cold.add(time.perf_counter() - t0)
        fig.foreign.add(meter.foreign_cores)
    assert renderer is not None
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        renderer.plan(snapshot).text()
        fig.warm.add(time.perf_counter() - t0)
    fig.lines, fig.bytes = text.count("\n"), len(text)
    return fig
