"""Faults at every step of a sync and of a mode switch, with traffic flowing.

Each external tool (iptables-restore, nft, ...) fails, hangs past the tool timeout or is
killed; kproxy's netlink batches fail or hang; the state dir turns read-only or full;
kproxy itself is killed -9 in the middle of syncs and switches. Every time: the service
nobody changes keeps answering (0 failed requests), the last good rules stay, the fault
shows in `kproxy status`, the metrics and /healthz (503 once a change has waited 2 x
syncPeriod, as upstream), and kproxy recovers by itself once the fault is gone.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kproxy.lab.faults import StateDirFault, ToolFaults
from kproxy.lab.load import LoadHarness
from kproxy.lab.proxy import ProxyProcess
from kproxy.lab.topology import Lab
from tests.support.faults import (
    FaultEnv,
    fault_env,
    iptables_present,
    nftables_present,
    wait_for,
)

pytestmark = pytest.mark.kernel
