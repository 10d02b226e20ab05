"""Kubernetes Events about Nodes and ProxyRollouts, in the shape `kubectl describe` lists.

Events about cluster-scoped objects live in "default"; a Node is named by its name as UID, as
kube-proxy's and the kubelet's Events do.
"""

from __future__ import annotations

import time
from typing import Any

from kproxy.text import one_line

EVENT_NAMESPACE = "default"
MESSAGE_LIMIT = 1000  # characters of a message kept (plus a marker saying how many were cut)


def event_body(
    involved: dict[str, str],
    type_: str,
    reason: str,
    message: str,
    *,
    component: str,
    instance: str,
) -> dict[str, Any]:
    """A v1 Event: `involved` is the object's apiVersion, kind, name and uid. The message is
    made one line: it may quote a Node's annotation or an object's name."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "name": f"{involved['name']}.{time.time_ns():x}",
            "namespace": EVENT_NAMESPACE,
        },
        "involvedObject": involved,
        "type": type_,
        "reason": reason,
        "message": one_line(message, limit=MESSAGE_LIMIT),
        "source": {"component": component, "host": instance},
        "reportingComponent": component,
        "reportingInstance": instance,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }


def node_ref(name: str) -> dict[str, str]:
    return {"apiVersion": "v1", "kind": "Node", "name": name, "uid": name}
