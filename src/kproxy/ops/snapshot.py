"""Record a node's whole dataplane as one JSON document, and compare two of them.

A snapshot holds what the kernel has, whatever wrote it: iptables-save of both backends,
kube-proxy's nftables tables, IPVS virtual servers, ipsets, kube-ipvs0's addresses and conntrack
usage. recorded_source() hands a document to the readers `kproxy list` uses
(ops.inspect), so `diff` can say "present in A's iptables rules, missing from B's nftables
maps" across a switch, exactly as the kernel read back would.
"""

from __future__ import annotations

import platform
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kproxy.host.commands import in_netns, run_command

if TYPE_CHECKING:  # the readers load only when a document is read (the daemon writes them)
    from kproxy.ops.inspect.destinations import Programmed
    from kproxy.ops.inspect.kernel import RecordedSource
    from kproxy.ops.inspect.model import Destination

FORMAT = "kproxy-snapshot/v1"


def _run(
    argv: Sequence[str], netns: str | None, input_data: str | None = None
) -> tuple[int, str, str]:
    if shutil.which(argv[0]) is None:
        return 127, "", f"{argv[0]} is not installed"
    proc = run_command(in_netns(argv, netns), input_data)
    return proc.returncode, proc.stdout, proc.stderr


def _section(argv: Sequence[str], netns: str | None) -> dict[str, Any]:
    code, out, err = _run(argv, netns)
    return {"command": " ".join(argv), "ok": code == 0, "output": out, "error": err.strip()}


# The nftables tables a snapshot records: kube-proxy's own ("nftables"), and kproxy's
# compact layout's in a section of its own named like its dataplane ("nftables-compact"),
# so that a snapshot taken during a switch between the layouts reads as two dataplanes.
# The whole ruleset would also hold every iptables-nft rule (already in the iptables-nft
# section): at 10,000 services `nft -j list ruleset` takes 54 s there, one table 0.4 s.
NFT_SECTIONS: dict[str, tuple[tuple[str, str], ...]] = {
    "nftables": (("ip", "kube-proxy"), ("ip6", "kube-proxy")),
    "nftables-compact": (("ip", "kproxy-compact"),),
}
NFT_TABLES = NFT_SECTIONS["nftables"]

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


def nft_command(section: str = "nftables") -> str:
    return "; ".join(f"nft -j list table {f} {n}" for f, n in NFT_SECTIONS[section])


NFT_COMMAND = nft_command()

# The sections of a snapshot, in order, and the command each records (None: the nftables
# tables, nftables_section).
SECTIONS: tuple[tuple[str, tuple[str, ...] | None], ...] = (
    ("iptables-nft", ("iptables-nft-save",)),
    ("iptables-legacy", ("iptables-legacy-save",)),
    ("nftables", None),
    ("nftables-compact", None),
    ("ipset", ("ipset", "save")),
    ("ipvs", ("ipvsadm", "-S", "-n")),
    ("kube-ipvs0", ("ip", "-j", "addr", "show", "dev", "kube-ipvs0")),
)


def nftables_section(run: Reader, section: str = "nftables") -> dict[str, Any]:
    """An nftables section's tables as one `nft -j` document (absent tables are no
    error)."""
    outputs: list[str] = []
    errors = []
    for family, name in NFT_SECTIONS[section]:
        code, out, err = run(["nft", "-j", "list", "table", family, name])
        if code == 0:
            if out.lstrip().startswith("{"):
                outputs.append(out.strip())
            else:
                errors.append(f"{family} {name}: not a JSON document: {out[:80]!r}")
        elif "No such file or directory" not in err and code != 127:
            errors.append(f"{family} {name}: {err.strip()}")
    return {
        "command": nft_command(section),
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
            snap[key] = nftables_section(lambda cmd: _run(cmd, netns), key)
        else:
            snap[key] = _section(argv, netns)
    snap["conntrack"] = conntrack_usage(netns)
    return snap


class _SectionOutputs(Mapping[str, str | None]):
    """A document's sections as a RecordedSource's dumps: a section is named by the key a
    live source reads the same command under. Read one by one as the readers ask (a
    preflight's kernel state runs a section's command on first use)."""

    def __init__(self, document: Mapping[str, Any]) -> None:
        self._document = document

    def __getitem__(self, key: str) -> str | None:
        section = self._document.get(key)
        output = section.get("output") if isinstance(section, Mapping) else None
        return output if isinstance(output, str) and output else None

    def __iter__(self) -> Iterator[str]:
        return (key for key, _ in SECTIONS)

    def __len__(self) -> int:
        return len(SECTIONS)


def recorded_source(document: Mapping[str, Any]) -> RecordedSource:
    """A snapshot document (or preflight's KernelState) as the readers' kernel source."""
    from kproxy.ops.inspect.kernel import RecordedSource

    return RecordedSource(dumps=_SectionOutputs(document))


def programmed_in(document: Mapping[str, Any]) -> Programmed:
    """Per dataplane, the service destinations a document's kernel programs."""
    from kproxy.ops.inspect.destinations import programmed

    return programmed(recorded_source(document))


def diff(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """Human findings: which service destinations one snapshot programs and the other lacks."""
    sa, sb = programmed_in(a), programmed_in(b)
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


def _owner(per_plane: Programmed, key: Destination) -> str:
    return ", ".join(sorted(name for name, keys in per_plane.items() if key in keys))
