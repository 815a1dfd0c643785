"""scripts/setup-system.sh, the one set-up step of `make test` and CI: nothing missing, it returns at once; a tool
missing where it cannot install, it stops within seconds naming the exact command."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "setup-system.sh"


def fake_path(tmp_path: Path, tools: list[str]) -> str:
    """A PATH with the shell's own utilities and stand-ins for `tools`, and no apt-get (so nothing installs)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("bash", "id", "env"):
        (bin_dir / name).symlink_to(shutil.which(name))
    for name in tools:
        (bin_dir / name).write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / name).chmod(0o755)
    return str(bin_dir)


def run(tmp_path: Path, tools: list[str], *groups: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": fake_path(tmp_path, tools)}
    return subprocess.run(
        [shutil.which("bash"), str(SCRIPT), *groups], env=env, capture_output=True, text=True, timeout=30
    )


def test_everything_present_returns_at_once(tmp_path):
    r = run(tmp_path, ["prometheus", "chromium"], "test")
    assert r.returncode == 0 and r.stdout == "" and r.stderr == ""


def test_a_missing_tool_that_cannot_be_installed_stops_with_the_command(tmp_path):
    r = run(tmp_path, [], "test")
    assert r.returncode == 1
    assert "missing prometheus chromium" in r.stderr
    assert "sudo apt-get install -y --no-install-recommends prometheus chromium" in r.stderr


@pytest.mark.parametrize("groups", [(), ("nonsense",)])
def test_a_wrong_call_is_refused(tmp_path, groups):
    r = run(tmp_path, ["prometheus", "chromium"], *groups)
    assert r.returncode == 2 and ("usage" in r.stderr or "unknown group 'nonsense'" in r.stderr)
