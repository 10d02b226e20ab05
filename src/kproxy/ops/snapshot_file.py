"""A node snapshot written straight to a file, each command's output streamed through.

ops.snapshot.take() holds every section's output as text. At 10,000 services the nft
document alone is ~100 MB: read through a pipe (bytes, then text) and escaped once more as
the document is written, it pushed the daemon ~370 MiB over its resident size for a
switch's record. Here each command writes into a temporary file that is escaped into the
document a megabyte at a time: the same document (json.load of the file equals take()'s,
but for taken_at), in a few MB of memory.
"""

from __future__ import annotations

import codecs
import json
import shutil
import tempfile
from pathlib import Path
from typing import IO

from kproxy.host.commands import in_netns, run_command
from kproxy.ops.snapshot import NFT_SECTIONS, SECTIONS, conntrack_usage, header, nft_command

CHUNK = 1 << 20
WHITESPACE = b" \t\r\n\x0b\x0c"


def _run_to_file(argv: list[str], netns: str | None) -> tuple[int, IO[bytes], str]:
    """Exit code, the output in a temporary file (deleted on close), stderr."""
    out = tempfile.TemporaryFile()  # noqa: SIM115 (the caller closes it)
    if shutil.which(argv[0]) is None:
        return 127, out, f"{argv[0]} is not installed"
    proc = run_command(in_netns(argv, netns), stdout=out)
    return proc.returncode, out, proc.stderr


def _strip(f: IO[bytes], start: int, end: int) -> tuple[int, int]:
    """[start, end) of f without the whitespace at its ends."""
    while start < end:
        f.seek(start)
        head = f.read(min(CHUNK, end - start))
        kept = len(head) - len(head.lstrip(WHITESPACE))
        start += kept
        if kept < len(head):
            break
    while end > start:
        n = min(CHUNK, end - start)
        f.seek(end - n)
        tail = f.read(n)
        cut = len(tail) - len(tail.rstrip(WHITESPACE))
        end -= cut
        if cut < len(tail):
            break
    return start, end


def _find(f: IO[bytes], start: int, end: int, byte: bytes, *, last: bool = False) -> int:
    """The offset of the first (or last) `byte` in [start, end), -1 when there is none."""
    if last:
        pos = end
        while pos > start:
            n = min(CHUNK, pos - start)
            f.seek(pos - n)
            at = f.read(n).rfind(byte)
            if at >= 0:
                return pos - n + at
            pos -= n
        return -1
    pos = start
    while pos < end:
        f.seek(pos)
        block = f.read(min(CHUNK, end - pos))
        at = block.find(byte)
        if at >= 0:
            return pos + at
        pos += len(block)
    return -1


def _escape_into(out: IO[str], f: IO[bytes], start: int, end: int) -> None:
    """Bytes [start, end) of f as the inside of a JSON string (as json.dump writes it)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    f.seek(start)
    left = end - start
    while left > 0:
        data = f.read(min(CHUNK, left))
        if not data:
            break
        left -= len(data)
        out.write(json.dumps(decoder.decode(data))[1:-1])
    out.write(json.dumps(decoder.decode(b"", final=True))[1:-1])


def _section_into(out: IO[str], argv: list[str], netns: str | None) -> None:
    """One command's section: {"command", "ok", "output", "error"}, as ops.snapshot's."""
    code, f, err = _run_to_file(argv, netns)
    with f:
        out.write(f'{{"command": {json.dumps(" ".join(argv))}, "ok": {json.dumps(code == 0)}, ')
        out.write('"output": "')
        _escape_into(out, f, 0, f.seek(0, 2))
        out.write(f'", "error": {json.dumps(err.strip())}}}')


def _nftables_into(out: IO[str], netns: str | None, section: str) -> None:
    """An nftables section's tables as one `nft -j` document, joined by text
    (ops.snapshot.nftables_section does the same in memory)."""
    docs: list[tuple[IO[bytes], int, int]] = []
    errors: list[str] = []
    try:
        for family, name in NFT_SECTIONS[section]:
            code, f, err = _run_to_file(["nft", "-j", "list", "table", family, name], netns)
            if code != 0:
                f.close()
                if "No such file or directory" not in err and code != 127:
                    errors.append(f"{family} {name}: {err.strip()}")
                continue
            start, end = _strip(f, 0, f.seek(0, 2))
            f.seek(start)
            if f.read(1) != b"{":
                f.seek(start)
                head = f.read(80).decode(errors="replace")
                errors.append(f"{family} {name}: not a JSON document: {head!r}")
                f.close()
                continue
            docs.append((f, start, end))
        command = nft_command(section)
        out.write(f'{{"command": {json.dumps(command)}, "ok": {json.dumps(not errors)}, ')
        out.write('"output": "')
        if len(docs) == 1:
            _escape_into(out, *docs[0])
        else:
            out.write(json.dumps('{"nftables": [')[1:-1])
            first = True
            for f, start, end in docs:
                lo, hi = _find(f, start, end, b"["), _find(f, start, end, b"]", last=True)
                if not 0 <= lo < hi:
                    continue
                inner = _strip(f, lo + 1, hi)
                if inner[0] >= inner[1]:
                    continue
                if not first:
                    out.write(", ")
                _escape_into(out, f, *inner)
                first = False
            out.write(json.dumps("]}")[1:-1])
        out.write(f'", "error": {json.dumps("; ".join(errors))}}}')
    finally:
        for f, _, _ in docs:
            f.close()


def write_node_snapshot(path: Path, netns: str | None = None) -> None:
    """ops.snapshot.take(netns)'s document, written to `path` as the commands run."""
    with path.open("w") as out:
        out.write("{\n")
        for key, value in header(netns).items():
            out.write(f" {json.dumps(key)}: {json.dumps(value)},\n")
        for key, argv in SECTIONS:
            out.write(f" {json.dumps(key)}: ")
            if argv is None:
                _nftables_into(out, netns, key)
            else:
                _section_into(out, list(argv), netns)
            out.write(",\n")
        out.write(f' "conntrack": {json.dumps(conntrack_usage(netns))}\n}}\n')
