"""The metrics server (:10249) and the proxy health server (:10256), as upstream serves them.

Metrics: /metrics, /healthz ("ok"), /proxyMode. Health: /healthz and /livez with upstream's
JSON; 503 when a queued change has not been applied within healthTimeout (2 x syncPeriod).
Both run in daemon threads and retry a failed bind every 5 s unless told to fail hard.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kproxy.dataplane.base import SyncResult
from kproxy.model.objects import Snapshot
from kproxy.model.snapshot import ChangeCounts
from kproxy.server.metrics import IP_FAMILY, ProxyMetrics
from kproxy.text import one_line

log = logging.getLogger("kproxy.server")
BIND_RETRY = 5.0
# Seconds a client may take per read of its request (and per write of the answer): a silent
# client's connection ends then instead of holding its thread.
REQUEST_TIMEOUT = 10.0


def go_time(ts: float) -> str:
    """A timestamp the way Go prints a time.Time (what upstream's JSON carries)."""
    dt = datetime.fromtimestamp(ts, UTC)
    return dt.strftime("%Y-%m-%d %H:%M:%S.%f") + " +0000 UTC"


def split_host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(port)


class HealthState:
    """upstream's ProxyHealthServer bookkeeping (implements sync.SyncObserver)."""

    def __init__(self, health_timeout: float, clock: Callable[[], float] = time.time) -> None:
        self.health_timeout = health_timeout
        self.clock = clock
        self.last_updated = 0.0
        self.oldest_pending_queued = 0.0
        self._lock = threading.Lock()

    def queued(self, when: float, pending_services: int, pending_endpoints: int) -> None:
        with self._lock:
            if not self.oldest_pending_queued:
                self.oldest_pending_queued = when

    def synced(
        self, snapshot: Snapshot, result: SyncResult, seconds: float, counts: ChangeCounts
    ) -> None:
        with self._lock:
            self.last_updated = self.clock()
            self.oldest_pending_queued = 0.0

    def failed(self, full: bool) -> None:
        pass

    def conntrack_cleaned(self, deleted: int, error: str | None = None) -> None:
        pass

    def report(self) -> tuple[bool, float, float]:
        """(healthy, lastUpdated, now). Healthy unless a change waits longer than the timeout."""
        now = self.clock()
        with self._lock:
            pending = self.oldest_pending_queued
            healthy = not pending or now - pending < self.health_timeout
            # When healthy, upstream reports lastUpdated as now: nothing is outstanding.
            last = now if healthy else self.last_updated
        return healthy, last, now


class _Server:
    """A ThreadingHTTPServer in a daemon thread, bound (with retries) in the background."""

    def __init__(
        self, name: str, address: str, handler: type[BaseHTTPRequestHandler], hard_fail: bool
    ) -> None:
        self.name = name
        self.address = address
        self.handler = handler
        self.hard_fail = hard_fail
        self.httpd: QuietHTTPServer | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        host, port = split_host_port(self.address)
        if port == 0:
            log.info("%s server disabled (port 0)", self.name)
            return
        try:
            self._bind(host, port)
        except OSError as err:
            if self.hard_fail:
                raise
            log.error(
                "%s server cannot bind %s (%s); retrying every %.0f s",
                self.name,
                self.address,
                err,
                BIND_RETRY,
            )
            threading.Thread(target=self._retry, args=(host, port), daemon=True).start()

    def _bind(self, host: str, port: int) -> None:
        httpd = QuietHTTPServer((host, port), self.handler)
        self.httpd = httpd
        threading.Thread(target=httpd.serve_forever, name=f"{self.name}-http", daemon=True).start()
        log.info("%s server listening on %s", self.name, self.address)

    def _retry(self, host: str, port: int) -> None:
        while not self._stop.wait(BIND_RETRY):
            try:
                self._bind(host, port)
                return
            except OSError:
                continue

    def stop(self) -> None:
        self._stop.set()
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()


class QuietHTTPServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer whose failed connection (a client that reset it, say) is logged
    in one line instead of socketserver's traceback on stderr."""

    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        err = sys.exc_info()[1]
        log.debug("http connection from %s failed: %s", client_address, one_line(err))


class RequestHandler(BaseHTTPRequestHandler):
    """The stdlib's request parsing (a bad request line is answered 400, an overlong one 414,
    too many or too long headers 431), bounded in time, logged in one line."""

    server_version = "kproxy"
    timeout = REQUEST_TIMEOUT

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), one_line(fmt % args, limit=300))

    def reply(
        self, code: int, body: bytes, content_type: str, headers: dict[str, str] | None = None
    ) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)


def metrics_server(
    address: str, metrics: ProxyMetrics, mode: Callable[[], str], hard_fail: bool
) -> _Server:
    class Handler(RequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self.reply(200, generate_latest(metrics.registry), CONTENT_TYPE_LATEST)
            elif path == "/healthz":
                self.reply(200, b"ok", "text/plain; charset=utf-8")
            elif path == "/proxyMode":
                self.reply(200, mode().encode(), "text/plain; charset=utf-8")
            else:
                self.reply(404, b"404 page not found\n", "text/plain; charset=utf-8")

    return _Server("metrics", address, Handler, hard_fail)


def health_server(
    address: str, state: HealthState, metrics: ProxyMetrics, hard_fail: bool
) -> _Server:
    class Handler(RequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path not in ("/healthz", "/livez"):
                self.reply(404, b"404 page not found\n", "text/plain; charset=utf-8")
                return
            healthy, last, now = state.report()
            code = HTTPStatus.OK if healthy else HTTPStatus.SERVICE_UNAVAILABLE
            body: dict[str, Any] = {"lastUpdated": go_time(last), "currentTime": go_time(now)}
            if path == "/healthz":
                # Node eligibility (deleting / ToBeDeletedByClusterAutoscaler) needs the API
                # source; from files the node is always eligible.
                body["nodeEligible"] = True
                metrics.healthz.labels(code=str(int(code))).inc()
            else:
                metrics.livez.labels(code=str(int(code))).inc()
            body["healthy"] = healthy
            body["status"] = {IP_FAMILY: {"lastUpdated": go_time(last), "healthy": healthy}}
            self.reply(
                int(code),
                json.dumps(body).encode(),
                "application/json",
                {"X-Content-Type-Options": "nosniff"},
            )

    return _Server("health", address, Handler, hard_fail)
