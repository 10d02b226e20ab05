"""IptablesBackend, detect_backend and detect_node_facts: unit tests with a fake runner, and
kernel tests in throwaway network namespaces (both flavours, each in its own namespace)."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Callable, Iterator, Sequence

import pytest

from kproxy.dataplane.facts import NodeFacts
from kproxy.dataplane.iptables.backend import (
    BUILTIN_CHAINS,
    IptablesBackend,
    IptablesError,
    RestoreError,
    TableOutline,
    command_wait_flags,
    detect_backend,
    outline_save,
    parse_failed_line,
    parse_save,
    restore_reason,
    restore_wait_flags,
    rule_spec,
)
from kproxy.dataplane.iptables.render import JUMPS, jump_rule
from kproxy.dataplane.nodefacts import (
    detect_node_facts,
    interface_addresses,
    nfacct_counters,
    parse_nfacct_list,
    pick_node_ips,
)
from kproxy.host.commands import parse_version

FLAVOURS = ["nft", "legacy"]

kernel = pytest.mark.kernel
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces")


# --------------------------------------------------------------------------- fake runner


class FakeRunner:
    """Answers argv by the first matching (predicate, result) rule; records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], str | None]] = []
        self.answers: list[tuple[Callable[[list[str]], bool], tuple[int, str, str]]] = []

    def on(
        self, predicate: Callable[[list[str]], bool], rc: int = 0, out: str = "", err: str = ""
    ) -> None:
        self.answers.append((predicate, (rc, out, err)))

    def __call__(
        self, argv: Sequence[str], input_data: str | None
    ) -> subprocess.CompletedProcess[str]:
        argv = list(argv)
        self.calls.append((argv, input_data))
        for predicate, (rc, out, err) in self.answers:
            if predicate(argv):
                return subprocess.CompletedProcess(argv, rc, out, err)
        return subprocess.CompletedProcess(argv, 0, "", "")


def has(*words: str) -> Callable[[list[str]], bool]:
    return lambda argv: all(w in argv for w in words)


def versioned(version: str) -> FakeRunner:
    fake = FakeRunner()
    fake.on(has("--version"), out=f"iptables v{version} (nf_tables)\n")
    return fake


# ------------------------------------------------------------------------------ unit tests


def test_parse_version() -> None:
    assert parse_version("iptables v1.8.9 (nf_tables)") == (1, 8, 9)
    assert parse_version("iptables-restore v1.6.2") == (1, 6, 2)
    assert parse_version("iptables v1.8") == (1, 8, 0)
    assert parse_version("no version here") is None


def test_wait_flags_follow_upstream_thresholds() -> None:
    assert restore_wait_flags((1, 8, 9), False) == ["-w", "5", "-W", "100000"]
    assert restore_wait_flags((1, 6, 2), False) == ["-w", "5", "-W", "100000"]
    assert restore_wait_flags((1, 6, 1), True) == ["-w"]
    assert restore_wait_flags((1, 4, 21), False) == []
    assert command_wait_flags((1, 6, 1)) == ["-w", "5", "-W", "100000"]
    assert command_wait_flags((1, 4, 22)) == ["-w", "5"]
    assert command_wait_flags((1, 4, 20)) == ["-w"]
    assert command_wait_flags((1, 4, 19)) == []


def test_restore_command_in_netns_with_upstream_flags() -> None:
    fake = versioned("1.8.9")
    backend = IptablesBackend("legacy", netns="ns1", runner=fake)
    backend.restore("*nat\nCOMMIT\n")
    argv, data = fake.calls[-1]
    assert argv == [
        "ip",
        "netns",
        "exec",
        "ns1",
        "iptables-legacy-restore",
        "-w",
        "5",
        "-W",
        "100000",
        "--noflush",
        "--counters",
    ]
    assert data == "*nat\nCOMMIT\n"
    # version is asked of the flavour's own iptables binary, once
    assert [a for a, _ in fake.calls if "--version" in a] == [
        ["ip", "netns", "exec", "ns1", "iptables-legacy", "--version"]
    ]
    backend.restore("x", noflush=False, counters=False)
    assert fake.calls[-1][0][-1] == "100000"


