"""Where the readers get the kernel's state: live (read-only commands in a netns) or recorded.

Everything here only reads: `iptables-<flavour>-save -c` (a full save; `-t nat` only for
nft, since for legacy it would create the table), `nft -j list table ip kube-proxy` (or one
of its maps), `ip -j addr`, `ipset save`, `ipvsadm -S -n`, `conntrack -L -o extended`,
/proc/net/xt_recent/<list> and /proc/timer_list. Results are cached per source under one
key per dump; refresh() forgets them (for the second read of `--rate`).

RecordedSource holds the same dumps as text under the same keys, so unit tests, offline
analysis of dumps collected from a node and `kproxy snapshot` documents
(ops.snapshot.recorded_source) run the very code a live `kproxy list` runs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any, Final

from kproxy.conntrack import Conntrack, ConntrackEntry, ConntrackError, parse_entries
from kproxy.host.commands import Runner, in_netns, run_command

_RECENT_NAME: Final = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
_RECENT_LINE: Final = re.compile(r"src=(\S+).*?last_seen: (\d+)")
# 64-bit kernels start jiffies at 2^32 - 300 s worth of ticks (INITIAL_JIFFIES).
_JIFFIES_BASE: Final = 1 << 32
_KNOWN_HZ: Final = (100, 250, 300, 1000)


class KernelSource:
    """Read-only access to one network namespace's dataplane (None: our own namespace)."""

    def __init__(self, netns: str | None = None, *, runner: Runner | None = None) -> None:
        self.netns = netns
        self._runner: Runner = runner or run_command
        self._cache: dict[str, Any] = {}
        self.errors: dict[str, str] = {}

    def __repr__(self) -> str:
        return f"KernelSource(netns={self.netns!r})"

    @property
    def recorded(self) -> bool:
        return False

    def refresh(self) -> None:
        self._cache.clear()
        self.errors.clear()

    def _cached(self, key: str, argv: list[str]) -> str | None:
        if key not in self._cache:
            proc = self._runner(in_netns(argv, self.netns), None)
            if proc.returncode == 0:
                self._cache[key] = proc.stdout
            else:
                self._cache[key] = None
                self.errors[key] = (proc.stderr or "").strip() or f"exit code {proc.returncode}"
        value = self._cache[key]
        return value if isinstance(value, str) else None

    def command(self, what: str) -> str:
        """The command a dump comes from (for "read from …" lines)."""
        return {
            "iptables-nft": "iptables-nft-save -c",
            "iptables-legacy": "iptables-legacy-save -c",
            "nftables": "nft -j list table ip kube-proxy",
            "nftables-compact": "nft -j list table ip kproxy-compact",
            "userspace-nft": "iptables-nft-save -c and the userspace workers",
            "userspace-legacy": "iptables-legacy-save -c and the userspace workers",
            "conntrack": "conntrack -L -o extended",
        }.get(what, what)

    # -- dumps -------------------------------------------------------------------------------

    def iptables_save(self, flavour: str) -> str | None:
        """Full `iptables-<flavour>-save -c` (None: the tool is missing or failed)."""
        return self._cached(f"iptables-{flavour}", [f"iptables-{flavour}-save", "-c"])

    def iptables_nat(self, flavour: str) -> str | None:
        """A save holding at least the nat table: `-t nat` alone for nft (a fraction of a
        10,000-service save), the full save for legacy (whose `-t` would create the table)."""
        if flavour == "legacy" or f"iptables-{flavour}" in self._cache:
            return self.iptables_save(flavour)
        return self._cached(f"iptables-{flavour}-nat", [f"iptables-{flavour}-save", "-t", "nat"])

    def nft_table(self, dataplane: str = "nftables") -> str | None:
        """`nft -j list table ip kube-proxy` (None: no such table, or no nft); another
        layout's table by its dataplane name ("nftables-compact": ip kproxy-compact), cached
        under that name."""
        return self._cached(dataplane, ["nft", "-j", "list", "table", *_nft_table(dataplane)])

    def nft_map(self, name: str, dataplane: str = "nftables") -> str | None:
        """A document holding one map (or set) of table ip kube-proxy (or another layout's):
        `nft -j list map` (the whole table's document is ~100 MB at 10,000 services), or the
        table when read."""
        if dataplane in self._cache:
            return self.nft_table(dataplane)
        key = f"nft-map:{name}" if dataplane == "nftables" else f"nft-map:{dataplane}:{name}"
        return self._cached(key, ["nft", "-j", "list", "map", *_nft_table(dataplane), name])

    def ip_addr(self) -> str | None:
        return self._cached("ip-addr", ["ip", "-j", "addr", "show"])

    def device_addr(self, device: str) -> str | None:
        """`ip -j addr show dev DEVICE` (None: no such device)."""
        return self._cached(device, ["ip", "-j", "addr", "show", "dev", device])

    def ipset_save(self) -> str | None:
        return self._cached("ipset", ["ipset", "save"])

    def ipvsadm_save(self) -> str | None:
        """`ipvsadm -S -n`: the virtual servers as text (a live ipvs read goes over netlink
        for its counters, ops.inspect.ipvs.read_ipvs; recorded sources have this)."""
        return self._cached("ipvs", ["ipvsadm", "-S", "-n"])

    def conntrack_entries(self) -> list[ConntrackEntry] | None:
        if "conntrack" not in self._cache:
            try:
                self._cache["conntrack"] = Conntrack(self.netns, runner=self._runner).list_entries(
                    None
                )
            except ConntrackError as err:
                self._cache["conntrack"] = None
                self.errors["conntrack"] = str(err)
        value = self._cache["conntrack"]
        return value if isinstance(value, list) else None

    def xt_recent(self, name: str) -> str | None:
        """/proc/net/xt_recent/NAME: the addresses an `-m recent` list remembers."""
        if not _RECENT_NAME.match(name):
            return None
        return self._cached(f"recent:{name}", ["cat", f"/proc/net/xt_recent/{name}"])

    def timer_list(self) -> str | None:
        return self._cached("timer_list", ["cat", "/proc/timer_list"])

    # -- derived -----------------------------------------------------------------------------

    def local_addresses(self) -> list[str] | None:
        """Every address on the node's interfaces (None: unreadable)."""
        text = self.ip_addr()
        if text is None:
            return None
        return parse_ip_addr(text)

    def jiffies(self) -> tuple[int, int] | None:
        """(jiffies now, HZ) for ageing xt_recent entries; None when not derivable."""
        text = self.timer_list()
        return parse_timer_list(text) if text is not None else None


