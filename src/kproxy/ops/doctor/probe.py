"""TCP connects from the node's network namespace: does an endpoint (or a service's virtual
address) answer? One subprocess per call does every connect in parallel, inside the
namespace (`ip netns exec`), so the probes see the node's routes and rules.

A connect that is refused counts as answered for a virtual address (the packet got through
the proxy's rules to a host that said no) and as "refused" for an endpoint (nothing listens
on the target port). Nothing is sent after the handshake.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence

from kproxy.host.commands import in_netns

TIMEOUT = 1.0

_SCRIPT = r"""
import json, socket, sys
from concurrent.futures import ThreadPoolExecutor
targets, timeout = json.loads(sys.argv[1]), float(sys.argv[2])
def one(t):
    ip, port = t
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect((ip, port))
        return "ok"
    except ConnectionRefusedError:
        return "refused"
    except OSError as e:
        return "timeout" if isinstance(e, TimeoutError) else (e.strerror or type(e).__name__)
    finally:
        s.close()
with ThreadPoolExecutor(max_workers=min(32, max(1, len(targets)))) as pool:
    print(json.dumps(list(pool.map(one, targets))))
"""


def connect_all(
    targets: Sequence[tuple[str, int]], netns: str | None, timeout: float = TIMEOUT
) -> dict[tuple[str, int], str]:
    """(ip, port) -> "ok" | "refused" | "timeout" | an error text."""
    if not targets:
        return {}
    unique = list(dict.fromkeys(targets))
    argv = in_netns([sys.executable, "-c", _SCRIPT, json.dumps(unique), str(timeout)], netns)
    try:
        proc = subprocess.run(
            argv, capture_output=True, text=True, check=False, timeout=timeout * 4 + 10
        )
        answers = json.loads(proc.stdout or "[]")
    except (subprocess.TimeoutExpired, ValueError):
        answers = []
    if len(answers) != len(unique):
        return {t: "probe failed to run" for t in unique}
    return dict(zip(unique, answers, strict=True))
