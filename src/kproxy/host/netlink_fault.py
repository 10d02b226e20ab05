"""A test's fault in kproxy's own netlink batches (nf_tables, IPVS), which no wrapper of a
command-line tool can reach. The tools' faults come from wrappers put first on PATH
(kproxy.lab.faults); this hook is off, and costs one comparison per batch, unless the
process starts with KPROXY_NETLINK_FAULT naming a control file. Then each batch reads the
file; a line `KIND ACTION [SECONDS]` (KIND: nftables, ipvs or any) applies:

  fail          the batch is refused before it is sent (EIO)
  hang SECONDS  it gets no answer for SECONDS (default: just past the bound of
                kproxy.host.netlink_wait), then fails as an unanswered batch does

A missing or empty file means no fault, so a test switches faults on and off while
kproxy runs."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path
from typing import Final

from kproxy.host.netlink_wait import answer_timeout

ENV: Final = "KPROXY_NETLINK_FAULT"
CONTROL: Final = os.environ.get(ENV) or None


def inject(kind: str) -> None:
    """Raise the fault the control file names for a batch of `kind`; return if none."""
    if CONTROL is None:
        return
    try:
        words = Path(CONTROL).read_text().split()
    except OSError:
        return
    if len(words) < 2 or words[0] not in (kind, "any"):
        return
    action = words[1]
    if action == "fail":
        raise OSError(errno.EIO, f"{kind} netlink batch refused (injected fault)")
    if action == "hang":
        time.sleep(float(words[2]) if len(words) > 2 else answer_timeout() + 1)
        raise OSError(errno.ETIMEDOUT, f"{kind} netlink batch unanswered (injected fault)")
