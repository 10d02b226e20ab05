"""The names of kproxy's proxy modes: the one list, importable from the lowest layer (the
config) without importing any dataplane. Each has a spec in dataplane/registry.py."""

from __future__ import annotations

from typing import Final

MODES: Final = ("iptables", "nftables", "ipvs", "userspace")
