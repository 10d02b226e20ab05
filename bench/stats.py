"""Repeated measurements: median and best of N, with the 'slower than 60 s: once' rule."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

ONCE_ABOVE = 60.0  # seconds: a run this slow is not repeated (marked "1 run")


@dataclass
class Stat:
    values: list[float] = field(default_factory=list)
    note: str = ""  # e.g. "extrapolated", "not run"

    def add(self, value: float) -> None:
        self.values.append(value)

    @property
    def median(self) -> float | None:
        return statistics.median(self.values) if self.values else None

    @property
    def best(self) -> float | None:
        return min(self.values) if self.values else None

    @property
    def once(self) -> bool:
        return len(self.values) == 1

    def to_json(self) -> dict[str, object]:
        return {"values": self.values, "median": self.median, "best": self.best, "note": self.note}


def repeat(fn: Callable[[], float], repeats: int, *, once_above: float = ONCE_ABOVE) -> Stat:
    """Call fn (which returns seconds) up to `repeats` times; stop after a slow one."""
    st = Stat()
    for _ in range(repeats):
        st.add(fn())
        if st.values[-1] > once_above:
            break
    return st


def fmt_s(value: float | None) -> str:
    """Seconds for a table: ms below 1 s."""
    if value is None:
        return "-"
    if value < 1.0:
        return f"{value * 1000:.1f} ms" if value < 0.1 else f"{value * 1000:.0f} ms"
    return f"{value:.2f} s" if value < 100 else f"{value:.0f} s"


def fmt_stat(st: Stat | None) -> str:
    if st is None or st.median is None:
        return st.note if st is not None and st.note else "-"
    text = fmt_s(st.median)
    if st.once:
        text += " (1 run)"
    if st.note:
        text += f" ({st.note})"
    return text
