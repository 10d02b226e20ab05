"""`kproxy run` for userspace mode through a bootstrap, as the userspace kernel tests and the
userspace benchmark start it."""

from __future__ import annotations

from kproxy.lab.proxy import ProxyProcess

BOOTSTRAP = """\
import sys
from kproxy.cli import main
sys.argv = ["kproxy", *sys.argv[1:]]
main()
"""


class UserspaceProxy(ProxyProcess):
    """`kproxy run --proxy-mode userspace`, started through a bootstrap (`python -c`)."""

    def argv(self) -> list[str]:
        argv = super().argv()
        assert argv[1:3] == ["-m", "kproxy.cli"]
        return [argv[0], "-c", BOOTSTRAP, *argv[3:]]
