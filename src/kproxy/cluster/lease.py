"""One active controller at a time, through a coordination.k8s.io/v1 Lease.

The holder renews the Lease every step; another instance takes it over only once the holder
has not renewed it for the Lease's duration, and every write carries the resourceVersion it
read, so two instances racing for it cannot both win. Nothing outlives its holder: a
controller that dies simply stops renewing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kproxy.sources.kubeclient import ApiError, Connection, json_request

log = logging.getLogger("kproxy.cluster.lease")

_MICRO = "%Y-%m-%dT%H:%M:%S.%fZ"


def micro_time(now: float) -> str:
    return datetime.fromtimestamp(now, UTC).strftime(_MICRO)


def parse_micro_time(text: str | None) -> float | None:
    if not text:
        return None
    for fmt in (_MICRO, "%Y-%m-%dT%H:%M:%SZ"):
        try:
            return datetime.strptime(text, fmt).replace(tzinfo=UTC).timestamp()
        except ValueError:
            continue
    return None


@dataclass(frozen=True)
class LeaseWrite:
    method: str  # "POST" (create) or "PUT" (renew or take over)
    body: dict[str, Any]


def next_write(
    lease: dict[str, Any] | None,
    *,
    namespace: str,
    name: str,
    identity: str,
    now: float,
    duration: float,
) -> LeaseWrite | None:
    """The write that makes (or keeps) `identity` the holder; None while another holds it."""
    if lease is None:
        spec = {
            "holderIdentity": identity,
            "leaseDurationSeconds": int(duration),
            "acquireTime": micro_time(now),
            "renewTime": micro_time(now),
            "leaseTransitions": 0,
        }
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": name, "namespace": namespace},
            "spec": spec,
        }
        return LeaseWrite("POST", body)
    spec = dict(lease.get("spec") or {})
    holder = spec.get("holderIdentity") or ""
    renewed = parse_micro_time(spec.get("renewTime")) or 0.0
    held_for = float(spec.get("leaseDurationSeconds") or duration)
    if holder and holder != identity and now < renewed + held_for:
        return None
    if holder != identity:
        spec["acquireTime"] = micro_time(now)
        spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
    spec.update(
        holderIdentity=identity,
        leaseDurationSeconds=int(duration),
        renewTime=micro_time(now),
    )
    body = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "resourceVersion": (lease.get("metadata") or {}).get("resourceVersion", ""),
        },
        "spec": spec,
    }
    return LeaseWrite("PUT", body)


class LeaderLease:
    def __init__(self, namespace: str, name: str, identity: str, *, duration: float = 15.0) -> None:
        self.namespace, self.name, self.identity = namespace, name, identity
        self.duration = duration
        self.holding = False
        self.path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"

    async def hold(self, conn: Connection, now: float) -> bool:
        """Renew or take the Lease; True while this instance holds it."""
        try:
            lease: dict[str, Any] | None = await json_request(
                conn, "GET", f"{self.path}/{self.name}"
            )
        except ApiError as err:
            if err.code != 404:
                raise
            lease = None
        write = next_write(
            lease,
            namespace=self.namespace,
            name=self.name,
            identity=self.identity,
            now=now,
            duration=self.duration,
        )
        if write is None:
            if self.holding:
                log.warning("lost the lease %s/%s", self.namespace, self.name)
            self.holding = False
            return False
        path = self.path if write.method == "POST" else f"{self.path}/{self.name}"
        try:
            await json_request(conn, write.method, path, body=write.body)
        except ApiError as err:
            if err.code in (409, 422):  # another instance wrote first
                self.holding = False
                return False
            raise
        if not self.holding:
            log.info("holding the lease %s/%s as %s", self.namespace, self.name, self.identity)
        self.holding = True
        return True

    async def release(self, conn: Connection) -> None:
        """Give the Lease up at a clean exit, so a successor need not wait it out."""
        if not self.holding:
            return
        try:
            lease = await json_request(conn, "GET", f"{self.path}/{self.name}")
            spec = lease.get("spec") or {}
            if spec.get("holderIdentity") == self.identity:
                lease["spec"] = {**spec, "holderIdentity": ""}
                await json_request(conn, "PUT", f"{self.path}/{self.name}", body=lease)
        except ApiError as err:
            log.warning("could not release the lease: %s", err)
        self.holding = False
