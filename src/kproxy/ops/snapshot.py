"""Record a node's whole dataplane as one JSON document, and compare two of them.

A snapshot holds what the kernel has, whatever wrote it: iptables-save of both backends,
kube-proxy's nftables tables, IPVS virtual servers, ipsets, kube-ipvs0's addresses and conntrack
usage. `services()` reads the service ports each dataplane actually programs, so `diff`
can say "present in A's iptables rules, missing from B's nftables maps" across a switch.
"""

from __future__ import annotations

import json
import platform
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kproxy.host.commands import in_netns

FORMAT = "kproxy-snapshot/v1"
# Service rules in KUBE-SERVICES, in either our restore order or iptables-save's order.
_IPT_COMMENT = re.compile(
    r'--comment "?(?P<name>[^" ]+) (?:cluster IP|external IP|loadbalancer IP)"?'
)
_IPT_PROTO = re.compile(r"-p (tcp|udp|sctp)\b")
_IPT_DEST = re.compile(r"-d ([0-9.]+)(?:/32)?\b")
_IPT_DPORT = re.compile(r"--dport (\d+)")


def _iptables_service(line: str) -> tuple[str, ServiceKey, str] | None:
    """(mode, destination, service) of a service rule: iptables mode's KUBE-SERVICES or
    userspace mode's KUBE-PORTALS-CONTAINER (both modes may share one backend mid-switch)."""
    if line.startswith("-A KUBE-SERVICES "):
        mode = "iptables"
    elif line.startswith("-A KUBE-PORTALS-CONTAINER "):
        mode = "userspace"
    else:
        return None
    c, p, d, n = (r.search(line) for r in (_IPT_COMMENT, _IPT_PROTO, _IPT_DEST, _IPT_DPORT))
    if not (c and p and d and n):
        return None
    return mode, ServiceKey(d[1], p[1], int(n[1])), c["name"]


