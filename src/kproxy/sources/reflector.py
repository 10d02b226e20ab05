"""List and watch one kind of object, keeping what the sink was given in step with the server.

This is client-go's reflector, reduced to what a proxy needs: list (paged), then watch from
the list's resourceVersion with bookmarks; a watch that ends is resumed from the last
resourceVersion seen (an event's or a bookmark's); 410 Gone means that version is no longer
kept, so everything is listed again and only the difference to what was delivered goes out.
Only the resourceVersion of each delivered object is remembered, not the object.

Failures never become deletions: a list that fails changes nothing, and the sink keeps what
it had until a later list succeeds. Retries back off exponentially (capped, with jitter), and
each failure is logged once when it starts or changes, not on every retry.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from kproxy.sources.base import NODE, ObjectEvent, ObjectKey
from kproxy.sources.kubeclient import (
    GONE,
    ApiError,
    Connection,
    json_request,
    request,
    status_error,
)

log = logging.getLogger("kproxy.sources.api")

# A watch event holding a big EndpointSlice is one long line; aiohttp's default is 128 KiB.
MAX_EVENT_BYTES = 64 << 20


@dataclass(frozen=True)
class Resource:
    kind: str
    api_version: str
    path: str  # the collection across all namespaces
    plural: str

    def describe(self) -> str:
        return self.plural


SERVICES = Resource("Service", "v1", "/api/v1/services", "services")
ENDPOINT_SLICES = Resource(
    "EndpointSlice",
    "discovery.k8s.io/v1",
    "/apis/discovery.k8s.io/v1/endpointslices",
    "endpointslices",
)
NODES = Resource("Node", "v1", "/api/v1/nodes", "nodes")


@dataclass(frozen=True)
class Timing:
    """Knobs of the list/watch machinery (tests shrink them)."""

    backoff_initial: float = 0.8  # client-go's reflector backoff: 800 ms doubling to 30 s
    backoff_max: float = 30.0
    watch_timeout: int = 300  # server-side timeoutSeconds: uniform in [t, 2t], as client-go
    read_grace: float = 60.0  # a silent watch connection is dropped after timeout + this
    list_timeout: float = 120.0
    connect_timeout: float = 10.0
    page_size: int = 500


class Gone(Exception):
    """The resourceVersion we hold is too old for the server (410): list again."""


class Backoff:
    def __init__(self, initial: float, cap: float) -> None:
        self.initial = initial
        self.cap = cap
        self.delay = 0.0

    def next(self) -> float:
        self.delay = self.initial if self.delay == 0 else min(self.cap, self.delay * 2)
        # Jitter keeps a fleet of proxies from hitting a recovering API server in lockstep.
        return min(self.cap, self.delay * random.uniform(1.0, 1.25))

    def reset(self) -> None:
        self.delay = 0.0


class HealthLog:
    """Logs a failure when it starts or changes and once when things work again."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.error: str | None = None
        self.failures = 0
        self.since = 0.0

    def failed(self, error: str) -> None:
        if self.error is None:
            self.since = time.monotonic()
        if error != self.error:
            log.warning(
                "%s: %s; retrying with backoff (the dataplane keeps its current state)",
                self.what,
                error,
            )
            self.error = error
        self.failures += 1

    def ok(self) -> None:
        if self.error is not None:
            log.info(
                "%s: working again after %d failed attempt(s) in %.1f s",
                self.what,
                self.failures,
                time.monotonic() - self.since,
            )
        self.error = None
        self.failures = 0


def describe_error(err: BaseException) -> str:
    if isinstance(err, ApiError):
        return str(err)
    if isinstance(err, asyncio.TimeoutError | TimeoutError):
        return "timed out"
    text = str(err) or type(err).__name__
    return f"{type(err).__name__}: {text}"[:300]


def _decode(line: bytes) -> Any:
    """A watch stream's line as JSON. ValueError (which ends this watch; the next resumes
    from the last version seen, as client-go's does) for a line that is not JSON."""
    try:
        return json.loads(line)
    except RecursionError:
        raise ValueError("a watch event nested too deep to decode") from None


# What a retry can cure: transport problems, server errors, garbage on the wire.
TRANSIENT = (ApiError, aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError)

# How a watch stream that was established ends when its connection is cut.
_CUT = (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, ConnectionResetError)

Deliver = Callable[[list[ObjectEvent]], None]
Keep = Callable[[dict[str, Any]], bool]


