"""Go durations (time.ParseDuration, time.Duration.String) on integer nanoseconds.

The configuration file and the flags spell durations the Go way ("1m30s", "1.5s", "0");
kproxy keeps them as float seconds and writes them back exactly as Go prints them.
"""

from __future__ import annotations

import math
import re

_UNIT_NS = {
    "ns": 1,
    "us": 1_000,
    "\u00b5s": 1_000,  # micro sign, what Go prints
    "\u03bcs": 1_000,  # Greek mu, also accepted by Go
    "ms": 1_000_000,
    "s": 1_000_000_000,
    "m": 60_000_000_000,
    "h": 3_600_000_000_000,
}
_DIGITS = re.compile(r"[0-9]*")
_UNIT = re.compile(r"[^0-9.]*")
_NS_PER_S = 1_000_000_000


def parse_duration_ns(text: str) -> int:
    """Parse a Go duration ("1h30m", "1.5s", "-300ms", "0") into integer nanoseconds."""
    s = text
    negative = False
    if s[:1] in ("+", "-"):
        negative = s[0] == "-"
        s = s[1:]
    if s == "0":
        return 0
    if not s:
        raise ValueError(f"invalid duration {text!r}")
    total = 0
    pos = 0
    while pos < len(s):
        whole = _DIGITS.match(s, pos)
        assert whole is not None  # [0-9]* always matches
        int_part = whole.group()
        pos = whole.end()
        frac_part = ""
        if s.startswith(".", pos):
            frac = _DIGITS.match(s, pos + 1)
            assert frac is not None
            frac_part = frac.group()
            pos = frac.end()
        if not int_part and not frac_part:
            raise ValueError(f"invalid duration {text!r}")
        unit_match = _UNIT.match(s, pos)
        assert unit_match is not None
        unit = unit_match.group()
        pos = unit_match.end()
        if not unit:
            raise ValueError(f"missing unit in duration {text!r} (use ns, us, ms, s, m or h)")
        if unit not in _UNIT_NS:
            raise ValueError(f"unknown unit {unit!r} in duration {text!r}")
        scale = _UNIT_NS[unit]
        total += int(int_part or "0") * scale
        if frac_part:
            total += int(frac_part) * scale // 10 ** len(frac_part)
        if total > 2**63 - (0 if negative else 1):
            raise ValueError(f"invalid duration {text!r}: out of range")
    return -total if negative else total


def parse_duration(text: str) -> float:
    """Parse a Go duration string into float seconds."""
    return parse_duration_ns(text) / _NS_PER_S


def _decimal(value: int, unit: int) -> str:
    whole, frac = divmod(value, unit)
    if not frac:
        return str(whole)
    width = len(str(unit)) - 1
    return f"{whole}.{str(frac).rjust(width, '0').rstrip('0')}"


def format_duration_ns(ns: int) -> str:
    """Format nanoseconds exactly like Go's time.Duration.String ("1m0s", "24h0m0s", "1.5ms")."""
    if ns == 0:
        return "0s"
    sign = "-" if ns < 0 else ""
    u = abs(ns)
    if u < 1_000:
        return f"{sign}{u}ns"
    if u < 1_000_000:
        return f"{sign}{_decimal(u, 1_000)}\u00b5s"
    if u < _NS_PER_S:
        return f"{sign}{_decimal(u, 1_000_000)}ms"
    hours, rest = divmod(u, _UNIT_NS["h"])
    minutes, rest = divmod(rest, _UNIT_NS["m"])
    text = f"{_decimal(rest, _NS_PER_S)}s"
    if hours:
        text = f"{hours}h{minutes}m{text}"
    elif minutes:
        text = f"{minutes}m{text}"
    return sign + text


def format_duration(seconds: float) -> str:
    """Format float seconds as a Go duration string."""
    return format_duration_ns(round(seconds * _NS_PER_S))


def parse_positive_duration(text: str) -> float:
    """A Go duration that must be more than zero, in float seconds."""
    seconds = parse_duration(text)
    if seconds <= 0:
        raise ValueError(f"{text!r} must be more than 0")
    return seconds


def check_seconds(value: float, *, zero: bool = False) -> float:
    """A number of seconds given as a number: finite and more than 0 (or at least 0 with
    zero=True); ValueError otherwise (NaN too)."""
    if not (value >= 0 if zero else value > 0) or math.isinf(value):
        bound = "at least 0" if zero else "more than 0"
        raise ValueError(f"{value} is not a number of seconds ({bound}, finite)")
    return value
