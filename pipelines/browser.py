"""Headless Chromium (Debian's `chromium`, installed by `scripts/setup-system.sh test`): what a browser shows of
a page, as the KFP UI would show an HTML artifact. Returns the DOM after rendering and can save a screenshot.

As root and on a machine whose network refuses outside connections it needs: no sandbox, no GPU, none of the
background connections (updates, sync, QUIC), and a fresh profile folder per call.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)


def render(
    page: str | Path, screenshot: str | Path | None = None, size: tuple[int, int] = (1280, 1600)
) -> str:
    """Load `page` (a local HTML file) in headless Chromium; return the rendered DOM, and write a PNG of the
    first `size` pixels (width, height) to `screenshot` when given."""
    with tempfile.TemporaryDirectory(prefix="gr2-chromium-") as profile:
        cmd = [
            "chromium",
            *FLAGS,
            f"--user-data-dir={profile}",
            f"--window-size={size[0]},{size[1]}",
            "--dump-dom",
        ]
        if screenshot is not None:
            cmd.append(f"--screenshot={Path(screenshot).resolve()}")
        proc = subprocess.run(
            [*cmd, Path(page).resolve().as_uri()], capture_output=True, text=True, timeout=180, check=False
        )
    if proc.returncode != 0 or "<html" not in proc.stdout:
        raise RuntimeError(
            f"chromium could not render {page} (exit {proc.returncode}): {proc.stderr[-2000:]}"
        )
    if screenshot is not None and not Path(screenshot).is_file():
        raise RuntimeError(f"chromium wrote no screenshot of {page}: {proc.stderr[-2000:]}")
    return proc.stdout
