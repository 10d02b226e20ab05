"""`kproxy preflight` as a user meets it: usage errors (exit 2), help, the JSON contract."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def kproxy(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kproxy.cli", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


@pytest.mark.parametrize(("mode", "hint"), [("nftabels", "nftables"), ("IPVS", "ipvs")])
def test_a_misspelt_target_mode_is_a_usage_error_with_a_suggestion(mode: str, hint: str) -> None:
    out = kproxy("preflight", "--to", mode, "--state-dir", "/nonexistent")
    assert out.returncode == 2 and f"did you mean '{hint}'" in out.stderr
    assert out.stdout == ""


def test_missing_files_and_namespaces_are_usage_errors(tmp_path: Path) -> None:
    cfg = kproxy("preflight", "--to", "nftables", "--config", str(tmp_path / "no.yaml"),
                 "--state-dir", str(tmp_path))  # fmt: skip
    assert cfg.returncode == 2 and "--config" in cfg.stderr and "does not exist" in cfg.stderr
    ns = kproxy("preflight", "--to", "nftables", "--netns", "kp-no-such-ns", "--state-dir", "/x")
    assert ns.returncode == 2 and "no network namespace" in ns.stderr


def test_help_documents_the_exit_codes() -> None:
    helps = {command: kproxy(command, "--help") for command in ("preflight", "doctor", "switch")}
    for command in ("preflight", "doctor"):
        out = helps[command]
        assert (
            out.returncode == 0 and "Exit codes: 0" in out.stdout and "2 usage error" in out.stdout
        )
    switch = helps["switch"].stdout
    assert "--force" in switch and "preflight" in switch

    # --nftables-layout: the same words in both (rich's box and wrapping taken out).
    def said(text: str) -> str:
        return " ".join(" ".join(line.strip(" │") for line in text.splitlines()).split())

    layout = "With --to nftables: the layout to switch to (upstream or compact"
    assert layout in said(switch) and layout in said(helps["preflight"].stdout)


@pytest.mark.kernel
def test_the_json_report_and_the_exit_code_agree(tmp_path: Path) -> None:
    """This machine's own namespace, read only (nothing serves here: nothing to back up)."""
    out = kproxy("preflight", "--to", "nftables", "--json", "--state-dir", str(tmp_path))
    doc = json.loads(out.stdout)
    blocks = [f for f in doc["findings"] if f["severity"] == "block"]
    assert out.returncode == (1 if blocks else 0) == doc["exit_code"]
    assert doc["target"] == "nftables" and doc["current_mode"] is None
    assert "backup.nothing-to-back-up" in [f["id"] for f in doc["findings"]]
    assert not list(tmp_path.iterdir()), "no backup written when nothing serves"
