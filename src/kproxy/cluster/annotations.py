"""The Node annotations through which a mode is declared for a node and its progress reported.

The node's kproxy reads the declared mode and writes the rest (cluster/agent.py); the
source reads the declared mode once before the dataplane is built (sources/cluster.py).
"""

from __future__ import annotations

import json
from typing import Any

PREFIX = "proxy.kproxy.io/"
# Declared by a person or a rollout: the mode this node should run.
MODE_ANNOTATION = PREFIX + "mode"
# Written by the node's kproxy.
CURRENT_MODE = PREFIX + "current-mode"
OBSERVED = PREFIX + "mode-observed"
SWITCH_STATE = PREFIX + "switch-state"
SWITCH_TARGET = PREFIX + "switch-target"
LAST_ERROR = PREFIX + "last-error"
STATUS_ANNOTATIONS = (CURRENT_MODE, OBSERVED, SWITCH_STATE, SWITCH_TARGET, LAST_ERROR)
# Written by a rollout controller on the nodes it moves.
ROLLOUT = PREFIX + "rollout"  # "NAME/STAGE": the rollout and stage the node belongs to
PREVIOUS_MODE = PREFIX + "previous-mode"  # where a rollback of the node goes
PREFLIGHT_REQUEST = PREFIX + "preflight-request"  # {"id": ..., "mode": ...}
LAST_ROLLOUT = PREFIX + "last-rollout"  # "NAME/STAGE", left when the rollout finished
ROLLOUT_ANNOTATIONS = (ROLLOUT, PREVIOUS_MODE, PREFLIGHT_REQUEST, LAST_ROLLOUT)
# Written by the node's kproxy for a rollout.
PREFLIGHT_RESULT = PREFIX + "preflight-result"  # {"id", "ok", "blocks", "warnings"}
VERIFY = PREFIX + "verify"  # {"at", "ok", "syncP99", "failures", "healthz", "summary"}
# Every key a node's kproxy writes on its Node (deploy/optional's admission policy allows
# exactly these).
AGENT_ANNOTATIONS = (*STATUS_ANNOTATIONS, PREFLIGHT_RESULT, VERIFY)


def annotations_of(node: dict[str, Any] | None) -> dict[str, str]:
    meta = node.get("metadata") if isinstance(node, dict) else None
    ann = meta.get("annotations") if isinstance(meta, dict) else None
    return {str(k): str(v) for k, v in ann.items()} if isinstance(ann, dict) else {}


def declared_mode(node: dict[str, Any] | None) -> str | None:
    """The mode the node annotation asks for, "" if it is set but empty, None if absent."""
    ann = annotations_of(node)
    if MODE_ANNOTATION not in ann:
        return None
    return ann[MODE_ANNOTATION].strip().lower()


def json_annotation(text: str | None) -> dict[str, Any] | None:
    """An annotation holding a JSON object (a preflight request or answer, a verify
    reading); None when absent or not an object."""
    if not text:
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None
