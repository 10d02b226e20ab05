"""Datagrams to retiring UDP/SCTP virtual servers wait while IPVS lets go of their flows.

Why (seen with `conntrack -E` in the UML switch test): with net/ipv4/vs/conntrack=1, IPVS
deletes the conntrack entry of a flow's tuple (client -> virtual address) when it expires
its own connection entry, whichever mode's entry holds that tuple by then. A UDP client
that keeps its source port is one such flow for as long as it sends. Deleting the flow's
conntrack entry first moves its next datagram to the new mode (a NEW entry, DNATed), but
deleting the virtual server afterwards makes IPVS expire its entry (expire_nodest_conn)
and so delete the new mode's entry: a reply on its way back then passes untranslated and
the client drops it, and the entry that reply leaves behind can make conntrack remap the
client's port later. Deleting the virtual server first drops the datagrams that arrive
before IPVS has expired its entries.

So while the virtual servers that carry datagram flows go, datagrams to them wait in an
NFQUEUE (raw PREROUTING and OUTPUT: before conntrack): replies to what IPVS forwarded before
come back through its entries (REPLY_GRACE), the virtual servers go, IPVS expires its
entries and deletes their conntrack entries (should some outlive EXPIRY_TIMEOUT, kproxy
deletes the flows' conntrack entries itself). Released, the
held datagrams are NEW to conntrack and the new mode takes them, REPLY_GRACE and a few
milliseconds late. Should the hold be impossible (no nfnetlink_queue, the queue taken),
the switch goes on without it and says so.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping

from kproxy.dataplane.base import OwnedObject
from kproxy.dataplane.iptables.backend import IptablesBackend, IptablesError
from kproxy.dataplane.ipvs.plan import VSKey
from kproxy.dataplane.nfqueue import PacketHold

log = logging.getLogger("kproxy.ipvs")

HOLD_QUEUE = 2900
HOLD_COMMENT = "kproxy: datagrams wait while ipvs mode retires"
HOLD_CHAINS = ("PREROUTING", "OUTPUT")
REPLY_GRACE = 0.25  # seconds for replies to datagrams IPVS forwarded just before
EXPIRY_TIMEOUT = 1.0  # IPVS expires the entries of a deleted server's flows within a jiffy


def hold_objects(where: str, rules: Iterable[str]) -> list[OwnedObject]:
    """The hold rules among raw-table rules of `where` ("iptables-legacy"): outside a
    switch they are what a crash during one left (harmless with --queue-bypass)."""
    return [
        OwnedObject(
            "iptables-rule",
            f"{where} raw",
            rule,
            "kproxy's datagram hold of a switch out of ipvs mode (left by a crash)",
        )
        for rule in sorted(rules)
        if f'"{HOLD_COMMENT}"' in rule
    ]


def hold_input(keys: Iterable[VSKey], verb: str) -> str:
    """raw-table restore input that inserts (-I) or deletes (-D) the hold rules."""
    lines = []
    keys = list(keys)
    for chain in HOLD_CHAINS:
        for k in keys:
            proto = k.protocol.lower()
            lines.append(
                f"{verb} {chain} -d {k.address}/32 -p {proto} -m {proto} --dport {k.port}"
                f' -m comment --comment "{HOLD_COMMENT}"'
                f" -j NFQUEUE --queue-num {HOLD_QUEUE} --queue-bypass"
            )
    return "*raw\n" + "\n".join(lines) + "\nCOMMIT\n"


@contextlib.contextmanager
def held(
    backend: IptablesBackend, netns: str | None, keys: Iterable[VSKey]
) -> Iterator[PacketHold | None]:
    """Datagrams to keys (IPv4) wait until the block ends; None if they cannot be held."""
    keys = [k for k in keys if ":" not in k.address]
    if not keys:
        yield None
        return
    try:
        hold = PacketHold(HOLD_QUEUE, netns).start()
    except OSError as err:
        log.warning("cannot hold datagrams (%s): a reply on its way back may be lost", err)
        yield None
        return
    try:
        backend.restore(hold_input(keys, "-I"))
    except IptablesError as err:
        hold.close()
        log.warning("cannot hold datagrams (%s): a reply on its way back may be lost", err)
        yield None
        return
    began = time.monotonic()
    try:
        yield hold
    finally:
        hold.release()
        waited = time.monotonic() - began
        try:
            backend.restore(hold_input(keys, "-D"))
        except IptablesError as err:
            # --queue-bypass: with nothing bound to the queue the rules let packets pass.
            log.warning("could not remove the datagram hold rules (%s): the next start will", err)
        hold.close()
        log.info(
            "held %d datagrams to %d virtual servers for %.0f ms while ipvs let go of their flows",
            hold.held,
            len(keys),
            waited * 1000,
        )


def wait_expired(
    keys: Iterable[VSKey],
    conns: Callable[[], Mapping[VSKey, int]],
    timeout: float = EXPIRY_TIMEOUT,
    interval: float = 0.01,
) -> bool:
    """Wait until IPVS has no connection entry left for keys (deleted servers: IPVS expires
    them by itself). False if some remain after timeout or the table cannot be read."""
    wanted = set(keys)
    deadline = time.monotonic() + timeout
    while True:
        try:
            left = wanted & {k for k, n in conns().items() if n}
        except OSError as err:
            log.warning("cannot read IPVS connection entries: %s", err)
            return False
        if not left:
            return True
        if time.monotonic() >= deadline:
            log.warning(
                "IPVS still has entries for %s after %.1f s", ", ".join(map(str, left)), timeout
            )
            return False
        time.sleep(interval)
