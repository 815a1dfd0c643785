"""KFP component: the stage table — floor/popularity/ltr plus every generative model, speed side by side."""

from kfp import dsl
from kfp.dsl import Artifact, Dataset, Input, Markdown, Metrics, Model, Output

from components._image import GPU_COMPONENT_KWARGS


@dsl.component(**GPU_COMPONENT_KWARGS)
def evaluate_models(
    examples: Input[Dataset],
    floor_report: Input[Artifact],
    sft_data: Input[Artifact],
    ar_sft_model: Input[Model],
    ar_model: Input[Model],
    naive_model: Input[Model],
    cft_model: Input[Model],
    opd_model: Input[Model],
    rl_model: Input[Model],
    report: Output[Artifact],
    summary: Output[Markdown],
    metrics: Output[Metrics],
    profile: str,
):
    """Score the reasoning teacher (from sft_data) and decode the test split with every model (AR teacher after SFT
    and after RL, naive conversion, CFT and the RL student at each tau, OPD at the serving
    tau), measure speed in one process, write report.json / report.md / plots; headline numbers to the KFP UI."""
    import base64
    from pathlib import Path

    from components._lib import model_steps

    bundles = {
        "ar_sft": ar_sft_model.path,
        "ar": ar_model.path,
        "naive": naive_model.path,
        "cft": cft_model.path,
        "opd": opd_model.path,
        "rl": rl_model.path,
    }
    rep = model_steps.evaluate_models(
        examples.path, floor_report.path, bundles, report.path, profile, sft_data.path
    )
    # A self-contained Markdown for the UI: plots inlined as data URIs.
    md = (Path(report.path) / "report.md").read_text()
    for name in rep.get("plots", []):
        data = base64.b64encode((Path(report.path) / name).read_bytes()).decode()
        md = md.replace(f"]({name})", f"](data:image/png;base64,{data})")
    for card in rep.get("model_cards", []):
        md += "\n\n" + (Path(report.path) / card).read_text()
    Path(summary.path).write_text(md)
    for row in rep["rows"]:
        key = row["model"] + (f"@tau{row['tau']}" if row.get("tau") is not None else "")
        metrics.log_metric(f"{key}/recall@1", row["recall@1"])
        if row.get("validity") is not None:
            metrics.log_metric(f"{key}/validity", row["validity"])
        if row.get("speedup_vs_ar") is not None:
            metrics.log_metric(f"{key}/speedup_vs_ar", row["speedup_vs_ar"])
