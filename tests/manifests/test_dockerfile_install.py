"""Each Dockerfile's own install RUN commands, executed for real in a fresh uv virtualenv (docker cannot run
here). The RUN text is parsed from the Dockerfile, not re-typed, so editing a Dockerfile changes what runs.

Everything runs as written, through sh, in the image's WORKDIR, except these substitutions:
- the build context: the Dockerfile's COPY instructions are replayed into tmp/rootfs/<dest>, so a missing COPY
  (say README.md, which hatchling needs) fails the install here as it would in `docker build`;
- absolute image paths (/app, /tmp) map into tmp/rootfs; ARG defaults and ENV are exported; `python` is the
  fresh venv's python (the image has no venv: its python is the base image's);
- `pip` is a shim running `uv pip install --python <venv>`: pip with the image's PIP_NO_CACHE_DIR would
  re-download every wheel on each run, uv installs from its cache with the same inputs (-c lock, extras, pins);
- download.pytorch.org is not reachable from dev/CI machines: the shim drops those --index-url /
  --extra-index-url values and adds --find-links /opt/wheels, which holds the torch 2.13.0+cpu wheel that the
  CPU index serves (the same substitution the Makefile's install uses). So the data and serve images are
  installed as built. For Dockerfile.train-gpu a CPU torch stands in for the cu128 one: its install commands,
  the project build and every other pin are verified, the CUDA wheel itself is not, and the image's own
  `assert torch.version.cuda` is checked to fire on the CPU stand-in (so a CPU torch cannot slip into it).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.manifests.test_images import EXTRAS, IMAGES, LOCK, ROOT, instructions

WHEELS = Path("/opt/wheels")
PYTORCH_INDEX = "https://download.pytorch.org/"
CUDA_ASSERT = "expected a CUDA build of torch"

# What each role's steps import, from the installed wheel (no PYTHONPATH): KFP component modules import kfp at
# the top and gr2/feast/GX inside their bodies, so the bodies' gr2 modules are listed too (the third-party
# packages are imported by each Dockerfile's own smoke `python -c`, which runs above).
ROLE_IMPORTS = {
    "data": [
        "components.ingest",
        "components.feast_apply",
        "components.materialize",
        "components.validate",
        "components.candidates",
        "components.gate",
        "components.deploy",
        "components.canary_analysis",
        "serving.rollout",
        "serving.canary",
        "components.artifact_store",
        "pipelines.pipeline",
        "gr2.gate",
        "gr2.metrics",
    ],
    "train-gpu": [
        "components.train_ar_teacher",
        "components.convert_cft",
        "components.distill_on_policy",
        "components.rl",
        "gr2.train",
        "gr2.teacher",
        "gr2.opd",
        "gr2.rl",
    ],
    "serve": ["serving.predictor", "serving.transformer", "serving.serve_local", "gr2.inference"],
}

SHIM = '''#!{python}
"""`pip install ARGS` -> `uv pip install --python $GR2_VENV_PY ARGS` (tests/manifests/test_dockerfile_install.py)."""
import json, os, sys

args = sys.argv[1:]
if args[:1] != ["install"]:
    sys.exit(f"pip shim: only `pip install` is supported, got {{args}}")
out, dropped, it = [], [], iter(args[1:])
for a in it:
    opt, eq, val = a.partition("=")
    if opt in ("-i", "--index-url", "--extra-index-url"):
        url = val if eq else next(it)
        if url.startswith("{pytorch}"):  # unreachable here: /opt/wheels holds its torch wheel
            dropped.append(url)
            continue
        out += [opt, url]
    else:
        out.append(a)
with open(os.environ["GR2_SHIM_LOG"], "a") as f:
    f.write(json.dumps({{"args": args[1:], "dropped": dropped}}) + "\\n")
uv, py = os.environ["GR2_UV"], os.environ["GR2_VENV_PY"]
os.execv(uv, [uv, "pip", "install", "--python", py, "--find-links", "{wheels}", *out])
'''


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


PINS = {norm(k.split("[")[0]): v for k, v in LOCK.items()}


def find_uv() -> str:
    uv = ROOT / ".venv" / "bin" / "uv"
    found = str(uv) if uv.exists() else shutil.which("uv")
    assert found, "uv not found (.venv/bin/uv or PATH): run `make install`, which installs the pinned uv"
    return found


def matches_lock(name: str, version: str) -> bool:
    """The lock's exact pin; torch by its public version (the local label, +cpu or +cu128, is the index's)."""
    lock = PINS.get(name)
    if lock is None or name != "torch":
        return version == lock
    return version.split("+")[0] == lock.split("+")[0]


def req_name(req: str) -> str:
    return norm(re.match(r"[A-Za-z0-9_.\-]+", req).group(0))


def extra_names(extra: str) -> set[str]:
    return {req_name(r) for r in EXTRAS[extra]}


class Image:
    """The parts of one Dockerfile this test replays: WORKDIR, ARG defaults, ENV, COPYs and the install RUNs."""

    def __init__(self, name: str):
        ins = instructions(name)
        workdirs = [rest for op, rest in ins if op == "WORKDIR"]
        assert len(workdirs) == 1 and workdirs[0].startswith("/"), f"{name}: one absolute WORKDIR expected"
        self.workdir = workdirs[0]
        self.args = dict(a.split("=", 1) for op, rest in ins if op == "ARG" for a in [rest] if "=" in a)
        self.env = dict(kv.split("=", 1) for op, rest in ins if op == "ENV" for kv in shlex.split(rest))
        # COPY --from copies out of another image, not from the build context
        self.copies = [
            shlex.split(rest) for op, rest in ins if op == "COPY" and not rest.startswith("--from=")
        ]
        self.runs = [rest for op, rest in ins if op == "RUN" and "pip install" in rest]
        assert self.runs, f"{name}: no RUN with `pip install`"


def host_paths(text: str, rootfs: Path, workdir: str) -> str:
    """Map the image's absolute paths (WORKDIR, /tmp) to their place under rootfs; URLs are left alone."""
    prefixes = "|".join(re.escape(p) for p in sorted({workdir.rstrip("/"), "/tmp"}, key=len, reverse=True))
    return re.sub(rf"(?<![\w./:])({prefixes})(?=/|\b)", lambda m: str(rootfs) + m.group(1), text)


