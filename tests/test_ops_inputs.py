"""OpsInputs: the ops commands' shared options, checked once, and what the running kproxy adds."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kproxy.cli_common import UsageError
from kproxy.ops.inputs import OpsInputs, node_name_of, ops_inputs, with_running_proxy


def test_a_namespace_that_does_not_exist_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="--netns: no network namespace 'kp-no-such-ns'"):
        ops_inputs(netns="kp-no-such-ns")


def test_an_admin_address_needs_a_readable_token(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="--admin-address: cannot read the admin token"):
        ops_inputs(state_dir=tmp_path, admin_address="127.0.0.1:10259")
    (tmp_path / "admin.token").write_text("secret\n")
    inputs = ops_inputs(state_dir=tmp_path, admin_address="127.0.0.1:10259")
    assert inputs.admin_target.address == ("127.0.0.1", 10259)
    assert inputs.admin_target.token == "secret"


def test_without_an_address_the_state_dirs_socket_is_asked(tmp_path: Path) -> None:
    assert ops_inputs(state_dir=tmp_path).admin_target.socket == tmp_path / "admin.sock"
    assert OpsInputs(state_dir=tmp_path).admin_target.socket == tmp_path / "admin.sock"


def test_the_node_name_is_the_override_then_the_proxys_then_this_hosts() -> None:
    assert node_name_of("Node-A", {"node": "node-b"}) == "node-a"
    assert node_name_of(None, {"node": "Node-B"}) == "node-b"
    assert node_name_of(None, None) == socket.gethostname().lower()
    assert OpsInputs(hostname="N1").node_name == "n1"


def test_without_a_running_proxy_only_the_given_inputs_count(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("")
    given = ops_inputs(state_dir=tmp_path, config_path=config, hostname="n1")
    inputs = with_running_proxy(given)
    assert inputs.status is None and inputs.config_path == config and inputs.source is None
    assert inputs.notes == (
        f"no kproxy answers at {tmp_path}: the current mode is read from the kernel",
    )
    assert inputs.access().netns is None and inputs.node_name == "n1"
    with pytest.raises(UsageError, match="--source: .* does not exist"):
        with_running_proxy(ops_inputs(state_dir=tmp_path, source=tmp_path / "missing"))