def test_old_restore_probes_its_own_version() -> None:
    fake = FakeRunner()
    fake.on(has("iptables-nft", "--version"), out="iptables v1.6.1\n")
    fake.on(has("iptables-nft-restore", "--version"), out="iptables-restore v1.6.1\n")
    backend = IptablesBackend("nft", runner=fake)
    assert backend.restore_command() == ["iptables-nft-restore", "-w", "--noflush", "--counters"]
    assert not backend.supports_random_fully()


def test_unreadable_version_assumes_upstream_minimum() -> None:
    fake = FakeRunner()
    fake.on(has("--version"), rc=127, err="not found")
    backend = IptablesBackend("nft", runner=fake)
    assert backend.version() == (1, 4, 11)
    assert not backend.supports_random_fully()
    assert backend.restore_wait_flags() == []


def test_rejects_unknown_flavour() -> None:
    with pytest.raises(ValueError, match="flavour"):
        IptablesBackend("iptables")


# stderr texts as iptables 1.8.9 prints them (measured in a namespace on this machine)
STDERR_PARSE = (
    "iptables-nft-restore v1.8.9 (nf_tables): Couldn't load match `bogus':No such "
    "file or directory\n\nError occurred at line: 4\nTry `iptables-nft-restore -h' "
    "or 'iptables-nft-restore --help' for more information.\n"
)
STDERR_NFT_FAILED = "iptables-nft-restore: line 3 failed: No chain/target/match by that name.\n"
STDERR_LEGACY_FAILED = (
    "Ignoring deprecated --wait-interval option.\niptables-restore: line 5 failed\n"
)
STDERR_CHAIN_DEL = (
    "iptables-nft-restore v1.8.9 (nf_tables): \nline 4: CHAIN_DEL failed (Device "
    "or resource busy): chain KUBE-A\n"
)
STDERR_COMMIT = "iptables-nft-restore: COMMIT expected at line 4\n"


@pytest.mark.parametrize(
    ("stderr", "line"),
    [
        (STDERR_PARSE, 4),
        (STDERR_NFT_FAILED, 3),
        (STDERR_LEGACY_FAILED, 5),
        (STDERR_CHAIN_DEL, 4),
        (STDERR_COMMIT, 4),
        ("Another app is holding the lock\n", None),
    ],
)
def test_parse_failed_line(stderr: str, line: int | None) -> None:
    assert parse_failed_line(stderr) == line


def test_restore_reason_skips_noise() -> None:
    assert restore_reason(STDERR_PARSE) == "Couldn't load match `bogus':No such file or directory"
    assert restore_reason(STDERR_LEGACY_FAILED) == "line 5 failed"
    assert restore_reason(STDERR_CHAIN_DEL).startswith("line 4: CHAIN_DEL failed")


def test_restore_error_names_line_and_text() -> None:
    data = "*nat\n:KUBE-A - [0:0]\n-A KUBE-A -j RETURN\n-A KUBE-A -m bogus -j RETURN\nCOMMIT\n"
    fake = versioned("1.8.9")
    fake.on(has("iptables-nft-restore"), rc=2, err=STDERR_PARSE)
    with pytest.raises(RestoreError) as info:
        IptablesBackend("nft", runner=fake).restore(data)
    err = info.value
    assert (err.returncode, err.line_number) == (2, 4)
    assert err.line_text == "-A KUBE-A -m bogus -j RETURN"
    assert err.input_data == data
    assert err.stderr == STDERR_PARSE
    assert str(err) == (
        "iptables-nft-restore rejected line 4 ('-A KUBE-A -m bogus -j RETURN'): "
        "Couldn't load match `bogus':No such file or directory"
    )
    assert "=>     4: -A KUBE-A -m bogus -j RETURN" in err.context()
    assert isinstance(err, IptablesError)


def test_restore_error_past_end_and_without_line() -> None:
    fake = versioned("1.8.9")
    fake.on(has("iptables-nft-restore"), rc=1, err=STDERR_COMMIT)
    with pytest.raises(RestoreError, match=r"line 4 \(past the end of the input\)") as info:
        IptablesBackend("nft", runner=fake).restore("*nat\n:X - [0:0]\n-A X -j RETURN\n")
    assert info.value.line_text is None
    fake = versioned("1.8.9")
    fake.on(has("iptables-nft-restore"), rc=4, err="Another app is currently holding the lock\n")
    with pytest.raises(RestoreError, match="failed with exit code 4: Another app") as info:
        IptablesBackend("nft", runner=fake).restore("*nat\nCOMMIT\n")
    assert info.value.line_number is None and info.value.context() == ""


