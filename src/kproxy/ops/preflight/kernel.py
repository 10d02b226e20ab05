"""Kernel support for the target mode: modules, kernel and nft versions, iptables backends.

A module is usable when it is loaded (/proc/modules), built in (modules.builtin, or =y in
the kernel config), or loadable (listed in /lib/modules/$(uname -r)/modules.dep; modinfo as
a fallback). A kernel that supports modules but has no /lib/modules/$(uname -r) was
upgraded and not rebooted: nothing more can be loaded until it is. ipvs mode's modules are
not loaded by anything at boot, so they must be listed in a modules-load.d file (the seeds'
ipvs nodes came back from reboots without ip_vs; #70304, #63801).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from kproxy.config import IPVS_SCHEDULERS
from kproxy.ops.preflight.access import NodeAccess
from kproxy.ops.preflight.context import Check, Context
from kproxy.ops.preflight.findings import Finding, block, info, warn

MIN_NFT_VERSION = (1, 0, 1)
MIN_NFT_KERNEL = (5, 13)
SKIP_KERNEL_CHECK_ENV = "KUBE_PROXY_NFTABLES_SKIP_KERNEL_VERSION_CHECK"
LOAD_DIRS = (
    "/etc/modules-load.d",
    "/run/modules-load.d",
    "/usr/lib/modules-load.d",
    "/lib/modules-load.d",
)
PERSIST_FILE = "/etc/modules-load.d/kproxy-ipvs.conf"
# kubelet's and the backend-detection hint chains: in both backends by design.
_SHARED_CHAINS = frozenset({"KUBE-FIREWALL", "KUBE-KUBELET-CANARY", "KUBE-IPTABLES-HINT"})


@dataclass(frozen=True)
class Module:
    name: str
    config: str  # the CONFIG_ symbol that builds it
    purpose: str
    required: bool = True  # False: only some services need it (a warning when missing)
    consequence: str = ""  # what a missing optional module costs, when not a service's sync


_CONNTRACK = (
    Module("nf_conntrack", "NF_CONNTRACK", "connection tracking (every mode's NAT)"),
    Module("nf_nat", "NF_NAT", "NAT (DNAT to endpoints, masquerade)"),
)
_XT = (
    Module("xt_conntrack", "NETFILTER_XT_MATCH_CONNTRACK", "-m conntrack --ctstate"),
    Module("xt_comment", "NETFILTER_XT_MATCH_COMMENT", "-m comment (rule names)"),
    Module("xt_addrtype", "NETFILTER_XT_MATCH_ADDRTYPE", "-m addrtype (NodePorts)"),
    Module("xt_mark", "NETFILTER_XT_MARK", "the masquerade mark"),
    Module("xt_MASQUERADE", "NETFILTER_XT_TARGET_MASQUERADE", "-j MASQUERADE"),
)
_IPTABLES_BACKEND = {
    "nft": (
        Module("nf_tables", "NF_TABLES", "iptables-nft's kernel side"),
        Module("nft_compat", "NFT_COMPAT", "xtables matches under iptables-nft"),
        Module("nft_chain_nat", "NFT_NAT", "nat chains under iptables-nft"),
    ),
    "legacy": (
        Module("ip_tables", "IP_NF_IPTABLES", "iptables-legacy's kernel side"),
        Module("iptable_nat", "IP_NF_NAT", "the legacy nat table"),
        Module("iptable_filter", "IP_NF_FILTER", "the legacy filter table"),
    ),
}
_IPTABLES_MODE = (
    Module("xt_statistic", "NETFILTER_XT_MATCH_STATISTIC", "-m statistic (endpoint choice)"),
    Module("xt_recent", "NETFILTER_XT_MATCH_RECENT", "-m recent (ClientIP affinity)", False),
)
_NFTABLES_MODE = (
    Module("nf_tables", "NF_TABLES", "nftables"),
    Module("nft_ct", "NFT_CT", "ct state / ct original matches"),
    Module("nft_nat", "NFT_NAT", "dnat / snat statements"),
    Module("nft_chain_nat", "NFT_NAT", "nat base chains"),
    Module("nft_masq", "NFT_MASQ", "masquerade"),
    Module("nft_numgen", "NFT_NUMGEN", "numgen (endpoint choice)"),
    Module("nft_fib_ipv4", "NFT_FIB_IPV4", "fib daddr type local (NodePorts; siderolabs/pkgs#951)"),
    Module("nft_reject_ipv4", "NFT_REJECT_IPV4", "reject for services without endpoints"),
)
_IPVS_MODE = (
    Module("ip_vs", "IP_VS", "the IPVS load balancer"),
    Module("ip_set", "IP_SET", "ipsets of the iptables side"),
    Module("ip_set_hash_ip", "IP_SET_HASH_IP", "KUBE-IPVS-IPS"),
    Module("ip_set_hash_ipport", "IP_SET_HASH_IPPORT", "KUBE-CLUSTER-IP and friends"),
    Module("ip_set_hash_ipportip", "IP_SET_HASH_IPPORTIP", "KUBE-LOOP-BACK"),
    Module("ip_set_hash_ipportnet", "IP_SET_HASH_IPPORTNET", "source-range sets"),
    Module("ip_set_bitmap_port", "IP_SET_BITMAP_PORT", "NodePort sets"),
    Module("xt_set", "NETFILTER_XT_SET", "-m set matches"),
    Module("dummy", "DUMMY", "the kube-ipvs0 interface"),
)
_USERSPACE_MODE = (
    Module("xt_REDIRECT", "NETFILTER_XT_TARGET_REDIRECT", "-j REDIRECT to the proxy sockets"),
)
# A switch out of ipvs mode holds datagrams to its UDP/SCTP virtual servers (ipvs/hold.py).
_HOLD_LOST = (
    "the switch cannot hold datagrams while IPVS lets go of UDP flows: a reply on its way"
    " back when a virtual server goes may be lost"
)
_LEAVING_IPVS = (
    Module("nfnetlink_queue", "NETFILTER_NETLINK_QUEUE", "the datagram hold", False, _HOLD_LOST),
    Module("xt_NFQUEUE", "NETFILTER_XT_TARGET_NFQUEUE", "-j NFQUEUE", False, _HOLD_LOST),
)


def scheduler_module(scheduler: str) -> Module:
    sched = scheduler or "rr"
    return Module(f"ip_vs_{sched}", f"IP_VS_{sched.upper()}", f"the {sched} IPVS scheduler")


def required_modules(
    mode: str, flavour: str, scheduler: str = "", extra_schedulers: tuple[str, ...] = ()
) -> list[Module]:
    mods: list[Module] = list(_CONNTRACK)
    if mode in ("iptables", "ipvs", "userspace"):
        mods += [*_IPTABLES_BACKEND.get(flavour, _IPTABLES_BACKEND["nft"]), *_XT]
    if mode == "iptables":
        mods += _IPTABLES_MODE
    elif mode == "nftables":
        mods += _NFTABLES_MODE
    elif mode == "ipvs":
        mods += [*_IPVS_MODE, scheduler_module(scheduler)]
        mods += [scheduler_module(s) for s in extra_schedulers]
    elif mode == "userspace":
        mods += _USERSPACE_MODE
    seen: dict[str, Module] = {}
    for m in mods:
        seen.setdefault(m.name, m)
    return list(seen.values())


def annotated_schedulers(ctx: Context) -> tuple[str, ...]:
    """Schedulers Services ask for with ipvs mode's per-Service annotation."""
    from kproxy.dataplane.ipvs.names import SCHEDULER_ANNOTATION

    if ctx.target != "ipvs" or ctx.snapshot is None:
        return ()
    wanted = {sp.annotation(SCHEDULER_ANNOTATION) for sp in ctx.snapshot.services.values()}
    return tuple(sorted(wanted & set(IPVS_SCHEDULERS)))


