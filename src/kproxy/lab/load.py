"""Background traffic for switch tests and benchmarks: what "no failed request" means.

Three kinds of traffic run at once against one service, from the lab's clients:
fresh TCP connections every few ms, long-lived TCP connections pinging every 100 ms, and a
UDP flow that keeps its source port. Every failure is recorded with its time.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from kproxy.lab.agent import ProbeAgent, ProbeResult
from kproxy.lab.topology import Lab

STREAM_GONE = ("closed", "reset")  # a ping error that ends its stream


@dataclass
class LoadResult:
    fresh_sent: int = 0
    fresh_failed: list[tuple[float, str]] = field(default_factory=list)
    pings_sent: int = 0
    pings_failed: list[tuple[float, str]] = field(default_factory=list)
    streams_dropped: int = 0
    udp_sent: int = 0
    udp_failed: list[tuple[float, str]] = field(default_factory=list)
    streams_opened: int = 0
    # (time, pod, error) of every failed ping: the pod that last answered on that stream, so
    # a failure can be laid at that endpoint's removal.
    stream_failures: list[tuple[float, str | None, str]] = field(default_factory=list)

    @property
    def failures(self) -> int:
        return len(self.fresh_failed) + len(self.pings_failed) + len(self.udp_failed)

    def summary(self) -> str:
        return (
            f"fresh {self.fresh_sent} sent / {len(self.fresh_failed)} failed; "
            f"long-lived pings {self.pings_sent} / {len(self.pings_failed)} failed, "
            f"{self.streams_dropped} streams dropped; "
            f"udp {self.udp_sent} / {len(self.udp_failed)} failed"
        )


class LoadHarness:
    def __init__(
        self,
        lab: Lab,
        *,
        tcp: tuple[str, int],
        udp: tuple[str, int] | None = None,
        streams: int = 5,
        fresh_interval: float = 0.005,
        timeout: float = 2.0,
        fresh_from: str | None = None,
        streams_from: str | None = None,
        ping_interval: float = 0.1,
        udp_interval: float = 0.05,
        udp_sport: int = 41053,
    ) -> None:
        """fresh_from / streams_from: the namespaces the fresh connections (and UDP) and the
        long-lived ones start in (default: the lab's first and last client). Harnesses that
        send UDP from one namespace at once need their own udp_sport each."""
        self.lab = lab
        self.tcp = tcp
        self.udp = udp
        self.n_streams = streams
        self.fresh_interval = fresh_interval
        self.ping_interval = ping_interval
        self.udp_interval = udp_interval
        self.udp_sport = udp_sport
        self.timeout = timeout
        self.fresh_from = fresh_from or lab.client_ns[0]
        self.streams_from = streams_from or lab.client_ns[-1]
        self.result = LoadResult()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._t0 = 0.0

    @property
    def started(self) -> float:
        """time.monotonic() at start(): the zero of the times in the result."""
        return self._t0

    def _now(self) -> float:
        return round(time.monotonic() - self._t0, 3)

    def start(self) -> LoadHarness:
        self._t0 = time.monotonic()
        fresh_agent = self.lab.agent(self.fresh_from)
        stream_agent = self.lab.agent(self.streams_from)
        ip, port = self.tcp
        streams = [
            stream_agent.open_stream(dst=ip, port=port, timeout=self.timeout)
            for _ in range(self.n_streams)
        ]
        self.result.streams_opened = len(streams)
        self._threads = [
            threading.Thread(target=self._fresh, args=(fresh_agent,), daemon=True),
            threading.Thread(target=self._streams, args=(stream_agent, streams), daemon=True),
        ]
        if self.udp is not None:
            self._threads.append(
                threading.Thread(target=self._udp, args=(fresh_agent,), daemon=True)
            )
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> LoadResult:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=10)
        return self.result

    def _record(self, r: ProbeResult, bucket: list[tuple[float, str]]) -> None:
        if not r.ok:
            bucket.append((self._now(), r.error or "failed"))

    def _fresh(self, agent: ProbeAgent) -> None:
        ip, port = self.tcp
        while not self._stop.is_set():
            r = agent.request(proto="tcp", dst=ip, port=port, timeout=self.timeout)
            self.result.fresh_sent += 1
            self._record(r, self.result.fresh_failed)
            self._stop.wait(self.fresh_interval)

    def _streams(self, agent: ProbeAgent, streams: list[str]) -> None:
        dead: set[str] = set()
        pods: dict[str, str | None] = {}
        while not self._stop.is_set():
            for sid in streams:
                if sid in dead:
                    continue
                r = agent.stream_ping(sid, timeout=1.0)
                self.result.pings_sent += 1
                if r.ok:
                    pods[sid] = r.pod
                else:
                    self._record(r, self.result.pings_failed)
                    error = r.error or "failed"
                    self.result.stream_failures.append((self._now(), pods.get(sid), error))
                    if error in STREAM_GONE:
                        dead.add(sid)
                        self.result.streams_dropped += 1
            self._stop.wait(self.ping_interval)

    def _udp(self, agent: ProbeAgent) -> None:
        assert self.udp is not None
        ip, port = self.udp
        while not self._stop.is_set():
            r = agent.request(proto="udp", dst=ip, port=port, timeout=1.0, sport=self.udp_sport)
            self.result.udp_sent += 1
            self._record(r, self.result.udp_failed)
            self._stop.wait(self.udp_interval)