def test_restore_error_points_at_jump_to_missing_chain() -> None:
    data = (
        "*filter\n:A - [0:0]\n-A A -j KUBE-MISSING\nCOMMIT\n*nat\n:B - [0:0]\n"
        "-A B -j RETURN\n-A B -m comment --comment x -j KUBE-MISSING\nCOMMIT\n"
    )
    fake = versioned("1.8.9")
    fake.on(
        has("iptables-nft-restore"),
        rc=2,
        err=(
            "iptables-nft-restore v1.8.9 (nf_tables): Chain 'KUBE-MISSING' does not exist\n"
            "Error occurred at line: 9\n"
        ),
    )
    with pytest.raises(RestoreError) as info:
        IptablesBackend("nft", runner=fake).restore(data)
    # only rules of the failed table are candidates
    assert info.value.suspect_line_number == 8
    assert str(info.value) == (
        "iptables-nft-restore rejected line 9 ('COMMIT'): Chain 'KUBE-MISSING' does not exist; "
        "the jump is on line 8 ('-A B -m comment --comment x -j KUBE-MISSING')"
    )


SAVE = """# Generated by iptables-save v1.8.9
*filter
:INPUT ACCEPT [0:0]
:KUBE-FIREWALL - [0:0]
-A INPUT -j KUBE-FIREWALL
COMMIT
*nat
:PREROUTING ACCEPT [3:180]
:KUBE-SERVICES - [0:0]
:KUBE-SVC-X - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A KUBE-SERVICES -d 10.96.0.10/32 -p udp -m udp --dport 53 -j KUBE-SVC-X
COMMIT
# Completed
"""


def test_parse_save_and_views() -> None:
    tables = parse_save(SAVE)
    assert set(tables) == {"filter", "nat"}
    assert tables["nat"].chains == {"PREROUTING": "ACCEPT", "KUBE-SERVICES": "-", "KUBE-SVC-X": "-"}
    assert len(tables["nat"].rules) == 2
    fake = FakeRunner()
    fake.on(has("iptables-legacy-save"), out=SAVE)
    backend = IptablesBackend("legacy", runner=fake)
    assert backend.chains("nat") == {"PREROUTING", "KUBE-SERVICES", "KUBE-SVC-X"}
    assert backend.rules("nat", "KUBE-SERVICES") == [
        "-A KUBE-SERVICES -d 10.96.0.10/32 -p udp -m udp --dport 53 -j KUBE-SVC-X"
    ]
    assert backend.save("mangle") == ""
    assert backend.save("filter").startswith("*filter\n") and backend.save("filter").endswith(
        "COMMIT\n"
    )
    # legacy never asks for one table: -t would create it in the kernel
    assert all("-t" not in argv for argv, _ in fake.calls)


def test_outline_keeps_chains_and_builtin_rules_only() -> None:
    outlines = outline_save(SAVE)
    assert outlines["nat"].chains == {"PREROUTING", "KUBE-SERVICES", "KUBE-SVC-X"}
    assert outlines["nat"].builtin_rules == {
        '-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES'
    }
    assert outlines["filter"].builtin_rules == {"-A INPUT -j KUBE-FIREWALL"}
    fake = FakeRunner()
    fake.on(has("iptables-legacy-save"), out=SAVE)
    got = IptablesBackend("legacy", runner=fake).outlines(("nat", "filter", "mangle"))
    assert got["mangle"].chains == set() and got["nat"].chains == outlines["nat"].chains
    assert len(fake.calls) == 1, "legacy reads every table from one save"


def test_nft_outlines_list_chain_names_and_read_builtin_chains_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    listed = {
        "filter": {"INPUT", "KUBE-FIREWALL"},
        "nat": {"PREROUTING", "KUBE-SERVICES", "KUBE-SVC-X"},
        "kube-proxy": {"service-ABC-ns/web/tcp/http"},
    }
    monkeypatch.setattr(IptablesBackend, "_listed_chains", lambda self: listed)
    fake = FakeRunner()
    fake.on(
        has("-S", "PREROUTING"),
        out='-P PREROUTING ACCEPT\n-A PREROUTING -m comment --comment "kubernetes service'
        ' portals" -j KUBE-SERVICES\n',
    )
    fake.on(has("-S", "INPUT"), out="-P INPUT ACCEPT\n-A INPUT -j KUBE-FIREWALL\n")
    got = IptablesBackend("nft", runner=fake).outlines(("nat", "filter", "mangle"))
    expected = outline_save(SAVE)
    for table in ("nat", "filter"):
        assert got[table].chains == expected[table].chains
        assert got[table].builtin_rules == expected[table].builtin_rules
    assert got["mangle"] == TableOutline()
    read = [argv for argv, _ in fake.calls if "-S" in argv]
    assert sorted(a[-1] for a in read) == ["INPUT", "PREROUTING"], "only existing built-ins"
    assert not any("iptables-nft-save" in argv for argv, _ in fake.calls)