def _norm(name: str) -> str:
    return name.strip().replace("-", "_")


def _module_name(path: str) -> str:
    base = path.strip().rsplit("/", 1)[-1]
    for ext in (".ko.zst", ".ko.xz", ".ko.gz", ".ko"):
        if base.endswith(ext):
            base = base[: -len(ext)]
    return _norm(base)


@dataclass
class KernelModules:
    """What the node's kernel has, read once (see module docstring for the sources)."""

    release: str
    loaded: set[str] | None  # None: no /proc/modules, the kernel has no module support
    builtin: set[str] | None  # None: no modules.builtin
    available: set[str] | None  # None: no modules.dep
    config: dict[str, str] | None  # CONFIG_X -> "y" | "m"; None: no kernel config found
    sysmodule: set[str]
    modules_dir: bool
    other_releases: list[str]
    persisted: dict[str, str] = field(default_factory=dict)  # module -> file
    modinfo: dict[str, str | None] = field(default_factory=dict)
    # modprobe -n says it would not load these: module -> why ("install ip_vs /bin/false")
    refused: dict[str, str] = field(default_factory=dict)

    @property
    def modular(self) -> bool:
        if self.loaded is not None:
            return True
        return bool(self.config and self.config.get("CONFIG_MODULES") == "y")

    def status(self, m: Module) -> str:
        """loaded | built-in | loadable | missing | unknown"""
        name = _norm(m.name)
        sym = f"CONFIG_{m.config}"
        if self.loaded is not None and name in self.loaded:
            return "loaded"
        if self.builtin is not None and name in self.builtin:
            return "built-in"
        if self.config is not None and self.config.get(sym) == "y":
            return "built-in"
        if not self.modular:
            if name in self.sysmodule:
                return "built-in"
            return "missing" if self.config is not None else "unknown"
        if name in self.refused:
            return "refused"
        if self.available is not None and name in self.available:
            return "loadable"
        if self.config is not None:
            # The symbol is the authority: some modules were merged into others over the
            # years, so a file name can be missing while the feature is there.
            if self.config.get(sym) == "m":
                return "loadable" if self.modules_dir else "missing"
            return "missing"
        if name in self.modinfo:
            where = self.modinfo[name]
            if where is None:
                return "missing"
            return "built-in" if where == "(builtin)" else "loadable"
        if name in self.sysmodule:
            return "built-in"
        if self.available is not None or self.config is not None:
            return "missing"
        return "unknown"


