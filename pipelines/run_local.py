"""Run the retraining DAG locally with kfp.local (SubprocessRunner, use_venv=False): `make run`.

    python -m pipelines.run_local --profile quick --dataset ml-100k [--benchmark-dir benchmarks]
    python -m pipelines.run_local --runner docker --dataset <path or name under the data root> ...

With --runner docker every step runs in the image the compiled pipeline names for it (components/_image.py:
`make images` builds them), through kfp.local.DockerRunner, with nothing installed at run time; the pipeline
root and the dataset are mounted at the same paths, the dataset read-only (pipelines/containers.py).

Artifacts go under runs/<run_id>/kfp (the pipeline root); the evaluation's report is copied to
runs/<run_id>/report.json / report.md, runs/latest points to the newest run, and the floor table is printed.
With --benchmark-dir the report is also copied to <dir>/<dataset>.json / .md with the command, machine and
git sha.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd
import yaml

from components._lib.paths import REPO_ROOT, repo_relative
from components._lib.report_io import table_markdown
from gr2.config import Profile, load_profile, profile_raw


def _dataset_label(dataset: str) -> str:
    return Path(dataset).name if "/" in dataset else dataset


def _latest(pattern: str, root: Path) -> Path | None:
    hits = sorted(root.glob(pattern), key=lambda p: p.stat().st_mtime)
    return hits[-1] if hits else None


def _serve_smoke(root: Path, report: dict, run_dir: Path) -> dict | None:
    """Serve the DAG's deployable model (the bundle named like the gate's candidate, default the RL student)
    with the run's online store; the gate's verdict says whether a cluster would have received it."""
    from deploy.smoke_local import smoke

    decision = _latest("**/decision/decision.json", root)
    want = json.loads(decision.read_text())["candidate"].split("@")[0] if decision else "rl"
    bundles = [
        p.parent
        for p in sorted(root.glob("**/model/bundle/reranker.json"))
        if json.loads(p.read_text()).get("name") == want
    ]
    store, examples = _latest("**/materialize/feature_store", root), _latest("**/candidates/examples", root)
    if not bundles or store is None or examples is None:
        return None
    res = smoke(bundles[-1], store, examples, log=run_dir / "serving_smoke.log")
    res["gate_passed"] = bool((report.get("gate") or {}).get("passed"))
    return res


def _smoke_markdown(s: dict) -> str:
    verdict = (
        "deployed (gate passed)"
        if s["gate_passed"]
        else "NOT deployed (gate failed): served for this check only"
    )
    return (
        f"\n## Local serving check\n\nModel `{Path(s['model_uri']).parent.parent.name}` {verdict}, behind the Feast "
        f"transformer on {s['url']}: {s['ok']}/{s['requests']} v1 requests answered 200 ({s['valid']} valid "
        f"outputs, {s['with_history']} with history read from the online store, p50 {s['p50_ms']} ms); "
        f"{s.get('reordered')}/{s['ok']} rankings differ from the input order, and {s.get('same_top1_reversed')} "
        f"keep their top-1 when the candidates are sent reversed; v2 "
        f"{s['v2_status']}; malformed JSON {s['malformed_status']}, next request {s['status_after_malformed']}.\n"
    )


PROFILE_FILE = "profile.yaml"  # in a run directory: the profile with its --set overrides applied


def run_profile(run_dir: str | Path) -> Profile:
    """The profile a run used: its PROFILE_FILE when it ran with overrides, else its report's profile name."""
    path = Path(run_dir) / PROFILE_FILE
    if path.exists():
        return load_profile(str(path))
    return load_profile(json.loads((Path(run_dir) / "report.json").read_text())["profile"])


def run_examples(run_dir: str | Path) -> pd.DataFrame:
    """The candidate lists a run evaluated: the output of its `candidates` step (all splits)."""
    found = sorted(Path(run_dir).glob("kfp/*/candidates/examples"))
    if not found:
        raise FileNotFoundError(f"no kfp/*/candidates/examples under {run_dir}: not a run directory")
    return pd.read_parquet(found[-1])


