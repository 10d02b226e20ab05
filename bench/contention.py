"""How busy the rest of the machine was during a measurement (it is shared, 2 cores).

foreign CPU = CPU time the whole machine used (from /proc/stat) minus the CPU of this
process and of the children it waited for (getrusage), over the wall time: 0.0 means
nothing else ran, 1.0 means another core's worth of work competed with the measurement.
Kernel workers count as foreign, including the ones freeing namespaces we deleted.
"""

from __future__ import annotations

import os
import resource
import time
from types import TracebackType

_HZ = os.sysconf("SC_CLK_TCK")


def _machine_busy_s() -> float:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / _HZ


def _own_s() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class Meter:
    """with Meter() as m: ...; then m.foreign_cores."""

    def __init__(self) -> None:
        self.foreign_cores = 0.0
        self.wall = 0.0

    def __enter__(self) -> Meter:
        self._t = time.monotonic()
        self._busy = _machine_busy_s()
        self._own = _own_s()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.wall = time.monotonic() - self._t
        foreign = (_machine_busy_s() - self._busy) - (_own_s() - self._own)
        self.foreign_cores = max(0.0, foreign) / self.wall if self.wall > 0 else 0.0
