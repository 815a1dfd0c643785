"""The generative model steps as plain functions over folders (called by the KFP components, the CLI, tests).

prepare_sft:   sources + examples -> sft_data/ (evidence, semantic IDs, tokenizer, teacher, SFT records)
train_ar:      sft_data -> AR teacher bundle (GR2 SFT), variant "trace" or "ar_no_trace"
convert_cft:   AR bundle + sft_data -> naive converted bundle, CFT bundle
rl:            AR or diffusion bundle + sft_data + examples -> the bundle after GRPO (docs/PAPER.md, RL)
distill:       diffusion student + AR teacher bundles -> the student after on-policy distillation (docs/PAPER.md, OPD)
evaluate:      examples + bundles + the floor report -> the full report (rows, speed, plots)
ablation:      examples + the AR teacher and its no-trace ablation -> what the trace buys (paired)
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from components._lib import sources
from components._lib.steps import as_profile, load_evidence
from gr2.config import Profile
from gr2.generative import bundle_dir

log = logging.getLogger("gr2.steps")


def prepare_sft(
    sources_dir: str | Path, examples_path: str | Path, out_dir: str | Path, profile: str | Profile
) -> dict:
    from gr2.stages.prepare import prepare_sft as _prepare

    prof = as_profile(profile)
    data = _prepare(
        sources.read_table(examples_path),
        sources.read_dataset(sources_dir, event_ts=False),
        prof,
        load_evidence(sources_dir),
    )
    data.save(out_dir)
    return {k: v for k, v in data.stats.items() if k != "sid"} | {
        "sid_unique_levels_1_3": data.sids.stats.get("unique_frac_levels_1_3"),
        "sid_codebook_size": data.sids.stats.get("codebook_size"),
    }


def train_ar(
    sft_dir: str | Path, out_dir: str | Path, profile: str | Profile, variant: str = "trace"
) -> dict:
    """Train the AR teacher; the bundle goes to out_dir/bundle (training log and curve beside it)."""
    from gr2.stages.prepare import SFTData
    from gr2.stages.train_stages import bundle_meta, train_ar_teacher

    bundle = train_ar_teacher(SFTData.load(sft_dir), as_profile(profile), out_dir, variant)
    return bundle_meta(bundle)["train"]


def convert_cft(
    ar_dir: str | Path,
    sft_dir: str | Path,
    naive_dir: str | Path,
    cft_dir: str | Path,
    profile: str | Profile,
) -> dict:
    """Naive conversion (naive_dir: a bundle, no training) then CFT (cft_dir/bundle, logs in cft_dir/train)."""
    from gr2.stages.prepare import SFTData
    from gr2.stages.train_stages import bundle_meta, convert, train_cft

    prof = as_profile(profile)
    dc = prof.diffusion
    naive = convert(bundle_dir(ar_dir), dc, naive_dir)
    cft = train_cft(naive, SFTData.load(sft_dir), prof, cft_dir)
    return bundle_meta(cft)["train"]


def rl(
    model_dir: str | Path,
    sft_dir: str | Path,
    examples_path: str | Path,
    out_dir: str | Path,
    profile: str | Profile,
) -> dict:
    """GRPO on training prompts; AR bundles use profile.ar_rl, diffusion bundles profile.rl (out_dir/bundle)."""
    from gr2.stages.opd_rl import train_rl
    from gr2.stages.prepare import SFTData
    from gr2.stages.train_stages import bundle_meta

    bundle = train_rl(
        bundle_dir(model_dir),
        SFTData.load(sft_dir),
        sources.read_table(examples_path),
        as_profile(profile),
        out_dir,
    )
    return bundle_meta(bundle)["train"]


def distill(
    student_dir: str | Path,
    teacher_dir: str | Path,
    sft_dir: str | Path,
    examples_path: str | Path,
    out_dir: str | Path,
    profile: str | Profile,
) -> dict:
    """OPD of the diffusion student from the frozen AR teacher, KL direction from the profile (out_dir/bundle)."""
    from gr2.stages.opd_rl import train_opd
    from gr2.stages.prepare import SFTData
    from gr2.stages.train_stages import bundle_meta

    bundle = train_opd(
        bundle_dir(student_dir),
        bundle_dir(teacher_dir),
        SFTData.load(sft_dir),
        sources.read_table(examples_path),
        as_profile(profile),
        out_dir,
    )
    return bundle_meta(bundle)["train"]


def evaluate_models(
    examples_path: str | Path,
    floor_report_dir: str | Path,
    bundles: Mapping[str, str | Path],
    out_dir: str | Path,
    profile: str | Profile,
    sft_dir: str | Path | None = None,
) -> dict[str, Any]:
    """Add the reasoning teacher's row (from `sft_dir`), the generative rows and the speed list to the floor
    report; plots; write report.json / report.md."""
    from gr2.model_card import write_model_cards
    from gr2.plots import plot_frontier, plot_training_curves
    from gr2.report import write_report
    from gr2.stages.evaluate import evaluate_generative, teacher_row
    from gr2.stages.prepare import SFTData

    t0 = time.perf_counter()
    prof = as_profile(profile)
    test = sources.read_test_lists(examples_path, prof.data.max_eval_examples)
    report = json.loads((Path(floor_report_dir) / "report.json").read_text())
    paths = {name: bundle_dir(p) for name, p in bundles.items() if p}
    ev = evaluate_generative(paths, test, prof)
    rows = ev.rows
    if sft_dir is not None:
        rows = [teacher_row(SFTData.load(sft_dir), test, prof), *rows]
    report["rows"] = report["rows"] + rows
    report["speed"] = ev.speed
    report["by_length"] = ev.by_length
    report["cold_start"] = ev.cold_start
    report["operating_tau"] = ev.operating_tau
    report["training"] = {
        name: json.loads((p / "reranker.json").read_text()).get("train") for name, p in paths.items()
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots = [plot_frontier(report, out / "frontier.png")]
    logs = {name: p.parent / "train" / "train_log.jsonl" for name, p in paths.items()}
    curves = plot_training_curves({k: v for k, v in logs.items() if v.exists()}, out / "training_curves.png")
    if curves:
        plots.append(curves)
    for name, p in paths.items():  # on-policy stages: reward / validity / KL per step
        rollout_png = p.parent / "train" / "curves.png"
        if rollout_png.exists():
            plots.append(Path(shutil.copy(rollout_png, out / f"{name}_rollout_curves.png")))
    report["plots"] = [p.name for p in plots]
    report["model_cards"] = [str(c.relative_to(out)) for c in write_model_cards(paths, report, out)]
    report["seconds_evaluate_models"] = round(time.perf_counter() - t0, 1)
    write_report(out, report)
    return report


def evaluate_ablation(
    examples_path: str | Path, bundles: Mapping[str, str | Path], out_dir: str | Path, profile: str | Profile
) -> dict[str, Any]:
    """The no-trace ablation's report (gr2/stages/evaluate.py `ablation_rows`): report.json and report.md."""
    from gr2.report import fmt_ci, json_default
    from gr2.stages.evaluate import ablation_rows

    prof = as_profile(profile)
    test = sources.read_test_lists(examples_path, prof.data.max_eval_examples)
    rep = ablation_rows({name: bundle_dir(p) for name, p in bundles.items()}, test, prof)
    d = rep["ar_minus_ar_no_trace"]
    lines = [
        "# Ablation: what the trace buys",
        "",
        "The AR teacher against the same model trained on the answer alone, on the same test lists.",
        "",
        "| model | recall@1 | validity |",
        "|---|---|---|",
        *(
            f"| {r['model']} | {r['recall@1']:.4f}{fmt_ci(r, 'recall@1')} | {r['validity']:.3f} |"
            for r in rep["rows"]
        ),
        "",
        f"`ar` - `ar_no_trace` recall@1 {d['delta']:+.4f}, paired 95% CI [{d['ci95'][0]:+.4f}, "
        f"{d['ci95'][1]:+.4f}] on {d['n_lists']} lists.",
    ]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(rep, indent=1, default=json_default))
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return rep
