"""The lab's UML guest kernel, built here (`kproxy lab uml-kernel`): Debian's do not fit.

Debian bookworm's user-mode-linux (6.1) hands a process's FPU state to the host through
ptrace with a fixed-size buffer; on a CPU whose XSAVE area is larger (AMX: 11 KB) the host
refuses it and the guest's init dies at once (uml.FPU_STATE_REASON). UML sizes that buffer
from the host since 6.13, but Debian's newer UML packages are built without legacy
iptables, which the guest's ipvs mode uses, and none has nf_tables for ip, which nftables
mode needs. So this module builds one: the newest `linux-source-X.Y` (X.Y >= 6.13) of
Debian's unstable suite, arch/um's x86_64_defconfig
plus the networking options of the installed Debian UML kernel (its config.gz: the guest
gets the network stack the tests were written against, policy routing and TPROXY
included) plus OPTIONS (what the lab and the ipvs, iptables and userspace modes need, as
modules where kproxy loads or refuses them by name), installed as CACHE/linux with its
modules under CACHE/modules/lib/modules/<release>.

Build time on 2 cores: see README "UML on hosts where Debian's kernel cannot boot". The
kernel is built once per machine; `uml.find_linux_uml()` prefers it when it exists.
"""

from __future__ import annotations

import gzip
import hashlib
import lzma
import os
import re
import shutil
import subprocess
import tempfile
import urllib.request
from collections.abc import Callable
from pathlib import Path

CACHE = Path(os.environ.get("KPROXY_UML_KERNEL_DIR", "/var/cache/kproxy/uml-kernel"))
MIRROR = "http://deb.debian.org/debian"
SUITE = "sid"
MIN_VERSION = (6, 13)  # UML sizes its FPU state buffer from the host from here on
DEBIAN_CONFIG = Path("/usr/share/doc/user-mode-linux/config.gz")
# The part of Debian's UML config taken over: the network stack, without traffic control,
# network filesystems and device drivers (build time, nothing the lab uses).
NETWORK_OPTION = re.compile(
    r"^CONFIG_(NET|IP_|IPV6|INET|NETFILTER|NF_|NFT_|XFRM|TCP_|BRIDGE|VETH|DUMMY|TUN|MACVLAN"
    r"|IPVLAN|VXLAN|VLAN_8021Q|LLC|STP|FIB_|GENEVE|NLMON|IFB|GRE|L2TP|SCTP|NETLINK|UNIX"
    r"|PACKET)[A-Z0-9_]*=[ym]$"
)
NOT_TAKEN = re.compile(
    r"^CONFIG_(NET_9P|NETWORK_FILESYSTEMS|NETFS|NET_VENDOR|NET_DSA|NET_SWITCHDEV|NET_FC"
    r"|NET_TEAM|NET_ACT|NET_SCH|NET_CLS|NET_EMATCH)"
)

