"""make lint's duplicate check: codeclone (pinned in the lock) over every Python file of the repository (the
packages, tests and scripts; .venv and build excluded), block clones of 3+ statements inside functions of 6+ lines,
within one file and across files. Every clone group must be allowed in scripts/duplicates-allowed.txt with a
one-line reason (at most 10); an allowance that matches nothing fails too, so the list stays true.

    python scripts/check_duplicates.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = ROOT / "scripts" / "duplicates-allowed.txt"
MAX_ALLOWANCES = 10


def clone_groups() -> list[frozenset[str]]:
    """Each clone group as the set of its places, `path:qualname`."""
    with tempfile.TemporaryDirectory(prefix="gr2-codeclone-") as tmp:
        report = Path(tmp) / "clones.json"
        args = [
            "--min-loc",
            "6",
            "--min-stmt",
            "3",
            "--skip-metrics",
            "--skip-dead-code",
            "--skip-dependencies",
        ]
        args += ["--no-progress", "--no-color", "--quiet", "--cache-path", str(Path(tmp) / "cache.json")]
        codeclone = Path(sys.executable).parent / "codeclone"
        proc = subprocess.run(
            [str(codeclone), str(ROOT), *args, "--json", str(report), "--no-timestamped-report-paths"],
            capture_output=True,
            text=True,
        )
        if not report.exists():
            sys.exit(f"codeclone wrote no report (exit {proc.returncode}): {proc.stderr[-2000:]}")
        groups = json.loads(report.read_text())["findings"]["groups"]["clones"]
    return [
        frozenset(f"{i['relative_path']}:{i['qualname'].split(':')[-1]}" for i in g["items"])
        for kind in ("functions", "blocks", "segments")
        for g in groups.get(kind, [])
    ]


def allowances() -> dict[frozenset[str], str]:
    """Lines `path:function path:function ...  # reason`; blank lines and lines starting with # are skipped."""
    out = {}
    for n, line in enumerate(ALLOWED.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        places, _, reason = line.partition("#")
        if not reason.strip():
            sys.exit(f"{ALLOWED.name}:{n}: an allowance needs a one-line reason after '#'")
        out[frozenset(places.split())] = reason.strip()
    return out


def main() -> int:
    allowed, found = allowances(), clone_groups()
    new = [g for g in found if g not in allowed]
    stale = [g for g in allowed if g not in found]
    for g in new:
        print("duplicate code:", " ".join(sorted(g)))
    for g in stale:
        print(f"{ALLOWED.name}: no such clone any more (remove the line):", " ".join(sorted(g)))
    if len(allowed) > MAX_ALLOWANCES:
        print(f"{ALLOWED.name}: {len(allowed)} allowances, at most {MAX_ALLOWANCES}")
    print(f"duplicates: {len(found)} clone groups, {len(allowed)} allowed")
    return 1 if new or stale or len(allowed) > MAX_ALLOWANCES else 0


if __name__ == "__main__":
    sys.exit(main())
