"""The rollout steps as plain functions over folders (called by the KFP components deploy / canary_analysis and
by the CLI `gr2 deploy` / `gr2 canary-analysis`): one implementation per step.

deploy:           gated model bundle + the gate's decision folder -> the canary plan (deploy/rollout.py)
canary_analysis:  the deploy plan + the run's examples -> promote or roll back (deploy/canary.py)

`store`: where the artifact store lives, as `open_store`'s keyword arguments (bucket, prefix, endpoint_url,
local_root); empty values mean the defaults (the environment, else the local store).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from components._lib.paths import REPO_ROOT

if TYPE_CHECKING:
    from deploy.rollout import Plan


def _open_store(store: dict[str, str] | None):
    from components.artifact_store import open_store

    return open_store(**{k: v or None for k, v in (store or {}).items()})


def deploy(
    model_dir: str | Path,
    decision_dir: str | Path,
    plan_dir: str | Path,
    run_id: str,
    stage: str,
    overlay: str = "manifests/overlays/prod",
    canary_percent: int = 10,
    dry_run: bool = True,
    smoke_instance: dict[str, Any] | None = None,
    store: dict[str, str] | None = None,
    serve_image: str = "",
    examples_path: str | Path | None = None,
) -> Plan:
    """Upload the gated model, render the overlay and (unless dry_run) start its canary. Returns the
    `deploy.rollout` plan (`outcome`, `storage_uri`, ...). The smoke test asks `smoke_instance`, or else the
    newest test list of `examples_path`; the decision's report row becomes the production record."""
    from deploy.rollout import rollout
    from gr2.gate import find_row, read_report
    from gr2.generative import bundle_dir

    dec = json.loads((Path(decision_dir) / "decision.json").read_text())
    if not dec["passed"]:
        raise RuntimeError("deploy called for a model that did not pass the gate")
    report = read_report(decision_dir)
    row = find_row(report["rows"], dec["candidate"])
    if row is None:
        raise RuntimeError(f"the evaluation report has no row for the gated candidate {dec['candidate']!r}")
    record = {
        "model": dec["candidate"],
        "run_id": run_id,
        **{k: row[k] for k in ("recall@1", "ndcg@5") if k in row},
    }
    overlay_path = Path(overlay)
    if not overlay_path.is_absolute() and not overlay_path.exists():
        overlay_path = REPO_ROOT / overlay  # relative to the repo root
    smoke = smoke_instance or {}
    if not smoke and not dry_run:  # the canary must be asked something it can answer
        if examples_path is None:
            raise ValueError(
                "deploy needs smoke_instance_json or examples unless dry_run: one request to ask"
            )
        from deploy.canary import probe_set

        smoke = probe_set(examples_path, 1)[0]
    return rollout(
        str(bundle_dir(model_dir)),
        run_id,
        stage,
        record,
        _open_store(store),
        overlay_path,
        plan_dir,
        smoke,
        canary_percent,
        dry_run,
        serve_image=serve_image or None,
    )


def canary_analysis(
    plan_dir: str | Path,
    examples_path: str | Path,
    analysis_dir: str | Path,
    profile: str = "quick",
    prometheus_url: str = "http://prometheus-operated.monitoring.svc:9090",
    revision_label: str = "serving_knative_dev_revision",
    scrape_interval_s: float = 30.0,
    model_name: str = "",
    store: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Move the canary through the profile's traffic steps, judge it against stable at each, then promote
    (writing the production pointer) or roll back. Returns the analysis report (`outcome`, `steps`)."""
    from deploy.canary import analyze, probe_set
    from gr2.config import load_profile

    cfg = load_profile(profile).canary
    return analyze(
        plan_dir,
        analysis_dir,
        _open_store(store),
        cfg,
        prometheus_url,
        probe_set(examples_path, cfg.probe_size),
        model_name=model_name or None,
        revision_label=revision_label,
        scrape_interval_s=scrape_interval_s,
    )