def test_nft_outlines_fall_back_to_saves_when_chains_cannot_be_listed() -> None:
    fake = FakeRunner()  # a runner of the caller's own: no netlink behind its back
    fake.on(has("iptables-nft-save", "nat"), out=SAVE.split("*nat")[0].split("*filter")[0])
    fake.on(has("iptables-nft-save", "filter"), out="*filter\n:INPUT ACCEPT [0:0]\nCOMMIT\n")
    got = IptablesBackend("nft", runner=fake).outlines(("nat", "filter"))
    assert got["filter"].chains == {"INPUT"}
    assert sum("iptables-nft-save" in argv for argv, _ in fake.calls) == 2


def test_rule_spec_unquotes_comments() -> None:
    assert rule_spec('-A PREROUTING -m comment --comment "kubernetes service portals" -j X') == [
        "PREROUTING",
        "-m",
        "comment",
        "--comment",
        "kubernetes service portals",
        "-j",
        "X",
    ]


def _saves(**outputs: str) -> FakeRunner:
    fake = FakeRunner()
    for binary, text in outputs.items():
        fake.on(has(binary.replace("_", "-")), out=text)
    return fake


def test_detect_backend_heuristic_order() -> None:
    hint = "*mangle\n:KUBE-KUBELET-CANARY - [0:0]\nCOMMIT\n"
    rules = "*nat\n:KUBE-SERVICES - [0:0]\n-A KUBE-SERVICES -j RETURN\n-A OUTPUT -j X\nCOMMIT\n"
    assert detect_backend(runner=_saves()) == "nft"
    assert detect_backend(runner=_saves(iptables_legacy_save=hint)) == "legacy"
    assert detect_backend(runner=_saves(ip6tables_legacy_save=hint)) == "legacy"
    # the nft hint wins even when legacy holds more rules
    fake = _saves(iptables_nft_save=hint, iptables_legacy_save=rules)
    assert detect_backend(runner=fake) == "nft"
    assert detect_backend(runner=_saves(iptables_legacy_save=rules)) == "legacy"
    # a tie goes to nft
    fake = _saves(iptables_legacy_save=rules, iptables_nft_save=rules)
    assert detect_backend(runner=fake) == "nft"
    fake = _saves()
    detect_backend("ns9", runner=fake)
    assert all(argv[:4] == ["ip", "netns", "exec", "ns9"] for argv, _ in fake.calls)
    assert all("mangle" not in argv for argv, _ in fake.calls if "legacy" in argv[4])


def test_pick_node_ips() -> None:
    addresses = [
        ("lo", "127.0.0.1", "host"),
        ("eth1", "198.51.100.5", "global"),
        ("eth0", "192.0.2.9", "link"),
        ("eth0", "192.0.2.10", "global"),
    ]
    assert pick_node_ips(addresses, ["eth0"]) == ("192.0.2.10",)
    assert pick_node_ips(addresses, []) == ("198.51.100.5",)
    assert pick_node_ips([("lo", "127.0.0.1", "host")], []) == ()


def test_parse_nfacct_list() -> None:
    text = (
        "{ pkts = 00000000000000000000, bytes = 00000000000000000000 } = "
        "localhost_nps_accepted_pkts;\n{ pkts = 00000000000000000003, bytes = "
        "00000000000000000180 } = other;\n"
    )
    assert parse_nfacct_list(text) == frozenset({"localhost_nps_accepted_pkts", "other"})


# ---------------------------------------------------------------------------- kernel tests