class RecordedSource(KernelSource):
    """Dumps given as text (recorded from a node, or built by a test), under the keys a
    live source caches them by ("iptables-nft", "nftables", "ipset", "ipvs", "kube-ipvs0",
    …). Nothing is ever run: a dump not given is unreadable (None)."""

    def __init__(
        self,
        *,
        iptables: Mapping[str, str] | None = None,
        nft: str | None = None,
        ip_addr: str | None = None,
        local_addresses: Iterable[str] | None = None,
        conntrack: str | None = None,
        recent: Mapping[str, str] | None = None,
        timer_list: str | None = None,
        dumps: Mapping[str, str | None] | None = None,
    ) -> None:
        super().__init__(None)
        given: dict[str, str | None] = {f"iptables-{f}": t for f, t in (iptables or {}).items()}
        given.update(nftables=nft, **{"ip-addr": ip_addr, "timer_list": timer_list})
        self._given = {k: v for k, v in given.items() if v is not None}
        # Read key by key, when a reader asks (a snapshot's sections, say).
        self._dumps: Mapping[str, str | None] = dumps or {}
        self._local = list(local_addresses) if local_addresses is not None else None
        self._conntrack = conntrack
        self._recent = dict(recent) if recent is not None else None

    def __repr__(self) -> str:
        return "RecordedSource()"

    @property
    def recorded(self) -> bool:
        return True

    def command(self, what: str) -> str:
        return f"a recorded {super().command(what)}"

    def _cached(self, key: str, argv: list[str]) -> str | None:
        if key in self._given:
            return self._given[key]
        return self._dumps.get(key)

    def iptables_nat(self, flavour: str) -> str | None:
        return self.iptables_save(flavour)

    def nft_map(self, name: str, dataplane: str = "nftables") -> str | None:
        return self.nft_table(dataplane)

    def local_addresses(self) -> list[str] | None:
        if self._local is not None:
            return list(self._local)
        return super().local_addresses()

    def conntrack_entries(self) -> list[ConntrackEntry] | None:
        return parse_entries(self._conntrack) if self._conntrack is not None else None

    def xt_recent(self, name: str) -> str | None:
        if self._recent is None:
            return None
        return self._recent.get(name, "")


def _nft_table(dataplane: str) -> tuple[str, str]:
    """(family, name) of nftables mode's table in the layout a dataplane name says."""
    from kproxy.dataplane.nftables.layouts import DATAPLANES, TABLES

    return "ip", TABLES[DATAPLANES[dataplane]]


# --- pure parsers ----------------------------------------------------------------------------


def parse_ip_addr(text: str) -> list[str]:
    """The addresses of `ip -j addr` (both families, interface order, de-duplicated)."""
    try:
        links = json.loads(text or "[]")
    except ValueError:
        return []
    out: list[str] = []
    for link in links if isinstance(links, list) else []:
        for info in link.get("addr_info", []) if isinstance(link, dict) else []:
            local = info.get("local")
            if isinstance(local, str) and local not in out:
                out.append(local)
    return out


def parse_recent(text: str) -> dict[str, int]:
    """xt_recent list -> {source address: last_seen in jiffies}."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        m = _RECENT_LINE.search(line)
        if m:
            out[m.group(1)] = int(m.group(2))
    return out


def parse_timer_list(text: str) -> tuple[int, int] | None:
    """(jiffies, HZ) from /proc/timer_list.

    HZ is derived from one read: on 64-bit kernels jiffies started at 2^32 - 300·HZ, so
    HZ = (jiffies - 2^32) / (uptime - 300 s), with uptime from "now at … nsecs" (rounded to
    the nearest common HZ). None when the numbers do not fit (32-bit, very young node).
    """
    jm = re.search(r"^jiffies: (\d+)", text, re.MULTILINE)
    nm = re.search(r"^now at (\d+) nsecs", text, re.MULTILINE)
    if jm is None or nm is None:
        return None
    jiffies = int(jm.group(1))
    uptime = int(nm.group(1)) / 1e9
    if uptime <= 330 or jiffies <= _JIFFIES_BASE:
        return None
    estimate = (jiffies - _JIFFIES_BASE) / (uptime - 300)
    hz = min(_KNOWN_HZ, key=lambda h: abs(h - estimate))
    if abs(hz - estimate) > hz * 0.05:
        return None
    return jiffies, hz