def module_tree(access: NodeAccess) -> NodeAccess:
    """Where modprobe looks for /lib/modules: the node's root, or the root that
    MODPROBE_OPTIONS' --dirname names (modprobe then really loads from there, e.g. in the
    UML guest, whose modules live outside /lib/modules)."""
    if access.fake_root:
        return access
    words = os.environ.get("MODPROBE_OPTIONS", "").split()
    for i, w in enumerate(words):
        if w in ("-d", "--dirname") and i + 1 < len(words):
            return NodeAccess(root=Path(words[i + 1]), runner=access.runner)
        if w.startswith("--dirname="):
            return NodeAccess(root=Path(w.split("=", 1)[1]), runner=access.runner)
    return access


def read_modules(access: NodeAccess) -> KernelModules:
    release = access.kernel_release()
    mod_dir = f"/lib/modules/{release}"
    tree = module_tree(access)
    loaded_text = access.read("/proc/modules")
    loaded = (
        {_norm(line.split()[0]) for line in loaded_text.splitlines() if line.strip()}
        if loaded_text is not None
        else None
    )
    builtin_text = tree.read(f"{mod_dir}/modules.builtin")
    builtin = (
        {_module_name(line) for line in builtin_text.splitlines() if line.strip()}
        if builtin_text is not None
        else None
    )
    dep_text = tree.read(f"{mod_dir}/modules.dep")
    available = (
        {_module_name(line.split(":", 1)[0]) for line in dep_text.splitlines() if ":" in line}
        if dep_text is not None
        else None
    )
    return KernelModules(
        release=release,
        loaded=loaded,
        builtin=builtin,
        available=available,
        config=_kernel_config(access, release) or _kernel_config(tree, release),
        sysmodule={_norm(n) for n in access.listdir("/sys/module")},
        modules_dir=tree.exists(mod_dir),
        other_releases=[r for r in tree.listdir("/lib/modules") if r != release],
        persisted=read_persisted(access),
    )


