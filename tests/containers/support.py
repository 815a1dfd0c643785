"""Helpers of the container tests: a command in a throwaway container, a `run_local` run directory and its
kfp.local log."""

from __future__ import annotations

import json
import re
from pathlib import Path

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def run_output(run_dir: Path, pattern: str) -> Path:
    """The newest `kfp/**/<pattern>` of a run (a task's output artifact)."""
    hits = sorted((run_dir / "kfp").glob(f"**/{pattern}"), key=lambda p: p.stat().st_mtime)
    assert hits, f"no {pattern} under {run_dir}/kfp"
    return hits[-1]


def bundle_named(run_dir: Path, name: str) -> Path:
    """The model bundle of a run whose reranker.json names `name` (as run_local picks the deployable one)."""
    found = [
        p.parent
        for p in sorted((run_dir / "kfp").glob("**/model/bundle/reranker.json"))
        if json.loads(p.read_text()).get("name") == name
    ]
    assert found, f"no {name} bundle under {run_dir}/kfp"
    return found[-1]


def executed_tasks(log: str) -> list[str]:
    """The tasks kfp.local ran, in order, from its log (`Executing task 'x'`)."""
    return re.findall(r"Executing task '([^']+)'", ANSI.sub("", log))


def executed_images(log: str) -> list[tuple[str, str]]:
    """(task, image) for each task kfp.local's DockerRunner ran, from its log: `Executing task 'x'` and then the
    `Found image 'y'` (or `Pulling image`) line of the container it started for it."""
    out, task = [], None
    for line in ANSI.sub("", log).splitlines():
        m = re.search(r"Executing task '([^']+)'", line)
        if m:
            task = m.group(1)
        m = re.search(r"(?:Found|Pulling) image '([^']+)'", line)
        if m and task is not None:
            out.append((task, m.group(1)))
            task = None
    return out


def run_in(client, image: str, command: list[str], **kwargs) -> str:
    """Run `command` in a throwaway container of `image` (no network) and return its output; raises with the
    output when it fails."""
    import docker

    try:
        out = client.containers.run(
            image, command, remove=True, network_mode="none", stdout=True, stderr=True, **kwargs
        )
    except docker.errors.ContainerError as e:
        raise AssertionError(f"{image} {command}: exit {e.exit_status}\n{e.stderr.decode()[-3000:]}") from e
    return out.decode()
