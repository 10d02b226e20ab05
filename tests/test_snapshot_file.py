"""ops.snapshot_file: the node snapshot streamed to a file is take()'s document. Unit tests
of the streaming pieces at tiny chunk sizes (every boundary case), and a kernel test that
compares both on a lab node holding iptables rules and kube-proxy nft tables in ip and ip6
(the join of two nft documents)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from kproxy.lab.topology import Lab
from kproxy.ops import snapshot_file
from kproxy.ops.snapshot import join_nft_documents, take
from kproxy.ops.snapshot_file import _escape_into, _find, _strip, write_node_snapshot


@pytest.fixture(params=[1, 2, 3, 1 << 20])
def chunk(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(snapshot_file, "CHUNK", request.param)
    return int(request.param)


def test_escaping_by_chunks_is_json_dumps(chunk: int) -> None:
    text = 'a "quoted" \\ line\n\ttab \u00e9t\u00e9 \u2603 \U0001f600 \x01 end'
    f = io.BytesIO(text.encode())
    out = io.StringIO()
    _escape_into(out, f, 0, len(text.encode()))
    assert out.getvalue() == json.dumps(text)[1:-1]
    assert json.loads(f'"{out.getvalue()}"') == text


def test_strip_and_find_see_across_chunks(chunk: int) -> None:
    data = b' \n {"nftables": [ {"a": 1}, {"b": [2]} ] } \n\n'
    f = io.BytesIO(data)
    start, end = _strip(f, 0, len(data))
    assert data[start:end] == data.strip()
    lo, hi = _find(f, start, end, b"["), _find(f, start, end, b"]", last=True)
    assert (lo, hi) == (data.index(b"["), data.rindex(b"]"))
    assert _find(f, start, end, b"#") == -1 and _find(f, start, end, b"#", last=True) == -1
    blank = io.BytesIO(b" \n\t ")
    assert _strip(blank, 0, 4)[0] == _strip(blank, 0, 4)[1]


@pytest.mark.kernel
def test_the_streamed_file_is_takes_document(lab: Lab, tmp_path: Path) -> None:
    ns = lab.node_ns
    lab.exec(ns, ["iptables-nft", "-t", "nat", "-N", "KUBE-SERVICES"])
    lab.exec(
        ns,
        [
            "iptables-nft",
            "-t",
            "nat",
            "-A",
            "KUBE-SERVICES",
            "-m",
            "comment",
            "--comment",
            'default/web:http cluster IP "quoted"',
            "-d",
            "10.96.0.10/32",
            "-p",
            "tcp",
            "--dport",
            "80",
            "-j",
            "ACCEPT",
        ],
    )
    script = (
        "add table ip kube-proxy\n"
        "add chain ip kube-proxy services\n"
        'add rule ip kube-proxy services ip daddr 10.96.0.10 tcp dport 80 counter comment "web"\n'
        "add table ip6 kube-proxy\n"
        "add chain ip6 kube-proxy services\n"
    )
    lab.exec(ns, ["nft", "-f", "-"], input=script)
    try:
        path = tmp_path / "snap.json"
        write_node_snapshot(path, ns)
        streamed = json.loads(path.read_text())
        taken = take(ns)
        for doc in (streamed, taken):
            doc.pop("taken_at")
            for key in ("iptables-nft", "iptables-legacy"):  # "# Completed on <time>"
                lines = doc[key]["output"].splitlines()
                doc[key]["output"] = [line for line in lines if not line.startswith("# ")]
        assert streamed == taken
        nft = json.loads(streamed["nftables"]["output"])["nftables"]
        families = sorted({i["table"]["family"] for i in nft if "table" in i})
        assert families == ["ip", "ip6"] and streamed["nftables"]["ok"]
        assert any('cluster IP \\"quoted\\"' in line for line in streamed["iptables-nft"]["output"])
        # The in-memory join and the streamed one agree on the two documents.
        docs = [
            lab.exec(ns, ["nft", "-j", "list", "table", f, "kube-proxy"]).stdout.strip()
            for f in ("ip", "ip6")
        ]
        assert json.loads(join_nft_documents(docs)) == json.loads(streamed["nftables"]["output"])
    finally:
        lab.exec(ns, ["nft", "delete", "table", "ip", "kube-proxy"], check=False)
        lab.exec(ns, ["nft", "delete", "table", "ip6", "kube-proxy"], check=False)