def _rv(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata")
    rv = meta.get("resourceVersion") if isinstance(meta, dict) else None
    return rv if isinstance(rv, str) else ""


class Reflector:
    """One resource's list+watch loop; run() until cancelled."""

    def __init__(
        self,
        resource: Resource,
        conn: Connection,
        deliver: Deliver,
        *,
        label_selector: str = "",
        field_selector: str = "",
        keep: Keep | None = None,
        timing: Timing | None = None,
    ) -> None:
        self.resource = resource
        self.conn = conn
        self.deliver = deliver
        self.label_selector = label_selector
        self.field_selector = field_selector
        self.keep = keep
        self.timing = timing or Timing()
        self.known: dict[ObjectKey, str] = {}  # key -> resourceVersion the sink was given
        self.resource_version = ""
        self.listed = asyncio.Event()  # the first list succeeded; its events are `initial`
        self.initial: list[ObjectEvent] = []
        self.lists = 0
        self.watches = 0
        self.skipped = 0  # objects and watch events that could not be used
        self.last_skipped: str | None = None
        self.health = HealthLog(f"{resource.describe()} list/watch")
        self.backoff = Backoff(self.timing.backoff_initial, self.timing.backoff_max)
        # "0": the first list may come from the API server's watch cache (cheap for it; the
        # watch that follows catches up). After a 410 we ask for "not older than" what we
        # had, and only if even that is gone for a fresh consistent list (""), as client-go.
        self._list_rv = "0"

    def _selectors(self) -> list[tuple[str, str]]:
        query = []
        if self.label_selector:
            query.append(("labelSelector", self.label_selector))
        if self.field_selector:
            query.append(("fieldSelector", self.field_selector))
        return query

    async def run(self, release: asyncio.Event) -> None:
        """List, hand the first list over (then wait for `release`), watch, forever."""
        need_list = True
        gone_in_a_row = 0
        while True:
            try:
                if need_list:
                    await self._relist(release)
                    need_list = False
                started = time.monotonic()
                events = await self._watch()
                if events == 0 and time.monotonic() - started < 1.0:
                    # A server that ends watches at once must not make us spin.
                    await asyncio.sleep(self.backoff.next())
                else:
                    self.backoff.reset()
                    gone_in_a_row = 0
            except Gone as why:
                log.info(
                    "%s: resourceVersion %s is gone (%s); listing again",
                    self.resource.describe(),
                    self.resource_version,
                    why,
                )
                self._list_rv = self.resource_version
                need_list = True
                gone_in_a_row += 1
                if gone_in_a_row > 1:  # a list that is gone again at once: slow down
                    await asyncio.sleep(self.backoff.next())
            except TRANSIENT as err:
                self.health.failed(describe_error(err))
                await asyncio.sleep(self.backoff.next())
            except Exception:  # a bug must not end the watch for good
                log.exception("%s: list/watch failed unexpectedly", self.resource.describe())
                need_list = True
                await asyncio.sleep(self.backoff.next())

    async def _relist(self, release: asyncio.Event) -> None:
        rv, objects = await self._list()
        self.health.ok()
        events = self._replace(objects)
        self.resource_version = rv
        self.lists += 1
        if not self.listed.is_set():
            self.initial = events
            self.listed.set()
            await release.wait()
        elif events:
            log.info(
                "%s: relisted, %d change(s) since the last watch",
                self.resource.describe(),
                len(events),
            )
            self.deliver(events)

    async def _list(self) -> tuple[str, dict[ObjectKey, dict[str, Any]]]:
        t = self.timing
        timeout = aiohttp.ClientTimeout(total=t.list_timeout, sock_connect=t.connect_timeout)
        objects: dict[ObjectKey, dict[str, Any]] = {}
        cont = ""
        restarts = 0
        while True:
            query = [*self._selectors(), ("limit", str(t.page_size))]
            if cont:
                query.append(("continue", cont))  # implies the first page's resourceVersion
            elif self._list_rv:
                query.append(("resourceVersion", self._list_rv))
            try:
                data = await json_request(
                    self.conn, "GET", self.resource.path, query=query, timeout=timeout
                )
            except ApiError as err:
                if err.code == GONE and restarts < 2 and (cont or self._list_rv):
                    # An expired continue token, or a version the server no longer has:
                    # start over from a fresh consistent list.
                    restarts += 1
                    cont, self._list_rv, objects = "", "", {}
                    continue
                raise
            items = data.get("items")
            if not isinstance(items, list):
                raise ApiError(200, "", f"{self.resource.kind}List without items")
            for item in items:
                key = self._key(item, in_list=True)
                if key is not None and (self.keep is None or self.keep(item)):
                    objects[key] = item
            meta = data.get("metadata") if isinstance(data.get("metadata"), dict) else {}
            cont = str(meta.get("continue") or "")
            if not cont:
                self._list_rv = "0"
                return str(meta.get("resourceVersion") or ""), objects

    def _replace(self, objects: dict[ObjectKey, dict[str, Any]]) -> list[ObjectEvent]:
        """The events turning what was delivered into this complete list."""
        events: list[ObjectEvent] = []
        known: dict[ObjectKey, str] = {}
        for key, obj in objects.items():
            rv = _rv(obj)
            known[key] = rv
            # An object without a resourceVersion cannot be compared: always send it.
            if not rv or self.known.get(key) != rv:
                events.append(ObjectEvent(key, obj))
        events.extend(ObjectEvent(key, None) for key in self.known if key not in known)
        self.known = known
        return events

    def _key(self, obj: Any, *, in_list: bool = False) -> ObjectKey | None:
        if not isinstance(obj, dict):
            return None
        if in_list:
            # List items carry no kind or apiVersion; the sink gets complete objects.
            obj.setdefault("kind", self.resource.kind)
            obj.setdefault("apiVersion", self.resource.api_version)
        meta = obj.get("metadata")
        name = meta.get("name") if isinstance(meta, dict) else None
        if not isinstance(name, str) or not name:
            self._skip("an object without metadata.name")
            return None
        assert isinstance(meta, dict)
        if self.resource.kind == NODE:
            return ObjectKey(NODE, "", name)
        namespace = meta.get("namespace")
        return ObjectKey(
            self.resource.kind,
            namespace if isinstance(namespace, str) and namespace else "default",
            name,
        )

    def _skip(self, why: str) -> None:
        """One object or watch event that cannot be used: reported, and the watch goes on
        (the object's next event, or the next list, may be usable)."""
        self.skipped += 1
        self.last_skipped = why
        log.warning("%s: %s; skipped", self.resource.describe(), why)

    async def _watch(self) -> int:
        """One watch request until the server ends it; the number of object events."""
        t = self.timing
        seconds = random.randint(t.watch_timeout, 2 * t.watch_timeout)
        query = [
            *self._selectors(),
            ("watch", "true"),
            ("resourceVersion", self.resource_version),
            ("allowWatchBookmarks", "true"),
            ("timeoutSeconds", str(seconds)),
        ]
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=t.connect_timeout, sock_read=seconds + t.read_grace
        )
        resp = await request(self.conn, "GET", self.resource.path, query=query, timeout=timeout)
        try:
            if resp.status == GONE:
                raise Gone(status_error(resp.status, await resp.read()).message)
            if resp.status != 200:
                raise status_error(resp.status, await resp.read())
            self.health.ok()
            self.watches += 1
            count = 0
            while True:
                try:
                    line = await resp.content.readline(max_line_length=MAX_EVENT_BYTES)
                except _CUT as err:
                    # An open watch cut mid-stream (API server restart, a load balancer's
                    # idle timeout) is routine: resume from the last version at once.
                    log.debug("%s: watch cut: %s", self.resource.describe(), describe_error(err))
                    return count
                if not line:
                    return count  # the server ended the watch (timeoutSeconds)
                if line.strip():
                    count += self._event(_decode(line))
        finally:
            resp.close()

    def _event(self, event: Any) -> int:
        """Apply one decoded watch event; the number of object events it was (0 or 1). An
        event of the wrong shape is skipped and reported: the stream itself is intact (one
        JSON document a line), so the events after it still arrive."""
        if not isinstance(event, dict) or not isinstance(event.get("object"), dict):
            what = type(event.get("object") if isinstance(event, dict) else event).__name__
            self._skip(f"a watch event whose object is a {what}, not an object")
            return 0
        kind, obj = event.get("type"), event["object"]
        if kind == "ERROR":
            err = status_error(200, obj)
            if err.code == GONE:
                raise Gone(err.message)
            raise err
        rv = _rv(obj)
        if kind == "BOOKMARK":
            if rv:
                self.resource_version = rv
            return 0
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            log.debug("%s: ignoring watch event type %r", self.resource.describe(), kind)
            return 0
        obj.setdefault("kind", self.resource.kind)
        obj.setdefault("apiVersion", self.resource.api_version)
        key = self._key(obj)
        if key is not None:
            present = kind != "DELETED" and (self.keep is None or self.keep(obj))
            if present:
                self.known[key] = rv
                self.deliver([ObjectEvent(key, obj)])
            elif key in self.known:
                del self.known[key]
                self.deliver([ObjectEvent(key, None)])
        if rv:
            self.resource_version = rv
        return 1

    def state(self) -> dict[str, object]:
        return {
            "resource_version": self.resource_version,
            "objects": len(self.known),
            "lists": self.lists,
            "watches": self.watches,
            "error": self.health.error,
            "skipped": self.skipped,
            "last_skipped": self.last_skipped,
        }
