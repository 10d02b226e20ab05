"""Facts about the User-Mode Linux guest the tests in tests/uml run in (the `guest` fixture of
tests/uml/conftest.py gives one)."""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kproxy.lab import uml_kernel
from kproxy.lab.uml import NFTABLES_GUEST_MODULES

# Debian's UML kernels have no nf_tables ip family (G9): the guest uses the legacy tools.
IPTABLES = "iptables-legacy"
IPTABLES_RESTORE = "iptables-legacy-restore"
IPTABLES_SAVE = "iptables-legacy-save"


@dataclass(frozen=True)
class Guest:
    """Facts about the UML guest the tests run in."""

    run_dir: Path | None
    modules: dict[str, str] = field(default_factory=dict)
    iptables: str = IPTABLES
    iptables_restore: str = IPTABLES_RESTORE
    iptables_save: str = IPTABLES_SAVE

    def require(self, *modules: str) -> None:
        missing = self.missing(*modules)
        if missing:
            pytest.fail(f"kernel modules missing in the UML guest: {', '.join(missing)}")

    def missing(self, *modules: str) -> list[str]:
        return [m for m in modules if self.modules.get(m, "missing") == "missing"]

    @property
    def own_kernel(self) -> bool:
        """The guest runs kproxy's own UML kernel (kproxy.lab.uml_kernel), not Debian's."""
        return (uml_kernel.module_dir() / platform.release()).is_dir()

    def require_nftables(self) -> None:
        """nf_tables for ip, which nftables mode needs: kproxy's own kernel must have it;
        Debian's UML kernels lack it, and there the test is skipped (`make test` builds
        kproxy's first, `kproxy lab uml-kernel`)."""
        missing = self.missing(*NFTABLES_GUEST_MODULES)
        if missing and not self.own_kernel:
            pytest.skip(
                f"the UML guest kernel has no nf_tables for ip ({', '.join(missing)} missing):"
                " Debian's UML kernels lack it; `kproxy lab uml-kernel` builds one that has it"
            )
        self.require(*NFTABLES_GUEST_MODULES)
