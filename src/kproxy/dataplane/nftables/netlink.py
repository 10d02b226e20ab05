"""A minimal nf_tables netlink client for the operations nft 1.0.6 makes expensive.

`nft` (1.0.6) fills its object cache before evaluating `delete element|chain|set` and
`add element|rule`: it dumps every chain and every set of the table from the kernel, which
at 10,000 services (110,000 chains) costs ~0.9 s per invocation (see bench/nft_incremental.py).
Deleting objects by name and adding map elements need no such cache, so kproxy sends those
messages itself, in one atomic nfnetlink batch:

* DELCHAIN / DELSET by name (stale chains and affinity sets);
* NEWSETELEM / DELSETELEM for kproxy's fixed sets and maps, whose key types it knows
  (ipv4_addr, inet_proto, inet_service, a numgen value and their concatenations), with
  verdicts or data of those types as values.

Rules are never written here: their bytecode is nft's business.

The socket is opened inside the target network namespace by a short-lived thread that
setns()es into /run/netns/NAME (only that thread changes namespace; the socket stays bound
to the namespace it was created in).
"""

from __future__ import annotations

import errno
import functools
import ipaddress
import os
import socket
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Final

from kproxy.host import netlink_fault
from kproxy.host.netlink_wait import answer_timeout
from kproxy.host.netns import socket_in_netns

NETLINK_NETFILTER: Final = 12
NFNL_SUBSYS_NFTABLES: Final = 10
NFNL_MSG_BATCH_BEGIN: Final = 0x10
NFNL_MSG_BATCH_END: Final = 0x11
NLMSG_ERROR: Final = 2
NLMSG_DONE: Final = 3
NLM_F_REQUEST: Final = 0x1
NLM_F_ACK: Final = 0x4
NLM_F_DUMP: Final = 0x300
NLM_F_CREATE: Final = 0x400
NLA_F_NESTED: Final = 0x8000
SO_SNDBUFFORCE: Final = 32

NFT_MSG_NEWTABLE: Final = 0
NFT_MSG_GETTABLE: Final = 1
NFT_MSG_NEWCHAIN: Final = 3
NFT_MSG_GETCHAIN: Final = 4
NFT_MSG_DELCHAIN: Final = 5
NFT_MSG_NEWRULE: Final = 6
NFT_MSG_GETRULE: Final = 7
NFT_MSG_DELRULE: Final = 8
NFT_MSG_NEWSET: Final = 9
NFT_MSG_GETSET: Final = 10
NFT_MSG_DELSET: Final = 11
NFT_MSG_NEWSETELEM: Final = 12
NFT_MSG_GETSETELEM: Final = 13
NFT_MSG_DELSETELEM: Final = 14
NFT_MSG_NEWGEN: Final = 15
NFT_MSG_GETGEN: Final = 16

NFTA_TABLE_NAME: Final = 1
NFTA_GEN_ID: Final = 1
NFTA_CHAIN_TABLE: Final = 1
NFTA_CHAIN_NAME: Final = 3
NFTA_RULE_TABLE: Final = 1
NFTA_RULE_CHAIN: Final = 2
NFTA_SET_TABLE: Final = 1
NFTA_SET_NAME: Final = 2
NFTA_SET_FLAGS: Final = 3
NFT_SET_ANONYMOUS: Final = 0x1
NFT_SET_MAP: Final = 0x8
NFTA_SET_ELEM_LIST_TABLE: Final = 1
NFTA_SET_ELEM_LIST_SET: Final = 2
NFTA_SET_ELEM_LIST_ELEMENTS: Final = 3
NFTA_LIST_ELEM: Final = 1
NFTA_SET_ELEM_KEY: Final = 1
NFTA_SET_ELEM_DATA: Final = 2
NFTA_SET_ELEM_USERDATA: Final = 6
NFTA_DATA_VALUE: Final = 1
NFTA_DATA_VERDICT: Final = 2
NFTA_VERDICT_CODE: Final = 1
NFTA_VERDICT_CHAIN: Final = 2
NFTNL_UDATA_SET_ELEM_COMMENT: Final = 0

FAMILIES: Final = {"ip": socket.AF_INET, "ip6": socket.AF_INET6, "inet": 1}
VERDICTS: Final = {"drop": 0, "accept": 1, "continue": -1, "return": -5}
JUMPS: Final = {"jump": -3, "goto": -4}
PROTOCOLS: Final = {"tcp": 6, "udp": 17, "sctp": 132}