def _kernel_config(access: NodeAccess, release: str) -> dict[str, str] | None:
    for path in ("/proc/config.gz", f"/boot/config-{release}", f"/lib/modules/{release}/config"):
        text = access.read(path)
        if text:
            out: dict[str, str] = {}
            for line in text.splitlines():
                key, eq, value = line.partition("=")
                if eq and key.startswith("CONFIG_"):
                    out[key] = value.strip()
            return out
    return None


def read_persisted(access: NodeAccess) -> dict[str, str]:
    """Modules listed for loading at boot (modules-load.d(5), and Debian's /etc/modules)."""
    out: dict[str, str] = {}
    files = [f"{d}/{n}" for d in LOAD_DIRS for n in access.listdir(d) if n.endswith(".conf")]
    files.append("/etc/modules")
    for path in files:
        text = access.read(path)
        for line in (text or "").splitlines():
            word = line.split("#", 1)[0].split(";", 1)[0].strip().split()
            if word:
                out.setdefault(_norm(word[0]), path)
    return out


def _fill_modinfo(access: NodeAccess, km: KernelModules, names: list[str]) -> None:
    """Ask modinfo about modules the files could not decide (real nodes only)."""
    if access.fake_root or km.available is not None or not km.modular:
        return
    for name in names:
        proc = access.runner(["modinfo", "-F", "filename", name], None)
        if proc.returncode == 127:
            return  # no kmod: stay "unknown"
        km.modinfo[name] = proc.stdout.strip() or None if proc.returncode == 0 else None


# `modprobe -n -v` prints "install /bin/false" for a module modprobe.d replaces by a no-op.
_DISABLED = re.compile(r"^install\s+(\S*/)?(false|true)\b")


def _dry_run_modprobe(access: NodeAccess, km: KernelModules, mods: list[Module]) -> None:
    """`modprobe -n -v` (a dry run) for the modules that look loadable: modprobe.d can
    still refuse them (`install ip_vs /bin/false`, a common hardening line)."""
    for m in mods:
        if km.status(m) != "loadable":
            continue
        proc = access.runner(["modprobe", "-n", "-v", m.name], None)
        if proc.returncode == 127:
            return  # no kmod here: the files are all there is
        lines = [ln.strip() for ln in proc.stdout.splitlines()]
        disabled = next((ln for ln in lines if _DISABLED.match(ln)), None)
        if disabled:
            km.refused[_norm(m.name)] = f"modprobe.d says {disabled!r}"
        elif proc.returncode != 0:
            km.refused[_norm(m.name)] = f"modprobe fails: {proc.stderr.strip()}"


# --- checks ---------------------------------------------------------------------------------


def target_flavour(ctx: Context) -> str:
    """The iptables backend the target mode would use: the current one, else what kproxy's
    --iptables-backend auto would pick (upstream's detection, read only)."""
    if ctx.current_flavour:
        return ctx.current_flavour
    from kproxy.dataplane.iptables.backend import detect_backend

    return detect_backend(ctx.access.netns, runner=ctx.access.runner)