OPTIONS: tuple[str, ...] = (
    "CONFIG_DEBUG_INFO_NONE=y",  # a quicker build; nobody debugs this kernel with gdb
    "CONFIG_NAMESPACES=y",
    "CONFIG_NET_NS=y",
    "CONFIG_UTS_NS=y",
    "CONFIG_IPC_NS=y",
    "CONFIG_PID_NS=y",
    "CONFIG_IPV6=y",
    "CONFIG_VETH=m",
    "CONFIG_BRIDGE=m",
    "CONFIG_BRIDGE_NETFILTER=m",
    "CONFIG_DUMMY=m",
    "CONFIG_NETFILTER=y",
    "CONFIG_NETFILTER_ADVANCED=y",
    "CONFIG_NETFILTER_NETLINK_QUEUE=m",
    "CONFIG_NETFILTER_NETLINK_ACCT=m",
    "CONFIG_NF_CONNTRACK=m",
    "CONFIG_NF_CONNTRACK_MARK=y",
    "CONFIG_NF_CONNTRACK_ZONES=y",
    "CONFIG_NF_CONNTRACK_PROCFS=y",
    "CONFIG_NF_CONNTRACK_EVENTS=y",
    "CONFIG_NF_CONNTRACK_TIMESTAMP=y",
    "CONFIG_NF_CONNTRACK_LABELS=y",
    "CONFIG_NF_CT_PROTO_SCTP=y",
    "CONFIG_NF_CT_NETLINK=m",
    "CONFIG_NF_NAT=m",
    # nf_tables with the ip family, which Debian's UML kernels lack: the
    # guest runs nftables mode and iptables-nft beside IPVS (the ipvs <-> nftables switch).
    "CONFIG_NF_TABLES=m",
    "CONFIG_NF_TABLES_IPV4=y",
    *(
        f"CONFIG_NFT_{x}=m"
        for x in (
            "CT",
            "NAT",
            "MASQ",
            "REDIR",
            "NUMGEN",
            "FIB",
            "FIB_IPV4",
            "REJECT",
            "REJECT_IPV4",
            "COMPAT",
            "LIMIT",
            "HASH",
        )
    ),
    "CONFIG_NETFILTER_XTABLES=m",
    "CONFIG_NETFILTER_XTABLES_LEGACY=y",
    *(
        f"CONFIG_NETFILTER_XT_{x}=m"
        for x in (
            "MARK",
            "CONNMARK",
            "NAT",
            "TARGET_CT",
            "TARGET_MARK",
            "TARGET_MASQUERADE",
            "TARGET_REDIRECT",
            "TARGET_NFQUEUE",
            "TARGET_NOTRACK",
            "MATCH_ADDRTYPE",
            "MATCH_COMMENT",
            "MATCH_CONNTRACK",
            "MATCH_IPVS",
            "MATCH_MARK",
            "MATCH_MULTIPORT",
            "MATCH_NFACCT",
            "MATCH_OWNER",
            "MATCH_PHYSDEV",
            "MATCH_RECENT",
            "MATCH_SOCKET",
            "MATCH_STATE",
            "MATCH_STATISTIC",
            "MATCH_LIMIT",
            "SET",
        )
    ),
    "CONFIG_IP_SET=m",
    *(
        f"CONFIG_IP_SET_{t}=m"
        for t in ("BITMAP_PORT", "HASH_IP", "HASH_IPPORT", "HASH_IPPORTIP", "HASH_IPPORTNET")
    ),
    "CONFIG_IP_SET_HASH_NET=m",
    "CONFIG_IP_VS=m",
    "CONFIG_IP_VS_PROTO_TCP=y",
    "CONFIG_IP_VS_PROTO_UDP=y",
    "CONFIG_IP_VS_PROTO_SCTP=y",
    *(f"CONFIG_IP_VS_{s}=m" for s in ("RR", "WRR", "LC", "WLC", "SH", "DH", "SED", "NQ", "MH")),
    "CONFIG_IP_VS_NFCT=y",
    "CONFIG_NF_DEFRAG_IPV4=m",
    "CONFIG_NF_SOCKET_IPV4=m",
    "CONFIG_NF_REJECT_IPV4=m",
    "CONFIG_IP_NF_IPTABLES=m",
    "CONFIG_IP_NF_IPTABLES_LEGACY=m",
    "CONFIG_IP_NF_FILTER=m",
    "CONFIG_IP_NF_NAT=m",
    "CONFIG_IP_NF_TARGET_MASQUERADE=m",
    "CONFIG_IP_NF_TARGET_REDIRECT=m",
    "CONFIG_IP_NF_MANGLE=m",
    "CONFIG_IP_NF_RAW=m",
    "CONFIG_IP_NF_TARGET_REJECT=m",
)


class KernelBuildError(RuntimeError):
    """The kernel could not be fetched, configured or built; the message says where."""


def kernel() -> Path | None:
    """The built kernel, if this machine has one."""
    path = CACHE / "linux"
    return path if path.is_file() and os.access(path, os.X_OK) else None


def fragment() -> list[str]:
    """The config lines merged onto the defconfig. OPTIONS last: merge_config lets a later
    line win (legacy xtables, for one)."""
    return [*debian_network_options(), *OPTIONS]


def recipe() -> str:
    """A fingerprint of what a build would configure: a kernel built from another one is
    rebuilt by `kproxy lab uml-kernel --if-needed`."""
    return hashlib.sha256("".join(o + "\n" for o in fragment()).encode()).hexdigest()


def up_to_date() -> bool:
    """A kernel was built here from the current recipe."""
    try:
        return kernel() is not None and (CACHE / "recipe").read_text().strip() == recipe()
    except OSError:
        return False


def module_dir() -> Path:
    """Where the built kernel's modules are: <release>/ below this."""
    return CACHE / "modules" / "lib" / "modules"


def debian_network_options(config_gz: Path = DEBIAN_CONFIG) -> list[str]:
    """The network options of Debian's UML kernel config; [] without the package."""
    try:
        text = gzip.decompress(config_gz.read_bytes()).decode()
    except OSError:
        return []
    return [
        line
        for line in text.splitlines()
        if NETWORK_OPTION.match(line) and not NOT_TAKEN.match(line)
    ]


def _version_of(package: str) -> tuple[int, ...]:
    return tuple(int(n) for n in package.removeprefix("linux-source-").split("."))


