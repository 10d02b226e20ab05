"""A node's rollout duties: preflight answers once per request, verify readings for the
breakers, from the proxy's own metrics."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kproxy.cluster.duties import RolloutDuties
from kproxy.ops.verify import Collector

HIST = "kubeproxy_sync_proxy_rules_duration_seconds"


def metrics_text(syncs: int, slow: int, failures: int = 0) -> str:
    """`syncs` syncs of ~10 ms, `slow` of them ~1 s, as the proxy's /metrics shows them."""
    fast = syncs - slow
    lines = [f"# TYPE {HIST} histogram"]
    for le, count in (("0.016", fast), ("1.024", syncs), ("+Inf", syncs)):
        lines.append(f'{HIST}_bucket{{ip_family="IPv4",le="{le}"}} {count}')
    lines += [
        f'{HIST}_count{{ip_family="IPv4"}} {syncs}',
        f'{HIST}_sum{{ip_family="IPv4"}} {fast * 0.01 + slow * 1.0}',
        "# TYPE kproxy_sync_failures_total counter",
        f"kproxy_sync_failures_total {failures}",
    ]
    return "\n".join(lines) + "\n"


class FakeProxy:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.preflights: list[str] = []
        self.text = metrics_text(100, 0)
        self.block = ""

    def preflight_report(self, target: str) -> dict[str, Any]:
        self.preflights.append(target)
        if self.block == "raise":
            raise RuntimeError("nft -j list table: killed")
        return {"ok": not self.block, "blocks": [self.block] if self.block else []}

    def verify_collector(self) -> Collector:
        return Collector(
            self.tmp,
            metrics_address="127.0.0.1:0",
            fetch=lambda _url: self.text,
            admin=lambda: {"ok": True, "pid": os.getpid(), "mode": "iptables", "healthy": True},
            count_services=lambda _mode: (None, "not read"),
        )


def test_a_preflight_request_is_answered_once_per_id(tmp_path: Path) -> None:
    proxy = FakeProxy(tmp_path)
    duties = RolloutDuties(proxy)
    request = json.dumps({"id": "r.n1.1", "mode": "nftables"})
    first = duties.preflight(request)
    assert duties.preflight(request) == first and proxy.preflights == ["nftables"]
    assert json.loads(first or "") == {"id": "r.n1.1", "mode": "nftables", "ok": True, "blocks": []}
    proxy.block = "raise"
    answer = json.loads(duties.preflight(json.dumps({"id": "r.n1.2", "mode": "ipvs"})) or "")
    assert not answer["ok"] and "preflight could not run: nft -j list table: killed" in str(
        answer["blocks"]
    )
    assert duties.preflight("not json") == duties.answered[1]  # type: ignore[index]


def test_verify_readings_follow_the_proxy_while_a_rollout_watches(tmp_path: Path) -> None:
    proxy = FakeProxy(tmp_path)
    duties = RolloutDuties(proxy, verify_interval=10)
    assert duties.verify(False, now=0) is None
    first = json.loads(duties.verify(True, now=0) or "")
    assert first["ok"] and first["healthz"] and first["syncP99"] < 0.02
    assert duties.verify(True, now=5) is None  # not due yet
    proxy.text = metrics_text(200, 50, failures=3)  # slow syncs and failures since
    second = json.loads(duties.verify(True, now=10) or "")
    assert not second["ok"] and second["failures"] == 3
    assert second["syncP99"] > 0.5 and "BREACH failures" in second["summary"]
