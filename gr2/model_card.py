"""Model cards: one Markdown page per evaluated model, written beside the run report (`model_cards/<name>.md`).

A card says what the model is (architecture, decoder, size), how it was made (stage, parent, teacher, training
summary from its bundle's reranker.json), what it was measured to do on this run's test users (every report row
of that model, with CIs, validity, NFE and speed), and what it is not for. Everything on it is read from the
bundle and the report; nothing is typed in by hand.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gr2.report import fmt_ci, fmt_value

STAGES = {
    "ar_sft": "AR teacher after supervised fine-tuning on the reasoning teacher's traces (GR2 stage 1-2)",
    "ar": "AR teacher: SFT + GRPO (GR2 stage 3); the speed baseline and the teacher of the diffusion stages",
    "ar_no_trace": "ablation: the AR teacher trained on the answer alone (no trace)",
    "naive": "the AR teacher converted to block diffusion with no training (the structural gap)",
    "cft": "block diffusion after conversion fine-tuning (masked diffusion inside blocks on the SFT prompts; "
    "targets per diffusion.cft_targets, by default the AR teacher's greedy responses; certainty forcing per "
    "diffusion.certainty_weight)",
    "opd": "block diffusion after on-policy distillation from the AR teacher",
    "rl": "block diffusion after GRPO on its own decoding trajectories: the deployable student",
}

USE = (
    "Re-ranks the top-10 candidates of the co-occurrence retriever for a user with an interaction history "
    "(items known to the semantic-ID table). It writes a short trace (its verdict on every candidate: a score level "
    "read from the evidence the feature store serves for it), then a JSON permutation; an invalid output falls "
    "back to the upstream order and is counted."
)
LIMITS = (
    "Not for users without history (the prompt carries no signal) or for items outside the catalogue it was "
    "trained on (their semantic IDs are unknown: the server answers 4xx). Trained and measured on one "
    "offline dataset split by time; accuracy on live traffic is not measured here. Speed figures are for the "
    "machine named in the report, at batch 1 and the serving batch."
)


def _ci(row: dict, key: str) -> str:
    return fmt_value(row.get(key), 3) + fmt_ci(row, key)


def model_card(name: str, bundle: str | Path, report: dict) -> str:
    """The Markdown card of the model evaluated under `name` (its rows in `report`) from `bundle`."""
    bundle = Path(bundle)
    cfg = json.loads((bundle / "reranker.json").read_text())
    hf = json.loads((bundle / "model" / "config.json").read_text())
    meta_path = bundle / "model" / "gr2_model.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    block = int(cfg.get("block_size", 0))
    rows = [r for r in report.get("rows", []) if r.get("model") == name]
    speed = [s for s in report.get("speed", []) if s.get("model") == name]
    arch = meta.get("model") or {}
    lines = [
        f"# Model card: `{name}`",
        "",
        f"{STAGES.get(name, cfg.get('stage', 'generative re-ranker'))}.",
        "",
        "## What it is",
        "",
        f"- Decoder: {'autoregressive (KV cache)' if block == 0 else f'block diffusion, block_size {block}'}; "
        f"at most {cfg.get('max_new_tokens')} new tokens; {cfg.get('n_candidates')} candidates per list.",
        f"- Backbone: Llama, d_model {hf.get('hidden_size')}, {hf.get('num_hidden_layers')} layers, "
        f"{hf.get('num_attention_heads')} heads, d_ff {hf.get('intermediate_size')}, vocabulary "
        f"{hf.get('vocab_size')} (closed: semantic-ID codes, evidence buckets, labels, JSON).",
        f"- Profile `{cfg.get('profile')}`; response format `{cfg.get('variant', 'trace')}`.",
    ]
    if arch:
        lines.append(f"- Model config: `{json.dumps(arch, sort_keys=True)}`")
    lines += ["", "## How it was made", ""]
    for key in ("stage", "parent", "teacher", "direction"):
        if cfg.get(key) is not None:
            lines.append(f"- {key}: `{cfg[key]}`")
    train = cfg.get("train") or {}
    if train:
        shown = {k: v for k, v in train.items() if not isinstance(v, dict | list) and k != "curves"}
        lines.append("- training summary: " + ", ".join(f"{k} {_short(v)}" for k, v in shown.items()))
    lines += [
        "",
        f"## Measured ({report.get('dataset')}, {report.get('n_examples', {}).get('test', '?')} test lists, "
        f"git `{report.get('git_sha')}`)",
        "",
    ]
    if rows:
        lines += [
            "| tau | recall@1 [95% CI] | recall@5 | ndcg@5 | validity (invalid: why) | n_users | nfe/seq "
            "| speedup vs AR |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            lines.append(
                f"| {fmt_value(r.get('tau'), 2)} | {_ci(r, 'recall@1')} | {fmt_value(r.get('recall@5'), 3)} | "
                f"{fmt_value(r.get('ndcg@5'), 3)} | {fmt_value(r.get('validity'), 3)}{_why(r)} | {r.get('n_users', '')} | "
                f"{fmt_value(r.get('nfe_per_seq'), 1)} | {fmt_value(r.get('speedup_vs_ar'), 2)} |"
            )
        lines.append("\nAn invalid output falls back to the upstream order (counted in the metrics).")
    else:
        lines.append("Not evaluated in this run.")
    if speed:
        lines += ["", "| tau | batch | tokens/s | tokens/forward | speedup vs AR |", "|---|---|---|---|---|"]
        for s in speed:
            lines.append(
                f"| {fmt_value(s.get('tau'), 2)} | {s['batch']} | {s['tokens_per_s']:.0f} | "
                f"{s['tokens_per_forward']:.2f} | {fmt_value(s.get('speedup_vs_ar'), 2)} |"
            )
        lines.append(f"\nMachine: {report.get('machine')}")
    lines += ["", "## Intended use", "", USE, "", "## Limitations", "", LIMITS, ""]
    return "\n".join(lines)


def _why(row: dict) -> str:
    bad = row.get("invalid_reasons") or {}
    return " (" + ", ".join(f"{k} {v}" for k, v in sorted(bad.items())) + ")" if bad else ""


def _short(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def write_model_cards(bundles: Mapping[str, str | Path], report: dict, out_dir: str | Path) -> list[Path]:
    """`out_dir/model_cards/<name>.md` for every bundle; returns the paths."""
    out = Path(out_dir) / "model_cards"
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, bundle in bundles.items():
        p = out / f"{name}.md"
        p.write_text(model_card(name, bundle, report))
        paths.append(p)
    return paths
