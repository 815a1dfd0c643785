"""`gr2`: every pipeline step from the command line (the same functions the KFP components call).


gr2 data fetch                       MovieLens-100K into .cache/ (from the recbole wheel)
gr2 ingest --dataset ml-100k --out runs/x/sources
gr2 feast-apply --sources runs/x/sources --store runs/x/feast
gr2 extract --sources ... --store ... --out runs/x/targets.parquet
gr2 validate --dataset PATH          GX suites on a dataset folder (exit 1 if anything fails)
gr2 validate --sources ... --table runs/x/examples.parquet --stage examples
gr2 candidates --sources ... --targets ... --out runs/x/examples.parquet
gr2 evaluate --sources ... --examples ... --out runs/x/report
gr2 pipeline compile --output build/pipeline.yaml
gr2 pipeline run-local --dataset ml-100k --profile quick
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
pipeline_app = typer.Typer(help="Compile or run the KFP pipeline.", no_args_is_help=True)
app.add_typer(data_app, name="data")
app.add_typer(pipeline_app, name="pipeline")


def _echo(obj) -> None:
    typer.echo(json.dumps(obj, indent=2, default=str))


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
    store: Path = typer.Option(..., help="feature store folder (registry + sqlite online store)"),
    fs_yaml: str = typer.Option("", help="environment yaml instead of a local store"),
) -> None:
    """feast apply + materialize the online store."""
    from components._lib import steps

    _echo(steps.feast_apply(sources, store, fs_yaml))


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


@app.command()
def evaluate(
    sources: Path = typer.Option(...),
    examples: Path = typer.Option(...),
    out: Path = typer.Option(..., help="report folder (report.json / report.md)"),
    profile: str = typer.Option("quick"),
    dataset: str = typer.Option(""),
) -> None:
    """Floor, popularity and ltr rows on the test examples."""
    from components._lib import steps
    from components._lib.report_io import table_markdown

    typer.echo(table_markdown(steps.evaluate(sources, examples, out, profile, dataset)))


@pipeline_app.command("compile")
def pipeline_compile(output: Path = typer.Option(Path("build/pipeline.yaml"))) -> None:
    """Compile the DAG to KFP YAML (image from GR2_IMAGE)."""
    from pipelines.pipeline import compile_pipeline

    typer.echo(compile_pipeline(str(output)))


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


if __name__ == "__main__":
    app()