def _run(
    argv: Sequence[str], netns: str | None, input_data: str | None = None
) -> tuple[int, str, str]:
    if shutil.which(argv[0]) is None:
        return 127, "", f"{argv[0]} is not installed"
    proc = subprocess.run(
        in_netns(argv, netns),
        input=input_data,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    return proc.returncode, proc.stdout, proc.stderr


def _section(argv: Sequence[str], netns: str | None) -> dict[str, Any]:
    code, out, err = _run(argv, netns)
    return {"command": " ".join(argv), "ok": code == 0, "output": out, "error": err.strip()}


# The nftables tables a snapshot records: kube-proxy's own. The whole ruleset would also
# hold every iptables-nft rule (already in the iptables-nft section): at 10,000 services
# `nft -j list ruleset` takes 54 s there, one table 0.4 s.
NFT_TABLES = (("ip", "kube-proxy"), ("ip6", "kube-proxy"))

# argv -> (exit code, stdout, stderr), in whatever namespace the caller reads
Reader = Callable[[list[str]], tuple[int, str, str]]


def join_nft_documents(outputs: list[str]) -> str:
    """`nft -j` documents ({"nftables": [...]}) as one, by text: at 10,000 services the
    table's document is ~100 MB, and parsing it into objects to merge them took the
    daemon's after-switch record to ~1 GB resident."""
    if len(outputs) == 1:
        return outputs[0]
    parts = []
    for out in outputs:
        start, end = out.find("["), out.rfind("]")
        inner = out[start + 1 : end].strip() if 0 <= start < end else ""
        if inner:
            parts.append(inner)
    return '{"nftables": [' + ", ".join(parts) + "]}"


NFT_COMMAND = "; ".join(f"nft -j list table {f} {n}" for f, n in NFT_TABLES)

# The sections of a snapshot, in order, and the command each records (None: the nftables
# tables, nftables_section).
SECTIONS: tuple[tuple[str, tuple[str, ...] | None], ...] = (
    ("iptables-nft", ("iptables-nft-save",)),
    ("iptables-legacy", ("iptables-legacy-save",)),
    ("nftables", None),
    ("ipset", ("ipset", "save")),
    ("ipvs", ("ipvsadm", "-S", "-n")),
    ("kube-ipvs0", ("ip", "-j", "addr", "show", "dev", "kube-ipvs0")),
)


def nftables_section(run: Reader) -> dict[str, Any]:
    """kube-proxy's nftables tables as one `nft -j` document (absent tables are no error)."""
    outputs: list[str] = []
    errors = []
    for family, name in NFT_TABLES:
        code, out, err = run(["nft", "-j", "list", "table", family, name])
        if code == 0:
            if out.lstrip().startswith("{"):
                outputs.append(out.strip())
            else:
                errors.append(f"{family} {name}: not a JSON document: {out[:80]!r}")
        elif "No such file or directory" not in err and code != 127:
            errors.append(f"{family} {name}: {err.strip()}")
    return {
        "command": NFT_COMMAND,
        "ok": not errors,
        "output": join_nft_documents(outputs) if outputs else '{"nftables": []}',
        "error": "; ".join(errors),
    }


def header(netns: str | None) -> dict[str, Any]:
    """What a snapshot says of itself, before its sections."""
    return {
        "format": FORMAT,
        "taken_at": time.time(),
        "host": platform.node(),
        "kernel": platform.release(),
        "netns": netns,
    }


def conntrack_usage(netns: str | None) -> dict[str, int | None]:
    code, out, _ = _run(["conntrack", "-C"], netns)
    _, max_out, _ = _run(["cat", "/proc/sys/net/netfilter/nf_conntrack_max"], netns)
    return {
        "count": int(out.strip()) if code == 0 and out.strip().isdigit() else None,
        "max": int(max_out.strip()) if max_out.strip().isdigit() else None,
    }


def take(netns: str | None = None) -> dict[str, Any]:
    """The node's dataplane now (read only; nothing is changed). ops.snapshot_file writes
    the same document straight to a file."""
    snap = header(netns)
    for key, argv in SECTIONS:
        if argv is None:
            snap[key] = nftables_section(lambda cmd: _run(cmd, netns))
        else:
            snap[key] = _section(argv, netns)
    snap["conntrack"] = conntrack_usage(netns)
    return snap


@dataclass(frozen=True, order=True)
class ServiceKey:
    ip: str
    proto: str
    port: int

    def __str__(self) -> str:
        return f"{self.proto} {self.ip}:{self.port}"


def services(snap: dict[str, Any]) -> dict[str, dict[ServiceKey, str]]:
    """Per dataplane, the programmed service destinations -> the service they belong to."""
    out: dict[str, dict[ServiceKey, str]] = {}
    for backend in ("iptables-nft", "iptables-legacy"):
        text = snap.get(backend, {}).get("output", "")
        flavour = backend.split("-", 1)[1]
        for line in text.splitlines():
            hit = _iptables_service(line)
            if hit:
                mode, key, name = hit
                out.setdefault(f"{mode}-{flavour}", {})[key] = name
    nft = _nft_services(snap.get("nftables", {}).get("output", ""))
    if nft:
        out["nftables"] = nft
    ipvs = _ipvs_services(snap.get("ipvs", {}).get("output", ""))
    if ipvs:
        out["ipvs"] = ipvs
    return out


# The one read that shows a plane's service destinations, for a switch's verification: a
# whole-node snapshot would also dump the other planes (seconds at 10,000 services).
_PLANE_READS: dict[str, tuple[str, tuple[str, ...]]] = {
    "iptables-nft": ("iptables-nft", ("iptables-nft-save", "-t", "nat")),
    # legacy: never -t (it would create the table in the kernel, G7); a save is one read anyway
    "iptables-legacy": ("iptables-legacy", ("iptables-legacy-save",)),
    "nftables": ("nftables", ("nft", "-j", "list", "map", "ip", "kube-proxy", "service-ips")),
    "ipvs": ("ipvs", ("ipvsadm", "-S", "-n")),
}


def plane_services(plane: str, netns: str | None = None) -> dict[ServiceKey, str]:
    """The service destinations one plane (a key of services()) has in the kernel now."""
    backend = plane.split("-", 1)[1] if plane.startswith("userspace-") else None
    section, argv = _PLANE_READS[f"iptables-{backend}" if backend else plane]
    return services({section: _section(argv, netns)}).get(plane, {})


def _nft_services(text: str) -> dict[ServiceKey, str]:
    # The ruleset also holds iptables-nft's tables (megabytes of JSON at 1,000 services):
    # without kube-proxy's service map there is nothing to decode.
    if '"service-ips"' not in text:
        return {}
    try:
        items = json.loads(text).get("nftables", [])
    except ValueError:
        return {}
    found: dict[ServiceKey, str] = {}
    for item in items:
        m = item.get("map")
        if not m or m.get("table") != "kube-proxy" or m.get("name") != "service-ips":
            continue
        for elem in m.get("elem", []):
            key, verdict = elem[0], elem[1]
            parts = key.get("concat", []) if isinstance(key, dict) else []
            if len(parts) != 3:
                continue
            target = ""
            for v in verdict.values() if isinstance(verdict, dict) else ():
                if isinstance(v, dict):
                    target = v.get("target", "")
            # Chain names carry ns/svc/proto/port after an 8-character hash prefix.
            parts_of_name = target.split("-", 2)[-1].split("/") if target else []
            name = ""
            if len(parts_of_name) == 4:
                ns, svc, _, port_name = parts_of_name
                name = f"{ns}/{svc}" + (f":{port_name}" if port_name else "")
            found[ServiceKey(str(parts[0]), str(parts[1]), int(parts[2]))] = name
    return found


def _ipvs_services(text: str) -> dict[ServiceKey, str]:
    found: dict[ServiceKey, str] = {}
    for line in text.splitlines():
        # `-A -t 10.96.0.10:80 -s rr`
        m = re.match(r"^-A -(?P<p>[tuq]) (?P<ip>[0-9.]+):(?P<port>\d+)", line)
        if m:
            proto = {"t": "tcp", "u": "udp", "q": "sctp"}[m["p"]]
            found[ServiceKey(m["ip"], proto, int(m["port"]))] = ""
    return found


def diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Human findings: which service destinations one snapshot programs and the other lacks."""
    sa, sb = services(a), services(b)
    union_a = {k: v for d in sa.values() for k, v in d.items()}
    union_b = {k: v for d in sb.values() for k, v in d.items()}
    where_a = ", ".join(sorted(sa)) or "no dataplane"
    where_b = ", ".join(sorted(sb)) or "no dataplane"
    out = [
        f"A programs {len(union_a)} service destinations ({where_a}); "
        f"B programs {len(union_b)} ({where_b})"
    ]
    for key in sorted(set(union_a) - set(union_b)):
        out.append(
            f"missing in B: {key} ({union_a[key] or 'unnamed'}), present in A's {_owner(sa, key)}"
        )
    for key in sorted(set(union_b) - set(union_a)):
        out.append(
            f"extra in B: {key} ({union_b[key] or 'unnamed'}) in B's {_owner(sb, key)},"
            " absent from A"
        )
    for name in sorted(set(sa) & set(sb)):
        if sa[name] == sb[name]:
            continue
        out.append(f"{name} differs: {len(set(sa[name]) ^ set(sb[name]))} destinations")
    ca, cb = a.get("conntrack", {}), b.get("conntrack", {})
    if ca.get("count") is not None and cb.get("count") is not None:
        out.append(f"conntrack entries: {ca['count']} -> {cb['count']} (max {cb.get('max')})")
    return out


def _owner(per_plane: dict[str, dict[ServiceKey, str]], key: ServiceKey) -> str:
    return ", ".join(sorted(name for name, keys in per_plane.items() if key in keys))
