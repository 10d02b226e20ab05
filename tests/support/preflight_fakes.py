"""A fake node for preflight and doctor: a file tree for /proc, /sys, /lib/modules and /etc,
canned command output, and recorded kernel snapshots."""

from __future__ import annotations

import gzip
import json
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kproxy.ops.preflight import NodeAccess

RELEASE = "6.1.0-test"


class FakeNode:
    """A node as files under `root` plus canned answers for the commands a check runs."""

    def __init__(self, root: Path, *, release: str = RELEASE) -> None:
        self.root = root
        self.release = release
        self.commands: dict[tuple[str, ...], tuple[int, str, str]] = {
            ("nft", "--version"): (0, "nftables v1.0.6 (Lester Gooch #5)\n", ""),
            ("iptables", "--version"): (0, "iptables v1.8.9 (nf_tables)\n", ""),
            ("ipset", "version"): (0, "ipset v7.17, protocol version: 7\n", ""),
            ("ip", "-j", "-4", "addr", "show"): (0, json.dumps(ADDRS), ""),
            ("ip", "-j", "-4", "route", "show", "default"): (0, '[{"dev": "eth0"}]', ""),
        }
        self.ran: list[list[str]] = []
        self.sysctls(
            {
                "net/ipv4/ip_forward": 1,
                "net/ipv4/conf/all/route_localnet": 0,
                "net/netfilter/nf_conntrack_count": 10,
                "net/netfilter/nf_conntrack_max": 262144,
                "net/netfilter/nf_conntrack_tcp_timeout_established": 86400,
                "kernel/osrelease": release,
            }
        )

    def file(self, path: str, text: str) -> FakeNode:
        p = self.root / path.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        if path.endswith(".gz"):
            p.write_bytes(gzip.compress(text.encode()))
        else:
            p.write_text(text)
        return self

    def sysctls(self, values: dict[str, object]) -> FakeNode:
        for name, value in values.items():
            self.file(f"/proc/sys/{name}", f"{value}\n")
        return self

    def modules(
        self,
        *,
        loaded: Sequence[str] | None = (),
        builtin: Sequence[str] = (),
        available: Sequence[str] = (),
        modules_dir: bool = True,
    ) -> FakeNode:
        if loaded is not None:
            self.file("/proc/modules", "".join(f"{m} 16384 0 - Live 0x0\n" for m in loaded))
        if modules_dir:
            d = f"/lib/modules/{self.release}"
            self.file(f"{d}/modules.builtin", "".join(f"kernel/x/{m}.ko\n" for m in builtin))
            self.file(f"{d}/modules.dep", "".join(f"kernel/x/{m}.ko.xz:\n" for m in available))
        return self

    def command(self, argv: Sequence[str], rc: int = 0, out: str = "", err: str = "") -> FakeNode:
        self.commands[tuple(argv)] = (rc, out, err)
        return self

    def runner(self, argv: Sequence[str], _input: str | None) -> subprocess.CompletedProcess[str]:
        self.ran.append(list(argv))
        rc, out, err = self.commands.get(tuple(argv), (0, "", ""))
        return subprocess.CompletedProcess(list(argv), rc, out, err)

    def access(self, cpus: int = 2) -> NodeAccess:
        return NodeAccess(root=self.root, runner=self.runner, cpus=cpus)


ADDRS = [
    {"ifname": "lo", "addr_info": [{"family": "inet", "local": "127.0.0.1", "scope": "host"}]},
    {"ifname": "eth0", "addr_info": [{"family": "inet", "local": "10.100.0.1", "scope": "global"}]},
]


def recorded(
    nft: str = "", legacy: str = "", nftables: str = "", ipvs: str = "", compact: str = ""
) -> Callable[[str | None], dict[str, Any]]:
    """A snapshot's sections (ops.snapshot.take()); nftables, compact: the `nft -j` output
    of nftables mode's upstream and compact layouts' sections."""

    def section(text: str, ok: bool = True) -> dict[str, Any]:
        return {"command": "x", "ok": ok, "output": text, "error": ""}

    snap = {
        "format": "kproxy-snapshot/v1",
        "iptables-nft": section(nft),
        "iptables-legacy": section(legacy),
        "nftables": section(nftables or '{"nftables": []}'),
        "nftables-compact": section(compact or '{"nftables": []}'),
        "ipset": section(""),
        "ipvs": section(ipvs),
        "kube-ipvs0": section("", ok=False),
        "conntrack": {"count": 1, "max": 262144},
    }
    return lambda _netns: json.loads(json.dumps(snap))


def live_state(
    objects: Sequence[dict[str, Any]],
    mode: str,
    flavour: str | None = None,
    programmed: dict[str, dict[Any, str]] | None = None,
    layout: str | None = None,
) -> Any:
    """What a running kproxy holds for these objects (its tracker's parsed objects and
    snapshot), its plane read from `programmed` (dataplane -> destinations) by name;
    layout: nftables mode's."""
    from kproxy.model.snapshot import tracker_of
    from kproxy.ops.preflight.live import LiveState, tracker_view

    tracker = tracker_of(objects, "node1")
    planes = programmed or {}
    return LiveState(
        mode=mode,
        flavour=flavour,
        snapshot=tracker.snapshot(),
        view=tracker_view(*tracker.parsed_objects()),
        plane_reader=lambda plane, _netns: dict(planes.get(plane, {})),
        layout=layout,
    )
