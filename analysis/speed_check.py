"""Decode speed of a finished run's AR teacher and diffusion models on any torch device (e.g. a GPU).

`make bench` measures speed on the CPU it trains on. This re-measures the same speed rows for the run's
bundles on another device, with the same code (`gr2.stages.evaluate.speed_table`): the run's first test lists,
AR for the `ar` teacher, every tau of the profile for each diffusion bundle, and `spec` (--spec drafting at the
profile's spec_tau, `ar` verifying), at batch 1 and the serving batch.

    python -m analysis.speed_check --run runs/latest --device cuda --out benchmarks/speed_cuda

A model may be named with a dtype, `<bundle>:bfloat16`, to decode it in bf16 as `serving --dtype bfloat16` does,
beside the same bundle in float32 in the same interleaved repeats (`--models ar,rl,rl:bfloat16`); `ar`, the
baseline, and spec's verifier are float32.

scripts/gpu_check.sh runs it on a GPU machine after the GPU tests, into benchmarks/speed_<gpu>.

writes <out>.json (command, machine, device, run, `speed` rows as in report.json) and <out>.md.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import pandas as pd
import torch

from analysis.output import provenance, run_record
from gr2.config import Profile
from gr2.generative import GenerativeReranker
from gr2.inference import CONFIG_FILE, DTYPES
from gr2.report import speed_markdown
from gr2.stages.evaluate import load, speed_table
from pipelines.run_local import run_examples, run_profile

# Where a run's steps keep their bundles: a training step's model/bundle, and CFT's naive conversion.
BUNDLE_GLOBS = ("kfp/*/*/model/bundle/reranker.json", "kfp/*/*/naive_model/reranker.json")


def run_bundles(run: Path) -> dict[str, Path]:
    """Every bundle of a run directory by its reranker.json name (the names the evaluation rows use)."""
    found: dict[str, Path] = {}
    for pattern in BUNDLE_GLOBS:
        for cfg in sorted(run.glob(pattern)):
            found.setdefault(json.loads(cfg.read_text()).get("name"), cfg.parent)
    return found


def split_lists(run: Path, split: str, limit: int = 0) -> tuple[Profile, pd.DataFrame]:
    """A run's profile (its eval threads set for torch, as the run decoded) and the lists of one split (the first
    `limit` only when > 0)."""
    profile = run_profile(run)
    torch.set_num_threads(profile.eval.threads)
    examples = run_examples(run)
    df = examples[examples["split"] == split].reset_index(drop=True)
    if limit > 0:
        df = df.head(limit)
    if df.empty:
        raise SystemExit(f"no examples in split {split!r}")
    return profile, df


def find_bundles(run: Path, names: list[str]) -> dict[str, Path]:
    """The bundles named `names` of a run directory (`run_bundles`), in that order."""
    found = run_bundles(run)
    missing = [n for n in names if n not in found]
    if missing:
        raise FileNotFoundError(f"no bundle named {missing} under {run}/kfp/*/*/model/bundle")
    return {n: found[n] for n in names}  # in the order asked for


def name_dtype(spec: str) -> tuple[str, str]:
    """A model argument "<bundle>[:<dtype>]" as (bundle, dtype); float32 where it names no dtype."""
    name, sep, dtype = spec.rpartition(":")
    return (name, dtype) if sep and dtype in DTYPES else (spec, "float32")


def load_models(run: Path, specs: list[str]) -> dict[str, GenerativeReranker]:
    """Each "<bundle>[:<dtype>]" loaded and cast to its dtype, by its spec; a bundle is one of the run's bundle
    names or a bundle folder (one with reranker.json, e.g. a recipe trained by hand on the run's sft_data)."""
    names = list(dict.fromkeys(name_dtype(s)[0] for s in specs))
    folders = {n: Path(n) for n in names if (Path(n) / CONFIG_FILE).is_file()}
    paths = folders | find_bundles(run, [n for n in names if n not in folders])
    models = {}
    for spec in specs:
        name, dtype = name_dtype(spec)
        models[spec] = load(paths[name])
        models[spec].cast(dtype)
    return models


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default="runs/latest", help="a run directory (make run / make bench)")
    ap.add_argument(
        "--models",
        default="ar,cft,rl",
        help="bundle names, each may end in :bfloat16; 'ar' (the float32 AR baseline) is required",
    )
    ap.add_argument(
        "--spec",
        default="rl",
        help="the diffusion bundle that drafts the spec rows ('' or absent: no spec rows)",
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--threads", type=int, default=0, help="torch CPU threads (0: the profile's eval.threads)"
    )
    ap.add_argument(
        "--repeats", type=int, default=0, help="speed repeats (0: the profile's eval.speed_repeats)"
    )
    ap.add_argument(
        "--batch", type=int, default=0, help="the second batch size (0: the profile's eval.speed_batch)"
    )
    ap.add_argument("--out", default="benchmarks/speed_device", help="output prefix (.json and .md)")
    args = ap.parse_args(argv)

    run = Path(args.run).resolve()
    report = json.loads((run / "report.json").read_text())
    profile = run_profile(run)
    ev = replace(profile.eval, speed_repeats=args.repeats) if args.repeats else profile.eval
    ev = replace(ev, speed_batch=args.batch) if args.batch else ev
    torch.set_num_threads(args.threads or ev.threads)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    if "ar" not in names:
        raise SystemExit("--models must include 'ar' (the speed baseline)")
    models = load_models(run, names)
    for name, m in models.items():
        m.name = name
        m.model.to(args.device)
    plans = [
        (n, "ar", None) if m.block_size == 0 else (n, "diffusion", t)
        for n, m in models.items()
        for t in ([None] if m.block_size == 0 else profile.diffusion.taus)
    ]
    if args.spec in models:
        models["spec"] = models[args.spec].with_verifier(models["ar"].model, "spec")
        plans.append(("spec", "spec", profile.diffusion.spec_tau))
    examples = run_examples(run)
    test = examples[examples["split"] == "test"].reset_index(drop=True)

    t0 = time.perf_counter()
    rows = speed_table(models, plans, test, ev, warmup=True)
    out = provenance("analysis.speed_check", argv, machine=True) | {
        "device": args.device,
        "device_name": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None,
        "run": run_record(run, report),
        "seconds": time.perf_counter() - t0,
        "speed": rows,
    }
    prefix = Path(args.out)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".json").write_text(json.dumps(out, indent=2) + "\n")
    md = [
        f"# Decode speed on {out['device_name'] or args.device}",
        "",
        f"- command: `{out['command']}`",
        f"- models from run `{out['run']['run_id']}` ({out['run']['dataset']}, profile {out['run']['profile']}, "
        f"trained at `{out['run']['git_sha']}`); measured at `{out['git_sha']}`",
        f"- machine: {out['machine']}",
        "",
        *speed_markdown(rows),
    ]
    prefix.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
