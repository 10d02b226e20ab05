"""Objects from the Kubernetes API server: list + watch of Services, EndpointSlices and Node.

The same Source as the file source: start() returns once the first batch (every object of
all three lists) has gone to the sink, then changes follow as they are watched. The client is
asyncio (kubernetes_asyncio); its loop runs in a thread of its own so the interface stays
synchronous and a slow sink never stalls the process's other threads.

Filters are upstream's: Services and EndpointSlices whose label selector says they are for
another proxy (service.kubernetes.io/service-proxy-name) or headless are never listed, and
EndpointSlices other than IPv4 are dropped here (single stack, as the model). The Node is
this node's only (fieldSelector metadata.name=NODE).

While the API server cannot be reached, nothing is delivered: the sink, and so the dataplane,
keeps the last state it was given. Only a list that succeeded can delete objects.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from kproxy.sources.base import NODE, EventSink, ObjectEvent
from kproxy.sources.kubeclient import (
    ApiError,
    ClientConfigError,
    ClientSettings,
    Connection,
    connect,
    json_request,
)
from kproxy.sources.reflector import (
    ENDPOINT_SLICES,
    NODES,
    SERVICES,
    TRANSIENT,
    Reflector,
    Timing,
    describe_error,
)

log = logging.getLogger("kproxy.sources.api")
T = TypeVar("T")

# Exactly what kube-proxy puts on its Service and EndpointSlice informers.
LABEL_SELECTOR = "!service.kubernetes.io/headless,!service.kubernetes.io/service-proxy-name"

_JOIN_TIMEOUT = 10.0

NodeListener = Callable[[dict[str, Any] | None], None]


def _ipv4_slice(obj: dict[str, Any]) -> bool:
    return obj.get("addressType") == "IPv4"


class ApiSource:
    """A Source over the API server (see the module docstring)."""

    def __init__(
        self,
        node_name: str,
        settings: ClientSettings | None = None,
        *,
        timing: Timing | None = None,
    ) -> None:
        self.node_name = node_name
        self.settings = settings or ClientSettings()
        self.timing = timing or Timing()
        # Called (in the source's thread) with this node's object after every change, and
        # with None when it is deleted; must return quickly.
        self.node_listeners: list[NodeListener] = []
        self.node: dict[str, Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._conn: Connection | None = None
        self._reflectors: list[Reflector] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._main: asyncio.Task[None] | None = None
        self._sink: EventSink | None = None
        self._synced = threading.Event()
        self._stopping = threading.Event()
        self._open_lock = threading.Lock()

    # --- the Source interface -------------------------------------------------------------

    @property
    def synced(self) -> bool:
        return self._synced.is_set()

    def start(self, sink: EventSink) -> None:
        """Connect and block until every list has succeeded once and gone to the sink (or
        stop() is called). Raises ClientConfigError for unusable connection settings."""
        if self._sink is not None:
            raise RuntimeError("ApiSource already started")
        self._sink = sink
        self.open()
        self._submit(self._run())
        waited = 0.0
        while not self._synced.wait(0.2):
            if self._stopping.is_set():
                return
            waited += 0.2
            if abs(waited - 10.0) < 0.1:
                log.warning(
                    "still waiting for the first lists from the API server (%s); no sync yet",
                    self.settings.description,
                )

    def stop(self) -> None:
        self._stopping.set()
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(_JOIN_TIMEOUT)
        except (concurrent.futures.TimeoutError, RuntimeError):
            log.warning("API source did not shut down within %.0f s", _JOIN_TIMEOUT)
        loop.call_soon_threadsafe(loop.stop)
        if thread is not threading.current_thread():
            thread.join(_JOIN_TIMEOUT)

    # --- connection and calls ----------------------------------------------------------------

    def open(self) -> None:
        """Start the client's thread and connect (no request yet); idempotent."""
        with self._open_lock:
            if self._conn is not None:
                return
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(
                    target=self._loop.run_forever, name="api-source", daemon=True
                )
                self._thread.start()
            self._conn = self.call(connect(self.settings), timeout=60.0)
            log.info("API source: %s, server %s", self.settings.description, self._conn.host)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the source's loop from another thread and wait for it."""
        return self._submit(coro).result(timeout)

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if self._loop is None:
            coro.close()
            raise RuntimeError("ApiSource is not open")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    @property
    def connection(self) -> Connection:
        if self._conn is None:
            raise RuntimeError("ApiSource is not open")
        return self._conn

    def fetch_node(self, wait: float = 10.0) -> dict[str, Any] | None:
        """This node's Node object, read once before the proxy is built (node IPs, declared
        mode); retried for up to `wait` seconds, None if it could not be read in time."""
        self.open()
        return self.call(self._fetch_node(wait), timeout=wait + 30.0)

    async def _fetch_node(self, wait: float) -> dict[str, Any] | None:
        deadline = time.monotonic() + wait
        delay = 0.2
        last = ""
        while True:
            try:
                node = await json_request(self.connection, "GET", f"{NODES.path}/{self.node_name}")
                node.setdefault("kind", NODE)
                node.setdefault("apiVersion", "v1")
                return node
            except TRANSIENT as err:
                if isinstance(err, ApiError) and err.code == 404:
                    last = f"Node {self.node_name} does not exist"
                else:
                    last = describe_error(err)
            if time.monotonic() + delay > deadline:
                log.warning("could not read Node %s: %s", self.node_name, last)
                return None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    # --- the watch ---------------------------------------------------------------------------

    async def _run(self) -> None:
        self._main = asyncio.current_task()
        conn = self.connection
        reflectors = [
            Reflector(
                SERVICES, conn, self._deliver, label_selector=LABEL_SELECTOR, timing=self.timing
            ),
            Reflector(
                ENDPOINT_SLICES,
                conn,
                self._deliver,
                label_selector=LABEL_SELECTOR,
                keep=_ipv4_slice,
                timing=self.timing,
            ),
            Reflector(
                NODES,
                conn,
                self._deliver,
                field_selector=f"metadata.name={self.node_name}",
                timing=self.timing,
            ),
        ]
        self._reflectors = reflectors
        release = asyncio.Event()
        self._tasks = [
            asyncio.create_task(r.run(release), name=f"watch-{r.resource.plural}")
            for r in reflectors
        ]
        await asyncio.gather(*(r.listed.wait() for r in reflectors))
        batch = [ev for r in reflectors for ev in r.initial]
        for r in reflectors:
            r.initial = []
        log.info(
            "API source synced: %s",
            ", ".join(f"{len(r.known)} {r.resource.plural}" for r in reflectors),
        )
        self._deliver(batch)
        self._synced.set()
        release.set()

    def _deliver(self, batch: Sequence[ObjectEvent]) -> None:
        sink = self._sink
        assert sink is not None
        try:
            sink(batch)
        except Exception:
            # As the file source: the view has moved on, and a stuck source is worse than
            # one lost update (the next relist repairs it).
            log.exception("object sink failed on a batch of %d events", len(batch))
        for ev in batch:
            if ev.key.kind == NODE and ev.key.name == self.node_name:
                self.node = ev.obj
                for listener in list(self.node_listeners):
                    try:
                        listener(ev.obj)
                    except Exception:
                        log.exception("node listener failed")

    async def _shutdown(self) -> None:
        if self._main is not None and not self._main.done():
            self._main.cancel()  # still waiting for the first lists
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception:
                log.exception("watch task failed")
        self._tasks = []
        if self._conn is not None:
            await self._conn.close()
            self._conn = None

    def state(self) -> dict[str, object]:
        """Per resource: resourceVersion, objects, lists, watches, current error."""
        return {r.resource.plural: r.state() for r in list(self._reflectors)}


__all__ = ["LABEL_SELECTOR", "ApiSource", "ClientConfigError", "ClientSettings", "Timing"]