class NetlinkError(Exception):
    def __init__(self, message: str, *, errno_: int = 0, index: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno_
        self.index = index


def _attr(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)


def _nested(kind: int, *attrs: bytes) -> bytes:
    return _attr(kind | NLA_F_NESTED, b"".join(attrs))


def _string(kind: int, text: str) -> bytes:
    return _attr(kind, text.encode() + b"\0")


class _Memo(dict[str, bytes]):
    """value text -> field bytes, computed once (for fields with few distinct values)."""

    def __init__(self, fn: Callable[[str], bytes]) -> None:
        super().__init__()
        self.fn = fn

    def __missing__(self, value: str) -> bytes:
        field = self[value] = self.fn(value)
        return field


_PORT = struct.Struct("!H")
_NUMGEN = struct.Struct("=I")  # numgen writes its register in host byte order
# type -> (value text -> field bytes, field length). Addresses are not memoised (there are
# as many as endpoints); protocols, ports and numgen slots are few.
_FIELDS: Final[dict[str, tuple[Callable[[str], bytes], int]]] = {
    "ipv4_addr": (functools.partial(socket.inet_pton, socket.AF_INET), 4),
    "ipv6_addr": (lambda v: ipaddress.IPv6Address(v).packed, 16),
    "inet_proto": (lambda v: bytes([PROTOCOLS[v] if v in PROTOCOLS else int(v)]), 1),
    "inet_service": (lambda v: _PORT.pack(int(v)), 2),
    "numgen": (lambda v: _NUMGEN.pack(int(v)), 4),
}
_MEMO_TYPES: Final = ("inet_proto", "inet_service", "numgen")


def _padded(type_: str) -> Callable[[str], bytes]:
    fn, size = _FIELDS[type_]
    pad = b"\0" * (-size % 4)
    if type_ in _MEMO_TYPES:
        return _Memo((lambda v: fn(v) + pad) if pad else fn).__getitem__
    return (lambda v: fn(v) + pad) if pad else fn


@functools.lru_cache(maxsize=64)
def key_encoder(type_: str) -> tuple[Callable[[str], bytes], int]:
    """(encoder, length) for keys of `type_` in the kernel's layout: concatenated fields
    each padded to 4 bytes. Made once per type: a full sync encodes every element, so the
    common arities are unrolled."""
    types = [t.strip() for t in type_.split(".")]
    for t in types:
        if t not in _FIELDS:
            raise ValueError(f"key type {t!r} is not supported")
    if len(types) == 1:
        return _FIELDS[types[0]][0], _FIELDS[types[0]][1]
    length = sum(_FIELDS[t][1] + (-_FIELDS[t][1] % 4) for t in types)
    fns = [_padded(t) for t in types]
    if len(fns) == 2:
        f0, f1 = fns

        def two(key: str) -> bytes:
            a, b = key.split(" . ")
            return f0(a) + f1(b)

        return two, length
    if len(fns) == 3:
        f0, f1, f2 = fns

        def three(key: str) -> bytes:
            a, b, c = key.split(" . ")
            return f0(a) + f1(b) + f2(c)

        return three, length
    if len(fns) == 4:
        f0, f1, f2, f3 = fns

        def four(key: str) -> bytes:
            a, b, c, d = key.split(" . ")
            return f0(a) + f1(b) + f2(c) + f3(d)

        return four, length

    def many(key: str) -> bytes:
        values = key.split(" . ")
        if len(values) != len(fns):
            raise ValueError
        return b"".join([f(v) for f, v in zip(fns, values, strict=True)])

    return many, length


def encode_key(type_: str, key: str) -> bytes:
    """A set key in the kernel's layout: concatenated fields each padded to 4 bytes."""
    encode = key_encoder(type_)[0]
    try:
        return encode(key.strip())
    except (OSError, ValueError, KeyError) as err:  # inet_pton, unpacking, int(), ...
        raise ValueError(f"key {key!r} does not fit type {type_!r}") from err


@functools.lru_cache(maxsize=4096)
def encode_verdict(value: str) -> bytes:
    verb, _, chain = value.partition(" ")
    if verb in JUMPS:
        return _nested(
            NFTA_DATA_VERDICT,
            _attr(NFTA_VERDICT_CODE, struct.pack("!i", JUMPS[verb])),
            _string(NFTA_VERDICT_CHAIN, chain),
        )
    if verb in VERDICTS and not chain:
        return _nested(
            NFTA_DATA_VERDICT, _attr(NFTA_VERDICT_CODE, struct.pack("!i", VERDICTS[verb]))
        )
    raise ValueError(f"verdict {value!r} is not supported")


PROTOCOL_NAMES: Final = {number: name for name, number in PROTOCOLS.items()}
VERDICT_NAMES: Final = {code: verb for verb, code in (VERDICTS | JUMPS).items()}
_DECODERS: Final[dict[str, tuple[Callable[[bytes], str], int]]] = {
    "ipv4_addr": (functools.partial(socket.inet_ntop, socket.AF_INET), 4),
    "ipv6_addr": (functools.partial(socket.inet_ntop, socket.AF_INET6), 16),
    "inet_proto": (lambda b: PROTOCOL_NAMES.get(b[0], str(b[0])), 1),
    "inet_service": (lambda b: str(_PORT.unpack(b)[0]), 2),
    "numgen": (lambda b: str(_NUMGEN.unpack(b)[0]), 4),
}


@functools.lru_cache(maxsize=64)
def key_decoder(type_: str) -> Callable[[bytes], str]:
    """The inverse of key_encoder: a key in the kernel's layout -> nft's text form
    ("10.96.0.10 . tcp . 80"), as `nft list` writes it."""
    types = [t.strip() for t in type_.split(".")]
    for t in types:
        if t not in _DECODERS:
            raise ValueError(f"key type {t!r} is not supported")
    if len(types) == 1:
        return _DECODERS[types[0]][0]
    fields: list[tuple[Callable[[bytes], str], int, int]] = []
    offset = 0
    for t in types:
        fn, size = _DECODERS[t]
        fields.append((fn, offset, offset + size))
        offset += size + (-size % 4)

    def concat(raw: bytes) -> str:
        return " . ".join([fn(raw[a:b]) for fn, a, b in fields])

    return concat


def _attr_spans(data: bytes, start: int, end: int) -> dict[int, tuple[int, int]]:
    """attribute type -> (payload start, payload end) of the attributes in data[start:end]."""
    out: dict[int, tuple[int, int]] = {}
    unpack = struct.unpack_from
    while start + 4 <= end:
        length, kind = unpack("=HH", data, start)
        if length < 4:
            break
        out[kind & 0x3FFF] = (start + 4, start + length)
        start += length + (-length % 4)
    return out


def decode_elements(
    attrs: bytes, key_type: str, data_type: str | None
) -> Iterator[tuple[str, str, str | None]]:
    """(key, value, comment) of the elements in one NEWSETELEM message's attributes, in the
    text form set_elements takes (value "" for sets, a verdict for verdict maps)."""
    spans = _attr_spans(attrs, 0, len(attrs))
    if NFTA_SET_ELEM_LIST_ELEMENTS not in spans:
        return
    key_of = key_decoder(key_type)
    data_of = key_decoder(data_type) if data_type is not None else None
    a, b = spans[NFTA_SET_ELEM_LIST_ELEMENTS]
    while a + 4 <= b:
        length, _ = struct.unpack_from("=HH", attrs, a)
        if length < 4:
            break
        elem = _attr_spans(attrs, a + 4, a + length)
        a += length + (-length % 4)
        if NFTA_SET_ELEM_KEY not in elem:
            continue
        ks, ke = elem[NFTA_SET_ELEM_KEY]
        vs, ve = _attr_spans(attrs, ks, ke)[NFTA_DATA_VALUE]
        key = key_of(attrs[vs:ve])
        value = ""
        if NFTA_SET_ELEM_DATA in elem:
            ds, de = elem[NFTA_SET_ELEM_DATA]
            data = _attr_spans(attrs, ds, de)
            if NFTA_DATA_VALUE in data and data_of is not None:
                vs, ve = data[NFTA_DATA_VALUE]
                value = data_of(attrs[vs:ve])
            elif NFTA_DATA_VERDICT in data:
                verdict = _attr_spans(attrs, *data[NFTA_DATA_VERDICT])
                cs, _ = verdict[NFTA_VERDICT_CODE]
                (code,) = struct.unpack_from("!i", attrs, cs)
                value = VERDICT_NAMES.get(code, str(code))
                chain = _attr_string(attrs, *data[NFTA_DATA_VERDICT], NFTA_VERDICT_CHAIN)
                if chain is not None:
                    value += " " + chain
        comment = None
        if NFTA_SET_ELEM_USERDATA in elem:
            us, ue = elem[NFTA_SET_ELEM_USERDATA]
            while us + 2 <= ue:  # type-length-value records
                kind, size = attrs[us], attrs[us + 1]
                if kind == NFTNL_UDATA_SET_ELEM_COMMENT:
                    comment = attrs[us + 2 : us + 2 + size].rstrip(b"\0").decode()
                us += 2 + size
        yield key, value, comment


@dataclass(frozen=True, slots=True)
class Op:
    """One message of a batch, with the text an error message should name."""

    msg_type: int
    flags: int
    payload: bytes
    describe: str


def delete_chain(table: str, name: str) -> Op:
    payload = _string(NFTA_CHAIN_TABLE, table) + _string(NFTA_CHAIN_NAME, name)
    return Op(NFT_MSG_DELCHAIN, 0, payload, f"delete chain {table} {name}")


def flush_chain(table: str, name: str) -> Op:
    """DELRULE naming a chain and no rule: every rule of the chain goes."""
    payload = _string(NFTA_RULE_TABLE, table) + _string(NFTA_RULE_CHAIN, name)
    return Op(NFT_MSG_DELRULE, 0, payload, f"flush chain {table} {name}")


def delete_set(table: str, name: str) -> Op:
    payload = _string(NFTA_SET_TABLE, table) + _string(NFTA_SET_NAME, name)
    return Op(NFT_MSG_DELSET, 0, payload, f"delete set {table} {name}")


def set_elements(
    table: str,
    container: str,
    key_type: str,
    elements: list[tuple[str, str, str | None]],
    *,
    delete: bool,
    data_type: str | None = None,
) -> Op:
    """NEWSETELEM / DELSETELEM for (key, value, comment) elements; value "" for sets, a
    verdict for verdict maps, data of `data_type` for other maps."""
    key_fn, key_len = key_encoder(key_type)
    # Every key (and data value) has its type's length: their attribute headers are fixed.
    key_pad = b"\0" * (-key_len % 4)
    key_head = struct.pack(
        "=HHHH", 8 + key_len + len(key_pad), NFTA_SET_ELEM_KEY | NLA_F_NESTED, 4 + key_len, 1
    )
    data_fn = data_head = None
    data_pad = b""
    if data_type is not None:
        data_fn, data_len = key_encoder(data_type)
        data_pad = b"\0" * (-data_len % 4)
        data_head = struct.pack(
            "=HHHH",
            8 + data_len + len(data_pad),
            NFTA_SET_ELEM_DATA | NLA_F_NESTED,
            4 + data_len,
            1,
        )
    elem_head = struct.Struct("=HH")
    list_elem = NFTA_LIST_ELEM | NLA_F_NESTED
    # Elements without a comment whose value is data (or absent) all have one length: their
    # element header is a constant, and each element is a few pieces joined once at the end
    # (a full sync encodes ~200,000 of them).
    key_only_len = 4 + len(key_head) + key_len + len(key_pad)
    key_only = elem_head.pack(key_only_len, list_elem) + key_head
    with_data = after_key = b""
    if data_fn is not None and data_head is not None:
        with_data_len = key_only_len + len(data_head) + data_len + len(data_pad)
        with_data = elem_head.pack(with_data_len, list_elem) + key_head
        after_key = key_pad + data_head
    items: list[bytes] = []
    add = items.extend
    try:
        for key, value, comment in elements:
            if comment is None and (delete or not value):
                add((key_only, key_fn(key), key_pad))
                continue
            if comment is None and data_fn is not None:
                add((with_data, key_fn(key), after_key, data_fn(value), data_pad))
                continue
            body = key_head + key_fn(key) + key_pad
            if not delete:
                if value and data_fn is not None:
                    body += data_head + data_fn(value) + data_pad  # type: ignore[operator]
                elif value:
                    body += _verdict_data(value)
                if comment is not None:
                    raw = comment.encode() + b"\0"
                    udata = bytes([NFTNL_UDATA_SET_ELEM_COMMENT, len(raw)]) + raw
                    body += _attr(NFTA_SET_ELEM_USERDATA, udata)
            items.append(elem_head.pack(4 + len(body), list_elem) + body)
    except (OSError, ValueError, KeyError) as err:  # inet_pton, unpacking, int(), ...
        raise ValueError(f"an element of {container} does not fit its type: {err}") from err
    payload = (
        _string(NFTA_SET_ELEM_LIST_TABLE, table)
        + _string(NFTA_SET_ELEM_LIST_SET, container)
        + _nested(NFTA_SET_ELEM_LIST_ELEMENTS, *items)
    )
    verb = "delete" if delete else "add"
    keys = ", ".join(k for k, _, _ in elements)
    return Op(
        NFT_MSG_DELSETELEM if delete else NFT_MSG_NEWSETELEM,
        0 if delete else NLM_F_CREATE,
        payload,
        f"{verb} element {table} {container} {{ {keys} }}",
    )


@functools.lru_cache(maxsize=4096)
def _verdict_data(value: str) -> bytes:
    return _nested(NFTA_SET_ELEM_DATA, encode_verdict(value))


def flush_set(table: str, name: str) -> Op:
    """DELSETELEM naming a set and no elements: every element goes."""
    payload = _string(NFTA_SET_ELEM_LIST_TABLE, table) + _string(NFTA_SET_ELEM_LIST_SET, name)
    return Op(NFT_MSG_DELSETELEM, 0, payload, f"flush set {table} {name}")


def open_socket(netns: str | None) -> socket.socket:
    """A NETLINK_NETFILTER socket in `netns` (None: the current namespace)."""
    return socket_in_netns(netns, socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)


class NftNetlink:
    """Send batches of Ops to nf_tables; every batch commits atomically or not at all."""

    def __init__(self, netns: str | None = None, *, family: str = "ip") -> None:
        self.netns = netns
        self.family = FAMILIES[family]
        self._sock: socket.socket | None = None
        self._seq = 1
        self._sndbuf = 1 << 16

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            self._sndbuf = 1 << 16

    def _socket(self) -> socket.socket:
        if self._sock is None:
            sock = open_socket(self.netns)
            sock.bind((0, 0))
            sock.settimeout(answer_timeout())
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            self._sock = sock
        return self._sock

    def _header(
        self, msg_type: int, flags: int, length: int, seq: int, family: int, res_id: int = 0
    ) -> bytes:
        return struct.pack("=IHHII", 16 + 4 + length, msg_type, flags, seq, 0) + struct.pack(
            "=BBH", family, 0, socket.htons(res_id)
        )

    def run(self, ops: list[Op]) -> None:
        if not ops:
            return
        if netlink_fault.CONTROL is not None:
            netlink_fault.inject("nftables")
        sock = self._socket()
        first = self._seq
        parts = [
            self._header(NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, 0, first, 0, NFNL_SUBSYS_NFTABLES)
        ]
        seqs: dict[int, int] = {}
        for i, op in enumerate(ops):
            seq = first + 1 + i
            seqs[seq] = i
            msg_type = (NFNL_SUBSYS_NFTABLES << 8) | op.msg_type
            # Only the last message asks for an ACK: a failing one is answered anyway (with
            # its error), and 2,000 ACKs cost 2,000 recv() calls (seconds at 10,000 services).
            flags = NLM_F_REQUEST | op.flags | (NLM_F_ACK if i == len(ops) - 1 else 0)
            parts.append(self._header(msg_type, flags, len(op.payload), seq, self.family))
            parts.append(op.payload)
        end = first + 1 + len(ops)
        parts.append(
            self._header(NFNL_MSG_BATCH_END, NLM_F_REQUEST, 0, end, 0, NFNL_SUBSYS_NFTABLES)
        )
        self._seq = end + 1
        data = b"".join(parts)
        if len(data) > self._sndbuf:
            # A batch is one send: a full sync's elements are megabytes. SO_SNDBUFFORCE
            # (CAP_NET_ADMIN) passes net.core.wmem_max, as nft does for big batches.
            try:
                sock.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, len(data))
            except OSError:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, len(data))
            self._sndbuf = len(data)
        timeout = answer_timeout(len(data))
        sock.settimeout(timeout)
        sock.send(data)
        pending = {end - 1}  # the ACK of the last message (or any error) ends the batch
        errors: list[tuple[int, int]] = []
        while pending:
            try:
                data = sock.recv(1 << 16)
            except TimeoutError as err:
                raise NetlinkError(f"no answer from nf_tables within {timeout:.0f} s") from err
            offset = 0
            while offset + 16 <= len(data):
                length, msg_type, _, seq, _ = struct.unpack_from("=IHHII", data, offset)
                if seq not in seqs:
                    pass  # a late answer to an earlier batch
                elif msg_type == NLMSG_ERROR:
                    (code,) = struct.unpack_from("=i", data, offset + 16)
                    if code:
                        errors.append((seq, -code))
                        # A failed batch is aborted: no further acks will come.
                        pending.clear()
                    pending.discard(seq)
                elif msg_type == NLMSG_DONE:
                    pending.clear()
                offset += max(length, 16) + (-length % 4)
        if errors:
            seq, errno_ = errors[0]
            index = seqs.get(seq)
            what = ops[index].describe if index is not None else "the batch"
            raise NetlinkError(
                f"nf_tables rejected {what}: {os.strerror(errno_)}", errno_=errno_, index=index
            )

    def _tables(self, flags: int, family: int, payload: bytes = b"") -> Iterator[tuple[int, bytes]]:
        """Send one GETTABLE request; yield (nfgen family, attributes) of each table in the
        answer. Ends at the kernel's ACK or DONE; an error answer raises NetlinkError."""
        return self._get(NFT_MSG_GETTABLE, NFT_MSG_NEWTABLE, flags, family, payload)

    def _get(
        self, request: int, answer: int, flags: int, family: int, payload: bytes = b""
    ) -> Iterator[tuple[int, bytes]]:
        """One GET request (a dump with NLM_F_DUMP); yield (nfgen family, attributes) of
        each `answer` message until the kernel's ACK or DONE."""
        sock = self._socket()
        timeout = answer_timeout()
        sock.settimeout(timeout)
        seq = self._seq
        self._seq += 1
        msg_type = (NFNL_SUBSYS_NFTABLES << 8) | request
        what = {
            NFT_MSG_GETTABLE: "get table",
            NFT_MSG_GETCHAIN: "get chain",
            NFT_MSG_GETGEN: "get generation",
            NFT_MSG_GETSETELEM: "get elements",
            NFT_MSG_GETSET: "get sets",
            NFT_MSG_GETRULE: "get rule",
        }.get(request, "get")
        sock.send(self._header(msg_type, flags, len(payload), seq, family) + payload)
        while True:
            try:
                data = sock.recv(1 << 20)
            except TimeoutError as err:
                raise NetlinkError(f"no answer from nf_tables within {timeout:.0f} s") from err
            offset = 0
            while offset + 16 <= len(data):
                length, kind, _, got_seq, _ = struct.unpack_from("=IHHII", data, offset)
                if got_seq == seq:
                    if kind == NLMSG_DONE:
                        return
                    if kind == NLMSG_ERROR:
                        (code,) = struct.unpack_from("=i", data, offset + 16)
                        if code == 0:
                            return  # the ACK of a non-dump request
                        raise NetlinkError(f"nf_tables: {what}: {os.strerror(-code)}", errno_=-code)
                    if kind == (NFNL_SUBSYS_NFTABLES << 8) | answer:
                        yield data[offset + 16], data[offset + 20 : offset + length]
                offset += max(length, 16) + (-length % 4)

    def table_exists(self, table: str) -> bool:
        """Does the table exist? One GETTABLE request: nft itself would dump every object
        of every table first (0.9 s at 1,000 services with nft 1.0.6)."""
        payload = _string(NFTA_TABLE_NAME, table)
        try:
            return any(True for _ in self._tables(NLM_F_REQUEST | NLM_F_ACK, self.family, payload))
        except NetlinkError as err:
            if err.errno == errno.ENOENT:
                return False
            raise

    def list_tables(self) -> list[tuple[int, str]]:
        """(address family, name) of every nf_tables table in the namespace, from one dump
        request (nft 1.0.6 `list tables` first dumps every object of every table)."""
        found: list[tuple[int, str]] = []
        for family, attrs in self._tables(NLM_F_REQUEST | NLM_F_DUMP, socket.AF_UNSPEC):
            name = _attr_string(attrs, 0, len(attrs), NFTA_TABLE_NAME)
            if name is not None:
                found.append((family, name))
        return found

    def generation(self) -> int:
        """The namespace's nf_tables ruleset generation: every committed batch, by anyone, of
        any family, adds one; reading it costs one small request at any ruleset size."""
        for _, attrs in self._get(
            NFT_MSG_GETGEN, NFT_MSG_NEWGEN, NLM_F_REQUEST | NLM_F_ACK, socket.AF_UNSPEC
        ):
            value = _attr_bytes(attrs, 0, len(attrs), NFTA_GEN_ID)
            if value is not None and len(value) >= 4:
                return int(struct.unpack_from("!I", value)[0])
        raise NetlinkError("nf_tables: get generation: no generation in the answer")

    def chains_by_table(self) -> dict[str, list[str]]:
        """Every chain name of this client's family, per table, from one dump (names only:
        110,000 chains of iptables-nft in ~1.3 s, where `iptables-nft-save` takes 14 s).
        The kernel's chain dump does not filter by table, so one dump serves them all."""
        found: dict[str, list[str]] = {}
        for _, attrs in self._get(
            NFT_MSG_GETCHAIN, NFT_MSG_NEWCHAIN, NLM_F_REQUEST | NLM_F_DUMP, self.family
        ):
            table = _attr_string(attrs, 0, len(attrs), NFTA_CHAIN_TABLE)
            name = _attr_string(attrs, 0, len(attrs), NFTA_CHAIN_NAME)
            if table is not None and name is not None:
                found.setdefault(table, []).append(name)
        return found

    def sets_by_table(self) -> dict[str, list[str]]:
        """The named sets (not maps, not anonymous sets) of this client's family, per table,
        from one dump: nft 1.0.6 `list sets` first fetches every element of every set."""
        found: dict[str, list[str]] = {}
        for _, attrs in self._get(
            NFT_MSG_GETSET, NFT_MSG_NEWSET, NLM_F_REQUEST | NLM_F_DUMP, self.family
        ):
            table = _attr_string(attrs, 0, len(attrs), NFTA_SET_TABLE)
            name = _attr_string(attrs, 0, len(attrs), NFTA_SET_NAME)
            raw = _attr_bytes(attrs, 0, len(attrs), NFTA_SET_FLAGS)
            flags = struct.unpack("!I", raw)[0] if raw is not None and len(raw) == 4 else 0
            if (
                table is not None
                and name is not None
                and not flags & (NFT_SET_ANONYMOUS | NFT_SET_MAP)
            ):
                found.setdefault(table, []).append(name)
        return found

    def elements(
        self, table: str, name: str, key_type: str, data_type: str | None = None
    ) -> list[tuple[str, str, str | None]]:
        """(key, value, comment) of every element of a set or map, from one dump (`nft -j
        list` of 200,000 elements takes seconds to print and parse)."""
        payload = _string(NFTA_SET_ELEM_LIST_TABLE, table) + _string(NFTA_SET_ELEM_LIST_SET, name)
        found: list[tuple[str, str, str | None]] = []
        for _, attrs in self._get(
            NFT_MSG_GETSETELEM,
            NFT_MSG_NEWSETELEM,
            NLM_F_REQUEST | NLM_F_DUMP,
            self.family,
            payload,
        ):
            found += decode_elements(attrs, key_type, data_type)
        return found

    def chains_with_rules(self, table: str) -> set[str]:
        """The chains of `table` that hold at least one rule, from one rule dump (the
        kernel filters it by table)."""
        found: set[str] = set()
        payload = _string(NFTA_RULE_TABLE, table)
        for _, attrs in self._get(
            NFT_MSG_GETRULE, NFT_MSG_NEWRULE, NLM_F_REQUEST | NLM_F_DUMP, self.family, payload
        ):
            name = _attr_string(attrs, 0, len(attrs), NFTA_RULE_CHAIN)
            if name is not None:
                found.add(name)
        return found


def _attr_bytes(data: bytes, start: int, end: int, kind: int) -> bytes | None:
    """The payload of attribute `kind` among the netlink attributes in data[start:end]."""
    while start + 4 <= end:
        length, attr = struct.unpack_from("=HH", data, start)
        if length < 4:
            return None
        if attr & 0x3FFF == kind:
            return data[start + 4 : start + length]
        start += length + (-length % 4)
    return None


def _attr_string(data: bytes, start: int, end: int, kind: int) -> str | None:
    """The string attribute `kind` among the netlink attributes in data[start:end]."""
    value = _attr_bytes(data, start, end, kind)
    return None if value is None else value.rstrip(b"\0").decode()
