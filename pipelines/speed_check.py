"""Decode speed of a finished run's AR teacher and diffusion models on any torch device (e.g. a GPU).

`make bench` measures speed on the CPU it trains on. This re-measures the same speed rows for the run's
bundles on another device, with the same code (`gr2.stages.evaluate.measure_speed`): the run's first test lists,
AR for the `ar` teacher, every tau of the profile for each diffusion bundle, at batch 1 and the serving batch.

    python -m pipelines.speed_check --run runs/latest --device cuda --out benchmarks/speed_cuda

writes <out>.json (command, machine, device, run, `speed` rows as in report.json) and <out>.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pandas as pd
import torch

from gr2.config import load_profile
from gr2.report import git_sha, machine_info
from gr2.stages.evaluate import load, measure_speed


def find_bundles(run: Path, names: list[str]) -> dict[str, Path]:
    """Bundles of a run directory by their reranker.json name (the names the evaluation rows use)."""
    found: dict[str, Path] = {}
    for cfg in sorted(run.glob("kfp/*/*/model/bundle/reranker.json")):
        name = json.loads(cfg.read_text()).get("name")
        if name in names and name not in found:
            found[name] = cfg.parent
    missing = [n for n in names if n not in found]
    if missing:
        raise FileNotFoundError(f"no bundle named {missing} under {run}/kfp/*/*/model/bundle")
    return {n: found[n] for n in names}  # in the order asked for


def speed_rows(
    bundles: dict[str, Path], test: pd.DataFrame, taus: list[float], n1: int, batch: int, nb: int, device: str
) -> list[dict]:
    """Speed rows (batch 1 on the first n1 lists, `batch` on the first nb), speedups against `ar`."""
    models = {name: load(path) for name, path in bundles.items()}
    for name, m in models.items():
        m.name = name
        m.model.to(device)
    plans = [(n, "ar" if m.block_size == 0 else "diffusion") for n, m in models.items()]
    plans = [(n, d, t) for n, d in plans for t in ([None] if d == "ar" else taus)]
    rows: list[dict] = []
    for b, n_ex in ((1, n1), (batch, nb)):
        sub = test.head(n_ex)
        prompts = models["ar"].encode_prompts(sub["history"].tolist(), sub["candidates"].tolist())
        for name, decoder, tau in plans:  # warm-up (kernels, allocator) before anything is timed
            models[name].decode(prompts[: max(b, 2)], decoder, tau or 1.0, b)
        block = [measure_speed(models[name], prompts, decoder, tau, b) for name, decoder, tau in plans]
        base = next(s for s in block if s["model"] == "ar")
        for s in block:
            s["speedup_vs_ar"] = s["tokens_per_s"] / base["tokens_per_s"]
            s["ideal_speedup"] = s["tokens_per_forward"] / base["tokens_per_forward"]
        rows += block
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default="runs/latest", help="a run directory (make run / make bench)")
    ap.add_argument("--models", default="ar,cft,rl", help="bundle names; 'ar' (the AR baseline) is required")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--threads", type=int, default=0, help="torch CPU threads (0: the profile's eval.threads)"
    )
    ap.add_argument("--out", default="benchmarks/speed_device", help="output prefix (.json and .md)")
    args = ap.parse_args(argv)

    run = Path(args.run).resolve()
    report = json.loads((run / "report.json").read_text())
    profile = load_profile(report["profile"])
    ev = profile.eval
    torch.set_num_threads(args.threads or ev.threads)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    if "ar" not in names:
        raise SystemExit("--models must include 'ar' (the speed baseline)")
    bundles = find_bundles(run, names)
    examples = pd.read_parquet(next(run.glob("kfp/*/candidates/examples")))
    test = examples[examples["split"] == "test"].reset_index(drop=True)

    t0 = time.perf_counter()
    rows = speed_rows(
        bundles,
        test,
        list(profile.diffusion.taus),
        ev.speed_examples,
        ev.speed_batch,
        ev.speed_batch_examples,
        args.device,
    )
    out = {
        "command": "python -m pipelines.speed_check " + " ".join(argv if argv is not None else sys.argv[1:]),
        "git_sha": git_sha(),
        "machine": machine_info(),
        "device": args.device,
        "device_name": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None,
        "run": {
            "dataset": report["dataset"],
            "profile": report["profile"],
            "run_id": report.get("run_id"),
            "git_sha": report.get("git_sha"),
        },
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
        f"- models from run `{report.get('run_id')}` ({report['dataset']}, profile {report['profile']}, "
        f"trained at `{report.get('git_sha')}`); measured at `{out['git_sha']}`",
        f"- machine: {out['machine']}",
        "",
        "| model | tau | batch | tokens/s | nfe/seq | tokens/forward | speedup vs AR | ideal speedup |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in rows:
        tau = "—" if s["tau"] is None else f"{s['tau']:.2f}"
        md.append(
            f"| {s['model']} | {tau} | {s['batch']} | {s['tokens_per_s']:.1f} | {s['nfe_per_seq']:.1f} | "
            f"{s['tokens_per_forward']:.2f} | {s['speedup_vs_ar']:.2f} | {s['ideal_speedup']:.2f} |"
        )
    prefix.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
