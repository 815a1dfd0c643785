"""Lists of different lengths in one model call: padded together, or grouped by length (one call per length)?

The server's micro-batcher puts requests of any length 2..N into one `rank()` call, and the decoder left-pads
their prompts (gr2/decode.py). The other design groups a batch by list length and makes one call per length.
This measures both on the same batches of a finished run's test lists, each list cut to a seeded random length
2..N (gr2/candidates.py `cut_lists`, the held-out item kept), as a client mix would send them:

    python -m analysis.pad_vs_group --run runs/latest --model rl --out benchmarks/pad_vs_group

Per batch: the wall time of the padded call and the summed wall time of the per-length calls (interleaved, the
order alternating), and whether both give each list the same ranking (rows are independent, so they must). Writes
<out>.json (command, machine, run, per-decoder figures and the per-batch times) and <out>.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from analysis.output import provenance
from analysis.speed_check import find_bundles
from gr2.candidates import cut_lists
from gr2.inference import RankRequest
from gr2.stages.evaluate import load
from pipelines.run_local import run_examples, run_profile


def timed(fn) -> tuple[float, list]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def compare(model, requests: list[RankRequest], decoder: str, tau: float | None, pad_first: bool) -> dict:
    """One batch both ways: seconds padded, seconds grouped, and whether every list got the same ranking."""
    lengths = sorted({len(r.candidates) for r in requests})

    def grouped() -> list:
        by_len = {n: [i for i, r in enumerate(requests) if len(r.candidates) == n] for n in lengths}
        out: list = [None] * len(requests)
        for idx in by_len.values():
            for i, res in zip(idx, model.rank([requests[i] for i in idx], decoder, tau), strict=True):
                out[i] = res
        return out

    runs = [("pad", lambda: model.rank(requests, decoder, tau)), ("group", grouped)]
    got = dict((name, timed(fn)) for name, fn in (runs if pad_first else runs[::-1]))
    same = [a.ranking == b.ranking for a, b in zip(got["pad"][1], got["group"][1], strict=True)]
    return {
        "pad_s": got["pad"][0],
        "group_s": got["group"][0],
        "lengths": len(lengths),
        "same": float(np.mean(same)),
    }


def ratio_ci(pad: np.ndarray, group: np.ndarray, seed: int, n_boot: int = 2000) -> list[float]:
    """95% bootstrap interval (over batches) of sum(group) / sum(pad)."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(pad), (n_boot, len(pad)))
    r = group[idx].sum(1) / pad[idx].sum(1)
    return [float(np.quantile(r, 0.025)), float(np.quantile(r, 0.975))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default="runs/latest", help="a run directory (make run / make bench)")
    ap.add_argument(
        "--model", default="rl", help="a diffusion bundle of the run (its AR verifier decodes 'ar')"
    )
    ap.add_argument("--decoders", default="diffusion,ar", help="decoders to measure, each at the model's tau")
    ap.add_argument("--batches", type=int, default=20, help="batches per decoder")
    ap.add_argument("--batch-size", type=int, default=16, help="lists per batch (the server's max batch)")
    ap.add_argument("--out", default="benchmarks/pad_vs_group", help="output prefix (.json and .md)")
    args = ap.parse_args(argv)

    run = Path(args.run).resolve()
    profile = run_profile(run)
    torch.set_num_threads(profile.eval.threads)
    model = load(find_bundles(run, [args.model])[args.model])
    examples = run_examples(run)
    test = examples[examples["split"] == "test"].reset_index(drop=True)
    rng = np.random.default_rng(profile.seed)
    n_max = int(test["candidates"].map(len).max())
    decoders = [d.strip() for d in args.decoders.split(",") if d.strip()]
    per: dict[str, list[dict]] = {d: [] for d in decoders}
    t0 = time.perf_counter()
    for b in range(args.batches + 1):  # batch 0 warms up and is not counted
        rows = test.sample(n=args.batch_size, random_state=int(rng.integers(1 << 31)))
        cut = cut_lists(rows, rng.integers(2, n_max + 1, len(rows)), int(rng.integers(1 << 31)))
        requests = [
            RankRequest(str(u), list(c), list(h))
            for u, c, h in zip(cut["user_id"], cut["candidates"], cut["history"], strict=True)
        ]
        for d in decoders:
            res = compare(model, requests, d, model.tau if d == "diffusion" else None, pad_first=b % 2 == 0)
            if b:
                per[d].append(res)
    figures: dict[str, dict[str, Any]] = {}
    for d, rs in per.items():
        pad, group = np.array([r["pad_s"] for r in rs]), np.array([r["group_s"] for r in rs])
        figures[d] = {
            "tau": model.tau if d == "diffusion" else None,
            "batches": len(rs),
            "pad_ms_per_batch": float(1000 * pad.mean()),
            "group_ms_per_batch": float(1000 * group.mean()),
            "group_over_pad": float(group.sum() / pad.sum()),
            "group_over_pad_ci95": ratio_ci(pad, group, profile.seed),
            "lengths_per_batch": float(np.mean([r["lengths"] for r in rs])),
            "same_ranking": float(np.mean([r["same"] for r in rs])),
            "per_batch": rs,
        }
    report = json.loads((run / "report.json").read_text())
    out = provenance("analysis.pad_vs_group", argv, machine=True) | {
        "run": {"dataset": report["dataset"], "profile": report["profile"], "git_sha": report.get("git_sha")},
        "model": args.model,
        "batch_size": args.batch_size,
        "seconds": time.perf_counter() - t0,
        "decoders": figures,
    }
    prefix = Path(args.out)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".json").write_text(json.dumps(out, indent=2) + "\n")
    m = out["machine"]
    md = [
        "# Mixed list lengths in one call: padded against grouped by length",
        "",
        f"`{out['command']}` at `{out['git_sha'][:7]}`; {m.get('cpu')} x{m.get('cores')}, torch {m.get('torch')}; "
        f"run {report['dataset']} / {report['profile']}, model `{args.model}`.",
        f"{args.batches} batches of {args.batch_size} test lists, each cut to a random length 2..{n_max}.",
        "",
        "| decoder | tau | lengths per batch | padded ms / batch | grouped ms / batch | grouped / padded [95% CI] "
        "| same ranking |",
        "|---|---|---|---|---|---|---|",
    ]
    for d, f in figures.items():
        lo, hi = f["group_over_pad_ci95"]
        tau = "—" if f["tau"] is None else f"{f['tau']:.2f}"
        md.append(
            f"| {d} | {tau} | {f['lengths_per_batch']:.1f} | {f['pad_ms_per_batch']:.0f} | "
            f"{f['group_ms_per_batch']:.0f} | {f['group_over_pad']:.2f} [{lo:.2f}, {hi:.2f}] | {f['same_ranking']:.3f} |"
        )
    prefix.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
