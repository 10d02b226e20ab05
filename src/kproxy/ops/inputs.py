"""What an ops command (preflight, doctor, verify, list, trace, status, switch) is told about
the node it looks at, built once from the options they share by `ops_inputs`.

What is not given can come from the running kproxy of the state dir (`with_running_proxy`):
its status, its network namespace, its --config and --source.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kproxy.cli_common import UsageError
from kproxy.defaults import DEFAULT_STATE_DIR

if TYPE_CHECKING:
    from kproxy.ops.preflight.access import NodeAccess
    from kproxy.server.admin import AdminTarget


@dataclass(frozen=True, slots=True)
class OpsInputs:
    """Which node and which proxy an ops command looks at, and with which objects."""

    state_dir: Path = DEFAULT_STATE_DIR
    config_path: Path | None = None
    source: Path | None = None
    netns: str | None = None  # the named network namespace to look into; None: ours
    hostname: str | None = None  # --hostname-override
    admin: AdminTarget | None = None  # None: the state dir's unix socket
    # Learnt from the running kproxy by with_running_proxy().
    status: dict[str, Any] | None = None
    notes: tuple[str, ...] = ()

    @property
    def admin_target(self) -> AdminTarget:
        from kproxy.server.admin import AdminTarget

        return self.admin or AdminTarget.of(self.state_dir)

    @property
    def node_name(self) -> str:
        return node_name_of(self.hostname, self.status)

    def access(self) -> NodeAccess:
        """Reads of the node, inside `netns` when one is given."""
        from kproxy.ops.preflight.access import NodeAccess

        return NodeAccess(netns=self.netns)


def ops_inputs(
    *,
    state_dir: Path = DEFAULT_STATE_DIR,
    config_path: Path | None = None,
    source: Path | None = None,
    netns: str | None = None,
    hostname: str | None = None,
    admin_address: str | None = None,
    token_file: Path | None = None,
) -> OpsInputs:
    """The shared options of an ops command, checked; UsageError names a bad one."""
    from kproxy.server.admin import AdminTarget

    if netns is not None and not Path("/run/netns", netns).exists():
        raise UsageError(f"--netns: no network namespace {netns!r} (see `ip netns list`)")
    try:
        admin = AdminTarget.of(state_dir, admin_address, token_file)
    except ValueError as err:
        raise UsageError(f"--admin-address: {err}") from None
    return OpsInputs(state_dir, config_path, source, netns, hostname, admin)


def node_name_of(hostname: str | None, status: Mapping[str, Any] | None = None) -> str:
    """--hostname-override, else the running kproxy's node, else this machine's hostname."""
    return (hostname or (status or {}).get("node") or socket.gethostname()).lower()


def running_status(inputs: OpsInputs) -> dict[str, Any] | None:
    """The running kproxy's status over its admin endpoint (None: nothing answers)."""
    from kproxy.server.admin import AdminUnavailable, call

    try:
        st = call(inputs.admin_target, {"op": "status"}, timeout=10)
    except (AdminUnavailable, OSError, ValueError):
        return None
    return st if st.get("ok", True) else None


def with_running_proxy(inputs: OpsInputs) -> OpsInputs:
    """`inputs` with the running kproxy's status, and its namespace, --config and --source
    where none is given; the notes say what came from it. UsageError for a missing file or
    a namespace without a name."""
    status = running_status(inputs)
    netns, config_path, source = inputs.netns, inputs.config_path, inputs.source
    notes = []
    if status is not None and isinstance(status.get("pid"), int):
        from kproxy.ops.preflight.run import ForeignNetns, daemon_inputs, daemon_netns

        if netns is None:
            try:
                netns = daemon_netns(status["pid"])
            except ForeignNetns as err:
                raise UsageError(str(err)) from None
            if netns is not None:
                notes.append(f"checked in network namespace {netns}: the running kproxy's")
        found = daemon_inputs(status["pid"])
        if config_path is None and "config" in found:
            config_path = found["config"]
            notes.append(f"--config {config_path}: the running kproxy's")
        if source is None and "source" in found:
            source = found["source"]
            notes.append(f"--source {source}: the running kproxy's")
    elif status is None:
        notes.append(
            f"no kproxy answers at {inputs.state_dir}: the current mode is read from the kernel"
        )
    for path, flag in ((config_path, "--config"), (source, "--source")):
        if path is not None and not path.exists():
            raise UsageError(f"{flag}: {path} does not exist")
    return replace(
        inputs,
        config_path=config_path,
        source=source,
        netns=netns,
        status=status,
        notes=tuple(notes),
    )