def check_modules(ctx: Context) -> list[Finding]:
    km = read_modules(ctx.access)
    scheduler = ctx.target_config.ipvs.scheduler
    mods = required_modules(ctx.target, target_flavour(ctx), scheduler, annotated_schedulers(ctx))
    if ctx.current_mode == "ipvs" and ctx.target != "ipvs":
        mods += _LEAVING_IPVS
    _fill_modinfo(ctx.access, km, [m.name for m in mods])
    _dry_run_modprobe(ctx.access, km, mods)
    out: list[Finding] = []
    if not km.modular:
        out.append(
            info(
                "kernel.no-module-support",
                f"kernel {km.release} has no loadable module support: only built-in features "
                "can be used",
                "nothing can be loaded later; a feature that is not built in needs another kernel",
                facts={"release": km.release},
            )
        )
    elif not km.modules_dir:
        needed = [m.name for m in mods if km.status(m) not in ("loaded", "built-in")]
        newer = ", ".join(km.other_releases) or "none"
        out.append(
            (block if needed else warn)(
                "kernel.modules-dir-missing",
                f"the running kernel {km.release} has no /lib/modules/{km.release} (installed "
                f"module trees: {newer}): the kernel was upgraded and the node not rebooted",
                "no module can be loaded until the node boots the installed kernel"
                + (f"; {', '.join(needed)} are needed and not loaded" if needed else ""),
                ["systemctl reboot  # boots the installed kernel and its modules"],
                facts={"release": km.release, "installed": km.other_releases, "needed": needed},
            )
        )
    for m in mods:
        status = km.status(m)
        facts = {"module": m.name, "status": status, "config": f"CONFIG_{m.config}"}
        if status in ("missing", "refused"):
            out.append(_missing(ctx, km, m, facts))
        elif status == "unknown":
            out.append(
                warn(
                    "kernel.module-unknown",
                    f"cannot tell whether the kernel has {m.name} ({m.purpose}): no "
                    "modules.builtin, modules.dep or kernel config to read",
                    f"{ctx.target} mode fails at its first sync if it is missing",
                    [f"modinfo {m.name}", f"modprobe -n -v {m.name}"],
                    subject=m.name,
                    facts=facts,
                )
            )
        elif status == "loadable" and ctx.target == "ipvs":
            out.append(
                info(
                    "kernel.module-loadable",
                    f"{m.name} ({m.purpose}) is not loaded but can be",
                    "the kernel loads it on first use; loading it now takes that out of the switch",
                    [f"modprobe {m.name}"],
                    subject=m.name,
                    facts=facts,
                )
            )
    if ctx.target == "ipvs":
        out += _persistence(km, mods)
    return out


def _missing(ctx: Context, km: KernelModules, m: Module, facts: dict[str, object]) -> Finding:
    if _norm(m.name) in km.refused:
        cause = f"modprobe would not load it ({km.refused[_norm(m.name)]})"
    elif km.config is not None and km.config.get(f"CONFIG_{m.config}") == "m":
        cause = f"it is a module (CONFIG_{m.config}=m) but /lib/modules/{km.release} is missing"
    elif km.config is not None and f"CONFIG_{m.config}" not in km.config:
        cause = f"this kernel is built without CONFIG_{m.config}"
    elif not km.modular:
        cause = "it is not built in and the kernel cannot load modules"
    else:
        cause = f"no {m.name} module exists for kernel {km.release}"
    fix = [
        f"zcat /proc/config.gz | grep CONFIG_{m.config}  # or /boot/config-$(uname -r)",
        "apt-get install linux-modules-extra-$(uname -r)  # where the distribution splits modules",
    ]
    if _norm(m.name) in km.refused:
        fix = [
            f"grep -rn '{m.name}' /etc/modprobe.d /run/modprobe.d /usr/lib/modprobe.d",
            f"# remove the line that disables it, then: modprobe {m.name}",
        ]
    if ctx.target == "ipvs" and m.name.startswith("ip_vs_"):
        other = [s for s in IPVS_SCHEDULERS if s != ctx.target_config.ipvs.scheduler]
        fix.append(f"# or set ipvs.scheduler to one the kernel has ({', '.join(other[:4])}, ...)")
    else:
        fix.append("# or use a kernel built with it (=y or =m), or another proxy mode")
    make = block if m.required else warn
    return make(
        "kernel.module-missing",
        f"{m.name} ({m.purpose}) is not available: {cause}",
        f"{ctx.target} mode cannot program its rules without it"
        if m.required
        else m.consequence or f"services that need {m.purpose} fail to sync in {ctx.target} mode",
        fix,
        subject=m.name,
        facts=facts,
    )


