"""Check that the `spec` decoder writes exactly what `ar` writes, on a finished run's lists.

`spec` (gr2/decode.py spec_generate) is lossless by construction: a diffusion student drafts each block and the AR
model `ar` keeps only what its own greedy decoding would write. This decodes a split of a run (default: the test
lists, as the evaluation does) with `ar` and with `spec` (the --draft student drafting at --tau, `ar` verifying),
in the evaluation's batches, and compares every response token for token:

    python -m analysis.spec_check --run runs/latest --draft rl --split test

prints (and with --out writes) JSON: lists, identical, and for the first mismatches the list, the first differing
position, both tokens and `ar`'s logit margin (top-1 minus top-2) there. A mismatch with a margin near 1e-6 is a
float tie (a forward over a block rounds differently from one token at a time); a larger one is a bug. Also nfe
and tokens per forward of both decoders, and `spec`'s tokens per verifier forward. Exit status 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from analysis.output import emit, run_record
from analysis.speed_check import find_bundles, split_lists
from gr2.stages.evaluate import load


@torch.no_grad()
def logit_margin(model: torch.nn.Module, prompt: list[int], prefix: list[int]) -> float:
    """Top-1 minus top-2 logit of `model` for the token after prompt + prefix (one unpadded forward)."""
    ids = torch.tensor([prompt + prefix], device=next(model.parameters()).device)
    top = model(input_ids=ids, logits_to_keep=1).logits[0, -1].float().topk(2).values
    return float(top[0] - top[1])


def check(
    run: Path, draft: str, split: str, tau: float | None = None, limit: int = 0, show: int = 10
) -> dict:
    report = json.loads((run / "report.json").read_text())
    profile, df = split_lists(run, split, limit)
    tau = profile.diffusion.spec_tau if tau is None else tau
    bundles = find_bundles(run, ["ar", draft])
    ar = load(bundles["ar"])
    spec = load(bundles[draft]).with_verifier(ar.model, "spec")
    prompts = ar.encode_prompts(df["history"].tolist(), df["candidates"].tolist())
    batch = profile.eval.batch_size
    a = ar.decode(prompts, "ar", 1.0, batch)
    s = spec.decode(prompts, "spec", tau, batch)
    wrong = [i for i, (x, y) in enumerate(zip(a.responses, s.responses, strict=True)) if x != y]
    mismatches = []
    for i in wrong[:show]:
        x, y = a.responses[i], s.responses[i]
        p = next((k for k, (u, v) in enumerate(zip(x, y, strict=False)) if u != v), min(len(x), len(y)))
        mismatches.append(
            {
                "list": i,
                "position": p,
                "ar": x[p] if p < len(x) else None,
                "spec": y[p] if p < len(y) else None,
                "ar_margin": logit_margin(ar.model, prompts[i], x[:p]),
            }
        )
    tokens = sum(len(r) for r in a.responses)
    return {
        "run": run_record(run, report),
        "draft": draft,
        "split": split,
        "tau": tau,
        "lists": len(df),
        "identical": len(df) - len(wrong),
        "mismatches": mismatches,
        "ar_nfe": a.nfe,
        "spec_nfe": s.nfe,
        "spec_verifier_nfe": s.verifier_nfe,
        "spec_tokens_per_forward": tokens / max(s.nfe, 1),
        "spec_tokens_per_verify": tokens / max(s.verifier_nfe, 1),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default="runs/latest", help="a run directory (make run / make bench)")
    ap.add_argument("--draft", default="rl", help="the diffusion bundle that drafts (default: rl)")
    ap.add_argument("--split", default="test", choices=["train", "val", "test"])
    ap.add_argument(
        "--tau", type=float, help="the draft's commit threshold (default: the profile's spec_tau)"
    )
    ap.add_argument("--limit", type=int, default=0, help="only the split's first N lists (0: all)")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args(argv)
    result = check(Path(args.run).resolve(), args.draft, args.split, args.tau, args.limit)
    return emit("analysis.spec_check", argv, result, args.out)


if __name__ == "__main__":
    out = main()
    sys.exit(0 if out["identical"] == out["lists"] else 1)