def sh(*argv: str, input_data: str | None = None) -> str:
    proc = subprocess.run(argv, input=input_data, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, f"{argv}: {proc.stderr}"
    return proc.stdout


@pytest.fixture
def make_netns() -> Iterator[Callable[[], str]]:
    created: list[str] = []

    def make() -> str:
        name = f"kpxt-{uuid.uuid4().hex[:10]}"
        sh("ip", "netns", "add", name)
        created.append(name)
        sh("ip", "-n", name, "link", "set", "lo", "up")
        return name

    try:
        yield make
    finally:
        for name in created:
            subprocess.run(["ip", "netns", "del", name], check=False)


def legacy_tables(ns: str) -> set[str]:
    return set(sh("ip", "netns", "exec", ns, "cat", "/proc/net/ip_tables_names").split())


def nft_ruleset(ns: str) -> str:
    return sh("ip", "netns", "exec", ns, "nft", "list", "ruleset").strip()


GOOD = """\
*nat
:KUBE-SERVICES - [0:0]
:KUBE-SVC-TEST - [0:0]
-A KUBE-SERVICES -m comment --comment "ns/svc:dns cluster IP" -d 10.96.0.10/32 -p udp -m udp \
--dport 53 -j KUBE-SVC-TEST
-A KUBE-SVC-TEST -j RETURN
COMMIT
"""


@kernel
@needs_root
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_restore_creates_chains_and_save_parses(
    flavour: str, make_netns: Callable[[], str]
) -> None:
    ns = make_netns()
    backend = IptablesBackend(flavour, netns=ns)
    backend.restore(GOOD)
    assert {"KUBE-SERVICES", "KUBE-SVC-TEST", "PREROUTING"} <= backend.chains("nat")
    assert backend.rules("nat", "KUBE-SVC-TEST") == ["-A KUBE-SVC-TEST -j RETURN"]
    [svc_rule] = backend.rules("nat", "KUBE-SERVICES")
    assert '--comment "ns/svc:dns cluster IP"' in svc_rule
    assert "*nat" in backend.save() and "KUBE-SVC-TEST" in backend.save("nat")
    # the other flavour does not see these rules
    other = IptablesBackend("legacy" if flavour == "nft" else "nft", netns=ns)
    assert "KUBE-SVC-TEST" not in other.chains("nat")
    assert backend.version() >= (1, 8, 0) and backend.supports_random_fully()


@kernel
@needs_root
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_our_jumps_print_in_the_save_exactly_as_we_write_them(
    flavour: str, make_netns: Callable[[], str]
) -> None:
    # Full syncs find jumps in place by text (no -C per jump): that needs the save to print
    # each jump the way the renderer writes it.
    ns = make_netns()
    backend = IptablesBackend(flavour, netns=ns)
    wanted: dict[str, list[str]] = {"nat": [], "filter": []}
    for table, chain, extra, comment, target in JUMPS:
        wanted[table].append(jump_rule(chain, extra, comment, target))
    targets = {t for _, _, _, _, t in JUMPS}
    data = ""
    for table, rules in wanted.items():
        chains = sorted({r.rsplit(" -j ", 1)[1] for r in rules} & targets)
        data += f"*{table}\n" + "".join(f":{c} - [0:0]\n" for c in chains)
        data += "".join(f"-A {r}\n" for r in rules) + "COMMIT\n"
    backend.restore(data)
    outlines = backend.outlines(("nat", "filter"))
    for table, rules in wanted.items():
        for rule in rules:
            assert f"-A {rule}" in outlines[table].builtin_rules, (table, rule)
    # nft reads the outline from the netlink chain dump and `iptables -S`: the same as the saves.
    from_saves = outline_save(backend.save("nat") + backend.save("filter"))
    for table in wanted:
        assert outlines[table].builtin_rules == from_saves[table].builtin_rules
        user_chains = {c for c in from_saves[table].chains if c not in BUILTIN_CHAINS}
        assert user_chains <= outlines[table].chains


@kernel
@needs_root
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_bad_line_raises_restore_error(flavour: str, make_netns: Callable[[], str]) -> None:
    ns = make_netns()
    backend = IptablesBackend(flavour, netns=ns)
    data = (
        "*nat\n:KUBE-SERVICES - [0:0]\n-A KUBE-SERVICES -j RETURN\n"
        "-A KUBE-SERVICES -m nosuchmatch -j RETURN\nCOMMIT\n"
    )
    with pytest.raises(RestoreError) as info:
        backend.restore(data)
    err = info.value
    assert err.line_number == 4
    assert err.line_text == "-A KUBE-SERVICES -m nosuchmatch -j RETURN"
    assert "line 4" in str(err) and "nosuchmatch" in str(err)
    assert err.input_data == data and err.returncode != 0
    # the table was not committed
    assert "KUBE-SERVICES" not in backend.chains("nat")


@kernel
@needs_root
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_jump_to_missing_chain_and_busy_delete(flavour: str, make_netns: Callable[[], str]) -> None:
    ns = make_netns()
    backend = IptablesBackend(flavour, netns=ns)
    with pytest.raises(RestoreError) as info:
        backend.restore("*nat\n:KUBE-A - [0:0]\n-A KUBE-A -j KUBE-MISSING\nCOMMIT\n")
    err = info.value
    if flavour == "nft":
        # iptables-nft resolves jumps at COMMIT and blames that line
        assert (err.line_number, err.line_text) == (4, "COMMIT")
        assert (err.suspect_line_number, err.suspect_line_text) == (3, "-A KUBE-A -j KUBE-MISSING")
        assert "line 4" in str(err) and "line 3" in str(err)
    else:
        assert (err.line_number, err.line_text) == (3, "-A KUBE-A -j KUBE-MISSING")
        assert err.suspect_line_number is None
    # G2: -X of a chain that still has rules fails on that line
    backend.restore("*nat\n:KUBE-A - [0:0]\n-A KUBE-A -j RETURN\nCOMMIT\n")
    with pytest.raises(RestoreError) as info:
        backend.restore("*nat\n-X KUBE-A\nCOMMIT\n")
    assert (info.value.line_number, info.value.line_text) == (2, "-X KUBE-A")
    # ... and works after a declaration has flushed it, in the same input
    backend.restore("*nat\n:KUBE-A - [0:0]\n-X KUBE-A\nCOMMIT\n")
    assert "KUBE-A" not in backend.chains("nat")


@kernel
@needs_root
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_noflush_keeps_unrelated_chains(flavour: str, make_netns: Callable[[], str]) -> None:
    ns = make_netns()
    backend = IptablesBackend(flavour, netns=ns)
    backend.restore(
        "*nat\n:OTHER-CHAIN - [0:0]\n-A OTHER-CHAIN -j RETURN\n-A OUTPUT -j OTHER-CHAIN\nCOMMIT\n"
    )
    backend.restore(GOOD)
    backend.restore("*nat\n:KUBE-SVC-TEST - [0:0]\n-A KUBE-SVC-TEST -j ACCEPT\nCOMMIT\n")
    assert backend.rules("nat", "OTHER-CHAIN") == ["-A OTHER-CHAIN -j RETURN"]
    assert backend.rules("nat", "OUTPUT") == ["-A OUTPUT -j OTHER-CHAIN"]
    assert len(backend.rules("nat", "KUBE-SERVICES")) == 1
    # a declared chain is flushed and rewritten
    assert backend.rules("nat", "KUBE-SVC-TEST") == ["-A KUBE-SVC-TEST -j ACCEPT"]
    # without --noflush the whole table is replaced
    backend.restore("*nat\n:ONLY - [0:0]\nCOMMIT\n", noflush=False)
    assert "OTHER-CHAIN" not in backend.chains("nat")
    assert backend.rules("nat") == []


@kernel
@needs_root
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_check_and_delete_rule(flavour: str, make_netns: Callable[[], str]) -> None:
    ns = make_netns()
    backend = IptablesBackend(flavour, netns=ns)
    backend.restore(
        GOOD + '*nat\n-A PREROUTING -m comment --comment "kubernetes service '
        'portals" -j KUBE-SERVICES\nCOMMIT\n'
    )
    [jump] = backend.rules("nat", "PREROUTING")
    spec = rule_spec(jump)
    assert backend.check_rule("nat", spec)
    assert not backend.check_rule("nat", ["PREROUTING", "-j", "KUBE-SVC-TEST"])
    assert not backend.check_rule("nat", ["NO-SUCH-CHAIN", "-j", "RETURN"])
    assert backend.delete_rule("nat", spec)
    assert backend.rules("nat", "PREROUTING") == []
    assert not backend.delete_rule("nat", spec)


@kernel
@needs_root
def test_legacy_reads_do_not_create_tables(make_netns: Callable[[], str]) -> None:
    ns = make_netns()
    backend = IptablesBackend("legacy", netns=ns)
    assert backend.save("nat") == ""
    assert backend.chains("mangle") == set() and backend.rules("filter") == []
    assert legacy_tables(ns) == set()
    backend.restore("*nat\n:KUBE-X - [0:0]\nCOMMIT\n")
    assert legacy_tables(ns) == {"nat"}


@kernel
@needs_root
def test_detect_backend_fresh_namespace_is_nft_and_untouched(make_netns: Callable[[], str]) -> None:
    ns = make_netns()
    assert detect_backend(ns) == "nft"
    assert legacy_tables(ns) == set()
    assert nft_ruleset(ns) == ""


@kernel
@needs_root
def test_detect_backend_legacy_kube_rules(make_netns: Callable[[], str]) -> None:
    ns = make_netns()
    IptablesBackend("legacy", netns=ns).restore(
        GOOD + "*nat\n-A PREROUTING -j KUBE-SERVICES\nCOMMIT\n"
    )
    assert detect_backend(ns) == "legacy"
    # a legacy KUBE-KUBELET-CANARY alone (no rules) is enough too
    ns2 = make_netns()
    IptablesBackend("legacy", netns=ns2).restore("*mangle\n:KUBE-KUBELET-CANARY - [0:0]\nCOMMIT\n")
    assert detect_backend(ns2) == "legacy"


@kernel
@needs_root
def test_detect_backend_nft_kube_rules(make_netns: Callable[[], str]) -> None:
    ns = make_netns()
    IptablesBackend("nft", netns=ns).restore(GOOD)
    assert detect_backend(ns) == "nft"
    assert legacy_tables(ns) == set()
    # nft hint chain wins over more legacy rules, as in iptables-wrappers
    IptablesBackend("nft", netns=ns).restore("*mangle\n:KUBE-IPTABLES-HINT - [0:0]\nCOMMIT\n")
    IptablesBackend("legacy", netns=ns).restore(
        "*filter\n:A - [0:0]\n-A A -j RETURN\n-A A -j RETURN\n-A A -j RETURN\nCOMMIT\n"
    )
    assert detect_backend(ns) == "nft"


@kernel
@needs_root
def test_detect_node_facts(make_netns: Callable[[], str]) -> None:
    ns = make_netns()
    # the lower-index interface holds an address too, so "first address" would be wrong
    sh("ip", "-n", ns, "link", "add", "name", "kp-a", "type", "veth", "peer", "name", "kp-b")
    sh("ip", "-n", ns, "addr", "add", "198.51.100.5/24", "dev", "kp-b")
    sh("ip", "-n", ns, "addr", "add", "192.0.2.10/24", "dev", "kp-a")
    sh("ip", "-n", ns, "addr", "add", "192.0.2.11/24", "dev", "kp-a")
    sh("ip", "-n", ns, "link", "set", "kp-a", "up")
    sh("ip", "-n", ns, "link", "set", "kp-b", "up")
    sh("ip", "-n", ns, "route", "add", "default", "via", "192.0.2.1", "dev", "kp-a")
    first = next(a for _, a, _ in interface_addresses(ns) if a != "127.0.0.1")
    assert first == "198.51.100.5"  # the peer end gets the lower ifindex
    facts = detect_node_facts(ns)
    assert isinstance(facts, NodeFacts)
    assert facts.node_ips == ("192.0.2.10",)
    assert set(facts.local_addresses) == {"127.0.0.1", "198.51.100.5", "192.0.2.10", "192.0.2.11"}
    assert facts.random_fully is True
    assert facts.nfacct_counters == nfacct_counters(ns)
    assert facts.tcp_be_liberal is False
    # tcp_be_liberal is read inside the namespace (conntrack must be loaded for the sysctl)
    IptablesBackend("nft", netns=ns).restore(
        "*nat\n-A OUTPUT -d 10.96.0.10 -j DNAT --to-destination 192.0.2.20\nCOMMIT\n"
    )
    sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.netfilter.nf_conntrack_tcp_be_liberal=1")
    assert detect_node_facts(ns).tcp_be_liberal is True
    given = detect_node_facts(ns, IptablesBackend("legacy", netns=ns), ["192.0.2.11"])
    assert given.node_ips == ("192.0.2.11",)
    # no default route: the first non-loopback address
    sh("ip", "-n", ns, "route", "del", "default")
    assert detect_node_facts(ns).node_ips == ("198.51.100.5",)
