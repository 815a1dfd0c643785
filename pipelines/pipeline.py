"""The retraining DAG: ingest -> feast apply/materialize -> extract -> validate -> candidates -> validate ->
evaluate. Every step is a component in components/; `make run` executes this same definition locally with
kfp.local (pipelines/run_local.py) and `make compile` writes it as cluster YAML (pipelines/cli.py).

Later stages (train_ar_teacher, convert_cft, distill_on_policy, rl, evaluate, gate, deploy) plug in inside
`_model_stages`, under both validation conditions: they read `examples` (the re-ranking examples table) and
`sources`, and a failed validation skips them all.
"""

# no `from __future__ import annotations`: KFP reads the real annotation objects

from kfp import dsl

from components.candidates import candidates
from components.evaluate_floor import evaluate_floor
from components.extract import extract
from components.feast_apply import feast_apply
from components.ingest import ingest
from components.validate import validate

PIPELINE_NAME = "gr2-retraining"


def _model_stages(sources, examples, profile, dataset) -> None:
    """Model stages that run only on validated examples. First version: the floor / popularity / ltr table."""
    evaluate_floor(sources=sources, examples=examples, profile=profile, dataset=dataset).set_display_name(
        "evaluate-floor"
    )


@dsl.pipeline(
    name=PIPELINE_NAME,
    description="Diffusion-GR2: data -> features -> validated re-ranking examples -> models",
)
def gr2_pipeline(
    dataset: str = "ml-100k",
    profile: str = "quick",
    snapshot_date: str = "",
    max_users: int = 0,
    fs_yaml: str = "",
    bounds_json: str = "{}",
):
    """`snapshot_date` is part of every cache key: a nightly run with a new date never reuses old data.

    `fs_yaml` = "" uses a per-run local feature store; a path (e.g. feature_repo/envs/prod.feature_store.yaml)
    selects an environment's registry / offline / online stores. `bounds_json` overrides validation
    row-count bounds (components/_lib/validation.py Bounds), e.g. for a small slice.
    """
    ing = ingest(dataset=dataset, profile=profile, snapshot_date=snapshot_date, max_users=max_users)
    fs = feast_apply(sources=ing.outputs["sources"], fs_yaml=fs_yaml)
    ex = extract(sources=ing.outputs["sources"], feature_store=fs.outputs["feature_store"], fs_yaml=fs_yaml)
    vt = validate(
        sources=ing.outputs["sources"],
        table=ex.outputs["targets"],
        profile=profile,
        stage="targets",
        bounds_json=bounds_json,
    ).set_display_name("validate-targets")
    with dsl.If(vt.outputs["Output"] == True, name="targets-valid"):  # noqa: E712 (a KFP condition, not a bool)
        cand = candidates(sources=ing.outputs["sources"], targets=ex.outputs["targets"], profile=profile)
        ve = validate(
            sources=ing.outputs["sources"],
            table=cand.outputs["examples"],
            profile=profile,
            stage="examples",
            bounds_json=bounds_json,
        ).set_display_name("validate-examples")
        with dsl.If(ve.outputs["Output"] == True, name="examples-valid"):  # noqa: E712
            _model_stages(ing.outputs["sources"], cand.outputs["examples"], profile, dataset)


def compile_pipeline(output: str) -> str:
    """Compile the DAG to KFP IR YAML at `output`."""
    from pathlib import Path

    from kfp import compiler

    Path(output).parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(gr2_pipeline, package_path=output)
    return output
