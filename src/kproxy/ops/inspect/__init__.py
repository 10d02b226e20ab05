"""`kproxy list` and `kproxy trace`: what the kernel programs, and where a connection goes.

Both read the kernel (read only) through one reader per mode (readers.py): iptables mode
in either backend (iptables_reader.py) and nftables mode (nftables_reader.py); ipvs and
userspace readers register the same way. CLI wiring:

    result = list_services(netns, mode=..., stats=..., rate=..., sort=..., snapshot=...)
    print(result.to_json() if as_json else result.text())

    result = trace(src, dst, port, proto, netns=..., mode=..., from_node=..., snapshot=...)
    print(result.to_json() if as_json else result.text())

ModeSelectionError (a ValueError) means --mode names nothing readable: a user error.
"""

from kproxy.ops.inspect.kernel import KernelSource, RecordedSource
from kproxy.ops.inspect.listing import ListingResult, list_services
from kproxy.ops.inspect.readers import ModeSelectionError, Reader, register
from kproxy.ops.inspect.trace import TraceResult, trace

__all__ = [
    "KernelSource",
    "ListingResult",
    "ModeSelectionError",
    "Reader",
    "RecordedSource",
    "TraceResult",
    "list_services",
    "register",
    "trace",
]
