"""The UML kernel recipe's pure parts: picking the source package, checking the config."""

from __future__ import annotations

from pathlib import Path

import pytest

from kproxy.lab import uml_kernel

INDEX = """\
Package: linux-source-6.12
Version: 6.12.117-1
Filename: pool/main/l/linux/linux-source-6.12_6.12.117-1_all.deb

Package: linux-source
Version: 7.2.13-1
Filename: pool/main/l/linux/linux-source_7.2.13-1_all.deb

Package: linux-source-7.2
Version: 7.2.13-1
Filename: pool/main/l/linux/linux-source-7.2_7.2.13-1_all.deb

Package: linux-source-6.9
Filename: pool/main/l/linux/linux-source-6.9_6.9.1-1_all.deb
"""


def test_the_newest_source_with_the_fpu_fix_is_picked() -> None:
    assert uml_kernel.newest_source(INDEX) == (
        "linux-source-7.2",
        "pool/main/l/linux/linux-source-7.2_7.2.13-1_all.deb",
    )


def test_no_source_new_enough_is_a_clear_error() -> None:
    old = "Package: linux-source-6.1\nFilename: pool/x/linux-source-6.1_6.1.1_all.deb\n"
    with pytest.raises(uml_kernel.KernelBuildError, match="6.13"):
        uml_kernel.newest_source(old)


def test_config_check_names_what_olddefconfig_dropped() -> None:
    config = "".join(o + "\n" for o in uml_kernel.OPTIONS)
    assert uml_kernel.check_config(config) == []
    # A module built in is as good; a dropped option is named with what it became.
    built_in = config.replace("CONFIG_IP_VS=m", "CONFIG_IP_VS=y")
    assert uml_kernel.check_config(built_in) == []
    dropped = config.replace("CONFIG_NETFILTER_XTABLES_LEGACY=y\n", "")
    assert uml_kernel.check_config(dropped) == [
        "CONFIG_NETFILTER_XTABLES_LEGACY (wanted y, got unset)"
    ]


def test_debian_network_options_are_taken_without_traffic_control(tmp_path: Path) -> None:
    import gzip

    cfg = tmp_path / "config.gz"
    cfg.write_bytes(
        gzip.compress(
            b"CONFIG_IP_MULTIPLE_TABLES=y\nCONFIG_NET_SCH_HTB=m\nCONFIG_EXT4_FS=y\n"
            b"# CONFIG_NF_TABLES_IPV4 is not set\nCONFIG_NETFILTER_XT_TARGET_TPROXY=m\n"
        )
    )
    assert uml_kernel.debian_network_options(cfg) == [
        "CONFIG_IP_MULTIPLE_TABLES=y",
        "CONFIG_NETFILTER_XT_TARGET_TPROXY=m",
    ]
    assert uml_kernel.debian_network_options(tmp_path / "absent.gz") == []


def test_a_kernel_built_from_another_recipe_is_not_up_to_date(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(uml_kernel, "CACHE", tmp_path)
    assert not uml_kernel.up_to_date()  # nothing built
    (tmp_path / "linux").write_text("#!/bin/sh\n")
    (tmp_path / "linux").chmod(0o755)
    (tmp_path / "recipe").write_text(uml_kernel.recipe() + "\n")
    assert uml_kernel.up_to_date()
    monkeypatch.setattr(uml_kernel, "OPTIONS", (*uml_kernel.OPTIONS, "CONFIG_NFT_TUNNEL=m"))
    assert not uml_kernel.up_to_date()