def newest_source(packages_index: str) -> tuple[str, str]:
    """(package, pool file name) of the newest linux-source-X.Y >= MIN_VERSION."""
    found: dict[str, str] = {}
    for stanza in packages_index.split("\n\n"):
        name = re.search(r"^Package: (linux-source-\d+\.\d+)$", stanza, re.M)
        file = re.search(r"^Filename: (\S+)$", stanza, re.M)
        if name and file:
            found[name.group(1)] = file.group(1)
    usable = [p for p in found if _version_of(p) >= MIN_VERSION]
    if not usable:
        raise KernelBuildError(
            f"no linux-source-X.Y >= {'.'.join(map(str, MIN_VERSION))} in Debian {SUITE}"
        )
    best = max(usable, key=_version_of)
    return best, found[best]


def _run(argv: list[str], cwd: Path, log: Callable[[str], None], what: str) -> None:
    log(f"{what}: {' '.join(argv)}")
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip()[-3000:]
        raise KernelBuildError(f"{what} failed (exit {proc.returncode}):\n{tail}")


def _fetch(url: str, dest: Path, log: Callable[[str], None]) -> None:
    log(f"downloading {url}")
    try:
        with urllib.request.urlopen(url, timeout=120) as answer, dest.open("wb") as out:
            shutil.copyfileobj(answer, out, 1 << 20)
    except OSError as err:
        raise KernelBuildError(f"could not download {url}: {err}") from err


def check_config(config: str) -> list[str]:
    """OPTIONS the configured kernel lacks ("=m" built in as "=y" counts as present)."""
    have = dict(line.split("=", 1) for line in config.splitlines() if line.startswith("CONFIG_"))
    missing = []
    for option in OPTIONS:
        name, want = option.split("=", 1)
        got = have.get(name)
        if got != want and not (want == "m" and got == "y"):
            missing.append(f"{name} (wanted {want}, got {got or 'unset'})")
    return missing


def build(log: Callable[[str], None] = print, *, jobs: int | None = None) -> Path:
    """Fetch, configure, build and install the kernel into CACHE; returns its path."""
    CACHE.parent.mkdir(parents=True, exist_ok=True)
    jobs = jobs or os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="uml-kernel-", dir=CACHE.parent) as tmp:
        work = Path(tmp)
        index = work / "Packages.xz"
        _fetch(f"{MIRROR}/dists/{SUITE}/main/binary-amd64/Packages.xz", index, log)
        package, pool_file = newest_source(lzma.decompress(index.read_bytes()).decode())
        deb = work / "source.deb"
        _fetch(f"{MIRROR}/{pool_file}", deb, log)
        log(f"unpacking {package}")
        unpack = (
            "dpkg-deb --fsys-tarfile source.deb"
            " | tar -xO --wildcards './usr/src/*.tar.xz' | tar -xJ"
        )
        _run(["sh", "-c", unpack], work, log, "unpack")
        deb.unlink()
        tree = next(p for p in work.iterdir() if p.is_dir() and p.name.startswith("linux-"))
        (work / "kproxy.config").write_text("".join(o + "\n" for o in fragment()))
        make = ["make", "ARCH=um", f"-j{jobs}"]
        _run([*make, "x86_64_defconfig"], tree, log, "defconfig")
        merge = ["scripts/kconfig/merge_config.sh", "-m", ".config", "../kproxy.config"]
        _run(merge, tree, log, "merge kproxy.config")
        _run([*make, "olddefconfig"], tree, log, "olddefconfig")
        missing = check_config((tree / ".config").read_text())
        if missing:
            raise KernelBuildError(f"{package}: the config lacks {', '.join(missing)}")
        log(f"building {package} for ARCH=um with {jobs} jobs (several minutes)")
        _run([*make, "linux", "modules"], tree, log, "build")
        staged = work / "install"
        staged.mkdir()
        _run(
            [*make, "modules_install", f"INSTALL_MOD_PATH={staged / 'modules'}"],
            tree,
            log,
            "modules_install",
        )
        shutil.copy2(tree / "linux", staged / "linux")
        _run(["strip", str(staged / "linux")], tree, log, "strip")
        (staged / "source").write_text(f"{package} {pool_file}\n")
        (staged / "recipe").write_text(recipe() + "\n")
        old = CACHE.with_name(CACHE.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if CACHE.exists():
            CACHE.rename(old)
        staged.rename(CACHE)
        shutil.rmtree(old, ignore_errors=True)
    path = kernel()
    assert path is not None
    log(f"UML kernel installed: {path}")
    return path