def run_local(
    dataset: str = "ml-100k",
    profile: str = "quick",
    runs_dir: str | Path = REPO_ROOT / "runs",
    run_id: str = "",
    snapshot_date: str = "",
    max_users: int = 0,
    bounds_json: str = "{}",
    benchmark_dir: str | None = None,
    command: str = "",
    serve_smoke: bool = True,
    overrides: dict | None = None,
    runner: str = "subprocess",
    ablation: bool = False,
) -> dict:
    """Execute the pipeline locally; returns {"run_dir", "report" (or None), "validation", "seconds"}.

    overrides: dotted profile keys ({"seed": 1}); the profile they give is written to runs/<id>/profile.yaml and
    every step reads that file.

    serve_smoke: then serve the deployable model on 127.0.0.1 behind the Feast transformer and send it real
    requests (deploy/smoke_local.py); the summary goes into the report as `serving_smoke`.

    runner: "subprocess" (this venv) or "docker" (the compiled pipeline's images, see the module docstring).

    ablation: also train and score the no-trace ablation (its report lands beside the run's as ablation.md)."""
    from kfp import local

    from pipelines.pipeline import gr2_pipeline

    label = _dataset_label(dataset)
    run_id = run_id or f"{datetime.now(UTC):%Y%m%d-%H%M%S}-{label}-{Path(profile).stem}"
    run_dir = Path(runs_dir).resolve() / run_id
    root = run_dir / "kfp"
    root.mkdir(parents=True, exist_ok=True)
    if overrides:
        raw, _ = profile_raw(profile, overrides)
        raw["name"] = f"{raw['name']} " + " ".join(f"{k}={v}" for k, v in overrides.items())
        profile = str(run_dir / PROFILE_FILE)
        Path(profile).write_text(yaml.safe_dump(raw, sort_keys=False))
    if runner not in ("subprocess", "docker"):
        raise ValueError(f"runner {runner!r}: subprocess or docker")
    if runner == "docker" and overrides:
        raise ValueError(
            "--set overrides write the profile outside the pipeline root; the docker runner needs a profile file"
        )
    # Components import gr2/components from the project; the subprocesses inherit this environment.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    params = {
        "dataset": dataset,
        "profile": profile,
        "snapshot_date": snapshot_date or f"{datetime.now(UTC):%Y-%m-%d}",
        "max_users": max_users,
        "bounds_json": bounds_json,
        "ablation": ablation,
    }
    # The artifact store of the steps (production pointer, uploads, each step's published result, the outcome):
    # the configured one (GR2_S3_BUCKET or GR2_ARTIFACT_ROOT), else <runs_dir>/artifacts.
    own_root = not os.environ.get("GR2_S3_BUCKET") and not os.environ.get("GR2_ARTIFACT_ROOT")
    if own_root:
        os.environ["GR2_ARTIFACT_ROOT"] = str(Path(runs_dir).resolve() / "artifacts")
    # The commit the run starts from, for the steps' reports: read when a report is written, it would name whatever
    # HEAD is by then if commits land during a long run. The subprocess runner's steps inherit it.
    from gr2.report import git_sha

    own_sha = not os.environ.get("GR2_GIT_SHA")
    if own_sha:
        os.environ["GR2_GIT_SHA"] = git_sha()
    t0 = time.perf_counter()
    try:
        if runner == "docker":
            from pipelines.containers import docker_runner

            if os.environ.get("GR2_S3_BUCKET"):
                raise ValueError(
                    "the docker runner's steps have no network: an S3 artifact store is unreachable"
                )
            artifact_root = Path(os.environ["GR2_ARTIFACT_ROOT"])
            with docker_runner(root, dataset, artifact_root) as (docker, dataset_in_steps):
                params["dataset"] = dataset_in_steps
                local.init(runner=docker, pipeline_root=str(root), raise_on_error=True)
                gr2_pipeline(**params)
        else:
            local.init(
                runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(root), raise_on_error=True
            )
            gr2_pipeline(**params)
    finally:
        if own_root:
            del os.environ["GR2_ARTIFACT_ROOT"]
        if own_sha:
            del os.environ["GR2_GIT_SHA"]
    seconds = time.perf_counter() - t0
    out: dict = {"run_dir": str(run_dir), "report": None, "validation": [], "seconds": round(seconds, 1)}
    for v in sorted(root.glob("**/validation.json")):
        out["validation"].append(json.loads(v.read_text()))
    # The gate's copy of the report carries its decision; without model stages, the evaluation's report.
    report_json = _latest("**/decision/report.json", root) or _latest("**/report/report.json", root)
    if report_json is not None:
        report = json.loads(report_json.read_text())
        report["command"] = command or " ".join(shlex.quote(a) for a in sys.argv)
        report["run_id"] = run_id
        report["pipeline_seconds"] = round(seconds, 1)
        from gr2.report import write_report

        if serve_smoke:
            report["serving_smoke"] = _serve_smoke(root, report, run_dir)
        evaluated = _latest("**/report/report.json", root)
        for png in sorted(evaluated.parent.glob("*.png")) if evaluated else []:
            shutil.copy(png, run_dir / png.name)  # the plots the report links to
        if evaluated and (evaluated.parent / "model_cards").is_dir():
            shutil.copytree(evaluated.parent / "model_cards", run_dir / "model_cards", dirs_exist_ok=True)
        ablation_md = _latest("**/evaluate-ablation/ablation/report.md", root)
        if ablation_md is not None:
            report["ablation"] = json.loads((ablation_md.parent / "report.json").read_text())
            shutil.copy(ablation_md, run_dir / "ablation.md")
        write_report(run_dir, report, link_latest=True)  # runs/<id>/report.json + .md, runs/latest -> <id>
        with open(run_dir / "report.md", "a") as f:
            f.write(f"\nRun `{run_id}`, pipeline {seconds:.0f} s, command `{report['command']}`.\n")
            if report.get("serving_smoke"):
                f.write(_smoke_markdown(report["serving_smoke"]))
        out["report"] = report
        if benchmark_dir:
            bench = Path(benchmark_dir)
            bench.mkdir(parents=True, exist_ok=True)
            bench_report = repo_relative(json.loads((run_dir / "report.json").read_text()))
            (bench / f"{label}.json").write_text(json.dumps(bench_report, indent=1) + "\n")
            md = (run_dir / "report.md").read_text()
            for name in report.get("plots", []):
                shutil.copy(run_dir / name, bench / f"{label}_{name}")
                md = md.replace(f"]({name})", f"]({label}_{name})")
            for card in report.get("model_cards", []):  # model_cards/rl.md -> <label>_model_cards/rl.md
                dest = bench / f"{label}_{card}"
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_text(repo_relative((run_dir / card).read_text()))
                md = md.replace(f"]({card})", f"]({label}_{card})")
            (bench / f"{label}.md").write_text(repo_relative(md))
            if (run_dir / "ablation.md").exists():
                shutil.copy(run_dir / "ablation.md", bench / f"{label}_ablation.md")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="ml-100k", help="ml-100k, a name under ../shared/data, or a path")
    ap.add_argument("--profile", default="quick", help="profile name (profiles/<name>.yaml) or path")
    ap.add_argument("--benchmark-dir", default=None, help="also copy the report to <dir>/<dataset>.json/.md")
    ap.add_argument("--runs-dir", default=str(REPO_ROOT / "runs"))
    ap.add_argument("--run-id", default="")
    ap.add_argument("--snapshot-date", default="", help="data version (default: today, UTC)")
    ap.add_argument("--max-users", type=int, default=0, help="first N users only (0 = all)")
    ap.add_argument("--bounds-json", default="{}", help="validation row-count bounds override (JSON)")
    ap.add_argument("--command", default="", help="the command to record in the report (e.g. 'make bench')")
    ap.add_argument("--no-serve-smoke", action="store_true", help="skip serving the model after the run")
    ap.add_argument(
        "--runner",
        choices=["subprocess", "docker"],
        default="subprocess",
        help="docker: every step in its image (make images), kfp.local.DockerRunner",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a profile key, e.g. --set seed=1 (YAML value; repeatable)",
    )
    ap.add_argument("--ablation", action="store_true", help="also train and score the no-trace ablation")
    a = ap.parse_args(argv)
    overrides = {}
    for item in a.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            ap.error(f"--set wants KEY=VALUE, got {item!r}")
        overrides[key] = yaml.safe_load(value)
    res = run_local(
        dataset=a.dataset,
        profile=a.profile,
        runs_dir=a.runs_dir,
        run_id=a.run_id,
        snapshot_date=a.snapshot_date,
        max_users=a.max_users,
        bounds_json=a.bounds_json,
        benchmark_dir=a.benchmark_dir,
        # the command as typed, without the machine's path to this file (sys.argv[0] under python -m)
        command=a.command
        or shlex.join(["python", "-m", "pipelines.run_local", *(sys.argv[1:] if argv is None else argv)]),
        serve_smoke=not a.no_serve_smoke,
        overrides=overrides,
        runner=a.runner,
        ablation=a.ablation,
    )
    if res["report"] is None:
        print(f"\nNo report: validation stopped the pipeline after {res['seconds']} s ({res['run_dir']}).")
        for v in res["validation"]:
            if not v["passed"]:
                print(v["message"])
        return 1
    rep = res["report"]
    ret = rep["retriever"]
    print(
        f"\n{rep['dataset']} ({rep['profile']}): retriever hit rate {ret['hit_rate']:.4f}, "
        f"{ret['n_test_examples']} test examples; pipeline {res['seconds']} s"
    )
    print(table_markdown(rep))
    print(f"\nreport: {res['run_dir']}/report.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
