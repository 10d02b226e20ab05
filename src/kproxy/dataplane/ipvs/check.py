"""Can ipvs mode run here? A clear startup error when not, never a fallback.

Two layers:
* kernel modules: ip_vs, ip_vs_<scheduler>, nf_conntrack must be loaded or built in; a
  missing one is loaded with modprobe when possible, and the error says how to load it
  now and how to make it load at boot (upstream's history: nodes rebooted without ip_vs
  silently fell back to iptables, #70304; the fallback was removed in v1.26);
* upstream's CanUseIPVSProxier: ipset >= 6.0, and the kernel accepts a virtual server with
  the scheduler (skipped when one already uses it), probed with 198.51.100.0:20000/TCP.

`missing_modules()` and `check_ipvs_support()` are the API the doctor/preflight use.
"""

from __future__ import annotations

import os
import platform
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from kproxy.dataplane.base import DataplaneUnavailable
from kproxy.dataplane.ipvs import names as n
from kproxy.host.commands import run_command

PERSIST_FILE = "/etc/modules-load.d/kproxy-ipvs.conf"
CONNTRACK_MODULE = "nf_conntrack"


def required_modules(scheduler: str = "", extra_schedulers: Iterable[str] = ()) -> list[str]:
    """The kernel modules ipvs mode needs with this scheduler (blank means rr)."""
    schedulers = [scheduler or n.DEFAULT_SCHEDULER, *extra_schedulers]
    mods = ["ip_vs"]
    mods += [f"ip_vs_{s}" for s in dict.fromkeys(schedulers)]
    mods.append(CONNTRACK_MODULE)
    return mods


def _builtin(release: str) -> set[str]:
    path = Path("/lib/modules") / release / "modules.builtin"
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return set()
    return {Path(line).name.removesuffix(".ko").replace("-", "_") for line in lines if line}


def _loaded() -> set[str]:
    try:
        return {line.split()[0] for line in Path("/proc/modules").read_text().splitlines() if line}
    except OSError:
        return set()


def module_present(name: str, *, release: str | None = None) -> bool:
    """Loaded now, or compiled into the kernel."""
    name = name.replace("-", "_")
    if name in _loaded() or (Path("/sys/module") / name).is_dir():
        return True
    return name in _builtin(release or platform.release())


def _modprobe(name: str) -> bool:
    tool = shutil.which("modprobe") or (
        "/sbin/modprobe" if os.path.exists("/sbin/modprobe") else ""
    )
    if not tool:
        return False
    proc = run_command([tool, name])
    return proc.returncode == 0


def missing_modules(
    scheduler: str = "",
    *,
    load: bool = True,
    present: Callable[[str], bool] = module_present,
    loader: Callable[[str], bool] = _modprobe,
) -> list[str]:
    """Modules ipvs mode needs that are neither loaded nor built in (after trying modprobe
    when `load`). Empty means the kernel side is fine."""
    missing = []
    for mod in required_modules(scheduler):
        if present(mod):
            continue
        if load and loader(mod) and present(mod):
            continue
        missing.append(mod)
    return missing


def _describe(mod: str) -> str:
    if mod == "ip_vs":
        return "ip_vs (the IPVS load balancer)"
    if mod.startswith("ip_vs_"):
        return f"{mod} (the {mod.removeprefix('ip_vs_')} IPVS scheduler)"
    if mod == CONNTRACK_MODULE:
        return f"{mod} (connection tracking, for IPVS NAT and masquerading)"
    return mod


def missing_modules_message(missing: list[str]) -> str:
    load = " && ".join(f"modprobe {m}" for m in missing)
    persist = "; ".join(f"echo {m} >> {PERSIST_FILE}" for m in missing)
    which = ", ".join(_describe(m) for m in missing)
    plural = "s" if len(missing) > 1 else ""
    return (
        f"ipvs mode needs the kernel module{plural} {which}, which could not be loaded: "
        f"load {'them' if plural else 'it'} with `{load}` and load {'them' if plural else 'it'} "
        f"at every boot with `{persist}` (or pick another proxy mode); kproxy never falls "
        "back to another mode"
    )


def check_modules(scheduler: str = "", *, load: bool = True) -> None:
    missing = missing_modules(scheduler, load=load)
    if missing:
        raise DataplaneUnavailable(missing_modules_message(missing))


def check_ipvs_support(
    scheduler: str = "",
    *,
    netns: str | None = None,
    load: bool = True,
    probe: bool = True,
) -> None:
    """Everything ipvs mode needs; DataplaneUnavailable says what is missing and how to fix it."""
    scheduler = scheduler or n.DEFAULT_SCHEDULER
    check_modules(scheduler, load=load)
    from kproxy.dataplane.ipvs.ipset import MIN_VERSION, IpsetClient

    if shutil.which("ipset") is None:
        raise DataplaneUnavailable(
            "ipvs mode needs the ipset tool (ipset >= 6.0), which is not installed: install "
            "the 'ipset' package (Debian/Ubuntu: apt-get install ipset)"
        )
    version = IpsetClient(netns).version()
    if version is None or version < MIN_VERSION:
        have = "an unreadable version" if version is None else f"v{version[0]}.{version[1]}"
        raise DataplaneUnavailable(
            f"ipvs mode needs ipset >= 6.0 and this node has {have}: upgrade the 'ipset' package"
        )
    if probe:
        probe_scheduler(scheduler, netns=netns)


def probe_scheduler(scheduler: str, *, netns: str | None = None) -> None:
    """Upstream's check: the kernel accepts a virtual server with this scheduler."""
    from kproxy.dataplane.ipvs.netlink import IpvsNetlink, IpvsUnavailable, NetlinkError
    from kproxy.dataplane.ipvs.plan import VirtualServer, VSKey

    try:
        client = IpvsNetlink(netns)
    except IpvsUnavailable as err:
        raise DataplaneUnavailable(f"{err}; {missing_modules_message(['ip_vs'])}") from err
    try:
        if any(s.scheduler == scheduler for s in client.services()):
            return
        vs = VirtualServer(VSKey("TCP", n.PROBE_ADDRESS, n.PROBE_PORT), scheduler)
        try:
            client.add_service(vs)
        except NetlinkError as err:
            if err.errno == 17:  # EEXIST: a leftover probe; it shows IPVS works
                client.delete_service(vs.key)
                client.add_service(vs)
            else:
                raise DataplaneUnavailable(
                    f"the kernel refused an IPVS virtual server with scheduler {scheduler} "
                    f"({err.strerror}); {missing_modules_message([f'ip_vs_{scheduler}'])}"
                ) from err
        client.delete_service(vs.key)
    finally:
        client.close()