def _persistence(km: KernelModules, mods: list[Module]) -> list[Finding]:
    """ipvs modules that are modules (not built in) must be loaded at boot."""
    if not km.modular:
        return []
    wanted = [m for m in mods if m.name in ("ip_vs", "nf_conntrack") or m.name.startswith("ip_vs_")]
    lacking = [
        m.name
        for m in wanted
        if km.status(m) in ("loaded", "loadable") and _norm(m.name) not in km.persisted
    ]
    if not lacking:
        return []
    lines = "\\n".join(lacking)
    return [
        warn(
            "kernel.module-not-persisted",
            f"{', '.join(lacking)} are not listed in any modules-load.d file: after a reboot "
            "they are not loaded until something asks for them",
            "ipvs nodes that came back from a reboot without ip_vs fell back or failed "
            "(kubernetes #70304, #63801)",
            [f"printf '{lines}\\n' >> {PERSIST_FILE}", "systemctl restart systemd-modules-load"],
            facts={"modules": lacking, "persisted": km.persisted},
        )
    ]


def _version(text: str) -> tuple[int, ...] | None:
    m = re.search(r"v?(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not m:
        return None
    return tuple(int(g) for g in m.groups() if g is not None)


def check_nftables(ctx: Context) -> list[Finding]:
    """nftables mode's preconditions: kernel >= 5.13, nft >= 1.0.1, a kernel that takes a
    transaction, an nft that can read the node's ruleset (#136786)."""
    out: list[Finding] = []
    release = ctx.access.kernel_release()
    kv = _version(release)
    if kv is not None and kv[:2] < MIN_NFT_KERNEL and not os.environ.get(SKIP_KERNEL_CHECK_ENV):
        out.append(
            block(
                "kernel.too-old",
                f"kernel {release} is older than 5.13, which nftables mode needs",
                "older kernels lack nftables features the rules use (upstream refuses too)",
                [
                    "# upgrade the kernel, or stay in iptables mode",
                    f"{SKIP_KERNEL_CHECK_ENV}=1  # skip the check, as upstream allows",
                ],
                facts={"release": release},
            )
        )
    proc = ctx.access.run(["nft", "--version"])
    if proc.returncode != 0:
        out.append(
            block(
                "nft.missing",
                "the nft command is missing or does not run",
                "nftables mode programs the kernel through nft",
                ["apt-get install nftables"],
                facts={"error": proc.stderr.strip()},
            )
        )
        return out
    version = _version(proc.stdout)
    if version is not None and version < MIN_NFT_VERSION:
        out.append(
            block(
                "nft.too-old",
                f"nft {'.'.join(map(str, version))} is older than 1.0.1",
                "older nft parses the whole ruleset and can be locked out by other programs' rules",
                ["apt-get install -t bookworm-backports nftables  # or any nftables >= 1.0.1"],
                facts={"version": proc.stdout.strip()},
            )
        )
    # --check: parsed and validated by the kernel, never committed.
    probe = ctx.access.run(["nft", "--check", "add", "table", "ip", "kproxy-probe"])
    if probe.returncode != 0:
        out.append(
            block(
                "nft.kernel-refused",
                f"the kernel refused an nftables test transaction: {probe.stderr.strip()}",
                "nftables mode cannot program anything",
                ["modprobe nf_tables", "zcat /proc/config.gz | grep CONFIG_NF_TABLES"],
            )
        )
    # kube-proxy's own table, which is all nftables mode lists (the whole ruleset takes
    # minutes on a big iptables-nft node, kernelstate.py).
    listing = ctx.access.run(["nft", "-j", "list", "table", "ip", "kube-proxy"])
    missing = "No such file or directory" in listing.stderr
    if listing.returncode != 0 and not missing and probe.returncode == 0:
        out.append(
            block(
                "nft.cannot-list",
                f"`nft list table ip kube-proxy` fails here: {listing.stderr.strip()}",
                "the node holds nftables objects this nft cannot parse (often written by a "
                "newer nft; kubernetes #136786); kproxy's syncs would fail the same way",
                ["nft --version", "nft list ruleset  # find the objects it cannot parse"],
            )
        )
    return out


def _kube_chains(save_text: str) -> list[str]:
    chains = []
    for line in save_text.splitlines():
        if line.startswith(":KUBE-"):
            name = line[1:].split()[0]
            if name not in _SHARED_CHAINS:
                chains.append(name)
    return chains


def kube_chains(ctx: Context, flavour: str) -> list[str]:
    """kube-proxy's chains in one iptables backend: from the save preflight read anyway,
    or beside a running kproxy (which reads no save) by their names alone."""
    if ctx.live is None:
        return _kube_chains(ctx.kernel_snapshot.get(f"iptables-{flavour}", {}).get("output", ""))
    names = ctx.node_dump.iptables_chains(flavour)
    return [n for n in names if n.startswith("KUBE-") and n not in _SHARED_CHAINS]


def check_iptables(ctx: Context) -> list[Finding]:
    """Which backend the iptables command uses, that the target's tools exist, and whether
    kube-proxy chains live in both backends at once."""
    out: list[Finding] = []
    per_backend = {fl: kube_chains(ctx, fl) for fl in ("nft", "legacy")}
    if per_backend["nft"] and per_backend["legacy"]:
        out.append(
            warn(
                "iptables.both-backends",
                f"kube-proxy chains exist in both iptables backends: {len(per_backend['nft'])} "
                f"in iptables-nft, {len(per_backend['legacy'])} in iptables-legacy",
                "the kernel runs both rule sets: stale rules of one backend (a REJECT for a "
                "service that has endpoints now, #102314) override the other's",
                [
                    "kproxy cleanup --dry-run  # lists what belongs to which mode and backend",
                    "iptables-legacy-save | grep -c KUBE-; iptables-nft-save | grep -c KUBE-",
                ],
                facts={"nft": per_backend["nft"][:20], "legacy": per_backend["legacy"][:20]},
            )
        )
    proc = ctx.access.run(["iptables", "--version"])
    if proc.returncode == 0:
        text = proc.stdout.strip()
        flavour = "nft" if "nf_tables" in text else "legacy" if "legacy" in text else "?"
        out.append(
            info(
                "iptables.backend",
                f"the iptables command is {text} (backend {flavour}); kube-proxy chains: "
                f"{len(per_backend['nft'])} in nft, {len(per_backend['legacy'])} in legacy",
                "other tools (CNI plugins, firewalls) write through this backend",
                facts={"version": text, "flavour": flavour},
            )
        )
    if ctx.target in ("iptables", "ipvs", "userspace"):
        flavour = target_flavour(ctx)
        for tool in (f"iptables-{flavour}-restore", f"iptables-{flavour}-save"):
            if ctx.access.run([tool, "--version"]).returncode == 127:
                out.append(
                    block(
                        "iptables.missing",
                        f"{tool} is not installed",
                        f"{ctx.target} mode writes its rules with it",
                        ["apt-get install iptables"],
                        subject=tool,
                    )
                )
    if ctx.target == "ipvs":
        ipset = ctx.access.run(["ipset", "version"])
        version = _version(ipset.stdout) if ipset.returncode == 0 else None
        if version is None or version < (6, 0):
            out.append(
                block(
                    "ipset.missing",
                    "ipset (>= 6.0) is missing"
                    if version is None
                    else f"ipset {'.'.join(map(str, version))} is older than 6.0",
                    "ipvs mode keeps its address sets in ipsets (upstream refuses to start)",
                    ["apt-get install ipset"],
                )
            )
    return out


CHECKS = (
    Check("kernel", check_modules),
    Check("kernel", check_nftables, ("nftables",)),
    Check("kernel", check_iptables),
)