def replay_copies(img: Image, rootfs: Path) -> Path:
    """COPY src... dest, with Docker's rules: dest relative to WORKDIR, a directory if it ends in / or has
    several sources, a directory source copies its contents."""
    app = rootfs / img.workdir.lstrip("/")
    app.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for tokens in img.copies:
        tokens = [t for t in tokens if not t.startswith("--")]
        *srcs, dest = tokens
        target = Path(dest) if dest.startswith("/") else Path(img.workdir) / dest
        target = rootfs / str(target).lstrip("/")
        into_dir = dest.endswith("/") or dest in (".", "./") or len(srcs) > 1
        for src in srcs:
            s = ROOT / src
            assert s.exists(), f"COPY {src}: not in the build context"
            t = target / s.name if into_dir and s.is_file() else target
            if s.is_dir():
                shutil.copytree(s, t, ignore=ignore, dirs_exist_ok=True)
            else:
                t.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(s, t)
    return app


def run_install(image: str, tmp: Path) -> tuple[subprocess.CompletedProcess, Path, Path, list[dict], Image]:
    """A fresh `uv venv`, the build context replayed, then the Dockerfile's install RUNs through sh."""
    assert WHEELS.is_dir(), f"{WHEELS} (the torch CPU wheel the lock pins) is missing on this machine"
    uv, img = find_uv(), Image(IMAGES[image])
    rootfs = tmp / "rootfs"
    app = replay_copies(img, rootfs)
    (rootfs / "tmp").mkdir()
    venv = tmp / "venv"
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True, timeout=120)
    shims = tmp / "shims"
    shims.mkdir()
    pip = shims / "pip"
    pip.write_text(SHIM.format(python=sys.executable, pytorch=PYTORCH_INDEX, wheels=WHEELS))
    pip.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV", "PYTHON"))}
    env.update(img.args)
    env.update({k: host_paths(v, rootfs, img.workdir) for k, v in img.env.items()})
    env.update(
        PATH=f"{venv / 'bin'}:{shims}:{os.environ['PATH']}",
        GR2_UV=uv,
        GR2_VENV_PY=str(venv / "bin" / "python"),
        GR2_SHIM_LOG=str(tmp / "pip.log"),
    )
    script = " && ".join(f"( {host_paths(r, rootfs, img.workdir)} )" for r in img.runs)
    r = subprocess.run(
        ["sh", "-c", script],  # what RUN's shell form runs
        cwd=app,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    log_file = tmp / "pip.log"
    log = [json.loads(ln) for ln in log_file.read_text().splitlines()] if log_file.exists() else []
    return r, venv, app, log, img


@pytest.mark.slow
@pytest.mark.parametrize("image", IMAGES)
def test_dockerfile_install_commands_build_the_locked_env(image, tmp_path):
    r, venv, app, log, img = run_install(image, tmp_path)
    out = r.stdout + r.stderr
    py = str(venv / "bin" / "python")
    n_pip = sum(len(re.findall(r"(?:^|&&|;)\s*pip install\b", run)) for run in img.runs)
    assert len(log) == n_pip, f"{image}: {len(log)} of {n_pip} pip installs ran\n{out[-3000:]}"
    dropped = [u for entry in log for u in entry["dropped"]]
    if image == "train-gpu":
        # The CPU torch stand-in must trip the image's own CUDA check, and only that (every install before it ran).
        assert r.returncode != 0 and CUDA_ASSERT in out, f"train-gpu: CUDA check did not fire\n{out[-3000:]}"
        assert dropped and all("/cu" in u for u in dropped), dropped
    else:
        assert r.returncode == 0, f"{image}: install RUN failed\n{out[-3000:]}"
        assert all(u.rstrip("/").endswith("/cpu") for u in dropped), f"{image}: non-CPU torch index {dropped}"

    uv = find_uv()
    check = subprocess.run([uv, "pip", "check", "--python", py], capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr

    listed = subprocess.run(
        [uv, "pip", "list", "--python", py, "--format", "json"], capture_output=True, text=True, check=True
    )
    installed = {norm(d["name"]): d for d in json.loads(listed.stdout)}
    project = installed.pop("diffusion-gr2")
    assert project["version"] == "0.1.0" and not project.get("editable_project_location"), project
    # Every installed distribution is in the lock, at the lock's version.
    wrong = {
        n: (d["version"], PINS.get(n)) for n, d in installed.items() if not matches_lock(n, d["version"])
    }
    assert not wrong, f"{image}: installed (version, lock) differ: {wrong}"
    if "TORCH_VERSION" in img.args:
        assert installed["torch"]["version"].split("+")[0] == img.args["TORCH_VERSION"]

    # Exactly the role's extras: each of their requirements present, other extras' (and dev tools) absent.
    project_install = next(e["args"] for e in log if any(a.startswith(".[") for a in e["args"]))
    extras = next(a for a in project_install if a.startswith(".["))[2:-1].split(",")
    mine = set().union(*(extra_names(e) for e in extras))
    mine |= {norm(a) for a in project_install if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.\-]*", a)}
    assert mine <= set(installed), f"{image}: extras {extras} not installed: {mine - set(installed)}"
    pinned_elsewhere = {
        req_name(r) for e, reqs in EXTRAS.items() if e not in extras and e != "all" for r in reqs if "==" in r
    }
    leaked = (pinned_elsewhere | {"pytest", "ruff", "moto"}) - mine
    assert not leaked & set(installed), (
        f"{image}: packages of other extras installed: {leaked & set(installed)}"
    )

    # The role's modules import from the installed wheel (outside the app dir, no PYTHONPATH).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    imp = subprocess.run(
        [py, "-c", "import " + ", ".join(ROLE_IMPORTS[image])],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert imp.returncode == 0, f"{image}: {imp.stderr[-2000:]}"
