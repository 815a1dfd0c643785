"""The type checker: mypy is clean on the package code (gr2/, components/, pipelines/, analysis/, serving/, deploy/).

The configuration is [tool.mypy] in pyproject.toml; `make lint` runs the same check. mypy caches its analysis
under .cache/mypy, so only a cold run (a fresh clone) reads torch's and transformers' own annotations."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gr2", "components", "pipelines", "analysis", "serving", "deploy")


@pytest.mark.slow
def test_mypy_is_clean_on_every_module_of_the_package():
    r = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    # Every module was checked: the configured `files` still name the whole package.
    n = sum(1 for pkg in PACKAGES for _ in (ROOT / pkg).rglob("*.py"))
    assert f"no issues found in {n} source files" in r.stdout, r.stdout
